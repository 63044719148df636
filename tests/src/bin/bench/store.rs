//! The `store` suite: the embedded store behind the real HTTP server (`profiler server`, release
//! build). A day of one service's 15 s profiles through `/ingest` (store bytes per service per
//! day), the 24-hour merge of that service through the Connect query API (latency), then 50
//! services' intervals through Connect Push from several clients (ingest throughput).
//! Profiles are realistic in size: 2,000 distinct stacks 8-40 frames deep out of a service's
//! 4,000, skewed counts, gzipped pprof as agents send it.
use std::{
    fmt::Write as _,
    path::Path,
    sync::atomic::{AtomicUsize, Ordering},
    time::Instant,
};

use anyhow::{Context, Result, bail};
use integration_tests::{Scratch, proto, server_harness::*};
use prost::Message;

use crate::procs::check_interrupted;

pub const SERVICES: usize = 50;
pub const STACKS: usize = 2000;
const INTERVAL_S: i64 = 15;
const DAY_S: i64 = 86_400;
/// Distinct interval profiles per service, reused round-robin (generation is client-side cost).
const VARIANTS: usize = 8;
/// Concurrent HTTP clients (50 agents would be 50 connections; a few saturate 2 CPUs).
const CLIENTS: usize = 4;
const QUERY_RUNS: usize = 10;
/// Spans (requests) per 15 s profile of the traced service.
const SPANS_PER_INTERVAL: usize = 50;
/// Spans in the many-span query.
const SPAN_QUERY_SPANS: usize = 100;

const TARGET_PROFILES_PER_S: f64 = 200.0;
const TARGET_MERGE_MS: f64 = 500.0;

#[derive(Debug)]
pub struct Ingest {
    pub profiles: usize,
    pub seconds: f64,
    /// The server's user + system CPU time while ingesting.
    pub server_cpu_s: f64,
}

impl Ingest {
    pub fn per_second(&self) -> f64 {
        self.profiles as f64 / self.seconds
    }
}

/// A day of a service traced with OpenTelemetry: every sample has a `span_id` label.
#[derive(Debug)]
pub struct SpanDay {
    pub ingest: Ingest,
    /// Pages in use added by that day.
    pub used_bytes: f64,
    /// `SelectMergeSpanProfile` of one span (Grafana's traces to profiles), over the day.
    pub one_span_ms: Vec<f64>,
    /// The same with [`SPAN_QUERY_SPANS`] spans spread over the day (a trace's spans).
    pub many_spans_ms: Vec<f64>,
    /// Totals of the two answers (checked non-zero).
    pub one_span_total: i64,
    pub many_spans_total: i64,
}

#[derive(Debug)]
pub struct StoreRun {
    pub intervals: usize,
    pub mean_gzip_bytes: f64,
    pub mean_raw_bytes: f64,
    pub day: Ingest,
    /// Pages in use after one service's day (`profiler_store_bytes`).
    pub day_used_bytes: f64,
    /// The database and its WAL on disk after that day.
    pub day_file_bytes: u64,
    pub merge_ms: Vec<f64>,
    pub merge_json_ms: Vec<f64>,
    /// `/pyroscope/render-diff` of the day's two halves.
    pub render_diff_ms: Vec<f64>,
    /// A day of a second service whose samples name their trace span.
    pub spans: SpanDay,
    pub merge_total: i64,
    pub merge_names: usize,
    pub throughput: Ingest,
    pub merge_after_ms: Vec<f64>,
    pub server_peak_rss_bytes: u64,
}

/// (utime + stime) of a process in seconds, from /proc/PID/stat.
fn process_cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("cannot read /proc/{pid}/stat"))?;
    // Fields after the parenthesized command name; utime and stime are fields 14 and 15.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("malformed /proc/PID/stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / per_second)
}

fn peak_rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                let kib = line.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?;
                kib.trim().parse::<u64>().ok()
            })
        })
        .map_or(0, |kib| kib * 1024)
}

/// Runs `jobs` on `CLIENTS` threads; each job is an index; any non-2xx fails the run.
fn run_parallel(
    client: &Client,
    jobs: usize,
    request: impl Fn(&Client, usize) -> HttpResponse + Sync,
) -> Result<f64> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let client = client.clone();
                let next = &next;
                let request = &request;
                scope.spawn(move || {
                    loop {
                        let job = next.fetch_add(1, Ordering::Relaxed);
                        if job >= jobs {
                            return None;
                        }
                        let response = request(&client, job);
                        if response.status != 200 {
                            next.store(jobs, Ordering::Relaxed);
                            return Some(format!("{} {}", response.status, response.text()));
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().expect("client thread"))
            .collect()
    });
    if let Some(failure) = failures.first() {
        bail!("an ingest request failed: {failure}");
    }
    Ok(started.elapsed().as_secs_f64())
}

fn merge_latencies(client: &Client, codec_json: bool, runs: usize) -> (Vec<f64>, i64, usize) {
    let end = unix_now_ms();
    let start = end - DAY_S * 1000;
    let selector = r#"{service_name="svc-0"}"#;
    let mut times = Vec::with_capacity(runs);
    let (mut total, mut names) = (0, 0);
    for _ in 0..runs {
        let began = Instant::now();
        if codec_json {
            let response = client.connect_json(
                "querier.v1.QuerierService/SelectMergeStacktraces",
                serde_json::json!({"profileTypeID": CPU_TYPE, "labelSelector": selector,
                                   "start": start.to_string(), "end": end.to_string()}),
            );
            names = response["flamegraph"]["names"]
                .as_array()
                .map_or(0, Vec::len);
        } else {
            // The default node limit, as Grafana and the UI ask.
            let response: api::SelectMergeStacktracesResponse = client.connect(
                "querier.v1.QuerierService/SelectMergeStacktraces",
                &api::SelectMergeStacktracesRequest {
                    profile_type_id: CPU_TYPE.into(),
                    label_selector: selector.into(),
                    start,
                    end,
                    max_nodes: None,
                    format: 1,
                    stack_trace_selector: None,
                    ..Default::default()
                },
            );
            let graph = response.flamegraph.unwrap_or_default();
            total = graph.total;
            names = graph.names.len();
        }
        times.push(began.elapsed().as_secs_f64() * 1000.0);
    }
    (times, total, names)
}

/// `/pyroscope/render-diff` (Profiles Drilldown's diff view) of svc-0's first 12 hours against
/// its last 12: round-trip milliseconds per run.
fn render_diff_latencies(client: &Client, runs: usize) -> Result<Vec<f64>> {
    let end = unix_now_ms();
    let middle = end - DAY_S * 500;
    let start = end - DAY_S * 1000;
    let query = format!("{CPU_TYPE}%7Bservice_name%3D%22svc-0%22%7D");
    let path = format!(
        "/pyroscope/render-diff?leftQuery={query}&leftFrom={start}&leftUntil={middle}\
         &rightQuery={query}&rightFrom={middle}&rightUntil={end}"
    );
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let began = Instant::now();
        let response = client.get(&path);
        times.push(began.elapsed().as_secs_f64() * 1000.0);
        if response.status != 200 || !response.text().contains("flamebearer") {
            bail!(
                "render-diff answered {}: {}",
                response.status,
                response.text()
            );
        }
    }
    Ok(times)
}

/// The span id of request `k` of interval `interval` (never zero).
fn span_id(interval: usize, k: usize) -> String {
    format!("{:016x}", (interval * SPANS_PER_INTERVAL + k + 1) as u64)
}

/// `profile` with every sample tagged with one of the interval's spans (round-robin), as the
/// pyroscope-otel span processor tags an instrumented service's samples.
fn with_span_labels(mut profile: proto::Profile, interval: usize) -> proto::Profile {
    let key = profile.string_table.len() as i64;
    profile.string_table.push("span_id".into());
    let first = profile.string_table.len() as i64;
    profile
        .string_table
        .extend((0..SPANS_PER_INTERVAL).map(|k| span_id(interval, k)));
    for (i, sample) in profile.sample.iter_mut().enumerate() {
        sample.label.push(proto::Label {
            key,
            str: first + (i % SPANS_PER_INTERVAL) as i64,
            ..Default::default()
        });
    }
    profile
}

/// `SelectMergeSpanProfile` of `span_ids` over the last day: round-trip ms per run, and the
/// answer's total.
fn span_latencies(client: &Client, span_ids: &[String], runs: usize) -> (Vec<f64>, i64) {
    let end = unix_now_ms();
    let start = end - DAY_S * 1000;
    let mut times = Vec::with_capacity(runs);
    let mut total = 0;
    for _ in 0..runs {
        let began = Instant::now();
        let response: api::SelectMergeSpanProfileResponse = client.connect(
            "querier.v1.QuerierService/SelectMergeSpanProfile",
            &api::SelectMergeSpanProfileRequest {
                profile_type_id: CPU_TYPE.into(),
                label_selector: r#"{service_name="svc-traced"}"#.into(),
                span_selector: span_ids.to_vec(),
                start,
                end,
                max_nodes: None,
                format: 0,
            },
        );
        times.push(began.elapsed().as_secs_f64() * 1000.0);
        total = response.flamegraph.unwrap_or_default().total;
    }
    (times, total)
}

/// A day of `svc-traced` (svc-1's profiles with span labels) through /ingest, then the span
/// queries Grafana's traces to profiles sends.
fn span_day(client: &Client, pid: u32, variants: &[proto::Profile]) -> Result<SpanDay> {
    let day_profiles = (DAY_S / INTERVAL_S) as usize;
    eprintln!(
        "bench: [store] one day of svc-traced: {day_profiles} profiles with {SPANS_PER_INTERVAL} spans each through /ingest"
    );
    let day_start = unix_now_ns() / 1_000_000_000 - DAY_S;
    let used_before = client
        .metric("profiler_store_bytes")
        .context("no profiler_store_bytes in /metrics")?;
    let cpu_before = process_cpu_seconds(pid)?;
    let seconds = run_parallel(client, day_profiles, |client, i| {
        let from = day_start + i as i64 * INTERVAL_S;
        let profile = with_span_labels(variants[i % VARIANTS].clone(), i);
        client.post(
            &format!(
                "/ingest?name=svc-traced&format=pprof&from={from}&until={}",
                from + INTERVAL_S
            ),
            "application/octet-stream",
            &gzip(&profile.encode_to_vec()),
        )
    })?;
    let ingest = Ingest {
        profiles: day_profiles,
        seconds,
        server_cpu_s: process_cpu_seconds(pid)? - cpu_before,
    };
    let used_bytes = client
        .metric("profiler_store_bytes")
        .context("no profiler_store_bytes in /metrics")?
        - used_before;
    eprintln!("bench: [store] span profiles over the day, {QUERY_RUNS} times each");
    let (one_span_ms, one_span_total) =
        span_latencies(client, &[span_id(day_profiles / 2, 7)], QUERY_RUNS);
    let spread: Vec<String> = (0..SPAN_QUERY_SPANS)
        .map(|n| span_id(n * day_profiles / SPAN_QUERY_SPANS, n % SPANS_PER_INTERVAL))
        .collect();
    let (many_spans_ms, many_spans_total) = span_latencies(client, &spread, QUERY_RUNS);
    if one_span_total <= 0 || many_spans_total <= one_span_total {
        bail!(
            "span profiles: one span's total {one_span_total}, {SPAN_QUERY_SPANS} spans' {many_spans_total}"
        );
    }
    Ok(SpanDay {
        ingest,
        used_bytes,
        one_span_ms,
        many_spans_ms,
        one_span_total,
        many_spans_total,
    })
}

pub fn run(profiler: &Path, scratch: &Scratch, intervals: usize) -> Result<StoreRun> {
    eprintln!(
        "bench: [store] generating {VARIANTS} profiles of {STACKS} stacks for each of {SERVICES} services"
    );
    let services: Vec<Vec<Vec<u8>>> = (0..SERVICES)
        .map(|service| {
            let pool = service_stack_pool(service, STACKS * 2);
            (0..VARIANTS)
                .map(|seed| {
                    // time 0: the server stamps it (Push) or takes `from` (/ingest).
                    synthetic_profile_from_pool(&pool, seed as u64, STACKS, 0).encode_to_vec()
                })
                .collect()
        })
        .collect();
    let mean_raw_bytes = services[0].iter().map(Vec::len).sum::<usize>() as f64 / VARIANTS as f64;
    let gzipped: Vec<Vec<Vec<u8>>> = services
        .iter()
        .map(|variants| variants.iter().map(|raw| gzip(raw)).collect())
        .collect();
    let mean_gzip_bytes = gzipped[0].iter().map(Vec::len).sum::<usize>() as f64 / VARIANTS as f64;
    check_interrupted()?;

    let data_dir = scratch.path("store-bench");
    let mut server = ServerProcess::start_with(profiler, &data_dir, &[]);
    let pid = server.process.pid();
    let client = server.client();

    // One service's day, oldest first, through /ingest with explicit times.
    let day_profiles = (DAY_S / INTERVAL_S) as usize;
    eprintln!("bench: [store] one day of svc-0: {day_profiles} profiles through /ingest");
    let day_start = unix_now_ns() / 1_000_000_000 - DAY_S;
    let cpu_before = process_cpu_seconds(pid)?;
    let seconds = run_parallel(&client, day_profiles, |client, i| {
        let from = day_start + i as i64 * INTERVAL_S;
        client.post(
            &format!(
                "/ingest?name=svc-0&format=pprof&from={from}&until={}",
                from + INTERVAL_S
            ),
            "application/octet-stream",
            &gzipped[0][i % VARIANTS],
        )
    })?;
    let day = Ingest {
        profiles: day_profiles,
        seconds,
        server_cpu_s: process_cpu_seconds(pid)? - cpu_before,
    };
    let day_used_bytes = client
        .metric("profiler_store_bytes")
        .context("no profiler_store_bytes in /metrics")?;
    let day_file_bytes = ["profiles.db", "profiles.db-wal"]
        .iter()
        .filter_map(|name| std::fs::metadata(data_dir.join(name)).ok())
        .map(|m| m.len())
        .sum();
    check_interrupted()?;

    eprintln!("bench: [store] 24-hour merge of svc-0, {QUERY_RUNS} times per codec");
    let (merge_ms, merge_total, merge_names) = merge_latencies(&client, false, QUERY_RUNS);
    if merge_total <= 0 {
        bail!("the 24-hour merge of svc-0 is empty");
    }
    let (merge_json_ms, _, _) = merge_latencies(&client, true, QUERY_RUNS);
    eprintln!("bench: [store] 24-hour render-diff of svc-0, {QUERY_RUNS} times");
    let render_diff_ms = render_diff_latencies(&client, QUERY_RUNS)?;
    check_interrupted()?;
    let pool = service_stack_pool(1, STACKS * 2);
    let traced: Vec<proto::Profile> = (0..VARIANTS)
        .map(|seed| synthetic_profile_from_pool(&pool, seed as u64, STACKS, 0))
        .collect();
    let spans = span_day(&client, pid, &traced)?;
    check_interrupted()?;

    // 50 services' intervals, interval by interval as agents send them, through Push.
    let jobs = SERVICES * intervals;
    eprintln!(
        "bench: [store] ingest throughput: {SERVICES} services x {intervals} intervals = {jobs} profiles through Connect Push, {CLIENTS} clients"
    );
    let requests: Vec<Vec<u8>> = (0..SERVICES)
        .flat_map(|service| {
            gzipped[service].iter().map(move |profile| {
                api::PushRequest {
                    series: vec![api::RawProfileSeries {
                        labels: vec![
                            api::LabelPair {
                                name: "__name__".into(),
                                value: "process_cpu".into(),
                            },
                            api::LabelPair {
                                name: "service_name".into(),
                                value: format!("svc-{service}"),
                            },
                        ],
                        samples: vec![api::RawSample {
                            raw_profile: profile.clone(),
                            id: String::new(),
                        }],
                    }],
                }
                .encode_to_vec()
            })
        })
        .collect();
    let cpu_before = process_cpu_seconds(pid)?;
    let seconds = run_parallel(&client, jobs, |client, job| {
        let (interval, service) = (job / SERVICES, job % SERVICES);
        client.post(
            "/push.v1.PusherService/Push",
            "application/proto",
            &requests[service * VARIANTS + interval % VARIANTS],
        )
    })?;
    let throughput = Ingest {
        profiles: jobs,
        seconds,
        server_cpu_s: process_cpu_seconds(pid)? - cpu_before,
    };
    let (merge_after_ms, _, _) = merge_latencies(&client, false, QUERY_RUNS);
    let server_peak_rss_bytes = peak_rss_bytes(pid);
    let (status, stderr) = server.process.stop();
    if !status.success() {
        bail!(
            "profiler server failed ({status}):\n{}",
            crate::tail(&stderr, 20)
        );
    }
    Ok(StoreRun {
        intervals,
        mean_gzip_bytes,
        mean_raw_bytes,
        day,
        day_used_bytes,
        day_file_bytes,
        merge_ms,
        merge_json_ms,
        render_diff_ms,
        spans,
        merge_total,
        merge_names,
        throughput,
        merge_after_ms,
        server_peak_rss_bytes,
    })
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::NAN, f64::max)
}

fn mark(ok: bool) -> &'static str {
    if ok { "met" } else { "**missed**" }
}

const MIB: f64 = (1 << 20) as f64;

pub fn render(r: &StoreRun) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Store and server\n");
    let _ = writeln!(
        out,
        "- profiles: {STACKS} distinct stacks (8-40 frames) of a service's {}, {:.0} KiB pprof, {:.0} KiB gzipped; one `profiler server` (release), {CLIENTS} concurrent HTTP clients on loopback",
        STACKS * 2,
        r.mean_raw_bytes / 1024.0,
        r.mean_gzip_bytes / 1024.0
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "| measure | result | target |");
    let _ = writeln!(out, "|---|---|---|");
    let t = &r.throughput;
    let _ = writeln!(
        out,
        "| ingest throughput, Connect Push, {SERVICES} services × {} intervals ({} profiles) | {:.0} profiles/s ({:.1} s; server CPU {:.1} ms per profile) | ≥ {TARGET_PROFILES_PER_S:.0} profiles/s: {} |",
        r.intervals,
        t.profiles,
        t.per_second(),
        t.seconds,
        t.server_cpu_s * 1000.0 / t.profiles as f64,
        mark(t.per_second() >= TARGET_PROFILES_PER_S)
    );
    let d = &r.day;
    let _ = writeln!(
        out,
        "| ingest, `/ingest` with times, one service's day ({} profiles) | {:.0} profiles/s ({:.1} s; server CPU {:.1} ms per profile) | |",
        d.profiles,
        d.per_second(),
        d.seconds,
        d.server_cpu_s * 1000.0 / d.profiles as f64
    );
    let merged = max(&r.merge_ms).max(max(&r.merge_after_ms));
    let _ = writeln!(
        out,
        "| 24-hour merge of one service ({} profiles), SelectMergeStacktraces protobuf | median {:.0} ms, max {:.0} ms; after the 50-service ingest median {:.0} ms, max {:.0} ms | ≤ {TARGET_MERGE_MS:.0} ms: {} |",
        d.profiles,
        median(&r.merge_ms),
        max(&r.merge_ms),
        median(&r.merge_after_ms),
        max(&r.merge_after_ms),
        mark(merged <= TARGET_MERGE_MS)
    );
    let _ = writeln!(
        out,
        "| the same merge, JSON (the web UI) | median {:.0} ms, max {:.0} ms | |",
        median(&r.merge_json_ms),
        max(&r.merge_json_ms)
    );
    let _ = writeln!(
        out,
        "| `/pyroscope/render-diff` of the same day's two halves (Drilldown's diff view, flamebearer JSON) | median {:.0} ms, max {:.0} ms | |",
        median(&r.render_diff_ms),
        max(&r.render_diff_ms)
    );
    let sp = &r.spans;
    let _ = writeln!(
        out,
        "| ingest, `/ingest` with times, a traced service's day ({} profiles, {SPANS_PER_INTERVAL} `span_id`s each) | {:.0} profiles/s ({:.1} s; server CPU {:.1} ms per profile); {:.1} MiB of pages in use | |",
        sp.ingest.profiles,
        sp.ingest.per_second(),
        sp.ingest.seconds,
        sp.ingest.server_cpu_s * 1000.0 / sp.ingest.profiles as f64,
        sp.used_bytes / MIB
    );
    let _ = writeln!(
        out,
        "| SelectMergeSpanProfile over that day: one span (traces to profiles) | median {:.0} ms, max {:.0} ms ({:.2} CPU-s) | |",
        median(&sp.one_span_ms),
        max(&sp.one_span_ms),
        sp.one_span_total as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "| the same, {SPAN_QUERY_SPANS} spans spread over the day | median {:.0} ms, max {:.0} ms ({:.2} CPU-s) | |",
        median(&sp.many_spans_ms),
        max(&sp.many_spans_ms),
        sp.many_spans_total as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "| store size per service per day (15 s intervals) | {:.1} MiB of pages in use; {:.1} MiB database + WAL files | |",
        r.day_used_bytes / MIB,
        r.day_file_bytes as f64 / MIB
    );
    let _ = writeln!(
        out,
        "| server peak RSS | {:.0} MiB | |",
        r.server_peak_rss_bytes as f64 / MIB
    );
    let _ = writeln!(
        out,
        "\n- the merged flame graph has {} names (default node limit) and a total of {:.1} CPU-hours.",
        r.merge_names,
        r.merge_total as f64 / 3.6e12
    );
    let _ = writeln!(
        out,
        "- latency is the client's round trip (request, merge, flame graph, encoding); each figure is over {QUERY_RUNS} runs, the first one included (a cold page cache would add the file reads)."
    );
    out
}
