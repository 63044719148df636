//! The user-stack unwinder: table-driven from `.eh_frame`, with frame-pointer fallback.
//!
//! The agent registers, per process, each executable mapping in the `PROCESS_MAPPINGS` LPM trie
//! (pid + address → table id, load bias) and, per ELF file, the file's unwind rows in
//! `UNWIND_PAGES` / `UNWIND_ROWS`. One `bpf_loop` iteration unwinds one frame, so the verifier
//! checks the step once, whatever the depth. Row lookup is `profiler_common::unwind::find_row`,
//! the same code the agent's tests run.
use core::{ffi::c_void, ptr};

use aya_ebpf::bindings::{BPF_F_NO_PREALLOC, pt_regs};
use aya_ebpf::{
    helpers::{
        bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_find_vma, bpf_get_current_task_btf, bpf_loop,
            bpf_probe_read_user as bpf_probe_read_user_raw, bpf_task_pt_regs,
        },
    },
    macros::map,
    maps::{Array, HashMap, LpmTrie, PerCpuArray, lpm_trie::Key},
};
use profiler_common::{
    CudaThread, DEFAULT_ROW_CHUNKS, MAX_MAPPING_PREFIXES, MAX_PENDING_RETURNS, MAX_UNWIND_PAGES,
    MAX_USER_FRAMES, NO_FALLBACK_FRAME, RawSample, SAMPLE_USER_FRAME_POINTERS,
    SAMPLE_USER_LEAF_RETURN_ADDRESS, SAMPLE_USER_STACK_COPY, SAMPLE_USER_STACK_ERROR,
    SAMPLE_USER_TABLE_MISSING, SAMPLE_USER_TRUNCATED, SAMPLE_USER_UNKNOWN_MAPPING,
    STACK_COPY_BYTES, STACK_COPY_EXACT_PC, STACK_COPY_SLACK, STAT_UNWIND_BAD_FRAME,
    STAT_UNWIND_COMPLETE, STAT_UNWIND_DEPTH_LIMIT, STAT_UNWIND_FP_END, STAT_UNWIND_FP_NO_CFI,
    STAT_UNWIND_FP_NO_MAPPING, STAT_UNWIND_FP_NO_TABLE, STAT_UNWIND_FRAME_POINTER_CODE,
    STAT_UNWIND_FRAMES, STAT_UNWIND_NEW_FILE_MAPPING, STAT_UNWIND_NO_USER_CONTEXT,
    STAT_UNWIND_PLT_FRAMES, STAT_UNWIND_READ_ERROR, STAT_UNWIND_RETURN_PROBE_FRAMES,
    STAT_UNWIND_SIGNAL_FRAMES, STAT_UNWIND_STACK_COPIES, STAT_UNWIND_STACK_COPY_EMPTY,
    STAT_UNWIND_STACK_COPY_SHED, StackCopyHeader,
    unwind::{
        CFA_PLT, CFA_SIGNAL, MAPPING_HAS_TABLE, MAPPING_PROCESS_MARKER,
        MAPPING_RELIABLE_FRAME_POINTERS, MAPPING_TABLE_PENDING, MappingKey, MappingValue,
        PAGE_SHIFT, PageEntry, PageKey, ROWS_PER_CHUNK, RowChunk, RowSource, Step, UnwindRow,
        find_row, frame_pointer_caller, signal_registers, step,
    },
};

pub use profiler_common::unwind::Registers;

use crate::shared::{CONFIG, SCRATCH_SLOTS, count, count_by, scratch_sample};

#[map(name = "UNWIND_ROWS")]
static UNWIND_ROWS: Array<RowChunk> = Array::with_max_entries(DEFAULT_ROW_CHUNKS, 0);

#[map(name = "UNWIND_PAGES")]
static UNWIND_PAGES: HashMap<PageKey, PageEntry> = HashMap::with_max_entries(MAX_UNWIND_PAGES, 0);

#[map(name = "PROCESS_MAPPINGS")]
static PROCESS_MAPPINGS: LpmTrie<MappingKey, MappingValue> =
    LpmTrie::with_max_entries(MAX_MAPPING_PREFIXES, BPF_F_NO_PREALLOC);

/// State carried between `bpf_loop` iterations.
#[repr(C)]
pub struct UnwindState {
    regs: Registers,
    pid: u32,
    frames: u32,
    flags: u32,
    /// Non-zero while `regs.rip` is the exact current instruction (first frame, or just after
    /// a signal frame) rather than a return address.
    exact_pc: u32,
    done: u32,
    /// Frames taken from RBP in files with reliable frame pointers (see `collect`).
    frame_pointer_frames: u32,
    /// The first frame whose caller came from the frame-pointer fallback.
    fallback_frame: u32,
    /// Non-zero when the walk stopped for the agent to finish it from a stack copy;
    /// `copy_regs` are then the last recorded frame's registers.
    copy_requested: u32,
    copy_exact_pc: u32,
    copy_regs: Registers,
    /// The last mapping found, so frames in the same file skip the trie.
    mapping: MappingValue,
    /// The last page found, so frames in the same 64 KiB of code skip the hash lookup.
    page_key: PageKey,
    page: PageEntry,
    /// Stack slots whose return address the kernel replaced with its return-probe trampoline
    /// (calls in progress under a CUDA return probe), and the real addresses; `return_count`
    /// of them are valid.
    return_slots: [u64; MAX_PENDING_RETURNS],
    return_addresses: [u64; MAX_PENDING_RETURNS],
    return_count: u32,
}

#[map(name = "UNWIND_STATE")]
static UNWIND_STATE: PerCpuArray<UnwindState> = PerCpuArray::with_max_entries(SCRATCH_SLOTS, 0);

const FRAME_MASK: u32 = MAX_USER_FRAMES as u32 - 1;
const _: () = assert!(MAX_USER_FRAMES.is_power_of_two());

struct Rows;

impl RowSource for Rows {
    #[inline(always)]
    fn row(&self, index: u32) -> Option<UnwindRow> {
        let chunk = UNWIND_ROWS.get(index / ROWS_PER_CHUNK as u32)?;
        Some(chunk.rows[(index as usize) & (ROWS_PER_CHUNK - 1)])
    }
}

/// The user registers saved on kernel entry, for samples that landed in the kernel.
#[inline(always)]
pub fn task_user_registers() -> Option<Registers> {
    // SAFETY: helpers on the current task; the pt_regs pointer is read with probe_read_kernel.
    unsafe {
        let task = bpf_get_current_task_btf();
        let regs = bpf_task_pt_regs(task) as *const pt_regs;
        if regs.is_null() {
            return None;
        }
        let regs: pt_regs = bpf_probe_read_kernel(regs).ok()?;
        // Kernel threads never entered from user space: their saved registers are zero.
        if regs.rip == 0 || regs.rsp == 0 {
            return None;
        }
        Some(Registers {
            rip: regs.rip,
            rsp: regs.rsp,
            rbp: regs.rbp,
        })
    }
}

/// Fills `sample.user_ips` and the user part of `sample.header.flags`.
///
/// `slot` picks this CPU's scratch state (the sampler's or the CUDA probes', so a sample taken
/// while a probe runs cannot overwrite the probe's walk); `sample` must be that slot's sample.
/// `exact_pc` says `regs.rip` is the current instruction rather than a return address.
/// `copy_allowed` is false when the record's ring is too full for a stack copy: a walk that
/// would stop for one is cut there instead (and counted). `returns` is the thread's CUDA state
/// when it has calls in progress under return probes: their stack slots hold the kernel's
/// trampoline, and the walk (and a stack copy) use the real return addresses instead.
#[inline(always)]
pub fn collect(
    slot: u32,
    pid: u32,
    regs: Option<Registers>,
    exact_pc: bool,
    copy_allowed: bool,
    returns: Option<*const CudaThread>,
    sample: *mut RawSample,
) {
    // SAFETY: the caller's scratch sample for `slot`; only raw accesses, since the bpf_loop
    // callback writes it too.
    unsafe {
        (*sample).header.user_frames = 0;
        (*sample).header.fallback_frame = NO_FALLBACK_FRAME;
        if !exact_pc {
            (*sample).header.flags |= SAMPLE_USER_LEAF_RETURN_ADDRESS;
        }
    }
    let Some(regs) = regs else {
        count(STAT_UNWIND_NO_USER_CONTEXT);
        return;
    };
    let Some(state) = UNWIND_STATE.get_ptr_mut(slot) else {
        return;
    };
    let mut loop_slot = slot;
    // SAFETY: this CPU's state slot.
    unsafe {
        (*state).regs = regs;
        (*state).pid = pid;
        (*state).frames = 0;
        (*state).flags = 0;
        (*state).exact_pc = u32::from(exact_pc);
        (*state).done = 0;
        (*state).frame_pointer_frames = 0;
        (*state).fallback_frame = NO_FALLBACK_FRAME as u32;
        (*state).copy_requested = 0;
        (*state).mapping = MappingValue::default();
        (*state).page_key = PageKey::default();
        (*state).return_count = 0;
        if let Some(thread) = returns {
            let depth = (*thread).depth as usize;
            (*state).return_count = depth.min(MAX_PENDING_RETURNS) as u32;
            (*state).return_slots = (*thread).return_slots;
            (*state).return_addresses = (*thread).return_addresses;
        }
        bpf_loop(
            MAX_USER_FRAMES as u32,
            unwind_step as *mut c_void,
            (&raw mut loop_slot).cast(),
            0,
        );
        if ptr::read_volatile(&raw const (*state).done) == 0 {
            (*state).flags |= SAMPLE_USER_TRUNCATED;
            count(STAT_UNWIND_DEPTH_LIMIT);
        }
        let frames = ptr::read_volatile(&raw const (*state).frames);
        count_by(STAT_UNWIND_FRAMES, frames as u64);
        count_by(
            STAT_UNWIND_FRAME_POINTER_CODE,
            ptr::read_volatile(&raw const (*state).frame_pointer_frames) as u64,
        );
        (*sample).header.user_frames = frames as u16;
        (*sample).header.fallback_frame =
            ptr::read_volatile(&raw const (*state).fallback_frame) as u16;
        (*sample).header.flags |= ptr::read_volatile(&raw const (*state).flags);
        if ptr::read_volatile(&raw const (*state).copy_requested) != 0 {
            if copy_allowed {
                let regs = (*state).copy_regs;
                let exact = ptr::read_volatile(&raw const (*state).copy_exact_pc) != 0;
                copy_stack(sample, &regs, exact);
                restore_return_addresses(sample, &*state);
            } else {
                // Shed under pressure: the stack ends at the last proven frame, marked.
                (*sample).header.flags |= SAMPLE_USER_TRUNCATED;
                count(STAT_UNWIND_STACK_COPY_SHED);
            }
        }
    }
}

/// Copies the user stack from `regs.rsp` upward, a page at a time, until
/// `STACK_COPY_BYTES` or the first unreadable page, and records `regs` with it.
#[inline(always)]
fn copy_stack(sample: *mut RawSample, regs: &Registers, exact_pc: bool) {
    const PAGE: u32 = 4096;
    const LIMIT: u32 = STACK_COPY_BYTES as u32;
    const _: () = assert!(STACK_COPY_BYTES.is_power_of_two() && STACK_COPY_SLACK >= 4096);
    let mut copied: u32 = 0;
    // SAFETY: this slot's scratch sample; each read stays inside `stack`: the offset is below
    // LIMIT and the length at most a page, and the buffer has a page of slack.
    unsafe {
        let buffer = (&raw mut (*sample).stack).cast::<u8>();
        for _ in 0..(LIMIT / PAGE + 1) {
            if copied >= LIMIT {
                break;
            }
            let from = regs.rsp.wrapping_add(copied as u64);
            let mut length = PAGE - (from & (PAGE as u64 - 1)) as u32;
            if length > LIMIT - copied {
                length = LIMIT - copied;
            }
            if length > PAGE {
                length = PAGE;
            }
            let offset = (copied & (LIMIT - 1)) as usize;
            if bpf_probe_read_user_raw(buffer.add(offset).cast(), length, from as *const c_void)
                != 0
            {
                break;
            }
            copied += length;
        }
        (*sample).copy = StackCopyHeader {
            rip: regs.rip,
            rsp: regs.rsp,
            rbp: regs.rbp,
            flags: if exact_pc { STACK_COPY_EXACT_PC } else { 0 },
            bytes: copied,
        };
        (*sample).header.flags |= SAMPLE_USER_STACK_COPY;
    }
    count(STAT_UNWIND_STACK_COPIES);
    if copied == 0 {
        count(STAT_UNWIND_STACK_COPY_EMPTY);
    }
}

/// Writes the real return addresses into a stack copy over the kernel's return-probe
/// trampolines, so the agent's walk of the copy sees the real callers.
#[inline(always)]
fn restore_return_addresses(sample: *mut RawSample, state: &UnwindState) {
    const LIMIT: u64 = STACK_COPY_BYTES as u64;
    // SAFETY: this slot's scratch sample; the offset is masked below LIMIT and the buffer has
    // slack past it.
    unsafe {
        let copied = (*sample).copy.bytes as u64;
        let rsp = (*sample).copy.rsp;
        let buffer = (&raw mut (*sample).stack).cast::<u8>();
        for i in 0..MAX_PENDING_RETURNS {
            if i as u32 >= state.return_count {
                break;
            }
            let offset = state.return_slots[i].wrapping_sub(rsp);
            if offset.saturating_add(8) > copied {
                continue;
            }
            let at = buffer.add((offset & (LIMIT - 1)) as usize).cast::<u64>();
            ptr::write_unaligned(at, state.return_addresses[i]);
        }
    }
}

/// Ends the walk at the frame just recorded (whose registers are `state.regs`): the agent
/// finishes it from a copy of the stack once it knows the process and the frame's table.
#[inline(always)]
fn stop_for_copy(state: &mut UnwindState, exact_pc: bool, flags: u32) -> i64 {
    state.copy_requested = 1;
    state.copy_exact_pc = u32::from(exact_pc);
    state.copy_regs = state.regs;
    state.done = 1;
    state.flags |= flags;
    1
}

/// What `vma_in_file` reads and answers.
#[repr(C)]
struct VmaQuery {
    /// Offset of `vm_file` in `vm_area_struct`.
    file_offset: u64,
    in_file: u64,
}

/// `bpf_find_vma` callback: whether the mapping found maps a file.
#[inline(never)]
extern "C" fn vma_in_file(_task: *mut c_void, vma: *mut c_void, ctx: *mut c_void) -> i64 {
    // SAFETY: `in_file` passes a pointer to a `VmaQuery` on its stack; the kernel's vma is read
    // with probe_read_kernel.
    unsafe {
        let query = &mut *(ctx as *mut VmaQuery);
        let file = bpf_probe_read_kernel((vma as u64 + query.file_offset) as *const u64);
        query.in_file = u64::from(matches!(file, Ok(file) if file != 0));
    }
    0
}

/// Whether `pc` is in a file-backed mapping of the current task; false when unknown (no
/// offset from the BTF, or the task's mappings are locked at the moment).
#[inline(always)]
fn in_file(pc: u64) -> bool {
    let file_offset = CONFIG.get(0).map_or(0, |config| config.vma_file_offset);
    if file_offset == 0 {
        return false;
    }
    let mut query = VmaQuery {
        file_offset: u64::from(file_offset),
        in_file: 0,
    };
    // SAFETY: the current task's BTF pointer, a callback of the signature the helper expects
    // and a pointer to the stack it reads.
    let found = unsafe {
        bpf_find_vma(
            bpf_get_current_task_btf(),
            pc,
            vma_in_file as *mut c_void,
            &mut query as *mut VmaQuery as *mut c_void,
            0,
        )
    };
    found == 0 && query.in_file != 0
}

/// Ends the walk; `stat` says why.
#[inline(always)]
fn stop(state: &mut UnwindState, stat: u32, flags: u32) -> i64 {
    state.done = 1;
    state.flags |= flags;
    count(stat);
    1
}

#[inline(always)]
fn read_user(addr: u64) -> Option<u64> {
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

/// One frame: records `regs.rip`, then computes the caller's registers.
#[inline(never)]
extern "C" fn unwind_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `collect` passes a pointer to the slot number on its stack.
    let slot = unsafe { *(ctx as *const u32) };
    let Some(state) = UNWIND_STATE.get_ptr_mut(slot) else {
        return 1;
    };
    let Some(sample) = scratch_sample(slot) else {
        return 1;
    };
    // SAFETY: this CPU's slots, not shared with anything running concurrently on it.
    let (state, sample) = unsafe { (&mut *state, &mut *sample) };
    let regs = state.regs;
    if regs.rip == 0 {
        return stop(state, STAT_UNWIND_COMPLETE, 0);
    }
    if state.frames >= MAX_USER_FRAMES as u32 {
        return stop(state, STAT_UNWIND_DEPTH_LIMIT, SAMPLE_USER_TRUNCATED);
    }
    sample.user_ips[(state.frames & FRAME_MASK) as usize] = regs.rip;
    state.frames += 1;

    // A return address points after the call; the call itself belongs to the caller's rule.
    let exact_pc = state.exact_pc != 0;
    let lookup_pc = if exact_pc { regs.rip } else { regs.rip - 1 };
    state.exact_pc = 0;

    let m = &state.mapping;
    if !(m.start <= lookup_pc && lookup_pc < m.end) {
        let key = Key::new(32 + 64, MappingKey::new(state.pid, lookup_pc));
        match PROCESS_MAPPINGS.get(&key) {
            // Only the process's marker: a registered process, an address it did not have
            // mapped when registered (JIT code, a library loaded since).
            Some(found) if found.flags & MAPPING_PROCESS_MARKER != 0 => {
                count(STAT_UNWIND_FP_NO_MAPPING);
                // A file mapped since (a library being loaded) has CFI the agent can read once
                // it sees the mapping: its callers are not guessed from RBP.
                if in_file(lookup_pc) {
                    count(STAT_UNWIND_NEW_FILE_MAPPING);
                    return stop_for_copy(state, exact_pc, SAMPLE_USER_UNKNOWN_MAPPING);
                }
                state.flags |= SAMPLE_USER_UNKNOWN_MAPPING;
                return frame_pointer_step(state);
            }
            Some(found) => state.mapping = *found,
            // Not registered yet: the agent has not seen this process's mappings.
            None => return stop_for_copy(state, exact_pc, SAMPLE_USER_UNKNOWN_MAPPING),
        }
    }
    let mapping = state.mapping;
    if mapping.flags & MAPPING_TABLE_PENDING != 0 {
        return stop_for_copy(state, exact_pc, SAMPLE_USER_TABLE_MISSING);
    }
    if mapping.flags & MAPPING_HAS_TABLE == 0 {
        count(STAT_UNWIND_FP_NO_CFI);
        return frame_pointer_step(state);
    }
    // A return address in a file whose every call site has the standard frame: RBP gives the
    // caller exactly as the table would, without the page and row lookups. The interrupted
    // instruction itself may be in a prologue, so it still takes the table.
    if !exact_pc && mapping.flags & MAPPING_RELIABLE_FRAME_POINTERS != 0 {
        return frame_pointer_run(state, sample);
    }
    let file_pc = lookup_pc.wrapping_sub(mapping.load_bias);
    let page_key = PageKey {
        table_id: mapping.table_id,
        page: (file_pc >> PAGE_SHIFT) as u32,
    };
    // Table ids start at 1, so the zeroed key of a fresh walk never matches.
    if state.page_key != page_key {
        let Some(page) = (unsafe { UNWIND_PAGES.get(&page_key) }).copied() else {
            // The table was evicted (or never placed): the agent reads it again and finishes.
            count(STAT_UNWIND_FP_NO_TABLE);
            return stop_for_copy(state, exact_pc, SAMPLE_USER_TABLE_MISSING);
        };
        state.page_key = page_key;
        state.page = page;
    }
    let page = state.page;
    let Some(row) = find_row(&Rows, page.first_row, page.row_count, file_pc as u16) else {
        count(STAT_UNWIND_FP_NO_TABLE);
        return stop_for_copy(state, exact_pc, SAMPLE_USER_TABLE_MISSING);
    };
    if row.cfa_kind == CFA_PLT {
        count(STAT_UNWIND_PLT_FRAMES);
    }
    match step(&row, &regs, read_user) {
        Step::Caller(caller) => advance(state, caller),
        Step::Outermost => stop(state, STAT_UNWIND_COMPLETE, 0),
        Step::Unreadable => stop(
            state,
            STAT_UNWIND_READ_ERROR,
            SAMPLE_USER_STACK_ERROR | SAMPLE_USER_TRUNCATED,
        ),
        Step::NoRule if row.cfa_kind == CFA_SIGNAL => signal_step(state),
        Step::NoRule => {
            count(STAT_UNWIND_FP_NO_CFI);
            frame_pointer_step(state)
        }
    }
}

/// Return addresses in a file with reliable frame pointers: follows the RBP chain for as long
/// as it stays in that file (up to `FRAME_POINTER_RUN` frames), in one `bpf_loop` iteration.
/// The frame at `state.regs` is already recorded.
#[inline(always)]
fn frame_pointer_run(state: &mut UnwindState, sample: &mut RawSample) -> i64 {
    let (start, end) = (state.mapping.start, state.mapping.end);
    let mut result = frame_chain_step(state);
    state.frame_pointer_frames += 1;
    for _ in 1..FRAME_POINTER_RUN {
        let rip = state.regs.rip;
        let pc = rip.wrapping_sub(1);
        if result != 0 || !(start <= pc && pc < end) || state.frames >= MAX_USER_FRAMES as u32 {
            break;
        }
        sample.user_ips[(state.frames & FRAME_MASK) as usize] = rip;
        state.frames += 1;
        state.frame_pointer_frames += 1;
        result = frame_chain_step(state);
    }
    result
}

/// Frames one `frame_pointer_run` walks at most: bounds the verifier's work per iteration.
const FRAME_POINTER_RUN: u32 = 8;

/// Moves to the caller, refusing frames that do not move up the stack. A return address read
/// from a slot of a call in progress under a return probe is the kernel's trampoline: the real
/// one is used.
#[inline(always)]
fn advance(state: &mut UnwindState, mut caller: Registers) -> i64 {
    if state.return_count > 0 {
        // Every rule reads the return address just below the caller's stack pointer.
        let slot = caller.rsp.wrapping_sub(8);
        for i in 0..MAX_PENDING_RETURNS {
            if (i as u32) < state.return_count && state.return_slots[i] == slot {
                caller.rip = state.return_addresses[i];
                count(STAT_UNWIND_RETURN_PROBE_FRAMES);
            }
        }
    }
    if caller.rip == 0 {
        return stop(state, STAT_UNWIND_COMPLETE, 0);
    }
    if caller.rsp <= state.regs.rsp {
        return stop(state, STAT_UNWIND_BAD_FRAME, SAMPLE_USER_TRUNCATED);
    }
    state.regs = caller;
    0
}

/// The frame-pointer fallback for code the tables do not cover: flagged on the sample, since
/// such a walk may skip frames.
#[inline(always)]
fn frame_pointer_step(state: &mut UnwindState) -> i64 {
    state.flags |= SAMPLE_USER_FRAME_POINTERS;
    if state.fallback_frame == NO_FALLBACK_FRAME as u32 {
        // The frame just recorded is exact; its caller is the first guess.
        state.fallback_frame = state.frames.wrapping_sub(1);
    }
    if state.regs.rbp == 0 {
        // The ABI's marker of the outermost frame (`_start` clears RBP).
        return stop(state, STAT_UNWIND_FP_END, 0);
    }
    frame_chain_step(state)
}

/// The classic walk: the saved RBP and return address sit at RBP and RBP + 8.
#[inline(always)]
fn frame_chain_step(state: &mut UnwindState) -> i64 {
    if state.regs.rbp == 0 {
        // In code with reliable frame pointers RBP is only 0 above `_start`, which clears it.
        return stop(state, STAT_UNWIND_COMPLETE, 0);
    }
    let Some(caller) = frame_pointer_caller(&state.regs, read_user) else {
        return stop(
            state,
            STAT_UNWIND_READ_ERROR,
            SAMPLE_USER_STACK_ERROR | SAMPLE_USER_TRUNCATED,
        );
    };
    if caller.rip == 0 {
        return stop(state, STAT_UNWIND_FP_END, SAMPLE_USER_TRUNCATED);
    }
    advance(state, caller)
}

/// `__restore_rt`: the interrupted context's registers are in the `ucontext` on the stack, and
/// its RIP is the interrupted instruction itself, not a return address.
#[inline(always)]
fn signal_step(state: &mut UnwindState) -> i64 {
    count(STAT_UNWIND_SIGNAL_FRAMES);
    let Some(interrupted) = signal_registers(&state.regs, read_user) else {
        return stop(
            state,
            STAT_UNWIND_READ_ERROR,
            SAMPLE_USER_STACK_ERROR | SAMPLE_USER_TRUNCATED,
        );
    };
    if interrupted.rip == 0 {
        return stop(state, STAT_UNWIND_COMPLETE, 0);
    }
    // The interrupted code may have been deeper in the stack than the handler's frame, so the
    // usual "moves up" check does not apply here.
    state.regs = interrupted;
    state.exact_pc = 1;
    0
}
