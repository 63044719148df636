//! Proof that a file's return addresses can be unwound from RBP alone.
//!
//! The BPF unwinder takes a shortcut for return addresses in files marked
//! `MAPPING_RELIABLE_FRAME_POINTERS`: it follows the RBP chain instead of looking up rows. That
//! gives the table's answer only where the caller was inside a standard frame (`CFA = RBP + 16`,
//! RBP saved at `CFA - 16`) when it made the call, since a return address always points just
//! after a call. The rows alone cannot tell: a function whose rows all say `CFA = RSP + 8` may
//! be a leaf, or may call a local function without aligning the stack (GCC does this for
//! callees it knows need no alignment) while the caller's caller uses RBP as a general
//! register. So the code is decoded, and every call instruction inside CFI-covered code is
//! checked against the row in effect at its address.
//!
//! Decoding restarts at every row boundary (rows start at instruction boundaries), so data or
//! padding cannot carry a misaligned decode from one function into the next.

use std::ops::Range;

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic};
use object::{Object, ObjectSection, SectionFlags, elf::SHF_EXECINSTR};
use profiler_common::unwind::{CFA_END, CFA_NONE, CFA_PLT, CFA_RBP, RBP_AT_CFA};

use super::{Rule, TableRow};

/// What the check of a file's call sites found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallSiteCheck {
    /// Bytes of code decoded (0: the check did not run, e.g. no code in the file).
    pub code_bytes: u64,
    /// Call instructions seen before the check ended.
    pub call_sites: u64,
    /// The address of the first call made outside a standard frame (or of the first covered
    /// code the file does not hold); the check stops there. 0 when there is none.
    pub first_frame_breaking_call: u64,
}

impl CallSiteCheck {
    /// Every call site decoded keeps a standard frame.
    pub fn proves_frame_pointers(&self) -> bool {
        self.code_bytes > 0 && self.first_frame_breaking_call == 0
    }
}

/// Whether a return address whose call was made under `rule` is unwound correctly from RBP:
/// inside the standard frame, or in the outermost frame (the ABI has `_start` clear RBP, so
/// the chain ends there as the table does).
pub const fn call_keeps_frame(rule: &Rule) -> bool {
    match rule.cfa_kind {
        CFA_RBP => rule.cfa_offset == 16 && rule.rbp_kind == RBP_AT_CFA && rule.rbp_offset == -16,
        CFA_END => true,
        _ => false,
    }
}

/// Decodes the code covered by `rows` (except PLT rows and gaps, which the shortcut and the
/// table treat alike) and checks each call against its row.
pub fn check_call_sites(
    file: &object::File<'_>,
    rows: impl Iterator<Item = TableRow>,
) -> CallSiteCheck {
    let code: Vec<(Range<u64>, &[u8])> = file
        .sections()
        .filter(|section| match section.flags() {
            SectionFlags::Elf { sh_flags } => sh_flags & u64::from(SHF_EXECINSTR) != 0,
            _ => false,
        })
        .filter_map(|section| {
            let data = section.data().ok()?;
            let start = section.address();
            Some((start..start.checked_add(data.len() as u64)?, data))
        })
        .collect();
    let mut check = CallSiteCheck::default();
    let mut instruction = Instruction::default();
    let mut rows = rows.peekable();
    while let Some(row) = rows.next() {
        let Some(end) = rows.peek().map(|next| next.address) else {
            break;
        };
        if matches!(row.rule.cfa_kind, CFA_NONE | CFA_PLT) {
            continue;
        }
        // Code the file does not hold (a separate debug file's NOBITS sections, a row across
        // two sections) cannot be checked, so it proves nothing.
        let Some(bytes) = code_bytes(&code, row.address..end) else {
            check.first_frame_breaking_call = row.address.max(1);
            return check;
        };
        check.code_bytes += bytes.len() as u64;
        let mut decoder = Decoder::with_ip(64, bytes, row.address, DecoderOptions::NONE);
        while decoder.can_decode() {
            decoder.decode_out(&mut instruction);
            if instruction.is_invalid() {
                break;
            }
            if instruction.mnemonic() == Mnemonic::Call {
                check.call_sites += 1;
                if !call_keeps_frame(&row.rule) {
                    check.first_frame_breaking_call = instruction.ip();
                    return check;
                }
            }
        }
    }
    check
}

/// The bytes of `range` if one executable section holds all of them.
fn code_bytes<'a>(code: &[(Range<u64>, &'a [u8])], range: Range<u64>) -> Option<&'a [u8]> {
    let (section, data) = code
        .iter()
        .find(|(section, _)| section.start <= range.start && range.end <= section.end)?;
    let start = usize::try_from(range.start - section.start).ok()?;
    let end = usize::try_from(range.end - section.start).ok()?;
    data.get(start..end)
}
