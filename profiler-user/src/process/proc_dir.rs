//! A process's /proc directory opened once, its files read relative to it.
//!
//! A snapshot reads five or six files of one process. Opened by full path, each costs a lookup
//! of `/proc`, of the pid and of the file; relative to the directory only the file is looked
//! up (the path walks were about a third of a snapshot's kernel time on a host forking 500
//! times a second). And every file read comes from the process the directory was opened for:
//! once that process is gone, a reused pid's new process is not read in its place (the kernel
//! answers `ESRCH`/`ENOENT`).
use std::{
    ffi::{CStr, CString, OsString},
    fs::File,
    io::{self, Read},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::{OsStrExt, OsStringExt},
    },
    path::{Path, PathBuf},
};

/// Bytes read at first: every /proc file a snapshot reads but `maps` and `environ` fits, so
/// one `read` returns it all and a second says the end.
const FIRST_READ_BYTES: usize = 4096;

#[derive(Debug)]
pub struct ProcDir {
    dir: OwnedFd,
}

impl ProcDir {
    /// Opens the directory at `path` (`/proc/PID`, or a stand-in directory in tests).
    pub fn open(path: &Path) -> io::Result<ProcDir> {
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid NUL-terminated path; the returned descriptor is owned below.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        Ok(ProcDir {
            dir: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// The whole of the file `name` in the directory.
    pub fn read(&self, name: &CStr) -> io::Result<Vec<u8>> {
        // SAFETY: a valid directory descriptor and NUL-terminated name; the descriptor
        // returned is owned below.
        let fd = unsafe {
            libc::openat(
                self.dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        let mut file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut bytes = Vec::with_capacity(FIRST_READ_BYTES);
        file.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    /// The file `name` as text; invalid UTF-8 is an error, as with `fs::read_to_string`.
    pub fn read_to_string(&self, name: &CStr) -> io::Result<String> {
        String::from_utf8(self.read(name)?)
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))
    }

    /// The target of the symbolic link `name` in the directory.
    pub fn read_link(&self, name: &CStr) -> io::Result<PathBuf> {
        let mut target = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: a valid directory descriptor and NUL-terminated name; the buffer is as long
        // as the length passed.
        let length = unsafe {
            libc::readlinkat(
                self.dir.as_raw_fd(),
                name.as_ptr(),
                target.as_mut_ptr().cast(),
                target.len(),
            )
        };
        let length = usize::try_from(length).map_err(|_| io::Error::last_os_error())?;
        target.truncate(length);
        Ok(PathBuf::from(OsString::from_vec(target)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_whole_files_and_links_relative_to_the_directory() {
        let temp = tempfile::tempdir().expect("temp dir");
        let long: Vec<u8> = (0..3 * FIRST_READ_BYTES + 17).map(|i| i as u8).collect();
        std::fs::write(temp.path().join("long"), &long).expect("write");
        std::os::unix::fs::symlink("/some/where", temp.path().join("link")).expect("link");
        let dir = ProcDir::open(temp.path()).expect("open");
        assert_eq!(dir.read(c"long").expect("long"), long);
        assert_eq!(
            dir.read_link(c"link").expect("link"),
            PathBuf::from("/some/where")
        );
        assert_eq!(
            dir.read(c"missing").expect_err("missing").kind(),
            io::ErrorKind::NotFound
        );
        // A file that is not a link, as `exe` of a stand-in directory.
        assert!(dir.read_link(c"long").is_err());
        assert!(ProcDir::open(&temp.path().join("long")).is_err());
    }

    #[test]
    fn reads_a_live_process_and_nothing_once_it_is_gone() {
        let dir = ProcDir::open(Path::new("/proc/self")).expect("open /proc/self");
        let stat = dir.read_to_string(c"stat").expect("stat");
        assert!(stat.starts_with(&format!("{} (", std::process::id())));
        assert_eq!(
            dir.read_link(c"exe").expect("exe"),
            std::env::current_exe().expect("current exe")
        );

        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("spawn sleep");
        let dir = ProcDir::open(Path::new(&format!("/proc/{}", child.id()))).expect("open");
        // Right after a vfork-style spawn the kernel may not have written argv yet.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let cmdline = loop {
            let cmdline = dir.read(c"cmdline").expect("cmdline");
            if !cmdline.is_empty() || std::time::Instant::now() > deadline {
                break cmdline;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert!(cmdline.starts_with(b"sleep\0"), "{cmdline:?}");
        child.kill().expect("kill");
        child.wait().expect("reap");
        // Reaped: its pid may name another process by now; the directory reads none.
        assert!(dir.read(c"stat").is_err());
    }
}
