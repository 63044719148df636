//! One CPU sample as the eBPF program writes it into the `SAMPLES` ring buffer.

use crate::python::{MAX_PYTHON_FRAMES, PyFrameRecord};

/// Deepest kernel stack recorded; the kernel's own `perf_event_max_stack` default is 127.
pub const MAX_KERNEL_FRAMES: usize = 127;
/// Deepest user stack recorded (a power of two: the unwinder masks indexes with it).
pub const MAX_USER_FRAMES: usize = 256;
/// Size of the `SAMPLES` ring buffer in bytes (power of two, multiple of the page size). The
/// program sheds stack copies once half of it is waiting: about 700 samples, seconds of the
/// reader being held up on a small host.
pub const SAMPLES_RING_BYTES: u32 = 4 << 20;
/// Scratch records per CPU in `SCRATCH_SAMPLE`: the CPU sampler's, the CUDA probes' and the
/// off-CPU program's. A cpu-clock sample can interrupt a uprobe program on the same CPU, and
/// a uprobe program can be preempted (a `sched_switch` in the middle of it), so no two share
/// scratch memory.
pub const SCRATCH_SLOTS: u32 = 3;
/// Entries of the `PID_FILTER` hash map.
pub const MAX_FILTERED_PIDS: u32 = 1024;

/// `SampleHeader::flags`: the kernel stack filled every slot, so deeper frames were cut.
pub const SAMPLE_KERNEL_TRUNCATED: u32 = 1 << 0;
/// `SampleHeader::flags`: the user stack filled every slot, so deeper frames were cut.
pub const SAMPLE_USER_TRUNCATED: u32 = 1 << 1;
/// `SampleHeader::flags`: reading the user stack failed (kernel thread, or an unreadable stack).
pub const SAMPLE_USER_STACK_ERROR: u32 = 1 << 2;
/// `SampleHeader::flags`: reading the kernel stack failed.
pub const SAMPLE_KERNEL_STACK_ERROR: u32 = 1 << 3;
/// `SampleHeader::flags`: the interrupted context was in user mode.
pub const SAMPLE_IN_USER_MODE: u32 = 1 << 4;
/// `SampleHeader::flags`: a user PC was in no mapping the agent registered for this process (a
/// new process, exec or dlopen): the agent should refresh its snapshot.
pub const SAMPLE_USER_UNKNOWN_MAPPING: u32 = 1 << 5;
/// `SampleHeader::flags`: a registered mapping's unwind table had no page for a PC (the table
/// was evicted or is still being built).
pub const SAMPLE_USER_TABLE_MISSING: u32 = 1 << 6;
/// `SampleHeader::flags`: at least one user frame was found by frame-pointer fallback.
pub const SAMPLE_USER_FRAME_POINTERS: u32 = 1 << 7;
/// `SampleHeader::flags`: the Python stack filled every slot, so outer Python frames were cut.
pub const SAMPLE_PYTHON_TRUNCATED: u32 = 1 << 8;
/// `SampleHeader::flags`: the Python walk stopped at unreadable memory (a frame being torn
/// down, or a layout that does not match).
pub const SAMPLE_PYTHON_ERROR: u32 = 1 << 9;
/// `SampleHeader::flags`: the thread was inside a CUDA synchronization call (a CPU sample of
/// it is time spent waiting for the GPU, often spinning).
pub const SAMPLE_IN_CUDA_SYNC: u32 = 1 << 10;
/// `SampleHeader::flags`: the user walk stopped at its last recorded frame because going on
/// would have meant guessing (the process is not registered yet, or the frame's file has CFI
/// whose table is not loaded yet). The record ends with a [`StackCopyHeader`] and that many
/// bytes of the user stack from the frame's RSP, and the agent finishes the walk.
pub const SAMPLE_USER_STACK_COPY: u32 = 1 << 11;
/// `SampleHeader::flags`: the first user address is a return address (a CUDA probe's caller,
/// just after its call), not the instruction the thread was stopped at.
pub const SAMPLE_USER_LEAF_RETURN_ADDRESS: u32 = 1 << 12;
/// All flags this ABI version defines; anything else means the two sides disagree.
pub const SAMPLE_KNOWN_FLAGS: u32 = (1 << 13) - 1;

/// Most bytes of user stack a record carries (from the stopping frame's RSP upward).
pub const STACK_COPY_BYTES: usize = 16 << 10;
/// Extra room after the copy buffer: the copy is read a page at a time, and a read of up to
/// a page at any offset below [`STACK_COPY_BYTES`] must stay inside the buffer for the verifier.
pub const STACK_COPY_SLACK: usize = 4 << 10;

/// `StackCopyHeader::flags`: `rip` is the interrupted instruction itself (the first frame, or
/// the one after a signal frame), not a return address.
pub const STACK_COPY_EXACT_PC: u32 = 1 << 0;

/// The registers of the frame the walk stopped at (the last user frame recorded) and the length
/// of the stack copy that follows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackCopyHeader {
    pub rip: u64,
    pub rsp: u64,
    pub rbp: u64,
    /// `STACK_COPY_*` bits.
    pub flags: u32,
    /// Bytes copied from `rsp` upward (at most [`STACK_COPY_BYTES`]; 0 when even the first
    /// page could not be read).
    pub bytes: u32,
}

const _: () = assert!(core::mem::size_of::<StackCopyHeader>() == 32);
pub const STACK_COPY_HEADER_BYTES: usize = core::mem::size_of::<StackCopyHeader>();

/// Fixed part of a sample. Frames follow in [`RawSample`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleHeader {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) when the sample was taken.
    pub ktime_ns: u64,
    /// Thread-group id (the process id as userspace sees it).
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    pub cpu: u32,
    /// `SAMPLE_*` bits.
    pub flags: u32,
    /// Number of valid entries in `RawSample::kernel_ips`.
    pub kernel_frames: u16,
    /// Number of valid entries in `RawSample::user_ips`.
    pub user_frames: u16,
    /// Number of valid entries in `RawSample::python`.
    pub python_frames: u16,
    /// Index in `RawSample::user_ips` of the first frame whose caller the unwinder took from
    /// the frame-pointer chain instead of the frame's unwind table ([`NO_FALLBACK_FRAME`]
    /// when none): frames up to it are exact, callers beyond it may be guesses.
    pub fallback_frame: u16,
    /// The thread's name (`task->comm`), NUL padded.
    pub comm: [u8; 16],
}

const _: () = assert!(core::mem::size_of::<SampleHeader>() == 48);

/// `SampleHeader::fallback_frame` when every caller came from an unwind table (or from the
/// frame-pointer chain of a file proven to keep frames).
pub const NO_FALLBACK_FRAME: u16 = u16::MAX;

/// The sample as the eBPF program builds it in its per-CPU scratch memory. Kernel frames are
/// innermost first, as are user and Python frames.
///
/// Only the used slots go into the ring buffer; see [`sample_record_bytes`] for the record.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawSample {
    pub header: SampleHeader,
    pub kernel_ips: [u64; MAX_KERNEL_FRAMES],
    pub user_ips: [u64; MAX_USER_FRAMES],
    pub python: [PyFrameRecord; MAX_PYTHON_FRAMES],
    /// Valid when `SAMPLE_USER_STACK_COPY` is set.
    pub copy: StackCopyHeader,
    pub stack: [u8; STACK_COPY_BYTES + STACK_COPY_SLACK],
}

pub const SAMPLE_HEADER_BYTES: usize = core::mem::size_of::<SampleHeader>();
const _: () = assert!(core::mem::align_of::<RawSample>() == 8);
const _: () = assert!(core::mem::offset_of!(RawSample, kernel_ips) == SAMPLE_HEADER_BYTES);

/// Bytes of the ring-buffer record of a sample with these frame counts.
///
/// The record is the header, then `user_frames` user addresses, then `kernel_frames` kernel
/// addresses (8 bytes each), then `python_frames` [`PyFrameRecord`]s: only what was collected,
/// since at 100 Hz every byte copied is a cold cache line in the sampling interrupt. With
/// `SAMPLE_USER_STACK_COPY`, [`stack_copy_record_bytes`] more follow.
pub const fn sample_record_bytes(
    kernel_frames: usize,
    user_frames: usize,
    python_frames: usize,
) -> usize {
    SAMPLE_HEADER_BYTES
        + 8 * (user_frames + kernel_frames)
        + core::mem::size_of::<PyFrameRecord>() * python_frames
}

/// Bytes the stack copy adds to a record: its header and the bytes copied.
pub const fn stack_copy_record_bytes(copied: usize) -> usize {
    STACK_COPY_HEADER_BYTES + copied
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for SampleHeader {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for RawSample {}

/// `ProcessEvent::kind`: the process exited (its last thread; its leader when the kernel's BTF
/// lacks the offsets to tell).
pub const EVENT_PROCESS_EXIT: u32 = 1;
/// `ProcessEvent::kind`: the process replaced its program (execve): its mappings are new.
pub const EVENT_PROCESS_EXEC: u32 = 2;

/// A process lifecycle event from the `EVENTS` ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessEvent {
    /// `bpf_ktime_get_ns()` at the event, comparable with the CUDA records' times.
    pub ktime_ns: u64,
    pub kind: u32,
    pub pid: u32,
}

const _: () = assert!(core::mem::size_of::<ProcessEvent>() == 16);

/// `ProcessEvent::kind`: a new process (not a thread) was forked; a [`ForkDetails`] follows.
pub const EVENT_PROCESS_FORK: u32 = 3;

/// Bytes of the exec'ed path kept (`linux_binprm.filename`, NUL-terminated).
pub const EXEC_FILENAME_BYTES: usize = 256;
/// Bytes of the new program's argument strings kept (NUL-separated, as /proc/PID/cmdline).
pub const EXEC_ARGS_BYTES: usize = 512;
/// Bytes of the new program's environment kept (NUL-separated, as /proc/PID/environ): copied
/// only when the whole environment fits, so what the agent finds there is all of it.
pub const EXEC_ENV_BYTES: usize = 4096;

/// Follows an `EVENT_PROCESS_EXEC` header: who the process became, read at the exec itself,
/// so a process that exits before the agent looks at /proc keeps its name, program, cgroup and
/// the range of its main executable's code. A field whose kernel offsets are unknown is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecDetails {
    /// `bpf_get_current_cgroup_id()`: the cgroup v2 id (the inode of its cgroupfs directory).
    pub cgroup_id: u64,
    /// The executable's inode number and device (the kernel's `dev_t`: major << 20 | minor).
    pub exe_ino: u64,
    pub exe_dev: u32,
    /// Bytes of `filename` and `args` that are valid.
    pub filename_len: u16,
    pub args_len: u16,
    /// `mm->env_end - mm->env_start`: the environment's size (0 when not read), and the bytes
    /// of it copied into `env`: all of them when it fits, else none.
    pub env_size: u32,
    pub env_len: u16,
    pub _pad: u16,
    /// `mm->start_code` and `mm->end_code`: the main executable's code, as mapped.
    pub start_code: u64,
    pub end_code: u64,
    /// The new `comm` (the executable's base name, 15 bytes at most).
    pub comm: [u8; 16],
    pub filename: [u8; EXEC_FILENAME_BYTES],
    pub args: [u8; EXEC_ARGS_BYTES],
    pub env: [u8; EXEC_ENV_BYTES],
}

const _: () = assert!(
    core::mem::size_of::<ExecDetails>()
        == 64 + EXEC_FILENAME_BYTES + EXEC_ARGS_BYTES + EXEC_ENV_BYTES
);

/// An exec event as the ring carries it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExecEvent {
    pub header: ProcessEvent,
    pub details: ExecDetails,
}

/// Follows an `EVENT_PROCESS_FORK` header (whose `pid` is the child).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForkDetails {
    pub parent_pid: u32,
    /// The parent's thread that forked (the child takes that thread's cgroups).
    pub parent_tid: u32,
    /// `bpf_get_current_cgroup_id()` in the parent at the fork: its cgroup v2 id. A child
    /// placed elsewhere at its birth (`clone3` with `CLONE_INTO_CGROUP`) shows another id in
    /// its exec event.
    pub parent_cgroup_id: u64,
}

/// A fork event as the ring carries it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForkEvent {
    pub header: ProcessEvent,
    pub details: ForkDetails,
}

const _: () = assert!(core::mem::size_of::<ForkEvent>() == 32);

/// `ProcessEvent::kind`: a task of the process `pid` was moved to other cgroups
/// (`cgroup_attach_task`, `cgroup_transfer_tasks`); `pid` 0 when the kernel's BTF lacked the
/// offset to tell whose. What the agent knew of the process's cgroups from before may be wrong.
/// A [`CgroupMoveDetails`] follows where the BTF gave the offsets to read the destination.
pub const EVENT_CGROUP_MIGRATION: u32 = 4;

/// Bytes of a move's destination path kept, NUL included: the size of the buffer the kernel
/// formats it into for these tracepoints (`TRACE_CGROUP_PATH_LEN`), so a path that fills it
/// may have been cut by the kernel.
pub const CGROUP_MOVE_PATH_BYTES: usize = 1024;

/// Follows an `EVENT_CGROUP_MIGRATION` header: where the task went, so the agent knows the
/// process's cgroups after the move without reading /proc (by then a child forked after the
/// move may be gone).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupMoveDetails {
    /// The task moved (its thread id).
    pub tid: u32,
    /// `dst_cgrp->root->hierarchy_id`: the first field of the /proc/PID/cgroup line that
    /// changed (0: the cgroup v2 hierarchy).
    pub hierarchy_id: i32,
    /// Non-zero when every thread of the process moved (a write to `cgroup.procs`), 0 for one
    /// thread (`tasks`, `cgroup.threads`).
    pub threadgroup: u32,
    /// Bytes of `path` that are valid, NUL included (0: not read).
    pub path_len: u32,
    /// The destination's path from its hierarchy's root (`/system.slice/x.service`), as the
    /// initial cgroup namespace sees it.
    pub path: [u8; CGROUP_MOVE_PATH_BYTES],
}

/// A move event with its destination, as the ring carries it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CgroupMoveEvent {
    pub header: ProcessEvent,
    pub details: CgroupMoveDetails,
}

const _: () = assert!(core::mem::size_of::<CgroupMoveEvent>() == 32 + CGROUP_MOVE_PATH_BYTES);

/// `ProcessEvent::kind` (`pid` 0): a cgroup was renamed, or a hierarchy mounted or unmounted:
/// the /proc/PID/cgroup text of any process may have changed.
pub const EVENT_CGROUPS_CHANGED: u32 = 5;

/// Size of the `EVENTS` ring buffer in bytes. An exec event is about 5 KiB with its
/// environment: 800 fit. A busy host execs a few hundred times a second and the agent drains
/// the ring every 100 ms, but its first seconds hold the pipeline up to a second at a time
/// (the first symbol tables, the first unwind tables): 2 MiB lost 215 events there on the host
/// suite, 1 MiB of the events without environments none.
pub const EVENTS_RING_BYTES: u32 = 4 << 20;

#[cfg(feature = "user")]
unsafe impl aya::Pod for ProcessEvent {}
