//! Table-build scenario: `build_table` run in this process on a few real libraries (libc,
//! libpython, libstdc++ and the largest ELF shared library on the machine), timed best of 3.
use std::{
    collections::HashSet,
    io::Read,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use profiler::unwinding::tables::{CfiSource, build_table};

/// Where the largest shared library is looked for (recursively, symlinks not followed).
const SCAN_ROOTS: &[&str] = &["/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/local/lib"];
/// The scan stops after this long and picks the largest library seen so far.
const SCAN_BUDGET: Duration = Duration::from_secs(20);
/// Builds are repeated (best of 3) only while one build takes less than this.
const REPEAT_BELOW: Duration = Duration::from_secs(10);

/// One library's table figures.
#[derive(Debug)]
pub struct TableBuild {
    /// What the library stands for: `libc`, `libpython3.11`, `libstdc++`, `largest`.
    pub role: String,
    pub path: PathBuf,
    pub file_bytes: u64,
    pub outcome: Result<TableFigures, String>,
}

#[derive(Debug)]
pub struct TableFigures {
    pub source: CfiSource,
    pub fdes: u64,
    pub rows_before_merge: u64,
    /// `UnwindTable::row_count()`: merged rows including the `CFA_NONE` markers.
    pub rows: usize,
    pub pages: usize,
    /// `UnwindTable::memory_bytes()`: bytes in the BPF maps (rows incl. page-start rows, page
    /// entries).
    pub memory_bytes: usize,
    /// Every timed `build_table` call (file already in memory).
    pub builds: Vec<Duration>,
    /// Splitting the rows into 64 KiB pages (first `paged()` call), done once.
    pub paging: Duration,
}

impl TableFigures {
    pub fn best(&self) -> Option<Duration> {
        self.builds.iter().min().copied()
    }

    /// Best build time in seconds per million merged rows.
    pub fn seconds_per_million_rows(&self) -> Option<f64> {
        let best = self.best()?;
        (self.rows > 0).then(|| best.as_secs_f64() / (self.rows as f64 / 1e6))
    }
}

/// What the scan for the largest library saw.
#[derive(Debug, Default)]
pub struct ScanInfo {
    pub files_seen: u64,
    pub elapsed: Duration,
    pub truncated: bool,
}

pub struct TablesResult {
    pub builds: Vec<TableBuild>,
    pub scan: ScanInfo,
}

pub fn run() -> anyhow::Result<TablesResult> {
    let mut candidates: Vec<(String, PathBuf)> = Vec::new();
    let libc = PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6");
    candidates.push(("libc".into(), libc));
    match libpython() {
        Some(path) => candidates.push(("libpython3.11".into(), path)),
        None => eprintln!(
            "bench: libpython3.11 not found under $PYENV_ROOT, ~/.pyenv or /root/.pyenv; skipped"
        ),
    }
    candidates.push((
        "libstdc++".into(),
        PathBuf::from("/usr/lib/x86_64-linux-gnu/libstdc++.so.6"),
    ));
    eprintln!(
        "bench: looking for the largest ELF shared library (at most {} s)",
        SCAN_BUDGET.as_secs()
    );
    let (largest, scan) = largest_shared_library();
    match largest {
        Some(path) => candidates.push(("largest on the machine".into(), path)),
        None => eprintln!("bench: no ELF shared library found by the scan"),
    }

    let mut builds = Vec::new();
    let mut seen = HashSet::new();
    for (role, path) in candidates {
        crate::procs::check_interrupted()?;
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        if !seen.insert(path.clone()) {
            continue;
        }
        eprintln!("bench: building the unwind table of {}", path.display());
        builds.push(measure(role, path));
    }
    Ok(TablesResult { builds, scan })
}

fn measure(role: String, path: PathBuf) -> TableBuild {
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(err) => {
            return TableBuild {
                role,
                path,
                file_bytes: 0,
                outcome: Err(format!("cannot read: {err}")),
            };
        }
    };
    let file_bytes = bytes.len() as u64;
    let mut builds = Vec::new();
    let mut table = None;
    for _ in 0..3 {
        let start = Instant::now();
        let built = build_table(&bytes);
        let took = start.elapsed();
        match built {
            Ok(t) => {
                builds.push(took);
                table = Some(t);
            }
            Err(err) => {
                return TableBuild {
                    role,
                    path,
                    file_bytes,
                    outcome: Err(format!("build_table failed: {err}")),
                };
            }
        }
        if took >= REPEAT_BELOW {
            break;
        }
    }
    let Some(table) = table else {
        return TableBuild {
            role,
            path,
            file_bytes,
            outcome: Err("no build ran".into()),
        };
    };
    let start = Instant::now();
    let pages = table.page_count();
    let paging = start.elapsed();
    let stats = table.stats();
    TableBuild {
        role,
        path,
        file_bytes,
        outcome: Ok(TableFigures {
            source: stats.source,
            fdes: stats.fdes,
            rows_before_merge: stats.rows_before_merge,
            rows: table.row_count(),
            pages,
            memory_bytes: table.memory_bytes(),
            builds,
            paging,
        }),
    }
}

/// `versions/3.11.7/lib/libpython3.11.so.1.0` under `$PYENV_ROOT`, `$HOME/.pyenv` or
/// `/root/.pyenv`; else any `versions/3.11*` with that library.
fn libpython() -> Option<PathBuf> {
    let roots: Vec<PathBuf> = [
        std::env::var_os("PYENV_ROOT").map(PathBuf::from),
        std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".pyenv")),
        Some(PathBuf::from("/root/.pyenv")),
    ]
    .into_iter()
    .flatten()
    .collect();
    let library = "lib/libpython3.11.so.1.0";
    for root in &roots {
        let path = root.join("versions/3.11.7").join(library);
        if path.is_file() {
            return Some(path);
        }
    }
    for root in &roots {
        let Ok(entries) = std::fs::read_dir(root.join("versions")) else {
            continue;
        };
        let mut versions: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("3.11"))
            .map(|e| e.path().join(library))
            .filter(|p| p.is_file())
            .collect();
        versions.sort();
        if let Some(path) = versions.pop() {
            return Some(path);
        }
    }
    None
}

/// The largest x86_64 ELF shared object (`ET_DYN`) named `*.so` or `*.so.*` under
/// [`SCAN_ROOTS`] and the pyenv versions' `lib` directories, by file size.
fn largest_shared_library() -> (Option<PathBuf>, ScanInfo) {
    let start = Instant::now();
    let mut roots: Vec<PathBuf> = SCAN_ROOTS.iter().map(PathBuf::from).collect();
    for pyenv in [
        std::env::var_os("PYENV_ROOT").map(PathBuf::from),
        Some(PathBuf::from("/root/.pyenv")),
    ]
    .into_iter()
    .flatten()
    {
        if let Ok(entries) = std::fs::read_dir(pyenv.join("versions")) {
            roots.extend(entries.flatten().map(|e| e.path().join("lib")));
        }
    }
    let mut info = ScanInfo::default();
    let mut visited = HashSet::new();
    let mut best: Option<(u64, PathBuf)> = None;
    let mut stack = roots;
    while let Some(dir) = stack.pop() {
        if start.elapsed() > SCAN_BUDGET {
            info.truncated = true;
            break;
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            // symlink_metadata: symlinks are neither followed nor counted (the target is
            // counted where it lives), so no loops and no double counting.
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                if visited.insert((meta.dev(), meta.ino())) {
                    stack.push(entry.path());
                }
                continue;
            }
            if !meta.is_file() || !visited.insert((meta.dev(), meta.ino())) {
                continue;
            }
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if !(name.ends_with(".so") || name.contains(".so.")) {
                continue;
            }
            info.files_seen += 1;
            if best.as_ref().is_some_and(|(size, _)| *size >= meta.len()) {
                continue;
            }
            if is_x86_64_shared_object(&entry.path()) {
                best = Some((meta.len(), entry.path()));
            }
        }
    }
    info.elapsed = start.elapsed();
    (best.map(|(_, path)| path), info)
}

fn is_x86_64_shared_object(path: &Path) -> bool {
    let mut header = [0u8; 20];
    let Ok(mut file) = std::fs::File::open(path) else {
        return false;
    };
    if file.read_exact(&mut header).is_err() {
        return false;
    }
    // Magic, 64-bit, little-endian, e_type ET_DYN (3), e_machine EM_X86_64 (62).
    header[..4] == *b"\x7fELF"
        && header[4] == 2
        && header[5] == 1
        && u16::from_le_bytes([header[16], header[17]]) == 3
        && u16::from_le_bytes([header[18], header[19]]) == 62
}
