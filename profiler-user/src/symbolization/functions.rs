//! Function ranges of a binary from its `.eh_frame`, to name the frames of code without
//! symbols.
//!
//! A stripped binary (a compiler's `cc1`, `bash`, coreutils) keeps its call-frame information:
//! every FDE covers one function (or one cold part of it) from its first byte to its last. A
//! frame at an address with no symbol is named after the start of the FDE that holds it, as
//! disassemblers name such functions (`sub_<address>`), so the samples of one function come
//! together instead of one frame per instruction address. An address that no FDE covers keeps
//! its `module+0x<file offset>` name.
use std::{fs::File, path::Path};

use object::{Object, ObjectSection, read::ReadCache};

/// The `[start, end)` virtual-address ranges of a file's FDEs, sorted by start.
#[derive(Debug, Default)]
pub(super) struct FunctionRanges {
    /// Starts and lengths, kept as two fields of one entry to halve the memory of 64-bit ends.
    ranges: Vec<(u64, u32)>,
}

impl FunctionRanges {
    /// Reads the ranges of the file at `path`; an unreadable or malformed file, or one without
    /// `.eh_frame`, gives none (its frames keep their offset names).
    pub(super) fn read(path: &Path) -> Self {
        let Ok(file) = File::open(path) else {
            return Self::default();
        };
        // Only the section headers and `.eh_frame` are read, not the whole file.
        let cache = ReadCache::new(file);
        let Ok(elf) = object::File::parse(&cache) else {
            return Self::default();
        };
        let Some(eh_frame) = elf.section_by_name(".eh_frame") else {
            return Self::default();
        };
        let Ok(data) = eh_frame.data() else {
            return Self::default();
        };
        let endian = if elf.is_little_endian() {
            gimli::RunTimeEndian::Little
        } else {
            gimli::RunTimeEndian::Big
        };
        let section = gimli::EhFrame::new(data, endian);
        let mut bases = gimli::BaseAddresses::default().set_eh_frame(eh_frame.address());
        if let Some(text) = elf.section_by_name(".text") {
            bases = bases.set_text(text.address());
        }
        if let Some(got) = elf.section_by_name(".got") {
            bases = bases.set_got(got.address());
        }
        let mut ranges = Vec::new();
        let mut entries = gimli::UnwindSection::entries(&section, &bases);
        // A malformed entry ends the walk: the ranges read so far are still FDEs.
        while let Ok(Some(entry)) = entries.next() {
            if let gimli::CieOrFde::Fde(partial) = entry
                && let Ok(fde) = partial.parse(gimli::UnwindSection::cie_from_offset)
                && let Ok(length) = u32::try_from(fde.len())
                && length > 0
                && fde.initial_address().checked_add(fde.len()).is_some()
            {
                ranges.push((fde.initial_address(), length));
            }
        }
        ranges.sort_unstable();
        ranges.shrink_to_fit();
        Self { ranges }
    }

    /// The start of the function that holds `vaddr`, if an FDE covers it. Where FDEs overlap
    /// (malformed tables), the one starting nearest below `vaddr` that covers it.
    pub(super) fn start_of(&self, vaddr: u64) -> Option<u64> {
        let after = self.ranges.partition_point(|&(start, _)| start <= vaddr);
        self.ranges[..after]
            .iter()
            .rev()
            .take(8)
            .find(|&&(start, length)| vaddr - start < u64::from(length))
            .map(|&(start, _)| start)
    }

    /// Bytes held, for the symbolizer's memory budget.
    pub(super) fn bytes(&self) -> u64 {
        (self.ranges.capacity() * std::mem::size_of::<(u64, u32)>()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_named_by_the_fde_that_covers_it() {
        let ranges = FunctionRanges {
            ranges: vec![(0x1000, 0x40), (0x1040, 0x10), (0x2000, 0x100)],
        };
        assert_eq!(ranges.start_of(0x1000), Some(0x1000));
        assert_eq!(ranges.start_of(0x103f), Some(0x1000));
        assert_eq!(ranges.start_of(0x1040), Some(0x1040));
        // Between FDEs (padding, a PLT without CFI) and outside all of them: no function.
        assert_eq!(ranges.start_of(0x1050), None);
        assert_eq!(ranges.start_of(0xfff), None);
        assert_eq!(ranges.start_of(0x2100), None);
        assert_eq!(ranges.start_of(u64::MAX), None);
    }

    #[test]
    fn ranges_of_a_real_binary_hold_its_symbols_addresses() {
        // The test binary has symbols: each function symbol's address must be the start of
        // the range that holds it, and an address inside must find the same start.
        let exe = std::env::current_exe().expect("current exe");
        let ranges = FunctionRanges::read(&exe);
        assert!(ranges.ranges.len() > 100, "{} FDEs", ranges.ranges.len());
        let data = std::fs::read(&exe).expect("read exe");
        let elf = object::File::parse(&*data).expect("parse exe");
        let mut checked = 0;
        for symbol in object::Object::symbols(&elf) {
            use object::ObjectSymbol;
            if symbol.kind() != object::SymbolKind::Text || symbol.size() < 16 {
                continue;
            }
            let Some(start) = ranges.start_of(symbol.address()) else {
                continue;
            };
            if start != symbol.address() {
                continue;
            }
            assert_eq!(
                ranges.start_of(symbol.address() + symbol.size() / 2),
                Some(start)
            );
            checked += 1;
        }
        assert!(checked > 100, "only {checked} functions checked");
        assert_eq!(FunctionRanges::read(Path::new("/nonexistent")).bytes(), 0);
    }
}
