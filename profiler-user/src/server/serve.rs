//! The server's command-line flags, its settings, and starting the store plus the server
//! together (`profiler agent` by default, `profiler server` alone).
use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use clap::{Args, ValueEnum};

use super::{AppState, DEFAULT_LISTEN, HealthBoard, Server, ServerConfig, ServerError};
use crate::store::{DEFAULT_DATA_DIR, Store, StoreError, StoreSettings};

/// How often retention and the size cap are enforced.
const MAINTENANCE_EVERY: Duration = Duration::from_secs(60);

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
    #[arg(long, env = "PROFILER_RETENTION", default_value = "7d", value_parser = parse_age)]
    pub retention: Duration,
    /// Size cap of the embedded store; the oldest profiles are deleted beyond it (e.g. 10GiB, 500MiB).
    #[arg(long, env = "PROFILER_MAX_STORE_SIZE", default_value = "10GiB", value_parser = parse_size)]
    pub max_store_size: u64,
    /// Bearer token required on every HTTP route except /metrics.
    #[arg(long, env = "PROFILER_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// Allow --listen on a non-loopback address without --auth-token.
    #[arg(long, env = "PROFILER_INSECURE_LISTEN")]
    pub insecure_listen: bool,
    /// Largest accepted request body, also after decompression (e.g. 16MiB).
    #[arg(long, env = "PROFILER_MAX_BODY_SIZE", default_value = "16MiB", value_parser = parse_size)]
    pub max_body_size: u64,
}

/// Settings of the store and server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    pub server: ServerConfig,
    /// `None` with `--store off`.
    pub store: Option<StoreSettings>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            server: ServerConfig::new(DEFAULT_LISTEN.parse().expect("valid default address")),
            store: Some(StoreSettings::new(DEFAULT_DATA_DIR)),
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
                insecure_listen: self.insecure_listen,
                max_body_bytes: self.max_body_size.min(usize::MAX as u64) as usize,
            },
            store: (self.store.unwrap_or(store_default) == Switch::On).then_some(StoreSettings {
                data_dir: self.data_dir,
                retention: self.retention,
                max_bytes: self.max_store_size,
            }),
        }
    }
}

/// `7d`, `12h`, `90m`, `30s` or plain seconds.
pub(crate) fn parse_age(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(pos) => text.split_at(pos),
        None => (text, "s"),
    };
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => {
            return Err(format!(
                "'{text}' is not a duration (e.g. 7d, 12h, 90m, 3600s)"
            ));
        }
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Duration::from_secs(n.saturating_mul(seconds))),
        _ => Err(format!(
            "'{text}' is not a positive duration (e.g. 7d, 12h, 90m, 3600s)"
        )),
    }
}

/// `10GiB`, `500MiB`, `64KiB`, `1GB`, or plain bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(pos) => text.split_at(pos),
        None => (text, ""),
    };
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "'{text}' is not a size (e.g. 10GiB, 500MiB, 16MiB)"
            ));
        }
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 => n
            .checked_mul(factor)
            .ok_or_else(|| format!("'{text}' is too large")),
        _ => Err(format!(
            "'{text}' is not a positive size (e.g. 10GiB, 500MiB)"
        )),
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
        let store = config.store.clone().map(Store::open).transpose()?;
        if let Some(store) = &store {
            // Enforce limits once at start (a lowered cap applies at once), then periodically.
            if let Err(err) = store.enforce_limits() {
                tracing::warn!("{err}");
            }
            store.spawn_maintenance(MAINTENANCE_EVERY);
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
    let serving = Serving::start(config)?;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    tracing::info!("stopping the server");
    serving.shutdown();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
