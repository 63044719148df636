//! The CUDA part of the ABI: which probed call a uprobe fired for (its attach cookie), the
//! per-thread state the probes keep, and the records they write into the `CUDA_EVENTS` ring.
//!
//! One uprobe program (`cuda_entry`) and one uretprobe program (`cuda_return`) serve every
//! probed function; the agent attaches them with the function's `CALL_*` id as the cookie.

use crate::sample::RawSample;

/// Bits 0..8 of a cookie: the `CALL_*` id. Ids are never reused.
pub const CALL_ID_MASK: u64 = 0xff;
/// Bit 32 of a cookie: the function is a trampoline that jumps (a tail call, the stack left as
/// at its entry) into another probed runtime function of its family, as CUDA 13's
/// `__cudaLaunchKernel` jumps into `cudaLaunchKernel`. Its entry counts the call and leaves the
/// stack pointer in [`CudaThread::tail_call_sp`]; the entry of the function it jumps into, seen
/// with that same stack pointer, is the same call and is not counted again.
pub const CALL_FLAG_TAIL_CALL: u64 = 1 << 32;

/// `cudaLaunchKernel(func, grid, block, args, smem, stream)` and the cooperative form: rdi = stub.
pub const CALL_RT_LAUNCH: u32 = 1;
/// `cudaLaunchKernelExC(config, func, args)`: rsi = stub.
pub const CALL_RT_LAUNCH_EXC: u32 = 2;
/// `__cudaLaunchKernel(kernel, ...)`: rdi = a `cudaKernel_t` handle from `__cudaGetKernel`.
pub const CALL_RT_LAUNCH_HANDLE: u32 = 3;
/// `__cudaGetKernel(cudaKernel_t *out, const void *stub)`: names the handle at return.
pub const CALL_RT_GET_KERNEL: u32 = 4;
/// `cudaGraphLaunch(exec, stream)`.
pub const CALL_RT_GRAPH_LAUNCH: u32 = 5;
/// `cudaMemcpy(dst, src, bytes, kind[, stream])`: rdx = bytes, rcx = kind.
pub const CALL_RT_MEMCPY: u32 = 6;
/// `cudaMalloc(void **p, bytes[, stream])`: rsi = bytes; `*p` (the device pointer) at return.
pub const CALL_RT_MALLOC: u32 = 7;
/// `cudaFree(p[, stream])`: rdi = the device pointer.
pub const CALL_RT_FREE: u32 = 8;
/// `cudaDeviceSynchronize()`, `cudaStreamSynchronize(s)`, `cudaEventSynchronize(e)`.
pub const CALL_RT_SYNC: u32 = 9;
/// Any other runtime entry point probed only to mark "inside the runtime".
pub const CALL_RT_OTHER: u32 = 10;

/// `cuLaunchKernel(f, ...)` and the cooperative form: rdi = function handle.
pub const CALL_DRV_LAUNCH: u32 = 32;
/// `cuLaunchKernelEx(config, f, params, extra)`: rsi = function handle.
pub const CALL_DRV_LAUNCH_EX: u32 = 33;
/// `cuGraphLaunch(exec, stream)`.
pub const CALL_DRV_GRAPH_LAUNCH: u32 = 34;
/// `cuMemcpyHtoD*(dst, src, bytes[, stream])`.
pub const CALL_DRV_MEMCPY_HTOD: u32 = 35;
/// `cuMemcpyDtoH*`.
pub const CALL_DRV_MEMCPY_DTOH: u32 = 36;
/// `cuMemcpyDtoD*`.
pub const CALL_DRV_MEMCPY_DTOD: u32 = 37;
/// `cuMemcpy` / `cuMemcpyAsync` (direction from unified addressing: unknown here).
pub const CALL_DRV_MEMCPY: u32 = 38;
/// `cuMemAlloc_v2(CUdeviceptr *p, bytes)`, `cuMemAllocAsync`: rsi = bytes; `*p` at return.
pub const CALL_DRV_ALLOC: u32 = 39;
/// `cuMemFree_v2(p)`, `cuMemFreeAsync`: rdi = the device pointer.
pub const CALL_DRV_FREE: u32 = 40;
/// `cuCtxSynchronize()`, `cuStreamSynchronize(s)`, `cuEventSynchronize(e)`.
pub const CALL_DRV_SYNC: u32 = 41;
/// `cuModuleGetFunction(CUfunction *out, CUmodule, const char *name)` and
/// `cuLibraryGetKernel(CUkernel *out, CUlibrary, const char *name)`: names the handle at return.
pub const CALL_DRV_GET_FUNCTION: u32 = 42;

/// Runtime calls have ids below this; driver calls at or above it.
pub const CALL_FIRST_DRIVER: u32 = 32;

/// How long after a runtime call's entry a driver call of the same kind still counts as made by
/// that runtime call. The real runtime calls the driver within microseconds; a runtime call that
/// fails before reaching the driver leaves its mark for at most this long.
pub const RUNTIME_TO_DRIVER_NS: u64 = 1_000_000;

/// Whether a runtime call is probed at return too: synchronizations (time blocked),
/// `__cudaGetKernel` and allocations (their out-parameters: a handle, a device pointer). The
/// others (launches, copies, frees: the frequent calls) only leave a mark at entry that the
/// driver call they make consumes ([`call_family`]), because a return probe costs more than the
/// entry probe itself and hides the caller's frame from CPU samples taken inside the call.
#[inline(always)]
pub fn runtime_call_has_return_probe(call: u32) -> bool {
    matches!(
        call,
        CALL_RT_SYNC | CALL_RT_GET_KERNEL | CALL_RT_MALLOC | CALL_RT_OTHER
    )
}

/// Whether a call (runtime or driver) is probed at return too: see
/// [`runtime_call_has_return_probe`]; for the driver, synchronizations, the naming calls and
/// allocations.
#[inline(always)]
pub fn has_return_probe(call: u32) -> bool {
    if call < CALL_FIRST_DRIVER {
        runtime_call_has_return_probe(call)
    } else {
        matches!(call, CALL_DRV_SYNC | CALL_DRV_GET_FUNCTION | CALL_DRV_ALLOC)
    }
}

/// The family of a counted call probed at entry only, shared by a runtime call and the driver
/// call it makes (0: none; calls with a return probe are told apart by the runtime depth).
#[inline(always)]
pub fn call_family(call: u32) -> u32 {
    match call {
        CALL_RT_LAUNCH
        | CALL_RT_LAUNCH_EXC
        | CALL_RT_LAUNCH_HANDLE
        | CALL_DRV_LAUNCH
        | CALL_DRV_LAUNCH_EX => 1,
        CALL_RT_GRAPH_LAUNCH | CALL_DRV_GRAPH_LAUNCH => 2,
        CALL_RT_MEMCPY | CALL_DRV_MEMCPY_HTOD | CALL_DRV_MEMCPY_DTOH | CALL_DRV_MEMCPY_DTOD
        | CALL_DRV_MEMCPY => 3,
        CALL_RT_FREE | CALL_DRV_FREE => 5,
        _ => 0,
    }
}

/// `cudaMemcpyKind` values, also used for the driver's directions.
pub const MEMCPY_HOST_TO_HOST: u32 = 0;
pub const MEMCPY_HOST_TO_DEVICE: u32 = 1;
pub const MEMCPY_DEVICE_TO_HOST: u32 = 2;
pub const MEMCPY_DEVICE_TO_DEVICE: u32 = 3;
pub const MEMCPY_DEFAULT: u32 = 4;

/// `CudaEventHeader::flags`: a `RawSample` with the calling thread's stack follows the header.
pub const CUDA_EVENT_HAS_STACK: u32 = 1 << 0;
/// `CudaEventHeader::flags`: the record names a handle: `handle` is the handle, `aux` the host
/// stub (`__cudaGetKernel`) or 0, and a NUL-padded name of [`KERNEL_NAME_BYTES`] follows.
pub const CUDA_EVENT_NAME: u32 = 1 << 1;
/// `CudaEventHeader::flags`: the stack was not taken because the thread's stack budget
/// (`--cuda-stacks-per-second`) was used up.
pub const CUDA_EVENT_RATE_LIMITED: u32 = 1 << 2;
/// All flags this ABI version defines.
pub const CUDA_EVENT_KNOWN_FLAGS: u32 = (1 << 3) - 1;

/// Bytes of a kernel name read from the process (longer names are cut).
pub const KERNEL_NAME_BYTES: usize = 256;
/// Size of the `CUDA_EVENTS` ring buffer in bytes.
pub const CUDA_EVENTS_RING_BYTES: u32 = 4 << 20;
/// Entries of the per-thread `CUDA_THREADS` LRU map.
pub const MAX_CUDA_THREADS: u32 = 16_384;

/// The fixed part of every `CUDA_EVENTS` record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaEventHeader {
    /// `bpf_ktime_get_ns()` at the call (entry) or at its return (synchronization, allocation).
    pub ktime_ns: u64,
    /// Bytes (copies, allocations), nanoseconds blocked (synchronization), else 1.
    pub value: u64,
    /// Host stub, function or kernel handle, graph exec, the device pointer allocated or freed,
    /// or the handle a name record names.
    pub handle: u64,
    /// Memcpy direction (`MEMCPY_*`), or the stub of a name record.
    pub aux: u64,
    pub pid: u32,
    pub tid: u32,
    /// The attach cookie: the `CALL_*` id in bits 0..8, the agent's index of the probed
    /// function above (so the exact API name is known).
    pub call: u32,
    /// `CUDA_EVENT_*` bits.
    pub flags: u32,
}

pub const CUDA_EVENT_HEADER_BYTES: usize = core::mem::size_of::<CudaEventHeader>();
const _: () = assert!(CUDA_EVENT_HEADER_BYTES == 48);

/// The per-CPU scratch record: a CUDA header directly followed by a sample, so one ring
/// reservation carries both. The CPU sampler only sends `sample`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ScratchRecord {
    pub cuda: CudaEventHeader,
    pub sample: RawSample,
}

const _: () = assert!(core::mem::offset_of!(ScratchRecord, sample) == CUDA_EVENT_HEADER_BYTES);

/// A name record: header plus the name.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CudaNameRecord {
    pub header: CudaEventHeader,
    pub name: [u8; KERNEL_NAME_BYTES],
}

/// Per-thread state in `CUDA_THREADS` (keyed by tid).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaThread {
    /// Stack budget in nanoseconds of refill time (one stack costs 1e9).
    pub tokens: u64,
    pub refilled_ns: u64,
    /// When the outermost synchronization call began.
    pub sync_start_ns: u64,
    /// `__cudaGetKernel`: the out-parameter and the stub, read at return.
    pub rt_out: u64,
    pub rt_stub: u64,
    /// `cuModuleGetFunction` / `cuLibraryGetKernel`: the out-parameter and the name pointer.
    pub drv_out: u64,
    pub drv_name: u64,
    /// Runtime calls in progress: driver calls made meanwhile are the runtime's own.
    pub runtime_depth: u32,
    /// Synchronization calls in progress (CPU samples meanwhile are waits for the GPU).
    pub sync_depth: u32,
    /// The last runtime call probed at entry only: when it began and its [`call_family`]
    /// (0: none pending). The driver call it makes clears it.
    pub runtime_call_ns: u64,
    pub runtime_call_family: u32,
    pub _pad: u32,
    /// An allocation in progress: its out-parameter (the device pointer at return) and size.
    pub alloc_out: u64,
    pub alloc_bytes: u64,
    /// The stack pointer at the entry of a trampoline ([`CALL_FLAG_TAIL_CALL`]) whose jump
    /// target has not fired yet (0: none).
    pub tail_call_sp: u64,
}

const _: () = assert!(core::mem::size_of::<CudaThread>() == 104);

/// Settings written by the agent into the single-entry `CUDA_CONFIG` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaConfig {
    /// Stacks taken per thread and second at most (0: never take stacks).
    pub stacks_per_second: u32,
    /// Stacks a thread may take in a burst.
    pub stack_burst: u32,
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for CudaEventHeader {}
    unsafe impl aya::Pod for CudaThread {}
    unsafe impl aya::Pod for CudaConfig {}
}
