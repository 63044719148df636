//! The Python walk: for a sample of a registered CPython process, finds the sampled thread's
//! `PyThreadState` and records its frame chain (code object, instruction, entry flag) innermost
//! first. Userspace symbolizes the code objects and splices the frames into the native stack.
//!
//! Every offset comes from the process's `PyProcInfo`; nothing here depends on a version.
use core::{ffi::c_void, ptr};

use aya_ebpf::{
    helpers::{
        bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_get_current_task, bpf_loop, bpf_probe_read_user as bpf_probe_read_user_raw,
        },
    },
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use profiler_common::{
    CodeIdentity, MAX_PYTHON_FRAMES, MAX_PYTHON_PROCESSES, MAX_PYTHON_THREAD_SCAN,
    MAX_PYTHON_THREADS, PY_ANCHOR_CFRAME, PY_ENTRY_EVERY_FRAME, PY_ENTRY_FLAG, PY_ENTRY_SHIM,
    PY_FRAME_ENTRY, PY_FRAME_FINGERPRINT_MASK, PY_INSTRUCTION_LASTI, PY_NAME_HEAD_BYTES,
    PY_NO_THREAD_STATE_RETRY_MS, PYTHON_CODE_READ_BYTES, PYTHON_FRAME_READ_BYTES,
    PYTHON_NAME_READ_BYTES, PyProcInfo, PyThreadEntry, RawSample, SAMPLE_PYTHON_ERROR,
    SAMPLE_PYTHON_TRUNCATED, STAT_PYTHON_FRAMES, STAT_PYTHON_NO_THREAD_STATE,
    STAT_PYTHON_READ_ERROR, STAT_PYTHON_TRUNCATED, STAT_PYTHON_WALKS,
};

use crate::shared::{SCRATCH_SLOTS, count, scratch_sample};

#[map(name = "PYTHON_PROCESSES")]
static PYTHON_PROCESSES: HashMap<u32, PyProcInfo> =
    HashMap::with_max_entries(MAX_PYTHON_PROCESSES, 0);

/// tid → thread state, so the thread list is scanned once per thread, not once per sample.
#[map(name = "PYTHON_THREADS")]
static PYTHON_THREADS: LruHashMap<u32, PyThreadEntry> =
    LruHashMap::with_max_entries(MAX_PYTHON_THREADS, 0);

/// State carried between `bpf_loop` iterations (too large for the BPF stack).
#[repr(C)]
struct PyWalkState {
    info: PyProcInfo,
    /// Thread scan: the current interpreter and thread state.
    interp: u64,
    tstate: u64,
    /// Thread scan: the value the sampled thread's state holds at `match_offset`.
    match_value: u64,
    /// Frame walk: the next frame to read.
    frame: u64,
    match_offset: u32,
    frames: u32,
    flags: u32,
    /// Frame walk: 1 once the chain ended (or the scan finished).
    done: u32,
    buf: [u8; PYTHON_FRAME_READ_BYTES],
    code_buf: [u8; PYTHON_CODE_READ_BYTES],
    name_buf: [u8; PYTHON_NAME_READ_BYTES],
}

#[map(name = "PYTHON_WALK")]
static PYTHON_WALK: PerCpuArray<PyWalkState> = PerCpuArray::with_max_entries(SCRATCH_SLOTS, 0);

const FRAME_MASK: u32 = MAX_PYTHON_FRAMES as u32 - 1;
const _: () = assert!(MAX_PYTHON_FRAMES.is_power_of_two());
const _: () = assert!(PYTHON_FRAME_READ_BYTES.is_power_of_two());
/// Iterations of the frame loop: recorded frames plus the shims between them (one per C-level
/// eval call, 3.12+), and one more to see whether a full stack ends there.
const MAX_FRAME_STEPS: u32 = 2 * MAX_PYTHON_FRAMES as u32 + 1;

#[inline(always)]
fn read_u64(addr: u64) -> Option<u64> {
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

/// A field of a copy in `buf` (a power-of-two size); offsets outside the copy read as 0.
#[inline(always)]
fn buf_u64<const N: usize>(buf: &[u8; N], offset: u16) -> u64 {
    let at = offset as usize & (N - 1);
    if at > N - 8 {
        return 0;
    }
    unsafe { ptr::read_unaligned(buf.as_ptr().add(at).cast::<u64>()) }
}

#[inline(always)]
fn buf_u32<const N: usize>(buf: &[u8; N], offset: u16) -> u32 {
    let at = offset as usize & (N - 1);
    if at > N - 4 {
        return 0;
    }
    unsafe { ptr::read_unaligned(buf.as_ptr().add(at).cast::<u32>()) }
}

#[inline(always)]
fn buf_u8<const N: usize>(buf: &[u8; N], offset: u16) -> u8 {
    buf[offset as usize & (N - 1)]
}

/// Reads `len` bytes (clamped to the buffer) at `addr` into `buf`; false when unreadable.
#[inline(always)]
fn read_prefix<const N: usize>(buf: &mut [u8; N], addr: u64, len: u32) -> bool {
    let mut len = len;
    if len > N as u32 {
        len = N as u32;
    }
    unsafe { bpf_probe_read_user_raw(buf.as_mut_ptr().cast(), len, addr as *const c_void) == 0 }
}

/// `word` without its bytes at and past `keep` (0..=8).
#[inline(always)]
fn keep_low_bytes(word: u64, keep: u64) -> u64 {
    if keep >= 8 {
        word
    } else {
        word & ((1u64 << (keep * 8)) - 1)
    }
}

/// The fingerprint of the code object at `code` as it is now (0 when it cannot be read): what
/// the agent checks the code object it reads later against.
#[inline(always)]
fn code_fingerprint(state: &mut PyWalkState, code: u64) -> u32 {
    let info = state.info;
    if !read_prefix(&mut state.code_buf, code, info.code_read_bytes as u32) {
        return 0;
    }
    let buf = &state.code_buf;
    let mut identity = CodeIdentity {
        firstlineno: buf_u32(buf, info.code_firstlineno),
        version: if info.code_version != 0 {
            buf_u32(buf, info.code_version)
        } else {
            0
        },
        name: buf_u64(buf, info.code_name),
        filename: buf_u64(buf, info.code_filename),
        line_table: buf_u64(buf, info.code_line_table),
        ..CodeIdentity::default()
    };
    if identity.version == 0 && !name_identity(state, &mut identity) {
        return 0;
    }
    identity.fingerprint()
}

/// Fills the name part of `identity` from the name string (compact strings only, like the
/// agent's reader); false when it cannot be read or is not a compact string.
#[inline(always)]
fn name_identity(state: &mut PyWalkState, identity: &mut CodeIdentity) -> bool {
    let info = state.info;
    let name = identity.name;
    if !read_prefix(&mut state.name_buf, name, info.name_read_bytes as u32) {
        return false;
    }
    let buf = &state.name_buf;
    let length = buf_u64(buf, info.unicode_length as u16);
    let bits = buf_u32(buf, info.unicode_state as u16);
    let shift = (info.unicode_kind_shift & 0xf) as u32;
    let kind = ((bits >> shift) & 0x7) as u64;
    let compact = (bits >> (shift + 3)) & 1 != 0;
    let ascii = (bits >> (shift + 4)) & 1 != 0;
    if !compact || !(kind == 1 || kind == 2 || kind == 4) || length > (1 << 30) {
        return false;
    }
    let byte_len = length * kind;
    let data = if ascii {
        identity.name_head = [
            buf_u64(buf, info.unicode_ascii_data as u16),
            buf_u64(buf, info.unicode_ascii_data as u16 + 8),
        ];
        name + info.unicode_ascii_data as u64
    } else {
        // Non-ASCII data starts further on: read just what the string holds of the head.
        let data = name + info.unicode_compact_data as u64;
        let mut head = [0u8; PY_NAME_HEAD_BYTES];
        let take = if byte_len < PY_NAME_HEAD_BYTES as u64 {
            byte_len as u32
        } else {
            PY_NAME_HEAD_BYTES as u32
        };
        if !read_prefix(&mut head, data, take) {
            return false;
        }
        identity.name_head = [buf_u64(&head, 0), buf_u64(&head, 8)];
        data
    };
    identity.name_head[0] = keep_low_bytes(identity.name_head[0], byte_len);
    identity.name_head[1] = keep_low_bytes(identity.name_head[1], byte_len.saturating_sub(8));
    identity.name_length = length;
    if byte_len > PY_NAME_HEAD_BYTES as u64 {
        match read_u64(data + byte_len - 8) {
            Some(tail) => identity.name_tail = tail,
            None => return false,
        }
    }
    true
}

/// Fills `sample.python` for a thread of a registered Python process.
///
/// `slot` picks this CPU's scratch state (see `user_stack::collect`); `sample` is that slot's
/// sample. The walk state and the sample are only touched through raw pointers here: the
/// `bpf_loop` callbacks write them, so no `&mut` to them may live across a `bpf_loop` call
/// (the compiler would assume the call cannot change them).
#[inline(always)]
pub fn collect(slot: u32, pid: u32, tid: u32, fsbase_offset: u32, sample: *mut RawSample) {
    unsafe { (*sample).header.python_frames = 0 };
    let Some(info) = (unsafe { PYTHON_PROCESSES.get(&pid) }).copied() else {
        return;
    };
    count(STAT_PYTHON_WALKS);
    let Some(state) = PYTHON_WALK.get_ptr_mut(slot) else {
        return;
    };
    // Every version records `pthread_self()` in the thread state; on x86_64 (glibc and musl)
    // it is the thread's FS base, the same seen from any PID namespace. 3.11+'s
    // `native_thread_id` is the tid as the process's own PID namespace numbers it: only the
    // fallback when the kernel's BTF gave no FS base offset (and the agent leaves it at 0 for
    // processes in another namespace).
    let (match_offset, match_value) = if fsbase_offset != 0 {
        let task = unsafe { bpf_get_current_task() };
        let Ok(fsbase) =
            (unsafe { bpf_probe_read_kernel((task + fsbase_offset as u64) as *const u64) })
        else {
            count(STAT_PYTHON_NO_THREAD_STATE);
            return;
        };
        (info.tstate_thread_id as u32, fsbase)
    } else if info.tstate_native_thread_id != 0 {
        (info.tstate_native_thread_id as u32, tid as u64)
    } else {
        count(STAT_PYTHON_NO_THREAD_STATE);
        return;
    };
    // SAFETY: this CPU's state slot; perf-event programs do not nest on a CPU.
    unsafe {
        (*state).info = info;
        (*state).frames = 0;
        (*state).flags = 0;
        (*state).match_offset = match_offset;
        (*state).match_value = match_value;
    }

    let Some(tstate) = thread_state(slot, pid, tid, state) else {
        count(STAT_PYTHON_NO_THREAD_STATE);
        return;
    };
    let first = match read_u64(tstate + info.tstate_frame as u64) {
        Some(anchor) if info.anchor_kind == PY_ANCHOR_CFRAME && anchor != 0 => {
            read_u64(anchor + info.cframe_current_frame as u64)
        }
        other => other,
    };
    let Some(first) = first else {
        count(STAT_PYTHON_READ_ERROR);
        unsafe { (*sample).header.flags |= SAMPLE_PYTHON_ERROR };
        return;
    };
    let mut loop_slot = slot;
    unsafe {
        (*state).frame = first;
        (*state).done = 0;
        bpf_loop(
            MAX_FRAME_STEPS,
            frame_step as *mut c_void,
            (&raw mut loop_slot).cast(),
            0,
        );
        if ptr::read_volatile(&raw const (*state).done) == 0
            && ptr::read_volatile(&raw const (*state).frame) != 0
        {
            (*state).flags |= SAMPLE_PYTHON_TRUNCATED;
            count(STAT_PYTHON_TRUNCATED);
        }
        // The callback wrote the frames into this CPU's scratch sample, which `sample` is.
        let frames = ptr::read_volatile(&raw const (*state).frames);
        let flags = ptr::read_volatile(&raw const (*state).flags);
        (*sample).header.python_frames = frames as u16;
        (*sample).header.flags |= flags;
    }
}

/// The sampled thread's `PyThreadState`: from the cache when it still matches, else by
/// scanning every interpreter's thread list.
#[inline(always)]
fn thread_state(slot: u32, pid: u32, tid: u32, state: *mut PyWalkState) -> Option<u64> {
    // SAFETY: this CPU's state slot; see `collect` for why it stays a raw pointer.
    let (info, match_offset, match_value) =
        unsafe { ((*state).info, (*state).match_offset, (*state).match_value) };
    let now_ms = (unsafe { bpf_ktime_get_ns() } / 1_000_000) as u32;
    if let Some(entry) = unsafe { PYTHON_THREADS.get(&tid) }
        && entry.pid == pid
    {
        if entry.thread_state == 0 {
            if now_ms.wrapping_sub(entry.checked_ms) < PY_NO_THREAD_STATE_RETRY_MS {
                return None;
            }
        } else if read_u64(entry.thread_state + match_offset as u64) == Some(match_value) {
            return Some(entry.thread_state);
        }
    }
    // An uninitialised interpreter is not cached as "no thread state": it is about to start.
    let interp = read_u64(info.runtime_addr + info.runtime_interpreters_head as u64)?;
    if interp == 0 {
        return None;
    }
    let first = read_u64(interp + info.interp_threads_head as u64)?;
    let mut loop_slot = slot;
    let (done, found) = unsafe {
        (*state).interp = interp;
        (*state).tstate = first;
        (*state).done = 0;
        bpf_loop(
            MAX_PYTHON_THREAD_SCAN,
            scan_step as *mut c_void,
            (&raw mut loop_slot).cast(),
            0,
        );
        (
            ptr::read_volatile(&raw const (*state).done),
            ptr::read_volatile(&raw const (*state).tstate),
        )
    };
    let found = if done == 0 { 0 } else { found };
    let entry = PyThreadEntry {
        thread_state: found,
        pid,
        checked_ms: now_ms,
    };
    let _ = PYTHON_THREADS.insert(&tid, &entry, 0);
    (found != 0).then_some(found)
}

/// One thread state of the scan; ends with `done = 1` and `tstate` = the match (or 0).
#[inline(never)]
extern "C" fn scan_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: the caller passes a pointer to the slot number on its stack.
    let slot = unsafe { *(ctx as *const u32) };
    let Some(state) = PYTHON_WALK.get_ptr_mut(slot) else {
        return 1;
    };
    let state = unsafe { &mut *state };
    let info = &state.info;
    if state.tstate == 0 {
        // This interpreter's list is exhausted: go on with the next interpreter.
        let next = read_u64(state.interp + info.interp_next as u64).unwrap_or(0);
        state.interp = next;
        if next == 0 {
            state.done = 1;
            return 1;
        }
        state.tstate = read_u64(next + info.interp_threads_head as u64).unwrap_or(0);
        return 0;
    }
    let tstate = state.tstate;
    if read_u64(tstate + state.match_offset as u64) == Some(state.match_value) {
        state.done = 1;
        return 1;
    }
    state.tstate = read_u64(tstate + info.tstate_next as u64).unwrap_or(0);
    0
}

/// One frame of the chain: records it unless it is a shim, then moves to the caller.
#[inline(never)]
extern "C" fn frame_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `collect` passes a pointer to the slot number on its stack.
    let slot = unsafe { *(ctx as *const u32) };
    let Some(state) = PYTHON_WALK.get_ptr_mut(slot) else {
        return 1;
    };
    let Some(sample) = scratch_sample(slot) else {
        return 1;
    };
    // SAFETY: this CPU's slots, not shared with anything running concurrently on it.
    let (state, sample) = unsafe { (&mut *state, &mut *sample) };
    let frame = state.frame;
    if frame == 0 {
        state.done = 1;
        return 1;
    }
    if !read_prefix(&mut state.buf, frame, state.info.frame_read_bytes as u32) {
        state.flags |= SAMPLE_PYTHON_ERROR;
        state.done = 1;
        count(STAT_PYTHON_READ_ERROR);
        return 1;
    }
    let info = &state.info;
    let back = buf_u64(&state.buf, info.frame_back);
    if back == frame {
        state.flags |= SAMPLE_PYTHON_ERROR;
        state.done = 1;
        count(STAT_PYTHON_READ_ERROR);
        return 1;
    }
    state.frame = back;
    if info.entry_kind == PY_ENTRY_SHIM && buf_u8(&state.buf, info.entry_offset) == info.shim_owner
    {
        // A shim: the frame recorded just before it began this C-level eval call.
        if state.frames > 0 {
            let last = ((state.frames - 1) & FRAME_MASK) as usize;
            sample.python[last].meta |= PY_FRAME_ENTRY;
        }
        return 0;
    }
    let code = buf_u64(&state.buf, info.frame_code) & !info.code_tag_mask;
    if code == 0 {
        return 0;
    }
    if state.frames >= MAX_PYTHON_FRAMES as u32 {
        state.flags |= SAMPLE_PYTHON_TRUNCATED;
        state.done = 1;
        count(STAT_PYTHON_TRUNCATED);
        return 1;
    }
    let instruction = if info.instruction_kind == PY_INSTRUCTION_LASTI {
        buf_u32(&state.buf, info.frame_instruction)
    } else {
        buf_u64(&state.buf, info.frame_instruction).wrapping_sub(code) as u32
    };
    let entry = match info.entry_kind {
        PY_ENTRY_EVERY_FRAME => PY_FRAME_ENTRY,
        PY_ENTRY_FLAG if buf_u8(&state.buf, info.entry_offset) != 0 => PY_FRAME_ENTRY,
        _ => 0,
    };
    let fingerprint = code_fingerprint(state, code);
    let record = &mut sample.python[(state.frames & FRAME_MASK) as usize];
    record.code = code;
    record.instruction = instruction;
    record.meta = (fingerprint & PY_FRAME_FINGERPRINT_MASK) | entry;
    state.frames += 1;
    count(STAT_PYTHON_FRAMES);
    0
}
