//! Off-CPU records: the `off_cpu_switch` program (on `sched_switch`) writes them into the
//! `OFF_CPU` ring buffer.
//!
//! A thread that blocks is sampled with a fixed probability when it is switched out: its stack
//! (kernel, native, Python) is taken then, while it is still the current task, and sent as an
//! [`OFF_CPU_BLOCKED`] record. When it is switched in again an [`OFF_CPU_WOKEN`] record with the
//! same `id` carries how long it was off the CPU. The agent pairs the two.

/// `OffCpuHeader::kind`: a sampled thread blocked; a sample record follows the header.
pub const OFF_CPU_BLOCKED: u32 = 1;
/// `OffCpuHeader::kind`: a sampled thread runs again; `duration_ns` is set.
pub const OFF_CPU_WOKEN: u32 = 2;

/// Size of the `OFF_CPU` ring buffer in bytes when off-CPU profiling is on (a page when off).
pub const OFF_CPU_RING_BYTES: u32 = 2 << 20;
/// Entries of `OFF_CPU_BLOCKED_THREADS` (sampled threads currently switched out).
pub const MAX_OFF_CPU_BLOCKED_THREADS: u32 = 16_384;

/// `SamplerConfig::off_cpu_threshold` for "every blocking switch".
pub const OFF_CPU_EVERY_SWITCH: u32 = u32::MAX;

/// `prev_state` bits of a thread that blocks: `TASK_INTERRUPTIBLE` and `TASK_UNINTERRUPTIBLE`
/// (which `TASK_KILLABLE` and `TASK_IDLE` include). A preempted thread is `TASK_RUNNING` (0).
pub const TASK_BLOCKED_STATES: u32 = 0x3;
/// `TASK_DEAD`: the last switch of an exiting thread, never counted.
pub const TASK_DEAD_STATE: u32 = 0x80;

/// Starts every off-CPU record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuHeader {
    /// `OFF_CPU_*`.
    pub kind: u32,
    pub tid: u32,
    /// Thread-group id.
    pub pid: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_ns()` at the switch-out: the block's id on its thread.
    pub blocked_ns: u64,
    /// [`OFF_CPU_WOKEN`]: nanoseconds from the switch-out to the switch-in.
    pub duration_ns: u64,
}

pub const OFF_CPU_HEADER_BYTES: usize = core::mem::size_of::<OffCpuHeader>();
const _: () = assert!(OFF_CPU_HEADER_BYTES == 32);

#[cfg(feature = "user")]
unsafe impl aya::Pod for OffCpuHeader {}
