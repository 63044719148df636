//! CFI → table rows.
//!
//! Rule mapping (per gimli row):
//! - return-address register (the CIE's, 16 on x86_64) `Undefined` → `CFA_END`;
//! - CFA `rsp + n` → `CFA_RSP`, `rbp + n` → `CFA_RBP`; any other register → `CFA_UNSUPPORTED`;
//! - CFA expression in an FDE lying inside `.plt`/`.plt.sec`/`.plt.got`, or exactly ld's PLT
//!   expression → `CFA_PLT`; `DW_OP_breg6 n; DW_OP_deref` (a stack-realigning function's
//!   frame) → `CFA_RBP_DEREF` n; any other expression → `CFA_UNSUPPORTED`;
//! - RBP `Offset(n)` → `RBP_AT_CFA` n; `Expression(DW_OP_breg6 n)` → `RBP_AT_RBP` n;
//!   unspecified, `SameValue` or `Undefined` → `RBP_UNCHANGED`; other RBP rules →
//!   `RBP_UNCHANGED`, counted (the return address is still right; a caller that needs RBP
//!   will find it wrong);
//! - a CFA or RBP offset outside `i16` → `CFA_UNSUPPORTED`;
//! - an FDE whose CIE has the `S` augmentation → one `CFA_SIGNAL` row for its whole range.
//!
//! Rules that compute no CFA (`NONE`, `END`, `SIGNAL`, `UNSUPPORTED`) carry no offsets and no
//! RBP rule. FDEs are ordered by start address (section order among equal starts); where FDEs
//! overlap, the one that starts first keeps its range and a later one only covers what lies
//! beyond it ("first wins"). A gap after an FDE gets a `CFA_NONE` row at the FDE's end, and so
//! does the end of the last FDE.

use std::collections::HashMap;
use std::ops::Range;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, CommonInformationEntry, DebugFrame, EhFrame, EndianSlice,
    LittleEndian, Register, RegisterRule, UnwindContext, UnwindOffset, UnwindSection,
    UnwindTableRow,
};
use object::{Architecture, Object, ObjectSection};
use profiler_common::unwind::{
    CFA_PLT, CFA_RBP, CFA_RBP_DEREF, CFA_RSP, PAGE_SHIFT, RBP_AT_CFA, RBP_AT_RBP, RBP_UNCHANGED,
};

use super::{
    BuildLimits, CfiSource, MAX_ADDRESS, MAX_CACHED_CIES, MAX_FDE_BYTES, MAX_FDE_ROWS, MAX_ROWS,
    Rule, TableError, TableRow, TableStats, UnwindTable, call_sites::check_call_sites,
    pages::PagedBuilder,
};

type Reader<'a> = EndianSlice<'a, LittleEndian>;

const RBP: Register = Register(6);
const RSP: Register = Register(7);

/// ld's CFA expression for `.plt` entries: `rsp + 8 + ((rip & 15) >= 11 ? 8 : 0)`:
/// `DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11; DW_OP_ge; DW_OP_lit3;
/// DW_OP_shl; DW_OP_plus`.
const PLT_EXPRESSION: [u8; 11] = [
    0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
];
/// Index of the `DW_OP_lit11` in [`PLT_EXPRESSION`]; the IBT variant has `DW_OP_lit10` (0x3a).
const PLT_EXPRESSION_THRESHOLD_INDEX: usize = 6;
const DW_OP_LIT10: u8 = 0x3a;

const PLT_SECTIONS: [&str; 3] = [".plt", ".plt.sec", ".plt.got"];

/// Builds the unwind table of an x86_64 ELF file from `.eh_frame`, or `.debug_frame` if there
/// is no (non-empty) `.eh_frame`. A file with neither gets an empty table. Malformed CFI is an
/// error (no partial table, no fallback to the other section): the caller then uses frame
/// pointers for the whole file.
pub fn build_table(elf_bytes: &[u8]) -> Result<UnwindTable, TableError> {
    build_table_within(elf_bytes, &BuildLimits::default())
}

/// [`build_table`] within `limits`: a table that cannot fit is rejected with
/// [`TableError::TooLarge`], from the FDE count before any row is decoded where the count
/// tells, else as soon as its rows pass the bound; the builder's allocations stay under
/// [`BuildLimits::working_bytes`] either way.
pub fn build_table_within(
    elf_bytes: &[u8],
    limits: &BuildLimits,
) -> Result<UnwindTable, TableError> {
    let file = object::File::parse(elf_bytes)?;
    if file.architecture() != Architecture::X86_64 || !file.is_little_endian() {
        return Err(TableError::UnsupportedArchitecture(file.architecture()));
    }
    let mut table = build_from_file(&file, limits)?;
    if limits.checkpoint() {
        return Err(TableError::Cancelled);
    }
    // Only a table that could qualify is worth decoding the code for.
    if table.row_count() > 1 && table.stats.signal_fdes == 0 {
        table.stats.call_sites = check_call_sites(&file, table.paged.table_rows());
    }
    Ok(table)
}

fn build_from_file(
    file: &object::File<'_>,
    limits: &BuildLimits,
) -> Result<UnwindTable, TableError> {
    let section_address = |name: &str| file.section_by_name(name).map(|s| s.address());
    let plt_ranges: Vec<Range<u64>> = PLT_SECTIONS
        .iter()
        .filter_map(|name| file.section_by_name(name))
        .map(|s| s.address()..s.address().saturating_add(s.size()))
        .collect();

    if let Some(section) = file.section_by_name(".eh_frame") {
        let data = section.data().map_err(|source| TableError::Section {
            section: ".eh_frame",
            source,
        })?;
        // A file claiming more FDEs than the budget allows is rejected without reading
        // `.eh_frame` at all (a file claiming fewer than it has is caught by the count below).
        check_claimed_fde_count(file, limits)?;
        // NOBITS in separate debug files: fall through to .debug_frame.
        if !data.is_empty() {
            return build_from_cfi_within(
                &CfiSection {
                    source: CfiSource::EhFrame,
                    data,
                    address: section.address(),
                    text_address: section_address(".text"),
                    got_address: section_address(".got"),
                    plt_ranges: &plt_ranges,
                },
                limits,
            );
        }
    }
    if let Some(section) = file.section_by_name(".debug_frame") {
        // A compressed section is inflated into memory: its size is checked first (real CFI
        // takes 20 to 60 bytes an FDE).
        if let Ok(compressed) = section.compressed_data()
            && compressed.uncompressed_size > limits.max_cfi_bytes()
        {
            return Err(TableError::TooLarge {
                what: "bytes of .debug_frame",
                count: compressed.uncompressed_size,
                limit: limits.max_cfi_bytes(),
                rows_decoded: 0,
            });
        }
        let data = section
            .uncompressed_data()
            .map_err(|source| TableError::Section {
                section: ".debug_frame",
                source,
            })?;
        if !data.is_empty() {
            return build_from_cfi_within(
                &CfiSection {
                    source: CfiSource::DebugFrame,
                    data: &data,
                    address: 0,
                    text_address: None,
                    got_address: None,
                    plt_ranges: &plt_ranges,
                },
                limits,
            );
        }
    }
    UnwindTable::from_rows(Vec::new(), TableStats::default())
}

/// The linker's count of the FDEs, in the header of `.eh_frame_hdr`, against the budget:
/// `TooLarge` when the file claims more than `limits` allows.
fn check_claimed_fde_count(
    file: &object::File<'_>,
    limits: &BuildLimits,
) -> Result<(), TableError> {
    match file
        .section_by_name(".eh_frame_hdr")
        .and_then(|hdr| hdr.data().ok())
        .and_then(eh_frame_hdr_fde_count)
    {
        Some(claimed) if claimed > limits.max_fdes() as u64 => Err(TableError::TooLarge {
            what: "FDEs in .eh_frame_hdr",
            count: claimed,
            limit: limits.max_fdes() as u64,
            rows_decoded: 0,
        }),
        _ => Ok(()),
    }
}

/// `fde_count` from the header of an `.eh_frame_hdr` section, when it is encoded as a plain
/// (absolute) number, as linkers write it; `None` for anything else.
pub(super) fn eh_frame_hdr_fde_count(hdr: &[u8]) -> Option<u64> {
    const OMIT: u8 = 0xff;
    // Bytes of a value in a DW_EH_PE encoding's format.
    let size = |encoding: u8| match encoding & 0x0f {
        0x00 | 0x04 | 0x0c => Some(8),
        0x02 | 0x0a => Some(2),
        0x03 | 0x0b => Some(4),
        _ => None,
    };
    let [1, pointer_encoding, count_encoding, table_encoding, ..] = *hdr else {
        return None;
    };
    if count_encoding == OMIT || table_encoding == OMIT || count_encoding & 0x70 != 0 {
        return None;
    }
    let at = 4 + if pointer_encoding == OMIT {
        0
    } else {
        size(pointer_encoding)?
    };
    let bytes = hdr.get(at..at + size(count_encoding)?)?;
    let mut value = [0u8; 8];
    value[..bytes.len()].copy_from_slice(bytes);
    Some(u64::from_le_bytes(value))
}

/// Checks the FDE count of `elf`'s `.eh_frame` against `limits` by reading the section
/// through `file` (the same file, e.g. with `pread`s into a small buffer) instead of through a
/// mapping of it: a file rejected here never has its `.eh_frame` pages mapped into the
/// process (they would count in its resident memory). `.eh_frame_hdr`'s count is looked at
/// first. Files without `.eh_frame` pass (the build checks `.debug_frame`).
pub fn check_fde_count(
    elf: &object::File<'_>,
    file: &std::fs::File,
    limits: &BuildLimits,
) -> Result<(), TableError> {
    use std::os::unix::fs::FileExt;
    let Some(section) = elf.section_by_name(".eh_frame") else {
        return Ok(());
    };
    let Some((offset, size)) = section.file_range() else {
        return Ok(());
    };
    check_claimed_fde_count(elf, limits)?;
    // Entry headers, read 64 KiB at a time: (length, CIE id) and, for 64-bit DWARF, the
    // length after a 0xffffffff escape.
    let mut buffer = vec![0u8; 64 << 10];
    let (mut buffered_at, mut buffered_len) = (0u64, 0usize);
    let mut read_at = |at: u64, bytes: &mut [u8]| -> bool {
        let len = bytes.len();
        if at < buffered_at || at + len as u64 > buffered_at + buffered_len as u64 {
            let want = (buffer.len() as u64).min(size.saturating_sub(at)) as usize;
            if want < len {
                return false;
            }
            match file.read_at(&mut buffer[..want], offset + at) {
                Ok(n) if n >= len => (buffered_at, buffered_len) = (at, n),
                _ => return false,
            }
        }
        let start = (at - buffered_at) as usize;
        bytes.copy_from_slice(&buffer[start..start + len]);
        true
    };
    let mut fdes = 0u64;
    let mut at = 0u64;
    let mut word = [0u8; 4];
    while at + 4 <= size && read_at(at, &mut word) {
        let length = u32::from_le_bytes(word);
        let (id_at, end) = match length {
            // The terminator.
            0 => break,
            0xffff_ffff => {
                let mut long = [0u8; 8];
                if !read_at(at + 4, &mut long) {
                    break;
                }
                (at + 12, (at + 12).saturating_add(u64::from_le_bytes(long)))
            }
            _ => (at + 4, at + 4 + u64::from(length)),
        };
        if !read_at(id_at, &mut word) {
            break;
        }
        // In .eh_frame a CIE has id 0; anything else points back at a CIE: an FDE.
        if u32::from_le_bytes(word) != 0 {
            fdes += 1;
            if fdes > limits.max_fdes() as u64 {
                return Err(TableError::TooLarge {
                    what: "FDEs",
                    count: fdes,
                    limit: limits.max_fdes() as u64,
                    rows_decoded: 0,
                });
            }
        }
        at = end;
    }
    // Malformed sections are the build's to report.
    Ok(())
}

/// One CFI section and what its pointers are relative to.
pub(crate) struct CfiSection<'a> {
    pub source: CfiSource,
    pub data: &'a [u8],
    /// Virtual address of the section (for `.eh_frame`'s pc-relative pointers).
    pub address: u64,
    pub text_address: Option<u64>,
    pub got_address: Option<u64>,
    pub plt_ranges: &'a [Range<u64>],
}

impl CfiSection<'_> {
    fn name(&self) -> &'static str {
        match self.source {
            CfiSource::DebugFrame => ".debug_frame",
            _ => ".eh_frame",
        }
    }
}

/// [`build_from_cfi_within`] with the fixed bounds only.
#[cfg(test)]
pub(crate) fn build_from_cfi(cfi: &CfiSection<'_>) -> Result<UnwindTable, TableError> {
    build_from_cfi_within(cfi, &BuildLimits::default())
}

/// The table of one CFI section (`.eh_frame` or `.debug_frame` bytes).
///
/// Three passes keep the memory to the merged table, and within the budget: the first only
/// counts the FDEs (allocating nothing; a file with more than the budget allows ends here), the
/// second reads the FDE headers (start, length, where the FDE is) into an index of exactly that
/// size, the third runs the FDE programs in address order and merges their rows as it goes,
/// instead of holding every FDE's rows before merging (tens of MiB for a large library such as
/// libtorch_cpu), stopping when the rows reach the budget.
///
/// `limits`: see [`build_table_within`].
pub(crate) fn build_from_cfi_within(
    cfi: &CfiSection<'_>,
    limits: &BuildLimits,
) -> Result<UnwindTable, TableError> {
    match cfi.source {
        CfiSource::DebugFrame => {
            let mut section = DebugFrame::new(cfi.data, LittleEndian);
            section.set_address_size(8);
            build_from_section(&section, &BaseAddresses::default(), cfi, limits)
        }
        CfiSource::EhFrame | CfiSource::None => {
            let mut section = EhFrame::new(cfi.data, LittleEndian);
            section.set_address_size(8);
            let mut bases = BaseAddresses::default().set_eh_frame(cfi.address);
            if let Some(text) = cfi.text_address {
                bases = bases.set_text(text);
            }
            if let Some(got) = cfi.got_address {
                bases = bases.set_got(got);
            }
            build_from_section(&section, &bases, cfi, limits)
        }
    }
}

/// An FDE found by the first pass (16 bytes: the index of a file with millions of FDEs is
/// the largest part of the builder's memory after the rows).
#[derive(Clone, Copy)]
struct FdeRef {
    start: u64,
    /// Bytes of code covered (an FDE over 4 GiB of code is rejected).
    length: u32,
    /// Where the FDE is in the section.
    offset: u32,
}

/// Bytes of one FDE index entry.
pub(super) const FDE_REF_BYTES: usize = std::mem::size_of::<FdeRef>();

/// FDEs between two looks at the cancel flag.
const CANCEL_CHECK_FDES: usize = 4096;

impl FdeRef {
    fn end(&self) -> u64 {
        self.start + u64::from(self.length)
    }
}

/// Counts the section's FDEs from the entries' headers alone (length and CIE pointer; a CIE
/// is parsed, an FDE is not), allocating nothing: the size of the table to come is known
/// before any of it is materialized.
fn count_fdes<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    name: &'static str,
    limits: &BuildLimits,
) -> Result<usize, TableError>
where
    S: UnwindSection<Reader<'a>>,
    S::Offset: UnwindOffset<usize>,
{
    let mut count = 0usize;
    let mut entries = section.entries(bases);
    while let Some(entry) = entries
        .next()
        .map_err(|source| TableError::MalformedSection {
            section: name,
            source,
        })?
    {
        if let CieOrFde::Fde(_) = entry {
            count += 1;
            if count.is_multiple_of(CANCEL_CHECK_FDES * 16) && limits.checkpoint() {
                return Err(TableError::Cancelled);
            }
        }
    }
    Ok(count)
}

fn build_from_section<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    cfi: &CfiSection<'a>,
    limits: &BuildLimits,
) -> Result<UnwindTable, TableError>
where
    S: UnwindSection<Reader<'a>>,
    S::Offset: UnwindOffset<usize>,
{
    let name = cfi.name();
    let mut stats = TableStats {
        source: cfi.source,
        ..TableStats::default()
    };
    // The size first: a file whose table cannot fit is rejected before anything is built.
    let fde_count = count_fdes(section, bases, name, limits)?;
    if fde_count > limits.max_fdes() {
        return Err(TableError::TooLarge {
            what: "FDEs",
            count: fde_count as u64,
            limit: limits.max_fdes() as u64,
            rows_decoded: 0,
        });
    }
    let mut cies: HashMap<usize, CommonInformationEntry<Reader<'a>>> = HashMap::new();
    let mut fdes = index_fdes(
        section, bases, name, &mut cies, &mut stats, fde_count, limits,
    )?;
    // FDEs with the same start stay in section order (the first one wins); in place, so the
    // sort needs no scratch as large as the index.
    fdes.sort_unstable_by_key(|fde| (fde.start, fde.offset));

    let mut merged = PagedBuilder::new(true, limits.max_rows);
    stats.row_bound = most_rows(cfi.data.len(), &fdes) as u64;
    merged.reserve_rows(stats.row_bound as usize);
    // One FDE's rows, reused.
    let mut fde_rows: Vec<TableRow> = Vec::new();
    // Allocated once and reused by every FDE program.
    let mut context = UnwindContext::new();
    let mut covered_end: Option<u64> = None;
    // FDEs whose program ran, and the first one whose program did not.
    let mut usable_fdes = 0u64;
    let mut first_malformed: Option<TableError> = None;
    for (index, fde_ref) in fdes.iter().enumerate() {
        if index % CANCEL_CHECK_FDES == 0 && limits.checkpoint() {
            return Err(TableError::Cancelled);
        }
        let (start, end) = (fde_ref.start, fde_ref.end());
        if covered_end.is_some_and(|covered| end <= covered) {
            // Wholly inside an FDE that starts earlier.
            stats.overlapping_fdes += 1;
            continue;
        }
        let offset = fde_ref.offset as usize;
        let fde_error = |source| TableError::MalformedFde {
            section: name,
            offset,
            source,
        };
        let fde = section
            .fde_from_offset(
                bases,
                S::Offset::from(offset),
                |section, bases, cie_offset| cached_cie(&mut cies, section, bases, cie_offset),
            )
            .map_err(fde_error)?;
        fde_rows.clear();
        if fde.is_signal_trampoline() {
            usable_fdes += 1;
            fde_rows.push(TableRow {
                address: start,
                rule: Rule::SIGNAL,
            });
        } else {
            let return_address = fde.cie().return_address_register();
            let in_plt = cfi
                .plt_ranges
                .iter()
                .any(|plt| plt.start <= start && end <= plt.end);
            // gimli's evaluation of the FDE's program; a program it cannot run (an opcode
            // where it is not allowed, an unknown one, a state stack misused) leaves the
            // FDE's range without CFI rather than the whole file (one such FDE in NVIDIA's
            // libnvrtc lost every function of the library its table).
            let program: Result<(), gimli::Error> = 'program: {
                let mut table = match fde.rows(section, bases, &mut context) {
                    Ok(table) => table,
                    Err(source) => break 'program Err(source),
                };
                let mut previous_start = start;
                loop {
                    let row = match table.next_row() {
                        Ok(Some(row)) => row,
                        Ok(None) => break 'program Ok(()),
                        Err(source) => break 'program Err(source),
                    };
                    let row_start = row.start_address();
                    // Empty rows (advance by 0) and rows past the FDE's end cover nothing.
                    if row_start >= row.end_address() || row_start >= end {
                        continue;
                    }
                    if row_start < previous_start {
                        break 'program Err(gimli::Error::InvalidCfiSetLoc(row_start));
                    }
                    previous_start = row_start;
                    if fde_rows.len() >= MAX_FDE_ROWS {
                        return Err(TableError::TooLarge {
                            what: "rows in one FDE",
                            count: fde_rows.len() as u64 + 1,
                            limit: MAX_FDE_ROWS as u64,
                            rows_decoded: merged.rows_so_far() as u64,
                        });
                    }
                    let rule = map_rule(row, return_address, in_plt, section, &mut stats);
                    fde_rows.push(TableRow {
                        address: row_start,
                        rule,
                    });
                }
            };
            match program {
                Ok(()) => usable_fdes += 1,
                Err(source) => {
                    stats.malformed_fdes += 1;
                    first_malformed.get_or_insert_with(|| fde_error(source));
                    fde_rows.clear();
                    // Before any FDE there is no row (no page): no CFI already.
                    if covered_end.is_some() {
                        fde_rows.push(TableRow {
                            address: start,
                            rule: Rule::NONE,
                        });
                    }
                }
            }
        }
        stats.rows_before_merge += fde_rows.len() as u64;
        if stats.rows_before_merge > MAX_ROWS as u64 {
            return Err(TableError::TooManyRows);
        }
        if fde_rows.is_empty() {
            continue;
        }
        match covered_end {
            Some(covered) if start < covered => {
                stats.overlapping_fdes += 1;
                // Only the part beyond the earlier FDE: the row in effect at its end goes on.
                let beyond = fde_rows.partition_point(|row| row.address <= covered);
                if let Some(in_effect) = beyond.checked_sub(1).map(|index| fde_rows[index]) {
                    merged.push(covered, in_effect.rule)?;
                }
                for row in &fde_rows[beyond..] {
                    merged.push(row.address, row.rule)?;
                }
            }
            previous => {
                if let Some(covered) = previous.filter(|&covered| covered < start) {
                    merged.push(covered, Rule::NONE)?;
                }
                for row in &fde_rows {
                    merged.push(row.address, row.rule)?;
                }
            }
        }
        covered_end = Some(end);
    }
    // Nothing but malformed programs: no table (the file's frames use frame pointers).
    if usable_fdes == 0
        && let Some(error) = first_malformed
    {
        return Err(error);
    }
    if let Some(end) = covered_end {
        merged.push(end, Rule::NONE)?;
    }
    stats.row_vector_growths = merged.row_vector_growths();
    // The merged rows are written into their pages as they come, with the table's invariants
    // (the page span among them) checked on the way.
    let mut table = UnwindTable::from_paged(merged, stats)?;
    table.stats.rows_after_merge = table.row_count() as u64;
    Ok(table)
}

/// An upper bound on the rows of the table of a section of `section_bytes` with these FDEs
/// (sorted by start). Each row of an FDE after its first needs an advance instruction of at
/// least one byte of the section; the merge adds one row an FDE at most (the gap before it,
/// or the rule in effect where it overlaps an earlier one); each page of the span starts
/// with one more; and the end marker.
fn most_rows(section_bytes: usize, fdes: &[FdeRef]) -> usize {
    let (Some(first), Some(last_end)) = (fdes.first(), fdes.iter().map(FdeRef::end).max()) else {
        return 0;
    };
    let pages = ((last_end >> PAGE_SHIFT).saturating_sub(first.start >> PAGE_SHIFT) + 1) as usize;
    section_bytes
        .saturating_add(fdes.len().saturating_mul(2))
        .saturating_add(pages)
        .saturating_add(1)
}

/// The first pass: every FDE's range and place, checked against the limits; CIEs are cached
/// for the second.
/// The CIE at `cie_offset`, parsed once per section (most FDEs share a few CIEs).
fn cached_cie<'a, S>(
    cies: &mut HashMap<usize, CommonInformationEntry<Reader<'a>>>,
    section: &S,
    bases: &BaseAddresses,
    cie_offset: S::Offset,
) -> gimli::Result<CommonInformationEntry<Reader<'a>>>
where
    S: UnwindSection<Reader<'a>>,
    S::Offset: UnwindOffset<usize>,
{
    let key = UnwindOffset::into(cie_offset);
    if let Some(cie) = cies.get(&key) {
        return Ok(cie.clone());
    }
    let cie = section.cie_from_offset(bases, cie_offset)?;
    if cies.len() < MAX_CACHED_CIES {
        cies.insert(key, cie.clone());
    }
    Ok(cie)
}

fn index_fdes<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    name: &'static str,
    cies: &mut HashMap<usize, CommonInformationEntry<Reader<'a>>>,
    stats: &mut TableStats,
    fde_count: usize,
    limits: &BuildLimits,
) -> Result<Vec<FdeRef>, TableError>
where
    S: UnwindSection<Reader<'a>>,
    S::Offset: UnwindOffset<usize>,
{
    let section_error = |source| TableError::MalformedSection {
        section: name,
        source,
    };
    // Exactly the size counted: no growth by doubling.
    let mut fdes = Vec::with_capacity(fde_count);
    let mut entries = section.entries(bases);
    while let Some(entry) = entries.next().map_err(section_error)? {
        let partial = match entry {
            CieOrFde::Cie(cie) => {
                if cies.len() < MAX_CACHED_CIES {
                    cies.insert(cie.offset(), cie);
                }
                continue;
            }
            CieOrFde::Fde(partial) => partial,
        };
        stats.fdes += 1;
        if stats.fdes > fde_count as u64 {
            // The count pass read the same section: only a bug could get here.
            return Err(TableError::TooManyFdes);
        }
        if (stats.fdes as usize).is_multiple_of(CANCEL_CHECK_FDES) && limits.checkpoint() {
            return Err(TableError::Cancelled);
        }
        let offset = partial.offset();
        let fde_error = |source| TableError::MalformedFde {
            section: name,
            offset,
            source,
        };
        let fde = partial
            .parse(|section, bases, cie_offset| cached_cie(cies, section, bases, cie_offset))
            .map_err(fde_error)?;
        if fde.entry_len() > MAX_FDE_BYTES {
            return Err(TableError::FdeTooLong {
                section: name,
                offset,
                length: fde.entry_len(),
            });
        }
        let start = fde.initial_address();
        let length = fde.len();
        if length == 0 {
            stats.empty_fdes += 1;
            continue;
        }
        start
            .checked_add(length)
            .filter(|&end| end <= MAX_ADDRESS)
            .ok_or(TableError::AddressOutOfRange { start, length })?;
        let length =
            u32::try_from(length).map_err(|_| TableError::AddressOutOfRange { start, length })?;
        let offset = u32::try_from(offset).map_err(|_| TableError::TooLarge {
            what: "bytes of CFI",
            count: offset as u64,
            limit: u64::from(u32::MAX),
            rows_decoded: 0,
        })?;
        if fde.is_signal_trampoline() {
            stats.signal_fdes += 1;
        }
        fdes.push(FdeRef {
            start,
            length,
            offset,
        });
    }
    Ok(fdes)
}

fn map_rule<'a, S: UnwindSection<Reader<'a>>>(
    row: &UnwindTableRow<usize>,
    return_address: Register,
    in_plt: bool,
    section: &S,
    stats: &mut TableStats,
) -> Rule {
    if matches!(row.register(return_address), Some(RegisterRule::Undefined)) {
        return Rule::END;
    }
    let (cfa_kind, cfa_offset) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let kind = match *register {
                RSP => CFA_RSP,
                RBP => CFA_RBP,
                _ => {
                    stats.unsupported_cfa_registers += 1;
                    return Rule::UNSUPPORTED;
                }
            };
            let Ok(offset) = i16::try_from(*offset) else {
                stats.offsets_out_of_range += 1;
                return Rule::UNSUPPORTED;
            };
            (kind, offset)
        }
        CfaRule::Expression(expression) => {
            let bytes = expression.get(section).ok().map(|e| e.0.slice());
            if in_plt || bytes.is_some_and(is_plt_expression) {
                stats.plt_rows += 1;
                (CFA_PLT, 0)
            } else if let Some(offset) = bytes.and_then(rbp_deref_offset) {
                (CFA_RBP_DEREF, offset)
            } else {
                stats.unsupported_cfa_expressions += 1;
                return Rule::UNSUPPORTED;
            }
        }
    };
    let (rbp_kind, rbp_offset) = match row.register(RBP) {
        None | Some(RegisterRule::SameValue | RegisterRule::Undefined) => (RBP_UNCHANGED, 0),
        Some(RegisterRule::Offset(offset)) => match i16::try_from(offset) {
            Ok(offset) => (RBP_AT_CFA, offset),
            Err(_) => {
                stats.offsets_out_of_range += 1;
                return Rule::UNSUPPORTED;
            }
        },
        Some(RegisterRule::Expression(expression)) => {
            match expression
                .get(section)
                .ok()
                .and_then(|e| rbp_offset_address(e.0.slice()))
            {
                Some(offset) => (RBP_AT_RBP, offset),
                None => {
                    stats.unsupported_rbp_rules += 1;
                    (RBP_UNCHANGED, 0)
                }
            }
        }
        Some(_) => {
            stats.unsupported_rbp_rules += 1;
            (RBP_UNCHANGED, 0)
        }
    };
    Rule {
        cfa_kind,
        rbp_kind,
        cfa_offset,
        rbp_offset,
    }
}

/// The operations of a DWARF expression, or `None` if any does not parse.
fn operations(bytes: &[u8]) -> Option<Vec<gimli::Operation<Reader<'_>>>> {
    let mut reader = EndianSlice::new(bytes, LittleEndian);
    let encoding = gimli::Encoding {
        address_size: 8,
        format: gimli::Format::Dwarf32,
        version: 4,
    };
    let mut operations = Vec::new();
    while !gimli::Reader::is_empty(&reader) {
        operations.push(gimli::Operation::parse(&mut reader, encoding).ok()?);
        if operations.len() > 2 {
            return None;
        }
    }
    Some(operations)
}

/// `n` of the expression `DW_OP_breg6 n` (RBP + n) alone.
fn rbp_offset_address(bytes: &[u8]) -> Option<i16> {
    match operations(bytes)?.as_slice() {
        [
            gimli::Operation::RegisterOffset {
                register, offset, ..
            },
        ] if *register == RBP => i16::try_from(*offset).ok(),
        _ => None,
    }
}

/// `n` of the CFA expression `DW_OP_breg6 n; DW_OP_deref` (the word at RBP + n).
fn rbp_deref_offset(bytes: &[u8]) -> Option<i16> {
    match operations(bytes)?.as_slice() {
        [
            gimli::Operation::RegisterOffset {
                register, offset, ..
            },
            gimli::Operation::Deref {
                size: 8,
                space: false,
                ..
            },
        ] if *register == RBP => i16::try_from(*offset).ok(),
        _ => None,
    }
}

/// ld's `.plt` CFA expression, with the `DW_OP_lit11` threshold or the IBT `DW_OP_lit10` one.
fn is_plt_expression(bytes: &[u8]) -> bool {
    bytes.len() == PLT_EXPRESSION.len()
        && bytes
            .iter()
            .zip(PLT_EXPRESSION)
            .enumerate()
            .all(|(index, (&byte, expected))| {
                byte == expected || (index == PLT_EXPRESSION_THRESHOLD_INDEX && byte == DW_OP_LIT10)
            })
}
