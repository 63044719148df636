//! Cardinality and size limits checked at ingest, in the spirit of Pyroscope's own per-tenant
//! limits (`max_global_series_per_tenant`, `max_label_names_per_series`,
//! `max_label_name_length`, `max_label_value_length`, `max_profile_stacktrace_depth`).
//!
//! Limits on *new* series (services, series, label values) are checked before the write touches
//! anything: a push over one is refused as a whole (HTTP 429, like Pyroscope's series limit) and
//! everything stored before stays. Label counts and lengths are malformed input (HTTP 400).
//! Stacks deeper than [`StoreLimits::max_stack_depth`] are not refused but cut at the root
//! side, under a `[truncated]` frame, as Pyroscope truncates them.
use std::sync::atomic::{AtomicU64, Ordering};

/// Default of `--max-services`: distinct `service_name` values in the store.
pub const DEFAULT_MAX_SERVICES: usize = 1_000;
/// Default of `--max-series`: series in the whole store (each costs ~3 KB of memory).
pub const DEFAULT_MAX_SERIES: usize = 100_000;
/// Default of `--max-series-per-service`.
pub const DEFAULT_MAX_SERIES_PER_SERVICE: usize = 10_000;
/// Default of `--max-label-values-per-name`: distinct values of one label name in one service.
pub const DEFAULT_MAX_LABEL_VALUES_PER_NAME: usize = 5_000;
/// Default of `--max-label-names-per-series` (Pyroscope: 30), not counting derived `__*__`.
pub const DEFAULT_MAX_LABEL_NAMES_PER_SERIES: usize = 30;
/// Default of `--max-label-name-length` (Pyroscope: 1024).
pub const DEFAULT_MAX_LABEL_NAME_LENGTH: usize = 1024;
/// Default of `--max-label-value-length` (Pyroscope: 2048).
pub const DEFAULT_MAX_LABEL_VALUE_LENGTH: usize = 2048;
/// Default of `--max-stack-depth` (Pyroscope: 1000).
pub const DEFAULT_MAX_STACK_DEPTH: usize = 1_000;
/// Default of `--max-query-nodes`: call-tree nodes one merge may read (20-80 bytes each while it
/// runs, so at most about 160 MiB at the limit; a busy service's day is tens of thousands).
pub const DEFAULT_MAX_QUERY_NODES: usize = 2_000_000;
/// Default of `--max-catalog-nodes`: call-tree nodes kept in memory to find a stack's node at
/// ingest, all services together (about 14 bytes each with their index, so about 1 MiB).
/// Past it the largest service's tree that has doubled since its first minute is sealed: kept
/// on disk for queries, started afresh in memory; past four times it, the largest trees whether
/// or not they doubled. A whole busy host adds about 450 nodes a second (stripped compilers
/// mostly).
pub const DEFAULT_MAX_CATALOG_NODES: usize = 65_536;
/// Default of `--max-catalog-frames`: frames, and strings, kept in memory to find a frame's id
/// at ingest (a frame about 50 bytes with its index, a string about 100 with its text, so
/// about 2.5 MiB at the bound). Past it the generation is sealed, with the call trees in
/// memory: kept on disk for queries, started afresh in memory. A whole busy host adds about 60
/// frames and 20 strings a second, so a generation lasts a few minutes there; 65,536 took a
/// quarter of an hour to fill, the agent's memory growing by about 1 MiB a minute all that
/// time (docs/benchmarks.md, suite `host`).
pub const DEFAULT_MAX_CATALOG_FRAMES: usize = 16_384;

/// The frame that replaces the root-side frames of a stack cut at `max_stack_depth`.
pub const TRUNCATED_FRAME: &str = "[truncated]";

/// The limits of one store. `0` disables a limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    pub max_services: usize,
    pub max_series: usize,
    pub max_series_per_service: usize,
    pub max_label_values_per_name: usize,
    pub max_label_names_per_series: usize,
    pub max_label_name_length: usize,
    pub max_label_value_length: usize,
    pub max_stack_depth: usize,
    pub max_query_nodes: usize,
    pub max_catalog_nodes: usize,
    pub max_catalog_frames: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_services: DEFAULT_MAX_SERVICES,
            max_series: DEFAULT_MAX_SERIES,
            max_series_per_service: DEFAULT_MAX_SERIES_PER_SERVICE,
            max_label_values_per_name: DEFAULT_MAX_LABEL_VALUES_PER_NAME,
            max_label_names_per_series: DEFAULT_MAX_LABEL_NAMES_PER_SERIES,
            max_label_name_length: DEFAULT_MAX_LABEL_NAME_LENGTH,
            max_label_value_length: DEFAULT_MAX_LABEL_VALUE_LENGTH,
            max_stack_depth: DEFAULT_MAX_STACK_DEPTH,
            max_query_nodes: DEFAULT_MAX_QUERY_NODES,
            max_catalog_nodes: DEFAULT_MAX_CATALOG_NODES,
            max_catalog_frames: DEFAULT_MAX_CATALOG_FRAMES,
        }
    }
}

/// `limit` with 0 meaning "no limit".
pub(crate) fn exceeds(count: usize, limit: usize) -> bool {
    limit != 0 && count > limit
}

/// Flags of the store's limits, to be flattened into the server's flags.
#[derive(Clone, Debug, clap::Args)]
pub struct StoreLimitArgs {
    /// Most distinct services (`service_name`) in the embedded store; a push adding one more is
    /// refused with 429. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_SERVICES", default_value_t = DEFAULT_MAX_SERVICES)]
    pub max_services: usize,
    /// Most series in the embedded store; a push adding one more is refused with 429. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_SERIES", default_value_t = DEFAULT_MAX_SERIES)]
    pub max_series: usize,
    /// Most series of one service; a push adding one more is refused with 429. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_SERIES_PER_SERVICE",
          default_value_t = DEFAULT_MAX_SERIES_PER_SERVICE)]
    pub max_series_per_service: usize,
    /// Most distinct values of one label name within one service; a push adding one more is
    /// refused with 429. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_LABEL_VALUES_PER_NAME",
          default_value_t = DEFAULT_MAX_LABEL_VALUES_PER_NAME)]
    pub max_label_values_per_name: usize,
    /// Most labels of one series (derived `__name__`-style labels not counted); more is refused
    /// with 400. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_LABEL_NAMES_PER_SERIES",
          default_value_t = DEFAULT_MAX_LABEL_NAMES_PER_SERIES)]
    pub max_label_names_per_series: usize,
    /// Longest label name in bytes; longer is refused with 400. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_LABEL_NAME_LENGTH",
          default_value_t = DEFAULT_MAX_LABEL_NAME_LENGTH)]
    pub max_label_name_length: usize,
    /// Longest label value in bytes; longer is refused with 400. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_LABEL_VALUE_LENGTH",
          default_value_t = DEFAULT_MAX_LABEL_VALUE_LENGTH)]
    pub max_label_value_length: usize,
    /// Deepest stored stack in frames; deeper stacks keep their leaf-side frames under a
    /// `[truncated]` frame. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_STACK_DEPTH", default_value_t = DEFAULT_MAX_STACK_DEPTH)]
    pub max_stack_depth: usize,
    /// Most call-tree nodes one query may merge (the distinct call paths of the services it
    /// selects); a bigger query is refused with 400 before it allocates anything, so a store
    /// filled with distinct stacks cannot make one query take the server's memory. 0: no limit.
    #[arg(long, env = "PROFILER_MAX_QUERY_NODES", default_value_t = DEFAULT_MAX_QUERY_NODES)]
    pub max_query_nodes: usize,
    /// Call-tree nodes kept in memory for ingest, all services together (about 14 bytes each).
    /// Past it the largest service's call tree that has at least doubled since its first minute
    /// is sealed: it stays on disk, where queries read it, and stacks seen again get new nodes.
    /// Trees that have not doubled stay (their services keep using them), so the services'
    /// trees in use can exceed it, up to four times it: past that the largest are sealed anyway.
    /// 0: no limit (memory grows with every distinct stack kept).
    #[arg(long, env = "PROFILER_MAX_CATALOG_NODES", default_value_t = DEFAULT_MAX_CATALOG_NODES)]
    pub max_catalog_nodes: usize,
    /// Frames kept in memory for ingest, and as many strings (function and file names,
    /// objects, build ids). Past it, after a write, the frames and the strings are sealed, and
    /// the call trees in memory with them: they stay on disk, where queries read them, and a
    /// frame, string or node seen again gets a new id; flame graphs merge by name, so queries
    /// answer the same. 0: no limit (memory grows with every distinct frame kept: a whole busy
    /// host adds about 60 a second).
    #[arg(long, env = "PROFILER_MAX_CATALOG_FRAMES", default_value_t = DEFAULT_MAX_CATALOG_FRAMES)]
    pub max_catalog_frames: usize,
    /// Skip the integrity check (`PRAGMA quick_check`) of the store when it opens. The check
    /// reads the whole file (about a second per GiB); a corrupt store is moved aside either way
    /// when opening it fails.
    #[arg(long, env = "PROFILER_NO_STORE_CHECK")]
    pub no_store_check: bool,
}

impl StoreLimitArgs {
    pub fn limits(&self) -> StoreLimits {
        StoreLimits {
            max_services: self.max_services,
            max_series: self.max_series,
            max_series_per_service: self.max_series_per_service,
            max_label_values_per_name: self.max_label_values_per_name,
            max_label_names_per_series: self.max_label_names_per_series,
            max_label_name_length: self.max_label_name_length,
            max_label_value_length: self.max_label_value_length,
            max_stack_depth: self.max_stack_depth,
            max_query_nodes: self.max_query_nodes,
            max_catalog_nodes: self.max_catalog_nodes,
            max_catalog_frames: self.max_catalog_frames,
        }
    }
}

/// Which limit refused a push: the `limit` label of `profiler_store_limit_rejections_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Services,
    Series,
    SeriesPerService,
    LabelValuesPerName,
    LabelNamesPerSeries,
    LabelNameLength,
    LabelValueLength,
}

impl Limit {
    pub const ALL: [Limit; 7] = [
        Limit::Services,
        Limit::Series,
        Limit::SeriesPerService,
        Limit::LabelValuesPerName,
        Limit::LabelNamesPerSeries,
        Limit::LabelNameLength,
        Limit::LabelValueLength,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Limit::Services => "max_services",
            Limit::Series => "max_series",
            Limit::SeriesPerService => "max_series_per_service",
            Limit::LabelValuesPerName => "max_label_values_per_name",
            Limit::LabelNamesPerSeries => "max_label_names_per_series",
            Limit::LabelNameLength => "max_label_name_length",
            Limit::LabelValueLength => "max_label_value_length",
        }
    }

    /// Cardinality limits: the push is well-formed but the store is full of series (429).
    pub fn is_cardinality(self) -> bool {
        matches!(
            self,
            Limit::Services | Limit::Series | Limit::SeriesPerService | Limit::LabelValuesPerName
        )
    }
}

/// A push over a limit. Display is one line naming the limit and its flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error(
        "service limit reached: the store holds {limit} services (--max-services), `{service}` would be one more"
    )]
    Services { limit: usize, service: String },
    #[error("series limit reached: the store holds {limit} series (--max-series)")]
    Series { limit: usize },
    #[error(
        "series limit reached for service `{service}`: {limit} series (--max-series-per-service)"
    )]
    SeriesPerService { limit: usize, service: String },
    #[error(
        "label `{name}` of service `{service}` has {limit} distinct values already (--max-label-values-per-name)"
    )]
    LabelValuesPerName {
        limit: usize,
        service: String,
        name: String,
    },
    #[error("a series has {count} labels, at most {limit} (--max-label-names-per-series)")]
    LabelNamesPerSeries { limit: usize, count: usize },
    #[error("label name `{name}` is longer than {limit} bytes (--max-label-name-length)")]
    LabelNameLength { limit: usize, name: String },
    #[error("the value of label `{name}` is longer than {limit} bytes (--max-label-value-length)")]
    LabelValueLength { limit: usize, name: String },
}

impl LimitError {
    pub fn limit(&self) -> Limit {
        match self {
            LimitError::Services { .. } => Limit::Services,
            LimitError::Series { .. } => Limit::Series,
            LimitError::SeriesPerService { .. } => Limit::SeriesPerService,
            LimitError::LabelValuesPerName { .. } => Limit::LabelValuesPerName,
            LimitError::LabelNamesPerSeries { .. } => Limit::LabelNamesPerSeries,
            LimitError::LabelNameLength { .. } => Limit::LabelNameLength,
            LimitError::LabelValueLength { .. } => Limit::LabelValueLength,
        }
    }
}

/// Shortens client text quoted in an error message.
pub(crate) fn quote(text: &str) -> String {
    let mut end = text.len().min(64);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].escape_debug().to_string()
}

/// Rejections per limit.
#[derive(Debug, Default)]
pub struct LimitCounters([AtomicU64; Limit::ALL.len()]);

impl LimitCounters {
    pub(crate) fn count(&self, limit: Limit) {
        self.0[limit as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Pushes refused by `limit` since the store opened.
    pub fn get(&self, limit: Limit) -> u64 {
        self.0[limit as usize].load(Ordering::Relaxed)
    }

    /// (limit name, rejections) of every limit, for /metrics.
    pub fn all(&self) -> Vec<(&'static str, u64)> {
        Limit::ALL
            .iter()
            .map(|&l| (l.name(), self.get(l)))
            .collect()
    }
}

/// Checks the labels of one profile (as given, without the derived `__*__` labels).
pub(crate) fn check_labels(
    limits: &StoreLimits,
    labels: &[(String, String)],
) -> Result<(), LimitError> {
    let count = labels
        .iter()
        .filter(|(k, _)| !k.starts_with("__") || k == "__session_id__")
        .count();
    if exceeds(count, limits.max_label_names_per_series) {
        return Err(LimitError::LabelNamesPerSeries {
            limit: limits.max_label_names_per_series,
            count,
        });
    }
    for (name, value) in labels {
        if exceeds(name.len(), limits.max_label_name_length) {
            return Err(LimitError::LabelNameLength {
                limit: limits.max_label_name_length,
                name: quote(name),
            });
        }
        if exceeds(value.len(), limits.max_label_value_length) {
            return Err(LimitError::LabelValueLength {
                limit: limits.max_label_value_length,
                name: quote(name),
            });
        }
    }
    Ok(())
}
