//! The `host` suite: a busy real host reproduced on this machine (a parallel C build in a loop,
//! an exec storm of short-lived programs and shell scripts, short-lived multi-threaded programs,
//! Python services on four CPython versions, a PyTorch inference loop and the known-stack
//! fixtures), all at once for `--host-seconds`, under the whole-host `profiler agent` with its
//! defaults (only its store, cache and listen address moved into the scratch directory).
//! Every 5 s the agent's memory, CPU, /metrics and the load average are read; afterwards its
//! store is read back for stack quality, service names and fixture completeness. It measures
//! and reports; it asserts nothing. See docs/benchmarks.md, "Suite host".
use std::{
    collections::BTreeMap,
    io::{Read, Seek, SeekFrom},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use integration_tests::{
    Scratch, fixture_source, pyenv_python, server_harness::parse_listening_line,
    server_harness::unix_now_ms, workspace_root,
};

use crate::{
    bpf_prog_stats,
    host_profiles::{self, FixtureSpec, Frame, ProfileAnalysis, libc_start_to},
    host_workload::{self, BuildLoop, BuildStats, Fixtures, Group},
    parse::ProgStats,
    procs,
};

pub const DEFAULT_SECONDS: u64 = 300;
pub const MIN_SECONDS: u64 = 60;
/// Seconds between two reads of the agent's state.
pub const POLL_S: u64 = 5;
/// The first minute is start-up: the agent's first tables and symbols, the workloads' own
/// start (PyTorch's import), and the 1-minute load average catching up. Shorter runs leave out
/// their first third.
pub const WARM_UP_S: f64 = 60.0;

pub fn warm_up_s(seconds: u64) -> f64 {
    WARM_UP_S.min(seconds as f64 / 3.0)
}
/// Between the starts of two workload parts, so they do not all exec at the same instant.
const STAGGER: Duration = Duration::from_secs(1);
/// How long the agent may take to flush and exit after SIGTERM.
const AGENT_STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// The agent's log filter.
pub const AGENT_RUST_LOG: &str = "info,profiler::self_metrics=debug";

static TERMINATED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_terminate(_: libc::c_int) {
    TERMINATED.store(true, Ordering::Relaxed);
}

/// SIGTERM and SIGHUP become a flag like Ctrl-C (procs::catch_sigint), so that being stopped
/// by a job runner or a closed terminal still kills every part of the workload.
fn catch_sigterm() {
    for signal in [libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installs a handler that only stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_terminate as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

fn check_stop() -> Result<()> {
    procs::check_interrupted()?;
    if TERMINATED.load(Ordering::Relaxed) {
        bail!("terminated");
    }
    Ok(())
}

/// The agent's memory from /proc/PID/status, bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rss {
    pub anon: u64,
    pub file: u64,
    pub shmem: u64,
    pub total: u64,
    /// VmHWM: the peak so far.
    pub peak: u64,
}

/// One read of the agent's state.
#[derive(Clone, Debug, Default)]
pub struct Poll {
    /// Seconds since the agent was started.
    pub t: f64,
    /// utime + stime from /proc/PID/stat, seconds.
    pub cpu_s: Option<f64>,
    pub rss: Option<Rss>,
    /// /proc/loadavg: 1, 5 and 15 minutes.
    pub load: Option<[f64; 3]>,
    /// `processes` of /proc/stat: forks since boot.
    pub forks: Option<u64>,
    /// Every unlabelled value of /metrics (empty when it could not be read).
    pub metrics: BTreeMap<String, f64>,
    /// The numbers of the agent's latest `interval` log line (unwind tables, rows...).
    pub interval: BTreeMap<String, f64>,
    pub bpf: Option<ProgStats>,
    /// Resident bytes by what is mapped (/proc/PID/smaps), read from the warm-up on: which
    /// mappings the RSS growth is made of.
    pub resident_by_mapping: Option<BTreeMap<String, u64>>,
}

impl Poll {
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics.get(name).copied()
    }
}

/// A workload part as the report shows it.
#[derive(Clone, Debug)]
pub struct PartReport {
    pub name: String,
    pub description: String,
    /// The service name the part should get (its OTEL_SERVICE_NAME, script or program name).
    pub expected_service: Option<String>,
    pub started_t: f64,
    /// When it exited before the end of the run, and how.
    pub exited: Option<(f64, String)>,
    /// Its last progress line (`seconds=... iterations=...`).
    pub progress: Option<String>,
}

/// What the agent's log said.
#[derive(Clone, Debug, Default)]
pub struct AgentLog {
    pub intervals: usize,
    pub last_interval: BTreeMap<String, f64>,
    /// The `agent stopped` line's numbers.
    pub stopped: Option<BTreeMap<String, f64>>,
    /// Warnings and errors by level and message, with how often each came.
    pub warnings: BTreeMap<String, usize>,
    /// The last lines, for when the agent died.
    pub tail: Vec<String>,
}

/// Reads the agent's JSON log as it grows.
struct LogReader {
    path: PathBuf,
    offset: u64,
    partial: String,
    addr: Option<SocketAddr>,
    running: bool,
    /// The table statistics of the debug line logged just before each `interval` line.
    tables: BTreeMap<String, f64>,
    log: AgentLog,
}

/// Distinct warning messages kept (messages with pids in them could be unbounded).
const MAX_WARNING_KINDS: usize = 100;

fn numbers(fields: &serde_json::Map<String, serde_json::Value>) -> BTreeMap<String, f64> {
    fields
        .iter()
        .filter_map(|(key, value)| Some((key.clone(), value.as_f64()?)))
        .collect()
}

/// A `Duration`'s Debug text (`11.3ms`, `1.2s`, `500µs`, `80ns`) in seconds.
fn debug_duration_s(text: &str) -> Option<f64> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" | "us" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    };
    Some(number.parse::<f64>().ok()? * scale)
}

/// `NativeTableStats { tables_loaded: 6, ..., build_time: 11.3ms }` (the agent logs the
/// unwind-table statistics with Debug); `build_time` becomes `build_time_s`.
fn parse_table_stats(text: &str) -> BTreeMap<String, f64> {
    let inner = text
        .split_once('{')
        .map_or("", |(_, rest)| rest.trim_end().trim_end_matches('}'));
    inner
        .split(',')
        .filter_map(|pair| {
            let (key, value) = pair.split_once(':')?;
            let (key, value) = (key.trim(), value.trim());
            if key == "build_time" {
                return Some(("build_time_s".to_string(), debug_duration_s(value)?));
            }
            Some((key.to_string(), value.parse().ok()?))
        })
        .collect()
}

impl LogReader {
    fn new(path: PathBuf) -> LogReader {
        LogReader {
            path,
            offset: 0,
            partial: String::new(),
            addr: None,
            running: false,
            tables: BTreeMap::new(),
            log: AgentLog::default(),
        }
    }

    fn read_new(&mut self) -> Result<()> {
        let mut file = match std::fs::File::open(&self.path) {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(err).context("cannot open the agent's log"),
        };
        file.seek(SeekFrom::Start(self.offset))
            .context("cannot seek in the agent's log")?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .context("cannot read the agent's log")?;
        self.offset += bytes.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&bytes));
        let Some(end) = self.partial.rfind('\n') else {
            return Ok(());
        };
        let complete: String = self.partial.drain(..=end).collect();
        for line in complete.lines() {
            self.line(line);
        }
        Ok(())
    }

    fn line(&mut self, line: &str) {
        self.log.tail.push(line.to_string());
        if self.log.tail.len() > 30 {
            self.log.tail.remove(0);
        }
        if self.addr.is_none() {
            self.addr = parse_listening_line(line);
        }
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line.trim()) else {
            return;
        };
        let Some(fields) = value.get("fields").and_then(|f| f.as_object()) else {
            return;
        };
        let message = fields.get("message").and_then(|m| m.as_str()).unwrap_or("");
        match message {
            "agent running" => self.running = true,
            "interval: BPF counters" => {
                if let Some(tables) = fields.get("tables").and_then(|t| t.as_str()) {
                    self.tables = parse_table_stats(tables);
                }
            }
            "interval" => {
                self.log.intervals += 1;
                let mut values = numbers(fields);
                values.extend(std::mem::take(&mut self.tables));
                self.log.last_interval = values;
            }
            // Two lines have this message: the counters, then the time the stop took.
            "agent stopped" if fields.get("samples_processed").is_some() => {
                self.log.stopped = Some(numbers(fields));
            }
            _ => {}
        }
        let level = value.get("level").and_then(|l| l.as_str()).unwrap_or("");
        if matches!(level, "WARN" | "ERROR") {
            let key = format!("{level} {message}");
            let kinds = self.log.warnings.len();
            let entry = if kinds < MAX_WARNING_KINDS || self.log.warnings.contains_key(&key) {
                key
            } else {
                format!("{level} (other messages)")
            };
            *self.log.warnings.entry(entry).or_default() += 1;
        }
    }
}

/// Everything the suite measured.
#[derive(Debug)]
pub struct HostRun {
    pub seconds: u64,
    /// /proc/loadavg just before the agent started: how busy the machine was without us.
    pub load_before: Option<[f64; 3]>,
    /// Other samplers and benchmarks seen during the run (`pid: command line` → polls that saw
    /// it): they disturb every figure.
    pub foreign: BTreeMap<String, usize>,
    /// CPU seconds of processes outside the bench's tree, by process name (a lower bound).
    pub outsiders: BTreeMap<String, f64>,
    /// From the agent's start until it logged `agent running`.
    pub ready_s: f64,
    pub polls: Vec<Poll>,
    pub metric_failures: usize,
    pub parts: Vec<PartReport>,
    pub skipped: Vec<String>,
    pub build: BuildStats,
    /// The agent died during the run: when and how.
    pub agent_died: Option<(f64, String)>,
    /// Its exit after SIGTERM: status and seconds.
    pub agent_stop: Option<(String, f64)>,
    pub log: AgentLog,
    pub analysis: Result<ProfileAnalysis, String>,
}

/// A Python "service" of the workload.
struct PythonService {
    version: &'static str,
    executable: &'static str,
    name: &'static str,
    /// `host_python_service.py`'s mode.
    mode: &'static str,
    /// How it names itself.
    env: (&'static str, &'static str),
    /// The service name it should get.
    expected: &'static str,
}

/// One per CPython version; the 3.11 one names itself only through OTEL_RESOURCE_ATTRIBUTES
/// (the OpenTelemetry resource variable, which SDKs honour as well as OTEL_SERVICE_NAME).
const PYTHON_SERVICES: [PythonService; 4] = [
    PythonService {
        version: "3.8.18",
        executable: "python3.8",
        name: "python 3.8 json",
        mode: "json",
        env: ("OTEL_SERVICE_NAME", "host-py38-json"),
        expected: "host-py38-json",
    },
    PythonService {
        version: "3.11.7",
        executable: "python3.11",
        name: "python 3.11 json",
        mode: "json",
        env: (
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.name=host-py311-resattr,deployment.environment=bench",
        ),
        expected: "host-py311-resattr",
    },
    PythonService {
        version: "3.12.1",
        executable: "python3.12",
        name: "python 3.12 http.server",
        mode: "http-server",
        env: ("OTEL_SERVICE_NAME", "host-py312-http"),
        expected: "host-py312-http",
    },
    PythonService {
        version: "3.13.0",
        executable: "python3.13",
        name: "python 3.13 http client",
        mode: "http-client",
        env: ("OTEL_SERVICE_NAME", "host-py313-client"),
        expected: "host-py313-client",
    },
];

/// A part before it starts.
struct PartSpec {
    name: String,
    description: String,
    expected_service: Option<String>,
    command: Command,
}

struct Part {
    report: PartReport,
    log: PathBuf,
    group: Group,
}

/// A command with none of the developer's service-naming environment (it must not change the
/// names the agent finds).
fn clean_command(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    for (var, _) in std::env::vars_os() {
        let name = var.to_string_lossy();
        if name.starts_with("OTEL_")
            || name.starts_with("PYROSCOPE_")
            || name.starts_with("PROFILER_")
        {
            cmd.env_remove(&var);
        }
    }
    cmd
}

fn spec(
    name: &str,
    description: String,
    expected_service: Option<&str>,
    command: Command,
) -> PartSpec {
    PartSpec {
        name: name.to_string(),
        description,
        expected_service: expected_service.map(str::to_string),
        command,
    }
}

/// The workload parts in start order, the parts skipped (with why), and the fixtures' chains.
fn plan(
    fixtures: &Fixtures,
    scratch: &Scratch,
    seconds: u64,
) -> (Vec<PartSpec>, Vec<String>, Vec<FixtureSpec>) {
    // Fixed-length programs get far more time than the run: they are killed at its end.
    let life = (seconds + 600).to_string();
    let mut parts = Vec::new();
    let mut skipped = Vec::new();
    let mut chains = Vec::new();

    let mut cmd = clean_command(&fixtures.spawner);
    cmd.arg(host_workload::SPAWN_RATE.to_string())
        .arg(&life)
        .arg(&fixtures.burst);
    parts.push(spec(
        "exec storm",
        format!(
            "`host_spawner {}`: fork+exec of /bin/true, /bin/echo, `host_burst` (1-4 ms busy), `sh -c` pipelines, `bash <(...)` and `bash /dev/fd/N`",
            host_workload::SPAWN_RATE
        ),
        Some("host_spawner"),
        cmd,
    ));
    let mut cmd = clean_command(&fixtures.threads);
    cmd.arg("loop")
        .arg(&life)
        .arg(host_workload::THREAD_RUNS.to_string());
    parts.push(spec(
        "named threads",
        format!(
            "`host_threads loop`: {} runs at a time of 2-5 threads named {}, each busy 50-500 ms",
            host_workload::THREAD_RUNS,
            host_workload::THREAD_NAMES
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Some("host_threads"),
        cmd,
    ));

    let script = fixture_source("host_python_service.py");
    let port_file = scratch.path("host-http-port");
    for service in PYTHON_SERVICES {
        let PythonService {
            version,
            executable,
            name,
            mode,
            env,
            expected,
        } = service;
        let Some(python) = pyenv_python(version, executable) else {
            skipped.push(format!(
                "{name}: pyenv's CPython {version} ({executable}) not found"
            ));
            continue;
        };
        let mut cmd = clean_command(&python);
        cmd.arg(&script).arg(mode);
        if mode.starts_with("http") {
            cmd.arg(&port_file);
        }
        cmd.env(env.0, env.1);
        parts.push(spec(
            name,
            format!(
                "CPython {version} `host_python_service.py {mode}` with {}={}",
                env.0, env.1
            ),
            Some(expected),
            cmd,
        ));
    }

    let torch = workspace_root().join(".tools/torch-venv/bin/python");
    if torch.exists() {
        let mut cmd = clean_command(&torch);
        cmd.arg(fixture_source("host_torch_infer.py"));
        parts.push(spec(
            "pytorch inference",
            "`.tools/torch-venv` (CPython 3.11, torch) `host_torch_infer.py`: Conv2d/ReLU/Linear, eval, no_grad, 1 thread, batches of 8×3×64×64".into(),
            Some("host_torch_infer"),
            cmd,
        ));
    } else {
        skipped.push(format!(
            "pytorch inference: {} not found (`cargo xtask setup` creates .tools/torch-venv)",
            torch.display()
        ));
    }

    let level_chain = || {
        let mut segment = libc_start_to("main");
        segment.extend(["level1", "level2", "level3", "level4"].map(Frame::Exact));
        vec![segment]
    };
    for (name, path, service, flags) in [
        (
            "fp_chain (frame pointers)",
            &fixtures.fp_chain,
            "host_fp_chain_fp",
            "-O2 -fno-omit-frame-pointer",
        ),
        (
            "fp_chain (no frame pointers)",
            &fixtures.nofp_chain,
            "host_fp_chain_nofp",
            "-O2 -fomit-frame-pointer",
        ),
    ] {
        let mut cmd = clean_command(path);
        cmd.arg(&life);
        parts.push(spec(
            name,
            format!("tests/fixtures/fp_chain.c built with {flags}"),
            Some(service),
            cmd,
        ));
        chains.push(FixtureSpec {
            name: if service.ends_with("_fp") {
                "fp_chain, frame pointers"
            } else {
                "fp_chain, no frame pointers"
            },
            service: service.to_string(),
            segments: level_chain(),
        });
    }

    let mut cmd = clean_command(&fixtures.frameless);
    cmd.arg(&life)
        .arg(host_workload::FRAMELESS_DEPTH.to_string());
    parts.push(spec(
        "frameless library",
        format!(
            "tests/fixtures/frameless_main.c → libframeless.so through the PLT, both -fomit-frame-pointer, recursion depth {}",
            host_workload::FRAMELESS_DEPTH
        ),
        Some("host_frameless_main"),
        cmd,
    ));
    let mut segment = libc_start_to("main");
    segment.extend(std::iter::repeat_n(
        Frame::Exact("recurse"),
        host_workload::FRAMELESS_DEPTH,
    ));
    segment.extend([Frame::Exact("burn"), Frame::Exact("frameless_outer")]);
    chains.push(FixtureSpec {
        name: "frameless library (PLT)",
        service: "host_frameless_main".into(),
        segments: vec![segment],
    });

    match pyenv_python("3.11.7", "python3.11") {
        Some(python) => {
            let mut cmd = clean_command(&python);
            cmd.arg(fixture_source("host_python_chain.py"));
            parts.push(spec(
                "python chain",
                "CPython 3.11 `host_python_chain.py`: host_chain_outer → host_chain_middle → host_chain_inner".into(),
                Some("host_python_chain"),
                cmd,
            ));
            // pyenv's python3.11 enters Py_BytesMain straight from glibc (main is a tail call).
            chains.push(FixtureSpec {
                name: "python chain (3.11)",
                service: "host_python_chain".into(),
                segments: vec![
                    libc_start_to("Py_BytesMain"),
                    vec![
                        Frame::Exact("<module>"),
                        Frame::Exact("host_chain_outer"),
                        Frame::Exact("host_chain_middle"),
                        Frame::Exact("host_chain_inner"),
                    ],
                ],
            });
        }
        None => skipped.push("python chain: pyenv's CPython 3.11.7 not found".into()),
    }
    (parts, skipped, chains)
}

/// `profiler agent` with its defaults but for the store, the table cache and the listen
/// address, which go to the scratch directory and a free loopback port.
fn agent_command(profiler: &Path, store: &Path, cache: &Path) -> Command {
    let mut cmd = clean_command(profiler);
    cmd.args(["--log-format", "json", "agent", "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(store)
        .arg("--cache-dir")
        .arg(cache)
        // The agent's own default (info), spelled out so a developer's RUST_LOG cannot change
        // it, plus the one debug line per interval with the unwind-table statistics (evicted,
        // deferred, rows in use), which /metrics does not have.
        .env("RUST_LOG", AGENT_RUST_LOG);
    cmd
}

fn read_proc_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which may contain spaces; utime and stime are fields
    // 14 and 15 of the line.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (per_second > 0.0).then(|| ticks / per_second)
}

fn read_rss(pid: u32) -> Option<Rss> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> Option<u64> {
        status.lines().find_map(|line| {
            let value = line.strip_prefix(key)?.trim().strip_suffix("kB")?;
            value.trim().parse::<u64>().ok().map(|v| v * 1024)
        })
    };
    Some(Rss {
        anon: kib("RssAnon:")?,
        file: kib("RssFile:")?,
        shmem: kib("RssShmem:").unwrap_or(0),
        total: kib("VmRSS:")?,
        peak: kib("VmHWM:")?,
    })
}

/// The resident bytes of a process's mappings, summed by name: a file's path, `[heap]`,
/// `[anon]` for nameless anonymous memory, a BPF ring's `anon_inode:bpf-ringbuf`...
fn read_resident_by_mapping(pid: u32) -> Option<BTreeMap<String, u64>> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut by_name = BTreeMap::new();
    let mut current = String::new();
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let bytes = kib.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()? * 1024;
            *by_name.entry(current.clone()).or_insert(0) += bytes;
            continue;
        }
        // A mapping's first line: `start-end perms offset dev inode [name]`; field lines
        // (`Size:`, `VmFlags:`...) start with a key ending in a colon.
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let is_header = fields.len() >= 5
            && fields[0].contains('-')
            && fields[0]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b'-');
        if is_header {
            current = match fields[5..].join(" ") {
                name if name.is_empty() => "[anon]".to_owned(),
                name => name,
            };
        }
    }
    Some(by_name)
}

fn read_load() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut values = text.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some([values.next()??, values.next()??, values.next()??])
}

/// `PF_KTHREAD` in the flags field of /proc/PID/stat.
const PF_KTHREAD: u64 = 0x0020_0000;

/// One process as /proc/PID/stat shows it.
struct ProcStat {
    pid: u32,
    ppid: u32,
    comm: String,
    flags: u64,
    cpu_s: f64,
    start: u64,
}

fn parse_proc_stat(pid: u32, text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let (comm, rest) = text[open + 1..].rsplit_once(')')?;
    // After the name: state, ppid, pgrp, session, tty, tpgid, flags, ..., utime (11), stime
    // (12), ..., starttime (19).
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let number = |i: usize| fields.get(i)?.parse::<u64>().ok();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ProcStat {
        pid,
        ppid: u32::try_from(number(1)?).ok()?,
        comm: comm.to_string(),
        flags: number(6)?,
        cpu_s: (number(11)? + number(12)?) as f64 / ticks,
        start: number(19)?,
    })
}

/// What runs on the machine besides the suite (processes that are not the bench's
/// descendants): another build, test or sampler disturbs every figure, and the report says so.
#[derive(Default)]
struct Outsiders {
    /// pid → (start time, CPU seconds) at the previous poll.
    last: std::collections::HashMap<u32, (u64, f64)>,
    /// CPU seconds by process name between polls. Processes that start and end between two
    /// polls are missed, so this is a lower bound.
    by_name: BTreeMap<String, f64>,
    /// Other `profiler`, `bench` and `perf` processes (`pid: command line`) → polls that saw
    /// them.
    samplers: BTreeMap<String, usize>,
}

/// Whether `pid` runs a `profiler`, `bench` or `perf` binary; its command line if so.
fn sampler_command(pid: u32) -> Option<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let exe = exe.to_string_lossy();
    let exe = exe.strip_suffix(" (deleted)").unwrap_or(&exe);
    if !matches!(exe.rsplit('/').next(), Some("profiler" | "bench" | "perf")) {
        return None;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    Some(
        String::from_utf8_lossy(&cmdline)
            .replace('\0', " ")
            .trim()
            .chars()
            .take(160)
            .collect(),
    )
}

impl Outsiders {
    fn poll(&mut self, bench: u32) {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        let stats: Vec<ProcStat> = entries
            .flatten()
            .filter_map(|entry| {
                let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
                let text = std::fs::read_to_string(entry.path().join("stat")).ok()?;
                parse_proc_stat(pid, &text)
            })
            .collect();
        let mut children: std::collections::HashMap<u32, Vec<u32>> = Default::default();
        for stat in &stats {
            children.entry(stat.ppid).or_default().push(stat.pid);
        }
        let mut ours = std::collections::HashSet::from([bench]);
        let mut queue = vec![bench];
        while let Some(pid) = queue.pop() {
            for &child in children.get(&pid).into_iter().flatten() {
                if ours.insert(child) {
                    queue.push(child);
                }
            }
        }
        let mut now = std::collections::HashMap::new();
        for stat in stats {
            if ours.contains(&stat.pid) || stat.flags & PF_KTHREAD != 0 || stat.pid == 1 {
                continue;
            }
            if let Some(command) = sampler_command(stat.pid) {
                *self
                    .samplers
                    .entry(format!("{}: {command}", stat.pid))
                    .or_default() += 1;
            }
            if let Some(&(start, cpu)) = self.last.get(&stat.pid)
                && start == stat.start
                && stat.cpu_s > cpu
            {
                *self.by_name.entry(stat.comm.clone()).or_default() += stat.cpu_s - cpu;
            }
            now.insert(stat.pid, (stat.start, stat.cpu_s));
        }
        self.last = now;
    }
}

fn read_forks() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("processes "))
        .and_then(|n| n.trim().parse().ok())
}

/// The unlabelled samples of a Prometheus text page.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (name, value) = line.split_once(' ')?;
            if name.contains('{') {
                return None;
            }
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

fn fetch_metrics(http: &ureq::Agent, addr: SocketAddr) -> Option<BTreeMap<String, f64>> {
    let response = http.get(&format!("http://{addr}/metrics")).call().ok()?;
    let text = response.into_string().ok()?;
    Some(parse_metrics(&text))
}

/// Starts the agent and waits until it runs; returns its HTTP address.
fn wait_for_agent(agent: &mut Group, log: &mut LogReader) -> Result<SocketAddr> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        check_stop()?;
        log.read_new()?;
        if let (Some(addr), true) = (log.addr, log.running) {
            return Ok(addr);
        }
        if let Some(status) = agent.exited()? {
            log.read_new()?;
            bail!(
                "profiler agent exited ({status}) before it ran:\n{}",
                log.log.tail.join("\n")
            );
        }
        if Instant::now() > deadline {
            bail!(
                "profiler agent did not log `agent running` within 120 s:\n{}",
                log.log.tail.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The name `--host-without` takes for a part: lower case, words joined by `-`
/// (`exec-storm`, `python-3-8-json`).
pub fn part_key(name: &str) -> String {
    name.to_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|word| !word.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// The parallel build, which is not a [`PartSpec`] (it runs on a thread of the bench).
const BUILD_PART: &str = "parallel build";

/// Takes the parts named in `without` (by [`part_key`]) out of `specs`, noting each in
/// `skipped`; the known-stack fixtures cannot be left out (the completeness figures need
/// them). An unknown name is an error that lists the names there are.
fn leave_out(
    specs: Vec<PartSpec>,
    chains: &[FixtureSpec],
    without: &[String],
    skipped: &mut Vec<String>,
) -> Result<(Vec<PartSpec>, bool)> {
    let is_fixture = |spec: &PartSpec| {
        chains
            .iter()
            .any(|chain| spec.expected_service.as_deref() == Some(chain.service.as_str()))
    };
    let optional: Vec<String> = std::iter::once(part_key(BUILD_PART))
        .chain(
            specs
                .iter()
                .filter(|s| !is_fixture(s))
                .map(|s| part_key(&s.name)),
        )
        .collect();
    for name in without {
        if !optional.contains(name) {
            bail!(
                "--host-without: no part {name:?} to leave out; the parts are: {}",
                optional.join(", ")
            );
        }
    }
    let left_out = |key: &str| without.iter().any(|name| name == key);
    let mut kept = Vec::new();
    for spec in specs {
        if !is_fixture(&spec) && left_out(&part_key(&spec.name)) {
            skipped.push(format!("{}: left out (--host-without)", spec.name));
        } else {
            kept.push(spec);
        }
    }
    let build = !left_out(&part_key(BUILD_PART));
    if !build {
        skipped.push(format!("{BUILD_PART}: left out (--host-without)"));
    }
    Ok((kept, build))
}

/// Runs the suite for `seconds`, without the parts named in `without` (see [`part_key`]).
pub fn run(
    profiler: &Path,
    scratch: &Scratch,
    seconds: u64,
    without: &[String],
) -> Result<HostRun> {
    catch_sigterm();
    eprintln!("bench: [host] building the fixtures and generating the C project");
    let fixtures = host_workload::build_fixtures()?;
    let build_dir = scratch.path("host-build");
    host_workload::generate_build_tree(&build_dir, host_workload::BUILD_FILES)?;
    let logs = scratch.path("host-logs");
    std::fs::create_dir_all(&logs).context("cannot create the log directory")?;
    let store = scratch.path("host-store");
    let cache = scratch.path("host-cache");
    let (specs, mut skipped, chains) = plan(&fixtures, scratch, seconds);
    let (specs, with_build) = leave_out(specs, &chains, without, &mut skipped)?;
    for reason in &skipped {
        eprintln!("bench: [host] skipped: {reason}");
    }

    let agent_log = logs.join("agent.log");
    let mut log = LogReader::new(agent_log.clone());
    let load_before = read_load();
    let mut outsiders = Outsiders::default();
    outsiders.poll(std::process::id());
    let started_ms = unix_now_ms();
    let t0 = Instant::now();
    let mut agent = Group::spawn(
        agent_command(profiler, &store, &cache),
        "profiler agent",
        &agent_log,
    )?;
    let addr = wait_for_agent(&mut agent, &mut log)?;
    let ready_s = t0.elapsed().as_secs_f64();
    eprintln!(
        "bench: [host] agent running after {ready_s:.1} s (pid {}, http://{addr}); starting {} workload parts, {seconds} s in all",
        agent.pid(),
        specs.len() + 1
    );

    let http = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(4))
        .build();
    let build = with_build.then(|| BuildLoop::start(build_dir, logs.join("build.log")));
    let mut pending = specs.into_iter();
    let mut parts: Vec<Part> = Vec::new();
    let mut polls: Vec<Poll> = Vec::new();
    let mut metric_failures = 0;
    let mut agent_died = None;
    let end = t0 + Duration::from_secs(seconds);
    let mut next_start = Instant::now() + STAGGER;
    let mut next_poll = t0;
    let mut next_progress = t0 + Duration::from_secs(30);
    loop {
        check_stop()?;
        let now = Instant::now();
        if now >= next_start {
            if let Some(spec) = pending.next() {
                let log_path =
                    logs.join(format!("{}.log", spec.name.replace([' ', '(', ')'], "_")));
                let group = Group::spawn(spec.command, &spec.name, &log_path)?;
                parts.push(Part {
                    report: PartReport {
                        name: spec.name,
                        description: spec.description,
                        expected_service: spec.expected_service,
                        started_t: t0.elapsed().as_secs_f64(),
                        exited: None,
                        progress: None,
                    },
                    log: log_path,
                    group,
                });
            }
            next_start += STAGGER;
        }
        let finished = now >= end;
        if now >= next_poll || finished {
            log.read_new()?;
            let pid = agent.pid();
            let metrics = fetch_metrics(&http, addr);
            if metrics.is_none() {
                metric_failures += 1;
            }
            polls.push(Poll {
                t: t0.elapsed().as_secs_f64(),
                cpu_s: read_proc_cpu(pid),
                rss: read_rss(pid),
                load: read_load(),
                forks: read_forks(),
                metrics: metrics.unwrap_or_default(),
                interval: log.log.last_interval.clone(),
                bpf: bpf_prog_stats(pid),
                resident_by_mapping: (t0.elapsed().as_secs_f64() >= warm_up_s(seconds))
                    .then(|| read_resident_by_mapping(pid))
                    .flatten(),
            });
            outsiders.poll(std::process::id());
            for part in &mut parts {
                if part.report.exited.is_none()
                    && let Some(status) = part.group.exited()?
                {
                    let t = t0.elapsed().as_secs_f64();
                    eprintln!(
                        "bench: [host] warning: {} exited after {t:.0} s ({status})",
                        part.group.what()
                    );
                    part.report.exited = Some((t, status.to_string()));
                }
            }
            if let Some(status) = agent.exited()? {
                let t = t0.elapsed().as_secs_f64();
                eprintln!("bench: [host] the agent exited after {t:.0} s ({status})");
                agent_died = Some((t, status.to_string()));
                break;
            }
            next_poll += Duration::from_secs(POLL_S);
        }
        if finished {
            break;
        }
        if now >= next_progress {
            let last = polls.last();
            eprintln!(
                "bench: [host] {:.0}/{seconds} s: load {:.1}, agent RSS {:.1} MiB, {} samples processed",
                t0.elapsed().as_secs_f64(),
                last.and_then(|p| p.load).map_or(0.0, |l| l[0]),
                last.and_then(|p| p.rss)
                    .map_or(0.0, |r| r.total as f64 / 1048576.0),
                last.and_then(|p| p.metric("profiler_samples_processed_total"))
                    .unwrap_or(0.0)
            );
            next_progress += Duration::from_secs(30);
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    // The agent first, while the workload still runs, so its last interval is a busy one.
    let agent_stop = if agent_died.is_none() {
        eprintln!("bench: [host] stopping the agent (SIGTERM)");
        let (status, took) = agent.stop(libc::SIGTERM, AGENT_STOP_TIMEOUT)?;
        Some((status.to_string(), took.as_secs_f64()))
    } else {
        None
    };
    eprintln!("bench: [host] stopping the workload");
    let build = build.map(BuildLoop::finish).unwrap_or_default();
    let mut reports = Vec::new();
    for mut part in parts {
        part.report.progress = host_workload::last_progress_line(&part.log);
        reports.push(part.report);
        drop(part.group);
    }
    log.read_new()?;
    let until_ms = unix_now_ms() + 60_000;

    eprintln!("bench: [host] reading the profiles back from the agent's store");
    let analysis = host_profiles::analyze(profiler, &store, started_ms - 60_000, until_ms, &chains)
        .map_err(|err| format!("{err:#}"));
    if let Err(err) = &analysis {
        eprintln!("bench: [host] warning: {err}");
    }
    Ok(HostRun {
        seconds,
        load_before,
        foreign: outsiders.samplers,
        outsiders: outsiders.by_name,
        ready_s,
        polls,
        metric_failures,
        parts: reports,
        skipped,
        build,
        agent_died,
        agent_stop,
        log: log.log,
        analysis,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_left_out_by_key_but_never_the_fixtures() {
        let part = |name: &str, service: &str| {
            spec(name, String::new(), Some(service), Command::new("true"))
        };
        let specs = || {
            vec![
                part("exec storm", "host_spawner"),
                part("python 3.8 json", "host-py38-json"),
                part("fp_chain (frame pointers)", "host_fp_chain_fp"),
            ]
        };
        let chains = [FixtureSpec {
            name: "fp_chain, frame pointers",
            service: "host_fp_chain_fp".into(),
            segments: Vec::new(),
        }];
        assert_eq!(part_key("Python 3.8 json"), "python-3-8-json");
        assert_eq!(
            part_key("fp_chain (frame pointers)"),
            "fp-chain-frame-pointers"
        );

        let mut skipped = Vec::new();
        let without = ["exec-storm".to_string(), "parallel-build".to_string()];
        let (kept, build) = leave_out(specs(), &chains, &without, &mut skipped).unwrap();
        let names: Vec<_> = kept.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["python 3.8 json", "fp_chain (frame pointers)"]);
        assert!(!build);
        assert_eq!(skipped.len(), 2, "{skipped:?}");

        let (kept, build) = leave_out(specs(), &chains, &[], &mut Vec::new()).unwrap();
        assert_eq!((kept.len(), build), (3, true));

        for bad in ["fp-chain-frame-pointers", "no-such-part"] {
            let err = leave_out(specs(), &chains, &[bad.to_string()], &mut Vec::new())
                .err()
                .expect("refused");
            let text = err.to_string();
            assert!(text.contains(bad) && text.contains("exec-storm"), "{text}");
        }
    }

    #[test]
    fn metrics_page_values() {
        let page = "# HELP a x\n# TYPE a counter\nprofiler_a_total 12\nprofiler_b{gpu=\"0\"} 3\nprofiler_c 1.5e3\n";
        let metrics = parse_metrics(page);
        assert_eq!(metrics.get("profiler_a_total"), Some(&12.0));
        assert_eq!(metrics.get("profiler_c"), Some(&1500.0));
        assert!(!metrics.contains_key("profiler_b{gpu=\"0\"}"));
    }

    #[test]
    fn proc_stat_line() {
        let line = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 123456 1000 10";
        let stat = parse_proc_stat(4242, line).unwrap();
        assert_eq!(stat.ppid, 1);
        assert_eq!(stat.comm, "a (weird) name");
        assert_eq!(stat.flags, 4194560);
        assert_eq!(stat.start, 123456);
        assert!(stat.cpu_s > 0.0);
    }

    #[test]
    fn log_lines() {
        let mut reader = LogReader::new(PathBuf::from("/nonexistent"));
        reader.line(r#"{"level":"INFO","fields":{"message":"HTTP server listening on 127.0.0.1:4321, web UI at http://127.0.0.1:4321/"}}"#);
        reader.line(r#"{"level":"INFO","fields":{"message":"agent running"}}"#);
        reader.line(r#"{"level":"DEBUG","fields":{"message":"interval: BPF counters","tables":"NativeTableStats { tables_loaded: 6, rows_in_use: 2048, build_time: 11.5ms }"}}"#);
        reader.line(r#"{"level":"INFO","fields":{"message":"interval","unwind_tables":12,"rss_bytes":1000}}"#);
        reader.line(r#"{"level":"WARN","fields":{"message":"slow"}}"#);
        reader.line(r#"{"level":"WARN","fields":{"message":"slow"}}"#);
        // The agent's two `agent stopped` lines: its counters, then the time the stop took.
        reader.line(r#"{"level":"INFO","fields":{"message":"agent stopped","samples_processed":900,"unknown_processes":3}}"#);
        reader.line(r#"{"level":"INFO","fields":{"message":"agent stopped","elapsed_ms":40}}"#);
        let stopped = reader.log.stopped.as_ref().expect("the counters line");
        assert_eq!(stopped.get("unknown_processes"), Some(&3.0));
        assert_eq!(reader.addr, Some("127.0.0.1:4321".parse().unwrap()));
        assert!(reader.running);
        assert_eq!(reader.log.intervals, 1);
        assert_eq!(reader.log.last_interval.get("unwind_tables"), Some(&12.0));
        assert_eq!(reader.log.warnings.get("WARN slow"), Some(&2));
        assert_eq!(reader.log.last_interval.get("rows_in_use"), Some(&2048.0));
        assert_eq!(reader.log.last_interval.get("build_time_s"), Some(&0.0115));
        assert_eq!(debug_duration_s("1.5s"), Some(1.5));
        assert_eq!(debug_duration_s("250µs"), Some(0.00025));
    }
}
