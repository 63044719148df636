//! The `gpu` suite: cost of the CUDA probes per call, measured with the stand-in runtime
//! (tests/fixtures/gpu/launch_loop.c), and the slowdown of a loop paced at 100,000 launches/s.
use std::{
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use integration_tests::{Scratch, gpu_standins};

/// Launches per measurement of the tight loop.
const TIGHT_CALLS: u64 = 1_000_000;
/// Launches of the paced loop (2 s at 100,000 launches/s).
const PACED_CALLS: u64 = 200_000;
const PACED_NS_PER_CALL: u64 = 10_000;

pub struct GpuResults {
    pub tight_unprobed_ns: f64,
    pub tight_probed_ns: f64,
    pub tight_stacks_ns: f64,
    pub paced_unprobed_s: f64,
    pub paced_probed_s: f64,
}

/// Runs `launch_loop CALLS WORK`, under `profiler record` with `profiler_args` when given;
/// returns the loop's elapsed nanoseconds.
fn run_loop(
    program: &Path,
    calls: u64,
    work: u64,
    profiler: Option<(&Path, &[&str])>,
    scratch: &Scratch,
) -> Result<u64> {
    let mut workload = Command::new(program)
        .args([calls.to_string(), work.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", program.display()))?;
    let mut recorder = None;
    if let Some((profiler, extra)) = profiler {
        let pid = workload.id().to_string();
        let output = scratch.path("gpu-bench.pb.gz");
        let mut child = Command::new(profiler)
            .args(["record", "--duration", "600", "--no-cache", "--pid", &pid])
            .arg("--output")
            .arg(&output)
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start profiler record")?;
        let log = crate::procs::collect_stderr(&mut child)?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while !log
            .lock()
            .unwrap()
            .lines()
            .any(|l| l.contains("probes attached") && l.contains("libcudart"))
        {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = workload.kill();
                bail!("the probes were not attached:\n{}", log.lock().unwrap());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        recorder = Some(child);
    }
    workload
        .stdin
        .as_mut()
        .context("stdin")?
        .write_all(b"go\n")?;
    let mut line = String::new();
    BufReader::new(workload.stdout.as_mut().context("stdout")?).read_line(&mut line)?;
    workload.wait()?;
    if let Some(mut child) = recorder {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        child.wait()?;
    }
    line.trim()
        .strip_prefix("elapsed_ns=")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("unexpected workload output {line:?}"))
}

pub fn run(profiler: &Path, scratch: &Scratch) -> Result<GpuResults> {
    let program = gpu_standins().join("launch_loop");
    let per_call = |ns: u64, calls: u64| ns as f64 / calls as f64;
    eprintln!("bench: [gpu 1/5] tight launch loop, no probes");
    let tight_unprobed_ns = per_call(
        run_loop(&program, TIGHT_CALLS, 0, None, scratch)?,
        TIGHT_CALLS,
    );
    eprintln!("bench: [gpu 2/5] tight launch loop, probes attached (default stack budget)");
    let tight_probed_ns = per_call(
        run_loop(&program, TIGHT_CALLS, 0, Some((profiler, &[])), scratch)?,
        TIGHT_CALLS,
    );
    eprintln!("bench: [gpu 3/5] tight launch loop, a stack for every call");
    let calls = TIGHT_CALLS / 10;
    let tight_stacks_ns = per_call(
        run_loop(
            &program,
            calls,
            0,
            Some((profiler, &["--cuda-stacks-per-second", "100000000"])),
            scratch,
        )?,
        calls,
    );
    // Pace the loop: find the work per launch that makes one iteration take 10 µs.
    let probe_iterations = 20_000u64;
    let sample = run_loop(&program, probe_iterations, 1000, None, scratch)?;
    let ns_per_work = (per_call(sample, probe_iterations) - tight_unprobed_ns).max(1.0) / 1000.0;
    let work = ((PACED_NS_PER_CALL as f64 - tight_unprobed_ns) / ns_per_work).max(0.0) as u64;
    eprintln!("bench: [gpu 4/5] loop paced at 100,000 launches/s, no probes");
    let paced_unprobed_s = run_loop(&program, PACED_CALLS, work, None, scratch)? as f64 / 1e9;
    eprintln!("bench: [gpu 5/5] loop paced at 100,000 launches/s, probes attached");
    let paced_probed_s =
        run_loop(&program, PACED_CALLS, work, Some((profiler, &[])), scratch)? as f64 / 1e9;
    Ok(GpuResults {
        tight_unprobed_ns,
        tight_probed_ns,
        tight_stacks_ns,
        paced_unprobed_s,
        paced_probed_s,
    })
}

pub fn render(r: &GpuResults) -> String {
    let probe_cost = r.tight_probed_ns - r.tight_unprobed_ns;
    let stack_cost = r.tight_stacks_ns - r.tight_unprobed_ns;
    let slowdown = (r.paced_probed_s / r.paced_unprobed_s - 1.0) * 100.0;
    format!(
        "\n## GPU: CUDA probe cost\n\n\
         Stand-in runtime (tests/fixtures/gpu), `cudaLaunchKernel` → driver `cuLaunchKernel` through a \
         cuGetProcAddress pointer: two entry and two return probes fire per call (the runtime's entry \
         notes the launch, the driver's entry and return are nested, the runtime's return reports \
         it once it succeeded). At the default budget the first launch has a stack and the others \
         are weighted onto it.\n\n\
         | measurement | value |\n|---|---|\n\
         | launch, no probes | {:.0} ns/call |\n\
         | launch, probes attached (default stack budget: weighted onto the kernel's stack) | {:.0} ns/call |\n\
         | cost per probed call | **{:.0} ns** (target ≤ 2000) |\n\
         | launch with a stack for every call (`--cuda-stacks-per-second 100000000`) | {:.0} ns/call (+{:.0} ns) |\n\
         | loop paced at 100,000 launches/s, 200,000 launches, no probes | {:.3} s |\n\
         | same loop, probes attached | {:.3} s (slowdown {:.1} %) |\n",
        r.tight_unprobed_ns,
        r.tight_probed_ns,
        probe_cost,
        r.tight_stacks_ns,
        stack_cost,
        r.paced_unprobed_s,
        r.paced_probed_s,
        slowdown
    )
}
