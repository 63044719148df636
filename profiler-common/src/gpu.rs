//! The CUDA part of the ABI: which probed call a uprobe fired for (its attach cookie), the
//! per-thread state the probes keep, and the records they write into the `CUDA_EVENTS` ring.
//!
//! One uprobe program (`cuda_entry`) and one uretprobe program (`cuda_return`) serve every
//! probed function; the agent attaches them with the function's `CALL_*` id as the cookie.

use crate::sample::RawSample;

/// Bits 0..8 of a cookie: the `CALL_*` id. Ids are never reused.
pub const CALL_ID_MASK: u64 = 0xff;

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

/// Every probed function is probed at entry and at return: a call is reported at its return,
/// and only when it succeeded (`cudaError_t` and `CUresult` are 0 on success), so a failed call
/// is never counted as work. The entry of the outermost probed call on a thread notes what it
/// will report; probed calls it makes meanwhile (the runtime's driver calls, a trampoline's jump
/// into another probed function) are nested and not reported again.
///
/// Nesting this deep is followed; deeper probed calls are still counted as nested, but CPU
/// samples taken inside them may show the kernel's return-probe trampoline.
pub const MAX_PENDING_RETURNS: usize = 4;

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
/// `CudaEventHeader::flags`: the call failed; `value` is its error code (`cudaError_t` or
/// `CUresult`), `handle` and `aux` are what a successful call would have reported.
pub const CUDA_EVENT_FAILED: u32 = 1 << 3;
/// `CudaEventHeader::flags`: the stack was taken because it is the first call of its kind
/// (kernel, direction) on its thread, outside the thread's budget, so that every later call of
/// that kind has a stack to stand on.
pub const CUDA_EVENT_FIRST_OF_KIND: u32 = 1 << 4;
/// All flags this ABI version defines.
pub const CUDA_EVENT_KNOWN_FLAGS: u32 = (1 << 5) - 1;

/// Bytes of a kernel name read from the process (longer names are cut).
pub const KERNEL_NAME_BYTES: usize = 256;
/// Size of the `CUDA_EVENTS` ring buffer in bytes (one page when the CUDA programs are not
/// loaded, and then no program writes to it).
pub const CUDA_EVENTS_RING_BYTES: u32 = 4 << 20;
/// Entries of the per-thread `CUDA_THREADS` LRU map.
pub const MAX_CUDA_THREADS: u32 = 16_384;
/// Entries of the `CUDA_STACK_KINDS` LRU map: the (thread, call, kernel or direction) kinds
/// that already had a stack.
pub const MAX_CUDA_STACK_KINDS: u32 = 16_384;

/// Key of `CUDA_STACK_KINDS`: what makes calls of a thread "of the same kind" for stack
/// sampling. The agent weights a call that came without a stack onto the last stack of its kind.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CudaStackKind {
    pub tid: u32,
    /// The `CALL_*` id, with bit 8 set for failed calls.
    pub call: u32,
    /// The kernel handle or stub (launches), the direction (copies), the error code (failed
    /// calls), else 0.
    pub key: u64,
}

impl CudaStackKind {
    /// The kind of a reported call (the fields of its [`CudaEventHeader`]).
    #[inline(always)]
    pub fn of(tid: u32, call: u32, flags: u32, value: u64, handle: u64, aux: u64) -> Self {
        let id = call & CALL_ID_MASK as u32;
        let failed = flags & CUDA_EVENT_FAILED != 0;
        let key = match id {
            _ if failed => value,
            CALL_RT_MEMCPY | CALL_DRV_MEMCPY_HTOD | CALL_DRV_MEMCPY_DTOH | CALL_DRV_MEMCPY_DTOD
            | CALL_DRV_MEMCPY => aux,
            CALL_RT_LAUNCH
            | CALL_RT_LAUNCH_EXC
            | CALL_RT_LAUNCH_HANDLE
            | CALL_RT_GRAPH_LAUNCH
            | CALL_DRV_LAUNCH
            | CALL_DRV_LAUNCH_EX
            | CALL_DRV_GRAPH_LAUNCH => handle,
            _ => 0,
        };
        CudaStackKind {
            tid,
            call: id | if failed { 0x100 } else { 0 },
            key,
        }
    }
}

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
    /// When the outermost call began (a synchronization's time blocked).
    pub call_start_ns: u64,
    /// `__cudaGetKernel`: the out-parameter and the stub, read at return.
    pub rt_out: u64,
    pub rt_stub: u64,
    /// `cuModuleGetFunction` / `cuLibraryGetKernel`: the out-parameter and the name pointer.
    pub drv_out: u64,
    pub drv_name: u64,
    /// The outermost call's attach cookie (its `call`), 0 when it reports nothing.
    pub pending_call: u32,
    /// Probed calls in progress (the outermost and the calls it made).
    pub depth: u32,
    /// What the outermost call reports at return: value, handle, aux as in [`CudaEventHeader`];
    /// for an allocation `handle` is the out-parameter, read at return for the device pointer.
    pub pending_value: u64,
    pub pending_handle: u64,
    pub pending_aux: u64,
    /// Non-zero while the outermost call is a synchronization (CPU samples are waits).
    pub in_sync: u32,
    pub _pad: u32,
    /// For calls in progress, by depth: the stack slot holding the return address (the stack
    /// pointer at entry) and the real return address, which the kernel replaces there with its
    /// return-probe trampoline. Unwinders reading that slot use the real one instead.
    pub return_slots: [u64; MAX_PENDING_RETURNS],
    pub return_addresses: [u64; MAX_PENDING_RETURNS],
}

const _: () = assert!(core::mem::size_of::<CudaThread>() == 160);

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
    unsafe impl aya::Pod for CudaStackKind {}
    unsafe impl aya::Pod for CudaConfig {}
}
