//! The one seam through which the user-space part of a stack is collected.
//!
//! This version walks frame pointers with the kernel's `bpf_get_stack(BPF_F_USER_STACK)`, which
//! uses the task's saved user registers when the sample landed in the kernel. The table-driven
//! .eh_frame unwinder replaces the body of `collect` without touching the sampler.
use aya_ebpf::{EbpfContext, helpers::generated::bpf_get_stack, programs::PerfEventContext};
use profiler_common::{
    MAX_USER_FRAMES, SAMPLE_USER_STACK_ERROR, SAMPLE_USER_TRUNCATED, STAT_USER_STACK_ERROR,
    STAT_USER_TRUNCATED,
};

use crate::sampler::{USER_STACK_FLAG, count};

/// Fills `ips` innermost first; returns the number of frames and `SAMPLE_*` flags.
#[inline(always)]
pub(crate) fn collect(ctx: &PerfEventContext, ips: &mut [u64; MAX_USER_FRAMES]) -> (u16, u32) {
    let bytes = unsafe {
        bpf_get_stack(
            ctx.as_ptr(),
            ips.as_mut_ptr().cast(),
            (MAX_USER_FRAMES * 8) as u32,
            USER_STACK_FLAG,
        )
    };
    if bytes < 0 {
        // Kernel threads get 0 frames, not an error, so this is a user task whose stack failed.
        count(STAT_USER_STACK_ERROR);
        return (0, SAMPLE_USER_STACK_ERROR);
    }
    let frames = (bytes / 8) as u16;
    if frames as usize == MAX_USER_FRAMES {
        count(STAT_USER_TRUNCATED);
        return (frames, SAMPLE_USER_TRUNCATED);
    }
    (frames, 0)
}
