//! `/metrics`, the probes, `/api/health`, `/api/gpu` and the web UI's files.
use super::*;

/// The web UI, embedded at build time (profiler-user/ui).
static UI: Dir<'_> = include_dir!("$CARGO_MANIFEST_DIR/ui");

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
    health: &crate::server::HealthBoard,
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

/// `GET /api/gpu?from=<unix ms>&until=<unix ms>[&service=<service_name>]`: NVML utilization
/// history per GPU, and the service's own GPU use when one is named.
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
        state
            .health
            .gpu
            .api_json(from, until, range.service.as_deref()),
    )
        .into_response()
}

#[derive(Debug, serde::Deserialize)]
pub struct GpuRange {
    from: Option<i64>,
    until: Option<i64>,
    service: Option<String>,
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
