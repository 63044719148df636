//! Push to Grafana Pyroscope: each interval's profiles go to `POST {url}/push.v1.PusherService/Push`
//! (Connect, protobuf `PushRequest`, gzipped pprof as `raw_profile`; docs/pyroscope-protocol.md §3).
//!
//! The exporter thread calls [`PushSink::write`], which only encodes the request and appends it
//! to a bounded [`queue::PushQueue`] (and, with `--spool-dir`, a file on disk); the `pusher`
//! thread sends from the queue, retrying 408/429/5xx and network errors with exponential backoff
//! and full jitter ([`backoff`]). Sampling never waits for the network.
pub mod backoff;
pub mod client;
pub mod queue;
pub mod spool;

use std::{
    fmt,
    io::Write,
    path::PathBuf,
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use clap::Args;
use prost::Message;

use self::{
    backoff::{Backoff, INITIAL_BACKOFF},
    client::{Client, Outcome},
    queue::PushQueue,
    spool::{Spool, SpoolError},
};
use super::{ExportError, ProfileSink, pprof::build_pprof};
use crate::{
    model::Profile,
    units::{parse_age, parse_size},
    wire::api::{LabelPair, PushRequest, RawProfileSeries, RawSample},
};

/// Default bound of the in-memory queue.
pub const DEFAULT_QUEUE_BYTES: u64 = 64 << 20;
/// Default bound of the disk spool.
pub const DEFAULT_SPOOL_BYTES: u64 = 1 << 30;
/// Requests of one batch (concatenated `PushRequest`s are one `PushRequest` on the wire).
const MAX_BATCH_PROFILES: usize = 32;
const MAX_BATCH_BYTES: u64 = 2 << 20;
/// How long a stopping agent keeps sending what is queued (while the receiver answers).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// At most one warning of a kind per this period; the others are counted in the next one.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The `--pyroscope-url`: printed (Display, Debug) with any password in it as `***`, since a
/// userinfo (`http://user:pass@host`) is sent as Basic auth. [`PushUrl::expose`] gives the URL.
#[derive(Clone, PartialEq, Eq)]
pub struct PushUrl(String);

impl PushUrl {
    /// The URL with its credentials, for the HTTP client only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PushUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&client::redact_url(&self.0))
    }
}

impl fmt::Debug for PushUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", client::redact_url(&self.0))
    }
}

impl PartialEq<&str> for PushUrl {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// The pusher's counters and queue at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PushStats {
    pub sent: u64,
    pub failed: u64,
    pub retries: u64,
    pub dropped: u64,
    pub queue_bytes: u64,
    pub spool_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("invalid --pyroscope-url {0}")]
    InvalidUrl(String),
    #[error(transparent)]
    Spool(#[from] SpoolError),
    #[error("cannot start the pusher thread: {0}")]
    Thread(std::io::Error),
}

/// How the agent authenticates to Pyroscope.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum PushAuth {
    #[default]
    None,
    /// Grafana Cloud: the stack's user id and an access-policy token.
    Basic {
        user: String,
        password: String,
    },
    Bearer(String),
}

impl fmt::Debug for PushAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushAuth::None => f.write_str("None"),
            PushAuth::Basic { user, .. } => write!(f, "Basic({user}, <redacted>)"),
            PushAuth::Bearer(_) => f.write_str("Bearer(<redacted>)"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpoolSettings {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// Settings of the push to Pyroscope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushConfig {
    /// Base URL; the push path is appended.
    pub url: PushUrl,
    pub auth: PushAuth,
    /// Sent as `X-Scope-OrgID`.
    pub tenant_id: Option<String>,
    /// Added to every series; the profile's own labels win.
    pub extra_labels: Vec<(String, String)>,
    pub queue_bytes: u64,
    pub max_backoff: Duration,
    pub spool: Option<SpoolSettings>,
}

impl PushConfig {
    pub fn new(url: impl Into<String>) -> Self {
        PushConfig {
            url: PushUrl(url.into()),
            auth: PushAuth::None,
            tenant_id: None,
            extra_labels: Vec::new(),
            queue_bytes: DEFAULT_QUEUE_BYTES,
            max_backoff: Duration::from_secs(60),
            spool: None,
        }
    }
}

/// Flags of the push to Pyroscope (`profiler agent`).
#[derive(Debug, Args)]
pub struct PushArgs {
    /// Push every interval's profiles to this Grafana Pyroscope (or compatible) server, e.g.
    /// http://pyroscope:4040. Also read from PYROSCOPE_URL. Turns the embedded store off unless
    /// --store on is given.
    #[arg(long, env = "PROFILER_PYROSCOPE_URL", value_parser = UrlParser)]
    pub pyroscope_url: Option<String>,
    /// User for HTTP basic auth (Grafana Cloud: the stack's numeric profiles user id).
    #[arg(long, env = "PROFILER_PYROSCOPE_USER", requires = "pyroscope_password")]
    pub pyroscope_user: Option<String>,
    /// Password for HTTP basic auth (Grafana Cloud: an access-policy token).
    #[arg(
        long,
        env = "PROFILER_PYROSCOPE_PASSWORD",
        hide_env_values = true,
        requires = "pyroscope_user"
    )]
    pub pyroscope_password: Option<String>,
    /// Bearer token sent as `Authorization: Bearer ...`.
    #[arg(
        long,
        env = "PROFILER_PYROSCOPE_TOKEN",
        hide_env_values = true,
        conflicts_with = "pyroscope_user"
    )]
    pub pyroscope_token: Option<String>,
    /// Tenant sent as the X-Scope-OrgID header (multi-tenant Pyroscope).
    #[arg(long, env = "PROFILER_PYROSCOPE_TENANT_ID")]
    pub pyroscope_tenant_id: Option<String>,
    /// Extra label NAME=VALUE on every pushed series; repeatable (environment: comma-separated).
    #[arg(long = "pyroscope-label", env = "PROFILER_PYROSCOPE_LABEL", value_delimiter = ',', value_parser = parse_label)]
    pub pyroscope_labels: Vec<(String, String)>,
    /// Bound of the in-memory push queue (e.g. 64MiB); beyond it the oldest profiles are dropped
    /// (or, with --spool-dir, kept on disk only).
    #[arg(long, env = "PROFILER_PUSH_QUEUE_SIZE", default_value = "64MiB", value_parser = parse_size)]
    pub push_queue_size: u64,
    /// Longest wait between two attempts while Pyroscope is unreachable (e.g. 60s, 5m).
    #[arg(long, env = "PROFILER_PUSH_MAX_BACKOFF", default_value = "60s", value_parser = parse_age)]
    pub push_max_backoff: Duration,
    /// Keep queued profiles in this directory too, so they survive an agent restart and an
    /// outage longer than the memory queue holds.
    #[arg(long, env = "PROFILER_SPOOL_DIR")]
    pub spool_dir: Option<PathBuf>,
    /// Bound of the disk spool (e.g. 1GiB); beyond it the oldest profiles are dropped.
    #[arg(long, env = "PROFILER_SPOOL_MAX_SIZE", default_value = "1GiB", value_parser = parse_size)]
    pub spool_max_size: u64,
}

impl PushArgs {
    /// `None` without a URL (flag, PROFILER_PYROSCOPE_URL or PYROSCOPE_URL).
    pub fn into_config(self) -> Option<PushConfig> {
        let url = self.pyroscope_url.or_else(|| {
            std::env::var("PYROSCOPE_URL")
                .ok()
                .filter(|u| !u.trim().is_empty())
        })?;
        let auth = match (
            self.pyroscope_user,
            self.pyroscope_password,
            self.pyroscope_token,
        ) {
            (_, _, Some(token)) if !token.is_empty() => PushAuth::Bearer(token),
            (Some(user), Some(password), _) => PushAuth::Basic { user, password },
            _ => PushAuth::None,
        };
        Some(PushConfig {
            url: PushUrl(url),
            auth,
            tenant_id: self.pyroscope_tenant_id.filter(|t| !t.is_empty()),
            extra_labels: self.pyroscope_labels,
            queue_bytes: self.push_queue_size,
            max_backoff: self.push_max_backoff,
            spool: self.spool_dir.map(|dir| SpoolSettings {
                dir,
                max_bytes: self.spool_max_size,
            }),
        })
    }
}

/// Parses `--pyroscope-url`. Not a plain function parser: clap's error for those quotes the
/// value, and this one may carry a password.
#[derive(Clone)]
struct UrlParser;

impl clap::builder::TypedValueParser for UrlParser {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        let invalid = |reason: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for --pyroscope-url: {reason}\n"),
            )
            .with_cmd(cmd)
        };
        let text = value
            .to_str()
            .ok_or_else(|| invalid("not valid UTF-8".into()))?;
        client::validate_url(text).map_err(invalid)
    }
}

/// `name=value`; names as Pyroscope's query language accepts them without quoting.
fn parse_label(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("'{text}' is not NAME=VALUE"))?;
    let (name, value) = (name.trim(), value.trim());
    let valid_name = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if !valid_name {
        return Err(format!(
            "label name '{name}' must be letters, digits, '_' or '.', not starting with a digit"
        ));
    }
    if name.starts_with("__") {
        return Err(format!(
            "label name '{name}' is reserved (names starting with __)"
        ));
    }
    if value.is_empty() || value.len() > 2048 {
        return Err(format!(
            "the value of label '{name}' must be 1 to 2048 bytes"
        ));
    }
    Ok((name.to_owned(), value.to_owned()))
}

/// One profile as a `PushRequest`: series labels `__name__`, the profile's labels (with
/// `service_name`), then the extra labels the profile does not already have.
pub fn push_request(profile: &Profile, extra_labels: &[(String, String)]) -> PushRequest {
    let pprof = build_pprof(profile);
    // Pyroscope's profile type name, as the embedded store names it (docs/pyroscope-protocol.md §6.3).
    let mut labels = vec![LabelPair {
        name: "__name__".into(),
        value: profile.kind.name().into(),
    }];
    let mut add = |name: &str, value: &str| {
        if !name.starts_with("__") && !value.is_empty() && !labels.iter().any(|l| l.name == name) {
            labels.push(LabelPair {
                name: name.into(),
                value: value.into(),
            });
        }
    };
    for (name, value) in profile.series_labels.iter().chain(extra_labels) {
        add(name, value);
    }
    labels.sort_by(|a, b| a.name.cmp(&b.name));
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder
        .write_all(&pprof.encode_to_vec())
        .expect("gzip into memory cannot fail");
    let raw_profile = encoder.finish().expect("gzip into memory cannot fail");
    PushRequest {
        series: vec![RawProfileSeries {
            labels,
            samples: vec![RawSample {
                raw_profile,
                id: uuid_v4(),
            }],
        }],
    }
}

/// A random (version 4) UUID: Pyroscope keeps it as the profile's id.
fn uuid_v4() -> String {
    let mut bytes = fastrand::u128(..).to_be_bytes();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[derive(Debug, Default)]
struct PushCounters {
    sent: AtomicU64,
    failed: AtomicU64,
    retries: AtomicU64,
}

/// State shared by the sink (exporter thread) and the pusher thread.
struct Shared {
    queue: Mutex<PushQueue>,
    wake: Condvar,
    stopping: AtomicBool,
    counters: PushCounters,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, PushQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Logs a warning at most once per [`WARN_EVERY`], saying how many were held back.
#[derive(Debug, Default)]
struct RateLimitedWarning {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedWarning {
    fn warn(&mut self, message: impl FnOnce() -> String) {
        let now = Instant::now();
        if self.last.is_some_and(|last| now - last < WARN_EVERY) {
            self.suppressed += 1;
            return;
        }
        let message = message();
        if self.suppressed > 0 {
            tracing::warn!(
                "{message} ({} similar warnings suppressed)",
                self.suppressed
            );
        } else {
            tracing::warn!("{message}");
        }
        self.last = Some(now);
        self.suppressed = 0;
    }
}

/// The exporter's end: encodes each profile and queues it; never waits for the network.
pub struct PushSink {
    shared: Arc<Shared>,
    extra_labels: Vec<(String, String)>,
    dropped_warning: RateLimitedWarning,
}

impl ProfileSink for PushSink {
    fn write(&mut self, profile: &Profile) -> Result<(), ExportError> {
        let body = push_request(profile, &self.extra_labels).encode_to_vec();
        let bytes = body.len();
        let dropped = {
            let mut queue = self.shared.queue();
            queue.push(body)
        };
        self.shared.wake.notify_all();
        tracing::debug!(
            service = profile.series_label("service_name").unwrap_or(""),
            time_ns = profile.start_unix_ns,
            bytes,
            "profile queued for push"
        );
        if dropped > 0 {
            self.dropped_warning.warn(|| {
                format!(
                    "the push queue is full (--push-queue-size/--spool-max-size): dropped the \
                     {dropped} oldest profile(s)"
                )
            });
        }
        Ok(())
    }
}

/// The pusher thread. [`Pusher::finish`] stops it after sending what it can.
pub struct Pusher {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Pusher {
    /// Opens the spool (if any) and starts the thread; the sink feeds it.
    pub fn start(config: &PushConfig) -> Result<(Pusher, PushSink), PushError> {
        let client = Client::new(config)?;
        let queue = match &config.spool {
            Some(settings) => {
                let (spool, spooled) = Spool::open(&settings.dir)?;
                if !spooled.is_empty() {
                    tracing::info!(
                        dir = %settings.dir.display(),
                        profiles = spooled.len(),
                        "sending profiles spooled by an earlier run"
                    );
                }
                PushQueue::with_spool(config.queue_bytes, spool, settings.max_bytes, &spooled)
            }
            None => PushQueue::new(config.queue_bytes),
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(queue),
            wake: Condvar::new(),
            stopping: AtomicBool::new(false),
            counters: PushCounters::default(),
        });
        let thread = {
            let shared = shared.clone();
            let backoff = Backoff::new(INITIAL_BACKOFF, config.max_backoff);
            std::thread::Builder::new()
                .name("pusher".into())
                .spawn(move || run(&shared, &client, backoff))
                .map_err(PushError::Thread)?
        };
        tracing::info!(url = %config.url, spool = ?config.spool.as_ref().map(|s| &s.dir), "pushing profiles to Pyroscope");
        Ok((
            Pusher {
                shared: shared.clone(),
                thread: Some(thread),
            },
            PushSink {
                shared,
                extra_labels: config.extra_labels.clone(),
                dropped_warning: RateLimitedWarning::default(),
            },
        ))
    }

    /// Sends what is queued while the receiver answers (up to a grace period), then stops.
    /// What is left stays in the spool, or is lost without one (logged).
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    pub fn stats(&self) -> PushStats {
        let counters = &self.shared.counters;
        let queue = self.shared.queue();
        PushStats {
            sent: counters.sent.load(Ordering::Relaxed),
            failed: counters.failed.load(Ordering::Relaxed),
            retries: counters.retries.load(Ordering::Relaxed),
            dropped: queue.dropped(),
            queue_bytes: queue.memory_bytes(),
            spool_bytes: queue.spool_bytes(),
        }
    }
}

impl Drop for Pusher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The pusher thread's loop.
fn run(shared: &Shared, client: &Client, mut backoff: Backoff) {
    let counters = &shared.counters;
    let mut rejected_warning = RateLimitedWarning::default();
    // After a rejected batch, its requests are retried one by one to find the bad one(s).
    let mut send_singly = 0usize;
    let mut stop_deadline: Option<Instant> = None;
    loop {
        let batch = {
            let mut queue = shared.queue();
            loop {
                if shared.stopping.load(Ordering::Relaxed) {
                    let deadline =
                        *stop_deadline.get_or_insert_with(|| Instant::now() + SHUTDOWN_GRACE);
                    if queue.is_empty() || Instant::now() >= deadline {
                        drop(queue);
                        report_leftovers(shared);
                        return;
                    }
                }
                if !queue.is_empty() {
                    let max = if send_singly > 0 {
                        1
                    } else {
                        MAX_BATCH_PROFILES
                    };
                    break queue.next_batch(max, MAX_BATCH_BYTES);
                }
                queue = shared.wake.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
        };
        if batch.is_empty() {
            // Everything taken was unreadable in the spool (already counted).
            continue;
        }
        let profiles = batch.len() as u64;
        let body: Vec<u8> = batch.iter().flat_map(|b| b.iter().copied()).collect();
        drop(batch);
        match client.send(&body) {
            Outcome::Sent => {
                shared.queue().complete();
                counters.sent.fetch_add(profiles, Ordering::Relaxed);
                if backoff.failures() > 0 {
                    tracing::info!(
                        retries = backoff.failures(),
                        "pushing to Pyroscope works again"
                    );
                }
                backoff.reset();
                send_singly = send_singly.saturating_sub(1);
            }
            Outcome::Rejected { .. } if profiles > 1 => {
                shared.queue().release();
                send_singly = profiles as usize;
            }
            Outcome::Rejected { status, message } => {
                shared.queue().complete();
                counters.failed.fetch_add(1, Ordering::Relaxed);
                send_singly = send_singly.saturating_sub(1);
                rejected_warning.warn(|| {
                    format!("Pyroscope rejected a profile (HTTP {status}), dropped it: {message}")
                });
            }
            Outcome::Retry {
                reason,
                retry_after,
            } => {
                shared.queue().release();
                counters.retries.fetch_add(1, Ordering::Relaxed);
                if shared.stopping.load(Ordering::Relaxed) {
                    // No waiting while stopping: the receiver is away.
                    report_leftovers(shared);
                    return;
                }
                let wait = backoff.next_wait(retry_after);
                if backoff.failures() == 1 {
                    tracing::warn!(
                        endpoint = client.endpoint(),
                        "cannot push to Pyroscope, retrying with backoff: {reason}"
                    );
                } else {
                    tracing::debug!(
                        retries = backoff.failures(),
                        wait_ms = wait.as_millis() as u64,
                        "push failed again: {reason}"
                    );
                }
                let queue = shared.queue();
                let _ = shared
                    .wake
                    .wait_timeout_while(queue, wait, |_| !shared.stopping.load(Ordering::Relaxed));
            }
        }
    }
}

fn report_leftovers(shared: &Shared) {
    let queue = shared.queue();
    if queue.is_empty() {
        return;
    }
    if queue.has_spool() {
        tracing::info!(
            profiles = queue.len(),
            "unsent profiles stay in the spool for the next start"
        );
    } else {
        tracing::warn!(
            profiles = queue.len(),
            "profiles not sent to Pyroscope are lost (--spool-dir keeps them across restarts)"
        );
    }
}

#[cfg(test)]
mod tests;
