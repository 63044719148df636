//! Executable mappings as the kernel announces them when they are made: perf `MMAP2` records
//! (what `perf record` uses for processes gone before it looks). A process that exits before
//! the agent reads /proc/PID/maps — most of them on a busy host — keeps its libraries this way,
//! so its libc and ld.so frames are unwound and named, not only its main executable's.
//!
//! One dummy software event per CPU carries the records (`mmap2` for executable mappings,
//! `comm_exec` to know where a program's image starts), timed on CLOCK_MONOTONIC like the BPF
//! events. The rings are drained by the pipeline before a sample newer than their last read, so
//! the mappings of a process whose sample is handled were read before it.
use std::{collections::VecDeque, sync::Arc};

use foldhash::{HashSet, HashSetExt};
use perf_event::{Builder, Sampler, events::Software};
use perf_event_open_sys::bindings::{
    PERF_RECORD_COMM, PERF_RECORD_LOST, PERF_RECORD_MISC_COMM_EXEC, PERF_RECORD_MISC_MMAP_BUILD_ID,
    PERF_RECORD_MMAP2,
};

use super::EXITED_PROCESS_RETENTION_NS;
use crate::{
    bounded::TwoGenerationCache,
    model::{FileId, MmapChange, Pid},
};

/// Processes whose mappings are remembered, in two generations: one announced or looked up
/// within the last 2,048 processes announced stays (3.7 s of the busiest host measured, 560
/// execs a second, where a sample waits well under a second for its handling), older ones
/// go a generation at a time.
pub const MAX_PROCESSES: usize = 4096;
/// Executable mappings kept per program image (a process that maps more keeps its first ones).
pub const MAX_MAPPINGS_PER_IMAGE: usize = 512;
/// Room for mappings an image starts with.
const MAPPINGS_AT_EXEC: usize = 8;
/// Exits waiting for their [`EXITED_PROCESS_RETENTION_NS`] at most (beyond, the oldest go
/// unexpired: their processes leave with [`MAX_PROCESSES`]' bound instead).
const MAX_PENDING_EXITS: usize = 2 * MAX_PROCESSES;
/// Distinct paths kept (shared by all processes); the set restarts when full.
const MAX_PATHS: usize = 16_384;
/// Rings of all CPUs together: records arrive at a few thousand a second on a busy host and
/// are drained several times a second, so a large host's many small rings hold enough.
const RING_BYTES_TOTAL: usize = 8 * 1024 * 1024;
/// Each CPU's ring, within these bounds. A small host's few rings take all the records: on 2
/// CPUs at 500 forks a second 256 KiB each held under a second of them, and the agent's
/// start-up (its first large symbol tables) stalls the pipeline longer (3,448 records lost in
/// the host benchmark's first 100 s); 1 MiB holds about 4 s. The pages are the kernel's, not
/// in the agent's RSS.
const RING_BYTES_PER_CPU: std::ops::RangeInclusive<usize> = 32 * 1024..=1024 * 1024;

/// The ring of one of `cpus` CPUs: a power of two (the kernel requires it).
fn ring_bytes_per_cpu(cpus: usize) -> usize {
    let share = (RING_BYTES_TOTAL / cpus.max(1))
        .clamp(*RING_BYTES_PER_CPU.start(), *RING_BYTES_PER_CPU.end());
    // The largest power of two not above the share.
    1 << (usize::BITS - 1 - share.leading_zeros())
}

/// One executable mapping as announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnouncedMapping {
    /// CLOCK_MONOTONIC time of the mmap.
    pub time_ns: u64,
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
    /// `None` when the record carried no device and inode.
    pub file: Option<FileId>,
    /// The path as the process saw it, or a pseudo-name such as `[vdso]`.
    pub path: Arc<str>,
}

/// The mappings of one program image: from an exec to the next.
#[derive(Debug, Default)]
struct Image {
    exec_ns: u64,
    mappings: Vec<AnnouncedMapping>,
    /// [`MmapLog::losses`] when the image began: any loss since may have been one of its
    /// mappings.
    losses_at_start: u64,
    /// Mappings beyond [`MAX_MAPPINGS_PER_IMAGE`] were not kept.
    overflowed: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MmapLogStats {
    pub processes: u64,
    pub mappings: u64,
    pub records_lost: u64,
    pub records_unparsable: u64,
    /// Processes whose announcements were dropped [`EXITED_PROCESS_RETENTION_NS`] after their
    /// exit.
    pub expired_processes: u64,
}

/// The announced mappings of recent program images, by process.
#[derive(Debug)]
pub struct MmapLog {
    /// At most two images per process: the current and the one before (samples of the old
    /// program may still be in flight when the new one is announced). Two generations of a
    /// flat map, not a linked LRU: every fork, exec, mmap and exit on the host touches these
    /// maps, and a linked list's scattered nodes cost a few cache misses each time (4.6 % of
    /// the agent's CPU on the host suite for this and `boundaries`).
    processes: TwoGenerationCache<Pid, Vec<Image>>,
    paths: HashSet<Arc<str>>,
    mappings: u64,
    stats: MmapLogStats,
    /// Times records were lost or unparsable.
    losses: u64,
    /// With [`Self::track_changes`]: the processes announced since the last
    /// [`Self::take_changes`], `None` once that is not known (records lost or unparsable, or
    /// more than [`MAX_CHANGES`]).
    changes: Option<Vec<MmapChange>>,
    tracking: bool,
    /// The latest times each pid's process ended or began ([`Self::process_boundary`]).
    boundaries: TwoGenerationCache<Pid, Boundaries>,
    /// Exits in the order seen ([`Self::exited`]), each to be expired once old enough.
    exits: VecDeque<(Pid, u64)>,
    /// When the latest read of the rings began (CLOCK_MONOTONIC ns): every code mapping made
    /// before then is in the log.
    read_from_ns: u64,
}

/// Exits and forks remembered per pid: a pid is reused about once a minute on the busiest host
/// measured (560 forks a second), so a few cover any exec a sample can wait for.
const MAX_BOUNDARIES_PER_PID: usize = 4;

/// The latest [`MAX_BOUNDARIES_PER_PID`] boundaries of a pid, in place: one is noted at every
/// fork and exit on the host (over a thousand a second on the busiest measured), and a heap
/// vector for each pid was an allocation and a free at every new pid.
#[derive(Clone, Copy, Debug, Default)]
struct Boundaries {
    times: [u64; MAX_BOUNDARIES_PER_PID],
    len: usize,
}

impl Boundaries {
    /// Adds `time_ns`, forgetting the oldest when full.
    fn push(&mut self, time_ns: u64) {
        if self.len == MAX_BOUNDARIES_PER_PID {
            self.times.rotate_left(1);
            self.times[MAX_BOUNDARIES_PER_PID - 1] = time_ns;
        } else {
            self.times[self.len] = time_ns;
            self.len += 1;
        }
    }

    fn iter(&self) -> impl Iterator<Item = &u64> {
        self.times[..self.len].iter()
    }
}

/// Takes an evicted or expired process's mappings off the count of mappings kept.
fn forget_mappings(mappings: &mut u64) -> impl FnMut(Pid, Vec<Image>) + '_ {
    |_, images| {
        let count: usize = images.iter().map(|image| image.mappings.len()).sum();
        *mappings = mappings.saturating_sub(count as u64);
    }
}

/// Processes remembered as changed between two [`MmapLog::take_changes`].
const MAX_CHANGES: usize = 65_536;

impl Default for MmapLog {
    fn default() -> Self {
        Self::new(MAX_PROCESSES)
    }
}

impl MmapLog {
    pub fn new(max_processes: usize) -> Self {
        Self {
            processes: TwoGenerationCache::new(max_processes),
            paths: HashSet::new(),
            mappings: 0,
            stats: MmapLogStats::default(),
            losses: 0,
            changes: None,
            tracking: false,
            boundaries: TwoGenerationCache::new(max_processes),
            exits: VecDeque::new(),
            read_from_ns: 0,
        }
    }

    /// The process with `pid` exited at `time_ns` (its exit event, applied once the samples
    /// taken before it are handled): its announcements go [`EXITED_PROCESS_RETENTION_NS`]
    /// later, as do those of processes that exited that long before `time_ns`.
    pub fn exited(&mut self, pid: Pid, time_ns: u64) {
        if self.exits.len() >= MAX_PENDING_EXITS {
            self.exits.pop_front();
        }
        self.exits.push_back((pid, time_ns));
        self.expire(time_ns);
    }

    /// Drops the announcements of processes that exited [`EXITED_PROCESS_RETENTION_NS`] or
    /// more before `now_ns`, unless their pid was announced or began again since the exit
    /// (another process's by then).
    pub fn expire(&mut self, now_ns: u64) {
        let before = now_ns.saturating_sub(EXITED_PROCESS_RETENTION_NS);
        while let Some(&(pid, exit_ns)) = self.exits.front() {
            if exit_ns >= before {
                break;
            }
            self.exits.pop_front();
            let reused = self
                .boundaries
                .peek_mut(&pid)
                .is_some_and(|times| times.iter().any(|&t| t > exit_ns));
            let Some(images) = self.processes.peek_mut(&pid) else {
                continue;
            };
            let announced_since = images.iter().any(|image| {
                image.exec_ns > exit_ns || image.mappings.iter().any(|m| m.time_ns > exit_ns)
            });
            if reused || announced_since {
                continue;
            }
            if let Some(images) = self.processes.remove(&pid) {
                forget_mappings(&mut self.mappings)(pid, images);
            }
            self.boundaries.remove(&pid);
            self.stats.expired_processes += 1;
        }
    }

    /// Starts remembering which processes each announcement is about.
    pub fn track_changes(&mut self) {
        if !self.tracking {
            self.tracking = true;
            self.changes = Some(Vec::new());
        }
    }

    /// The execs and code mappings announced since the last call, in the order read; `None`
    /// when some announcements were lost, so any process may have changed.
    pub fn take_changes(&mut self) -> Option<Vec<MmapChange>> {
        if !self.tracking {
            return None;
        }
        // With room for as many as last time: they are pushed one by one, about as many each time.
        let room = self.changes.as_ref().map_or(0, Vec::len);
        self.changes.replace(Vec::with_capacity(room))
    }

    /// Every code mapping made before this time (CLOCK_MONOTONIC ns) is in the log: when the
    /// latest read of the announcement rings began.
    pub fn complete_before_ns(&self) -> u64 {
        self.read_from_ns
    }

    fn changed(&mut self, change: impl FnOnce() -> MmapChange) {
        if let Some(changes) = &mut self.changes {
            if changes.len() >= MAX_CHANGES {
                self.changes = None;
            } else {
                changes.push(change());
            }
        }
    }

    fn lost(&mut self) {
        self.changes = None;
        self.losses += 1;
    }

    pub fn stats(&self) -> MmapLogStats {
        MmapLogStats {
            processes: self.processes.len() as u64,
            mappings: self.mappings,
            ..self.stats.clone()
        }
    }

    /// `pid` exec'ed at `time_ns`: its mappings from then on are a new image's.
    pub fn exec(&mut self, pid: Pid, time_ns: u64) {
        self.changed(|| MmapChange::Exec { pid, time_ns });
        let image = Image {
            exec_ns: time_ns,
            // A dynamically linked program maps its code, ld.so's and libc's at least: room
            // for them at once, rather than growing at every exec on the host.
            mappings: Vec::with_capacity(MAPPINGS_AT_EXEC),
            losses_at_start: self.losses,
            overflowed: false,
        };
        let Some(images) = self
            .processes
            .get_mut_evicting(&pid, forget_mappings(&mut self.mappings))
        else {
            self.insert(pid, vec![image]);
            return;
        };
        if images.iter().any(|i| i.exec_ns == time_ns) {
            return;
        }
        // Records from several CPUs arrive out of order: mappings made after this exec but
        // read before it move to the new image.
        let mut moved = Vec::new();
        for older in images
            .iter_mut()
            .filter(|i| i.exec_ns < time_ns && i.mappings.iter().any(|m| m.time_ns >= time_ns))
        {
            let (later, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut older.mappings)
                .into_iter()
                .partition(|m| m.time_ns >= time_ns);
            older.mappings = kept;
            moved.extend(later);
        }
        let mut image = image;
        image.mappings.extend(moved);
        images.push(image);
        images.sort_by_key(|i| i.exec_ns);
        let removed: usize = images
            .drain(..images.len().saturating_sub(2))
            .map(|i| i.mappings.len())
            .sum();
        self.mappings = self.mappings.saturating_sub(removed as u64);
    }

    /// `pid` mapped executable code.
    pub fn mapped(&mut self, pid: Pid, mut mapping: AnnouncedMapping) {
        mapping.path = self.intern(&mapping.path);
        self.mapped_interned(pid, mapping);
    }

    /// [`Self::mapped`] for a mapping whose path is interned already.
    fn mapped_interned(&mut self, pid: Pid, mapping: AnnouncedMapping) {
        self.changed(|| MmapChange::Mapped {
            pid,
            path: Arc::clone(&mapping.path),
            inode: mapping.file.map(|file| file.ino),
        });
        let time_ns = mapping.time_ns;
        let Some(images) = self
            .processes
            .get_mut_evicting(&pid, forget_mappings(&mut self.mappings))
        else {
            // No exec seen: a process started before the agent (its /proc entry serves).
            self.insert(
                pid,
                vec![Image {
                    exec_ns: 0,
                    mappings: vec![mapping],
                    losses_at_start: self.losses,
                    overflowed: false,
                }],
            );
            self.mappings += 1;
            return;
        };
        let Some(image) = images.iter_mut().rev().find(|i| i.exec_ns <= time_ns) else {
            return; // Older than every image kept.
        };
        if image.mappings.len() < MAX_MAPPINGS_PER_IMAGE {
            image.mappings.push(mapping);
            self.mappings += 1;
        } else {
            image.overflowed = true;
        }
    }

    fn insert(&mut self, pid: Pid, images: Vec<Image>) {
        self.processes
            .insert_evicting(pid, images, forget_mappings(&mut self.mappings));
    }

    fn intern(&mut self, path: &Arc<str>) -> Arc<str> {
        if let Some(known) = self.paths.get(&**path) {
            return Arc::clone(known);
        }
        self.remember(Arc::clone(path))
    }

    /// The shared copy of `path`, allocated only the first time it is seen: announcements
    /// repeat the same few hundred library paths thousands of times a second.
    fn intern_str(&mut self, path: &str) -> Arc<str> {
        match self.paths.get(path) {
            Some(known) => Arc::clone(known),
            None => self.remember(Arc::from(path)),
        }
    }

    fn remember(&mut self, path: Arc<str>) -> Arc<str> {
        if self.paths.len() >= MAX_PATHS {
            self.paths.clear();
        }
        self.paths.insert(Arc::clone(&path));
        path
    }

    /// When `pid` first exec'ed after `time_ns`, by the kernel's announcements: they are read
    /// before every batch of samples and on demand, while the exec events wait for the samples
    /// taken before them. `None` when the pid changed hands in between (the process exited, or a new one was
    /// forked with its pid: [`Self::process_boundary`]), so the exec is another process's.
    pub fn exec_after(&mut self, pid: Pid, time_ns: u64) -> Option<u64> {
        let exec_ns = self
            .processes
            .get_mut_evicting(&pid, forget_mappings(&mut self.mappings))?
            .iter()
            .map(|image| image.exec_ns)
            .find(|&exec_ns| exec_ns > time_ns)?;
        let reused = self.boundaries.get_mut(&pid).is_some_and(|times| {
            times
                .iter()
                .any(|&boundary| time_ns < boundary && boundary <= exec_ns)
        });
        (!reused).then_some(exec_ns)
    }

    /// The process with `pid` exited, or a new one was forked with it, at `time_ns` (the
    /// lifecycle events, noted as they are read): an exec announced for the pid after that is
    /// not the earlier process's.
    pub fn process_boundary(&mut self, pid: Pid, time_ns: u64) {
        match self.boundaries.get_mut(&pid) {
            Some(times) => times.push(time_ns),
            None => {
                let mut times = Boundaries::default();
                times.push(time_ns);
                self.boundaries.insert(pid, times);
            }
        }
    }

    /// The first time after `time_ns` that the process with `pid` ended or a new one began
    /// ([`Self::process_boundary`]).
    pub fn boundary_after(&mut self, pid: Pid, time_ns: u64) -> Option<u64> {
        self.boundaries
            .get_mut(&pid)?
            .iter()
            .copied()
            .filter(|&boundary| boundary > time_ns)
            .min()
    }

    /// Whether `pid` was announced mapping code at `addr` at or after `since_ns`: a snapshot
    /// taken before then is missing a library loaded since.
    pub fn announced_since(&mut self, pid: Pid, addr: u64, since_ns: u64) -> bool {
        self.processes
            .get_mut_evicting(&pid, forget_mappings(&mut self.mappings))
            .is_some_and(|images| {
                images
                    .iter()
                    .flat_map(|image| &image.mappings)
                    .any(|m| m.time_ns >= since_ns && m.start <= addr && addr < m.end)
            })
    }

    /// The executable mappings of the program `pid` ran at `time_ns` (an exec event's time or
    /// a sample's), sorted by address: where two overlap, the later mmap replaced the earlier.
    /// `None` unless the exec that started that program was announced.
    pub fn mappings_at(&mut self, pid: Pid, time_ns: u64) -> Option<Vec<AnnouncedMapping>> {
        self.image_mappings(pid, time_ns, false)
    }

    /// [`Self::mappings_at`], but only when every mapping that program made since its exec was
    /// kept (no record lost or unparsable since, none beyond [`MAX_MAPPINGS_PER_IMAGE`]) and
    /// no later exec was announced. Such a list can stand in for /proc/PID/maps.
    pub fn complete_mappings_at(
        &mut self,
        pid: Pid,
        time_ns: u64,
    ) -> Option<Vec<AnnouncedMapping>> {
        self.image_mappings(pid, time_ns, true)
    }

    fn image_mappings(
        &mut self,
        pid: Pid,
        time_ns: u64,
        complete: bool,
    ) -> Option<Vec<AnnouncedMapping>> {
        let losses = self.losses;
        let images = self
            .processes
            .get_mut_evicting(&pid, forget_mappings(&mut self.mappings))?;
        let (index, image) = images
            .iter()
            .enumerate()
            .rev()
            .find(|(_, i)| i.exec_ns <= time_ns && i.exec_ns != 0)?;
        // A complete list is the one of the program the process runs now: a later exec
        // announced means it runs another.
        let latest = index + 1 == images.len();
        if complete && (!latest || image.overflowed || image.losses_at_start != losses) {
            return None;
        }
        let mut by_time = image.mappings.clone();
        by_time.sort_by_key(|m| m.time_ns);
        let mut result: Vec<AnnouncedMapping> = Vec::with_capacity(by_time.len());
        for mapping in by_time {
            result.retain(|m| m.end <= mapping.start || m.start >= mapping.end);
            result.push(mapping);
        }
        result.sort_by_key(|m| m.start);
        Some(result)
    }
}

/// The per-CPU rings of announcements.
pub struct MmapEvents {
    samplers: Vec<Sampler>,
    pub log: MmapLog,
}

impl std::fmt::Debug for MmapEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapEvents")
            .field("cpus", &self.samplers.len())
            .field("log", &self.log)
            .finish()
    }
}

impl MmapEvents {
    /// Opens one event per CPU in `cpus`, enabled at once.
    pub fn open(cpus: &[u32]) -> std::io::Result<Self> {
        let mut samplers = Vec::with_capacity(cpus.len());
        for &cpu in cpus {
            let mut sampler = Builder::new(Software::DUMMY)
                .one_cpu(cpu as usize)
                .any_pid()
                .mmap(true)
                .mmap2(true)
                .comm(true)
                .comm_exec(true)
                .sample_id_all(true)
                // The layout `parse_announcement` reads at the end of every record.
                .sample(perf_event::SampleFlag::TID | perf_event::SampleFlag::TIME)
                .clockid(perf_event::Clock::MONOTONIC)
                .exclude_kernel(false)
                .build()?
                .sampled(ring_bytes_per_cpu(cpus.len()))?;
            sampler.enable()?;
            samplers.push(sampler);
        }
        Ok(Self {
            samplers,
            log: MmapLog::default(),
        })
    }

    /// Reads every announcement waiting in the rings into the log.
    pub fn drain(&mut self) {
        // A record is in its ring before the mmap call that makes it returns, so whatever
        // was mapped before now is read below.
        self.log.read_from_ns = crate::model::monotonic_now_ns();
        for sampler in &mut self.samplers {
            while let Some(record) = sampler.next_record() {
                // Contiguous unless the record wraps around the ring's end.
                let data = record.to_contiguous();
                match parse_announcement(record.ty(), record.misc(), &data) {
                    Ok(Some(Parsed::Mapped(pid, fields, path))) => {
                        let path = self.log.intern_str(&String::from_utf8_lossy(path));
                        self.log.mapped_interned(pid, fields.with_path(path));
                    }
                    Ok(Some(Parsed::Execed(pid, time_ns))) => self.log.exec(pid, time_ns),
                    Ok(Some(Parsed::Lost(count))) => {
                        self.log.stats.records_lost += count;
                        self.log.lost();
                    }
                    Ok(None) => {}
                    Err(Truncated) => {
                        self.log.stats.records_unparsable += 1;
                        self.log.lost();
                    }
                }
            }
        }
    }
}

/// An announced mapping as parsed, before its path is interned.
#[derive(Debug, PartialEq, Eq)]
struct MappingFields {
    time_ns: u64,
    start: u64,
    end: u64,
    file_offset: u64,
    file: Option<FileId>,
}

impl MappingFields {
    fn with_path(self, path: Arc<str>) -> AnnouncedMapping {
        AnnouncedMapping {
            time_ns: self.time_ns,
            start: self.start,
            end: self.end,
            file_offset: self.file_offset,
            file: self.file,
            path,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Parsed<'a> {
    /// The path's bytes, without the terminating NUL and padding.
    Mapped(Pid, MappingFields, &'a [u8]),
    Execed(Pid, u64),
    Lost(u64),
}

/// A record shorter than its type's fields.
#[derive(Debug, PartialEq, Eq)]
struct Truncated;

/// The `sample_id` the kernel appends to every record with `sample_id_all` and the sample
/// type TID | TIME: pid and tid (u32 each), then the time (u64).
const SAMPLE_ID_BYTES: usize = 16;

/// The fixed fields of `PERF_RECORD_MMAP2` before the file name: pid, tid, addr, len, pgoff,
/// maj, min, ino, ino_generation, prot, flags.
const MMAP2_FIELD_BYTES: usize = 4 + 4 + 8 + 8 + 8 + 4 + 4 + 8 + 8 + 4 + 4;

/// Reads the records the announcements are made of (the kernel's `enum perf_event_type`
/// layouts, in this machine's byte order), from `data`, the record after its header. Read by
/// hand rather than through perf-event2's general parser: thousands arrive a second on a busy
/// host (every exec maps several files), and that parser was 3.7 % of the agent's CPU there.
/// `None` for records that announce nothing kept (a thread's new name, an unknown type).
fn parse_announcement(
    record_type: u32,
    misc: u16,
    data: &[u8],
) -> Result<Option<Parsed<'_>>, Truncated> {
    let u32_at = |offset: usize| -> Result<u32, Truncated> {
        let bytes = data.get(offset..offset + 4).ok_or(Truncated)?;
        Ok(u32::from_ne_bytes(bytes.try_into().map_err(|_| Truncated)?))
    };
    let u64_at = |offset: usize| -> Result<u64, Truncated> {
        let bytes = data.get(offset..offset + 8).ok_or(Truncated)?;
        Ok(u64::from_ne_bytes(bytes.try_into().map_err(|_| Truncated)?))
    };
    // Where the sample_id begins, after at least `fields` bytes of the record's own.
    let sample_id_at = |fields: usize| {
        data.len()
            .checked_sub(SAMPLE_ID_BYTES)
            .filter(|&at| at >= fields)
            .ok_or(Truncated)
    };
    // The time is the sample_id's last field, at the record's end.
    let time_ns = || u64_at(data.len().checked_sub(8).ok_or(Truncated)?);
    match record_type {
        PERF_RECORD_MMAP2 => {
            let path_end = sample_id_at(MMAP2_FIELD_BYTES)?;
            let start = u64_at(8)?;
            // With a build id in the union, there is no device and inode.
            let file = if u32::from(misc) & PERF_RECORD_MISC_MMAP_BUILD_ID == 0 {
                let (major, minor, ino) = (u32_at(32)?, u32_at(36)?, u64_at(40)?);
                (ino != 0).then(|| FileId {
                    dev: libc::makedev(major, minor),
                    ino,
                })
            } else {
                None
            };
            let path = &data[MMAP2_FIELD_BYTES..path_end];
            let path = path
                .iter()
                .position(|&byte| byte == 0)
                .map_or(path, |nul| &path[..nul]);
            Ok(Some(Parsed::Mapped(
                Pid(u32_at(0)?),
                MappingFields {
                    time_ns: time_ns()?,
                    start,
                    end: start.saturating_add(u64_at(16)?),
                    file_offset: u64_at(24)?,
                    file,
                },
                path,
            )))
        }
        // An exec's new name marks where a program image starts (a thread renamed starts
        // none): pid, tid, then the name, NUL-padded to eight bytes at least.
        PERF_RECORD_COMM if u32::from(misc) & PERF_RECORD_MISC_COMM_EXEC != 0 => {
            sample_id_at(16)?;
            Ok(Some(Parsed::Execed(Pid(u32_at(0)?), time_ns()?)))
        }
        // The event id, then how many records were lost.
        PERF_RECORD_LOST => {
            sample_id_at(16)?;
            Ok(Some(Parsed::Lost(u64_at(8)?)))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_keeps_its_latest_boundaries() {
        let mut log = MmapLog::new(8);
        let pid = Pid(7);
        for time_ns in 1..=6 {
            log.process_boundary(pid, time_ns * 100);
        }
        // The four latest are kept: 300..=600.
        assert_eq!(log.boundary_after(pid, 0), Some(300));
        assert_eq!(log.boundary_after(pid, 450), Some(500));
        assert_eq!(log.boundary_after(pid, 600), None);
        assert_eq!(log.boundary_after(Pid(8), 0), None);
    }

    /// An exited process's announcements go a minute after its exit, unless its pid was
    /// announced or began again since (another process's by then).
    #[test]
    fn an_exited_process_is_forgotten_a_minute_after_its_exit() {
        let second = 1_000_000_000;
        let mut log = MmapLog::new(16);
        for pid in [1, 2, 3] {
            log.exec(Pid(pid), second);
            log.mapped(Pid(pid), mapping(second + 1, 0x1000, 0x2000, "/bin/a"));
        }
        // 1 exits for good; 2's pid is forked again after its exit; 3's pid exec'ed again.
        for pid in [1, 2, 3] {
            log.process_boundary(Pid(pid), 10 * second);
            log.exited(Pid(pid), 10 * second);
        }
        log.process_boundary(Pid(2), 20 * second);
        log.exec(Pid(3), 20 * second);
        log.expire(69 * second);
        assert!(
            log.mappings_at(Pid(1), 2 * second).is_some(),
            "exited 59 s ago"
        );
        assert_eq!(log.stats().expired_processes, 0);
        log.expire(71 * second);
        assert!(
            log.mappings_at(Pid(1), 2 * second).is_none(),
            "exited 61 s ago"
        );
        assert!(log.boundary_after(Pid(1), 0).is_none());
        assert!(
            log.mappings_at(Pid(2), 2 * second).is_some(),
            "the pid began again"
        );
        assert!(
            log.mappings_at(Pid(3), 2 * second).is_some(),
            "the pid exec'ed again"
        );
        let stats = log.stats();
        assert_eq!((stats.expired_processes, stats.processes), (1, 2));
        assert_eq!(stats.mappings, 2);
    }

    fn mapping(time_ns: u64, start: u64, end: u64, path: &str) -> AnnouncedMapping {
        AnnouncedMapping {
            time_ns,
            start,
            end,
            file_offset: 0,
            file: Some(FileId { dev: 1, ino: start }),
            path: Arc::from(path),
        }
    }

    #[test]
    fn an_image_holds_the_mappings_made_after_its_exec() {
        let mut log = MmapLog::default();
        let pid = Pid(42);
        log.exec(pid, 100);
        log.mapped(pid, mapping(110, 0x1000, 0x2000, "/bin/a"));
        log.mapped(pid, mapping(120, 0x7000, 0x8000, "/lib/libc.so.6"));
        // Read out of order: a mapping of the next program before its exec record.
        log.mapped(pid, mapping(210, 0x3000, 0x4000, "/bin/b"));
        log.exec(pid, 200);
        let first = log.mappings_at(pid, 150).expect("first program announced");
        let paths: Vec<&str> = first.iter().map(|m| &*m.path).collect();
        assert_eq!(paths, ["/bin/a", "/lib/libc.so.6"]);
        let second = log.mappings_at(pid, 250).expect("second program announced");
        let paths: Vec<&str> = second.iter().map(|m| &*m.path).collect();
        assert_eq!(paths, ["/bin/b"]);
        assert_eq!(log.mappings_at(pid, 50), None, "before any exec seen");
        assert_eq!(log.mappings_at(Pid(7), 150), None);
    }

    #[test]
    fn an_exec_after_the_pid_changed_hands_is_another_processes() {
        let mut log = MmapLog::default();
        let pid = Pid(42);
        log.exec(pid, 100);
        log.exec(pid, 300);
        assert_eq!(log.exec_after(pid, 150), Some(300));
        // The process exited at 200 and the pid was reused: the exec at 300 is not its.
        log.process_boundary(pid, 200);
        assert_eq!(log.exec_after(pid, 150), None);
        // A sample of the new process, taken after the reuse, sees no later exec either.
        assert_eq!(log.exec_after(pid, 250), Some(300));
        assert_eq!(log.exec_after(pid, 300), None);
        // A boundary after the exec says nothing of it.
        let other = Pid(43);
        log.exec(other, 500);
        log.process_boundary(other, 600);
        assert_eq!(log.exec_after(other, 400), Some(500));
    }

    #[test]
    fn rings_share_a_fixed_budget() {
        assert_eq!(ring_bytes_per_cpu(2), 1024 * 1024);
        assert_eq!(ring_bytes_per_cpu(8), 1024 * 1024);
        assert_eq!(ring_bytes_per_cpu(12), 512 * 1024);
        assert_eq!(ring_bytes_per_cpu(64), 128 * 1024);
        assert_eq!(ring_bytes_per_cpu(192), 32 * 1024);
        assert_eq!(ring_bytes_per_cpu(4096), 32 * 1024);
        assert!((1..=512).all(|cpus| ring_bytes_per_cpu(cpus).is_power_of_two()));
    }

    #[test]
    fn a_later_mmap_replaces_what_it_overlaps() {
        let mut log = MmapLog::default();
        let pid = Pid(1);
        log.exec(pid, 1);
        log.mapped(pid, mapping(2, 0x1000, 0x3000, "/lib/old.so"));
        log.mapped(pid, mapping(3, 0x2000, 0x4000, "/lib/new.so"));
        let mappings = log.mappings_at(pid, 10).expect("announced");
        let paths: Vec<&str> = mappings.iter().map(|m| &*m.path).collect();
        assert_eq!(paths, ["/lib/new.so"]);
    }

    #[test]
    fn bounded_by_processes_and_images() {
        let mut log = MmapLog::new(2);
        for pid in 1..=3 {
            log.exec(Pid(pid), 1);
            log.mapped(Pid(pid), mapping(2, 0x1000, 0x2000, "/bin/x"));
        }
        assert_eq!(log.stats().processes, 2);
        assert_eq!(log.stats().mappings, 2);
        assert!(
            log.mappings_at(Pid(1), 5).is_none(),
            "the oldest went first"
        );
        for exec in [10, 20, 30] {
            log.exec(Pid(3), exec);
            log.mapped(Pid(3), mapping(exec + 1, 0x1000, 0x2000, "/bin/y"));
        }
        assert!(log.mappings_at(Pid(3), 15).is_none(), "two images kept");
        assert_eq!(log.mappings_at(Pid(3), 25).map(|m| m.len()), Some(1));
        assert_eq!(log.stats().mappings, 3);
    }

    #[test]
    fn a_complete_list_is_the_current_programs_with_nothing_lost() {
        let mut log = MmapLog::default();
        let pid = Pid(9);
        log.exec(pid, 100);
        log.mapped(pid, mapping(110, 0x1000, 0x2000, "/bin/a"));
        assert_eq!(log.complete_mappings_at(pid, 150).map(|m| m.len()), Some(1));
        // A later exec: the process runs another program now.
        log.exec(pid, 200);
        log.mapped(pid, mapping(210, 0x3000, 0x4000, "/bin/b"));
        assert!(log.complete_mappings_at(pid, 150).is_none());
        assert!(
            log.mappings_at(pid, 150).is_some(),
            "still there for a gone process"
        );
        assert_eq!(log.complete_mappings_at(pid, 250).map(|m| m.len()), Some(1));
        // Lost records may have been this program's mappings.
        log.lost();
        assert!(log.complete_mappings_at(pid, 250).is_none());
        assert!(log.mappings_at(pid, 250).is_some());
        // A program exec'ed after the loss is complete again, until it maps too much.
        let other = Pid(10);
        log.exec(other, 300);
        for page in 0..MAX_MAPPINGS_PER_IMAGE as u64 {
            log.mapped(
                other,
                mapping(310, page * 0x1000, (page + 1) * 0x1000, "/lib/x"),
            );
        }
        assert!(log.complete_mappings_at(other, 400).is_some());
        log.mapped(other, mapping(320, 0x90_0000, 0x91_0000, "/lib/y"));
        assert!(log.complete_mappings_at(other, 400).is_none());
    }

    /// The kernel announces this test's own dlopen on the ring of the CPU it ran on.
    #[test]
    fn the_kernel_announces_a_library_mapped_now() {
        let cpus: Vec<u32> = (0..std::thread::available_parallelism().map_or(1, |n| n.get()))
            .map(|c| c as u32)
            .collect();
        let mut events = match MmapEvents::open(&cpus) {
            Ok(events) => events,
            Err(error) if error.raw_os_error() == Some(libc::EACCES) => {
                eprintln!("skipped: perf events need privileges ({error})");
                return;
            }
            Err(error) => panic!("cannot open perf events: {error}"),
        };
        // An executable mapping of a file, as a dlopen makes (no code of it runs).
        let library = std::env::current_exe().expect("own executable");
        let file = std::fs::File::open(&library).expect("open own executable");
        let mapped = unsafe { memmap2::MmapOptions::new().len(4096).map_exec(&file) }
            .expect("map executable");
        let address = mapped.as_ptr() as u64;
        let mapped_after_ns = crate::model::monotonic_now_ns();
        events.drain();
        let me = Pid(std::process::id());
        let images = events
            .log
            .processes
            .get_mut(&me)
            .expect("own mappings announced");
        let found = images
            .iter()
            .flat_map(|i| &i.mappings)
            .find(|m| m.start == address && std::path::Path::new(&*m.path) == library)
            .cloned();
        drop(mapped);
        let Some(found) = found else {
            panic!("{library:?} at {address:#x} not announced: {images:?}");
        };
        // Every field as the kernel wrote it: the record's layout read right.
        let metadata = file.metadata().expect("stat own executable");
        assert_eq!(
            (found.end, found.file_offset, found.file),
            (address + 4096, 0, Some(FileId::of(&metadata)))
        );
        assert!(
            found.time_ns > 0 && found.time_ns.abs_diff(mapped_after_ns) < 10_000_000_000,
            "mapped at {} (monotonic), read at {mapped_after_ns}",
            found.time_ns
        );
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    /// A record's bytes after its header: `fields`, then the sample_id (pid, tid, time).
    fn record(fields: &[u8], time_ns: u64) -> Vec<u8> {
        let mut data = fields.to_vec();
        data.extend_from_slice(&7u32.to_ne_bytes());
        data.extend_from_slice(&8u32.to_ne_bytes());
        data.extend_from_slice(&time_ns.to_ne_bytes());
        data
    }

    #[test]
    fn records_are_read_by_their_kernel_layouts() {
        let comm = |pid: u32| {
            [
                &pid.to_ne_bytes()[..],
                &pid.to_ne_bytes(),
                b"sh\0\0\0\0\0\0",
            ]
            .concat()
        };
        let exec = PERF_RECORD_MISC_COMM_EXEC as u16;
        assert_eq!(
            parse_announcement(PERF_RECORD_COMM, exec, &record(&comm(42), 99)),
            Ok(Some(Parsed::Execed(Pid(42), 99)))
        );
        // A thread renamed (prctl) starts no image.
        assert_eq!(
            parse_announcement(PERF_RECORD_COMM, 0, &record(&comm(42), 99)),
            Ok(None)
        );
        let lost = [5u64.to_ne_bytes(), 17u64.to_ne_bytes()].concat();
        assert_eq!(
            parse_announcement(PERF_RECORD_LOST, 0, &record(&lost, 1)),
            Ok(Some(Parsed::Lost(17)))
        );
        // A build id in the union: no device and inode.
        let mut mmap2 = [
            &9u32.to_ne_bytes()[..],
            &9u32.to_ne_bytes(),
            &0x4000u64.to_ne_bytes(),
            &0x2000u64.to_ne_bytes(),
            &0x1000u64.to_ne_bytes(),
            &[20u8; 24],
            &5u32.to_ne_bytes(),
            &2u32.to_ne_bytes(),
            b"/lib/a.so\0\0\0\0\0\0\0",
        ]
        .concat();
        let build_id = PERF_RECORD_MISC_MMAP_BUILD_ID as u16;
        let expected = |file| {
            Some(Parsed::Mapped(
                Pid(9),
                MappingFields {
                    time_ns: 3,
                    start: 0x4000,
                    end: 0x6000,
                    file_offset: 0x1000,
                    file,
                },
                &b"/lib/a.so"[..],
            ))
        };
        assert_eq!(
            parse_announcement(PERF_RECORD_MMAP2, build_id, &record(&mmap2, 3)),
            Ok(expected(None))
        );
        assert_eq!(
            parse_announcement(PERF_RECORD_MMAP2, 0, &record(&mmap2, 3)),
            Ok(expected(Some(FileId {
                dev: libc::makedev(0x1414_1414, 0x1414_1414),
                ino: 0x1414_1414_1414_1414,
            })))
        );
        // Shorter than its fixed fields and sample_id: refused, whatever is cut.
        mmap2.truncate(40);
        assert_eq!(
            parse_announcement(PERF_RECORD_MMAP2, 0, &record(&mmap2, 3)),
            Err(Truncated)
        );
        assert_eq!(
            parse_announcement(PERF_RECORD_COMM, exec, &[0; 31]),
            Err(Truncated)
        );
        assert_eq!(
            parse_announcement(PERF_RECORD_LOST, 0, &[0; 31]),
            Err(Truncated)
        );
    }

    proptest::proptest! {
        /// Whatever the bytes, a record is read or refused, never a panic.
        #[test]
        fn any_bytes_are_read_or_refused(
            record_type in 0u32..20,
            misc in proptest::prelude::any::<u16>(),
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
        ) {
            let _ = parse_announcement(record_type, misc, &data);
        }
    }
}

#[cfg(test)]
mod change_tests {
    use super::*;

    fn mapping(time_ns: u64) -> AnnouncedMapping {
        AnnouncedMapping {
            time_ns,
            start: 0x1000,
            end: 0x2000,
            file_offset: 0,
            file: None,
            path: Arc::from("/lib/x.so"),
        }
    }

    #[test]
    fn changes_name_each_announced_process_until_records_are_lost() {
        let mut log = MmapLog::new(8);
        log.mapped(Pid(1), mapping(5));
        assert_eq!(log.take_changes(), None, "not tracked yet");
        log.track_changes();
        log.mapped(Pid(2), mapping(6));
        log.exec(Pid(3), 7);
        assert_eq!(
            log.take_changes(),
            Some(vec![
                MmapChange::Mapped {
                    pid: Pid(2),
                    path: Arc::from("/lib/x.so"),
                    inode: None
                },
                MmapChange::Exec {
                    pid: Pid(3),
                    time_ns: 7
                }
            ])
        );
        assert_eq!(log.take_changes(), Some(vec![]));
        log.mapped(Pid(4), mapping(8));
        log.lost();
        assert_eq!(
            log.take_changes(),
            None,
            "lost records: anything may have changed"
        );
        log.mapped(Pid(5), mapping(9));
        assert_eq!(
            log.take_changes(),
            Some(vec![MmapChange::Mapped {
                pid: Pid(5),
                path: Arc::from("/lib/x.so"),
                inode: None
            }])
        );
    }
}
