//! Splitting a table into the 64 KiB pages of the BPF maps, and the lookup BPF runs on them.

use profiler_common::unwind::{PAGE_SHIFT, PageEntry, RowSource, UnwindRow, find_row};

use super::{MAX_ADDRESS, MAX_PAGES, Rule, TableError, TableRow};

const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
const PAGE_OFFSET_MASK: u64 = PAGE_SIZE - 1;
/// Tables whose rows may take this many bytes get them reserved up front
/// ([`PagedBuilder::reserve_rows`]); smaller ones grow as they come.
const RESERVE_FROM_BYTES: usize = 4 << 20;

/// A row slice as the BPF row array.
pub struct SliceRows<'a>(pub &'a [UnwindRow]);

impl RowSource for SliceRows<'_> {
    fn row(&self, index: u32) -> Option<UnwindRow> {
        self.0.get(index as usize).copied()
    }
}

/// A table as it goes into the BPF maps: one row array, and for each page of the span (every
/// page from the first FDE's to the one holding the last FDE's last byte, gap pages included)
/// where its rows are. Every page starts with a row at `pc_low` 0 holding the rule in effect at
/// the page start, so a lookup never needs the previous page. `first_row` in the page entries
/// indexes this table's row array; the loader adds where that array starts in the BPF one.
///
/// It is the only form a table is kept in: the merged rows by address ([`Self::table_rows`])
/// are read back from it, so a large library's table is held once, at 8 bytes a row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedRows {
    first_page: u32,
    rows: Vec<UnwindRow>,
    /// Entry `i` is page `first_page + i`.
    entries: Vec<PageEntry>,
    /// The address of the end marker (the last `CFA_NONE` row), 0 for an empty table, and
    /// whether it is written in a page (it is not when it falls on a page boundary).
    end: u64,
    end_written: bool,
    /// Rows of the merged table, the end marker included.
    row_count: usize,
}

/// Builds [`PagedRows`] from rows given in address order, checking the table invariants as
/// they come (so a hostile table fails before it is held whole).
#[derive(Debug, Default)]
pub(super) struct PagedBuilder {
    paged: PagedRows,
    /// The page whose rows are being written (valid once a row was written).
    page: u64,
    in_effect: Rule,
    /// The last row given, not written yet: a later row at the same address replaces it.
    pending: Option<TableRow>,
    /// When set, rows are merged as given (same address: replaced; same rule as the previous
    /// row: dropped); otherwise either is an error.
    merge: bool,
    /// Rows (page start rows included) the table may have: beyond, [`TableError::TooLarge`]
    /// before the row vector grows (its capacity never passes this bound).
    max_rows: usize,
    /// Times the row vector grew by reallocating (and copying) it.
    row_vector_growths: u64,
}

impl PagedBuilder {
    /// `merge`: see the field.
    pub(super) fn new(merge: bool, max_rows: usize) -> Self {
        PagedBuilder {
            merge,
            max_rows,
            in_effect: Rule::NONE,
            ..PagedBuilder::default()
        }
    }

    pub(super) fn push(&mut self, address: u64, rule: Rule) -> Result<(), TableError> {
        if !rule.is_valid() {
            return Err(TableError::InvalidRows("unknown rule kind"));
        }
        if address > MAX_ADDRESS {
            return Err(TableError::InvalidRows("address beyond the 48-bit range"));
        }
        if let Some(pending) = self.pending {
            if address < pending.address || (address == pending.address && !self.merge) {
                return Err(TableError::InvalidRows("addresses not strictly increasing"));
            }
            self.pending = None;
            if address != pending.address {
                self.write(pending)?;
            }
        }
        if self.paged.row_count > 0 && self.in_effect == rule {
            if self.merge {
                return Ok(());
            }
            return Err(TableError::InvalidRows("neighbours with the same rule"));
        }
        self.pending = Some(TableRow { address, rule });
        Ok(())
    }

    /// Writes a merged row into its page, opening the pages up to it.
    fn write(&mut self, row: TableRow) -> Result<(), TableError> {
        let page = row.address >> PAGE_SHIFT;
        if self.paged.row_count == 0 {
            self.paged.first_page = page as u32;
            self.page = page;
            self.open_page(row.address)?;
        }
        self.open_pages_through(page, row.address)?;
        self.push_row(
            row.rule
                .with_pc_low((row.address & PAGE_OFFSET_MASK) as u16),
        )?;
        self.in_effect = row.rule;
        self.paged.row_count += 1;
        Ok(())
    }

    /// Opens the pages after the current one up to `page`, checking the span first (a hostile
    /// table's gap must not be filled page by page before it fails).
    fn open_pages_through(&mut self, page: u64, next_address: u64) -> Result<(), TableError> {
        let span = page.saturating_sub(u64::from(self.paged.first_page)) + 1;
        if span > MAX_PAGES {
            return Err(TableError::TooManyPages { pages: span });
        }
        while page > self.page {
            self.close_page();
            self.page += 1;
            self.open_page(next_address)?;
        }
        Ok(())
    }

    /// Reserves room for `rows` rows at once (at most [`Self::max_rows`]) when the table may
    /// be large, so the row vector never grows by copying: each growth of a large library's
    /// rows held the old vector and the new one at once (24 and 28 MiB for libtorch_cpu,
    /// the agent's peak RSS). Room not written is never touched, so it costs address space,
    /// not memory; where even that is refused, the vector grows as before.
    pub(super) fn reserve_rows(&mut self, rows: usize) {
        let rows = rows.min(self.max_rows);
        if rows * std::mem::size_of::<UnwindRow>() < RESERVE_FROM_BYTES {
            return;
        }
        let _ = self
            .paged
            .rows
            .try_reserve_exact(rows.saturating_sub(self.paged.rows.len()));
    }

    /// Times the row vector was reallocated to grow (its first allocation not counted).
    pub(super) fn row_vector_growths(&self) -> u64 {
        self.row_vector_growths
    }

    /// Rows decoded into the table so far (page start rows included).
    pub(super) fn rows_so_far(&self) -> usize {
        self.paged.rows.len()
    }

    /// Appends a row within [`Self::max_rows`], growing the vector by at most half again and
    /// never past the bound (so a rejected table never held more than the budget).
    fn push_row(&mut self, row: UnwindRow) -> Result<(), TableError> {
        let rows = &mut self.paged.rows;
        if rows.len() >= self.max_rows {
            return Err(TableError::TooLarge {
                what: "rows",
                count: rows.len() as u64 + 1,
                limit: self.max_rows as u64,
                rows_decoded: rows.len() as u64,
            });
        }
        if rows.len() == rows.capacity() {
            let grow = (rows.len() / 2).max(1024).min(self.max_rows - rows.len());
            self.row_vector_growths += u64::from(!rows.is_empty());
            rows.reserve_exact(grow);
        }
        rows.push(row);
        Ok(())
    }

    /// Starts page `self.page` with the rule in effect, unless `next_address` (the row about
    /// to be written) is exactly its start.
    fn open_page(&mut self, next_address: u64) -> Result<(), TableError> {
        let page_start = self.page << PAGE_SHIFT;
        self.paged.entries.push(PageEntry {
            first_row: self.paged.rows.len() as u32,
            row_count: 0,
        });
        if next_address != page_start {
            self.push_row(self.in_effect.with_pc_low(0))?;
        }
        Ok(())
    }

    fn close_page(&mut self) {
        if let Some(entry) = self.paged.entries.last_mut() {
            entry.row_count = self.paged.rows.len() as u32 - entry.first_row;
        }
    }

    /// The table; its last row must be the `CFA_NONE` end marker.
    pub(super) fn finish(mut self) -> Result<PagedRows, TableError> {
        let Some(last) = self.pending.take() else {
            return Ok(PagedRows::default());
        };
        if self.paged.row_count == 0 {
            return Err(TableError::InvalidRows(
                "an end marker without covered rows",
            ));
        }
        if last.rule != Rule::NONE {
            return Err(TableError::InvalidRows("the last row is not CFA_NONE"));
        }
        // The end marker is written only when it falls inside the last covered page; one on
        // a page boundary opens no page.
        if last.address & PAGE_OFFSET_MASK != 0 {
            self.write(last)?;
            self.paged.end_written = true;
        } else {
            // The last covered byte's page still holds rows (the rule in effect).
            self.open_pages_through((last.address - 1) >> PAGE_SHIFT, last.address)?;
            self.paged.row_count += 1;
        }
        self.close_page();
        self.paged.end = last.address;
        self.paged.rows.shrink_to_fit();
        self.paged.entries.shrink_to_fit();
        Ok(self.paged)
    }
}

impl PagedRows {
    /// The merged rows by address, as the builder made them (the page start rows left out).
    pub fn table_rows(&self) -> impl Iterator<Item = TableRow> + '_ {
        let mut previous = Rule::NONE;
        let written = self
            .page_entries()
            .flat_map(move |(page, entry)| {
                let first = entry.first_row as usize;
                self.rows[first..first + entry.row_count as usize]
                    .iter()
                    .map(move |row| TableRow {
                        address: (u64::from(page) << PAGE_SHIFT) | u64::from(row.pc_low),
                        rule: Rule::of(row),
                    })
            })
            .filter(move |row| {
                // A page start row repeats the rule in effect; merged rows never do.
                let keep = row.rule != previous;
                previous = row.rule;
                keep
            });
        // An end marker on a page boundary is in no page.
        let end = (self.row_count > 0 && !self.end_written).then_some(TableRow {
            address: self.end,
            rule: Rule::NONE,
        });
        written.chain(end)
    }

    /// Rows of the merged table (the end marker included).
    pub fn row_count(&self) -> usize {
        self.row_count
    }

    /// The row array (all pages' rows, page after page).
    pub fn rows(&self) -> &[UnwindRow] {
        &self.rows
    }

    pub fn page_count(&self) -> usize {
        self.entries.len()
    }

    /// `(page, where its rows are)` for every page, in address order.
    pub fn page_entries(&self) -> impl Iterator<Item = (u32, PageEntry)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .map(|(index, entry)| (self.first_page + index as u32, *entry))
    }

    pub fn page_entry(&self, page: u32) -> Option<PageEntry> {
        let index = page.checked_sub(self.first_page)?;
        self.entries.get(index as usize).copied()
    }

    /// The row in effect at `addr`: the page map lookup, then the shared `find_row`.
    pub fn lookup(&self, addr: u64) -> Option<UnwindRow> {
        let page = u32::try_from(addr >> PAGE_SHIFT).ok()?;
        let entry = self.page_entry(page)?;
        find_row(
            &SliceRows(&self.rows),
            entry.first_row,
            entry.row_count,
            (addr & PAGE_OFFSET_MASK) as u16,
        )
    }
}

#[cfg(test)]
mod tests {
    use profiler_common::unwind::{CFA_NONE, CFA_RBP, CFA_RSP, RBP_AT_CFA, RBP_UNCHANGED};

    use super::*;
    use crate::unwinding::tables::{TableStats, UnwindTable};

    fn rsp(offset: i16) -> Rule {
        Rule {
            cfa_kind: CFA_RSP,
            rbp_kind: RBP_UNCHANGED,
            cfa_offset: offset,
            rbp_offset: 0,
        }
    }

    fn row(address: u64, rule: Rule) -> TableRow {
        TableRow { address, rule }
    }

    #[test]
    fn every_page_of_the_span_starts_with_the_rule_in_effect() {
        let rbp = Rule {
            cfa_kind: CFA_RBP,
            rbp_kind: RBP_AT_CFA,
            cfa_offset: 16,
            rbp_offset: -16,
        };
        let rows = vec![
            row(0x1_fff0, rsp(8)),
            row(0x2_0000, rsp(16)), // exactly at a page start: no extra start row
            row(0x2_0100, rbp),
            row(0x4_0010, Rule::NONE), // gap spanning the page boundary at 0x5_0000
            row(0x5_0020, rsp(8)),
            row(0x6_0000, Rule::NONE), // end marker on a page boundary: no page for it
        ];
        let table = UnwindTable::from_rows(rows, TableStats::default()).unwrap();
        let pages = table.pages();
        let numbers: Vec<u32> = pages.iter().map(|(page, _)| *page).collect();
        assert_eq!(numbers, vec![1, 2, 3, 4, 5]);
        for (page, rows) in &pages {
            assert_eq!(rows[0].pc_low, 0, "page {page:#x} starts at offset 0");
            assert!(rows.windows(2).all(|w| w[0].pc_low < w[1].pc_low));
        }
        assert_eq!(pages[0].1[0].cfa_kind, CFA_NONE, "before the first FDE");
        assert_eq!(pages[0].1[1], rsp(8).with_pc_low(0xfff0));
        assert_eq!(pages[1].1.len(), 2);
        assert_eq!(pages[1].1[0], rsp(16).with_pc_low(0));
        assert_eq!(pages[2].1, vec![rbp.with_pc_low(0)], "inside one rule");
        assert_eq!(
            pages[3].1,
            vec![rbp.with_pc_low(0), Rule::NONE.with_pc_low(0x10)]
        );
        assert_eq!(
            pages[4].1,
            vec![Rule::NONE.with_pc_low(0), rsp(8).with_pc_low(0x20)]
        );
        assert_eq!(table.memory_bytes(), (9 + 5) * 8);

        let kind_at = |addr| table.lookup(addr).map(|r| Rule::of(&r));
        assert_eq!(kind_at(0xffff), None, "page before the first FDE");
        assert_eq!(kind_at(0x1_0000), Some(Rule::NONE));
        assert_eq!(kind_at(0x1_fff0), Some(rsp(8)));
        assert_eq!(kind_at(0x2_00ff), Some(rsp(16)));
        assert_eq!(kind_at(0x3_1234), Some(rbp));
        assert_eq!(kind_at(0x4_0010), Some(Rule::NONE));
        assert_eq!(kind_at(0x5_0000), Some(Rule::NONE));
        assert_eq!(kind_at(0x5_ffff), Some(rsp(8)));
        assert_eq!(kind_at(0x6_0000), None, "after the last FDE");
        assert_eq!(kind_at(u64::MAX), None);
    }

    #[test]
    fn empty_table_has_no_pages() {
        let table = UnwindTable::from_rows(Vec::new(), TableStats::default()).unwrap();
        assert!(table.pages().is_empty());
        assert_eq!(table.lookup(0), None);
        assert_eq!(table.memory_bytes(), 0);
    }
}
