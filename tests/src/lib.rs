//! Harness for the end-to-end tests: builds fixture programs, runs them and the real
//! `profiler` binary (which loads the real BPF program, so these tests need root), and parses
//! what it writes.
use std::{
    collections::HashMap,
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{Mutex, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

pub use profiler::wire::proto;

pub mod server_harness;

use server_harness::LoggedChild;

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

/// `target/fixtures`, where fixture programs are built.
pub fn fixture_dir() -> PathBuf {
    let dir = workspace_root().join("target").join("fixtures");
    std::fs::create_dir_all(&dir).expect("create target/fixtures");
    dir
}

/// `tests/fixtures/<name>`: a fixture source or script.
pub fn fixture_source(name: &str) -> PathBuf {
    workspace_root().join("tests").join("fixtures").join(name)
}

/// Produces `target/fixtures/<name>` with `make` once per test process (later calls return the
/// cached path). `make` gets the output path and must leave the file there.
pub fn cached_fixture(name: &str, make: impl FnOnce(&Path)) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut built = built.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let out = fixture_dir().join(name);
    make(&out);
    assert!(
        out.exists(),
        "building fixture {name} left no {}",
        out.display()
    );
    built.insert(name.to_string(), out.clone());
    out
}

/// Runs a build command; fails the test with its output when it fails.
fn run_build(mut cmd: Command) {
    let output = cmd
        .output()
        .unwrap_or_else(|err| panic!("cannot run {cmd:?}: {err}"));
    assert!(
        output.status.success(),
        "{cmd:?} failed with {}:\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Builds `target/fixtures/<name>` as `compiler FLAGS -o OUT SOURCES TRAILING` (sources relative
/// to `tests/fixtures`; libraries go in `trailing` so that they follow the objects that need
/// them), once per test process. Works for gcc, g++ and rustc.
pub fn build_fixture(
    name: &str,
    compiler: &str,
    flags: &[&str],
    sources: &[&str],
    trailing: &[&str],
) -> PathBuf {
    cached_fixture(name, |out| {
        let mut cmd = Command::new(compiler);
        cmd.args(flags).arg("-o").arg(out);
        for source in sources {
            cmd.arg(fixture_source(source));
        }
        cmd.args(trailing);
        run_build(cmd);
    })
}

/// Compiles `tests/fixtures/<source>` with `compiler` and `flags` into `target/fixtures/<name>`
/// (once per test process).
pub fn build_c_fixture(source: &str, name: &str, compiler: &str, flags: &[&str]) -> PathBuf {
    build_fixture(name, compiler, flags, &[source], &[])
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
            "-fno-optimize-sibling-calls",
        ],
    )
}

/// Compiler flags of the fixtures without frame pointers: only `.eh_frame` describes their
/// frames (`-g` only adds symbols and lines; it does not change the code).
pub const NOFP_FLAGS: &[&str] = &["-O2", "-g", "-fomit-frame-pointer"];

/// `tests/fixtures/<source>` built with gcc `-O2 -fomit-frame-pointer` into
/// `target/fixtures/<stem>-nofp`.
pub fn nofp_fixture(source: &str) -> PathBuf {
    let name = source.trim_end_matches(".c").to_string() + "-nofp";
    build_c_fixture(source, &name, "gcc", NOFP_FLAGS)
}

/// `tests/fixtures/<stem>.c` built without frame pointers as the shared library
/// `target/fixtures/<stem>.so` (`-fPIC -shared`).
pub fn nofp_shared_library(source: &str) -> PathBuf {
    let name = source.trim_end_matches(".c").to_string() + ".so";
    let flags: Vec<&str> = NOFP_FLAGS
        .iter()
        .copied()
        .chain(["-fPIC", "-shared"])
        .collect();
    build_c_fixture(source, &name, "gcc", &flags)
}

/// A copy of `binary` named `name` with `strip --strip-all` applied (no `.symtab`, no debug
/// info; `.dynsym` and `.eh_frame` stay).
pub fn stripped_copy(binary: &Path, name: &str) -> PathBuf {
    cached_fixture(name, |out| {
        let mut cmd = Command::new("strip");
        cmd.arg("--strip-all").arg("-o").arg(out).arg(binary);
        run_build(cmd);
    })
}

/// A running fixture process, killed when dropped.
pub struct Running {
    pub child: Child,
}

impl Running {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit; returns its status and the CPU time it got (all
    /// threads; read every 20 ms until it exits, so at most that much short).
    pub fn wait_measuring_cpu(&mut self) -> (ExitStatus, Duration) {
        let pid = self.pid();
        let mut cpu = Duration::ZERO;
        loop {
            if let Some(now) = cpu_time_so_far(pid) {
                cpu = cpu.max(now);
            }
            if let Some(status) = self.child.try_wait().expect("wait for the fixture") {
                return (status, cpu);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// How long a fixture may take to say "ready". Generous: under CPU contention the
/// free-threaded 3.13t spins on `sched_yield` at start-up (1,800 calls for `-c pass`), which
/// took 32-44 s to import asyncio at load average 8 on 2 CPUs (0.2 s on a quiet machine).
pub const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// Waits until `child`, started with a piped stdout, prints a line `ready` (its start-up is
/// over). Its later lines come through the receiver returned, which the caller may drop: they
/// are read either way, so the child never blocks on a full pipe.
pub fn await_ready(
    child: &mut Child,
    timeout: Duration,
) -> Result<std::sync::mpsc::Receiver<String>, String> {
    let stdout = child
        .stdout
        .take()
        .ok_or("the fixture's stdout is not piped")?;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (line_tx, line_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut ready = false;
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            if ready {
                let _ = line_tx.send(line);
            } else if line == "ready" {
                ready = true;
                let _ = ready_tx.send(());
            }
        }
    });
    ready_rx
        .recv_timeout(timeout)
        .map_err(|_| format!("the fixture (pid {}) never printed ready", child.id()))?;
    Ok(line_rx)
}

/// The sampling rate for tests that judge stack shapes, not the rate: 97 Hz, not the default
/// 100 Hz. A 10 ms period is in step with the 250 Hz scheduler tick (every 2.5 ticks), and
/// under CPU contention that locks the samples to whichever task runs at that phase of the
/// tick: at load average 8 on 2 CPUs, `perf record -a -F 100` (the same per-CPU cpu-clock
/// timer the agent uses) gave a busy Python process 0.18-1.15 samples per 10 ms of its CPU
/// time from one 4 s window to the next; at 97 Hz 0.69-0.78 (2026-12-07; docs/architecture.md,
/// "Counts under CPU contention").
pub const SHAPE_SAMPLING_HZ: &str = "97";

/// How many samples a test needs before it judges stack shapes: `wanted`, or fewer when the
/// fixture got less CPU time than that takes (a busy machine), but never under 10. `share` is
/// the part of `cpu` the samples cover (a recording window shorter than the measurement).
pub fn sample_floor(wanted: i64, cpu: Duration, share: f64) -> i64 {
    let at_100_hz = cpu.as_secs_f64() * 100.0 * share;
    wanted.min(at_100_hz as i64).max(wanted.min(10))
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

/// Like [`spawn`], with extra environment variables.
pub fn spawn_with_env(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Running {
    let child = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot start {}: {err}", program.display()));
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
    /// The source file of each function in `functions` (empty when unknown).
    pub files: Vec<String>,
    pub values: Vec<i64>,
    pub str_labels: HashMap<String, String>,
    pub num_labels: HashMap<String, i64>,
    /// How many user-space locations (unwound frames, not counting inlined functions) the
    /// stack has.
    pub user_frames: usize,
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
            let mut files = Vec::new();
            let mut user_frames = 0;
            for id in &s.location_id {
                let location = locations.get(id).expect("location exists");
                if location.address != 0 && location.address < KERNEL_START {
                    user_frames += 1;
                }
                for line in &location.line {
                    let function = functions.get(&line.function_id).expect("function exists");
                    names.push(string(function.name));
                    files.push(string(function.filename));
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
                files,
                values: s.value.clone(),
                str_labels,
                num_labels,
                user_frames,
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

/// One pprof sample as the unwinding tests look at it.
#[derive(Clone, Debug)]
pub struct StackSample {
    /// Function names from the root (the synthetic process-name frame) to the leaf, inlined
    /// functions expanded.
    pub frames: Vec<String>,
    /// The source file of each frame (empty when unknown): Python frames name their `.py`.
    pub files: Vec<String>,
    /// How many user-space locations (unwound frames, not counting inlined functions) the
    /// stack has.
    pub user_frames: usize,
    pub count: i64,
    pub pid: Option<i64>,
}

/// Kernel addresses start here on x86_64; user addresses are below.
const KERNEL_START: u64 = 0xffff_8000_0000_0000;

pub fn stack_samples(profile: &proto::Profile) -> Vec<StackSample> {
    samples_counting_value(profile, 0)
}

/// Like [`stack_samples`], counting the values of sample type `sample_type` (a memory
/// profile's `inuse_space`, say) instead of the first.
pub fn stack_samples_of_type(profile: &proto::Profile, sample_type: &str) -> Vec<StackSample> {
    let index = profile
        .sample_type
        .iter()
        .position(|t| profile.string_table[t.r#type as usize] == sample_type)
        .unwrap_or_else(|| panic!("no sample type {sample_type}"));
    samples_counting_value(profile, index)
}

fn samples_counting_value(profile: &proto::Profile, index: usize) -> Vec<StackSample> {
    readable_samples(profile)
        .into_iter()
        .map(|s| StackSample {
            // pprof lists functions leaf first; these tests read stacks root first.
            frames: s.functions.into_iter().rev().collect(),
            files: s.files.into_iter().rev().collect(),
            user_frames: s.user_frames,
            count: s.values[index],
            pid: s.num_labels.get("pid").copied(),
        })
        .collect()
}

/// Sum of the counts of `samples`.
pub fn total_count<'a>(samples: impl IntoIterator<Item = &'a StackSample>) -> i64 {
    samples.into_iter().map(|s| s.count).sum()
}

/// `name×N` for runs of the same frame, so deep recursion stays readable.
pub fn collapse_repeats(frames: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < frames.len() {
        let run = frames[i..].iter().take_while(|f| **f == frames[i]).count();
        if run > 1 {
            parts.push(format!("{}×{run}", frames[i]));
        } else {
            parts.push(frames[i].clone());
        }
        i += run;
    }
    parts.join(";")
}

/// The `n` most frequent stacks, one folded line each (`root;...;leaf COUNT`, repeated frames
/// collapsed), for assertion messages.
pub fn top_stacks<'a>(samples: impl IntoIterator<Item = &'a StackSample>, n: usize) -> String {
    let mut counts: HashMap<String, i64> = HashMap::new();
    for sample in samples {
        *counts.entry(collapse_repeats(&sample.frames)).or_default() += sample.count;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut text = String::new();
    for (stack, count) in counts.iter().take(n) {
        text.push_str(&format!("  {stack} {count}\n"));
    }
    if counts.len() > n {
        text.push_str(&format!("  ... and {} more stacks\n", counts.len() - n));
    }
    if counts.is_empty() {
        text.push_str("  (no samples)\n");
    }
    text
}

/// Index of `chain` as a contiguous run inside `frames`, if present.
pub fn find_chain<S: AsRef<str>>(frames: &[String], chain: &[S]) -> Option<usize> {
    if chain.is_empty() || frames.len() < chain.len() {
        return None;
    }
    frames
        .windows(chain.len())
        .position(|w| w.iter().zip(chain).all(|(a, b)| a == b.as_ref()))
}

/// True when `PROFILER_REQUIRE_EXTERNAL=1` asks that tests needing
/// software outside the repository (pyenv interpreters) fail instead of skipping.
pub fn require_external() -> bool {
    std::env::var("PROFILER_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1")
}

/// A pprof file read by an independent reader (npm `pprof-format`, tests/js/check_pprof.mjs):
/// its JSON summary (sample types, period, totals, mappings, samples with their frames), or
/// `None` when node or the package is missing and [`require_external`] does not ask for them.
pub fn independent_pprof_summary(pprof: &[u8]) -> Option<serde_json::Value> {
    let js_dir = workspace_root().join("tests/js");
    if !js_dir.join("node_modules/pprof-format").is_dir() {
        assert!(
            !require_external(),
            "tests/js/node_modules/pprof-format is missing: run `cargo xtask test`"
        );
        eprintln!("skipped: the independent pprof reader (tests/js/node_modules missing)");
        return None;
    }
    let scratch = Scratch::new("pprof-reader");
    let file = scratch.path("profile.pb.gz");
    std::fs::write(&file, pprof).expect("write the pprof");
    let output = match Command::new("node")
        .arg(js_dir.join("check_pprof.mjs"))
        .arg(&file)
        .output()
    {
        Ok(output) => output,
        Err(err) if !require_external() => {
            eprintln!("skipped: the independent pprof reader (cannot run node: {err})");
            return None;
        }
        Err(err) => panic!("cannot run node: {err}; run `cargo xtask test`"),
    };
    assert!(
        output.status.success(),
        "check_pprof.mjs: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(serde_json::from_slice(&output.stdout).expect("check_pprof.mjs prints JSON"))
}

/// A pyenv interpreter, e.g. `pyenv_python("3.11.7", "python3.11")`: looked up under
/// `$PYENV_ROOT`, then `$HOME/.pyenv`.
pub fn pyenv_python(version: &str, executable: &str) -> Option<PathBuf> {
    let roots = [
        std::env::var_os("PYENV_ROOT").map(PathBuf::from),
        std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".pyenv")),
    ];
    roots
        .into_iter()
        .flatten()
        .map(|root| {
            root.join("versions")
                .join(version)
                .join("bin")
                .join(executable)
        })
        .find(|path| path.is_file())
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

/// Sends `signal` to `pid`.
pub fn send_signal(pid: u32, signal: i32) {
    let pid = i32::try_from(pid).expect("pid fits in i32");
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc_kill(pid, signal) };
}

pub const SIGTERM: i32 = 15;
pub const SIGINT: i32 = 2;

/// A running `profiler agent`, whose stderr is collected in the background. Killed when
/// dropped unless stopped.
pub struct Agent {
    process: LoggedChild,
}

impl Agent {
    /// Starts `profiler agent ARGS` and waits until its sampler is attached (it logs
    /// `sampler attached`). Unless `args` say otherwise the agent's HTTP server listens on a
    /// free loopback port and its store is off ([`agent_isolation_args`]).
    pub fn start(args: &[&str]) -> Agent {
        Agent::start_with_env(args, &[])
    }

    /// Like [`Agent::start`], with extra environment variables (they may override `RUST_LOG`).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Agent {
        Agent::start_through(&[], args, env)
    }

    /// Like [`Agent::start_with_env`], run through `wrapper` (e.g. `prlimit --nofile=…`).
    pub fn start_through(wrapper: &[&str], args: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut command = match wrapper.split_first() {
            Some((program, wrapper_args)) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(profiler_bin());
                command
            }
            None => Command::new(profiler_bin()),
        };
        command
            .arg("agent")
            .args(agent_isolation_args(args))
            .env("RUST_LOG", "info")
            .envs(env.iter().copied());
        for var in server_harness::SERVER_ENV {
            command.env_remove(var);
        }
        let mut process = LoggedChild::spawn(command);
        if let Err(log) = process.wait_for_line(Duration::from_secs(30), |line| {
            line.contains("sampler attached").then_some(())
        }) {
            panic!("profiler agent did not attach: {log}");
        }
        Agent { process }
    }

    /// The address the agent's HTTP server listens on (from its `listening on ADDR` line, logged
    /// before the sampler attaches).
    pub fn http_addr(&self) -> std::net::SocketAddr {
        let text = self.stderr();
        text.lines()
            .find_map(server_harness::parse_listening_line)
            .unwrap_or_else(|| panic!("the agent logged no `listening on ADDR`:\n{text}"))
    }

    /// The agent's stderr so far.
    pub fn stderr(&self) -> String {
        self.process.stderr()
    }

    /// Waits for a log line (so far or to come) containing `needle`; returns it.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        self.process
            .wait_for_line(timeout, |line| {
                line.contains(needle).then(|| line.to_string())
            })
            .unwrap_or_else(|log| panic!("the agent logged no {needle:?}: {log}"))
    }

    /// How many intervals the agent has flushed so far (its `interval` log lines).
    pub fn intervals_flushed(&self) -> usize {
        self.stderr()
            .lines()
            .filter(|line| line.contains("self_metrics") && line.contains(" interval "))
            .count()
    }

    /// Waits until the agent has flushed `n` intervals. At start the agent snapshots and
    /// symbolizes every process it sees, which can hold its pipeline back for seconds (and the
    /// late intervals are then flushed in a burst); after a few intervals it keeps up, and the
    /// start time of an interval's profile is close to when its samples were taken.
    pub fn wait_for_intervals(&mut self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.intervals_flushed() < n {
            if Instant::now() > deadline {
                let (status, stderr) = self.stop();
                panic!(
                    "the agent flushed fewer than {n} intervals in {timeout:?} ({status}):\n{stderr}"
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then waits for the agent to flush and exit; returns its status and stderr.
    pub fn stop(&mut self) -> (ExitStatus, String) {
        self.process.stop()
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// A `profiler` subcommand (`record`, or `agent` run like one) in the background with
/// `RUST_LOG=info`, its log collected. Stopped with SIGINT, it writes its output and exits 0.
/// Killed when dropped unless stopped.
pub struct Recording {
    process: LoggedChild,
}

impl Recording {
    pub fn spawn(subcommand: &str, args: &[&str], env: &[(&str, &str)]) -> Recording {
        let mut command = Command::new(profiler_bin());
        command
            .arg(subcommand)
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info");
        Recording {
            process: LoggedChild::spawn(command),
        }
    }

    /// `profiler record ARGS` without an end (it runs until stopped), once its sampler is
    /// attached.
    pub fn until_stopped(args: &[&str]) -> Recording {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--duration", "600"]);
        let mut recording = Recording::spawn("record", &all, &[]);
        recording.wait_for(&["sampler attached"], Duration::from_secs(60));
        recording
    }

    /// Waits for a log line (so far or to come) containing every one of `needles`; returns it.
    pub fn wait_for(&mut self, needles: &[&str], timeout: Duration) -> String {
        self.process
            .wait_for_line(timeout, |line| {
                needles
                    .iter()
                    .all(|needle| line.contains(needle))
                    .then(|| line.to_string())
            })
            .unwrap_or_else(|log| panic!("no log line with {needles:?}: {log}"))
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.process.stderr()
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// SIGINT, then waits for the output to be written; asserts a clean exit; returns the log.
    pub fn stop(mut self) -> String {
        let (status, log) = self.process.stop_with(SIGINT);
        assert!(status.success(), "profiler failed ({status}):\n{log}");
        log
    }

    /// Waits for the end of its `--duration`; asserts a clean exit; returns the log.
    pub fn wait(mut self) -> String {
        let (status, log) = self.process.wait();
        assert!(status.success(), "profiler failed ({status}):\n{log}");
        log
    }
}

/// `args` for `profiler agent`, plus `--listen 127.0.0.1:0` unless they give `--listen`, and
/// `--store off` unless they give `--store` or `--data-dir`: the agent's defaults
/// (127.0.0.1:4040, /var/lib/profiler) would collide between tests and with a user's agent.
pub fn agent_isolation_args(args: &[&str]) -> Vec<String> {
    let gives = |flag: &str| {
        args.iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
    };
    let mut out: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    if !gives("--listen") {
        out.extend(["--listen".into(), "127.0.0.1:0".into()]);
    }
    if !gives("--store") && !gives("--data-dir") {
        out.extend(["--store".into(), "off".into()]);
    }
    out
}

/// The agent's profiles of one service in `dir` (`<service>-<unix seconds>[-N].pb.gz`), decoded,
/// oldest first.
pub fn service_profiles(dir: &Path, service: &str) -> Vec<(PathBuf, proto::Profile)> {
    let prefix = format!("{service}-");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.expect("read_dir entry").path())
            .filter(|p| {
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                name.starts_with(&prefix) && name.ends_with(".pb.gz")
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    let mut profiles: Vec<_> = files
        .into_iter()
        .map(|path| {
            let profile = decode_pprof(&path);
            (path, profile)
        })
        .collect();
    profiles.sort_by_key(|(_, p)| p.time_nanos);
    profiles
}

/// Stand-in functions start with `push %rbp`, an instruction the kernel's uprobe code
/// emulates; anything else is single-stepped out of line at every hit.
pub const STANDIN_FLAGS: &[&str] = &[
    "-O2",
    "-g",
    "-fPIC",
    "-shared",
    "-fno-omit-frame-pointer",
    "-fcf-protection=none",
];

fn run_gpu_build(mut cmd: Command) {
    let output = cmd.output().expect("run build command");
    assert!(
        output.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `target/fixtures/gpu/` with the stand-in libcuda.so.1, libcudart.so.12, the C programs
/// `cuda_app` and `leader_exit` and the benchmark loop `launch_loop` (tests/fixtures/gpu).
pub fn gpu_standins() -> PathBuf {
    let dir = fixture_dir().join("gpu");
    cached_fixture("gpu/cuda_app", |app| {
        std::fs::create_dir_all(&dir).expect("mkdir");
        let version_script = dir.join("cudart.map");
        std::fs::write(&version_script, "libcudart.so.12 { global: *; };\n").expect("write");
        let driver_script = dir.join("cuda.map");
        std::fs::write(&driver_script, "libcuda.so.1 { global: *; };\n").expect("write");
        for (source, name, script) in [
            ("gpu/fake_cuda.c", "libcuda.so.1", &driver_script),
            ("gpu/fake_cudart.c", "libcudart.so.12", &version_script),
        ] {
            let mut cmd = Command::new("gcc");
            cmd.args(STANDIN_FLAGS)
                .arg(format!("-Wl,-soname,{name}"))
                .arg(format!("-Wl,--version-script={}", script.display()))
                // The runtime finds the driver next to itself, as with an installed toolkit.
                .arg("-Wl,-rpath,$ORIGIN")
                .arg("-o")
                .arg(dir.join(name))
                .arg(fixture_source(source))
                .arg("-ldl");
            run_gpu_build(cmd);
        }
        for (source, out) in [
            ("gpu/launch_loop.c", dir.join("launch_loop")),
            ("gpu/leader_exit.c", dir.join("leader_exit")),
            ("gpu/cuda_app.c", app.to_path_buf()),
        ] {
            let mut cmd = Command::new("gcc");
            cmd.args([
                "-O2",
                "-g",
                "-fno-omit-frame-pointer",
                "-fno-optimize-sibling-calls",
                "-fno-ipa-icf",
                "-fcf-protection=none",
                "-o",
            ])
            .arg(out)
            .arg(fixture_source(source))
            .arg(format!("-L{}", dir.display()))
            .args([
                "-l:libcudart.so.12",
                "-l:libcuda.so.1",
                "-lpthread",
                "-Wl,-rpath,$ORIGIN",
            ]);
            run_gpu_build(cmd);
        }
    });
    dir
}

/// How long [`cpu_got_while`] waits.
#[derive(Clone, Copy, Debug)]
pub enum Wait {
    /// This long.
    For(Duration),
    /// Until the processes got this much CPU time together, at most `at_most`: a quiet
    /// machine gives it in about as long, a busy one in several times that.
    ForCpu { wanted: Duration, at_most: Duration },
}

/// Waits as `wait` says (a recorder's sampler is attached meanwhile) and returns the CPU time
/// `pids` got together in that window: what a sample count is judged by, rather than the wall
/// time. Stops early when one of them ends, keeping what they got until then (an ended
/// process's threads' times are gone).
pub fn cpu_got_while(pids: &[u32], wait: Wait) -> Duration {
    let cpu = || -> Option<Duration> { pids.iter().map(|&p| cpu_time_so_far(p)).sum() };
    let (wanted, at_most) = match wait {
        Wait::For(duration) => (Duration::MAX, duration),
        Wait::ForCpu { wanted, at_most } => (wanted, at_most),
    };
    let started = Instant::now();
    let Some(before) = cpu() else {
        return Duration::ZERO;
    };
    let mut got = Duration::ZERO;
    while got < wanted && started.elapsed() < at_most {
        std::thread::sleep(
            Duration::from_millis(50).min(at_most.saturating_sub(started.elapsed())),
        );
        match cpu() {
            Some(now) if now >= before + got => got = now - before,
            _ => break,
        }
    }
    got
}

/// Total CPU time so far of all threads of `pid`, from `/proc/PID/task/*/schedstat` (ns
/// resolution; `/proc/PID/stat` only has 10 ms ticks). `None` when the process is gone.
pub fn cpu_time_so_far(pid: u32) -> Option<Duration> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total_ns: u64 = 0;
    for task in tasks.flatten() {
        let text = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total_ns += text
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(Duration::from_nanos(total_ns))
}
