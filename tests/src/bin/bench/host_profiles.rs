//! Reads the `host` suite's profiles back: after the agent has stopped, `profiler server` opens
//! the agent's embedded store and the whole run is fetched per service as merged pprof through
//! `/api/pprof` (the web UI's download). Then: stack quality over every sample, per-service
//! sample counts with suspicious names flagged, and the known fixtures' completeness.
use std::{collections::BTreeMap, fmt::Write as _, io::Read, path::Path, time::Duration};

use anyhow::{Context, Result, anyhow, bail};
use integration_tests::{
    StackSample, collapse_repeats, proto,
    server_harness::{Client, ServerProcess, api},
    stack_samples,
};
use prost::Message;

use crate::host_workload::THREAD_NAMES;

/// Sample counts; CPU time in ns when only that type is stored (then divided by the period).
const SAMPLES_TYPE: &str = "process_cpu:samples:count:cpu:nanoseconds";
const CPU_TYPE: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
/// The agent's default frequency: 100 Hz, so one sample is 10 ms of CPU.
const SAMPLE_PERIOD_NS: i64 = 10_000_000;
/// The most frequent stacks with `[unknown]` or `[truncated]` listed in the report.
const BAD_STACKS_SHOWN: usize = 12;

/// One frame of an expected chain.
#[derive(Clone, Debug)]
pub enum Frame {
    Exact(&'static str),
    /// Any name with this prefix (`__libc_start_main` has the alias `__libc_start_main_impl`).
    Prefix(&'static str),
}

impl Frame {
    fn matches(&self, name: &str) -> bool {
        match self {
            Frame::Exact(exact) => name == *exact,
            Frame::Prefix(prefix) => name.starts_with(prefix),
        }
    }

    fn text(&self) -> String {
        match self {
            Frame::Exact(exact) => (*exact).to_string(),
            Frame::Prefix(prefix) => format!("{prefix}*"),
        }
    }
}

/// A fixture with a known stack: every sample of its service should contain each segment
/// contiguously, in this order from the root.
#[derive(Clone, Debug)]
pub struct FixtureSpec {
    pub name: &'static str,
    pub service: String,
    pub segments: Vec<Vec<Frame>>,
}

impl FixtureSpec {
    pub fn chain_text(&self) -> String {
        self.segments
            .iter()
            .map(|segment| {
                let frames: Vec<String> = segment.iter().map(Frame::text).collect();
                collapse_repeats(&frames)
            })
            .collect::<Vec<_>>()
            .join(";…;")
    }

    fn complete(&self, frames: &[String]) -> bool {
        let mut from = 0;
        for segment in &self.segments {
            let found = frames.get(from..).and_then(|rest| {
                rest.windows(segment.len())
                    .position(|w| w.iter().zip(segment).all(|(name, f)| f.matches(name)))
            });
            match found {
                Some(at) => from += at + segment.len(),
                None => return false,
            }
        }
        !frames.iter().any(|f| is_truncated(f) || is_unknown(f))
    }
}

/// glibc's start frames down to `main`: the expected top of every C fixture's stack.
pub fn libc_start_to(main: &'static str) -> Vec<Frame> {
    vec![
        Frame::Exact("_start"),
        Frame::Prefix("__libc_start_main"),
        Frame::Exact("__libc_start_call_main"),
        Frame::Exact(main),
    ]
}

fn is_truncated(frame: &str) -> bool {
    frame == "[truncated]"
}

/// `[unknown]` and `[unknown python]`.
fn is_unknown(frame: &str) -> bool {
    frame.starts_with("[unknown")
}

/// A frame without a symbol: `[unknown]` (no mapping), `module!sub_ADDRESS` (named after the
/// start of its function in `.eh_frame`) or `module+0xOFFSET` / `0xADDRESS` (a mapping or
/// address without a symbol).
fn is_unmapped(frame: &str) -> bool {
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    frame == "[unknown]"
        || frame
            .rsplit_once("+0x")
            .is_some_and(|(module, offset)| !module.is_empty() && hex(offset))
        || frame
            .rsplit_once("!sub_")
            .is_some_and(|(module, address)| !module.is_empty() && hex(address))
        || frame.strip_prefix("0x").is_some_and(hex)
}

/// Why a service name looks wrong, if it does.
pub fn suspicious(name: &str) -> Option<&'static str> {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
        Some("purely numeric (a script run as /dev/fd/N?)")
    } else if THREAD_NAMES.contains(&name) {
        Some("a thread's name (host_threads), not the program's")
    } else if matches!(name, "sh" | "bash" | "dash") {
        Some("the shell, not what it runs")
    } else if name.ends_with(".sh") {
        Some("a script name with its .sh")
    } else {
        None
    }
}

/// Process names (comm) of this workload's user programs: under `kernel` they mean user
/// processes labelled as kernel threads.
const USER_PROGRAMS: &[&str] = &[
    "true", "echo", "bash", "sh", "cat", "tr", "cc1", "as", "gcc", "make", "python",
];

/// One service's samples over the run.
#[derive(Clone, Debug, Default)]
pub struct ServiceStats {
    pub name: String,
    pub samples: i64,
    /// Samples with an `[unknown]` or `[unknown python]` frame.
    pub unknown: i64,
    /// Samples with an unsymbolized frame (`[unknown]`, `module+0x…`, `0x…`).
    pub unmapped: i64,
    pub truncated: i64,
    /// The most frequent root frames (the process names, comm) with their counts.
    pub roots: Vec<(String, i64)>,
}

impl ServiceStats {
    /// Why this service's name looks wrong, if it does: [`suspicious`], or user programs of
    /// the workload among the root frames of `kernel`.
    pub fn flag(&self) -> Option<&'static str> {
        let user_roots = self.roots.iter().any(|(root, _)| {
            root.starts_with("host_")
                || root.starts_with("python")
                || USER_PROGRAMS.contains(&root.as_str())
        });
        if self.name == "kernel" && user_roots {
            Some("user processes (see their names) labelled as kernel threads")
        } else {
            suspicious(&self.name)
        }
    }
}

/// A fixture's completeness.
#[derive(Clone, Debug)]
pub struct FixtureResult {
    pub name: &'static str,
    pub service: String,
    pub chain: String,
    pub samples: i64,
    pub complete: i64,
    /// The most frequent incomplete stacks (folded, repeats collapsed) with their counts.
    pub incomplete_top: Vec<(String, i64)>,
}

impl FixtureResult {
    pub fn share(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.complete as f64 / self.samples as f64)
    }
}

#[derive(Clone, Debug)]
pub struct ProfileAnalysis {
    pub profile_type: String,
    /// Every service, most samples first.
    pub services: Vec<ServiceStats>,
    pub fixtures: Vec<FixtureResult>,
    /// The most frequent stacks with `[unknown…]` or `[truncated]` frames, as
    /// `service: folded stack`, with their counts.
    pub bad_stacks: Vec<(String, i64)>,
}

impl ProfileAnalysis {
    pub fn total(&self) -> ServiceStats {
        let mut total = ServiceStats {
            name: "all".into(),
            ..ServiceStats::default()
        };
        for s in &self.services {
            total.samples += s.samples;
            total.unknown += s.unknown;
            total.unmapped += s.unmapped;
            total.truncated += s.truncated;
        }
        total
    }

    pub fn samples_of(&self, service: &str) -> i64 {
        self.services
            .iter()
            .find(|s| s.name == service)
            .map_or(0, |s| s.samples)
    }
}

fn connect<Req: Message, Resp: Message + Default>(
    client: &Client,
    method: &str,
    request: &Req,
) -> Result<Resp> {
    let response = client
        .try_request(
            "POST",
            &format!("/querier.v1.QuerierService/{method}"),
            &[("Content-Type", "application/proto")],
            Some(&request.encode_to_vec()),
        )
        .map_err(|err| anyhow!("{method}: {err}"))?;
    if response.status != 200 {
        bail!("{method}: HTTP {}: {}", response.status, response.text());
    }
    Resp::decode(response.body.as_slice()).with_context(|| format!("{method}: undecodable answer"))
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// `{service_name="NAME"}` with `\` and `"` escaped.
fn selector(service: &str) -> String {
    let escaped = service.replace('\\', "\\\\").replace('"', "\\\"");
    format!("{{service_name=\"{escaped}\"}}")
}

fn merged_samples(
    client: &Client,
    profile_type: &str,
    service: &str,
    from_ms: i64,
    until_ms: i64,
) -> Result<Vec<StackSample>> {
    let query = format!("{profile_type}{}", selector(service));
    let path = format!(
        "/api/pprof?query={}&from={from_ms}&until={until_ms}",
        url_encode(&query)
    );
    let response = client
        .try_request("GET", &path, &[], None)
        .map_err(|err| anyhow!("GET {path}: {err}"))?;
    if response.status != 200 {
        bail!("GET {path}: HTTP {}: {}", response.status, response.text());
    }
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(response.body.as_slice())
        .read_to_end(&mut raw)
        .with_context(|| format!("the pprof of service {service:?} is not gzip"))?;
    let profile = proto::Profile::decode(raw.as_slice())
        .with_context(|| format!("the pprof of service {service:?} does not decode"))?;
    Ok(stack_samples(&profile))
}

/// Opens the agent's store with `profiler server` on a free loopback port and reads the whole
/// run back.
pub fn analyze(
    profiler: &Path,
    store_dir: &Path,
    from_ms: i64,
    until_ms: i64,
    fixtures: &[FixtureSpec],
) -> Result<ProfileAnalysis> {
    let data_dir = store_dir
        .to_str()
        .context("the store directory is not UTF-8")?;
    let server = ServerProcess::try_start_with(
        profiler,
        &["--listen", "127.0.0.1:0", "--data-dir", data_dir],
    )
    .map_err(|log| anyhow!("profiler server did not start on the agent's store: {log}"))?;
    let client = server.client();
    // ServerProcess logs its address before it opens the store; wait until it answers.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while client
        .try_request("GET", "/readyz", &[], None)
        .map_or(true, |r| r.status != 200)
    {
        if std::time::Instant::now() > deadline {
            bail!("profiler server on the agent's store was not ready within 60 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }

    let types: api::ProfileTypesResponse = connect(
        &client,
        "ProfileTypes",
        &api::ProfileTypesRequest {
            start: from_ms,
            end: until_ms,
        },
    )?;
    let ids: Vec<&str> = types.profile_types.iter().map(|t| t.id.as_str()).collect();
    let (profile_type, divisor) = if ids.contains(&SAMPLES_TYPE) {
        (SAMPLES_TYPE, 1)
    } else if ids.contains(&CPU_TYPE) {
        (CPU_TYPE, SAMPLE_PERIOD_NS)
    } else {
        bail!("the agent's store has no CPU profiles (profile types: {ids:?})");
    };
    let names: api::LabelValuesResponse = connect(
        &client,
        "LabelValues",
        &api::LabelValuesRequest {
            name: "service_name".into(),
            matchers: Vec::new(),
            start: from_ms,
            end: until_ms,
        },
    )?;

    let mut services = Vec::new();
    let mut bad_stacks: BTreeMap<String, i64> = BTreeMap::new();
    let mut fixture_results: Vec<FixtureResult> = fixtures
        .iter()
        .map(|f| FixtureResult {
            name: f.name,
            service: f.service.clone(),
            chain: f.chain_text(),
            samples: 0,
            complete: 0,
            incomplete_top: Vec::new(),
        })
        .collect();
    for name in names.names {
        let samples = merged_samples(&client, profile_type, &name, from_ms, until_ms)?;
        let mut stats = ServiceStats {
            name: name.clone(),
            ..ServiceStats::default()
        };
        let mut roots: BTreeMap<&str, i64> = BTreeMap::new();
        for sample in &samples {
            let count = sample.count / divisor;
            stats.samples += count;
            if let Some(root) = sample.frames.first() {
                *roots.entry(root.as_str()).or_default() += count;
            }
            if sample.frames.iter().any(|f| is_unknown(f)) {
                stats.unknown += count;
            }
            if sample.frames.iter().any(|f| is_unmapped(f)) {
                stats.unmapped += count;
            }
            if sample.frames.iter().any(|f| is_truncated(f)) {
                stats.truncated += count;
            }
            if sample
                .frames
                .iter()
                .any(|f| is_truncated(f) || is_unknown(f))
            {
                *bad_stacks
                    .entry(format!("{name}: {}", collapse_repeats(&sample.frames)))
                    .or_default() += count;
            }
        }
        let mut roots: Vec<(String, i64)> = roots
            .into_iter()
            .map(|(root, count)| (root.to_string(), count))
            .collect();
        roots.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        roots.truncate(3);
        stats.roots = roots;
        for (spec, result) in fixtures.iter().zip(fixture_results.iter_mut()) {
            if spec.service != name {
                continue;
            }
            let mut incomplete: BTreeMap<String, i64> = BTreeMap::new();
            for sample in &samples {
                let count = sample.count / divisor;
                result.samples += count;
                if spec.complete(&sample.frames) {
                    result.complete += count;
                } else {
                    *incomplete
                        .entry(collapse_repeats(&sample.frames))
                        .or_default() += count;
                }
            }
            let mut top: Vec<(String, i64)> = incomplete.into_iter().collect();
            top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            top.truncate(3);
            result.incomplete_top = top;
        }
        services.push(stats);
    }
    services.sort_by(|a, b| b.samples.cmp(&a.samples).then_with(|| a.name.cmp(&b.name)));
    drop(server);
    let mut bad_stacks: Vec<(String, i64)> = bad_stacks.into_iter().collect();
    bad_stacks.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    bad_stacks.truncate(BAD_STACKS_SHOWN);
    Ok(ProfileAnalysis {
        bad_stacks,
        profile_type: profile_type.to_string(),
        services,
        fixtures: fixture_results,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(text: &str) -> Vec<String> {
        text.split(';').map(str::to_string).collect()
    }

    #[test]
    fn chains_match_in_order_with_gaps_between_segments() {
        let mut segments = vec![libc_start_to("Py_BytesMain")];
        segments.push(vec![Frame::Exact("<module>"), Frame::Exact("inner")]);
        let spec = FixtureSpec {
            name: "py",
            service: "py".into(),
            segments,
        };
        let good = "python3.11;_start;__libc_start_main_impl;__libc_start_call_main;Py_BytesMain;\
                    Py_RunMain;<module>;inner;rangeiter_next";
        assert!(spec.complete(&frames(good)));
        assert!(!spec.complete(&frames(&format!("{good};[truncated]"))));
        assert!(!spec.complete(&frames(
            "python3.11;Py_BytesMain;<module>;inner;rangeiter_next"
        )));
        assert!(!spec.complete(&frames(
            "python3.11;_start;__libc_start_main;__libc_start_call_main;Py_BytesMain;inner;<module>"
        )));
    }

    #[test]
    fn frame_kinds() {
        assert!(is_unmapped("libfoo.so+0x1a2b"));
        assert!(is_unmapped("cc1!sub_71f5a0"));
        assert!(!is_unmapped("cc1!sub_main"));
        assert!(is_unmapped("[unknown]"));
        assert!(is_unmapped("0x7f00"));
        assert!(!is_unmapped("[unknown python]"));
        assert!(!is_unmapped("a+0xzz"));
        assert!(is_unknown("[unknown python]"));
        assert_eq!(
            suspicious("63"),
            Some("purely numeric (a script run as /dev/fd/N?)")
        );
        assert!(suspicious("lto cgu.1").is_some());
        assert!(suspicious("deploy.sh").is_some());
        assert!(suspicious("bash").is_some());
        assert!(suspicious("host_threads").is_none());
        assert_eq!(
            selector(r#"a"b\c"#),
            r#"{service_name="a\"b\\c"}"#.to_string()
        );
        assert_eq!(url_encode("a b{\"}"), "a%20b%7B%22%7D");
    }
}
