//! Per-process snapshots and labels.
//!
//! [`ProcessRegistry`] takes a [`ProcessInfo`] snapshot the first time a pid is looked up: start
//! time, name, labels (see [`labels`] for `service_name`), and the executable mappings with their
//! files opened so they stay readable after the process exits or deletes them. Snapshots are
//! retaken on PID reuse (a different start time) and on demand when an address is in no mapping
//! (`dlopen`, `exec`), both rate-limited per pid, and dropped once the process is gone and the
//! snapshot has been unused for a whole interval.
pub mod cgroup;
pub mod elf_headers;
pub mod files;
pub mod identity;
pub mod kubernetes;
pub mod labels;
pub(crate) mod lru;
pub mod maps;
pub mod mmap_events;
mod proc_dir;

use std::{
    collections::BTreeMap,
    ffi::CStr,
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use thiserror::Error;
use tracing::debug;

use self::{
    cgroup::{CgroupInfo, CgroupMoves, KnownCgroup, parse_cgroup_bytes},
    files::FileCache,
    identity::{
        CgroupPaths, ExecutablePaths, ForkedProgram, Identities, Identity, forked_snapshot,
    },
    kubernetes::{KubernetesNames, KubernetesSources, kubernetes_names},
    labels::{LabelInputs, derive_labels, is_kernel_thread, parse_cmdline, parse_environ},
    lru::Lru,
    maps::executable_mappings,
    mmap_events::{AnnouncedMapping, MmapEvents, MmapLogStats},
    proc_dir::ProcDir,
};
use crate::{
    bounded::ParseMemo,
    model::{
        CgroupMove, ExecRecord, LabelEnv, MappedFile, Mapping, MmapChanges, Pid, ProcessInfo,
        ProcessLabels, monotonic_now_ns,
    },
};

/// /proc/PID/cgroup texts kept parsed: one per cgroup a process was first seen in lately
/// (each at most 4 KiB).
pub const MAX_KEPT_CGROUP_TEXTS: usize = 256;

/// Exits read and not yet applied that are remembered by pid ([`ProcessRegistry::note_exit_read`]);
/// they are applied within seconds, a few thousand at the most on a host forking 500 times a
/// second.
pub const MAX_EXITS_AHEAD: usize = 65_536;

/// How long what is known of an exited process (its identity, its announced mappings) is kept
/// after its exit. Its last samples are handled within seconds (a held sample waits at most a
/// few); a child forked from it has its own snapshot by the time it has run this long. Without a
/// time bound a host forking ten times a second filled the identity and announcement bounds
/// within minutes, the agent's memory growing all that time (about 0.5 MiB a minute in the host
/// benchmark without its exec storm).
pub const EXITED_PROCESS_RETENTION_NS: u64 = 60_000_000_000;

/// Why a process could not be read.
#[derive(Debug, Error)]
pub enum ProcessError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed {path}")]
    MalformedStat { path: PathBuf },
    #[error("process {pid} is exiting (a zombie): nothing left to read")]
    Exiting { pid: Pid },
}

/// The fields of /proc/PID/stat the registry uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatFields {
    /// The name in parentheses (field 2).
    pub comm: String,
    /// Field 3: `R`, `S`, `Z` (zombie: exited, not reaped yet), `X` (dead), ...
    pub state: char,
    /// Field 9.
    pub flags: u64,
    /// Field 22, clock ticks since boot.
    pub start_time: u64,
}

/// Parses /proc/PID/stat. The name may contain spaces and parentheses, so fields are counted
/// from the last ')'.
pub fn parse_stat(text: &str) -> Option<StatFields> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_owned();
    // Fields after the name start at field 3 (state).
    let fields: Vec<&str> = text.get(close + 1..)?.split_ascii_whitespace().collect();
    let field = |number: usize| fields.get(number.checked_sub(3)?)?.parse::<u64>().ok();
    Some(StatFields {
        comm,
        state: fields.first()?.chars().next()?,
        flags: field(9)?,
        start_time: field(22)?,
    })
}

/// Limits and timings of a [`ProcessRegistry`].
#[derive(Clone, Debug)]
pub struct RegistryConfig {
    /// Snapshots kept at most; the least recently used is dropped beyond.
    pub max_processes: usize,
    /// Mapped files the file cache keeps open at most.
    pub max_open_files: usize,
    /// Minimum time between two /proc/PID/stat re-reads (PID reuse check), and between two
    /// maps refreshes, of one pid.
    pub recheck_interval: Duration,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            max_processes: 16_384,
            max_open_files: 4096,
            recheck_interval: Duration::from_secs(1),
        }
    }
}

/// How a fork event says a process was forked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForkOrigin {
    /// `bpf_ktime_get_ns` time of the fork.
    pub forked_ns: u64,
    /// The parent's thread that forked.
    pub parent_tid: u32,
    /// The parent's cgroup v2 id at the fork.
    pub parent_cgroup_id: u64,
}

/// Counters of a [`ProcessRegistry`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryStats {
    /// Snapshots taken, for any reason.
    pub snapshots_taken: u64,
    /// Snapshots retaken by [`ProcessRegistry::refresh_for_address`].
    pub refreshes: u64,
    /// Of those, retaken before the recheck interval because code was announced at the address.
    pub refreshes_announced: u64,
    /// Of those, for a process gone from /proc: its announced mappings placed the address.
    pub refreshes_from_announcements: u64,
    /// Snapshots retaken because the pid now names another process.
    pub pid_reuse: u64,
    /// Lookups of pids with no /proc entry.
    pub lookups_failed: u64,
    /// First lookups of a process whose exit event was read already: built from its events
    /// without asking /proc, which no longer has it (or has a later process by that pid).
    pub exits_known_at_lookup: u64,
    /// Exits read from the ring and not applied yet (bounded).
    pub exits_ahead: u64,
    /// Snapshots built from the exec or fork event because /proc was gone already.
    pub snapshots_from_events: u64,
    /// Snapshots built from the fork or earlier exec event for a sample taken in an exec
    /// (before its exec event), whose /proc entry already shows the new program.
    pub snapshots_before_exec: u64,
    /// Fork children left unknown: their parent, not snapshotted at the fork, exited or its
    /// pid was reused since (so /proc no longer shows it), and the identity held for the pid
    /// is not from before the fork.
    pub parents_gone_since_fork: u64,
    /// Fork children named by what their parent ran at the fork (the parent's identity gone
    /// since: it exited long before the child).
    pub parents_from_fork_time: u64,
    /// Identities from exec and fork events held (bounded).
    pub identities: u64,
    /// Of those, identities of exited processes (bounded in number and age).
    pub exited_identities: u64,
    /// Exited processes' identities forgotten for their age.
    pub identities_expired: u64,
    /// Snapshots from events whose mappings came from the kernel's mmap announcements.
    pub snapshots_from_announced_mmaps: u64,
    /// Snapshots of live processes whose mappings came from the announcements instead of
    /// /proc/PID/maps.
    pub maps_from_announcements: u64,
    /// Snapshots of live processes whose command line came from their exec event instead of
    /// /proc/PID/cmdline.
    pub cmdlines_from_exec: u64,
    /// Snapshots of live processes taken without reading /proc/PID/stat and exe: who the
    /// process is came from its exec event, its mappings from the announcements (see
    /// `ProcessRegistry::identity_from_exec`).
    pub identities_from_exec: u64,
    /// Cgroup directory names remembered (bounded).
    pub cgroup_paths: u64,
    /// /proc/PID/cgroup texts kept parsed (bounded), and the snapshots whose cgroup came from
    /// one without a parse.
    pub cgroup_texts: u64,
    pub cgroup_texts_reused: u64,
    /// Snapshots of live processes whose cgroups came from their parent at their fork
    /// instead of /proc/PID/cgroup (see [`KnownCgroup`]).
    pub cgroups_from_fork: u64,
    /// Processes whose latest move between cgroups is kept (bounded, see [`CgroupMoves`]).
    pub cgroup_moves: u64,
    /// Cgroups of running processes known anew from a move's destination as the kernel
    /// reported it, without reading /proc/PID/cgroup (see [`KnownCgroup::after_move`]).
    pub cgroups_from_moves: u64,
    /// Exec'ed paths remembered with their symbolic links resolved (bounded).
    pub executable_paths: u64,
    /// File descriptors the agent holds for files, counted in /proc/self/fd (everything the
    /// process holds: the file cache, snapshots and tables still using evicted files, the
    /// symbolizer's own opens, the store), not sockets, pipes and BPF objects.
    pub open_files: u64,
    /// Files the file cache holds (bounded by `max_open_files`).
    pub cached_files: u64,
}

#[derive(Debug)]
struct Entry {
    info: Arc<ProcessInfo>,
    /// What tells this process from a later one given the same pid.
    start: ProcessStart,
    start_checked_at: Instant,
    refreshed_at: Instant,
    /// CLOCK_MONOTONIC time the snapshot was taken at (the mmap announcements' clock).
    taken_ns: u64,
    /// The eviction interval in which the snapshot was last looked up.
    used_in_interval: u64,
    /// Taken while the process was mid-exec (no command line yet), or before it moved to other
    /// cgroups: retaken at the next check.
    provisional: bool,
    /// Its process's exit event was applied: gone, /proc need not be asked.
    exited: bool,
    /// Its cgroups, for its fork children, when read from /proc or known from its fork.
    cgroup: Option<KnownCgroup>,
}

/// How a snapshot's process is told from a later process with the same pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ProcessStart {
    /// Its start time as /proc/PID/stat gives it (clock ticks since boot).
    Read(u64),
    /// Not read: the snapshot came from the exec event at this CLOCK_MONOTONIC time. The
    /// process began before that exec; a later process with the pid began after it.
    ExecedAt(u64),
}

impl ProcessStart {
    /// Whether a process that started at `start_ticks` (from /proc/PID/stat) is this one.
    fn is(&self, start_ticks: u64) -> bool {
        match *self {
            ProcessStart::Read(start) => start == start_ticks,
            // A process given the pid later was forked after this one exited, so after its
            // exec. The start time counts whole ticks (10 ms), so a start in the exec's own
            // tick counts as this process: a pid is handed out again only after every other
            // pid has been (tens of thousands of forks), which no host does within a tick.
            ProcessStart::ExecedAt(exec_ns) => {
                boottime_ticks_of_monotonic(exec_ns).is_some_and(|exec| start_ticks <= exec)
            }
        }
    }
}

/// A CLOCK_MONOTONIC time in the clock ticks since boot that /proc/PID/stat counts a start
/// time in (CLOCK_BOOTTIME, which also counts time suspended).
fn boottime_ticks_of_monotonic(monotonic_ns: u64) -> Option<u64> {
    let now = |clock| {
        let mut time = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid clock id and a timespec to write.
        (unsafe { libc::clock_gettime(clock, &mut time) } == 0)
            .then(|| time.tv_sec as u64 * 1_000_000_000 + time.tv_nsec as u64)
    };
    let suspended_ns = now(libc::CLOCK_BOOTTIME)?.saturating_sub(now(libc::CLOCK_MONOTONIC)?);
    // SAFETY: sysconf has no preconditions.
    let ticks_per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&ticks| ticks > 0)?;
    Some((monotonic_ns + suspended_ns) / (1_000_000_000 / ticks_per_second))
}

/// Per-process snapshots, keyed by pid.
#[derive(Debug)]
pub struct ProcessRegistry {
    proc_root: PathBuf,
    host: String,
    config: RegistryConfig,
    processes: Lru<Pid, Entry>,
    files: FileCache,
    /// Incremented by each [`Self::evict_exited`].
    interval: u64,
    stats: RegistryStats,
    /// Who processes became at exec, or were forked from (see [`identity`]).
    identities: Identities,
    cgroups: CgroupPaths,
    /// /proc/PID/cgroup texts parsed lately: most processes share a few (a read and a parse
    /// at every first sample of a process, with a dozen v1 hierarchies on hybrid hosts).
    cgroup_texts: ParseMemo<CgroupInfo>,
    /// The kernel's reports of processes moved between cgroups, which tell whether their
    /// [`KnownCgroup`]s hold.
    cgroup_moves: CgroupMoves,
    /// Whether a move's destination path reads as /proc/PID/cgroup does for the agent: the
    /// kernel reports it from the hierarchy's root, /proc from the reader's cgroup namespace.
    move_paths_hold: bool,
    /// Exits read from the lifecycle ring whose events are not applied yet (they wait for the
    /// samples taken before them), with their times: a sample handled meanwhile is of a
    /// process that has exited. Dropped when applied, or when a later process is forked with
    /// the pid.
    exits_ahead: foldhash::HashMap<Pid, u64>,
    /// Exec'ed paths with their links resolved, by the path given to execve and the file it
    /// named (see [`ExecutablePaths`]).
    executable_paths: ExecutablePaths,
    /// The kernel's announcements of executable mmaps, when they could be opened.
    mmaps: Option<MmapEvents>,
}

impl ProcessRegistry {
    /// `proc_root` is normally "/proc"; `host` is the agent's host name (a process's `HOSTNAME`
    /// equal to it is not taken for a pod or container name).
    pub fn new(proc_root: PathBuf, host: String) -> Self {
        Self::with_config(proc_root, host, RegistryConfig::default())
    }

    pub fn with_config(proc_root: PathBuf, host: String, config: RegistryConfig) -> Self {
        Self {
            processes: Lru::new(config.max_processes),
            files: FileCache::new(config.max_open_files),
            proc_root,
            host,
            config,
            interval: 0,
            stats: RegistryStats::default(),
            identities: Identities::default(),
            cgroups: CgroupPaths::new(),
            cgroup_texts: ParseMemo::new(MAX_KEPT_CGROUP_TEXTS),
            cgroup_moves: CgroupMoves::default(),
            move_paths_hold: false,
            exits_ahead: foldhash::HashMap::default(),
            executable_paths: ExecutablePaths::default(),
            mmaps: None,
        }
    }

    /// Uses the kernel's mmap announcements for processes gone from /proc (their libraries).
    /// Keeps at most `max_open_files` mapped files open (see [`files::FdBudget`]).
    pub fn set_max_open_files(&mut self, max_open_files: usize) {
        self.config.max_open_files = max_open_files;
        self.files.set_max_open_files(max_open_files);
    }

    /// The kernel reports every move of a task between cgroups and every change of cgroup
    /// paths ([`Self::note_cgroup_change`]): a fork child's cgroups may then be its parent's.
    /// `move_paths_hold`: the destinations the moves carry read as this agent's
    /// /proc/PID/cgroup does (see [`cgroup::in_initial_cgroup_namespace`]).
    pub fn track_cgroup_changes(&mut self, move_paths_hold: bool) {
        self.cgroup_moves.track();
        self.move_paths_hold = move_paths_hold;
    }

    /// The destination of a move that can be applied to what is known of a process's
    /// cgroups (every thread moved, its path as /proc would read it).
    fn applicable_move<'a>(&self, moved: Option<&'a CgroupMove>) -> Option<&'a CgroupMove> {
        moved.filter(|moved| moved.threadgroup && self.move_paths_hold)
    }

    /// A task of `pid` moved to other cgroups at `ktime_ns` (to `moved`, where the kernel said;
    /// `None` for `pid`: any process's cgroups may read otherwise). Noted when read from the
    /// ring, before the events ahead of it are applied: a move only ever makes what is known
    /// count for less until it is applied in its turn ([`Self::apply_cgroup_move`]).
    pub fn note_cgroup_change(
        &mut self,
        pid: Option<Pid>,
        ktime_ns: u64,
        moved: Option<&CgroupMove>,
    ) {
        self.cgroup_moves.note(pid, ktime_ns);
        let Some(pid) = pid else {
            return;
        };
        let taken_ns = match self.processes.peek_mut(&pid) {
            Some(entry) if !entry.exited && entry.taken_ns <= ktime_ns => entry.taken_ns,
            _ => return,
        };
        // The pid names another process now: its snapshot is not of the one that moved.
        if self.exits_ahead.contains_key(&pid) || self.changed_hands_after(pid, taken_ns).is_some()
        {
            return;
        }
        // Its labels may name the cgroups it left: the whole snapshot is read again at its
        // next check.
        if self.applicable_move(moved).is_some() {
            // Its cgroups from the move on, when the move is applied in its turn.
            if let Some(entry) = self.processes.peek_mut(&pid) {
                entry.provisional = true;
            }
            return;
        }
        // Its cgroups at once (a move is rare), for the children it forks from now on (those
        // forked since the move read their own).
        let read_ns = monotonic_now_ns();
        let raw = fs::read(process_dir(&self.proc_root, pid).join("cgroup")).ok();
        let cgroup = cgroup_of(raw, &mut self.cgroup_texts, read_ns).1;
        if let Some(entry) = self.processes.peek_mut(&pid) {
            entry.provisional = true;
            entry.cgroup = cgroup;
        }
    }

    /// Applies a move of `pid` at `moved_ns` (to `moved`, where the kernel said), in its turn
    /// among the exec and fork events: the cgroups known of the process from before the move
    /// become those after it, where [`KnownCgroup::after_move`] can tell them, else unknown
    /// (its children read their own). Knowledge from after the move is left as it is.
    pub fn apply_cgroup_move(&mut self, pid: Pid, moved_ns: u64, moved: Option<&CgroupMove>) {
        let moved = self.applicable_move(moved);
        let memo = &mut self.cgroup_texts;
        let mut after = |known: &KnownCgroup| -> Option<KnownCgroup> {
            known.after_move(moved?, moved_ns, |text| {
                memo.get_or_parse(text.as_bytes(), parse_cgroup_bytes)
            })
        };
        let mut applied = 0;
        if let Some(entry) = self.processes.peek_mut(&pid)
            && !entry.exited
            && let Some(known) = entry.cgroup.as_ref()
            && known.since_ns <= moved_ns
        {
            entry.cgroup = after(known);
            applied += u64::from(entry.cgroup.is_some());
        }
        if let Some(cgroup) = self.identities.running_cgroup_mut(pid)
            && let Some(known) = cgroup.as_ref()
            && known.since_ns <= moved_ns
        {
            *cgroup = after(known);
            applied += u64::from(cgroup.is_some());
        }
        self.stats.cgroups_from_moves += applied;
    }

    pub fn watch_mmaps(&mut self, events: MmapEvents) {
        self.mmaps = Some(events);
    }

    /// Reads the mmap announcements waiting; called before a sample newer than the last read,
    /// so the mappings a process made before its sample are known when the sample is handled.
    pub fn drain_mmaps(&mut self) {
        if let Some(events) = &mut self.mmaps {
            events.drain();
        }
    }

    /// Starts remembering which processes the mmap announcements are about; false when the
    /// announcements are not watched.
    pub fn track_mmap_changes(&mut self) -> bool {
        match &mut self.mmaps {
            Some(events) => {
                events.log.track_changes();
                true
            }
            None => false,
        }
    }

    /// The execs and code mappings announced since the last call; `None` when that is not
    /// known (announcements lost or not watched).
    pub fn take_mmap_changes(&mut self) -> Option<MmapChanges> {
        let log = &mut self.mmaps.as_mut()?.log;
        let complete_before_ns = log.complete_before_ns();
        Some(MmapChanges {
            changes: log.take_changes()?,
            complete_before_ns,
        })
    }

    pub fn mmap_stats(&self) -> Option<MmapLogStats> {
        self.mmaps.as_ref().map(|events| events.log.stats())
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn stats(&self) -> RegistryStats {
        RegistryStats {
            open_files: files::open_file_descriptors(),
            cached_files: self.files.len() as u64,
            identities: self.identities.len() as u64,
            exited_identities: self.identities.exited_len() as u64,
            identities_expired: self.identities.expired(),
            cgroup_paths: self.cgroups.len() as u64,
            cgroup_texts: self.cgroup_texts.len() as u64,
            exits_ahead: self.exits_ahead.len() as u64,
            cgroup_texts_reused: self.cgroup_texts.hits(),
            executable_paths: self.executable_paths.len() as u64,
            cgroup_moves: self.cgroup_moves.len() as u64,
            ..self.stats
        }
    }

    /// The process exec'ed `record` (from the exec event).
    pub fn record_exec(&mut self, pid: Pid, record: Arc<ExecRecord>) {
        // Opened now, while it is on disk as exec'ed: a build's test program or a configure
        // check is often deleted the moment it exits. A file open already costs a lookup.
        if let Some(id) = record.exe
            && !self.files.contains(id)
        {
            let path = self.executable_paths.resolve(&record);
            let _ = self.files.announced(&path, id);
        }
        // An exec keeps the cgroups; another v2 id than the one known is a child placed
        // elsewhere at its birth.
        let cgroup = self
            .identities
            .running_cgroup(pid)
            .filter(|known| known.v2_id.is_none_or(|id| id == record.cgroup_id))
            .map(|known| KnownCgroup {
                v2_id: Some(record.cgroup_id),
                ..known
            });
        self.identities.record(pid, Identity::Exec(record), cgroup);
    }

    /// The process was forked from `parent` (from the fork event): until it execs, it is the
    /// parent's program, whose snapshot (if the registry holds one) is kept for it. It was
    /// forked by the parent's thread `parent_tid` in the parent's cgroup v2
    /// `parent_cgroup_id`: its cgroups are the parent's where those are known to hold.
    pub fn record_fork(&mut self, pid: Pid, parent: Pid, fork: ForkOrigin) {
        let ForkOrigin {
            forked_ns,
            parent_tid,
            parent_cgroup_id,
        } = fork;
        let (parent_info, parent_cgroup) = match self.processes.get_mut(&parent) {
            Some(entry) => (
                Some(Arc::clone(&entry.info)),
                entry.cgroup.clone().filter(|_| !entry.exited),
            ),
            None => (None, None),
        };
        let parent_cgroup = parent_cgroup.or_else(|| self.identities.running_cgroup(parent));
        let moves = &self.cgroup_moves;
        let cgroup = parent_cgroup.and_then(|known| {
            known.for_child(parent, parent_tid, parent_cgroup_id, forked_ns, |since| {
                moves.moved_since(parent, since)
            })
        });
        // Without a snapshot, what the parent's events say it runs now: the fork event comes
        // in order, after the parent's exec, so its identity is the one it forked with. Kept
        // one level deep: a fork of a fork takes what its parent had inherited.
        let inherited = match &parent_info {
            Some(_) => None,
            None => match self.identities.get_running(parent) {
                Some(Identity::Exec(record)) => Some(ForkedProgram::Exec(record)),
                Some(Identity::Fork {
                    parent_info: Some(info),
                    ..
                }) => Some(ForkedProgram::Snapshot(info)),
                Some(Identity::Fork { inherited, .. }) => inherited,
                None => None,
            },
        };
        self.identities.record(
            pid,
            Identity::Fork {
                parent,
                parent_info,
                forked_ns,
                inherited,
            },
            cgroup,
        );
    }

    /// The process exited at `exit_ns` (from the exit event): its identity moves among the
    /// exited ones.
    pub fn record_exit(&mut self, pid: Pid, exit_ns: u64) {
        // A snapshot taken before the exit is of the process that exited (a pid is not reused
        // while its process lives); one taken after may be a later process's.
        if let Some(entry) = self.processes.peek_mut(&pid)
            && entry.taken_ns <= exit_ns
        {
            entry.exited = true;
        }
        if self.exits_ahead.get(&pid) == Some(&exit_ns) {
            self.exits_ahead.remove(&pid);
        }
        self.identities.exited(pid, exit_ns);
        if let Some(events) = &mut self.mmaps {
            events.log.exited(pid, exit_ns);
        }
    }

    /// Number of snapshots held.
    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The snapshot of `pid`, taken now if the pid is new or now names another process. `None`
    /// only when there is no snapshot and /proc/PID does not exist (the process exited before
    /// its first sample was processed).
    pub fn lookup(&mut self, pid: Pid) -> Option<Arc<ProcessInfo>> {
        let now = Instant::now();
        let interval = self.interval;
        let recheck = self.config.recheck_interval;
        let stat_path = || process_dir(&self.proc_root, pid).join("stat");
        if let Some(entry) = self.processes.get_mut(&pid) {
            entry.used_in_interval = interval;
            if now.duration_since(entry.start_checked_at) < recheck {
                return Some(Arc::clone(&entry.info));
            }
            entry.start_checked_at = now;
            let current_start = fs::read_to_string(stat_path())
                .ok()
                .and_then(|text| parse_stat(&text))
                .map(|stat| stat.start_time);
            match current_start {
                Some(start) if !entry.start.is(start) => {
                    debug!(%pid, old = ?entry.start, new = start, "pid reused");
                    self.stats.pid_reuse += 1;
                }
                Some(start) if !entry.provisional => {
                    // Proven the same process: later checks compare start times.
                    entry.start = ProcessStart::Read(start);
                    return Some(Arc::clone(&entry.info));
                }
                Some(_) if entry.provisional => {
                    debug!(%pid, "retaking a snapshot taken mid-exec");
                }
                // Same process, or gone: the snapshot still serves its in-flight samples.
                _ => return Some(Arc::clone(&entry.info)),
            }
        }
        // The samples taken before an exit are handled before it is applied: one of a pid
        // whose exit is read but not applied is of the process that exited. 50-60 a second on
        // the host benchmark, each a snapshot attempt (its announced mappings gathered, its
        // /proc entry opened) for a process gone.
        if self.exits_ahead.contains_key(&pid) {
            self.processes.remove(&pid);
            self.stats.exits_known_at_lookup += 1;
            return self.snapshot_from_events(pid, now, 0);
        }
        match self.take_snapshot(pid, now) {
            Some(info) => Some(info),
            None => {
                // Reused and gone again: the old snapshot describes another process.
                self.processes.remove(&pid);
                self.stats.lookups_failed += 1;
                self.snapshot_from_events(pid, now, 0)
            }
        }
    }

    /// A snapshot of a process gone from /proc, built from its exec or fork event.
    fn snapshot_from_events(
        &mut self,
        pid: Pid,
        now: Instant,
        depth: usize,
    ) -> Option<Arc<ProcessInfo>> {
        let forked_from = match self.identities.get(pid) {
            Some(Identity::Fork { parent, .. }) => Some(parent),
            _ => None,
        };
        let info = Arc::new(self.build_from_events(pid, now, depth)?);
        self.stats.snapshots_from_events += 1;
        let entry = Entry {
            start: ProcessStart::Read(info.start_time),
            info: Arc::clone(&info),
            start_checked_at: now,
            refreshed_at: now,
            taken_ns: monotonic_now_ns(),
            used_in_interval: self.interval,
            provisional: false,
            // Built because /proc had no readable entry for it.
            exited: true,
            cgroup: None,
        };
        self.processes.insert(pid, entry);
        debug!(
            %pid,
            service_name = %info.labels.service_name,
            mappings = info.mappings.len(),
            forked_from = forked_from.map(|parent| parent.0),
            "snapshot from events"
        );
        Some(info)
    }

    /// When the latest exec recorded for `pid` ended, if after `time_ns`: a sample taken then
    /// is of the program before it.
    pub fn exec_after(&mut self, pid: Pid, time_ns: u64) -> Option<u64> {
        self.identities.exec_after(pid, time_ns)
    }

    /// `pid` as it was at `time_ns`, in an exec that ended at `exec_ns` (the sample's user
    /// registers are still the old program's): its snapshot if taken before the exec, else
    /// built from the fork or exec event before it, whether or not that exec is recorded yet.
    /// Never from /proc, which already shows the new program. `None` when the old program is
    /// not known; nothing is kept, as the exec has ended the old program.
    pub fn snapshot_before_exec(
        &mut self,
        pid: Pid,
        time_ns: u64,
        exec_ns: u64,
    ) -> Option<Arc<ProcessInfo>> {
        if let Some(entry) = self.processes.get_mut(&pid)
            && entry.taken_ns < exec_ns
        {
            return Some(Arc::clone(&entry.info));
        }
        let identity = match self.identities.before_exec(pid, time_ns) {
            Some(before) => before,
            // An exec after `time_ns` is recorded, but not what came before it.
            None if self.identities.exec_after(pid, time_ns).is_some() => return None,
            // The exec is not recorded yet: the identity held is the old program's.
            None => self.identities.get(pid)?,
        };
        let info = self.build_from_identity(pid, identity, Instant::now(), 0)?;
        self.stats.snapshots_before_exec += 1;
        Some(Arc::new(info))
    }

    /// When `pid` exec'ed after `time_ns`: by its exec event when applied, else by the
    /// kernel's announcements as last read (the exec event may still wait behind samples taken
    /// before it, or be written after a read of /proc that already shows the new program: the
    /// kernel announces an exec before it maps the new program). An announced exec counts only
    /// when the lifecycle events read after the announcements show no exit or fork of the pid
    /// in between ([`Self::note_process_boundary`]): else the pid was reused.
    pub fn exec_since(&mut self, pid: Pid, time_ns: u64) -> Option<u64> {
        if let Some(exec_ns) = self.identities.exec_after(pid, time_ns) {
            return Some(exec_ns);
        }
        self.mmaps.as_mut()?.log.exec_after(pid, time_ns)
    }

    /// When the process with `pid` first exited, or the pid was given to a new process, after
    /// `time_ns`, as far as the lifecycle events read so far say.
    fn changed_hands_after(&mut self, pid: Pid, time_ns: u64) -> Option<u64> {
        self.mmaps.as_mut()?.log.boundary_after(pid, time_ns)
    }

    /// A lifecycle event read from its ring (applied or not): the process with `pid` exited,
    /// or a new one was forked with it, at `time_ns`.
    pub fn note_process_boundary(&mut self, pid: Pid, time_ns: u64) {
        if let Some(events) = &mut self.mmaps {
            events.log.process_boundary(pid, time_ns);
        }
    }

    /// An exit read from the lifecycle ring, to be applied ([`Self::record_exit`]) once the
    /// samples taken before it are handled.
    pub fn note_exit_read(&mut self, pid: Pid, exit_ns: u64) {
        self.note_process_boundary(pid, exit_ns);
        // Beyond the bound an exit is not noted: its process's first lookup asks /proc.
        if self.exits_ahead.len() < MAX_EXITS_AHEAD || self.exits_ahead.contains_key(&pid) {
            self.exits_ahead.insert(pid, exit_ns);
        }
    }

    /// A fork read from the lifecycle ring: a later process has the pid, so /proc is asked
    /// again for it.
    pub fn note_fork_read(&mut self, pid: Pid, forked_ns: u64) {
        self.note_process_boundary(pid, forked_ns);
        if self
            .exits_ahead
            .get(&pid)
            .is_some_and(|&exit_ns| exit_ns <= forked_ns)
        {
            self.exits_ahead.remove(&pid);
        }
    }

    /// Whether the registry holds a snapshot of `pid`.
    pub fn has_snapshot(&self, pid: Pid) -> bool {
        self.processes.contains_key(&pid)
    }

    fn build_from_events(&mut self, pid: Pid, now: Instant, depth: usize) -> Option<ProcessInfo> {
        let identity = self.identities.get(pid)?;
        self.build_from_identity(pid, identity, now, depth)
    }

    fn build_from_identity(
        &mut self,
        pid: Pid,
        identity: Identity,
        now: Instant,
        depth: usize,
    ) -> Option<ProcessInfo> {
        let info = match identity {
            Identity::Exec(record) => self.exec_snapshot(pid, &record),
            Identity::Fork {
                parent,
                parent_info,
                forked_ns,
                inherited,
            } => {
                // A parent not snapshotted at the fork: now, from /proc or its own events (a
                // fork of a fork, a few levels at most). A parent that exec'ed since the fork
                // runs another program now (a shell forks for `<(…)`, then execs its last
                // command): as it was before that exec, never from /proc.
                let parent_info = match parent_info {
                    Some(info) => info,
                    None if depth < 4
                        && let Some(exec_ns) = self.exec_since(parent, forked_ns) =>
                    {
                        self.snapshot_before_exec(parent, forked_ns, exec_ns)?
                    }
                    // A parent that exited since the fork, its pid perhaps another process's
                    // now: a snapshot taken before that is its own, and so is an identity
                    // from before the fork; /proc is not.
                    None if depth < 4 => match (
                        self.changed_hands_after(parent, forked_ns),
                        self.processes.get_mut(&parent),
                    ) {
                        (None, Some(entry)) => Arc::clone(&entry.info),
                        (Some(ended_ns), Some(entry)) if entry.taken_ns < ended_ns => {
                            Arc::clone(&entry.info)
                        }
                        (Some(_), _) => match self.identities.get(parent) {
                            Some(identity) if identity.since_ns() <= forked_ns => Arc::new(
                                self.build_from_identity(parent, identity, now, depth + 1)?,
                            ),
                            // Forgotten (it exited long ago) or another process's now:
                            // what it ran at the fork, as its events said then.
                            _ => match self.inherited_snapshot(parent, inherited) {
                                Some(info) => info,
                                None => {
                                    self.stats.parents_gone_since_fork += 1;
                                    return None;
                                }
                            },
                        },
                        (None, None) => self
                            .take_snapshot(parent, now)
                            .or_else(|| self.snapshot_from_events(parent, now, depth + 1))
                            .or_else(|| self.inherited_snapshot(parent, inherited))?,
                    },
                    None => return None,
                };
                forked_snapshot(pid, &parent_info)
            }
        };
        Some(info)
    }

    /// The parent as a fork child's identity recorded it at the fork (see
    /// [`Identity::Fork`]'s `inherited`), for a parent whose own identity is gone.
    fn inherited_snapshot(
        &mut self,
        parent: Pid,
        inherited: Option<ForkedProgram>,
    ) -> Option<Arc<ProcessInfo>> {
        let info = match inherited? {
            ForkedProgram::Exec(record) => Arc::new(self.exec_snapshot(parent, &record)),
            ForkedProgram::Snapshot(info) => info,
        };
        self.stats.parents_from_fork_time += 1;
        Some(info)
    }

    /// What an exec event says of the program: its labels, and its main executable's code
    /// as the one mapping known.
    fn exec_snapshot(&mut self, pid: Pid, record: &ExecRecord) -> ProcessInfo {
        let exe = self.executable_paths.resolve(record);
        // Where v1 hierarchies are mounted and the fork does not say them, the v2 id's alone.
        let cgroup = match self.exec_cgroup(pid, record).0 {
            Some(cgroup) => cgroup,
            None => self.cgroups.cgroup(record.cgroup_id).unwrap_or_default(),
        };
        let cmdline = record.args.to_vec();
        let env = record
            .label_env
            .as_ref()
            .map(LabelEnv::to_map)
            .unwrap_or_default();
        // The container's names are the runtime's, found by the container id whether or not
        // the process lives; /proc/PID is not read (the pid may be another process's now).
        let kubernetes = names_in_pod(&self.proc_root, None, &cgroup, &env, &self.host);
        let labels = derive_labels(&LabelInputs {
            cmdline: &cmdline,
            env: &env,
            exe: Some(&exe),
            comm: &record.comm,
            cgroup: &cgroup,
            kubernetes: &kubernetes,
            host: &self.host,
            is_kernel_thread: false,
        });
        // All its libraries when the kernel announced its mmaps, else its main executable.
        let announced = self.announced_mappings(pid, record);
        let mappings = match (announced, record.exe, record.code) {
            (Some(mappings), ..) => mappings,
            (None, Some(id), Some((start, end))) => self
                .files
                .executable(&exe, id)
                .map(|(file, file_offset)| {
                    vec![Mapping {
                        start,
                        end,
                        file_offset,
                        name: Arc::clone(&file.path),
                        file: Some(file),
                    }]
                })
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        ProcessInfo {
            pid,
            start_time: 0,
            comm: Arc::from(record.comm.as_str()),
            labels,
            mappings,
            is_kernel_thread: false,
        }
    }

    /// What /proc/PID/maps would list as executable, from the announcements of the program
    /// `pid` exec'ed last: `None` unless that exec and every mapping since were announced and
    /// every mapped file is the one the agent opens by that path (same device and inode; a
    /// process in another mount namespace usually is not), so the list matches the maps file.
    fn complete_announced_mappings(&mut self, pid: Pid) -> Option<Vec<Mapping>> {
        let Identity::Exec(record) = self.identities.get(pid)? else {
            return None;
        };
        // Read up to now, as the maps file would be: the kernel writes an announcement during
        // the mmap itself, so every mapping made before the sample being handled is in the
        // rings, but the last drain (before this batch) may have been before it.
        self.drain_mmaps();
        let announced = self
            .mmaps
            .as_mut()?
            .log
            .complete_mappings_at(pid, record.exec_ns)?;
        if announced.is_empty() {
            return None;
        }
        announced
            .into_iter()
            .map(|mapping| {
                let file = match mapping.file {
                    Some(id) => Some(self.files.announced(&mapping.path, id)?),
                    None => None,
                };
                Some(announced_mapping(mapping, file))
            })
            .collect()
    }

    /// The executable mappings the kernel announced for the program `record` started: all its
    /// libraries, not only its main executable. `None` when that exec was not announced.
    fn announced_mappings(&mut self, pid: Pid, record: &ExecRecord) -> Option<Vec<Mapping>> {
        let announced = self.mmaps.as_mut()?.log.mappings_at(pid, record.exec_ns)?;
        if announced.is_empty() {
            return None;
        }
        let mappings = self.resolve_announced(announced);
        self.stats.snapshots_from_announced_mmaps += 1;
        Some(mappings)
    }

    /// Announced mappings with their files opened (by path, checked against the device and
    /// inode the kernel announced).
    fn resolve_announced(&mut self, announced: Vec<AnnouncedMapping>) -> Vec<Mapping> {
        announced
            .into_iter()
            .map(|mapping| {
                let file = mapping
                    .file
                    .and_then(|id| self.files.announced(&mapping.path, id));
                announced_mapping(mapping, file)
            })
            .collect()
    }

    /// Retakes the snapshot of `pid` because `addr` is in none of its mappings (a library
    /// loaded or a program exec'ed after the snapshot): at once when the kernel announced code
    /// mapped there since the snapshot (a process importing PyTorch loads libraries for
    /// seconds, and each sample in one not yet known would be cut), else at most once per
    /// recheck interval per pid (JIT code is in no file, and rereading the maps file for every
    /// sample of it would cost more than it finds). Returns the current snapshot, refreshed or
    /// not.
    pub fn refresh_for_address(&mut self, pid: Pid, addr: u64) -> Option<Arc<ProcessInfo>> {
        let now = Instant::now();
        let interval = self.interval;
        let recheck = self.config.recheck_interval;
        let Some(entry) = self.processes.get_mut(&pid) else {
            return self.lookup(pid);
        };
        entry.used_in_interval = interval;
        let previous = Arc::clone(&entry.info);
        if previous.mapping_for(addr).is_some() {
            return Some(previous);
        }
        let (refreshed_at, taken_ns) = (entry.refreshed_at, entry.taken_ns);
        if now.duration_since(refreshed_at) < recheck {
            if !self.announced_since(pid, addr, taken_ns) {
                return Some(previous);
            }
            self.stats.refreshes_announced += 1;
        }
        // Marked before reading, so a process that is gone is not retried for every sample.
        if let Some(entry) = self.processes.get_mut(&pid) {
            entry.refreshed_at = now;
            entry.taken_ns = monotonic_now_ns();
        }
        // Everything is reread, not just maps: an exec changes the program and its labels. The
        // maps file, not the announcements: they never say what was unmapped.
        match self.take_snapshot_with(pid, now, MapsSource::ProcMaps) {
            Some(info) => {
                self.stats.refreshes += 1;
                debug!(%pid, addr = format_args!("{addr:#x}"), "refreshed mappings");
                Some(info)
            }
            // Gone: what the kernel announced its program mapped may still place the address
            // (a library mapped after a snapshot taken while ld.so was loading them), else
            // the old snapshot keeps serving in-flight samples.
            None => self
                .refresh_from_announcements(pid, &previous, addr, taken_ns)
                .or(Some(previous)),
        }
    }

    /// `previous` with the mappings the kernel announced for the program it was a snapshot of
    /// (the one `pid` ran at `taken_ns`), when they place `addr`: for a process gone from
    /// /proc. Who it was (name, labels) stays as read before.
    fn refresh_from_announcements(
        &mut self,
        pid: Pid,
        previous: &ProcessInfo,
        addr: u64,
        taken_ns: u64,
    ) -> Option<Arc<ProcessInfo>> {
        self.drain_mmaps();
        let announced = self.mmaps.as_mut()?.log.mappings_at(pid, taken_ns)?;
        if !announced.iter().any(|m| m.start <= addr && addr < m.end) {
            return None;
        }
        let mappings = self.resolve_announced(announced);
        let info = Arc::new(ProcessInfo {
            pid: previous.pid,
            start_time: previous.start_time,
            comm: Arc::clone(&previous.comm),
            labels: previous.labels.clone(),
            mappings,
            is_kernel_thread: previous.is_kernel_thread,
        });
        if let Some(entry) = self.processes.get_mut(&pid) {
            entry.info = Arc::clone(&info);
        }
        self.stats.refreshes += 1;
        self.stats.refreshes_from_announcements += 1;
        debug!(%pid, addr = format_args!("{addr:#x}"), "mappings refreshed from announcements");
        Some(info)
    }

    /// Whether the kernel announced code mapped at `addr` by `pid` at or after `since_ns`
    /// (the rings read up to now first).
    fn announced_since(&mut self, pid: Pid, addr: u64, since_ns: u64) -> bool {
        self.drain_mmaps();
        self.mmaps
            .as_mut()
            .is_some_and(|events| events.log.announced_since(pid, addr, since_ns))
    }

    /// Drops the snapshot of `pid` (it exec'ed a new program): the next lookup takes a new one.
    pub fn forget(&mut self, pid: Pid) {
        self.processes.remove(&pid);
    }

    /// Drops snapshots of processes that have exited and were not looked up since the previous
    /// call. Call once per interval.
    pub fn evict_exited(&mut self) {
        let current = self.interval;
        let proc_root = &self.proc_root;
        // Asking /proc about every snapshot unused for an interval was 1.7 % of the agent's CPU
        // on a host forking 500 times a second, nearly all for processes whose exit is known.
        self.processes.retain(|pid, entry| {
            entry.used_in_interval >= current
                || (!entry.exited && process_dir(proc_root, *pid).exists())
        });
        // Exits expire older ones as they come; this catches up after the last exit.
        let now_ns = monotonic_now_ns();
        self.identities.expire(now_ns);
        if let Some(events) = &mut self.mmaps {
            events.log.expire(now_ns);
        }
        self.interval += 1;
    }

    /// What the exec event of the program `pid` runs already says, so its snapshot need not
    /// read it from /proc again: its arguments when the event holds all of them, and its cgroup
    /// on a host with cgroup v2 alone (one hierarchy, whose id the event carries). Nothing for a
    /// process that has not exec'ed since the agent started.
    fn known_program(&mut self, pid: Pid) -> KnownProgram {
        match self.identities.get(pid) {
            Some(Identity::Exec(record)) => self.known_from(pid, &record),
            _ => KnownProgram::default(),
        }
    }

    /// What the exec event `record` of `pid` says of its program (see
    /// [`Self::known_program`]); its cgroups also when known from its fork.
    fn known_from(&mut self, pid: Pid, record: &ExecRecord) -> KnownProgram {
        let (cgroup, cgroup_from_fork) = self.exec_cgroup(pid, record);
        KnownProgram {
            comm: record.comm.clone(),
            cmdline: record.args_complete.then(|| record.args.to_vec()),
            env: record.label_env.as_ref().map(LabelEnv::to_map),
            cgroup,
            cgroup_from_fork,
        }
    }

    /// The cgroups of the program `pid` exec'ed (`record`), when known without /proc: from
    /// the event's cgroup v2 id on a host with cgroup v2 alone, else from its fork while no
    /// task of it moved since (then with that knowledge).
    fn exec_cgroup(
        &mut self,
        pid: Pid,
        record: &ExecRecord,
    ) -> (Option<CgroupInfo>, Option<KnownCgroup>) {
        if let Some(cgroup) = self.cgroups.unified_cgroup(record.cgroup_id) {
            return (Some(cgroup), None);
        }
        let known = self
            .identities
            .exec_cgroup(pid, record.exec_ns)
            .filter(|known| !self.cgroup_moves.moved_since(pid, known.since_ns));
        (
            known.as_ref().map(|known| CgroupInfo::clone(&known.info)),
            known,
        )
    }

    /// Reads /proc/PID and stores the snapshot; `None` when the process does not exist. The
    /// mappings come from the kernel's announcements when they are complete for the program
    /// it runs, else from /proc/PID/maps (the larger part of a snapshot's cost).
    fn take_snapshot(&mut self, pid: Pid, now: Instant) -> Option<Arc<ProcessInfo>> {
        self.take_snapshot_with(pid, now, MapsSource::AnnouncementsWhenComplete)
    }

    fn take_snapshot_with(
        &mut self,
        pid: Pid,
        now: Instant,
        maps: MapsSource,
    ) -> Option<Arc<ProcessInfo>> {
        // Before anything is read: code mapped from now on may be missing from the snapshot.
        let taken_ns = monotonic_now_ns();
        let process_dir = process_dir(&self.proc_root, pid);
        let announced = match maps {
            MapsSource::AnnouncementsWhenComplete => self.complete_announced_mappings(pid),
            MapsSource::ProcMaps => None,
        };
        let from_announcements = announced.is_some();
        let from_exec = announced
            .as_deref()
            .and_then(|mappings| self.identity_from_exec(pid, &process_dir, mappings, taken_ns));
        let snapshot = match (from_exec, announced) {
            (Some((identity, exec_ns)), Some(mappings)) => {
                Ok((identity.with_mappings(pid, mappings), Some(exec_ns)))
            }
            (_, announced) => {
                let known = self.known_program(pid);
                open_process_dir(&process_dir).and_then(|dir| {
                    let identity = read_identity_in(
                        pid,
                        &process_dir,
                        &dir,
                        &self.host,
                        known,
                        &mut self.cgroup_texts,
                        taken_ns,
                    )?;
                    Ok((
                        match announced {
                            Some(mappings) => identity.with_mappings(pid, mappings),
                            None => {
                                read_mappings(pid, &process_dir, &dir, identity, &mut self.files)
                            }
                        },
                        None,
                    ))
                })
            }
        };
        let (snapshot, execed_at) = match snapshot {
            Ok(taken) => taken,
            Err(error) => {
                debug!(%pid, %error, "no snapshot");
                return None;
            }
        };
        let (info, provisional) = (Arc::new(snapshot.info), snapshot.provisional);
        self.stats.snapshots_taken += 1;
        if snapshot.cmdline_from_exec {
            self.stats.cmdlines_from_exec += 1;
        }
        if from_announcements {
            self.stats.maps_from_announcements += 1;
        }
        if execed_at.is_some() {
            self.stats.identities_from_exec += 1;
        }
        if snapshot.cgroup_from_fork {
            self.stats.cgroups_from_fork += 1;
        }
        // Taken again (a provisional one after a move, a library loaded): the cgroups known
        // from before are kept where they still hold. Events are applied in order, so an
        // entry not marked exited is of the process with the pid now; and were it not (an
        // exit lost), the cgroups the pid's process had then, unmoved since and read the same
        // now, are still those of any process with the pid.
        let moves = &self.cgroup_moves;
        let cgroup = match self.processes.peek_mut(&pid) {
            Some(old) if !old.exited => match &old.cgroup {
                Some(known) => {
                    known.kept_across(snapshot.cgroup, |since| moves.moved_since(pid, since))
                }
                None => snapshot.cgroup,
            },
            _ => snapshot.cgroup,
        };
        let entry = Entry {
            start: execed_at.map_or(ProcessStart::Read(info.start_time), ProcessStart::ExecedAt),
            info: Arc::clone(&info),
            start_checked_at: now,
            refreshed_at: now,
            taken_ns,
            used_in_interval: self.interval,
            provisional,
            exited: false,
            cgroup,
        };
        if let Some((evicted, _)) = self.processes.insert(pid, entry) {
            debug!(pid = %evicted, "snapshot evicted: too many processes");
        }
        Some(info)
    }

    /// Who a live process is, from its exec event instead of /proc/PID/stat and exe, when the
    /// events prove it: the exec recorded is the latest one announced, no exit or fork of the
    /// pid is logged since, and `mappings` (complete since that exec) hold the exec'ed file,
    /// whose path is what /proc/PID/exe shows (for a script, its interpreter: the file the
    /// kernel ran). Only what the event lacks is read from /proc: the command line when longer
    /// than the event holds, the environment when larger, and the cgroup where v1 hierarchies
    /// are mounted (the event has the v2 id alone). The name is the one the exec gave; a
    /// rename since (`prctl(PR_SET_NAME)`) is not seen, as it is not in a snapshot taken
    /// before the rename. Returns the identity and the exec's time (which tells the process
    /// from a later one with its pid); `None`: read /proc instead.
    fn identity_from_exec(
        &mut self,
        pid: Pid,
        process_dir: &Path,
        mappings: &[Mapping],
        taken_ns: u64,
    ) -> Option<(LabelledProcess, u64)> {
        let Some(Identity::Exec(record)) = self.identities.get(pid) else {
            return None;
        };
        if self.changed_hands_after(pid, record.exec_ns).is_some() {
            return None;
        }
        let exe_id = record.exe?;
        let exe = mappings
            .iter()
            .find(|m| m.file.as_ref().is_some_and(|file| file.id == exe_id))?;
        let exe = exe
            .name
            .strip_suffix(maps::DELETED_SUFFIX)
            .unwrap_or(&exe.name);
        let known = self.known_from(pid, &record);
        let needs_proc = known.cmdline.is_none() || known.env.is_none() || known.cgroup.is_none();
        let dir = match needs_proc {
            true => Some(open_process_dir(process_dir).ok()?),
            false => None,
        };
        let read = |name: &CStr| dir.as_ref().and_then(|dir| dir.read(name).ok());
        let cmdline_from_exec = known.cmdline.is_some();
        let cmdline = match known.cmdline {
            Some(cmdline) => cmdline,
            // Gone, or not readable: /proc is read the usual way, which tells.
            None => Some(parse_cmdline(&read(c"cmdline")?)).filter(|c| !c.is_empty())?,
        };
        let env = known.env.unwrap_or_else(|| {
            read(c"environ")
                .map(|raw| parse_environ(&raw))
                .unwrap_or_default()
        });
        let (cgroup, known_cgroup) = match known.cgroup {
            Some(cgroup) => (cgroup, known.cgroup_from_fork),
            None => cgroup_of(read(c"cgroup"), &mut self.cgroup_texts, taken_ns),
        };
        let kubernetes = pod_names(process_dir, &cgroup, &env, &self.host);
        let labels = derive_labels(&LabelInputs {
            cmdline: &cmdline,
            env: &env,
            exe: Some(exe),
            comm: &known.comm,
            cgroup: &cgroup,
            kubernetes: &kubernetes,
            host: &self.host,
            is_kernel_thread: false,
        });
        let identity = LabelledProcess {
            comm: known.comm,
            start_time: 0,
            labels,
            is_kernel_thread: false,
            provisional: false,
            cmdline_from_exec,
            cgroup: known_cgroup,
        };
        Some((identity, record.exec_ns))
    }
}

/// Where a snapshot's mappings come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MapsSource {
    /// The kernel's announcements when complete for the process's program, else the maps file.
    AnnouncementsWhenComplete,
    ProcMaps,
}

/// An announced mapping as a snapshot's mapping, named as /proc/PID/maps names it.
fn announced_mapping(mapping: AnnouncedMapping, file: Option<Arc<MappedFile>>) -> Mapping {
    let name = match &file {
        Some(file) => Arc::clone(&file.path),
        // perf's name for anonymous executable memory (JIT code); the maps file leaves it blank.
        None if &*mapping.path == ANNOUNCED_ANONYMOUS_NAME => Arc::from(maps::ANONYMOUS_NAME),
        None => mapping.path,
    };
    Mapping {
        start: mapping.start,
        end: mapping.end,
        file_offset: mapping.file_offset,
        name,
        file,
    }
}

/// /proc/PID under `proc_root`.
fn process_dir(proc_root: &Path, pid: Pid) -> PathBuf {
    proc_root.join(pid.0.to_string())
}

/// Opens a process's directory; a missing one (the process exited) is a read error of it.
fn open_process_dir(process_dir: &Path) -> Result<ProcDir, ProcessError> {
    ProcDir::open(process_dir).map_err(|source| ProcessError::Read {
        path: process_dir.to_owned(),
        source,
    })
}

/// How the kernel's mmap announcements name anonymous memory.
const ANNOUNCED_ANONYMOUS_NAME: &str = "//anon";

/// A process as read from /proc.
#[derive(Debug)]
pub struct Snapshot {
    pub info: ProcessInfo,
    /// A user process without a command line: read between `execve` replacing the address space
    /// and the kernel writing argv and the environment (a vfork parent, like the spawner, is
    /// released in between), so labels may be missing. Worth reading again.
    pub provisional: bool,
    /// See [`LabelledProcess::cmdline_from_exec`].
    pub cmdline_from_exec: bool,
    /// See [`LabelledProcess::cgroup`].
    pub cgroup: Option<KnownCgroup>,
    /// `cgroup` came from the process's fork, not /proc/PID/cgroup.
    pub cgroup_from_fork: bool,
}

/// Who a process is, as read from /proc: its name, labels and start time.
#[derive(Clone, Debug)]
pub struct LabelledProcess {
    pub comm: String,
    pub start_time: u64,
    pub labels: ProcessLabels,
    pub is_kernel_thread: bool,
    /// Read before the kernel wrote argv (see [`Snapshot::provisional`]).
    pub provisional: bool,
    /// The command line came from the exec event, not /proc/PID/cmdline.
    pub cmdline_from_exec: bool,
    /// Its cgroups, for its fork children: as read from /proc now, or known from its fork.
    pub cgroup: Option<KnownCgroup>,
}

/// Reads who a process is. Only /proc/PID/stat is required; every other file may vanish as the
/// process exits and then contributes nothing.
pub fn read_identity(
    pid: Pid,
    process_dir: &Path,
    host: &str,
) -> Result<LabelledProcess, ProcessError> {
    let dir = open_process_dir(process_dir)?;
    read_identity_alone(pid, process_dir, &dir, host)
}

/// [`read_identity_in`] of a process the registry knows nothing of, outside any registry.
fn read_identity_alone(
    pid: Pid,
    process_dir: &Path,
    dir: &ProcDir,
    host: &str,
) -> Result<LabelledProcess, ProcessError> {
    let mut cgroup_texts = ParseMemo::new(1);
    let known = KnownProgram::default();
    read_identity_in(pid, process_dir, dir, host, known, &mut cgroup_texts, 0)
}

/// What a process's exec event says of it (see `ProcessRegistry::known_program`); what is
/// `None` is read from /proc.
#[derive(Debug, Default)]
struct KnownProgram {
    /// The name the exec gave the process. Another name in /proc/PID/stat means the event is
    /// not of the program the process runs (a later exec's event was lost), or the program
    /// renamed itself: all is read from /proc then.
    comm: String,
    cmdline: Option<Vec<String>>,
    /// The labels' variables of the environment the program started with (what
    /// /proc/PID/environ shows, unless the program wrote over it since).
    env: Option<BTreeMap<String, String>>,
    cgroup: Option<CgroupInfo>,
    /// `cgroup`, when it came from the process's fork.
    cgroup_from_fork: Option<KnownCgroup>,
}

/// [`read_identity`] from the process's directory, already open, from `read_ns` on
/// (`bpf_ktime_get_ns` time).
fn read_identity_in(
    pid: Pid,
    process_dir: &Path,
    dir: &ProcDir,
    host: &str,
    known: KnownProgram,
    cgroup_texts: &mut ParseMemo<CgroupInfo>,
    read_ns: u64,
) -> Result<LabelledProcess, ProcessError> {
    let stat_path = || process_dir.join("stat");
    let stat_text = dir
        .read_to_string(c"stat")
        .map_err(|source| ProcessError::Read {
            path: stat_path(),
            source,
        })?;
    let stat =
        parse_stat(&stat_text).ok_or_else(|| ProcessError::MalformedStat { path: stat_path() })?;
    // Its memory and command line are gone already; the exec or fork event says who it was.
    if matches!(stat.state, 'Z' | 'X') {
        return Err(ProcessError::Exiting { pid });
    }

    // The same `task->comm` as /proc/PID/comm, without opening another file.
    let comm = stat.comm.clone();
    let known = if known.comm == comm {
        known
    } else {
        KnownProgram::default()
    };
    let cmdline_from_exec = known.cmdline.is_some();
    let cmdline = known.cmdline.unwrap_or_else(|| {
        dir.read(c"cmdline")
            .map(|raw| parse_cmdline(&raw))
            .unwrap_or_default()
    });
    let exe = dir.read_link(c"exe").ok().map(|path| {
        let path = path.to_string_lossy().into_owned();
        match path.strip_suffix(maps::DELETED_SUFFIX) {
            Some(stripped) => stripped.to_owned(),
            None => path,
        }
    });
    let is_kernel_thread = is_kernel_thread(Some(stat.flags), cmdline.is_empty(), exe.is_some());
    // A user process without a command line and an executable has lost its memory: it is
    // exiting, its state not yet `Z` (exec keeps the executable set while the command line is
    // not yet there). Read now, it would be named after nothing; its exec or fork event says
    // who it was, and the kernel's announcements what it had mapped. A command line from the
    // exec event says nothing of that: the executable alone tells.
    if !is_kernel_thread && exe.is_none() && (cmdline_from_exec || cmdline.is_empty()) {
        return Err(ProcessError::Exiting { pid });
    }

    // Kernel threads have no environment or cgroup of interest.
    let (env, (cgroup, known_cgroup)) = if is_kernel_thread {
        Default::default()
    } else {
        let env = known.env.unwrap_or_else(|| {
            dir.read(c"environ")
                .map(|raw| parse_environ(&raw))
                .unwrap_or_default()
        });
        let cgroup = match known.cgroup {
            Some(cgroup) => (cgroup, known.cgroup_from_fork),
            None => cgroup_of(dir.read(c"cgroup").ok(), cgroup_texts, read_ns),
        };
        (env, cgroup)
    };
    let kubernetes = pod_names(process_dir, &cgroup, &env, host);
    let labels = derive_labels(&LabelInputs {
        cmdline: &cmdline,
        env: &env,
        exe: exe.as_deref(),
        comm: &comm,
        cgroup: &cgroup,
        kubernetes: &kubernetes,
        host,
        is_kernel_thread,
    });
    Ok(LabelledProcess {
        comm,
        start_time: stat.start_time,
        labels,
        is_kernel_thread,
        provisional: !is_kernel_thread && cmdline.is_empty(),
        cmdline_from_exec,
        cgroup: known_cgroup,
    })
}

/// The cgroups of /proc/PID/cgroup's text `raw` (none when it could not be read), and what
/// is known of them from `read_ns` on.
fn cgroup_of(
    raw: Option<Vec<u8>>,
    cgroup_texts: &mut ParseMemo<CgroupInfo>,
    read_ns: u64,
) -> (CgroupInfo, Option<KnownCgroup>) {
    let Some(raw) = raw else {
        return Default::default();
    };
    let cgroup = cgroup_texts.get_or_parse(&raw, parse_cgroup_bytes);
    let known = KnownCgroup {
        info: Arc::new(cgroup.clone()),
        since_ns: read_ns,
        v2_id: None,
        all_threads: false,
        text: std::str::from_utf8(&raw).ok().map(Arc::from),
    };
    (cgroup, Some(known))
}

/// The Kubernetes names of a process in a pod's cgroup (none for any other process).
fn pod_names(
    process_dir: &Path,
    cgroup: &CgroupInfo,
    env: &BTreeMap<String, String>,
    host: &str,
) -> KubernetesNames {
    match process_dir.parent() {
        Some(proc_root) => names_in_pod(proc_root, Some(process_dir), cgroup, env, host),
        None => KubernetesNames::default(),
    }
}

/// The Kubernetes names of a process in a pod (none outside one); without `process_dir`, from
/// the container runtime's config and the environment alone.
fn names_in_pod(
    proc_root: &Path,
    process_dir: Option<&Path>,
    cgroup: &CgroupInfo,
    env: &BTreeMap<String, String>,
    host: &str,
) -> KubernetesNames {
    match &cgroup.pod_uid {
        Some(_) => kubernetes_names(&KubernetesSources {
            process_dir,
            host_root: &proc_root.join("1").join("root"),
            container_id: cgroup.container_id.as_deref(),
            env,
            host,
        }),
        None => KubernetesNames::default(),
    }
}

impl LabelledProcess {
    /// The snapshot of this process with `mappings` (from /proc/PID/maps or announcements).
    pub fn with_mappings(self, pid: Pid, mappings: Vec<Mapping>) -> Snapshot {
        debug!(%pid, comm = %self.comm, service_name = %self.labels.service_name, mappings = mappings.len(), "snapshot");
        Snapshot {
            provisional: self.provisional,
            cmdline_from_exec: self.cmdline_from_exec,
            cgroup_from_fork: self.cgroup.as_ref().is_some_and(|known| known.all_threads),
            cgroup: self.cgroup,
            info: ProcessInfo {
                pid,
                start_time: self.start_time,
                comm: Arc::from(self.comm),
                labels: self.labels,
                mappings,
                is_kernel_thread: self.is_kernel_thread,
            },
        }
    }
}

/// Reads one process: who it is ([`read_identity`]) and its executable mappings.
pub fn read_process(
    pid: Pid,
    process_dir: &Path,
    host: &str,
    files: &mut FileCache,
) -> Result<Snapshot, ProcessError> {
    let dir = open_process_dir(process_dir)?;
    let identity = read_identity_alone(pid, process_dir, &dir, host)?;
    Ok(read_mappings(pid, process_dir, &dir, identity, files))
}

/// The snapshot of a process whose identity was read, with its executable mappings from
/// /proc/PID/maps.
fn read_mappings(
    pid: Pid,
    process_dir: &Path,
    dir: &ProcDir,
    identity: LabelledProcess,
    files: &mut FileCache,
) -> Snapshot {
    // Kernel threads have no user mappings.
    let mappings = if identity.is_kernel_thread {
        Vec::new()
    } else {
        dir.read_to_string(c"maps")
            .map(|text| executable_mappings(pid, process_dir, &text, files))
            .unwrap_or_default()
    };
    identity.with_mappings(pid, mappings)
}

#[cfg(test)]
mod tests;
