//! Native unwind tables: the row format and the lookup that the BPF unwinder runs, shared with
//! the agent so host tests exercise exactly the code BPF executes.
//!
//! The agent turns each ELF file's `.eh_frame` into rows `pc → (CFA rule, RBP rule)`, merged and
//! split into 64 KiB pages of the file's virtual address space. A page's rows are contiguous in
//! the global row array (stored in chunks of [`ROWS_PER_CHUNK`]) and its first row always starts
//! at offset 0 of the page, so a lookup never looks outside the page: a bounded binary search on
//! the low 16 bits of the PC.

/// Rows per element of the `UNWIND_ROWS` array map.
pub const ROWS_PER_CHUNK: usize = 256;
/// Pages cover `1 << PAGE_SHIFT` bytes of a file's address space.
pub const PAGE_SHIFT: u32 = 16;
/// Enough binary-search steps for the largest possible page (65,536 rows plus the start row).
pub const MAX_SEARCH_STEPS: u32 = 17;

/// No CFI covers this PC (a gap between FDEs): fall back to the frame pointer.
pub const CFA_NONE: u8 = 0;
/// CFA = RSP + cfa_offset.
pub const CFA_RSP: u8 = 1;
/// CFA = RBP + cfa_offset.
pub const CFA_RBP: u8 = 2;
/// The `.plt` rule GCC and ld emit: CFA = RSP + 8 + ((RIP & 15) >= 11 ? 8 : 0).
pub const CFA_PLT: u8 = 3;
/// A signal trampoline (`__restore_rt`): the interrupted registers are in the `ucontext` on the
/// stack.
pub const CFA_SIGNAL: u8 = 4;
/// The outermost frame (the return address is undefined, e.g. `_start`): the stack is complete.
pub const CFA_END: u8 = 5;
/// A CFA expression the unwinder cannot evaluate: fall back to the frame pointer.
pub const CFA_UNSUPPORTED: u8 = 6;
/// CFA = the word at RBP + cfa_offset: functions that realign their stack (GCC's "DRAP", for
/// AVX locals) keep the pointer to their argument area, which is the CFA, in their frame
/// (`DW_OP_breg6 n; DW_OP_deref`).
pub const CFA_RBP_DEREF: u8 = 7;

/// RBP keeps its value in the caller.
pub const RBP_UNCHANGED: u8 = 0;
/// The caller's RBP is saved at CFA + rbp_offset.
pub const RBP_AT_CFA: u8 = 1;
/// The caller's RBP is saved at RBP + rbp_offset (`DW_CFA_expression rbp: DW_OP_breg6 n`, the
/// frame of a stack-realigning function).
pub const RBP_AT_RBP: u8 = 2;

/// Offset of `uc_mcontext.gregs` from RSP in the `__restore_rt` frame: the handler's `ret`
/// popped `rt_sigframe.pretcode`, so RSP points at `struct ucontext`, whose mcontext starts at
/// byte 40 (after uc_flags, uc_link and uc_stack).
pub const SIGNAL_MCONTEXT_OFFSET: u64 = 40;
/// `gregs` indexes (`REG_RBP`, `REG_RSP`, `REG_RIP` in `<sys/ucontext.h>`).
pub const SIGNAL_GREG_RBP: u64 = 10;
pub const SIGNAL_GREG_RSP: u64 = 15;
pub const SIGNAL_GREG_RIP: u64 = 16;

/// One row: the rules in effect from `pc_low` (offset in the page) to the next row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRow {
    pub pc_low: u16,
    pub cfa_kind: u8,
    pub rbp_kind: u8,
    pub cfa_offset: i16,
    pub rbp_offset: i16,
}

const _: () = assert!(core::mem::size_of::<UnwindRow>() == 8);

/// One element of the `UNWIND_ROWS` array map.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RowChunk {
    pub rows: [UnwindRow; ROWS_PER_CHUNK],
}

const _: () = assert!(core::mem::size_of::<RowChunk>() == 8 * ROWS_PER_CHUNK);

/// Key of the `UNWIND_PAGES` hash map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PageKey {
    /// Table id assigned by the agent (never 0).
    pub table_id: u32,
    /// File virtual address >> PAGE_SHIFT.
    pub page: u32,
}

/// Where a page's rows are in the global row array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageEntry {
    pub first_row: u32,
    pub row_count: u32,
}

/// Key of the `PROCESS_MAPPINGS` LPM trie: pid then address, both big-endian, so one process's
/// mappings share the 32-bit pid prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingKey {
    pub bytes: [u8; 12],
}

impl MappingKey {
    pub const fn new(pid: u32, addr: u64) -> Self {
        let p = pid.to_be_bytes();
        let a = addr.to_be_bytes();
        MappingKey {
            bytes: [
                p[0], p[1], p[2], p[3], a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
            ],
        }
    }
}

/// The mapping has an unwind table (`table_id`).
pub const MAPPING_HAS_TABLE: u32 = 1 << 0;
/// Code without CFI (JIT, anonymous memory, a file whose table could not be built): use frame
/// pointers.
pub const MAPPING_FRAME_POINTERS: u32 = 1 << 1;

/// Every function of the mapped file keeps a standard frame-pointer frame wherever it calls
/// (see the agent's `UnwindTable::frame_pointers_reliable`): return addresses in it are unwound
/// from RBP without a row lookup. Only set together with `MAPPING_HAS_TABLE`.
pub const MAPPING_RELIABLE_FRAME_POINTERS: u32 = 1 << 2;
/// The file has CFI but its table is still being built: BPF stops there and sends a copy of
/// the stack for the agent to finish the walk, rather than guess from RBP.
pub const MAPPING_TABLE_PENDING: u32 = 1 << 3;
/// The per-process marker (prefix length 32, the pid alone): the process is registered, so an
/// address that finds only this entry is in no mapping the agent knows (JIT code made since,
/// a library loaded since). Its `start` and `end` are 0.
pub const MAPPING_PROCESS_MARKER: u32 = 1 << 4;

/// Value of the `PROCESS_MAPPINGS` LPM trie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingValue {
    pub table_id: u32,
    pub flags: u32,
    /// Subtract from a PC to get the file's virtual address.
    pub load_bias: u64,
    /// The mapping's range, so consecutive frames in the same mapping skip the trie.
    pub start: u64,
    pub end: u64,
}

const _: () = assert!(core::mem::size_of::<MappingValue>() == 32);

/// Read access to the global row array (a BPF array map, or a slice on the host).
pub trait RowSource {
    fn row(&self, index: u32) -> Option<UnwindRow>;
}

/// The row in effect at `pc_low` among the `count` rows starting at `first`, sorted by
/// `pc_low`. Bounded by [`MAX_SEARCH_STEPS`] steps, as the verifier requires.
#[inline(always)]
pub fn find_row<S: RowSource>(rows: &S, first: u32, count: u32, pc_low: u16) -> Option<UnwindRow> {
    if count == 0 {
        return None;
    }
    // Invariant: rows[lo].pc_low <= pc_low < rows[hi].pc_low (hi == count stands for +inf).
    let mut lo = 0u32;
    let mut hi = count;
    let mut step = 0;
    while step < MAX_SEARCH_STEPS {
        if hi - lo <= 1 {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        let row = rows.row(first.wrapping_add(mid))?;
        if row.pc_low <= pc_low {
            lo = mid;
        } else {
            hi = mid;
        }
        step += 1;
    }
    if hi - lo > 1 {
        return None;
    }
    let row = rows.row(first.wrapping_add(lo))?;
    (row.pc_low <= pc_low).then_some(row)
}

/// Registers the unwinder tracks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Registers {
    pub rip: u64,
    pub rsp: u64,
    pub rbp: u64,
}

/// The canonical frame address for `row` at `regs`, for the rules that compute one; `read`
/// reads a word of the unwound thread's memory.
#[inline(always)]
pub fn cfa(
    row: &UnwindRow,
    regs: &Registers,
    read: impl FnOnce(u64) -> Option<u64>,
) -> Option<u64> {
    match row.cfa_kind {
        CFA_RSP => Some(regs.rsp.wrapping_add(row.cfa_offset as i64 as u64)),
        CFA_RBP => Some(regs.rbp.wrapping_add(row.cfa_offset as i64 as u64)),
        CFA_RBP_DEREF => read(regs.rbp.wrapping_add(row.cfa_offset as i64 as u64)),
        CFA_PLT => Some(
            regs.rsp
                .wrapping_add(if regs.rip & 15 >= 11 { 16 } else { 8 }),
        ),
        _ => None,
    }
}

/// One step of the walk: what the rules say about the caller of the frame at `regs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The caller's registers.
    Caller(Registers),
    /// The outermost frame: the stack is complete.
    Outermost,
    /// Memory the rule needs could not be read.
    Unreadable,
    /// The row computes no caller (`CFA_NONE`, `CFA_UNSUPPORTED`, `CFA_SIGNAL`): the caller
    /// decides (frame pointers, the signal frame).
    NoRule,
}

/// The caller of the frame at `regs` under `row` (the row in effect at its PC, or at its
/// return address - 1). BPF and the agent's late unwinder run exactly this.
#[inline(always)]
pub fn step(row: &UnwindRow, regs: &Registers, read: impl Fn(u64) -> Option<u64>) -> Step {
    match row.cfa_kind {
        CFA_END => Step::Outermost,
        CFA_RSP | CFA_RBP | CFA_PLT | CFA_RBP_DEREF => {
            let Some(cfa) = cfa(row, regs, &read) else {
                return Step::Unreadable;
            };
            let Some(return_address) = read(cfa.wrapping_sub(8)) else {
                return Step::Unreadable;
            };
            let rbp = match saved_rbp_address(row, regs, cfa) {
                Some(address) => match read(address) {
                    Some(rbp) => rbp,
                    None => return Step::Unreadable,
                },
                None => regs.rbp,
            };
            Step::Caller(Registers {
                rip: return_address,
                rsp: cfa,
                rbp,
            })
        }
        _ => Step::NoRule,
    }
}

/// The caller by the frame-pointer chain: the saved RBP and the return address sit at RBP and
/// RBP + 8. `None` when they cannot be read.
#[inline(always)]
pub fn frame_pointer_caller(
    regs: &Registers,
    read: impl Fn(u64) -> Option<u64>,
) -> Option<Registers> {
    let saved_rbp = read(regs.rbp)?;
    let return_address = read(regs.rbp.wrapping_add(8))?;
    Some(Registers {
        rip: return_address,
        rsp: regs.rbp.wrapping_add(16),
        rbp: saved_rbp,
    })
}

/// The interrupted context of a signal frame (`__restore_rt`, RSP at its `ucontext`): its RIP
/// is the interrupted instruction itself, not a return address.
#[inline(always)]
pub fn signal_registers(regs: &Registers, read: impl Fn(u64) -> Option<u64>) -> Option<Registers> {
    let gregs = regs.rsp.wrapping_add(SIGNAL_MCONTEXT_OFFSET);
    Some(Registers {
        rbp: read(gregs + SIGNAL_GREG_RBP * 8)?,
        rsp: read(gregs + SIGNAL_GREG_RSP * 8)?,
        rip: read(gregs + SIGNAL_GREG_RIP * 8)?,
    })
}

/// Where the caller's RBP is saved under `row`, given the frame's `cfa`; `None` when RBP keeps
/// its value.
#[inline(always)]
pub fn saved_rbp_address(row: &UnwindRow, regs: &Registers, cfa: u64) -> Option<u64> {
    match row.rbp_kind {
        RBP_AT_CFA => Some(cfa.wrapping_add(row.rbp_offset as i64 as u64)),
        RBP_AT_RBP => Some(regs.rbp.wrapping_add(row.rbp_offset as i64 as u64)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Slice<'a>(&'a [UnwindRow]);

    impl RowSource for Slice<'_> {
        fn row(&self, index: u32) -> Option<UnwindRow> {
            self.0.get(index as usize).copied()
        }
    }

    fn row(pc_low: u16, cfa_offset: i16) -> UnwindRow {
        UnwindRow {
            pc_low,
            cfa_kind: CFA_RSP,
            rbp_kind: RBP_UNCHANGED,
            cfa_offset,
            rbp_offset: 0,
        }
    }

    #[test]
    fn finds_the_row_in_effect() {
        let rows = [row(0, 8), row(4, 16), row(10, 24), row(300, 8)];
        let slice = Slice(&rows);
        for (pc, offset) in [
            (0, 8),
            (3, 8),
            (4, 16),
            (9, 16),
            (10, 24),
            (299, 24),
            (300, 8),
            (u16::MAX, 8),
        ] {
            assert_eq!(
                find_row(&slice, 0, 4, pc).unwrap().cfa_offset,
                offset,
                "pc {pc}"
            );
        }
        // A window inside a larger array.
        assert_eq!(find_row(&slice, 1, 2, 5).unwrap().cfa_offset, 16);
        assert_eq!(find_row(&slice, 1, 2, 3), None, "before the first row");
        assert_eq!(find_row(&slice, 0, 0, 3), None);
        assert_eq!(
            find_row(&slice, 2, 5, 400),
            None,
            "rows past the array end are missing"
        );
    }

    #[test]
    fn largest_page_fits_the_step_bound() {
        let rows: [UnwindRow; 4096] = core::array::from_fn(|i| row((i * 16) as u16, i as i16));
        let slice = Slice(&rows);
        for i in (0..4096).step_by(7) {
            assert_eq!(
                find_row(&slice, 0, 4096, (i * 16 + 3) as u16)
                    .unwrap()
                    .cfa_offset,
                i as i16
            );
        }
    }

    #[test]
    fn computes_cfa_per_rule() {
        let regs = Registers {
            rip: 0x1000b,
            rsp: 0x7ff0,
            rbp: 0x8000,
        };
        let no_memory = |_| -> Option<u64> { panic!("no memory read expected") };
        let mut r = row(0, 24);
        assert_eq!(cfa(&r, &regs, no_memory), Some(0x7ff0 + 24));
        r.cfa_kind = CFA_RBP;
        r.cfa_offset = 16;
        assert_eq!(cfa(&r, &regs, no_memory), Some(0x8010));
        r.cfa_kind = CFA_PLT;
        assert_eq!(
            cfa(&r, &regs, no_memory),
            Some(0x7ff0 + 16),
            "rip & 15 == 11"
        );
        assert_eq!(
            cfa(
                &r,
                &Registers {
                    rip: 0x10000,
                    ..regs
                },
                no_memory
            ),
            Some(0x7ff0 + 8)
        );
        r.cfa_kind = CFA_NONE;
        assert_eq!(cfa(&r, &regs, no_memory), None);
        // A realigned frame: the CFA is the word stored at RBP - 40.
        r.cfa_kind = CFA_RBP_DEREF;
        r.cfa_offset = -40;
        let read = |addr| (addr == 0x8000 - 40).then_some(0x9000);
        assert_eq!(cfa(&r, &regs, read), Some(0x9000));
        assert_eq!(cfa(&r, &regs, |_| None), None, "unreadable");
    }

    #[test]
    fn finds_the_saved_rbp_per_rule() {
        let regs = Registers {
            rip: 0x1000,
            rsp: 0x7ff0,
            rbp: 0x8000,
        };
        let mut r = row(0, 16);
        assert_eq!(saved_rbp_address(&r, &regs, 0x9000), None);
        r.rbp_kind = RBP_AT_CFA;
        r.rbp_offset = -16;
        assert_eq!(saved_rbp_address(&r, &regs, 0x9000), Some(0x9000 - 16));
        r.rbp_kind = RBP_AT_RBP;
        r.rbp_offset = 0;
        assert_eq!(saved_rbp_address(&r, &regs, 0x9000), Some(0x8000));
    }

    #[test]
    fn mapping_keys_are_big_endian() {
        let key = MappingKey::new(0x01020304, 0x1122334455667788);
        assert_eq!(
            key.bytes,
            [1, 2, 3, 4, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]
        );
    }
}
