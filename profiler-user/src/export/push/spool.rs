//! The disk spool: every queued push request is also a file, so queued profiles survive an
//! agent restart and an outage longer than the in-memory queue holds.
//!
//! One file per request, `<id:020>.push`, written atomically (temp file, fsync, rename) and
//! deleted once the receiver accepted it. Layout: `PRSPOOL1` magic, CRC-32 of the body (u32 LE),
//! body length (u64 LE), body (an encoded `PushRequest`). A file that does not match is skipped
//! with a warning and deleted, never trusted and never a panic. An exclusive `flock` on
//! `.lock` keeps two agents from sharing one spool.
use std::{
    fs::{self, File, OpenOptions},
    io,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use crate::export::write_atomically;

const MAGIC: &[u8; 8] = b"PRSPOOL1";
const HEADER_BYTES: usize = 8 + 4 + 8;
const EXTENSION: &str = "push";

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("cannot use spool directory {}: {source}", path.display())]
    Open { path: PathBuf, source: io::Error },
    #[error("spool directory {} is in use by another agent", path.display())]
    Locked { path: PathBuf },
}

/// Why a spool file could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum SpoolReadError {
    #[error("cannot read it: {0}")]
    Io(#[source] std::io::Error),
    #[error("it is not a spool file (bad header)")]
    BadHeader,
    #[error("it is truncated or has trailing bytes")]
    BadLength,
    #[error("its checksum does not match (corrupted)")]
    BadChecksum,
    #[error("its body is neither in memory nor spooled")]
    Lost,
}

/// A spooled request found at start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpooledEntry {
    pub id: u64,
    /// Size of the file on disk.
    pub file_bytes: u64,
}

#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    /// Holds the exclusive lock for as long as the spool is open.
    _lock: File,
}

impl Spool {
    /// Opens (creating) `dir`, takes its lock, removes temp files of an interrupted write and
    /// lists the spooled requests, oldest first. Files with foreign names are left alone.
    pub fn open(dir: &Path) -> Result<(Spool, Vec<SpooledEntry>), SpoolError> {
        let open_error = |source| SpoolError::Open {
            path: dir.to_owned(),
            source,
        };
        fs::create_dir_all(dir).map_err(open_error)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(".lock"))
            .map_err(open_error)?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = io::Error::last_os_error();
            return Err(if err.kind() == io::ErrorKind::WouldBlock {
                SpoolError::Locked {
                    path: dir.to_owned(),
                }
            } else {
                open_error(err)
            });
        }
        let mut entries = Vec::new();
        for entry in fs::read_dir(dir).map_err(open_error)? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.contains(".tmp-") {
                let _ = fs::remove_file(entry.path());
                continue;
            }
            let Some(id) = parse_file_name(&name) else {
                continue;
            };
            match entry.metadata() {
                Ok(meta) if meta.is_file() => entries.push(SpooledEntry {
                    id,
                    file_bytes: meta.len(),
                }),
                _ => {
                    tracing::warn!(file = %entry.path().display(), "skipping an unreadable spool entry")
                }
            }
        }
        entries.sort_by_key(|e| e.id);
        Ok((
            Spool {
                dir: dir.to_owned(),
                _lock: lock,
            },
            entries,
        ))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path_of(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:020}.{EXTENSION}"))
    }

    /// Writes a request durably; returns the file's size.
    pub fn write(&self, id: u64, body: &[u8]) -> io::Result<u64> {
        let file = encode_file(body);
        write_atomically(&self.path_of(id), &file).map_err(|err| match err {
            crate::export::ExportError::Write { source, .. }
            | crate::export::ExportError::CreateDirectory { source, .. } => source,
            other => io::Error::other(other.to_string()),
        })?;
        Ok(file.len() as u64)
    }

    /// Reads a request back, checking header, length and checksum.
    pub fn read(&self, id: u64) -> Result<Vec<u8>, SpoolReadError> {
        let bytes = fs::read(self.path_of(id)).map_err(SpoolReadError::Io)?;
        decode_file(&bytes).map(<[u8]>::to_vec)
    }

    /// Deletes a request (sent, dropped or corrupted); a file already gone is fine.
    pub fn remove(&self, id: u64) {
        match fs::remove_file(self.path_of(id)) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => tracing::warn!(
                file = %self.path_of(id).display(),
                "cannot delete a spool file: {err}"
            ),
        }
    }
}

fn parse_file_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(EXTENSION)?.strip_suffix('.')?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    stem.parse().ok()
}

pub fn encode_file(body: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(HEADER_BYTES + body.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    file.extend_from_slice(&(body.len() as u64).to_le_bytes());
    file.extend_from_slice(body);
    file
}

pub fn decode_file(file: &[u8]) -> Result<&[u8], SpoolReadError> {
    if file.len() < HEADER_BYTES || &file[..8] != MAGIC {
        return Err(SpoolReadError::BadHeader);
    }
    let checksum = u32::from_le_bytes(file[8..12].try_into().expect("4 bytes"));
    let length = u64::from_le_bytes(file[12..20].try_into().expect("8 bytes"));
    let body = &file[HEADER_BYTES..];
    if body.len() as u64 != length {
        return Err(SpoolReadError::BadLength);
    }
    if crc32fast::hash(body) != checksum {
        return Err(SpoolReadError::BadChecksum);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_order_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (spool, entries) = Spool::open(dir.path()).unwrap();
            assert!(entries.is_empty());
            for (id, body) in [(3u64, &b"third"[..]), (1, b"first"), (2, b"")] {
                let size = spool.write(id, body).unwrap();
                assert_eq!(size as usize, HEADER_BYTES + body.len());
            }
        }
        let (spool, entries) = Spool::open(dir.path()).unwrap();
        let ids: Vec<u64> = entries.iter().map(|e| e.id).collect();
        assert_eq!(ids, [1, 2, 3]);
        assert_eq!(spool.read(1).unwrap(), b"first");
        assert_eq!(spool.read(2).unwrap(), b"");
        assert_eq!(spool.read(3).unwrap(), b"third");
        spool.remove(2);
        spool.remove(2);
        drop(spool);
        let (_, entries) = Spool::open(dir.path()).unwrap();
        assert_eq!(entries.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 3]);
    }

    #[test]
    fn a_second_agent_cannot_open_the_same_spool() {
        let dir = tempfile::tempdir().unwrap();
        let (_first, _) = Spool::open(dir.path()).unwrap();
        let err = Spool::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("in use by another agent"), "{err}");
    }

    #[test]
    fn corrupted_files_are_reported_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, _) = Spool::open(dir.path()).unwrap();
        let good = encode_file(b"a push request");
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 0x40;
        let mut long = good.clone();
        long.push(0);
        let cases: [(&[u8], SpoolReadError); 6] = [
            (&[], SpoolReadError::BadHeader),
            (b"PRSPOOL1", SpoolReadError::BadHeader),
            (
                b"garbage that is long enough to hold a header",
                SpoolReadError::BadHeader,
            ),
            (&good[..good.len() - 3], SpoolReadError::BadLength),
            (&long, SpoolReadError::BadLength),
            (&flipped, SpoolReadError::BadChecksum),
        ];
        for (id, (bytes, expected)) in cases.iter().enumerate() {
            fs::write(spool.path_of(id as u64), bytes).unwrap();
            let error = spool.read(id as u64).unwrap_err();
            assert_eq!(error.to_string(), expected.to_string());
        }
        assert!(matches!(spool.read(99), Err(SpoolReadError::Io(_))));
    }

    #[test]
    fn foreign_and_temporary_files_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("notes.txt"), b"x").unwrap();
        fs::write(dir.path().join("12.push"), b"x").unwrap();
        fs::write(dir.path().join("0000000000000000000x.push"), b"x").unwrap();
        let temp = dir.path().join(".00000000000000000001.push.tmp-1-0");
        fs::write(&temp, b"half").unwrap();
        fs::create_dir(dir.path().join("00000000000000000005.push")).unwrap();
        let (_, entries) = Spool::open(dir.path()).unwrap();
        assert!(entries.is_empty(), "{entries:?}");
        assert!(!temp.exists(), "an interrupted write is cleaned up");
        assert!(dir.path().join("notes.txt").exists());
    }
}
