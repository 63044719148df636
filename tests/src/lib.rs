//! Harness for the end-to-end tests: builds fixture programs, runs them and the real
//! `profiler` binary (which loads the real BPF program, so these tests need root), and parses
//! what it writes.
use std::{
    collections::HashMap,
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Mutex, MutexGuard, OnceLock},
    time::Duration,
};

pub use profiler::export::proto;

/// The repository root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The `profiler` binary built in the same profile as this test.
pub fn profiler_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> → target/<profile>/profiler
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps")
        .join("profiler");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build -p profiler-user`; `cargo xtask test` does this)",
        bin.display()
    );
    bin
}

/// BPF tests sample the whole machine; running them one at a time keeps the fixtures' CPU share
/// (and so their sample counts) predictable on a 2-core machine.
pub fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn fixture_dir() -> PathBuf {
    let dir = workspace_root().join("target").join("fixtures");
    std::fs::create_dir_all(&dir).expect("create target/fixtures");
    dir
}

/// Compiles `tests/fixtures/<source>` with `compiler` and `flags` into `target/fixtures/<name>`
/// (once per test process).
pub fn build_c_fixture(source: &str, name: &str, compiler: &str, flags: &[&str]) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut built = built.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let src = workspace_root().join("tests").join("fixtures").join(source);
    let out = fixture_dir().join(name);
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap_or_else(|err| panic!("cannot run {compiler}: {err}"));
    assert!(
        status.success(),
        "{compiler} {flags:?} {} failed",
        src.display()
    );
    built.insert(name.to_string(), out.clone());
    out
}

/// The frame-pointer fixtures: `-O2 -fno-omit-frame-pointer`, noinline functions.
pub fn fp_fixture(source: &str) -> PathBuf {
    let name = source.trim_end_matches(".c").to_string() + "-fp";
    build_c_fixture(
        source,
        &name,
        "gcc",
        &[
            "-O2",
            "-g",
            "-fno-omit-frame-pointer",
            "-mno-omit-leaf-frame-pointer",
            "-fno-optimize-sibling-calls",
        ],
    )
}

/// A running fixture process, killed when dropped.
pub struct Running {
    pub child: Child,
}

impl Running {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn spawn(program: &Path, args: &[&str]) -> Running {
    let child = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot start {}: {err}", program.display()));
    // Let it get past the dynamic loader so its mappings are in place.
    std::thread::sleep(Duration::from_millis(200));
    Running { child }
}

/// Runs `profiler` with `args`; returns its output.
pub fn run_profiler(args: &[&str]) -> Output {
    run_profiler_with_env(args, &[])
}

pub fn run_profiler_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(profiler_bin());
    cmd.args(args).env("RUST_LOG", "info");
    for var in [
        "PROFILER_FREQUENCY",
        "PROFILER_PID",
        "PROFILER_OUTPUT",
        "PROFILER_FORMAT",
        "PROFILER_DURATION",
    ] {
        cmd.env_remove(var);
    }
    for (key, value) in env {
        cmd.env(key, value);
    }
    cmd.output().expect("run profiler")
}

/// Fails with the profiler's stderr when it did not succeed.
pub fn assert_success(output: &Output) {
    assert!(
        output.status.success(),
        "profiler failed with {}:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A folded line: frames from root to leaf, and a count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoldedStack {
    pub frames: Vec<String>,
    pub count: u64,
}

pub fn parse_folded(text: &str) -> Vec<FoldedStack> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let (stack, count) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("folded line without count: {line:?}"));
            FoldedStack {
                frames: stack.split(';').map(str::to_string).collect(),
                count: count
                    .parse()
                    .unwrap_or_else(|_| panic!("bad count in {line:?}")),
            }
        })
        .collect()
}

/// Reads a gzipped pprof file.
pub fn decode_pprof(path: &Path) -> proto::Profile {
    use prost::Message;
    let bytes = std::fs::read(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&bytes[..])
        .read_to_end(&mut raw)
        .expect("pprof is gzipped");
    proto::Profile::decode(&raw[..]).expect("pprof decodes")
}

/// One pprof sample in readable form.
#[derive(Clone, Debug)]
pub struct ReadableSample {
    /// Function names, innermost first (inlined functions expanded innermost first).
    pub functions: Vec<String>,
    pub values: Vec<i64>,
    pub str_labels: HashMap<String, String>,
    pub num_labels: HashMap<String, i64>,
}

pub fn readable_samples(profile: &proto::Profile) -> Vec<ReadableSample> {
    let string = |i: i64| {
        profile
            .string_table
            .get(i as usize)
            .cloned()
            .unwrap_or_default()
    };
    let functions: HashMap<u64, &proto::Function> =
        profile.function.iter().map(|f| (f.id, f)).collect();
    let locations: HashMap<u64, &proto::Location> =
        profile.location.iter().map(|l| (l.id, l)).collect();
    profile
        .sample
        .iter()
        .map(|s| {
            let mut names = Vec::new();
            for id in &s.location_id {
                let location = locations.get(id).expect("location exists");
                for line in &location.line {
                    names.push(string(
                        functions
                            .get(&line.function_id)
                            .expect("function exists")
                            .name,
                    ));
                }
            }
            let mut str_labels = HashMap::new();
            let mut num_labels = HashMap::new();
            for label in &s.label {
                if label.str != 0 {
                    str_labels.insert(string(label.key), string(label.str));
                } else {
                    num_labels.insert(string(label.key), label.num);
                }
            }
            ReadableSample {
                functions: names,
                values: s.value.clone(),
                str_labels,
                num_labels,
            }
        })
        .collect()
}

/// A unique scratch directory under target/, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let dir = workspace_root().join("target").join("scratch").join(
            format!(
                "{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            )
            .replace(['(', ')'], ""),
        );
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
