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
//! Every probed function is probed at entry and at return, and a call is reported at its
//! return, when its result is known: a call that returned an error is reported as failed (with
//! its error code), never as a launch, copy, allocation or wait. The entry of the outermost
//! probed call on a thread notes what it will report; probed calls made meanwhile raise a
//! per-thread depth and are nested: the runtime's own driver calls, and the jump of a trampoline
//! such as CUDA 13's `__cudaLaunchKernel` into `cudaLaunchKernel` (the same stack pointer, the
//! return address already replaced by the kernel's return-probe trampoline).
//!
//! While a call is in progress, the kernel keeps its real return address aside and leaves a
//! trampoline address in the stack slot. The entry notes the slot and the real address per
//! depth, so the CPU sampler's walk (and its stack copies) see the real caller.
//!
//! Allocations report the device pointer read from their out-parameter at return (the agent
//! pairs it with the free that names it); frees are reported without a stack.
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
    CALL_DRV_MEMCPY_HTOD, CALL_DRV_SYNC, CALL_ID_MASK, CALL_RT_FREE, CALL_RT_GET_KERNEL,
    CALL_RT_GRAPH_LAUNCH, CALL_RT_LAUNCH, CALL_RT_LAUNCH_EXC, CALL_RT_LAUNCH_HANDLE,
    CALL_RT_MALLOC, CALL_RT_MEMCPY, CALL_RT_SYNC, CUDA_EVENT_FAILED, CUDA_EVENT_FIRST_OF_KIND,
    CUDA_EVENT_HAS_STACK, CUDA_EVENT_HEADER_BYTES, CUDA_EVENT_NAME, CUDA_EVENT_RATE_LIMITED,
    CUDA_EVENTS_RING_BYTES, CudaConfig, CudaEventHeader, CudaNameRecord, CudaStackKind, CudaThread,
    MAX_CUDA_STACK_KINDS, MAX_CUDA_THREADS, MAX_PENDING_RETURNS, MEMCPY_DEFAULT,
    MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, STAT_CUDA_EVENTS,
    STAT_CUDA_EVENTS_LOST, STAT_CUDA_FAILED, STAT_CUDA_FIRST_STACKS, STAT_CUDA_NAMES,
    STAT_CUDA_NESTED, STAT_CUDA_STACKS, STAT_CUDA_STACKS_RATE_LIMITED, STAT_CUDA_UNMATCHED_RETURNS,
    STAT_CUDA_UNREADABLE_RESULTS, SamplerConfig,
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

/// The (thread, call, kernel or direction) kinds that already had a stack: the first call of a
/// kind always gets one, so every later call of it has a sampled stack to be weighted onto.
#[map(name = "CUDA_STACK_KINDS")]
static CUDA_STACK_KINDS: LruHashMap<CudaStackKind, u8> =
    LruHashMap::with_max_entries(MAX_CUDA_STACK_KINDS, 0);

const NS_PER_STACK: u64 = 1_000_000_000;

/// Drops an exiting thread's state, so a later thread with the same tid starts clean (a thread
/// that dies inside a call would otherwise leave its depths raised).
#[inline(always)]
pub fn forget_thread(tid: u32) {
    let _ = CUDA_THREADS.remove(&tid);
}

/// Thread `tid`'s CUDA state, for the CPU sampler: whether it is inside a synchronization
/// call, and the return slots of its calls in progress.
#[inline(always)]
pub fn thread(tid: u32) -> Option<*const CudaThread> {
    CUDA_THREADS.get_ptr(tid)
}

/// The attach cookie: the `CALL_*` id in its low byte, the agent's function index above it
/// (together the record's `call`).
#[inline(always)]
fn cookie(ctx: *mut core::ffi::c_void) -> (u32, u32) {
    let cookie = unsafe { bpf_get_attach_cookie(ctx) };
    ((cookie & CALL_ID_MASK) as u32, cookie as u32)
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
    /// `CUDA_EVENT_FAILED` or 0.
    flags: u32,
}

/// Whether this is the first call of its kind on the thread (and notes the kind).
#[inline(always)]
fn first_of_kind(tid: u32, event: &Event) -> bool {
    let kind = CudaStackKind::of(
        tid,
        event.call,
        event.flags,
        event.value,
        event.handle,
        event.aux,
    );
    if unsafe { CUDA_STACK_KINDS.get(&kind) }.is_some() {
        return false;
    }
    CUDA_STACK_KINDS.insert(&kind, &0, 0).is_ok()
}

/// Sends one event; with a stack (walked from `caller`) for the first call of its kind on the
/// thread, or when the thread's budget allows.
#[inline(always)]
fn emit(pid: u32, tid: u32, thread: *mut CudaThread, event: Event, caller: Option<Registers>) {
    count(STAT_CUDA_EVENTS);
    let Some(record) = scratch_record(SLOT_CUDA) else {
        return;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let mut flags = event.flags;
    let stacks_wanted = CUDA_CONFIG
        .get(0)
        .is_some_and(|config| config.stacks_per_second != 0);
    let with_stack = caller.is_some()
        && stacks_wanted
        && if first_of_kind(tid, &event) {
            flags |= CUDA_EVENT_FIRST_OF_KIND;
            count(STAT_CUDA_FIRST_STACKS);
            true
        } else {
            take_stack(thread, now)
        };
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
            user_stack::collect(SLOT_CUDA, pid, caller, false, copy_allowed, None, sample);
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
    let Some((_, tid)) = current_ids(&config) else {
        return 0;
    };
    let (call, full_cookie) = cookie(ctx.as_ptr());
    let Some(thread) = thread_state(tid) else {
        return 0;
    };
    let regs = ctx.regs as *const pt_regs;
    // SAFETY: the probe's register snapshot and this thread's map entry (only this thread's
    // probes write it).
    unsafe {
        let (rdi, rsi, rdx, rcx, rsp) = (
            (*regs).rdi,
            (*regs).rsi,
            (*regs).rdx,
            (*regs).rcx,
            (*regs).rsp,
        );
        // The kernel places its return trampoline after this program ran: `[rsp]` is still this
        // call's real return address, unless a trampoline jumped here (then it is the kernel's).
        let return_address = read_u64(rsp).unwrap_or(0);
        let mut depth = (*thread).depth;
        if depth > 0 {
            let outer_slot = (*thread).return_slots[0];
            // Not deeper in the stack than the outermost call, and not a jump into this
            // function: that call ended without its return being seen (longjmp, or no room
            // for a return probe). Start over rather than count every later call as nested.
            if rsp > outer_slot
                || (rsp == outer_slot && return_address == (*thread).return_addresses[0])
            {
                count(STAT_CUDA_UNMATCHED_RETURNS);
                depth = 0;
                (*thread).pending_call = 0;
                (*thread).in_sync = 0;
            }
        }
        let index = depth as usize;
        if index < MAX_PENDING_RETURNS {
            (*thread).return_slots[index] = rsp;
            (*thread).return_addresses[index] = if index > 0
                && rsp == (*thread).return_slots[(index - 1) & (MAX_PENDING_RETURNS - 1)]
            {
                // A jump into this function: the slot holds the trampoline already.
                (*thread).return_addresses[(index - 1) & (MAX_PENDING_RETURNS - 1)]
            } else {
                return_address
            };
        }
        (*thread).depth = depth + 1;
        // Naming calls name their handle at return, nested or not.
        match call {
            CALL_RT_GET_KERNEL => {
                (*thread).rt_out = rdi;
                (*thread).rt_stub = rsi;
            }
            CALL_DRV_GET_FUNCTION => {
                (*thread).drv_out = rdi;
                (*thread).drv_name = rdx;
            }
            _ => {}
        }
        if depth > 0 {
            // The runtime's own driver call, or a trampoline's jump target: the outermost call
            // reports it.
            if call != CALL_RT_GET_KERNEL && call != CALL_DRV_GET_FUNCTION {
                count(STAT_CUDA_NESTED);
            }
            return 0;
        }
        let (value, handle, aux) = match call {
            CALL_RT_LAUNCH | CALL_RT_LAUNCH_HANDLE | CALL_DRV_LAUNCH => (1, rdi, 0),
            CALL_RT_LAUNCH_EXC | CALL_DRV_LAUNCH_EX => (1, rsi, 0),
            CALL_RT_GRAPH_LAUNCH | CALL_DRV_GRAPH_LAUNCH => (1, rdi, 0),
            CALL_RT_MEMCPY => (rdx, 0, rcx),
            CALL_DRV_MEMCPY_HTOD => (rdx, 0, MEMCPY_HOST_TO_DEVICE as u64),
            CALL_DRV_MEMCPY_DTOH => (rdx, 0, MEMCPY_DEVICE_TO_HOST as u64),
            CALL_DRV_MEMCPY_DTOD => (rdx, 0, MEMCPY_DEVICE_TO_DEVICE as u64),
            CALL_DRV_MEMCPY => (rdx, 0, MEMCPY_DEFAULT as u64),
            // The out-parameter, read at return for the device pointer.
            CALL_RT_MALLOC | CALL_DRV_ALLOC => (rsi, rdi, 0),
            // Freeing NULL does nothing.
            CALL_RT_FREE | CALL_DRV_FREE if rdi != 0 => (1, rdi, 0),
            CALL_RT_SYNC | CALL_DRV_SYNC => {
                (*thread).in_sync = 1;
                (0, 0, 0)
            }
            _ => {
                (*thread).pending_call = 0;
                return 0;
            }
        };
        (*thread).pending_call = full_cookie;
        (*thread).pending_value = value;
        (*thread).pending_handle = handle;
        (*thread).pending_aux = aux;
        (*thread).call_start_ns = bpf_ktime_get_ns();
    }
    0
}

#[uretprobe]
pub fn cuda_return(ctx: RetProbeContext) -> u32 {
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let Some((pid, tid)) = current_ids(&config) else {
        return 0;
    };
    let (call, _) = cookie(ctx.as_ptr());
    let Some(thread) = CUDA_THREADS.get_ptr_mut(tid) else {
        count(STAT_CUDA_UNMATCHED_RETURNS);
        return 0;
    };
    let regs = ctx.regs as *const pt_regs;
    // SAFETY: the probe's register snapshot and this thread's map entry.
    unsafe {
        let (rip, rsp, rbp, rax) = ((*regs).rip, (*regs).rsp, (*regs).rbp, (*regs).rax);
        if (*thread).depth == 0 {
            count(STAT_CUDA_UNMATCHED_RETURNS);
            return 0;
        }
        (*thread).depth -= 1;
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
            _ => {}
        }
        if (*thread).depth > 0 {
            return 0;
        }
        // The outermost call returned (a trampoline's return may come last: what is reported
        // is what the outermost entry noted).
        let pending = (*thread).pending_call;
        (*thread).pending_call = 0;
        (*thread).in_sync = 0;
        if pending == 0 {
            return 0;
        }
        let id = pending & CALL_ID_MASK as u32;
        // The registers are the caller's, just after the call returned.
        let caller = Registers { rip, rsp, rbp };
        if !succeeded(rax) {
            count(STAT_CUDA_FAILED);
            let event = Event {
                call: pending,
                value: rax & 0xffff_ffff,
                handle: if matches!(id, CALL_RT_MALLOC | CALL_DRV_ALLOC) {
                    0
                } else {
                    (*thread).pending_handle
                },
                aux: (*thread).pending_aux,
                flags: CUDA_EVENT_FAILED,
            };
            emit(pid, tid, thread, event, Some(caller));
            return 0;
        }
        let mut event = Event {
            call: pending,
            value: (*thread).pending_value,
            handle: (*thread).pending_handle,
            aux: (*thread).pending_aux,
            flags: 0,
        };
        match id {
            CALL_RT_MALLOC | CALL_DRV_ALLOC => {
                event.handle = match read_u64(event.handle) {
                    Some(pointer) if pointer != 0 => pointer,
                    _ => {
                        count(STAT_CUDA_UNREADABLE_RESULTS);
                        return 0;
                    }
                };
            }
            CALL_RT_SYNC | CALL_DRV_SYNC => {
                event.value = bpf_ktime_get_ns().saturating_sub((*thread).call_start_ns);
            }
            CALL_RT_FREE | CALL_DRV_FREE => {
                // A free only needs its pointer: the agent knows the allocation's stack.
                emit(pid, tid, thread, event, None);
                return 0;
            }
            _ => {}
        }
        emit(pid, tid, thread, event, Some(caller));
    }
    0
}
