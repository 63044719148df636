//! The embedded profile store: profiles per series on local disk, queried by the HTTP server.
//!
//! Engine: SQLite (bundled, WAL journal) in `<data dir>/profiles.db`; docs/architecture.md says
//! why. Layout, designed so a 24-hour merge reads little and adds fast:
//! - a *stack space* per (profile type, service_name) interns call stacks as a tree of nodes
//!   (parent node, function name); node 0 is the root, parents always have smaller ids;
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
pub mod ingest;
pub mod query;
pub mod selector;
pub mod sink;

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use foldhash::{HashMap, HashMapExt};
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

/// Default directory of the embedded store.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/profiler";
/// Default retention of stored profiles.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);
/// Default cap on the store's size on disk.
pub const DEFAULT_MAX_BYTES: u64 = 10 << 30;
/// Default period of enforcing the retention and the size cap.
pub const DEFAULT_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(60);
const DATABASE_FILE: &str = "profiles.db";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the profile store in {}: {message}", path.display())]
    Open { path: PathBuf, message: String },
    #[error("profile store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error(transparent)]
    Corrupt(#[from] codec::CorruptProfile),
    #[error(
        "invalid profile type `{0}`: expected name:sample_type:sample_unit:period_type:period_unit"
    )]
    InvalidProfileType(String),
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

/// One profile to store: stacks as paths of indexes into `names`, root first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewProfile {
    pub profile_type: Option<ProfileType>,
    /// Series labels without the derived `__*` ones; `service_name` is added when missing.
    pub labels: Vec<(String, String)>,
    pub time_ns: i64,
    pub duration_ns: i64,
    pub names: Vec<String>,
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
}

#[derive(Debug, Default)]
struct Space {
    profile_type: String,
    service_name: String,
    /// (parent, name id) per node; node 0 is the root.
    nodes: Vec<(u32, u32)>,
    index: HashMap<(u32, u32), u32>,
    /// Whole stacks (name ids, root first) → their leaf node: an agent sends mostly the same
    /// stacks every interval, so one lookup per stack replaces one per frame. Only a shortcut:
    /// cleared when it reaches [`MAX_CACHED_STACKS`] and whenever nodes are undone.
    leaf_by_stack: HashMap<Box<[u32]>, u32>,
}

/// Stacks remembered per space (about 150 bytes each).
const MAX_CACHED_STACKS: usize = 20_000;

impl Space {
    fn new(profile_type: String, service_name: String) -> Space {
        Space {
            profile_type,
            service_name,
            nodes: vec![(u32::MAX, 0)],
            index: HashMap::new(),
            leaf_by_stack: HashMap::new(),
        }
    }
}

#[derive(Debug, Default)]
struct Catalog {
    names: Vec<Arc<str>>,
    name_ids: HashMap<Arc<str>, u32>,
    spaces: HashMap<i64, Space>,
    space_ids: HashMap<(String, String), i64>,
    series: HashMap<i64, SeriesInfo>,
    series_ids: HashMap<String, i64>,
    next_space: i64,
    next_series: i64,
}

impl Catalog {
    fn intern_name(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.name_ids.get(name) {
            return id;
        }
        let id = self.names.len() as u32;
        let name: Arc<str> = name.into();
        self.names.push(name.clone());
        self.name_ids.insert(name, id);
        id
    }
}

/// What one write added to the catalog, to persist it and to undo it if the commit fails.
#[derive(Default)]
struct CatalogAdditions {
    names_before: usize,
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
    path: PathBuf,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    catalog: RwLock<Catalog>,
    counters: StoreCounters,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS names(id INTEGER PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spaces(id INTEGER PRIMARY KEY, profile_type TEXT NOT NULL,
    service_name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS node_blocks(space_id INTEGER NOT NULL, first_idx INTEGER NOT NULL,
    nodes BLOB NOT NULL, PRIMARY KEY(space_id, first_idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS series(id INTEGER PRIMARY KEY, space_id INTEGER NOT NULL,
    profile_type TEXT NOT NULL, labels TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles(id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL,
    time_ns INTEGER NOT NULL, duration_ns INTEGER NOT NULL, total INTEGER NOT NULL,
    stacks BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS profiles_by_series_time ON profiles(series_id, time_ns);
CREATE INDEX IF NOT EXISTS profiles_by_time ON profiles(time_ns);
";

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(Duration::from_secs(10))?;
    // WAL: readers never block the writer. synchronous=NORMAL: a commit is in the WAL file
    // before it returns, so it survives the process being killed (not necessarily power loss).
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "cache_size", -32_000)?;
    Ok(())
}

fn unix_now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

impl Store {
    /// Opens (or creates) the store in `settings.data_dir`.
    pub fn open(settings: StoreSettings) -> Result<Store, StoreError> {
        let open_error = |message: String| StoreError::Open {
            path: settings.data_dir.clone(),
            message,
        };
        std::fs::create_dir_all(&settings.data_dir).map_err(|e| open_error(e.to_string()))?;
        let path = settings.data_dir.join(DATABASE_FILE);
        let mut conn = Connection::open(&path).map_err(|e| open_error(e.to_string()))?;
        // Must precede the first table: lets deleted pages be returned to the file system.
        conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")
            .map_err(|e| open_error(e.to_string()))?;
        configure(&conn).map_err(|e| open_error(e.to_string()))?;
        conn.execute_batch(SCHEMA)
            .map_err(|e| open_error(e.to_string()))?;
        migrate_node_rows(&mut conn).map_err(|e| open_error(e.to_string()))?;
        let catalog = load_catalog(&conn).map_err(|e| open_error(e.to_string()))?;
        tracing::info!(
            path = %path.display(),
            series = catalog.series.len(),
            "profile store open"
        );
        Ok(Store {
            inner: Arc::new(Inner {
                settings,
                path,
                writer: Mutex::new(conn),
                readers: Mutex::new(Vec::new()),
                catalog: RwLock::new(catalog),
                counters: StoreCounters::default(),
            }),
        })
    }

    pub fn settings(&self) -> &StoreSettings {
        &self.inner.settings
    }

    pub fn counters(&self) -> &StoreCounters {
        &self.inner.counters
    }

    /// Stores profiles atomically: when this returns Ok, all are durable; on error, none is.
    pub fn ingest(&self, profiles: &[NewProfile]) -> Result<(), StoreError> {
        let result = self.ingest_inner(profiles);
        match &result {
            Ok(()) => self
                .inner
                .counters
                .profiles_ingested
                .fetch_add(profiles.len() as u64, Ordering::Relaxed),
            Err(_) => self
                .inner
                .counters
                .ingest_errors
                .fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    fn ingest_inner(&self, profiles: &[NewProfile]) -> Result<(), StoreError> {
        if profiles.is_empty() {
            return Ok(());
        }
        let mut writer = self.inner.writer.lock().unwrap_or_else(|p| p.into_inner());
        let mut additions = CatalogAdditions::default();
        let rows = {
            let mut catalog = self.write_catalog();
            additions.names_before = catalog.names.len();
            profiles
                .iter()
                .map(|profile| encode_profile(&mut catalog, &mut additions, profile))
                .collect::<Vec<_>>()
        };
        match self.persist(&mut writer, &additions, &rows) {
            Ok(()) => {
                let mut catalog = self.write_catalog();
                for row in &rows {
                    if let Some(series) = catalog.series.get_mut(&row.series) {
                        series.first_ns = series.first_ns.min(row.time_ns);
                        series.last_ns = series.last_ns.max(row.time_ns);
                    }
                }
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
            for (id, name) in catalog
                .names
                .iter()
                .enumerate()
                .skip(additions.names_before)
            {
                insert_name.execute(params![id as i64, name.as_ref()])?;
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
                if first < space.nodes.len() {
                    let block = codec::encode_nodes(first, &space.nodes[first..]);
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
                "INSERT INTO profiles(series_id, time_ns, duration_ns, total, stacks) \
                 VALUES (?, ?, ?, ?, ?)",
            )?;
            for row in rows {
                insert_profile.execute(params![
                    row.series,
                    row.time_ns,
                    row.duration_ns,
                    row.total,
                    row.stacks
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn undo(&self, additions: &CatalogAdditions) {
        let mut catalog = self.write_catalog();
        for id in &additions.series {
            if let Some(series) = catalog.series.remove(id) {
                catalog.series_ids.remove(&labels_key(&series.labels));
            }
        }
        for &(space_id, before) in &additions.nodes {
            if let Some(space) = catalog.spaces.get_mut(&space_id) {
                for &node in &space.nodes[before..] {
                    space.index.remove(&node);
                }
                space.nodes.truncate(before);
                space.leaf_by_stack.clear();
            }
        }
        for id in &additions.spaces {
            if let Some(space) = catalog.spaces.remove(id) {
                catalog
                    .space_ids
                    .remove(&(space.profile_type, space.service_name));
            }
        }
        let before = additions.names_before;
        for name in catalog.names.split_off(before) {
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
                conn.pragma_update(None, "cache_size", -32_000)?;
                conn
            }
        };
        let result = f(&conn);
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
            if let Some(series) = catalog.series.remove(&id) {
                catalog.series_ids.remove(&labels_key(&series.labels));
            }
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
            if let Some(space) = catalog.spaces.remove(&id) {
                catalog
                    .space_ids
                    .remove(&(space.profile_type, space.service_name));
            }
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
                    if let Err(err) = (Store { inner }).enforce_limits() {
                        tracing::warn!("{err}");
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
    profile: &NewProfile,
) -> ProfileRow {
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

    let space_key = (type_id.clone(), service.clone());
    let space_id = match catalog.space_ids.get(&space_key) {
        Some(&id) => id,
        None => {
            let id = catalog.next_space;
            catalog.next_space += 1;
            catalog
                .spaces
                .insert(id, Space::new(type_id.clone(), service));
            catalog.space_ids.insert(space_key, id);
            additions.spaces.push(id);
            id
        }
    };
    let key = labels_key(&labels);
    let series = match catalog.series_ids.get(&key) {
        Some(&id) => id,
        None => {
            let id = catalog.next_series;
            catalog.next_series += 1;
            catalog.series.insert(
                id,
                SeriesInfo {
                    id,
                    space: space_id,
                    profile_type: type_id,
                    labels,
                    first_ns: i64::MAX,
                    last_ns: i64::MIN,
                },
            );
            catalog.series_ids.insert(key, id);
            additions.series.push(id);
            id
        }
    };

    let name_ids: Vec<u32> = profile
        .names
        .iter()
        .map(|name| catalog.intern_name(name))
        .collect();
    let space = catalog
        .spaces
        .get_mut(&space_id)
        .expect("space just resolved");
    if !additions.nodes.iter().any(|(id, _)| *id == space_id) {
        additions.nodes.push((space_id, space.nodes.len()));
    }
    let mut values: HashMap<u32, i64> = HashMap::with_capacity(profile.stacks.len());
    let mut stack: Vec<u32> = Vec::new();
    for (path, value) in &profile.stacks {
        if *value == 0 {
            continue;
        }
        stack.clear();
        stack.extend(
            path.iter()
                .filter_map(|&local| name_ids.get(local as usize).copied()),
        );
        let node = match space.leaf_by_stack.get(stack.as_slice()) {
            Some(&leaf) => leaf,
            None => {
                let mut node = 0u32;
                for &name in &stack {
                    node = match space.index.get(&(node, name)) {
                        Some(&child) => child,
                        None => {
                            let child = space.nodes.len() as u32;
                            space.nodes.push((node, name));
                            space.index.insert((node, name), child);
                            child
                        }
                    };
                }
                if space.leaf_by_stack.len() >= MAX_CACHED_STACKS {
                    space.leaf_by_stack.clear();
                }
                space.leaf_by_stack.insert(stack.as_slice().into(), node);
                node
            }
        };
        // Saturating: values come from clients and may be extreme.
        let sum = values.entry(node).or_default();
        *sum = sum.saturating_add(*value);
    }
    let mut entries: Vec<(u32, i64)> = values.into_iter().filter(|(_, v)| *v != 0).collect();
    entries.sort_unstable();
    ProfileRow {
        series,
        time_ns: profile.time_ns,
        duration_ns: profile.duration_ns,
        total: entries
            .iter()
            .fold(0i64, |sum, (_, v)| sum.saturating_add(*v)),
        stacks: codec::encode(&entries),
    }
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

fn load_catalog(conn: &Connection) -> Result<Catalog, StoreError> {
    let mut catalog = Catalog::default();
    {
        let mut stmt = conn.prepare("SELECT id, name FROM names ORDER BY id")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let name: String = row.get(1)?;
            // Ids are dense from 0 because they are assigned as the vector's length.
            debug_assert_eq!(id as usize, catalog.names.len());
            catalog.intern_name(&name);
        }
    }
    {
        let mut stmt = conn.prepare("SELECT id, profile_type, service_name FROM spaces")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let (profile_type, service): (String, String) = (row.get(1)?, row.get(2)?);
            catalog
                .space_ids
                .insert((profile_type.clone(), service.clone()), id);
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
            if first != space.nodes.len() as i64 {
                return Err(StoreError::Corrupt(codec::CorruptProfile(
                    "call-tree node blocks do not follow each other",
                )));
            }
            let block = row.get_ref(2)?.as_blob().map_err(rusqlite::Error::from)?;
            let Space { nodes, index, .. } = space;
            codec::decode_nodes(first as usize, block, |parent, name| {
                index.insert((parent, name), nodes.len() as u32);
                nodes.push((parent, name));
            })?;
        }
    }
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
            catalog.series_ids.insert(key, id);
            catalog.series.insert(
                id,
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
