//! Route handlers, one file per API: `ingestion` (Pyroscope's `/ingest` and Connect `Push`),
//! `queries` (the Connect querier methods and the pprof download), `operations` (metrics,
//! health, GPU state and the web UI's files). What they share is here.
mod ingestion;
mod operations;
mod queries;

pub use ingestion::{ingest, push};
pub use operations::*;
pub use queries::{pprof_download, querier, render_diff, render_single, settings};

use std::{collections::HashMap, fmt::Write as _};

use axum::{
    body::Body,
    extract::{FromRequest, Multipart, Path, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};
use include_dir::{Dir, include_dir};
use prost::Message;

use super::{
    AppState,
    connect::{self, ApiError, Codec},
    render,
};
use crate::{
    store::{
        NewProfile, ProfileType, Store, ingest,
        query::{MergedTree, OFF_CPU_TYPE, Selection, WALL_TYPE},
        selector::{MAX_MATCHERS, MatchOp, Selector, parse_app_name},
    },
    wire::api::{self, *},
    wire::proto,
};

fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Runs store work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("query task failed: {e}")))?
}

fn store_error(err: crate::store::StoreError) -> ApiError {
    match &err {
        // Over a cardinality limit: 429, as Pyroscope answers its series limit.
        crate::store::StoreError::Limit(limit) if limit.limit().is_cardinality() => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "resource_exhausted",
            err.to_string(),
        ),
        _ if err.is_client_error() => ApiError::invalid(err),
        _ => ApiError::internal(err),
    }
}

/// Runs a query on the blocking pool within `--query-timeout`, waiting for a turn included
/// ([`super::MAX_CONCURRENT_QUERIES`] run at once). Past the deadline the client gets a 503; the
/// query finishes in the background and only then frees its turn, so abandoned queries cannot
/// pile up beyond the bound.
async fn bounded_query<T: Send + 'static>(
    state: &AppState,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let timeout = state.config.query_timeout;
    let turns = state.health.queries.clone();
    let run = async move {
        let turn = turns
            .acquire_owned()
            .await
            .map_err(|e| ApiError::internal(format!("query turns closed: {e}")))?;
        blocking(move || {
            let result = work();
            drop(turn);
            result
        })
        .await
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(result) => result,
        Err(_) => {
            state
                .health
                .query_timeouts
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(timeout_s = timeout.as_secs_f64(), "query timed out");
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "deadline_exceeded",
                format!(
                    "the query took longer than --query-timeout ({}s): narrow the time range or \
                     the label selector",
                    timeout.as_secs_f64()
                ),
            ))
        }
    }
}

async fn save(store: Store, profiles: Vec<NewProfile>) -> Result<(), ApiError> {
    blocking(move || store.ingest(&profiles).map_err(store_error)).await
}
