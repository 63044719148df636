//! The Python scenarios: the extra BPF cost per sample of walking 50 Python frames (the same
//! workload recorded with and without `--no-python`), the agent's cost of reading a code
//! object it has not seen (what symbolizing a new Python function costs), and how much of a
//! new Python process's first CPU time a whole-host recording under load shows without its
//! Python frames.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use integration_tests::{Scratch, fixture_source, parse_folded, pyenv_python};
use profiler::{
    model::Pid,
    process::{files::FileCache, read_process},
    runtimes::python::{CodeCache, ProcMemory, code::read_code_object, detect_python},
};

use crate::{
    BpfCost, bpf_cost,
    parse::{self, AgentCounters, AgentSummary, median},
    procs::Proc,
    profiler_command, tail,
    unwind::record,
};

/// Python frames on the stack of every sample of the stack scenario (walk on and off).
pub const PYTHON_FRAMES: usize = 50;
/// Deeper stacks, walk on only: what BPF pays for the deepest stacks it records in full.
pub const DEEP_PYTHON_FRAMES: [usize; 3] = [300, 900, profiler_common::MAX_PYTHON_FRAMES];
/// Distinct code objects read in the code-object scenario.
const CODE_OBJECTS: usize = 2000;

/// The interpreter the suite runs (a shared libpython build, like most deployments).
pub fn interpreter() -> Result<PathBuf> {
    pyenv_python("3.12.1", "python3.12")
        .context("the python suite needs pyenv's Python 3.12.1 (preinstalled on the dev machines)")
}

/// One recording of the stack scenario.
#[derive(Debug)]
pub struct StackRun {
    /// Python frames on the workers' stacks.
    pub frames: usize,
    pub python_walk: bool,
    pub bpf: BpfCost,
    pub agent: Option<AgentSummary>,
    pub counters: Option<AgentCounters>,
}

impl StackRun {
    /// The recording's BPF run time divided by the samples BPF sent (the workers'): filtered
    /// runs of other processes are charged to them, so on a busy machine this is an upper bound.
    pub fn ns_per_sent_sample(&self) -> Option<f64> {
        let sent = self.counters.as_ref()?.bpf("samples_sent");
        let agent = self.agent.as_ref()?;
        (sent > 0 && agent.bpf_run_time_ns > 0).then(|| agent.bpf_run_time_ns as f64 / sent as f64)
    }

    fn python_frames_per_sample(&self) -> Option<f64> {
        let counters = self.counters.as_ref()?;
        let sent = counters.bpf("samples_sent");
        (sent > 0).then(|| counters.bpf("python_frames") as f64 / sent as f64)
    }
}

pub fn run_stack(
    profiler: &Path,
    python: &Path,
    workers: usize,
    seconds: u64,
    frames: usize,
    python_walk: bool,
    scratch: &Scratch,
) -> Result<StackRun> {
    let mut procs = (0..workers)
        .map(|i| {
            let mut cmd = Command::new(python);
            cmd.arg(fixture_source("python/bench_python.py"))
                .arg("stack")
                .arg(frames.to_string())
                .arg((seconds + 30).to_string());
            Proc::spawn(cmd, &format!("python worker {i}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let pids: Vec<String> = procs.iter().map(|w| w.pid().to_string()).collect();
    let output = scratch.path(&format!("python-{frames}-{python_walk}.pb.gz"));
    let mut cmd = profiler_command(profiler, "profiler=debug");
    cmd.arg("--duration")
        .arg(seconds.to_string())
        .arg("--output")
        .arg(&output)
        .arg("--pid")
        .arg(pids.join(","));
    if !python_walk {
        cmd.arg("--no-python");
    }
    let recorder = Proc::spawn(cmd, "profiler record")?;
    let (finished, window) = record(recorder, |_| {
        let mut all = true;
        for worker in procs.iter_mut() {
            all &= !worker.poll()?;
        }
        Ok(all)
    })?;
    drop(procs);
    if !finished.usage.success {
        bail!(
            "profiler record failed; its log:\n{}",
            tail(&finished.stderr, 20)
        );
    }
    Ok(StackRun {
        frames,
        python_walk,
        bpf: bpf_cost(&window),
        agent: parse::parse_agent_summary(&finished.stderr),
        counters: parse::parse_agent_counters(&finished.stderr),
    })
}

/// What reading code objects costs the agent.
#[derive(Debug)]
pub struct CodeObjectCost {
    pub objects: usize,
    /// Mean time to read and decode a code object never seen before (through /proc/PID/mem).
    pub new_object_ns: f64,
    /// Mean time to answer the same object from the cache.
    pub cached_ns: f64,
}

pub fn run_code_objects(python: &Path) -> Result<CodeObjectCost> {
    let mut child = Command::new(python)
        .arg(fixture_source("python/bench_python.py"))
        .arg("code-objects")
        .arg(CODE_OBJECTS.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .context("start the code-object workload")?;
    let result = (|| {
        let stdout = child.stdout.take().context("stdout")?;
        let mut addresses = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if line == "ready" {
                break;
            }
            addresses.push(
                line.trim()
                    .parse::<u64>()
                    .context("a code object address")?,
            );
        }
        let pid = Pid(child.id());
        let mut files = FileCache::new(64);
        let snapshot = read_process(
            pid,
            &PathBuf::from(format!("/proc/{pid}")),
            "host",
            &mut files,
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let process = detect_python(&snapshot.info).map_err(|e| anyhow::anyhow!("{e}"))?;
        let memory = ProcMemory::open(pid).map_err(|e| anyhow::anyhow!("{e}"))?;
        // The fingerprints BPF would have recorded for them (read once, untimed).
        let objects = addresses
            .iter()
            .map(|&address| {
                read_code_object(&memory, &process.layout, process.code_type_addr, address)
                    .map(|code| (address, code.fingerprint))
                    .map_err(|e| anyhow::anyhow!("code object at {address:#x}: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut cache = CodeCache::new(4 * CODE_OBJECTS);
        let read_all = |cache: &mut CodeCache| -> Result<f64> {
            let start = Instant::now();
            for &(address, fingerprint) in &objects {
                let code = cache
                    .code_object(
                        &memory,
                        &process.layout,
                        process.code_type_addr,
                        pid,
                        address,
                        fingerprint,
                    )
                    .map_err(|e| anyhow::anyhow!("code object at {address:#x}: {e}"))?;
                std::hint::black_box(Arc::clone(&code));
            }
            Ok(start.elapsed().as_nanos() as f64 / addresses.len().max(1) as f64)
        };
        let new_object_ns = read_all(&mut cache)?;
        let cached_ns = read_all(&mut cache)?;
        Ok(CodeObjectCost {
            objects: addresses.len(),
            new_object_ns,
            cached_ns,
        })
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Fresh interpreters the first-samples scenario starts, one after the other.
const FRESH_PROCESSES: usize = 8;
/// CPU time each fresh interpreter burns in its Python function.
const FRESH_CPU_SECONDS: f64 = 0.3;
/// Busy shell loops per CPU that load the machine meanwhile.
const LOAD_PER_CPU: usize = 4;

/// Samples of the fresh interpreters in the first-samples scenario, by what they show.
#[derive(Debug, Default)]
pub struct FirstSamples {
    pub processes: usize,
    pub load_workers: usize,
    /// With Python frames (from interpreter start-up's frozen imports on).
    pub with_python: u64,
    /// In the eval loop without Python frames: CPU time before the agent knew the process.
    pub eval_without_python: u64,
    /// Neither (the interpreter's native start-up and exit).
    pub native_only: u64,
    /// /proc/loadavg (1 minute) when the last process finished.
    pub load_average: Option<f64>,
}

/// Whole-host `profiler record` (the agent's pipeline) while busy loops load the machine and
/// [`FRESH_PROCESSES`] new interpreters start one after the other.
pub fn run_first_samples(
    profiler: &Path,
    python: &Path,
    cpus: usize,
    scratch: &Scratch,
) -> Result<FirstSamples> {
    let load_workers = LOAD_PER_CPU * cpus;
    let mut load = Vec::new();
    for _ in 0..load_workers {
        load.push(
            Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .context("start a busy loop")?,
        );
    }
    let result = (|| {
        let out = scratch.path("first-samples.folded");
        let mut recorder = profiler_command(profiler, "info")
            .args(["--duration", "90", "--format", "folded", "--output"])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("start profiler record")?;
        let stderr = recorder.stderr.take().context("recorder stderr")?;
        let mut lines = BufReader::new(stderr).lines();
        for line in lines.by_ref() {
            if line?.contains("sampler attached") {
                break;
            }
        }
        // Drain the rest of the log so the recorder never blocks on a full pipe.
        let drain = std::thread::spawn(move || lines.map_while(Result::ok).count());
        let program = format!(
            "import time\n\
             def first_python_work():\n    start = time.process_time()\n    \
             while time.process_time() - start < {FRESH_CPU_SECONDS}:\n        pass\n\
             first_python_work()\n"
        );
        for _ in 0..FRESH_PROCESSES {
            let status = Command::new(python)
                .args(["-c", &program])
                .status()
                .context("run a fresh interpreter")?;
            if !status.success() {
                bail!("a fresh interpreter failed: {status}");
            }
        }
        let load_average = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|text| text.split_whitespace().next()?.parse().ok());
        // Stop the recording (it writes its output on SIGINT).
        let _ = Command::new("kill")
            .args(["-INT", &recorder.id().to_string()])
            .status();
        let status = recorder.wait()?;
        let _ = drain.join();
        if !status.success() {
            bail!("profiler record failed: {status}");
        }
        let text = std::fs::read_to_string(&out).context("the folded output")?;
        let name = python
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut samples = FirstSamples {
            processes: FRESH_PROCESSES,
            load_workers,
            load_average,
            ..FirstSamples::default()
        };
        for stack in parse_folded(&text) {
            if stack.frames.first() != Some(&name) {
                continue;
            }
            let python_frame = |frame: &String| {
                frame.contains(".py:") || frame.contains("<string>:") || frame.contains("<frozen")
            };
            if stack.frames.iter().any(python_frame) {
                samples.with_python += stack.count;
            } else if stack
                .frames
                .iter()
                .any(|frame| frame.contains("_PyEval_EvalFrameDefault"))
            {
                samples.eval_without_python += stack.count;
            } else {
                samples.native_only += stack.count;
            }
        }
        Ok(samples)
    })();
    for mut child in load {
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

/// The suite's section of the report.
pub fn render(
    runs: &[StackRun],
    code: Option<&CodeObjectCost>,
    first: Option<&FirstSamples>,
    seconds: u64,
) -> String {
    let mut out = String::from("\n## Python\n\n");
    out.push_str(&format!(
        "Workers run pyenv's CPython 3.12 with {PYTHON_FRAMES} Python frames on the stack (a \
         recursion in `tests/fixtures/python/bench_python.py`), one per CPU; `profiler record \
         --pid` samples them for {seconds} s with the Python walk on, then with `--no-python`; \
         then with {DEEP_PYTHON_FRAMES:?} frames, walk on. BPF cost is the kernel's run-time \
         accounting (kernel.bpf_stats_enabled) per program run.\n\n"
    ));
    out.push_str(
        "| Python frames on the stack | Python walk | BPF ns per sent sample | BPF ns per run (window mean) | median of 1-s means | runs | Python frames per sample |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|\n");
    let show = |value: Option<f64>, digits: usize| {
        value.map_or("?".to_string(), |v| format!("{v:.digits$}"))
    };
    for run in runs {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            run.frames,
            if run.python_walk { "on" } else { "off" },
            show(run.ns_per_sent_sample(), 0),
            show(run.bpf.window_mean_ns, 0),
            show(median(&run.bpf.per_second_ns), 0),
            run.bpf.window_runs,
            show(run.python_frames_per_sample(), 1),
        ));
    }
    let on = runs
        .iter()
        .find(|r| r.python_walk && r.frames == PYTHON_FRAMES)
        .and_then(StackRun::ns_per_sent_sample);
    let off = runs
        .iter()
        .find(|r| !r.python_walk)
        .and_then(StackRun::ns_per_sent_sample);
    if let (Some(on), Some(off)) = (on, off) {
        let extra_us = (on - off) / 1000.0;
        out.push_str(&format!(
            "\nExtra BPF cost of {PYTHON_FRAMES} Python frames (per sent sample, walk on − off): \
             **{extra_us:.1} µs per sample** (target ≤ 10 µs): {}.\n",
            if extra_us <= 10.0 { "met" } else { "MISSED" }
        ));
        for run in runs.iter().filter(|r| r.frames != PYTHON_FRAMES) {
            if let Some(deep) = run.ns_per_sent_sample() {
                out.push_str(&format!(
                    "- {} frames: {:.1} µs per sample more than without the walk ({:.0} ns per frame).\n",
                    run.frames,
                    (deep - off) / 1000.0,
                    (deep - off) / run.frames as f64
                ));
            }
        }
    }
    if let Some(code) = code {
        out.push_str(&format!(
            "\nSymbolizing a new code object (read through /proc/PID/mem, name, file and line \
             table): **{:.1} µs** each over {} objects; from the cache: {:.2} µs.\n",
            code.new_object_ns / 1000.0,
            code.objects,
            code.cached_ns / 1000.0
        ));
    }
    if let Some(first) = first {
        let per_process_ms = first.eval_without_python as f64 * 10.0 / first.processes as f64;
        out.push_str(&format!(
            "\nFirst samples of a new Python process: whole-host `profiler record`, {} busy shell \
             loops as load (load average {}), {} fresh interpreters one after the other, each \
             burning {FRESH_CPU_SECONDS} s of CPU in a Python function. Their samples: {} with \
             Python frames, {} in the eval loop without them, {} native only (start-up and \
             exit). The eval loop ran without Python frames for **{per_process_ms:.0} ms of CPU \
             per process** (at 100 Hz; target < 100 ms): {}.\n",
            first.load_workers,
            first
                .load_average
                .map_or("?".to_string(), |l| format!("{l:.1}")),
            first.processes,
            first.with_python,
            first.eval_without_python,
            first.native_only,
            if per_process_ms < 100.0 {
                "met"
            } else {
                "MISSED"
            }
        ));
    }
    out
}
