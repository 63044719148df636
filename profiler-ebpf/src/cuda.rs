//! CUDA uprobes: one entry program and one return program serve every probed runtime and driver
//! function; the attach cookie says which call fired (`profiler_common::gpu::CALL_*`).
//!
//! Every reported call becomes one record in `CUDA_EVENTS`: a `CudaEventHeader`, followed by the
//! calling thread's user and Python stacks when the thread's stack budget allows (a token bucket
//! per thread, so a launch storm costs a header per call, not a stack walk). The stack is taken
//! from the caller's frame: at entry the return address is at `[rsp]`; at return (sync calls)
//! the registers already are the caller's. The walks are the sampler's own
//! (`user_stack::collect`, `python::collect`), run in their own scratch slot.
//!
//! A runtime call that calls the driver is counted once. Synchronizations, `__cudaGetKernel` and
//! allocations are probed at return too: their entries raise a per-thread depth that their
//! return lowers, and driver calls made meanwhile are only counted as nested. The other runtime
//! calls (launches, copies, frees: the frequent ones) are probed at entry only, because a return
//! probe costs more than the entry probe: they leave a mark of their family, which the driver
//! call of the same family that follows within `RUNTIME_TO_DRIVER_NS` consumes as nested.
//!
//! A runtime function that only jumps into another probed one (CUDA 13's `__cudaLaunchKernel`
//! into `cudaLaunchKernel`) is counted at its own entry, where its arguments are what the agent
//! names; the entry of its jump target, seen with the same stack pointer, is not counted again.
//!
//! Allocations are reported at return, where the out-parameter holds the device pointer (the
//! agent pairs it with the free that names it); frees are reported without a stack.
use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_NO_WAKEUP, pt_regs},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_user, bpf_probe_read_user_str_bytes, generated::bpf_get_attach_cookie,
    },
    macros::{map, uprobe, uretprobe},
    maps::{Array, LruHashMap, RingBuf},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{
    CALL_DRV_ALLOC, CALL_DRV_FREE, CALL_DRV_GET_FUNCTION, CALL_DRV_GRAPH_LAUNCH, CALL_DRV_LAUNCH,
    CALL_DRV_LAUNCH_EX, CALL_DRV_MEMCPY, CALL_DRV_MEMCPY_DTOD, CALL_DRV_MEMCPY_DTOH,
    CALL_DRV_MEMCPY_HTOD, CALL_DRV_SYNC, CALL_FIRST_DRIVER, CALL_FLAG_TAIL_CALL, CALL_ID_MASK,
    CALL_RT_FREE, CALL_RT_GET_KERNEL, CALL_RT_GRAPH_LAUNCH, CALL_RT_LAUNCH, CALL_RT_LAUNCH_EXC,
    CALL_RT_LAUNCH_HANDLE, CALL_RT_MALLOC, CALL_RT_MEMCPY, CALL_RT_SYNC, CUDA_EVENT_HAS_STACK,
    CUDA_EVENT_HEADER_BYTES, CUDA_EVENT_NAME, CUDA_EVENT_RATE_LIMITED, CUDA_EVENTS_RING_BYTES,
    CudaConfig, CudaEventHeader, CudaNameRecord, CudaThread, MAX_CUDA_THREADS, MEMCPY_DEFAULT,
    MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, RUNTIME_TO_DRIVER_NS,
    STAT_CUDA_EVENTS, STAT_CUDA_EVENTS_LOST, STAT_CUDA_NAMES, STAT_CUDA_NESTED, STAT_CUDA_STACKS,
    STAT_CUDA_STACKS_RATE_LIMITED, STAT_CUDA_UNMATCHED_RETURNS, STAT_CUDA_UNREADABLE_RESULTS,
    SamplerConfig, call_family, runtime_call_has_return_probe,
};

use crate::{
    python,
    shared::{CONFIG, PID_FILTER, SLOT_CUDA, count, output_sample, scratch_record},
    user_stack::{self, Registers},
};

#[map(name = "CUDA_EVENTS")]
static CUDA_EVENTS: RingBuf = RingBuf::with_byte_size(CUDA_EVENTS_RING_BYTES, 0);

#[map(name = "CUDA_CONFIG")]
static CUDA_CONFIG: Array<CudaConfig> = Array::with_max_entries(1, 0);

#[map(name = "CUDA_THREADS")]
static CUDA_THREADS: LruHashMap<u32, CudaThread> =
    LruHashMap::with_max_entries(MAX_CUDA_THREADS, 0);

const NS_PER_STACK: u64 = 1_000_000_000;

/// Drops an exiting thread's state, so a later thread with the same tid starts clean (a thread
/// that dies inside a call would otherwise leave its depths raised).
#[inline(always)]
pub fn forget_thread(tid: u32) {
    let _ = CUDA_THREADS.remove(&tid);
}

/// Whether thread `tid` is inside a CUDA synchronization call (for the CPU sampler).
#[inline(always)]
pub fn in_sync(tid: u32) -> bool {
    match CUDA_THREADS.get_ptr(tid) {
        // SAFETY: a map value; a torn read only misflags one sample.
        Some(thread) => (unsafe { (*thread).sync_depth }) > 0,
        None => false,
    }
}

/// The attach cookie: the `CALL_*` id in its low byte, the agent's function index above it
/// (together the record's `call`), and whether the function is a trampoline into another
/// probed function ([`CALL_FLAG_TAIL_CALL`]).
#[inline(always)]
fn cookie(ctx: *mut core::ffi::c_void) -> (u32, u32, bool) {
    let cookie = unsafe { bpf_get_attach_cookie(ctx) };
    (
        (cookie & CALL_ID_MASK) as u32,
        cookie as u32,
        cookie & CALL_FLAG_TAIL_CALL != 0,
    )
}

/// The current thread's ids, or `None` when the `--pid` filter excludes the process.
#[inline(always)]
fn current_ids(config: &SamplerConfig) -> Option<(u32, u32)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    if config.filter_pids != 0 && unsafe { PID_FILTER.get(&tgid) }.is_none() {
        return None;
    }
    Some((tgid, tid))
}

#[inline(always)]
fn thread_state(tid: u32) -> Option<*mut CudaThread> {
    if let Some(thread) = CUDA_THREADS.get_ptr_mut(tid) {
        return Some(thread);
    }
    let fresh = CudaThread::default();
    CUDA_THREADS.insert(&tid, &fresh, 0).ok()?;
    CUDA_THREADS.get_ptr_mut(tid)
}

#[inline(always)]
fn read_u64(addr: u64) -> Option<u64> {
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

/// Takes one stack from the thread's budget if there is one.
#[inline(always)]
fn take_stack(thread: *mut CudaThread, now: u64) -> bool {
    let config = CUDA_CONFIG.get(0).copied().unwrap_or_default();
    if config.stacks_per_second == 0 {
        return false;
    }
    let capacity = config.stack_burst.max(1) as u64 * NS_PER_STACK;
    // SAFETY: this thread's entry; only this thread's probes write it.
    unsafe {
        let tokens = if (*thread).refilled_ns == 0 {
            capacity
        } else {
            let elapsed = now.saturating_sub((*thread).refilled_ns).min(capacity);
            ((*thread).tokens + elapsed * config.stacks_per_second as u64).min(capacity)
        };
        (*thread).refilled_ns = now;
        if tokens >= NS_PER_STACK {
            (*thread).tokens = tokens - NS_PER_STACK;
            true
        } else {
            (*thread).tokens = tokens;
            false
        }
    }
}

/// What one reported call carries besides the stack.
struct Event {
    call: u32,
    value: u64,
    handle: u64,
    aux: u64,
}

/// Sends one event; with a stack (walked from `caller`) when the budget allows.
#[inline(always)]
fn emit(pid: u32, tid: u32, thread: *mut CudaThread, event: Event, caller: Option<Registers>) {
    count(STAT_CUDA_EVENTS);
    let Some(record) = scratch_record(SLOT_CUDA) else {
        return;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let with_stack = caller.is_some() && take_stack(thread, now);
    let mut flags = 0;
    if with_stack {
        flags |= CUDA_EVENT_HAS_STACK;
        count(STAT_CUDA_STACKS);
    } else if caller.is_some() {
        flags |= CUDA_EVENT_RATE_LIMITED;
        count(STAT_CUDA_STACKS_RATE_LIMITED);
    }
    // SAFETY: this CPU's CUDA scratch slot; only raw accesses, as the walks' callbacks write
    // the sample part too.
    unsafe {
        (*record).cuda = CudaEventHeader {
            ktime_ns: now,
            value: event.value,
            handle: event.handle,
            aux: event.aux,
            pid,
            tid,
            call: event.call,
            flags,
        };
        let sent = if with_stack {
            let sample = &raw mut (*record).sample;
            (*sample).header.ktime_ns = now;
            (*sample).header.pid = pid;
            (*sample).header.tid = tid;
            (*sample).header.cpu = bpf_get_smp_processor_id();
            (*sample).header.flags = 0;
            (*sample).header.kernel_frames = 0;
            (*sample).header.python_frames = 0;
            (*sample).header.comm = bpf_get_current_comm().unwrap_or([0; 16]);
            let fsbase_offset = CONFIG.get(0).map_or(0, |c| c.task_fsbase_offset);
            let copy_allowed =
                CUDA_EVENTS.query(BPF_RB_AVAIL_DATA as u64) < (CUDA_EVENTS_RING_BYTES / 2) as u64;
            user_stack::collect(SLOT_CUDA, pid, caller, false, copy_allowed, sample);
            python::collect(SLOT_CUDA, pid, tid, fsbase_offset, sample);
            output_sample(
                &CUDA_EVENTS,
                &raw const (*record).cuda,
                CUDA_EVENT_HEADER_BYTES as u32,
                sample,
            )
        } else {
            CUDA_EVENTS
                .output::<CudaEventHeader>(&(*record).cuda, BPF_RB_NO_WAKEUP as u64)
                .is_ok()
        };
        if !sent {
            count(STAT_CUDA_EVENTS_LOST);
        }
    }
}

/// Whether a call succeeded: `cudaError_t` and `CUresult` are 0 on success.
#[inline(always)]
fn succeeded(rax: u64) -> bool {
    rax as u32 == 0
}

/// Names `handle` (read from `out`) with the string at `name` (driver) or the stub (runtime).
/// Called after a successful call only: anything unreadable then is counted, never silent.
#[inline(always)]
fn emit_name(pid: u32, tid: u32, call: u32, out: u64, stub: u64, name: u64) {
    let handle = match read_u64(out) {
        Some(handle) if handle != 0 => handle,
        _ => {
            count(STAT_CUDA_UNREADABLE_RESULTS);
            return;
        }
    };
    let Some(mut entry) = CUDA_EVENTS.reserve::<CudaNameRecord>(0) else {
        count(STAT_CUDA_EVENTS_LOST);
        return;
    };
    let record = entry.as_mut_ptr();
    // SAFETY: `record` is the reserved ring-buffer memory, written before submitting.
    let readable = unsafe {
        (*record).header = CudaEventHeader {
            ktime_ns: bpf_ktime_get_ns(),
            value: 0,
            handle,
            aux: stub,
            pid,
            tid,
            call,
            flags: CUDA_EVENT_NAME,
        };
        (*record).name[0] = 0;
        name == 0
            || matches!(
                bpf_probe_read_user_str_bytes(name as *const u8, &mut (*record).name),
                Ok(read) if !read.is_empty()
            )
    };
    if !readable {
        entry.discard(0);
        count(STAT_CUDA_UNREADABLE_RESULTS);
        return;
    }
    entry.submit(BPF_RB_NO_WAKEUP as u64);
    count(STAT_CUDA_NAMES);
}

#[uprobe]
pub fn cuda_entry(ctx: ProbeContext) -> u32 {
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let Some((pid, tid)) = current_ids(&config) else {
        return 0;
    };
    let (call, full_cookie, tail_calls) = cookie(ctx.as_ptr());
    let Some(thread) = thread_state(tid) else {
        return 0;
    };
    let regs = ctx.regs as *const pt_regs;
    // SAFETY: the probe's register snapshot and this thread's map entry.
    let (rdi, rsi, rdx, rcx, rsp, rbp) = unsafe {
        (
            (*regs).rdi,
            (*regs).rsi,
            (*regs).rdx,
            (*regs).rcx,
            (*regs).rsp,
            (*regs).rbp,
        )
    };
    unsafe {
        let family = call_family(call);
        if call < CALL_FIRST_DRIVER {
            // A trampoline jumped here: its entry, with this same stack pointer, counted the call.
            if (*thread).tail_call_sp != 0 && (*thread).tail_call_sp == rsp {
                (*thread).tail_call_sp = 0;
                count(STAT_CUDA_NESTED);
                return 0;
            }
            (*thread).tail_call_sp = if tail_calls { rsp } else { 0 };
            if runtime_call_has_return_probe(call) {
                (*thread).runtime_depth += 1;
            } else {
                (*thread).runtime_call_family = family;
                (*thread).runtime_call_ns = bpf_ktime_get_ns();
            }
        } else if (*thread).runtime_depth > 0
            || (family != 0
                && (*thread).runtime_call_family == family
                && bpf_ktime_get_ns().wrapping_sub((*thread).runtime_call_ns)
                    < RUNTIME_TO_DRIVER_NS)
        {
            if family != 0 && (*thread).runtime_call_family == family {
                (*thread).runtime_call_family = 0;
            }
            // The runtime's own driver call: names still count, events do not.
            if call == CALL_DRV_GET_FUNCTION {
                (*thread).drv_out = rdi;
                (*thread).drv_name = rdx;
            } else {
                count(STAT_CUDA_NESTED);
            }
            return 0;
        }
    }
    let event = |value: u64, handle: u64, aux: u64| Event {
        call: full_cookie,
        value,
        handle,
        aux,
    };
    let event = match call {
        CALL_RT_LAUNCH | CALL_RT_LAUNCH_HANDLE | CALL_DRV_LAUNCH => event(1, rdi, 0),
        CALL_RT_LAUNCH_EXC | CALL_DRV_LAUNCH_EX => event(1, rsi, 0),
        CALL_RT_GRAPH_LAUNCH | CALL_DRV_GRAPH_LAUNCH => event(1, rdi, 0),
        CALL_RT_MEMCPY => event(rdx, 0, rcx),
        CALL_DRV_MEMCPY_HTOD => event(rdx, 0, MEMCPY_HOST_TO_DEVICE as u64),
        CALL_DRV_MEMCPY_DTOH => event(rdx, 0, MEMCPY_DEVICE_TO_HOST as u64),
        CALL_DRV_MEMCPY_DTOD => event(rdx, 0, MEMCPY_DEVICE_TO_DEVICE as u64),
        CALL_DRV_MEMCPY => event(rdx, 0, MEMCPY_DEFAULT as u64),
        CALL_RT_MALLOC | CALL_DRV_ALLOC => {
            // Reported at return, with the device pointer.
            unsafe {
                (*thread).alloc_out = rdi;
                (*thread).alloc_bytes = rsi;
            }
            return 0;
        }
        CALL_RT_FREE | CALL_DRV_FREE => {
            if rdi == 0 {
                // Freeing NULL does nothing.
                return 0;
            }
            // A free only needs its pointer: the agent knows the allocation's stack.
            emit(pid, tid, thread, event(1, rdi, 0), None);
            return 0;
        }
        CALL_RT_SYNC | CALL_DRV_SYNC => {
            // SAFETY: this thread's entry.
            unsafe {
                if (*thread).sync_depth == 0 {
                    (*thread).sync_start_ns = bpf_ktime_get_ns();
                }
                (*thread).sync_depth += 1;
            }
            return 0;
        }
        CALL_RT_GET_KERNEL => {
            unsafe {
                (*thread).rt_out = rdi;
                (*thread).rt_stub = rsi;
            }
            return 0;
        }
        CALL_DRV_GET_FUNCTION => {
            unsafe {
                (*thread).drv_out = rdi;
                (*thread).drv_name = rdx;
            }
            return 0;
        }
        _ => return 0,
    };
    // At entry the return address is on top of the stack: start the walk in the caller.
    let caller = read_u64(rsp).map(|rip| Registers {
        rip,
        rsp: rsp + 8,
        rbp,
    });
    emit(pid, tid, thread, event, caller);
    0
}

#[uretprobe]
pub fn cuda_return(ctx: RetProbeContext) -> u32 {
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let Some((pid, tid)) = current_ids(&config) else {
        return 0;
    };
    let (call, full_cookie, _) = cookie(ctx.as_ptr());
    let Some(thread) = CUDA_THREADS.get_ptr_mut(tid) else {
        count(STAT_CUDA_UNMATCHED_RETURNS);
        return 0;
    };
    let regs = ctx.regs as *const pt_regs;
    // SAFETY: the probe's register snapshot and this thread's map entry.
    let (rip, rsp, rbp, rax) = unsafe { ((*regs).rip, (*regs).rsp, (*regs).rbp, (*regs).rax) };
    let is_runtime = call < CALL_FIRST_DRIVER;
    unsafe {
        if is_runtime {
            if (*thread).runtime_depth == 0 {
                count(STAT_CUDA_UNMATCHED_RETURNS);
                return 0;
            }
            (*thread).runtime_depth -= 1;
        }
        match call {
            CALL_RT_GET_KERNEL => {
                if (*thread).rt_out != 0 && succeeded(rax) {
                    emit_name(pid, tid, call, (*thread).rt_out, (*thread).rt_stub, 0);
                }
                (*thread).rt_out = 0;
            }
            CALL_DRV_GET_FUNCTION => {
                if (*thread).drv_out != 0 && succeeded(rax) {
                    emit_name(pid, tid, call, (*thread).drv_out, 0, (*thread).drv_name);
                }
                (*thread).drv_out = 0;
            }
            CALL_RT_MALLOC | CALL_DRV_ALLOC => {
                if !is_runtime && (*thread).runtime_depth > 0 {
                    // The runtime's own allocation: its return reports it.
                    return 0;
                }
                let out = (*thread).alloc_out;
                (*thread).alloc_out = 0;
                if out == 0 {
                    count(STAT_CUDA_UNMATCHED_RETURNS);
                    return 0;
                }
                if !succeeded(rax) {
                    // Nothing was allocated.
                    return 0;
                }
                let pointer = match read_u64(out) {
                    Some(pointer) if pointer != 0 => pointer,
                    _ => {
                        count(STAT_CUDA_UNREADABLE_RESULTS);
                        return 0;
                    }
                };
                let event = Event {
                    call: full_cookie,
                    value: (*thread).alloc_bytes,
                    handle: pointer,
                    aux: 0,
                };
                // The registers are the caller's, just after the call returned.
                emit(pid, tid, thread, event, Some(Registers { rip, rsp, rbp }));
            }
            CALL_RT_SYNC | CALL_DRV_SYNC => {
                if !is_runtime && (*thread).runtime_depth > 0 {
                    // Nested in a runtime call: the entry was not counted either.
                    return 0;
                }
                if (*thread).sync_depth == 0 {
                    count(STAT_CUDA_UNMATCHED_RETURNS);
                    return 0;
                }
                (*thread).sync_depth -= 1;
                if (*thread).sync_depth == 0 {
                    let blocked = bpf_ktime_get_ns().saturating_sub((*thread).sync_start_ns);
                    let event = Event {
                        call: full_cookie,
                        value: blocked,
                        handle: 0,
                        aux: 0,
                    };
                    // The registers are the caller's, just after the call returned.
                    emit(pid, tid, thread, event, Some(Registers { rip, rsp, rbp }));
                }
            }
            _ => {}
        }
    }
    0
}
