//! The ABI between the eBPF sampler (`profiler-ebpf`) and the agent (`profiler-user`).
//!
//! Everything that crosses the kernel/user boundary is defined here once: `#[repr(C)]` structs
//! with fixed-width integers and explicit padding (no `bool`, no implicit holes), map and program
//! names, limits and counter ids. Layouts are pinned by compile-time assertions so that a change
//! on one side cannot silently desynchronise the other.
#![no_std]

pub mod gpu;
pub mod off_cpu;
pub mod python;
pub mod sample;
pub mod stats;
pub mod unwind;

pub use gpu::*;
pub use off_cpu::*;
pub use python::*;
pub use sample::*;
pub use stats::*;

/// Names of the programs and maps in the eBPF object, shared so neither side spells them twice.
pub mod names {
    pub const PROGRAM_SAMPLE_CPU: &str = "sample_cpu";
    pub const MAP_SAMPLES: &str = "SAMPLES";
    pub const MAP_STATS: &str = "STATS";
    pub const MAP_PID_FILTER: &str = "PID_FILTER";
    pub const MAP_CONFIG: &str = "CONFIG";
    pub const PROGRAM_PROCESS_EXIT: &str = "process_exit";
    pub const TRACEPOINT_PROCESS_EXIT: &str = "sched_process_exit";
    pub const PROGRAM_PROCESS_EXEC: &str = "process_exec";
    pub const TRACEPOINT_PROCESS_EXEC: &str = "sched_process_exec";
    pub const PROGRAM_PROCESS_FORK: &str = "process_fork";
    pub const TRACEPOINT_PROCESS_FORK: &str = "sched_process_fork";
    /// One program on the tracepoints that move tasks between cgroups.
    pub const PROGRAM_CGROUP_MIGRATION: &str = "cgroup_migration";
    pub const TRACEPOINTS_CGROUP_MIGRATION: [&str; 2] =
        ["cgroup_attach_task", "cgroup_transfer_tasks"];
    /// One program on the tracepoints that change cgroup paths or hierarchies.
    pub const PROGRAM_CGROUPS_CHANGED: &str = "cgroups_changed";
    pub const TRACEPOINTS_CGROUPS_CHANGED: [&str; 3] =
        ["cgroup_rename", "cgroup_setup_root", "cgroup_destroy_root"];
    pub const MAP_EVENTS: &str = "EVENTS";
    pub const MAP_UNWIND_ROWS: &str = "UNWIND_ROWS";
    pub const MAP_SCRATCH_SAMPLE: &str = "SCRATCH_SAMPLE";
    pub const MAP_UNWIND_PAGES: &str = "UNWIND_PAGES";
    pub const MAP_PROCESS_MAPPINGS: &str = "PROCESS_MAPPINGS";
    pub const MAP_PYTHON_PROCESSES: &str = "PYTHON_PROCESSES";
    pub const MAP_PYTHON_THREADS: &str = "PYTHON_THREADS";
    pub const PROGRAM_CUDA_ENTRY: &str = "cuda_entry";
    pub const PROGRAM_CUDA_RETURN: &str = "cuda_return";
    pub const MAP_CUDA_EVENTS: &str = "CUDA_EVENTS";
    pub const MAP_CUDA_CONFIG: &str = "CUDA_CONFIG";
    pub const PROGRAM_OFF_CPU: &str = "off_cpu_switch";
    pub const TRACEPOINT_SCHED_SWITCH: &str = "sched_switch";
    pub const MAP_OFF_CPU: &str = "OFF_CPU";
}

/// Default capacity of `UNWIND_ROWS` in chunks (the agent sets it from its memory budget).
pub const DEFAULT_ROW_CHUNKS: u32 = 16_384;
/// Capacity of `UNWIND_PAGES` (64 KiB pages: 4 GiB of code).
pub const MAX_UNWIND_PAGES: u32 = 65_536;
/// Capacity of `PROCESS_MAPPINGS` (LPM prefixes; a mapping needs up to ~40).
pub const MAX_MAPPING_PREFIXES: u32 = 262_144;

/// Run-time settings written by the agent into the single-entry `CONFIG` array before attaching.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SamplerConfig {
    /// Non-zero: only processes (thread-group ids) present in `PID_FILTER` are sampled.
    pub filter_pids: u32,
    /// Non-zero: samples of the idle task (pid 0) are kept instead of only counted.
    pub keep_idle: u32,
    /// Offset of `thread.fsbase` in `task_struct` (from the kernel's BTF), 0 when unknown:
    /// the FS base is `pthread_self()`, which identifies a thread's Python thread state.
    pub task_fsbase_offset: u32,
    /// Offsets of `signal` in `task_struct` and of `live` (threads not yet exiting) in
    /// `signal_struct`, 0 when unknown: the exit tracepoint reports a process when its last
    /// thread exits, not when its leader does.
    pub task_signal_offset: u32,
    pub signal_live_offset: u32,
    /// Non-zero once the CUDA probes are loaded: only then can a thread be inside a CUDA
    /// synchronization, so samples skip that lookup before.
    pub cuda_probes: u32,
    /// Offsets the exec and fork events read (0 when the BTF lacks one; that part is left 0).
    pub identity: IdentityOffsets,
    /// Off-CPU profiling: a blocking switch is sampled when `bpf_get_prandom_u32()` is below
    /// this (0: off; [`OFF_CPU_EVERY_SWITCH`]: every one).
    pub off_cpu_threshold: u32,
    /// The agent's own process, whose threads' waits are left out.
    pub off_cpu_exclude_pid: u32,
    /// Offset of `vm_file` in `vm_area_struct`, 0 when unknown. A registered process running
    /// code in no registered mapping: in a file (a library loaded since), the walk stops for a
    /// stack copy the agent finishes once it has read the new mapping; else (JIT code) it goes
    /// on by frame pointers.
    pub vma_file_offset: u32,
    /// Offsets of `root` in `struct cgroup` and of `hierarchy_id` in `struct cgroup_root`, 0
    /// when unknown: then a move event does not say where the task went.
    pub cgroup_root_offset: u32,
    pub cgroup_root_hierarchy_offset: u32,
}

/// Kernel struct offsets (from the BTF) behind the exec and fork events.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IdentityOffsets {
    pub binprm_filename: u32,
    pub binprm_file: u32,
    pub file_inode: u32,
    pub inode_ino: u32,
    pub inode_sb: u32,
    pub sb_dev: u32,
    pub task_mm: u32,
    pub task_pid: u32,
    pub task_tgid: u32,
    pub mm_start_code: u32,
    pub mm_end_code: u32,
    pub mm_arg_start: u32,
    pub mm_arg_end: u32,
    pub mm_env_start: u32,
    pub mm_env_end: u32,
    /// Non-zero when every offset above was found.
    pub complete: u32,
}

const _: () = assert!(core::mem::size_of::<IdentityOffsets>() == 64);
const _: () = assert!(core::mem::size_of::<SamplerConfig>() == 108);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for SamplerConfig {}
    unsafe impl aya::Pod for IdentityOffsets {}
    unsafe impl aya::Pod for unwind::UnwindRow {}
    unsafe impl aya::Pod for unwind::RowChunk {}
    unsafe impl aya::Pod for unwind::PageKey {}
    unsafe impl aya::Pod for unwind::PageEntry {}
    unsafe impl aya::Pod for unwind::MappingKey {}
    unsafe impl aya::Pod for unwind::MappingValue {}
    unsafe impl aya::Pod for python::PyProcInfo {}
    unsafe impl aya::Pod for python::PyFrameRecord {}
    unsafe impl aya::Pod for python::PyThreadEntry {}
}
