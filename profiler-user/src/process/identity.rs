//! Who a process is when /proc can no longer say: the exec and fork events.
//!
//! A process that exits before the agent reads /proc/PID (a compiler, a `sh -c`, a test
//! helper, a worker forked for a moment) would otherwise be named by its sample's thread name
//! (`lto cgu.1`, `ctrl-c`), with no `executable` label and no mappings. The BPF exec event
//! carries the path, the arguments, the cgroup, the executable's inode and the range of its
//! code; the fork event carries the parent. From them the registry builds a snapshot:
//!
//! - after an exec: the labels of the program it became (the same rules as /proc gives them,
//!   without the environment, which the event does not carry), the cgroup's labels from its
//!   path, and one mapping, the main executable's code, when the file on disk is still the one
//!   that was exec'ed (same inode);
//! - after a fork without exec: the parent's snapshot (the child runs the parent's program,
//!   mapped at the same addresses), under the child's pid.

use std::{
    collections::{HashMap, VecDeque},
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use object::read::ReadCache;

use super::{
    EXITED_PROCESS_RETENTION_NS,
    cgroup::{CgroupInfo, KnownCgroup, parse_cgroup},
};
use crate::{
    bounded::TwoGenerationCache,
    model::{ExecRecord, FileId, MappedFile, Pid, ProcessInfo},
};

/// Identities of running processes kept at most, in two generations (those not used during a
/// whole generation are forgotten first, should exits go unseen).
pub const MAX_LIVE_IDENTITIES: usize = 16_384;

/// Identities of exited processes kept at most, for their samples still in flight and for
/// the children forked from them: in two generations, so the latest 4,096 exits are always
/// kept (7 s of the busiest host measured), earlier ones go a generation at a time.
pub const MAX_EXITED_IDENTITIES: usize = 8_192;

/// What the events say about a process.
#[derive(Clone, Debug)]
pub enum Identity {
    /// It exec'ed this program.
    Exec(Arc<ExecRecord>),
    /// It was forked from `parent` at `forked_ns` (`bpf_ktime_get_ns` time) and has not
    /// exec'ed; the parent's snapshot at the fork.
    Fork {
        parent: Pid,
        parent_info: Option<Arc<ProcessInfo>>,
        forked_ns: u64,
        /// Without a snapshot of the parent at the fork: what its own events said it ran then,
        /// for when the parent's identity is gone (it exited long before the child).
        inherited: Option<ForkedProgram>,
    },
}

/// The program a fork child runs until it execs, as known at the fork.
#[derive(Clone, Debug)]
pub enum ForkedProgram {
    /// The parent's (or an ancestor's, forked without exec since) exec event.
    Exec(Arc<ExecRecord>),
    /// A snapshot of the ancestor the parent was forked from without exec since.
    Snapshot(Arc<ProcessInfo>),
}

impl Identity {
    /// When the process became what it says: its exec, or its fork.
    pub fn since_ns(&self) -> u64 {
        match self {
            Identity::Exec(record) => record.exec_ns,
            Identity::Fork { forked_ns, .. } => *forked_ns,
        }
    }
}

/// The latest identity per pid, and the one before its latest exec, bounded.
///
/// Running processes and exited ones are bounded apart: on a host that forks hundreds of
/// times a second, one bound would forget a long-running parent (a service's supervisor, a
/// build's driver) within seconds, and with it the name of every child it forks that exits
/// before /proc is read.
///
/// Flat maps in two generations rather than linked LRU lists: every fork, exec and exit on the
/// host records here, and a list's scattered nodes cost a few cache misses each time.
#[derive(Debug)]
pub struct Identities {
    live: TwoGenerationCache<Pid, Entry>,
    /// With the exit's time; never moved forward by a lookup, so they go in the order of their
    /// exits.
    exited: TwoGenerationCache<Pid, (Entry, u64)>,
    /// The exits in the order applied, for their expiry: (pid, exit time).
    exits: VecDeque<(Pid, u64)>,
    /// Exited identities forgotten [`EXITED_PROCESS_RETENTION_NS`] after their exit.
    expired: u64,
}

#[derive(Debug)]
struct Entry {
    current: Identity,
    /// What the process was before the exec `current` records: for its samples taken in
    /// that exec, handled after it.
    before_exec: Option<Identity>,
    /// Its cgroups, when known from its fork (an exec keeps them) and the moves since.
    cgroup: Option<KnownCgroup>,
}

impl Default for Identities {
    fn default() -> Self {
        Identities {
            live: TwoGenerationCache::new(MAX_LIVE_IDENTITIES),
            exited: TwoGenerationCache::new(MAX_EXITED_IDENTITIES),
            exits: VecDeque::new(),
            expired: 0,
        }
    }
}

impl Identities {
    /// Records what the latest event of `pid` says it is, with its cgroups when known.
    pub fn record(&mut self, pid: Pid, identity: Identity, cgroup: Option<KnownCgroup>) {
        let before_exec = match identity {
            // Its old program, unless that entry is another process's (a pid reused).
            Identity::Exec(_) => self.entry(pid).map(|entry| entry.current.clone()),
            Identity::Fork { .. } => None,
        };
        let entry = Entry {
            current: identity,
            before_exec,
            cgroup,
        };
        // A pid recorded again is a running process (an exec, or a new process reusing it).
        self.exited.remove(&pid);
        self.live.insert(pid, entry);
    }

    /// The process exited at `exit_ns` (CLOCK_MONOTONIC): its identity is kept, among the
    /// exited ones, while its last samples and its children may still ask, for
    /// [`EXITED_PROCESS_RETENTION_NS`]. Those that exited longer ago go now.
    pub fn exited(&mut self, pid: Pid, exit_ns: u64) {
        if let Some(entry) = self.live.remove(&pid) {
            self.exited.insert(pid, (entry, exit_ns));
            if self.exits.len() >= MAX_EXITED_IDENTITIES {
                // Its identity went with a generation already.
                self.exits.pop_front();
            }
            self.exits.push_back((pid, exit_ns));
        }
        self.expire(exit_ns);
    }

    /// Forgets the identities of processes that exited [`EXITED_PROCESS_RETENTION_NS`] or
    /// more before `now_ns` (CLOCK_MONOTONIC).
    pub fn expire(&mut self, now_ns: u64) {
        let before = now_ns.saturating_sub(EXITED_PROCESS_RETENTION_NS);
        while let Some(&(pid, exit_ns)) = self.exits.front()
            && exit_ns < before
        {
            self.exits.pop_front();
            // Unless the pid ran again since (recorded anew, maybe exited again later), or the
            // identity went with a generation.
            if self
                .exited
                .peek_mut(&pid)
                .is_some_and(|(_, exited_ns)| *exited_ns == exit_ns)
            {
                self.exited.remove(&pid);
                self.expired += 1;
            }
        }
    }

    /// Exited identities forgotten for their age so far.
    pub fn expired(&self) -> u64 {
        self.expired
    }

    /// Exited identities held.
    pub fn exited_len(&self) -> usize {
        self.exited.len()
    }

    fn entry(&mut self, pid: Pid) -> Option<&mut Entry> {
        if let Some(entry) = self.live.get_mut(&pid) {
            return Some(entry);
        }
        self.exited.peek_mut(&pid).map(|(entry, _)| entry)
    }

    /// The identity of `pid` while it runs (not one kept after its exit: a process forking
    /// under that pid now is a later one).
    pub fn get_running(&mut self, pid: Pid) -> Option<Identity> {
        self.live.get_mut(&pid).map(|entry| entry.current.clone())
    }

    /// The cgroups of `pid` while it runs, when known from its fork.
    pub fn running_cgroup(&mut self, pid: Pid) -> Option<KnownCgroup> {
        self.live.get_mut(&pid)?.cgroup.clone()
    }

    /// What is known of the cgroups of `pid` while it runs, to change at a move of it.
    pub fn running_cgroup_mut(&mut self, pid: Pid) -> Option<&mut Option<KnownCgroup>> {
        self.live.get_mut(&pid).map(|entry| &mut entry.cgroup)
    }

    /// The cgroups of the program `pid` exec'ed at `exec_ns`, when known from its fork.
    pub fn exec_cgroup(&mut self, pid: Pid, exec_ns: u64) -> Option<KnownCgroup> {
        let entry = self.entry(pid)?;
        match &entry.current {
            Identity::Exec(record) if record.exec_ns == exec_ns => entry.cgroup.clone(),
            _ => None,
        }
    }

    pub fn get(&mut self, pid: Pid) -> Option<Identity> {
        self.entry(pid).map(|entry| entry.current.clone())
    }

    /// What `pid` was at `time_ns`, when its latest recorded exec ended after then: the
    /// identity before that exec. `None` when no recorded exec ended after `time_ns`, or when
    /// the process exec'ed twice since (the one before is not kept).
    pub fn before_exec(&mut self, pid: Pid, time_ns: u64) -> Option<Identity> {
        let entry = self.entry(pid)?;
        let Identity::Exec(record) = &entry.current else {
            return None;
        };
        if record.exec_ns <= time_ns {
            return None;
        }
        match entry.before_exec.clone()? {
            Identity::Exec(earlier) if earlier.exec_ns > time_ns => None,
            before => Some(before),
        }
    }

    /// When the latest exec recorded for `pid` ended, if it ended after `time_ns`.
    pub fn exec_after(&mut self, pid: Pid, time_ns: u64) -> Option<u64> {
        match &self.entry(pid)?.current {
            Identity::Exec(record) if record.exec_ns > time_ns => Some(record.exec_ns),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.live.len() + self.exited.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The exec'ed path with its links resolved, when it still names the exec'ed file.
fn resolved_executable_path(record: &ExecRecord) -> Option<String> {
    let path = Path::new(&record.filename);
    if path.is_absolute()
        && let Ok(real) = fs::canonicalize(path)
        && record
            .exe
            .is_none_or(|id| fs::metadata(&real).is_ok_and(|m| FileId::of(&m) == id))
    {
        return Some(real.to_string_lossy().into_owned());
    }
    None
}

/// Exec'ed paths remembered with their symbolic links resolved (about 200 bytes each).
pub const MAX_EXECUTABLE_PATHS: usize = 1_024;

/// Exec'ed paths resolved, remembered by the path given to execve: resolving it costs a
/// `readlink` for every component of the path and a `stat` of the result, and a busy host
/// execs the same few programs hundreds of times a second (in the host benchmark about 270 of
/// the agent's system calls a second). A remembered path is used only for the file it was
/// resolved to (its device and inode): one replaced since resolves again. Only absolute
/// paths of exec events that name their file are kept; the rest cost no system call.
#[derive(Debug)]
pub struct ExecutablePaths {
    paths: TwoGenerationCache<Box<str>, (FileId, Arc<str>)>,
}

impl Default for ExecutablePaths {
    fn default() -> Self {
        Self {
            paths: TwoGenerationCache::new(MAX_EXECUTABLE_PATHS),
        }
    }
}

impl ExecutablePaths {
    /// The executable path `record` names, as /proc/PID/exe would: symbolic links resolved
    /// when the path still names the exec'ed file, else the path as given.
    pub fn resolve(&mut self, record: &ExecRecord) -> String {
        self.resolved(record)
            .unwrap_or_else(|| record.filename.clone())
    }

    fn resolved(&mut self, record: &ExecRecord) -> Option<String> {
        let Some(id) = record
            .exe
            .filter(|_| Path::new(&record.filename).is_absolute())
        else {
            return resolved_executable_path(record);
        };
        if let Some((resolved_for, path)) = self.paths.get(record.filename.as_str())
            && resolved_for == id
        {
            return Some(path.to_string());
        }
        // Not remembered unresolved: the file may be back at its path by the next exec.
        let path = resolved_executable_path(record)?;
        self.paths.insert(
            record.filename.as_str().into(),
            (id, Arc::from(path.as_str())),
        );
        Some(path)
    }

    pub fn len(&self) -> usize {
        self.paths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.paths.len() == 0
    }
}

/// Where the main executable's code starts in the file: `mm->start_code` is the load address
/// of the lowest executable segment, whose file offset this is.
pub fn code_file_offset(file: &fs::File) -> Option<u64> {
    let cache = ReadCache::new(file);
    let headers = super::elf_headers::ElfHeaders::parse(&cache).ok()?;
    headers
        .loads
        .iter()
        .filter(|load| load.executable)
        .min_by_key(|load| load.vaddr)
        .map(|load| load.file_offset)
}

/// The exec'ed file when it is still on disk as it was exec'ed (same inode).
pub fn open_executable(path: &str, expected: FileId) -> Option<(fs::File, PathBuf)> {
    let file = fs::File::open(path).ok()?;
    (FileId::of(&file.metadata().ok()?) == expected).then(|| (file, PathBuf::from(path)))
}

/// The cgroup v2 path of a cgroup id: ids are the inode numbers of the cgroup directories, so
/// the cgroup2 mount is walked and remembered, and walked again (at most once a second) when
/// an id is not known yet.
#[derive(Debug)]
pub struct CgroupPaths {
    root: Option<PathBuf>,
    /// cgroup v2 is the only hierarchy mounted: a process's cgroup is the one its id names, as
    /// /proc/PID/cgroup would say (with v1 hierarchies too, that file says more).
    unified: bool,
    paths: HashMap<u64, String>,
    walked_at: Option<Instant>,
}

/// Cgroup directories remembered at most.
const MAX_CGROUPS: usize = 65_536;

impl CgroupPaths {
    /// Finds the cgroup2 mount in the agent's mount table.
    pub fn new() -> Self {
        Self::from_mountinfo(&fs::read_to_string("/proc/self/mountinfo").unwrap_or_default())
    }

    /// From the text of a mount table (/proc/PID/mountinfo).
    pub fn from_mountinfo(mountinfo: &str) -> Self {
        let mut paths = Self::with_root(cgroup2_mount(mountinfo));
        paths.unified = paths.root.is_some() && !has_cgroup_v1_mount(mountinfo);
        paths
    }

    pub fn with_root(root: Option<PathBuf>) -> Self {
        CgroupPaths {
            unified: false,
            root,
            paths: HashMap::new(),
            walked_at: None,
        }
    }

    /// Cgroup directories remembered (bounded by `MAX_CGROUPS`).
    pub fn len(&self) -> usize {
        self.paths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// The path of cgroup `id` relative to the cgroup2 root (`/system.slice/x.service`).
    pub fn path(&mut self, id: u64) -> Option<String> {
        if id == 0 {
            return None;
        }
        if let Some(path) = self.paths.get(&id) {
            return Some(path.clone());
        }
        let root = self.root.clone()?;
        if self
            .walked_at
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return None;
        }
        self.walked_at = Some(Instant::now());
        self.paths.clear();
        self.walk(&root, &root);
        self.paths.get(&id).cloned()
    }

    /// What the v2 path of cgroup `id` says of a process in it, when the id's directory is
    /// found.
    pub fn cgroup(&mut self, id: u64) -> Option<CgroupInfo> {
        self.path(id)
            .map(|path| parse_cgroup(&format!("0::{path}")))
    }

    /// What /proc/PID/cgroup would say of a process in cgroup `id`, without reading it: only
    /// on a host with cgroup v2 alone, and when the id's directory is found.
    pub fn unified_cgroup(&mut self, id: u64) -> Option<CgroupInfo> {
        if !self.unified {
            return None;
        }
        self.cgroup(id)
    }

    fn walk(&mut self, root: &Path, dir: &Path) {
        if self.paths.len() >= MAX_CGROUPS {
            return;
        }
        let Ok(metadata) = fs::metadata(dir) else {
            return;
        };
        let relative = dir.strip_prefix(root).unwrap_or(dir);
        self.paths.insert(
            metadata.ino(),
            format!("/{}", relative.to_string_lossy()).replace("//", "/"),
        );
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                self.walk(root, &entry.path());
            }
        }
    }
}

impl Default for CgroupPaths {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether a cgroup v1 hierarchy is mounted (a hybrid or v1 host).
fn has_cgroup_v1_mount(mountinfo: &str) -> bool {
    mountinfo.lines().any(|line| {
        line.split_once(" - ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            == Some("cgroup")
    })
}

/// The mount point of the cgroup2 file system in a /proc/PID/mountinfo text.
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // ... mount-point ... - fstype source options
        let (fields, rest) = line.split_once(" - ")?;
        let fstype = rest.split_whitespace().next()?;
        let mount_point = fields.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(mount_point))
    })
}

/// A snapshot of a fork child that never exec'ed: its parent's, under its own pid.
pub fn forked_snapshot(pid: Pid, parent: &ProcessInfo) -> ProcessInfo {
    ProcessInfo {
        pid,
        start_time: 0,
        comm: Arc::clone(&parent.comm),
        labels: parent.labels.clone(),
        mappings: parent.mappings.clone(),
        is_kernel_thread: false,
    }
}

/// The main executable as a mapped file, for a snapshot built from an exec event.
pub fn executable_file(
    path: &str,
    expected: FileId,
    build_id: impl FnOnce(&fs::File) -> Option<String>,
) -> Option<(Arc<MappedFile>, u64)> {
    let (handle, open_path) = open_executable(path, expected)?;
    let offset = code_file_offset(&handle)?;
    let file = MappedFile {
        id: expected,
        path: Arc::from(path),
        open_path,
        build_id: build_id(&handle).map(Arc::from),
        handle: Some(handle),
    };
    Some((Arc::new(file), offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample handled after its process's exec was recorded still finds the program it was
    /// taken in: the fork before the first exec, the first program before the second, and
    /// nothing when two execs ended after it.
    #[test]
    fn the_identity_before_an_exec_answers_for_samples_taken_in_it() {
        let exec = |comm: &str, exec_ns| {
            Identity::Exec(Arc::new(ExecRecord {
                comm: comm.into(),
                exec_ns,
                ..Default::default()
            }))
        };
        let comm = |identity: Option<Identity>| match identity {
            Some(Identity::Exec(record)) => record.comm.clone(),
            Some(Identity::Fork { parent, .. }) => format!("fork of {}", parent.0),
            None => "none".into(),
        };
        let mut identities = Identities::default();
        let pid = Pid(42);
        identities.record(
            pid,
            Identity::Fork {
                parent: Pid(7),
                parent_info: None,
                inherited: None,
                forked_ns: 0,
            },
            None,
        );
        assert_eq!(identities.exec_after(pid, 0), None);
        identities.record(pid, exec("bash", 100), None);
        assert_eq!(identities.exec_after(pid, 50), Some(100));
        assert_eq!(identities.exec_after(pid, 100), None);
        assert_eq!(comm(identities.before_exec(pid, 50)), "fork of 7");
        assert_eq!(comm(identities.before_exec(pid, 150)), "none");
        identities.record(pid, exec("sleep", 200), None);
        assert_eq!(comm(identities.before_exec(pid, 150)), "bash");
        assert_eq!(comm(identities.before_exec(pid, 50)), "none");
        assert_eq!(comm(identities.get(pid)), "sleep");
        // A new process under the same pid has nothing before it.
        identities.record(
            pid,
            Identity::Fork {
                parent: Pid(8),
                parent_info: None,
                inherited: None,
                forked_ns: 0,
            },
            None,
        );
        assert_eq!(comm(identities.before_exec(pid, 150)), "none");
    }

    /// An exited process's identity is kept a minute after its exit, whatever the lookups
    /// meanwhile (a lookup does not make it younger), and then forgotten; a running one stays.
    #[test]
    fn exited_identities_go_a_minute_after_the_exit() {
        let second = 1_000_000_000;
        let fork = |parent| Identity::Fork {
            parent: Pid(parent),
            parent_info: None,
            inherited: None,
            forked_ns: 0,
        };
        let mut identities = Identities::default();
        identities.record(Pid(1), fork(0), None);
        identities.record(Pid(10), fork(1), None);
        identities.record(Pid(11), fork(1), None);
        identities.exited(Pid(10), 5 * second);
        identities.exited(Pid(11), 30 * second);
        assert_eq!(identities.exited_len(), 2);
        // Looked up just before its minute is over: still the first to go.
        identities.expire(64 * second);
        assert!(identities.get(Pid(10)).is_some());
        identities.expire(66 * second);
        assert!(identities.get(Pid(10)).is_none(), "exited 61 s ago");
        assert!(identities.get(Pid(11)).is_some(), "exited 36 s ago");
        assert_eq!(identities.expired(), 1);
        // Another exit expires the ones older than a minute before it.
        identities.record(Pid(12), fork(1), None);
        identities.exited(Pid(12), 91 * second);
        assert!(identities.get(Pid(11)).is_none());
        assert!(identities.get(Pid(12)).is_some());
        assert!(identities.get(Pid(1)).is_some(), "running: no age bound");
        assert_eq!((identities.expired(), identities.exited_len()), (2, 1));
    }

    /// A running parent's identity outlives the churn of short-lived processes around it:
    /// forks and exits of many more processes than either bound holds.
    #[test]
    fn running_processes_outlive_the_churn_of_exited_ones() {
        let mut identities = Identities::default();
        let parent = Pid(7);
        identities.record(
            parent,
            Identity::Exec(Arc::new(ExecRecord {
                comm: "supervisor".into(),
                ..Default::default()
            })),
            None,
        );
        let churn = (MAX_LIVE_IDENTITIES + MAX_EXITED_IDENTITIES) as u32 * 2;
        for pid in 100..100 + churn {
            identities.record(
                Pid(pid),
                Identity::Fork {
                    parent,
                    parent_info: None,
                    inherited: None,
                    forked_ns: 0,
                },
                None,
            );
            identities.exited(Pid(pid), 0);
        }
        assert!(matches!(
            identities.get(parent),
            Some(Identity::Exec(record)) if record.comm == "supervisor"
        ));
        // The latest exited are still known, the oldest forgotten, within the bound.
        let last = Pid(100 + churn - 1);
        assert!(identities.get(last).is_some());
        assert!(identities.get(Pid(100)).is_none());
        assert!(identities.len() <= MAX_LIVE_IDENTITIES + MAX_EXITED_IDENTITIES);
        // Once exited, the parent is among them, and a pid reused is running again.
        identities.exited(parent, 0);
        assert!(identities.get(parent).is_some());
        identities.record(
            last,
            Identity::Fork {
                parent,
                parent_info: None,
                inherited: None,
                forked_ns: 0,
            },
            None,
        );
        assert!(matches!(identities.get(last), Some(Identity::Fork { .. })));
    }

    #[test]
    fn finds_the_cgroup2_mount() {
        let hybrid = "\
25 20 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(cgroup2_mount("garbage\n1 2 3\n"), None);
        assert!(has_cgroup_v1_mount(hybrid));
        assert!(!has_cgroup_v1_mount(unified));
    }

    #[test]
    fn cgroup_ids_are_directory_inodes() {
        let dir = tempfile::tempdir().unwrap();
        let unit = dir.path().join("system.slice").join("web.service");
        fs::create_dir_all(&unit).unwrap();
        let id = fs::metadata(&unit).unwrap().ino();
        let mut paths = CgroupPaths::with_root(Some(dir.path().to_path_buf()));
        assert_eq!(paths.path(id), Some("/system.slice/web.service".into()));
        assert_eq!(
            paths.path(fs::metadata(dir.path()).unwrap().ino()),
            Some("/".into())
        );
        // An unknown id walks again only after a second.
        let later = dir.path().join("late.service");
        fs::create_dir(&later).unwrap();
        assert_eq!(paths.path(fs::metadata(&later).unwrap().ino()), None);
        assert_eq!(paths.path(0), None);
    }

    /// A cgroup id says what /proc/PID/cgroup would only where cgroup v2 is the one hierarchy:
    /// with v1 hierarchies mounted too, that file names more (a container's id in a v1 path).
    #[test]
    fn a_cgroup_id_stands_for_the_cgroup_file_only_with_cgroup_v2_alone() {
        let dir = tempfile::tempdir().unwrap();
        let scope = dir
            .path()
            .join("system.slice")
            .join(format!("docker-{}.scope", "ab".repeat(32)));
        fs::create_dir_all(&scope).unwrap();
        let id = fs::metadata(&scope).unwrap().ino();
        let root = dir.path().display();
        let unified = format!("30 1 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n");
        let cgroup = CgroupPaths::from_mountinfo(&unified)
            .unified_cgroup(id)
            .expect("found");
        assert_eq!(cgroup.container_id, Some("ab".repeat(32)));
        assert_eq!(
            cgroup.path.as_deref(),
            Some(&*format!("/system.slice/docker-{}.scope", "ab".repeat(32)))
        );
        let hybrid =
            format!("{unified}27 25 0:24 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n");
        assert_eq!(
            CgroupPaths::from_mountinfo(&hybrid).unified_cgroup(id),
            None
        );
        assert_eq!(
            CgroupPaths::from_mountinfo(&unified).unified_cgroup(id + 1_000_000),
            None
        );
    }

    #[test]
    fn the_executable_is_taken_only_while_it_is_the_file_exec_ed() {
        let sleep = fs::metadata("/bin/sleep").unwrap();
        let id = FileId::of(&sleep);
        let (file, offset) = executable_file("/bin/sleep", id, |_| None).expect("opened");
        assert_eq!(file.id, id);
        assert!(offset > 0, "the code segment follows the ELF headers");
        let other = FileId {
            dev: id.dev,
            ino: id.ino + 1,
        };
        assert!(executable_file("/bin/sleep", other, |_| None).is_none());
        let record = ExecRecord {
            filename: "/bin/sh".into(),
            exe: Some(FileId::of(
                &fs::metadata(fs::canonicalize("/bin/sh").unwrap()).unwrap(),
            )),
            ..ExecRecord::default()
        };
        let mut paths = ExecutablePaths::default();
        assert_eq!(
            paths.resolve(&record),
            fs::canonicalize("/bin/sh").unwrap().to_string_lossy(),
            "a symbolic link is resolved as /proc/PID/exe shows it"
        );
        let relative = ExecRecord {
            filename: "./run.sh".into(),
            ..ExecRecord::default()
        };
        assert_eq!(paths.resolve(&relative), "./run.sh");
    }

    /// A remembered resolution serves only the file it was made for: after the link moves to
    /// another file, the next exec through it resolves again.
    #[test]
    fn exec_ed_paths_are_remembered_for_the_file_they_named() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["one", "two"] {
            fs::write(dir.path().join(name), name).unwrap();
        }
        let link = dir.path().join("program");
        std::os::unix::fs::symlink("one", &link).unwrap();
        let record = |target: &str| ExecRecord {
            filename: link.to_string_lossy().into_owned(),
            exe: Some(FileId::of(&fs::metadata(dir.path().join(target)).unwrap())),
            ..ExecRecord::default()
        };
        let canonical = |name: &str| {
            fs::canonicalize(dir.path().join(name))
                .unwrap()
                .to_string_lossy()
                .into_owned()
        };
        let (real_one, real_two) = (canonical("one"), canonical("two"));
        let real = |name: &str| {
            if name == "one" {
                real_one.clone()
            } else {
                real_two.clone()
            }
        };
        let mut paths = ExecutablePaths::default();
        assert_eq!(paths.resolve(&record("one")), real("one"));
        assert_eq!(paths.len(), 1);
        fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink("two", &link).unwrap();
        // The same file again: remembered (not resolved from the disk, where it would fail
        // the check that the path still names it).
        assert_eq!(paths.resolve(&record("one")), real("one"));
        assert_eq!(paths.resolve(&record("two")), real("two"));
        assert_eq!(paths.len(), 1, "the entry was replaced");
        // A path that no longer names its file is not remembered unresolved.
        fs::remove_file(&link).unwrap();
        let gone = record("two");
        fs::remove_file(dir.path().join("two")).unwrap();
        assert_eq!(
            paths.resolve(&gone),
            real("two"),
            "remembered for that file"
        );
        let other = ExecRecord {
            filename: dir.path().join("missing").to_string_lossy().into_owned(),
            exe: gone.exe,
            ..ExecRecord::default()
        };
        assert_eq!(paths.resolve(&other), other.filename);
        assert_eq!(paths.len(), 1);
    }
}
