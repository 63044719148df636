//! Splitting a table into the 64 KiB pages of the BPF maps, and the lookup BPF runs on them.

use profiler_common::unwind::{PAGE_SHIFT, PageEntry, RowSource, UnwindRow, find_row};

use super::{Rule, TableRow};

const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
const PAGE_OFFSET_MASK: u64 = PAGE_SIZE - 1;

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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedRows {
    first_page: u32,
    rows: Vec<UnwindRow>,
    /// Entry `i` is page `first_page + i`.
    entries: Vec<PageEntry>,
}

impl PagedRows {
    /// `rows` must satisfy the table invariants (sorted, last row `CFA_NONE`, bounded span).
    pub(super) fn from_rows(rows: &[TableRow]) -> PagedRows {
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
            return PagedRows::default();
        };
        if rows.len() < 2 {
            return PagedRows::default();
        }
        let first_page = first.address >> PAGE_SHIFT;
        // The last row is the end marker; the last covered byte is just before it.
        let last_page = (last.address - 1) >> PAGE_SHIFT;
        let page_count = (last_page - first_page + 1) as usize;
        let mut paged_rows = Vec::with_capacity(rows.len() + page_count);
        let mut entries = Vec::with_capacity(page_count);
        let mut next = 0;
        let mut in_effect = Rule::NONE;
        for page in first_page..=last_page {
            let page_start = page << PAGE_SHIFT;
            let page_end = page_start + PAGE_SIZE;
            let first_row = paged_rows.len();
            if rows.get(next).is_none_or(|row| row.address != page_start) {
                paged_rows.push(in_effect.with_pc_low(0));
            }
            while let Some(row) = rows.get(next).filter(|row| row.address < page_end) {
                paged_rows.push(
                    row.rule
                        .with_pc_low((row.address & PAGE_OFFSET_MASK) as u16),
                );
                in_effect = row.rule;
                next += 1;
            }
            entries.push(PageEntry {
                first_row: first_row as u32,
                row_count: (paged_rows.len() - first_row) as u32,
            });
        }
        PagedRows {
            // Addresses are below MAX_ADDRESS, so pages fit u32.
            first_page: first_page as u32,
            rows: paged_rows,
            entries,
        }
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
