//! The maps and helpers every program shares: the per-CPU counters, the pid filter, the
//! sampler's configuration, the scratch records and the one function that writes a sample
//! record into a ring buffer. Programs import these from here; nothing here imports a
//! program's module, so the crate's modules form no cycle (`sampler` → `cuda`, `python`,
//! `user_stack` → `shared`).
use core::{ffi::c_void, mem::MaybeUninit, ptr};

use aya_ebpf::{
    bindings::{BPF_RB_NO_WAKEUP, bpf_dynptr},
    helpers::{
        bpf_get_smp_processor_id,
        generated::{
            bpf_dynptr_write, bpf_ringbuf_discard_dynptr, bpf_ringbuf_reserve_dynptr,
            bpf_ringbuf_submit_dynptr,
        },
    },
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
};
use profiler_common::{
    MAX_FILTERED_PIDS, MAX_KERNEL_FRAMES, MAX_PYTHON_FRAMES, MAX_USER_FRAMES, PyFrameRecord,
    RawSample, SAMPLE_HEADER_BYTES, SAMPLE_USER_STACK_COPY, STACK_COPY_BYTES,
    STACK_COPY_HEADER_BYTES, STAT_COUNT, SamplerConfig, ScratchRecord, StatCounters,
    sample_record_bytes, stack_copy_record_bytes,
};

/// One value per CPU holding every counter (see `StatCounters`).
#[map(name = "STATS")]
pub(crate) static STATS: PerCpuArray<StatCounters> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "PID_FILTER")]
pub(crate) static PID_FILTER: HashMap<u32, u8> = HashMap::with_max_entries(MAX_FILTERED_PIDS, 0);

#[map(name = "CONFIG")]
pub(crate) static CONFIG: Array<SamplerConfig> = Array::with_max_entries(1, 0);

pub(crate) use profiler_common::SCRATCH_SLOTS;
pub(crate) const SLOT_SAMPLER: u32 = 0;
pub(crate) const SLOT_CUDA: u32 = 1;
pub(crate) const SLOT_OFF_CPU: u32 = 2;

/// The records under construction, `SCRATCH_SLOTS` per CPU (the agent sizes the map to the
/// possible CPUs): too large for the 512-byte BPF stack, and the unwinder's bpf_loop callback
/// fills them too. A plain array, not a per-CPU one: a record with 1,024 Python frames and a
/// stack copy is over the 32 KiB a per-CPU value may have.
#[map(name = "SCRATCH_SAMPLE")]
pub(crate) static SCRATCH_SAMPLE: Array<ScratchRecord> = Array::with_max_entries(SCRATCH_SLOTS, 0);

/// This CPU's scratch record for `slot`.
#[inline(always)]
pub(crate) fn scratch_record(slot: u32) -> Option<*mut ScratchRecord> {
    let cpu = unsafe { bpf_get_smp_processor_id() };
    SCRATCH_SAMPLE.get_ptr_mut(cpu.wrapping_mul(SCRATCH_SLOTS).wrapping_add(slot))
}

/// The sample part of this CPU's scratch record for `slot`.
#[inline(always)]
pub(crate) fn scratch_sample(slot: u32) -> Option<*mut RawSample> {
    let record = scratch_record(slot)?;
    // SAFETY: a field of a valid map value.
    Some(unsafe { &raw mut (*record).sample })
}

#[inline(always)]
pub(crate) fn count(stat: u32) {
    count_by(stat, 1);
}

#[inline(always)]
pub(crate) fn count_by(stat: u32, amount: u64) {
    if stat >= STAT_COUNT {
        return;
    }
    if let Some(stats) = STATS.get_ptr_mut(0) {
        // Per-CPU value, and perf-event programs do not nest on one CPU: a plain add is safe
        // there (a uprobe's count interrupted by a sample may lose one increment).
        unsafe { (*stats).counters[stat as usize] += amount };
    }
}

/// Sends `prefix` (`prefix_len` bytes, may be 0) followed by the used part of `sample` as one
/// record: header, user frames, kernel frames, Python frames (`profiler_common::sample`).
/// Returns false when the ring buffer had no room.
///
/// # Safety
/// `prefix` must point to `prefix_len` readable bytes of a map value and `sample` to a scratch
/// sample whose frame counts were set by this program.
#[inline(always)]
pub(crate) unsafe fn output_sample<T>(
    ring: &RingBuf,
    prefix: *const T,
    prefix_len: u32,
    sample: *const RawSample,
) -> bool {
    unsafe {
        // Clamped, so the verifier sees every copy stay within its array.
        let mut user = ptr::read_volatile(&raw const (*sample).header.user_frames) as u32;
        if user > MAX_USER_FRAMES as u32 {
            user = MAX_USER_FRAMES as u32;
        }
        let mut kernel = ptr::read_volatile(&raw const (*sample).header.kernel_frames) as u32;
        if kernel > MAX_KERNEL_FRAMES as u32 {
            kernel = MAX_KERNEL_FRAMES as u32;
        }
        let mut python = ptr::read_volatile(&raw const (*sample).header.python_frames) as u32;
        if python > MAX_PYTHON_FRAMES as u32 {
            python = MAX_PYTHON_FRAMES as u32;
        }
        let user_bytes = user * 8;
        let kernel_bytes = kernel * 8;
        let python_bytes = python * size_of::<PyFrameRecord>() as u32;
        let has_copy =
            ptr::read_volatile(&raw const (*sample).header.flags) & SAMPLE_USER_STACK_COPY != 0;
        let mut copied = 0;
        if has_copy {
            copied = ptr::read_volatile(&raw const (*sample).copy.bytes);
            if copied > STACK_COPY_BYTES as u32 {
                copied = STACK_COPY_BYTES as u32;
            }
        }
        let copy_bytes = if has_copy {
            stack_copy_record_bytes(copied as usize) as u32
        } else {
            0
        };
        let size = prefix_len
            + sample_record_bytes(kernel as usize, user as usize, python as usize) as u32
            + copy_bytes;

        let mut record = MaybeUninit::<bpf_dynptr>::uninit();
        let record = record.as_mut_ptr();
        // A ring buffer map's address is what the helpers take as the map.
        let map = (ring as *const RingBuf).cast_mut().cast::<c_void>();
        if bpf_ringbuf_reserve_dynptr(map, size, 0, record) != 0 {
            // The verifier insists on releasing even a failed reservation.
            bpf_ringbuf_discard_dynptr(record, 0);
            return false;
        }
        let mut offset = 0;
        if prefix_len > 0 {
            bpf_dynptr_write(record, 0, prefix.cast_mut().cast(), prefix_len, 0);
            offset = prefix_len;
        }
        let parts: [(*const u8, u32); 4] = [
            (
                (&raw const (*sample).header).cast(),
                SAMPLE_HEADER_BYTES as u32,
            ),
            ((&raw const (*sample).user_ips).cast(), user_bytes),
            ((&raw const (*sample).kernel_ips).cast(), kernel_bytes),
            ((&raw const (*sample).python).cast(), python_bytes),
        ];
        for (source, length) in parts {
            bpf_dynptr_write(record, offset, source.cast_mut().cast(), length, 0);
            offset += length;
        }
        if has_copy {
            bpf_dynptr_write(
                record,
                offset,
                (&raw const (*sample).copy).cast_mut().cast(),
                STACK_COPY_HEADER_BYTES as u32,
                0,
            );
            offset += STACK_COPY_HEADER_BYTES as u32;
            if copied > 0 {
                bpf_dynptr_write(
                    record,
                    offset,
                    (&raw const (*sample).stack).cast_mut().cast(),
                    copied,
                    0,
                );
            }
        }
        // No wakeup per sample: the agent drains the buffer on a timer, which costs it a few
        // wakeups a second instead of one per sample.
        bpf_ringbuf_submit_dynptr(record, BPF_RB_NO_WAKEUP as u64);
        true
    }
}
