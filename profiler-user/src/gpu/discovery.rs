//! Finds CUDA runtime and driver libraries in running processes by the symbols they export
//! (PyTorch ships renamed copies such as `libcudart-<hash>.so.12`, so names prove nothing),
//! and attaches the CUDA probes once per file: a uprobe lives on the file (inode + offset), so
//! one attachment serves every process that maps it, now or later.
//!
//! The scan reads `/proc/*/maps` every few seconds, so libraries loaded with `dlopen` after the
//! process started are found at the next scan. With the kernel's mmap announcements watched it
//! reads only the processes that may have mapped a library it has not seen: not those that
//! announced nothing, nor those that exec'ed since the last scan and mapped only files already
//! known not to be CUDA libraries (most of a busy host's hundreds of execs a second). Files are
//! opened through `/proc/PID/root`, which reaches into containers' mount namespaces.
use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

// foldhash, not SipHash: every announced mmap and lifecycle event notes its process here,
// thousands a second on a busy host.
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::{
    CALL_DRV_ALLOC, CALL_DRV_FREE, CALL_DRV_GET_FUNCTION, CALL_DRV_GRAPH_LAUNCH, CALL_DRV_LAUNCH,
    CALL_DRV_LAUNCH_EX, CALL_DRV_MEMCPY, CALL_DRV_MEMCPY_DTOD, CALL_DRV_MEMCPY_DTOH,
    CALL_DRV_MEMCPY_HTOD, CALL_DRV_SYNC, CALL_RT_FREE, CALL_RT_GET_KERNEL, CALL_RT_GRAPH_LAUNCH,
    CALL_RT_LAUNCH, CALL_RT_LAUNCH_EXC, CALL_RT_LAUNCH_HANDLE, CALL_RT_MALLOC, CALL_RT_MEMCPY,
    CALL_RT_SYNC,
};

use crate::{
    model::{FileId, MmapChange, Pid, monotonic_now_ns},
    process::maps::{Backing, parse_maps_line},
};

/// Every probed function: its exported name and its `CALL_*` id.
pub const PROBED_FUNCTIONS: &[(&str, u32)] = &[
    ("cudaLaunchKernel", CALL_RT_LAUNCH),
    ("cudaLaunchKernel_ptsz", CALL_RT_LAUNCH),
    ("cudaLaunchCooperativeKernel", CALL_RT_LAUNCH),
    ("cudaLaunchCooperativeKernel_ptsz", CALL_RT_LAUNCH),
    ("cudaLaunchKernelExC", CALL_RT_LAUNCH_EXC),
    ("cudaLaunchKernelExC_ptsz", CALL_RT_LAUNCH_EXC),
    ("__cudaLaunchKernel", CALL_RT_LAUNCH_HANDLE),
    ("__cudaLaunchKernel_ptsz", CALL_RT_LAUNCH_HANDLE),
    ("__cudaGetKernel", CALL_RT_GET_KERNEL),
    ("cudaGraphLaunch", CALL_RT_GRAPH_LAUNCH),
    ("cudaGraphLaunch_ptsz", CALL_RT_GRAPH_LAUNCH),
    ("cudaMemcpy", CALL_RT_MEMCPY),
    ("cudaMemcpy_ptds", CALL_RT_MEMCPY),
    ("cudaMemcpyAsync", CALL_RT_MEMCPY),
    ("cudaMemcpyAsync_ptsz", CALL_RT_MEMCPY),
    ("cudaMalloc", CALL_RT_MALLOC),
    ("cudaMallocAsync", CALL_RT_MALLOC),
    ("cudaMallocAsync_ptsz", CALL_RT_MALLOC),
    ("cudaFree", CALL_RT_FREE),
    ("cudaFreeAsync", CALL_RT_FREE),
    ("cudaFreeAsync_ptsz", CALL_RT_FREE),
    ("cudaDeviceSynchronize", CALL_RT_SYNC),
    ("cudaStreamSynchronize", CALL_RT_SYNC),
    ("cudaStreamSynchronize_ptsz", CALL_RT_SYNC),
    ("cudaEventSynchronize", CALL_RT_SYNC),
    ("cuLaunchKernel", CALL_DRV_LAUNCH),
    ("cuLaunchKernel_ptsz", CALL_DRV_LAUNCH),
    ("cuLaunchCooperativeKernel", CALL_DRV_LAUNCH),
    ("cuLaunchCooperativeKernel_ptsz", CALL_DRV_LAUNCH),
    ("cuLaunchKernelEx", CALL_DRV_LAUNCH_EX),
    ("cuLaunchKernelEx_ptsz", CALL_DRV_LAUNCH_EX),
    ("cuGraphLaunch", CALL_DRV_GRAPH_LAUNCH),
    ("cuGraphLaunch_ptsz", CALL_DRV_GRAPH_LAUNCH),
    ("cuMemcpyHtoD_v2", CALL_DRV_MEMCPY_HTOD),
    ("cuMemcpyHtoD_v2_ptds", CALL_DRV_MEMCPY_HTOD),
    ("cuMemcpyHtoDAsync_v2", CALL_DRV_MEMCPY_HTOD),
    ("cuMemcpyHtoDAsync_v2_ptsz", CALL_DRV_MEMCPY_HTOD),
    ("cuMemcpyDtoH_v2", CALL_DRV_MEMCPY_DTOH),
    ("cuMemcpyDtoH_v2_ptds", CALL_DRV_MEMCPY_DTOH),
    ("cuMemcpyDtoHAsync_v2", CALL_DRV_MEMCPY_DTOH),
    ("cuMemcpyDtoHAsync_v2_ptsz", CALL_DRV_MEMCPY_DTOH),
    ("cuMemcpyDtoD_v2", CALL_DRV_MEMCPY_DTOD),
    ("cuMemcpyDtoD_v2_ptds", CALL_DRV_MEMCPY_DTOD),
    ("cuMemcpyDtoDAsync_v2", CALL_DRV_MEMCPY_DTOD),
    ("cuMemcpyDtoDAsync_v2_ptsz", CALL_DRV_MEMCPY_DTOD),
    ("cuMemcpy", CALL_DRV_MEMCPY),
    ("cuMemcpy_ptds", CALL_DRV_MEMCPY),
    ("cuMemcpyAsync", CALL_DRV_MEMCPY),
    ("cuMemcpyAsync_ptsz", CALL_DRV_MEMCPY),
    ("cuMemAlloc_v2", CALL_DRV_ALLOC),
    ("cuMemAllocAsync", CALL_DRV_ALLOC),
    ("cuMemAllocAsync_ptsz", CALL_DRV_ALLOC),
    ("cuMemFree_v2", CALL_DRV_FREE),
    ("cuMemFreeAsync", CALL_DRV_FREE),
    ("cuMemFreeAsync_ptsz", CALL_DRV_FREE),
    ("cuCtxSynchronize", CALL_DRV_SYNC),
    ("cuStreamSynchronize", CALL_DRV_SYNC),
    ("cuStreamSynchronize_ptsz", CALL_DRV_SYNC),
    ("cuEventSynchronize", CALL_DRV_SYNC),
    ("cuModuleGetFunction", CALL_DRV_GET_FUNCTION),
    ("cuLibraryGetKernel", CALL_DRV_GET_FUNCTION),
];

/// The exports that make a file a CUDA runtime or driver library worth probing.
const MARKER_SYMBOLS: &[&str] = &["cudaLaunchKernel", "__cudaLaunchKernel", "cuLaunchKernel"];

/// How often `/proc` is scanned for new CUDA libraries.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(2);

/// One place to probe in a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbePoint {
    pub symbol: &'static str,
    pub call: u32,
    pub file_offset: u64,
}

impl ProbePoint {
    /// The attach cookie: the call id and the function's index in [`PROBED_FUNCTIONS`].
    pub fn cookie(&self) -> u64 {
        let index = PROBED_FUNCTIONS
            .iter()
            .position(|(name, _)| *name == self.symbol)
            .unwrap_or(0);
        u64::from(self.call | ((index as u32) << 8))
    }
}

/// The probed function a cookie names.
pub fn function_name(cookie: u32) -> &'static str {
    PROBED_FUNCTIONS
        .get((cookie >> 8) as usize)
        .filter(|(_, call)| *call == cookie & 0xff)
        .map_or("cuda", |(name, _)| name)
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not an ELF file we can read: {message}")]
    Elf { path: String, message: String },
}

/// The probe points `path` exports, or an empty list when it is no CUDA library. Only defined
/// `STT_FUNC` dynamic symbols count (an IFUNC symbol would put the probe on its resolver), and
/// two names at one address are probed once.
pub fn probe_points(path: &Path) -> Result<Vec<ProbePoint>, DiscoveryError> {
    let display = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| DiscoveryError::Read {
        path: display.clone(),
        source,
    })?;
    // SAFETY: read-only mapping; a file truncated meanwhile can fault, as with any mmap reader;
    // shared libraries are replaced by rename, not rewritten in place.
    let data = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| DiscoveryError::Read {
        path: display.clone(),
        source,
    })?;
    let elf = object::File::parse(&*data).map_err(|err| DiscoveryError::Elf {
        path: display.clone(),
        message: err.to_string(),
    })?;
    let wanted: HashMap<&str, (&'static str, u32)> = PROBED_FUNCTIONS
        .iter()
        .map(|&(name, call)| (name, (name, call)))
        .collect();
    let mut found: Vec<ProbePoint> = Vec::new();
    let mut has_marker = false;
    for symbol in elf.dynamic_symbols() {
        if !symbol.is_definition() {
            continue;
        }
        let Ok(name) = symbol.name() else { continue };
        let Some(&(static_name, call)) = wanted.get(name) else {
            continue;
        };
        let object::SymbolFlags::Elf { st_info, .. } = symbol.flags() else {
            continue;
        };
        if st_info & 0xf != object::elf::STT_FUNC {
            continue;
        }
        let Some(section) = symbol
            .section_index()
            .and_then(|i| elf.section_by_index(i).ok())
        else {
            continue;
        };
        let Some((section_offset, _)) = section.file_range() else {
            continue;
        };
        let Some(relative) = symbol.address().checked_sub(section.address()) else {
            continue;
        };
        has_marker |= MARKER_SYMBOLS.contains(&name);
        found.push(ProbePoint {
            symbol: static_name,
            call,
            file_offset: section_offset + relative,
        });
    }
    if !has_marker {
        return Ok(Vec::new());
    }
    // Keep the table's order (the preferred name first) and one probe per address.
    found.sort_by_key(|p| {
        PROBED_FUNCTIONS
            .iter()
            .position(|(name, _)| *name == p.symbol)
    });
    let mut offsets = HashSet::new();
    found.retain(|p| offsets.insert(p.file_offset));
    Ok(found)
}

/// Attaches probes; the BPF side in production, a recorder in tests.
pub trait ProbeAttacher {
    /// Called before a library's probes are attached; an error skips the library.
    fn prepare(&mut self) -> Result<(), crate::bpf::BpfError> {
        Ok(())
    }

    fn attach(
        &mut self,
        target: &Path,
        point: &ProbePoint,
        at_return: bool,
    ) -> Result<(), crate::bpf::BpfError>;

    /// How many lifecycle events (exec, fork, exit) the kernel could not deliver so far (its
    /// events ring full): the forks and exits the scans' proofs rely on may be missing since.
    fn lifecycle_events_lost(&self) -> u64 {
        0
    }
}

impl ProbeAttacher for crate::bpf::Sampler {
    /// Loads the CUDA programs at the first library (their failure is logged there, once).
    fn prepare(&mut self) -> Result<(), crate::bpf::BpfError> {
        self.ensure_cuda_loaded()
    }

    fn attach(
        &mut self,
        target: &Path,
        point: &ProbePoint,
        at_return: bool,
    ) -> Result<(), crate::bpf::BpfError> {
        self.attach_cuda(target, point.file_offset, point.cookie(), at_return)
    }

    fn lifecycle_events_lost(&self) -> u64 {
        self.stats().get(profiler_common::STAT_EVENTS_LOST)
    }
}

/// A CUDA library found in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundLibrary {
    pub pid: Pid,
    /// The path as the process sees it.
    pub path: String,
    pub probes: usize,
}

/// Counters for self-metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscoveryStats {
    pub libraries_attached: u64,
    pub probes_attached: u64,
    pub attach_errors: u64,
    pub processes_using_cuda: u64,
    /// Process maps read by scans, and processes a scan did not read (nothing announced since
    /// the scan before; or an exec, or a fork from a process proven not to map a CUDA library,
    /// since it, and only files known not to be CUDA libraries mapped after).
    pub maps_read: u64,
    pub maps_unchanged: u64,
}

/// Scans processes and attaches each CUDA library once.
pub struct Discovery {
    proc_root: PathBuf,
    /// (path as mapped, inode) → whether it is a CUDA library, so each file is parsed once.
    checked: HashMap<(Arc<str>, u64), Option<FileId>>,
    attached: HashSet<FileId>,
    /// Processes seen mapping a CUDA library at the last scan.
    users: HashSet<Pid>,
    /// Every process the last scan found, with whether it maps a CUDA library.
    scanned: HashMap<Pid, bool>,
    /// With [`Self::watch_changes`]: what was announced since the last scan of the processes
    /// whose executable mappings may have changed (an exec, a fork or exit, the mapping of a
    /// file not known not to be a CUDA library). The others are not read again. `None` when
    /// that is not known: every process is read.
    changed: Option<HashMap<Pid, Announced>>,
    watching: bool,
    /// When the last scan began (CLOCK_MONOTONIC ns): an exec announced since but made
    /// before may have had its mappings announced to that scan, so it is not trusted.
    scanned_at_ns: u64,
    /// When the last scan ended: it had read every map it read by then.
    scan_ended_ns: u64,
    /// Every code mapping made before this time has been noted
    /// ([`Self::note_mappings_complete_before`]).
    mappings_complete_before_ns: u64,
    /// [`ProbeAttacher::lifecycle_events_lost`] at the last scan: a scan that finds it grown
    /// reads every process, since a lost fork and exit make a reused pid look like the process
    /// the last scan read.
    lifecycle_events_lost: u64,
    next_scan: Instant,
    pub stats: DiscoveryStats,
}

/// Changed processes remembered between two scans; beyond, the next scan reads every process.
const MAX_CHANGED: usize = 65_536;

/// What was announced of one process since the last scan.
#[derive(Clone, Copy, Debug, Default)]
struct Announced {
    /// Its latest exec (CLOCK_MONOTONIC ns), 0 for none.
    exec_ns: u64,
    /// Its latest fork or exit, 0 for none.
    boundary_ns: u64,
    /// It mapped a file not known not to be a CUDA library, or changed in a way not told.
    read_maps: bool,
    /// Its latest fork: from which process, when.
    forked_from: Option<(Pid, u64)>,
}

/// The longest chain of forks followed back to a process the last scan read.
const MAX_FORK_CHAIN: usize = 16;

/// What proves, without its maps, that a process forked since the last scan maps no CUDA
/// library: a fork copies its parent's mappings, so a child maps none when its parent mapped
/// none at the fork and it mapped only files known not to be CUDA libraries since. Whatever
/// its parent mapped before the fork was announced first (the kernel writes the record while
/// the mapping is made, and the fork copies it after), so it is in `changed` when the fork is
/// older than the announcements read (`mappings_complete_before_ns`).
struct ForkProof<'a> {
    changed: &'a HashMap<Pid, Announced>,
    /// What the last scan found.
    previous: &'a HashMap<Pid, bool>,
    last_scan_began_ns: u64,
    last_scan_ended_ns: u64,
    mappings_complete_before_ns: u64,
}

impl ForkProof<'_> {
    /// Whether the process with announcements `announced` maps no CUDA library now, by its
    /// fork.
    fn proves(&self, announced: &Announced) -> bool {
        let Some((parent, fork_ns)) = announced.forked_from else {
            return false;
        };
        // Not when it exited (a zombie) or mapped an unknown file since its fork.
        !announced.read_maps
            && announced.boundary_ns == fork_ns
            && self.mapped_none_at(parent, fork_ns, 0)
    }

    /// Whether `pid` mapped no CUDA library at `time_ns`.
    fn mapped_none_at(&self, pid: Pid, time_ns: u64, depth: usize) -> bool {
        if depth >= MAX_FORK_CHAIN || time_ns >= self.mappings_complete_before_ns {
            return false;
        }
        // What the last scan read, for the same process when nothing says otherwise: its
        // mappings since were announced, and none since the last scan began was of a file
        // not known not to be a CUDA library.
        let as_last_read =
            || time_ns >= self.last_scan_ended_ns && self.previous.get(&pid) == Some(&false);
        let Some(announced) = self.changed.get(&pid) else {
            return as_last_read();
        };
        if announced.read_maps {
            return false;
        }
        // After an exec, the process mapped only files known not to be CUDA libraries.
        let execed_before = announced.exec_ns != 0
            && announced.exec_ns >= self.last_scan_began_ns
            && announced.exec_ns <= time_ns;
        match announced.forked_from {
            // Its process at `time_ns` began with this fork.
            Some((parent, fork_ns)) if fork_ns <= time_ns => {
                (execed_before && announced.exec_ns >= fork_ns)
                    || self.mapped_none_at(parent, fork_ns, depth + 1)
            }
            // An earlier process of this pid, whose start is not known.
            Some(_) => false,
            // Unless it exited by then (a later process of this pid would have forked).
            None if announced.boundary_ns != 0 && announced.boundary_ns <= time_ns => false,
            None => execed_before || as_last_read(),
        }
    }
}

impl Announced {
    /// Whether the process maps a CUDA library, when the announcements prove it without its
    /// maps: it exec'ed since the last scan (`scanned_at_ns`) and mapped only files known
    /// not to be CUDA libraries since. `None`: its maps are read.
    fn proves(&self, scanned_at_ns: u64) -> Option<bool> {
        let exec_is_latest = self.exec_ns != 0 && self.exec_ns > self.boundary_ns;
        (!self.read_maps && exec_is_latest && self.exec_ns >= scanned_at_ns).then_some(false)
    }
}

impl Discovery {
    pub fn new(proc_root: PathBuf) -> Self {
        Discovery {
            proc_root,
            checked: HashMap::new(),
            attached: HashSet::new(),
            users: HashSet::new(),
            scanned: HashMap::new(),
            changed: None,
            watching: false,
            scanned_at_ns: 0,
            scan_ended_ns: 0,
            mappings_complete_before_ns: 0,
            lifecycle_events_lost: 0,
            next_scan: Instant::now(),
            stats: DiscoveryStats::default(),
        }
    }

    /// Processes that mapped a CUDA library at the last scan.
    pub fn users(&self) -> &HashSet<Pid> {
        &self.users
    }

    /// From now on the caller reports every process whose executable mappings may change
    /// ([`Self::note_changed`]) or that it cannot know ([`Self::note_unknown_changes`]), so a
    /// scan reads only those maps. A host with hundreds of processes would otherwise have every
    /// /proc/PID/maps (thousands of lines for a PyTorch process) read and parsed every scan.
    pub fn watch_changes(&mut self) {
        self.watching = true;
    }

    /// `pid`'s mappings may have changed in a way not told: the next scan reads its maps.
    pub fn note_changed(&mut self, pid: Pid) {
        if let Some(announced) = self.announced(pid) {
            announced.read_maps = true;
        }
    }

    /// What the kernel announced of a process's code ([`MmapChange`], in the order read).
    pub fn note_mmap_change(&mut self, change: &MmapChange) {
        match change {
            MmapChange::Exec { pid, time_ns } => self.note_exec(*pid, *time_ns),
            MmapChange::Mapped { pid, path, inode } => {
                // Anonymous code (JIT) and the kernel's pseudo-files hold no library; a file
                // checked before is known, whichever process maps it.
                let known_not_cuda = match inode {
                    Some(inode) => {
                        matches!(self.checked.get(&(Arc::clone(path), *inode)), Some(None))
                    }
                    // `//anon` is how the announcements name anonymous code.
                    None => !path.starts_with('/') || path.starts_with("//"),
                };
                if !known_not_cuda {
                    self.note_changed(*pid);
                }
            }
        }
    }

    /// `pid` exec'ed at `time_ns` (CLOCK_MONOTONIC).
    pub fn note_exec(&mut self, pid: Pid, time_ns: u64) {
        if let Some(announced) = self.announced(pid) {
            announced.exec_ns = announced.exec_ns.max(time_ns);
        }
    }

    /// `pid` forked from `parent` at `time_ns` (CLOCK_MONOTONIC).
    pub fn note_fork(&mut self, pid: Pid, parent: Pid, time_ns: u64) {
        if let Some(announced) = self.announced(pid) {
            announced.boundary_ns = announced.boundary_ns.max(time_ns);
            if announced.forked_from.is_none_or(|(_, ns)| ns <= time_ns) {
                announced.forked_from = Some((parent, time_ns));
            }
        }
    }

    /// `pid` exited at `time_ns`.
    pub fn note_exit(&mut self, pid: Pid, time_ns: u64) {
        if let Some(announced) = self.announced(pid) {
            announced.boundary_ns = announced.boundary_ns.max(time_ns);
        }
    }

    /// Every code mapping made before `time_ns` has been noted ([`Self::note_mmap_change`]).
    pub fn note_mappings_complete_before(&mut self, time_ns: u64) {
        self.mappings_complete_before_ns = self.mappings_complete_before_ns.max(time_ns);
    }

    /// What was announced of `pid` since the last scan; `None` when changes are not known.
    fn announced(&mut self, pid: Pid) -> Option<&mut Announced> {
        let full = self
            .changed
            .as_ref()
            .is_some_and(|changed| changed.len() >= MAX_CHANGED && !changed.contains_key(&pid));
        if full {
            self.changed = None;
        }
        Some(self.changed.as_mut()?.entry(pid).or_default())
    }

    /// Announcements were lost: the next scan reads every process.
    pub fn note_unknown_changes(&mut self) {
        self.changed = None;
    }

    /// Scans when the interval has passed; returns the processes newly seen using CUDA.
    pub fn maybe_scan(&mut self, attacher: &mut impl ProbeAttacher) -> Vec<Pid> {
        if Instant::now() < self.next_scan {
            return Vec::new();
        }
        self.next_scan = Instant::now() + SCAN_INTERVAL;
        self.scan(attacher)
    }

    /// Reads the maps of every process that may have changed (of every process when changes
    /// are not watched or not known); attaches new CUDA libraries. Processes that vanish
    /// meanwhile are skipped: nothing about one process can fail the scan of another.
    pub fn scan(&mut self, attacher: &mut impl ProbeAttacher) -> Vec<Pid> {
        let Ok(entries) = std::fs::read_dir(&self.proc_root) else {
            return Vec::new();
        };
        let own_pid = std::process::id();
        let mut users = HashSet::new();
        // Read before the processes: a loss after this read is seen by the next scan, which
        // corrects what this one took from it.
        let lifecycle_events_lost = attacher.lifecycle_events_lost();
        if lifecycle_events_lost != self.lifecycle_events_lost {
            self.lifecycle_events_lost = lifecycle_events_lost;
            self.note_unknown_changes();
        }
        // Changes from here on are the next scan's: a mapping made after a process's maps are
        // read below is announced after, and noted for the next scan.
        let previous_scan_ns = std::mem::replace(&mut self.scanned_at_ns, monotonic_now_ns());
        let changed = std::mem::replace(&mut self.changed, self.watching.then(HashMap::new));
        let previous = std::mem::take(&mut self.scanned);
        let forks = changed.as_ref().map(|changed| ForkProof {
            changed,
            previous: &previous,
            last_scan_began_ns: previous_scan_ns,
            last_scan_ended_ns: self.scan_ended_ns,
            mappings_complete_before_ns: self.mappings_complete_before_ns,
        });
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == own_pid {
                continue;
            }
            let pid = Pid(pid);
            let known = match changed.as_ref().map(|c| c.get(&pid)) {
                None => None,
                Some(None) => previous.get(&pid).copied(),
                Some(Some(announced)) => announced.proves(previous_scan_ns).or_else(|| {
                    forks
                        .as_ref()
                        .is_some_and(|forks| forks.proves(announced))
                        .then_some(false)
                }),
            };
            let uses_cuda = match known {
                Some(uses_cuda) => {
                    self.stats.maps_unchanged += 1;
                    uses_cuda
                }
                None => match self.scan_process(pid, attacher) {
                    Some(uses_cuda) => uses_cuda,
                    None => continue,
                },
            };
            self.scanned.insert(pid, uses_cuda);
            if uses_cuda {
                users.insert(pid);
            }
        }
        self.scan_ended_ns = monotonic_now_ns();
        let new: Vec<Pid> = users.difference(&self.users).copied().collect();
        self.stats.processes_using_cuda = users.len() as u64;
        self.users = users;
        new
    }

    /// Whether the process maps a CUDA library; `None` when its maps cannot be read.
    fn scan_process(&mut self, pid: Pid, attacher: &mut impl ProbeAttacher) -> Option<bool> {
        let process_dir = self.proc_root.join(pid.0.to_string());
        let maps = std::fs::read_to_string(process_dir.join("maps")).ok()?;
        self.stats.maps_read += 1;
        let mut uses_cuda = false;
        for line in maps.lines() {
            let Some(entry) = parse_maps_line(line) else {
                continue;
            };
            if !entry.is_executable() || entry.inode == 0 {
                continue;
            }
            let Backing::File {
                path,
                deleted: false,
            } = entry.backing()
            else {
                continue;
            };
            let key = (Arc::<str>::from(path), entry.inode);
            let file_id = match self.checked.get(&key) {
                Some(known) => *known,
                None => {
                    let found = self.inspect(&process_dir, path, entry.inode, attacher);
                    if self.checked.len() > 100_000 {
                        self.checked.clear();
                    }
                    self.checked.insert(key, found);
                    found
                }
            };
            uses_cuda |= file_id.is_some();
        }
        Some(uses_cuda)
    }

    /// Parses a newly seen file; attaches it when it is a CUDA library not attached yet.
    fn inspect(
        &mut self,
        process_dir: &Path,
        path: &str,
        inode: u64,
        attacher: &mut impl ProbeAttacher,
    ) -> Option<FileId> {
        // Through the process's root, so a container's file is the one we read and probe.
        let target = process_dir.join("root").join(path.trim_start_matches('/'));
        let metadata = std::fs::metadata(&target).ok()?;
        if metadata.ino() != inode {
            return None;
        }
        let id = FileId {
            dev: metadata.dev(),
            ino: metadata.ino(),
        };
        if self.attached.contains(&id) {
            return Some(id);
        }
        let points = match probe_points(&target) {
            Ok(points) => points,
            Err(err) => {
                tracing::debug!("{err}");
                return None;
            }
        };
        if points.is_empty() || attacher.prepare().is_err() {
            return None;
        }
        let mut attached = 0;
        for point in &points {
            // The return probe first: a call entered between the two attachments then has its
            // return seen without its entry (counted as unmatched, no state), never an entry
            // that raised a per-thread depth without the return that lowers it.
            // Every call is reported at its return, when its result is known.
            let mut ok = attacher.attach(&target, point, true);
            if ok.is_ok() {
                ok = attacher.attach(&target, point, false);
            }
            match ok {
                Ok(()) => attached += 1,
                Err(err) => {
                    self.stats.attach_errors += 1;
                    tracing::warn!(symbol = point.symbol, "{err}");
                }
            }
        }
        self.attached.insert(id);
        self.stats.libraries_attached += 1;
        self.stats.probes_attached += attached;
        tracing::info!(
            path,
            probes = attached,
            "CUDA library found; probes attached"
        );
        Some(id)
    }
}
