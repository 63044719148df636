//! Native unwind tables: an ELF file's CFI (`.eh_frame`, else `.debug_frame`) turned into the
//! compact rows of `profiler_common::unwind` that the BPF unwinder walks.
//!
//! [`build_table`] runs every FDE's CFA program with gimli and maps each row to a
//! [`Rule`] (see `builder.rs` for the mapping), then sorts, merges equal neighbours and marks
//! gaps between FDEs with `CFA_NONE` rows. [`UnwindTable::paged`] splits the rows into the
//! 64 KiB pages the BPF maps hold, and [`UnwindTable::lookup`] finds a PC's row with the very
//! `find_row` BPF runs. [`TableCache`] keeps built tables on disk, keyed by build id.
//!
//! Invariants of a table's rows (checked again when a table comes from the disk cache): strictly
//! increasing addresses below [`MAX_ADDRESS`], no two neighbours with the same rule, the last row
//! is `CFA_NONE` (the end of the last FDE), and the rows span at most [`MAX_PAGES`] pages.

mod builder;
mod cache;
mod call_sites;
mod pages;
#[cfg(test)]
mod tests;

use profiler_common::unwind::{
    CFA_END, CFA_NONE, CFA_PLT, CFA_RBP, CFA_RBP_DEREF, CFA_RSP, CFA_SIGNAL, CFA_UNSUPPORTED,
    PAGE_SHIFT, RBP_AT_CFA, RBP_AT_RBP, RBP_UNCHANGED, UnwindRow,
};

pub use builder::{build_table, build_table_within, check_fde_count};
pub use cache::{CacheError, TableCache};
pub use call_sites::{CallSiteCheck, call_keeps_frame};
use pages::PagedBuilder;
pub use pages::{PagedRows, SliceRows};

/// Upper bound on rows produced by FDE programs (before merging); more is hostile or broken.
pub const MAX_ROWS: usize = 16 << 20;
/// Rows one table may have, whatever the budget: 32 MiB of rows (the largest real library
/// measured, libtorch_cpu, has 2.7 M). The builder's memory is bounded from this, so a larger
/// budget holds more tables, not a larger worst case for one hostile file.
pub const MAX_TABLE_ROWS: usize = 4 << 20;
/// Upper bound on FDEs in one section.
pub const MAX_FDES: usize = 8 << 20;
/// Upper bound on one FDE's length in bytes (its CFA program is inside it). The largest FDEs in
/// real libraries are a few KiB.
pub const MAX_FDE_BYTES: usize = 1 << 20;
/// Upper bound on the 64 KiB pages a table spans (64 GiB of code).
pub const MAX_PAGES: u64 = 1 << 20;
/// Addresses must fit the `u32` page numbers of the BPF page map.
pub const MAX_ADDRESS: u64 = 1 << (32 + PAGE_SHIFT);
/// Upper bound on one FDE's program rows (before merging). Real functions have a few hundred
/// at most; the bound keeps the per-FDE row buffer small whatever the FDE holds.
pub const MAX_FDE_ROWS: usize = 1 << 16;
/// CIEs kept parsed during a build; beyond, a CIE is parsed again each time an FDE needs it
/// (real files have a handful).
pub const MAX_CACHED_CIES: usize = 256;

/// What one build may use, set from the unwind-table budget (`--unwind-table-memory`): a table
/// that could never be placed is not built, and the builder's own memory is bounded by design.
///
/// - Before anything is decoded, the FDEs are counted: the linker's count in `.eh_frame_hdr`
///   first (without reading `.eh_frame`), then the entries themselves (reading only each
///   entry's header, no allocation); a file with more than [`Self::max_fdes`] is rejected at
///   once. Every FDE of
///   real code has 5 to 8 rows an FDE (libc 6.4, libstdc++ 6.0, bash 8.0) and only
///   back-to-back frameless leaves merge to fewer, so `max_fdes` is half the row budget.
/// - The FDE index (16 bytes an FDE) is allocated at its exact size from the count.
/// - The table's rows (8 bytes each, page start rows included; page entries are fewer) stop at
///   [`Self::max_rows`], the rows the budget holds (at most [`MAX_TABLE_ROWS`]): the build
///   fails there, at once.
/// - One FDE's rows stop at [`MAX_FDE_ROWS`], cached CIEs at [`MAX_CACHED_CIES`].
/// - A compressed `.debug_frame` is inflated only up to [`Self::max_cfi_bytes`].
///
/// [`Self::working_bytes`] is the resulting bound on the builder's own allocations.
#[derive(Clone, Debug)]
pub struct BuildLimits {
    /// Rows the paged table may have (the BPF row array's capacity).
    pub max_rows: usize,
    /// Set to stop a build under way (the agent is stopping): it fails with
    /// [`TableError::Cancelled`] within a few thousand FDEs.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The input, when it is a file mapping whose pages the build lets go of as it goes.
    pub mapped_input: Option<MappedInput>,
}

/// A build's input that is a private read-only file mapping. At each checkpoint the build
/// drops the pages it has read from the agent's memory (`MADV_DONTNEED`: they are read back
/// from the page cache when touched again), so a large library's `.eh_frame` (18 MiB for
/// libtorch_cpu) is never resident in the agent all at once: the agent's peak RSS is not
/// set by the largest library it builds.
#[derive(Clone, Copy, Debug)]
pub struct MappedInput {
    address: usize,
    len: usize,
}

impl MappedInput {
    /// # Safety
    /// `bytes` must be a whole private (or shared) read-only file mapping that was never
    /// written, kept mapped for as long as builds use these limits: dropping such pages loses
    /// nothing.
    pub unsafe fn new(bytes: &[u8]) -> Self {
        MappedInput {
            address: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
    }

    fn release(&self) {
        // SAFETY: the range is a read-only file mapping still mapped (see `new`); a failure
        // only leaves the pages resident.
        unsafe {
            libc::madvise(
                self.address as *mut libc::c_void,
                self.len,
                libc::MADV_DONTNEED,
            );
        }
    }
}

impl Default for BuildLimits {
    /// The fixed bounds only (no budget): for `record` without a row array and for tests.
    fn default() -> Self {
        BuildLimits {
            max_rows: MAX_ROWS,
            cancel: None,
            mapped_input: None,
        }
    }
}

impl BuildLimits {
    /// Limits for a row array of `row_capacity` rows (one table at most [`MAX_TABLE_ROWS`]).
    pub fn for_row_capacity(row_capacity: usize) -> Self {
        BuildLimits {
            max_rows: row_capacity.clamp(1, MAX_TABLE_ROWS),
            cancel: None,
            mapped_input: None,
        }
    }

    /// FDEs a file may have (see the type's documentation).
    pub fn max_fdes(&self) -> usize {
        (self.max_rows / 2).clamp(1, MAX_FDES)
    }

    /// Bytes of decompressed `.debug_frame` a build may inflate (64 an allowed FDE).
    pub fn max_cfi_bytes(&self) -> u64 {
        self.max_fdes() as u64 * 64
    }

    /// Upper bound on the bytes the builder allocates for one build: the FDE index, the
    /// rows and page entries, one FDE's rows, the CIE cache (its entries and their table
    /// slots), plus 64 KiB for the rest (the unwind context, the section list).
    pub fn working_bytes(&self) -> usize {
        use std::mem::size_of;
        type Cie = gimli::CommonInformationEntry<gimli::EndianSlice<'static, gimli::LittleEndian>>;
        self.max_fdes() * builder::FDE_REF_BYTES
            + self.max_rows
                * (size_of::<UnwindRow>() + 2 * size_of::<profiler_common::unwind::PageEntry>())
            + MAX_FDE_ROWS * size_of::<TableRow>() * 2
            + MAX_CACHED_CIES * (size_of::<Cie>() + 16) * 2
            + (64 << 10)
    }

    /// Called every few thousand FDEs: lets go of the input's pages read so far and says
    /// whether the build is to stop.
    fn checkpoint(&self) -> bool {
        if let Some(input) = &self.mapped_input {
            input.release();
        }
        self.cancel
            .as_ref()
            .is_some_and(|cancel| cancel.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Why a table could not be built (or loaded).
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("not a readable ELF file: {0}")]
    Elf(#[from] object::Error),
    #[error("unsupported architecture {0:?} (only x86_64)")]
    UnsupportedArchitecture(object::Architecture),
    #[error("cannot read section {section}: {source}")]
    Section {
        section: &'static str,
        source: object::Error,
    },
    #[error("malformed {section}: {source}")]
    MalformedSection {
        section: &'static str,
        source: gimli::Error,
    },
    #[error("malformed FDE at {section}+{offset:#x}: {source}")]
    MalformedFde {
        section: &'static str,
        offset: usize,
        source: gimli::Error,
    },
    #[error("FDE at {section}+{offset:#x} is {length} bytes long (limit {MAX_FDE_BYTES})")]
    FdeTooLong {
        section: &'static str,
        offset: usize,
        length: usize,
    },
    #[error("FDE range {start:#x}+{length:#x} goes beyond address {MAX_ADDRESS:#x}")]
    AddressOutOfRange { start: u64, length: u64 },
    #[error("more than {MAX_FDES} FDEs")]
    TooManyFdes,
    #[error("more than {MAX_ROWS} rows")]
    TooManyRows,
    #[error("the table spans {pages} pages of 64 KiB (limit {MAX_PAGES})")]
    TooManyPages { pages: u64 },
    #[error("invalid table rows: {0}")]
    InvalidRows(&'static str),
    /// The table cannot fit the budget (or the builder's bounds): known from the FDE count
    /// before any row was decoded (`rows_decoded` 0), or when the rows passed the bound.
    #[error(
        "too large for the unwind-table budget: {count} {what} (limit {limit}; {rows_decoded} rows decoded)"
    )]
    TooLarge {
        what: &'static str,
        count: u64,
        limit: u64,
        rows_decoded: u64,
    },
    #[error("cancelled: the agent is stopping")]
    Cancelled,
}

impl TableError {
    /// Whether the file's table would not fit the budget (counted as too large, not failed).
    pub fn is_too_large(&self) -> bool {
        matches!(
            self,
            TableError::TooLarge { .. } | TableError::TooManyFdes | TableError::TooManyRows
        )
    }
}

/// Which section a table was built from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CfiSource {
    /// No CFI section at all: the table is empty.
    #[default]
    None,
    EhFrame,
    DebugFrame,
}

/// What the builder saw; kept with the table (and in the disk cache).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    pub source: CfiSource,
    /// FDEs in the section, including empty and signal-frame ones.
    pub fdes: u64,
    /// FDEs whose CIE has the `S` augmentation (whole range `CFA_SIGNAL`).
    pub signal_fdes: u64,
    /// FDEs covering no address (length 0), skipped.
    pub empty_fdes: u64,
    /// FDEs overlapping an FDE that starts earlier; only their uncovered part is used.
    pub overlapping_fdes: u64,
    /// Rows of the FDE programs (one per signal FDE), before merging.
    pub rows_before_merge: u64,
    /// Rows of the table: merged, with the `CFA_NONE` gap and end markers.
    pub rows_after_merge: u64,
    /// Program rows whose CFA is the `.plt` expression.
    pub plt_rows: u64,
    /// Program rows with another CFA expression (`CFA_UNSUPPORTED`).
    pub unsupported_cfa_expressions: u64,
    /// Program rows whose CFA is based on a register other than RSP and RBP (`CFA_UNSUPPORTED`).
    pub unsupported_cfa_registers: u64,
    /// Program rows with a CFA or RBP offset outside `i16` (`CFA_UNSUPPORTED`).
    pub offsets_out_of_range: u64,
    /// Program rows whose RBP rule is none of "unchanged", "saved at CFA+n" and "saved at
    /// RBP+n" (kept as `RBP_UNCHANGED`).
    pub unsupported_rbp_rules: u64,
    /// The decoded call sites, checked against the rows: whether return addresses in the file
    /// can be unwound from RBP alone (see `call_sites.rs`).
    pub call_sites: CallSiteCheck,
    /// FDEs whose program gimli could not evaluate (an opcode where it is not allowed, an
    /// unknown one, a state stack misused): their range has no CFI (`Rule::NONE`), so no
    /// frame there is unwound by a rule it does not have. A file with only such FDEs has no
    /// table.
    pub malformed_fdes: u64,
    /// An upper bound on the table's rows (page start rows included), known from the FDE
    /// index before any program runs: what a large table's row vector is reserved at.
    pub row_bound: u64,
    /// Times the row vector was reallocated to grow, each a copy of all rows so far with both
    /// vectors held; none for a table large enough to be reserved at `row_bound`.
    pub row_vector_growths: u64,
}

/// A row's rules without its address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Rule {
    pub cfa_kind: u8,
    pub rbp_kind: u8,
    pub cfa_offset: i16,
    pub rbp_offset: i16,
}

impl Rule {
    /// No CFI here: the BPF unwinder falls back to the frame pointer.
    pub const NONE: Rule = Rule::special(CFA_NONE);
    pub const UNSUPPORTED: Rule = Rule::special(CFA_UNSUPPORTED);
    pub const SIGNAL: Rule = Rule::special(CFA_SIGNAL);
    pub const END: Rule = Rule::special(CFA_END);

    /// A rule that computes no CFA, so carries no offsets and no RBP rule (keeps merging
    /// effective and the table canonical).
    pub const fn special(cfa_kind: u8) -> Rule {
        Rule {
            cfa_kind,
            rbp_kind: RBP_UNCHANGED,
            cfa_offset: 0,
            rbp_offset: 0,
        }
    }

    pub const fn with_pc_low(self, pc_low: u16) -> UnwindRow {
        UnwindRow {
            pc_low,
            cfa_kind: self.cfa_kind,
            rbp_kind: self.rbp_kind,
            cfa_offset: self.cfa_offset,
            rbp_offset: self.rbp_offset,
        }
    }

    pub const fn of(row: &UnwindRow) -> Rule {
        Rule {
            cfa_kind: row.cfa_kind,
            rbp_kind: row.rbp_kind,
            cfa_offset: row.cfa_offset,
            rbp_offset: row.rbp_offset,
        }
    }

    /// Whether the kinds are ones the BPF unwinder knows.
    pub const fn is_valid(&self) -> bool {
        matches!(
            self.cfa_kind,
            CFA_NONE
                | CFA_RSP
                | CFA_RBP
                | CFA_PLT
                | CFA_SIGNAL
                | CFA_END
                | CFA_UNSUPPORTED
                | CFA_RBP_DEREF
        ) && matches!(self.rbp_kind, RBP_UNCHANGED | RBP_AT_CFA | RBP_AT_RBP)
    }
}

/// The rule in effect from `address` (a file virtual address) to the next row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableRow {
    pub address: u64,
    pub rule: Rule,
}

/// One ELF file's unwind table, held in the paged form the BPF maps take (8 bytes a row); the
/// merged rows by address are read back from it.
#[derive(Debug)]
pub struct UnwindTable {
    paged: PagedRows,
    stats: TableStats,
}

impl UnwindTable {
    /// A table from rows that must satisfy the invariants in the module documentation.
    pub fn from_rows(
        rows: impl IntoIterator<Item = TableRow>,
        stats: TableStats,
    ) -> Result<UnwindTable, TableError> {
        let mut builder = PagedBuilder::new(false, MAX_ROWS);
        for row in rows {
            builder.push(row.address, row.rule)?;
        }
        UnwindTable::from_paged(builder, stats)
    }

    fn from_paged(builder: PagedBuilder, stats: TableStats) -> Result<UnwindTable, TableError> {
        Ok(UnwindTable {
            paged: builder.finish()?,
            stats,
        })
    }

    /// The merged rows by address, `CFA_NONE` markers included.
    pub fn rows(&self) -> Vec<TableRow> {
        self.paged.table_rows().collect()
    }

    pub fn stats(&self) -> &TableStats {
        &self.stats
    }

    /// Merged rows, including the `CFA_NONE` markers.
    pub fn row_count(&self) -> usize {
        self.paged.row_count()
    }

    /// The rows split into 64 KiB pages, as loaded into the BPF maps.
    pub fn paged(&self) -> &PagedRows {
        &self.paged
    }

    /// Each page (file virtual address >> `PAGE_SHIFT`) with its rows; the first row of every
    /// page has `pc_low` 0.
    pub fn pages(&self) -> Vec<(u32, Vec<UnwindRow>)> {
        let paged = self.paged();
        paged
            .page_entries()
            .map(|(page, entry)| {
                let first = entry.first_row as usize;
                let rows = paged.rows()[first..first + entry.row_count as usize].to_vec();
                (page, rows)
            })
            .collect()
    }

    pub fn page_count(&self) -> usize {
        self.paged().page_count()
    }

    /// Bytes the table takes in the BPF maps: 8 per paged row (page start rows included) and
    /// 8 per page entry.
    pub fn memory_bytes(&self) -> usize {
        let paged = self.paged();
        paged.rows().len() * 8 + paged.page_count() * 8
    }

    /// Whether every call in the file's CFI-covered code is made from inside the standard
    /// frame-pointer frame (`push rbp; mov rbp, rsp`, as `-fno-omit-frame-pointer` builds), as
    /// decoding the code proved, so a caller's frame is found from RBP alone. BPF then skips
    /// the row lookup for return addresses in this file; the first frame (maybe in a
    /// prologue) still uses the table, and signal trampolines need it too.
    pub fn frame_pointers_reliable(&self) -> bool {
        self.stats.source != CfiSource::None
            && self.row_count() > 1
            && self.stats.call_sites.proves_frame_pointers()
            && self.stats.signal_fdes == 0
            // The calls inside a malformed FDE's range were never checked against rows.
            && self.stats.malformed_fdes == 0
    }

    /// The row in effect at file virtual address `addr`, found the way BPF finds it. `None`
    /// when no page covers `addr` (before the first FDE's page or after the last FDE's end).
    pub fn lookup(&self, addr: u64) -> Option<UnwindRow> {
        self.paged().lookup(addr)
    }
}
