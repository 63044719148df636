//! The `host` suite's section of the markdown report: targets, the agent's memory and CPU,
//! a timeline, caches, stack quality, service names and fixture completeness.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use crate::{
    host::{AGENT_RUST_LOG, HostRun, POLL_S, Poll, warm_up_s},
    host_profiles::{ProfileAnalysis, ServiceStats},
    host_workload::{self, progress_value},
    parse::{median, quantile},
};

const TARGET_RSS_GROWTH_PCT: f64 = 5.0;
/// "128 MB", read as MiB like the other suites.
const TARGET_PEAK_RSS_MIB: f64 = 128.0;
const TARGET_US_PER_SAMPLE: f64 = 25.0;
const TARGET_COMPLETE: f64 = 0.95;
const TARGET_LOAD: f64 = 8.0;
/// Timeline rows: one per this many polls.
const TIMELINE_EVERY: usize = 6;
const TOP_SERVICES: usize = 40;

const SAMPLES: &str = "profiler_samples_processed_total";
const AGENT_CPU: &str = "profiler_agent_cpu_seconds_total";

/// At most `chars` characters of `text`, with `…` when cut.
fn shorten(text: &str, chars: usize) -> String {
    let mut shown: String = text.chars().take(chars).collect();
    if shown.len() < text.len() {
        shown.push('…');
    }
    shown
}

/// Online CPUs.
fn cpus() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    online.max(1) as f64
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn pct(part: i64, whole: i64) -> String {
    if whole > 0 {
        format!("{:.2} %", part as f64 * 100.0 / whole as f64)
    } else {
        "n/a".into()
    }
}

fn verdict(pass: Option<bool>) -> &'static str {
    match pass {
        Some(true) => "PASS",
        Some(false) => "MISS",
        None => "n/a (not measured)",
    }
}

fn opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "n/a".into(), |v| format!("{v:.decimals$}"))
}

/// Least-squares line through `points` (x, y): (intercept, slope); None with fewer than two
/// distinct x.
fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    (sxx > 0.0).then(|| {
        let slope = sxy / sxx;
        (mean_y - slope * mean_x, slope)
    })
}

/// Least-squares slope of `points` (x, y); None with fewer than two distinct x.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    fit(points).map(|(_, slope)| slope)
}

/// Growth in % from the first x of `points` to the last along their least-squares line: what
/// the series grew by, not what two of its points happen to differ by (the file-backed RSS
/// moves by several MiB from one poll to the next as symbol pages are read and given back).
fn fitted_growth(points: &[(f64, f64)]) -> Option<f64> {
    let (intercept, slope) = fit(points)?;
    let first = points.iter().map(|p| p.0).reduce(f64::min)?;
    let last = points.iter().map(|p| p.0).reduce(f64::max)?;
    let start = intercept + slope * first;
    (start > 0.0).then(|| slope * (last - first) * 100.0 / start)
}

/// CPU µs per sample between two polls from the agent's own /metrics, whose CPU time and sample
/// count are taken at the same moment (the end of an interval).
fn us_per_sample(a: &Poll, b: &Poll) -> Option<f64> {
    let samples = b.metric(SAMPLES)? - a.metric(SAMPLES)?;
    let cpu = b.metric(AGENT_CPU)? - a.metric(AGENT_CPU)?;
    (samples > 0.0).then(|| cpu * 1e6 / samples)
}

/// CPU µs per sample of each agent interval whose end the polls saw: the /metrics values
/// change once an interval (every 15 s), so consecutive polls with the same sample count are
/// one interval end. `polls` all have both figures (`figures` keeps only those).
fn interval_us_per_sample(polls: &[&Poll]) -> Vec<f64> {
    let mut ends: Vec<&Poll> = Vec::new();
    for poll in polls {
        if ends
            .last()
            .is_none_or(|last| last.metric(SAMPLES) != poll.metric(SAMPLES))
        {
            ends.push(poll);
        }
    }
    ends.windows(2)
        .filter_map(|pair| us_per_sample(pair[0], pair[1]))
        .collect()
}

/// The median and quartiles of the steady state's intervals (see
/// [`interval_us_per_sample`]), and their count.
#[derive(Clone, Copy, Debug, PartialEq)]
struct IntervalSpread {
    median: f64,
    lower_quartile: f64,
    upper_quartile: f64,
    intervals: usize,
}

fn interval_spread(us: &[f64]) -> Option<IntervalSpread> {
    Some(IntervalSpread {
        median: median(us)?,
        lower_quartile: quantile(us, 0.25)?,
        upper_quartile: quantile(us, 0.75)?,
        intervals: us.len(),
    })
}

/// The figures the targets are judged on.
struct Figures<'a> {
    steady: Vec<&'a Poll>,
    warm: Option<&'a Poll>,
    last: Option<&'a Poll>,
    growth_pct: Option<f64>,
    /// Along the least-squares line of VmRSS over the steady polls: what the target is judged on.
    fitted_growth_pct: Option<f64>,
    anon_growth_pct: Option<f64>,
    file_growth_pct: Option<f64>,
    slope_mib_min: Option<f64>,
    anon_slope_mib_min: Option<f64>,
    peak_mib: Option<f64>,
    /// The poll that first saw the peak, and the one before it (seconds since the start).
    peak_between_s: Option<(f64, f64)>,
    steady_us: Option<f64>,
    /// The steady state's intervals one by one: a start-up that runs on past the warm-up
    /// raises the mean over the window ([`Self::steady_us`]) but only its own intervals here,
    /// so runs compare by this better.
    steady_intervals: Option<IntervalSpread>,
    whole_us: Option<f64>,
    whole_cpu_s: Option<f64>,
    whole_samples: Option<f64>,
    load_median: Option<f64>,
    load_min: Option<f64>,
    load_max: Option<f64>,
}

fn growth(a: Option<u64>, b: Option<u64>) -> Option<f64> {
    let (a, b) = (a? as f64, b? as f64);
    (a > 0.0).then(|| (b - a) * 100.0 / a)
}

fn figures(run: &HostRun) -> Figures<'_> {
    let warm_up = warm_up_s(run.seconds);
    let steady: Vec<&Poll> = run.polls.iter().filter(|p| p.t >= warm_up).collect();
    let warm = steady.iter().copied().find(|p| p.rss.is_some());
    let last = run.polls.iter().rev().find(|p| p.rss.is_some());
    let rss_points = |field: fn(&crate::host::Rss) -> u64| -> Vec<(f64, f64)> {
        steady
            .iter()
            .filter_map(|p| Some((p.t / 60.0, mib(field(p.rss.as_ref()?)))))
            .collect()
    };
    let total_points = rss_points(|r| r.total);
    let with_metrics: Vec<&Poll> = steady
        .iter()
        .copied()
        .filter(|p| p.metric(SAMPLES).is_some() && p.metric(AGENT_CPU).is_some())
        .collect();
    let steady_us = match (with_metrics.first(), with_metrics.last()) {
        (Some(a), Some(b)) => us_per_sample(a, b),
        _ => None,
    };
    // Whole run: the agent's `agent stopped` line (everything, shutdown included), else the
    // last /metrics.
    let stopped = run.log.stopped.as_ref();
    let whole_cpu_s = stopped
        .and_then(|s| s.get("agent_cpu_us"))
        .map(|us| us / 1e6)
        .or_else(|| run.polls.iter().rev().find_map(|p| p.metric(AGENT_CPU)));
    let whole_samples = stopped
        .and_then(|s| s.get("samples_processed").copied())
        .or_else(|| run.polls.iter().rev().find_map(|p| p.metric(SAMPLES)));
    let whole_us = match (whole_cpu_s, whole_samples) {
        (Some(cpu), Some(n)) if n > 0.0 => Some(cpu * 1e6 / n),
        _ => None,
    };
    let loads: Vec<f64> = steady.iter().filter_map(|p| Some(p.load?[0])).collect();
    // The first poll that saw the peak.
    let peak_poll = run
        .polls
        .iter()
        .enumerate()
        .filter_map(|(i, p)| Some((i, p.t, p.rss?.peak)))
        .max_by_key(|&(i, _, peak)| (peak, std::cmp::Reverse(i)));
    let peak = peak_poll.map(|(.., peak)| mib(peak)).or_else(|| {
        stopped
            .and_then(|s| s.get("peak_rss_bytes"))
            .map(|b| b / 1048576.0)
    });
    let peak_between_s = peak_poll.map(|(i, t, _)| {
        let before = i.checked_sub(1).map_or(0.0, |b| run.polls[b].t);
        (before, t)
    });
    Figures {
        growth_pct: growth(
            warm.and_then(|p| p.rss).map(|r| r.total),
            last.and_then(|p| p.rss).map(|r| r.total),
        ),
        fitted_growth_pct: fitted_growth(&total_points),
        anon_growth_pct: growth(
            warm.and_then(|p| p.rss).map(|r| r.anon),
            last.and_then(|p| p.rss).map(|r| r.anon),
        ),
        file_growth_pct: growth(
            warm.and_then(|p| p.rss).map(|r| r.file),
            last.and_then(|p| p.rss).map(|r| r.file),
        ),
        slope_mib_min: slope(&total_points),
        anon_slope_mib_min: slope(&rss_points(|r| r.anon)),
        peak_mib: peak,
        peak_between_s,
        steady_us,
        steady_intervals: interval_spread(&interval_us_per_sample(&with_metrics)),
        whole_us,
        whole_cpu_s,
        whole_samples,
        load_median: median(&loads),
        load_min: loads.iter().copied().reduce(f64::min),
        load_max: loads.iter().copied().reduce(f64::max),
        steady,
        warm,
        last,
    }
}

fn rss_text(p: Option<&Poll>) -> String {
    match p.and_then(|p| p.rss.map(|r| (p.t, r))) {
        Some((t, r)) => format!(
            "{:.1} MiB (anon {:.1}, file {:.1}, shmem {:.1}) at {t:.0} s",
            mib(r.total),
            mib(r.anon),
            mib(r.file),
            mib(r.shmem)
        ),
        None => "n/a".into(),
    }
}

pub fn render(run: &HostRun) -> String {
    let mut out = String::new();
    let f = figures(run);
    let _ = writeln!(out, "\n### Host: a busy real host\n");
    let _ = writeln!(
        out,
        "- workload, all at once for {} s (parts started 1 s apart once the agent ran): `make -j4` clean rebuilds of {} generated C files in a loop; an exec storm (`host_spawner`, {} spawns/s asked); short-lived multi-threaded programs with named threads; Python services on CPython 3.8, 3.11, 3.12 (http.server) and 3.13 (its client); a PyTorch CPU inference loop; the known-stack fixtures (fp_chain with and without frame pointers, the frameless library called through the PLT, a Python chain on 3.11)",
        run.seconds,
        host_workload::BUILD_FILES,
        host_workload::SPAWN_RATE
    );
    let _ = writeln!(
        out,
        "- agent: `profiler --log-format json agent` with its defaults (100 Hz, 15 s intervals, embedded store, Python and GPU support on) except `--data-dir`, `--cache-dir` (empty: a first start) in the scratch directory and `--listen 127.0.0.1:0`, `RUST_LOG={AGENT_RUST_LOG}` (one more log line per interval: the unwind-table statistics); running {:.1} s after its start",
        run.ready_s
    );
    let _ = writeln!(
        out,
        "- read every {POLL_S} s: /proc/PID/stat (utime+stime), /proc/PID/status (RssAnon, RssFile, RssShmem, VmRSS, VmHWM), /proc/loadavg, /proc/stat (forks), the agent's /metrics (updated at the end of each 15 s interval) and its log; warm-up: the first {warm_up:.0} s; steady state: the {} polls from {warm_up:.0} s to the end",
        f.steady.len(),
        warm_up = warm_up_s(run.seconds)
    );
    if let Some((t, status)) = &run.agent_died {
        let _ = writeln!(
            out,
            "- **the agent exited after {t:.0} s ({status})**; its last log lines are in the details"
        );
    }
    for reason in &run.skipped {
        let _ = writeln!(out, "- skipped: {reason}");
    }
    let _ = writeln!(
        out,
        "- the machine before the run: load average {} (1, 5, 15 min)",
        run.load_before.map_or("n/a".into(), |l| format!(
            "{:.1}, {:.1}, {:.1}",
            l[0], l[1], l[2]
        ))
    );
    let outside: f64 = run.outsiders.values().sum();
    let capacity = run.seconds as f64 * cpus();
    let mut busiest: Vec<(&String, &f64)> = run.outsiders.iter().collect();
    busiest.sort_by(|a, b| b.1.total_cmp(a.1));
    let _ = writeln!(
        out,
        "- {}CPU of processes outside the suite (not the bench's descendants; read every {POLL_S} s, so a lower bound): {outside:.1} CPU-seconds, {:.1} % of the machine over the run{}{}",
        if outside > 0.05 * capacity {
            "**not a quiet run**: "
        } else {
            ""
        },
        outside * 100.0 / capacity,
        if busiest.is_empty() { "" } else { "; most: " },
        busiest
            .iter()
            .take(6)
            .map(|(name, s)| format!("{name} {s:.1} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if run.foreign.is_empty() {
        let _ = writeln!(
            out,
            "- no other `profiler`, `bench` or `perf` process was seen during the run"
        );
    } else {
        let _ = writeln!(
            out,
            "- **not a quiet run**: other samplers or benchmarks ran meanwhile (seen in that many of the {} polls): {}",
            run.polls.len(),
            run.foreign
                .iter()
                .map(|(what, polls)| format!("`{what}` ({polls})"))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }

    render_targets(&mut out, run, &f);
    render_agent(&mut out, run, &f);
    render_timeline(&mut out, run);
    render_resident_by_mapping(&mut out, &f);
    match &run.analysis {
        Ok(analysis) => {
            render_quality(&mut out, run, analysis);
            render_fixtures(&mut out, analysis);
            render_services(&mut out, run, analysis);
        }
        Err(err) => {
            let _ = writeln!(
                out,
                "\nThe profiles could not be read back from the agent's store: {err}"
            );
        }
    }
    render_workload(&mut out, run);
    render_log(&mut out, run);
    out
}

fn render_targets(out: &mut String, run: &HostRun, f: &Figures<'_>) {
    let warm_up = warm_up_s(run.seconds);
    let _ = writeln!(out, "\n#### Targets\n");
    let _ = writeln!(out, "| target | measured | verdict |");
    let _ = writeln!(out, "|---|---|---|");
    let _ = writeln!(
        out,
        "| agent RSS flat after warm-up (< {TARGET_RSS_GROWTH_PCT:.0} % growth from {warm_up:.0} s to the end, along the least-squares line) | {} % (slope {} MiB/min; first and last poll: {:.1} → {:.1} MiB, {} %) | {} |",
        opt(f.fitted_growth_pct, 1),
        opt(f.slope_mib_min, 2),
        f.warm.and_then(|p| p.rss).map_or(0.0, |r| mib(r.total)),
        f.last.and_then(|p| p.rss).map_or(0.0, |r| mib(r.total)),
        opt(f.growth_pct, 1),
        verdict(f.fitted_growth_pct.map(|g| g < TARGET_RSS_GROWTH_PCT))
    );
    let _ = writeln!(
        out,
        "| agent peak RSS ≤ {TARGET_PEAK_RSS_MIB:.0} MiB | {} MiB (VmHWM) | {} |",
        opt(f.peak_mib, 1),
        verdict(f.peak_mib.map(|p| p <= TARGET_PEAK_RSS_MIB))
    );
    let _ = writeln!(
        out,
        "| agent CPU ≤ {TARGET_US_PER_SAMPLE:.0} µs per sample, steady state | {} µs ({}; whole run incl. start-up and shutdown: {} µs) | {} |",
        opt(f.steady_us, 1),
        spread_text(f.steady_intervals),
        opt(f.whole_us, 1),
        verdict(f.steady_us.map(|us| us <= TARGET_US_PER_SAMPLE))
    );
    let load_ok = f.load_median.map(|l| l >= TARGET_LOAD);
    let load_note = match (f.load_median, load_ok) {
        (Some(load), Some(true)) => format!("load average {load:.1} (median, 1 min)"),
        (Some(load), _) => format!("load average only {load:.1}: below {TARGET_LOAD:.0}"),
        (None, _) => "load average not read".into(),
    };
    match &run.analysis {
        Ok(analysis) => {
            for fixture in &analysis.fixtures {
                let share = fixture.share();
                let _ = writeln!(
                    out,
                    "| {} ≥ {:.0} % complete at load ≥ {TARGET_LOAD:.0} | {} ({} of {} samples; {load_note}) | {} |",
                    fixture.name,
                    TARGET_COMPLETE * 100.0,
                    share.map_or("no samples".into(), |s| format!("{:.1} %", s * 100.0)),
                    fixture.complete,
                    fixture.samples,
                    verdict(share.map(|s| s >= TARGET_COMPLETE))
                );
            }
        }
        Err(_) => {
            let _ = writeln!(
                out,
                "| known fixtures ≥ {:.0} % complete | profiles not readable | n/a |",
                TARGET_COMPLETE * 100.0
            );
        }
    }
}

/// "median of the 16 agent intervals 88.1 µs, quartiles 84.0-95.2".
fn spread_text(spread: Option<IntervalSpread>) -> String {
    match spread {
        Some(s) => format!(
            "median of the {} agent intervals {:.1} µs, quartiles {:.1}-{:.1}",
            s.intervals, s.median, s.lower_quartile, s.upper_quartile
        ),
        None => "no whole agent interval in the steady state".into(),
    }
}

fn render_agent(out: &mut String, run: &HostRun, f: &Figures<'_>) {
    let _ = writeln!(out, "\n#### Agent\n");
    let _ = writeln!(out, "| figure | value |");
    let _ = writeln!(out, "|---|---|");
    let first = f.steady.first();
    let last = f.steady.last();
    let span = match (first, last) {
        (Some(a), Some(b)) if b.t > a.t => Some((*a, *b)),
        _ => None,
    };
    let rate = |get: &dyn Fn(&Poll) -> Option<f64>| {
        span.and_then(|(a, b)| Some((get(b)? - get(a)?) / (b.t - a.t)))
    };
    let _ = writeln!(
        out,
        "| samples processed | {} in the whole run; {} per second in the steady state |",
        opt(f.whole_samples, 0),
        opt(rate(&|p| p.metric(SAMPLES)), 1)
    );
    let last_poll = run.polls.iter().rev().find(|p| !p.metrics.is_empty());
    let metric = |name: &str| last_poll.and_then(|p| p.metric(name));
    let stopped = |name: &str| run.log.stopped.as_ref().and_then(|s| s.get(name).copied());
    let _ = writeln!(
        out,
        "| samples dropped (ring buffer full, agent queue full, undecodable) | {} |",
        opt(
            stopped("samples_dropped").or_else(|| metric("profiler_samples_dropped_total")),
            0
        )
    );
    let _ = writeln!(
        out,
        "| agent CPU, whole run | {} s, {} µs per sample |",
        opt(f.whole_cpu_s, 2),
        opt(f.whole_us, 1)
    );
    let proc_cpu = rate(&|p| p.cpu_s);
    let _ = writeln!(
        out,
        "| agent CPU, steady state | {} % of one CPU; {} µs per sample (/metrics: CPU and samples of the same interval ends); {}; cross-check with /proc/PID/stat CPU over the same polls: {} µs |",
        opt(proc_cpu.map(|c| c * 100.0), 1),
        opt(f.steady_us, 1),
        spread_text(f.steady_intervals),
        opt(
            span.and_then(|(a, b)| {
                let cpu = b.cpu_s? - a.cpu_s?;
                let n = b.metric(SAMPLES)? - a.metric(SAMPLES)?;
                (n > 0.0).then(|| cpu * 1e6 / n)
            }),
            1
        )
    );
    let _ = writeln!(
        out,
        "| RSS at the end of the warm-up | {} |",
        rss_text(f.warm)
    );
    let _ = writeln!(out, "| RSS at the end | {} |", rss_text(f.last));
    let _ = writeln!(
        out,
        "| RSS growth after the warm-up | total {} %, anon {} %, file {} %; slope {} MiB/min total, {} MiB/min anon |",
        opt(f.growth_pct, 1),
        opt(f.anon_growth_pct, 1),
        opt(f.file_growth_pct, 1),
        opt(f.slope_mib_min, 2),
        opt(f.anon_slope_mib_min, 2)
    );
    let reached = f
        .peak_between_s
        .map(|(from, to)| format!(", reached between {from:.0} s and {to:.0} s"))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "| peak RSS (VmHWM) | {} MiB{reached} |",
        opt(f.peak_mib, 1)
    );
    let _ = writeln!(
        out,
        "| load average (1 min), steady state | median {}, min {}, max {} |",
        opt(f.load_median, 1),
        opt(f.load_min, 1),
        opt(f.load_max, 1)
    );
    let _ = writeln!(
        out,
        "| forks per second on the machine, steady state | {} |",
        opt(rate(&|p| p.forks.map(|n| n as f64)), 0)
    );
    let bpf = span.and_then(|(a, b)| {
        let (a, b) = (a.bpf?, b.bpf?);
        let runs = b.run_cnt.checked_sub(a.run_cnt)?;
        (runs > 0).then(|| {
            (
                b.run_time_ns.saturating_sub(a.run_time_ns) as f64 / runs as f64,
                runs,
            )
        })
    });
    let _ = writeln!(
        out,
        "| BPF sampler, steady state (kernel.bpf_stats_enabled) | {} |",
        bpf.map_or("n/a".into(), |(ns, runs)| format!(
            "{ns:.0} ns per run over {runs} runs"
        ))
    );
    let tables = &run.log.last_interval;
    let table = |name: &str| tables.get(name).map_or("n/a".into(), |v| format!("{v:.0}"));
    let _ = writeln!(
        out,
        "| unwind tables at the last interval | {} loaded ({} built, {} from the cache), {} evicted, {} deferred (no room), {} too large, {} failed; {} of {} rows in use; {} s building tables; {} processes registered |",
        table("tables_loaded"),
        table("tables_built"),
        table("tables_from_cache"),
        table("tables_evicted"),
        table("tables_deferred"),
        table("tables_too_large"),
        table("tables_failed"),
        table("rows_in_use"),
        table("row_capacity"),
        opt(tables.get("build_time_s").copied(), 1),
        table("processes_registered"),
    );
    let _ = writeln!(
        out,
        "| agent stop after SIGTERM | {} |",
        run.agent_stop
            .as_ref()
            .map_or("n/a (it was not running)".into(), |(status, s)| format!(
                "{status} after {s:.1} s"
            ))
    );
    if run.metric_failures > 0 {
        let _ = writeln!(
            out,
            "| /metrics reads that failed | {} of {} |",
            run.metric_failures,
            run.polls.len()
        );
    }
}

/// What the agent's resident memory is made of at the end of the warm-up and at the end, by
/// kind and by the mappings that changed most: which part an RSS growth is.
fn render_resident_by_mapping(out: &mut String, f: &Figures<'_>) {
    let first = f
        .steady
        .iter()
        .find_map(|p| Some((p.t, p.resident_by_mapping.as_ref()?)));
    let last = f
        .steady
        .iter()
        .rev()
        .find_map(|p| Some((p.t, p.resident_by_mapping.as_ref()?)));
    let (Some((t_first, first)), Some((t_last, last))) = (first, last) else {
        return;
    };
    let kind = |name: &str| -> &'static str {
        match name {
            _ if name.starts_with("anon_inode:bpf") => "BPF maps and rings",
            _ if name.ends_with("/profiler") => "the agent's binary",
            _ if name.starts_with('/') => "other files (symbol files, libraries)",
            _ => "anonymous (heap, stacks)",
        }
    };
    let by_kind = |resident: &BTreeMap<String, u64>| {
        let mut kinds: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (name, bytes) in resident {
            *kinds.entry(kind(name)).or_insert(0) += bytes;
        }
        kinds
    };
    let (kinds_first, kinds_last) = (by_kind(first), by_kind(last));
    let _ = writeln!(out, "\n#### Resident memory by mapping\n");
    let _ = writeln!(
        out,
        "/proc/PID/smaps, Rss summed by mapping name, at {t_first:.0} s (the first poll after the warm-up) and {t_last:.0} s (the last). A BPF ring's data pages are mapped twice, so they count twice.\n"
    );
    let _ = writeln!(
        out,
        "| kind | at {t_first:.0} s MiB | at {t_last:.0} s MiB | change MiB |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    let names: BTreeSet<&str> = kinds_first
        .keys()
        .chain(kinds_last.keys())
        .copied()
        .collect();
    for name in names {
        let (a, b) = (
            kinds_first.get(name).copied().unwrap_or(0),
            kinds_last.get(name).copied().unwrap_or(0),
        );
        let _ = writeln!(
            out,
            "| {name} | {:.1} | {:.1} | {:+.1} |",
            mib(a),
            mib(b),
            mib(b) - mib(a)
        );
    }
    let mut changes: Vec<(&str, u64, u64)> = first
        .keys()
        .chain(last.keys())
        .map(String::as_str)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|name| {
            (
                name,
                first.get(name).copied().unwrap_or(0),
                last.get(name).copied().unwrap_or(0),
            )
        })
        .filter(|&(_, a, b)| a != b)
        .collect();
    changes.sort_by_key(|&(_, a, b)| std::cmp::Reverse(a.abs_diff(b)));
    let _ = writeln!(out, "\nThe mappings that changed most:\n");
    let _ = writeln!(
        out,
        "| mapping | at {t_first:.0} s MiB | at {t_last:.0} s MiB | change MiB |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for (name, a, b) in changes.into_iter().take(RESIDENT_CHANGES_SHOWN) {
        let _ = writeln!(
            out,
            "| `{name}` | {:.2} | {:.2} | {:+.2} |",
            mib(a),
            mib(b),
            mib(b) - mib(a)
        );
    }
}

/// Rows of the table of the mappings whose resident memory changed most.
const RESIDENT_CHANGES_SHOWN: usize = 12;

fn render_timeline(out: &mut String, run: &HostRun) {
    let _ = writeln!(out, "\n#### Timeline\n");
    let _ = writeln!(
        out,
        "One row per {} s. CPU %: /proc/PID/stat over the row; µs/sample and samples/s: the agent's /metrics (its CPU and sample count at its latest interval end, so they lag up to 15 s); caches: /metrics gauges; unwind tables resident (loaded − evicted) / evicted so far and rows in use: the agent's latest interval log lines.\n",
        POLL_S as usize * TIMELINE_EVERY
    );
    let _ = writeln!(
        out,
        "| t s | load 1m | agent CPU % | µs/sample | samples/s | RSS anon MiB | RSS file MiB | symbol cache entries | open files | processes tracked | Python processes | unwind tables resident / evicted | unwind rows in use |"
    );
    let _ = writeln!(
        out,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut rows: Vec<&Poll> = run.polls.iter().step_by(TIMELINE_EVERY).collect();
    if let Some(last) = run.polls.last()
        && rows.last().is_none_or(|r| r.t < last.t)
    {
        rows.push(last);
    }
    let mut previous: Option<&Poll> = None;
    for p in rows {
        let cpu = previous.and_then(|a| {
            let dt = p.t - a.t;
            let cpu = p.cpu_s? - a.cpu_s?;
            (dt > 0.0).then_some(cpu * 100.0 / dt)
        });
        let us = previous.and_then(|a| us_per_sample(a, p));
        let per_second = previous.and_then(|a| {
            let dt = p.t - a.t;
            let samples = p.metric(SAMPLES)? - a.metric(SAMPLES)?;
            (dt > 0.0).then_some(samples / dt)
        });
        let gauge = |name: &str| opt(p.metric(name), 0);
        let logged = |name: &str| p.interval.get(name).copied();
        let tables = match (logged("tables_loaded"), logged("tables_evicted")) {
            (Some(loaded), Some(evicted)) => format!("{:.0} / {evicted:.0}", loaded - evicted),
            _ => opt(logged("unwind_tables"), 0),
        };
        let _ = writeln!(
            out,
            "| {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            p.t,
            opt(p.load.map(|l| l[0]), 1),
            opt(cpu, 1),
            opt(us, 1),
            opt(per_second, 0),
            opt(p.rss.map(|r| mib(r.anon)), 1),
            opt(p.rss.map(|r| mib(r.file)), 1),
            gauge("profiler_symbol_cache_entries"),
            gauge("profiler_open_files"),
            gauge("profiler_processes_tracked"),
            gauge("profiler_python_processes"),
            tables,
            opt(logged("rows_in_use").or(logged("unwind_rows")), 0),
        );
        previous = Some(p);
    }
    // How the caches grew after the warm-up.
    let warm_up = warm_up_s(run.seconds);
    let warm = run
        .polls
        .iter()
        .find(|p| p.t >= warm_up && !p.metrics.is_empty());
    let last = run.polls.iter().rev().find(|p| !p.metrics.is_empty());
    if let (Some(a), Some(b)) = (warm, last) {
        let mut changes = Vec::new();
        for (name, label) in [
            ("profiler_symbol_cache_entries", "symbol cache entries"),
            (
                "profiler_symbol_cache_evicted_total",
                "symbol cache evictions",
            ),
            ("profiler_open_files", "open files"),
            ("profiler_processes_tracked", "processes tracked"),
            ("profiler_python_processes", "Python processes"),
            (
                "profiler_python_processes_pending",
                "Python processes pending",
            ),
            (
                "profiler_python_processes_disabled_total",
                "Python processes disabled",
            ),
            ("profiler_cuda_libraries_probed", "CUDA libraries probed"),
            ("profiler_cuda_probes_attached", "CUDA probes attached"),
            ("profiler_store_bytes", "store bytes"),
            ("profiler_store_catalog_names", "store strings"),
            ("profiler_store_catalog_frames", "store frames"),
            ("profiler_store_catalog_nodes", "store call-tree nodes"),
            (
                "profiler_store_node_trees_sealed_total",
                "store call trees sealed",
            ),
            (
                "profiler_store_frame_generations_sealed_total",
                "store frame and string generations sealed",
            ),
            (
                "profiler_store_sqlite_memory_bytes",
                "SQLite memory (bytes)",
            ),
            ("profiler_python_code_objects", "Python code objects"),
            ("profiler_symbol_file_bytes", "parsed symbol tables (bytes)"),
            ("profiler_process_identities", "exec/fork identities"),
            ("profiler_announced_mmaps", "announced mmaps"),
            ("profiler_process_snapshots_total", "process snapshots read"),
            (
                "profiler_process_maps_from_announcements_total",
                "of which mappings from announcements",
            ),
            (
                "profiler_process_cmdlines_from_exec_total",
                "of which command lines from exec events",
            ),
            (
                "profiler_process_identities_from_exec_total",
                "of which identities from exec events (no stat, exe)",
            ),
            (
                "profiler_process_cgroups_from_fork_total",
                "of which cgroups from the parent at the fork (no /proc/PID/cgroup)",
            ),
            (
                "profiler_cgroup_moves",
                "processes moved between cgroups kept",
            ),
            (
                "profiler_process_snapshots_before_exec_total",
                "samples taken in an exec, resolved against the program before it",
            ),
            ("profiler_late_walks_held", "samples held for a late walk"),
            (
                "profiler_symbol_interned_strings",
                "interned names and paths",
            ),
            (
                "profiler_agent_heap_allocated_bytes",
                "heap allocated (bytes)",
            ),
            (
                "profiler_agent_heap_resident_bytes",
                "heap resident (bytes)",
            ),
        ] {
            if let (Some(x), Some(y)) = (a.metric(name), b.metric(name)) {
                changes.push(format!("{label} {x:.0} → {y:.0}"));
            }
        }
        for (name, label) in [
            ("tables_loaded", "unwind tables loaded"),
            ("tables_evicted", "evicted"),
            ("rows_in_use", "unwind rows in use"),
        ] {
            if let (Some(x), Some(y)) = (a.interval.get(name), b.interval.get(name)) {
                changes.push(format!("{label} {x:.0} → {y:.0}"));
            }
        }
        let _ = writeln!(
            out,
            "\nFrom {:.0} s to {:.0} s: {}.",
            a.t,
            b.t,
            changes.join("; ")
        );
        let lookups = |name| a.metric(name).zip(b.metric(name)).map(|(x, y)| y - x);
        if let (Some(count), Some(seconds)) = (
            lookups("profiler_symbol_lookups_total"),
            lookups("profiler_symbol_lookup_seconds_total"),
        ) && count > 0.0
        {
            let _ = write!(
                out,
                "Symbol lookups in that time (native frames that missed the symbol cache): {count:.0}, {seconds:.2} s of wall time, {:.0} µs each",
                seconds / count * 1e6
            );
            if let (Some(loads), Some(load_seconds), Some(start_seconds)) = (
                lookups("profiler_symbol_file_loads_total"),
                lookups("profiler_symbol_file_load_seconds_total"),
                lookups("profiler_symbol_function_start_seconds_total"),
            ) {
                let rest = count - loads;
                let _ = write!(
                    out,
                    "; of which {loads:.0} first read a file's symbols ({load_seconds:.2} s), the other {rest:.0} {:.0} µs each; naming frames by their function's start {start_seconds:.2} s",
                    if rest > 0.0 {
                        (seconds - load_seconds) / rest * 1e6
                    } else {
                        0.0
                    }
                );
            }
            if let Some(cpu_seconds) = lookups("profiler_symbol_lookup_cpu_seconds_total") {
                let _ = write!(
                    out,
                    "; their CPU time {cpu_seconds:.2} s, {:.0} µs each ({:.1} % of the agent's CPU then)",
                    cpu_seconds / count * 1e6,
                    lookups(AGENT_CPU).map_or(f64::NAN, |agent| 100.0 * cpu_seconds / agent)
                );
            }
            if let Some(hits) = lookups("profiler_symbol_function_name_hits_total") {
                let _ = write!(
                    out,
                    "; function names from the name cache (not demangled again) {hits:.0}"
                );
            }
            if let Some(hits) = lookups("profiler_symbol_function_range_hits_total") {
                let _ = write!(
                    out,
                    "; frames of stripped code named by a remembered function, without a lookup, {hits:.0}"
                );
            }
            let _ = writeln!(out, ".");
        }
    }
}

fn render_quality(out: &mut String, run: &HostRun, analysis: &ProfileAnalysis) {
    let total = analysis.total();
    let _ = writeln!(out, "\n#### Stack quality, every sample of the run\n");
    let _ = writeln!(
        out,
        "From the agent's store after the run (`profiler server` on its data directory, each service's whole run as merged pprof from `/api/pprof`, type `{}`): the share of samples with at least one such frame. Unmapped: `[unknown]`, `module!sub_…`, `module+0x…` or `0x…` (no symbol).\n",
        analysis.profile_type
    );
    let _ = writeln!(
        out,
        "| services | samples | with [unknown] | unmapped | [truncated] |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|");
    let row = |out: &mut String, s: &ServiceStats| {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            s.name,
            s.samples,
            pct(s.unknown, s.samples),
            pct(s.unmapped, s.samples),
            pct(s.truncated, s.samples)
        );
    };
    row(
        out,
        &ServiceStats {
            name: format!("all {} services", analysis.services.len()),
            ..total.clone()
        },
    );
    for s in analysis.services.iter().take(15) {
        row(out, s);
    }
    if !analysis.bad_stacks.is_empty() {
        let _ = writeln!(
            out,
            "\nThe most frequent stacks with `[unknown]` or `[truncated]` (service: folded stack, repeats collapsed):\n"
        );
        for (stack, count) in &analysis.bad_stacks {
            let _ = writeln!(out, "- {count}× `{}`", shorten(stack, 300));
        }
    }
    let last = run.polls.iter().rev().find(|p| !p.metrics.is_empty());
    render_counters(
        out,
        "The agent's own counters at its last interval",
        |name| last.and_then(|p| p.metric(name)),
        [
            SAMPLES,
            "profiler_truncated_stacks_total",
            "profiler_unmapped_frames_total",
            "profiler_symbolization_misses_total",
            "profiler_unknown_processes_total",
        ],
    );
    // The same counters over the whole run, the last (busy) interval and the stop included,
    // as the store's figures are.
    let stopped = run.log.stopped.as_ref();
    render_counters(
        out,
        "The same at its stop, over the whole run",
        |name| stopped.and_then(|s| s.get(name).copied()),
        [
            "samples_processed",
            "truncated_stacks",
            "unmapped_frames",
            "symbolization_misses",
            "unknown_processes",
        ],
    );
    // Lost lifecycle events leave short-lived processes without an identity.
    if let Some(lost) = stopped.and_then(|s| s.get("process_events_lost").copied()) {
        let _ = writeln!(
            out,
            "Exec, fork and exit events lost (events ring full), whole run: {lost}."
        );
    }
}

/// One sentence of the agent's stack-quality counters; `names`: samples processed, truncated
/// stacks, unmapped frames, symbolization misses, samples of unknown processes.
fn render_counters(
    out: &mut String,
    what: &str,
    counter: impl Fn(&str) -> Option<f64>,
    names: [&str; 5],
) {
    let Some(samples) = counter(names[0]).filter(|n| *n > 0.0) else {
        return;
    };
    let per = |name: &str| {
        counter(name).map_or("n/a".into(), |v| {
            format!("{v:.0} ({:.2} % of samples)", v * 100.0 / samples)
        })
    };
    let _ = writeln!(
        out,
        "\n{what} ({samples:.0} samples processed): truncated stacks {}; unmapped frames {}; symbolization misses {}; samples of processes it did not know {}.",
        per(names[1]),
        per(names[2]),
        per(names[3]),
        per(names[4]),
    );
}

fn render_fixtures(out: &mut String, analysis: &ProfileAnalysis) {
    let _ = writeln!(out, "\n#### Known fixtures\n");
    let _ = writeln!(
        out,
        "Complete: the sample's stack (root first) contains each segment of the expected chain contiguously and in order, and no `[truncated]` or `[unknown…]` frame.\n"
    );
    let _ = writeln!(
        out,
        "| fixture | service | expected chain | samples | complete |"
    );
    let _ = writeln!(out, "|---|---|---|---:|---:|");
    for f in &analysis.fixtures {
        let _ = writeln!(
            out,
            "| {} | `{}` | `{}` | {} | {} |",
            f.name,
            f.service,
            f.chain,
            f.samples,
            f.share()
                .map_or("n/a".into(), |s| format!("{:.1} %", s * 100.0))
        );
    }
    for f in &analysis.fixtures {
        for (stack, count) in &f.incomplete_top {
            let _ = writeln!(
                out,
                "- {} incomplete ({count} samples): `{}`",
                f.name,
                shorten(stack, 400)
            );
        }
    }
}

fn render_services(out: &mut String, run: &HostRun, analysis: &ProfileAnalysis) {
    let total = analysis.total().samples;
    let _ = writeln!(out, "\n#### Service names\n");
    let _ = writeln!(
        out,
        "| workload part | expected service | samples under it |"
    );
    let _ = writeln!(out, "|---|---|---:|");
    for part in &run.parts {
        if let Some(expected) = &part.expected_service {
            let samples = analysis.samples_of(expected);
            let _ = writeln!(
                out,
                "| {} | `{expected}` | {} |",
                part.name,
                if samples > 0 {
                    samples.to_string()
                } else {
                    "**none: not found**".into()
                }
            );
        }
    }
    let flagged: Vec<&ServiceStats> = analysis
        .services
        .iter()
        .filter(|s| s.flag().is_some())
        .collect();
    let _ = writeln!(
        out,
        "\n{} services in all; {} flagged as suspicious ({} samples, {}). The {} with most samples, then every other flagged one:\n",
        analysis.services.len(),
        flagged.len(),
        flagged.iter().map(|s| s.samples).sum::<i64>(),
        pct(flagged.iter().map(|s| s.samples).sum(), total),
        TOP_SERVICES.min(analysis.services.len())
    );
    let _ = writeln!(
        out,
        "| service | samples | share | process names (root frames) | flag |"
    );
    let _ = writeln!(out, "|---|---:|---:|---|---|");
    let row = |out: &mut String, s: &ServiceStats| {
        let roots: Vec<String> = s
            .roots
            .iter()
            .map(|(root, count)| format!("{} {count}", root.replace('|', "\\|")))
            .collect();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            s.name.replace('|', "\\|"),
            s.samples,
            pct(s.samples, total),
            roots.join(", "),
            s.flag().unwrap_or("")
        );
    };
    for s in analysis.services.iter().take(TOP_SERVICES) {
        row(out, s);
    }
    for s in analysis
        .services
        .iter()
        .skip(TOP_SERVICES)
        .filter(|s| s.flag().is_some())
    {
        row(out, s);
    }
    let rest: Vec<&ServiceStats> = analysis
        .services
        .iter()
        .skip(TOP_SERVICES)
        .filter(|s| s.flag().is_none())
        .collect();
    if !rest.is_empty() {
        let _ = writeln!(
            out,
            "| ({} more services) | {} | {} | | |",
            rest.len(),
            rest.iter().map(|s| s.samples).sum::<i64>(),
            pct(rest.iter().map(|s| s.samples).sum(), total)
        );
    }
}

fn render_workload(out: &mut String, run: &HostRun) {
    let _ = writeln!(out, "\n#### Workload\n");
    let _ = writeln!(out, "| part | what | started at s | last progress | rate |");
    let _ = writeln!(out, "|---|---|---:|---|---:|");
    let b = &run.build;
    let _ = writeln!(
        out,
        "| parallel build | `make -j4` of {} generated C files (gcc -O2 -g), clean + rebuild in a loop | 1 | {} files compiled, {} complete builds, {} failed{} | mean {} s per build |",
        host_workload::BUILD_FILES,
        b.objects,
        b.builds,
        b.failures,
        b.last_error
            .as_ref()
            .map_or(String::new(), |e| format!(" (last error: {e})")),
        opt(
            (!b.build_seconds.is_empty())
                .then(|| b.build_seconds.iter().sum::<f64>() / b.build_seconds.len() as f64),
            1
        )
    );
    for part in &run.parts {
        let progress = part.progress.as_deref().unwrap_or("");
        let rate = ["spawned", "iterations", "batches", "runs"]
            .iter()
            .find_map(|key| {
                let count = progress_value(progress, key)?;
                let seconds = progress_value(progress, "seconds").filter(|s| *s > 0.0)?;
                Some(format!("{:.0} {key}/s", count / seconds))
            });
        let exited = part.exited.as_ref().map_or(String::new(), |(t, status)| {
            format!("; **exited after {t:.0} s ({status})**")
        });
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {}{exited} | {} |",
            part.name,
            part.description,
            part.started_t,
            if progress.is_empty() { "—" } else { progress },
            rate.unwrap_or_else(|| "—".into())
        );
    }
}

fn render_log(out: &mut String, run: &HostRun) {
    let _ = writeln!(out, "\n#### Agent log\n");
    let _ = writeln!(
        out,
        "- {} `interval` lines; last: {}",
        run.log.intervals,
        run.log
            .last_interval
            .iter()
            .map(|(k, v)| format!("{k} {v:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut warnings: Vec<(&String, &usize)> = run.log.warnings.iter().collect();
    warnings.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    if warnings.is_empty() {
        let _ = writeln!(out, "- no warnings or errors");
    }
    for (message, count) in warnings.iter().take(15) {
        let shown: String = message.chars().take(300).collect();
        let _ = writeln!(out, "- {count}× {shown}");
    }
    if run.agent_died.is_some() {
        let _ = writeln!(out, "\nThe agent's last log lines:\n\n```");
        for line in &run.log.tail {
            let _ = writeln!(out, "{line}");
        }
        let _ = writeln!(out, "```");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll(t: f64, samples: f64, cpu_s: f64) -> Poll {
        Poll {
            t,
            cpu_s: None,
            rss: None,
            load: None,
            forks: None,
            metrics: BTreeMap::from([(SAMPLES.into(), samples), (AGENT_CPU.into(), cpu_s)]),
            interval: BTreeMap::new(),
            bpf: None,
            resident_by_mapping: None,
        }
    }

    #[test]
    fn each_interval_counts_once_and_a_slow_one_moves_the_median_little() {
        // Interval ends every 15 s, polls every 5 s (each end seen three times); 3,000
        // samples an interval at 100 µs each, but the first at 400 µs (a start-up).
        let mut polls = Vec::new();
        let (mut samples, mut cpu) = (0.0, 0.0);
        for interval in 0..7 {
            if interval > 0 {
                samples += 3000.0;
                cpu += 3000.0 * if interval == 1 { 400e-6 } else { 100e-6 };
            }
            for poll_in_interval in 0..3 {
                polls.push(poll(
                    f64::from(interval * 15 + poll_in_interval * 5),
                    samples,
                    cpu,
                ));
            }
        }
        let refs: Vec<&Poll> = polls.iter().collect();
        let us = interval_us_per_sample(&refs);
        assert_eq!(us.len(), 6, "{us:?}");
        assert!((us[0] - 400.0).abs() < 1e-6 && us[1..].iter().all(|u| (u - 100.0).abs() < 1e-6));
        let spread = interval_spread(&us).unwrap();
        assert!((spread.median - 100.0).abs() < 1e-6, "{spread:?}");
        assert_eq!(spread.intervals, 6);
        // The mean over the window counts the slow interval whole.
        let mean = us_per_sample(refs[0], refs[refs.len() - 1]).unwrap();
        assert!((mean - 150.0).abs() < 1e-6, "{mean}");
    }

    #[test]
    fn least_squares_slope() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        assert_eq!(slope(&[(1.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
    }

    #[test]
    fn growth_follows_the_line_not_the_last_point() {
        // Flat at 100 MiB, ±3 from poll to poll, the first poll low and the last high: 9.3 %
        // from one to the other, about nothing along the line.
        let noisy: Vec<(f64, f64)> = (0..49)
            .map(|i| {
                let y = match i {
                    0 => 97.0,
                    48 => 106.0,
                    _ if i % 2 == 0 => 103.0,
                    _ => 97.0,
                };
                (f64::from(i), y)
            })
            .collect();
        assert!(growth(Some(97), Some(106)).unwrap() > TARGET_RSS_GROWTH_PCT);
        let flat = fitted_growth(&noisy).unwrap();
        assert!(flat.abs() < 2.0, "{flat}");
        // A steady climb is growth whatever the endpoints: 100 → 118 over nine polls.
        let climbing: Vec<(f64, f64)> = (0..10)
            .map(|i| (f64::from(i), 100.0 + 2.0 * f64::from(i)))
            .collect();
        assert!((fitted_growth(&climbing).unwrap() - 18.0).abs() < 1e-9);
        assert_eq!(fitted_growth(&[(1.0, 100.0)]), None);
    }
}
