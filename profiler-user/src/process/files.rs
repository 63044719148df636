//! Opening mapped files as the process sees them, shared across processes by [`FileId`].
use std::{
    fs::{self, File},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use object::ReadCache;
use tracing::debug;

use super::{lru::Lru, maps::MapsEntry};
use crate::model::{FileId, MappedFile, Pid, descriptor_path};

/// An LRU-bounded cache of opened mapped files. Evicting an entry only drops the cache's
/// reference: snapshots still using the file keep it open. While cached, the open handle also
/// pins the inode, so its (dev, ino) cannot be reused by another file.
#[derive(Debug)]
pub struct FileCache {
    files: Lru<FileId, Arc<MappedFile>>,
}

/// Descriptors kept for everything else the process opens: BPF maps, programs and links, perf
/// events (two per CPU), the store's database, the symbolizer's files, logs.
pub const FD_RESERVE: u64 = 256;

/// How the process's file descriptors are shared between the users that can each exhaust them:
/// HTTP connections (a client can open as many as it likes) and the mapped-file cache (one per
/// distinct binary or library on the host). Without a split, idle sockets up to the limit left
/// no descriptor for /proc and every stack came out `[truncated] ; [unknown]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdBudget {
    /// The soft `RLIMIT_NOFILE` in force.
    pub limit: u64,
    /// `--max-connections`, lowered to fit (the probe reserve comes on top).
    pub connections: usize,
    /// Mapped files the cache keeps open, lowered to fit.
    pub mapped_files: usize,
}

impl FdBudget {
    /// Raises the soft open-file limit to the hard one (as Go's runtime does: a soft limit of
    /// 1024 is an old `select()` constraint), then splits it with [`Self::split`], logging what
    /// was lowered.
    pub fn at_start(max_connections: usize, max_mapped_files: usize, probe_reserve: usize) -> Self {
        let limit = raise_open_file_limit();
        let budget = Self::split(limit, max_connections, max_mapped_files, probe_reserve);
        let mut lowered = Vec::new();
        if budget.connections < max_connections {
            lowered.push(format!(
                "{} HTTP connections (--max-connections {max_connections})",
                budget.connections
            ));
        }
        if budget.mapped_files < max_mapped_files {
            lowered.push(format!(
                "{} open mapped files (of {max_mapped_files})",
                budget.mapped_files
            ));
        }
        if !lowered.is_empty() {
            tracing::warn!(
                "open-file limit {limit}: at most {}, so none can take the descriptors the \
                 others need; raise `ulimit -n` for more",
                lowered.join(" and ")
            );
        }
        budget
    }

    /// Beyond [`FD_RESERVE`], at most a quarter of the descriptors for connections (with the
    /// probes' reserve) and half for mapped files; values already lower are kept.
    pub fn split(
        limit: u64,
        max_connections: usize,
        max_mapped_files: usize,
        probe_reserve: usize,
    ) -> Self {
        let spare = usize::try_from(limit.saturating_sub(FD_RESERVE)).unwrap_or(usize::MAX);
        FdBudget {
            limit,
            connections: max_connections.min((spare / 4).saturating_sub(probe_reserve).max(1)),
            mapped_files: max_mapped_files.min((spare / 2).max(1)),
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (at most 2^20, what the kernel allows by
/// default); returns the soft limit in force afterwards.
fn raise_open_file_limit() -> u64 {
    let mut limits = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limits) } != 0 {
        return 1024;
    }
    let wanted = limits.rlim_max.min(1 << 20);
    if limits.rlim_cur < wanted {
        let raised = libc::rlimit {
            rlim_cur: wanted,
            rlim_max: limits.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return wanted;
        }
    }
    limits.rlim_cur
}

/// File descriptors this process holds for files (see [`count_file_links`]), from
/// /proc/self/fd.
pub fn open_file_descriptors() -> u64 {
    count_file_links(Path::new("/proc/self/fd"))
}

/// The entries of an fd directory (`/proc/PID/fd`) whose link names a file: a path, not a
/// `socket:[…]`, `pipe:[…]` or `anon_inode:…` (BPF maps and programs, perf events, epoll). The
/// descriptor reading the directory itself is left out.
pub fn count_file_links(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut count = 0;
    for entry in entries.flatten() {
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        let is_path = target.as_os_str().as_encoded_bytes().first() == Some(&b'/');
        // The directory stream being read is a descriptor too: /proc/<pid>/fd.
        let is_this_listing = target.starts_with("/proc") && target.ends_with("fd");
        if is_path && !is_this_listing {
            count += 1;
        }
    }
    count
}

impl FileCache {
    pub fn new(max_open_files: usize) -> Self {
        Self {
            files: Lru::new(max_open_files),
        }
    }

    /// Keeps at most `max_open_files` open: the least recently used beyond are let go now
    /// (closed once no snapshot holds them either).
    pub fn set_max_open_files(&mut self, max_open_files: usize) {
        self.files.set_capacity(max_open_files);
    }

    /// Whether the file `id` is held open.
    pub fn contains(&self, id: FileId) -> bool {
        self.files.contains_key(&id)
    }

    /// Number of files the cache holds open.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The executable an exec event named, with the file offset its code starts at: from the
    /// cache when that file is open already, else opened by `path` if it is still the file
    /// exec'ed (same identity).
    pub fn executable(&mut self, path: &str, id: FileId) -> Option<(Arc<MappedFile>, u64)> {
        if let Some(file) = self.files.get_mut(&id) {
            let offset = super::identity::code_file_offset(file.handle.as_ref()?)?;
            return Some((Arc::clone(file), offset));
        }
        let (file, offset) = super::identity::executable_file(path, id, read_build_id)?;
        self.files.insert(id, Arc::clone(&file));
        Some((file, offset))
    }

    /// A file announced by an mmap record of a process that may be gone: from the cache, else
    /// opened by `path` in the agent's namespace if that is still the file mapped (same
    /// identity). Without an identity to check, only a cached file of that path would do, so
    /// `None`.
    pub fn announced(&mut self, path: &str, id: FileId) -> Option<Arc<MappedFile>> {
        if let Some(file) = self.files.get_mut(&id) {
            return Some(Arc::clone(file));
        }
        let (handle, open_path) = super::identity::open_executable(path, id)?;
        let file = Arc::new(MappedFile {
            id,
            path: Arc::from(path),
            open_path,
            build_id: read_build_id(&handle).map(Arc::from),
            handle: Some(handle),
        });
        self.files.insert(id, Arc::clone(&file));
        Some(file)
    }

    /// The file behind a file-backed mapping, opened as the process sees it: through
    /// /proc/PID/map_files (works for deleted files and other mount namespaces), else through
    /// /proc/PID/root. `None` when neither names the mapped file.
    pub fn open(
        &mut self,
        pid: Pid,
        process_dir: &Path,
        entry: &MapsEntry<'_>,
        path: &str,
    ) -> Option<Arc<MappedFile>> {
        // Known by the device and inode the maps line names: no lookup in /proc at all (each
        // costs a walk of the process's memory map in the kernel). The inode is live while
        // mapped, so the pair names this very file.
        if let Some(dev) = entry.dev
            && entry.inode != 0
            && let Some(file) = self.files.get_mut(&FileId {
                dev,
                ino: entry.inode,
            })
        {
            return Some(Arc::clone(file));
        }
        let map_files_path = process_dir
            .join("map_files")
            .join(format!("{:x}-{:x}", entry.start, entry.end));
        let root_path = process_dir.join("root").join(path.trim_start_matches('/'));
        // stat before open: a cache hit costs no file descriptor.
        let (source, id) = match fs::metadata(&map_files_path) {
            Ok(metadata) => (map_files_path, FileId::of(&metadata)),
            Err(map_files_error) => match fs::metadata(&root_path) {
                // The path may now name another file (upgraded, replaced): the inode must match.
                Ok(metadata) if entry.inode == 0 || metadata.ino() == entry.inode => {
                    (root_path, FileId::of(&metadata))
                }
                Ok(_) => {
                    debug!(%pid, path, "mapped file replaced on disk and map_files unavailable");
                    return None;
                }
                Err(root_error) => {
                    debug!(%pid, path, %map_files_error, %root_error, "cannot open mapped file");
                    return None;
                }
            },
        };
        if let Some(file) = self.files.get_mut(&id) {
            return Some(Arc::clone(file));
        }
        let handle = match File::open(&source) {
            Ok(handle) => handle,
            Err(error) => {
                debug!(%pid, path, source = %source.display(), %error, "cannot open mapped file");
                return None;
            }
        };
        // Identify by what was actually opened (the file may have changed since the stat).
        let id = match handle.metadata() {
            Ok(metadata) => FileId::of(&metadata),
            Err(error) => {
                debug!(%pid, path, %error, "cannot fstat mapped file");
                return None;
            }
        };
        if let Some(file) = self.files.get_mut(&id) {
            return Some(Arc::clone(file));
        }
        let file = Arc::new(MappedFile {
            id,
            path: Arc::from(path),
            open_path: own_namespace_path(path, id).unwrap_or_else(|| descriptor_path(&handle)),
            build_id: read_build_id(&handle).map(Arc::from),
            handle: Some(handle),
        });
        self.files.insert(id, Arc::clone(&file));
        Some(file)
    }
}

/// `path` itself when it names the same file in the agent's mount namespace, so that files
/// looked up next to it (debug links) are found too.
fn own_namespace_path(path: &str, id: FileId) -> Option<PathBuf> {
    let metadata = fs::metadata(path).ok()?;
    (FileId::of(&metadata) == id).then(|| PathBuf::from(path))
}

/// The GNU build id of an ELF file as lower-case hex; `None` for non-ELF, malformed or
/// id-less files. Reads only the headers and notes, not the whole file.
pub fn read_build_id(file: &File) -> Option<String> {
    let cache = ReadCache::new(file);
    let id = super::elf_headers::ElfHeaders::parse(&cache)
        .ok()?
        .build_id?;
    if id.is_empty() {
        return None;
    }
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// Held by any thread while it creates or removes its own mapping of a file that processes map
/// (their binaries and libraries), so the symbolizer can tell its own new mapping of such a file
/// from another thread's: it gives its own mappings' pages back with `MADV_DONTNEED`, which is
/// only safe on a range known to stay that mapping (see `Symbolizer::release_file_pages`).
pub static FILE_MAPPING_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes [`FILE_MAPPING_LOCK`] (a panic elsewhere while holding it left nothing to repair).
pub fn lock_file_mappings() -> std::sync::MutexGuard<'static, ()> {
    FILE_MAPPING_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A read-only mapping of a whole file, made and removed under [`FILE_MAPPING_LOCK`].
pub struct GuardedMmap(Option<memmap2::Mmap>);

impl GuardedMmap {
    /// Maps all of `file` read-only.
    ///
    /// # Safety
    /// As `memmap2::Mmap::map`: the file must not be truncated or changed while mapped.
    pub unsafe fn map(file: &File) -> std::io::Result<Self> {
        let _guard = lock_file_mappings();
        // SAFETY: the caller's promise.
        unsafe { memmap2::Mmap::map(file) }.map(|mapped| Self(Some(mapped)))
    }
}

impl std::ops::Deref for GuardedMmap {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl Drop for GuardedMmap {
    fn drop(&mut self) {
        let _guard = lock_file_mappings();
        drop(self.0.take());
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn build_id_of_non_elf_is_none() {
        let mut file = tempfile::tempfile().expect("tempfile");
        file.write_all(b"\x7fELF garbage that is not really an ELF file")
            .expect("write");
        assert_eq!(read_build_id(&file), None);
        let empty = tempfile::tempfile().expect("tempfile");
        assert_eq!(read_build_id(&empty), None);
    }

    #[test]
    fn build_id_of_sleep_is_hex() {
        let file = File::open("/bin/sleep").expect("open /bin/sleep");
        let id = read_build_id(&file).expect("build id");
        assert!(id.len() >= 16, "{id}");
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
    }
}
