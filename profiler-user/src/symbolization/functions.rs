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
//!
//! A function is remembered (`FunctionIndex::remember`) when every address in it provably
//! gets the same name: the file's only symbols are `.dynsym` (no `.symtab`, no
//! `.gnu_debugdata`, no DWARF, no separate debug file: the caller says so), and either none of
//! them can name an address of the function and no other FDE starts inside it, or one sized
//! symbol names it and no other symbol starts inside it. The next address sampled in that
//! function is then named without a symbol search: a stripped compiler is sampled at
//! thousands of addresses a second (7,571 distinct addresses in 9,638 samples of one `cc1`
//! run, in 2,426 functions; 57 % of the samples in functions its `.dynsym` names), each of
//! which cost a symbol search of 20-30 µs.
use std::{collections::BTreeMap, fs::File, ops::Range, path::Path, sync::Arc};

use object::{Object, ObjectSymbol, read::ReadCache};

use super::RememberedFunction;
use crate::process::elf_headers::ElfHeaders;

/// Functions remembered per file at most (`FunctionIndex::remember`): the file's start over
/// when full. The symbolizer bounds them over all files too (`MAX_FUNCTION_RANGES`).
const MAX_RANGES_PER_FILE: usize = 8_192;
/// A file with more dynamic symbols than this remembers no functions: the bounds of its
/// symbols would cost more memory (16 bytes a symbol) than its lookups are worth.
const MAX_RANGE_SYMBOLS: usize = 65_536;

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
    /// Where the file's symbols could name an address; `None`: functions are not remembered.
    symbols: Option<SymbolBounds>,
    /// Remembered functions: start → (end, what their addresses are named).
    ranges: BTreeMap<u64, (u64, Arc<RememberedFunction>)>,
}

/// The defined symbols of a file whose only symbol table is `.dynsym`, as blazesym reads them:
/// a sized symbol names the addresses it covers, a sizeless one only its own address, and
/// only the symbols at the greatest start at or below an address are candidates. Every
/// defined symbol is kept, whatever its type (more than blazesym considers, so a range found
/// free of them is free of blazesym's).
struct SymbolBounds {
    /// Starts and sizes, ascending.
    symbols: Vec<(u64, u64)>,
    /// For each index, the largest end (start + size) of the symbols up to and including it.
    ends_so_far: Vec<u64>,
}

/// How the addresses of a function to remember were named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NamedBy {
    /// No symbol: after the start of the FDE that holds them.
    FunctionStart,
    /// By a sized symbol whose name alone is the frame (no line, no inlined function).
    Symbol,
}

impl SymbolBounds {
    fn read<'data>(elf: &impl Object<'data>) -> Option<Self> {
        let mut symbols: Vec<(u64, u64)> = Vec::new();
        for symbol in elf.dynamic_symbols() {
            if symbol.is_undefined() {
                continue;
            }
            if symbols.len() == MAX_RANGE_SYMBOLS {
                return None;
            }
            symbols.push((symbol.address(), symbol.size()));
        }
        symbols.sort_unstable();
        let mut ends_so_far = Vec::with_capacity(symbols.len());
        let mut end = 0u64;
        for &(start, size) in &symbols {
            end = end.max(start.saturating_add(size));
            ends_so_far.push(end);
        }
        Some(Self {
            symbols,
            ends_so_far,
        })
    }

    /// The index of the first symbol that starts at or after `address`.
    fn first_from(&self, address: u64) -> usize {
        self.symbols.partition_point(|&(start, _)| start < address)
    }

    /// Whether no symbol can name any address of `range`: none starts in it, and none that
    /// starts before it reaches into it (a sizeless one names only its own address).
    fn none_names(&self, range: &Range<u64>) -> bool {
        let first_not_below = self.first_from(range.start);
        if self
            .symbols
            .get(first_not_below)
            .is_some_and(|&(start, _)| start < range.end)
        {
            return false;
        }
        first_not_below == 0 || self.ends_so_far[first_not_below - 1] <= range.start
    }

    /// Whether one symbol names every address of `range`, its own: every symbol that starts
    /// in it starts at its start and has its size (aliases), so whichever of them a lookup
    /// takes for one address it takes for all (the candidates for an address are the symbols
    /// at the greatest start at or below it).
    fn only_one_names(&self, range: &Range<u64>) -> bool {
        let first = self.first_from(range.start);
        let mut inside = self.symbols[first..]
            .iter()
            .take_while(|&&(start, _)| start < range.end)
            .peekable();
        inside.peek().is_some()
            && inside.all(|&(start, size)| {
                start == range.start && start.saturating_add(size) == range.end
            })
    }

    fn heap_bytes(&self) -> usize {
        self.symbols.capacity() * std::mem::size_of::<(u64, u64)>()
            + self.ends_so_far.capacity() * std::mem::size_of::<u64>()
    }
}

impl FunctionIndex {
    /// Maps the file at `path`; `None` for a file without `.eh_frame_hdr` (or unreadable):
    /// its frames keep their offset names. With `symbols_only_in_binary` (the caller found no
    /// DWARF and no separate debug file), a file whose only symbols are `.dynsym` remembers
    /// the functions it names.
    pub(super) fn open(path: &Path, symbols_only_in_binary: bool) -> Option<Self> {
        let file = File::open(path).ok()?;
        // The headers only, read through the cache; the sections are used in the mapping.
        let (little_endian, header, frames, text, got, symbols) = {
            let cache = ReadCache::new(&file);
            // The headers alone: a whole parse would copy the symbol tables through the cache.
            let elf = ElfHeaders::parse(&cache).ok()?;
            let placed = |name: &str| {
                let section = elf.section(name)?;
                let (offset, size) = section.file_range?;
                let start = usize::try_from(offset).ok()?;
                let end = start.checked_add(usize::try_from(size).ok()?)?;
                Some((start..end, section.address))
            };
            let address = |name: &str| elf.section(name).map(|s| s.address);
            let dynsym_only = symbols_only_in_binary
                && elf.section(".symtab").is_none()
                && elf.section(".gnu_debugdata").is_none();
            // Only `.dynsym` is there to read, and these bounds need it whole.
            let symbols = dynsym_only
                .then(|| SymbolBounds::read(&object::File::parse(&cache).ok()?))
                .flatten();
            (
                elf.little_endian,
                placed(".eh_frame_hdr")?,
                placed(".eh_frame")?,
                address(".text"),
                address(".got"),
                symbols,
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
            symbols,
            ranges: BTreeMap::new(),
        })
    }

    /// Where the file is mapped: the symbolizer's own mapping, only dropped with the index.
    pub(super) fn mapped_start(&self) -> u64 {
        self.mapped.as_ptr() as u64
    }

    /// The start of the function whose FDE holds `vaddr`, if one does.
    #[cfg(test)]
    pub(super) fn start_of(&self, vaddr: u64) -> Option<u64> {
        self.function_of(vaddr).map(|function| function.start)
    }

    /// The addresses of the function (FDE) that holds `vaddr`, if one does.
    pub(super) fn function_of(&self, vaddr: u64) -> Option<Range<u64>> {
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
        let start = fde.initial_address();
        (fde.len() > 0).then(|| start..start.saturating_add(fde.len()))
    }

    /// What the addresses of the remembered function that holds `vaddr` are named.
    pub(super) fn remembered(&self, vaddr: u64) -> Option<&Arc<RememberedFunction>> {
        let (_, (end, remembered)) = self.ranges.range(..=vaddr).next_back()?;
        (vaddr < *end).then_some(remembered)
    }

    /// Remembers `function` with what one of its addresses was named, `named_by`, when every
    /// address of it is named so. Named after the function's start (`function` from
    /// [`Self::function_of`]): no symbol can name one of its addresses, and the FDE found for
    /// its last address is the one found for its first (the search table's entries are
    /// sorted, so no other FDE starts in between). Named by a symbol (`function` its
    /// addresses): no other symbol starts in it.
    pub(super) fn remember(
        &mut self,
        function: Range<u64>,
        named_by: NamedBy,
        remembered: Arc<RememberedFunction>,
    ) {
        let Some(symbols) = &self.symbols else {
            return;
        };
        if function.is_empty() {
            return;
        }
        let provable = match named_by {
            NamedBy::FunctionStart => {
                symbols.none_names(&function)
                    && self.function_of(function.end - 1).as_ref() == Some(&function)
            }
            NamedBy::Symbol => symbols.only_one_names(&function),
        };
        if !provable {
            return;
        }
        if self.ranges.len() >= MAX_RANGES_PER_FILE {
            self.ranges.clear();
        }
        self.ranges
            .insert(function.start, (function.end, remembered));
    }

    /// Functions remembered.
    pub(super) fn remembered_len(&self) -> usize {
        self.ranges.len()
    }

    /// Forgets the functions remembered (the symbolizer's bound over all files).
    pub(super) fn forget_remembered(&mut self) {
        self.ranges = BTreeMap::new();
    }

    /// Heap bytes of the symbols' bounds (the remembered functions are bounded by count).
    pub(super) fn heap_bytes(&self) -> usize {
        self.symbols.as_ref().map_or(0, SymbolBounds::heap_bytes)
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
        let index = FunctionIndex::open(&exe, true).expect("the test binary has .eh_frame_hdr");
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
        assert!(FunctionIndex::open(Path::new("/nonexistent"), true).is_none());
        let not_elf = std::env::temp_dir().join(format!("not-elf-{}", std::process::id()));
        std::fs::write(&not_elf, b"\x7fELF garbage").expect("write");
        assert!(FunctionIndex::open(&not_elf, true).is_none());
        let _ = std::fs::remove_file(&not_elf);
    }
}
