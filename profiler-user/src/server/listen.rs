//! Accepting connections, before any request is read (so before the token is checked): a bound
//! on concurrent connections with a small reserve that answers only the probes, a timeout for
//! the request head, and an idle timeout for kept-alive connections.
//!
//! A client that opens sockets and sends nothing (or one byte now and then) holds a connection
//! for at most the header timeout; beyond `max_connections` new connections get the reserve,
//! where `/healthz` and `/readyz` are answered and everything else gets a 503, and beyond the
//! reserve they are closed at once. Each refusal is counted.
use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    http::{HeaderValue, Request, StatusCode, header},
    response::{IntoResponse, Response},
};
use hyper::{
    body::Incoming,
    rt::{Sleep, Timer},
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore, watch},
    task::JoinSet,
};
use tower_service::Service;

use super::{HealthBoard, LIVENESS_PATH, READINESS_PATH, connect::ApiError};

/// Default bound of concurrent connections (`--max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default time a client has to send a request head (`--http-header-timeout`).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a kept-alive connection may wait for its next request (`--http-idle-timeout`).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections beyond `max_connections` that are still accepted, for the probes only (one
/// request each), so a kubelet sees the process alive while the limit is hit.
pub const PROBE_RESERVE: usize = 16;
/// Header timeout of a reserve connection (or the configured one if shorter): a probe sends its
/// request at once, so idle sockets cannot hold the reserve for long.
const PROBE_HEADER_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a stopping server waits for in-flight requests before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// At most one warning about refused connections or failed accepts per this period.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The connection limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// Counters of the connection layer, exported by /metrics.
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    /// Connections now open (gauge).
    pub open: AtomicU64,
    /// Connections refused over the limit (closed at once, or a 503 on a reserve connection).
    pub rejected: AtomicU64,
    /// Connections closed because the request head did not arrive in time.
    pub header_timeouts: AtomicU64,
}

/// Serves `app` on `listener` until `shutdown` changes, then lets in-flight requests finish
/// (within [`SHUTDOWN_GRACE`]).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    health: Arc<HealthBoard>,
    mut shutdown: watch::Receiver<bool>,
) {
    let general = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let reserve = Arc::new(Semaphore::new(PROBE_RESERVE));
    let mut connections = JoinSet::new();
    let mut last_warning: Option<Instant> = None;
    let mut unwarned = 0u64;
    loop {
        // Reap finished connections so the set stays as small as the open connections.
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, _peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of descriptors (EMFILE) and the like: wait a little instead of spinning.
                if warn_now(&mut last_warning, &mut unwarned) {
                    tracing::warn!("HTTP server cannot accept a connection: {err}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (permit, probes_only) = match general.clone().try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => match reserve.clone().try_acquire_owned() {
                Ok(permit) => (permit, true),
                Err(_) => {
                    health.connections.rejected.fetch_add(1, Ordering::Relaxed);
                    if warn_now(&mut last_warning, &mut unwarned) {
                        tracing::warn!(
                            max_connections = limits.max_connections,
                            refused_since_last_warning = unwarned,
                            "HTTP connection limit reached: closing new connections"
                        );
                    }
                    drop(stream);
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let connection = Connection {
            stream,
            app: app.clone(),
            limits,
            health: health.clone(),
            probes_only,
            permit,
        };
        connections.spawn(connection.run(shutdown.clone()));
    }
    drop(listener);
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        connections.abort_all();
    }
}

/// Whether to log now (at most once per [`WARN_EVERY`]); counts the silenced events.
fn warn_now(last: &mut Option<Instant>, silenced: &mut u64) -> bool {
    let now = Instant::now();
    if last.is_some_and(|at| now.duration_since(at) < WARN_EVERY) {
        *silenced += 1;
        return false;
    }
    *last = Some(now);
    *silenced = 0;
    true
}

struct Connection {
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    health: Arc<HealthBoard>,
    /// A reserve connection: only the probes are answered, one request.
    probes_only: bool,
    permit: OwnedSemaphorePermit,
}

impl Connection {
    async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let Connection {
            stream,
            app,
            limits,
            health,
            probes_only,
            permit,
        } = self;
        let counters = &health.connections;
        counters.open.fetch_add(1, Ordering::Relaxed);
        let activity = Arc::new(AtomicU64::new(0));
        let io = TokioIo::new(CountingIo {
            inner: stream,
            bytes_read: activity.clone(),
        });
        let rejected = health.clone();
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let mut app = app.clone();
            let refuse = probes_only && !is_probe(request.uri().path());
            if refuse {
                rejected
                    .connections
                    .rejected
                    .fetch_add(1, Ordering::Relaxed);
            }
            async move {
                if refuse {
                    return Ok::<_, std::convert::Infallible>(too_many_connections());
                }
                app.call(request.map(Body::new)).await
            }
        });
        let header_timeout = if probes_only {
            limits.header_timeout.min(PROBE_HEADER_TIMEOUT)
        } else {
            limits.header_timeout
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(HeadTimer {
                header: header_timeout,
                idle: limits.idle_timeout,
                bytes_read: activity,
                heads: Arc::default(),
            })
            .header_read_timeout(header_timeout)
            .keep_alive(!probes_only);
        let connection = builder.serve_connection(io, service);
        tokio::pin!(connection);
        let result = tokio::select! {
            result = connection.as_mut() => result,
            _ = shutdown.changed() => {
                // Finish the request in flight, close an idle connection now.
                connection.as_mut().graceful_shutdown();
                connection.as_mut().await
            }
        };
        if let Err(err) = result {
            if err.is_timeout() {
                counters.header_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("closed an HTTP connection: {err}");
            } else if !err.is_incomplete_message() && !err.is_closed() {
                tracing::debug!("HTTP connection error: {err}");
            }
        }
        counters.open.fetch_sub(1, Ordering::Relaxed);
        drop(permit);
    }
}

fn is_probe(path: &str) -> bool {
    path == LIVENESS_PATH || path == READINESS_PATH
}

/// The answer to a non-probe request on a reserve connection.
fn too_many_connections() -> Response {
    let mut response = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        "too many open connections (--max-connections): try again later",
    )
    .into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// The socket, counting the bytes read so the head timer knows whether a request has begun.
struct CountingIo {
    inner: TcpStream,
    bytes_read: Arc<AtomicU64>,
}

impl AsyncRead for CountingIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            self.bytes_read.fetch_add(read as u64, Ordering::Relaxed);
        }
        result
    }
}

impl AsyncWrite for CountingIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// hyper's timer for one connection. hyper's HTTP/1 server asks a timer only for the
/// request-head deadline (`sleep_until` when it starts waiting for a head), and starts that wait
/// right after the previous response: this timer turns it into the idle timeout until a byte of
/// the next request arrives, then the header timeout from that byte. The first request of a
/// connection has the header timeout from the start.
#[derive(Clone)]
struct HeadTimer {
    header: Duration,
    idle: Duration,
    bytes_read: Arc<AtomicU64>,
    /// Heads waited for so far.
    heads: Arc<AtomicU64>,
}

impl Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        TokioTimer::new().sleep(duration)
    }

    fn sleep_until(&self, _deadline: Instant) -> Pin<Box<dyn Sleep>> {
        let first = self.heads.fetch_add(1, Ordering::Relaxed) == 0;
        let now = tokio::time::Instant::now();
        let (started, deadline) = if first {
            (Some(now), now + self.header)
        } else {
            (None, now + self.idle)
        };
        Box::pin(HeadSleep {
            header: self.header,
            bytes_at_start: self.bytes_read.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.clone(),
            started,
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn Sleep>>, new_deadline: Instant) {
        *sleep = self.sleep_until(new_deadline);
    }
}

struct HeadSleep {
    header: Duration,
    bytes_at_start: u64,
    bytes_read: Arc<AtomicU64>,
    /// When the head began to arrive (its first byte; the first head: the connection's start).
    started: Option<tokio::time::Instant>,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Sleep for HeadSleep {}

impl Future for HeadSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // hyper polls this whenever the connection wakes, so a new byte is seen at once.
        if self.started.is_none() && self.bytes_read.load(Ordering::Relaxed) > self.bytes_at_start {
            let now = tokio::time::Instant::now();
            self.started = Some(now);
            let deadline = now + self.header;
            self.sleep.as_mut().reset(deadline);
        }
        self.sleep.as_mut().poll(cx)
    }
}
