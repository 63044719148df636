//! The only module that talks to aya: loads the embedded eBPF object, attaches the sampler to
//! the cpu-clock event of every online CPU, and exposes its maps by intent (ring buffer of
//! samples, per-cause counters, the pid filter).
mod btf;
mod capabilities;

use std::{
    collections::BTreeMap,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::PathBuf,
    sync::Arc,
};

use crate::{
    bounded::ParseMemo,
    model::{CgroupMove, ExecArgs, ExecRecord, FileId, LabelEnv},
};
use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, IterableMap, MapData, PerCpuArray, RingBuf,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{
        PerfEvent, RawTracePoint, UProbe,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
    },
    util::online_cpus,
};
use profiler_common::{
    CGROUP_MOVE_PATH_BYTES, CgroupMoveDetails, CgroupMoveEvent, CudaConfig, EVENT_CGROUP_MIGRATION,
    EVENT_CGROUPS_CHANGED, EVENT_PROCESS_EXEC, EVENT_PROCESS_EXIT, EVENT_PROCESS_FORK, ExecDetails,
    ExecEvent, ForkEvent, IdentityOffsets, MAX_FILTERED_PIDS, ProcessEvent, PyProcInfo, STAT_COUNT,
    STAT_NAMES, STAT_RINGBUF_PENDING_BYTES, SamplerConfig, StatCounters, names,
    unwind::{MappingKey, MappingValue, PageEntry, PageKey, ROWS_PER_CHUNK, RowChunk},
};

pub use capabilities::{check_kernel_support, check_privileges};

/// The eBPF object built by `cargo xtask build-ebpf` (profiler-user's build script embeds it).
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler.bpf.o"));

/// Default location of the kernel's BTF; the `PROFILER_BTF_PATH` variable overrides it (tests).
pub const DEFAULT_BTF_PATH: &str = "/sys/kernel/btf/vmlinux";

// Messages spell out the whole cause chain (aya's errors keep the verifier log and errno one
// level down), and the cause stays reachable as `source()` for callers that match on it.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error(
        "the profiler needs root or the CAP_BPF and CAP_PERFMON capabilities (missing: {missing})"
    )]
    MissingPrivileges { missing: String },
    #[error(
        "this kernel has no BTF ({path} not found); a kernel built with CONFIG_DEBUG_INFO_BTF=y is required"
    )]
    NoBtf { path: PathBuf },
    #[error("this kernel does not support BPF (the bpf() system call failed: {0})")]
    NoBpf(std::io::Error),
    #[error("loading the eBPF object failed: {}", error_chain(.0))]
    Load(#[source] aya::EbpfError),
    #[error("eBPF program {name} is not in the object")]
    ProgramMissing { name: String },
    #[error("eBPF program {name} failed to load or attach: {}", error_chain(.source))]
    Program {
        name: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("CUDA attribution is off")]
    CudaOff,
    #[error("the CUDA programs did not load")]
    CudaNotLoaded,
    #[error("attaching to the cpu-clock event of CPU {cpu} failed: {}", error_chain(.source))]
    Attach {
        cpu: u32,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("eBPF map {name} is not in the object")]
    MapMissing { name: &'static str },
    #[error("eBPF map {name}: {}", error_chain(.source))]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot list the CPUs ({path}): {source}")]
    Cpus {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{cpus} possible CPUs are more than the scratch map can index")]
    TooManyCpus { cpus: usize },
    #[error("attaching a CUDA probe to {target} failed: {}", error_chain(.source))]
    UProbe {
        target: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("the pid filter holds at most {max} processes; {given} were given")]
    TooManyPids { given: usize, max: u32 },
}

/// What to sample.
#[derive(Clone, Debug)]
pub struct SamplerSettings {
    pub frequency_hz: u64,
    /// Only these processes (and all their threads) when non-empty.
    pub pids: Vec<u32>,
    /// Capacity of the unwind-row array in bytes (the BPF memory budget for unwind tables).
    pub unwind_table_bytes: u64,
    /// Load the CUDA probe programs (attached per library later, by [`Sampler::attach_cuda`]).
    pub cuda: bool,
    /// Stacks per thread and second the CUDA probes may take.
    pub cuda_stacks_per_second: u32,
    /// Off-CPU profiling: the share of blocking switches sampled (`None`: off).
    pub off_cpu_probability: Option<f64>,
}

/// `SamplerConfig::off_cpu_threshold` for sampling a blocking switch with `probability`
/// (`bpf_get_prandom_u32()` below it).
pub fn off_cpu_threshold(probability: f64) -> u32 {
    if probability >= 1.0 {
        profiler_common::OFF_CPU_EVERY_SWITCH
    } else {
        ((probability.max(0.0) * 4_294_967_296.0) as u32).max(1)
    }
}

/// The off-CPU program's records (`profiler_common::off_cpu`).
pub struct OffCpuRing {
    ring: RingBuf<MapData>,
}

impl OffCpuRing {
    /// Calls `f` for every record waiting; returns how many there were.
    pub fn drain(&mut self, f: impl FnMut(&[u8])) -> usize {
        drain_ring(&mut self.ring, f)
    }
}

/// Writes the unwinder's maps, named by intent. The agent's table manager talks to this trait
/// so it can be tested without a kernel.
pub trait UnwindMaps {
    /// Capacity of the row array, in chunks of `ROWS_PER_CHUNK` rows.
    fn row_chunk_capacity(&self) -> u32;
    fn write_row_chunk(&mut self, index: u32, chunk: &RowChunk) -> Result<(), BpfError>;
    fn insert_page(&mut self, key: PageKey, entry: PageEntry) -> Result<(), BpfError>;
    fn remove_page(&mut self, key: PageKey) -> Result<(), BpfError>;
    fn insert_mapping(
        &mut self,
        prefix_len: u32,
        key: MappingKey,
        value: MappingValue,
    ) -> Result<(), BpfError>;
    fn remove_mapping(&mut self, prefix_len: u32, key: MappingKey) -> Result<(), BpfError>;
    /// Inserts `entries` (prefix length, key, value) in their order, each as
    /// [`Self::insert_mapping`] would: BPF may see the first ones before the last. Returns the
    /// index and error of each that failed (the others are in).
    fn insert_mappings(
        &mut self,
        entries: &[(u32, MappingKey, MappingValue)],
    ) -> Vec<(usize, BpfError)> {
        entries
            .iter()
            .enumerate()
            .filter_map(|(index, &(prefix_len, key, value))| {
                self.insert_mapping(prefix_len, key, value)
                    .err()
                    .map(|error| (index, error))
            })
            .collect()
    }
    /// Removes `entries` (prefix length, key) in their order, each as
    /// [`Self::remove_mapping`] would; one that is not in the map is passed over.
    fn remove_mappings(&mut self, entries: &[(u32, MappingKey)]) {
        for &(prefix_len, key) in entries {
            let _ = self.remove_mapping(prefix_len, key);
        }
    }
    /// A page entry as placed (`None` when the page is not in the map). The agent's late
    /// unwinder reads the rows BPF would have used.
    fn read_page(&self, key: PageKey) -> Result<Option<PageEntry>, BpfError>;
    fn read_row_chunk(&self, index: u32) -> Result<RowChunk, BpfError>;
}

/// The unwinder's maps in the kernel.
pub struct KernelUnwindMaps {
    rows: Array<MapData, RowChunk>,
    pages: HashMap<MapData, PageKey, PageEntry>,
    mappings: LpmTrie<MapData, MappingKey, MappingValue>,
    row_chunks: u32,
    /// Whether the kernel takes the mappings' trie entries in batches: a
    /// process's registration is tens to hundreds of entries, one system call each without.
    mapping_batches: bool,
}

/// `BPF_MAP_UPDATE_BATCH` and `BPF_MAP_DELETE_BATCH` of the kernel's `enum bpf_cmd`: aya 0.14
/// has no call for them.
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The `batch` member of the kernel's `union bpf_attr` (the kernel zero-fills the union's
/// bytes beyond those given).
#[repr(C)]
#[derive(Default)]
struct MapBatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Runs a batch `command` over `keys` (with `values` for an update) of the map `map`, whose
/// key and value sizes they must have. `Err((done, error))`: the first `done` elements were
/// done and the next one failed, or (`done` 0) the command failed as a whole.
fn map_batch<K, V>(
    map: BorrowedFd<'_>,
    command: libc::c_long,
    keys: &[K],
    values: Option<&[V]>,
) -> Result<(), (usize, std::io::Error)> {
    let Ok(count) = u32::try_from(keys.len()) else {
        return Err((0, std::io::Error::from(std::io::ErrorKind::InvalidInput)));
    };
    let mut attr = MapBatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.map_or(0, |values| values.as_ptr() as u64),
        count,
        map_fd: map.as_raw_fd() as u32,
        ..MapBatchAttr::default()
    };
    // SAFETY: `attr` points at `count` keys (and values) that outlive the call; the kernel
    // reads that many elements of the map's key and value sizes and writes back only
    // `attr.count`.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            &mut attr as *mut MapBatchAttr,
            std::mem::size_of::<MapBatchAttr>(),
        )
    };
    if result == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    // A command refused before any element (unknown to the kernel, or for this map) leaves
    // `count` as given; one that stopped at an element writes back how many it did.
    let done = if attr.count >= count {
        0
    } else {
        attr.count as usize
    };
    Err((done, error))
}

fn map_error(name: &'static str) -> impl Fn(aya::maps::MapError) -> BpfError {
    move |source| BpfError::Map { name, source }
}

impl KernelUnwindMaps {
    /// A batch was refused as a whole where its first element alone went in: this kernel
    /// takes no batches for the trie; one system call an entry from now on.
    fn no_mapping_batches(&mut self) {
        tracing::debug!("the kernel takes no batches of LPM trie entries");
        self.mapping_batches = false;
    }
}

impl UnwindMaps for KernelUnwindMaps {
    fn row_chunk_capacity(&self) -> u32 {
        self.row_chunks
    }

    fn write_row_chunk(&mut self, index: u32, chunk: &RowChunk) -> Result<(), BpfError> {
        self.rows
            .set(index, chunk, 0)
            .map_err(map_error(names::MAP_UNWIND_ROWS))
    }

    fn insert_page(&mut self, key: PageKey, entry: PageEntry) -> Result<(), BpfError> {
        self.pages
            .insert(key, entry, 0)
            .map_err(map_error(names::MAP_UNWIND_PAGES))
    }

    fn remove_page(&mut self, key: PageKey) -> Result<(), BpfError> {
        self.pages
            .remove(&key)
            .map_err(map_error(names::MAP_UNWIND_PAGES))
    }

    fn insert_mapping(
        &mut self,
        prefix_len: u32,
        key: MappingKey,
        value: MappingValue,
    ) -> Result<(), BpfError> {
        self.mappings
            .insert(&Key::new(prefix_len, key), value, 0)
            .map_err(map_error(names::MAP_PROCESS_MAPPINGS))
    }

    fn remove_mapping(&mut self, prefix_len: u32, key: MappingKey) -> Result<(), BpfError> {
        self.mappings
            .remove(&Key::new(prefix_len, key))
            .map_err(map_error(names::MAP_PROCESS_MAPPINGS))
    }

    fn insert_mappings(
        &mut self,
        entries: &[(u32, MappingKey, MappingValue)],
    ) -> Vec<(usize, BpfError)> {
        let keys: Vec<Key<MappingKey>> = entries
            .iter()
            .map(|&(prefix_len, key, _)| Key::new(prefix_len, key))
            .collect();
        let values: Vec<MappingValue> = entries.iter().map(|&(_, _, value)| value).collect();
        let mut failed = Vec::new();
        let mut next = 0;
        while next < entries.len() {
            let mut refused_whole = false;
            if self.mapping_batches {
                let fd = self.mappings.map().fd().as_fd();
                let batch = map_batch(
                    fd,
                    BPF_MAP_UPDATE_BATCH,
                    &keys[next..],
                    Some(&values[next..]),
                );
                let Err((done, _)) = batch else {
                    break;
                };
                next += done;
                refused_whole = done == 0;
            }
            // The element the batch stopped at, alone (which tells its own error from a
            // kernel that takes no batches for this map), or every element without batches.
            let (prefix_len, key, value) = entries[next];
            match self.insert_mapping(prefix_len, key, value) {
                Ok(()) if refused_whole => self.no_mapping_batches(),
                Ok(()) => {}
                Err(error) => failed.push((next, error)),
            }
            next += 1;
        }
        failed
    }

    fn remove_mappings(&mut self, entries: &[(u32, MappingKey)]) {
        let keys: Vec<Key<MappingKey>> = entries
            .iter()
            .map(|&(prefix_len, key)| Key::new(prefix_len, key))
            .collect();
        let mut next = 0;
        while next < entries.len() {
            let mut refused_whole = false;
            if self.mapping_batches {
                let fd = self.mappings.map().fd().as_fd();
                let batch =
                    map_batch::<_, MappingValue>(fd, BPF_MAP_DELETE_BATCH, &keys[next..], None);
                let Err((done, error)) = batch else {
                    break;
                };
                next += done;
                // Not in the map: passed over, as a removal one by one does.
                if error.raw_os_error() == Some(libc::ENOENT) {
                    next += 1;
                    continue;
                }
                refused_whole = done == 0;
            }
            let (prefix_len, key) = entries[next];
            if self.remove_mapping(prefix_len, key).is_ok() && refused_whole {
                self.no_mapping_batches();
            }
            next += 1;
        }
    }

    fn read_page(&self, key: PageKey) -> Result<Option<PageEntry>, BpfError> {
        match self.pages.get(&key, 0) {
            Ok(entry) => Ok(Some(entry)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(err) => Err(map_error(names::MAP_UNWIND_PAGES)(err)),
        }
    }

    fn read_row_chunk(&self, index: u32) -> Result<RowChunk, BpfError> {
        self.rows
            .get(&index, 0)
            .map_err(map_error(names::MAP_UNWIND_ROWS))
    }
}

/// Exec environments kept with their label variables: a busy host's execs come from a few
/// parents with one environment each (4 KiB at most an environment).
pub const MAX_KEPT_ENVIRONMENTS: usize = 16;

/// Process lifecycle events (exits, execs) from the kernel.
pub struct EventRing {
    ring: RingBuf<MapData>,
    environments: ParseMemo<LabelEnv>,
    cgroup_changes: bool,
}

impl EventRing {
    /// Whether the ring carries every move of a task between cgroups and every change of
    /// cgroup paths ([`LifecycleEvent::CgroupChanged`]): only then may a process's cgroups be
    /// known from its parent's.
    pub fn tracks_cgroup_changes(&self) -> bool {
        self.cgroup_changes
    }

    /// The exec environments whose labels are kept for the next execs.
    pub fn environments(&self) -> &ParseMemo<LabelEnv> {
        &self.environments
    }

    /// Appends the lifecycle events since the last call to `events`, oldest first (into the
    /// caller's buffer: a thousand a second on a busy host, a new vector each time grew).
    pub fn drain_into(&mut self, events: &mut Vec<LifecycleEvent>) {
        while let Some(item) = self.ring.next() {
            if item.len() >= std::mem::size_of::<ProcessEvent>() {
                // SAFETY: length checked; ProcessEvent is plain old data.
                let event: ProcessEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                match event.kind {
                    EVENT_PROCESS_EXIT => events.push(LifecycleEvent::Exited {
                        pid: event.pid,
                        ktime_ns: event.ktime_ns,
                    }),
                    EVENT_PROCESS_EXEC => {
                        let program = (item.len() >= std::mem::size_of::<ExecEvent>()).then(|| {
                            let environments = &mut self.environments;
                            let mut record = |exec: &ExecEvent| {
                                exec_record(&exec.details, event.ktime_ns, environments)
                            };
                            let pointer = item.as_ptr().cast::<ExecEvent>();
                            Arc::new(if pointer.is_aligned() {
                                // SAFETY: length and alignment checked; ExecEvent is plain old
                                // data. Read in place: its 4 KiB environment is mostly unused.
                                record(unsafe { &*pointer })
                            } else {
                                // SAFETY: length checked; ExecEvent is plain old data.
                                record(&unsafe { std::ptr::read_unaligned(pointer) })
                            })
                        });
                        events.push(LifecycleEvent::Execed {
                            pid: event.pid,
                            ktime_ns: event.ktime_ns,
                            program,
                        });
                    }
                    EVENT_PROCESS_FORK if item.len() >= std::mem::size_of::<ForkEvent>() => {
                        // SAFETY: length checked; ForkEvent is plain old data.
                        let fork: ForkEvent =
                            unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                        events.push(LifecycleEvent::Forked {
                            pid: event.pid,
                            parent: fork.details.parent_pid,
                            parent_tid: fork.details.parent_tid,
                            parent_cgroup_id: fork.details.parent_cgroup_id,
                            ktime_ns: event.ktime_ns,
                        });
                    }
                    EVENT_CGROUP_MIGRATION | EVENT_CGROUPS_CHANGED => {
                        let destination = (event.kind == EVENT_CGROUP_MIGRATION
                            && item.len() >= std::mem::size_of::<CgroupMoveEvent>())
                        .then(|| {
                            // SAFETY: length checked; CgroupMoveEvent is plain old data.
                            let moved: CgroupMoveEvent =
                                unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                            cgroup_move(&moved.details)
                        })
                        .flatten();
                        events.push(LifecycleEvent::CgroupChanged {
                            pid: (event.kind == EVENT_CGROUP_MIGRATION && event.pid != 0)
                                .then_some(event.pid),
                            ktime_ns: event.ktime_ns,
                            destination,
                        })
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Registers CPython processes with the BPF Python walk. A trait so the agent's Python
/// tracking can be tested without a kernel.
pub trait PythonMaps {
    fn insert_process(&mut self, pid: u32, info: &PyProcInfo) -> Result<(), BpfError>;
    fn remove_process(&mut self, pid: u32) -> Result<(), BpfError>;
}

/// The `PYTHON_PROCESSES` map in the kernel.
pub struct KernelPythonMaps {
    processes: HashMap<MapData, u32, PyProcInfo>,
}

impl PythonMaps for KernelPythonMaps {
    fn insert_process(&mut self, pid: u32, info: &PyProcInfo) -> Result<(), BpfError> {
        self.processes
            .insert(pid, info, 0)
            .map_err(map_error(names::MAP_PYTHON_PROCESSES))
    }

    fn remove_process(&mut self, pid: u32) -> Result<(), BpfError> {
        match self.processes.remove(&pid) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(err) => Err(map_error(names::MAP_PYTHON_PROCESSES)(err)),
        }
    }
}

/// Offsets in kernel structures the BPF programs read, from the kernel's BTF.
struct TaskOffsets {
    /// `task_struct.thread.fsbase`: the BPF Python walk identifies a thread's state by
    /// `pthread_self()`, which is the FS base (in every PID namespace).
    fsbase: Result<u32, String>,
    /// `task_struct.signal` and `signal_struct.live`: the exit tracepoint tells the last thread
    /// of a process from its leader.
    signal_live: Result<(u32, u32), String>,
    /// What the exec and fork events read.
    identity: Result<IdentityOffsets, String>,
    /// `vm_area_struct.vm_file`: whether code in no registered mapping is in a file.
    vma_file: Result<u32, String>,
    /// `cgroup.root` and `cgroup_root.hierarchy_id`: which hierarchy a move event's
    /// destination is in.
    cgroup_hierarchy: Result<(u32, u32), String>,
}

fn task_offsets(btf_path: &std::path::Path) -> Result<TaskOffsets, String> {
    let bytes = std::fs::read(btf_path).map_err(|e| format!("{}: {e}", btf_path.display()))?;
    let btf = btf::Btf::parse(&bytes).map_err(|e| e.to_string())?;
    let offset = |structure: &str, path: &[&str]| {
        btf.member_offset(structure, path)
            .map_err(|e| e.to_string())
    };
    Ok(TaskOffsets {
        fsbase: offset("task_struct", &["thread", "fsbase"]),
        vma_file: offset("vm_area_struct", &["vm_file"]),
        cgroup_hierarchy: offset("cgroup", &["root"])
            .and_then(|root| Ok((root, offset("cgroup_root", &["hierarchy_id"])?))),
        signal_live: offset("task_struct", &["signal"])
            .and_then(|signal| Ok((signal, offset("signal_struct", &["live"])?))),
        identity: (|| {
            Ok(IdentityOffsets {
                binprm_filename: offset("linux_binprm", &["filename"])?,
                binprm_file: offset("linux_binprm", &["file"])?,
                file_inode: offset("file", &["f_inode"])?,
                inode_ino: offset("inode", &["i_ino"])?,
                inode_sb: offset("inode", &["i_sb"])?,
                sb_dev: offset("super_block", &["s_dev"])?,
                task_mm: offset("task_struct", &["mm"])?,
                task_pid: offset("task_struct", &["pid"])?,
                task_tgid: offset("task_struct", &["tgid"])?,
                mm_start_code: offset("mm_struct", &["start_code"])?,
                mm_end_code: offset("mm_struct", &["end_code"])?,
                mm_arg_start: offset("mm_struct", &["arg_start"])?,
                mm_arg_end: offset("mm_struct", &["arg_end"])?,
                mm_env_start: offset("mm_struct", &["env_start"])?,
                mm_env_end: offset("mm_struct", &["env_end"])?,
                complete: 1,
            })
        })(),
    })
}

/// A process lifecycle event, with its `bpf_ktime_get_ns()` time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LifecycleEvent {
    /// The process's last thread exited.
    Exited { pid: u32, ktime_ns: u64 },
    /// The process replaced its program: everything before `ktime_ns` was the old one's.
    /// `program` says who it became (`None` when the kernel's BTF lacked the offsets).
    Execed {
        pid: u32,
        ktime_ns: u64,
        program: Option<Arc<ExecRecord>>,
    },
    /// A new process forked from `parent` (it runs the parent's program until it execs), by
    /// its thread `parent_tid`, in the parent's cgroup v2 `parent_cgroup_id`.
    Forked {
        pid: u32,
        parent: u32,
        parent_tid: u32,
        parent_cgroup_id: u64,
        ktime_ns: u64,
    },
    /// A task of `pid` moved to other cgroups (to `destination`, where the event says), or
    /// (`None`) any process's cgroup text may read otherwise now (a cgroup renamed, a
    /// hierarchy mounted or unmounted).
    CgroupChanged {
        pid: Option<u32>,
        ktime_ns: u64,
        destination: Option<Box<CgroupMove>>,
    },
}

/// Where a move event says its task went; `None` where it does not say it whole: a hierarchy
/// not read, a path not read, cut at the kernel's buffer's end or not UTF-8.
fn cgroup_move(details: &CgroupMoveDetails) -> Option<Box<CgroupMove>> {
    let hierarchy_id = u32::try_from(details.hierarchy_id).ok()?;
    let len = details.path_len as usize;
    if len == 0 || len >= CGROUP_MOVE_PATH_BYTES {
        return None;
    }
    // The length counts the NUL.
    let path = std::str::from_utf8(&details.path[..len - 1]).ok()?;
    if !path.starts_with('/') {
        return None;
    }
    Some(Box::new(CgroupMove {
        tid: details.tid,
        threadgroup: details.threadgroup != 0,
        hierarchy_id,
        path: path.into(),
    }))
}

impl LifecycleEvent {
    pub fn pid(&self) -> u32 {
        match self {
            Self::Exited { pid, .. } | Self::Execed { pid, .. } | Self::Forked { pid, .. } => *pid,
            Self::CgroupChanged { pid, .. } => pid.unwrap_or(0),
        }
    }

    pub fn ktime_ns(&self) -> u64 {
        match self {
            Self::Exited { ktime_ns, .. }
            | Self::Execed { ktime_ns, .. }
            | Self::Forked { ktime_ns, .. }
            | Self::CgroupChanged { ktime_ns, .. } => *ktime_ns,
        }
    }
}

/// The exec event's details as the agent keeps them. `exe_dev` is the kernel's `dev_t`
/// (major << 20 | minor), converted to the encoding `stat` reports.
pub fn exec_record(
    details: &ExecDetails,
    exec_ns: u64,
    environments: &mut ParseMemo<LabelEnv>,
) -> ExecRecord {
    let text = |bytes: &[u8], len: usize| {
        let bytes = &bytes[..len.min(bytes.len())];
        let bytes = bytes.split(|&b| b == 0).next().unwrap_or_default();
        String::from_utf8_lossy(bytes).into_owned()
    };
    let args_bytes = &details.args[..(details.args_len as usize).min(details.args.len())];
    // The whole argument area was read when it was shorter than the buffer (at its size it
    // may have been cut) and ends with its last argument's NUL.
    let args_complete = args_bytes.len() < details.args.len() && args_bytes.last() == Some(&0);
    let args_bytes = args_bytes.strip_suffix(&[0]).unwrap_or(args_bytes);
    let args = if args_bytes.is_empty() {
        ExecArgs::default()
    } else if let Ok(text) = std::str::from_utf8(args_bytes) {
        ExecArgs::from_nul_separated(text)
    } else {
        args_bytes
            .split(|&b| b == 0)
            .map(String::from_utf8_lossy)
            .collect()
    };
    let (major, minor) = (
        u64::from(details.exe_dev >> 20),
        u64::from(details.exe_dev & 0xf_ffff),
    );
    ExecRecord {
        filename: text(&details.filename, details.filename_len as usize),
        args,
        args_complete,
        comm: text(&details.comm, details.comm.len()),
        cgroup_id: details.cgroup_id,
        exe: (details.exe_ino != 0).then(|| FileId {
            dev: libc::makedev(major as u32, minor as u32),
            ino: details.exe_ino,
        }),
        code: (details.start_code != 0 && details.end_code > details.start_code)
            .then_some((details.start_code, details.end_code)),
        exec_ns,
        label_env: exec_label_env(details, environments),
    }
}

/// The labels' variables of an exec event's environment, when the event holds all of it.
fn exec_label_env(
    details: &ExecDetails,
    environments: &mut ParseMemo<LabelEnv>,
) -> Option<LabelEnv> {
    let len = details.env_len as usize;
    let whole =
        details.env_size > 0 && len == details.env_size as usize && len <= details.env.len();
    whole.then(|| environments.get_or_parse(&details.env[..len], LabelEnv::from_environ))
}

/// Records of the CUDA probes (`profiler_common::gpu`), drained by the agent's pipeline.
pub struct CudaEventRing {
    ring: RingBuf<MapData>,
}

impl CudaEventRing {
    /// Calls `f` for every record waiting; returns how many there were.
    pub fn drain(&mut self, f: impl FnMut(&[u8])) -> usize {
        drain_ring(&mut self.ring, f)
    }
}

/// Everything `Sampler::start` hands to the agent besides the sampler itself.
pub struct SamplerParts {
    pub samples: SampleRing,
    pub events: EventRing,
    /// Whether CUDA attribution is on (not `--no-gpu`). Its programs are loaded, and its ring
    /// mapped, only when the first CUDA library is probed ([`Sampler::take_cuda_ring`]).
    pub cuda: bool,
    pub unwind_maps: KernelUnwindMaps,
    pub python_maps: KernelPythonMaps,
    /// The off-CPU records, when off-CPU profiling is on and its program is attached.
    pub off_cpu: Option<OffCpuRing>,
}

fn btf_path() -> PathBuf {
    std::env::var_os("PROFILER_BTF_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_BTF_PATH))
}

/// A loaded and attached sampler. Dropping it detaches every program.
pub struct Sampler {
    // Holds the programs and their perf-event links.
    ebpf: Ebpf,
    stats: PerCpuArray<MapData, StatCounters>,
    pid_filter_entries: u32,
    attached_cpus: usize,
    frequency_hz: u64,
    cuda: CudaPrograms,
}

/// The CUDA uprobe programs: verified at start, before anything is attached, and their 8 MiB
/// ring mapped only once a process uses CUDA, so hosts and recordings without CUDA do not pay
/// its memory. Verifying both takes about a second of CPU on a busy host, and much more of its
/// wall time: done at the first CUDA library, it held the pipeline up that long, and the
/// events ring overflowed (3,000-8,000 exec, fork and exit events lost, and in a 60 s run 921
/// samples dropped, as PyTorch started in the busy-host benchmark; none without it).
enum CudaPrograms {
    Off,
    /// Verified; the ring not mapped yet.
    Deferred {
        stacks_per_second: u32,
    },
    /// Loaded; the ring waits here until the pipeline takes it.
    Loaded {
        ring: Option<CudaEventRing>,
    },
    Failed,
}

/// The ring buffer of samples, moved to the reader thread.
pub struct SampleRing {
    ring: RingBuf<MapData>,
}

impl SampleRing {
    /// Calls `f` for every record waiting in the ring buffer; returns how many there were.
    pub fn drain(&mut self, f: impl FnMut(&[u8])) -> usize {
        drain_ring(&mut self.ring, f)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.ring.as_fd()
    }

    pub fn raw_fd(&self) -> i32 {
        self.ring.as_raw_fd()
    }
}

/// Counters kept by the eBPF program, summed over CPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpfStats {
    /// Indexed by the `STAT_*` ids of profiler-common.
    pub counters: [u64; STAT_COUNT as usize],
}

impl Default for BpfStats {
    fn default() -> Self {
        BpfStats {
            counters: [0; STAT_COUNT as usize],
        }
    }
}

impl BpfStats {
    pub fn get(&self, id: u32) -> u64 {
        self.counters.get(id as usize).copied().unwrap_or(0)
    }

    /// Named values, for logs and metrics.
    pub fn named(&self) -> BTreeMap<&'static str, u64> {
        STAT_NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| (*name, self.counters[i]))
            .collect()
    }
}

impl Sampler {
    /// Fails with a clear error when this process or kernel cannot run the sampler.
    pub fn preflight() -> Result<(), BpfError> {
        check_privileges()?;
        check_kernel_support(&btf_path())
    }

    /// Checks privileges and kernel support and loads the programs; sampling begins with
    /// [`Sampler::attach`], so the agent can register known processes first.
    pub fn load(settings: &SamplerSettings) -> Result<(Self, SamplerParts), BpfError> {
        Self::preflight()?;
        if settings.pids.len() > MAX_FILTERED_PIDS as usize {
            return Err(BpfError::TooManyPids {
                given: settings.pids.len(),
                max: MAX_FILTERED_PIDS,
            });
        }
        // Kernels >= 5.11 charge BPF memory to the cgroup; raising RLIMIT_MEMLOCK is only needed
        // on older ones and fails without CAP_SYS_RESOURCE, which is harmless here.
        raise_memlock_limit();

        let chunk_bytes =
            (ROWS_PER_CHUNK * std::mem::size_of::<profiler_common::unwind::UnwindRow>()) as u64;
        let btf_path = btf_path();
        // Parsed while the kernel verifies the programs.
        let offsets = std::thread::spawn(move || task_offsets(&btf_path));
        let row_chunks = (settings.unwind_table_bytes / chunk_bytes)
            .clamp(1, u64::from(u32::MAX / ROWS_PER_CHUNK as u32)) as u32;
        // The program needs no CO-RE relocations, so skip parsing the kernel's BTF (a third of
        // start-up time); the object's own BTF still goes to the kernel.
        let mut ebpf = EbpfLoader::new()
            .btf(None)
            .map_max_entries(names::MAP_UNWIND_ROWS, row_chunks)
            .map_max_entries(names::MAP_SCRATCH_SAMPLE, scratch_records()?)
            .map_max_entries(
                names::MAP_CUDA_EVENTS,
                ring_bytes(settings.cuda, profiler_common::CUDA_EVENTS_RING_BYTES),
            )
            .map_max_entries(
                names::MAP_OFF_CPU,
                ring_bytes(
                    settings.off_cpu_probability.is_some(),
                    profiler_common::OFF_CPU_RING_BYTES,
                ),
            )
            .load(EBPF_OBJECT)
            .map_err(BpfError::Load)?;

        let offsets = offsets
            .join()
            .unwrap_or_else(|_| Err("reading the kernel's BTF panicked".into()))
            .unwrap_or_else(|reason| TaskOffsets {
                fsbase: Err(reason.clone()),
                signal_live: Err(reason.clone()),
                identity: Err(reason.clone()),
                vma_file: Err(reason.clone()),
                cgroup_hierarchy: Err(reason),
            });
        let task_fsbase_offset = offsets.fsbase.unwrap_or_else(|reason| {
            tracing::warn!(
                "Python 3.8-3.10, and 3.11+ in other PID namespaces, will show native frames only: cannot find the FS base in the kernel's task_struct ({reason})"
            );
            0
        });
        let (task_signal_offset, signal_live_offset) =
            offsets.signal_live.unwrap_or_else(|reason| {
                tracing::info!(
                    "a process is taken as exited when its main thread exits: cannot find the live thread count in the kernel's task_struct ({reason})"
                );
                (0, 0)
            });
        let vma_file_offset = offsets.vma_file.unwrap_or_else(|reason| {
            tracing::info!(
                "the first samples in a library loaded after its process was first sampled \
                 are cut where the library starts: cannot find vm_file in the kernel's \
                 vm_area_struct ({reason})"
            );
            0
        });
        let (cgroup_root_offset, cgroup_root_hierarchy_offset) =
            offsets.cgroup_hierarchy.unwrap_or_else(|reason| {
                tracing::info!(
                    "children forked right after their parent moved between cgroups read their \
                     own cgroups from /proc: cannot find the cgroup hierarchy in the kernel's \
                     BTF ({reason})"
                );
                (0, 0)
            });
        let identity = offsets.identity.unwrap_or_else(|reason| {
            tracing::info!(
                "processes that exit before the agent reads /proc are named by their thread: \
                 cannot find the exec details in the kernel's BTF ({reason})"
            );
            IdentityOffsets::default()
        });
        // A woken thread is found by its tid, read from the task_struct.
        let off_cpu_probability = settings.off_cpu_probability.filter(|_| {
            let known = identity.task_pid != 0 && identity.task_tgid != 0;
            if !known {
                tracing::warn!(
                    "off-CPU profiling is off: the kernel's BTF lacks task_struct's pid and tgid"
                );
            }
            known
        });
        let config = SamplerConfig {
            filter_pids: u32::from(!settings.pids.is_empty()),
            keep_idle: 0,
            task_fsbase_offset,
            task_signal_offset,
            signal_live_offset,
            cuda_probes: 0,
            identity,
            off_cpu_threshold: off_cpu_probability.map_or(0, off_cpu_threshold),
            off_cpu_exclude_pid: std::process::id(),
            vma_file_offset,
            cgroup_root_offset,
            cgroup_root_hierarchy_offset,
        };
        // Borrowed, not taken: the CUDA programs, loaded later, refer to these maps by the file
        // descriptors the object holds.
        let mut config_map: Array<_, SamplerConfig> = borrow_map(&mut ebpf, names::MAP_CONFIG)?;
        config_map
            .set(0, config, 0)
            .map_err(map_error(names::MAP_CONFIG))?;
        let mut pid_filter: HashMap<_, u32, u8> = borrow_map(&mut ebpf, names::MAP_PID_FILTER)?;
        for pid in &settings.pids {
            pid_filter
                .insert(pid, 1, 0)
                .map_err(map_error(names::MAP_PID_FILTER))?;
        }
        let stats: PerCpuArray<_, StatCounters> = take_map(&mut ebpf, names::MAP_STATS)?;
        let ring: RingBuf<_> = take_map(&mut ebpf, names::MAP_SAMPLES)?;
        let events: RingBuf<_> = take_map(&mut ebpf, names::MAP_EVENTS)?;
        let unwind_maps = KernelUnwindMaps {
            rows: take_map(&mut ebpf, names::MAP_UNWIND_ROWS)?,
            pages: take_map(&mut ebpf, names::MAP_UNWIND_PAGES)?,
            mappings: take_map(&mut ebpf, names::MAP_PROCESS_MAPPINGS)?,
            row_chunks,
            mapping_batches: true,
        };
        let python_maps = KernelPythonMaps {
            processes: take_map(&mut ebpf, names::MAP_PYTHON_PROCESSES)?,
        };

        // Before the lifecycle tracepoints are attached: nothing waits in a ring meanwhile.
        let cuda = match settings.cuda {
            true => match load_cuda_programs(&mut ebpf) {
                Ok(()) => CudaPrograms::Deferred {
                    stacks_per_second: settings.cuda_stacks_per_second,
                },
                Err(err) => {
                    tracing::warn!("CUDA attribution is off: {err}");
                    CudaPrograms::Failed
                }
            },
            false => CudaPrograms::Off,
        };

        for (program, tracepoint) in [
            (names::PROGRAM_PROCESS_EXIT, names::TRACEPOINT_PROCESS_EXIT),
            (names::PROGRAM_PROCESS_EXEC, names::TRACEPOINT_PROCESS_EXEC),
            (names::PROGRAM_PROCESS_FORK, names::TRACEPOINT_PROCESS_FORK),
        ] {
            let lifecycle: &mut RawTracePoint = program_mut(&mut ebpf, program)?;
            lifecycle.load().map_err(program_error(program))?;
            lifecycle
                .attach(tracepoint)
                .map_err(program_error(program))?;
        }
        // Optional: without them every snapshot reads its process's cgroups from /proc.
        let cgroup_changes = match attach_cgroup_programs(&mut ebpf) {
            Ok(()) => true,
            Err(err) => {
                tracing::warn!(
                    "cgroup moves are not traced, so each process's cgroups are read from \
                     /proc: {err}"
                );
                false
            }
        };

        let off_cpu = match off_cpu_probability {
            Some(_) => {
                let ring: RingBuf<_> = take_map(&mut ebpf, names::MAP_OFF_CPU)?;
                let program: &mut RawTracePoint = program_mut(&mut ebpf, names::PROGRAM_OFF_CPU)?;
                program
                    .load()
                    .map_err(program_error(names::PROGRAM_OFF_CPU))?;
                program
                    .attach(names::TRACEPOINT_SCHED_SWITCH)
                    .map_err(program_error(names::PROGRAM_OFF_CPU))?;
                Some(OffCpuRing { ring })
            }
            None => None,
        };

        let program: &mut PerfEvent = program_mut(&mut ebpf, names::PROGRAM_SAMPLE_CPU)?;
        program
            .load()
            .map_err(program_error(names::PROGRAM_SAMPLE_CPU))?;
        let sampler = Sampler {
            ebpf,
            stats,
            pid_filter_entries: settings.pids.len() as u32,
            attached_cpus: 0,
            frequency_hz: settings.frequency_hz,
            cuda,
        };
        Ok((
            sampler,
            SamplerParts {
                samples: SampleRing { ring },
                events: EventRing {
                    ring: events,
                    environments: ParseMemo::new(MAX_KEPT_ENVIRONMENTS),
                    cgroup_changes,
                },
                cuda: settings.cuda,
                unwind_maps,
                python_maps,
                off_cpu,
            },
        ))
    }

    /// Starts sampling: attaches the program to the cpu-clock event of every online CPU.
    pub fn attach(&mut self) -> Result<(), BpfError> {
        let program: &mut PerfEvent = program_mut(&mut self.ebpf, names::PROGRAM_SAMPLE_CPU)?;
        let cpus = online_cpus().map_err(|(path, source)| BpfError::Cpus {
            path: path.to_owned(),
            source,
        })?;
        // cpu-clock counts in nanoseconds, so a fixed period gives exactly `frequency_hz`
        // samples per second of CPU time.
        let period_ns = 1_000_000_000 / self.frequency_hz.max(1);
        for &cpu in &cpus {
            program
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Period(period_ns),
                    false,
                )
                .map_err(|source| BpfError::Attach { cpu, source })?;
        }
        self.attached_cpus = cpus.len();
        tracing::info!(
            cpus = cpus.len(),
            frequency_hz = self.frequency_hz,
            "sampler attached"
        );
        Ok(())
    }

    /// Stops taking samples: detaches the CPU sampler and the off-CPU program, and leaves the
    /// rest (exec, fork and exit programs, maps) to the drop. Dropping the whole sampler takes
    /// seconds with large unwind tables, and the sampler, detached at some point in that, went
    /// on sampling: about 450 samples taken after the stop were dropped at every stop of the
    /// busy-host benchmark. Read [`Self::stats`] and the run statistics before: the programs'
    /// figures go with them.
    pub fn stop_sampling(&mut self) {
        let report = |what: &str, unloaded: Result<(), aya::programs::ProgramError>| match unloaded
        {
            // The off-CPU program is loaded only when off-CPU profiling is on.
            Ok(()) | Err(aya::programs::ProgramError::NotLoaded) => {}
            Err(err) => tracing::debug!("cannot detach the {what}: {err}"),
        };
        if let Ok(program) = program_mut::<PerfEvent>(&mut self.ebpf, names::PROGRAM_SAMPLE_CPU) {
            report("CPU sampler", program.unload());
        }
        if let Ok(program) = program_mut::<RawTracePoint>(&mut self.ebpf, names::PROGRAM_OFF_CPU) {
            report("off-CPU program", program.unload());
        }
    }

    /// Per-cause counters summed over CPUs (the ring-buffer gauge is the maximum instead).
    pub fn stats(&self) -> BpfStats {
        let mut out = BpfStats::default();
        let Ok(per_cpu) = self.stats.get(&0, 0) else {
            return out;
        };
        for cpu in per_cpu.iter() {
            for (id, (total, &value)) in out.counters.iter_mut().zip(&cpu.counters).enumerate() {
                if id == STAT_RINGBUF_PENDING_BYTES as usize {
                    *total = (*total).max(value);
                } else {
                    *total += value;
                }
            }
        }
        out
    }

    /// Total run time and run count of the sampler program, as the kernel accounts them while
    /// `kernel.bpf_stats_enabled` is 1 (zeros otherwise).
    pub fn program_run_stats(&self) -> (u64, u64) {
        self.named_program_run_stats(names::PROGRAM_SAMPLE_CPU)
    }

    /// The same for the off-CPU program (zeros when it is not loaded).
    pub fn off_cpu_run_stats(&self) -> (u64, u64) {
        self.named_program_run_stats(names::PROGRAM_OFF_CPU)
    }

    fn named_program_run_stats(&self, name: &str) -> (u64, u64) {
        self.ebpf
            .program(name)
            .and_then(|program| program.info().ok())
            .map(|info| (info.run_time().as_nanos() as u64, info.run_count()))
            .unwrap_or((0, 0))
    }

    /// Fill level of the pid filter map as (entries, capacity).
    pub fn pid_filter_fill(&self) -> (u32, u32) {
        (self.pid_filter_entries, MAX_FILTERED_PIDS)
    }

    pub fn attached_cpus(&self) -> usize {
        self.attached_cpus
    }

    /// The CUDA probes' ring, once, after the first [`Sampler::attach_cuda`] loaded them.
    pub fn take_cuda_ring(&mut self) -> Option<CudaEventRing> {
        match &mut self.cuda {
            CudaPrograms::Loaded { ring } => ring.take(),
            _ => None,
        }
    }

    /// Whether the CUDA programs failed to load (or CUDA attribution is off): no probe can be
    /// attached, so there is nothing to look for.
    pub fn cuda_unavailable(&self) -> bool {
        matches!(self.cuda, CudaPrograms::Off | CudaPrograms::Failed)
    }

    /// Maps the CUDA programs' ring on first use; an error turns CUDA attribution off for good.
    pub fn ensure_cuda_loaded(&mut self) -> Result<(), BpfError> {
        match self.cuda {
            CudaPrograms::Loaded { .. } => Ok(()),
            CudaPrograms::Off => Err(BpfError::CudaOff),
            CudaPrograms::Failed => Err(BpfError::CudaNotLoaded),
            CudaPrograms::Deferred { stacks_per_second } => {
                match map_cuda(&mut self.ebpf, stacks_per_second) {
                    Ok(ring) => {
                        // Samples now look up whether their thread waits in a CUDA sync.
                        let mut config: Array<_, SamplerConfig> =
                            borrow_map(&mut self.ebpf, names::MAP_CONFIG)?;
                        let current = config.get(&0, 0).map_err(map_error(names::MAP_CONFIG))?;
                        config
                            .set(
                                0,
                                SamplerConfig {
                                    cuda_probes: 1,
                                    ..current
                                },
                                0,
                            )
                            .map_err(map_error(names::MAP_CONFIG))?;
                        self.cuda = CudaPrograms::Loaded { ring: Some(ring) };
                        Ok(())
                    }
                    Err(err) => {
                        tracing::warn!("CUDA attribution is off: {err}");
                        self.cuda = CudaPrograms::Failed;
                        Err(err)
                    }
                }
            }
        }
    }

    /// Attaches the CUDA entry (or return) program at `file_offset` of the ELF file `target`,
    /// for every process that maps it, with `cookie` (a `CALL_*` id, the function's index and
    /// flags: `ProbePoint::cookie`) as the cookie.
    pub fn attach_cuda(
        &mut self,
        target: &std::path::Path,
        file_offset: u64,
        cookie: u64,
        at_return: bool,
    ) -> Result<(), BpfError> {
        self.ensure_cuda_loaded()?;
        let name = if at_return {
            names::PROGRAM_CUDA_RETURN
        } else {
            names::PROGRAM_CUDA_ENTRY
        };
        let program: &mut UProbe = program_mut(&mut self.ebpf, name)?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(file_offset),
            cookie: Some(cookie),
        };
        program
            .attach(point, target, UProbeScope::AllProcesses)
            .map(|_| ())
            .map_err(|source| BpfError::UProbe {
                target: target.display().to_string(),
                source,
            })
    }
}

/// Loads (verifies) the CUDA uprobe programs; attached later, one probe per function found.
fn load_cuda_programs(ebpf: &mut Ebpf) -> Result<(), BpfError> {
    for name in [names::PROGRAM_CUDA_ENTRY, names::PROGRAM_CUDA_RETURN] {
        let program: &mut UProbe = program_mut(ebpf, name)?;
        program.load().map_err(program_error(name))?;
    }
    Ok(())
}

/// Writes the loaded CUDA programs' settings and maps their ring.
fn map_cuda(ebpf: &mut Ebpf, stacks_per_second: u32) -> Result<CudaEventRing, BpfError> {
    let mut config: Array<_, CudaConfig> = take_map(ebpf, names::MAP_CUDA_CONFIG)?;
    let settings = CudaConfig {
        stacks_per_second,
        stack_burst: stacks_per_second.max(1),
    };
    config
        .set(0, settings, 0)
        .map_err(map_error(names::MAP_CUDA_CONFIG))?;
    let ring: RingBuf<_> = take_map(ebpf, names::MAP_CUDA_EVENTS)?;
    Ok(CudaEventRing { ring })
}

/// Calls `f` for every record waiting in `ring`; returns how many there were.
fn drain_ring(ring: &mut RingBuf<MapData>, mut f: impl FnMut(&[u8])) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        f(&item);
        n += 1;
    }
    n
}

/// Attaches the programs that report moves between cgroups and changes of cgroup paths,
/// each to every one of its tracepoints.
fn attach_cgroup_programs(ebpf: &mut Ebpf) -> Result<(), BpfError> {
    for (program, tracepoints) in [
        (
            names::PROGRAM_CGROUP_MIGRATION,
            &names::TRACEPOINTS_CGROUP_MIGRATION[..],
        ),
        (
            names::PROGRAM_CGROUPS_CHANGED,
            &names::TRACEPOINTS_CGROUPS_CHANGED[..],
        ),
    ] {
        let tracer: &mut RawTracePoint = program_mut(ebpf, program)?;
        tracer.load().map_err(program_error(program))?;
        for tracepoint in tracepoints {
            tracer.attach(tracepoint).map_err(program_error(program))?;
        }
    }
    Ok(())
}

/// The program `name` of the object, as its concrete type.
fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, BpfError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| BpfError::ProgramMissing {
            name: name.to_owned(),
        })?
        .try_into()
        .map_err(program_error(name))
}

fn program_error(name: &str) -> impl Fn(aya::programs::ProgramError) -> BpfError {
    move |source| BpfError::Program {
        name: name.to_owned(),
        source,
    }
}

/// The map `name`, left in the object (for maps only set up at load time).
fn borrow_map<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<T, BpfError>
where
    T: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
{
    typed_map(ebpf.map_mut(name), name)
}

/// The map `name`, moved out of the object. Its file descriptor closes when the map is
/// dropped, so programs loaded later must not use a map taken this way and dropped.
fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, BpfError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    typed_map(ebpf.take_map(name), name)
}

fn typed_map<M, T>(map: Option<M>, name: &'static str) -> Result<T, BpfError>
where
    T: TryFrom<M, Error = aya::maps::MapError>,
{
    let map = map.ok_or(BpfError::MapMissing { name })?;
    T::try_from(map).map_err(map_error(name))
}

/// Bytes of a ring whose programs are loaded only when `used`: the ABI's size then, else one
/// page (the kernel maps all of a ring into the agent, its data pages twice: 8 MiB of RSS for
/// a 4 MiB ring nothing writes to). The CUDA ring keeps its 4 MiB when used: 1 MiB on a 2-CPU
/// host lost 1,280 of a 20,000-launch storm.
fn ring_bytes(used: bool, abi_bytes: u32) -> u32 {
    if used { abi_bytes } else { 4096 }
}

/// Entries of `SCRATCH_SAMPLE`: its slots for every possible CPU (BPF indexes it by
/// `bpf_get_smp_processor_id()`, which is below the possible count).
fn scratch_records() -> Result<u32, BpfError> {
    let cpus = aya::util::nr_cpus().map_err(|(path, source)| BpfError::Cpus {
        path: path.to_owned(),
        source,
    })?;
    u32::try_from(cpus)
        .ok()
        .and_then(|cpus| cpus.checked_mul(profiler_common::SCRATCH_SLOTS))
        .ok_or(BpfError::TooManyCpus { cpus })
}

fn raise_memlock_limit() {
    let limit = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) } != 0 {
        tracing::debug!(
            "setrlimit(RLIMIT_MEMLOCK) failed; fine on kernels that charge BPF memory to cgroups"
        );
    }
}

/// Flattens an error and its sources into one line.
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(next) = source {
        let text = next.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = next.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A move event's destination is taken only when whole: a hierarchy read, a path read,
    /// not cut at the kernel's buffer's end, UTF-8 and from the hierarchy's root.
    #[test]
    fn a_move_destination_is_taken_only_when_whole() {
        let details = |hierarchy_id: i32, path: &[u8], path_len: u32| {
            let mut details = CgroupMoveDetails {
                tid: 7,
                hierarchy_id,
                threadgroup: 1,
                path_len,
                path: [0; CGROUP_MOVE_PATH_BYTES],
            };
            details.path[..path.len()].copy_from_slice(path);
            details
        };
        let whole = cgroup_move(&details(4, b"/docker-a.scope\0", 16)).expect("whole");
        assert_eq!(
            *whole,
            CgroupMove {
                tid: 7,
                threadgroup: true,
                hierarchy_id: 4,
                path: "/docker-a.scope".into(),
            }
        );
        assert_eq!(
            cgroup_move(&details(0, b"/\0", 2)).map(|m| m.path),
            Some("/".into())
        );
        assert_eq!(cgroup_move(&details(-1, b"/a\0", 3)), None, "no hierarchy");
        assert_eq!(cgroup_move(&details(4, b"", 0)), None, "no path");
        assert_eq!(cgroup_move(&details(4, b"a\0", 2)), None, "relative");
        assert_eq!(cgroup_move(&details(4, b"/\xff\0", 3)), None, "not UTF-8");
        let full = [b'/'; CGROUP_MOVE_PATH_BYTES];
        assert_eq!(
            cgroup_move(&details(4, &full, CGROUP_MOVE_PATH_BYTES as u32)),
            None,
            "filled the buffer: may be cut"
        );
        assert_eq!(
            cgroup_move(&details(4, b"/a\0", u32::MAX)),
            None,
            "a length past the buffer"
        );
    }

    /// An LPM trie with the mappings trie's key and value sizes, made with `BPF_MAP_CREATE`
    /// (aya 0.14 makes maps only from an object file).
    fn mappings_like_trie(max_entries: u32) -> std::os::fd::OwnedFd {
        #[repr(C)]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        const BPF_MAP_CREATE: libc::c_long = 0;
        const BPF_MAP_TYPE_LPM_TRIE: u32 = 11;
        const BPF_F_NO_PREALLOC: u32 = 1;
        let attr = CreateAttr {
            map_type: BPF_MAP_TYPE_LPM_TRIE,
            key_size: std::mem::size_of::<Key<MappingKey>>() as u32,
            value_size: std::mem::size_of::<MappingValue>() as u32,
            max_entries,
            map_flags: BPF_F_NO_PREALLOC,
        };
        // SAFETY: a plain struct the kernel reads; a new descriptor is returned on success.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_CREATE,
                &attr as *const CreateAttr,
                std::mem::size_of::<CreateAttr>(),
            )
        };
        assert!(
            fd >= 0,
            "BPF_MAP_CREATE: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: the descriptor was just made and is owned by nobody else.
        unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) }
    }

    fn lookup(map: BorrowedFd<'_>, key: &Key<MappingKey>) -> Option<MappingValue> {
        #[repr(C)]
        struct ElemAttr {
            map_fd: u32,
            _pad: u32,
            key: u64,
            value: u64,
            flags: u64,
        }
        const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
        let mut value = MappingValue::default();
        let attr = ElemAttr {
            map_fd: map.as_raw_fd() as u32,
            _pad: 0,
            key: key as *const Key<MappingKey> as u64,
            value: &mut value as *mut MappingValue as u64,
            flags: 0,
        };
        // SAFETY: the kernel reads the key and writes one value into `value`.
        let result = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_ELEM,
                &attr as *const ElemAttr,
                std::mem::size_of::<ElemAttr>(),
            )
        };
        (result == 0).then_some(value)
    }

    /// The batch commands the mappings trie is written with, on this kernel: a batch goes in
    /// whole, one that meets a bad element stops there and says how many it did, and a
    /// deletion stops at a key that is not there.
    #[test]
    fn mapping_batches_go_in_whole_or_up_to_the_element_that_failed() {
        let trie = mappings_like_trie(64);
        let key = |prefix_len, pid, addr| Key::new(prefix_len, MappingKey::new(pid, addr));
        let value = |table_id| MappingValue {
            table_id,
            ..MappingValue::default()
        };
        let keys: Vec<_> = (0..10u64).map(|i| key(32 + 52, 7, i << 12)).collect();
        let values: Vec<_> = (0..10u32).map(value).collect();
        map_batch(trie.as_fd(), BPF_MAP_UPDATE_BATCH, &keys, Some(&values))
            .expect("a batch of ten");
        for (key, value) in keys.iter().zip(&values) {
            assert_eq!(lookup(trie.as_fd(), key).as_ref(), Some(value));
        }
        // A prefix longer than the key's 96 bits is refused: the batch stops at it.
        let bad = vec![
            key(32 + 52, 8, 0),
            key(32 + 200, 8, 1 << 12),
            key(32 + 52, 8, 2 << 12),
        ];
        let (done, error) = map_batch(trie.as_fd(), BPF_MAP_UPDATE_BATCH, &bad, Some(&values[..3]))
            .expect_err("a bad prefix length");
        assert_eq!((done, error.raw_os_error()), (1, Some(libc::EINVAL)));
        assert!(lookup(trie.as_fd(), &bad[0]).is_some());
        assert!(lookup(trie.as_fd(), &bad[2]).is_none());
        // Deleting: the first five go, then a key never inserted stops the batch.
        let mut deletions = keys[..5].to_vec();
        deletions.push(bad[2]);
        deletions.extend_from_slice(&keys[5..]);
        let (done, error) =
            map_batch::<_, MappingValue>(trie.as_fd(), BPF_MAP_DELETE_BATCH, &deletions, None)
                .expect_err("a missing key");
        assert_eq!((done, error.raw_os_error()), (5, Some(libc::ENOENT)));
        assert!(lookup(trie.as_fd(), &keys[4]).is_none());
        assert!(lookup(trie.as_fd(), &keys[5]).is_some());
        map_batch::<_, MappingValue>(trie.as_fd(), BPF_MAP_DELETE_BATCH, &keys[5..], None)
            .expect("the rest");
        assert!(keys.iter().all(|key| lookup(trie.as_fd(), key).is_none()));
    }

    #[test]
    fn a_ring_is_one_page_without_its_programs() {
        let abi = profiler_common::CUDA_EVENTS_RING_BYTES;
        assert_eq!(ring_bytes(false, abi), 4096);
        assert_eq!(ring_bytes(true, abi), abi);
    }

    fn empty_exec_details() -> ExecDetails {
        ExecDetails {
            cgroup_id: 0,
            exe_ino: 0,
            exe_dev: 0,
            filename_len: 0,
            args_len: 0,
            env_size: 0,
            env_len: 0,
            _pad: 0,
            start_code: 0,
            end_code: 0,
            comm: [0; 16],
            filename: [0; profiler_common::EXEC_FILENAME_BYTES],
            args: [0; profiler_common::EXEC_ARGS_BYTES],
            env: [0; profiler_common::EXEC_ENV_BYTES],
        }
    }

    #[test]
    fn an_exec_record_has_the_labels_environment_only_when_the_event_held_all_of_it() {
        let mut details = empty_exec_details();
        // One memo throughout: a kept environment answers only for the whole of it.
        let mut environments = ParseMemo::new(2);
        assert_eq!(
            exec_record(&details, 1, &mut environments).label_env,
            None,
            "not read"
        );
        let env = b"PATH=/bin\0OTEL_SERVICE_NAME=nightly-report\0POD_NAME=\xff\0HOME=/root\0";
        details.env[..env.len()].copy_from_slice(env);
        details.env_size = env.len() as u32;
        details.env_len = env.len() as u16;
        let kept = exec_record(&details, 1, &mut environments)
            .label_env
            .expect("the whole environment");
        assert_eq!(
            kept.to_map().into_iter().collect::<Vec<_>>(),
            [
                ("OTEL_SERVICE_NAME".to_owned(), "nightly-report".to_owned()),
                ("POD_NAME".to_owned(), "\u{fffd}".to_owned()),
            ]
        );
        let again = exec_record(&details, 1, &mut environments).label_env;
        assert_eq!(
            again,
            Some(kept),
            "the same labels from the kept environment"
        );
        assert_eq!(environments.hits(), 1);
        // Larger than the event: nothing copied, and nothing is known of it.
        details.env_size = 9000;
        details.env_len = 0;
        assert_eq!(exec_record(&details, 1, &mut environments).label_env, None);
        details.env_len = env.len() as u16;
        assert_eq!(
            exec_record(&details, 1, &mut environments).label_env,
            None,
            "a part is not all"
        );
    }

    #[test]
    fn an_exec_record_keeps_every_argument_as_the_kernel_copied_them() {
        let mut details = ExecDetails {
            cgroup_id: 7,
            ..empty_exec_details()
        };
        let filename = b"/usr/lib/gcc/cc1\0";
        details.filename[..filename.len()].copy_from_slice(filename);
        details.filename_len = filename.len() as u16;
        details.comm[..3].copy_from_slice(b"cc1");
        // An empty argument in the middle, invalid UTF-8, and the kernel's final NUL.
        let args = b"cc1\0\0-O2\0caf\xe9\0";
        details.args[..args.len()].copy_from_slice(args);
        details.args_len = args.len() as u16;
        let record = exec_record(&details, 42, &mut ParseMemo::new(2));
        assert_eq!(record.filename, "/usr/lib/gcc/cc1");
        assert_eq!(record.comm, "cc1");
        assert_eq!(record.args.to_vec(), ["cc1", "", "-O2", "caf\u{fffd}"]);
        assert_eq!(record.exe, None);
        assert_eq!(record.code, None);
        assert_eq!((record.cgroup_id, record.exec_ns), (7, 42));
        assert!(record.args_complete);

        // The same in valid UTF-8, taken whole rather than argument by argument.
        let args = b"cc1\0\0-O2\0x.c\0";
        details.args = [0; profiler_common::EXEC_ARGS_BYTES];
        details.args[..args.len()].copy_from_slice(args);
        details.args_len = args.len() as u16;
        let record = exec_record(&details, 42, &mut ParseMemo::new(2));
        assert_eq!(record.args.to_vec(), ["cc1", "", "-O2", "x.c"]);
        assert_eq!(
            record.args,
            ["cc1", "", "-O2", "x.c"].into_iter().collect(),
            "the same record as collected argument by argument"
        );
        assert!(record.args_complete);

        details.args_len = 0;
        let unread = exec_record(&details, 42, &mut ParseMemo::new(2));
        assert_eq!(unread.args.iter().count(), 0);
        assert!(
            !unread.args_complete,
            "no arguments read is not all of them"
        );
    }

    #[test]
    fn an_exec_record_whose_arguments_fill_the_buffer_may_have_lost_some() {
        let mut details = ExecDetails {
            args: [b'x'; profiler_common::EXEC_ARGS_BYTES],
            ..empty_exec_details()
        };
        // Cut by the buffer: the kernel had more, even when its last byte is a NUL.
        details.args_len = profiler_common::EXEC_ARGS_BYTES as u16;
        assert!(!exec_record(&details, 1, &mut ParseMemo::new(2)).args_complete);
        details.args[profiler_common::EXEC_ARGS_BYTES - 1] = 0;
        assert!(!exec_record(&details, 1, &mut ParseMemo::new(2)).args_complete);
        // Shorter than the buffer but not ending with a NUL: read partly.
        details.args_len = 100;
        assert!(!exec_record(&details, 1, &mut ParseMemo::new(2)).args_complete);
        details.args[99] = 0;
        assert!(exec_record(&details, 1, &mut ParseMemo::new(2)).args_complete);
    }
}
