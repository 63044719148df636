//! The markdown report: machine facts, the results table, details and the targets.
use std::{fmt::Write, time::Duration};

use integration_tests::workspace_root;

use crate::{
    CollectorRun, Outcome, Results, Throughput,
    parse::{self, AgentSummary},
    tables::TablesResult,
    unwind::{DepthRun, SharedRun},
};

/// Targets from the issue (development machine).
const TARGET_BPF_NS: f64 = 5_000.0;
const TARGET_AGENT_US: f64 = 20.0;
/// "64 MB", read as MiB like the table's column.
const TARGET_RSS_MIB: f64 = 64.0;

#[derive(Clone, Debug)]
pub struct Facts {
    pub cpus: usize,
    pub kernel: String,
    pub cpu_model: String,
    pub perf_version: Option<String>,
    pub date: String,
    pub commit: String,
}

impl Facts {
    pub fn collect(perf_version: Option<String>) -> Facts {
        // SAFETY: sysconf has no preconditions.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let cpus = usize::try_from(online).ok().filter(|&n| n > 0).unwrap_or(1);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        Facts {
            cpus,
            kernel,
            cpu_model,
            perf_version,
            date: utc_now(),
            commit,
        }
    }
}

/// `YYYY-MM-DD HH:MM UTC` of now.
fn utc_now() -> String {
    let t = profiler::model::UtcTime::of(std::time::SystemTime::now());
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02} UTC",
        t.year, t.month, t.day, t.hour, t.minute
    )
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Collector CPU per kept sample, µs.
fn cpu_per_sample_us(run: &CollectorRun) -> Option<f64> {
    run.samples
        .filter(|&n| n > 0)
        .map(|n| us(run.usage.cpu) / n as f64)
}

fn opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "n/a".into(), |v| format!("{v:.decimals$}"))
}

fn mark(value: Option<f64>, target: f64) -> &'static str {
    match value {
        Some(v) if v <= target => "PASS",
        Some(_) => "MISS",
        None => "n/a (not measured)",
    }
}

fn row(out: &mut String, name: &str, baseline: &Throughput, t: &Throughput, run: &CollectorRun) {
    let slowdown = (1.0 - t.units_per_second / baseline.units_per_second) * 100.0;
    let bpf = match &run.bpf {
        Some(bpf) => format!(
            "{} / {} / {}",
            opt(parse::median(&bpf.per_second_ns), 0),
            opt(parse::quantile(&bpf.per_second_ns, 0.9), 0),
            opt(bpf.window_mean_ns, 0)
        ),
        None => "n/a".into(),
    };
    let _ = writeln!(
        out,
        "| {name} | {:.0} | {slowdown:+.2} % | {} | {bpf} | {} | {:.1} |",
        t.units_per_second,
        run.samples.map_or_else(|| "n/a".into(), |n| n.to_string()),
        opt(cpu_per_sample_us(run), 1),
        mib(run.usage.max_rss_bytes),
    );
}

/// The report's heading and the facts about this run.
pub fn render_header(f: &Facts, options_line: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## Benchmark results\n");
    let _ = writeln!(
        out,
        "- date: {}; commit {}; harness: `{}`",
        f.date, f.commit, options_line
    );
    let _ = writeln!(
        out,
        "- machine: {} online CPUs, {}, kernel {}",
        f.cpus, f.cpu_model, f.kernel
    );
    out
}

/// The CPU-overhead suite: workload alone, under the profiler, under perf.
pub fn render(r: &Results) -> String {
    let mut out = String::new();
    let f = &r.facts;
    let _ = writeln!(out, "\n### CPU overhead\n");
    let _ = writeln!(
        out,
        "- perf: {}",
        f.perf_version.as_deref().unwrap_or("not found")
    );
    let _ = writeln!(
        out,
        "- each scenario: {} workload processes (one per CPU) for {} s; profiler and perf at 100 Hz per CPU\n",
        r.baseline.workers, r.seconds
    );

    let _ = writeln!(
        out,
        "| scenario | workload units/s | slowdown | samples | BPF ns/sample median / p90 / mean | collector CPU µs/sample | collector peak RSS MiB |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(
        out,
        "| baseline | {:.0} | — | — | — | — | — |",
        r.baseline.units_per_second
    );
    let (ours_t, ours) = &r.ours;
    row(&mut out, "profiler", &r.baseline, ours_t, ours);
    match &r.perf {
        Outcome::Ran(t, Some(run)) => row(&mut out, "perf", &r.baseline, t, run),
        Outcome::Ran(t, None) => {
            let _ = writeln!(
                out,
                "| perf | {:.0} | | n/a | n/a | n/a | n/a |",
                t.units_per_second
            );
        }
        Outcome::Skipped(why) => {
            let _ = writeln!(out, "| perf | skipped: {why} | | | | | |");
        }
    }
    let _ = writeln!(
        out,
        "| baseline again | {:.0} | {:+.2} % | — | — | — | — |",
        r.baseline_again.units_per_second,
        (1.0 - r.baseline_again.units_per_second / r.baseline.units_per_second) * 100.0
    );

    let _ = writeln!(out, "\n#### Details\n");
    let _ = writeln!(
        out,
        "- workload units completed: baseline {}, profiler {}{}, baseline again {}",
        r.baseline.units,
        ours_t.units,
        match &r.perf {
            Outcome::Ran(t, _) => format!(", perf {}", t.units),
            Outcome::Skipped(_) => String::new(),
        },
        r.baseline_again.units
    );
    let _ = writeln!(
        out,
        "- slowdown is relative to the first baseline; the second baseline's difference from it is run-to-run noise, and a slowdown within that noise means nothing"
    );
    if let Some(bpf) = &ours.bpf {
        let _ = writeln!(
            out,
            "- profiler BPF program: {} one-second intervals while the workload ran, {} runs; per-interval means min {} / max {} ns",
            bpf.per_second_ns.len(),
            bpf.window_runs,
            opt(parse::quantile(&bpf.per_second_ns, 0.0), 0),
            opt(parse::quantile(&bpf.per_second_ns, 1.0), 0),
        );
    }
    if let Some(agent) = &ours.agent {
        let whole = (agent.bpf_run_count > 0)
            .then(|| agent.bpf_run_time_ns as f64 / agent.bpf_run_count as f64);
        let _ = writeln!(
            out,
            "- cross-check, agent's final log line: bpf_run_time_ns / bpf_run_count = {} / {} = {} ns per run over the whole recording (including idle ticks after the workload ended)",
            agent.bpf_run_time_ns,
            agent.bpf_run_count,
            opt(whole, 0)
        );
        let _ = writeln!(
            out,
            "- profiler samples: seen {}, processed {}, dropped {}",
            agent.samples_seen, agent.samples_processed, agent.samples_dropped
        );
    }
    // µs per sample is numerically ms per 1000 samples.
    let per_1000 = cpu_per_sample_us(ours);
    let _ = writeln!(
        out,
        "- profiler CPU (wait4 rusage, user+sys, whole run incl. BPF load and the final symbolize+write): {:.1} ms = {} ms per 1000 samples; self-reported agent_cpu_us {}",
        us(ours.usage.cpu) / 1000.0,
        opt(per_1000, 2),
        ours.agent
            .map_or_else(|| "n/a".into(), |a| a.agent_cpu_us.to_string()),
    );
    let _ = writeln!(
        out,
        "- profiler CPU in steady state (/proc/PID/task/*/schedstat between the polls while the workload ran, leaving out the first 2 s of the window, per BPF run): {} µs; per one-second interval (ms): {}",
        opt(ours.steady_cpu_per_run.map(us), 1),
        ours.agent_cpu_per_second_ms
            .iter()
            .map(|ms| format!("{ms:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let _ = writeln!(
        out,
        "- profiler peak RSS: {:.1} MiB (ru_maxrss); self-reported peak_rss_bytes {}",
        mib(ours.usage.max_rss_bytes),
        ours.agent.map_or_else(
            || "n/a".into(),
            |a| format!("{} ({:.1} MiB)", a.peak_rss_bytes, mib(a.peak_rss_bytes))
        ),
    );
    if let Outcome::Ran(_, Some(perf)) = &r.perf {
        let _ = writeln!(
            out,
            "- perf CPU (wait4 rusage): {:.1} ms = {} ms per 1000 samples; event {}. perf does no symbolization during record (it stores raw addresses and resolves them in `perf report`), so its figures are not like-for-like with the profiler's.",
            us(perf.usage.cpu) / 1000.0,
            opt(cpu_per_sample_us(perf), 2),
            perf.event.as_deref().unwrap_or("unknown"),
        );
    }
    let _ = writeln!(
        out,
        "- neither collector's rusage includes the in-kernel sampling work (BPF program, perf's stack copy): it runs in interrupt context, is charged to the interrupted task and shows up as workload slowdown."
    );

    let _ = writeln!(out, "\n#### Targets\n");
    let bpf_median = ours
        .bpf
        .as_ref()
        .and_then(|b| parse::median(&b.per_second_ns));
    let agent_us = cpu_per_sample_us(ours);
    let steady_us = ours.steady_cpu_per_run.map(us);
    let rss = Some(mib(ours.usage.max_rss_bytes)).filter(|&m| m > 0.0);
    let _ = writeln!(
        out,
        "- BPF ≤ 5 µs per sample (median): {} ns → {}",
        opt(bpf_median, 0),
        mark(bpf_median, TARGET_BPF_NS)
    );
    // A continuous agent pays start-up (BPF verification, first tables and symbols) once per
    // boot of the agent, so the per-sample target is judged on the steady state; the whole
    // run, start-up included, is shown beside it.
    let _ = writeln!(
        out,
        "- agent ≤ 20 µs CPU per sample (steady state): {} µs → {} (whole {}-s run incl. start-up and the final write: {} µs)",
        opt(steady_us, 1),
        mark(steady_us, TARGET_AGENT_US),
        r.seconds,
        opt(agent_us, 1),
    );
    let _ = writeln!(
        out,
        "- peak RSS ≤ 64 MiB: {} MiB → {}",
        opt(rss, 1),
        mark(rss, TARGET_RSS_MIB)
    );
    out
}

/// Target from the issue: BPF ≤ 15 µs per sample at 30 frames.
const TARGET_DEPTH_BPF_NS: f64 = 15_000.0;
const TARGET_DEPTH_FRAMES: usize = 30;
/// Target from the issue: table build ≤ 0.5 s per million rows.
const TARGET_BUILD_S_PER_M_ROWS: f64 = 0.5;

fn percent(part: i64, whole: i64) -> String {
    if whole > 0 {
        format!("{:.1} %", part as f64 * 100.0 / whole as f64)
    } else {
        "n/a".into()
    }
}

fn counter_percent(part: u64, whole: u64) -> String {
    percent(
        i64::try_from(part).unwrap_or(i64::MAX),
        i64::try_from(whole).unwrap_or(i64::MAX),
    )
}

/// The agent's own peak RSS (`VmHWM`, from its final log line), MiB. `ru_maxrss` from `wait4`
/// is not used here: Linux carries the pre-exec memory of the forked child (a copy of the
/// bench's) into it, which after the table-build suite is larger than the agent.
fn agent_rss(agent: Option<&AgentSummary>) -> String {
    agent
        .filter(|a| a.peak_rss_bytes > 0)
        .map_or_else(|| "n/a".into(), |a| format!("{:.1}", mib(a.peak_rss_bytes)))
}

/// The depth scenario: BPF cost per sample and the stacks' completeness by stack depth.
pub fn render_depth(runs: &[DepthRun], seconds: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Unwinder: BPF cost by stack depth\n");
    let workers = runs.first().map_or(0, |r| r.workers);
    let _ = writeln!(
        out,
        "- workload: `bench_depth` built with `gcc -O2 -fomit-frame-pointer` (no frame pointers), {workers} workers (one per CPU) with the hot loop at the bottom of a recursion; `profiler record --pid <workers> --duration {seconds} --no-cache` at 100 Hz per CPU; stack frames = recursion + 5 (`depth_leaf`, `main`, `__libc_start_call_main`, `__libc_start_main`, `_start`)\n"
    );
    let _ = writeln!(
        out,
        "| stack frames | BPF ns/run median / mean | BPF ns per sent sample | BPF runs on workers | worker samples | user frames/sample mean (min–max) | complete stacks | BPF unwind_complete | agent peak RSS MiB |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for run in runs {
        let stacks = run.stacks.as_ref();
        let complete_bpf = run.counters.as_ref().map_or_else(
            || "n/a".into(),
            |c| counter_percent(c.bpf("unwind_complete"), c.bpf("samples_sent")),
        );
        let _ = writeln!(
            out,
            "| {} | {} / {} | {} | {} | {} | {} | {} | {} | {} |",
            run.frames,
            opt(parse::median(&run.bpf.per_second_ns), 0),
            opt(run.bpf.window_mean_ns, 0),
            opt(run.ns_per_sent_sample(), 0),
            run.counters.as_ref().map_or_else(
                || "n/a".into(),
                |c| counter_percent(c.bpf("samples_sent"), c.bpf("samples_seen"))
            ),
            stacks.map_or_else(|| "n/a".into(), |s| s.samples.to_string()),
            stacks.map_or_else(
                || "n/a".into(),
                |s| format!(
                    "{:.1} ({}–{})",
                    s.mean_user_frames, s.min_user_frames, s.max_user_frames
                )
            ),
            stacks.map_or_else(|| "n/a".into(), |s| percent(s.complete, s.samples)),
            complete_bpf,
            agent_rss(run.agent.as_ref()),
        );
    }
    let _ = writeln!(out, "\n#### Details\n");
    let _ = writeln!(
        out,
        "- BPF ns/run: Δrun_time_ns / Δrun_cnt of the perf-event program from `/proc/<agent>/fdinfo`, polled once a second while the workers ran (median of the per-second means, and the mean over the window). The program runs on every tick of every CPU; runs on other processes (`filtered` below) stop early and are cheap, so when other processes take CPU time these figures understate the cost of an unwound sample. BPF ns per sent sample: the agent's whole-recording `bpf_run_time_ns` divided by the samples BPF sent (the worker samples), charging the filtered runs to them: an upper bound."
    );
    let _ = writeln!(
        out,
        "- complete stacks: worker samples (from the pprof output) whose user stack is `_start` … `main` → `depth_recurse` × recursion → `depth_leaf` (innermost user frame) with no `[truncated]` marker. BPF unwind_complete: the BPF counter over the samples it sent (all pids in the filter, whole recording)."
    );
    for run in runs {
        let mut parts = vec![format!("recursion {}", run.recursion)];
        if let Some(c) = &run.counters {
            parts.push(format!(
                "BPF runs seen {} (idle {}, filtered {}), sent {}, unwind_complete {}, depth_limit {}, read_error {}, bad_frame {}, fp fallbacks no_mapping/no_table/no_cfi {}/{}/{}, unwind_frames/sent {}",
                c.bpf("samples_seen"),
                c.bpf("idle"),
                c.bpf("filtered"),
                c.bpf("samples_sent"),
                c.bpf("unwind_complete"),
                c.bpf("unwind_depth_limit"),
                c.bpf("unwind_read_error"),
                c.bpf("unwind_bad_frame"),
                c.bpf("unwind_fp_no_mapping"),
                c.bpf("unwind_fp_no_table"),
                c.bpf("unwind_fp_no_cfi"),
                opt(
                    (c.bpf("samples_sent") > 0)
                        .then(|| c.bpf("unwind_frames") as f64 / c.bpf("samples_sent") as f64),
                    1
                ),
            ));
        }
        if let Some(a) = &run.agent {
            let whole =
                (a.bpf_run_count > 0).then(|| a.bpf_run_time_ns as f64 / a.bpf_run_count as f64);
            parts.push(format!(
                "agent's own figure over the whole recording {} ns/run",
                opt(whole, 0)
            ));
        }
        if let Some(s) = &run.stacks {
            parts.push(format!(
                "samples in the hot loop {}",
                percent(s.in_hot_loop, s.samples)
            ));
            if let Some(top) = &s.top_incomplete {
                parts.push(format!("most frequent incomplete stack: `{top}`"));
            }
        }
        parts.push(format!(
            "agent CPU {:.2} s, ru_maxrss {:.1} MiB",
            run.usage.cpu.as_secs_f64(),
            mib(run.usage.max_rss_bytes)
        ));
        parts.push(format!(
            "per-second BPF means min {} / max {} ns",
            opt(parse::quantile(&run.bpf.per_second_ns, 0.0), 0),
            opt(parse::quantile(&run.bpf.per_second_ns, 1.0), 0)
        ));
        let _ = writeln!(out, "- {} frames: {}", run.frames, parts.join("; "));
    }
    out
}

/// The table-build scenario.
pub fn render_tables(t: &TablesResult) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Unwinder: table build and size\n");
    let _ = writeln!(
        out,
        "- `profiler::unwinding::tables::build_table` in the bench process (release build) on the file already read into memory; best of 3 (one build when it takes over 10 s). rows = `row_count()` (merged rows with the gap/end markers), BPF bytes = `memory_bytes()` (8 per row in the row array incl. page-start rows, 8 per page entry)"
    );
    let _ = writeln!(
        out,
        "- largest library: the biggest x86_64 ELF `ET_DYN` named `*.so*` under /usr/lib, /usr/lib/x86_64-linux-gnu, /usr/local/lib and the pyenv versions' lib directories ({} files looked at in {:.1} s{})\n",
        t.scan.files_seen,
        t.scan.elapsed.as_secs_f64(),
        if t.scan.truncated {
            ", scan stopped at its time limit"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "| library | file | file MiB | CFI | FDEs | rows | pages | BPF map KiB | build ms (best) | s per M rows | paging ms |"
    );
    let _ = writeln!(out, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for build in &t.builds {
        let file = build.path.display();
        let size = mib(build.file_bytes);
        match &build.outcome {
            Ok(f) => {
                let _ = writeln!(
                    out,
                    "| {} | `{file}` | {size:.1} | {:?} | {} | {} | {} | {:.0} | {} | {} | {:.1} |",
                    build.role,
                    f.source,
                    f.fdes,
                    f.rows,
                    f.pages,
                    f.memory_bytes as f64 / 1024.0,
                    opt(f.best().map(|d| d.as_secs_f64() * 1e3), 1),
                    opt(f.seconds_per_million_rows(), 3),
                    f.paging.as_secs_f64() * 1e3,
                );
            }
            Err(err) => {
                let _ = writeln!(
                    out,
                    "| {} | `{file}` | {size:.1} | failed: {err} | | | | | | | |",
                    build.role
                );
            }
        }
    }
    let _ = writeln!(out, "\n#### Details\n");
    for build in &t.builds {
        if let Ok(f) = &build.outcome {
            let times: Vec<String> = f
                .builds
                .iter()
                .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
                .collect();
            let _ = writeln!(
                out,
                "- {}: builds {} ms; {} FDE program rows before merging → {} rows",
                build.role,
                times.join(" / "),
                f.rows_before_merge,
                f.rows
            );
        }
    }
    out
}

/// The shared-table scenario.
pub fn render_shared(runs: &[SharedRun]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Unwinder: shared tables and agent memory\n");
    if let Some(first) = runs.first() {
        let _ = writeln!(
            out,
            "- {} driver processes built with `-O2 -fomit-frame-pointer`, each busy 1 ms every 100 ms; in the library variant process i dlopens the generated libraries libbench(i … i+4 mod 50) (`-fPIC -shared`, no frame pointers, one build id each), so each of the 50 libraries is mapped by 10 processes; `profiler record --duration {} --no-cache` system-wide with `RUST_LOG=profiler=debug`\n",
            first.processes, first.seconds
        );
    }
    let _ = writeln!(
        out,
        "| scenario | drivers sampled | complete driver stacks | processes registered | executable files: drivers / all sampled | tables loaded / evicted / resident | rows in use | mapping prefixes | agent peak RSS MiB | agent CPU s |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for run in runs {
        let table = |key: &str| run.counters.as_ref().and_then(|c| c.table(key));
        let show = |v: Option<u64>| v.map_or_else(|| "n/a".into(), |v| v.to_string());
        let resident = match (table("tables_loaded"), table("tables_evicted")) {
            (Some(l), Some(e)) => Some(l.saturating_sub(e)),
            _ => None,
        };
        let _ = writeln!(
            out,
            "| {} | {} of {} | {} | {} | {} / {} | {} / {} / {} | {} | {} | {} | {:.2} |",
            run.label,
            show(run.drivers_sampled.map(|n| n as u64)),
            run.processes,
            percent(run.driver_complete, run.driver_samples),
            show(table("processes_registered")),
            run.driver_files,
            show(run.sampled_files.map(|n| n as u64)),
            show(table("tables_loaded")),
            show(table("tables_evicted")),
            show(resident),
            show(table("rows_in_use")),
            show(table("mapping_prefixes")),
            agent_rss(run.agent.as_ref()),
            run.usage.cpu.as_secs_f64(),
        );
    }
    let _ = writeln!(out, "\n#### Details\n");
    let _ = writeln!(
        out,
        "- executable files: distinct (device, inode) of executable file mappings in /proc/PID/maps, plus the vDSO: of the 100 drivers (read before the recording), and of every process with samples in the profile (all processes' maps read once a second during the recording; the agent itself and other processes on the machine included). One table per file means resident tables (loaded − evicted) ≤ the latter. complete driver stacks: the drivers' samples in the profile whose user stack reaches `_start` without a `[truncated]` marker (a process's first sample is taken before its tables exist and may be cut short)."
    );
    let _ = writeln!(
        out,
        "- processes registered, tables, rows and prefixes: the agent's `NativeTableStats` in its final debug log line. rows in use counts whole 256-row chunks; mapping prefixes are the LPM-trie entries of all registered processes. agent peak RSS: the agent's own `VmHWM` (`peak_rss_bytes` of its final log line); `wait4`'s ru_maxrss (below) can be higher, as Linux carries the forked child's pre-exec size (a copy of the bench process) into it."
    );
    for run in runs {
        if let Some(c) = &run.counters {
            let _ = writeln!(
                out,
                "- {}: {}; samples processed {}; BPF unwind_complete {} of {} sent",
                run.label,
                c.tables
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                run.agent
                    .map_or_else(|| "n/a".into(), |a| a.samples_processed.to_string()),
                c.bpf("unwind_complete"),
                c.bpf("samples_sent"),
            );
        }
        let _ = writeln!(
            out,
            "- {}: {} generated libraries; {} processes in the profile; {} driver samples, {} complete; agent ru_maxrss {:.1} MiB",
            run.label,
            run.libraries,
            run.processes_sampled
                .map_or_else(|| "n/a".into(), |n| n.to_string()),
            run.driver_samples,
            run.driver_complete,
            mib(run.usage.max_rss_bytes),
        );
        for note in &run.notes {
            let _ = writeln!(out, "  - agent log: {note}");
        }
    }
    out
}

/// The unwinder milestone's targets, for whichever of its scenarios ran.
pub fn render_unwind_targets(
    depth: &[DepthRun],
    tables: Option<&TablesResult>,
    shared: &[SharedRun],
) -> String {
    let mut out = String::new();
    if depth.is_empty() && tables.is_none() && shared.is_empty() {
        return out;
    }
    let _ = writeln!(out, "\n### Unwinder targets\n");
    if let Some(run) = depth.iter().find(|r| r.frames == TARGET_DEPTH_FRAMES) {
        let median = parse::median(&run.bpf.per_second_ns);
        let upper = run.ns_per_sent_sample();
        let _ = writeln!(
            out,
            "- BPF ≤ 15 µs per sample at {TARGET_DEPTH_FRAMES} frames: median {} ns per run, upper bound {} ns per sent sample → {}",
            opt(median, 0),
            opt(upper, 0),
            mark(upper.or(median), TARGET_DEPTH_BPF_NS)
        );
    }
    if let Some(t) = tables {
        let built: Vec<&crate::tables::TableFigures> = t
            .builds
            .iter()
            .filter_map(|b| b.outcome.as_ref().ok())
            .collect();
        let rows: usize = built.iter().map(|f| f.rows).sum();
        let secs: f64 = built
            .iter()
            .filter_map(|f| f.best())
            .map(|d| d.as_secs_f64())
            .sum();
        let overall = (rows > 0).then(|| secs / (rows as f64 / 1e6));
        let worst = built
            .iter()
            .filter_map(|f| f.seconds_per_million_rows())
            .max_by(f64::total_cmp);
        let _ = writeln!(
            out,
            "- table build ≤ 0.5 s per million rows: {} s overall ({} rows in {:.3} s), worst library {} s → {}",
            opt(overall, 3),
            rows,
            secs,
            opt(worst, 3),
            mark(worst, TARGET_BUILD_S_PER_M_ROWS)
        );
    }
    for run in shared {
        let table = |key: &str| run.counters.as_ref().and_then(|c| c.table(key));
        let resident = match (table("tables_loaded"), table("tables_evicted")) {
            (Some(l), Some(e)) => Some(l.saturating_sub(e)),
            _ => None,
        };
        let verdict = match (resident, run.sampled_files) {
            (Some(resident), Some(files)) if resident <= files as u64 => "PASS",
            (Some(_), Some(_)) => "MISS",
            _ => "n/a (not measured)",
        };
        let _ = writeln!(
            out,
            "- shared tables, {}: {} tables resident ({} loaded, {} evicted) for {} distinct executable files of the sampled processes, {} processes registered → {verdict}",
            run.label,
            resident.map_or_else(|| "n/a".into(), |v| v.to_string()),
            table("tables_loaded").map_or_else(|| "n/a".into(), |v| v.to_string()),
            table("tables_evicted").map_or_else(|| "n/a".into(), |v| v.to_string()),
            run.sampled_files
                .map_or_else(|| "n/a".into(), |n| n.to_string()),
            table("processes_registered").map_or_else(|| "n/a".into(), |v| v.to_string()),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn date_format() {
        let date = super::utc_now();
        assert_eq!(date.len(), "2025-01-01 00:00 UTC".len(), "{date}");
        assert!(date.ends_with(" UTC"));
    }
}
