//! An ELF file's headers (load segments, sections, build id, debug link), read without its
//! symbol tables. `object::File::parse` reads both symbol tables whole, and through a
//! `ReadCache` that is a copy into memory: 13 MiB of libtorch_cpu's `.symtab` (and 1.8 MiB of
//! `.dynsym`) to learn its build id or where its code starts, each time a file is opened.
use object::{
    Endianness, FileKind, ReadRef, elf,
    read::elf::{CompressionHeader, FileHeader, ProgramHeader, SectionHeader},
};

/// One `PT_LOAD` segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    pub file_offset: u64,
    pub file_size: u64,
    pub vaddr: u64,
    pub executable: bool,
}

/// One section header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub name: Box<[u8]>,
    pub address: u64,
    /// Offset and size in the file; `None` for a section with no bytes there (`SHT_NOBITS`).
    pub file_range: Option<(u64, u64)>,
    /// The size of its contents once decompressed (`SHF_COMPRESSED`, or a GNU `.zdebug_`
    /// section): the bytes a reader of it holds. The file size when not compressed, 0 when
    /// not in the file.
    pub uncompressed_size: u64,
}

/// What [`ElfHeaders::parse`] reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElfHeaders {
    pub little_endian: bool,
    /// The `PT_LOAD` segments, in header order.
    pub loads: Vec<LoadSegment>,
    pub sections: Vec<Section>,
    /// The GNU build id note's bytes (from the note sections, or the note segments of a file
    /// without section headers).
    pub build_id: Option<Vec<u8>>,
    /// The file name in `.gnu_debuglink`.
    pub debuglink: Option<Vec<u8>>,
}

impl ElfHeaders {
    /// Reads the file header, the program and section headers, the section names and the
    /// notes, nothing else.
    pub fn parse<'data, R: ReadRef<'data>>(data: R) -> object::Result<Self> {
        match FileKind::parse(data) {
            Ok(FileKind::Elf32) => Self::parse_as::<elf::FileHeader32<Endianness>, R>(data),
            // Anything else fails in the 64-bit header's checks, with object's own error.
            _ => Self::parse_as::<elf::FileHeader64<Endianness>, R>(data),
        }
    }

    fn parse_as<'data, Elf, R>(data: R) -> object::Result<Self>
    where
        Elf: FileHeader<Endian = Endianness>,
        R: ReadRef<'data>,
    {
        let header = Elf::parse(data)?;
        let endian = header.endian()?;
        let program_headers = header.program_headers(endian, data)?;
        let table = header.sections(endian, data)?;
        let loads = program_headers
            .iter()
            .filter(|segment| segment.p_type(endian) == elf::PT_LOAD)
            .map(|segment| LoadSegment {
                file_offset: segment.p_offset(endian).into(),
                file_size: segment.p_filesz(endian).into(),
                vaddr: segment.p_vaddr(endian).into(),
                executable: segment.p_flags(endian) & elf::PF_X != 0,
            })
            .collect();
        let mut sections = Vec::with_capacity(table.len());
        let mut build_id = None;
        let mut debuglink = None;
        // The null section (index 0) is no section.
        for section in table.iter().skip(1) {
            // A section whose name cannot be read is not one asked for by name.
            let name = table.section_name(endian, section).unwrap_or_default();
            let file_range = section.file_range(endian);
            // A compression header that cannot be read leaves the section as stored.
            let uncompressed_size = match section.compression(endian, data).ok().flatten() {
                Some((compression, _, _)) => compression.ch_size(endian).into(),
                None => match file_range {
                    Some((offset, size)) if name.starts_with(b".zdebug_") => {
                        gnu_uncompressed_size(data, offset, size).unwrap_or(size)
                    }
                    Some((_, size)) => size,
                    None => 0,
                },
            };
            if build_id.is_none()
                && let Ok(Some(notes)) = section.notes(endian, data)
            {
                build_id = gnu_build_id(notes, endian);
            }
            if name == b".gnu_debuglink"
                && let Ok(bytes) = section.data(endian, data)
            {
                // The name, NUL-terminated, then its CRC.
                let end = bytes.iter().position(|&byte| byte == 0);
                debuglink = end.map(|end| bytes[..end].to_vec());
            }
            sections.push(Section {
                name: name.into(),
                address: section.sh_addr(endian).into(),
                file_range,
                uncompressed_size,
            });
        }
        if sections.is_empty() {
            build_id = program_headers
                .iter()
                .filter_map(|segment| segment.notes(endian, data).ok().flatten())
                .find_map(|notes| gnu_build_id(notes, endian));
        }
        Ok(Self {
            little_endian: endian == Endianness::Little,
            loads,
            sections,
            build_id,
            debuglink,
        })
    }

    /// The section named `name`; for a `.debug_` name, its GNU-compressed `.zdebug_` form
    /// where only that is present.
    pub fn section(&self, name: &str) -> Option<&Section> {
        let exact = |wanted: &[u8]| self.sections.iter().find(|s| &*s.name == wanted);
        exact(name.as_bytes()).or_else(|| {
            let rest = name.strip_prefix(".debug_")?;
            exact(format!(".zdebug_{rest}").as_bytes())
        })
    }
}

/// The GNU build id among `notes`. A malformed note ends the search, not the parse: the
/// headers are still good for everything else.
fn gnu_build_id<Elf: FileHeader>(
    mut notes: object::read::elf::NoteIterator<'_, Elf>,
    endian: Elf::Endian,
) -> Option<Vec<u8>> {
    while let Ok(Some(note)) = notes.next() {
        if note.name() == elf::ELF_NOTE_GNU && note.n_type(endian) == elf::NT_GNU_BUILD_ID {
            return Some(note.desc().to_vec());
        }
    }
    None
}

/// The decompressed size a GNU `.zdebug_` section states: `ZLIB`, then the size as a
/// big-endian u64.
fn gnu_uncompressed_size<'data, R: ReadRef<'data>>(data: R, offset: u64, size: u64) -> Option<u64> {
    if size < 12 {
        return None;
    }
    let header = data.read_bytes_at(offset, 12).ok()?;
    let size: [u8; 8] = header.strip_prefix(b"ZLIB")?.try_into().ok()?;
    Some(u64::from_be_bytes(size))
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use object::{Object, ObjectSection, ObjectSegment, read::ReadCache};

    use super::*;

    /// Every field against `object::File::parse` of the same file, on real binaries of this
    /// machine: executables and shared libraries with build ids and debug links, and libc's
    /// separate debug file where installed (compressed sections, `SHT_NOBITS` code).
    #[test]
    fn headers_read_alone_match_the_whole_parse() {
        let mut candidates: Vec<std::path::PathBuf> = vec![
            std::env::current_exe().expect("test binary"),
            "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
            "/bin/ls".into(),
            "/usr/lib/x86_64-linux-gnu/libz.so.1".into(),
        ];
        let libc = std::fs::read("/usr/lib/x86_64-linux-gnu/libc.so.6").expect("libc");
        let id = ElfHeaders::parse(&*libc)
            .expect("libc")
            .build_id
            .expect("libc build id");
        let hex: String = id.iter().map(|byte| format!("{byte:02x}")).collect();
        candidates
            .push(format!("/usr/lib/debug/.build-id/{}/{}.debug", &hex[..2], &hex[2..]).into());
        let mut checked = 0;
        let mut with_debuglink = 0;
        for path in candidates.iter().filter(|path| path.exists()) {
            let file = File::open(path).expect("open");
            let cache = ReadCache::new(&file);
            let headers = ElfHeaders::parse(&cache).expect("headers");
            let data = std::fs::read(path).expect("read");
            let whole = object::File::parse(&*data).expect("parse");

            assert_eq!(headers.little_endian, whole.is_little_endian(), "{path:?}");
            let loads: Vec<_> = whole
                .segments()
                .map(|segment| (segment.file_range(), segment.address()))
                .collect();
            let ours: Vec<_> = headers
                .loads
                .iter()
                .map(|load| ((load.file_offset, load.file_size), load.vaddr))
                .collect();
            assert_eq!(ours, loads, "{path:?}");
            assert_eq!(
                headers.build_id.as_deref(),
                whole.build_id().unwrap(),
                "{path:?}"
            );
            assert_eq!(
                headers.debuglink.as_deref(),
                whole.gnu_debuglink().unwrap().map(|(name, _)| name),
                "{path:?}"
            );
            assert_eq!(headers.sections.len(), whole.sections().count(), "{path:?}");
            for (ours, section) in headers.sections.iter().zip(whole.sections()) {
                let name = section.name().unwrap();
                assert_eq!(&*ours.name, name.as_bytes(), "{path:?}");
                assert_eq!(
                    headers.section(name).map(|s| s.address),
                    Some(section.address()),
                    "{path:?} {name}"
                );
                assert_eq!(ours.address, section.address(), "{path:?} {name}");
                assert_eq!(ours.file_range, section.file_range(), "{path:?} {name}");
                let uncompressed = section.compressed_file_range().unwrap().uncompressed_size;
                assert_eq!(ours.uncompressed_size, uncompressed, "{path:?} {name}");
            }
            checked += 1;
            with_debuglink += usize::from(headers.debuglink.is_some());
        }
        assert!(checked >= 3, "too few binaries on this machine to compare");
        assert!(with_debuglink >= 1, "no binary with a debug link compared");
    }

    /// A broken build id note costs the build id, not the headers (the whole parse reported
    /// such a file's segments too).
    #[test]
    fn a_malformed_note_loses_only_the_build_id() {
        let mut data = std::fs::read("/bin/ls").expect("read");
        let good = ElfHeaders::parse(&*data).expect("headers");
        let note = good.section(".note.gnu.build-id").expect("a build id note");
        let (offset, _) = note.file_range.expect("in the file");
        // The note's name size, far past the section's end.
        data[offset as usize..offset as usize + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let broken = ElfHeaders::parse(&*data).expect("headers still read");
        assert_eq!(broken.build_id, None);
        assert_eq!(broken.loads, good.loads);
        assert_eq!(broken.sections, good.sections);
        assert_eq!(broken.debuglink, good.debuglink);
    }

    /// Bytes flipped anywhere in the headers' parts of a real binary: an answer or an error,
    /// never a panic (a hostile file is read like any other).
    #[test]
    fn flipped_bytes_never_panic() {
        let original = std::fs::read("/bin/ls").expect("read");
        let good = ElfHeaders::parse(&*original).expect("headers");
        let section_headers_at = original.len().saturating_sub(4096);
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut parsed, mut failed) = (0, 0);
        for _ in 0..2_000 {
            let mut data = original.clone();
            for _ in 0..1 + next() % 4 {
                // The file header and program headers, or the section headers and names at
                // the end, or a note.
                let region = match next() % 3 {
                    0 => 0..1024,
                    1 => section_headers_at..original.len(),
                    _ => 0..original.len(),
                };
                let at = region.start + (next() as usize) % (region.end - region.start);
                data[at] ^= 1 << (next() % 8);
            }
            match ElfHeaders::parse(&*data) {
                Ok(_) => parsed += 1,
                Err(_) => failed += 1,
            }
        }
        assert!(parsed > 0 && failed > 0, "{parsed} parsed, {failed} failed");
        assert!(!good.loads.is_empty());
    }

    #[test]
    fn truncated_and_foreign_input_is_an_error_not_a_panic() {
        let data = std::fs::read("/bin/ls").expect("read");
        for cut in [0, 4, 16, 63, 64, 200, data.len() / 2] {
            // Either an error or headers; never a panic. Cut before the section table, it
            // must be an error.
            let parsed = ElfHeaders::parse(&data[..cut]);
            if cut <= 64 {
                assert!(parsed.is_err(), "cut at {cut}");
            }
        }
        assert!(ElfHeaders::parse(&b"#!/bin/sh\necho hi\n"[..]).is_err());
    }
}
