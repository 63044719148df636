//! Reading another process's memory. Every failure is a value: the target runs concurrently
//! (or is garbage), so pointers read from it are never trusted.
use std::{
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use thiserror::Error;

use crate::model::Pid;

/// The largest single read: bounds what a corrupt length field can make us allocate.
pub const MAX_READ_LEN: usize = 1 << 20;

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum MemoryError {
    #[error("cannot open {path}: errno {errno:?}")]
    Open { path: PathBuf, errno: Option<i32> },
    #[error("read of {len} bytes at {addr:#x} exceeds the {MAX_READ_LEN}-byte limit")]
    TooLarge { addr: u64, len: usize },
    #[error("null or out-of-range address {addr:#x}")]
    BadAddress { addr: u64 },
    #[error("read of {len} bytes at {addr:#x} failed: errno {errno:?}")]
    Unreadable {
        addr: u64,
        len: usize,
        errno: Option<i32>,
    },
    #[error("read of {len} bytes at {addr:#x} returned only {got}")]
    Short { addr: u64, len: usize, got: usize },
}

/// Read access to a process's address space.
pub trait ProcessMemory {
    /// Fills `buf` from `addr`, entirely or not at all.
    fn read_exact(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError>;
}

/// Typed reads on top of [`ProcessMemory`] (little-endian, x86_64).
pub trait ProcessMemoryExt: ProcessMemory {
    fn read_array<const N: usize>(&self, addr: u64) -> Result<[u8; N], MemoryError> {
        let mut buf = [0u8; N];
        self.read_exact(addr, &mut buf)?;
        Ok(buf)
    }
    fn read_u8(&self, addr: u64) -> Result<u8, MemoryError> {
        Ok(self.read_array::<1>(addr)?[0])
    }
    fn read_u32(&self, addr: u64) -> Result<u32, MemoryError> {
        Ok(u32::from_le_bytes(self.read_array(addr)?))
    }
    fn read_i32(&self, addr: u64) -> Result<i32, MemoryError> {
        Ok(i32::from_le_bytes(self.read_array(addr)?))
    }
    fn read_u64(&self, addr: u64) -> Result<u64, MemoryError> {
        Ok(u64::from_le_bytes(self.read_array(addr)?))
    }
    /// `len` bytes at `addr`, refused beyond [`MAX_READ_LEN`].
    fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        if len > MAX_READ_LEN {
            return Err(MemoryError::TooLarge { addr, len });
        }
        let mut buf = vec![0u8; len];
        self.read_exact(addr, &mut buf)?;
        Ok(buf)
    }
}

impl<T: ProcessMemory + ?Sized> ProcessMemoryExt for T {}

/// User-space addresses on x86_64 end below 2^47; anything else is garbage, not worth a syscall.
fn check_range(addr: u64, len: usize) -> Result<(), MemoryError> {
    const USER_END: u64 = 1 << 47;
    if len > MAX_READ_LEN {
        return Err(MemoryError::TooLarge { addr, len });
    }
    let end = addr.checked_add(len as u64);
    if addr < 4096 || end.is_none_or(|end| end > USER_END) {
        return Err(MemoryError::BadAddress { addr });
    }
    Ok(())
}

/// A live process through `/proc/PID/mem` (pread). Needs ptrace access to the target (root or
/// the same user with a permissive `ptrace_scope`).
#[derive(Debug)]
pub struct ProcMemory {
    pid: Pid,
    file: File,
}

impl ProcMemory {
    pub fn open(pid: Pid) -> Result<Self, MemoryError> {
        Self::open_in(Path::new("/proc"), pid)
    }

    pub fn open_in(proc_root: &Path, pid: Pid) -> Result<Self, MemoryError> {
        let path = proc_root.join(pid.0.to_string()).join("mem");
        let file = File::open(&path).map_err(|error| MemoryError::Open {
            path,
            errno: error.raw_os_error(),
        })?;
        Ok(Self { pid, file })
    }

    pub fn pid(&self) -> Pid {
        self.pid
    }
}

impl ProcessMemory for ProcMemory {
    fn read_exact(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        check_range(addr, buf.len())?;
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], addr + done as u64) {
                Ok(0) => {
                    return Err(MemoryError::Short {
                        addr,
                        len: buf.len(),
                        got: done,
                    });
                }
                Ok(n) => done += n,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => {
                    return Err(MemoryError::Unreadable {
                        addr,
                        len: buf.len(),
                        errno: error.raw_os_error(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Memory made of byte regions at fixed addresses: synthetic objects for tests, or a copy of a
/// process's memory.
#[derive(Clone, Debug, Default)]
pub struct MemoryImage {
    regions: Vec<(u64, Vec<u8>)>,
}

impl MemoryImage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `bytes` at `addr` (later regions win where they overlap).
    pub fn insert(&mut self, addr: u64, bytes: Vec<u8>) {
        self.regions.push((addr, bytes));
    }
}

impl ProcessMemory for MemoryImage {
    fn read_exact(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        check_range(addr, buf.len())?;
        let end = addr + buf.len() as u64;
        let region = self.regions.iter().rev().find(|(start, bytes)| {
            *start <= addr && end <= start.saturating_add(bytes.len() as u64)
        });
        match region {
            Some((start, bytes)) => {
                let from = (addr - start) as usize;
                buf.copy_from_slice(&bytes[from..from + buf.len()]);
                Ok(())
            }
            None => Err(MemoryError::Unreadable {
                addr,
                len: buf.len(),
                errno: Some(libc::EIO),
            }),
        }
    }
}
