//! The server's command-line flags, its settings, and starting the store plus the server
//! together (`profiler agent` by default, `profiler server` alone).
use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, LazyLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use clap::{Args, ValueEnum};

use super::{
    AppState, ConnectionLimits, DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_QUERY_TIMEOUT, HealthBoard, Server,
    ServerConfig, ServerError,
};
use crate::store::{
    DEFAULT_DATA_DIR, DEFAULT_MAINTENANCE_INTERVAL, DEFAULT_MAX_BYTES, DEFAULT_RETENTION, Store,
    StoreError, StoreOptions, StoreSettings, limits::StoreLimitArgs,
};
use crate::units::{format_age, format_size, parse_age, parse_size};

// The flags' defaults as `--help` shows them, written from the constants the store and server
// use, so there is one source for each default.
static DEFAULT_RETENTION_TEXT: LazyLock<String> = LazyLock::new(|| format_age(DEFAULT_RETENTION));
static DEFAULT_MAINTENANCE_TEXT: LazyLock<String> =
    LazyLock::new(|| format_age(DEFAULT_MAINTENANCE_INTERVAL));
static DEFAULT_MAX_STORE_TEXT: LazyLock<String> = LazyLock::new(|| format_size(DEFAULT_MAX_BYTES));
static DEFAULT_MAX_BODY_TEXT: LazyLock<String> =
    LazyLock::new(|| format_size(DEFAULT_MAX_BODY_BYTES as u64));
static DEFAULT_MAX_CONNECTIONS_TEXT: LazyLock<String> =
    LazyLock::new(|| DEFAULT_MAX_CONNECTIONS.to_string());
static DEFAULT_HEADER_TIMEOUT_TEXT: LazyLock<String> =
    LazyLock::new(|| format_age(DEFAULT_HEADER_TIMEOUT));
static DEFAULT_IDLE_TIMEOUT_TEXT: LazyLock<String> =
    LazyLock::new(|| format_age(DEFAULT_IDLE_TIMEOUT));
static DEFAULT_QUERY_TIMEOUT_TEXT: LazyLock<String> =
    LazyLock::new(|| format_age(DEFAULT_QUERY_TIMEOUT));

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// Flags of the embedded store and the HTTP server.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Address of the HTTP server (web UI, Pyroscope-compatible ingest and query API, /metrics).
    /// Beyond loopback it requires --auth-token or --insecure-listen.
    #[arg(long, env = "PROFILER_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Keep profiles in the embedded store (queried by the web UI and the API). Default: on, but
    /// off for `profiler agent` with --pyroscope-url (pass --store on to keep both).
    #[arg(long, env = "PROFILER_STORE", value_enum)]
    pub store: Option<Switch>,
    /// Directory of the embedded store.
    #[arg(long, env = "PROFILER_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// How long stored profiles are kept (e.g. 7d, 12h, 90m, 3600s).
    #[arg(long, env = "PROFILER_RETENTION", default_value = DEFAULT_RETENTION_TEXT.as_str(),
          value_parser = parse_age)]
    pub retention: Duration,
    /// Size cap of the embedded store; the oldest profiles are deleted beyond it (e.g. 10GiB, 500MiB).
    #[arg(long, env = "PROFILER_MAX_STORE_SIZE", default_value = DEFAULT_MAX_STORE_TEXT.as_str(),
          value_parser = parse_size)]
    pub max_store_size: u64,
    /// How often --retention and --max-store-size are enforced while running (also at start).
    #[arg(long, env = "PROFILER_MAINTENANCE_INTERVAL",
          default_value = DEFAULT_MAINTENANCE_TEXT.as_str(), value_parser = parse_age)]
    pub maintenance_interval: Duration,
    /// Bearer token required on every HTTP route except /metrics, /healthz and /readyz
    /// (/metrics too with --auth-metrics).
    #[arg(long, env = "PROFILER_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// Require --auth-token on /metrics as well (Prometheus then needs the bearer token).
    #[arg(long, env = "PROFILER_AUTH_METRICS", requires = "auth_token")]
    pub auth_metrics: bool,
    /// Allow --listen on a non-loopback address without --auth-token.
    #[arg(long, env = "PROFILER_INSECURE_LISTEN")]
    pub insecure_listen: bool,
    /// Largest accepted request body, also after decompression (e.g. 16MiB).
    #[arg(long, env = "PROFILER_MAX_BODY_SIZE", default_value = DEFAULT_MAX_BODY_TEXT.as_str(),
          value_parser = parse_size)]
    pub max_body_size: u64,
    /// Most HTTP connections open at once. Beyond it a small reserve still answers /healthz and
    /// /readyz (anything else gets a 503), and further connections are closed at once; each
    /// refusal is counted in profiler_http_connections_rejected_total.
    #[arg(long, env = "PROFILER_MAX_CONNECTIONS",
          default_value = DEFAULT_MAX_CONNECTIONS_TEXT.as_str(),
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// How long a client has to send a whole request head, from connecting (or from the first
    /// byte of a next request on a kept-alive connection); then the connection is closed.
    #[arg(long, env = "PROFILER_HTTP_HEADER_TIMEOUT",
          default_value = DEFAULT_HEADER_TIMEOUT_TEXT.as_str(), value_parser = parse_age)]
    pub http_header_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request before it is closed.
    #[arg(long, env = "PROFILER_HTTP_IDLE_TIMEOUT",
          default_value = DEFAULT_IDLE_TIMEOUT_TEXT.as_str(), value_parser = parse_age)]
    pub http_idle_timeout: Duration,
    /// Longest time one query may take (waiting for a turn included); beyond it the client gets
    /// a 503 and profiler_http_query_timeouts_total counts it.
    #[arg(long, env = "PROFILER_QUERY_TIMEOUT",
          default_value = DEFAULT_QUERY_TIMEOUT_TEXT.as_str(), value_parser = parse_age)]
    pub query_timeout: Duration,
    #[command(flatten)]
    pub store_limits: StoreLimitArgs,
}

/// Settings of the store and server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    pub server: ServerConfig,
    /// `None` with `--store off`.
    pub store: Option<StoreSettings>,
    /// The store's limits and its integrity check at open.
    pub store_options: StoreOptions,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            server: ServerConfig::new(DEFAULT_LISTEN.parse().expect("valid default address")),
            store: Some(StoreSettings::new(DEFAULT_DATA_DIR)),
            store_options: StoreOptions::default(),
        }
    }
}

impl From<ServerArgs> for ServeConfig {
    fn from(args: ServerArgs) -> Self {
        args.into_config(Switch::On)
    }
}

impl ServerArgs {
    /// The settings, with `store_default` when --store was not given.
    pub fn into_config(self, store_default: Switch) -> ServeConfig {
        ServeConfig {
            server: ServerConfig {
                listen: self.listen,
                auth_token: self.auth_token.filter(|t| !t.is_empty()),
                auth_metrics: self.auth_metrics,
                insecure_listen: self.insecure_listen,
                max_body_bytes: self.max_body_size.min(usize::MAX as u64) as usize,
                connections: ConnectionLimits {
                    max_connections: self.max_connections.min(usize::MAX as u64) as usize,
                    header_timeout: self.http_header_timeout,
                    idle_timeout: self.http_idle_timeout,
                },
                query_timeout: self.query_timeout,
            },
            store: (self.store.unwrap_or(store_default) == Switch::On).then_some(StoreSettings {
                data_dir: self.data_dir,
                retention: self.retention,
                max_bytes: self.max_store_size,
                maintenance_interval: self.maintenance_interval,
            }),
            store_options: StoreOptions {
                limits: self.store_limits.limits(),
                integrity_check: !self.store_limits.no_store_check,
                ..StoreOptions::default()
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Server(#[from] ServerError),
}

/// The store (when on) and the running server.
pub struct Serving {
    pub store: Option<Store>,
    pub health: Arc<HealthBoard>,
    server: Server,
}

impl Serving {
    pub fn start(config: &ServeConfig) -> Result<Serving, ServeError> {
        // Refuse an unprotected address before touching the disk.
        config.server.check()?;
        let store = config
            .store
            .clone()
            .map(|settings| Store::open_with(settings, config.store_options.clone()))
            .transpose()?;
        if let Some(store) = &store {
            // Enforce limits once at start (a lowered cap applies at once), then periodically.
            if let Err(err) = store.enforce_limits() {
                tracing::warn!("{err}");
            }
            store.spawn_maintenance(store.settings().maintenance_interval);
        }
        let health = Arc::new(HealthBoard::default());
        let server = Server::start(AppState {
            store: store.clone(),
            health: health.clone(),
            config: Arc::new(config.server.clone()),
        })?;
        Ok(Serving {
            store,
            health,
            server,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn shutdown(self) {
        self.server.shutdown();
    }
}

/// `profiler server`: the store and the HTTP server without sampling, until `stop`.
pub fn run_server(config: &ServeConfig, stop: &AtomicBool) -> Result<(), ServeError> {
    let budget = crate::process::files::FdBudget::at_start(
        config.server.connections.max_connections,
        0,
        super::listen::PROBE_RESERVE,
    );
    let mut config = config.clone();
    config.server.connections.max_connections = budget.connections;
    let serving = Serving::start(&config)?;
    // Nothing to attach: ready as soon as it listens.
    serving.health.set_ready(true);
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    serving.health.set_ready(false);
    tracing::info!("stopping the server");
    serving.shutdown();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_defaults_are_the_store_and_server_constants() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            server: ServerArgs,
        }
        let config = Cli::try_parse_from(["profiler"])
            .unwrap()
            .server
            .into_config(Switch::On);
        let store = config.store.unwrap();
        assert_eq!(store, StoreSettings::new(DEFAULT_DATA_DIR));
        assert_eq!(store.retention, Duration::from_secs(7 * 86_400));
        assert_eq!(config.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        // What --help shows (docs/configuration.md lists the same; tests/tests/deploy.rs checks).
        assert_eq!(DEFAULT_RETENTION_TEXT.as_str(), "7d");
        assert_eq!(DEFAULT_MAX_STORE_TEXT.as_str(), "10GiB");
        assert_eq!(DEFAULT_MAINTENANCE_TEXT.as_str(), "1m");
        assert_eq!(DEFAULT_MAX_BODY_TEXT.as_str(), "16MiB");
        assert_eq!(DEFAULT_MAX_CONNECTIONS_TEXT.as_str(), "1024");
        assert_eq!(DEFAULT_HEADER_TIMEOUT_TEXT.as_str(), "10s");
        assert_eq!(DEFAULT_IDLE_TIMEOUT_TEXT.as_str(), "1m");
        assert_eq!(DEFAULT_QUERY_TIMEOUT_TEXT.as_str(), "30s");
        assert_eq!(config.server.connections, ConnectionLimits::default());
        assert_eq!(config.server.query_timeout, DEFAULT_QUERY_TIMEOUT);
    }

    #[test]
    fn formatted_ages_and_sizes_parse_back() {
        for seconds in [1, 59, 60, 90, 3600, 86_400, 7 * 86_400, 10 * 86_400 + 1] {
            let age = Duration::from_secs(seconds);
            assert_eq!(parse_age(&format_age(age)), Ok(age), "{seconds}");
        }
        for bytes in [
            1,
            1000,
            1024,
            16 << 20,
            10 << 30,
            (1 << 40) * 3,
            1_000_000_007,
        ] {
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes), "{bytes}");
        }
        assert_eq!(format_age(Duration::from_secs(5400)), "90m");
        assert_eq!(format_size(1536), "1536B");
    }

    #[test]
    fn ages_and_sizes_parse_with_units() {
        assert_eq!(parse_age("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_age("90m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_age("3600"), Ok(Duration::from_secs(3600)));
        assert!(parse_age("0d").is_err());
        assert!(parse_age("soon").unwrap_err().contains("not a"));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("1 GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").unwrap_err().contains("not a size"));
        assert!(
            parse_size("99999999999TiB")
                .unwrap_err()
                .contains("too large")
        );
    }
}
