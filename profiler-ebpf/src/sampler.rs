use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA, bpf_perf_event_data},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        generated::bpf_get_stack,
    },
    macros::{map, perf_event},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::PerfEventContext,
};
use profiler_common::{
    MAX_FILTERED_PIDS, MAX_KERNEL_FRAMES, RawSample, SAMPLE_IN_USER_MODE,
    SAMPLE_KERNEL_STACK_ERROR, SAMPLE_KERNEL_TRUNCATED, SAMPLES_RING_BYTES, STAT_COUNT,
    STAT_FILTERED, STAT_IDLE, STAT_KERNEL_STACK_ERROR, STAT_KERNEL_TRUNCATED, STAT_RINGBUF_FULL,
    STAT_RINGBUF_PENDING_BYTES, STAT_SAMPLES_SEEN, STAT_SAMPLES_SENT, SamplerConfig,
};

use crate::user_stack;

#[map(name = "SAMPLES")]
static SAMPLES: RingBuf = RingBuf::with_byte_size(SAMPLES_RING_BYTES, 0);

#[map(name = "STATS")]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_COUNT, 0);

#[map(name = "PID_FILTER")]
static PID_FILTER: HashMap<u32, u8> = HashMap::with_max_entries(MAX_FILTERED_PIDS, 0);

#[map(name = "CONFIG")]
static CONFIG: Array<SamplerConfig> = Array::with_max_entries(1, 0);

#[inline(always)]
pub(crate) fn count(stat: u32) {
    if let Some(slot) = STATS.get_ptr_mut(stat) {
        // Per-CPU slot and perf-event programs do not nest on one CPU: a plain add is safe.
        unsafe { *slot += 1 };
    }
}

#[perf_event]
pub fn sample_cpu(ctx: PerfEventContext) -> u32 {
    count(STAT_SAMPLES_SEEN);
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    let config = CONFIG.get(0).copied().unwrap_or_default();

    if tgid == 0 && config.keep_idle == 0 {
        count(STAT_IDLE);
        return 0;
    }
    if config.filter_pids != 0 && unsafe { PID_FILTER.get(&tgid) }.is_none() {
        count(STAT_FILTERED);
        return 0;
    }

    let Some(mut entry) = SAMPLES.reserve::<RawSample>(0) else {
        count(STAT_RINGBUF_FULL);
        return 0;
    };
    let sample = entry.as_mut_ptr();
    // SAFETY: `sample` points at reserved ring-buffer memory of size_of::<RawSample>().
    unsafe {
        let header = &mut (*sample).header;
        header.ktime_ns = bpf_ktime_get_ns();
        header.pid = tgid;
        header.tid = tid;
        header.cpu = bpf_get_smp_processor_id();
        header._pad = 0;
        header.comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let mut flags = 0;

        let data = ctx.as_ptr() as *const bpf_perf_event_data;
        // Ring 3 in the saved code segment selector means the CPU was running user code.
        if (*data).regs.cs & 3 == 3 {
            flags |= SAMPLE_IN_USER_MODE;
        }

        let kernel_bytes = bpf_get_stack(
            ctx.as_ptr(),
            (*sample).kernel_ips.as_mut_ptr().cast(),
            (MAX_KERNEL_FRAMES * 8) as u32,
            0,
        );
        header.kernel_frames = if kernel_bytes > 0 {
            (kernel_bytes / 8) as u16
        } else {
            0
        };
        if kernel_bytes < 0 {
            // A sample taken in user mode has no kernel stack (-EFAULT): that is not an error.
            if flags & SAMPLE_IN_USER_MODE == 0 {
                flags |= SAMPLE_KERNEL_STACK_ERROR;
                count(STAT_KERNEL_STACK_ERROR);
            }
        } else if header.kernel_frames as usize == MAX_KERNEL_FRAMES {
            flags |= SAMPLE_KERNEL_TRUNCATED;
            count(STAT_KERNEL_TRUNCATED);
        }

        let (user_frames, user_flags) = user_stack::collect(&ctx, &mut (*sample).user_ips);
        header.user_frames = user_frames;
        header.flags = flags | user_flags;
    }
    entry.submit(0);
    count(STAT_SAMPLES_SENT);
    if let Some(slot) = STATS.get_ptr_mut(STAT_RINGBUF_PENDING_BYTES) {
        unsafe { *slot = SAMPLES.query(BPF_RB_AVAIL_DATA as u64) };
    }
    0
}

/// `bpf_get_stack` flag for user stacks, re-exported so the user-stack seam can use it.
pub(crate) const USER_STACK_FLAG: u64 = BPF_F_USER_STACK as u64;
