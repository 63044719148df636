//! The markdown report: machine facts, the results table, details and the targets.
use std::{fmt::Write, time::Duration};

use integration_tests::workspace_root;

use crate::{CollectorRun, Outcome, Results, Throughput, parse};

/// Targets from the issue (development machine).
const TARGET_BPF_NS: f64 = 5_000.0;
const TARGET_AGENT_US: f64 = 20.0;
/// "64 MB", read as MiB like the table's column.
const TARGET_RSS_MIB: f64 = 64.0;

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

/// `YYYY-MM-DD HH:MM UTC` without a date crate (civil-from-days, Howard Hinnant's algorithm).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
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

pub fn render(r: &Results) -> String {
    let mut out = String::new();
    let f = &r.facts;
    let _ = writeln!(out, "## Benchmark results\n");
    let _ = writeln!(
        out,
        "- date: {}; commit {}; harness: `{}`",
        f.date, f.commit, r.options_line
    );
    let _ = writeln!(
        out,
        "- machine: {} online CPUs, {}, kernel {}",
        f.cpus, f.cpu_model, f.kernel
    );
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

    let _ = writeln!(out, "\n### Details\n");
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
        "- profiler CPU in steady state (/proc/PID/task/*/schedstat between the polls while the workload ran, per BPF run): {} µs",
        opt(ours.steady_cpu_per_run.map(us), 1)
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

    let _ = writeln!(out, "\n### Targets\n");
    let bpf_median = ours
        .bpf
        .as_ref()
        .and_then(|b| parse::median(&b.per_second_ns));
    let agent_us = cpu_per_sample_us(ours);
    let rss = Some(mib(ours.usage.max_rss_bytes)).filter(|&m| m > 0.0);
    let _ = writeln!(
        out,
        "- BPF ≤ 5 µs per sample (median): {} ns → {}",
        opt(bpf_median, 0),
        mark(bpf_median, TARGET_BPF_NS)
    );
    let _ = writeln!(
        out,
        "- agent ≤ 20 µs CPU per sample (whole run): {} µs → {}",
        opt(agent_us, 1),
        mark(agent_us, TARGET_AGENT_US)
    );
    let _ = writeln!(
        out,
        "- peak RSS ≤ 64 MiB: {} MiB → {}",
        opt(rss, 1),
        mark(rss, TARGET_RSS_MIB)
    );
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
