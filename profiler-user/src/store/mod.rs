//! The embedded profile store: profiles per series on local disk, queried by the HTTP server.
//!
//! Engine: SQLite (bundled, WAL journal) in `<data dir>/profiles.db`; docs/architecture.md says
//! why. Layout, designed so a 24-hour merge reads little and adds fast:
//! - a *stack space* per (profile type, service_name) interns call stacks as a tree of nodes
//!   (parent node, frame); node 0 is the root, parents always have smaller ids. A frame is a
//!   function name with its file, line, object file, build id and address ([`frames`]),
//!   shared by all spaces; queries merge sibling frames of one name;
//! - a *series* is one label set (incl. `service_name` and the derived `__profile_type__`
//!   labels) in one stack space;
//! - a stored *profile* is its series, time, total and a compact blob of (node, self value)
//!   pairs ([`codec`]). Merging = adding blobs into one dense vector per space, then one pass
//!   to sum children into parents.
//!
//! The catalog (names, spaces with their node trees, series) is also held in memory. Writers are
//! serialized; a write first extends the in-memory catalog, then commits the rows in one
//! transaction, and undoes the in-memory part if the commit fails. Readers use their own
//! connections and see only committed profiles, whose nodes are always already in memory.
pub mod codec;
pub mod frames;
mod id_index;
pub mod ingest;
pub mod limits;
pub mod query;
pub mod selector;
pub mod sink;

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use foldhash::{HashMap, HashMapExt};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, config::DbConfig, params};

use frames::Frame;
use id_index::IdIndex;

pub use limits::{Limit, LimitCounters, LimitError, StoreLimits};

/// Default directory of the embedded store.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/profiler";
/// Default retention of stored profiles.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);
/// Default cap on the store's size on disk.
pub const DEFAULT_MAX_BYTES: u64 = 10 << 30;
/// Default period of enforcing the retention and the size cap.
pub const DEFAULT_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(60);
/// Default of [`StoreOptions::settle_age`]: four agent intervals.
pub const DEFAULT_SETTLE_AGE: Duration = Duration::from_secs(60);
const DATABASE_FILE: &str = "profiles.db";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the profile store in {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: Box<StoreError>,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("profile store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error(transparent)]
    Corrupt(#[from] codec::CorruptProfile),
    #[error("profile store integrity check failed: {0}")]
    Integrity(String),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("negative sample value {value}: sample values must be zero or positive")]
    NegativeValue { value: i64 },
    #[error(
        "invalid profile type `{0}`: expected name:sample_type:sample_unit:period_type:period_unit"
    )]
    InvalidProfileType(String),
    #[error(
        "query too large: it would merge {nodes} call-tree nodes, over the limit of {limit} (--max-query-nodes); select fewer services"
    )]
    QueryTooLarge { nodes: usize, limit: usize },
    #[error("setting `{name}` was changed at {stored_ms} ms, after this change ({modified_ms} ms)")]
    SettingOutdated {
        name: String,
        stored_ms: i64,
        modified_ms: i64,
    },
    #[error(
        "a setting needs a name of at most {MAX_SETTING_NAME} bytes and a value of at most {MAX_SETTING_VALUE}"
    )]
    InvalidSetting,
}

/// Bounds of one setting (Grafana's apps store small JSON documents).
pub const MAX_SETTING_NAME: usize = 256;
pub const MAX_SETTING_VALUE: usize = 64 * 1024;
/// Settings kept at most; a new name beyond is refused.
pub const MAX_SETTINGS: i64 = 1024;

/// A setting as Pyroscope's `settings.v1` API has it: name, value, and the client's time of the
/// change in milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub name: String,
    pub value: String,
    pub modified_ms: i64,
}

impl StoreError {
    fn sqlite_code(&self) -> Option<ErrorCode> {
        match self {
            StoreError::Sqlite(err) => err.sqlite_error_code(),
            StoreError::Open { source, .. } => source.sqlite_code(),
            _ => None,
        }
    }

    /// The database file is damaged or not a database: it must be moved aside.
    pub fn is_corruption(&self) -> bool {
        match self {
            StoreError::Corrupt(_) | StoreError::Integrity(_) => true,
            StoreError::Open { source, .. } => source.is_corruption(),
            _ => matches!(
                self.sqlite_code(),
                Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
            ),
        }
    }

    /// The disk (or the file system's quota) is full.
    pub fn is_disk_full(&self) -> bool {
        self.sqlite_code() == Some(ErrorCode::DiskFull)
    }

    /// The client's input is at fault (HTTP 4xx), not the store.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            StoreError::InvalidProfileType(_)
                | StoreError::Limit(_)
                | StoreError::NegativeValue { .. }
                | StoreError::QueryTooLarge { .. }
                | StoreError::SettingOutdated { .. }
                | StoreError::InvalidSetting
        )
    }
}

/// How the store opens and what it accepts, beyond [`StoreSettings`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    pub limits: StoreLimits,
    /// Run `PRAGMA quick_check` when opening (about a second per GiB).
    pub integrity_check: bool,
    /// How long a service's call-tree generation lives before its size is taken as what the
    /// service keeps using ([`StoreLimits::max_catalog_nodes`]).
    pub settle_age: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            limits: StoreLimits::default(),
            integrity_check: true,
            settle_age: DEFAULT_SETTLE_AGE,
        }
    }
}

/// Where and how much the store keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSettings {
    pub data_dir: PathBuf,
    /// Profiles older than this are deleted.
    pub retention: Duration,
    /// Beyond this many bytes of data the oldest profiles are deleted.
    pub max_bytes: u64,
    /// How often the retention and the size cap are enforced while running.
    pub maintenance_interval: Duration,
}

impl StoreSettings {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        StoreSettings {
            data_dir: data_dir.into(),
            retention: DEFAULT_RETENTION,
            max_bytes: DEFAULT_MAX_BYTES,
            maintenance_interval: DEFAULT_MAINTENANCE_INTERVAL,
        }
    }
}

/// A Pyroscope profile type: `name:sample_type:sample_unit:period_type:period_unit`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProfileType {
    pub name: String,
    pub sample_type: String,
    pub sample_unit: String,
    pub period_type: String,
    pub period_unit: String,
}

impl ProfileType {
    pub fn id(&self) -> String {
        format!(
            "{}:{}:{}:{}:{}",
            self.name, self.sample_type, self.sample_unit, self.period_type, self.period_unit
        )
    }

    /// Parses an ID; a sixth `:delta` part is tolerated, as Pyroscope does.
    pub fn parse(id: &str) -> Result<ProfileType, StoreError> {
        let parts: Vec<&str> = id.split(':').collect();
        match parts.as_slice() {
            [name, sample_type, sample_unit, period_type, period_unit]
            | [
                name,
                sample_type,
                sample_unit,
                period_type,
                period_unit,
                "delta",
            ] if !name.is_empty() && !sample_type.is_empty() => Ok(ProfileType {
                name: name.to_string(),
                sample_type: sample_type.to_string(),
                sample_unit: sample_unit.to_string(),
                period_type: period_type.to_string(),
                period_unit: period_unit.to_string(),
            }),
            _ => Err(StoreError::InvalidProfileType(id.to_owned())),
        }
    }
}

/// One profile to store: stacks as paths of indexes into `frames`, root first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewProfile {
    pub profile_type: Option<ProfileType>,
    /// Series labels without the derived `__*` ones; `service_name` is added when missing.
    pub labels: Vec<(String, String)>,
    pub time_ns: i64,
    pub duration_ns: i64,
    /// The sampling period (pprof `period`, in the period type's unit); 0 when unknown.
    pub period: i64,
    /// The strings of `frames`.
    pub names: Vec<String>,
    /// The frames of the stacks. Empty when every frame is a bare name (folded text): then
    /// stack paths are indexes into `names`.
    pub frames: Vec<Frame>,
    pub stacks: Vec<(Vec<u32>, i64)>,
    /// The samples that named a span (a `span_id` sample label), per span. They are among
    /// `stacks` too: a span query reads these, every other query the stacks.
    pub spans: Vec<NewSpan>,
    /// The samples with numeric labels (the agent's `pid` and `tid`), per distinct set of them.
    /// They are among `stacks` too: only downloads read these.
    pub labelled: Vec<NewLabelled>,
}

/// The samples of a [`NewProfile`] with one set of numeric labels, sorted by key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewLabelled {
    pub labels: Vec<(String, i64)>,
    pub stacks: Vec<(Vec<u32>, i64)>,
}

/// The samples of one span in a [`NewProfile`], as Pyroscope keeps them per sample rather
/// than as series labels (a label per request would make a series per request).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewSpan {
    pub span_id: u64,
    pub trace_id: String,
    pub span_name: String,
    pub stacks: Vec<(Vec<u32>, i64)>,
}

impl NewProfile {
    pub fn total(&self) -> i64 {
        self.stacks
            .iter()
            .fold(0i64, |sum, (_, v)| sum.saturating_add(*v))
    }
}

/// A series as queries see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeriesInfo {
    pub id: i64,
    pub space: i64,
    pub profile_type: String,
    /// All labels, incl. `__name__`, `__profile_type__`, `service_name`..., sorted by name.
    pub labels: Vec<(String, String)>,
    /// Oldest and newest stored profile time; `first > last` while the series is empty.
    pub first_ns: i64,
    pub last_ns: i64,
}

/// Counters for /metrics and the health endpoint.
#[derive(Debug, Default)]
pub struct StoreCounters {
    pub profiles_ingested: AtomicU64,
    pub ingest_errors: AtomicU64,
    pub profiles_evicted: AtomicU64,
    /// Pushes refused per limit (`profiler_store_limit_rejections_total{limit}`).
    pub limit_rejections: LimitCounters,
    /// Stacks cut at `max_stack_depth`.
    pub stacks_truncated: AtomicU64,
    /// Pushes refused for a negative sample value.
    pub negative_values_rejected: AtomicU64,
    /// Corrupt databases moved aside at open.
    pub databases_quarantined: AtomicU64,
    /// Operations that failed on a corrupt database while running.
    pub corruption_errors: AtomicU64,
    /// Writes that failed because the disk was full.
    pub disk_full_errors: AtomicU64,
    /// Queries refused at --max-query-nodes.
    pub queries_too_large: AtomicU64,
    /// Call trees sealed at --max-catalog-nodes, or with the frames at --max-catalog-frames
    /// (see `Space::seal`).
    pub node_trees_sealed: AtomicU64,
    /// Of those, trees sealed at four times the bound without having doubled: trees in steady use,
    /// whose nodes the next writes store again (a bound too small for the host's services).
    pub node_trees_sealed_in_use: AtomicU64,
    /// Generations of frames and of names sealed at --max-catalog-frames (the two end together).
    pub frame_generations_sealed: AtomicU64,
}

impl StoreCounters {
    /// `(name, help, kind, value)` of the store's limit and failure counters for /metrics, in
    /// the shape of the server's own metrics (one line each, `limit` as a label where needed).
    pub fn metric_values(&self) -> Vec<(String, &'static str, &'static str, f64)> {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed) as f64;
        let mut out: Vec<(String, &'static str, &'static str, f64)> = self
            .limit_rejections
            .all()
            .into_iter()
            .map(|(limit, value)| {
                (
                    format!("profiler_store_limit_rejections_total{{limit=\"{limit}\"}}"),
                    "Writes refused by a store limit (--max-services, --max-series...).",
                    "counter",
                    value as f64,
                )
            })
            .collect();
        for (name, help, value) in [
            (
                "profiler_store_stacks_truncated_total",
                "Stacks cut at --max-stack-depth.",
                load(&self.stacks_truncated),
            ),
            (
                "profiler_store_queries_too_large_total",
                "Queries refused because they would merge more call-tree nodes than --max-query-nodes.",
                load(&self.queries_too_large),
            ),
            (
                "profiler_store_node_trees_sealed_total",
                "Services' in-memory call trees sealed (left on disk for queries) at --max-catalog-nodes, or with the frames at --max-catalog-frames.",
                load(&self.node_trees_sealed),
            ),
            (
                "profiler_store_node_trees_sealed_in_use_total",
                "Of those, trees sealed at four times --max-catalog-nodes without having doubled: trees in steady use, whose nodes the next writes store again (raise the bound when it keeps growing).",
                load(&self.node_trees_sealed_in_use),
            ),
            (
                "profiler_store_frame_generations_sealed_total",
                "Generations of the store's in-memory frames and names sealed (left on disk for queries) at --max-catalog-frames; the two end together.",
                load(&self.frame_generations_sealed),
            ),
            (
                "profiler_store_negative_values_rejected_total",
                "Writes refused for a negative sample value.",
                load(&self.negative_values_rejected),
            ),
            (
                "profiler_store_databases_quarantined_total",
                "Corrupt store databases moved aside at open.",
                load(&self.databases_quarantined),
            ),
            (
                "profiler_store_corruption_errors_total",
                "Store operations that failed on a corrupt database.",
                load(&self.corruption_errors),
            ),
            (
                "profiler_store_disk_full_errors_total",
                "Store writes that failed because the disk was full.",
                load(&self.disk_full_errors),
            ),
        ] {
            out.push((name.to_owned(), help, "counter", value));
        }
        out
    }
}

/// One service's call tree for the profiles of one name (`process_cpu`, `off_cpu`, ...): the
/// sample types of a profile (`samples:count` and `cpu:nanoseconds`) have the same stacks, so
/// they share it, each series keeping its own values per node. Stores written before kept one
/// tree per sample type; those stay as they are, each used by its own series.
#[derive(Debug)]
struct Space {
    /// The type id of the profile that made the space (the `spaces` row), whose name is its key.
    profile_type: String,
    service_name: String,
    /// Nodes `1..=sealed` belong to earlier generations of this space's call tree: they are on
    /// disk only, where queries read them ([`read_sealed_nodes`]), and ingest no longer finds
    /// them (a stack seen again gets new nodes). Bounds the memory of a space that keeps
    /// seeing new stacks ([`StoreLimits::max_catalog_nodes`]).
    sealed: u32,
    /// The current generation: `(parent, frame id)` per node, parents as node ids; position 0
    /// is the root (node 0), position `p ≥ 1` is node `sealed + p`.
    nodes: Vec<(u32, u32)>,
    /// The current generation's nodes (but the root) by (parent, frame id), as positions.
    index: IdIndex,
    /// When the current generation began: the space's creation, its last seal, the store's open.
    generation_started: Instant,
    /// The current generation's node count once it had lived [`StoreOptions::settle_age`]:
    /// about the stacks the service keeps sending. A generation is sealed only once it holds
    /// twice that (see [`Catalog::seal_over`]).
    settled_nodes: Option<usize>,
    /// A whole stack's hash (frame ids, root first) → its leaf node: an agent sends mostly the
    /// same stacks every interval, so one lookup and a walk up the leaf's parents (which checks
    /// it is that stack) replace a lookup per frame. Only a shortcut, keyed by hash so an entry
    /// costs about 20 bytes, not the stack: a colliding stack replaces the entry; cleared when it
    /// reaches [`MAX_CACHED_STACKS`] and whenever nodes are undone or sealed.
    leaf_by_stack: HashMap<u64, u32>,
}

/// Stacks remembered per space.
const MAX_CACHED_STACKS: usize = 8_192;

/// How far the call trees in steady use may take the nodes in memory past
/// `--max-catalog-nodes` before trees are sealed that have not doubled ([`Catalog::seal_over`]).
const HARD_BOUND_FACTOR: usize = 4;

/// The key of a space: the profile name of `type_id` (`process_cpu` of
/// `process_cpu:cpu:nanoseconds:cpu:nanoseconds`) and the service.
fn space_key(type_id: &str, service: &str) -> (String, String) {
    let name = type_id.split(':').next().unwrap_or(type_id);
    (name.to_owned(), service.to_owned())
}

/// Hashes a stack for [`Space::leaf_by_stack`]: the same stack, the same hash, within the process.
fn stack_hash(stack: &[u32]) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::default().hash_one(stack)
}

impl Space {
    fn new(profile_type: String, service_name: String) -> Space {
        Space {
            profile_type,
            service_name,
            sealed: 0,
            nodes: vec![(u32::MAX, 0)],
            index: IdIndex::default(),
            generation_started: Instant::now(),
            settled_nodes: None,
            leaf_by_stack: HashMap::new(),
        }
    }

    /// How many node ids the space has given out, sealed or not (the root included).
    fn len(&self) -> usize {
        self.sealed as usize + self.nodes.len()
    }

    /// The id of the current generation's node at `position`.
    fn node_id(&self, position: usize) -> u32 {
        if position == 0 {
            0
        } else {
            self.sealed + position as u32
        }
    }

    /// Where node `id` is in the current generation; `None` when sealed or not given out.
    fn position(&self, id: u32) -> Option<usize> {
        match id {
            0 => Some(0),
            id if id > self.sealed => {
                Some((id - self.sealed) as usize).filter(|&p| p < self.nodes.len())
            }
            _ => None,
        }
    }

    /// The nodes with ids from `first` (≥ the current generation's first) to the last.
    fn nodes_from(&self, first: usize) -> &[(u32, u32)] {
        // Sealing follows the write of a generation's last block, never precedes it.
        debug_assert!(first > self.sealed as usize, "nodes {first}.. are sealed");
        let position = first.saturating_sub(self.sealed as usize).max(1);
        self.nodes.get(position..).unwrap_or(&[])
    }

    /// The node of a root-first stack of frame ids, added (with its missing ancestors) when new.
    fn node_of(&mut self, stack: &[u32]) -> u32 {
        let hash = stack_hash(stack);
        if let Some(&leaf) = self.leaf_by_stack.get(&hash)
            && self.is_path_of(leaf, stack)
        {
            return leaf;
        }
        let mut node = 0u32;
        for &frame in stack {
            node = match self.index.find(&self.nodes, &(node, frame)) {
                Some(position) => self.node_id(position as usize),
                None => {
                    let position = self.nodes.len();
                    self.nodes.push((node, frame));
                    self.index.insert(&self.nodes, position as u32);
                    self.node_id(position)
                }
            };
        }
        if self.leaf_by_stack.len() >= MAX_CACHED_STACKS {
            self.leaf_by_stack.clear();
        }
        self.leaf_by_stack.insert(hash, node);
        node
    }

    /// Whether `node` is the node of `stack` (root first): its frames, read up its parents.
    fn is_path_of(&self, node: u32, stack: &[u32]) -> bool {
        let mut node = node;
        for &frame in stack.iter().rev() {
            match self.position(node).map(|p| self.nodes[p]) {
                Some((parent, own)) if node != 0 && own == frame => node = parent,
                _ => return false,
            }
        }
        node == 0
    }

    /// Forgets the nodes from id `len` on (a write that is undone).
    fn truncate(&mut self, len: usize) {
        let keep = len.saturating_sub(self.sealed as usize).max(1);
        for position in (keep..self.nodes.len()).rev() {
            self.index.remove(&self.nodes, position as u32);
        }
        self.nodes.truncate(keep);
        self.leaf_by_stack.clear();
    }

    /// Every node of the space, ids as positions: the sealed ones read with `conn`.
    fn all_nodes(
        &self,
        conn: &Connection,
        space_id: i64,
    ) -> Result<std::borrow::Cow<'_, [(u32, u32)]>, StoreError> {
        if self.sealed == 0 {
            return Ok(std::borrow::Cow::Borrowed(&self.nodes));
        }
        let mut nodes = read_sealed_nodes(conn, space_id, self.sealed)?;
        nodes.extend_from_slice(&self.nodes[1..]);
        Ok(std::borrow::Cow::Owned(nodes))
    }

    /// Ends the current generation (already on disk): its nodes leave memory.
    fn seal(&mut self) {
        self.sealed += self.nodes.len() as u32 - 1;
        self.nodes = vec![(u32::MAX, 0)];
        self.index = IdIndex::default();
        self.leaf_by_stack = HashMap::new();
        self.generation_started = Instant::now();
        self.settled_nodes = None;
    }
}

/// Nodes `1..=sealed` of a space, read from its node blocks, with the root at position 0:
/// what [`Space::seal`] took out of memory.
fn read_sealed_nodes(
    conn: &Connection,
    space_id: i64,
    sealed: u32,
) -> Result<Vec<(u32, u32)>, StoreError> {
    let mut nodes = Vec::with_capacity(sealed as usize + 1);
    nodes.push((u32::MAX, 0));
    let mut stmt = conn.prepare_cached(
        "SELECT first_idx, nodes FROM node_blocks WHERE space_id = ? AND first_idx <= ? \
         ORDER BY first_idx",
    )?;
    let mut rows = stmt.query(params![space_id, i64::from(sealed)])?;
    while let Some(row) = rows.next()? {
        let first: i64 = row.get(0)?;
        if first != nodes.len() as i64 {
            return Err(StoreError::Corrupt(codec::CorruptProfile(
                "call-tree node blocks do not follow each other",
            )));
        }
        let block = row.get_ref(1)?.as_blob().map_err(rusqlite::Error::from)?;
        codec::decode_nodes(first as usize, block, |parent, frame| {
            nodes.push((parent, frame))
        })?;
    }
    // Generations are sealed after their blocks are written, so a block never straddles one.
    if nodes.len() != sealed as usize + 1 {
        return Err(StoreError::Corrupt(codec::CorruptProfile(
            "sealed call-tree nodes are missing",
        )));
    }
    Ok(nodes)
}

#[derive(Debug, Default)]
struct Catalog {
    /// Names with ids below this belong to earlier generations: on disk only, where queries
    /// read them ([`CatalogReader`](query::CatalogReader)), and no longer found by ingest (a
    /// string seen again gets a new id). Bounds the memory of a store that keeps seeing new
    /// strings ([`StoreLimits::max_catalog_frames`]).
    sealed_names: u32,
    /// The current generation of strings of the frames (function and file names, objects,
    /// build ids): `names[i]` is name `sealed_names + i`.
    names: Vec<Arc<str>>,
    /// The current generation's names → their ids.
    name_ids: HashMap<Arc<str>, u32>,
    /// As `sealed_names`, for frames.
    sealed_frames: u32,
    /// The current generation of frames of every space: `frames[i]` is frame
    /// `sealed_frames + i`; their strings are name ids of any generation.
    frames: Vec<Frame>,
    /// The current generation's frames by value, as positions in `frames`.
    frame_ids: IdIndex,
    spaces: HashMap<i64, Space>,
    /// The space new series of a profile name and service use ([`space_key`]).
    space_ids: HashMap<(String, String), i64>,
    series: HashMap<i64, SeriesInfo>,
    series_ids: HashMap<String, i64>,
    next_space: i64,
    next_series: i64,
    /// Per service: its series count and, per label name, the series count of each value.
    cardinality: HashMap<String, ServiceCardinality>,
}

#[derive(Debug, Default)]
struct ServiceCardinality {
    series: usize,
    values: HashMap<String, HashMap<String, u32>>,
}

fn service_of(labels: &[(String, String)]) -> &str {
    labels
        .iter()
        .find(|(k, _)| k == "service_name")
        .map_or("", |(_, v)| v.as_str())
}

/// Labels counted per name: not the derived `__*__` ones, nor `service_name` itself.
fn counted_labels(labels: &[(String, String)]) -> impl Iterator<Item = &(String, String)> {
    labels
        .iter()
        .filter(|(k, _)| (!k.starts_with("__") || k == "__session_id__") && k != "service_name")
}

impl Catalog {
    fn add_series(&mut self, key: String, info: SeriesInfo) {
        let service = self
            .cardinality
            .entry(service_of(&info.labels).to_owned())
            .or_default();
        service.series += 1;
        for (name, value) in counted_labels(&info.labels) {
            *service
                .values
                .entry(name.clone())
                .or_default()
                .entry(value.clone())
                .or_default() += 1;
        }
        self.series_ids.insert(key, info.id);
        self.series.insert(info.id, info);
    }

    fn remove_series(&mut self, id: i64) {
        let Some(info) = self.series.remove(&id) else {
            return;
        };
        self.series_ids.remove(&labels_key(&info.labels));
        let service_name = service_of(&info.labels);
        let Some(service) = self.cardinality.get_mut(service_name) else {
            return;
        };
        service.series = service.series.saturating_sub(1);
        for (name, value) in counted_labels(&info.labels) {
            if let Some(values) = service.values.get_mut(name) {
                if let Some(count) = values.get_mut(value) {
                    *count -= 1;
                    if *count == 0 {
                        values.remove(value);
                    }
                }
                if values.is_empty() {
                    service.values.remove(name);
                }
            }
        }
        if service.series == 0 {
            self.cardinality.remove(service_name);
        }
    }

    /// Whether one more series with `labels` stays within the cardinality limits.
    fn check_new_series(
        &self,
        limits: &StoreLimits,
        labels: &[(String, String)],
    ) -> Result<(), LimitError> {
        let service_name = service_of(labels);
        let service = self.cardinality.get(service_name);
        if service.is_none() && limits::exceeds(self.cardinality.len() + 1, limits.max_services) {
            return Err(LimitError::Services {
                limit: limits.max_services,
                service: limits::quote(service_name),
            });
        }
        if limits::exceeds(self.series.len() + 1, limits.max_series) {
            return Err(LimitError::Series {
                limit: limits.max_series,
            });
        }
        let Some(service) = service else {
            return Ok(());
        };
        if limits::exceeds(service.series + 1, limits.max_series_per_service) {
            return Err(LimitError::SeriesPerService {
                limit: limits.max_series_per_service,
                service: limits::quote(service_name),
            });
        }
        for (name, value) in counted_labels(labels) {
            let Some(values) = service.values.get(name) else {
                continue;
            };
            if !values.contains_key(value)
                && limits::exceeds(values.len() + 1, limits.max_label_values_per_name)
            {
                return Err(LimitError::LabelValuesPerName {
                    limit: limits.max_label_values_per_name,
                    service: limits::quote(service_name),
                    name: limits::quote(name),
                });
            }
        }
        Ok(())
    }

    /// Forgets space `id` (unused, or added by a write that is undone).
    fn remove_space(&mut self, id: i64) {
        if let Some(space) = self.spaces.remove(&id) {
            let key = space_key(&space.profile_type, &space.service_name);
            if self.space_ids.get(&key) == Some(&id) {
                self.space_ids.remove(&key);
            }
        }
    }

    /// Names given ids so far, sealed or not: the next name's id.
    fn name_count(&self) -> usize {
        self.sealed_names as usize + self.names.len()
    }

    /// Frames given ids so far, sealed or not: the next frame's id.
    fn frame_count(&self) -> usize {
        self.sealed_frames as usize + self.frames.len()
    }

    fn intern_name(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.name_ids.get(name) {
            return id;
        }
        self.push_name(name.into())
    }

    /// Adds `name` to the current generation without looking for it (loading the store).
    fn push_name(&mut self, name: Arc<str>) -> u32 {
        let id = self.name_count() as u32;
        self.names.push(name.clone());
        self.name_ids.insert(name, id);
        id
    }

    /// `frame`'s strings must be name ids.
    fn intern_frame(&mut self, frame: Frame) -> u32 {
        if let Some(position) = self.frame_ids.find(&self.frames, &frame) {
            return self.sealed_frames + position;
        }
        self.frames.push(frame);
        let position = self.frames.len() as u32 - 1;
        self.frame_ids.insert(&self.frames, position);
        self.sealed_frames + position
    }

    /// Frame `id` when it is in memory (the current generation).
    fn frame(&self, id: u32) -> Option<Frame> {
        let position = id.checked_sub(self.sealed_frames)?;
        self.frames.get(position as usize).copied()
    }

    /// Name `id` when it is in memory (the current generation).
    fn name(&self, id: u32) -> Option<&Arc<str>> {
        let position = id.checked_sub(self.sealed_names)?;
        self.names.get(position as usize)
    }

    /// Ends the current generation of frames and that of names, when either holds more than
    /// `max` (0: no limit); returns how many generations ended and how many call trees were
    /// sealed with them. Only for what is already on disk. The two end together, and with them
    /// every tree in memory: a frame names its strings by id and a node its frame, so a frame
    /// sealed alone would be added again under a new id by the next write, and so would every
    /// node above it, the trees in memory keeping both (at a seal every few minutes, more
    /// nodes than the bound on nodes could hold).
    fn seal_frames_and_names_over(&mut self, max: usize) -> (u64, u64) {
        if !limits::exceeds(self.frames.len(), max) && !limits::exceeds(self.names.len(), max) {
            return (0, 0);
        }
        let sealed = u64::from(self.seal_frames()) + u64::from(self.seal_names());
        let mut trees = 0;
        if sealed > 0 {
            for space in self.spaces.values_mut() {
                if space.nodes.len() > 1 && space.len() < u32::MAX as usize / 2 {
                    space.seal();
                    trees += 1;
                }
            }
        }
        (sealed, trees)
    }

    /// Ends the current generation of frames; whether it did. Ids are u32 and a sealed
    /// generation numbers on: past half of them, the generation stays in memory rather than
    /// run out.
    fn seal_frames(&mut self) -> bool {
        if self.frames.is_empty() || self.frame_count() >= u32::MAX as usize / 2 {
            return false;
        }
        self.sealed_frames = self.frame_count() as u32;
        self.frames = Vec::new();
        self.frame_ids = IdIndex::default();
        true
    }

    /// As [`Self::seal_frames`], for names.
    fn seal_names(&mut self) -> bool {
        if self.names.is_empty() || self.name_count() >= u32::MAX as usize / 2 {
            return false;
        }
        self.sealed_names = self.name_count() as u32;
        self.names = Vec::new();
        self.name_ids = HashMap::new();
        true
    }

    /// Seals the spaces with the most nodes in memory until all together keep at most `max`
    /// (0: no limit); returns how many were sealed, and of those how many had not doubled.
    /// Only for nodes already on disk.
    ///
    /// With `settle_age`, only a generation that has at least doubled since it had lived that
    /// long: one that holds about the stacks its service keeps sending would only be made again
    /// by the next writes (its nodes on disk a second time), so it stays, and the bound is then
    /// exceeded by what the services use. A service that keeps sending new stacks (a stripped
    /// compiler's addresses) doubles and is sealed. Without, any (at open).
    ///
    /// What the services use may exceed `max` only up to [`HARD_BOUND_FACTOR`] times it: when
    /// the trees left after sealing the grown ones are past that (many services, each with a
    /// large steady tree), the largest are sealed whether or not they doubled, until `max`
    /// holds again. Their nodes are then written a second time, the price of the memory bound.
    fn seal_over(&mut self, max: usize, settle_age: Option<Duration>) -> (u64, u64) {
        if max == 0 {
            return (0, 0);
        }
        if let Some(age) = settle_age {
            for space in self.spaces.values_mut() {
                if space.settled_nodes.is_none() && space.generation_started.elapsed() >= age {
                    space.settled_nodes = Some(space.nodes.len());
                }
            }
        }
        let grown = |space: &Space| {
            settle_age.is_none()
                || space
                    .settled_nodes
                    .is_some_and(|n| space.nodes.len() >= 2 * n)
        };
        let mut in_memory: usize = self.spaces.values().map(|s| s.nodes.len()).sum();
        let (mut sealed, mut sealed_in_use) = (0, 0);
        // Grown trees first; then, only if the trees in use alone are past the hard bound, any.
        for any_tree in [false, true] {
            if any_tree && in_memory <= max.saturating_mul(HARD_BOUND_FACTOR) {
                break;
            }
            while in_memory > max {
                // Node ids are u32 and a sealed space numbers on: one that has used half of
                // them keeps its tree in memory rather than run out.
                let Some(space) = self
                    .spaces
                    .values_mut()
                    .filter(|s| {
                        s.nodes.len() > 1
                            && s.len() < u32::MAX as usize / 2
                            && (any_tree || grown(s))
                    })
                    .max_by_key(|s| s.nodes.len())
                else {
                    break;
                };
                in_memory -= space.nodes.len() - 1;
                sealed_in_use += u64::from(!grown(space));
                space.seal();
                sealed += 1;
            }
        }
        (sealed, sealed_in_use)
    }
}

/// What one write added to the catalog, to persist it and to undo it if the commit fails.
#[derive(Default)]
struct CatalogAdditions {
    names_before: usize,
    frames_before: usize,
    spaces: Vec<i64>,
    /// (space, node count before).
    nodes: Vec<(i64, usize)>,
    series: Vec<i64>,
}

/// The store; cheap to clone, safe to share between threads.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    settings: StoreSettings,
    limits: StoreLimits,
    settle_age: Duration,
    path: PathBuf,
    /// When a disk-full and a corruption error were last logged (at most once a minute each).
    disk_full_logged: Mutex<Option<Instant>>,
    corruption_logged: Mutex<Option<Instant>>,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    catalog: RwLock<Catalog>,
    counters: StoreCounters,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS names(id INTEGER PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS frame_blocks(first_id INTEGER PRIMARY KEY, frames BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS spaces(id INTEGER PRIMARY KEY, profile_type TEXT NOT NULL,
    service_name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS node_blocks(space_id INTEGER NOT NULL, first_idx INTEGER NOT NULL,
    nodes BLOB NOT NULL, PRIMARY KEY(space_id, first_idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS series(id INTEGER PRIMARY KEY, space_id INTEGER NOT NULL,
    profile_type TEXT NOT NULL, labels TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles(id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL,
    time_ns INTEGER NOT NULL, duration_ns INTEGER NOT NULL, total INTEGER NOT NULL,
    stacks BLOB NOT NULL, spans BLOB, period INTEGER, labelled BLOB);
CREATE INDEX IF NOT EXISTS profiles_by_series_time ON profiles(series_id, time_ns);
CREATE INDEX IF NOT EXISTS profiles_by_time ON profiles(time_ns);
CREATE TABLE IF NOT EXISTS settings(name TEXT PRIMARY KEY, value TEXT NOT NULL,
    modified_at INTEGER NOT NULL);
";

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(Duration::from_secs(10))?;
    // WAL: readers never block the writer. synchronous=NORMAL: a commit is in the WAL file
    // before it returns, so it survives the process being killed (not necessarily power loss).
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "cache_size", WRITER_CACHE_KIB)?;
    Ok(())
}

/// SQLite's page cache of each of up to 8 pooled readers, in KiB (as `PRAGMA cache_size`
/// takes it, negated); pages beyond it come from the kernel's page cache, so the agent's RSS
/// does not grow with the store.
const READER_CACHE_KIB: i64 = -4096;

/// The writer's page cache, in KiB. It appends (profiles at the end of their tables, a
/// series' newest entry in its index), so the pages it needs again are few; a larger cache
/// only filled during a run, a few MiB of the agent's growth, without making writes faster.
const WRITER_CACHE_KIB: i64 = -1024;

/// All of SQLite's memory together, a soft limit (`sqlite3_soft_heap_limit64`): past it SQLite
/// recycles cached pages before allocating more.
pub const SQLITE_SOFT_HEAP_LIMIT_BYTES: i64 = 24 << 20;

/// Bytes SQLite holds now, all connections together.
pub fn sqlite_memory_bytes() -> u64 {
    // SAFETY: reads a process-wide counter.
    u64::try_from(unsafe { rusqlite::ffi::sqlite3_memory_used() }).unwrap_or(0)
}

/// Sets [`SQLITE_SOFT_HEAP_LIMIT_BYTES`] (process-wide, once).
fn limit_sqlite_memory() {
    static LIMIT: std::sync::Once = std::sync::Once::new();
    LIMIT.call_once(|| {
        // SAFETY: sets a process-wide SQLite setting; thread-safe in SQLite's default
        // (serialized) threading mode.
        unsafe {
            rusqlite::ffi::sqlite3_soft_heap_limit64(SQLITE_SOFT_HEAP_LIMIT_BYTES);
        }
    });
}

fn unix_now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Opens the database at `path` and loads its catalog; with `check`, runs `PRAGMA quick_check`
/// first. On error the connection is closed without a checkpoint, so a damaged file and its
/// WAL are left as they were found.
fn open_database(
    path: &Path,
    check: bool,
    limits: &StoreLimits,
) -> Result<(Connection, Catalog), StoreError> {
    limit_sqlite_memory();
    let mut conn = Connection::open(path)?;
    match prepare_database(&mut conn, check, limits) {
        Ok(catalog) => Ok((conn, catalog)),
        Err(err) => {
            let _ = conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true);
            drop(conn);
            Err(err)
        }
    }
}

fn prepare_database(
    conn: &mut Connection,
    check: bool,
    limits: &StoreLimits,
) -> Result<Catalog, StoreError> {
    // Must precede the first table: lets deleted pages be returned to the file system.
    conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
    configure(conn)?;
    if check {
        let started = Instant::now();
        let result: String = conn.query_row("PRAGMA quick_check(1)", [], |r| r.get(0))?;
        if result != "ok" {
            return Err(StoreError::Integrity(result.replace('\n', " ")));
        }
        tracing::debug!(elapsed = ?started.elapsed(), "profile store: integrity check passed");
    }
    conn.execute_batch(SCHEMA)?;
    migrate_node_rows(conn)?;
    add_profile_column(conn, "spans", "BLOB")?;
    add_profile_column(conn, "period", "INTEGER")?;
    add_profile_column(conn, "labelled", "BLOB")?;
    give_names_frames(conn)?;
    load_catalog(conn, limits.max_catalog_nodes, limits.max_catalog_frames)
}

/// Renames the database and its `-wal` and `-shm` files to `<name>.corrupt-<UTC time>[-wal|-shm]`;
/// returns the new name of the database.
fn quarantine(path: &Path, now: SystemTime) -> Result<PathBuf, StoreError> {
    let stamp = utc_stamp(now);
    let target = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(format!(".corrupt-{stamp}{suffix}"));
        PathBuf::from(name)
    };
    // A second quarantine within the same second must not overwrite the first.
    let mut moved_to = target("");
    let mut n = 1;
    while moved_to.exists() {
        moved_to = target(&format!(".{n}"));
        n += 1;
    }
    let base = moved_to.clone();
    for suffix in ["", "-wal", "-shm"] {
        let mut from = path.as_os_str().to_owned();
        from.push(suffix);
        let mut to = base.as_os_str().to_owned();
        to.push(suffix);
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && !suffix.is_empty() => {}
            Err(source) => {
                return Err(StoreError::Io {
                    what: format!(
                        "cannot move the corrupt {} aside",
                        PathBuf::from(from).display()
                    ),
                    source,
                });
            }
        }
    }
    Ok(moved_to)
}

/// `YYYYMMDDTHHMMSSZ` of a time (UTC).
fn utc_stamp(time: SystemTime) -> String {
    let t = crate::model::UtcTime::of(time);
    format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        t.year, t.month, t.day, t.hour, t.minute, t.second
    )
}

impl Store {
    /// Opens (or creates) the store in `settings.data_dir` with the default limits.
    pub fn open(settings: StoreSettings) -> Result<Store, StoreError> {
        Store::open_with(settings, StoreOptions::default())
    }

    /// Opens (or creates) the store in `settings.data_dir`. A database that is corrupt or not a
    /// database (found while opening, or by the integrity check) is moved aside as
    /// `profiles.db.corrupt-<UTC time>` with its `-wal` and `-shm` files, and an empty one is
    /// started; only a failure to start that one is an error.
    pub fn open_with(settings: StoreSettings, options: StoreOptions) -> Result<Store, StoreError> {
        let open_error = |source: StoreError| StoreError::Open {
            path: settings.data_dir.clone(),
            source: Box::new(source),
        };
        std::fs::create_dir_all(&settings.data_dir).map_err(|source| {
            open_error(StoreError::Io {
                what: "cannot create the directory".into(),
                source,
            })
        })?;
        let path = settings.data_dir.join(DATABASE_FILE);
        let mut quarantined = 0;
        let (conn, catalog) = match open_database(&path, options.integrity_check, &options.limits) {
            Ok(opened) => opened,
            Err(err) if err.is_corruption() => {
                let moved_to = quarantine(&path, SystemTime::now()).map_err(open_error)?;
                tracing::warn!(
                    error = %err,
                    moved_to = %moved_to.display(),
                    "profile store: the database is corrupt; moved it aside with its -wal and \
                     -shm files and started an empty one"
                );
                quarantined = 1;
                open_database(&path, false, &options.limits).map_err(open_error)?
            }
            Err(err) => return Err(open_error(err)),
        };
        tracing::info!(
            path = %path.display(),
            series = catalog.series.len(),
            "profile store open"
        );
        let counters = StoreCounters::default();
        counters
            .databases_quarantined
            .store(quarantined, Ordering::Relaxed);
        Ok(Store {
            inner: Arc::new(Inner {
                settings,
                limits: options.limits,
                settle_age: options.settle_age,
                path,
                disk_full_logged: Mutex::new(None),
                corruption_logged: Mutex::new(None),
                writer: Mutex::new(conn),
                readers: Mutex::new(Vec::new()),
                catalog: RwLock::new(catalog),
                counters,
            }),
        })
    }

    pub fn limits(&self) -> &StoreLimits {
        &self.inner.limits
    }

    /// Refuses a query over the stack spaces `spaces` when they hold more call-tree nodes than
    /// `--max-query-nodes` (what a merge allocates is proportional to them).
    pub(crate) fn check_query_size<'a>(
        &self,
        spaces: impl Iterator<Item = &'a i64>,
    ) -> Result<(), StoreError> {
        let limit = self.inner.limits.max_query_nodes;
        let nodes: usize = {
            let catalog = self.read_catalog();
            spaces
                .filter_map(|id| catalog.spaces.get(id))
                .map(Space::len)
                .sum()
        };
        if limits::exceeds(nodes, limit) {
            self.inner
                .counters
                .queries_too_large
                .fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::QueryTooLarge { nodes, limit });
        }
        Ok(())
    }

    /// Counts and logs (at most once a minute per kind) a failure that is the disk's or the
    /// file's, not the request's.
    fn note_failure(&self, err: &StoreError) {
        let (counter, last, message) = if err.is_disk_full() {
            (
                &self.inner.counters.disk_full_errors,
                &self.inner.disk_full_logged,
                "profile store: the disk is full; writes fail until space returns",
            )
        } else if err.is_corruption() {
            (
                &self.inner.counters.corruption_errors,
                &self.inner.corruption_logged,
                "profile store: the database is corrupt; it is moved aside at the next start",
            )
        } else {
            return;
        };
        let total = counter.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
            *last = Some(Instant::now());
            tracing::warn!(error = %err, failures = total, "{message}");
        }
    }

    pub fn settings(&self) -> &StoreSettings {
        &self.inner.settings
    }

    pub fn counters(&self) -> &StoreCounters {
        &self.inner.counters
    }

    /// Stores profiles atomically: when this returns Ok, all are durable; on error, none is.
    pub fn ingest(&self, profiles: &[NewProfile]) -> Result<(), StoreError> {
        let counters = &self.inner.counters;
        let result = self.ingest_inner(profiles);
        match &result {
            Ok(()) => {
                counters
                    .profiles_ingested
                    .fetch_add(profiles.len() as u64, Ordering::Relaxed);
            }
            Err(err) => {
                counters.ingest_errors.fetch_add(1, Ordering::Relaxed);
                match err {
                    StoreError::Limit(limit) => counters.limit_rejections.count(limit.limit()),
                    StoreError::NegativeValue { .. } => {
                        counters
                            .negative_values_rejected
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    other => self.note_failure(other),
                }
            }
        }
        result
    }

    fn ingest_inner(&self, profiles: &[NewProfile]) -> Result<(), StoreError> {
        if profiles.is_empty() {
            return Ok(());
        }
        // What can be checked without the catalog, before taking any lock.
        for profile in profiles {
            limits::check_labels(&self.inner.limits, &profile.labels)?;
            if let Some(&(_, value)) = profile.stacks.iter().find(|(_, v)| *v < 0) {
                return Err(StoreError::NegativeValue { value });
            }
        }
        let mut writer = self.inner.writer.lock().unwrap_or_else(|p| p.into_inner());
        let mut additions = CatalogAdditions::default();
        let mut truncated = 0u64;
        let rows = {
            let mut catalog = self.write_catalog();
            additions.names_before = catalog.name_count();
            additions.frames_before = catalog.frame_count();
            profiles
                .iter()
                .map(|profile| {
                    encode_profile(
                        &mut catalog,
                        &mut additions,
                        &self.inner.limits,
                        &mut truncated,
                        profile,
                    )
                })
                .collect::<Result<Vec<_>, LimitError>>()
        };
        let rows = match rows {
            Ok(rows) => rows,
            Err(err) => {
                self.undo(&additions);
                return Err(err.into());
            }
        };
        match self.persist(&mut writer, &additions, &rows) {
            Ok(()) => {
                if truncated > 0 {
                    self.inner
                        .counters
                        .stacks_truncated
                        .fetch_add(truncated, Ordering::Relaxed);
                }
                let mut catalog = self.write_catalog();
                for row in &rows {
                    if let Some(series) = catalog.series.get_mut(&row.series) {
                        series.first_ns = series.first_ns.min(row.time_ns);
                        series.last_ns = series.last_ns.max(row.time_ns);
                    }
                }
                // Only now: a sealed generation must be on disk, where queries read it.
                let (sealed, sealed_in_use) = catalog.seal_over(
                    self.inner.limits.max_catalog_nodes,
                    Some(self.inner.settle_age),
                );
                let counters = &self.inner.counters;
                counters
                    .node_trees_sealed
                    .fetch_add(sealed, Ordering::Relaxed);
                counters
                    .node_trees_sealed_in_use
                    .fetch_add(sealed_in_use, Ordering::Relaxed);
                let (generations, trees) =
                    catalog.seal_frames_and_names_over(self.inner.limits.max_catalog_frames);
                counters
                    .frame_generations_sealed
                    .fetch_add(generations, Ordering::Relaxed);
                counters
                    .node_trees_sealed
                    .fetch_add(trees, Ordering::Relaxed);
                Ok(())
            }
            Err(err) => {
                self.undo(&additions);
                Err(err)
            }
        }
    }

    fn persist(
        &self,
        writer: &mut Connection,
        additions: &CatalogAdditions,
        rows: &[ProfileRow],
    ) -> Result<(), StoreError> {
        let tx = writer.transaction()?;
        {
            let catalog = self.read_catalog();
            let mut insert_name = tx.prepare_cached("INSERT INTO names(id, name) VALUES (?, ?)")?;
            // Sealing waits for the write to be on disk, so what it added is in memory.
            let first_name = additions.names_before - catalog.sealed_names as usize;
            for (position, name) in catalog.names.iter().enumerate().skip(first_name) {
                let id = catalog.sealed_names as usize + position;
                insert_name.execute(params![id as i64, name.as_ref()])?;
            }
            let first_frame = additions.frames_before - catalog.sealed_frames as usize;
            if catalog.frames.len() > first_frame {
                tx.execute(
                    "INSERT INTO frame_blocks(first_id, frames) VALUES (?, ?)",
                    params![
                        additions.frames_before as i64,
                        frames::encode_frames(&catalog.frames[first_frame..])
                    ],
                )?;
            }
            for id in &additions.spaces {
                let space = &catalog.spaces[id];
                tx.execute(
                    "INSERT INTO spaces(id, profile_type, service_name) VALUES (?, ?, ?)",
                    params![id, space.profile_type, space.service_name],
                )?;
            }
            let mut insert_nodes = tx.prepare_cached(
                "INSERT INTO node_blocks(space_id, first_idx, nodes) VALUES (?, ?, ?)",
            )?;
            for &(space_id, before) in &additions.nodes {
                let space = &catalog.spaces[&space_id];
                // Node 0, the root, is implicit.
                let first = before.max(1);
                if first < space.len() {
                    let block = codec::encode_nodes(first, space.nodes_from(first));
                    insert_nodes.execute(params![space_id, first as i64, block])?;
                }
            }
            for id in &additions.series {
                let series = &catalog.series[id];
                tx.execute(
                    "INSERT INTO series(id, space_id, profile_type, labels) VALUES (?, ?, ?, ?)",
                    params![
                        id,
                        series.space,
                        series.profile_type,
                        labels_key(&series.labels)
                    ],
                )?;
            }
        }
        {
            let mut insert_profile = tx.prepare_cached(
                "INSERT INTO profiles(series_id, time_ns, duration_ns, total, stacks, spans, \
                 period, labelled) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            )?;
            for row in rows {
                insert_profile.execute(params![
                    row.series,
                    row.time_ns,
                    row.duration_ns,
                    row.total,
                    row.stacks,
                    row.spans,
                    row.period,
                    row.labelled,
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn undo(&self, additions: &CatalogAdditions) {
        let mut catalog = self.write_catalog();
        for &id in &additions.series {
            catalog.remove_series(id);
        }
        for &(space_id, before) in &additions.nodes {
            if let Some(space) = catalog.spaces.get_mut(&space_id) {
                space.truncate(before);
            }
        }
        for id in &additions.spaces {
            catalog.remove_space(*id);
        }
        let catalog = &mut *catalog;
        let first_frame = additions.frames_before - catalog.sealed_frames as usize;
        for position in (first_frame..catalog.frames.len()).rev() {
            catalog.frame_ids.remove(&catalog.frames, position as u32);
        }
        catalog.frames.truncate(first_frame);
        let first_name = additions.names_before - catalog.sealed_names as usize;
        for name in catalog.names.split_off(first_name) {
            catalog.name_ids.remove(&name);
        }
    }

    fn read_catalog(&self) -> std::sync::RwLockReadGuard<'_, Catalog> {
        self.inner.catalog.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_catalog(&self) -> std::sync::RwLockWriteGuard<'_, Catalog> {
        self.inner
            .catalog
            .write()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` with a read-only connection from the pool.
    fn with_reader<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let pooled = self
            .inner
            .readers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => {
                let conn = Connection::open_with_flags(
                    &self.inner.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                conn.busy_timeout(Duration::from_secs(10))?;
                conn.pragma_update(None, "cache_size", READER_CACHE_KIB)?;
                conn
            }
        };
        let result = f(&conn);
        if let Err(err) = &result {
            self.note_failure(err);
        }
        let mut pool = self.inner.readers.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < 8 {
            pool.push(conn);
        }
        result
    }

    /// Every series, optionally only those with profiles overlapping `[start_ns, end_ns]`.
    pub fn series(&self, range: Option<(i64, i64)>) -> Vec<SeriesInfo> {
        let catalog = self.read_catalog();
        let mut out: Vec<SeriesInfo> = catalog
            .series
            .values()
            .filter(|s| s.first_ns <= s.last_ns)
            .filter(|s| range.is_none_or(|(start, end)| s.first_ns <= end && s.last_ns >= start))
            .cloned()
            .collect();
        out.sort_by_key(|s| s.id);
        out
    }

    /// Bytes the data takes (pages in use, without free pages).
    pub fn used_bytes(&self) -> Result<u64, StoreError> {
        self.with_reader(used_bytes)
    }

    /// What the in-memory catalog holds: (strings, frames, call-tree nodes of all spaces).
    pub fn catalog_sizes(&self) -> (usize, usize, usize) {
        let catalog = self.read_catalog();
        let nodes = catalog.spaces.values().map(|s| s.nodes.len()).sum();
        (catalog.names.len(), catalog.frames.len(), nodes)
    }

    /// The store file on disk, for tests and the benchmark.
    pub fn database_path(&self) -> &Path {
        &self.inner.path
    }

    /// Deletes profiles older than the retention and, while over the size cap, the oldest ones;
    /// then drops empty series and spaces. Returns the number of profiles deleted.
    pub fn enforce_limits(&self) -> Result<u64, StoreError> {
        self.enforce_limits_at(unix_now_ns())
    }

    pub fn enforce_limits_at(&self, now_ns: i64) -> Result<u64, StoreError> {
        let settings = &self.inner.settings;
        let cutoff = now_ns.saturating_sub(settings.retention.as_nanos() as i64);
        let writer = self.inner.writer.lock().unwrap_or_else(|p| p.into_inner());
        let mut deleted =
            writer.execute("DELETE FROM profiles WHERE time_ns < ?", [cutoff])? as u64;
        loop {
            let used = used_bytes(&writer)?;
            if used <= settings.max_bytes {
                break;
            }
            let count: i64 = writer.query_row("SELECT COUNT(*) FROM profiles", [], |r| r.get(0))?;
            if count == 0 {
                break;
            }
            // Delete the oldest tenth of what exceeds, at least one profile, then re-measure.
            let excess_share = (used - settings.max_bytes) as f64 / used as f64;
            let batch = ((count as f64 * excess_share * 1.1).ceil() as i64).clamp(1, count);
            deleted += writer.execute(
                "DELETE FROM profiles WHERE id IN \
                 (SELECT id FROM profiles ORDER BY time_ns LIMIT ?)",
                [batch],
            )? as u64;
        }
        if deleted > 0 {
            self.drop_empty(&writer)?;
            writer.execute_batch("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")?;
            self.inner
                .counters
                .profiles_evicted
                .fetch_add(deleted, Ordering::Relaxed);
            tracing::info!(deleted, "profile store: removed old profiles");
        }
        Ok(deleted)
    }

    /// Recomputes series time ranges and removes series and spaces without profiles.
    fn drop_empty(&self, writer: &Connection) -> Result<(), StoreError> {
        let mut ranges = HashMap::new();
        {
            let mut stmt = writer.prepare(
                "SELECT series_id, MIN(time_ns), MAX(time_ns) FROM profiles GROUP BY series_id",
            )?;
            let mut rows = stmt.query([])?;
            while let Some(row) = rows.next()? {
                ranges.insert(row.get::<_, i64>(0)?, (row.get(1)?, row.get(2)?));
            }
        }
        let mut catalog = self.write_catalog();
        let empty: Vec<i64> = catalog
            .series
            .keys()
            .filter(|id| !ranges.contains_key(id))
            .copied()
            .collect();
        for id in empty {
            writer.execute("DELETE FROM series WHERE id = ?", [id])?;
            catalog.remove_series(id);
        }
        for (id, series) in catalog.series.iter_mut() {
            (series.first_ns, series.last_ns) = ranges[id];
        }
        let used_spaces: std::collections::HashSet<i64> =
            catalog.series.values().map(|s| s.space).collect();
        let unused: Vec<i64> = catalog
            .spaces
            .keys()
            .filter(|id| !used_spaces.contains(id))
            .copied()
            .collect();
        for id in unused {
            writer.execute("DELETE FROM node_blocks WHERE space_id = ?", [id])?;
            writer.execute("DELETE FROM spaces WHERE id = ?", [id])?;
            catalog.remove_space(id);
        }
        Ok(())
    }

    /// Runs [`Store::enforce_limits`] every `every` on a background thread until the store's
    /// last other handle is dropped.
    pub fn spawn_maintenance(&self, every: Duration) -> std::thread::JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        std::thread::Builder::new()
            .name("store-maintenance".into())
            .spawn(move || {
                loop {
                    // Sleep in short steps so the thread ends soon after the store is dropped.
                    let deadline = std::time::Instant::now() + every;
                    while std::time::Instant::now() < deadline {
                        if weak.strong_count() == 0 {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(200).min(every));
                    }
                    let Some(inner) = weak.upgrade() else { return };
                    let store = Store { inner };
                    if let Err(err) = store.enforce_limits() {
                        if err.is_disk_full() || err.is_corruption() {
                            store.note_failure(&err);
                        } else {
                            tracing::warn!("{err}");
                        }
                    }
                }
            })
            .expect("spawning the store maintenance thread")
    }
}

fn used_bytes(conn: &Connection) -> Result<u64, StoreError> {
    let pages: i64 = conn.query_row("PRAGMA page_count", [], |r| r.get(0))?;
    let free: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
    let page_size: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    Ok(((pages - free).max(0) * page_size) as u64)
}

/// A profile ready to insert.
struct ProfileRow {
    series: i64,
    time_ns: i64,
    duration_ns: i64,
    total: i64,
    stacks: Vec<u8>,
    /// The span blob ([`codec::encode_spans`]); `None` when no sample named a span.
    spans: Option<Vec<u8>>,
    period: Option<i64>,
    /// The numeric-label blob ([`codec::encode_labelled`]); `None` when no sample had one.
    labelled: Option<Vec<u8>>,
}

/// The canonical text of a label set, the series' identity.
fn labels_key(labels: &[(String, String)]) -> String {
    serde_json::to_string(labels).unwrap_or_default()
}

/// The full, sorted label set of a series: the given labels plus the derived ones.
pub fn series_labels(
    profile_type: &ProfileType,
    labels: &[(String, String)],
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = labels
        .iter()
        .filter(|(k, _)| !k.starts_with("__") || k == "__session_id__")
        .cloned()
        .collect();
    let service = labels
        .iter()
        .find(|(k, _)| k == "service_name")
        .map(|(_, v)| v.clone())
        .filter(|v| !v.is_empty());
    if service.is_none() {
        out.retain(|(k, _)| k != "service_name");
        out.push(("service_name".into(), "unknown_service".into()));
    }
    let service = service.unwrap_or_else(|| "unknown_service".into());
    out.extend([
        ("__name__".to_owned(), profile_type.name.clone()),
        ("__profile_type__".to_owned(), profile_type.id()),
        ("__type__".to_owned(), profile_type.sample_type.clone()),
        ("__unit__".to_owned(), profile_type.sample_unit.clone()),
        (
            "__period_type__".to_owned(),
            profile_type.period_type.clone(),
        ),
        (
            "__period_unit__".to_owned(),
            profile_type.period_unit.clone(),
        ),
        ("__service_name__".to_owned(), service),
    ]);
    out.sort();
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

fn encode_profile(
    catalog: &mut Catalog,
    additions: &mut CatalogAdditions,
    limits: &StoreLimits,
    truncated: &mut u64,
    profile: &NewProfile,
) -> Result<ProfileRow, LimitError> {
    let profile_type = profile.profile_type.clone().unwrap_or_else(|| ProfileType {
        name: "process_cpu".into(),
        sample_type: "cpu".into(),
        sample_unit: "nanoseconds".into(),
        period_type: "cpu".into(),
        period_unit: "nanoseconds".into(),
    });
    let type_id = profile_type.id();
    let labels = series_labels(&profile_type, &profile.labels);
    let service = labels
        .iter()
        .find(|(k, _)| k == "service_name")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();

    let key = labels_key(&labels);
    let existing_series = catalog.series_ids.get(&key).copied();
    if existing_series.is_none() {
        catalog.check_new_series(limits, &labels)?;
    }

    // An existing series keeps its space (a store written before may have one per sample type).
    let series_space = existing_series.and_then(|id| catalog.series.get(&id).map(|s| s.space));
    let tree_key = space_key(&type_id, &service);
    let space_id = match series_space.or_else(|| catalog.space_ids.get(&tree_key).copied()) {
        Some(id) => id,
        None => {
            let id = catalog.next_space;
            catalog.next_space += 1;
            catalog
                .spaces
                .insert(id, Space::new(type_id.clone(), service));
            catalog.space_ids.insert(tree_key, id);
            additions.spaces.push(id);
            id
        }
    };
    let series = match existing_series {
        Some(id) => id,
        None => {
            let id = catalog.next_series;
            catalog.next_series += 1;
            catalog.add_series(
                key,
                SeriesInfo {
                    id,
                    space: space_id,
                    profile_type: type_id,
                    labels,
                    first_ns: i64::MAX,
                    last_ns: i64::MIN,
                },
            );
            additions.series.push(id);
            id
        }
    };
    let truncated_frame = (limits.max_stack_depth > 0
        && profile
            .stacks
            .iter()
            .any(|(path, _)| path.len() > limits.max_stack_depth))
    .then(|| {
        let name = catalog.intern_name(limits::TRUNCATED_FRAME);
        catalog.intern_frame(Frame::named(name))
    });

    let name_ids: Vec<u32> = profile
        .names
        .iter()
        .map(|name| catalog.intern_name(name))
        .collect();
    // The store's frame of each of the profile's frames; `None` for one with an unknown name.
    let frame_ids: Vec<Option<u32>> = if profile.frames.is_empty() {
        name_ids
            .iter()
            .map(|&name| Some(catalog.intern_frame(Frame::named(name))))
            .collect()
    } else {
        profile
            .frames
            .iter()
            .map(|frame| {
                let stored = frame.translated(|id| name_ids.get(id as usize).copied())?;
                Some(catalog.intern_frame(stored))
            })
            .collect()
    };
    let space = catalog
        .spaces
        .get_mut(&space_id)
        .expect("space just resolved");
    if !additions.nodes.iter().any(|(id, _)| *id == space_id) {
        additions.nodes.push((space_id, space.len()));
    }
    let mut stack: Vec<u32> = Vec::new();
    let mut entries_of = |stacks: &[(Vec<u32>, i64)], truncated: &mut u64| {
        let mut values: HashMap<u32, i64> = HashMap::with_capacity(stacks.len());
        for (path, value) in stacks {
            if *value == 0 {
                continue;
            }
            stack.clear();
            // Deeper than the limit: the leaf-side frames under one `[truncated]` frame.
            let path = match truncated_frame {
                Some(frame) if path.len() > limits.max_stack_depth => {
                    *truncated += 1;
                    stack.push(frame);
                    &path[path.len() - (limits.max_stack_depth - 1)..]
                }
                _ => path.as_slice(),
            };
            stack.extend(
                path.iter()
                    .filter_map(|&local| frame_ids.get(local as usize).copied().flatten()),
            );
            let node = space.node_of(&stack);
            // Saturating: values come from clients and may be extreme.
            let sum = values.entry(node).or_default();
            *sum = sum.saturating_add(*value);
        }
        let mut entries: Vec<(u32, i64)> = values.into_iter().filter(|(_, v)| *v != 0).collect();
        entries.sort_unstable();
        entries
    };
    let entries = entries_of(&profile.stacks, truncated);
    // A span's stacks are also among the profile's: counted once as truncated.
    let spans: Vec<codec::SpanEntries> = profile
        .spans
        .iter()
        .map(|span| codec::SpanEntries {
            span_id: span.span_id,
            trace_id: span.trace_id.clone(),
            span_name: span.span_name.clone(),
            entries: entries_of(&span.stacks, &mut 0),
        })
        .filter(|span| !span.entries.is_empty())
        .collect();
    let labelled: Vec<codec::LabelledEntries> = profile
        .labelled
        .iter()
        .map(|group| codec::LabelledEntries {
            labels: group.labels.clone(),
            entries: entries_of(&group.stacks, &mut 0),
        })
        .filter(|group| !group.entries.is_empty())
        .collect();
    Ok(ProfileRow {
        series,
        time_ns: profile.time_ns,
        duration_ns: profile.duration_ns,
        total: entries
            .iter()
            .fold(0i64, |sum, (_, v)| sum.saturating_add(*v)),
        stacks: codec::encode(&entries),
        spans: (!spans.is_empty()).then(|| codec::encode_spans(&spans)),
        period: (profile.period > 0).then_some(profile.period),
        labelled: (!labelled.is_empty()).then(|| codec::encode_labelled(&labelled)),
    })
}

/// Stores written before span profiles (`spans`), periods (`period`) or numeric labels
/// (`labelled`) lack that column of `profiles`; it is added, empty.
fn add_profile_column(conn: &Connection, name: &str, kind: &str) -> Result<(), StoreError> {
    let present: i64 = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info('profiles') WHERE name = ?",
        [name],
        |r| r.get(0),
    )?;
    if present == 0 {
        conn.execute_batch(&format!("ALTER TABLE profiles ADD COLUMN {name} {kind}"))?;
    }
    Ok(())
}

/// Stores written before frames keyed their nodes by name id: each name becomes the frame of
/// the same id, a bare name, so their nodes keep their meaning. A store has names without
/// frames only then (a write adds both in one transaction).
fn give_names_frames(conn: &Connection) -> Result<(), StoreError> {
    let frame_blocks: i64 =
        conn.query_row("SELECT COUNT(*) FROM frame_blocks", [], |r| r.get(0))?;
    let names: i64 = conn.query_row("SELECT COUNT(*) FROM names", [], |r| r.get(0))?;
    if frame_blocks > 0 || names == 0 {
        return Ok(());
    }
    let bare: Vec<Frame> = (0..names as u32).map(Frame::named).collect();
    conn.execute(
        "INSERT INTO frame_blocks(first_id, frames) VALUES (0, ?)",
        [frames::encode_frames(&bare)],
    )?;
    tracing::info!(names, "profile store: gave stored names their frames");
    Ok(())
}

/// Stores written before node blocks kept one `nodes` row per node: converts them to one block
/// per space in a single transaction (a crash midway leaves the old table in place).
fn migrate_node_rows(conn: &mut Connection) -> Result<(), StoreError> {
    let old: i64 = conn.query_row(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'nodes'",
        [],
        |r| r.get(0),
    )?;
    if old == 0 {
        return Ok(());
    }
    let tx = conn.transaction()?;
    {
        let mut blocks: Vec<(i64, Vec<(u32, u32)>)> = Vec::new();
        let mut stmt =
            tx.prepare("SELECT space_id, idx, parent, name_id FROM nodes ORDER BY space_id, idx")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let space_id: i64 = row.get(0)?;
            let (idx, parent, name): (u32, u32, u32) = (row.get(1)?, row.get(2)?, row.get(3)?);
            if blocks.last().is_none_or(|(id, _)| *id != space_id) {
                blocks.push((space_id, Vec::new()));
            }
            let nodes = &mut blocks.last_mut().expect("just pushed").1;
            if idx as usize != nodes.len() + 1 || parent >= idx {
                return Err(StoreError::Corrupt(codec::CorruptProfile(
                    "call-tree nodes are not numbered in order",
                )));
            }
            nodes.push((parent, name));
        }
        let mut insert =
            tx.prepare("INSERT INTO node_blocks(space_id, first_idx, nodes) VALUES (?, 1, ?)")?;
        for (space_id, nodes) in &blocks {
            insert.execute(params![space_id, codec::encode_nodes(1, nodes)])?;
        }
    }
    tx.execute("DROP TABLE nodes", [])?;
    tx.commit()?;
    tracing::info!("profile store: converted call-tree nodes to node blocks");
    Ok(())
}

/// Loads the catalog; at most `max_nodes` call-tree nodes (0: all) stay in memory, a space
/// with more is sealed as it loads (its nodes counted, not kept); frames and names, the last
/// `max_frames` or fewer of each (0: all), the ones before sealed as they load.
fn load_catalog(
    conn: &Connection,
    max_nodes: usize,
    max_frames: usize,
) -> Result<Catalog, StoreError> {
    let mut catalog = Catalog::default();
    {
        let mut stmt = conn.prepare("SELECT id, name FROM names ORDER BY id")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let name: String = row.get(1)?;
            // Ids are dense from 0 because they are assigned as the next free one.
            if id != catalog.name_count() as i64 {
                return Err(StoreError::Corrupt(codec::CorruptProfile(
                    "names are not numbered in order",
                )));
            }
            // Pushed, not interned: a string of a sealed generation may be there again.
            catalog.push_name(name.into());
            // Each kind on its own here: the frames are not loaded yet, nor the trees.
            if limits::exceeds(catalog.names.len(), max_frames) {
                catalog.seal_names();
            }
        }
    }
    {
        let mut stmt =
            conn.prepare("SELECT first_id, frames FROM frame_blocks ORDER BY first_id")?;
        let mut rows = stmt.query([])?;
        let names = catalog.name_count() as u32;
        while let Some(row) = rows.next()? {
            let first: i64 = row.get(0)?;
            if first != catalog.frame_count() as i64 {
                return Err(StoreError::Corrupt(codec::CorruptProfile(
                    "frame blocks do not follow each other",
                )));
            }
            let block = row.get_ref(1)?.as_blob().map_err(rusqlite::Error::from)?;
            let mut bad = false;
            frames::decode_frames(block, |frame| {
                let known = |id: u32| id == frames::NO_STRING || id < names;
                bad |= frame.name >= names
                    || ![frame.system_name, frame.file, frame.object, frame.build_id]
                        .into_iter()
                        .all(known);
                catalog.frames.push(frame);
            })?;
            if bad {
                return Err(StoreError::Corrupt(codec::CorruptProfile(
                    "a frame refers to a name that is not stored",
                )));
            }
            if limits::exceeds(catalog.frames.len(), max_frames) {
                catalog.seal_frames();
            }
        }
        // Only the generation kept: a frame of a sealed one may be there again.
        for position in 0..catalog.frames.len() {
            catalog.frame_ids.insert(&catalog.frames, position as u32);
        }
    }
    {
        let mut stmt = conn.prepare("SELECT id, profile_type, service_name FROM spaces")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let (profile_type, service): (String, String) = (row.get(1)?, row.get(2)?);
            // Two spaces of one key (a store written with one per sample type): new series use
            // the first, each existing series its own.
            catalog
                .space_ids
                .entry(space_key(&profile_type, &service))
                .or_insert(id);
            catalog.spaces.insert(id, Space::new(profile_type, service));
            catalog.next_space = catalog.next_space.max(id + 1);
        }
    }
    {
        let mut stmt = conn.prepare(
            "SELECT space_id, first_idx, nodes FROM node_blocks ORDER BY space_id, first_idx",
        )?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let space_id: i64 = row.get(0)?;
            let first: i64 = row.get(1)?;
            let Some(space) = catalog.spaces.get_mut(&space_id) else {
                continue;
            };
            // Blocks are written in one transaction with the nodes before them, so a gap or
            // overlap means the file was damaged.
            if first != space.len() as i64 {
                return Err(StoreError::Corrupt(codec::CorruptProfile(
                    "call-tree node blocks do not follow each other",
                )));
            }
            let block = row.get_ref(2)?.as_blob().map_err(rusqlite::Error::from)?;
            let Space {
                nodes,
                index,
                sealed,
                ..
            } = space;
            codec::decode_nodes(first as usize, block, |parent, name| {
                if *sealed > 0 {
                    *sealed += 1;
                } else {
                    nodes.push((parent, name));
                    index.insert(nodes, nodes.len() as u32 - 1);
                }
            })?;
            if space.sealed == 0 && limits::exceeds(space.nodes.len(), max_nodes) {
                space.seal();
            }
        }
    }
    catalog.seal_over(max_nodes, None);
    let mut ranges: HashMap<i64, (i64, i64)> = HashMap::new();
    {
        let mut stmt = conn.prepare(
            "SELECT series_id, MIN(time_ns), MAX(time_ns) FROM profiles GROUP BY series_id",
        )?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            ranges.insert(row.get(0)?, (row.get(1)?, row.get(2)?));
        }
    }
    {
        let mut stmt = conn.prepare("SELECT id, space_id, profile_type, labels FROM series")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let key: String = row.get(3)?;
            let labels: Vec<(String, String)> = serde_json::from_str(&key).unwrap_or_default();
            let (first_ns, last_ns) = ranges.get(&id).copied().unwrap_or((i64::MAX, i64::MIN));
            catalog.add_series(
                key,
                SeriesInfo {
                    id,
                    space: row.get(1)?,
                    profile_type: row.get(2)?,
                    labels,
                    first_ns,
                    last_ns,
                },
            );
            catalog.next_series = catalog.next_series.max(id + 1);
        }
    }
    Ok(catalog)
}

/// Looks up a profile row count, for tests and the benchmark.
impl Store {
    /// Every user setting (`settings.v1`), by name.
    pub fn user_settings(&self) -> Result<Vec<Setting>, StoreError> {
        self.with_reader(|conn| {
            let mut statement =
                conn.prepare("SELECT name, value, modified_at FROM settings ORDER BY name")?;
            let rows = statement.query_map([], |row| {
                Ok(Setting {
                    name: row.get(0)?,
                    value: row.get(1)?,
                    modified_ms: row.get(2)?,
                })
            })?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// Stores a setting, unless the stored one was changed later (as Pyroscope refuses an
    /// outdated write); a change without a time is stamped `now_ms`.
    pub fn set_user_setting(
        &self,
        mut setting: Setting,
        now_ms: i64,
    ) -> Result<Setting, StoreError> {
        if setting.name.is_empty()
            || setting.name.len() > MAX_SETTING_NAME
            || setting.value.len() > MAX_SETTING_VALUE
        {
            return Err(StoreError::InvalidSetting);
        }
        if setting.modified_ms <= 0 {
            setting.modified_ms = now_ms;
        }
        let writer = self.inner.writer.lock().unwrap_or_else(|p| p.into_inner());
        let stored: Option<i64> = writer
            .query_row(
                "SELECT modified_at FROM settings WHERE name = ?",
                [&setting.name],
                |row| row.get(0),
            )
            .optional()?;
        match stored {
            Some(stored_ms) if stored_ms > setting.modified_ms => {
                return Err(StoreError::SettingOutdated {
                    name: setting.name,
                    stored_ms,
                    modified_ms: setting.modified_ms,
                });
            }
            None => {
                let count: i64 =
                    writer.query_row("SELECT COUNT(*) FROM settings", [], |row| row.get(0))?;
                if count >= MAX_SETTINGS {
                    return Err(StoreError::InvalidSetting);
                }
            }
            Some(_) => {}
        }
        writer.execute(
            "INSERT OR REPLACE INTO settings(name, value, modified_at) VALUES (?, ?, ?)",
            rusqlite::params![setting.name, setting.value, setting.modified_ms],
        )?;
        Ok(setting)
    }

    pub fn profile_count(&self) -> Result<u64, StoreError> {
        self.with_reader(|conn| {
            Ok(conn
                .query_row("SELECT COUNT(*) FROM profiles", [], |r| r.get::<_, i64>(0))
                .optional()?
                .unwrap_or(0) as u64)
        })
    }
}

#[cfg(test)]
mod tests;
