//! Opening mapped files as the process sees them, shared across processes by [`FileId`].
use std::{
    fs::{self, File},
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use object::{Object, ReadCache};
use tracing::debug;

use super::{lru::Lru, maps::MapsEntry};
use crate::model::{FileId, MappedFile, Pid};

/// An LRU-bounded cache of opened mapped files. Evicting an entry only drops the cache's
/// reference: snapshots still using the file keep it open. While cached, the open handle also
/// pins the inode, so its (dev, ino) cannot be reused by another file.
#[derive(Debug)]
pub struct FileCache {
    files: Lru<FileId, Arc<MappedFile>>,
}

/// A file's identity: device and inode.
pub(super) fn file_id(metadata: &fs::Metadata) -> FileId {
    FileId {
        dev: metadata.dev(),
        ino: metadata.ino(),
    }
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
            Ok(metadata) => (map_files_path, file_id(&metadata)),
            Err(map_files_error) => match fs::metadata(&root_path) {
                // The path may now name another file (upgraded, replaced): the inode must match.
                Ok(metadata) if entry.inode == 0 || metadata.ino() == entry.inode => {
                    (root_path, file_id(&metadata))
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
            Ok(metadata) => file_id(&metadata),
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
            open_path: own_namespace_path(path, id).unwrap_or_else(|| fd_path(&handle)),
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
    (file_id(&metadata) == id).then(|| PathBuf::from(path))
}

fn fd_path(handle: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", handle.as_raw_fd()))
}

/// The GNU build id of an ELF file as lower-case hex; `None` for non-ELF, malformed or
/// id-less files. Reads only the headers and notes, not the whole file.
pub fn read_build_id(file: &File) -> Option<String> {
    let cache = ReadCache::new(file);
    let object = object::File::parse(&cache).ok()?;
    let id = object.build_id().ok()??;
    if id.is_empty() {
        return None;
    }
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
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
