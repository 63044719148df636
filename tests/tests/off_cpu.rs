//! Off-CPU and GIL-wait profiles end to end: the real `sched_switch` program times real
//! fixture processes while they block, and the agent pairs, unwinds and symbolizes the blocks.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use integration_tests::{server_harness::*, *};

const SIGUSR1: i32 = 10;
const SLEEP_CHAIN: [&str; 4] = ["main", "sleep_outer", "sleep_middle", "sleep_inner"];

/// The fixture's and recording's files.
struct Run {
    scratch: Scratch,
}

impl Run {
    fn new(tag: &str) -> Run {
        Run {
            scratch: Scratch::new(tag),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.scratch.path(name)
    }

    /// The stacks of the `kind` profile (`off_cpu`, `gil_wait`) the recording wrote next to
    /// `stacks.folded`; none when it wrote no such profile (nothing blocked).
    fn stacks(&self, kind: &str) -> Vec<FoldedStack> {
        std::fs::read_to_string(self.path(&format!("stacks.{kind}.folded")))
            .map(|text| parse_folded(&text))
            .unwrap_or_default()
    }
}

/// `profiler record --off-cpu` with `probability` into `run`'s `stacks.folded` (and its
/// `stacks.<kind>.folded` siblings), of `pid` or of the whole host; returns once attached.
fn start_recording(run: &Run, pid: Option<u32>, probability: &str) -> Recording {
    let out = run.path("stacks.folded");
    let pid = pid.map(|pid| pid.to_string());
    let mut args = vec![
        "--off-cpu",
        "--off-cpu-probability",
        probability,
        "--format",
        "folded",
        "--output",
        out.to_str().unwrap(),
    ];
    if let Some(pid) = &pid {
        args.extend(["--pid", pid]);
    }
    Recording::until_stopped(&args)
}

/// Starts `profiler record --off-cpu` of `pid` (every blocking switch, or `probability` of
/// them), once it is attached signals the fixture to begin, waits for the fixture to end and
/// stops the recording. Returns the recording's log.
fn record_waits(run: &Run, fixture: &mut Running, probability: &str) -> String {
    let recording = start_recording(run, Some(fixture.pid()), probability);
    send_signal(fixture.pid(), SIGUSR1);
    let (status, _) = fixture.wait_measuring_cpu();
    assert!(status.success(), "the fixture failed: {status}");
    recording.stop()
}

fn has_frame(stack: &FoldedStack, name: &str) -> bool {
    stack
        .frames
        .iter()
        .any(|frame| frame == name || frame.starts_with(&format!("{name} ")))
}

fn sum(stacks: &[FoldedStack], keep: impl Fn(&FoldedStack) -> bool) -> u64 {
    stacks.iter().filter(|s| keep(s)).map(|s| s.count).sum()
}

fn slept_ns(path: &Path) -> f64 {
    std::fs::read_to_string(path)
        .expect("the fixture wrote the time it slept")
        .trim()
        .parse()
        .expect("a number of nanoseconds")
}

/// The fixture sleeping 2 s under [`SLEEP_CHAIN`], recorded with `probability`: the
/// recording's files, the nanoseconds the fixture measured around its sleeps, the log.
fn record_sleeping_chain(tag: &str, probability: &str) -> (Run, f64, String) {
    let fixture = fp_fixture("off_cpu_waits.c");
    let run = Run::new(tag);
    let result = run.path("slept");
    let mut running = spawn(&fixture, &["sleep", "2", result.to_str().unwrap()]);
    let log = record_waits(&run, &mut running, probability);
    let slept = slept_ns(&result);
    (run, slept, log)
}

/// Every blocking switch timed: the blocked time under the sleeping chain is the time the
/// fixture measured around its sleeps, within 10 %.
#[test]
fn blocked_time_under_a_sleeping_chain_matches_the_time_slept() {
    let _guard = exclusive();
    let (run, slept, log) = record_sleeping_chain("off-cpu-sleep", "1");
    let stacks = run.stacks("off_cpu");
    let in_chain = sum(&stacks, |s| {
        find_chain(&s.frames, &SLEEP_CHAIN).is_some() && has_frame(s, "do_nanosleep")
    });
    let total = sum(&stacks, |_| true);
    assert!(
        (in_chain as f64 - slept).abs() <= 0.10 * slept,
        "{in_chain} ns blocked under {SLEEP_CHAIN:?} in do_nanosleep, the fixture slept {slept} \
         ns ({total} ns blocked in all); stacks: {:#?}\nlog: {log}",
        stacks.iter().take(5).collect::<Vec<_>>()
    );
    // The stack ends in the scheduler, without the tracepoint's and the program's frames.
    let leaf = stacks
        .iter()
        .filter(|s| find_chain(&s.frames, &SLEEP_CHAIN).is_some())
        .map(|s| s.frames.last().unwrap().as_str())
        .collect::<Vec<_>>();
    assert!(
        leaf.iter().all(|l| *l == "__schedule"),
        "leaf frames: {leaf:?}"
    );
}

/// A share of the switches sampled: each block stands for 1/share, so the total still
/// estimates the time slept (1,000 blocks, a quarter sampled: 25 % is over four standard
/// deviations).
#[test]
fn sampled_blocks_estimate_the_time_blocked() {
    let _guard = exclusive();
    let (run, slept, log) = record_sleeping_chain("off-cpu-sampled", "0.25");
    let in_chain = sum(&run.stacks("off_cpu"), |s| {
        find_chain(&s.frames, &SLEEP_CHAIN).is_some()
    });
    assert!(
        (in_chain as f64 - slept).abs() <= 0.25 * slept,
        "estimated {in_chain} ns blocked under the chain, the fixture slept {slept} ns\nlog: {log}"
    );
    assert!(
        log.contains("off_cpu_stacks"),
        "the BPF counters are logged: {log}"
    );
}

/// A mutex, a pipe read and a futex: each thread's time shows under its own function, with
/// the kernel's and the C library's frames of its cause.
#[test]
fn each_cause_of_waiting_shows_under_its_function() {
    let _guard = exclusive();
    let fixture = fp_fixture("off_cpu_waits.c");
    let run = Run::new("off-cpu-causes");
    let mut running = spawn(&fixture, &["causes", "2"]);
    let log = record_waits(&run, &mut running, "1");
    let stacks = run.stacks("off_cpu");
    let causes: [(&str, &[&str]); 3] = [
        ("wait_on_mutex", &["__lll_lock_wait", "futex_wait"]),
        ("wait_on_pipe", &["anon_pipe_read"]),
        ("wait_on_futex", &["futex_wait"]),
    ];
    for (function, cause) in causes {
        let blocked = sum(&stacks, |s| {
            has_frame(s, function) && cause.iter().all(|frame| has_frame(s, frame))
        });
        // Each thread waits for about 20 ms in every 20 ms of the 2 s.
        assert!(
            blocked >= 1_000_000_000,
            "{function}: {blocked} ns blocked in {cause:?}; top stacks: {:#?}\nlog: {log}",
            stacks
                .iter()
                .filter(|s| has_frame(s, function))
                .take(3)
                .collect::<Vec<_>>()
        );
    }
    // No thread waits for a GIL here.
    assert!(run.stacks("gil_wait").is_empty());
}

/// The whole host, briefly: the agent's own threads' waits are left out.
#[test]
fn the_profilers_own_waits_are_left_out() {
    let _guard = exclusive();
    let fixture = fp_fixture("off_cpu_waits.c");
    let run = Run::new("off-cpu-host");
    let result = run.path("slept");
    let running = spawn(&fixture, &["sleep", "3", result.to_str().unwrap()]);
    // pprof, whose samples carry the pid: the profiler's own threads are told by pid, not by
    // name (another process on the host may be called `profiler` too).
    let out = run.path("stacks.pb.gz");
    let recording = Recording::until_stopped(&[
        "--off-cpu",
        "--off-cpu-probability",
        "1",
        "--format",
        "pprof",
        "--output",
        out.to_str().unwrap(),
    ]);
    let profiler_pid = i64::from(recording.pid());
    send_signal(running.pid(), SIGUSR1);
    std::thread::sleep(Duration::from_millis(1500));
    recording.stop();
    let samples = stack_samples(&decode_pprof(&run.path("stacks.off_cpu.pb.gz")));
    assert!(
        samples
            .iter()
            .any(|s| s.pid == Some(i64::from(running.pid()))),
        "the fixture's waits are recorded ({} stacks)",
        samples.len()
    );
    assert!(
        samples.iter().all(|s| s.pid.is_some()),
        "every off-CPU sample names its process"
    );
    let own: Vec<&StackSample> = samples
        .iter()
        .filter(|s| s.pid == Some(profiler_pid))
        .collect();
    assert!(own.is_empty(), "the profiler's own waits: {own:#?}");
}

/// An interpreter for the GIL test, and whether it has a GIL.
struct Python {
    label: String,
    path: PathBuf,
    has_gil: bool,
}

fn pythons() -> Vec<Python> {
    let mut found = Vec::new();
    for (version, executable) in [
        ("3.8.18", "python3.8"),
        ("3.11.7", "python3.11"),
        ("3.12.1", "python3.12"),
        ("3.13.0", "python3.13"),
    ] {
        match pyenv_python(version, executable) {
            Some(path) => found.push(Python {
                label: format!("pyenv {version}"),
                path,
                has_gil: true,
            }),
            None => skip_or_fail(&format!("pyenv Python {version} is not installed")),
        }
    }
    for (label, path, has_gil) in [
        (
            "debian sid 3.14 (stripped)",
            ".tools/python3.14/usr/bin/python3.14",
            true,
        ),
        (
            "free-threaded 3.14t",
            ".tools/python3.14t/bin/python3.14t",
            false,
        ),
    ] {
        let path = workspace_root().join(path);
        if path.is_file() {
            found.push(Python {
                label: label.into(),
                path,
                has_gil,
            });
        } else {
            skip_or_fail(&format!(
                "{} is missing (`cargo xtask setup`)",
                path.display()
            ));
        }
    }
    found
}

fn skip_or_fail(what: &str) {
    assert!(
        !require_external(),
        "{what} (PROFILER_REQUIRE_EXTERNAL=1 forbids skipping)"
    );
    eprintln!("skipping: {what}");
}

/// Two Python threads fighting for the GIL: each waits about as long as it runs, and the
/// `gil_wait` profile shows that time under the Python function that waits (`spin_a`,
/// `spin_b`), in `take_gil` or its caller. A free-threaded build has no GIL: nothing is
/// reported.
#[test]
fn gil_waits_show_under_the_python_function_that_waits() {
    let _guard = exclusive();
    let script = fixture_source("gil_contention.py");
    for python in pythons() {
        let run = Run::new("gil-wait");
        let mut running = spawn(&python.path, &[script.to_str().unwrap(), "2"]);
        let log = record_waits(&run, &mut running, "1");
        let gil = run.stacks("gil_wait");
        let by_function: BTreeMap<&str, u64> = ["spin_a", "spin_b"]
            .into_iter()
            .map(|f| (f, sum(&gil, |s| has_frame(s, f))))
            .collect();
        if !python.has_gil {
            assert!(
                gil.is_empty(),
                "{}: GIL waits reported for a build without a GIL: {gil:#?}",
                python.label
            );
            continue;
        }
        for (function, waited) in &by_function {
            // Two threads share one GIL for 2 s: each waits for about half of it.
            assert!(
                *waited >= 400_000_000,
                "{}: {function} waited {waited} ns for the GIL ({by_function:?}); stacks: \
                 {:#?}\nlog: {log}",
                python.label,
                gil.iter().take(3).collect::<Vec<_>>()
            );
        }
        // The same time is in off_cpu, where the GIL waits are most of the blocked time.
        let off_cpu = run.stacks("off_cpu");
        let waited: u64 = by_function.values().sum();
        let blocked_in_spin = sum(&off_cpu, |s| {
            has_frame(s, "spin_a") || has_frame(s, "spin_b")
        });
        assert!(
            blocked_in_spin >= waited,
            "{}: off_cpu has {blocked_in_spin} ns under the spin functions, gil_wait {waited}",
            python.label
        );
    }
}

/// `profiler agent --off-cpu` into its store: the service's off-CPU profile and its wall view
/// (CPU and off-CPU time together) answer through the query API Grafana uses.
#[test]
fn the_agent_stores_off_cpu_profiles_and_a_wall_view() {
    let _guard = exclusive();
    let fixture = fp_fixture("off_cpu_waits.c");
    let service = "off-cpu-agent-check";
    let run = Run::new("off-cpu-agent");
    let result = run.path("slept");
    let running = spawn_with_env(
        &fixture,
        &["sleep", "30", result.to_str().unwrap()],
        &[("OTEL_SERVICE_NAME", service)],
    );
    let data_dir = run.path("data");
    let ServerProcess {
        process: mut agent,
        addr,
    } = ServerProcess::try_start_subcommand(
        &profiler_bin(),
        "agent",
        &[
            "--interval",
            "2",
            "--off-cpu",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data_dir.to_str().expect("UTF-8 scratch path"),
        ],
    )
    .unwrap_or_else(|err| panic!("the agent did not listen: {err}"));
    agent
        .wait_for_line(Duration::from_secs(120), |line| {
            line.contains("sampler attached").then_some(())
        })
        .unwrap_or_else(|err| panic!("no `sampler attached`: {err}"));
    send_signal(running.pid(), SIGUSR1);
    let client = Client::new(addr);
    let selector = format!(r#"{{service_name="{service}"}}"#);
    const OFF_CPU: &str = "off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds";
    const WALL: &str = "wall:wall:nanoseconds:wall:nanoseconds";
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let graph = loop {
        let graph = client.merge(OFF_CPU, &selector);
        if flamegraph_total_of(&graph, "sleep_inner") > 0 {
            break graph;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no sleep_inner in {service}'s off_cpu after 120 s:\n{}",
            agent.stderr()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let names = flamegraph_names(&graph);
    for function in ["sleep_outer", "sleep_middle", "do_nanosleep"] {
        assert!(names.iter().any(|n| n == function), "{function}: {names:?}");
    }
    let types = client.connect_json(
        "querier.v1.QuerierService/ProfileTypes",
        serde_json::json!({}),
    );
    for id in [OFF_CPU, WALL] {
        assert!(
            types["profileTypes"]
                .as_array()
                .is_some_and(|all| all.iter().any(|t| t["ID"] == id)),
            "{id} not listed: {types}"
        );
    }
    // The wall view holds the off-CPU time, and the CPU time on top of it.
    let wall = client.merge(WALL, &selector);
    assert!(
        flamegraph_total_of(&wall, "sleep_inner") >= flamegraph_total_of(&graph, "sleep_inner"),
        "wall {} < off_cpu {}",
        flamegraph_total_of(&wall, "sleep_inner"),
        flamegraph_total_of(&graph, "sleep_inner")
    );
    let (status, stderr) = agent.stop();
    assert!(status.success(), "{stderr}");
}

/// py-spy as the oracle: `py-spy record --gil` samples only the thread holding the GIL, so the
/// share of its ticks a function holds the GIL is what `gil_wait` does not count. Both run
/// over the same contention on CPython 3.11; each function's waiting share agrees within 25
/// points (py-spy samples from outside, at 100 Hz, and may miss ticks on a busy machine).
#[test]
fn gil_waits_agree_with_py_spy() {
    let _guard = exclusive();
    let py_spy = workspace_root().join(".tools/py-spy/bin/py-spy");
    let Some(python) = pyenv_python("3.11.7", "python3.11") else {
        skip_or_fail("pyenv Python 3.11.7 is not installed");
        return;
    };
    if !py_spy.is_file() {
        skip_or_fail("py-spy is not installed under .tools (`cargo xtask setup`)");
        return;
    }
    let script = fixture_source("gil_contention.py");
    let run = Run::new("gil-py-spy");
    let mut running = spawn(&python, &[script.to_str().unwrap(), "3"]);
    let pid = running.pid().to_string();
    let recording = start_recording(&run, Some(running.pid()), "1");
    send_signal(running.pid(), SIGUSR1);
    // Inside the 3 s of contention: 0.5 s in, for 2 s. --gil counts the holder per tick;
    // --idle counts every thread at every tick (the main thread's samples are the ticks).
    std::thread::sleep(Duration::from_millis(500));
    let py_spy_run = |mode: &str, name: &str| {
        let path = run.path(name);
        let child = std::process::Command::new(&py_spy)
            .args([
                "record",
                mode,
                "--nonblocking",
                "-d",
                "2",
                "-r",
                "100",
                "-f",
                "raw",
            ])
            .arg("-o")
            .arg(&path)
            .args(["--pid", &pid])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start py-spy");
        (child, path)
    };
    let (mut holders, holders_path) = py_spy_run("--gil", "holders.txt");
    let (mut all, all_path) = py_spy_run("--idle", "all.txt");
    holders.wait().expect("py-spy --gil");
    all.wait().expect("py-spy --idle");
    let (status, _) = running.wait_measuring_cpu();
    assert!(status.success());
    recording.stop();

    let count = |path: &Path, function: &str| -> u64 {
        parse_folded(&std::fs::read_to_string(path).unwrap_or_default())
            .iter()
            .filter(|s| s.frames.iter().any(|f| f.contains(function)))
            .map(|s| s.count)
            .sum()
    };
    let ticks = count(&all_path, "spin_a").max(1) as f64;
    let gil = run.stacks("gil_wait");
    for function in ["spin_a", "spin_b"] {
        let holding = count(&holders_path, function) as f64 / ticks;
        // The 3 s of contention, all inside the recording.
        let waiting = sum(&gil, |s| has_frame(s, function)) as f64 / 3e9;
        eprintln!(
            "{function}: gil_wait {:.0} % of the time, py-spy: holds the GIL {:.0} % of {ticks} ticks",
            waiting * 100.0,
            holding * 100.0
        );
        assert!(
            (waiting - (1.0 - holding)).abs() <= 0.25,
            "{function}: waits {:.0} % of the time for the GIL here, py-spy saw it hold the GIL \
             {:.0} % of {ticks} ticks",
            waiting * 100.0,
            holding * 100.0
        );
    }
}
