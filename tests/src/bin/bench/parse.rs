//! Parsers for what the bench reads: BPF fdinfo, the agent's JSON log, perf's stderr, the
//! workload's output. All of them tolerate missing or malformed input (they return `None`)
//! because kernels, perf versions and log formats vary.
use std::collections::BTreeMap;

/// Kernel statistics of one BPF program, from `/proc/PID/fdinfo/FD`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgStats {
    /// `prog_id:` (absent on old kernels: 0), used to count a program held by two fds once.
    pub prog_id: u64,
    /// `prog_type:` (7 is `BPF_PROG_TYPE_PERF_EVENT`, the sampler).
    pub prog_type: u32,
    pub run_time_ns: u64,
    pub run_cnt: u64,
}

/// Parses one fdinfo file. `None` unless it describes a BPF program (`prog_type:`) with both
/// run counters (kernels without BPF stats omit them).
pub fn parse_prog_fdinfo(text: &str) -> Option<ProgStats> {
    let mut prog_type = None;
    let mut prog_id = 0;
    let mut run_time_ns = None;
    let mut run_cnt = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key.trim() {
            "prog_type" => prog_type = Some(value.parse().unwrap_or(u32::MAX)),
            "prog_id" => prog_id = value.parse().unwrap_or(0),
            "run_time_ns" => run_time_ns = value.parse().ok(),
            "run_cnt" => run_cnt = value.parse().ok(),
            _ => {}
        }
    }
    Some(ProgStats {
        prog_id,
        prog_type: prog_type?,
        run_time_ns: run_time_ns?,
        run_cnt: run_cnt?,
    })
}

/// The figures of the agent's final `recording finished` log line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentSummary {
    pub samples_seen: u64,
    pub samples_processed: u64,
    pub samples_dropped: u64,
    pub agent_cpu_us: u64,
    pub bpf_run_time_ns: u64,
    pub bpf_run_count: u64,
    pub peak_rss_bytes: u64,
}

/// Finds the last `recording finished` line in the agent's JSON log (`--log-format json`: one
/// object per line, the values under `fields`). Missing numeric fields read as 0.
pub fn parse_agent_summary(stderr: &str) -> Option<AgentSummary> {
    stderr.lines().rev().find_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        let fields = value.get("fields")?;
        if fields.get("message")?.as_str()? != "recording finished" {
            return None;
        }
        let num = |key: &str| {
            fields
                .get(key)
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0)
        };
        Some(AgentSummary {
            samples_seen: num("samples_seen"),
            samples_processed: num("samples_processed"),
            samples_dropped: num("samples_dropped"),
            agent_cpu_us: num("agent_cpu_us"),
            bpf_run_time_ns: num("bpf_run_time_ns"),
            bpf_run_count: num("bpf_run_count"),
            peak_rss_bytes: num("peak_rss_bytes"),
        })
    })
}

/// The sample count from perf record's closing line, e.g.
/// `[ perf record: Captured and wrote 1.234 MB perf.data (4012 samples) ]`.
pub fn parse_perf_samples(stderr: &str) -> Option<u64> {
    stderr.lines().rev().find_map(|line| {
        let (before, _) = line.split_once(" samples)")?;
        let (_, count) = before.rsplit_once('(')?;
        count.trim().parse().ok()
    })
}

/// The workload's `units=N seconds=S` line.
pub fn parse_workload_output(stdout: &str) -> Option<(u64, f64)> {
    stdout.lines().rev().find_map(|line| {
        let mut units = None;
        let mut seconds = None;
        for word in line.split_whitespace() {
            if let Some(v) = word.strip_prefix("units=") {
                units = v.parse().ok();
            } else if let Some(v) = word.strip_prefix("seconds=") {
                seconds = v.parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0);
            }
        }
        Some((units?, seconds?))
    })
}

/// The agent's debug line `recording finished: BPF counters` (`RUST_LOG=profiler=debug`): the
/// BPF counters and the native table manager's `NativeTableStats`, both logged with `Debug`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentCounters {
    /// BPF counters by name (`samples_seen`, `unwind_complete`, `unwind_frames`, ...).
    pub bpf: BTreeMap<String, u64>,
    /// `NativeTableStats` fields by name; `build_time` is kept as text (e.g. `11.3ms`).
    pub tables: BTreeMap<String, String>,
}

impl AgentCounters {
    pub fn bpf(&self, name: &str) -> u64 {
        self.bpf.get(name).copied().unwrap_or(0)
    }

    pub fn table(&self, name: &str) -> Option<u64> {
        self.tables.get(name).and_then(|v| v.parse().ok())
    }
}

/// Finds the last `recording finished: BPF counters` line of the JSON log.
pub fn parse_agent_counters(stderr: &str) -> Option<AgentCounters> {
    stderr.lines().rev().find_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        let fields = value.get("fields")?;
        if fields.get("message")?.as_str()? != "recording finished: BPF counters" {
            return None;
        }
        let mut counters = AgentCounters::default();
        // `{"samples_seen": 223, "samples_sent": 24}`
        let bpf = fields.get("counters")?.as_str()?;
        for pair in debug_fields(bpf.trim().trim_start_matches('{').trim_end_matches('}')) {
            if let Ok(n) = pair.1.parse() {
                counters.bpf.insert(pair.0.trim_matches('"').to_string(), n);
            }
        }
        // `NativeTableStats { tables_loaded: 6, ..., build_time: 11.343566ms }`
        if let Some(tables) = fields.get("tables").and_then(serde_json::Value::as_str) {
            let inner = tables
                .split_once('{')
                .map_or("", |(_, rest)| rest.trim_end().trim_end_matches('}'));
            for (key, value) in debug_fields(inner) {
                counters.tables.insert(key.to_string(), value.to_string());
            }
        }
        Some(counters)
    })
}

/// The distinct notable lines of the agent's JSON log: warnings, errors, and the `no unwind
/// table` notes, as `LEVEL message (file)`, in order of first appearance.
pub fn notable_log_lines(stderr: &str) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for line in stderr.lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line.trim()) else {
            continue;
        };
        let level = value
            .get("level")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let Some(fields) = value.get("fields") else {
            continue;
        };
        let message = fields
            .get("message")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        if !(level == "WARN" || level == "ERROR" || message.starts_with("no unwind table")) {
            continue;
        }
        let mut text = format!("{level} {message}");
        if let Some(file) = fields.get("file").and_then(serde_json::Value::as_str) {
            text.push_str(&format!(" ({file})"));
        }
        if !lines.contains(&text) {
            lines.push(text);
        }
    }
    lines
}

/// `a: 1, b: 2` → [(a, 1), (b, 2)], trimmed; pairs without `:` are skipped.
fn debug_fields(text: &str) -> Vec<(&str, &str)> {
    text.split(',')
        .filter_map(|pair| {
            let (key, value) = pair.split_once(':')?;
            Some((key.trim(), value.trim()))
        })
        .filter(|(key, _)| !key.is_empty())
        .collect()
}

/// The `q`-quantile (0..=1) of `values` by the nearest-rank method; `None` when empty.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median: the mean of the two middle values for an even count.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_of_a_program() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nprog_type:\t7\n\
                    prog_jited:\t1\nprog_tag:\tdeadbeefdeadbeef\nmemlock:\t4096\nprog_id:\t42\n\
                    run_time_ns:\t123456\nrun_cnt:\t100\nrecursion_misses:\t0\n";
        assert_eq!(
            parse_prog_fdinfo(text),
            Some(ProgStats {
                prog_id: 42,
                prog_type: 7,
                run_time_ns: 123456,
                run_cnt: 100
            })
        );
    }

    #[test]
    fn fdinfo_without_program_or_counters() {
        assert_eq!(
            parse_prog_fdinfo("pos:\t0\nflags:\t02\nmnt_id:\t15\n"),
            None
        );
        assert_eq!(parse_prog_fdinfo("map_type:\t27\nrun_cnt:\t5\n"), None);
        assert_eq!(parse_prog_fdinfo("prog_type:\t7\nprog_id:\t3\n"), None);
        assert_eq!(
            parse_prog_fdinfo("prog_type:\t7\nrun_time_ns:\tx\nrun_cnt:\t1\n"),
            None
        );
        assert_eq!(parse_prog_fdinfo(""), None);
    }

    #[test]
    fn agent_summary_from_json_log() {
        let log = r#"{"timestamp":"t","level":"INFO","fields":{"message":"sampling started"},"target":"profiler"}
not json at all
{"timestamp":"t","level":"INFO","fields":{"message":"recording finished","samples_seen":4000,"samples_processed":3990,"samples_dropped":0,"agent_cpu_us":51000,"bpf_run_time_ns":8000000,"bpf_run_count":4001,"rss_bytes":1,"peak_rss_bytes":20000000},"target":"profiler::self_metrics"}
{"timestamp":"t","level":"INFO","fields":{"message":"profile written","samples":3990},"target":"profiler"}"#;
        let summary = parse_agent_summary(log).expect("summary");
        assert_eq!(summary.samples_processed, 3990);
        assert_eq!(summary.agent_cpu_us, 51000);
        assert_eq!(summary.bpf_run_count, 4001);
        assert_eq!(summary.peak_rss_bytes, 20_000_000);
        assert_eq!(parse_agent_summary("plain text log\n{}\n"), None);
    }

    #[test]
    fn agent_counters_from_debug_line() {
        let log = r#"{"timestamp":"t","level":"DEBUG","fields":{"message":"recording finished: BPF counters","counters":"{\"idle\": 199, \"samples_seen\": 223, \"unwind_frames\": 215}","tables":"NativeTableStats { tables_loaded: 6, tables_built: 6, processes_registered: 2, build_time: 11.343566ms }"},"target":"profiler::self_metrics"}
{"timestamp":"t","level":"INFO","fields":{"message":"recording finished","samples_seen":223},"target":"profiler::self_metrics"}"#;
        let counters = parse_agent_counters(log).expect("counters");
        assert_eq!(counters.bpf("samples_seen"), 223);
        assert_eq!(counters.bpf("unwind_frames"), 215);
        assert_eq!(counters.bpf("missing"), 0);
        assert_eq!(counters.table("tables_loaded"), Some(6));
        assert_eq!(counters.table("processes_registered"), Some(2));
        assert_eq!(counters.table("build_time"), None);
        assert_eq!(
            counters.tables.get("build_time").map(String::as_str),
            Some("11.343566ms")
        );
        assert_eq!(parse_agent_counters("not json\n{}\n"), None);
    }

    #[test]
    fn notable_lines() {
        let log = r#"{"level":"INFO","fields":{"message":"sampling started"}}
{"level":"INFO","fields":{"message":"no unwind table, using frame pointers: bad","file":"/x.so"}}
{"level":"WARN","fields":{"message":"slow"}}
{"level":"WARN","fields":{"message":"slow"}}
garbage"#;
        assert_eq!(
            notable_log_lines(log),
            [
                "INFO no unwind table, using frame pointers: bad (/x.so)",
                "WARN slow"
            ]
        );
    }

    #[test]
    fn perf_sample_line() {
        let stderr = "[ perf record: Woken up 3 times to write data ]\n\
                      [ perf record: Captured and wrote 1.234 MB /tmp/x/perf.data (4012 samples) ]\n";
        assert_eq!(parse_perf_samples(stderr), Some(4012));
        assert_eq!(
            parse_perf_samples("[ perf record: Captured and wrote 0 MB ]\n"),
            None
        );
        assert_eq!(parse_perf_samples("( samples)"), None);
    }

    #[test]
    fn workload_output() {
        assert_eq!(
            parse_workload_output("units=1238 seconds=1.003014\n"),
            Some((1238, 1.003014))
        );
        assert_eq!(parse_workload_output("units=5\n"), None);
        assert_eq!(parse_workload_output("units=5 seconds=0\n"), None);
        assert_eq!(parse_workload_output(""), None);
    }

    #[test]
    fn quantiles() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        let values: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&values, 0.9), Some(9.0));
        assert_eq!(quantile(&values, 1.0), Some(10.0));
        assert_eq!(quantile(&[f64::NAN], 0.5), None);
    }
}
