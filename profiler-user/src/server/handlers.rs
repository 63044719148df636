//! Route handlers: ingest, the Connect query methods, metrics, health and the UI's files.
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
        query::Selection,
        selector::{MAX_MATCHERS, Selector, parse_app_name},
    },
    wire::api::{self, *},
    wire::proto,
};

/// The web UI, embedded at build time (profiler-user/ui).
static UI: Dir<'_> = include_dir!("$CARGO_MANIFEST_DIR/ui");

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

// ---- ingest ----

/// `POST /ingest`: Pyroscope's legacy ingest (docs/pyroscope-protocol.md §4).
pub async fn ingest(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let limit = state.config.max_body_bytes;
    let params: HashMap<String, String> = axum::extract::Query::try_from_uri(request.uri())
        .map(|q| q.0)
        .map_err(|e| ApiError::invalid(format!("bad query string: {e}")))?;
    let name = params
        .get("name")
        .ok_or_else(|| ApiError::invalid("missing query parameter `name`"))?;
    let (app, mut labels) = parse_app_name(name).map_err(ApiError::invalid)?;
    let now = unix_now_ns();
    let time_param = |key: &str| -> Result<i64, ApiError> {
        match params.get(key) {
            None => Ok(now),
            Some(text) => ingest::parse_time(text, now).ok_or_else(|| {
                ApiError::invalid(format!("invalid `{key}` time `{}`", text.escape_debug()))
            }),
        }
    };
    let (from, until) = (time_param("from")?, time_param("until")?);
    if let Some(spy) = params.get("spyName") {
        labels.push(("pyroscope_spy".into(), spy.clone()));
    }
    let format = params.get("format").map(|f| f.to_ascii_lowercase());
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let is_multipart = content_type.starts_with("multipart/form-data");

    let profiles = match format.as_deref() {
        Some("pprof") | None if is_multipart || format.is_some() => {
            let (pprof_bytes, display_names) = if is_multipart {
                read_multipart(request, &state, limit).await?
            } else {
                (
                    connect::read_body(request.into_body(), limit)
                        .await?
                        .to_vec(),
                    HashMap::new(),
                )
            };
            // The body limit holds after decompression too (a small gzip can inflate a lot).
            let pprof = ingest::decode_pprof(&pprof_bytes, limit)?;
            ingest::validate_pprof(&pprof)?;
            let profile_name = derive_name(&pprof, &display_names);
            if !labels.iter().any(|(k, _)| k == "service_name") {
                labels.push(("service_name".into(), app));
            }
            ingest::validate_labels(&labels)?;
            ingest::profiles_from_pprof(&pprof, &profile_name, &labels, from)?
        }
        None | Some("folded") | Some("lines") => {
            if is_multipart {
                return Err(ApiError::unsupported_media(
                    "multipart bodies carry pprof; use format=pprof or send folded text",
                ));
            }
            let sample_rate = params
                .get("sampleRate")
                .and_then(|r| r.parse::<u32>().ok())
                .filter(|r| *r > 0)
                .unwrap_or(100);
            let (service, profile_type, factor) = ingest::text_profile_type(&app, sample_rate)?;
            let body = connect::read_body(request.into_body(), limit).await?;
            let (names, stacks) =
                ingest::parse_folded(&body, format.as_deref() == Some("lines"), factor)?;
            if labels.iter().any(|(k, _)| k == "service_name") {
                labels.push(("app_name".into(), service));
            } else {
                labels.push(("service_name".into(), service));
            }
            ingest::validate_labels(&labels)?;
            vec![NewProfile {
                profile_type: Some(profile_type),
                labels,
                time_ns: from,
                duration_ns: (until - from).max(0),
                names,
                stacks,
            }]
        }
        Some(other) => {
            return Err(ApiError::unsupported_media(format!(
                "format `{}` is not supported (pprof, folded, lines)",
                other.escape_debug()
            )));
        }
    };
    save(store, profiles).await?;
    Ok(StatusCode::OK.into_response())
}

/// The `__name__` for an `/ingest` pprof, with `sample_type_config` display names applied.
fn derive_name(pprof: &proto::Profile, display_names: &HashMap<String, String>) -> String {
    if display_names.is_empty() {
        return ingest::derive_pprof_name(pprof);
    }
    let mut renamed = pprof.clone();
    for sample_type in &mut renamed.sample_type {
        let current = renamed
            .string_table
            .get(sample_type.r#type as usize)
            .cloned()
            .unwrap_or_default();
        if let Some(display) = display_names.get(&current) {
            renamed.string_table.push(display.clone());
            sample_type.r#type = renamed.string_table.len() as i64 - 1;
        }
    }
    ingest::derive_pprof_name(&renamed)
}

/// The `profile` (and optional `sample_type_config`) fields of a multipart upload.
async fn read_multipart(
    request: Request,
    state: &AppState,
    limit: usize,
) -> Result<(Vec<u8>, HashMap<String, String>), ApiError> {
    let (parts, body) = request.into_parts();
    let body = connect::read_body(body, limit).await?;
    let request = Request::from_parts(parts, Body::from(body));
    let mut multipart = Multipart::from_request(request, state)
        .await
        .map_err(|e| ApiError::invalid(format!("malformed multipart body: {}", e.body_text())))?;
    let mut profile = None;
    let mut display_names = HashMap::new();
    while let Some(field) = multipart
        .next_field()
        .await
        .map_err(|e| ApiError::invalid(format!("malformed multipart body: {}", e.body_text())))?
    {
        let name = field.name().unwrap_or("").to_owned();
        let bytes = field.bytes().await.map_err(|e| {
            ApiError::invalid(format!("malformed multipart body: {}", e.body_text()))
        })?;
        match name.as_str() {
            "profile" => profile = Some(bytes.to_vec()),
            "prev_profile" => {
                return Err(ApiError::invalid(
                    "unsupported client version: prev_profile is obsolete",
                ));
            }
            "sample_type_config" => {
                let config: HashMap<String, serde_json::Value> = serde_json::from_slice(&bytes)
                    .map_err(|e| ApiError::invalid(format!("malformed sample_type_config: {e}")))?;
                for (sample_type, settings) in config {
                    if let Some(display) = settings.get("display-name").and_then(|v| v.as_str()) {
                        display_names.insert(sample_type, display.to_owned());
                    }
                }
            }
            _ => {}
        }
    }
    let profile =
        profile.ok_or_else(|| ApiError::invalid("the multipart body has no `profile` field"))?;
    Ok((profile, display_names))
}

/// `POST /push.v1.PusherService/Push` (docs/pyroscope-protocol.md §3).
pub async fn push(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let limit = state.config.max_body_bytes;
    let codec = Codec::from_headers(&headers)?;
    let body = connect::read_body(body, limit).await?;
    let body = connect::decode_content_encoding(&headers, body, limit)?;
    let request: PushRequest = connect::decode(codec, &body)?;
    let now = unix_now_ns();
    let profiles = blocking(move || {
        let mut profiles = Vec::new();
        for series in &request.series {
            let labels: Vec<(String, String)> = series
                .labels
                .iter()
                .map(|l| (l.name.clone(), l.value.clone()))
                .collect();
            ingest::validate_labels(&labels)?;
            let explicit_name = labels
                .iter()
                .find(|(k, _)| k == "__name__")
                .map(|(_, v)| v.clone());
            let series_labels: Vec<(String, String)> = labels
                .into_iter()
                .filter(|(k, _)| k != "__name__" && k != "__delta__")
                .collect();
            for sample in &series.samples {
                let pprof = ingest::decode_pprof(&sample.raw_profile, limit)?;
                ingest::validate_pprof(&pprof)?;
                let name = explicit_name
                    .clone()
                    .unwrap_or_else(|| ingest::derive_pprof_name(&pprof));
                profiles.extend(ingest::profiles_from_pprof(
                    &pprof,
                    &name,
                    &series_labels,
                    now,
                )?);
            }
        }
        Ok::<_, ApiError>(profiles)
    })
    .await?;
    save(store, profiles).await?;
    Ok(connect::encode(codec, &PushResponse {}))
}

// ---- queries ----

fn ms_to_ns(ms: i64) -> i64 {
    ms.saturating_mul(1_000_000)
}

/// (start, end) in ns; end 0 means now, start 0 means an hour before end.
fn time_range(start_ms: i64, end_ms: i64) -> (i64, i64) {
    let end = if end_ms <= 0 {
        unix_now_ns()
    } else {
        ms_to_ns(end_ms)
    };
    let start = if start_ms <= 0 {
        end - 3_600_000_000_000
    } else {
        ms_to_ns(start_ms)
    };
    (start, end)
}

fn optional_range(start_ms: i64, end_ms: i64) -> Option<(i64, i64)> {
    (start_ms > 0 || end_ms > 0).then(|| time_range(start_ms, end_ms))
}

/// Parses a label selector; one refused for its size is counted.
fn parse_selector(state: &AppState, text: &str) -> Result<Selector, ApiError> {
    Selector::parse(text).map_err(|err| {
        if err.is_limit() {
            state
                .health
                .selectors_rejected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ApiError::invalid(err)
    })
}

fn selection(
    state: &AppState,
    profile_type_id: &str,
    label_selector: &str,
    start: i64,
    end: i64,
) -> Result<Selection, ApiError> {
    ProfileType::parse(profile_type_id).map_err(store_error)?;
    let selector = parse_selector(state, label_selector)?;
    let (start_ns, end_ns) = time_range(start, end);
    if start_ns > end_ns {
        return Err(ApiError::invalid("start is after end"));
    }
    Ok(Selection {
        // A trailing `:delta` names the same series.
        profile_type: profile_type_id.trim_end_matches(":delta").to_owned(),
        selector,
        start_ns,
        end_ns,
    })
}

/// The `matchers` of LabelNames, LabelValues and Series: at most [`MAX_MATCHERS`] selectors
/// (each within the limits of one selector).
fn selectors(state: &AppState, matchers: &[String]) -> Result<Vec<Selector>, ApiError> {
    if matchers.len() > MAX_MATCHERS {
        state
            .health
            .selectors_rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::invalid(format!(
            "{} matchers given, at most {MAX_MATCHERS} are allowed",
            matchers.len()
        )));
    }
    matchers.iter().map(|m| parse_selector(state, m)).collect()
}

fn max_nodes(requested: Option<i64>) -> usize {
    match requested {
        Some(n) if n > 0 => n as usize,
        _ => render::DEFAULT_MAX_NODES,
    }
}

/// `POST /querier.v1.QuerierService/{method}`.
pub async fn querier(
    State(state): State<AppState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let codec = Codec::from_headers(&headers)?;
    let limit = state.config.max_body_bytes;
    let body = connect::read_body(body, limit).await?;
    let body = connect::decode_content_encoding(&headers, body, limit)?;
    match method.as_str() {
        "ProfileTypes" => {
            let request: ProfileTypesRequest = connect::decode(codec, &body)?;
            let range = optional_range(request.start, request.end);
            let series = bounded_query(&state, move || Ok(store.series(range))).await?;
            let mut ids: Vec<String> = series.into_iter().map(|s| s.profile_type).collect();
            ids.sort();
            ids.dedup();
            let profile_types = ids
                .iter()
                .filter_map(|id| ProfileType::parse(id).ok())
                .map(|t| api::ProfileType {
                    id: t.id(),
                    name: t.name,
                    sample_type: t.sample_type,
                    sample_unit: t.sample_unit,
                    period_type: t.period_type,
                    period_unit: t.period_unit,
                })
                .collect();
            Ok(connect::encode(
                codec,
                &ProfileTypesResponse { profile_types },
            ))
        }
        "LabelNames" => {
            let request: LabelNamesRequest = connect::decode(codec, &body)?;
            let selectors = selectors(&state, &request.matchers)?;
            let range = optional_range(request.start, request.end);
            let names =
                bounded_query(&state, move || Ok(store.label_names(&selectors, range))).await?;
            Ok(connect::encode(codec, &LabelNamesResponse { names }))
        }
        "LabelValues" => {
            let request: LabelValuesRequest = connect::decode(codec, &body)?;
            let selectors = selectors(&state, &request.matchers)?;
            let range = optional_range(request.start, request.end);
            let name = request.name;
            let names = bounded_query(&state, move || {
                Ok(store.label_values(&name, &selectors, range))
            })
            .await?;
            Ok(connect::encode(codec, &LabelValuesResponse { names }))
        }
        "Series" => {
            let request: SeriesRequest = connect::decode(codec, &body)?;
            let selectors = selectors(&state, &request.matchers)?;
            let range = optional_range(request.start, request.end);
            let series = bounded_query(&state, move || Ok(store.series(range))).await?;
            let mut sets: Vec<Vec<LabelPair>> = series
                .into_iter()
                .filter(|s| {
                    selectors.is_empty() || selectors.iter().any(|sel| sel.matches(&s.labels))
                })
                .map(|s| {
                    s.labels
                        .into_iter()
                        .filter(|(k, _)| {
                            request.label_names.is_empty() || request.label_names.contains(k)
                        })
                        .map(|(name, value)| LabelPair { name, value })
                        .collect()
                })
                .collect();
            sets.sort();
            sets.dedup();
            let labels_set = sets.into_iter().map(|labels| Labels { labels }).collect();
            Ok(connect::encode(codec, &SeriesResponse { labels_set }))
        }
        "SelectMergeStacktraces" => {
            let request: SelectMergeStacktracesRequest = connect::decode(codec, &body)?;
            if request.format > 1 {
                return Err(ApiError::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "unimplemented",
                    "only the flamegraph format is supported",
                ));
            }
            let selection = selection(
                &state,
                &request.profile_type_id,
                &request.label_selector,
                request.start,
                request.end,
            )?;
            let max_nodes = max_nodes(request.max_nodes);
            let flamegraph = bounded_query(&state, move || {
                let tree = store.merge(&selection).map_err(store_error)?;
                Ok(render::flamegraph(&tree, max_nodes))
            })
            .await?;
            Ok(connect::encode(
                codec,
                &SelectMergeStacktracesResponse {
                    flamegraph: Some(flamegraph),
                },
            ))
        }
        "Diff" => {
            let request: DiffRequest = connect::decode(codec, &body)?;
            let (Some(left), Some(right)) = (request.left, request.right) else {
                return Err(ApiError::invalid("Diff needs both `left` and `right`"));
            };
            let left_selection = selection(
                &state,
                &left.profile_type_id,
                &left.label_selector,
                left.start,
                left.end,
            )?;
            let right_selection = selection(
                &state,
                &right.profile_type_id,
                &right.label_selector,
                right.start,
                right.end,
            )?;
            let max_nodes = max_nodes(left.max_nodes.or(right.max_nodes));
            let flamegraph = bounded_query(&state, move || {
                let left = store.merge(&left_selection).map_err(store_error)?;
                let right = store.merge(&right_selection).map_err(store_error)?;
                Ok(render::flamegraph_diff(&left, &right, max_nodes))
            })
            .await?;
            Ok(connect::encode(
                codec,
                &DiffResponse {
                    flamegraph: Some(flamegraph),
                },
            ))
        }
        "SelectMergeProfile" => {
            let request: SelectMergeProfileRequest = connect::decode(codec, &body)?;
            if codec == Codec::Json {
                return Err(ApiError::unsupported_media(
                    "SelectMergeProfile answers a pprof message: use application/proto, or GET /api/pprof for a .pb.gz file",
                ));
            }
            let selection = selection(
                &state,
                &request.profile_type_id,
                &request.label_selector,
                request.start,
                request.end,
            )?;
            let profile = bounded_query(&state, move || merged_pprof(&store, &selection)).await?;
            Ok((
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/proto"),
                )],
                profile.encode_to_vec(),
            )
                .into_response())
        }
        "SelectSeries" => {
            let request: SelectSeriesRequest = connect::decode(codec, &body)?;
            let selection = selection(
                &state,
                &request.profile_type_id,
                &request.label_selector,
                request.start,
                request.end,
            )?;
            let series =
                bounded_query(&state, move || select_series(&store, &selection, &request)).await?;
            Ok(connect::encode(codec, &SelectSeriesResponse { series }))
        }
        "GetProfileStats" => {
            let series = bounded_query(&state, move || Ok(store.series(None))).await?;
            let response = GetProfileStatsResponse {
                data_ingested: !series.is_empty(),
                oldest_profile_time: series
                    .iter()
                    .map(|s| s.first_ns / 1_000_000)
                    .min()
                    .unwrap_or(0),
                newest_profile_time: series
                    .iter()
                    .map(|s| s.last_ns / 1_000_000)
                    .max()
                    .unwrap_or(0),
            };
            Ok(connect::encode(codec, &response))
        }
        other => Err(ApiError::not_found(format!(
            "unknown method querier.v1.QuerierService/{}",
            other.escape_debug()
        ))),
    }
}

fn merged_pprof(store: &Store, selection: &Selection) -> Result<proto::Profile, ApiError> {
    let tree = store.merge(selection).map_err(store_error)?;
    let profile_type = ProfileType::parse(&selection.profile_type).map_err(store_error)?;
    Ok(render::pprof(
        &tree,
        &profile_type,
        selection.start_ns,
        selection.end_ns,
    ))
}

/// Buckets profile totals at `start, start+step, ...`; a point's timestamp is its bucket's right
/// edge and covers `(edge - step, edge]`; one series per distinct group-by label values.
fn select_series(
    store: &Store,
    selection: &Selection,
    request: &SelectSeriesRequest,
) -> Result<Vec<Series>, ApiError> {
    let step_ns = if request.step.is_finite() && request.step > 0.0 {
        (request.step * 1e9) as i64
    } else {
        15_000_000_000
    }
    .max(1_000_000);
    let average = request.aggregation == Some(1);
    let mut groups: HashMap<Vec<LabelPair>, std::collections::BTreeMap<i64, (f64, u64)>> =
        HashMap::new();
    for (series, points) in store.totals(selection).map_err(store_error)? {
        let key: Vec<LabelPair> = request
            .group_by
            .iter()
            .filter_map(|name| {
                series
                    .labels
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(k, v)| LabelPair {
                        name: k.clone(),
                        value: v.clone(),
                    })
            })
            .collect();
        let buckets = groups.entry(key).or_default();
        for (time_ns, total) in points {
            // In i128: the range and step come from the client and may be extreme.
            let (start, step) = (i128::from(selection.start_ns), i128::from(step_ns));
            let index = (i128::from(time_ns) - start + step - 1).div_euclid(step);
            let edge = (start + index * step).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
            let bucket = buckets.entry(edge).or_default();
            bucket.0 += total as f64;
            bucket.1 += 1;
        }
    }
    let mut series: Vec<Series> = groups
        .into_iter()
        .map(|(labels, buckets)| Series {
            labels,
            points: buckets
                .into_iter()
                .map(|(edge, (sum, count))| Point {
                    value: if average { sum / count as f64 } else { sum },
                    timestamp: edge / 1_000_000,
                })
                .collect(),
        })
        .collect();
    series.sort_by(|a, b| a.labels.cmp(&b.labels));
    if let Some(limit) = request.limit.filter(|l| *l > 0) {
        let total = |s: &Series| s.points.iter().map(|p| p.value).sum::<f64>();
        series.sort_by(|a, b| total(b).total_cmp(&total(a)));
        series.truncate(limit as usize);
    }
    Ok(series)
}

/// `GET /api/pprof?query=<type>{selector}&from=<ms>&until=<ms>`: the merged profile as a
/// gzipped pprof file (the UI's download button).
pub async fn pprof_download(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let params: HashMap<String, String> = axum::extract::Query::try_from_uri(&uri)
        .map(|q| q.0)
        .map_err(|e| ApiError::invalid(format!("bad query string: {e}")))?;
    let query = params.get("query").ok_or_else(|| {
        ApiError::invalid("missing query parameter `query` (<profile type>{selector})")
    })?;
    let (profile_type, selector) = match query.find('{') {
        Some(pos) => (&query[..pos], &query[pos..]),
        None => (query.as_str(), "{}"),
    };
    let ms = |key: &str| -> Result<i64, ApiError> {
        params.get(key).map_or(Ok(0), |v| {
            v.parse().map_err(|_| {
                ApiError::invalid(format!("`{key}` must be milliseconds since the epoch"))
            })
        })
    };
    let selection = selection(&state, profile_type, selector, ms("from")?, ms("until")?)?;
    let profile = bounded_query(&state, move || merged_pprof(&store, &selection)).await?;
    let body = crate::store::ingest::gzip(&profile.encode_to_vec());
    Ok((
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (
                header::CONTENT_DISPOSITION,
                HeaderValue::from_static("attachment; filename=\"profile.pb.gz\""),
            ),
        ],
        body,
    )
        .into_response())
}

// ---- metrics, health, UI ----

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let gpu = state.health.gpu.clone();
    let server = server_metrics(&state.health);
    let store = state
        .store
        .as_ref()
        .map(|store| store.counters().metric_values())
        .unwrap_or_default();
    let metrics = blocking(move || Ok(state.health.snapshot(state.store.as_ref())))
        .await
        .unwrap_or_default();
    let mut text = String::new();
    let values = metrics
        .values()
        .into_iter()
        .map(|v| (v.name, v.help, v.kind, v.value));
    // A labelled series (`name{label="…"}`) shares its HELP and TYPE with the others of its name.
    let mut described = std::collections::HashSet::new();
    for (series, help, kind, value) in values.chain(server).chain(store) {
        let name = series.split('{').next().unwrap_or(&series).to_owned();
        if described.insert(name.clone()) {
            let _ = writeln!(text, "# HELP {name} {help}");
            let _ = writeln!(text, "# TYPE {name} {kind}");
        }
        let _ = writeln!(text, "{series} {value}");
    }
    text.push_str(&gpu.render_prometheus());
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// The HTTP server's own limits and refusals: name, help, kind, value.
pub(crate) fn server_metrics(
    health: &super::HealthBoard,
) -> Vec<(String, &'static str, &'static str, f64)> {
    use std::sync::atomic::Ordering::Relaxed;
    let connections = &health.connections;
    [
        (
            "profiler_http_connections_open",
            "HTTP connections open now.",
            "gauge",
            connections.open.load(Relaxed),
        ),
        (
            "profiler_http_connections_rejected_total",
            "HTTP connections refused over --max-connections (closed, or a 503 for a non-probe request on a reserve connection).",
            "counter",
            connections.rejected.load(Relaxed),
        ),
        (
            "profiler_http_header_timeouts_total",
            "HTTP connections closed because the request head did not arrive within --http-header-timeout.",
            "counter",
            connections.header_timeouts.load(Relaxed),
        ),
        (
            "profiler_http_query_timeouts_total",
            "Queries answered with a 503 after --query-timeout.",
            "counter",
            health.query_timeouts.load(Relaxed),
        ),
        (
            "profiler_http_selectors_rejected_total",
            "Queries refused with a 400 for a label selector beyond the size or matcher limits.",
            "counter",
            health.selectors_rejected.load(Relaxed),
        ),
    ]
    .into_iter()
    .map(|(name, help, kind, value)| (name.to_owned(), help, kind, value as f64))
    .collect()
}

/// `GET /healthz`: the process is alive and serves HTTP.
pub async fn healthz() -> Response {
    axum::Json(serde_json::json!({"status": "alive"})).into_response()
}

/// `GET /readyz`: 200 once the agent samples (or `profiler server` listens), else 503.
pub async fn readyz(State(state): State<AppState>) -> Result<Response, ApiError> {
    if !state.health.is_ready() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "not ready: sampling is not running (starting up or stopping)",
        ));
    }
    Ok(axum::Json(serde_json::json!({"status": "ready"})).into_response())
}

/// `GET /api/gpu?from=<unix ms>&until=<unix ms>`: NVML utilization history per GPU.
pub async fn gpu(
    State(state): State<AppState>,
    axum::extract::Query(range): axum::extract::Query<GpuRange>,
) -> Response {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let until = range.until.unwrap_or(now_ms);
    let from = range.from.unwrap_or(until - 3_600_000);
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        state.health.gpu.api_json(from, until),
    )
        .into_response()
}

#[derive(Debug, serde::Deserialize)]
pub struct GpuRange {
    from: Option<i64>,
    until: Option<i64>,
}

/// `GET /api/health`: the numbers the UI's health panel shows.
pub async fn health(State(state): State<AppState>) -> Response {
    let store_on = state.store.is_some();
    let series = state.store.as_ref().map_or(0, |s| s.series(None).len());
    let uptime = state.health.started.elapsed().as_secs();
    let metrics = blocking(move || Ok(state.health.snapshot(state.store.as_ref())))
        .await
        .unwrap_or_default();
    let errors = metrics.export_errors
        + metrics.symbolization_errors
        + metrics.decode_errors
        + metrics.store_ingest_errors;
    let body = serde_json::json!({
        "status": "ok",
        "uptime_seconds": uptime,
        "samples": {
            "processed": metrics.samples_processed,
            "received": metrics.samples_received,
            "dropped": metrics.samples_dropped(),
        },
        "errors": errors,
        "profiles_written": metrics.profiles_written,
        "store": {
            "enabled": store_on,
            "series": series,
            "profiles_ingested": metrics.store_profiles_ingested,
            "ingest_errors": metrics.store_ingest_errors,
            "profiles_evicted": metrics.store_profiles_evicted,
            "bytes": metrics.store_bytes,
        },
        "http": { "requests": metrics.http_requests, "errors": metrics.http_errors },
        "metrics": metrics.values().into_iter().map(|v| (v.name, serde_json::Value::from(v.value))).collect::<serde_json::Map<String, serde_json::Value>>(),
    });
    axum::Json(body).into_response()
}

fn content_type_for(path: &str) -> &'static str {
    match path.rsplit('.').next().unwrap_or("") {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        _ => "application/octet-stream",
    }
}

fn ui_file(path: &str) -> Option<Response> {
    let file = UI.get_file(path)?;
    Some(
        (
            StatusCode::OK,
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(content_type_for(path)),
                ),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            ],
            file.contents(),
        )
            .into_response(),
    )
}

/// `GET /`: the UI's index page.
pub async fn ui() -> Response {
    ui_file("index.html").unwrap_or_else(|| {
        ApiError::not_found("the web UI is not built into this binary").into_response()
    })
}

/// The UI's other files (only files embedded at build time; never the file system), or a JSON
/// 404 for anything else.
pub async fn ui_or_not_found(method: axum::http::Method, uri: Uri) -> Response {
    let path = uri.path().trim_start_matches('/');
    if method == axum::http::Method::GET
        && let Some(response) = ui_file(path)
    {
        return response;
    }
    ApiError::not_found(format!("no such endpoint: {method} {}", uri.path())).into_response()
}
