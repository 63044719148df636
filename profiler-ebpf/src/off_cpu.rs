//! Off-CPU time: `off_cpu_switch` runs on every `sched_switch`.
//!
//! For the thread switched out (`prev`, still the current task) that blocks (interruptible or
//! uninterruptible sleep, not a preemption), it decides with a fixed probability whether to
//! sample this block: if so it takes the thread's stack exactly as the CPU sampler does and
//! sends it as an `OFF_CPU_BLOCKED` record, and remembers the switch-out time by tid. For the
//! thread switched in (`next`), a remembered time ends the block: an `OFF_CPU_WOKEN` record
//! carries its duration. Keyed by tid in one global map, so a thread that wakes on another
//! CPU is timed once, from its switch-out to its switch-in.
use aya_ebpf::{
    EbpfContext,
    bindings::BPF_RB_AVAIL_DATA,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_kernel,
        generated::{bpf_get_current_task, bpf_get_prandom_u32},
    },
    macros::{map, raw_tracepoint},
    maps::{LruHashMap, PerCpuArray, RingBuf},
    programs::RawTracePointContext,
};
use profiler_common::{
    MAX_OFF_CPU_BLOCKED_THREADS, OFF_CPU_BLOCKED, OFF_CPU_EVERY_SWITCH, OFF_CPU_HEADER_BYTES,
    OFF_CPU_RING_BYTES, OFF_CPU_WOKEN, OffCpuHeader, STAT_OFF_CPU_LOST, STAT_OFF_CPU_STACKS,
    STAT_OFF_CPU_SWITCHES, STAT_OFF_CPU_WOKEN, SamplerConfig, TASK_BLOCKED_STATES, TASK_DEAD_STATE,
};

use crate::{
    cuda,
    sampler::take_stacks,
    shared::{CONFIG, PID_FILTER, SLOT_OFF_CPU, count, output_sample, scratch_sample},
    user_stack,
};

#[map(name = "OFF_CPU")]
static OFF_CPU: RingBuf = RingBuf::with_byte_size(OFF_CPU_RING_BYTES, 0);

/// tid → switch-out time of the sampled block it is in.
#[map(name = "OFF_CPU_BLOCKED_THREADS")]
static BLOCKED_THREADS: LruHashMap<u32, u64> =
    LruHashMap::with_max_entries(MAX_OFF_CPU_BLOCKED_THREADS, 0);

/// The header of the record under construction (the record's prefix must be map memory).
#[map(name = "OFF_CPU_HEADER")]
static HEADER: PerCpuArray<OffCpuHeader> = PerCpuArray::with_max_entries(1, 0);

/// `sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
/// unsigned int prev_state)`, as a raw tracepoint: the arguments are the context's words.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn off_cpu_switch(ctx: RawTracePointContext) -> i32 {
    // A reference, not a copy: this runs on every context switch of the machine.
    let Some(config) = CONFIG.get(0) else {
        return 0;
    };
    if config.off_cpu_threshold == 0 {
        return 0;
    }
    // SAFETY: the raw tracepoint's context is its argument array.
    let (next, prev_state) = unsafe {
        let args = ctx.as_ptr() as *const u64;
        (*args.add(2), *args.add(3) as u32)
    };
    let now = unsafe { bpf_ktime_get_ns() };
    woken(next, now, config);
    if prev_state & TASK_BLOCKED_STATES != 0 && prev_state & TASK_DEAD_STATE == 0 {
        count(STAT_OFF_CPU_SWITCHES);
        // The draw first: most blocks are not sampled, and need no other check.
        if config.off_cpu_threshold == OFF_CPU_EVERY_SWITCH
            || unsafe { bpf_get_prandom_u32() } < config.off_cpu_threshold
        {
            blocked(ctx.as_ptr(), now, config);
        }
    }
    0
}

/// `next` runs again: ends its sampled block, if it is in one.
#[inline(always)]
fn woken(next: u64, now: u64, config: &SamplerConfig) {
    let offsets = &config.identity;
    if offsets.task_pid == 0 || next == 0 {
        return;
    }
    // SAFETY: kernel reads through the probe-read helper, which fails cleanly.
    let tid: i32 = unsafe { bpf_probe_read_kernel((next + offsets.task_pid as u64) as *const i32) }
        .unwrap_or(0);
    if tid <= 0 {
        return;
    }
    let tid = tid as u32;
    // SAFETY: a copy of the value is taken before the entry is removed.
    let Some(blocked_ns) = (unsafe { BLOCKED_THREADS.get(&tid) }).copied() else {
        return;
    };
    let _ = BLOCKED_THREADS.remove(&tid);
    let pid: i32 =
        unsafe { bpf_probe_read_kernel((next + offsets.task_tgid as u64) as *const i32) }
            .unwrap_or(0);
    let header = OffCpuHeader {
        kind: OFF_CPU_WOKEN,
        tid,
        pid: pid as u32,
        _pad: 0,
        blocked_ns,
        duration_ns: now.saturating_sub(blocked_ns),
    };
    if OFF_CPU.output::<OffCpuHeader>(&header, 0).is_ok() {
        count(STAT_OFF_CPU_WOKEN);
    } else {
        count(STAT_OFF_CPU_LOST);
    }
}

/// The current task blocks and this block was drawn: unless the task is left out, takes its
/// stack now (the duration comes at its switch-in).
#[inline(always)]
fn blocked(ctx: *mut core::ffi::c_void, now: u64, config: &SamplerConfig) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    if tgid == 0 || tgid == config.off_cpu_exclude_pid {
        return;
    }
    // Kernel threads have no mm: their waits are the kernel's business.
    if config.identity.task_mm != 0 {
        // SAFETY: kernel read through the probe-read helper.
        let mm: u64 = unsafe {
            bpf_probe_read_kernel(
                (bpf_get_current_task() + config.identity.task_mm as u64) as *const u64,
            )
        }
        .unwrap_or(0);
        if mm == 0 {
            return;
        }
    }
    if config.filter_pids != 0 && unsafe { PID_FILTER.get(&tgid) }.is_none() {
        return;
    }
    let Some(sample) = scratch_sample(SLOT_OFF_CPU) else {
        return;
    };
    let Some(header) = HEADER.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch slot and header; a sched_switch does not nest on a CPU.
    unsafe {
        *header = OffCpuHeader {
            kind: OFF_CPU_BLOCKED,
            tid,
            pid: tgid,
            _pad: 0,
            blocked_ns: now,
            duration_ns: 0,
        };
        let sample_header = &mut (*sample).header;
        sample_header.ktime_ns = now;
        sample_header.pid = tgid;
        sample_header.tid = tid;
        sample_header.cpu = bpf_get_smp_processor_id();
        sample_header.python_frames = 0;
        sample_header.comm = bpf_get_current_comm().unwrap_or([0; 16]);
        sample_header.flags = 0;
        let cuda_thread = if config.cuda_probes != 0 {
            cuda::thread(tid)
        } else {
            None
        };
        let copy_allowed =
            OFF_CPU.query(BPF_RB_AVAIL_DATA as u64) < (OFF_CPU_RING_BYTES / 2) as u64;
        take_stacks(
            ctx,
            SLOT_OFF_CPU,
            sample,
            config,
            false,
            user_stack::task_user_registers(),
            copy_allowed,
            cuda_thread,
        );
        if !output_sample(
            &OFF_CPU,
            header as *const OffCpuHeader,
            OFF_CPU_HEADER_BYTES as u32,
            sample,
        ) {
            count(STAT_OFF_CPU_LOST);
            return;
        }
    }
    count(STAT_OFF_CPU_STACKS);
    let _ = BLOCKED_THREADS.insert(&tid, &now, 0);
}
