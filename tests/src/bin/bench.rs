//! Benchmark harness (`cargo xtask bench [-- --suite ... --output FILE]`). Suites: `overhead`
//! (a busy workload on every CPU alone, under `profiler record` and under `perf record -F 100
//! -a -g`: BPF cost per sample, collector CPU and peak RSS, slowdown), and the unwinder's
//! `depth` (BPF cost and stack completeness at 10-128 frames without frame pointers), `tables`
//! (table build time and size) and `shared` (agent RSS and table sharing with 100 processes),
//! and `store` (the embedded store behind the HTTP server: ingest throughput, 24-hour merge
//! latency, bytes per service per day), `gpu` (CUDA probe cost), `off-cpu` (off-CPU profiling's
//! cost per context switch and on a switch-heavy program), and `host` (the whole-host agent on
//! a reproduced busy host: memory over time, CPU per sample, stack quality, service names).
//! It measures and reports; it asserts nothing about timing. See docs/benchmarks.md.
// A crate root resolves `mod` next to itself (src/bin/), so point into bench/.
#[path = "bench/gpu.rs"]
mod gpu;
#[path = "bench/host.rs"]
mod host;
#[path = "bench/host_profiles.rs"]
mod host_profiles;
#[path = "bench/host_report.rs"]
mod host_report;
#[path = "bench/host_workload.rs"]
mod host_workload;
#[path = "bench/off_cpu.rs"]
mod off_cpu;
#[path = "bench/parse.rs"]
mod parse;
#[path = "bench/procs.rs"]
mod procs;
#[path = "bench/python.rs"]
mod python;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/store.rs"]
mod store;
#[path = "bench/store_hostile.rs"]
mod store_hostile;
#[path = "bench/tables.rs"]
mod tables;
#[path = "bench/unwind.rs"]
mod unwind;

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use integration_tests::{Scratch, fp_fixture, workspace_root};

use parse::{AgentSummary, ProgStats};
use procs::{Finished, Proc, Usage};

const USAGE: &str = "\
usage: bench [--suite SUITES] [--seconds N] [--depth-seconds N] [--shared-seconds N]
             [--store-intervals N] [--host-seconds N] [--host-without PARTS]
             [--output FILE] [--no-build]

  --suite SUITES       comma-separated, any of: overhead, depth, tables, shared, python,
                       store, gpu, off-cpu, host, unwind (= depth,tables,shared), all
                       (default: all, which leaves out host)
  --seconds N          overhead suite: length of each scenario in seconds (default 20)
  --depth-seconds N    depth suite: recording per stack depth in seconds (default 8)
  --shared-seconds N   shared suite: recording per variant in seconds (default 10)
  --store-intervals N  store suite: 15 s intervals of 50 services to ingest (default 12)
  --host-seconds N     host suite: length of the run in seconds (default 300, at least 60)
  --host-without PARTS host suite: comma-separated parts to leave out, by name in lower case
                       with `-` between words (exec-storm, named-threads, parallel-build,
                       python-3-8-json, pytorch-inference, ...); the known-stack fixtures stay
  --output FILE        also write the markdown report to FILE
  --no-build           do not run `cargo build --release -p profiler-user` first

Needs root. Suites:
  overhead  workload alone, under `profiler record`, under `perf record -F 100 -a -g`, alone
            again (the repeat shows the run-to-run noise)
  depth     BPF cost per sample and stack completeness at 10, 30, 50 and 128 frames
            (a workload without frame pointers)
  tables    unwind-table build time and size for libc, libpython3.11, libstdc++ and the
            largest shared library on the machine
  shared    agent RSS and table sharing with 100 processes mapping 50 libraries, and with
            100 processes of one binary
  python    extra BPF cost per sample of 50 Python frames (walk on vs --no-python, uses the
            depth seconds), the agent's cost of reading a new code object, and the CPU
            time new Python processes run under load before they get Python frames
  store     the embedded store behind `profiler server` (no root needed): a day of one
            service's 2,000-stack profiles (bytes per service per day), its 24-hour merge
            (latency), 50 services' intervals through Connect Push (profiles per second)
  gpu       cost per probed CUDA call (stand-in runtime) and the slowdown of a loop making
            100,000 launches/s
  host      a busy host reproduced here (parallel build, exec storm, named threads, Python
            services, PyTorch, known-stack fixtures) under `profiler agent` with its defaults:
            agent RSS over time, CPU per sample, caches, stack quality, service names,
            fixture completeness (not in `all`: it takes --host-seconds and loads the machine)";

#[derive(Clone, Copy, Debug, Default)]
struct Suites {
    overhead: bool,
    depth: bool,
    tables: bool,
    shared: bool,
    python: bool,
    store: bool,
    gpu: bool,
    off_cpu: bool,
    host: bool,
}

impl Suites {
    fn parse(text: &str) -> Result<Suites> {
        let mut suites = Suites::default();
        for name in text.split(',').map(str::trim) {
            match name {
                "all" => {
                    suites = Suites {
                        overhead: true,
                        depth: true,
                        tables: true,
                        shared: true,
                        python: true,
                        store: true,
                        gpu: true,
                        off_cpu: true,
                        // Five minutes of a saturated machine: only when asked for.
                        host: false,
                    }
                }
                "overhead" => suites.overhead = true,
                "unwind" => {
                    suites.depth = true;
                    suites.tables = true;
                    suites.shared = true;
                }
                "depth" => suites.depth = true,
                "tables" => suites.tables = true,
                "shared" => suites.shared = true,
                "python" => suites.python = true,
                "store" => suites.store = true,
                "gpu" => suites.gpu = true,
                "off-cpu" => suites.off_cpu = true,
                "host" => suites.host = true,
                other => bail!(
                    "unknown suite {other:?}: use overhead, depth, tables, shared, python, store, gpu, off-cpu, host, unwind or all"
                ),
            }
        }
        Ok(suites)
    }

    /// Whether a suite needs the BPF program (root, the release profiler, the sysctl).
    fn needs_bpf(&self) -> bool {
        self.overhead
            || self.depth
            || self.shared
            || self.python
            || self.gpu
            || self.off_cpu
            || self.host
    }
}

struct Options {
    suites: Suites,
    seconds: u64,
    depth_seconds: u64,
    shared_seconds: u64,
    store_intervals: u64,
    host_seconds: u64,
    host_without: Vec<String>,
    output: Option<PathBuf>,
    build: bool,
}

/// A whole number of seconds from `min` to 3600.
fn parse_seconds(flag: &str, text: &str, min: u64) -> Result<u64> {
    match text.parse::<u64>() {
        Ok(n) if (min..=3600).contains(&n) => Ok(n),
        _ => bail!("{flag} must be a whole number from {min} to 3600, not {text:?}"),
    }
}

fn parse_args(args: &[String]) -> Result<Option<Options>> {
    let mut options = Options {
        suites: Suites::parse("all")?,
        seconds: 20,
        depth_seconds: 8,
        shared_seconds: 10,
        store_intervals: 12,
        host_seconds: host::DEFAULT_SECONDS,
        host_without: Vec::new(),
        output: None,
        build: true,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next().cloned())
                .with_context(|| format!("{flag} needs a value\n\n{USAGE}"))
        };
        match flag {
            // Below a few seconds the per-second BPF figures have too few points.
            "--seconds" => options.seconds = parse_seconds(flag, &value()?, 3)?,
            "--depth-seconds" => options.depth_seconds = parse_seconds(flag, &value()?, 3)?,
            "--shared-seconds" => options.shared_seconds = parse_seconds(flag, &value()?, 2)?,
            "--store-intervals" => options.store_intervals = parse_seconds(flag, &value()?, 1)?,
            "--host-seconds" => {
                options.host_seconds = parse_seconds(flag, &value()?, host::MIN_SECONDS)?
            }
            "--host-without" => {
                options.host_without = value()?
                    .split(',')
                    .map(host::part_key)
                    .filter(|key| !key.is_empty())
                    .collect()
            }
            "--suite" => options.suites = Suites::parse(&value()?)?,
            "--output" => options.output = Some(PathBuf::from(value()?)),
            "--no-build" => options.build = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => bail!("unknown argument {other:?}\n\n{USAGE}"),
        }
    }
    Ok(Some(options))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workload's throughput in one scenario.
#[derive(Clone, Copy, Debug)]
pub struct Throughput {
    pub workers: usize,
    pub units: u64,
    /// Sum over workers of units / that worker's own measured seconds.
    pub units_per_second: f64,
}

/// BPF program cost while the workload ran, from `/proc/PID/fdinfo` polled once a second.
#[derive(Clone, Debug, Default)]
pub struct BpfCost {
    /// One mean (ns per run) per one-second interval that lay inside the workload's run.
    pub per_second_ns: Vec<f64>,
    /// Total Δrun_time_ns / Δrun_cnt over those intervals.
    pub window_mean_ns: Option<f64>,
    /// Program runs in those intervals (≈ samples: the CPUs are busy, so few idle ticks).
    pub window_runs: u64,
}

/// What one collector (our profiler or perf) cost.
#[derive(Debug, Default)]
pub struct CollectorRun {
    pub usage: Usage,
    /// Samples the collector kept (ours: samples_processed; perf: its "( N samples)").
    pub samples: Option<u64>,
    pub bpf: Option<BpfCost>,
    /// Ours only: the final `recording finished` log line.
    pub agent: Option<AgentSummary>,
    /// Ours only: agent CPU per BPF run while the workload ran (startup and final write excluded).
    pub steady_cpu_per_run: Option<Duration>,
    /// ours: the agent's CPU in each one-second poll interval while the workload ran (ms).
    pub agent_cpu_per_second_ms: Vec<f64>,
    /// perf only: the event it sampled (from `perf evlist`).
    pub event: Option<String>,
}

pub enum Outcome {
    Ran(Throughput, Option<Box<CollectorRun>>),
    Skipped(String),
}

pub struct Results {
    pub seconds: u64,
    pub facts: report::Facts,
    pub baseline: Throughput,
    pub baseline_again: Throughput,
    pub ours: (Throughput, CollectorRun),
    pub perf: Outcome,
}

fn run(args: &[String]) -> Result<()> {
    let Some(options) = parse_args(args)? else {
        return Ok(());
    };
    let suites = options.suites;
    // SAFETY: geteuid has no preconditions.
    if suites.needs_bpf() && unsafe { libc::geteuid() } != 0 {
        bail!("the benchmark loads BPF programs and sets kernel.bpf_stats_enabled: run it as root");
    }
    procs::catch_sigint();
    let options_line = std::iter::once("bench".to_string())
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");

    let profiler = if suites.needs_bpf() || suites.store {
        Some(profiler_binary(options.build)?)
    } else {
        None
    };
    let perf = if suites.overhead { find_perf() } else { None };
    let facts = report::Facts::collect(perf.as_ref().map(|(_, version)| version.clone()));
    let scratch = Scratch::new("bench");

    // Restored when this guard drops, also on error or Ctrl-C.
    let _stats = if suites.needs_bpf() {
        Some(SysctlGuard::set("/proc/sys/kernel/bpf_stats_enabled", "1")?)
    } else {
        None
    };

    let mut markdown = report::render_header(&facts, &options_line);
    if let (true, Some(profiler)) = (suites.overhead, &profiler) {
        let results = run_overhead(&options, profiler, perf.as_ref(), &facts, &scratch)?;
        markdown.push_str(&report::render(&results));
        settle()?;
    }
    let mut depth_runs = Vec::new();
    if let (true, Some(profiler)) = (suites.depth, &profiler) {
        let workload = unwind::depth_workload()?;
        for (i, &frames) in unwind::DEPTHS.iter().enumerate() {
            eprintln!(
                "bench: [depth {}/{}] {frames}-frame stacks, {} workers, {} s",
                i + 1,
                unwind::DEPTHS.len(),
                facts.cpus,
                options.depth_seconds
            );
            depth_runs.push(unwind::run_depth(
                profiler,
                &workload,
                facts.cpus,
                frames,
                options.depth_seconds,
                &scratch,
            )?);
            settle()?;
        }
        markdown.push_str(&report::render_depth(&depth_runs, options.depth_seconds));
    }
    let mut shared_runs = Vec::new();
    if let (true, Some(profiler)) = (suites.shared, &profiler) {
        eprintln!(
            "bench: [shared] building the driver and {} libraries",
            unwind::SHARED_LIBRARIES
        );
        let fixtures = unwind::shared_fixtures()?;
        for (i, with_libraries) in [true, false].into_iter().enumerate() {
            eprintln!(
                "bench: [shared {}/2] {} driver processes{}, {} s",
                i + 1,
                unwind::SHARED_PROCESSES,
                if with_libraries {
                    " mapping 50 libraries"
                } else {
                    " of one binary"
                },
                options.shared_seconds
            );
            shared_runs.push(unwind::run_shared(
                profiler,
                &fixtures,
                with_libraries,
                options.shared_seconds,
                &scratch,
            )?);
            settle()?;
        }
        markdown.push_str(&report::render_shared(&shared_runs));
    }
    if let (true, Some(profiler)) = (suites.python, &profiler) {
        let interpreter = python::interpreter()?;
        let mut runs = Vec::new();
        let scenarios: Vec<(usize, bool)> = [
            (python::PYTHON_FRAMES, true),
            (python::PYTHON_FRAMES, false),
        ]
        .into_iter()
        .chain(python::DEEP_PYTHON_FRAMES.map(|frames| (frames, true)))
        .collect();
        let steps = scenarios.len() + 2;
        for (i, (frames, walk)) in scenarios.into_iter().enumerate() {
            eprintln!(
                "bench: [python {}/{steps}] {frames} Python frames, walk {}, {} workers, {} s",
                i + 1,
                if walk { "on" } else { "off" },
                facts.cpus,
                options.depth_seconds
            );
            runs.push(python::run_stack(
                profiler,
                &interpreter,
                facts.cpus,
                options.depth_seconds,
                frames,
                walk,
                &scratch,
            )?);
            settle()?;
        }
        eprintln!(
            "bench: [python {}/{steps}] reading new code objects",
            steps - 1
        );
        let code = python::run_code_objects(&interpreter)?;
        settle()?;
        eprintln!("bench: [python {steps}/{steps}] first samples of new processes under load");
        let first = python::run_first_samples(profiler, &interpreter, facts.cpus, &scratch)?;
        markdown.push_str(&python::render(
            &runs,
            Some(&code),
            Some(&first),
            options.depth_seconds,
        ));
    }
    if let (true, Some(profiler)) = (suites.store, &profiler) {
        let run = store::run(profiler, &scratch, options.store_intervals as usize)?;
        markdown.push_str(&store::render(&run));
        let hostile = store_hostile::run(profiler, &scratch)?;
        markdown.push_str(&store_hostile::render(&hostile));
    }
    if let (true, Some(profiler)) = (suites.gpu, &profiler) {
        let results = gpu::run(profiler, &scratch)?;
        markdown.push_str(&gpu::render(&results));
        settle()?;
    }
    if let (true, Some(profiler)) = (suites.off_cpu, &profiler) {
        let results = off_cpu::run(profiler, &scratch)?;
        markdown.push_str(&off_cpu::render(&results));
        settle()?;
    }
    if let (true, Some(profiler)) = (suites.host, &profiler) {
        eprintln!(
            "bench: [host] a busy host for {} s under `profiler agent`",
            options.host_seconds
        );
        let run = host::run(
            profiler,
            &scratch,
            options.host_seconds,
            &options.host_without,
        )?;
        markdown.push_str(&host_report::render(&run));
        settle()?;
    }
    let mut table_results = None;
    if suites.tables {
        eprintln!("bench: [tables] unwind-table build time and size");
        let result = tables::run()?;
        markdown.push_str(&report::render_tables(&result));
        table_results = Some(result);
    }
    markdown.push_str(&report::render_unwind_targets(
        &depth_runs,
        table_results.as_ref(),
        &shared_runs,
    ));

    println!("{markdown}");
    if let Some(path) = &options.output {
        std::fs::write(path, &markdown)
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("bench: report written to {}", path.display());
    }
    Ok(())
}

/// The CPU-overhead suite: baseline, profiler, perf, baseline again.
fn run_overhead(
    options: &Options,
    profiler: &Path,
    perf: Option<&(PathBuf, String)>,
    facts: &report::Facts,
    scratch: &Scratch,
) -> Result<Results> {
    let workload = build_workload()?;
    let seconds = options.seconds;
    eprintln!(
        "bench: [overhead] {} workers per scenario, {seconds} s each: baseline, profiler, perf, baseline again",
        facts.cpus
    );

    // Unmeasured warm-up: the first scenario should not pay for cold caches or CPU clock ramp-up.
    eprintln!("bench: warm-up (3 s, not measured)");
    finish_workers(start_workers(&workload, facts.cpus, 3)?)?;
    settle()?;

    eprintln!("bench: [overhead 1/4] baseline (workload alone)");
    let workers = start_workers(&workload, facts.cpus, seconds)?;
    let baseline = finish_workers(workers)?;
    settle()?;

    eprintln!("bench: [overhead 2/4] profiler record");
    let ours = run_ours(profiler, &workload, facts.cpus, seconds, scratch)?;
    settle()?;

    let perf = match perf {
        None => {
            eprintln!(
                "bench: [overhead 3/4] perf skipped: `perf` not found (Debian: apt-get install linux-perf; `cargo xtask setup` installs it)"
            );
            Outcome::Skipped("perf not found (install Debian's linux-perf)".into())
        }
        Some((perf, _)) => {
            eprintln!("bench: [overhead 3/4] perf record -F 100 -a -g");
            run_perf(perf, &workload, facts.cpus, seconds, scratch)?
        }
    };
    settle()?;

    // The same baseline again: how far two identical runs differ is the noise floor for the
    // slowdown column (large on shared VMs).
    eprintln!("bench: [overhead 4/4] baseline again (noise check)");
    let workers = start_workers(&workload, facts.cpus, seconds)?;
    let baseline_again = finish_workers(workers)?;

    Ok(Results {
        seconds,
        facts: facts.clone(),
        baseline,
        baseline_again,
        ours,
        perf,
    })
}

/// The release `profiler` next to this binary (both live in target/release). Building it here
/// (a no-op when up to date) rather than asking the user keeps `cargo xtask bench` one step and
/// guarantees the profiler matches the checked-out source.
fn profiler_binary(build: bool) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the bench binary's path")?;
    let dir = exe
        .parent()
        .context("the bench binary has no parent directory")?;
    if build {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        eprintln!("bench: cargo build --release -p profiler-user");
        let status = Command::new(&cargo)
            .args(["build", "--release", "-p", "profiler-user"])
            .current_dir(workspace_root())
            .status()
            .with_context(|| format!("cannot run {cargo:?}"))?;
        if !status.success() {
            bail!("`cargo build --release -p profiler-user` failed ({status})");
        }
    }
    let profiler = dir.join("profiler");
    if !profiler.exists() {
        bail!(
            "{} is missing: run `cargo build --release -p profiler-user` (or drop --no-build)",
            profiler.display()
        );
    }
    if dir.file_name().is_some_and(|name| name != "release") {
        eprintln!(
            "bench: warning: {} is not a release build; run through `cargo xtask bench`",
            profiler.display()
        );
    }
    Ok(profiler)
}

fn build_workload() -> Result<PathBuf> {
    // fp_fixture panics when the compiler is missing; say so plainly instead.
    let gcc = Command::new("gcc").arg("--version").output();
    if !gcc.is_ok_and(|out| out.status.success()) {
        bail!("gcc is needed to build the workload (apt-get install gcc)");
    }
    Ok(fp_fixture("bench_workload.c"))
}

/// `perf` and its version, if it runs.
fn find_perf() -> Option<(PathBuf, String)> {
    let candidates = [PathBuf::from("/usr/bin/perf"), PathBuf::from("perf")];
    candidates.into_iter().find_map(|perf| {
        let out = Command::new(&perf).arg("--version").output().ok()?;
        out.status.success().then(|| {
            (
                perf,
                String::from_utf8_lossy(&out.stdout).trim().to_string(),
            )
        })
    })
}

/// Sets a sysctl through /proc/sys and puts the old value back when dropped.
struct SysctlGuard {
    path: &'static str,
    old: String,
}

impl SysctlGuard {
    fn set(path: &'static str, value: &str) -> Result<SysctlGuard> {
        let old = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {path}"))?
            .trim()
            .to_string();
        std::fs::write(path, value).with_context(|| format!("cannot write {value} to {path}"))?;
        Ok(SysctlGuard { path, old })
    }
}

impl Drop for SysctlGuard {
    fn drop(&mut self) {
        if let Err(err) = std::fs::write(self.path, &self.old) {
            eprintln!(
                "bench: warning: cannot restore {} to {}: {err}",
                self.path, self.old
            );
        }
    }
}

/// A short pause between scenarios so one's tail (file writes, exits) does not overlap the next.
fn settle() -> Result<()> {
    procs::check_interrupted()?;
    std::thread::sleep(Duration::from_secs(2));
    procs::check_interrupted()
}

fn start_workers(workload: &Path, count: usize, seconds: u64) -> Result<Vec<Proc>> {
    (0..count)
        .map(|i| {
            let mut cmd = Command::new(workload);
            cmd.arg(seconds.to_string());
            Proc::spawn(cmd, &format!("workload worker {i}"))
        })
        .collect()
}

fn finish_workers(workers: Vec<Proc>) -> Result<Throughput> {
    let count = workers.len();
    let mut units = 0;
    let mut units_per_second = 0.0;
    for (i, worker) in workers.into_iter().enumerate() {
        let Finished { usage, stdout, .. } = worker.wait()?;
        let Some((n, secs)) = parse::parse_workload_output(&stdout) else {
            bail!(
                "workload worker {i} printed no `units=N seconds=S` line (success: {}): {stdout:?}",
                usage.success
            );
        };
        units += n;
        units_per_second += n as f64 / secs;
    }
    Ok(Throughput {
        workers: count,
        units,
        units_per_second,
    })
}

/// One poll of the profiler while it runs.
/// Polls at the start of the window left out of the steady-state agent CPU.
const WARM_UP_POLLS: usize = 2;

struct Poll {
    workers_running: bool,
    bpf: Option<ProgStats>,
    agent_cpu: Option<Duration>,
}

/// `BPF_PROG_TYPE_PERF_EVENT`: the sampler. The agent also holds a raw-tracepoint program
/// (`sched_process_exit`) whose cheap runs must not dilute the per-sample figures.
const PROG_TYPE_PERF_EVENT: u32 = 7;

/// Sums the run counters of the perf-event BPF programs `pid` holds an fd for (each program
/// once); of all its programs when it holds no perf-event program.
pub fn bpf_prog_stats(pid: u32) -> Option<ProgStats> {
    let entries = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?;
    let mut programs: Vec<ProgStats> = Vec::new();
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let Some(stats) = parse::parse_prog_fdinfo(&text) else {
            continue;
        };
        if stats.prog_id != 0 && programs.iter().any(|p| p.prog_id == stats.prog_id) {
            continue;
        }
        programs.push(stats);
    }
    if programs.is_empty() {
        return None;
    }
    let samplers = programs.iter().any(|p| p.prog_type == PROG_TYPE_PERF_EVENT);
    let mut total = ProgStats {
        prog_id: 0,
        prog_type: if samplers { PROG_TYPE_PERF_EVENT } else { 0 },
        run_time_ns: 0,
        run_cnt: 0,
    };
    for program in programs
        .iter()
        .filter(|p| !samplers || p.prog_type == PROG_TYPE_PERF_EVENT)
    {
        total.run_time_ns += program.run_time_ns;
        total.run_cnt += program.run_cnt;
    }
    Some(total)
}

/// Per-second and overall BPF cost from consecutive once-a-second polls.
pub fn bpf_cost(window: &[ProgStats]) -> BpfCost {
    let mut bpf = BpfCost::default();
    for pair in window.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let runs = b.run_cnt.saturating_sub(a.run_cnt);
        if runs > 0 {
            bpf.per_second_ns
                .push(b.run_time_ns.saturating_sub(a.run_time_ns) as f64 / runs as f64);
        }
    }
    if let (Some(first), Some(last)) = (window.first(), window.last()) {
        let runs = last.run_cnt.saturating_sub(first.run_cnt);
        if runs > 0 {
            bpf.window_runs = runs;
            bpf.window_mean_ns =
                Some(last.run_time_ns.saturating_sub(first.run_time_ns) as f64 / runs as f64);
        }
    }
    bpf
}

/// `profiler --log-format json record ...` with `RUST_LOG` as given and none of the bench's own
/// `PROFILER_*` environment variables (they must not change what is measured).
pub fn profiler_command(profiler: &Path, rust_log: &str) -> Command {
    let mut cmd = Command::new(profiler);
    cmd.args(["--log-format", "json", "record"])
        .env("RUST_LOG", rust_log);
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("PROFILER_") {
            cmd.env_remove(var);
        }
    }
    cmd
}

/// Polls the workers and the collector once a second until all have exited; `on_tick` sees
/// whether every worker was still running and the collector's pid while it runs.
fn supervise(
    workers: &mut [Proc],
    collector: &mut Proc,
    mut on_tick: impl FnMut(bool, Option<u32>),
) -> Result<()> {
    let start = Instant::now();
    let mut tick = 0u32;
    loop {
        procs::check_interrupted()?;
        let mut workers_running = true;
        for worker in workers.iter_mut() {
            if worker.poll()? {
                workers_running = false;
            }
        }
        let collector_running = !collector.poll()?;
        on_tick(workers_running, collector_running.then(|| collector.pid()));
        if !collector_running && workers.iter().all(Proc::is_done) {
            return Ok(());
        }
        // Fixed one-second grid from the start, so slow polls do not stretch the intervals.
        tick += 1;
        let next = start + Duration::from_secs(u64::from(tick));
        while Instant::now() < next {
            procs::check_interrupted()?;
            std::thread::sleep(
                next.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(50)),
            );
        }
    }
}

fn run_ours(
    profiler: &Path,
    workload: &Path,
    cpus: usize,
    seconds: u64,
    scratch: &Scratch,
) -> Result<(Throughput, CollectorRun)> {
    let mut workers = start_workers(workload, cpus, seconds)?;
    let mut cmd = profiler_command(profiler, "info");
    cmd.arg("--duration")
        .arg(seconds.to_string())
        .arg("--output")
        .arg(scratch.path("profile.pb.gz"));
    let mut profiler = Proc::spawn(cmd, "profiler record")?;
    let profiler_pid = profiler.pid();

    let mut polls = Vec::new();
    supervise(&mut workers, &mut profiler, |workers_running, pid| {
        polls.push(Poll {
            workers_running,
            bpf: pid.and_then(bpf_prog_stats),
            agent_cpu: pid.and_then(integration_tests::cpu_time_so_far),
        });
    })?;
    let throughput = finish_workers(workers)?;
    let finished = profiler.wait()?;
    if !finished.usage.success {
        bail!(
            "profiler record failed; its log:\n{}",
            tail(&finished.stderr, 20)
        );
    }
    let agent = parse::parse_agent_summary(&finished.stderr);
    if agent.is_none() {
        eprintln!("bench: warning: no `recording finished` line in the profiler's log");
    }

    // Only polls taken while every worker ran: after the workload ends the CPUs go idle and the
    // program's cheap idle-tick runs would pull the figures down.
    let window: Vec<(ProgStats, Option<Duration>)> = polls
        .iter()
        .filter(|p| p.workers_running)
        .filter_map(|p| Some((p.bpf?, p.agent_cpu)))
        .collect();
    let stats: Vec<ProgStats> = window.iter().map(|(stats, _)| *stats).collect();
    let bpf = bpf_cost(&stats);
    // The first seconds finish start-up (first symbols, kallsyms, first tables) and are not
    // the steady state; the whole run, start-up included, is reported separately.
    let steady: Vec<_> = window.iter().skip(WARM_UP_POLLS).collect();
    let mut steady_cpu_per_run = None;
    if let (Some(first), Some(last)) = (steady.first(), steady.last())
        && let (Some(a), Some(b)) = (first.1, last.1)
        && last.0.run_cnt > first.0.run_cnt
    {
        let runs = (last.0.run_cnt - first.0.run_cnt).min(u64::from(u32::MAX)) as u32;
        steady_cpu_per_run = Some(b.saturating_sub(a) / runs);
    }
    let agent_cpu_per_second_ms: Vec<f64> = window
        .windows(2)
        .filter_map(|pair| Some(pair[1].1?.saturating_sub(pair[0].1?).as_secs_f64() * 1e3))
        .collect();
    if bpf.per_second_ns.is_empty() {
        eprintln!(
            "bench: warning: no BPF run statistics in /proc/{}/fdinfo (kernel without run_time_ns/run_cnt?)",
            profiler_pid
        );
    }
    Ok((
        throughput,
        CollectorRun {
            usage: finished.usage,
            samples: agent.map(|a| a.samples_processed),
            bpf: Some(bpf),
            agent,
            steady_cpu_per_run,
            agent_cpu_per_second_ms,
            event: None,
        },
    ))
}

fn run_perf(
    perf: &Path,
    workload: &Path,
    cpus: usize,
    seconds: u64,
    scratch: &Scratch,
) -> Result<Outcome> {
    let data = scratch.path("perf.data");
    let mut workers = start_workers(workload, cpus, seconds)?;
    let mut cmd = Command::new(perf);
    cmd.args(["record", "-F", "100", "-a", "-g", "-o"])
        .arg(&data)
        .args(["--", "sleep"])
        .arg(seconds.to_string());
    let mut recorder = Proc::spawn(cmd, "perf record")?;
    supervise(&mut workers, &mut recorder, |_, _| {})?;
    let throughput = finish_workers(workers)?;
    let finished = recorder.wait()?;
    if !finished.usage.success {
        eprintln!(
            "bench: warning: perf record failed:\n{}",
            tail(&finished.stderr, 10)
        );
        return Ok(Outcome::Skipped(format!(
            "perf record failed: {}",
            tail(&finished.stderr, 1).trim()
        )));
    }
    let samples = parse::parse_perf_samples(&finished.stderr);
    if samples.is_none() {
        eprintln!("bench: warning: no `( N samples)` line in perf's output");
    }
    Ok(Outcome::Ran(
        throughput,
        Some(Box::new(CollectorRun {
            usage: finished.usage,
            samples,
            event: perf_event(perf, &data),
            ..CollectorRun::default()
        })),
    ))
}

/// The event perf sampled: `cycles` with a hardware PMU, else its `cpu-clock` fallback.
fn perf_event(perf: &Path, data: &Path) -> Option<String> {
    let out = Command::new(perf)
        .args(["evlist", "-i"])
        .arg(data)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let events: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    (out.status.success() && !events.is_empty()).then(|| events.join(", "))
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
