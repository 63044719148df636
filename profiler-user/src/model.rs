//! The vocabulary shared by the pipeline stages.
//!
//! Data flows one way: `sampling` decodes [`Sample`]s from the ring buffer; `process` snapshots
//! each process ([`ProcessInfo`]) the first time one of its samples is seen; `unwinding` turns a
//! sample into an [`UnwoundStack`] of normalized frames (kernel address, or file + file offset);
//! `symbolization` turns those into [`SymbolizedFrame`]s; `aggregation` counts identical stacks
//! per series and hands [`Profile`]s to `export`.
use std::{
    collections::BTreeMap, fmt, fs::File, os::fd::AsRawFd, os::unix::fs::MetadataExt,
    path::PathBuf, sync::Arc,
};

/// A process id (thread-group id).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pid(pub u32);

/// A thread id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tid(pub u32);

impl fmt::Display for Pid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A decoded CPU sample.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// CLOCK_MONOTONIC nanoseconds.
    pub ktime_ns: u64,
    pub pid: Pid,
    pub tid: Tid,
    pub cpu: u32,
    /// The thread name.
    pub comm: Arc<str>,
    /// Kernel return addresses, innermost first.
    pub kernel_ips: Vec<u64>,
    /// User addresses, innermost first: the instruction the thread was stopped at (unless
    /// `user_leaf_is_return_address`), then return addresses.
    pub user_ips: Vec<u64>,
    /// The first user address is a return address too (a CUDA probe's caller).
    pub user_leaf_is_return_address: bool,
    pub kernel_truncated: bool,
    pub user_truncated: bool,
    pub user_stack_error: bool,
    /// BPF met a user PC outside every mapping registered for this process.
    pub user_unknown_mapping: bool,
    /// BPF met a registered mapping whose unwind table is not loaded.
    pub user_table_missing: bool,
    /// The first user frame (index into `user_ips`) whose caller BPF took from the
    /// frame-pointer chain rather than the frame's unwind table.
    pub fallback_frame: Option<usize>,
    /// Python frames of the sampled thread, innermost first (empty for non-Python threads).
    pub python_frames: Vec<PythonFrameRef>,
    /// The Python stack was deeper than BPF records.
    pub python_truncated: bool,
    /// The thread was inside a CUDA synchronization call (waiting for the GPU).
    pub in_cuda_sync: bool,
    /// BPF stopped the user walk at the last frame of `user_ips` rather than guess, and sent
    /// the stack from there for the agent to finish the walk.
    pub stack_copy: Option<Box<StackCopy>>,
}

impl Sample {
    /// Bytes of the stack copy it carries (0 without one): what holding the sample costs.
    pub fn stack_copy_bytes(&self) -> usize {
        self.stack_copy.as_ref().map_or(0, |copy| copy.bytes.len())
    }
}

/// The environment variables labels are derived from; everything else is not kept.
pub const LABEL_ENV_VARS: &[&str] = &[
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "PYROSCOPE_APPLICATION_NAME",
    "HOSTNAME",
    // KUBERNETES_ENV_VARS, spelled out because const slices cannot be concatenated (a test
    // checks they are all here).
    "POD_NAMESPACE",
    "POD_NAME",
    "CONTAINER_NAME",
];

/// Keeps only the variables in [`LABEL_ENV_VARS`] from a NUL-separated environment (as
/// /proc/PID/environ, or an exec event's copy of it).
pub fn parse_environ(raw: &[u8]) -> BTreeMap<String, String> {
    label_variables(raw)
        .map(|(name, value)| (name.to_owned(), String::from_utf8_lossy(value).into_owned()))
        .collect()
}

/// The [`LABEL_ENV_VARS`] of an environment, in its order (a variable set twice: both, the
/// last one winning in a map, as in Python's `os.environ`).
fn label_variables(raw: &[u8]) -> impl Iterator<Item = (&'static str, &[u8])> {
    // Every exec event's environment is parsed (hundreds a second on a busy host): the NULs
    // are found with SIMD, and a variable whose first byte starts no label variable's name is
    // passed over without looking for its `=`. Nothing is decoded or copied for the rest.
    // (Seven SIMD substring searches, one per name, took as long on a 4 KiB environment;
    // searching from the end, three times as long.)
    let mut start = 0;
    memchr::memchr_iter(0, raw)
        .chain(std::iter::once(raw.len()))
        .filter_map(move |end| {
            let entry = raw.get(start..end).unwrap_or_default();
            start = end + 1;
            let first = entry.first()?;
            if !LABEL_ENV_VARS.iter().any(|k| k.as_bytes()[0] == *first) {
                return None;
            }
            let equals = memchr::memchr(b'=', entry)?;
            let (key, value) = (&entry[..equals], &entry[equals + 1..]);
            let name = LABEL_ENV_VARS.iter().find(|k| k.as_bytes() == key)?;
            Some((*name, value))
        })
}

/// The [`LABEL_ENV_VARS`] of an exec event's environment, kept as one allocation (`NAME=value`,
/// each followed by a NUL; most programs have none, and the registry keeps thousands of exec
/// records: a map each cost half a KiB where one variable was set). Shared: the exec records of
/// one environment (one parse, see `bounded::ParseMemo`) hold the same allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelEnv(Arc<str>);

impl LabelEnv {
    /// The label variables of a NUL-separated environment.
    pub fn from_environ(raw: &[u8]) -> Self {
        let mut kept = String::new();
        for (name, value) in label_variables(raw) {
            kept.push_str(name);
            kept.push('=');
            kept.push_str(&String::from_utf8_lossy(value));
            kept.push('\0');
        }
        Self(kept.into())
    }

    /// As [`parse_environ`] would have read them.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        parse_environ(self.0.as_bytes())
    }
}

/// Where the kernel's move event says a task moved between cgroups: one line of its
/// process's /proc/PID/cgroup now reads otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMove {
    /// The thread moved.
    pub tid: u32,
    /// Every thread of its process moved with it (a write to `cgroup.procs`).
    pub threadgroup: bool,
    /// The changed line's hierarchy id (0: cgroup v2) and its new path, from the hierarchy's
    /// root (as the initial cgroup namespace sees it).
    pub hierarchy_id: u32,
    pub path: Box<str>,
}

/// Who a process became at an exec, as the kernel saw it then (the exec event): enough to name
/// a process that exits before its /proc entry is read, and to symbolize its main executable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecRecord {
    /// The path given to execve (may be relative, or a symlink).
    pub filename: String,
    /// The argument strings (at most the first 512 bytes of them).
    pub args: ExecArgs,
    /// `args` holds every argument, as /proc/PID/cmdline had them at the exec.
    pub args_complete: bool,
    /// The new process name (the executable's base name, truncated to 15 bytes).
    pub comm: String,
    /// The cgroup v2 id (the inode of the cgroup's directory in cgroupfs), 0 when unknown.
    pub cgroup_id: u64,
    /// The executable's identity, when the kernel's BTF gave the offsets.
    pub exe: Option<FileId>,
    /// The main executable's code as mapped (`mm->start_code..end_code`).
    pub code: Option<(u64, u64)>,
    /// When the exec happened (CLOCK_MONOTONIC ns, the BPF event's time).
    pub exec_ns: u64,
    /// The [`LABEL_ENV_VARS`] of the environment the program started with, when the event
    /// held all of it (`None`: too large for the event, or not read; /proc/PID/environ then).
    pub label_env: Option<LabelEnv>,
}

/// The arguments of an exec, kept as one allocation (each followed by a NUL) rather than a
/// `String` each: the registry keeps thousands of exec records, most never looked at again,
/// and a compiler's command line has dozens of arguments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecArgs(Box<str>);

impl ExecArgs {
    /// The arguments, argv[0] first.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.split_terminator('\0')
    }

    pub fn to_vec(&self) -> Vec<String> {
        self.iter().map(str::to_owned).collect()
    }
}

impl ExecArgs {
    /// The arguments as the kernel keeps them: each ended by a NUL, the last one's NUL
    /// dropped (`a\0b` is `["a", "b"]`). One allocation of the exact size, where collecting
    /// the arguments one by one grew the string and shrank it again, at every exec on the host.
    pub fn from_nul_separated(text: &str) -> Self {
        let mut joined = String::with_capacity(text.len() + 1);
        joined.push_str(text);
        joined.push('\0');
        ExecArgs(joined.into_boxed_str())
    }
}

impl<S: AsRef<str>> FromIterator<S> for ExecArgs {
    /// An argument holding a NUL ends there, as it would in the kernel's copy.
    fn from_iter<I: IntoIterator<Item = S>>(args: I) -> Self {
        let mut joined = String::new();
        for arg in args {
            let arg = arg.as_ref();
            joined.push_str(arg.split('\0').next().unwrap_or_default());
            joined.push('\0');
        }
        ExecArgs(joined.into_boxed_str())
    }
}

/// A copy of a thread's user stack, from the registers of the frame the BPF walk stopped at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StackCopy {
    pub rip: u64,
    pub rsp: u64,
    pub rbp: u64,
    /// `rip` is the interrupted instruction, not a return address.
    pub exact_pc: bool,
    /// The stack from `rsp` upward.
    pub bytes: Vec<u8>,
}

impl StackCopy {
    /// The word at `address`, if the copy holds all of it.
    pub fn read(&self, address: u64) -> Option<u64> {
        let offset = usize::try_from(address.checked_sub(self.rsp)?).ok()?;
        let word = self.bytes.get(offset..offset.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }
}

/// A Python frame as the BPF walk recorded it: enough to find and fingerprint the code object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PythonFrameRef {
    pub code_addr: u64,
    /// `f_lasti` (≤3.10) or the instruction pointer's distance from `code_addr` (3.11+).
    pub instruction: u32,
    /// The code object's fingerprint when BPF read it (`CodeIdentity::fingerprint`, 0 when
    /// unreadable): the code object read later at `code_addr` must match it to name the frame.
    pub fingerprint: u32,
    /// The first frame of its C-level `_PyEval_EvalFrameDefault` call.
    pub entry: bool,
}

/// Identity of a file on disk, independent of the path a process used to open it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    /// The identity of the file `metadata` describes.
    pub fn of(metadata: &std::fs::Metadata) -> Self {
        FileId {
            dev: metadata.dev(),
            ino: metadata.ino(),
        }
    }
}

/// `/proc/self/fd/N` of `handle`: a path that opens the very file the agent holds (good only
/// while `handle` is open).
pub fn descriptor_path(handle: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", handle.as_raw_fd()))
}

/// A file mapped by at least one process, opened by the agent when first seen so it stays
/// readable after the process exits, is deleted, or lives in another mount namespace.
#[derive(Debug)]
pub struct MappedFile {
    pub id: FileId,
    /// The path as the process sees it (from /proc/PID/maps), used in output.
    pub path: Arc<str>,
    /// A path the agent can open right now to read the file (a path in the agent's own mount
    /// namespace when it names the same file, else `/proc/self/fd/N` of `handle`).
    pub open_path: PathBuf,
    /// Lower-case hex GNU build id, when the file has one.
    pub build_id: Option<Arc<str>>,
    /// Keeps the file open for as long as any snapshot refers to it.
    pub handle: Option<File>,
}

impl MappedFile {
    /// A path that reads this file now: `open_path` while it still names this file (same
    /// device and inode), else the agent's own descriptor of it. A path can come to name
    /// another file (a rebuilt binary, an upgraded package) while processes still run the old.
    /// The descriptor path is only good while `self` lives: use it to open, not to keep.
    pub fn readable_path(&self) -> PathBuf {
        let same = std::fs::metadata(&self.open_path)
            .is_ok_and(|metadata| FileId::of(&metadata) == self.id);
        match &self.handle {
            Some(handle) if !same => descriptor_path(handle),
            _ => self.open_path.clone(),
        }
    }
}

/// One executable mapping of a process.
#[derive(Clone, Debug)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Offset in the file of `start`.
    pub file_offset: u64,
    /// `None` for anonymous or special mappings (`[vdso]`, JIT code).
    pub file: Option<Arc<MappedFile>>,
    /// Path or pseudo-name as shown in /proc/PID/maps (`[vdso]`, `[anon]` for nameless).
    pub name: Arc<str>,
}

impl Mapping {
    pub fn contains(&self, addr: u64) -> bool {
        (self.start..self.end).contains(&addr)
    }
}

/// Where a process comes from, used for series labels and `service_name`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessLabels {
    /// The inferred service name (see `process::labels` for the precedence).
    pub service_name: String,
    /// The executable path as the process sees it (empty for kernel threads).
    pub executable: String,
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
    pub systemd_unit: Option<String>,
    /// Kubernetes namespace, pod and container names (see `process::kubernetes`).
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
}

/// What the agent knows about a process, captured when its first sample arrives.
#[derive(Debug)]
pub struct ProcessInfo {
    pub pid: Pid,
    /// Start time in clock ticks since boot (/proc/PID/stat field 22): tells PID reuse apart.
    pub start_time: u64,
    /// The process name (/proc/PID/comm of the main thread).
    pub comm: Arc<str>,
    pub labels: ProcessLabels,
    /// Executable file mappings, sorted by start address.
    pub mappings: Vec<Mapping>,
    pub is_kernel_thread: bool,
}

impl ProcessInfo {
    pub fn mapping_for(&self, addr: u64) -> Option<&Mapping> {
        let idx = self.mappings.partition_point(|m| m.end <= addr);
        self.mappings.get(idx).filter(|m| m.contains(addr))
    }
}

/// A frame after unwinding, before symbolization.
#[derive(Clone, Debug)]
pub enum UnwoundFrame {
    /// A kernel address.
    Kernel(u64),
    /// A user address inside a file-backed mapping.
    User {
        addr: u64,
        file: Arc<MappedFile>,
        /// Offset of `addr` in the file.
        file_offset: u64,
        /// The mapping the address came from, for pprof's mapping table.
        mapping_start: u64,
        mapping_end: u64,
        mapping_offset: u64,
    },
    /// A user address in an anonymous or special mapping (`name`), or outside every mapping.
    UserUnmapped { addr: u64, name: Option<Arc<str>> },
    /// A Python frame, in place of the interpreter's native frame that ran it.
    Python {
        frame: PythonFrameRef,
        runtime: RuntimeHandle,
    },
}

/// The interpreter state a frame needs to be symbolized, opaque here: the runtime that unwound
/// the frame (`runtimes::python`) puts its state in and symbolization takes it out by type, so
/// the model depends on neither.
#[derive(Clone)]
pub struct RuntimeHandle(Arc<dyn std::any::Any + Send + Sync>);

impl RuntimeHandle {
    pub fn new<T: std::any::Any + Send + Sync>(runtime: Arc<T>) -> Self {
        RuntimeHandle(runtime)
    }

    /// The state, if it is a `T`.
    pub fn get<T: std::any::Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RuntimeHandle")
    }
}

/// A sample's stack after unwinding, innermost frame first.
#[derive(Clone, Debug)]
pub struct UnwoundStack {
    pub frames: Vec<UnwoundFrame>,
    /// The stack was cut short (depth limit or unwinding failure); deeper frames are missing.
    pub truncated: bool,
}

/// Where a frame's code lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    Kernel,
    Native,
    /// A Python function: `lines[0]` holds its qualified name, file and line.
    Python,
    /// A synthetic frame (the process name at the root, `[truncated]` markers).
    Synthetic,
}

/// A file-backed mapping as pprof describes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MappingInfo {
    pub start: u64,
    pub limit: u64,
    pub file_offset: u64,
    pub filename: Arc<str>,
    pub build_id: Option<Arc<str>>,
}

/// One function level of a frame. Several levels mean inlining.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FrameLine {
    /// Demangled, human-readable name; `module+0xoffset` or `[unknown]` when unsymbolized.
    pub function: Arc<str>,
    /// The raw (mangled) name, when it differs from `function`.
    pub system_name: Option<Arc<str>>,
    /// The source file, else the module path.
    pub file: Option<Arc<str>>,
    /// Source line, 0 when unknown.
    pub line: u32,
}

/// A symbolized frame: the unit that becomes one pprof Location.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SymbolizedFrame {
    pub kind: FrameKind,
    /// The address (absolute for user frames, kernel address for kernel frames, 0 for synthetic).
    pub address: u64,
    pub mapping: Option<Arc<MappingInfo>>,
    /// Innermost first; the last entry is the function the others were inlined into. Never empty.
    pub lines: Vec<FrameLine>,
    /// True when no symbol was found (the name is `module+0xoffset` or `[unknown]`).
    pub unsymbolized: bool,
}

impl SymbolizedFrame {
    /// A frame that is no code address: a marker, a kernel name, a copy direction.
    pub fn synthetic(name: &str) -> Arc<SymbolizedFrame> {
        Arc::new(SymbolizedFrame {
            kind: FrameKind::Synthetic,
            address: 0,
            mapping: None,
            lines: vec![FrameLine {
                function: name.into(),
                system_name: None,
                file: None,
                line: 0,
            }],
            unsymbolized: false,
        })
    }
}

/// A per-sample label value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelValue {
    Str(Arc<str>),
    Num(i64),
}

/// Counts of one stack with one set of per-sample labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileSample {
    /// Indexes into `Profile::frames`, innermost first.
    pub stack: Vec<u32>,
    /// The primary value, in the unit of the kind's first sample type: samples taken with this
    /// stack and these labels (CPU), launches, nanoseconds, bytes.
    pub count: u64,
    /// The values of the kind's further sample types (`ProfileKind::sample_types()[1..]`, e.g.
    /// objects allocated and memory in use); empty for kinds with one.
    pub more_values: Vec<u64>,
    pub labels: Vec<(Arc<str>, LabelValue)>,
}

/// Most values one sample of any kind carries ([`ProfileKind::sample_types`]).
pub const MAX_SAMPLE_VALUES: usize = 4;
/// The values of one sample in its kind's sample-type order; unused slots stay 0.
pub type SampleValues = [u64; MAX_SAMPLE_VALUES];

/// What a profile's values measure. Each kind is its own series in the store (`__name__`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProfileKind {
    /// CPU samples (`process_cpu`).
    #[default]
    Cpu,
    /// CUDA kernel and graph launches (count).
    CudaLaunch,
    /// Time blocked in CUDA synchronization calls (nanoseconds).
    CudaSync,
    /// Bytes copied between host and device.
    CudaMemcpy,
    /// Device memory allocated (bytes, allocations) and still in use at the window's end.
    CudaAlloc,
    /// CUDA calls that returned an error (count), labelled with the error (`cuda_error`).
    CudaError,
    /// Time threads spent blocked, switched out (nanoseconds), under the stack they blocked at.
    OffCpu,
    /// Of that, time CPython threads waited to take the GIL (nanoseconds).
    GilWait,
}

impl ProfileKind {
    pub const CUDA: [ProfileKind; 5] = [
        ProfileKind::CudaLaunch,
        ProfileKind::CudaSync,
        ProfileKind::CudaMemcpy,
        ProfileKind::CudaAlloc,
        ProfileKind::CudaError,
    ];

    /// The profile's `__name__` (Pyroscope's name for the series), also the file-name tag.
    pub fn name(self) -> &'static str {
        match self {
            ProfileKind::Cpu => "process_cpu",
            ProfileKind::CudaLaunch => "cuda_launch",
            ProfileKind::CudaSync => "cuda_sync",
            ProfileKind::CudaMemcpy => "cuda_memcpy",
            ProfileKind::CudaAlloc => "cuda_alloc",
            ProfileKind::CudaError => "cuda_errors",
            ProfileKind::OffCpu => "off_cpu",
            ProfileKind::GilWait => "gil_wait",
        }
    }

    /// pprof sample types (type, unit) of a non-CPU profile, the primary one (the value in
    /// `ProfileSample::count`, pprof's default sample type) first. Each becomes its own
    /// Pyroscope series `<name>:<type>:<unit>:<period type>:<period unit>`. `cuda_alloc` is a
    /// memory profile like Go's heap profile: bytes and objects allocated in the window, and
    /// bytes and objects still allocated at its end, by allocating stack.
    pub fn sample_types(self) -> &'static [(&'static str, &'static str)] {
        match self {
            ProfileKind::Cpu => &[("cpu", "nanoseconds")],
            ProfileKind::CudaLaunch => &[("launches", "count")],
            ProfileKind::CudaSync => &[("blocked", "nanoseconds")],
            ProfileKind::CudaMemcpy => &[("copied", "bytes")],
            ProfileKind::CudaAlloc => &[
                ("alloc_space", "bytes"),
                ("alloc_objects", "count"),
                ("inuse_space", "bytes"),
                ("inuse_objects", "count"),
            ],
            ProfileKind::CudaError => &[("errors", "count")],
            ProfileKind::OffCpu => &[("off_cpu", "nanoseconds")],
            ProfileKind::GilWait => &[("gil_wait", "nanoseconds")],
        }
    }

    /// pprof period type of a non-CPU profile: the primary sample type, except for memory
    /// (`space/bytes`, as Go heap profiles have it).
    pub fn period_type(self) -> (&'static str, &'static str) {
        match self {
            ProfileKind::CudaAlloc => ("space", "bytes"),
            other => other.sample_types()[0],
        }
    }
}

/// An aggregated profile of one series over one time window, ready to export.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    /// What the values measure; `count` of a sample is in this kind's unit.
    pub kind: ProfileKind,
    /// Series labels (`service_name`, `host`, ...), sorted by name.
    pub series_labels: Vec<(String, String)>,
    /// Window start, nanoseconds since the Unix epoch.
    pub start_unix_ns: i64,
    pub duration_ns: i64,
    /// Nanoseconds of CPU time one sample stands for (1e9 / frequency).
    pub period_ns: i64,
    pub frames: Vec<SymbolizedFrame>,
    pub samples: Vec<ProfileSample>,
}

impl Profile {
    pub fn total_samples(&self) -> u64 {
        self.samples.iter().map(|s| s.count).sum()
    }

    pub fn series_label(&self, name: &str) -> Option<&str> {
        self.series_labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A moment as the UTC calendar shows it, for names and reports (a corrupt store's file name,
/// the benchmark report's date): the one civil-from-days conversion (Howard Hinnant's
/// algorithm), instead of a date crate for two format strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UtcTime {
    pub year: i64,
    pub month: i64,
    pub day: i64,
    pub hour: i64,
    pub minute: i64,
    pub second: i64,
}

impl UtcTime {
    /// `time` in UTC; a time before 1970 counts as the epoch.
    pub fn of(time: std::time::SystemTime) -> UtcTime {
        let secs = time
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        UtcTime {
            year: yoe + era * 400 + i64::from(month <= 2),
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
        }
    }
}

/// What the kernel announced of a process's code (for library discovery, which then reads
/// only the maps that may hold a library it has not seen).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MmapChange {
    /// `pid` exec'ed at `time_ns` (CLOCK_MONOTONIC): its earlier mappings are gone.
    Exec { pid: Pid, time_ns: u64 },
    /// `pid` mapped code from `path` (as the process names it; `inode` `None` when the record
    /// carried none, as for anonymous code).
    Mapped {
        pid: Pid,
        path: Arc<str>,
        inode: Option<u64>,
    },
}

/// The announcements of processes' code since the last look ([`PipelineAccess::changed_processes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MmapChanges {
    /// In the order read.
    pub changes: Vec<MmapChange>,
    /// Every code mapping made before this time (CLOCK_MONOTONIC ns) is in `changes` or was
    /// in those of an earlier look.
    pub complete_before_ns: u64,
}

/// What a stage that takes stacks outside the CPU sampler (accelerator calls, off-CPU
/// blocks) needs from the CPU pipeline.
pub trait PipelineAccess {
    /// What the kernel announced of processes' code since the last call (`None`: unknown,
    /// announcements were lost, so any process may have changed).
    fn changed_processes(&mut self) -> Option<MmapChanges>;
    /// A process's snapshot.
    fn process(&mut self, pid: Pid) -> Option<Arc<ProcessInfo>>;
    /// Registers a process's unwind tables and interpreter now (a new user of the
    /// accelerator), so even its first calls unwind from tables.
    fn prepare_process(&mut self, pid: Pid);
    /// The symbolized stack of a sample a probe took, its walk finished as far as it goes now:
    /// frames (innermost first), the process, whether it was cut.
    fn probe_stack(
        &mut self,
        sample: &mut Sample,
    ) -> (Vec<Arc<SymbolizedFrame>>, Option<Arc<ProcessInfo>>, bool);
    /// The symbol at `address` of `pid` (a snapshot older than the address's mapping is
    /// refreshed once), or `None` when no mapping holds it.
    fn symbol_at(
        &mut self,
        pid: Pid,
        process: Option<&Arc<ProcessInfo>>,
        address: u64,
    ) -> Option<Arc<SymbolizedFrame>>;
    /// A frame that is no code address (shared, so aggregators dedupe it).
    fn synthetic(&mut self, name: &str) -> Arc<SymbolizedFrame>;
    /// Whether `pid` runs a free-threaded CPython, which has no GIL.
    fn free_threaded_python(&mut self, pid: Pid) -> bool;
}

/// One event for a profile of [`ProfileEvent::kind`]: values in the kind's sample-type order.
#[derive(Debug)]
pub struct ProfileEvent {
    pub kind: ProfileKind,
    pub process: Option<Arc<ProcessInfo>>,
    pub sample: Sample,
    /// Innermost first.
    pub frames: Vec<Arc<SymbolizedFrame>>,
    pub truncated: bool,
    pub values: SampleValues,
    /// A label of the event itself (a failed call's `cuda_error`).
    pub label: Option<(&'static str, Arc<str>)>,
}

/// CPU time the calling thread has used (wall-clock figures of a thread on a loaded host count
/// the time it waited for a CPU too).
pub fn thread_cpu_time() -> std::time::Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// CLOCK_MONOTONIC in nanoseconds, the clock of `bpf_ktime_get_ns` ([`Sample::ktime_ns`], the
/// lifecycle events, the mmap announcements).
pub fn monotonic_now_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } != 0 {
        return 0;
    }
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}
