//! The late unwinder: finishes the user walks BPF stopped rather than guess.
//!
//! BPF stops at a frame whose caller it cannot prove (the process is not registered yet, or the
//! frame's file has CFI whose table is not in the maps) and sends the stack from that frame's
//! RSP (`SAMPLE_USER_STACK_COPY`). Here the walk goes on with exactly BPF's rules
//! (`profiler_common::unwind::step`), the rows read back from the maps and the memory from
//! the copy. A frame whose table is still being built makes the walk [`Walk::Pending`]: the
//! caller holds the sample and tries again once the table is in, and only when it has waited
//! long enough does it [`give up`](Patience::GiveUp), cutting the stack there as truncated.

use profiler_common::{
    MAX_USER_FRAMES,
    unwind::{CFA_SIGNAL, Registers, Step, frame_pointer_caller, signal_registers, step},
};

use std::sync::Arc;

use super::native::RowLookup;
use crate::model::{Mapping, ProcessInfo, Sample};

/// Counters of the late walks (BPF stopped rather than guess; the agent finished).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LateWalkStats {
    /// Walks finished by the agent.
    pub finished: u64,
    /// Of those, cut where a table was still missing after the wait (or at shutdown).
    pub gave_up: u64,
    /// Samples whose process was gone before its mappings were read.
    pub no_process: u64,
    /// Of `finished`: samples taken before their process's exec, walked against the program
    /// before it.
    pub before_exec_walked: u64,
    /// Samples taken inside an exec syscall whose copy was not walked (it may be the new
    /// program's stack).
    pub in_exec_not_walked: u64,
    /// Samples taken inside an exec whose user addresses were already the new program's (its
    /// entry point), dropped: the stack ends `[truncated]` (any sample cut at an exec, not
    /// only those with a stack copy).
    pub in_exec_new_program_cut: u64,
    /// Samples of a process read from /proc for the first time while it exec'ed (the read
    /// shows the new program): resolved against the program before the exec.
    pub exec_during_first_lookup: u64,
    /// Walks that reached a return address their snapshot did not map and went on against a
    /// newer one that does (a library mapped since the snapshot).
    pub refreshed_mid_walk: u64,
    /// Samples not held because the held copies had reached their bound.
    pub over_bound: u64,
    /// Samples held now, and the bytes of their copies.
    pub held: u64,
    pub held_bytes: u64,
}

/// Where the late unwinder gets rows from ([`super::native::NativeTables`] in the agent).
pub trait LateRows {
    fn row_at(&mut self, mapping: &Mapping, pc: u64) -> RowLookup;
}

impl<M: crate::bpf::UnwindMaps> LateRows for super::native::NativeTables<M> {
    fn row_at(&mut self, mapping: &Mapping, pc: u64) -> RowLookup {
        super::native::NativeTables::row_at(self, mapping, pc)
    }
}

/// Whether a walk that needs a table still being built waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Patience {
    Wait,
    /// Cut the stack at that frame instead (marked truncated).
    GiveUp,
}

/// The outcome of [`finish_walk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// The sample's user stack is final (complete, or cut and marked truncated).
    Done,
    /// A table is still being built; the sample is unchanged.
    Pending,
}

/// Finishes the user walk of `sample` from its stack copy against `process`'s mappings. On
/// [`Walk::Done`] the callers found are appended to `user_ips`, `user_truncated` and
/// `fallback_frame` say how the walk ended (as for a BPF walk) and the copy is dropped.
///
/// A return address in none of `process`'s mappings asks `refresh` for a newer snapshot (a
/// snapshot taken while ld.so was still mapping libraries has no libc, where `main`'s and
/// every thread's callers are); when it maps the address, the walk goes on against it and
/// `process` becomes it, so the frames are symbolized against the same mappings.
pub fn finish_walk(
    sample: &mut Sample,
    process: &mut Arc<ProcessInfo>,
    rows: &mut impl LateRows,
    patience: Patience,
    refresh: &mut dyn FnMut(u64) -> Option<Arc<ProcessInfo>>,
) -> Walk {
    let Some(copy) = sample.stack_copy.as_deref() else {
        return Walk::Done;
    };
    let read = |address: u64| copy.read(address);
    let recorded = sample.user_ips.len();
    let mut regs = Registers {
        rip: copy.rip,
        rsp: copy.rsp,
        rbp: copy.rbp,
    };
    let mut exact_pc = copy.exact_pc;
    // Sized for a typical walk: grown push by push it was reallocated several times a walk.
    let mut callers = Vec::with_capacity(32);
    let mut fallback = None;
    let mut truncated = false;
    loop {
        if recorded + callers.len() >= MAX_USER_FRAMES {
            truncated = true;
            break;
        }
        // A return address points after the call; the call belongs to the caller's rule.
        let pc = if exact_pc {
            regs.rip
        } else {
            regs.rip.wrapping_sub(1)
        };
        if process.mapping_for(pc).is_none()
            && let Some(fresh) = refresh(pc).filter(|fresh| fresh.mapping_for(pc).is_some())
        {
            *process = fresh;
        }
        let lookup = match process.mapping_for(pc) {
            Some(mapping) => rows.row_at(mapping, pc),
            None => RowLookup::NoTable,
        };
        let caller = match lookup {
            RowLookup::Pending if patience == Patience::Wait => return Walk::Pending,
            RowLookup::Pending => {
                truncated = true;
                break;
            }
            RowLookup::Row(row) => match step(&row, &regs, read) {
                Step::Caller(caller) => caller,
                Step::Outermost => break,
                Step::Unreadable => {
                    truncated = true;
                    break;
                }
                Step::NoRule if row.cfa_kind == CFA_SIGNAL => {
                    // The interrupted code's registers; its RIP is exact.
                    match signal_registers(&regs, read) {
                        Some(interrupted) if interrupted.rip != 0 => {
                            callers.push(interrupted.rip);
                            regs = interrupted;
                            exact_pc = true;
                            continue;
                        }
                        Some(_) => break,
                        None => {
                            truncated = true;
                            break;
                        }
                    }
                }
                Step::NoRule => match frame_pointer_step(&regs, read) {
                    FramePointer::Caller(caller) => {
                        fallback.get_or_insert(recorded - 1 + callers.len());
                        caller
                    }
                    FramePointer::End => break,
                    FramePointer::Cut => {
                        truncated = true;
                        break;
                    }
                },
            },
            RowLookup::NoTable | RowLookup::NoRow => {
                fallback.get_or_insert(recorded - 1 + callers.len());
                match frame_pointer_step(&regs, read) {
                    FramePointer::Caller(caller) => caller,
                    FramePointer::End => break,
                    FramePointer::Cut => {
                        truncated = true;
                        break;
                    }
                }
            }
        };
        if caller.rip == 0 {
            break;
        }
        // Frames must move up the stack, or the walk could loop.
        if caller.rsp <= regs.rsp {
            truncated = true;
            break;
        }
        callers.push(caller.rip);
        regs = caller;
        exact_pc = false;
    }
    sample.user_ips.extend(callers);
    sample.user_truncated |= truncated;
    if sample.fallback_frame.is_none() {
        sample.fallback_frame = fallback;
    }
    sample.stack_copy = None;
    Walk::Done
}

enum FramePointer {
    Caller(Registers),
    /// RBP 0: the ABI's outermost-frame marker.
    End,
    /// The chain could not be read.
    Cut,
}

fn frame_pointer_step(regs: &Registers, read: impl Fn(u64) -> Option<u64>) -> FramePointer {
    if regs.rbp == 0 {
        return FramePointer::End;
    }
    match frame_pointer_caller(regs, read) {
        Some(caller) if caller.rip != 0 => FramePointer::Caller(caller),
        _ => FramePointer::Cut,
    }
}

#[cfg(test)]
mod tests;
