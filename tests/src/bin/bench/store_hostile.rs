//! The `store` suite's hostile-input stage: the attacks of the hardening issue against a fresh
//! `profiler server` (release, default limits), with the server's memory before and after.
//! - cardinality: one million distinct values of one series label in one service, pushed as
//!   200 Connect Push requests of 5,000 series each (the labels differ, the profile is tiny);
//! - selectors: a `LabelNames` call with 200,000 matchers;
//! - meanwhile and afterwards, how long `/healthz` and a `LabelNames` query take.
use std::{fmt::Write as _, time::Instant};

use anyhow::{Result, bail};
use integration_tests::{Scratch, server_harness::*};
use prost::Message;

const PUSHES: usize = 200;
const SERIES_PER_PUSH: usize = 5_000;
const MATCHERS: usize = 200_000;

#[derive(Debug)]
pub struct HostileRun {
    pub rss_start: u64,
    pub accepted: usize,
    pub refused: usize,
    pub other: usize,
    pub first_refusal: String,
    pub push_seconds: f64,
    pub rss_after_cardinality: u64,
    pub label_values_after: usize,
    pub label_names_ms: f64,
    pub healthz_ms: f64,
    pub matchers_status: u16,
    pub matchers_ms: f64,
    pub rss_after_matchers: u64,
    pub peak: u64,
    pub restart_ms: f64,
    pub rss_after_restart: u64,
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                let kib = line.strip_prefix(field)?.trim().strip_suffix("kB")?;
                kib.trim().parse::<u64>().ok()
            })
        })
        .map_or(0, |kib| kib * 1024)
}

fn timed<T>(run: impl FnOnce() -> T) -> (T, f64) {
    let started = Instant::now();
    let value = run();
    (value, started.elapsed().as_secs_f64() * 1000.0)
}

pub fn run(profiler: &std::path::Path, scratch: &Scratch) -> Result<HostileRun> {
    let data_dir = scratch.path("store-hostile");
    let mut server = ServerProcess::start_with(profiler, &data_dir, &[]);
    let pid = server.process.pid();
    let client = server.client();
    let rss_start = status_kib(pid, "VmRSS:");

    eprintln!(
        "bench: [store] hostile: {} distinct values of one label in {PUSHES} pushes",
        PUSHES * SERIES_PER_PUSH
    );
    let profile = pprof_from_stacks(&[(vec!["main".into(), "attack".into()], 1)], unix_now_ns());
    let template = push_request(
        &[("service_name", "attacked"), ("attack_id", "0")],
        &profile,
    )
    .series
    .remove(0);
    let (mut accepted, mut refused, mut other) = (0, 0, 0);
    let mut first_refusal = String::new();
    let started = Instant::now();
    for push in 0..PUSHES {
        let series = (0..SERIES_PER_PUSH)
            .map(|i| {
                let mut series = template.clone();
                for label in &mut series.labels {
                    if label.name == "attack_id" {
                        label.value = format!("v{}", push * SERIES_PER_PUSH + i);
                    }
                }
                series
            })
            .collect();
        let body = api::PushRequest { series }.encode_to_vec();
        let response = client.post("/push.v1.PusherService/Push", "application/proto", &body);
        match response.status {
            200 => accepted += 1,
            400 | 429 => {
                refused += 1;
                if first_refusal.is_empty() {
                    first_refusal = format!("{} {}", response.status, response.text());
                }
            }
            _ => other += 1,
        }
    }
    let push_seconds = started.elapsed().as_secs_f64();
    let rss_after_cardinality = status_kib(pid, "VmRSS:");
    let (values, _) = timed(|| client.label_values("attack_id", None));
    let (names, label_names_ms) = timed(|| {
        client.request(
            "POST",
            "/querier.v1.QuerierService/LabelNames",
            &[("Content-Type", "application/json")],
            Some(b"{}"),
        )
    });
    if names.status != 200 {
        bail!(
            "LabelNames after the attack: {} {}",
            names.status,
            names.text()
        );
    }
    let (_, healthz_ms) = timed(|| client.get("/healthz"));

    eprintln!("bench: [store] hostile: LabelNames with {MATCHERS} matchers");
    let matchers: Vec<String> = (0..MATCHERS).map(|i| format!("l{i}=\"v\"")).collect();
    let body = serde_json::json!({ "matchers": [format!("{{{}}}", matchers.join(","))] });
    let (response, matchers_ms) = timed(|| {
        client.request(
            "POST",
            "/querier.v1.QuerierService/LabelNames",
            &[("Content-Type", "application/json")],
            Some(body.to_string().as_bytes()),
        )
    });
    let rss_after_matchers = status_kib(pid, "VmRSS:");
    let peak = status_kib(pid, "VmHWM:");
    let (status, stderr) = server.process.stop();
    if !status.success() {
        bail!(
            "profiler server failed ({status}):\n{}",
            crate::tail(&stderr, 20)
        );
    }
    // Reopening the attacked store: how long until it answers, and its memory then.
    let (mut reopened, restart_ms) = timed(|| ServerProcess::start_with(profiler, &data_dir, &[]));
    let rss_after_restart = status_kib(reopened.process.pid(), "VmRSS:");
    let _ = reopened.process.stop();
    Ok(HostileRun {
        rss_start,
        accepted,
        refused,
        other,
        first_refusal,
        push_seconds,
        rss_after_cardinality,
        label_values_after: values.len(),
        label_names_ms,
        healthz_ms,
        matchers_status: response.status,
        matchers_ms,
        rss_after_matchers,
        peak,
        restart_ms,
        rss_after_restart,
    })
}

const MIB: f64 = (1 << 20) as f64;

pub fn render(r: &HostileRun) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n#### Hostile input (default limits)\n");
    let _ = writeln!(out, "| attack | answer | server memory (VmRSS) |");
    let _ = writeln!(out, "|---|---|---|");
    let _ = writeln!(
        out,
        "| {} distinct values of one label, {PUSHES} pushes of {SERIES_PER_PUSH} series | {} accepted, {} refused, {} other in {:.1} s; first refusal: {}; `LabelValues attack_id` then lists {}; `LabelNames` {:.0} ms, `/healthz` {:.0} ms | {:.1} MiB before, {:.1} MiB after |",
        PUSHES * SERIES_PER_PUSH,
        r.accepted,
        r.refused,
        r.other,
        r.push_seconds,
        r.first_refusal
            .replace('|', "\\|")
            .chars()
            .take(160)
            .collect::<String>(),
        r.label_values_after,
        r.label_names_ms,
        r.healthz_ms,
        r.rss_start as f64 / MIB,
        r.rss_after_cardinality as f64 / MIB
    );
    let _ = writeln!(
        out,
        "| `LabelNames` with {MATCHERS} matchers | {} in {:.0} ms | {:.1} MiB after |",
        r.matchers_status,
        r.matchers_ms,
        r.rss_after_matchers as f64 / MIB
    );
    let _ = writeln!(
        out,
        "| reopening the attacked store | answering after {:.0} ms | {:.1} MiB; peak during the attacks (VmHWM) {:.1} MiB |",
        r.restart_ms,
        r.rss_after_restart as f64 / MIB,
        r.peak as f64 / MIB
    );
    out
}
