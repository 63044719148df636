//! The HTTP server on one port: Pyroscope-compatible ingest (`/ingest`, Connect Push), the
//! Connect query API Grafana and the web UI use (`querier.v1.QuerierService`), `/metrics`,
//! `/api/health`, the probes `/healthz` and `/readyz`, and the embedded web UI at `/`.
//!
//! Runs on its own small tokio runtime thread, so the sampling pipeline never waits for it;
//! store work runs on tokio's blocking pool.
pub mod connect;
pub(crate) mod handlers;
pub mod listen;
pub mod render;
pub mod serve;

use std::{
    net::{SocketAddr, TcpListener},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::{Request, State},
    http::{HeaderValue, Method, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};

use crate::{self_metrics::SelfMetrics, store::Store};
use connect::ApiError;
pub use listen::{
    ConnectionCounters, ConnectionLimits, DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
};

/// Default address of the HTTP server.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:4040";
/// Default limit of a request body, also after decompression.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// Default bound of one query's time (`--query-timeout`), waiting for a turn included.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(30);
/// Queries that run at once on the blocking pool (8 threads); the others wait for a turn, so
/// ingest and /metrics keep threads while heavy queries run.
pub const MAX_CONCURRENT_QUERIES: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "refusing to listen on {0} without --auth-token: only loopback addresses are safe without \
         one (or pass --insecure-listen to accept that anyone who can reach the port can read and \
         write profiles)"
    )]
    Unprotected(SocketAddr),
    #[error("cannot start the HTTP server: {0}")]
    Runtime(#[source] std::io::Error),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Bearer token required on every route but /metrics and the probes.
    pub auth_token: Option<String>,
    /// Require the token on /metrics too.
    pub auth_metrics: bool,
    /// Allow a non-loopback address without a token.
    pub insecure_listen: bool,
    pub max_body_bytes: usize,
    /// Concurrent connections, header and idle timeouts (enforced before a request is read).
    pub connections: ConnectionLimits,
    /// Longest a query may take before the client gets a 503.
    pub query_timeout: Duration,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr) -> Self {
        ServerConfig {
            listen,
            auth_token: None,
            auth_metrics: false,
            insecure_listen: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            connections: ConnectionLimits::default(),
            query_timeout: DEFAULT_QUERY_TIMEOUT,
        }
    }

    /// Listening beyond loopback needs a token or an explicit opt-out.
    pub fn check(&self) -> Result<(), ServerError> {
        if !self.listen.ip().is_loopback() && self.auth_token.is_none() && !self.insecure_listen {
            return Err(ServerError::Unprotected(self.listen));
        }
        Ok(())
    }
}

/// What the agent reports about itself, updated every interval, read by /metrics and the UI.
#[derive(Debug)]
pub struct HealthBoard {
    latest: Mutex<SelfMetrics>,
    /// NVML readings (filled by the agent's poller; empty in `profiler server`).
    pub gpu: Arc<crate::gpu::nvml::GpuBoard>,
    started: Instant,
    pub http_requests: AtomicU64,
    pub http_errors: AtomicU64,
    /// Refused, timed-out and open connections (server/listen.rs).
    pub connections: ConnectionCounters,
    /// Queries answered with a 503 because they ran past --query-timeout.
    pub query_timeouts: AtomicU64,
    /// Label selectors refused for their size or number of matchers.
    pub selectors_rejected: AtomicU64,
    /// Turns for queries on the blocking pool ([`MAX_CONCURRENT_QUERIES`]).
    pub queries: Arc<tokio::sync::Semaphore>,
    /// Whether `/readyz` answers 200: set once the agent samples (the server alone: once it
    /// listens), cleared when it stops.
    ready: AtomicBool,
}

impl Default for HealthBoard {
    fn default() -> Self {
        HealthBoard {
            latest: Mutex::new(SelfMetrics::default()),
            gpu: Arc::default(),
            started: Instant::now(),
            http_requests: AtomicU64::new(0),
            http_errors: AtomicU64::new(0),
            connections: ConnectionCounters::default(),
            query_timeouts: AtomicU64::new(0),
            selectors_rejected: AtomicU64::new(0),
            queries: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_QUERIES)),
            ready: AtomicBool::new(false),
        }
    }
}

impl HealthBoard {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    pub fn publish(&self, metrics: SelfMetrics) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = metrics;
    }

    /// The latest agent metrics with the server's and store's counters filled in.
    pub fn snapshot(&self, store: Option<&Store>) -> SelfMetrics {
        let mut metrics = self
            .latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        metrics.http_requests = self.http_requests.load(Ordering::Relaxed);
        metrics.nvml_polls = self.gpu.poll_stats();
        metrics.http_errors = self.http_errors.load(Ordering::Relaxed);
        if let Some(store) = store {
            let counters = store.counters();
            metrics.store_profiles_ingested = counters.profiles_ingested.load(Ordering::Relaxed);
            metrics.store_ingest_errors = counters.ingest_errors.load(Ordering::Relaxed);
            metrics.store_profiles_evicted = counters.profiles_evicted.load(Ordering::Relaxed);
            metrics.store_bytes = store.used_bytes().unwrap_or(0);
            metrics.store_sqlite_memory_bytes = crate::store::sqlite_memory_bytes();
            let (names, frames, nodes) = store.catalog_sizes();
            metrics.store_catalog_names = names as u64;
            metrics.store_catalog_frames = frames as u64;
            metrics.store_catalog_nodes = nodes as u64;
        }
        metrics
    }
}

#[derive(Clone)]
pub struct AppState {
    pub store: Option<Store>,
    pub health: Arc<HealthBoard>,
    pub config: Arc<ServerConfig>,
}

impl AppState {
    fn store(&self) -> Result<&Store, ApiError> {
        self.store.as_ref().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the embedded store is off (--store off)",
            )
        })
    }
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/ingest", post(handlers::ingest))
        .route("/pyroscope/ingest", post(handlers::ingest))
        .route("/push.v1.PusherService/Push", post(handlers::push))
        .route(
            "/querier.v1.QuerierService/{method}",
            post(handlers::querier),
        )
        .route(
            "/settings.v1.SettingsService/{method}",
            post(handlers::settings),
        )
        .route("/metrics", get(handlers::metrics))
        .route(LIVENESS_PATH, get(handlers::healthz))
        .route(READINESS_PATH, get(handlers::readyz))
        .route("/api/health", get(handlers::health))
        .route("/api/gpu", get(handlers::gpu))
        .route("/api/pprof", get(handlers::pprof_download))
        .route("/pyroscope/render", get(handlers::render_single))
        .route("/pyroscope/render-diff", get(handlers::render_diff))
        .route("/", get(handlers::ui))
        .fallback(handlers::ui_or_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

async fn method_not_allowed(method: Method) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "unimplemented",
        format!("method {method} is not allowed here"),
    )
}

/// Cookie that carries the token for a browser after it opened `/?token=TOKEN` once.
pub const TOKEN_COOKIE: &str = "profiler_token";
/// Liveness probe: 200 while the process serves HTTP.
pub const LIVENESS_PATH: &str = "/healthz";
/// Readiness probe: 200 once sampling runs, 503 before and while stopping.
pub const READINESS_PATH: &str = "/readyz";

/// Checks the bearer token (header or cookie) and counts requests and errors. `/?token=TOKEN`
/// with the right token sets the cookie and redirects to `/`, so a browser can open the UI.
/// The probes never need the token (a kubelet has none), nor does /metrics unless
/// `auth_metrics`; they reveal no profile data.
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    state.health.http_requests.fetch_add(1, Ordering::Relaxed);
    let path = request.uri().path();
    let probe = path == LIVENESS_PATH || path == READINESS_PATH;
    let open = probe || (path == "/metrics" && !state.config.auth_metrics);
    if let Some(token) = &state.config.auth_token
        && !open
    {
        if request.uri().path() == "/"
            && let Some(offered) = query_token(request.uri())
        {
            if constant_time_eq(offered.as_bytes(), token.as_bytes()) {
                return login_redirect(token);
            }
            return unauthorized(&state);
        }
        let headers = request.headers();
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_credentials)
            .is_some_and(|presented| constant_time_eq(presented.as_bytes(), token.as_bytes()));
        let cookie =
            || cookie_values(headers).any(|presented| session::verify(token, presented.as_bytes()));
        if !bearer && !cookie() {
            let mut response = unauthorized(&state);
            if has_body(request.headers()) {
                // The body stays unread: tell the client the connection ends here.
                close_connection(&mut response);
            }
            return response;
        }
    }
    // The whole body (within the limit) is read before the handler runs. A handler that rejects
    // a request early would otherwise leave the rest unread, and hyper then drops the connection
    // without saying so: the client's next request on that kept-alive connection would fail.
    let (parts, body) = request.into_parts();
    let request = match connect::read_body(body, state.config.max_body_bytes).await {
        Ok(bytes) => Request::from_parts(parts, axum::body::Body::from(bytes)),
        Err(err) => {
            state.health.http_errors.fetch_add(1, Ordering::Relaxed);
            let mut response = err.into_response();
            close_connection(&mut response);
            return response;
        }
    };
    let response = next.run(request).await;
    // A 503 from /readyz while starting is an answer, not an error of the server.
    if !probe && (response.status().is_client_error() || response.status().is_server_error()) {
        state.health.http_errors.fetch_add(1, Ordering::Relaxed);
    }
    response
}

/// Whether a request announces a body (a length above 0, or chunked).
fn has_body(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|length| length != "0")
}

/// `Connection: close`: the server will not read the rest of this request.
fn close_connection(response: &mut Response) {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
}

fn unauthorized(state: &AppState) -> Response {
    state.health.http_errors.fetch_add(1, Ordering::Relaxed);
    let mut response = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "missing or wrong bearer token",
    )
    .into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// The `token` query parameter, percent-decoded.
fn query_token(uri: &axum::http::Uri) -> Option<String> {
    let query: axum::extract::Query<std::collections::HashMap<String, String>> =
        axum::extract::Query::try_from_uri(uri).ok()?;
    query.0.get("token").cloned()
}

/// The credentials of an `Authorization: Bearer ...` header; the scheme is case-insensitive
/// (RFC 9110 §11.1), so `bearer` and `BEARER` work too.
fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, credentials) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credentials.trim_start())
}

/// 303 to `/` with a session cookie (HttpOnly, SameSite=Strict), so the token leaves the
/// address bar and scripts cannot read the cookie. The cookie is an HMAC keyed by the token
/// ([`session`]), not the token itself.
fn login_redirect(token: &str) -> Response {
    let cookie = format!(
        "{TOKEN_COOKIE}={}; Path=/; HttpOnly; SameSite=Strict",
        session::cookie_value(token)
    );
    let mut response = StatusCode::SEE_OTHER.into_response();
    let headers = response.headers_mut();
    headers.insert(header::LOCATION, HeaderValue::from_static("/"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        headers.insert(header::SET_COOKIE, value);
    }
    response
}

/// The values of every session cookie in the request.
fn cookie_values(headers: &axum::http::HeaderMap) -> impl Iterator<Item = &str> + '_ {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| *name == TOKEN_COOKIE)
        .map(|(_, value)| value)
}

/// The UI's session cookie: HMAC-SHA256 of a fixed label keyed by the token, hex-encoded. It
/// proves the browser was given the token once without being the token: a leaked cookie (a
/// proxy log, a stolen browser profile) does not reveal the bearer token for the API, and it
/// stops working when the token changes.
mod session {
    use ring::hmac;

    /// What the HMAC signs; a new label would void every cookie issued before.
    const LABEL: &[u8] = b"profiler web UI session v1";

    pub fn cookie_value(token: &str) -> String {
        let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
        hmac::sign(&key, LABEL)
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `presented` (hex) is the cookie for `token`, compared in constant time.
    pub fn verify(token: &str, presented: &[u8]) -> bool {
        let Some(tag) = decode_hex(presented) else {
            return false;
        };
        let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
        hmac::verify(&key, LABEL, &tag).is_ok()
    }

    fn decode_hex(text: &[u8]) -> Option<Vec<u8>> {
        if !text.len().is_multiple_of(2) {
            return None;
        }
        text.chunks(2)
            .map(|pair| {
                let digit = |c: u8| (c as char).to_digit(16);
                Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
            })
            .collect()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A running server; dropping it (or [`Server::shutdown`]) stops it.
pub struct Server {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Binds (synchronously, so errors surface here) and serves on a background thread.
    pub fn start(state: AppState) -> Result<Server, ServerError> {
        let config = state.config.clone();
        config.check()?;
        let listener = TcpListener::bind(config.listen).map_err(|source| ServerError::Bind {
            addr: config.listen,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(ServerError::Runtime)?;
        let addr = listener.local_addr().map_err(ServerError::Runtime)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(8)
            .thread_name("http")
            .enable_all()
            .build()
            .map_err(ServerError::Runtime)?;
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        let limits = config.connections;
        let health = state.health.clone();
        let app = router(state);
        let thread = std::thread::Builder::new()
            .name("http-server".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(err) => {
                            tracing::error!("HTTP server: {err}");
                            return;
                        }
                    };
                    listen::serve(listener, app, limits, health, shutdown_rx).await;
                });
            })
            .map_err(ServerError::Runtime)?;
        // Tests and scripts started with port 0 read the bound address from this line.
        tracing::info!("HTTP server listening on {addr}, web UI at http://{addr}/");
        Ok(Server {
            addr,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests;
