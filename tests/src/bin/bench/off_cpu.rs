//! The `off-cpu` suite: what off-CPU profiling costs per context switch, and what it does to a
//! switch-heavy program (tests/fixtures/pingpong.c: threads passing a byte over pipes).
//!
//! Each scenario runs the same ping-pong processes alone, under `profiler record` without
//! off-CPU profiling (the CPU sampler only), and with `--off-cpu` at the default probability
//! and at every switch. Switches per second are the machine's (`ctxt` of /proc/stat); the
//! off-CPU program's cost is the kernel's own accounting of it (`kernel.bpf_stats_enabled`).
use std::{
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use integration_tests::{Scratch, build_c_fixture};

/// A switch rate to measure at: ping-pong processes, rounds each, nanoseconds per round (0:
/// as fast as they go).
pub struct Scenario {
    pub name: &'static str,
    pub processes: usize,
    pub rounds: u64,
    pub pace_ns: u64,
}

pub const SCENARIOS: [Scenario; 3] = [
    Scenario {
        name: "about 50,000 switches/s (one pair, a round every 80 µs)",
        processes: 1,
        rounds: 50_000,
        pace_ns: 80_000,
    },
    Scenario {
        name: "about 200,000 switches/s (two pairs, a round every 20 µs each)",
        processes: 2,
        rounds: 200_000,
        pace_ns: 20_000,
    },
    Scenario {
        name: "as fast as it goes (two pairs)",
        processes: 2,
        rounds: 150_000,
        pace_ns: 0,
    },
];

/// The profiler settings compared.
pub const MODES: [(&str, &[&str]); 4] = [
    ("alone", &[]),
    ("CPU sampler only", &[]),
    ("--off-cpu (default probability 0.05)", &["--off-cpu"]),
    (
        "--off-cpu --off-cpu-probability 1",
        &["--off-cpu", "--off-cpu-probability", "1"],
    ),
];

#[derive(Clone, Debug, Default)]
pub struct Measurement {
    /// Wall time of the slowest ping-pong process, seconds.
    pub elapsed_s: f64,
    /// Context switches per second on the machine while they ran.
    pub switches_per_s: f64,
    /// The profiler's figures (none alone).
    pub agent_cpu_s: f64,
    pub recorded_s: f64,
    pub off_cpu_runs: u64,
    pub off_cpu_run_ns: u64,
    pub off_cpu_stacks: u64,
    pub off_cpu_blocks: u64,
    pub off_cpu_lost: u64,
}

pub struct OffCpuResults {
    /// By scenario, then by mode.
    pub runs: Vec<Vec<Measurement>>,
}

fn context_switches() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    stat.lines()
        .find_map(|line| line.strip_prefix("ctxt "))
        .and_then(|n| n.trim().parse().ok())
        .context("no ctxt line in /proc/stat")
}

/// Reads a JSON log's last line with `message`, as a map of its numeric fields.
fn log_fields(log: &str, message: &str) -> Option<serde_json::Map<String, serde_json::Value>> {
    log.lines().rev().find_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        let fields = value.get("fields")?.as_object()?;
        (fields.get("message")?.as_str()? == message).then(|| fields.clone())
    })
}

fn number(fields: Option<&serde_json::Map<String, serde_json::Value>>, key: &str) -> u64 {
    fields
        .and_then(|f| f.get(key))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// `profiler record` of `pids` with `extra`, once attached; its log is collected.
fn start_profiler(
    profiler: &Path,
    pids: &[u32],
    extra: &[&str],
    scratch: &Scratch,
) -> Result<(Child, Arc<Mutex<String>>)> {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let mut child = Command::new(profiler)
        .args(["--log-format", "json", "record", "--duration", "600"])
        .args(["--pid", &pids.join(",")])
        .arg("--output")
        .arg(scratch.path("off-cpu-bench.pb.gz"))
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start profiler record")?;
    let log = crate::procs::collect_stderr(&mut child)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !log.lock().unwrap().contains("sampler attached") {
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            let _ = child.kill();
            bail!("the profiler did not start:\n{}", log.lock().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((child, log))
}

fn measure(
    program: &Path,
    scenario: &Scenario,
    profiler: Option<(&Path, &[&str])>,
    scratch: &Scratch,
) -> Result<Measurement> {
    let mut workloads = Vec::new();
    for _ in 0..scenario.processes {
        workloads.push(
            Command::new(program)
                .args([scenario.rounds.to_string(), scenario.pace_ns.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .with_context(|| format!("cannot start {}", program.display()))?,
        );
    }
    let pids: Vec<u32> = workloads.iter().map(Child::id).collect();
    let recorder = match profiler {
        Some((profiler, extra)) => Some(start_profiler(profiler, &pids, extra, scratch)?),
        None => None,
    };
    let started = Instant::now();
    let switches_before = context_switches()?;
    for workload in &mut workloads {
        workload
            .stdin
            .as_mut()
            .context("stdin")?
            .write_all(b"go\n")?;
    }
    let mut elapsed_s: f64 = 0.0;
    for workload in &mut workloads {
        let mut line = String::new();
        BufReader::new(workload.stdout.as_mut().context("stdout")?).read_line(&mut line)?;
        workload.wait()?;
        let ns: u64 = line
            .trim()
            .strip_prefix("elapsed_ns=")
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("unexpected workload output {line:?}"))?;
        elapsed_s = elapsed_s.max(ns as f64 / 1e9);
    }
    let wall = started.elapsed().as_secs_f64();
    let switches = context_switches()? - switches_before;
    let mut measurement = Measurement {
        elapsed_s,
        switches_per_s: switches as f64 / wall,
        ..Measurement::default()
    };
    if let Some((mut child, log)) = recorder {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        child.wait()?;
        let log = log.lock().unwrap().clone();
        let summary = log_fields(&log, "recording finished");
        let off_cpu = log_fields(&log, "recording finished: off-CPU");
        measurement.agent_cpu_s = number(summary.as_ref(), "agent_cpu_us") as f64 / 1e6;
        measurement.recorded_s = wall;
        measurement.off_cpu_runs = number(off_cpu.as_ref(), "off_cpu_program_runs");
        measurement.off_cpu_run_ns = number(off_cpu.as_ref(), "off_cpu_program_run_time_ns");
        measurement.off_cpu_stacks = number(off_cpu.as_ref(), "off_cpu_stacks");
        measurement.off_cpu_blocks = number(off_cpu.as_ref(), "off_cpu_blocks");
        measurement.off_cpu_lost = number(off_cpu.as_ref(), "off_cpu_lost");
    }
    Ok(measurement)
}

pub fn run(profiler: &Path, scratch: &Scratch) -> Result<OffCpuResults> {
    let program = build_c_fixture("pingpong.c", "pingpong", "gcc", &["-O2", "-pthread"]);
    let mut runs = Vec::new();
    let steps = SCENARIOS.len() * MODES.len();
    for (s, scenario) in SCENARIOS.iter().enumerate() {
        let mut by_mode = Vec::new();
        for (m, (mode, extra)) in MODES.iter().enumerate() {
            eprintln!(
                "bench: [off-cpu {}/{steps}] {}, {mode}",
                s * MODES.len() + m + 1,
                scenario.name
            );
            let profiler = (m > 0).then_some((profiler, *extra));
            by_mode.push(measure(&program, scenario, profiler, scratch)?);
            std::thread::sleep(Duration::from_secs(1));
        }
        runs.push(by_mode);
    }
    Ok(OffCpuResults { runs })
}

pub fn render(results: &OffCpuResults) -> String {
    let mut out = String::from(
        "\n## Off-CPU: cost per context switch\n\n\
         tests/fixtures/pingpong.c: threads passing a byte over two pipes (every round, each \
         thread blocks once in `read`), recorded with `profiler record --pid` of the ping-pong \
         processes. Switches/s: the whole machine's (`ctxt` of /proc/stat) while they ran. The \
         off-CPU program runs on every switch of the machine (it leaves out other processes \
         after a map lookup); its cost per run is the kernel's accounting \
         (`kernel.bpf_stats_enabled`). Agent CPU: the recording's own CPU time over the run \
         (start-up excluded: the recording starts before the workload).\n",
    );
    for (scenario, by_mode) in SCENARIOS.iter().zip(&results.runs) {
        let alone = by_mode[0].elapsed_s;
        out.push_str(&format!(
            "\n### {}: {} × {} rounds\n\n\
             | profiler | elapsed | slowdown | switches/s | off-CPU program, ns per run (runs) | stacks taken | blocks counted | records lost | agent CPU, % of one CPU |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            scenario.name, scenario.processes, scenario.rounds
        ));
        for ((mode, _), m) in MODES.iter().zip(by_mode) {
            let per_run = if m.off_cpu_runs > 0 {
                format!(
                    "{:.0} ({})",
                    m.off_cpu_run_ns as f64 / m.off_cpu_runs as f64,
                    m.off_cpu_runs
                )
            } else {
                "–".into()
            };
            let cpu = if m.recorded_s > 0.0 {
                format!("{:.1} %", 100.0 * m.agent_cpu_s / m.recorded_s)
            } else {
                "–".into()
            };
            out.push_str(&format!(
                "| {mode} | {:.3} s | {:+.1} % | {:.0} | {per_run} | {} | {} | {} | {cpu} |\n",
                m.elapsed_s,
                (m.elapsed_s / alone - 1.0) * 100.0,
                m.switches_per_s,
                m.off_cpu_stacks,
                m.off_cpu_blocks,
                m.off_cpu_lost,
            ));
        }
    }
    out
}
