//! Parsing /proc/PID/maps into the executable [`Mapping`]s of a process.
use std::{path::Path, sync::Arc};

use super::files::FileCache;
use crate::model::{Mapping, Pid};

/// Name given to executable mappings without a pathname (JIT code, for instance).
pub const ANONYMOUS_NAME: &str = "[anon]";

/// Suffix the kernel appends to the pathname of a mapped file that was unlinked.
pub const DELETED_SUFFIX: &str = " (deleted)";

/// One line of /proc/PID/maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapsEntry<'a> {
    pub start: u64,
    pub end: u64,
    /// `rwxp`-style permissions.
    pub perms: &'a str,
    pub offset: u64,
    /// The device as `major:minor` says it, as a `dev_t` (what `stat` calls `st_dev` for
    /// the same file on an ordinary file system).
    pub dev: Option<u64>,
    pub inode: u64,
    /// Everything after the inode, leading blanks removed; may contain spaces. Empty for
    /// anonymous mappings.
    pub pathname: &'a str,
}

/// What backs a mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing<'a> {
    /// A file, `path` without any " (deleted)" suffix.
    File { path: &'a str, deleted: bool },
    /// A pseudo-file such as `[vdso]`, `[vsyscall]`, `[heap]`, `anon_inode:...`.
    Special(&'a str),
    /// No pathname at all.
    Anonymous,
}

impl<'a> MapsEntry<'a> {
    pub fn is_executable(&self) -> bool {
        self.perms.contains('x')
    }

    pub fn backing(&self) -> Backing<'a> {
        let name = self.pathname;
        if name.is_empty() {
            Backing::Anonymous
        } else if name.starts_with('/') {
            match name.strip_suffix(DELETED_SUFFIX) {
                Some(path) => Backing::File {
                    path,
                    deleted: true,
                },
                None => Backing::File {
                    path: name,
                    deleted: false,
                },
            }
        } else {
            Backing::Special(name)
        }
    }
}

/// Splits off the next blank-separated field.
fn next_field<'a>(rest: &mut &'a str) -> Option<&'a str> {
    let trimmed = rest.trim_start_matches([' ', '\t']);
    if trimmed.is_empty() {
        return None;
    }
    let end = trimmed.find([' ', '\t']).unwrap_or(trimmed.len());
    let (field, tail) = trimmed.split_at(end);
    *rest = tail;
    Some(field)
}

/// Parses one maps line; `None` for anything malformed.
pub fn parse_maps_line(line: &str) -> Option<MapsEntry<'_>> {
    let mut rest = line.trim_end_matches(['\n', '\r']);
    let range = next_field(&mut rest)?;
    let perms = next_field(&mut rest)?;
    let offset = next_field(&mut rest)?;
    let device = next_field(&mut rest)?;
    let inode = next_field(&mut rest)?;
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    if start >= end {
        return None;
    }
    Some(MapsEntry {
        start,
        end,
        perms,
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: device.split_once(':').and_then(|(major, minor)| {
            Some(libc::makedev(
                u32::from_str_radix(major, 16).ok()?,
                u32::from_str_radix(minor, 16).ok()?,
            ))
        }),
        inode: inode.parse().ok()?,
        pathname: rest.trim_start_matches([' ', '\t']),
    })
}

/// The executable mappings listed in `maps_text`, sorted by start address. File-backed ones are
/// opened (through `files`) from `process_dir` (/proc/PID); a file that cannot be opened still
/// yields a mapping, with `file: None`.
pub fn executable_mappings(
    pid: Pid,
    process_dir: &Path,
    maps_text: &str,
    files: &mut FileCache,
) -> Vec<Mapping> {
    let mut mappings: Vec<Mapping> = maps_text
        .lines()
        .filter_map(parse_maps_line)
        .filter(MapsEntry::is_executable)
        .map(|entry| {
            let (file, name) = match entry.backing() {
                Backing::File { path, .. } => {
                    (files.open(pid, process_dir, &entry, path), entry.pathname)
                }
                Backing::Special(name) => (None, name),
                Backing::Anonymous => (None, ANONYMOUS_NAME),
            };
            Mapping {
                start: entry.start,
                end: entry.end,
                file_offset: entry.offset,
                file,
                name: Arc::from(name),
            }
        })
        .collect();
    mappings.sort_by_key(|m| m.start);
    // Overlaps cannot come from the kernel; drop them so lookups by address stay well defined.
    mappings.dedup_by(|later, earlier| later.start < earlier.end);
    mappings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_real_lines() {
        let line = "7f2c4a5d0000-7f2c4a665000 r-xp 00028000 fd:01 1053312                    /usr/lib/x86_64-linux-gnu/libc.so.6";
        let entry = parse_maps_line(line).expect("valid line");
        assert_eq!(entry.start, 0x7f2c_4a5d_0000);
        assert_eq!(entry.end, 0x7f2c_4a66_5000);
        assert_eq!(entry.offset, 0x28000);
        assert_eq!(entry.inode, 1_053_312);
        assert_eq!(entry.dev, Some(libc::makedev(0xfd, 0x01)));
        assert!(entry.is_executable());
        assert_eq!(
            entry.backing(),
            Backing::File {
                path: "/usr/lib/x86_64-linux-gnu/libc.so.6",
                deleted: false
            }
        );

        let deleted =
            parse_maps_line("55d0-55e0 r-xp 00001000 08:02 42   /tmp/my dir/app (deleted)")
                .expect("valid line");
        assert_eq!(
            deleted.backing(),
            Backing::File {
                path: "/tmp/my dir/app",
                deleted: true
            }
        );

        let vdso = parse_maps_line(
            "7ffd1000-7ffd3000 r-xp 00000000 00:00 0                          [vdso]",
        )
        .expect("valid line");
        assert_eq!(vdso.backing(), Backing::Special("[vdso]"));
        let anon = parse_maps_line("7f00-8f00 rwxp 00000000 00:00 0 ").expect("valid line");
        assert_eq!(anon.backing(), Backing::Anonymous);
        let not_exec = parse_maps_line("1000-2000 rw-p 00000000 00:00 0 [heap]").expect("valid");
        assert!(!not_exec.is_executable());
    }

    #[test]
    fn rejects_malformed_lines() {
        for line in [
            "",
            "xyz",
            "1000-2000",
            "1000-2000 r-xp",
            "2000-1000 r-xp 0 00:00 0",
            "1000-2000 r-xp zz 00:00 0",
            "1000-2000 r-xp 0 00:00 -1",
            "10000000000000000-2 r-xp 0 00:00 0",
            "1000_2000 r-xp 0 00:00 0",
        ] {
            assert_eq!(parse_maps_line(line), None, "{line:?}");
        }
    }

    #[test]
    fn special_and_anonymous_mappings_have_no_file() {
        let text = "\
7ffd1000-7ffd3000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0          [vsyscall]
7f0000000000-7f0000100000 rwxp 00000000 00:00 0
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
";
        let mut files = FileCache::new(4);
        let mappings = executable_mappings(Pid(1), Path::new("/nonexistent/1"), text, &mut files);
        let names: Vec<&str> = mappings.iter().map(|m| &*m.name).collect();
        assert_eq!(names, ["[vdso]", "[anon]", "[vsyscall]"]);
        assert!(mappings.iter().all(|m| m.file.is_none()));
    }

    /// A tiny deterministic generator so the garbage test needs no extra crates.
    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let valid =
            "7f2c4a5d0000-7f2c4a665000 r-xp 00028000 fd:01 1053312   /usr/lib/libc.so.6 (deleted)";
        let alphabet = b"0123456789abcdefx-: \t/[]()\n\rdeleted\xff";
        let mut files = FileCache::new(4);
        for round in 0..20_000 {
            let line: String = match round % 3 {
                // Random bytes from a maps-like alphabet.
                0 => {
                    let len = (rng.next() % 120) as usize;
                    let bytes: Vec<u8> = (0..len)
                        .map(|_| alphabet[(rng.next() % alphabet.len() as u64) as usize])
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                }
                // A valid line cut short.
                1 => {
                    let cut = (rng.next() % (valid.len() as u64 + 1)) as usize;
                    valid.get(..cut).unwrap_or(valid).to_owned()
                }
                // A valid line with one byte replaced.
                _ => {
                    let mut bytes = valid.as_bytes().to_vec();
                    let at = (rng.next() % bytes.len() as u64) as usize;
                    if let Some(b) = bytes.get_mut(at) {
                        *b = alphabet[(rng.next() % alphabet.len() as u64) as usize];
                    }
                    String::from_utf8_lossy(&bytes).into_owned()
                }
            };
            if let Some(entry) = parse_maps_line(&line) {
                assert!(entry.start < entry.end);
                let _ = entry.backing();
            }
            let _ = executable_mappings(Pid(1), Path::new("/nonexistent/1"), &line, &mut files);
        }
    }
}
