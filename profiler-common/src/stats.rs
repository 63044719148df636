//! Per-cause counters kept by the eBPF program in the per-CPU `STATS` array.
//!
//! Ids are indexes into the array and are never reused: a retired counter keeps its slot.

/// Every time the perf event fired.
pub const STAT_SAMPLES_SEEN: u32 = 0;
/// Samples written to the ring buffer.
pub const STAT_SAMPLES_SENT: u32 = 1;
/// Samples lost because the ring buffer was full (the agent is not keeping up).
pub const STAT_RINGBUF_FULL: u32 = 2;
/// Samples of the idle task, counted but not sent.
pub const STAT_IDLE: u32 = 3;
/// Samples skipped by the `--pid` filter.
pub const STAT_FILTERED: u32 = 4;
/// Samples whose kernel stack could not be read.
pub const STAT_KERNEL_STACK_ERROR: u32 = 5;
/// Samples of user tasks whose user stack could not be read.
pub const STAT_USER_STACK_ERROR: u32 = 6;
/// Samples whose kernel stack filled every slot.
pub const STAT_KERNEL_TRUNCATED: u32 = 7;
/// Samples whose user stack filled every slot.
pub const STAT_USER_TRUNCATED: u32 = 8;
/// Gauge, not a counter: bytes waiting in the ring buffer as last seen by this CPU.
pub const STAT_RINGBUF_PENDING_BYTES: u32 = 9;
/// User stacks that reached the outermost frame (complete).
pub const STAT_UNWIND_COMPLETE: u32 = 10;
/// User stacks cut at `MAX_USER_FRAMES`.
pub const STAT_UNWIND_DEPTH_LIMIT: u32 = 11;
/// User stacks stopped because stack memory could not be read.
pub const STAT_UNWIND_READ_ERROR: u32 = 12;
/// User stacks stopped because a frame did not move up the stack (corrupt or looping).
pub const STAT_UNWIND_BAD_FRAME: u32 = 13;
/// Samples without user registers (kernel threads).
pub const STAT_UNWIND_NO_USER_CONTEXT: u32 = 14;
/// User frames unwound, all methods.
pub const STAT_UNWIND_FRAMES: u32 = 15;
/// Frame-pointer steps because the PC was in no registered mapping.
pub const STAT_UNWIND_FP_NO_MAPPING: u32 = 16;
/// Frame-pointer steps because the mapping's table had no page for the PC.
pub const STAT_UNWIND_FP_NO_TABLE: u32 = 17;
/// Frame-pointer steps because no CFI covers the PC (gaps, JIT, unsupported expressions).
pub const STAT_UNWIND_FP_NO_CFI: u32 = 18;
/// Signal frames stepped through.
pub const STAT_UNWIND_SIGNAL_FRAMES: u32 = 19;
/// PLT frames stepped through.
pub const STAT_UNWIND_PLT_FRAMES: u32 = 20;
/// Process events lost because the events ring buffer was full.
pub const STAT_EVENTS_LOST: u32 = 21;
/// User stacks whose frame-pointer chain ended without reaching the outermost frame.
pub const STAT_UNWIND_FP_END: u32 = 22;
/// Samples of registered Python processes (a Python walk was attempted).
pub const STAT_PYTHON_WALKS: u32 = 23;
/// Python frames recorded.
pub const STAT_PYTHON_FRAMES: u32 = 24;
/// Python walks that found no thread state for the sampled thread (not a Python thread, or
/// the interpreter is not initialised).
pub const STAT_PYTHON_NO_THREAD_STATE: u32 = 25;
/// Python walks stopped by unreadable memory.
pub const STAT_PYTHON_READ_ERROR: u32 = 26;
/// Python walks cut at `MAX_PYTHON_FRAMES`.
pub const STAT_PYTHON_TRUNCATED: u32 = 27;
/// CUDA calls seen by the probes and reported (after removing the runtime's own driver calls).
pub const STAT_CUDA_EVENTS: u32 = 28;
/// Driver calls made by the runtime on the application's behalf, not counted twice.
pub const STAT_CUDA_NESTED: u32 = 29;
/// CUDA events sent with a stack.
pub const STAT_CUDA_STACKS: u32 = 30;
/// CUDA events sent without a stack because the thread's budget was used up.
pub const STAT_CUDA_STACKS_RATE_LIMITED: u32 = 31;
/// CUDA events lost because the `CUDA_EVENTS` ring buffer was full.
pub const STAT_CUDA_EVENTS_LOST: u32 = 32;
/// Kernel handles named (`__cudaGetKernel`, `cuModuleGetFunction`, `cuLibraryGetKernel`).
pub const STAT_CUDA_NAMES: u32 = 33;
/// Returns with no matching entry state (thread state evicted or the probe attached mid-call).
pub const STAT_CUDA_UNMATCHED_RETURNS: u32 = 34;
/// Successful naming or allocation calls whose out-parameter or name string could not be read
/// (the handle or pointer stays unknown).
pub const STAT_CUDA_UNREADABLE_RESULTS: u32 = 35;
/// Return addresses unwound from RBP alone in files whose table shows reliable frame pointers
/// (`MAPPING_RELIABLE_FRAME_POINTERS`), not a fallback.
pub const STAT_UNWIND_FRAME_POINTER_CODE: u32 = 36;
/// Walks stopped for the agent to finish, with a copy of the stack (`SAMPLE_USER_STACK_COPY`):
/// the process was not registered yet, or a frame's table was not loaded.
pub const STAT_UNWIND_STACK_COPIES: u32 = 37;
/// Of those, copies whose first page could not be read (no bytes to finish the walk with).
pub const STAT_UNWIND_STACK_COPY_EMPTY: u32 = 38;
/// Walks that stopped for a copy while the ring was over half full: no copy was sent, the
/// stack ends at the last proven frame (marked truncated).
pub const STAT_UNWIND_STACK_COPY_SHED: u32 = 39;
/// CUDA calls that returned an error (reported as failed, never as work).
pub const STAT_CUDA_FAILED: u32 = 40;
/// CUDA events given a stack outside the budget as the first of their kind on their thread.
pub const STAT_CUDA_FIRST_STACKS: u32 = 41;
/// Return addresses restored from a pending CUDA return probe (the stack slot held the
/// kernel's uretprobe trampoline).
pub const STAT_UNWIND_RETURN_PROBE_FRAMES: u32 = 42;
/// Blocking switches off-CPU profiling saw (every thread's, before the draw and the filters).
pub const STAT_OFF_CPU_SWITCHES: u32 = 43;
/// Blocks sampled (drawn, of a user thread the filters keep): a stack was taken and sent.
pub const STAT_OFF_CPU_STACKS: u32 = 44;
/// Sampled threads switched in again (an `OFF_CPU_WOKEN` record sent).
pub const STAT_OFF_CPU_WOKEN: u32 = 45;
/// Off-CPU records lost because the `OFF_CPU` ring buffer was full.
pub const STAT_OFF_CPU_LOST: u32 = 46;
/// Walks of a registered process stopped for a copy at code in a file it mapped after it was
/// registered (a library loaded since): the agent finishes them once it has read the mapping.
/// Also counted in `STAT_UNWIND_FP_NO_MAPPING`.
pub const STAT_UNWIND_NEW_FILE_MAPPING: u32 = 47;
/// Number of slots in `STATS`.
pub const STAT_COUNT: u32 = 48;

/// The single value per CPU of the `STATS` map: all of that CPU's counters side by side, so a
/// sample's counting touches a couple of cache lines instead of one allocation per counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatCounters {
    pub counters: [u64; STAT_COUNT as usize],
}

impl Default for StatCounters {
    fn default() -> Self {
        StatCounters {
            counters: [0; STAT_COUNT as usize],
        }
    }
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for StatCounters {}

/// Human-readable names, indexed by id, used for logs and metrics.
pub const STAT_NAMES: [&str; 48] = [
    "samples_seen",
    "samples_sent",
    "ringbuf_full",
    "idle",
    "filtered",
    "kernel_stack_error",
    "user_stack_error",
    "kernel_truncated",
    "user_truncated",
    "ringbuf_pending_bytes",
    "unwind_complete",
    "unwind_depth_limit",
    "unwind_read_error",
    "unwind_bad_frame",
    "unwind_no_user_context",
    "unwind_frames",
    "unwind_fp_no_mapping",
    "unwind_fp_no_table",
    "unwind_fp_no_cfi",
    "unwind_signal_frames",
    "unwind_plt_frames",
    "events_lost",
    "unwind_fp_end",
    "python_walks",
    "python_frames",
    "python_no_thread_state",
    "python_read_error",
    "python_truncated",
    "cuda_events",
    "cuda_nested",
    "cuda_stacks",
    "cuda_stacks_rate_limited",
    "cuda_events_lost",
    "cuda_names",
    "cuda_unmatched_returns",
    "cuda_unreadable_results",
    "unwind_frame_pointer_code",
    "unwind_stack_copies",
    "unwind_stack_copy_empty",
    "unwind_stack_copy_shed",
    "cuda_failed",
    "cuda_first_stacks",
    "unwind_return_probe_frames",
    "off_cpu_switches",
    "off_cpu_stacks",
    "off_cpu_woken",
    "off_cpu_lost",
    "unwind_new_file_mapping",
];

const _: () = assert!(STAT_NAMES.len() as u32 <= STAT_COUNT);
