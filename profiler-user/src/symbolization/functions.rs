//! Function ranges of a binary from its `.eh_frame`, to name the frames of code without
//! symbols.
//!
//! A stripped binary (a compiler's `cc1`, `bash`, coreutils) keeps its call-frame information:
//! every FDE covers one function (or one cold part of it) from its first byte to its last. A
//! frame at an address with no symbol is named after the start of the FDE that holds it, as
//! disassemblers name such functions (`sub_<address>`), so the samples of one function come
//! together instead of one frame per instruction address. An address that no FDE covers keeps
//! its `module+0x<file offset>` name. The lookup is the binary search of `.eh_frame_hdr`, the
//! table the kernel-less unwinders use, read in place.
use std::{fs::File, ops::Range, path::Path};

use object::{Object, ObjectSection, read::ReadCache};

/// A file's `.eh_frame_hdr` search table and `.eh_frame`, mapped, not read: a lookup touches
/// a few pages of the file (given back with the symbol files' pages), so even libtorch's 17 MiB
/// of CFI costs no heap.
pub(super) struct FunctionIndex {
    mapped: memmap2::Mmap,
    little_endian: bool,
    /// File ranges and virtual addresses of `.eh_frame_hdr` and `.eh_frame`.
    header: (Range<usize>, u64),
    frames: (Range<usize>, u64),
    text: Option<u64>,
    got: Option<u64>,
}

impl FunctionIndex {
    /// Maps the file at `path`; `None` for a file without `.eh_frame_hdr` (or unreadable):
    /// its frames keep their offset names.
    pub(super) fn open(path: &Path) -> Option<Self> {
        let file = File::open(path).ok()?;
        // The headers only, read through the cache; the sections are used in the mapping.
        let (little_endian, header, frames, text, got) = {
            let cache = ReadCache::new(&file);
            let elf = object::File::parse(&cache).ok()?;
            let placed = |name: &str| {
                let section = elf.section_by_name(name)?;
                let (offset, size) = section.file_range()?;
                let start = usize::try_from(offset).ok()?;
                let end = start.checked_add(usize::try_from(size).ok()?)?;
                Some((start..end, section.address()))
            };
            let address = |name: &str| elf.section_by_name(name).map(|s| s.address());
            (
                elf.is_little_endian(),
                placed(".eh_frame_hdr")?,
                placed(".eh_frame")?,
                address(".text"),
                address(".got"),
            )
        };
        // SAFETY: a read-only shared mapping; the handle the process stage holds keeps the
        // file, and a file truncated under the mapping would fault, which ELF files in use
        // are not.
        let mapped = unsafe { memmap2::Mmap::map(&file) }.ok()?;
        if header.0.end > mapped.len() || frames.0.end > mapped.len() {
            return None;
        }
        Some(Self {
            mapped,
            little_endian,
            header,
            frames,
            text,
            got,
        })
    }

    /// Where the file is mapped: the symbolizer's own mapping, only dropped with the index.
    pub(super) fn mapped_start(&self) -> u64 {
        self.mapped.as_ptr() as u64
    }

    /// The start of the function whose FDE holds `vaddr`, if one does.
    pub(super) fn start_of(&self, vaddr: u64) -> Option<u64> {
        let endian = if self.little_endian {
            gimli::RunTimeEndian::Little
        } else {
            gimli::RunTimeEndian::Big
        };
        let mut bases = gimli::BaseAddresses::default()
            .set_eh_frame_hdr(self.header.1)
            .set_eh_frame(self.frames.1);
        if let Some(text) = self.text {
            bases = bases.set_text(text);
        }
        if let Some(got) = self.got {
            bases = bases.set_got(got);
        }
        let header = gimli::EhFrameHdr::new(&self.mapped[self.header.0.clone()], endian)
            .parse(&bases, 8)
            .ok()?;
        let frames = gimli::EhFrame::new(&self.mapped[self.frames.0.clone()], endian);
        let fde = header
            .table()?
            .fde_for_address(
                &frames,
                &bases,
                vaddr,
                gimli::UnwindSection::cie_from_offset,
            )
            .ok()?;
        (fde.len() > 0).then(|| fde.initial_address())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_a_real_binary_are_named_by_the_function_that_holds_them() {
        // The test binary has symbols: a function symbol's address and an address inside it
        // must both find the symbol's address as the start of their FDE.
        let exe = std::env::current_exe().expect("current exe");
        let index = FunctionIndex::open(&exe).expect("the test binary has .eh_frame_hdr");
        let data = std::fs::read(&exe).expect("read exe");
        let elf = object::File::parse(&*data).expect("parse exe");
        let (mut checked, mut outside) = (0, 0);
        for symbol in object::Object::symbols(&elf) {
            use object::ObjectSymbol;
            if symbol.kind() != object::SymbolKind::Text || symbol.size() < 16 {
                continue;
            }
            if index.start_of(symbol.address()) != Some(symbol.address()) {
                continue;
            }
            let inside = symbol.address() + symbol.size() / 2;
            assert_eq!(
                index.start_of(inside),
                Some(symbol.address()),
                "{inside:#x}"
            );
            checked += 1;
        }
        // Nothing covers the ELF header or addresses past the end of the file's code.
        for vaddr in [0, 0x10, u64::MAX - 1] {
            if index.start_of(vaddr).is_none() {
                outside += 1;
            }
        }
        assert!(checked > 100, "only {checked} functions checked");
        assert_eq!(outside, 3);
        assert!(FunctionIndex::open(Path::new("/nonexistent")).is_none());
        let not_elf = std::env::temp_dir().join(format!("not-elf-{}", std::process::id()));
        std::fs::write(&not_elf, b"\x7fELF garbage").expect("write");
        assert!(FunctionIndex::open(&not_elf).is_none());
        let _ = std::fs::remove_file(&not_elf);
    }
}
