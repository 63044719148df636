//! The export stage: turns aggregated [`Profile`]s into files (gzipped pprof or folded stacks),
//! and pushes them to Grafana Pyroscope ([`push`]).
//!
//! Files are always written atomically (temp file in the same directory, fsync, rename), so a
//! reader never sees a partial profile.
pub mod folded;
pub mod pprof;
pub mod push;

use std::{
    fmt,
    fs::{self, File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
    str::FromStr,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::model::Profile;

/// Why a profile could not be written. Display is one line naming the path.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot create directory {}: {source}", path.display())]
    CreateDirectory { path: PathBuf, source: io::Error },
    /// The embedded store refused or failed it. The store sits beside the exporters, not
    /// below them, so its error is kept as a boxed source rather than named here.
    #[error("cannot store the profile: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The file formats the exporter can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputFormat {
    /// Gzipped pprof protobuf (`.pb.gz`).
    Pprof,
    /// Folded stacks text, one `root;...;leaf count` line per stack.
    Folded,
}

impl OutputFormat {
    /// The conventional file name extension, without the leading dot.
    pub fn file_extension(self) -> &'static str {
        match self {
            OutputFormat::Pprof => "pb.gz",
            OutputFormat::Folded => "folded",
        }
    }
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OutputFormat::Pprof => "pprof",
            OutputFormat::Folded => "folded",
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown output format `{0}` (expected `pprof` or `folded`)")]
pub struct UnknownOutputFormat(pub String);

impl FromStr for OutputFormat {
    type Err = UnknownOutputFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "pprof" => Ok(OutputFormat::Pprof),
            "folded" => Ok(OutputFormat::Folded),
            _ => Err(UnknownOutputFormat(s.to_owned())),
        }
    }
}

/// Serializes a profile in the given format.
pub fn render(profile: &Profile, format: OutputFormat) -> Vec<u8> {
    match format {
        OutputFormat::Pprof => pprof::encode_pprof_gz(profile),
        OutputFormat::Folded => {
            let mut text = Vec::new();
            // Writing into a Vec cannot fail.
            folded::write_folded(profile, &mut text).expect("writing into memory cannot fail");
            text
        }
    }
}

/// Writes `bytes` to `path` so that `path` holds either its old content or all of `bytes`, never
/// a prefix: write a temp file in the same directory (same file system, so rename is atomic),
/// fsync it, rename it over `path`, then fsync the directory so the rename survives a crash.
/// The temp file is removed on failure.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ExportError> {
    let write_error = |source: io::Error| ExportError::Write {
        path: path.to_owned(),
        source,
    };
    let file_name = path.file_name().ok_or_else(|| {
        write_error(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the path does not name a file",
        ))
    })?;
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };

    let (temp_path, mut temp_file) = create_temp_file(directory, file_name).map_err(write_error)?;
    let result = temp_file
        .write_all(bytes)
        .and_then(|()| temp_file.sync_all())
        .and_then(|()| {
            drop(temp_file);
            fs::rename(&temp_path, path)
        });
    if let Err(source) = result {
        let _ = fs::remove_file(&temp_path);
        return Err(write_error(source));
    }
    // Best effort: the data is complete either way; this only makes the rename itself durable.
    if let Ok(dir) = File::open(directory) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Creates a new, uniquely named hidden file next to the target. `create_new` guarantees we never
/// write into someone else's file (e.g. one left behind by a crashed run with the same pid).
fn create_temp_file(directory: &Path, file_name: &std::ffi::OsStr) -> io::Result<(PathBuf, File)> {
    static NEXT_TEMP_ID: AtomicU64 = AtomicU64::new(0);
    let mut last_error = None;
    for _ in 0..16 {
        let temp_id = NEXT_TEMP_ID.fetch_add(1, Ordering::Relaxed);
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(file_name);
        temp_name.push(format!(".tmp-{}-{temp_id}", std::process::id()));
        let temp_path = directory.join(temp_name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp_path)
        {
            Ok(file) => return Ok((temp_path, file)),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => last_error = Some(error),
            Err(error) => return Err(error),
        }
    }
    Err(last_error.unwrap_or_else(|| io::Error::other("no free temporary file name")))
}

/// Where finished profiles go.
pub trait ProfileSink {
    fn write(&mut self, profile: &Profile) -> Result<(), ExportError>;
}

/// Writes each profile as `<service_name>-<start unix seconds>.pb.gz` in a directory.
#[derive(Clone, Debug)]
pub struct DirectorySink {
    pub dir: PathBuf,
}

impl DirectorySink {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DirectorySink { dir: dir.into() }
    }

    /// The path a profile is written to; `-N` is appended when another profile of the same
    /// service and second is already there (e.g. two processes of one service), so none is lost.
    pub fn path_for(&self, profile: &Profile) -> PathBuf {
        let service_name =
            sanitize_file_name_part(profile.series_label("service_name").unwrap_or("unknown"));
        let start_seconds = profile.start_unix_ns.div_euclid(1_000_000_000);
        let base = format!("{service_name}-{start_seconds}");
        let mut path = self.dir.join(format!("{base}.pb.gz"));
        let mut suffix = 1u32;
        while path.exists() {
            path = self.dir.join(format!("{base}-{suffix}.pb.gz"));
            suffix += 1;
        }
        path
    }
}

impl ProfileSink for DirectorySink {
    fn write(&mut self, profile: &Profile) -> Result<(), ExportError> {
        fs::create_dir_all(&self.dir).map_err(|source| ExportError::CreateDirectory {
            path: self.dir.clone(),
            source,
        })?;
        write_atomically(&self.path_for(profile), &pprof::encode_pprof_gz(profile))
    }
}

/// Keeps `[A-Za-z0-9._-]` and turns everything else into `_`, so a service name can never
/// escape the directory or produce an awkward file name.
fn sanitize_file_name_part(name: &str) -> String {
    let sanitized: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if sanitized.is_empty() {
        "unknown".to_owned()
    } else {
        sanitized
    }
}

/// A hand-built profile shared by the export tests: a synthetic root, a native frame in a mapping
/// with a build id, a frame with an inlined function, an unsymbolized `libfoo.so+0x1234` frame, a
/// kernel frame, a second address in `main` (same Function, other line) and a name containing
/// ';' and '\n'.
#[cfg(test)]
pub(crate) mod test_fixture {
    use std::sync::Arc;

    use crate::model::{
        FrameKind, FrameLine, LabelValue, MappingInfo, Profile, ProfileSample, SymbolizedFrame,
    };

    pub const ROOT: u32 = 0;
    pub const MAIN: u32 = 1;
    pub const INLINED: u32 = 2;
    pub const LIBFOO_UNSYMBOLIZED: u32 = 3;
    pub const KERNEL: u32 = 4;
    pub const ODD_NAME: u32 = 5;
    pub const MAIN_OTHER_LINE: u32 = 6;
    pub const PERIOD_NS: i64 = 10_000_000;
    pub const START_UNIX_NS: i64 = 1_700_000_000_123_456_789;
    pub const DURATION_NS: i64 = 10_000_000_000;

    pub fn line(
        function: &str,
        system_name: Option<&str>,
        file: Option<&str>,
        line: u32,
    ) -> FrameLine {
        FrameLine {
            function: function.into(),
            system_name: system_name.map(Into::into),
            file: file.map(Into::into),
            line,
        }
    }

    pub fn app_mapping() -> Arc<MappingInfo> {
        Arc::new(MappingInfo {
            start: 0x40_0000,
            limit: 0x50_0000,
            file_offset: 0x1000,
            filename: "/usr/bin/myapp".into(),
            build_id: Some("deadbeef00112233".into()),
        })
    }

    pub fn libfoo_mapping() -> Arc<MappingInfo> {
        Arc::new(MappingInfo {
            start: 0x7f00_0000_0000,
            limit: 0x7f00_0001_0000,
            file_offset: 0,
            filename: "/usr/lib/libfoo.so".into(),
            build_id: None,
        })
    }

    pub fn labels(pairs: &[(&str, LabelValue)]) -> Vec<(Arc<str>, LabelValue)> {
        pairs
            .iter()
            .map(|(key, value)| (Arc::from(*key), value.clone()))
            .collect()
    }

    pub fn profile() -> Profile {
        let native = |address, mapping: Arc<MappingInfo>, lines| SymbolizedFrame {
            kind: FrameKind::Native,
            address,
            // Separate Arcs with equal content on purpose: mappings dedupe by value.
            mapping: Some(Arc::new((*mapping).clone())),
            lines,
            unsymbolized: false,
        };
        let frames = vec![
            SymbolizedFrame {
                kind: FrameKind::Synthetic,
                address: 0,
                mapping: None,
                lines: vec![line("myapp", None, None, 0)],
                unsymbolized: false,
            },
            native(
                0x40_1000,
                app_mapping(),
                vec![line("main", None, Some("src/main.rs"), 10)],
            ),
            native(
                0x40_2000,
                app_mapping(),
                vec![
                    line("inner_helper", None, Some("src/lib.rs"), 42),
                    line("outer_fn", Some("_ZN5outer2fnE"), Some("src/lib.rs"), 7),
                ],
            ),
            SymbolizedFrame {
                kind: FrameKind::Native,
                address: 0x7f00_0000_1234,
                mapping: Some(libfoo_mapping()),
                lines: vec![line(
                    "libfoo.so+0x1234",
                    None,
                    Some("/usr/lib/libfoo.so"),
                    0,
                )],
                unsymbolized: true,
            },
            SymbolizedFrame {
                kind: FrameKind::Kernel,
                address: 0xffff_ffff_8100_0000,
                mapping: None,
                lines: vec![line("do_syscall_64", None, None, 0)],
                unsymbolized: false,
            },
            native(
                0x40_3000,
                app_mapping(),
                vec![line("weird;name\nx", None, Some("src/odd.rs"), 3)],
            ),
            native(
                0x40_1100,
                app_mapping(),
                vec![line("main", None, Some("src/main.rs"), 12)],
            ),
        ];
        let worker = LabelValue::Str("worker".into());
        let samples = vec![
            ProfileSample {
                stack: vec![KERNEL, LIBFOO_UNSYMBOLIZED, MAIN, ROOT],
                count: 3,
                more_values: Vec::new(),
                labels: labels(&[
                    ("thread_name", worker.clone()),
                    ("tid", LabelValue::Num(42)),
                ]),
            },
            ProfileSample {
                stack: vec![INLINED, MAIN, ROOT],
                count: 5,
                more_values: Vec::new(),
                labels: labels(&[("thread_name", worker)]),
            },
            ProfileSample {
                stack: vec![INLINED, MAIN, ROOT],
                count: 2,
                more_values: Vec::new(),
                labels: labels(&[("thread_name", LabelValue::Str("other".into()))]),
            },
            ProfileSample {
                stack: vec![ODD_NAME, MAIN_OTHER_LINE, ROOT],
                count: 1,
                more_values: Vec::new(),
                labels: Vec::new(),
            },
        ];
        Profile {
            kind: crate::model::ProfileKind::Cpu,
            series_labels: vec![
                ("host".to_owned(), "node-1".to_owned()),
                ("service_name".to_owned(), "my app/v1".to_owned()),
            ],
            start_unix_ns: START_UNIX_NS,
            duration_ns: DURATION_NS,
            period_ns: PERIOD_NS,
            frames,
            samples,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_a_directory_path() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let regular_file = dir.path().join("plain-file");
        fs::write(&regular_file, b"x").expect("write plain file");
        let target = regular_file.join("profile.pb.gz");
        (dir, regular_file, target)
    }

    fn directory_entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("read dir")
            .map(|entry| {
                entry
                    .expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        names
    }

    #[test]
    fn output_format_parses_and_displays() {
        assert_eq!("pprof".parse(), Ok(OutputFormat::Pprof));
        assert_eq!("Folded".parse(), Ok(OutputFormat::Folded));
        assert_eq!(
            "svg".parse::<OutputFormat>().unwrap_err().to_string(),
            "unknown output format `svg` (expected `pprof` or `folded`)"
        );
        for format in [OutputFormat::Pprof, OutputFormat::Folded] {
            assert_eq!(format.to_string().parse(), Ok(format));
        }
    }

    #[test]
    fn render_produces_gzip_for_pprof_and_text_for_folded() {
        let profile = test_fixture::profile();
        let pprof_bytes = render(&profile, OutputFormat::Pprof);
        assert_eq!(&pprof_bytes[..2], &[0x1f, 0x8b], "gzip magic");
        let folded_text = String::from_utf8(render(&profile, OutputFormat::Folded)).expect("utf-8");
        assert!(folded_text.starts_with("myapp;main;"), "{folded_text}");
    }

    #[test]
    fn write_atomically_writes_and_replaces_content() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("out.pb.gz");
        write_atomically(&path, b"first").expect("first write");
        write_atomically(&path, b"second, longer").expect("second write");
        assert_eq!(fs::read(&path).expect("read back"), b"second, longer");
        assert_eq!(
            directory_entries(dir.path()),
            vec!["out.pb.gz"],
            "no temp file left"
        );
    }

    #[test]
    fn write_atomically_error_names_the_path_and_leaves_nothing_behind() {
        let (dir, _regular_file, target) = not_a_directory_path();
        let error = write_atomically(&target, b"data").expect_err("parent is a regular file");
        let message = error.to_string();
        assert!(
            message.starts_with(&format!("cannot write {}: ", target.display())),
            "{message}"
        );
        assert!(message.contains("Not a directory"), "{message}");
        assert!(!message.contains('\n'), "one line: {message}");
        assert_eq!(directory_entries(dir.path()), vec!["plain-file"]);
    }

    #[test]
    fn write_atomically_removes_temp_file_when_rename_fails() {
        let dir = tempfile::tempdir().expect("temp dir");
        // Renaming a file over a non-empty directory fails after the temp file was written.
        let target = dir.path().join("occupied");
        fs::create_dir(&target).expect("mkdir");
        fs::write(target.join("keep"), b"x").expect("write");
        let error = write_atomically(&target, b"data").expect_err("target is a directory");
        assert!(
            error.to_string().contains(&target.display().to_string()),
            "{error}"
        );
        assert_eq!(directory_entries(dir.path()), vec!["occupied"]);
    }

    #[test]
    fn directory_sink_names_files_by_service_and_start_second() {
        let dir = tempfile::tempdir().expect("temp dir");
        let sink_dir = dir.path().join("nested/profiles");
        let mut sink = DirectorySink::new(&sink_dir);
        let profile = test_fixture::profile();
        sink.write(&profile).expect("first profile");
        sink.write(&profile).expect("same service and second");

        let mut unnamed = profile.clone();
        unnamed.series_labels.clear();
        sink.write(&unnamed).expect("profile without service_name");

        assert_eq!(
            directory_entries(&sink_dir),
            vec![
                "my_app_v1-1700000000-1.pb.gz",
                "my_app_v1-1700000000.pb.gz",
                "unknown-1700000000.pb.gz",
            ]
        );
        let written = fs::read(sink_dir.join("my_app_v1-1700000000.pb.gz")).expect("read");
        assert_eq!(written, pprof::encode_pprof_gz(&profile));
    }

    #[test]
    fn directory_sink_reports_uncreatable_directory() {
        let (_dir, regular_file, _target) = not_a_directory_path();
        let sink_dir = regular_file.join("profiles");
        let error = DirectorySink::new(&sink_dir)
            .write(&test_fixture::profile())
            .expect_err("parent is a regular file");
        assert!(
            error
                .to_string()
                .starts_with(&format!("cannot create directory {}: ", sink_dir.display())),
            "{error}"
        );
    }

    #[test]
    fn file_name_part_is_sanitized() {
        assert_eq!(
            sanitize_file_name_part("api-server_v1.2"),
            "api-server_v1.2"
        );
        assert_eq!(
            sanitize_file_name_part("../etc/pässwd x"),
            ".._etc_p_sswd_x"
        );
        assert_eq!(sanitize_file_name_part(""), "unknown");
    }
}
