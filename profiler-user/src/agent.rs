//! Wires the stages together for `profiler record` and `profiler agent`.
//!
//! Threads: the sample reader (ring buffer → channel, never blocks), the pipeline (this thread:
//! process snapshots, unwinding, symbolization, aggregation; it owns the !Send blazesym
//! symbolizer), and in agent mode an exporter thread so a slow output never stalls sampling.
use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crossbeam_channel::{RecvTimeoutError, TrySendError};

mod priority;

use crate::{
    aggregation::{Aggregator, AggregatorSettings, Grouping, synthetic_frame},
    bpf::{
        BpfError, EventRing, KernelPythonMaps, KernelUnwindMaps, LifecycleEvent, OffCpuRing,
        Sampler, SamplerSettings,
    },
    config::{AgentConfig, RecordConfig, SamplingConfig},
    export::{
        self, DirectorySink, ExportError, ProfileSink,
        push::{PushError, Pusher},
    },
    gpu::{
        attribution::{Accelerator, CudaAttribution},
        nvml::{GpuBoard, NvmlPoller},
    },
    model::{
        FileId, MmapChanges, Pid, PipelineAccess, ProcessInfo, Profile, ProfileEvent, ProfileKind,
        Sample, SymbolizedFrame, UnwoundFrame, UnwoundStack, monotonic_now_ns,
    },
    off_cpu::OffCpu,
    process::{
        ForkOrigin, ProcessRegistry, RegistryConfig, cgroup::in_initial_cgroup_namespace,
        files::FdBudget, mmap_events::MmapEvents,
    },
    runtimes::python::PythonTracker,
    sampling::{SampleQueue, SampleReader},
    self_metrics::{SelfMetrics, process_cpu_time, process_rss},
    server::serve::{ServeError, Serving},
    store::sink::StoreSink,
    symbolization::{Symbolizer, SymbolizerOptions},
    unwinding::{
        ProcessSource, Unwinder,
        late::{LateWalkStats, Patience, Walk, finish_walk},
        native::NativeTables,
        resolve_address, user_lookup_address,
    },
};

/// The frame added to CPU samples taken inside a CUDA synchronization call.
pub const CUDA_SYNC_FRAME: &str = "[cuda sync]";
pub use crate::gpu::attribution::STACK_NOT_SAMPLED_FRAME;

/// Samples buffered between the reader and the pipeline at most (about 10 s of 64 busy CPUs at
/// 100 Hz); the queue takes memory only for the samples in it.
const SAMPLE_QUEUE: usize = 65_536;
/// Profiles buffered between the pipeline and the exporter.
const EXPORT_QUEUE: usize = 1_024;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot write {path}: {message}")]
    OutputNotWritable { path: String, message: String },
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Push(#[from] PushError),
}

/// Sets glibc's allocator up for an agent that lives for months: a fixed threshold of 1 MiB
/// above which allocations are mapped (and given back when freed), instead of the dynamic
/// one that, once a large table was built, keeps such blocks in the heap for good; and two
/// arenas rather than one per thread. The `profiler` binary gives Rust's allocations to
/// jemalloc (main.rs), so there this serves the C code (SQLite, NVML); a program built on the
/// library with glibc's allocator gets the same settings. Call before any thread starts.
pub fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; it is called before other threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// What a finished recording produced.
#[derive(Debug)]
pub struct RecordSummary {
    pub profile: Profile,
    pub metrics: SelfMetrics,
}

impl ProcessSource for ProcessRegistry {
    fn lookup(&mut self, pid: Pid) -> Option<Arc<ProcessInfo>> {
        ProcessRegistry::lookup(self, pid)
    }

    fn refresh_for_address(&mut self, pid: Pid, addr: u64) -> Option<Arc<ProcessInfo>> {
        ProcessRegistry::refresh_for_address(self, pid, addr)
    }
}

/// Process snapshots → unwinding → symbolization → aggregation, for one sample at a time.
struct Pipeline {
    processes: ProcessRegistry,
    unwinder: Unwinder,
    native_tables: NativeTables<KernelUnwindMaps>,
    python: PythonTracker<KernelPythonMaps>,
    events: EventRing,
    symbolizer: Symbolizer,
    aggregator: Aggregator,
    samples_processed: u64,
    /// CUDA call attribution (`gpu::attribution`).
    accelerator: Option<Box<dyn Accelerator>>,
    /// Off-CPU and GIL-wait time (`off_cpu`).
    off_cpu: Option<OffCpu>,
    /// One aggregator per kind the accelerator and the off-CPU stage report.
    event_aggregators: Vec<(ProfileKind, Aggregator)>,
    /// Synthetic frames by name, shared so the aggregators dedupe them (they key by pointer).
    synthetic: std::collections::HashMap<String, Arc<SymbolizedFrame>>,
    /// Samples whose user walk waits for a table (see `unwinding::late`).
    late: LateSamples,
    /// Lifecycle events drained but not applied yet (oldest first), and the time of the
    /// newest sample handled: events apply in sample-time order.
    pending_lifecycle: std::collections::VecDeque<LifecycleEvent>,
    newest_sample_ns: u64,
    /// Events drained since the last poll, for the CUDA side (names, allocations).
    drained_since_poll: Vec<LifecycleEvent>,
    /// The buffer the lifecycle ring is drained into, kept for its capacity.
    drained: Vec<LifecycleEvent>,
    /// The pids with an exec event not applied yet: the time of the oldest, and how many.
    pending_execs: foldhash::HashMap<u32, (u64, u32)>,
    /// When the rings of events (lifecycle, mmap announcements) were last read
    /// (`bpf_ktime_get_ns` time): everything written before then is drained.
    drained_at_ns: u64,
    /// No sample is waiting in the queue (set by the pump before each poll).
    idle: bool,
}

/// How long after an event, with no sample waiting, it is taken to be past.
const LIFECYCLE_SETTLE_NS: u64 = 200_000_000;

/// How long a sample waits for the tables its late walk needs before it is cut there.
const LATE_WALK_PATIENCE: Duration = Duration::from_secs(10);
/// An event is written to its ring a moment after BPF takes its time: a sample taken within
/// this of the last read of the rings has them read again first.
const DRAIN_MARGIN_NS: u64 = 1_000_000;
/// Bytes of stack copies held at most; beyond, a new sample is finished as far as it goes.
const LATE_WALK_BYTES: usize = 16 << 20;

/// Whether a kernel function is part of an exec syscall (for [`exec_stage`]): the syscall's
/// entry (`__x64_sys_execve`, `__x64_sys_execveat` and their compat and other architectures'
/// names) or the steps below it that compilers keep as functions.
fn is_exec_function(name: &str) -> bool {
    name.contains("sys_execve")
        || [
            "do_execveat_common",
            "bprm_execve",
            "begin_new_exec",
            "kernel_execve",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

/// Where a sample's kernel stack is in an exec, for the walk of its user stack copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExecStage {
    /// Not in an exec syscall.
    Outside,
    /// Setting the exec up (opening the file, copying the arguments and environment): the
    /// address space is still the old program's, and so is the stack copy.
    BeforeNewAddressSpace,
    /// In `bprm_execve` or below, where the exec replaces the address space (or a kernel frame
    /// without a name, which could be anywhere): the copy may be the new program's stack.
    MayHaveNewAddressSpace,
}

/// Functions of an exec that run before `bprm_execve`, with the old address space.
const EXEC_SETUP_FUNCTIONS: [&str; 4] = [
    "copy_strings",
    "copy_string_kernel",
    "alloc_bprm",
    "do_open_execat",
];

/// Functions from `bprm_execve` down to where the exec replaces the address space, whichever
/// a kernel keeps as functions; any of them may be past it.
const EXEC_LOAD_FUNCTIONS: [&str; 10] = [
    "bprm_execve",
    "exec_binprm",
    "search_binary_handler",
    "load_elf_binary",
    "load_script",
    "load_misc_binary",
    "begin_new_exec",
    "exec_mmap",
    "setup_new_exec",
    "setup_arg_pages",
];

/// Whether a kernel function is the agent's own exec event program (`bpf_prog_<tag>_process_exec`
/// in kallsyms). It runs on `sched_process_exec`, once the new program is loaded, and the
/// kernel's unwinder may not get past it: a stack of it alone is an exec past its point of no
/// return.
fn is_exec_event_program(name: &str) -> bool {
    name.strip_prefix("bpf_prog_")
        .is_some_and(|rest| rest.ends_with("_process_exec"))
}

/// [`ExecStage`] of a kernel stack given its functions' names (`None`: a frame without one).
fn exec_stage<'a>(functions: impl IntoIterator<Item = Option<&'a str>>) -> ExecStage {
    let (mut in_exec, mut setting_up, mut loading) = (false, false, false);
    for function in functions {
        let Some(name) = function else {
            return ExecStage::MayHaveNewAddressSpace;
        };
        if is_exec_event_program(name) {
            return ExecStage::MayHaveNewAddressSpace;
        }
        in_exec |= is_exec_function(name);
        setting_up |= EXEC_SETUP_FUNCTIONS.iter().any(|f| name.starts_with(f));
        loading |= EXEC_LOAD_FUNCTIONS.iter().any(|f| name.starts_with(f));
    }
    match (in_exec, setting_up && !loading) {
        (false, _) => ExecStage::Outside,
        (true, true) => ExecStage::BeforeNewAddressSpace,
        (true, false) => ExecStage::MayHaveNewAddressSpace,
    }
}

/// Cuts the user addresses of a sample taken late in an exec (at
/// [`ExecStage::MayHaveNewAddressSpace`], not walked) at the first one the program before the
/// exec did not map, and says whether it cut. Once the exec has set up the new program, the
/// user registers BPF read are the new program's entry (ld.so's `_start`): that address is
/// neither the old program's nor, the exec not yet ended, known as the new one's, so it is
/// dropped and the stack ends `[truncated]` instead of in an `[unknown]` frame.
fn cut_at_new_program(sample: &mut Sample, before_exec: &ProcessInfo) -> bool {
    let first_unmapped = sample.user_ips.iter().enumerate().position(|(depth, &ip)| {
        before_exec
            .mapping_for(user_lookup_address(sample, depth, ip))
            .is_none()
    });
    match first_unmapped {
        Some(depth) => {
            sample.user_ips.truncate(depth);
            sample.user_truncated = true;
            true
        }
        None => false,
    }
}

/// After a stop signal: the samples already read are handled for at most this long (the rest
/// are dropped and counted), and held late walks wait at most this long for their tables, so
/// the agent exits well within 10 s of SIGTERM (Kubernetes gives 30) with the current
/// interval flushed. Unwind-table builds under way are cancelled.
const STOP_DRAIN_BUDGET: Duration = Duration::from_secs(2);
const STOP_LATE_WALK_PATIENCE: Duration = Duration::from_secs(2);

/// The snapshot a sample is unwound and symbolized against.
enum SnapshotOf {
    /// What the registry holds for its pid, or takes now.
    Registry,
    /// The one its late walk was finished against, for the rest of its way.
    LateWalk(Arc<ProcessInfo>),
    /// The program its process ran before the exec the sample was taken in (`None`: not
    /// known). Not registered: the exec has ended that program.
    BeforeExec(Option<Arc<ProcessInfo>>),
}

/// A snapshot chosen before the sample is unwound (`None`: no process).
struct Pinned(Option<Arc<ProcessInfo>>);

impl ProcessSource for Pinned {
    fn lookup(&mut self, _pid: Pid) -> Option<Arc<ProcessInfo>> {
        self.0.clone()
    }

    fn refresh_for_address(&mut self, _pid: Pid, _addr: u64) -> Option<Arc<ProcessInfo>> {
        self.0.clone()
    }
}

/// A sample waiting for its late walk: since when, and the snapshot it is walked against.
type Held = (Instant, Sample, Arc<ProcessInfo>, Registration);

/// Whether a held sample's snapshot is registered for BPF when its walk goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Registration {
    /// The process's current program: registered, so BPF walks its next samples itself.
    Register,
    /// The program before an exec ([`Pipeline::walks_before_exec`]): the pid runs another
    /// program now, whose samples BPF must not walk against it.
    BeforeExec,
}

impl Registration {
    /// The snapshot a sample walked against `process` is aggregated with.
    fn snapshot(self, process: Arc<ProcessInfo>) -> SnapshotOf {
        match self {
            Registration::Register => SnapshotOf::LateWalk(process),
            Registration::BeforeExec => SnapshotOf::BeforeExec(Some(process)),
        }
    }
}

/// Samples held for their late walk, oldest first, bounded by the bytes of their copies.
#[derive(Default)]
struct LateSamples {
    queue: std::collections::VecDeque<Held>,
    bytes: usize,
    /// [`NativeTables::builds_finished`] when the held samples were last walked.
    builds_finished_at_last_try: u64,
    stats: LateWalkStats,
}

impl LateSamples {
    fn hold(&mut self, sample: Sample, process: Arc<ProcessInfo>, registration: Registration) {
        self.hold_since(Instant::now(), sample, process, registration);
    }

    fn hold_since(
        &mut self,
        since: Instant,
        mut sample: Sample,
        process: Arc<ProcessInfo>,
        registration: Registration,
    ) {
        let bytes = sample.stack_copy_bytes();
        if self.bytes + bytes > LATE_WALK_BYTES {
            // Over the bound the stack is cut at the stop frame rather than memory grown; the
            // sample is still counted, at the next retry.
            self.stats.over_bound += 1;
            sample.stack_copy = None;
            sample.user_truncated = true;
            self.queue.push_back((since, sample, process, registration));
            return;
        }
        self.bytes += bytes;
        self.queue.push_back((since, sample, process, registration));
    }

    fn take(&mut self) -> Vec<Held> {
        self.bytes = 0;
        self.queue.drain(..).collect()
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Worth walking again: a table build finished since the last try, or the oldest sample's
    /// patience ran out (retrying on every batch would walk each held sample hundreds of
    /// times a second).
    fn due(&self, builds_finished: u64) -> bool {
        !self.queue.is_empty()
            && (builds_finished != self.builds_finished_at_last_try
                || self
                    .queue
                    .front()
                    .is_some_and(|(since, ..)| since.elapsed() >= LATE_WALK_PATIENCE))
    }

    fn stats(&self) -> LateWalkStats {
        LateWalkStats {
            held: self.queue.len() as u64,
            held_bytes: self.bytes as u64,
            ..self.stats
        }
    }
}

/// The BPF maps and rings the pipeline reads and writes.
struct KernelInputs {
    unwind_maps: KernelUnwindMaps,
    python_maps: KernelPythonMaps,
    events: EventRing,
    cuda: bool,
    off_cpu: Option<OffCpuRing>,
}

impl KernelInputs {
    fn from_parts(parts: crate::bpf::SamplerParts) -> (Self, crate::bpf::SampleRing) {
        (
            KernelInputs {
                unwind_maps: parts.unwind_maps,
                python_maps: parts.python_maps,
                events: parts.events,
                cuda: parts.cuda,
                off_cpu: parts.off_cpu,
            },
            parts.samples,
        )
    }
}

/// What the accelerator's attribution reaches of the pipeline (`gpu::attribution`).
impl PipelineAccess for Pipeline {
    fn changed_processes(&mut self) -> Option<MmapChanges> {
        self.processes.take_mmap_changes()
    }

    fn process(&mut self, pid: Pid) -> Option<Arc<ProcessInfo>> {
        self.processes.lookup(pid)
    }

    fn prepare_process(&mut self, pid: Pid) {
        if let Some(process) = self.processes.lookup(pid) {
            self.native_tables.sync(&process);
            self.python.sync(&process);
        }
    }

    fn probe_stack(
        &mut self,
        sample: &mut Sample,
    ) -> (Vec<Arc<SymbolizedFrame>>, Option<Arc<ProcessInfo>>, bool) {
        let pinned = if sample.stack_copy.is_some() {
            let process = self.processes.lookup(sample.pid);
            let process = process.map(|process| self.snapshot_for_copy(sample, process));
            match process {
                Some(mut process) => {
                    self.finish_late_walk(
                        sample,
                        &mut process,
                        Patience::GiveUp,
                        Registration::Register,
                    );
                    SnapshotOf::LateWalk(process)
                }
                None => {
                    sample.stack_copy = None;
                    sample.user_truncated = true;
                    SnapshotOf::Registry
                }
            }
        } else {
            SnapshotOf::Registry
        };
        self.symbolized_stack(sample, pinned)
    }

    fn symbol_at(
        &mut self,
        pid: Pid,
        process: Option<&Arc<ProcessInfo>>,
        address: u64,
    ) -> Option<Arc<SymbolizedFrame>> {
        // A snapshot older than the address's mapping (dlopen) is refreshed once.
        let process = match process {
            Some(p) if p.mapping_for(address).is_some() => Some(p.clone()),
            _ => self
                .processes
                .refresh_for_address(pid, address)
                .filter(|p| p.mapping_for(address).is_some()),
        }?;
        Some(
            self.symbolizer
                .symbolize(&resolve_address(&process, address)),
        )
    }

    fn synthetic(&mut self, name: &str) -> Arc<SymbolizedFrame> {
        Pipeline::synthetic(self, name)
    }

    fn free_threaded_python(&mut self, pid: Pid) -> bool {
        self.python.is_free_threaded(pid)
    }
}

impl Pipeline {
    fn new(
        grouping: Grouping,
        sampling: &SamplingConfig,
        start_unix_ns: i64,
        kernel: KernelInputs,
        gpus: Option<Arc<GpuBoard>>,
    ) -> Self {
        let host = hostname();
        let aggregator_settings = |kind| AggregatorSettings {
            grouping,
            period_ns: sampling.period_ns(),
            host: host.clone(),
            max_thread_names: 64,
            kind,
            gpus: gpus.clone(),
        };
        let KernelInputs {
            unwind_maps,
            python_maps,
            events,
            cuda,
            off_cpu,
        } = kernel;
        let mut processes = ProcessRegistry::new("/proc".into(), host.clone());
        if events.tracks_cgroup_changes() {
            processes.track_cgroup_changes(in_initial_cgroup_namespace());
        }
        match aya::util::online_cpus()
            .map_err(|(_, error)| error)
            .and_then(|cpus| MmapEvents::open(&cpus))
        {
            Ok(events) => processes.watch_mmaps(events),
            Err(error) => tracing::warn!(
                "the kernel's mmap announcements are unavailable ({error}): the libraries of \
                 processes that exit before /proc is read stay [unknown]"
            ),
        }
        // With the announcements, a CUDA scan reads only the maps of processes that changed.
        let watch_changes = cuda && processes.track_mmap_changes();
        let accelerator: Option<Box<dyn Accelerator>> =
            cuda.then(|| Box::new(CudaAttribution::new(watch_changes)) as Box<dyn Accelerator>);
        let off_cpu = off_cpu
            .zip(sampling.off_cpu)
            .map(|(ring, settings)| OffCpu::new(ring, settings));
        let accelerator_kinds = accelerator.as_ref().map_or(&[][..], |a| a.kinds());
        let off_cpu_kinds = off_cpu.as_ref().map_or(&[][..], OffCpu::kinds);
        let event_aggregators = accelerator_kinds
            .iter()
            .chain(off_cpu_kinds)
            .map(|&kind| {
                (
                    kind,
                    Aggregator::new(aggregator_settings(kind), start_unix_ns),
                )
            })
            .collect();
        Pipeline {
            processes,
            unwinder: Unwinder::default(),
            native_tables: NativeTables::new(unwind_maps, sampling.cache_dir.as_deref()),
            python: PythonTracker::new(python_maps, "/proc".into(), sampling.python_frames),
            events,
            symbolizer: Symbolizer::new(SymbolizerOptions {
                source_lines: sampling.source_lines,
                ..SymbolizerOptions::default()
            }),
            aggregator: Aggregator::new(aggregator_settings(ProfileKind::Cpu), start_unix_ns),
            samples_processed: 0,
            accelerator,
            off_cpu,
            event_aggregators,
            synthetic: std::collections::HashMap::new(),
            late: LateSamples::default(),
            pending_lifecycle: std::collections::VecDeque::new(),
            newest_sample_ns: 0,
            drained_since_poll: Vec::new(),
            drained: Vec::new(),
            drained_at_ns: 0,
            pending_execs: foldhash::HashMap::default(),
            idle: false,
        }
    }

    fn synthetic(&mut self, name: &str) -> Arc<SymbolizedFrame> {
        if let Some(frame) = self.synthetic.get(name) {
            return frame.clone();
        }
        if self.synthetic.len() > 100_000 {
            self.synthetic.clear();
        }
        let frame = synthetic_frame(name);
        self.synthetic.insert(name.to_string(), frame.clone());
        frame
    }

    /// A CPU sample from the ring buffer. One whose user walk BPF left to the agent is finished
    /// first, or held until the tables it needs are in.
    fn handle(&mut self, mut sample: Sample) {
        self.newest_sample_ns = self.newest_sample_ns.max(sample.ktime_ns);
        // The exec, fork and mmaps of the sampled process happened before the sample: they are
        // in the rings unless the sample is newer than their last read. Without this, a sample
        // read while the batch is handled (the reader runs meanwhile) of a process that has
        // exited is given its parent's identity, or its program without its libraries.
        if sample.ktime_ns.saturating_add(DRAIN_MARGIN_NS) > self.drained_at_ns {
            self.drain_events();
        }
        self.apply_lifecycle(sample.ktime_ns);
        if let Some(before) = self.before_exec(&sample) {
            let process = match before {
                Some(process) if self.walks_before_exec(&sample) => process,
                before => {
                    // In the exec, or the old program unknown: the copy is not walked.
                    if sample.stack_copy.take().is_some() {
                        sample.user_truncated = true;
                    }
                    if let Some(old) = &before
                        && self.exec_stage(&sample) == ExecStage::MayHaveNewAddressSpace
                        && cut_at_new_program(&mut sample, old)
                    {
                        self.late.stats.in_exec_new_program_cut += 1;
                    }
                    return self.handle_unwound(&sample, SnapshotOf::BeforeExec(before));
                }
            };
            return self.walk_or_hold(sample, process, Registration::BeforeExec);
        }
        if sample.stack_copy.is_none() {
            return self.handle_unwound(&sample, SnapshotOf::Registry);
        }
        let Some(process) = self.processes.lookup(sample.pid) else {
            // Gone before its mappings were read: nothing to unwind against.
            sample.stack_copy = None;
            sample.user_truncated = true;
            self.late.stats.no_process += 1;
            return self.handle_unwound(&sample, SnapshotOf::Registry);
        };
        let process = self.snapshot_for_copy(&sample, process);
        self.walk_or_hold(sample, process, Registration::Register);
    }

    /// Finishes the walk of a sample's stack copy against `process` and aggregates it, or
    /// holds it until the tables it needs are in. The snapshot goes with a held sample: by the
    /// time the walk finishes the process may have exec'ed another program.
    fn walk_or_hold(
        &mut self,
        mut sample: Sample,
        mut process: Arc<ProcessInfo>,
        registration: Registration,
    ) {
        if registration == Registration::Register {
            // The one count of this sample towards its process's registration: its walk and
            // its frames after only keep the registration current.
            self.native_tables.sync(&process);
        }
        match self.finish_late_walk(&mut sample, &mut process, Patience::Wait, registration) {
            Walk::Done => self.handle_unwound(&sample, registration.snapshot(process)),
            Walk::Pending => self.late.hold(sample, process, registration),
        }
    }

    /// Whether the stack copy of a sample taken before its process's exec event is walked,
    /// against the program before the exec (never registered: the pid runs another program
    /// now). Taken before the exec syscall (a fork child still in its parent's code), or in
    /// it before the exec replaces the address space (copying the arguments), the copy is the
    /// old program's stack. Taken later in the syscall it is not walked: the user registers
    /// are still the old program's, but once the exec has replaced the address space the
    /// stack read is the new program's, so the stack ends there, marked truncated.
    fn walks_before_exec(&mut self, sample: &Sample) -> bool {
        if sample.stack_copy.is_none() {
            return false;
        }
        if self.exec_stage(sample) == ExecStage::MayHaveNewAddressSpace {
            self.late.stats.in_exec_not_walked += 1;
            return false;
        }
        true
    }

    /// Where the sample's kernel stack is in an exec, by its functions' names (the lookups
    /// are the symbolizer's, cached for the stack's own symbolization).
    fn exec_stage(&mut self, sample: &Sample) -> ExecStage {
        let kernel_frames: Vec<_> = sample
            .kernel_ips
            .iter()
            .map(|&address| UnwoundFrame::Kernel(address))
            .collect();
        let frames = self.symbolizer.symbolize_frames(&kernel_frames);
        exec_stage(frames.iter().flat_map(|frame| {
            let unnamed = (frame.unsymbolized || frame.lines.is_empty()).then_some(None);
            unnamed
                .into_iter()
                .chain(frame.lines.iter().map(|line| Some(line.function.as_ref())))
        }))
    }

    /// The snapshot to finish a stack copy's walk against: `process`, or a fresh one when the
    /// copy starts in code it does not map (BPF stopped at a library loaded since the snapshot;
    /// the refresh also registers the library, so BPF walks it from then on).
    fn snapshot_for_copy(
        &mut self,
        sample: &Sample,
        process: Arc<ProcessInfo>,
    ) -> Arc<ProcessInfo> {
        let Some(copy) = sample.stack_copy.as_deref() else {
            return process;
        };
        // A return address points after its call.
        let pc = if copy.exact_pc {
            copy.rip
        } else {
            copy.rip.wrapping_sub(1)
        };
        if !sample.user_unknown_mapping || process.mapping_for(pc).is_some() {
            return process;
        }
        self.processes
            .refresh_for_address(sample.pid, pc)
            .unwrap_or(process)
    }

    /// Finishes the walk of a sample BPF stopped against `process`: registers it (so BPF
    /// unwinds its next samples itself) and goes on from the stack copy.
    fn finish_late_walk(
        &mut self,
        sample: &mut Sample,
        process: &mut Arc<ProcessInfo>,
        patience: Patience,
        registration: Registration,
    ) -> Walk {
        if registration == Registration::Register {
            self.native_tables.resync(process);
        }
        let pid = sample.pid;
        let walked_against = Arc::clone(process);
        let processes = &mut self.processes;
        // Against the program before an exec, /proc shows another program: no refresh.
        let mut refresh = |address: u64| match registration {
            Registration::Register => processes.refresh_for_address(pid, address),
            Registration::BeforeExec => None,
        };
        let walk = finish_walk(
            sample,
            process,
            &mut self.native_tables,
            patience,
            &mut refresh,
        );
        if !Arc::ptr_eq(&walked_against, process) {
            self.late.stats.refreshed_mid_walk += 1;
            // Registered too, so BPF walks the library from the next sample on.
            self.native_tables.resync(process);
        }
        if walk == Walk::Done {
            self.late.stats.finished += 1;
            if registration == Registration::BeforeExec {
                self.late.stats.before_exec_walked += 1;
            }
            if patience == Patience::GiveUp && sample.user_truncated {
                self.late.stats.gave_up += 1;
            }
        }
        walk
    }

    /// At the end: the tables held samples wait for are awaited (for at most `patience`)
    /// before every walk is finished as far as it goes, so the last seconds of a short run are
    /// not cut where a busy builder was slow.
    fn settle_late_walks(&mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        loop {
            self.retry_late_walks(false);
            if self.late.is_empty() || !self.native_tables.building() {
                break;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            if !self.native_tables.wait_for_build(left) {
                break;
            }
        }
        self.retry_late_walks(true);
    }

    /// Retries the held samples (their tables may be in now); those held past
    /// [`LATE_WALK_PATIENCE`], or all of them with `give_up`, are finished as far as they go.
    fn retry_late_walks(&mut self, give_up: bool) {
        let builds_finished = self.native_tables.builds_finished();
        if !give_up && !self.late.due(builds_finished) {
            return;
        }
        self.late.builds_finished_at_last_try = builds_finished;
        for (held_since, mut sample, mut process, registration) in self.late.take() {
            let patience = if give_up || held_since.elapsed() >= LATE_WALK_PATIENCE {
                Patience::GiveUp
            } else {
                Patience::Wait
            };
            match self.finish_late_walk(&mut sample, &mut process, patience, registration) {
                Walk::Done => self.handle_unwound(&sample, registration.snapshot(process)),
                Walk::Pending => self
                    .late
                    .hold_since(held_since, sample, process, registration),
            }
        }
    }

    /// Aggregates a sample whose user walk is final, against `snapshot`.
    fn handle_unwound(&mut self, sample: &Sample, snapshot: SnapshotOf) {
        let (frames, process, truncated) = self.symbolized_stack(sample, snapshot);
        let mut frames = frames;
        if sample.in_cuda_sync {
            frames.insert(0, self.synthetic(CUDA_SYNC_FRAME));
        }
        self.aggregator
            .add(process.as_ref(), sample, &frames, truncated);
        self.samples_processed += 1;
    }

    /// Unwinds, interleaves Python frames and symbolizes one sample's stack.
    fn symbolized_stack(
        &mut self,
        sample: &Sample,
        snapshot: SnapshotOf,
    ) -> (Vec<Arc<SymbolizedFrame>>, Option<Arc<ProcessInfo>>, bool) {
        let register = !matches!(snapshot, SnapshotOf::BeforeExec(_));
        // A late walk's sample counted towards the registration when its walk began.
        let counted = matches!(snapshot, SnapshotOf::LateWalk(_));
        let (mut stack, process) = match snapshot {
            SnapshotOf::Registry => self.unwinder.unwind(sample, &mut self.processes),
            SnapshotOf::LateWalk(process) => {
                self.unwinder.unwind(sample, &mut Pinned(Some(process)))
            }
            SnapshotOf::BeforeExec(process) => self.unwinder.unwind(sample, &mut Pinned(process)),
        };
        if let Some(process) = process.as_ref().filter(|_| register) {
            // A process sampled REGISTER_AT_SAMPLE times (or a registered one's new snapshot
            // after a dlopen) has its mappings registered, so BPF unwinds its next samples
            // from the tables.
            if counted {
                self.native_tables.resync(process);
            } else {
                self.native_tables.sync(process);
            }
            self.check_table_use(sample, &mut stack);
            self.python.sync(process);
        }
        self.python.interleave(sample, &mut stack);
        let frames = self.symbolizer.symbolize_stack(&stack);
        (frames, process, stack.truncated)
    }

    /// Tells the table manager which files this sample's frames ran in (up to the first frame
    /// unwound without its table, beyond which the frames may be guesses) and asks for that
    /// frame's table. When that frame's file has CFI (its table was only not in the maps yet),
    /// the callers BPF found from RBP are guesses in code that does not keep frame pointers:
    /// they are dropped and the stack is marked truncated, never shown as if complete.
    fn check_table_use(&mut self, sample: &Sample, stack: &mut UnwoundStack) {
        let kernel = sample.kernel_ips.len();
        let user = stack.frames.get(kernel..).unwrap_or_default();
        let exact = sample.fallback_frame.map_or(user.len(), |k| k + 1);
        let mut previous: Option<FileId> = None;
        for frame in user.iter().take(exact) {
            if let UnwoundFrame::User { file, .. } = frame
                && previous != Some(file.id)
            {
                previous = Some(file.id);
                self.native_tables.touch(file);
            }
        }
        let Some(k) = sample.fallback_frame else {
            return;
        };
        let guessed = match user.get(k) {
            Some(UnwoundFrame::User { file, .. }) => {
                let file = file.clone();
                self.native_tables.demand(&file);
                self.native_tables.has_cfi(&file)
            }
            // A file mapped after the snapshot (dlopen): its table is unknown too.
            Some(UnwoundFrame::UserUnmapped { name: None, .. }) => true,
            _ => false,
        };
        if guessed && user.len() > k + 1 {
            stack.frames.truncate(kernel + k + 1);
            stack.truncated = true;
            self.unwinder.stats.guessed_callers_dropped += 1;
        }
    }

    /// Follows exits and execs, finds new CUDA libraries (attaching their probes) and turns the
    /// probes' records into CUDA profile events.
    ///
    /// The lifecycle events are drained before the CUDA ring: a process's records are written
    /// before its exit (or exec) is, so every record it made before is then in this batch and
    /// is handled, with the process's kernel names and mappings, before the process is
    /// forgotten.
    ///
    /// The other stages see a lifecycle event only once the samples taken before it are
    /// handled ([`Self::apply_lifecycle`]): a process's last samples are still its program's,
    /// and its exec or fork event is known before its first samples are.
    fn poll(&mut self, sampler: Option<&mut Sampler>) {
        self.symbolizer.release_file_pages_when_grown();
        self.native_tables.poll_builds();
        self.retry_late_walks(false);
        self.drain_events();
        let lifecycle = std::mem::take(&mut self.drained_since_poll);
        self.poll_accelerator(sampler, &lifecycle);
        self.poll_off_cpu();
        // With no sample waiting, everything up to a moment ago is past.
        let horizon = if self.idle {
            monotonic_now_ns().saturating_sub(LIFECYCLE_SETTLE_NS)
        } else {
            0
        };
        self.apply_lifecycle(horizon.max(self.newest_sample_ns));
    }

    /// Takes the lifecycle events and the mmap announcements out of their rings. Called at each
    /// poll and before a sample taken since the last call: every event that happened before a
    /// sample is then known when the sample is handled.
    fn drain_events(&mut self) {
        self.drained_at_ns = monotonic_now_ns();
        self.processes.drain_mmaps();
        let mut drained = std::mem::take(&mut self.drained);
        self.events.drain_into(&mut drained);
        if drained.is_empty() {
            self.drained = drained;
            return;
        }
        if self.accelerator.is_some() {
            self.drained_since_poll.extend(drained.iter().cloned());
        }
        for event in &drained {
            match event {
                LifecycleEvent::Execed { pid, ktime_ns, .. } => {
                    let pending = self.pending_execs.entry(*pid).or_insert((*ktime_ns, 0));
                    pending.0 = pending.0.min(*ktime_ns);
                    pending.1 += 1;
                }
                // Read after the mmap announcements: an exec announced for a pid after one of
                // these is another process's.
                LifecycleEvent::Exited { pid, ktime_ns } => {
                    self.processes.note_exit_read(Pid(*pid), *ktime_ns);
                }
                LifecycleEvent::Forked { pid, ktime_ns, .. } => {
                    self.processes.note_fork_read(Pid(*pid), *ktime_ns);
                }
                LifecycleEvent::CgroupChanged {
                    pid,
                    ktime_ns,
                    destination,
                } => {
                    self.processes.note_cgroup_change(
                        pid.map(Pid),
                        *ktime_ns,
                        destination.as_deref(),
                    );
                }
            }
        }
        self.pending_lifecycle.extend(drained.drain(..));
        self.drained = drained;
    }

    /// When the sample was taken in an exec of its process (before the exec's event): the
    /// snapshot of the program the process ran until then (`Some(None)`: not known). /proc
    /// shows the new program by now, but the sample is of the old.
    fn before_exec(&mut self, sample: &Sample) -> Option<Option<Arc<ProcessInfo>>> {
        let first_lookup = !self.processes.has_snapshot(sample.pid);
        if first_lookup {
            // A snapshot is about to be read from /proc: an exec that ended before that read
            // is to be known first.
            self.drain_events();
        }
        let exec_ns = match self.pending_execs.get(&sample.pid.0) {
            Some(&(exec_ns, _)) if exec_ns > sample.ktime_ns => exec_ns,
            // Or applied already, when the sample is handled after samples taken since.
            _ => match self.processes.exec_after(sample.pid, sample.ktime_ns) {
                Some(exec_ns) => exec_ns,
                None if first_lookup => {
                    // Or during the read of /proc, which then shows the new program: the
                    // kernel announced that exec before mapping it.
                    self.processes.lookup(sample.pid);
                    self.drain_events();
                    let exec_ns = self.processes.exec_since(sample.pid, sample.ktime_ns)?;
                    self.late.stats.exec_during_first_lookup += 1;
                    exec_ns
                }
                None => return None,
            },
        };
        Some(
            self.processes
                .snapshot_before_exec(sample.pid, sample.ktime_ns, exec_ns),
        )
    }

    /// An exec event of `pid` is applied: the next pending one, if any, becomes the oldest.
    fn exec_applied(&mut self, pid: u32) {
        let Some((_, count)) = self.pending_execs.get(&pid).copied() else {
            return;
        };
        if count <= 1 {
            self.pending_execs.remove(&pid);
            return;
        }
        let next = self
            .pending_lifecycle
            .iter()
            .filter_map(|event| match event {
                LifecycleEvent::Execed {
                    pid: other,
                    ktime_ns,
                    ..
                } if *other == pid => Some(*ktime_ns),
                _ => None,
            })
            .min();
        match next {
            Some(next) => {
                self.pending_execs.insert(pid, (next, count - 1));
            }
            None => {
                self.pending_execs.remove(&pid);
            }
        }
    }

    /// Applies the lifecycle events that happened before `until_ns` (`bpf_ktime_get_ns` time).
    fn apply_lifecycle(&mut self, until_ns: u64) {
        while self
            .pending_lifecycle
            .front()
            .is_some_and(|event| event.ktime_ns() <= until_ns)
        {
            let Some(event) = self.pending_lifecycle.pop_front() else {
                break;
            };
            match event {
                LifecycleEvent::Exited { pid, ktime_ns } => {
                    self.processes.record_exit(Pid(pid), ktime_ns);
                    self.native_tables.unregister(Pid(pid));
                    self.python.forget(Pid(pid));
                    self.symbolizer.forget_process(Pid(pid));
                }
                LifecycleEvent::Execed { pid, program, .. } => {
                    self.exec_applied(pid);
                    // A new program: its next sample takes a new snapshot and registration.
                    self.native_tables.unregister(Pid(pid));
                    self.python.forget(Pid(pid));
                    self.symbolizer.forget_process(Pid(pid));
                    self.processes.forget(Pid(pid));
                    if let Some(program) = program {
                        self.processes.record_exec(Pid(pid), program);
                    }
                }
                LifecycleEvent::Forked {
                    pid,
                    parent,
                    parent_tid,
                    parent_cgroup_id,
                    ktime_ns,
                } => {
                    let origin = ForkOrigin {
                        forked_ns: ktime_ns,
                        parent_tid,
                        parent_cgroup_id,
                    };
                    self.processes.record_fork(Pid(pid), Pid(parent), origin);
                }
                // Noted as read from the ring (see `drain_events`); applied now, in order with
                // the forks that inherit the cgroups.
                LifecycleEvent::CgroupChanged {
                    pid: Some(pid),
                    ktime_ns,
                    destination,
                } => {
                    self.processes
                        .apply_cgroup_move(Pid(pid), ktime_ns, destination.as_deref());
                }
                LifecycleEvent::CgroupChanged { pid: None, .. } => {}
            }
        }
    }

    /// Finds new accelerator libraries and aggregates the events of the calls made since.
    fn poll_accelerator(&mut self, sampler: Option<&mut Sampler>, lifecycle: &[LifecycleEvent]) {
        let Some(mut accelerator) = self.accelerator.take() else {
            return;
        };
        let mut events = Vec::new();
        if accelerator.poll(self, sampler, lifecycle, &mut events) {
            self.accelerator = Some(accelerator);
        }
        self.aggregate_events(events);
    }

    /// Pairs the off-CPU records in since the last poll and aggregates the finished blocks.
    fn poll_off_cpu(&mut self) {
        let Some(mut off_cpu) = self.off_cpu.take() else {
            return;
        };
        let mut events = Vec::new();
        off_cpu.poll(self, &mut events);
        self.off_cpu = Some(off_cpu);
        self.aggregate_events(events);
    }

    fn aggregate_events(&mut self, events: Vec<ProfileEvent>) {
        for event in events {
            if let Some((_, aggregator)) = self
                .event_aggregators
                .iter_mut()
                .find(|(kind, _)| *kind == event.kind)
            {
                aggregator.add_labelled_values(
                    event.process.as_ref(),
                    &event.sample,
                    &event.frames,
                    event.truncated,
                    &event.values,
                    event.label,
                );
            }
        }
    }

    /// Ends the window of every profile kind; the accelerator adds what is still held at the
    /// end (device memory in use, as `inuse_*` values of `cuda_alloc`).
    fn flush(&mut self, end_unix_ns: i64) -> Vec<Profile> {
        let mut profiles = self.aggregator.flush(end_unix_ns);
        // Blocks that ended by now count in this window.
        self.poll_off_cpu();
        let mut accelerator = self.accelerator.take();
        if let Some(accelerator) = &mut accelerator {
            // The calls made up to the window's end are counted in it, those after in the next.
            let ago = u64::try_from(unix_now_ns().saturating_sub(end_unix_ns)).unwrap_or(0);
            accelerator.end_window_at(monotonic_now_ns().saturating_sub(ago));
            let mut events = Vec::new();
            accelerator.finish_window(self, &mut events);
            self.aggregate_events(events);
        }
        for (_, aggregator) in &mut self.event_aggregators {
            profiles.extend(aggregator.flush(end_unix_ns));
        }
        if let Some(accelerator) = &mut accelerator {
            let mut events = Vec::new();
            accelerator.start_window(self, &mut events);
            self.aggregate_events(events);
        }
        self.accelerator = accelerator;
        profiles
    }

    /// Accelerator calls made after `end_ns` (`bpf_ktime_get_ns` time) are left out of the
    /// current window (kept for the next one); an earlier end already set stands.
    fn end_accelerator_window_at(&mut self, end_ns: u64) {
        if let Some(accelerator) = &mut self.accelerator {
            accelerator.end_window_at(end_ns);
        }
    }

    /// Before sampling starts: reads the kernel's symbols (a one-time cost that would otherwise
    /// land on whichever sample first has a kernel frame) and registers the given processes, so
    /// even their first samples are unwound from tables.
    fn prepare(&mut self, pids: &[u32]) {
        self.symbolizer.load_kernel_symbols();
        for &pid in pids {
            if let Some(process) = self.processes.lookup(Pid(pid)) {
                self.native_tables
                    .sync_waiting(&process, Duration::from_secs(10));
                self.python.sync(&process);
            }
        }
    }

    fn metrics(&self, sampler: Option<&Sampler>, reader: Option<&SampleReader>) -> SelfMetrics {
        let symbols = self.symbolizer.stats();
        let registry = self.processes.stats();
        let (rss, peak) = process_rss();
        let mut metrics = SelfMetrics {
            samples_processed: self.samples_processed,
            truncated_stacks: self.unwinder.stats.truncated_stacks
                + self.python.stats().truncated_stacks,
            unmapped_frames: self.unwinder.stats.unmapped_frames,
            unknown_processes: self.unwinder.stats.unknown_processes,
            frames_symbolized: symbols.frames_symbolized,
            symbolization_misses: symbols.misses,
            symbolization_misses_by_function: symbols.named_by_function_start,
            symbolization_errors: symbols.errors,
            symbol_cache_entries: symbols.cache_entries as u64,
            symbol_cache_evicted: symbols.cache_evicted,
            symbol_lookups: symbols.native_lookups,
            symbol_lookup_time: symbols.native_lookup_time,
            symbol_lookup_cpu_time: symbols.native_lookup_cpu_time,
            symbol_file_loads: symbols.file_loads,
            symbol_file_load_time: symbols.file_load_time,
            symbol_function_start_time: symbols.function_start_time,
            symbol_files: symbols.resolvers as u64,
            symbol_file_bytes: symbols.resolver_bytes,
            symbol_file_page_releases: symbols.file_page_releases,
            symbol_files_dropped: symbols.resolvers_dropped,
            python_code_objects: symbols.python_code_entries as u64,
            symbol_function_names: symbols.function_names as u64,
            symbol_function_name_hits: symbols.function_name_hits,
            symbol_kernel_functions: symbols.kernel_functions as u64,
            symbol_kernel_function_hits: symbols.kernel_function_hits,
            symbol_function_ranges: symbols.function_ranges as u64,
            symbol_function_range_hits: symbols.function_range_hits,
            symbol_function_ranges_cleared: symbols.function_ranges_cleared,
            symbol_interned_strings: symbols.interned_strings as u64,
            exec_environments: self.events.environments().len() as u64,
            exec_environments_reused: self.events.environments().hits(),
            processes_tracked: self.processes.len() as u64,
            open_files: registry.open_files,
            process_snapshots_from_events: registry.snapshots_from_events,
            process_exits_known_at_lookup: registry.exits_known_at_lookup,
            process_exits_ahead: registry.exits_ahead,
            process_snapshots_before_exec: registry.snapshots_before_exec,
            process_parents_gone_since_fork: registry.parents_gone_since_fork,
            process_parents_from_fork_time: registry.parents_from_fork_time,
            process_identities: registry.identities,
            process_exited_identities: registry.exited_identities,
            process_identities_expired: registry.identities_expired,
            cgroup_paths: registry.cgroup_paths,
            cgroup_texts: registry.cgroup_texts,
            cgroup_texts_reused: registry.cgroup_texts_reused,
            process_cgroups_from_fork: registry.cgroups_from_fork,
            process_cgroups_from_moves: registry.cgroups_from_moves,
            cgroup_moves: registry.cgroup_moves,
            executable_paths: registry.executable_paths,
            process_snapshots_from_announced_mmaps: registry.snapshots_from_announced_mmaps,
            process_maps_from_announcements: registry.maps_from_announcements,
            process_cmdlines_from_exec: registry.cmdlines_from_exec,
            process_identities_from_exec: registry.identities_from_exec,
            process_snapshots: registry.snapshots_taken,
            process_refreshes: registry.refreshes,
            process_refreshes_announced: registry.refreshes_announced,
            process_refreshes_from_announcements: registry.refreshes_from_announcements,
            announced_mmaps: self.processes.mmap_stats().unwrap_or_default(),
            agent_cpu: process_cpu_time(),
            agent_rss_bytes: rss,
            agent_peak_rss_bytes: peak,
            heap: crate::self_metrics::heap_stats(),
            native_tables: self.native_tables.stats(),
            python: self.python.stats(),
            late_walks: self.late.stats(),
            guessed_callers_dropped: self.unwinder.stats.guessed_callers_dropped,
            ..SelfMetrics::default()
        };
        if let Some(sampler) = sampler {
            metrics.bpf = sampler.stats();
            (metrics.bpf_run_time_ns, metrics.bpf_run_count) = sampler.program_run_stats();
            (metrics.pid_filter_entries, metrics.pid_filter_capacity) = sampler.pid_filter_fill();
            (metrics.off_cpu_run_time_ns, metrics.off_cpu_run_count) = sampler.off_cpu_run_stats();
        }
        if let Some(off_cpu) = &self.off_cpu {
            metrics.off_cpu = off_cpu.stats();
        }
        if let Some(reader) = reader {
            add_reader_counts(&mut metrics, reader.stats.counts());
        }
        if let Some(accelerator) = &self.accelerator {
            let stats = accelerator.stats();
            metrics.cuda = stats.discovery;
            metrics.cuda_decode_errors = stats.decode_errors;
            metrics.cuda_names = stats.names;
            metrics.cuda_allocations = stats.allocations;
            metrics.cuda_call_stacks = stats.call_stacks;
            metrics.cuda_failed_calls = stats.failed_calls;
        }
        metrics
    }
}

/// The sample reader's counters into the self-metrics (stages expose their counts; only the
/// agent, at the top, writes them into [`SelfMetrics`]).
fn add_reader_counts(metrics: &mut SelfMetrics, counts: crate::sampling::ReaderCounts) {
    metrics.samples_received = counts.received;
    metrics.decode_errors = counts.decode_errors;
    metrics.agent_queue_full = counts.channel_full;
    metrics.stack_copies_shed = counts.copies_shed;
}

fn sampler_settings(sampling: &SamplingConfig) -> SamplerSettings {
    SamplerSettings {
        frequency_hz: sampling.frequency_hz,
        pids: sampling.pids.clone(),
        unwind_table_bytes: sampling.unwind_table_bytes,
        cuda: sampling.gpu.enabled,
        cuda_stacks_per_second: sampling.gpu.cuda_stacks_per_second,
        off_cpu_probability: sampling.off_cpu.map(|settings| settings.probability),
    }
}

fn unix_now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn check_pids_exist(pids: &[u32]) -> Result<(), AgentError> {
    match pids
        .iter()
        .find(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    {
        Some(&pid) => Err(AgentError::NoSuchProcess(pid)),
        None => Ok(()),
    }
}

/// Where `profiler record` writes a non-CPU profile: beside the CPU one, as
/// `<stem>.<kind>.<extension>` (`profile.pb.gz` → `profile.cuda_launch.pb.gz`).
pub fn sibling_path(
    output: &Path,
    kind: ProfileKind,
    format: export::OutputFormat,
) -> std::path::PathBuf {
    let extension = format.file_extension();
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name
        .strip_suffix(&format!(".{extension}"))
        .unwrap_or(&name)
        .to_string();
    output.with_file_name(format!("{stem}.{}.{extension}", kind.name()))
}

/// Fails early, before sampling, when `path` cannot be created.
fn check_writable_file(path: &Path) -> Result<(), AgentError> {
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let probe = dir.join(format!(
        ".{}.probe-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let not_writable = |err: std::io::Error| AgentError::OutputNotWritable {
        path: path.display().to_string(),
        message: err.to_string(),
    };
    if path.is_dir() {
        return Err(not_writable(std::io::Error::from(
            std::io::ErrorKind::IsADirectory,
        )));
    }
    std::fs::File::create(&probe).map_err(not_writable)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn check_writable_dir(dir: &Path) -> Result<(), AgentError> {
    let not_writable = |err: std::io::Error| AgentError::OutputNotWritable {
        path: dir.display().to_string(),
        message: err.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(not_writable)?;
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(not_writable)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Runs the pipeline on samples from `rx` until `until` returns true; calls `until` about
/// every 100 ms with the pipeline so the caller can poll the other inputs and flush. A batch
/// is cut short once `stop` is set (a batch of new processes' samples can take seconds); the
/// samples left are for the stop's own bounded drain.
fn pump(
    pipeline: &mut Pipeline,
    rx: &SampleQueue,
    stop: &AtomicBool,
    mut until: impl FnMut(&mut Pipeline) -> bool,
) {
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(sample) => {
                pipeline.handle(sample);
                // Drain whatever else is queued before checking the clock again.
                for (index, sample) in rx.try_iter().take(4096).enumerate() {
                    pipeline.handle(sample);
                    if index % 64 == 63 && stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        pipeline.idle = rx.is_empty();
        if until(pipeline) {
            return;
        }
    }
}

/// Handles the samples already read, for at most `budget`; the samples left are dropped (and
/// returned as a count), so a deep queue on a busy host cannot hold up the stop.
fn drain_queue(
    pipeline: &mut Pipeline,
    rx: &SampleQueue,
    budget: Duration,
    taken_until_ns: u64,
) -> u64 {
    let deadline = Instant::now() + budget;
    let mut dropped = 0u64;
    let mut taken_while_stopping = 0u64;
    for (index, sample) in rx.try_iter().enumerate() {
        if dropped > 0 || (index % 64 == 0 && Instant::now() >= deadline) {
            dropped += 1;
            continue;
        }
        // Taken while the BPF programs were being detached (seconds, with large unwind
        // tables): the exec, fork and exit programs may have gone first, so who the process
        // was is not known.
        if sample.ktime_ns > taken_until_ns {
            taken_while_stopping += 1;
            continue;
        }
        pipeline.handle(sample);
    }
    if dropped > 0 {
        tracing::warn!(
            samples = dropped,
            "stopping: samples still queued after {budget:?} dropped"
        );
    }
    if taken_while_stopping > 0 {
        tracing::info!(
            samples = taken_while_stopping,
            "stopping: samples taken while the BPF programs were detached dropped"
        );
    }
    dropped + taken_while_stopping
}

/// `profiler record`: samples for `config.duration` (or until `stop`), writes one profile.
pub fn record(config: &RecordConfig, stop: &AtomicBool) -> Result<RecordSummary, AgentError> {
    Sampler::preflight()?;
    check_pids_exist(&config.sampling.pids)?;
    check_writable_file(&config.output)?;
    // Every thread of a recording handles samples (there is no server or exporter).
    priority::raise_sampling_threads(config.sampling.sampling_nice);
    let start_unix_ns = unix_now_ns();
    let (mut sampler, parts) = Sampler::load(&sampler_settings(&config.sampling))?;
    let (kernel, samples) = KernelInputs::from_parts(parts);
    let mut pipeline = Pipeline::new(
        Grouping::Single,
        &config.sampling,
        start_unix_ns,
        kernel,
        None,
    );
    let default_files = RegistryConfig::default().max_open_files;
    let budget = FdBudget::at_start(0, default_files, 0);
    pipeline.processes.set_max_open_files(budget.mapped_files);
    pipeline.prepare(&config.sampling.pids);
    sampler.attach()?;
    pipeline.poll(Some(&mut sampler));
    let (reader, rx) = SampleReader::spawn(samples, SAMPLE_QUEUE);
    let started = Instant::now();
    pump(&mut pipeline, &rx, stop, |pipeline| {
        pipeline.poll(Some(&mut sampler));
        started.elapsed() >= config.duration || stop.load(Ordering::Relaxed)
    });

    // Detach first so no sample is taken after the window, then take everything in flight.
    let bpf_stats = sampler.stats();
    let bpf_run_stats = sampler.program_run_stats();
    let off_cpu_run_stats = sampler.off_cpu_run_stats();
    let duration_ns = started.elapsed().as_nanos() as i64;
    sampler.stop_sampling();
    // CUDA calls still reported between here and the probes' detaching are outside the window.
    let stopped_at_ns = monotonic_now_ns();
    pipeline.end_accelerator_window_at(stopped_at_ns);
    drop(sampler);
    let reader_stats = reader.stats.clone();
    reader.stop();
    pipeline.drain_events();
    // Stopped by a signal: as prompt as the agent; at the end of the duration: thorough.
    let signalled = stop.load(Ordering::Relaxed);
    let dropped_at_stop = if signalled {
        drain_queue(&mut pipeline, &rx, STOP_DRAIN_BUDGET, stopped_at_ns)
    } else {
        drain_queue(
            &mut pipeline,
            &rx,
            Duration::from_secs(365 * 24 * 3600),
            stopped_at_ns,
        )
    };
    pipeline.poll(None);
    pipeline.settle_late_walks(if signalled {
        STOP_LATE_WALK_PATIENCE
    } else {
        LATE_WALK_PATIENCE
    });
    let all_profiles = pipeline.flush(start_unix_ns + duration_ns);
    let (mut profiles, cuda_profiles): (Vec<Profile>, Vec<Profile>) = all_profiles
        .into_iter()
        .partition(|p| p.kind == ProfileKind::Cpu);
    let mut profile = profiles.pop().unwrap_or_else(|| Profile {
        series_labels: vec![("host".into(), hostname())],
        start_unix_ns,
        duration_ns,
        period_ns: config.sampling.period_ns(),
        ..Profile::default()
    });
    profile.duration_ns = duration_ns;

    let bytes = export::render(&profile, config.format);
    export::write_atomically(&config.output, &bytes)?;
    let mut written = 1;
    for mut cuda_profile in cuda_profiles {
        cuda_profile.duration_ns = duration_ns;
        let path = sibling_path(&config.output, cuda_profile.kind, config.format);
        export::write_atomically(&path, &export::render(&cuda_profile, config.format))?;
        tracing::info!(path = %path.display(), kind = cuda_profile.kind.name(), total = cuda_profile.total_samples(), "profile written");
        written += 1;
    }

    let mut metrics = pipeline.metrics(None, None);
    metrics.bpf = bpf_stats;
    (metrics.bpf_run_time_ns, metrics.bpf_run_count) = bpf_run_stats;
    (metrics.off_cpu_run_time_ns, metrics.off_cpu_run_count) = off_cpu_run_stats;
    add_reader_counts(&mut metrics, reader_stats.counts());
    metrics.agent_queue_full += dropped_at_stop;
    metrics.profiles_written = written;
    metrics.log("recording finished");
    tracing::info!(path = %config.output.display(), samples = profile.total_samples(), "profile written");
    Ok(RecordSummary { profile, metrics })
}

/// The exporter thread and its queue: the pipeline hands over each interval's profiles without
/// waiting; a full queue drops the batch and counts it.
struct Exporter {
    queue: Option<crossbeam_channel::Sender<Vec<Profile>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    counters: Arc<ExportCounters>,
    /// Sends what the push sink queued, on its own thread.
    pusher: Option<Pusher>,
}

impl Exporter {
    fn spawn(mut sink: impl ProfileSink + Send + 'static, pusher: Option<Pusher>) -> Exporter {
        let (queue, batches) = crossbeam_channel::bounded::<Vec<Profile>>(EXPORT_QUEUE);
        let counters = Arc::new(ExportCounters::default());
        let thread = {
            let counters = counters.clone();
            std::thread::Builder::new()
                .name("exporter".into())
                .spawn(move || {
                    for profile in batches.into_iter().flatten() {
                        match sink.write(&profile) {
                            Ok(()) => counters.written.fetch_add(1, Ordering::Relaxed),
                            Err(err) => {
                                tracing::warn!("{err}");
                                counters.errors.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    }
                })
                .expect("spawning the exporter thread")
        };
        Exporter {
            queue: Some(queue),
            thread: Some(thread),
            counters,
            pusher,
        }
    }

    fn submit(&self, profiles: Vec<Profile>) {
        let count = profiles.len() as u64;
        let Some(queue) = &self.queue else { return };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = queue.try_send(profiles)
        {
            self.counters.errors.fetch_add(count, Ordering::Relaxed);
            tracing::warn!(
                profiles = count,
                "the output is not keeping up; dropped this interval's profiles"
            );
        }
    }

    /// Waits until everything submitted has been written (and pushed, or spooled, as far as
    /// the receiver allows).
    fn finish(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Some(pusher) = self.pusher.take() {
            pusher.finish();
        }
    }

    fn add_to(&self, metrics: &mut SelfMetrics) {
        metrics.profiles_written = self.counters.written.load(Ordering::Relaxed);
        metrics.export_errors = self.counters.errors.load(Ordering::Relaxed);
        if let Some(pusher) = &self.pusher {
            let push = pusher.stats();
            metrics.push_sent = push.sent;
            metrics.push_failed = push.failed;
            metrics.push_retries = push.retries;
            metrics.push_dropped = push.dropped;
            metrics.push_queue_bytes = push.queue_bytes;
            metrics.spool_bytes = push.spool_bytes;
        }
    }
}

/// Ends the current window: hands its profiles to the exporter and logs the agent's health.
fn flush_interval(
    pipeline: &mut Pipeline,
    exporter: &Exporter,
    sampler: Option<&Sampler>,
    reader: Option<&SampleReader>,
) -> SelfMetrics {
    exporter.submit(pipeline.flush(unix_now_ns()));
    pipeline.processes.evict_exited();
    let mut metrics = pipeline.metrics(sampler, reader);
    exporter.add_to(&mut metrics);
    metrics.log("interval");
    metrics
}

/// Every output of the agent, written in turn by the exporter thread.
struct Outputs(Vec<Box<dyn ProfileSink + Send>>);

impl ProfileSink for Outputs {
    fn write(&mut self, profile: &Profile) -> Result<(), ExportError> {
        let mut result = Ok(());
        for sink in &mut self.0 {
            // One failing output must not starve the others.
            if let Err(err) = sink.write(profile) {
                result = Err(err);
            }
        }
        result
    }
}

/// `profiler agent`: samples until `stop`, writing one profile per service every interval.
pub fn run_agent(config: &AgentConfig, stop: Arc<AtomicBool>) -> Result<(), AgentError> {
    Sampler::preflight()?;
    check_pids_exist(&config.sampling.pids)?;
    let mut outputs: Vec<Box<dyn ProfileSink + Send>> = Vec::new();
    if let Some(dir) = &config.output_dir {
        check_writable_dir(dir)?;
        outputs.push(Box::new(DirectorySink::new(dir.clone())));
    }
    // Sampling and push never depend on the store: one that cannot be opened (a corrupt file is
    // already moved aside by the store itself; this is e.g. an unwritable directory) is logged
    // and left out, and the server answers ingest and queries with 503.
    let budget = FdBudget::at_start(
        config.serve.server.connections.max_connections,
        RegistryConfig::default().max_open_files,
        crate::server::listen::PROBE_RESERVE,
    );
    let mut serve = config.serve.clone();
    serve.server.connections.max_connections = budget.connections;
    let serving = match Serving::start(&serve) {
        Err(crate::server::serve::ServeError::Store(err)) => {
            tracing::error!("{err}; running without the embedded store");
            let mut without_store = serve.clone();
            without_store.store = None;
            Serving::start(&without_store)?
        }
        started => started?,
    };
    if let Some(store) = &serving.store {
        outputs.push(Box::new(StoreSink::new(store.clone())));
    }
    let pusher = match &config.push {
        Some(push) => {
            let (pusher, sink) = Pusher::start(push)?;
            outputs.push(Box::new(sink));
            Some(pusher)
        }
        None => None,
    };
    let mut exporter = Exporter::spawn(Outputs(outputs), pusher);
    // The server, store, pusher and exporter threads are started: the threads started from here
    // on handle samples and inherit this one's priority (`priority`).
    priority::raise_sampling_threads(config.sampling.sampling_nice);
    let (mut sampler, parts) = Sampler::load(&sampler_settings(&config.sampling))?;
    let (kernel, samples) = KernelInputs::from_parts(parts);
    let mut pipeline = Pipeline::new(
        Grouping::PerService,
        &config.sampling,
        unix_now_ns(),
        kernel,
        Some(serving.health.gpu.clone()),
    );
    pipeline.processes.set_max_open_files(budget.mapped_files);
    let gpu = &config.sampling.gpu;
    let nvml = if gpu.enabled {
        Some(NvmlPoller::spawn(
            gpu.nvml_library.clone(),
            gpu.nvml_interval,
            hostname(),
            serving.health.gpu.clone(),
        ))
    } else {
        serving
            .health
            .gpu
            .set_unavailable("GPU support is off (--no-gpu)".into());
        None
    };
    pipeline.prepare(&config.sampling.pids);
    sampler.attach()?;
    pipeline.poll(Some(&mut sampler));
    let (reader, rx) = SampleReader::spawn(samples, SAMPLE_QUEUE);
    serving.health.set_ready(true);
    tracing::info!(
        interval_s = config.interval.as_secs_f64(),
        output_dir = ?config.output_dir,
        store = ?config.serve.store.as_ref().map(|s| &s.data_dir),
        pyroscope = ?config.push.as_ref().map(|p| &p.url),
        url = %format!("http://{}/", serving.local_addr()),
        "agent running"
    );
    let mut next_flush = Instant::now() + config.interval;
    pump(&mut pipeline, &rx, &stop, |pipeline| {
        pipeline.poll(Some(&mut sampler));
        let now = Instant::now();
        if now >= next_flush {
            // After a stall (start-up, a slow table build) start the next window from now
            // instead of flushing a burst of empty catch-up windows.
            next_flush = (next_flush + config.interval).max(now + config.interval / 2);
            let metrics = flush_interval(pipeline, &exporter, Some(&sampler), Some(&reader));
            serving.health.publish(metrics);
        }
        stop.load(Ordering::Relaxed)
    });

    serving.health.set_ready(false);
    let stopping = Instant::now();
    tracing::info!("stopping: flushing the current interval");
    let bpf_stats = sampler.stats();
    let bpf_run_stats = sampler.program_run_stats();
    let off_cpu_run_stats = sampler.off_cpu_run_stats();
    sampler.stop_sampling();
    let stopped_at_ns = monotonic_now_ns();
    drop(sampler);
    let reader_stats = reader.stats.clone();
    reader.stop();
    pipeline.drain_events();
    let dropped_at_stop = drain_queue(&mut pipeline, &rx, STOP_DRAIN_BUDGET, stopped_at_ns);
    pipeline.poll(None);
    pipeline.settle_late_walks(STOP_LATE_WALK_PATIENCE);
    exporter.submit(pipeline.flush(unix_now_ns()));
    exporter.finish();
    tracing::info!(
        elapsed_ms = stopping.elapsed().as_millis() as u64,
        "stopping: the last interval is written"
    );
    let mut metrics = pipeline.metrics(None, None);
    metrics.bpf = bpf_stats;
    (metrics.bpf_run_time_ns, metrics.bpf_run_count) = bpf_run_stats;
    (metrics.off_cpu_run_time_ns, metrics.off_cpu_run_count) = off_cpu_run_stats;
    add_reader_counts(&mut metrics, reader_stats.counts());
    metrics.agent_queue_full += dropped_at_stop;
    exporter.add_to(&mut metrics);
    metrics.log("agent stopped");
    if let Some(nvml) = nvml {
        nvml.stop();
    }
    serving.shutdown();
    // The table builder is cancelled when the pipeline goes: whatever it was building or still
    // had queued is dropped, not finished.
    drop(pipeline);
    tracing::info!(
        elapsed_ms = stopping.elapsed().as_millis() as u64,
        "agent stopped"
    );
    Ok(())
}

#[derive(Debug, Default)]
struct ExportCounters {
    written: std::sync::atomic::AtomicU64,
    errors: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
mod tests {
    use std::{path::PathBuf, sync::Arc};

    use super::{ExecStage, cut_at_new_program, exec_stage};
    use crate::model::{FileId, MappedFile, Mapping, Pid, ProcessInfo, ProcessLabels, Sample, Tid};

    /// A kernel stack, root first, as the host benchmark's samples of exec'ing processes have it.
    fn stage(stack: &str) -> ExecStage {
        exec_stage(stack.split(';').map(|name| (name != "?").then_some(name)))
    }

    /// Only an exec still setting up (copying the arguments) keeps the old program's address
    /// space for certain; from `bprm_execve` on, or with a frame without a name, it may not.
    #[test]
    fn an_exec_keeps_the_old_address_space_only_while_it_sets_up() {
        const SYSCALL: &str = "entry_SYSCALL_64_after_hwframe;do_syscall_64;__x64_sys_execve";
        for (below, expected) in [
            (
                "do_execveat_common.isra.0;copy_strings.isra.0;strnlen_user",
                ExecStage::BeforeNewAddressSpace,
            ),
            (
                "do_execveat_common.isra.0;alloc_bprm;do_open_execat;do_filp_open",
                ExecStage::BeforeNewAddressSpace,
            ),
            (
                "do_execveat_common.isra.0;bprm_execve;load_elf_binary;strnlen_user",
                ExecStage::MayHaveNewAddressSpace,
            ),
            (
                "do_execveat_common.isra.0;bprm_execve;load_elf_binary;begin_new_exec;__mmput;exit_mmap",
                ExecStage::MayHaveNewAddressSpace,
            ),
            // bprm_execve inlined: the loader's own frames still tell.
            (
                "do_execveat_common.isra.0;load_elf_binary;elf_load;vm_mmap_pgoff",
                ExecStage::MayHaveNewAddressSpace,
            ),
            (
                "do_execveat_common.isra.0;?;copy_strings.isra.0",
                ExecStage::MayHaveNewAddressSpace,
            ),
        ] {
            assert_eq!(stage(&format!("{SYSCALL};{below}")), expected, "{below}");
        }
        assert_eq!(
            stage("entry_SYSCALL_64_after_hwframe;do_syscall_64;__x64_sys_read;copy_strings"),
            ExecStage::Outside
        );
        assert_eq!(
            stage("entry_SYSCALL_64_after_hwframe;?;__x64_sys_read"),
            ExecStage::MayHaveNewAddressSpace
        );
        // The agent's exec event program alone: the kernel's unwinder stopped in it, on
        // `sched_process_exec`, after the new program was loaded (host benchmark samples).
        assert_eq!(
            stage("bpf_prog_990ba2c658a839b5_process_exec"),
            ExecStage::MayHaveNewAddressSpace
        );
        assert_eq!(
            stage(&format!(
                "{SYSCALL};do_execveat_common.isra.0;bprm_execve;bpf_trace_run3;\
                 bpf_prog_990ba2c658a839b5_process_exec;__bpf_ringbuf_reserve"
            )),
            ExecStage::MayHaveNewAddressSpace
        );
        // Another program's: no sign of an exec.
        assert_eq!(
            stage("bpf_prog_6deef7357e7b4530_sd_devices"),
            ExecStage::Outside
        );
    }

    fn program_before_exec() -> ProcessInfo {
        let libc = Arc::new(MappedFile {
            id: FileId { dev: 1, ino: 2 },
            path: "/lib/libc.so.6".into(),
            open_path: PathBuf::from("/lib/libc.so.6"),
            build_id: None,
            handle: None,
        });
        ProcessInfo {
            pid: Pid(7),
            start_time: 1,
            comm: "sh".into(),
            labels: ProcessLabels::default(),
            mappings: vec![Mapping {
                start: 0x7f00_0000_0000,
                end: 0x7f00_0010_0000,
                file_offset: 0x2_8000,
                file: Some(libc),
                name: "/lib/libc.so.6".into(),
            }],
            is_kernel_thread: false,
        }
    }

    fn sample_in_exec(user_ips: Vec<u64>) -> Sample {
        Sample {
            pid: Pid(7),
            tid: Tid(7),
            kernel_ips: vec![0xffff_ffff_8100_0000],
            user_ips,
            ..Default::default()
        }
    }

    #[test]
    fn a_sample_late_in_an_exec_keeps_only_the_old_programs_addresses() {
        let old = program_before_exec();
        // The exec has set the new program's entry (ld.so's `_start`, mapped by the exec
        // at an address the old program never used): dropped, and the stack is truncated.
        let mut entry = sample_in_exec(vec![0x7f55_1234_5290]);
        assert!(cut_at_new_program(&mut entry, &old));
        assert!(entry.user_ips.is_empty());
        assert!(entry.user_truncated);

        // Still the old program's registers: `execve` in its libc stays.
        let mut in_libc = sample_in_exec(vec![0x7f00_0000_1234]);
        assert!(!cut_at_new_program(&mut in_libc, &old));
        assert_eq!(in_libc.user_ips, vec![0x7f00_0000_1234]);
        assert!(!in_libc.user_truncated);

        // Cut from the first address the old program did not map: what BPF walked past it
        // is not the old program's stack.
        let mut mixed = sample_in_exec(vec![0x7f00_0000_1234, 0x55aa_0000_1000, 0x7f00_0000_2000]);
        assert!(cut_at_new_program(&mut mixed, &old));
        assert_eq!(mixed.user_ips, vec![0x7f00_0000_1234]);
        assert!(mixed.user_truncated);

        // A return address at a mapping's end belongs to the call before it (the mapping's);
        // the interrupted address itself (no kernel frames) is exact.
        let mut at_end = sample_in_exec(vec![0x7f00_0000_1234, 0x7f00_0010_0000]);
        assert!(!cut_at_new_program(&mut at_end, &old));
        let mut exact = Sample {
            kernel_ips: Vec::new(),
            ..sample_in_exec(vec![0x7f00_0010_0000])
        };
        assert!(cut_at_new_program(&mut exact, &old));
    }
}
