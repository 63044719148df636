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
/// Number of slots in `STATS`.
pub const STAT_COUNT: u32 = 16;

/// Human-readable names, indexed by id, used for logs and metrics.
pub const STAT_NAMES: [&str; 10] = [
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
];

const _: () = assert!(STAT_NAMES.len() as u32 <= STAT_COUNT);
