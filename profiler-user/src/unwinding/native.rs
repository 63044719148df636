//! Keeps the BPF unwinder's maps in step with the processes on the machine.
//!
//! One unwind table per ELF file (keyed by build id, else by file identity) is placed in the
//! shared row array, so 100 processes of the same binary cost one table. Tables are built on
//! first sight of a mapping (or loaded from the on-disk cache) and placed while the row array
//! has room. Room is given by use, not by mapping: a process maps many files it never runs (a
//! CPU-only PyTorch maps a gigabyte of CUDA libraries), so the pipeline reports the files its
//! samples' frames are in ([`NativeTables::touch`]) and the file whose missing table made BPF
//! fall back to frame pointers ([`NativeTables::demand`]). A demanded table evicts tables no
//! sample has used for [`MIN_RESIDENCY`]; a table nobody demands waits for free room. Each
//! process's executable mappings are registered in the LPM trie as (pid, address range) →
//! (table, load bias); exits and pid reuse remove them, and a table no registered process maps
//! lets go of its file.
// Looked up for every sample's frames: a fast hash (keys come from our own snapshots).
use foldhash::{HashMap, HashMapExt};
use std::{
    collections::HashSet,
    ops::Range,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use object::{Object, ObjectSegment};
use profiler_common::unwind::{
    MAPPING_FRAME_POINTERS, MAPPING_HAS_TABLE, MAPPING_PROCESS_MARKER,
    MAPPING_RELIABLE_FRAME_POINTERS, MAPPING_TABLE_PENDING, MappingKey, MappingValue, PAGE_SHIFT,
    PageEntry, PageKey, ROWS_PER_CHUNK, RowChunk, RowSource, UnwindRow, find_row,
};

use super::read_cache::{CachedReads, ReadCacheStats};
use super::tables::{
    BuildLimits, MappedInput, TableCache, TableError, UnwindTable, build_table_within,
    check_fde_count,
};
use crate::{
    bpf::UnwindMaps,
    model::{FileId, MappedFile, Mapping, Pid, ProcessInfo},
};

/// Counters and gauges of the table manager, for the self-metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NativeTableStats {
    pub tables_loaded: u64,
    pub tables_built: u64,
    pub tables_from_cache: u64,
    pub tables_evicted: u64,
    /// Files whose table could not be built (malformed CFI, unreadable): frame pointers.
    pub tables_failed: u64,
    /// Files whose table alone exceeds the memory budget: frame pointers.
    pub tables_too_large: u64,
    /// Placements put off because the budget was full (of tables samples use, or with nobody
    /// asking for this one yet).
    pub tables_deferred: u64,
    /// Tables asked for by a sample that fell back to frame pointers in their file.
    pub tables_demanded: u64,
    /// Files the manager knows (placed, built but waiting, building, unusable).
    pub table_slots: u64,
    /// Samples of processes not registered yet that put their registration off (most
    /// processes on a busy host are never sampled again).
    pub registrations_put_off: u64,
    /// Processes registered so far (each a map update per address block of its mappings, and
    /// the deletes at its exit).
    pub registrations: u64,
    pub rows_in_use: u64,
    pub row_capacity: u64,
    pub processes_registered: u64,
    pub mapping_prefixes: u64,
    pub map_errors: u64,
    pub build_time: Duration,
    /// The late unwinder's reads of placed tables (bounded).
    pub read_cache: ReadCacheStats,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum TableKey {
    BuildId(Arc<str>),
    File(FileId),
    Vdso,
}

/// How file offsets relate to the ELF's virtual addresses, per PT_LOAD segment.
#[derive(Clone, Debug, Default)]
struct Segments(Vec<(u64, u64, u64)>); // (file offset, virtual address, file size)

impl Segments {
    fn of(elf: &object::File<'_>) -> Segments {
        Segments(
            elf.segments()
                .map(|s| {
                    let (offset, size) = s.file_range();
                    (offset, s.address(), size)
                })
                .collect(),
        )
    }

    /// PC - load_bias = virtual address, for a mapping of `file_offset` at `start`.
    fn load_bias(&self, start: u64, file_offset: u64) -> Option<u64> {
        // The kernel maps a segment from its page-aligned offset, so the mapping's offset is the
        // segment's offset rounded down; containment alone would pick a neighbouring segment
        // that shares the page.
        let &(offset, vaddr, _) = self
            .0
            .iter()
            .find(|(offset, _, _)| offset & !0xfff == file_offset)
            .or_else(|| {
                self.0.iter().find(|(offset, _, size)| {
                    (*offset..offset + size.max(&1)).contains(&file_offset)
                })
            })?;
        Some(
            start
                .wrapping_sub(file_offset)
                .wrapping_sub(vaddr.wrapping_sub(offset)),
        )
    }
}

#[derive(Debug)]
enum SlotState {
    Loaded {
        /// The chunk ranges holding the table (several when it was split between free ranges).
        chunks: Vec<Range<u32>>,
        pages: Vec<u32>,
    },
    /// Being built (or read from the cache) on the builder thread.
    Building,
    /// Built but not in the maps (evicted, or never placed for lack of room): mappings point at
    /// its id, BPF finds no page and reports the miss, and a demand reads it again.
    Evicted,
    /// No usable table: the mappings use frame pointers.
    Unusable,
}

#[derive(Debug)]
struct TableSlot {
    id: u32,
    state: SlotState,
    segments: Segments,
    /// The table says the file's frames can be walked with RBP alone.
    reliable_frame_pointers: bool,
    last_used: u64,
    /// When a sample last had a frame in the file: a table sampled within the minimum
    /// residency is never evicted, so a budget too small for the working set degrades to
    /// frame pointers for some files instead of rebuilding tables in a loop.
    sampled_at: Option<Instant>,
    /// A sample asked for this table since it was last placed.
    demanded: bool,
    /// No rebuild before this (set when a demanded table could not be placed).
    retry_after: Option<Instant>,
    /// Registered processes mapping the file.
    registrations: u32,
    /// The files (several copies of one build id) that use this table.
    files: Vec<FileId>,
    /// The file to build from; dropped while no registered process maps it, so the file is
    /// not held open for a table that may never be needed again.
    source: Option<Arc<MappedFile>>,
    /// Its build was asked for at the front of the line (a held sample waits for it).
    urgent: bool,
}

impl TableSlot {
    /// Used by a sample within `window`.
    fn is_hot(&self, window: Duration) -> bool {
        self.sampled_at.is_some_and(|at| at.elapsed() < window)
    }
}

#[derive(Debug)]
struct Registration {
    /// The snapshot registered (by address): a new snapshot means re-registering.
    snapshot: usize,
    prefixes: Vec<(u32, MappingKey)>,
    /// Per mapping of the snapshot: the value its prefixes hold and which of `prefixes` they
    /// are, so a table coming in updates only the prefixes of the mappings that use it.
    values: Vec<(MappingValue, Range<usize>)>,
    /// The tables of the registered mappings (each counted in its slot's `registrations`).
    tables: Vec<TableKey>,
    /// Tables this registration went without because they were still being built; when one
    /// is ready the process is registered again.
    waiting_for: Vec<TableKey>,
}

/// Part of a table placed in one contiguous chunk range: pages `pages` (indexes into the
/// table's pages), their rows packed from the range's first chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Extent {
    chunks: Range<u32>,
    pages: Range<usize>,
}

/// First-fit allocator of contiguous chunk ranges in the row array.
#[derive(Debug)]
struct ChunkAllocator {
    free: Vec<Range<u32>>,
    capacity: u32,
}

impl ChunkAllocator {
    fn new(capacity: u32) -> Self {
        ChunkAllocator {
            free: std::iter::once(0..capacity).collect(),
            capacity,
        }
    }

    #[cfg(test)]
    fn allocate(&mut self, chunks: u32) -> Option<Range<u32>> {
        let index = self.free.iter().position(|r| r.len() as u32 >= chunks)?;
        let range = &mut self.free[index];
        let allocated = range.start..range.start + chunks;
        range.start += chunks;
        if range.start == range.end {
            self.free.remove(index);
        }
        Some(allocated)
    }

    /// Room for a table whose pages have `page_rows` rows each: its pages in order, packed
    /// into free ranges first fit, split only between pages. `None` (nothing allocated) when
    /// the pages do not fit.
    fn allocate_pages(&mut self, page_rows: &[u32]) -> Option<Vec<Extent>> {
        let rows_per_chunk = ROWS_PER_CHUNK as u64;
        let mut extents = Vec::new();
        let mut free = self.free.clone().into_iter();
        let mut range = free.next()?;
        let mut page = 0;
        while page < page_rows.len() {
            // Whole pages from `page` on that fit in what is left of `range`.
            let capacity = u64::from(range.end - range.start) * rows_per_chunk;
            let mut rows = 0u64;
            let mut end = page;
            while end < page_rows.len() && rows + u64::from(page_rows[end]) <= capacity {
                rows += u64::from(page_rows[end]);
                end += 1;
            }
            if end == page {
                // Not even this page fits here: the next free range.
                range = free.next()?;
                continue;
            }
            let chunks = rows.div_ceil(rows_per_chunk) as u32;
            extents.push(Extent {
                chunks: range.start..range.start + chunks,
                pages: page..end,
            });
            range.start += chunks;
            page = end;
            if range.start == range.end {
                match free.next() {
                    Some(next) => range = next,
                    None if page < page_rows.len() => return None,
                    None => break,
                }
            }
        }
        for extent in &extents {
            self.take(extent.chunks.clone());
        }
        Some(extents)
    }

    /// Removes `chunks` (inside one free range) from the free list.
    fn take(&mut self, chunks: Range<u32>) {
        let Some(index) = self
            .free
            .iter()
            .position(|free| free.start <= chunks.start && chunks.end <= free.end)
        else {
            return;
        };
        let free = self.free.remove(index);
        let mut at = index;
        for piece in [free.start..chunks.start, chunks.end..free.end] {
            if !piece.is_empty() {
                self.free.insert(at, piece);
                at += 1;
            }
        }
    }

    fn release(&mut self, chunks: Range<u32>) {
        let at = self.free.partition_point(|r| r.start < chunks.start);
        self.free.insert(at, chunks);
        // Merge neighbours so large tables keep fitting.
        let mut merged: Vec<Range<u32>> = Vec::with_capacity(self.free.len());
        for range in self.free.drain(..) {
            match merged.last_mut() {
                Some(last) if last.end == range.start => last.end = range.end,
                _ => merged.push(range),
            }
        }
        self.free = merged;
    }

    fn in_use(&self) -> u32 {
        self.capacity - self.free.iter().map(|r| r.len() as u32).sum::<u32>()
    }
}

/// The LPM prefixes covering `[start, end)`, as (prefix length in address bits, base address).
pub fn address_prefixes(start: u64, end: u64) -> Vec<(u32, u64)> {
    let mut prefixes = Vec::new();
    let mut addr = start;
    while addr < end {
        let mut bits = if addr == 0 {
            63
        } else {
            addr.trailing_zeros().min(63)
        };
        while bits > 0 && addr.checked_add(1u64 << bits).is_none_or(|next| next > end) {
            bits -= 1;
        }
        prefixes.push((64 - bits, addr));
        addr += 1u64 << bits;
    }
    prefixes
}

pub struct NativeTables<M: UnwindMaps> {
    maps: CachedReads<M>,
    builder: TableBuilder,
    allocator: ChunkAllocator,
    slots: HashMap<TableKey, TableSlot>,
    /// Which table each mapped file uses (for [`Self::touch`] and [`Self::demand`]).
    file_tables: HashMap<FileId, TableKey>,
    next_table_id: u32,
    tick: u64,
    processes: HashMap<Pid, Registration>,
    builds_finished: u64,
    /// Processes sampled but not registered yet: when first seen and how many samples (see
    /// [`Self::sync`]).
    sightings: HashMap<Pid, (Instant, u32)>,
    has_vdso: bool,
    min_residency: Duration,
    stats: NativeTableStats,
}

/// A table sampled within this time is not evicted for another one.
pub const MIN_RESIDENCY: Duration = Duration::from_secs(10);
/// Processes remembered as sampled and not registered yet, at most.
const MAX_SIGHTINGS: usize = 8192;
/// The sample at which a process is registered (see [`NativeTables::sync`]).
pub const REGISTER_AT_SAMPLE: u32 = 4;

/// Slots kept at most; beyond, those no registered process maps are forgotten.
pub const MAX_TABLE_SLOTS: usize = 16_384;

/// What [`NativeTables::row_at`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowLookup {
    Row(UnwindRow),
    /// The file has no table (no CFI, anonymous code): frame pointers are all there is.
    NoTable,
    /// The table is being built or read again (it has now been asked for): try later.
    Pending,
    /// The table has no row for the address (outside its FDEs).
    NoRow,
}

/// The row array as the maps hold it, a chunk at a time (a binary search stays in one or two
/// chunks), each shared with the read cache.
struct MapRows<'a, M: UnwindMaps> {
    maps: &'a CachedReads<M>,
    chunk: std::cell::RefCell<Option<(u32, std::rc::Rc<RowChunk>)>>,
}

impl<M: UnwindMaps> RowSource for MapRows<'_, M> {
    fn row(&self, index: u32) -> Option<UnwindRow> {
        let chunk_index = index / ROWS_PER_CHUNK as u32;
        let mut cached = self.chunk.borrow_mut();
        if cached.as_ref().is_none_or(|(i, _)| *i != chunk_index) {
            *cached = Some((chunk_index, self.maps.shared_row_chunk(chunk_index).ok()?));
        }
        cached
            .as_ref()
            .map(|(_, chunk)| chunk.rows[index as usize % ROWS_PER_CHUNK])
    }
}

/// A table to build: the file (none for the vDSO).
struct BuildRequest {
    key: TableKey,
    source: Option<Arc<MappedFile>>,
}

/// Why a file got no table: its message, and whether it was only too large for the budget.
#[derive(Debug)]
struct BuildFailure {
    message: String,
    too_large: bool,
}

impl From<String> for BuildFailure {
    fn from(message: String) -> Self {
        BuildFailure {
            message,
            too_large: false,
        }
    }
}

impl From<TableError> for BuildFailure {
    fn from(err: TableError) -> Self {
        BuildFailure {
            too_large: err.is_too_large(),
            message: err.to_string(),
        }
    }
}

struct BuildResult {
    key: TableKey,
    table: Result<(UnwindTable, Segments), BuildFailure>,
    from_cache: bool,
    elapsed: Duration,
}

/// Files at least this large (libtorch_cpu, libLLVM, chromium: their tables take tens of seconds
/// to build on a busy host) are built on a thread of their own, so the small tables of the
/// processes that start meanwhile are never queued behind them.
const LARGE_FILE_BYTES: u64 = 64 << 20;

/// Builds tables on threads of their own, so a large library (or hundreds of processes
/// appearing at once) never holds up sample processing. Two threads: one for files of at least
/// [`LARGE_FILE_BYTES`], one for the rest. Each has two lines: tables a held sample waits for
/// go before those registrations asked for, which on a busy host can be hundreds of files long.
struct TableBuilder {
    small: BuildLine,
    large: BuildLine,
    /// [`LARGE_FILE_BYTES`] but in tests.
    large_file_bytes: u64,
    results: crossbeam_channel::Receiver<BuildResult>,
    /// Set when the manager goes (the agent stops): the builds under way end within a few
    /// thousand FDEs and the requests still queued are dropped, not built.
    cancel: Arc<std::sync::atomic::AtomicBool>,
}

/// One builder thread and its two lines.
struct BuildLine {
    urgent: Option<crossbeam_channel::Sender<BuildRequest>>,
    requests: Option<crossbeam_channel::Sender<BuildRequest>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TableBuilder {
    fn spawn(
        cache: Option<TableCache>,
        vdso: Option<Arc<[u8]>>,
        mut limits: BuildLimits,
        large_file_bytes: u64,
    ) -> TableBuilder {
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        limits.cancel = Some(cancel.clone());
        let (outgoing, results) = crossbeam_channel::unbounded();
        let small = BuildLine::spawn(
            "unwind-tables",
            cache.clone(),
            vdso.clone(),
            limits.clone(),
            outgoing.clone(),
        );
        let large = BuildLine::spawn("unwind-large", cache, vdso, limits, outgoing);
        TableBuilder {
            small,
            large,
            large_file_bytes,
            results,
            cancel,
        }
    }

    fn submit(&self, request: BuildRequest, urgent: bool) {
        // The same file always goes to the same thread, which builds it once.
        let size = request
            .source
            .as_deref()
            .and_then(|file| file.handle.as_ref())
            .and_then(|handle| handle.metadata().ok())
            .map_or(0, |meta| meta.len());
        let line = if size >= self.large_file_bytes {
            &self.large
        } else {
            &self.small
        };
        line.submit(request, urgent);
    }
}

impl BuildLine {
    fn spawn(
        name: &str,
        cache: Option<TableCache>,
        vdso: Option<Arc<[u8]>>,
        limits: BuildLimits,
        outgoing: crossbeam_channel::Sender<BuildResult>,
    ) -> BuildLine {
        let cancelled = limits
            .cancel
            .clone()
            .unwrap_or_else(|| Arc::new(std::sync::atomic::AtomicBool::new(false)));
        let (requests, incoming) = crossbeam_channel::unbounded::<BuildRequest>();
        let (urgent, incoming_urgent) = crossbeam_channel::unbounded::<BuildRequest>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // Built from the urgent line while also waiting in the other: built once.
                let mut built_early: HashSet<TableKey> = HashSet::new();
                loop {
                    let request = crossbeam_channel::select_biased! {
                        recv(incoming_urgent) -> request => match request {
                            Ok(request) => {
                                built_early.insert(request.key.clone());
                                request
                            }
                            Err(_) => break,
                        },
                        recv(incoming) -> request => match request {
                            Ok(request) if built_early.remove(&request.key) => continue,
                            Ok(request) => request,
                            Err(_) => break,
                        },
                    };
                    if cancelled.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    if incoming.is_empty() {
                        built_early.clear();
                    }
                    let started = Instant::now();
                    let (table, from_cache) = read_table(
                        &request.key,
                        request.source.as_deref(),
                        cache.as_ref(),
                        vdso.as_deref(),
                        &limits,
                    );
                    // Let go of the file before answering: the manager decides who holds it.
                    drop(request.source);
                    let result = BuildResult {
                        key: request.key,
                        table,
                        from_cache,
                        elapsed: started.elapsed(),
                    };
                    if outgoing.send(result).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning an unwind-table builder thread");
        BuildLine {
            urgent: Some(urgent),
            requests: Some(requests),
            thread: Some(thread),
        }
    }

    fn submit(&self, request: BuildRequest, urgent: bool) {
        let line = if urgent { &self.urgent } else { &self.requests };
        if let Some(line) = line {
            let _ = line.send(request);
        }
    }

    /// Closes the lines and waits for the thread (its build under way is cancelled).
    fn stop(&mut self) {
        self.urgent = None;
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for TableBuilder {
    fn drop(&mut self) {
        self.cancel
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.small.stop();
        self.large.stop();
    }
}

impl<M: UnwindMaps> NativeTables<M> {
    pub fn new(maps: M, cache_dir: Option<&Path>) -> Self {
        let capacity = maps.row_chunk_capacity();
        let vdso = own_vdso();
        NativeTables {
            maps: CachedReads::new(maps),
            has_vdso: vdso.is_some(),
            builder: TableBuilder::spawn(
                cache_dir.map(TableCache::new),
                vdso,
                BuildLimits::for_row_capacity(capacity as usize * ROWS_PER_CHUNK),
                LARGE_FILE_BYTES,
            ),
            builds_finished: 0,
            allocator: ChunkAllocator::new(capacity),
            slots: HashMap::new(),
            file_tables: HashMap::new(),
            next_table_id: 1,
            tick: 0,
            processes: HashMap::new(),
            sightings: HashMap::new(),
            min_residency: MIN_RESIDENCY,
            stats: NativeTableStats {
                row_capacity: u64::from(capacity) * ROWS_PER_CHUNK as u64,
                ..Default::default()
            },
        }
    }

    pub fn stats(&self) -> NativeTableStats {
        let mut stats = self.stats.clone();
        stats.rows_in_use = u64::from(self.allocator.in_use()) * ROWS_PER_CHUNK as u64;
        stats.processes_registered = self.processes.len() as u64;
        stats.table_slots = self.slots.len() as u64;
        stats.read_cache = self.maps.stats();
        stats
    }

    /// A sample had a frame in `file` that its table unwound: keeps the table resident.
    pub fn touch(&mut self, file: &MappedFile) {
        if let Some(slot) = self
            .file_tables
            .get(&file.id)
            .and_then(|key| self.slots.get_mut(key))
        {
            slot.sampled_at = Some(Instant::now());
        }
    }

    /// The row the BPF unwinder would use at `pc` in `mapping` (a PC of the process, already
    /// `- 1` for return addresses), read back from the maps, for the agent's late unwinder.
    pub fn row_at(&mut self, mapping: &Mapping, pc: u64) -> RowLookup {
        let key = match &mapping.file {
            Some(file) => match self.file_tables.get(&file.id) {
                Some(key) => key.clone(),
                // A process not registered (yet): its file's table is asked for now.
                None => {
                    let key = table_key(file);
                    self.ensure_table(&key, Some(file.clone()), true);
                    self.link_file(file.id, &key);
                    key
                }
            },
            None if &*mapping.name == "[vdso]" && self.has_vdso => {
                self.ensure_table(&TableKey::Vdso, None, true);
                TableKey::Vdso
            }
            None => return RowLookup::NoTable,
        };
        let Some(slot) = self.slots.get(&key) else {
            return RowLookup::NoTable;
        };
        match slot.state {
            SlotState::Loaded { .. } => {}
            SlotState::Unusable => return RowLookup::NoTable,
            SlotState::Building | SlotState::Evicted => {
                if let Some(file) = &mapping.file {
                    let file = file.clone();
                    self.demand(&file);
                }
                return RowLookup::Pending;
            }
        }
        let Some(load_bias) = slot.segments.load_bias(mapping.start, mapping.file_offset) else {
            return RowLookup::NoTable;
        };
        let file_pc = pc.wrapping_sub(load_bias);
        let page_key = PageKey {
            table_id: slot.id,
            page: (file_pc >> PAGE_SHIFT) as u32,
        };
        let page = match self.maps.read_page(page_key) {
            Ok(Some(page)) => page,
            Ok(None) => return RowLookup::NoRow,
            Err(_) => {
                self.stats.map_errors += 1;
                return RowLookup::NoRow;
            }
        };
        let rows = MapRows {
            maps: &self.maps,
            chunk: std::cell::RefCell::new(None),
        };
        match find_row(&rows, page.first_row, page.row_count, file_pc as u16) {
            Some(row) => RowLookup::Row(row),
            None => RowLookup::NoRow,
        }
    }

    /// Whether `file` has (or will have) an unwind table: its frames' callers are not to be
    /// taken from the frame-pointer chain. False for files without CFI and unknown files.
    pub fn has_cfi(&self, file: &MappedFile) -> bool {
        self.file_tables
            .get(&file.id)
            .and_then(|key| self.slots.get(key))
            .is_some_and(|slot| !matches!(slot.state, SlotState::Unusable))
    }

    /// BPF unwound a frame in `file` with frame pointers because the file's table was not in
    /// the maps (still building, evicted, never placed): bring it in, evicting tables no
    /// sample uses if the budget is full.
    pub fn demand(&mut self, file: &Arc<MappedFile>) {
        let Some(key) = self.file_tables.get(&file.id).cloned() else {
            return;
        };
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        slot.sampled_at = Some(Instant::now());
        match slot.state {
            SlotState::Loaded { .. } | SlotState::Unusable => return,
            // Queued behind registrations' tables: asked for again at the front of the line.
            SlotState::Building => {
                slot.demanded = true;
                if !slot.urgent {
                    self.ensure_table(&key, Some(file.clone()), true);
                }
                return;
            }
            SlotState::Evicted if slot.retry_after.is_some_and(|at| Instant::now() < at) => {
                return;
            }
            SlotState::Evicted => {}
        }
        slot.demanded = true;
        self.stats.tables_demanded += 1;
        self.tick += 1;
        self.ensure_table(&key, Some(file.clone()), true);
    }

    /// Overrides [`MIN_RESIDENCY`].
    pub fn with_min_residency(mut self, min_residency: Duration) -> Self {
        self.min_residency = min_residency;
        self
    }

    pub fn maps(&self) -> &M {
        self.maps.inner()
    }

    /// Makes BPF unwind `process` with its current snapshot; cheap when already done. Tables
    /// not built yet are requested; until they are ready BPF stops at those mappings (the
    /// agent finishes from a stack copy) and the process is registered again once they are.
    ///
    /// A process is registered at its [`REGISTER_AT_SAMPLE`]th sample, not its first: a
    /// registration costs a map update per address block of each mapping (about 30 for a small
    /// program, measured at about 100 µs of agent CPU with the deletes at its exit), while a
    /// late walk from a sample's stack copy costs about 6 µs, and on a busy host most processes
    /// are sampled once or twice in their life (the host benchmark registered 60 processes a
    /// second at the second sample). The samples before are unwound by the late walk from
    /// the same tables; only a stack deeper than the copy ends early there, marked truncated.
    ///
    /// Each call counts one sample: a sample whose stack is looked at again (its walk finished
    /// after a refresh, its frames symbolized after its late walk) is [`Self::resync`]ed.
    pub fn sync(&mut self, process: &Arc<ProcessInfo>) {
        if !self.processes.contains_key(&process.pid) && !process.is_kernel_thread {
            if self.sighting(process.pid) < REGISTER_AT_SAMPLE {
                self.stats.registrations_put_off += 1;
                return;
            }
            self.sightings.remove(&process.pid);
        }
        self.register(process);
    }

    /// [`Self::sync`] for a sample already counted: keeps a registration current with
    /// `process` (a new snapshot, tables come in) without counting another sample towards one.
    pub fn resync(&mut self, process: &Arc<ProcessInfo>) {
        if self.processes.contains_key(&process.pid) {
            self.register(process);
        }
    }

    /// Counts a sample of a process not registered; returns its samples so far (bounded: the
    /// processes first seen longest ago go first).
    fn sighting(&mut self, pid: Pid) -> u32 {
        if self.sightings.len() >= MAX_SIGHTINGS && !self.sightings.contains_key(&pid) {
            let now = Instant::now();
            self.sightings
                .retain(|_, (at, _)| now.duration_since(*at) < Duration::from_secs(10));
            if self.sightings.len() >= MAX_SIGHTINGS {
                self.sightings.clear();
            }
        }
        let (_, samples) = self.sightings.entry(pid).or_insert((Instant::now(), 0));
        *samples += 1;
        *samples
    }

    fn register(&mut self, process: &Arc<ProcessInfo>) {
        self.poll_builds();
        let snapshot = Arc::as_ptr(process) as usize;
        if let Some(registration) = self.processes.get(&process.pid)
            && registration.snapshot == snapshot
            && registration.waiting_for.iter().all(|key| {
                matches!(
                    self.slots.get(key).map(|s| &s.state),
                    Some(SlotState::Building)
                )
            })
        {
            return;
        }
        if process.is_kernel_thread {
            return;
        }
        if self
            .processes
            .get(&process.pid)
            .is_some_and(|r| r.snapshot == snapshot && r.values.len() == process.mappings.len())
        {
            self.update_registration(process);
            return;
        }
        // The old prefixes go first (the new ones may have the same keys); the old tables are
        // released last, so a table both registrations use is never forgotten in between.
        let previous = self.processes.remove(&process.pid);
        if let Some(previous) = &previous {
            self.remove_prefixes(previous);
        }
        self.tick += 1;
        let mut entries = Vec::new();
        let mut ranges = Vec::with_capacity(process.mappings.len());
        let mut tables = Vec::new();
        let mut waiting_for = Vec::new();
        for mapping in &process.mappings {
            let (value, key, waiting) = self.mapping_value(mapping);
            if let Some(key) = key
                && !tables.contains(&key)
                && let Some(slot) = self.slots.get_mut(&key)
            {
                slot.registrations += 1;
                tables.push(key);
            }
            waiting_for.extend(waiting);
            let first = entries.len();
            for (bits, base) in address_prefixes(mapping.start, mapping.end) {
                entries.push((32 + bits, MappingKey::new(process.pid.0, base), value));
            }
            ranges.push((value, first..entries.len()));
        }
        // The marker last: until it is there BPF takes the process for unregistered and sends
        // stack copies instead of taking a missing mapping for JIT code.
        let marker_value = MappingValue {
            flags: MAPPING_PROCESS_MARKER,
            ..MappingValue::default()
        };
        entries.push((32, MappingKey::new(process.pid.0, 0), marker_value));
        // All in one go where the kernel takes batches (in this order, the marker last).
        let failed = self.maps.insert_mappings(&entries);
        for (index, err) in &failed {
            self.stats.map_errors += 1;
            let what = if *index + 1 == entries.len() {
                "a process"
            } else {
                "a mapping"
            };
            tracing::debug!(pid = process.pid.0, "cannot register {what}: {err}");
        }
        // The prefixes that went in, and each mapping's among them.
        let mut inserted = vec![true; entries.len()];
        for (index, _) in &failed {
            inserted[*index] = false;
        }
        let mut prefixes = Vec::with_capacity(entries.len());
        let mut position = Vec::with_capacity(entries.len() + 1);
        for (index, &(prefix_len, key, _)) in entries.iter().enumerate() {
            position.push(prefixes.len());
            if inserted[index] {
                prefixes.push((prefix_len, key));
            }
        }
        position.push(prefixes.len());
        let values: Vec<_> = ranges
            .into_iter()
            .map(|(value, range)| (value, position[range.start]..position[range.end]))
            .collect();
        self.stats.mapping_prefixes += prefixes.len() as u64;
        if previous.is_none() {
            self.stats.registrations += 1;
        }
        self.processes.insert(
            process.pid,
            Registration {
                snapshot,
                prefixes,
                values,
                tables,
                waiting_for,
            },
        );
        if let Some(previous) = previous {
            self.release_tables(previous.tables);
        }
    }

    /// The same snapshot registered again because tables it waited for are in: only the
    /// prefixes of mappings whose value changed are written (in place; each update is atomic,
    /// and the old value, a pending table, is right until then). A process with a hundred
    /// libraries would otherwise rewrite thousands of trie entries for every table that lands.
    fn update_registration(&mut self, process: &Arc<ProcessInfo>) {
        let Some(mut registration) = self.processes.remove(&process.pid) else {
            return;
        };
        self.tick += 1;
        let mut waiting_for = Vec::new();
        for (index, mapping) in process.mappings.iter().enumerate() {
            let (value, _, waiting) = self.mapping_value(mapping);
            waiting_for.extend(waiting);
            let (registered, range) = &mut registration.values[index];
            if *registered == value {
                continue;
            }
            *registered = value;
            let entries: Vec<_> = registration.prefixes[range.clone()]
                .iter()
                .map(|&(prefix_len, key)| (prefix_len, key, value))
                .collect();
            for (_, err) in self.maps.insert_mappings(&entries) {
                self.stats.map_errors += 1;
                tracing::debug!(pid = process.pid.0, "cannot update a mapping: {err}");
            }
        }
        registration.waiting_for = waiting_for;
        self.processes.insert(process.pid, registration);
    }

    /// Like [`Self::sync`], but first waits (up to `timeout`) for the process's tables, so
    /// even its first samples unwind from them. Used before sampling starts.
    pub fn sync_waiting(&mut self, process: &Arc<ProcessInfo>, timeout: Duration) {
        self.register(process);
        let deadline = Instant::now() + timeout;
        while self
            .processes
            .get(&process.pid)
            .is_some_and(|r| !r.waiting_for.is_empty())
            && let Some(left) = deadline.checked_duration_since(Instant::now())
        {
            match self.builder.results.recv_timeout(left) {
                Ok(result) => self.finish_build(result),
                Err(_) => break,
            }
            self.register(process);
        }
    }

    /// Builds finished so far (placed, failed or put off): held samples are worth walking
    /// again when this changes.
    pub fn builds_finished(&self) -> u64 {
        self.builds_finished
    }

    /// Whether the builder has tables to finish.
    pub fn building(&self) -> bool {
        self.slots
            .values()
            .any(|slot| matches!(slot.state, SlotState::Building))
    }

    /// Waits up to `timeout` for the builder to finish a table, and places what it finished.
    /// False when nothing came.
    pub fn wait_for_build(&mut self, timeout: Duration) -> bool {
        match self.builder.results.recv_timeout(timeout) {
            Ok(result) => {
                self.finish_build(result);
                self.poll_builds();
                true
            }
            Err(_) => false,
        }
    }

    /// Places tables the builder thread has finished.
    pub fn poll_builds(&mut self) {
        while let Ok(result) = self.builder.results.try_recv() {
            self.finish_build(result);
        }
    }

    fn finish_build(&mut self, result: BuildResult) {
        self.stats.build_time += result.elapsed;
        self.builds_finished += 1;
        // A second build of one table (asked for again at the front of the line while the
        // first was under way) finds it placed already.
        let Some(slot) = self
            .slots
            .get(&result.key)
            .filter(|slot| matches!(slot.state, SlotState::Building))
        else {
            return;
        };
        let (id, source) = (slot.id, slot.source.clone());
        let name = source
            .as_ref()
            .map(|f| f.path.to_string())
            .unwrap_or_else(|| "[vdso]".into());
        let demanded = slot.demanded || slot.is_hot(self.min_residency);
        let (state, segments, reliable_frame_pointers) = match result.table {
            Ok((table, segments)) => {
                if result.from_cache {
                    self.stats.tables_from_cache += 1;
                } else {
                    self.stats.tables_built += 1;
                }
                let reliable = table.frame_pointers_reliable();
                (self.place(id, &table, &name, demanded), segments, reliable)
            }
            Err(failure) if failure.too_large => {
                self.stats.tables_too_large += 1;
                tracing::warn!(
                    file = %name,
                    "unwind table larger than the budget (--unwind-table-memory) or the rows one table may have, not built; using frame pointers: {}",
                    failure.message
                );
                (SlotState::Unusable, Segments::default(), false)
            }
            Err(failure) => {
                self.stats.tables_failed += 1;
                tracing::info!(
                    file = %name,
                    "no unwind table, using frame pointers: {}",
                    failure.message
                );
                (SlotState::Unusable, Segments::default(), false)
            }
        };
        if let Some(slot) = self.slots.get_mut(&result.key) {
            // A demanded table that found no room backs off before it is read again; one
            // nobody asked for simply waits to be demanded.
            slot.retry_after = (demanded && matches!(state, SlotState::Evicted))
                .then(|| Instant::now() + self.min_residency);
            if !matches!(state, SlotState::Evicted) {
                slot.demanded = false;
            }
            slot.state = state;
            slot.urgent = false;
            slot.segments = segments;
            slot.reliable_frame_pointers = reliable_frame_pointers;
        }
    }

    /// Forgets a process (it exited, or its pid now belongs to another process).
    pub fn unregister(&mut self, pid: Pid) {
        self.sightings.remove(&pid);
        let Some(registration) = self.processes.remove(&pid) else {
            return;
        };
        self.remove_prefixes(&registration);
        self.release_tables(registration.tables);
    }

    fn remove_prefixes(&mut self, registration: &Registration) {
        self.stats.mapping_prefixes = self
            .stats
            .mapping_prefixes
            .saturating_sub(registration.prefixes.len() as u64);
        self.maps.remove_mappings(&registration.prefixes);
    }

    /// Drops one registration's hold on each of `tables`; a table no registration holds lets
    /// go of its file, or is forgotten when it is not in the maps either.
    fn release_tables(&mut self, tables: Vec<TableKey>) {
        for key in tables {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            slot.registrations = slot.registrations.saturating_sub(1);
            if slot.registrations > 0 {
                continue;
            }
            match slot.state {
                // Kept for the next process of the same binary; its file is let go.
                SlotState::Loaded { .. } | SlotState::Unusable => slot.source = None,
                // A build in flight finishes first.
                SlotState::Building => {}
                SlotState::Evicted => self.forget_slot(&key),
            }
        }
        if self.slots.len() > MAX_TABLE_SLOTS {
            self.forget_unmapped_slots();
        }
    }

    /// Drops a slot no registered process maps (its table is not in the maps).
    fn forget_slot(&mut self, key: &TableKey) {
        if let Some(slot) = self.slots.remove(key) {
            self.unlink_files(key, &slot.files);
        }
    }

    /// Files map to their table both ways: `file_tables`, and each slot's `files`.
    fn link_file(&mut self, id: FileId, key: &TableKey) {
        if let Some(slot) = self.slots.get_mut(key) {
            if !slot.files.contains(&id) {
                slot.files.push(id);
            }
            self.file_tables.insert(id, key.clone());
        }
    }

    fn unlink_files(&mut self, key: &TableKey, files: &[FileId]) {
        for id in files {
            if self.file_tables.get(id) == Some(key) {
                self.file_tables.remove(id);
            }
        }
    }

    /// Over [`MAX_TABLE_SLOTS`]: forgets the unusable and evicted slots nothing maps.
    fn forget_unmapped_slots(&mut self) {
        let idle: Vec<TableKey> = self
            .slots
            .iter()
            .filter(|(_, slot)| {
                slot.registrations == 0
                    && matches!(slot.state, SlotState::Unusable | SlotState::Evicted)
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in &idle {
            if let Some(slot) = self.slots.remove(key) {
                self.unlink_files(key, &slot.files);
            }
        }
    }

    /// The trie value for `mapping`, its table's key, and the table it still waits for.
    fn mapping_value(
        &mut self,
        mapping: &Mapping,
    ) -> (MappingValue, Option<TableKey>, Option<TableKey>) {
        let frame_pointers = MappingValue {
            table_id: 0,
            flags: MAPPING_FRAME_POINTERS,
            load_bias: 0,
            start: mapping.start,
            end: mapping.end,
        };
        let (key, source) = match &mapping.file {
            Some(file) => (table_key(file), Some(file.clone())),
            None if &*mapping.name == "[vdso]" && self.has_vdso => (TableKey::Vdso, None),
            None => return (frame_pointers, None, None),
        };
        self.ensure_table(&key, source, false);
        if let Some(file) = &mapping.file {
            self.link_file(file.id, &key);
        }
        let Some(slot) = self.slots.get(&key) else {
            return (frame_pointers, None, None);
        };
        let with_table = |slot: &TableSlot| {
            let load_bias = slot
                .segments
                .load_bias(mapping.start, mapping.file_offset)?;
            Some(MappingValue {
                table_id: slot.id,
                flags: if slot.reliable_frame_pointers {
                    MAPPING_HAS_TABLE | MAPPING_RELIABLE_FRAME_POINTERS
                } else {
                    MAPPING_HAS_TABLE
                },
                load_bias,
                ..frame_pointers
            })
        };
        match slot.state {
            // Evicted tables are registered too: BPF finds no page, reports the miss, and the
            // frame's file is demanded.
            SlotState::Loaded { .. } | SlotState::Evicted => {
                let value = with_table(slot).unwrap_or(frame_pointers);
                (value, Some(key), None)
            }
            // BPF stops there and sends the stack, which the agent unwinds once the table is in.
            SlotState::Building => (
                MappingValue {
                    flags: MAPPING_TABLE_PENDING,
                    ..frame_pointers
                },
                Some(key.clone()),
                Some(key),
            ),
            SlotState::Unusable => (frame_pointers, Some(key), None),
        }
    }

    /// Requests the table for `key` unless it is placed, building, unusable or backing off;
    /// `urgent` when a sample waits for it (a table queued behind others is asked for again at
    /// the front of the line).
    fn ensure_table(&mut self, key: &TableKey, source: Option<Arc<MappedFile>>, urgent: bool) {
        let tick = self.tick;
        match self.slots.get_mut(key) {
            Some(slot) => {
                slot.last_used = tick;
                if slot.source.is_none() {
                    slot.source = source;
                }
                let request = match slot.state {
                    SlotState::Building => urgent && !slot.urgent,
                    SlotState::Loaded { .. } | SlotState::Unusable => false,
                    // A table nobody demands waits for free room or a demand.
                    SlotState::Evicted => {
                        slot.demanded && slot.retry_after.is_none_or(|at| Instant::now() >= at)
                    }
                };
                if !request {
                    return;
                }
                slot.state = SlotState::Building;
            }
            None => {
                let id = self.next_table_id;
                self.next_table_id += 1;
                self.slots.insert(
                    key.clone(),
                    TableSlot {
                        id,
                        state: SlotState::Building,
                        segments: Segments::default(),
                        reliable_frame_pointers: false,
                        last_used: tick,
                        sampled_at: None,
                        demanded: false,
                        retry_after: None,
                        registrations: 0,
                        files: Vec::new(),
                        source,
                        urgent: false,
                    },
                );
            }
        }
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        slot.urgent |= urgent;
        let source = slot.source.clone();
        self.builder.submit(
            BuildRequest {
                key: key.clone(),
                source,
            },
            urgent,
        );
    }

    /// Writes `table` into free chunks; for a `demanded` table, evicting tables no sample has
    /// used lately as needed. A table may be split between free ranges at page boundaries
    /// (each page's rows stay contiguous, which is all a lookup needs), so free room scattered
    /// by evictions is used rather than evicting more.
    fn place(&mut self, id: u32, table: &UnwindTable, name: &str, demanded: bool) -> SlotState {
        let paged = table.paged();
        let total_rows = paged.rows().len();
        if total_rows == 0 {
            self.stats.tables_failed += 1;
            return SlotState::Unusable;
        }
        let page_rows: Vec<u32> = paged.page_entries().map(|(_, e)| e.row_count).collect();
        let chunks = total_rows.div_ceil(ROWS_PER_CHUNK) as u32;
        let largest_page = page_rows
            .iter()
            .map(|&rows| (rows as usize).div_ceil(ROWS_PER_CHUNK) as u32)
            .max()
            .unwrap_or(0);
        if chunks > self.allocator.capacity || largest_page > self.allocator.capacity {
            self.stats.tables_too_large += 1;
            tracing::warn!(
                file = name,
                rows = total_rows,
                capacity_rows = u64::from(self.allocator.capacity) * ROWS_PER_CHUNK as u64,
                "unwind table larger than the whole budget (--unwind-table-memory); using frame pointers"
            );
            return SlotState::Unusable;
        }
        let extents = loop {
            if let Some(extents) = self.allocator.allocate_pages(&page_rows) {
                break extents;
            }
            if !demanded || !self.evict_least_recently_used() {
                // Nobody asked for it yet, or everything placed is in use: this file waits,
                // rather than pushing out a table that is needed right now.
                self.stats.tables_deferred += 1;
                tracing::debug!(
                    file = name,
                    rows = total_rows,
                    demanded,
                    "unwind-table budget full; deferring"
                );
                return SlotState::Evicted;
            }
        };
        let entries: Vec<(u32, PageEntry)> = paged.page_entries().collect();
        let mut page_numbers = Vec::with_capacity(entries.len());
        let mut failed = false;
        for extent in &extents {
            let pages = &entries[extent.pages.clone()];
            let (Some(&(_, first)), Some(&(_, last))) = (pages.first(), pages.last()) else {
                continue;
            };
            let from = first.first_row as usize;
            let to = (last.first_row + last.row_count) as usize;
            // Chunk by chunk from the table's own rows (no copy of a large table), the last
            // one padded.
            for (i, chunk_rows) in paged.rows()[from..to].chunks(ROWS_PER_CHUNK).enumerate() {
                let mut chunk = RowChunk {
                    rows: [UnwindRow::default(); ROWS_PER_CHUNK],
                };
                chunk.rows[..chunk_rows.len()].copy_from_slice(chunk_rows);
                failed |= self
                    .maps
                    .write_row_chunk(extent.chunks.start + i as u32, &chunk)
                    .is_err();
            }
            let base_row = extent.chunks.start * ROWS_PER_CHUNK as u32;
            for &(page, entry) in pages {
                page_numbers.push(page);
                let entry = PageEntry {
                    first_row: base_row + (entry.first_row - first.first_row),
                    ..entry
                };
                failed |= self
                    .maps
                    .insert_page(PageKey { table_id: id, page }, entry)
                    .is_err();
            }
        }
        let chunk_ranges: Vec<Range<u32>> = extents.into_iter().map(|e| e.chunks).collect();
        if failed {
            self.stats.map_errors += 1;
            for page in &page_numbers {
                let _ = self.maps.remove_page(PageKey {
                    table_id: id,
                    page: *page,
                });
            }
            for range in chunk_ranges {
                self.allocator.release(range);
            }
            return SlotState::Unusable;
        }
        self.stats.tables_loaded += 1;
        SlotState::Loaded {
            chunks: chunk_ranges,
            pages: page_numbers,
        }
    }

    /// Evicts the placed table samples used least recently (never-sampled ones first, then by
    /// registration), unless every placed table was sampled within the minimum residency.
    fn evict_least_recently_used(&mut self) -> bool {
        let Some(key) = self
            .slots
            .iter()
            .filter(|(_, slot)| matches!(slot.state, SlotState::Loaded { .. }))
            .filter(|(_, slot)| !slot.is_hot(self.min_residency))
            .min_by_key(|(_, slot)| (slot.sampled_at, slot.last_used))
            .map(|(key, _)| key.clone())
        else {
            return false;
        };
        let slot = self.slots.get_mut(&key).expect("present");
        if let SlotState::Loaded { chunks, pages } =
            std::mem::replace(&mut slot.state, SlotState::Evicted)
        {
            for page in pages {
                let _ = self.maps.remove_page(PageKey {
                    table_id: slot.id,
                    page,
                });
            }
            for range in chunks {
                self.allocator.release(range);
            }
            self.stats.tables_evicted += 1;
            tracing::debug!(table = slot.id, "evicted an unwind table to make room");
        }
        if slot.registrations == 0 {
            self.forget_slot(&key);
        }
        true
    }
}

/// Reads a file's table: from the cache by build id, else built from its CFI (and cached).
/// Returns whether it came from the cache.
fn read_table(
    key: &TableKey,
    source: Option<&MappedFile>,
    cache: Option<&TableCache>,
    vdso: Option<&[u8]>,
    limits: &BuildLimits,
) -> (Result<(UnwindTable, Segments), BuildFailure>, bool) {
    let mapped;
    let mut opened: Option<std::fs::File> = None;
    let data: &[u8] = match (key, source) {
        (TableKey::Vdso, _) => match vdso {
            Some(vdso) => vdso,
            None => return (Err(String::from("no vdso").into()), false),
        },
        (_, Some(file)) => {
            // The agent's own descriptor when it has one: the path may name another file by now
            // (a rebuilt binary, an upgraded package), whose table would be wrong for this one.
            let handle = match file.handle.as_ref().map_or_else(
                || std::fs::File::open(&file.open_path),
                std::fs::File::try_clone,
            ) {
                Ok(handle) => handle,
                Err(err) => return (Err(err.to_string().into()), false),
            };
            // SAFETY: read-only mapping of a file the agent holds open. Guarded: the
            // symbolizer may map the same file at the same time (see `GuardedMmap`).
            mapped = match unsafe { crate::process::files::GuardedMmap::map(&handle) } {
                Ok(mapped) => mapped,
                Err(err) => return (Err(err.to_string().into()), false),
            };
            opened = Some(handle);
            &mapped
        }
        (_, None) => {
            return (
                Err(String::from("the file is no longer available").into()),
                false,
            );
        }
    };
    let elf = match object::File::parse(data) {
        Ok(elf) => elf,
        Err(err) => return (Err(err.to_string().into()), false),
    };
    let segments = Segments::of(&elf);
    let build_id = match key {
        TableKey::BuildId(id) => Some(id.clone()),
        _ => None,
    };
    if let (Some(cache), Some(build_id)) = (cache, &build_id)
        && let Some(table) = cache.load(build_id)
    {
        return (Ok((table, segments)), true);
    }
    // Counted from the file, not the mapping: a file rejected here costs no resident memory.
    if let Some(file) = &opened
        && let Err(err) = check_fde_count(&elf, file, limits)
    {
        return (Err(err.into()), false);
    }
    let mut limits = limits.clone();
    if opened.is_some() {
        // SAFETY: `mapped` is a private read-only mapping of the file, alive until we return.
        limits.mapped_input = Some(unsafe { MappedInput::new(data) });
    }
    match build_table_within(data, &limits) {
        Ok(table) => {
            if let (Some(cache), Some(build_id)) = (cache, &build_id)
                && let Err(err) = cache.store(build_id, &table)
            {
                tracing::debug!("unwind-table cache: {err}");
            }
            (Ok((table, segments)), false)
        }
        Err(err) => (Err(err.into()), false),
    }
}

fn table_key(file: &MappedFile) -> TableKey {
    match &file.build_id {
        Some(id) => TableKey::BuildId(id.clone()),
        None => TableKey::File(file.id),
    }
}

/// The kernel maps the same vDSO image into every process: read it from our own memory.
fn own_vdso() -> Option<Arc<[u8]>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let line = maps.lines().find(|line| line.ends_with("[vdso]"))?;
    let (start, end) = line.split_whitespace().next()?.split_once('-')?;
    let (start, end) = (
        u64::from_str_radix(start, 16).ok()?,
        u64::from_str_radix(end, 16).ok()?,
    );
    let mut bytes = vec![0u8; end.checked_sub(start)? as usize];
    use std::os::unix::fs::FileExt;
    std::fs::File::open("/proc/self/mem")
        .ok()?
        .read_exact_at(&mut bytes, start)
        .ok()?;
    Some(bytes.into())
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, os::unix::fs::MetadataExt, path::PathBuf};

    use super::*;
    use crate::{
        bpf::BpfError,
        model::ProcessLabels,
        unwinding::tables::{Rule, build_table},
    };

    /// The maps as plain collections, so registration logic is tested without a kernel.
    #[derive(Default)]
    struct FakeMaps {
        capacity: u32,
        chunks: BTreeMap<u32, RowChunk>,
        pages: HashMap<PageKey, PageEntry>,
        mappings: HashMap<(u32, [u8; 12]), MappingValue>,
        /// Trie entries written or removed so far.
        mapping_writes: usize,
    }

    impl UnwindMaps for FakeMaps {
        fn row_chunk_capacity(&self) -> u32 {
            self.capacity
        }
        fn write_row_chunk(&mut self, index: u32, chunk: &RowChunk) -> Result<(), BpfError> {
            assert!(index < self.capacity);
            self.chunks.insert(index, *chunk);
            Ok(())
        }
        fn insert_page(&mut self, key: PageKey, entry: PageEntry) -> Result<(), BpfError> {
            self.pages.insert(key, entry);
            Ok(())
        }
        fn remove_page(&mut self, key: PageKey) -> Result<(), BpfError> {
            self.pages.remove(&key);
            Ok(())
        }
        fn insert_mapping(
            &mut self,
            len: u32,
            key: MappingKey,
            value: MappingValue,
        ) -> Result<(), BpfError> {
            self.mappings.insert((len, key.bytes), value);
            self.mapping_writes += 1;
            Ok(())
        }
        fn remove_mapping(&mut self, len: u32, key: MappingKey) -> Result<(), BpfError> {
            self.mappings.remove(&(len, key.bytes));
            self.mapping_writes += 1;
            Ok(())
        }
        fn read_page(&self, key: PageKey) -> Result<Option<PageEntry>, BpfError> {
            Ok(self.pages.get(&key).copied())
        }
        fn read_row_chunk(&self, index: u32) -> Result<RowChunk, BpfError> {
            Ok(self.chunks.get(&index).copied().unwrap_or(RowChunk {
                rows: [UnwindRow::default(); ROWS_PER_CHUNK],
            }))
        }
    }

    fn mapped(path: &str) -> Arc<MappedFile> {
        let meta = std::fs::metadata(path).unwrap();
        Arc::new(MappedFile {
            id: FileId {
                dev: meta.dev(),
                ino: meta.ino(),
            },
            path: path.into(),
            open_path: PathBuf::from(path),
            build_id: None,
            handle: None,
        })
    }

    /// A file's table is built from the file the agent holds, even once another file replaced
    /// it at its path: the processes mapping the old one still run its code.
    #[test]
    fn a_table_is_built_from_the_file_held_not_from_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let compile = |name: &str, source: &str| {
            let source_path = dir.path().join(format!("{name}.c"));
            std::fs::write(&source_path, source).unwrap();
            let output = dir.path().join(format!("{name}.so"));
            let status = std::process::Command::new("gcc")
                .args(["-O2", "-shared", "-fPIC", "-o"])
                .arg(&output)
                .arg(&source_path)
                .status()
                .unwrap();
            assert!(status.success());
            output
        };
        let small = compile("small", "int held(int x) { return x + 1; }\n");
        let functions: String = (0..200)
            .map(|i| format!("int other{i}(int x) {{ return x * {i} + held_elsewhere(x); }}\n"))
            .collect();
        let large = compile("large", &format!("int held_elsewhere(int);\n{functions}"));
        let limits = BuildLimits::default();
        let held = mapped(small.to_str().unwrap());
        let held = Arc::new(MappedFile {
            handle: Some(std::fs::File::open(&small).unwrap()),
            ..Arc::into_inner(held).unwrap()
        });
        let key = TableKey::File(held.id);
        let (before, _) = read_table(&key, Some(&held), None, None, &limits);
        let (_, before_segments) = before.unwrap();

        std::fs::rename(&large, &small).unwrap();
        let (after, _) = read_table(&key, Some(&held), None, None, &limits);
        let (_, after_segments) = after.unwrap();
        assert_eq!(
            format!("{after_segments:?}"),
            format!("{before_segments:?}")
        );
        // The path's file is another: its segments differ (the test can tell the two apart).
        let (replaced, _) = read_table(
            &key,
            Some(&mapped(small.to_str().unwrap())),
            None,
            None,
            &limits,
        );
        let (_, replaced_segments) = replaced.unwrap();
        assert_ne!(
            format!("{replaced_segments:?}"),
            format!("{before_segments:?}")
        );
    }

    /// A table asked for after a large file's is built while the large one is still being
    /// built: the processes that start while libtorch's table is built are not cut for it.
    #[test]
    fn a_small_table_is_not_queued_behind_a_large_one() {
        let cc1 = std::process::Command::new("gcc")
            .arg("-print-prog-name=cc1")
            .output()
            .expect("gcc runs");
        let cc1 = String::from_utf8(cc1.stdout).unwrap().trim().to_string();
        let open = |path: &str| {
            let mut file = Arc::try_unwrap(mapped(path)).unwrap();
            file.handle = Some(std::fs::File::open(path).unwrap());
            Arc::new(file)
        };
        let (large, small) = (open(&cc1), open("/usr/bin/true"));
        let large_bytes = std::fs::metadata(&cc1).unwrap().len();
        assert!(large_bytes > 8 << 20, "cc1 is {large_bytes} bytes");
        // cc1 (30 MiB) counts as large here; true (40 KiB) does not.
        let builder =
            TableBuilder::spawn(None, None, BuildLimits::for_row_capacity(1 << 22), 1 << 20);
        // Eight builds of cc1 (under keys of their own) are queued first: with one line the
        // small table would come last; with two it comes before the last of them at the latest,
        // even when the machine is busy.
        let large_keys: Vec<TableKey> = (0..8)
            .map(|ino| TableKey::File(FileId { dev: u64::MAX, ino }))
            .collect();
        for key in &large_keys {
            let request = BuildRequest {
                key: key.clone(),
                source: Some(large.clone()),
            };
            builder.submit(request, false);
        }
        let small_key = TableKey::File(small.id);
        let request = BuildRequest {
            key: small_key.clone(),
            source: Some(small.clone()),
        };
        builder.submit(request, false);
        let mut order = Vec::new();
        while order.len() < large_keys.len() + 1 {
            let result = builder
                .results
                .recv_timeout(Duration::from_secs(300))
                .expect("every table is built");
            assert!(result.table.is_ok(), "a table for {:?}", result.key);
            order.push(result.key);
        }
        let small_at = order.iter().position(|key| *key == small_key).unwrap();
        assert!(
            small_at < large_keys.len(),
            "the small table came after every large one: {order:?}"
        );
    }

    fn process(pid: u32, files: &[Arc<MappedFile>]) -> Arc<ProcessInfo> {
        let mappings = files
            .iter()
            .enumerate()
            .map(|(i, file)| Mapping {
                start: 0x7f00_0000_0000 + (i as u64) * 0x1000_0000,
                end: 0x7f00_0000_0000 + (i as u64) * 0x1000_0000 + 0x20_0000,
                file_offset: 0,
                file: Some(file.clone()),
                name: file.path.clone(),
            })
            .collect();
        Arc::new(ProcessInfo {
            pid: Pid(pid),
            start_time: 1,
            comm: "p".into(),
            labels: ProcessLabels::default(),
            mappings,
            is_kernel_thread: false,
        })
    }

    const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";

    /// Row-array chunks the table of `path` takes.
    fn chunks_needed(path: &str) -> usize {
        let table = build_table(&std::fs::read(path).unwrap()).unwrap();
        table.paged().rows().len().div_ceil(ROWS_PER_CHUNK)
    }
    const LIBM: &str = "/lib/x86_64-linux-gnu/libm.so.6";

    #[test]
    fn processes_share_one_table_per_file_and_unregister_cleanly() {
        let mut tables = tables_with_room(4096);
        let libc = mapped(LIBC);
        let (a, b) = (
            process(10, std::slice::from_ref(&libc)),
            process(11, &[libc]),
        );
        tables.sync_waiting(&a, Duration::from_secs(30));
        tables.sync_waiting(&b, Duration::from_secs(30));
        let stats = tables.stats();
        assert_eq!(stats.tables_loaded, 1, "two processes, one table");
        assert_eq!(stats.processes_registered, 2);
        let values = mapping_values(&tables);
        assert!(
            values
                .iter()
                .all(|v| v.flags == MAPPING_HAS_TABLE && v.table_id == values[0].table_id)
        );
        let markers: Vec<_> = tables
            .maps()
            .mappings
            .iter()
            .filter(|((len, _), v)| *len == 32 && v.flags == MAPPING_PROCESS_MARKER)
            .collect();
        assert_eq!(markers.len(), 2, "one marker per registered process");
        assert!(!tables.maps().pages.is_empty());
        // Every page entry points inside the rows written.
        let rows_written = tables.maps().chunks.len() * ROWS_PER_CHUNK;
        assert!(
            tables
                .maps()
                .pages
                .values()
                .all(|p| (p.first_row + p.row_count) as usize <= rows_written)
        );

        let before = tables.maps().mappings.len();
        tables.unregister(Pid(10));
        assert_eq!(
            tables.maps().mappings.len(),
            before / 2,
            "only pid 10's prefixes removed"
        );
        tables.unregister(Pid(11));
        assert!(tables.maps().mappings.is_empty());
    }

    /// A table manager over fake maps with room for `capacity` row chunks.
    fn tables_with_room(capacity: u32) -> NativeTables<FakeMaps> {
        NativeTables::new(
            FakeMaps {
                capacity,
                ..FakeMaps::default()
            },
            None,
        )
    }

    /// Polls the builder until `done` holds (or 30 s pass).
    fn poll_until(
        tables: &mut NativeTables<FakeMaps>,
        done: impl Fn(&NativeTables<FakeMaps>) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(tables) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            tables.poll_builds();
        }
    }

    fn placed(tables: &NativeTables<FakeMaps>, table_id: u32) -> bool {
        tables.maps().pages.keys().any(|k| k.table_id == table_id)
    }

    fn table_id_of(tables: &NativeTables<FakeMaps>, pid: u32) -> u32 {
        tables
            .maps()
            .mappings
            .iter()
            .find(|((_, key), value)| {
                key[..4] == pid.to_be_bytes() && value.flags & MAPPING_PROCESS_MARKER == 0
            })
            .map(|(_, value)| value.table_id)
            .expect("registered")
    }

    /// The registered mappings' values, without the per-process markers.
    fn mapping_values(tables: &NativeTables<FakeMaps>) -> Vec<MappingValue> {
        tables
            .maps()
            .mappings
            .values()
            .filter(|v| v.flags & MAPPING_PROCESS_MARKER == 0)
            .copied()
            .collect()
    }

    /// A table landing for a registered process rewrites the prefixes of the mappings that use
    /// it, not the whole registration.
    #[test]
    fn a_table_coming_in_updates_only_its_mappings() {
        let mut tables = tables_with_room(4096);
        let (libc, libm) = (mapped(LIBC), mapped(LIBM));
        tables.sync_waiting(
            &process(30, std::slice::from_ref(&libc)),
            Duration::from_secs(30),
        );
        let both = process(31, &[libc, libm]);
        for _ in 0..REGISTER_AT_SAMPLE {
            tables.sync(&both);
        }
        // Registered at its REGISTER_AT_SAMPLE-th sample; libm's table is being built.
        let entries = tables.maps().mappings.len();
        poll_until(&mut tables, |t| !t.building());
        let writes_before = tables.maps().mapping_writes;
        tables.sync(&both);
        let libm_mapping = &both.mappings[1];
        assert_eq!(
            tables.maps().mapping_writes - writes_before,
            address_prefixes(libm_mapping.start, libm_mapping.end).len(),
            "only libm's prefixes written"
        );
        assert_eq!(tables.maps().mappings.len(), entries);
        assert!(
            mapping_values(&tables)
                .iter()
                .all(|v| v.flags == MAPPING_HAS_TABLE),
            "{:?}",
            mapping_values(&tables)
        );
        let writes_after = tables.maps().mapping_writes;
        tables.sync(&both);
        assert_eq!(
            tables.maps().mapping_writes,
            writes_after,
            "nothing changed"
        );
    }

    #[test]
    fn a_table_nobody_samples_waits_and_a_demanded_one_evicts_it() {
        // Room for one of the two tables at a time.
        let libc_chunks = chunks_needed(LIBC);
        let mut tables = tables_with_room(libc_chunks as u32 + 8);
        let (libc, libm) = (mapped(LIBC), mapped(LIBM));
        tables.sync_waiting(
            &process(20, std::slice::from_ref(&libc)),
            Duration::from_secs(30),
        );
        let libc_table = table_id_of(&tables, 20);
        assert!(placed(&tables, libc_table));
        tables.sync_waiting(
            &process(21, std::slice::from_ref(&libm)),
            Duration::from_secs(30),
        );
        let libm_table = table_id_of(&tables, 21);
        assert_ne!(libm_table, 0, "registered with its table id, pages absent");
        assert!(
            !placed(&tables, libm_table),
            "nobody asked for libm's table yet"
        );
        assert_eq!(tables.stats().tables_deferred, 1);
        // A sample fell back to frame pointers in libm: its table pushes out libc's, which no
        // sample has used.
        tables.demand(&libm);
        poll_until(&mut tables, |t| placed(t, libm_table));
        assert!(placed(&tables, libm_table));
        assert!(!placed(&tables, libc_table));
        let stats = tables.stats();
        assert_eq!((stats.tables_demanded, stats.tables_evicted), (1, 1));
    }

    #[test]
    fn recently_sampled_tables_are_not_evicted() {
        let libc_chunks = chunks_needed(LIBC);
        let mut tables = tables_with_room(libc_chunks as u32 + 8);
        let (libc, libm) = (mapped(LIBC), mapped(LIBM));
        tables.sync_waiting(
            &process(40, std::slice::from_ref(&libc)),
            Duration::from_secs(30),
        );
        let libc_table = table_id_of(&tables, 40);
        tables.touch(&libc);
        tables.sync_waiting(
            &process(41, std::slice::from_ref(&libm)),
            Duration::from_secs(30),
        );
        tables.demand(&libm);
        poll_until(&mut tables, |t| t.stats().tables_deferred >= 2);
        let stats = tables.stats();
        assert_eq!(
            (stats.tables_deferred, stats.tables_evicted),
            (2, 0),
            "libc stays, libm waits"
        );
        assert!(placed(&tables, libc_table));
        // Asking again right away does not read the table again: the deferral backs off.
        tables.demand(&libm);
        std::thread::sleep(Duration::from_millis(200));
        tables.poll_builds();
        assert_eq!(
            tables.stats().tables_built,
            3,
            "no rebuild during the back-off"
        );
    }

    /// Most processes on a busy host are sampled once or twice: registering them (a map
    /// update per address block) waits for their REGISTER_AT_SAMPLE-th sample.
    #[test]
    fn a_process_is_registered_once_sampled_enough() {
        let mut tables = tables_with_room(4096);
        let p = process(70, &[mapped(LIBC)]);
        for sample in 1..REGISTER_AT_SAMPLE {
            tables.sync(&p);
            // The same sample looked at again (its frames after its late walk) is no other.
            tables.resync(&p);
            tables.resync(&p);
            assert!(
                tables.maps().mappings.is_empty(),
                "not after sample {sample}"
            );
        }
        assert_eq!(
            tables.stats().registrations_put_off,
            u64::from(REGISTER_AT_SAMPLE - 1)
        );
        tables.sync(&p);
        assert_eq!(tables.stats().processes_registered, 1);
        assert_eq!(tables.stats().registrations, 1);
        assert!(!tables.maps().mappings.is_empty());
        // Kept current, not registered anew.
        tables.resync(&p);
        tables.sync(&p);
        assert_eq!(tables.stats().registrations, 1);
        // Unregistered at its exit; a new process with the same pid starts over.
        tables.unregister(Pid(70));
        tables.sync(&p);
        assert!(tables.maps().mappings.is_empty());
    }

    /// The late unwinder reads back from the maps exactly the rows the table has.
    #[test]
    fn rows_read_back_from_the_maps_match_the_table() {
        let mut tables = tables_with_room(4096);
        let libc = mapped(LIBC);
        let p = process(60, std::slice::from_ref(&libc));
        tables.sync_waiting(&p, Duration::from_secs(30));
        let table = build_table(&std::fs::read(LIBC).unwrap()).unwrap();
        let elf_bytes = std::fs::read(LIBC).unwrap();
        let elf = object::File::parse(&elf_bytes[..]).unwrap();
        let mapping = &p.mappings[0];
        let bias = Segments::of(&elf)
            .load_bias(mapping.start, mapping.file_offset)
            .unwrap();
        let mut compared = 0;
        for row in table.rows().iter().step_by(97) {
            let pc = row.address + bias;
            if !mapping.contains(pc) {
                continue;
            }
            let expected = table.lookup(row.address).map(|r| Rule::of(&r));
            match tables.row_at(mapping, pc) {
                RowLookup::Row(found) => assert_eq!(Some(Rule::of(&found)), expected, "{pc:#x}"),
                other => panic!("{pc:#x}: {other:?}"),
            }
            compared += 1;
        }
        assert!(compared > 100, "compared {compared} rows");
        // A process's own marker is registered last, after its mappings.
        let marker = MappingKey::new(60, 0);
        assert_eq!(
            tables
                .maps()
                .mappings
                .get(&(32, marker.bytes))
                .map(|v| v.flags),
            Some(MAPPING_PROCESS_MARKER)
        );
    }

    #[test]
    fn a_table_no_process_maps_lets_go_of_its_file() {
        let mut tables = tables_with_room(4096);
        let libc = mapped(LIBC);
        tables.sync_waiting(
            &process(50, std::slice::from_ref(&libc)),
            Duration::from_secs(30),
        );
        assert_eq!(Arc::strong_count(&libc), 2, "the test and the slot");
        tables.unregister(Pid(50));
        // The placed table no longer holds the file.
        assert_eq!(Arc::strong_count(&libc), 1);
        assert_eq!(
            tables.stats().table_slots,
            1,
            "the placed table stays for the next process"
        );
        tables.sync_waiting(
            &process(51, std::slice::from_ref(&libc)),
            Duration::from_secs(30),
        );
        assert_eq!(tables.stats().tables_loaded, 1, "reused, not rebuilt");
    }

    #[test]
    fn table_larger_than_the_budget_falls_back_to_frame_pointers() {
        let mut tables = tables_with_room(2);
        let p = process(30, &[mapped(LIBC)]);
        tables.sync_waiting(&p, Duration::from_secs(30));
        assert_eq!(tables.stats().tables_too_large, 1);
        // Rejected by the builder, within the budget, not built and then found too large.
        assert_eq!(tables.stats().tables_built, 0);
        assert_eq!(tables.stats().tables_failed, 0);
        assert!(
            mapping_values(&tables)
                .iter()
                .all(|v| v.flags == MAPPING_FRAME_POINTERS)
        );
        assert!(tables.maps().pages.is_empty());
    }

    #[test]
    fn prefixes_cover_exactly_the_range() {
        for (start, end) in [
            (0x1000u64, 0x2000u64),
            (0x40_1000, 0x40_5123),
            (0x7f12_3456_7000, 0x7f12_3460_0000),
            (5, 6),
        ] {
            let prefixes = address_prefixes(start, end);
            let mut covered = start;
            for (bits, base) in &prefixes {
                assert_eq!(*base, covered, "contiguous");
                let size = 1u64 << (64 - bits);
                assert_eq!(base % size, 0, "aligned");
                covered += size;
            }
            assert_eq!(covered, end);
            assert!(prefixes.len() <= 128);
        }
        assert_eq!(address_prefixes(0x1000, 0x2000), vec![(52, 0x1000)]);
    }

    #[test]
    fn allocator_reuses_and_merges_freed_ranges() {
        let mut a = ChunkAllocator::new(10);
        let x = a.allocate(4).unwrap();
        let y = a.allocate(4).unwrap();
        assert_eq!((x.clone(), y.clone()), (0..4, 4..8));
        assert!(a.allocate(3).is_none());
        assert_eq!(a.in_use(), 8);
        a.release(x);
        a.release(y);
        assert_eq!(
            a.allocate(10),
            Some(0..10),
            "freed neighbours merge back into one range"
        );
    }

    #[test]
    fn a_table_is_split_between_free_ranges_at_page_boundaries() {
        let rows = ROWS_PER_CHUNK as u32;
        let mut a = ChunkAllocator::new(10);
        let (x, y, z) = (
            a.allocate(3).unwrap(),
            a.allocate(3).unwrap(),
            a.allocate(4).unwrap(),
        );
        a.release(x);
        a.release(z);
        // Free: 0..3 and 6..10. Pages of 2, 1 and 3 chunks fit only split: the first two in
        // 0..3, the third in 6..9.
        let extents = a
            .allocate_pages(&[2 * rows, rows, 3 * rows - 10])
            .expect("fits in pieces");
        assert_eq!(
            extents,
            vec![
                Extent {
                    chunks: 0..3,
                    pages: 0..2
                },
                Extent {
                    chunks: 6..9,
                    pages: 2..3
                },
            ]
        );
        assert_eq!(a.in_use(), 3 + 3 + 3);
        // A page larger than every free range does not fit, and nothing is taken.
        assert!(a.allocate_pages(&[2 * rows]).is_none());
        assert_eq!(a.in_use(), 9);
        a.release(y);
        assert_eq!(a.allocate_pages(&[rows, rows]).map(|e| e.len()), Some(1));
    }

    #[test]
    fn load_bias_for_pie_and_fixed_segments() {
        let segments = Segments(vec![
            (0, 0, 0x1000),
            (0x1000, 0x1000, 0x5000),
            (0x6000, 0x7000, 0x100),
        ]);
        // A PIE text mapping at 0x5555_5555_5000 for file offset 0x1000.
        assert_eq!(
            segments.load_bias(0x5555_5555_5000, 0x1000),
            Some(0x5555_5555_4000)
        );
        // A segment whose address differs from its file offset.
        assert_eq!(
            segments.load_bias(0x7f00_0000_6000, 0x6000),
            Some(0x7f00_0000_6000 - 0x7000)
        );
        // rustc's layout: the code segment starts mid-page, sharing its first page with the
        // read-only segment before it, and its address is one page above its offset.
        let rust = Segments(vec![(0, 0, 0x16a58), (0x16a60, 0x17a60, 0x3f050)]);
        assert_eq!(
            rust.load_bias(0x5555_5556_b000, 0x16000),
            Some(0x5555_5556_b000 - 0x16000 - 0x1000)
        );
    }
}
