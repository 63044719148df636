//! The agent side of Python unwinding: recognises CPython processes as their snapshots arrive,
//! checks the layout against the live process, registers them with the BPF walk, and splices
//! the Python frames BPF recorded into the native stack in place of the interpreter's frames.
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Weak},
    time::{Duration, Instant},
};

use profiler_common::{
    PY_ANCHOR_CFRAME, PY_ANCHOR_DIRECT, PY_ENTRY_EVERY_FRAME, PY_ENTRY_FLAG, PY_ENTRY_SHIM,
    PY_INSTRUCTION_LASTI, PY_INSTRUCTION_POINTER, PY_NAME_HEAD_BYTES, PyProcInfo,
};

use super::{
    code::{CodeError, read_code_object},
    detect::{
        DetectError, InterpreterElf, PythonProcess, detect_python_with, inspect_interpreter_elf,
    },
    layout::{EntryMarker, FrameAnchor, InstructionUnit, PyLayout},
    memory::{ProcMemory, ProcessMemoryExt},
    walk::{MAX_THREADS, WalkError, thread_first_frame, thread_states, walk_frame_chain},
};
use crate::{
    bpf::PythonMaps,
    model::{FileId, Pid, ProcessInfo, RuntimeHandle, Sample, UnwoundFrame, UnwoundStack},
};

/// How long to wait before checking again a process whose interpreter is not initialised yet.
const RETRY_PENDING: Duration = Duration::from_millis(200);
/// Interpreter ELF files remembered (by file identity) so each is parsed once.
const MAX_CACHED_ELF_FILES: usize = 4096;
/// Frames whose code objects the self-check reads.
const SELF_CHECK_FRAMES: usize = 16;
/// Self-checks in a row whose frames must fail before the layout is judged wrong: frames read
/// from a running interpreter can be half-built (a starting interpreter has one or two), while
/// a wrong layout fails every time.
const FRAME_CHECK_ATTEMPTS: u32 = 5;

/// A CPython process the BPF walk is registered for: what symbolization needs to read its
/// code objects.
#[derive(Debug)]
pub struct PythonRuntime {
    pub pid: Pid,
    pub process: PythonProcess,
    pub memory: ProcMemory,
}

impl PythonRuntime {
    fn in_eval_loop(&self, addr: u64) -> bool {
        // Return addresses point after the call; the interrupted PC is exact.
        self.process
            .eval_frame_ranges
            .iter()
            .any(|range| range.contains(&addr) || range.contains(&addr.wrapping_sub(1)))
    }

    /// Each eval call runs exactly one Python frame (≤3.10), or a run of frames ending with the
    /// one marked as its entry (3.11+).
    fn one_frame_per_eval_call(&self) -> bool {
        self.process.layout.entry_marker == EntryMarker::None
    }
}

/// The flat description of a layout the BPF walk reads. `kernel_tids` says whether the
/// process's thread ids are the kernel's (it runs in the agent's PID namespace): only then may
/// BPF fall back to matching `native_thread_id` with the kernel tid.
pub fn bpf_proc_info(process: &PythonProcess, kernel_tids: bool) -> PyProcInfo {
    let layout: &PyLayout = &process.layout;
    let narrow = |offset: u32| u16::try_from(offset).unwrap_or(u16::MAX);
    let narrow_u8 = |offset: u32| u8::try_from(offset).unwrap_or(u8::MAX);
    let (anchor_kind, tstate_frame, cframe_current_frame) = match layout.tstate_frame {
        FrameAnchor::ThreadFrame { offset } | FrameAnchor::ThreadCurrentFrame { offset } => {
            (PY_ANCHOR_DIRECT, offset, 0)
        }
        FrameAnchor::CFrame {
            cframe,
            current_frame,
        } => (PY_ANCHOR_CFRAME, cframe, current_frame),
    };
    let (entry_kind, entry_offset, shim_owner) = match layout.entry_marker {
        EntryMarker::None => (PY_ENTRY_EVERY_FRAME, 0, 0),
        EntryMarker::IsEntryFlag { offset } => (PY_ENTRY_FLAG, offset, 0),
        EntryMarker::ShimOwner { offset, value } => (PY_ENTRY_SHIM, offset, value),
    };
    PyProcInfo {
        runtime_addr: process.runtime_addr,
        code_tag_mask: layout.stackref_tag_mask,
        runtime_interpreters_head: narrow(layout.runtime_interpreters_head),
        interp_next: narrow(layout.interp_next),
        interp_threads_head: narrow(layout.interp_threads_head),
        tstate_next: narrow(layout.tstate_next),
        tstate_thread_id: narrow(layout.tstate_thread_id),
        tstate_native_thread_id: layout
            .tstate_native_thread_id
            .filter(|_| kernel_tids)
            .map(narrow)
            .unwrap_or(0),
        tstate_frame: narrow(tstate_frame),
        cframe_current_frame: narrow(cframe_current_frame),
        frame_code: narrow(layout.frame_code),
        frame_back: narrow(layout.frame_back),
        frame_instruction: narrow(layout.frame_instruction),
        entry_offset: narrow(entry_offset),
        code_firstlineno: narrow(layout.code_firstlineno),
        code_version: layout.code_version.map(narrow).unwrap_or(0),
        code_name: narrow(layout.code_qualname.unwrap_or(layout.code_name)),
        code_filename: narrow(layout.code_filename),
        code_line_table: narrow(layout.code_line_table),
        unicode_length: narrow_u8(layout.unicode_length),
        unicode_state: narrow_u8(layout.unicode_state),
        unicode_kind_shift: layout.unicode_kind_shift,
        unicode_ascii_data: narrow_u8(layout.unicode_ascii_data),
        unicode_compact_data: narrow_u8(layout.unicode_compact_data),
        anchor_kind,
        instruction_kind: match layout.instruction_unit {
            InstructionUnit::LastiBytes | InstructionUnit::LastiCodeUnits => PY_INSTRUCTION_LASTI,
            InstructionUnit::InstructionPointer => PY_INSTRUCTION_POINTER,
        },
        entry_kind,
        shim_owner,
        frame_read_bytes: narrow_u8(layout.frame_read_bytes()),
        code_read_bytes: narrow(layout.code_read_bytes()),
        name_read_bytes: narrow_u8(layout.unicode_ascii_data + PY_NAME_HEAD_BYTES as u32),
    }
}

/// The raw instruction field a [`crate::model::PythonFrameRef`] stands for, as the userspace
/// symbolizer expects it (an absolute pointer for 3.11+, a sign-extended `f_lasti` before).
pub fn raw_instruction(layout: &PyLayout, code_addr: u64, recorded: u32) -> u64 {
    match layout.instruction_unit {
        InstructionUnit::InstructionPointer => code_addr.wrapping_add(u64::from(recorded)),
        _ => recorded as i32 as i64 as u64,
    }
}

/// Why the self-check did not pass.
#[derive(Debug)]
enum CheckFailure {
    /// The interpreter is not running yet (or is finalizing): try again later.
    NotReady(String),
    /// The layout does not describe this process.
    Mismatch(String),
    /// The frames read do not point at code objects: a wrong layout, or frames caught while
    /// being built. Decided by [`FRAME_CHECK_ATTEMPTS`] checks in a row.
    FramesMismatch(String),
}

/// Counters of Python tracking, for self-metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonStats {
    /// Processes whose Python frames BPF records now.
    pub active: u64,
    /// Python processes waiting for their interpreter to initialise.
    pub pending: u64,
    /// Python processes left to native unwinding (unsupported build or failed self-check).
    pub disabled: u64,
    /// Python frames spliced into stacks.
    pub frames: u64,
    /// Samples with Python frames but no eval-loop frame to put them in place of.
    pub unanchored_samples: u64,
    /// Samples whose Python stack was deeper than BPF records (their root side is cut) and
    /// whose native stack was complete.
    pub truncated_stacks: u64,
}

#[derive(Debug)]
enum State {
    NotPython,
    Pending {
        runtime: Arc<PythonRuntime>,
        next_attempt: Instant,
        /// Checks so far whose frames failed, in a row.
        frame_failures: u32,
    },
    Active(Arc<PythonRuntime>),
    Disabled,
}

#[derive(Debug)]
struct Tracked {
    /// The snapshot this state was derived from; a new snapshot (exec, dlopen) is looked at
    /// again. A `Weak` keeps the allocation, so the address cannot be reused meanwhile.
    snapshot: Weak<ProcessInfo>,
    state: State,
}

/// Python processes by pid, and the BPF registration of the active ones.
pub struct PythonTracker<M: PythonMaps> {
    maps: M,
    proc_root: PathBuf,
    /// foldhash: every exit and exec on the host looks its process up here.
    processes: foldhash::HashMap<Pid, Tracked>,
    elf_files: HashMap<FileId, Option<Arc<InterpreterElf>>>,
    /// Detection errors already logged (free-threaded or unknown builds), so each is logged once.
    reported: HashSet<String>,
    stats: PythonStats,
    /// False with `--no-python`: nothing is registered, so BPF never walks Python frames.
    enabled: bool,
}

impl<M: PythonMaps> PythonTracker<M> {
    pub fn new(maps: M, proc_root: PathBuf, enabled: bool) -> Self {
        Self {
            enabled,
            maps,
            proc_root,
            processes: foldhash::HashMap::default(),
            elf_files: HashMap::new(),
            reported: HashSet::new(),
            stats: PythonStats::default(),
        }
    }

    pub fn stats(&self) -> PythonStats {
        let mut stats = self.stats;
        stats.active = 0;
        stats.pending = 0;
        for tracked in self.processes.values() {
            match tracked.state {
                State::Active(_) => stats.active += 1,
                State::Pending { .. } => stats.pending += 1,
                _ => {}
            }
        }
        stats
    }

    /// Whether `pid` is known to run a free-threaded CPython (no GIL to wait for).
    pub fn is_free_threaded(&self, pid: Pid) -> bool {
        matches!(
            self.processes.get(&pid).map(|tracked| &tracked.state),
            Some(State::Active(runtime) | State::Pending { runtime, .. })
                if runtime.process.layout.free_threaded
        )
    }

    /// Looks at `process` if it is a snapshot not seen yet, and retries pending processes.
    /// Cheap when nothing changed: a hash lookup and a pointer comparison.
    pub fn sync(&mut self, process: &Arc<ProcessInfo>) {
        let pid = process.pid;
        if let Some(tracked) = self.processes.get(&pid)
            && std::ptr::eq(tracked.snapshot.as_ptr(), Arc::as_ptr(process))
        {
            if let State::Pending {
                runtime,
                next_attempt,
                frame_failures,
            } = &tracked.state
                && Instant::now() >= *next_attempt
            {
                let (runtime, frame_failures) = (Arc::clone(runtime), *frame_failures);
                let state = self.activate(runtime, frame_failures);
                if let Some(tracked) = self.processes.get_mut(&pid) {
                    tracked.state = state;
                }
            }
            return;
        }
        if process.is_kernel_thread || !self.enabled {
            return;
        }
        let state = match self.detect(process) {
            Ok(python) => {
                // A refreshed snapshot of an already registered interpreter keeps its state.
                match self.processes.get(&pid).map(|t| &t.state) {
                    Some(State::Active(runtime))
                        if runtime.process.runtime_addr == python.runtime_addr =>
                    {
                        State::Active(Arc::clone(runtime))
                    }
                    Some(State::Disabled) => State::Disabled,
                    _ => match ProcMemory::open_in(&self.proc_root, pid) {
                        Ok(memory) => self.activate(
                            Arc::new(PythonRuntime {
                                pid,
                                process: python,
                                memory,
                            }),
                            0,
                        ),
                        Err(error) => {
                            tracing::debug!(%pid, "cannot read the memory of Python process: {error}");
                            State::NotPython
                        }
                    },
                }
            }
            Err(DetectError::NotPython) => State::NotPython,
            Err(error) => {
                self.stats.disabled += 1;
                // Each unsupported interpreter is reported once, not once per process.
                let message = error.to_string();
                if self.reported.len() < MAX_CACHED_ELF_FILES && self.reported.insert(message) {
                    tracing::warn!(%pid, "Python frames off for this process (native stacks kept): {error}");
                } else {
                    tracing::debug!(%pid, "Python frames off for this process: {error}");
                }
                State::Disabled
            }
        };
        if matches!(state, State::NotPython | State::Disabled)
            && matches!(
                self.processes.get(&pid).map(|t| &t.state),
                Some(State::Active(_))
            )
        {
            self.unregister(pid);
        }
        self.processes.insert(
            pid,
            Tracked {
                snapshot: Arc::downgrade(process),
                state,
            },
        );
    }

    /// The process exited or exec'ed: its interpreter (if any) is gone.
    pub fn forget(&mut self, pid: Pid) {
        if let Some(tracked) = self.processes.remove(&pid)
            && matches!(tracked.state, State::Active(_))
        {
            self.unregister(pid);
        }
    }

    /// Replaces each native eval-loop frame of `stack` by the Python frames it was running
    /// (≤3.10 one, 3.11+ the run up to its entry frame), keeping every native frame between;
    /// Python frames left over (the native walk stopped early) go to the outer end.
    pub fn interleave(&mut self, sample: &Sample, stack: &mut UnwoundStack) {
        if sample.python_frames.is_empty() {
            return;
        }
        let Some(Tracked {
            state: State::Active(runtime),
            ..
        }) = self.processes.get(&sample.pid)
        else {
            return;
        };
        let python = &sample.python_frames;
        let mut next = 0;
        let mut frames = Vec::with_capacity(stack.frames.len() + python.len());
        let python_frame = |index: usize| UnwoundFrame::Python {
            frame: python[index],
            runtime: RuntimeHandle::new(Arc::clone(runtime)),
        };
        // A walk cut at the depth limit has the innermost frames only: once they are placed,
        // the frames further out (native and Python) belong to the part not recorded, so the
        // stack ends there and is marked truncated rather than shown joined to its root.
        let cut = sample.python_truncated;
        let in_eval = |frame: &UnwoundFrame| match frame {
            UnwoundFrame::User { addr, .. } => runtime.in_eval_loop(*addr),
            _ => false,
        };
        // A sample can catch an eval call that has begun but not pushed its first frame yet:
        // one eval frame more than there are runs of Python frames, always the innermost. With
        // the whole native stack at hand, runs are matched from the root, so that fresh eval
        // frame stays native instead of every run landing one eval call too deep.
        let runs = if runtime.one_frame_per_eval_call() {
            python.len()
        } else {
            python.iter().filter(|f| f.entry).count()
                + usize::from(python.last().is_some_and(|f| !f.entry))
        };
        let mut not_begun = if stack.truncated || cut {
            0
        } else {
            stack
                .frames
                .iter()
                .filter(|f| in_eval(f))
                .count()
                .saturating_sub(runs)
        };
        for frame in stack.frames.drain(..) {
            if cut && next >= python.len() {
                break;
            }
            let in_eval = in_eval(&frame);
            if in_eval && not_begun > 0 && next == 0 {
                not_begun -= 1;
                frames.push(frame);
                continue;
            }
            if !in_eval || next >= python.len() {
                frames.push(frame);
                continue;
            }
            if runtime.one_frame_per_eval_call() {
                frames.push(python_frame(next));
                next += 1;
            } else {
                while next < python.len() {
                    frames.push(python_frame(next));
                    next += 1;
                    if python[next - 1].entry {
                        break;
                    }
                }
            }
        }
        if next == 0 {
            self.stats.unanchored_samples += 1;
        }
        while next < python.len() {
            frames.push(python_frame(next));
            next += 1;
        }
        self.stats.frames += python.len() as u64;
        if cut && !stack.truncated {
            self.stats.truncated_stacks += 1;
            stack.truncated = true;
        }
        stack.frames = frames;
    }

    fn unregister(&mut self, pid: Pid) {
        if let Err(error) = self.maps.remove_process(pid.0) {
            tracing::debug!(%pid, "{error}");
        }
    }

    fn detect(&mut self, process: &ProcessInfo) -> Result<PythonProcess, DetectError> {
        if self.elf_files.len() > MAX_CACHED_ELF_FILES {
            self.elf_files.clear();
        }
        let elf_files = &mut self.elf_files;
        detect_python_with(process, &mut |file| {
            if let Some(cached) = elf_files.get(&file.id) {
                return Ok(cached.as_deref().cloned());
            }
            let inspected = inspect_interpreter_elf(&file.readable_path(), &file.path)?;
            elf_files.insert(file.id, inspected.clone().map(Arc::new));
            Ok(inspected)
        })
    }

    /// Self-checks the layout on the live process and registers it with BPF when it holds.
    /// `frame_failures`: the checks before this one whose frames failed, in a row.
    fn activate(&mut self, runtime: Arc<PythonRuntime>, frame_failures: u32) -> State {
        let pid = runtime.pid;
        match self_check(&runtime, &self.proc_root) {
            Ok(threads) => {
                let info = bpf_proc_info(&runtime.process, threads.kernel_tids);
                tracing::debug!(%pid, ?info, "registering Python process with BPF");
                match self.maps.insert_process(pid.0, &info) {
                    Ok(()) => {
                        let (major, minor, micro) = runtime.process.version;
                        tracing::info!(
                            %pid,
                            python = %format!("{major}.{minor}.{micro}"),
                            interpreter = %runtime.process.interpreter_file.path,
                            "Python frames on"
                        );
                        State::Active(runtime)
                    }
                    Err(error) => {
                        tracing::warn!(%pid, "Python frames off for this process: {error}");
                        self.stats.disabled += 1;
                        State::Disabled
                    }
                }
            }
            Err(CheckFailure::NotReady(reason)) => {
                tracing::debug!(%pid, "Python interpreter not ready: {reason}");
                State::Pending {
                    runtime,
                    next_attempt: Instant::now() + RETRY_PENDING,
                    frame_failures: 0,
                }
            }
            Err(CheckFailure::FramesMismatch(reason))
                if frame_failures + 1 < FRAME_CHECK_ATTEMPTS =>
            {
                tracing::debug!(%pid, "Python frames not checkable yet: {reason}");
                State::Pending {
                    runtime,
                    next_attempt: Instant::now() + RETRY_PENDING,
                    frame_failures: frame_failures + 1,
                }
            }
            Err(CheckFailure::Mismatch(reason) | CheckFailure::FramesMismatch(reason)) => {
                self.stats.disabled += 1;
                tracing::warn!(
                    %pid,
                    "Python frames off for this process (native stacks kept): the {}.{} layout does not match: {reason}",
                    runtime.process.version.0,
                    runtime.process.version.1
                );
                State::Disabled
            }
        }
    }
}

/// What the self-check learnt about the process's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CheckedThreads {
    /// The process's thread ids are the kernel's: it runs in the agent's PID namespace.
    kernel_tids: bool,
}

/// Reads the live process the way BPF will: its thread states must belong to its threads and
/// its frames must point at code objects.
fn self_check(runtime: &PythonRuntime, proc_root: &Path) -> Result<CheckedThreads, CheckFailure> {
    let memory = &runtime.memory;
    let layout = &runtime.process.layout;
    let threads = match thread_states(memory, layout, runtime.process.runtime_addr) {
        Ok(threads) if !threads.is_empty() => threads,
        Ok(_) => return Err(CheckFailure::NotReady("no thread states".into())),
        Err(WalkError::NoInterpreter) => {
            return Err(CheckFailure::NotReady("no interpreter yet".into()));
        }
        Err(WalkError::Runtime(error)) => return Err(CheckFailure::NotReady(error.to_string())),
    };
    // BPF matches `thread_id` (`pthread_self()`) with the FS base. On x86_64 glibc and musl
    // `pthread_self()` is the thread pointer, whose first word points at itself (the TCB's
    // `tcb`/`self`): that is what a real thread id looks like, in any PID namespace.
    let thread_ids: Vec<u64> = threads
        .iter()
        .filter_map(|&t| {
            memory
                .read_u64(t.wrapping_add(u64::from(layout.tstate_thread_id)))
                .ok()
        })
        .collect();
    if thread_ids.iter().all(|&id| id == 0) {
        // Created but not bound to a thread yet (a starting interpreter or thread).
        return Err(CheckFailure::NotReady("thread states not bound yet".into()));
    }
    let is_thread_pointer = |id: u64| id != 0 && memory.read_u64(id) == Ok(id);
    if !thread_ids.iter().any(|&id| is_thread_pointer(id)) {
        return Err(CheckFailure::Mismatch(format!(
            "no thread state's thread_id ({thread_ids:x?}) is a thread pointer of the process"
        )));
    }
    let tasks = namespace_task_ids(proc_root, runtime.pid);
    if let Some(offset) = layout.tstate_native_thread_id
        && !tasks.ids.is_empty()
    {
        let ids: Vec<u64> = threads
            .iter()
            .filter_map(|&t| memory.read_u64(t.wrapping_add(u64::from(offset))).ok())
            .collect();
        if !ids.iter().any(|id| tasks.ids.contains(id)) {
            return Err(CheckFailure::Mismatch(format!(
                "no thread state's native_thread_id ({ids:?}) is a thread of the process \
                 (its thread ids in its PID namespace: {:?})",
                tasks.ids
            )));
        }
    }
    let (mut code_objects, mut not_code) = (0, 0);
    for &thread in &threads {
        let Ok(first) = thread_first_frame(memory, layout, thread) else {
            continue;
        };
        let (frames, _) = walk_frame_chain(memory, layout, first);
        for frame in frames.iter().take(SELF_CHECK_FRAMES) {
            match read_code_object(
                memory,
                layout,
                runtime.process.code_type_addr,
                frame.code_addr,
            ) {
                Ok(_) => code_objects += 1,
                Err(CodeError::NotCode { .. }) => not_code += 1,
                // A frame being torn down while we read: no evidence either way.
                Err(_) => {}
            }
        }
        if code_objects + not_code >= SELF_CHECK_FRAMES {
            break;
        }
    }
    if not_code > code_objects {
        return Err(CheckFailure::FramesMismatch(format!(
            "{not_code} of {} frames do not point at code objects",
            not_code + code_objects
        )));
    }
    Ok(CheckedThreads {
        kernel_tids: tasks.kernel_tids,
    })
}

/// A process's thread ids as it sees them itself.
#[derive(Debug, Default)]
struct NamespaceTaskIds {
    /// Empty when `/proc` could not be read (the process is exiting).
    ids: HashSet<u64>,
    /// The ids are the kernel's (those of `proc_root`'s PID namespace).
    kernel_tids: bool,
}

/// Thread ids of `pid` in its own PID namespace: the last `NSpid` entry of each task's
/// status (a containerised process numbers its threads from its namespace's pid 1, and
/// CPython records those numbers as `native_thread_id`).
fn namespace_task_ids(proc_root: &Path, pid: Pid) -> NamespaceTaskIds {
    let process = proc_root.join(pid.0.to_string());
    let kernel_ids: Vec<u64> = std::fs::read_dir(process.join("task"))
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
                .take(MAX_THREADS)
                .collect()
        })
        .unwrap_or_default();
    let levels = |status: &Path| -> Option<Vec<u64>> {
        let text = std::fs::read_to_string(status).ok()?;
        let line = text.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
        line.split_whitespace().map(|n| n.parse().ok()).collect()
    };
    // Kernels without NSpid (before 4.1) have no nested view to offer.
    match levels(&process.join("status")) {
        Some(nspid) if nspid.len() > 1 => NamespaceTaskIds {
            ids: kernel_ids
                .iter()
                .filter_map(|tid| {
                    let status = process.join("task").join(tid.to_string()).join("status");
                    levels(&status)?.last().copied()
                })
                .collect(),
            kernel_tids: false,
        },
        _ => NamespaceTaskIds {
            ids: kernel_ids.into_iter().collect(),
            kernel_tids: true,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        bpf::BpfError,
        model::{MappedFile, PythonFrameRef, Tid},
        runtimes::python::{
            detect::VersionSource,
            layout::{PY310, PY312},
        },
    };

    #[derive(Default)]
    struct RecordingMaps {
        registered: Vec<u32>,
        removed: Vec<u32>,
    }

    impl PythonMaps for RecordingMaps {
        fn insert_process(&mut self, pid: u32, _info: &PyProcInfo) -> Result<(), BpfError> {
            self.registered.push(pid);
            Ok(())
        }
        fn remove_process(&mut self, pid: u32) -> Result<(), BpfError> {
            self.removed.push(pid);
            Ok(())
        }
    }

    const EVAL: std::ops::Range<u64> = 0x10_000..0x11_000;
    const EVAL_COLD: std::ops::Range<u64> = 0x20_000..0x20_400;

    fn tracker_with(layout: PyLayout) -> (PythonTracker<RecordingMaps>, Pid) {
        let runtime = runtime_in_this_process(layout, 0x1000);
        let pid = runtime.pid;
        let mut tracker = PythonTracker::new(RecordingMaps::default(), "/proc".into(), true);
        tracker.processes.insert(
            pid,
            Tracked {
                snapshot: Weak::new(),
                state: State::Active(Arc::new(runtime)),
            },
        );
        (tracker, pid)
    }

    /// An interpreter "in" the test process: its `_PyRuntime` at `runtime_addr` of our memory.
    fn runtime_in_this_process(layout: PyLayout, runtime_addr: u64) -> PythonRuntime {
        let pid = Pid(std::process::id());
        PythonRuntime {
            pid,
            process: PythonProcess {
                version: (layout.python.0, layout.python.1, 0),
                version_source: VersionSource::FileName,
                layout,
                runtime_addr,
                code_type_addr: 0x2000,
                none_addr: None,
                interpreter_file: Arc::new(MappedFile {
                    id: FileId { dev: 1, ino: 2 },
                    path: Arc::from("/usr/lib/libpython3.so"),
                    open_path: "/nonexistent".into(),
                    build_id: None,
                    handle: None,
                }),
                load_bias: 0,
                eval_frame_ranges: vec![EVAL, EVAL_COLD],
            },
            memory: ProcMemory::open(pid).expect("own memory"),
        }
    }

    /// A self-check whose frames fail is retried; only a failure that persists turns Python
    /// frames off (a starting interpreter's one or two frames can be caught half-built). Thread
    /// states not bound to a thread yet are waited for.
    #[test]
    fn frames_that_fail_the_self_check_disable_only_when_the_failure_persists() {
        let layout = PY312;
        // Runtime, interpreter, thread state, cframe, frame and a non-code object, in one
        // buffer of this process; the thread id is a word pointing at itself, as a thread
        // pointer does.
        let mut memory = vec![0u64; 0x1000];
        let base = memory.as_ptr() as u64;
        let (runtime, interp, tstate, cframe, frame, object, thread_pointer) = (
            base,
            base + 0x1000,
            base + 0x2000,
            base + 0x3000,
            base + 0x4000,
            base + 0x5000,
            base + 0x6000,
        );
        let tid: u64 = std::fs::read_dir("/proc/self/task")
            .expect("own tasks")
            .find_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
            .expect("a task");
        let mut write = |addr: u64, offset: u32, value: u64| {
            memory[((addr - base) as usize + offset as usize) / 8] = value;
        };
        write(runtime, layout.runtime_interpreters_head, interp);
        write(interp, layout.interp_threads_head, tstate);
        write(
            tstate,
            layout.tstate_native_thread_id.expect("3.12 has it"),
            tid,
        );
        let FrameAnchor::CFrame {
            cframe: cframe_offset,
            current_frame,
        } = layout.tstate_frame
        else {
            panic!("3.12 reaches its frames through the cframe");
        };
        write(tstate, cframe_offset, cframe);
        write(cframe, current_frame, frame);
        write(frame, layout.frame_code, object);
        write(object, layout.object_type, 0xdead);
        write(thread_pointer, 0, thread_pointer);

        let mut tracker = PythonTracker::new(RecordingMaps::default(), "/proc".into(), true);
        let runtime = Arc::new(runtime_in_this_process(layout, runtime));
        // A thread state not bound to its thread yet: not ready, not a mismatch.
        let state = tracker.activate(Arc::clone(&runtime), 0);
        assert!(
            matches!(
                state,
                State::Pending {
                    frame_failures: 0,
                    ..
                }
            ),
            "{state:?}"
        );
        write(tstate, layout.tstate_thread_id, thread_pointer);
        for failures in 0..FRAME_CHECK_ATTEMPTS - 1 {
            let state = tracker.activate(Arc::clone(&runtime), failures);
            assert!(
                matches!(state, State::Pending { frame_failures, .. } if frame_failures == failures + 1),
                "{state:?}"
            );
        }
        assert_eq!(tracker.stats.disabled, 0);
        let state = tracker.activate(Arc::clone(&runtime), FRAME_CHECK_ATTEMPTS - 1);
        assert!(matches!(state, State::Disabled), "{state:?}");
        assert_eq!(tracker.stats.disabled, 1);
        assert!(tracker.maps.registered.is_empty());
        drop(memory);
    }

    fn native(addr: u64) -> UnwoundFrame {
        UnwoundFrame::UserUnmapped { addr, name: None }
    }

    fn user(addr: u64) -> UnwoundFrame {
        UnwoundFrame::User {
            addr,
            file: Arc::new(MappedFile {
                id: FileId { dev: 1, ino: 2 },
                path: Arc::from("/usr/lib/libpython3.so"),
                open_path: "/nonexistent".into(),
                build_id: None,
                handle: None,
            }),
            file_offset: addr,
            mapping_start: 0,
            mapping_end: 0x100_000,
            mapping_offset: 0,
        }
    }

    fn py(code_addr: u64, entry: bool) -> PythonFrameRef {
        PythonFrameRef {
            code_addr,
            instruction: 0,
            fingerprint: 1,
            entry,
        }
    }

    fn sample(pid: Pid, python: Vec<PythonFrameRef>) -> Sample {
        Sample {
            ktime_ns: 0,
            pid,
            tid: Tid(pid.0),
            cpu: 0,
            comm: Arc::from("python"),
            python_frames: python,
            ..Default::default()
        }
    }

    /// "P<code>" for Python frames, "N<addr>" for native ones, innermost first.
    fn describe(stack: &UnwoundStack) -> Vec<String> {
        stack
            .frames
            .iter()
            .map(|frame| match frame {
                UnwoundFrame::Python { frame, .. } => format!("P{:x}", frame.code_addr),
                UnwoundFrame::User { addr, .. } | UnwoundFrame::UserUnmapped { addr, .. } => {
                    format!("N{addr:x}")
                }
                UnwoundFrame::Kernel(addr) => format!("K{addr:x}"),
            })
            .collect()
    }

    #[test]
    fn each_eval_call_runs_one_frame_up_to_3_10() {
        let (mut tracker, pid) = tracker_with(PY310);
        // leaf (C) <- eval <- call helper <- eval (.cold) <- main
        let mut stack = UnwoundStack {
            frames: vec![
                native(0x50_000),
                user(EVAL.start + 0x10),
                native(0x51_000),
                user(EVAL_COLD.start + 0x20),
                native(0x52_000),
            ],
            truncated: false,
        };
        let python = vec![py(0xa, true), py(0xb, true)];
        tracker.interleave(&sample(pid, python), &mut stack);
        assert_eq!(describe(&stack), ["N50000", "Pa", "N51000", "Pb", "N52000"]);
    }

    #[test]
    fn an_eval_call_runs_frames_up_to_its_entry_frame_from_3_11() {
        let (mut tracker, pid) = tracker_with(PY312);
        // Two C-level eval calls: the inner one ran a and b (b is its entry frame), the outer
        // one c and d, with a C callback (sorted's key) between them.
        let mut stack = UnwoundStack {
            frames: vec![
                native(0x50_000),
                user(EVAL.start + 0x10),
                native(0x51_000),
                user(EVAL.start + 0x20),
                native(0x52_000),
            ],
            truncated: false,
        };
        let python = vec![py(0xa, false), py(0xb, true), py(0xc, false), py(0xd, true)];
        tracker.interleave(&sample(pid, python), &mut stack);
        assert_eq!(
            describe(&stack),
            ["N50000", "Pa", "Pb", "N51000", "Pc", "Pd", "N52000"]
        );
        assert_eq!(tracker.stats().frames, 4);
    }

    #[test]
    fn an_eval_call_that_has_not_begun_stays_native() {
        let (mut tracker, pid) = tracker_with(PY312);
        // The innermost eval call was caught on entry, before it pushed a frame: three eval
        // frames, two runs (a b, c d). The runs belong to the outer two.
        let mut stack = UnwoundStack {
            frames: vec![
                user(EVAL.start + 0x30),
                native(0x50_000),
                user(EVAL.start + 0x10),
                native(0x51_000),
                user(EVAL.start + 0x20),
                native(0x52_000),
            ],
            truncated: false,
        };
        let python = vec![py(0xa, false), py(0xb, true), py(0xc, false), py(0xd, true)];
        tracker.interleave(&sample(pid, python), &mut stack);
        assert_eq!(
            describe(&stack),
            [
                format!("N{:x}", EVAL.start + 0x30).as_str(),
                "N50000",
                "Pa",
                "Pb",
                "N51000",
                "Pc",
                "Pd",
                "N52000"
            ]
        );
    }

    #[test]
    fn frames_without_an_eval_frame_go_to_the_outer_end() {
        let (mut tracker, pid) = tracker_with(PY312);
        // The native walk stopped before reaching the interpreter.
        let mut stack = UnwoundStack {
            frames: vec![native(0x50_000), native(0x51_000)],
            truncated: true,
        };
        tracker.interleave(&sample(pid, vec![py(0xa, true)]), &mut stack);
        assert_eq!(describe(&stack), ["N50000", "N51000", "Pa"]);
        assert_eq!(tracker.stats().unanchored_samples, 1);
    }

    #[test]
    fn unknown_processes_and_forgotten_ones_keep_native_stacks() {
        let (mut tracker, pid) = tracker_with(PY312);
        let frames = vec![native(0x50_000), user(EVAL.start)];
        let mut stack = UnwoundStack {
            frames: frames.clone(),
            truncated: false,
        };
        tracker.interleave(&sample(Pid(pid.0 + 1), vec![py(0xa, true)]), &mut stack);
        assert_eq!(describe(&stack), ["N50000", "N10000"]);
        tracker.forget(pid);
        assert_eq!(tracker.maps.removed, [pid.0]);
        tracker.interleave(&sample(pid, vec![py(0xa, true)]), &mut stack);
        assert_eq!(describe(&stack), ["N50000", "N10000"]);
    }

    #[test]
    fn bpf_info_carries_every_layout_row() {
        for layout in [PY310, PY312] {
            let (tracker, pid) = tracker_with(layout);
            let Some(Tracked {
                state: State::Active(runtime),
                ..
            }) = tracker.processes.get(&pid)
            else {
                unreachable!()
            };
            let info = bpf_proc_info(&runtime.process, true);
            assert_eq!(info.frame_back as u32, layout.frame_back);
            assert_eq!(info.frame_code as u32, layout.frame_code);
            assert_eq!(info.code_firstlineno as u32, layout.code_firstlineno);
            assert_eq!(info.tstate_thread_id as u32, layout.tstate_thread_id);
            assert_eq!(
                info.tstate_native_thread_id as u32,
                layout.tstate_native_thread_id.unwrap_or(0)
            );
            // In another PID namespace the native ids are not the kernel's: BPF must not use
            // them, while `thread_id` (the FS base) still works.
            let info = bpf_proc_info(&runtime.process, false);
            assert_eq!(info.tstate_native_thread_id, 0);
            assert_eq!(info.tstate_thread_id as u32, layout.tstate_thread_id);
        }
    }

    /// A process in its own PID namespace is pid (and tid) 1 there; our own threads keep the
    /// kernel's numbers.
    #[test]
    fn thread_ids_are_read_in_the_process_namespace() {
        let own = namespace_task_ids(Path::new("/proc"), Pid(std::process::id()));
        assert!(own.kernel_tids);
        assert!(own.ids.contains(&u64::from(std::process::id())));

        let mut unshare = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "sleep", "30"])
            .spawn()
            .expect("unshare (util-linux) runs");
        let children = format!("/proc/{0}/task/{0}/children", unshare.id());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let child = loop {
            let text = std::fs::read_to_string(&children).unwrap_or_default();
            if let Some(pid) = text.split_whitespace().next().and_then(|p| p.parse().ok()) {
                break Pid(pid);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "unshare forked no child"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let namespaced = namespace_task_ids(Path::new("/proc"), child);
        let _ = unshare.kill();
        let _ = unshare.wait();
        assert!(!namespaced.kernel_tids);
        assert_eq!(namespaced.ids, HashSet::from([1]));
    }
}
