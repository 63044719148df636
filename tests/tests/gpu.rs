//! CUDA attribution against stand-in CUDA libraries (tests/fixtures/gpu): real symbol names,
//! signatures and the runtime → driver call path through cuGetProcAddress pointers, no GPU.
//! Needs root (loads the BPF program). `profiler record` runs against a fixture process that
//! waits on stdin until the probes are attached.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use integration_tests::{
    Recording, STANDIN_FLAGS, Scratch, StackSample, cached_fixture, decode_pprof, exclusive,
    find_chain, fixture_source, gpu_standins as standins, proto, pyenv_python, require_external,
    spawn, spawn_with_env, stack_samples, stack_samples_of_type, top_stacks, total_count,
};

/// The scripted synchronization wait of the stand-in driver, in milliseconds.
const SYNC_MS: u64 = 40;
const ROUNDS: u64 = 10;

/// `profiler record` of `pid` until stopped, into `output`, with `extra` flags.
fn record_pid(pid: &str, output: &Path, extra: &[&str]) -> Recording {
    let output = output.to_str().expect("UTF-8 scratch path");
    let mut args = vec![
        "--duration",
        "120",
        "--pid",
        pid,
        "--no-cache",
        "--output",
        output,
    ];
    args.extend_from_slice(extra);
    Recording::spawn("record", &args, &[])
}

/// Waits until the probes of each library (a part of its path) are attached.
fn wait_for_probes(recording: &mut Recording, libraries: &[&str]) {
    for library in libraries {
        recording.wait_for(&["probes attached", library], Duration::from_secs(60));
    }
}

fn spawn_waiting(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|err| panic!("start {}: {err}", program.display()))
}

fn say(child: &mut Child, line: &str) {
    let stdin = child.stdin.as_mut().expect("piped stdin");
    stdin.write_all(line.as_bytes()).expect("write stdin");
    stdin.flush().expect("flush");
}

/// Waits for the fixture's "done" line; returns it.
fn read_done(child: &mut Child) -> String {
    let mut out = String::new();
    let stdout = child.stdout.as_mut().expect("piped stdout");
    BufReader::new(stdout).read_line(&mut out).expect("read");
    assert_eq!(
        out.split_whitespace().next(),
        Some("done"),
        "the fixture did not finish: {out:?}"
    );
    out
}

/// Waits for the fixture's "done" line and its exit; returns the line.
fn wait_done(child: &mut Child) -> String {
    let line = read_done(child);
    child.wait().expect("wait fixture");
    line
}

fn profile_of(output: &Path, kind: &str) -> Vec<StackSample> {
    let path = output.with_file_name(format!("profile.{kind}.pb.gz"));
    assert!(path.exists(), "{} was not written", path.display());
    stack_samples(&decode_pprof(&path))
}

/// Sum of counts of the samples whose leaf-side frames include `frame`.
fn count_with(samples: &[StackSample], frame: &str) -> i64 {
    samples
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == frame))
        .map(|s| s.count)
        .sum()
}

/// Sum of counts of the samples whose frames contain `chain` (root first) contiguously.
fn count_chain(samples: &[StackSample], chain: &[&str]) -> i64 {
    samples
        .iter()
        .filter(|s| find_chain(&s.frames, chain).is_some())
        .map(|s| s.count)
        .sum()
}

/// The value of `field=N` in the last log line containing `marker`.
fn log_number(log: &str, marker: &str, field: &str) -> u64 {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no log line with {marker:?}:\n{log}"));
    let prefix = format!("{field}=");
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(&prefix))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {line:?}"))
}

const MIB: i64 = 1 << 20;
const KIB: i64 = 1 << 10;

#[test]
fn c_program_launches_copies_allocations_and_waits_are_attributed() {
    let _guard = exclusive();
    let dir = standins();
    let app = dir.join("cuda_app");
    let scratch = Scratch::new("gpu-c");
    let output = scratch.path("profile.pb.gz");
    let sync_ms = SYNC_MS.to_string();
    let rounds = ROUNDS.to_string();
    let mut fixture = spawn_waiting(&app, &[&rounds], &[("CUDA_STANDIN_SYNC_MS", &sync_ms)]);
    let pid = fixture.id().to_string();
    // Every call's stack: this test checks them all.
    let mut recording = record_pid(&pid, &output, &["--cuda-stacks-per-second", "10000"]);
    wait_for_probes(&mut recording, &["libcudart.so.12", "libcuda.so.1"]);
    say(&mut fixture, "go\n");
    // The fixture exits right after its last calls: its exit reaches the agent together with
    // (or before) its last records, which must still be named and counted.
    let done = wait_done(&mut fixture);
    let log = recording.stop();
    let rounds = ROUNDS as i64;

    let launches = profile_of(&output, "cuda_launch");
    let summary = top_stacks(&launches, 30);
    // Exact counts per call site, API function and kernel name: each launch once although
    // every runtime launch also calls the driver, and every handle named.
    let expected = [
        ("launch_matmul", "cudaLaunchKernel", "matmul_kernel", 3),
        ("launch_relu", "cudaLaunchKernelExC", "relu_kernel", 2),
        ("launch_softmax", "__cudaLaunchKernel", "softmax_kernel", 1),
        ("launch_triton", "cuLaunchKernel", "triton_fused_add", 4),
        (
            "launch_reduce",
            "cudaLaunchCooperativeKernel",
            "reduce_kernel",
            1,
        ),
        ("launch_scale", "cudaLaunchKernel_ptsz", "scale_kernel", 2),
        ("launch_attention", "cuLaunchKernelEx", "flash_attn_fwd", 3),
        ("replay_graphs", "cudaGraphLaunch", "graph@0x6000", 1),
        ("replay_graphs", "cuGraphLaunch", "graph@0x7000", 1),
    ];
    for (caller, api, kernel, per_round) in expected {
        assert_eq!(
            count_chain(&launches, &["train_step", caller, api, kernel]),
            per_round * rounds,
            "{caller} → {api} → {kernel}:\n{summary}\n{log}"
        );
        assert_eq!(
            count_with(&launches, kernel),
            per_round * rounds,
            "launches named {kernel}:\n{summary}\n{log}"
        );
    }
    let per_round: i64 = expected.iter().map(|e| e.3).sum();
    assert_eq!(
        launches.iter().map(|s| s.count).sum::<i64>(),
        per_round * rounds,
        "no other launches (no double counting):\n{summary}"
    );
    assert!(
        !launches
            .iter()
            .any(|s| s.frames.iter().any(|f| f.starts_with("kernel@"))),
        "every handle named:\n{summary}"
    );
    // Complete stacks: from main down to the launching function, then API and kernel.
    let matmul = launches
        .iter()
        .find(|s| s.frames.last().map(String::as_str) == Some("matmul_kernel"))
        .unwrap_or_else(|| panic!("no matmul stack:\n{summary}"));
    assert!(
        find_chain(
            &matmul.frames,
            &[
                "main",
                "train_step",
                "launch_matmul",
                "cudaLaunchKernel",
                "matmul_kernel"
            ]
        )
        .is_some(),
        "{:?}",
        matmul.frames
    );

    let copies = profile_of(&output, "cuda_memcpy");
    let summary = top_stacks(&copies, 10);
    assert_eq!(
        count_with(&copies, "[host to device]"),
        MIB * rounds,
        "{summary}"
    );
    assert_eq!(
        count_with(&copies, "[device to host]"),
        (4 * KIB + 8 * KIB) * rounds,
        "{summary}"
    );
    assert_eq!(
        count_chain(
            &copies,
            &["copy_results_async", "cudaMemcpyAsync", "[device to host]"]
        ),
        8 * KIB * rounds,
        "{summary}"
    );
    assert_eq!(
        count_chain(&copies, &["copy_weights", "cudaMemcpy"]),
        (MIB + 4 * KIB) * rounds,
        "{summary}"
    );

    // Memory: allocated in the window (bytes and objects), by allocating stack; freed bytes
    // paired with their allocations; nothing in use once the process is gone.
    let path = output.with_file_name("profile.cuda_alloc.pb.gz");
    let memory = decode_pprof(&path);
    let type_names: Vec<String> = memory
        .sample_type
        .iter()
        .map(|t| {
            format!(
                "{}/{}",
                memory.string_table[t.r#type as usize], memory.string_table[t.unit as usize]
            )
        })
        .collect();
    assert_eq!(
        type_names,
        [
            "alloc_space/bytes",
            "alloc_objects/count",
            "inuse_space/bytes",
            "inuse_objects/count"
        ]
    );
    assert_eq!(
        memory.string_table[memory.default_sample_type as usize],
        "alloc_space"
    );
    let allocated = stack_samples_of_type(&memory, "alloc_space");
    let summary = top_stacks(&allocated, 10);
    assert_eq!(
        count_chain(&allocated, &["train_step", "cudaMalloc"]),
        2 * MIB * rounds,
        "{summary}"
    );
    assert_eq!(
        count_chain(
            &allocated,
            &["train_step", "cache_workspace", "cuMemAlloc_v2"]
        ),
        64 * KIB * rounds,
        "{summary}"
    );
    // Stream-ordered allocations, once each although the runtime's also calls the driver's.
    assert_eq!(
        count_chain(
            &allocated,
            &["train_step", "stage_activations", "cudaMallocAsync"]
        ),
        256 * KIB * rounds,
        "{summary}"
    );
    assert_eq!(
        count_chain(
            &allocated,
            &["train_step", "reserve_scratch", "cuMemAllocAsync"]
        ),
        128 * KIB * rounds,
        "{summary}"
    );
    assert_eq!(
        total_count(&allocated),
        (2 * MIB + 64 * KIB + 256 * KIB + 128 * KIB) * rounds,
        "{summary}"
    );
    assert_eq!(
        total_count(&stack_samples_of_type(&memory, "alloc_objects")),
        4 * rounds
    );
    assert_eq!(
        total_count(&stack_samples_of_type(&memory, "inuse_space")),
        0
    );
    let marker = "recording finished: CUDA";
    let freed = (2 * MIB + 256 * KIB + 128 * KIB) * rounds + 64 * KIB * rounds / 2;
    assert_eq!(
        log_number(&log, marker, "cuda_freed_bytes") as i64,
        freed,
        "{log}"
    );
    assert_eq!(
        log_number(&log, marker, "cuda_frees") as i64,
        rounds * 3 + rounds / 2
    );
    // The workspaces never freed went with the process.
    assert_eq!(
        log_number(&log, marker, "cuda_released_bytes") as i64,
        64 * KIB * rounds / 2
    );
    assert_eq!(log_number(&log, marker, "cuda_in_use_bytes"), 0);
    assert_eq!(log_number(&log, marker, "cuda_untracked_frees"), 0);
    assert_eq!(log_number(&log, marker, "cuda_unreadable_results"), 0);
    assert_eq!(log_number(&log, marker, "cuda_events_lost"), 0);

    // Time blocked, per synchronization call: at least the scripted waits, at most the wall
    // time the fixture measured around the calls (which a loaded machine stretches beyond the
    // scripted sleep), and within 10% of it.
    let waits = profile_of(&output, "cuda_sync");
    let summary = top_stacks(&waits, 10);
    let scripted_ns = (SYNC_MS * 1_000_000) as i64 * rounds;
    let measured: Vec<i64> = done
        .trim()
        .strip_prefix("done blocked_ns=")
        .unwrap_or_else(|| panic!("no blocked times in {done:?}"))
        .split(',')
        .map(|n| n.parse().expect("a number"))
        .collect();
    for (chain, measured_ns) in [
        &["train_step", "wait_for_gpu", "cudaDeviceSynchronize"][..],
        &["train_step", "wait_for_streams", "cudaStreamSynchronize"],
        &["train_step", "wait_for_streams", "cuStreamSynchronize"],
    ]
    .into_iter()
    .zip(measured)
    {
        let blocked_ns = count_chain(&waits, chain);
        assert!(
            scripted_ns <= blocked_ns
                && blocked_ns <= measured_ns
                && (measured_ns - blocked_ns) * 10 <= measured_ns,
            "{chain:?}: blocked {blocked_ns} ns, scripted {scripted_ns} ns, measured by the \
             fixture {measured_ns} ns\n{summary}"
        );
    }
    assert_eq!(waits.len(), 3, "no other waits:\n{summary}");
}

/// A process whose main thread exits while another goes on is not taken as exited: the names
/// it learned before still name the launches its other thread makes afterwards.
#[test]
fn a_main_thread_exiting_first_does_not_end_the_process() {
    let _guard = exclusive();
    let dir = standins();
    let scratch = Scratch::new("gpu-leader");
    let output = scratch.path("profile.pb.gz");
    let mut fixture = spawn_waiting(&dir.join("leader_exit"), &[], &[]);
    let pid = fixture.id().to_string();
    let mut recording = record_pid(&pid, &output, &[]);
    wait_for_probes(&mut recording, &["libcuda.so.1"]);
    say(&mut fixture, "go\n");
    wait_done(&mut fixture);
    let log = recording.stop();
    let launches = profile_of(&output, "cuda_launch");
    let summary = top_stacks(&launches, 5);
    assert_eq!(total_count(&launches), 5, "{summary}\n{log}");
    assert_eq!(
        count_chain(
            &launches,
            &[
                "launch_after_leader_exit",
                "cuLaunchKernel",
                "kernel_after_leader_exit"
            ]
        ),
        5,
        "named after the main thread exited:\n{summary}\n{log}"
    );
}

/// CPU samples of a thread spinning inside a synchronization call are marked `[cuda sync]`.
#[test]
fn cpu_samples_inside_synchronization_get_a_cuda_sync_frame() {
    let _guard = exclusive();
    let dir = standins();
    let scratch = Scratch::new("gpu-spin");
    let output = scratch.path("profile.pb.gz");
    // Two rounds: six synchronizations, 1.2 s of spinning. (A sample can also fall in a call's
    // few microseconds outside the spin, e.g. in the probes' own handling: few calls keep that
    // unlikely.)
    let mut fixture = spawn_waiting(
        &dir.join("cuda_app"),
        &["2"],
        &[("CUDA_STANDIN_SYNC_MS", "200"), ("CUDA_STANDIN_SPIN", "1")],
    );
    let pid = fixture.id().to_string();
    let mut recording = record_pid(&pid, &output, &[]);
    wait_for_probes(&mut recording, &["libcudart.so.12", "libcuda.so.1"]);
    say(&mut fixture, "go\n");
    wait_done(&mut fixture);
    std::thread::sleep(Duration::from_millis(300));
    recording.stop();
    let cpu = stack_samples(&decode_pprof(&output));
    let in_sync: i64 = cpu
        .iter()
        .filter(|s| s.frames.last().map(String::as_str) == Some("[cuda sync]"))
        .map(|s| s.count)
        .sum();
    let total: i64 = cpu.iter().map(|s| s.count).sum();
    // 1.2 seconds of spinning at 100 Hz (fewer on a busy machine); the rest of the program
    // takes almost no CPU.
    assert!(
        in_sync * 10 >= total * 8 && in_sync >= 20,
        "{in_sync} of {total} samples marked:\n{}",
        top_stacks(&cpu, 5)
    );
    // The spinning function is under the marker, and the whole stack above it is there: the
    // return address the kernel replaced with its uretprobe trampoline while the call runs is
    // restored, so the caller of each synchronization follows the runtime's frame.
    let marked: Vec<&StackSample> = cpu
        .iter()
        .filter(|s| s.frames.last().map(String::as_str) == Some("[cuda sync]"))
        .collect();
    let summary = top_stacks(&cpu, 5);
    // Nearly all: on a busy machine a sample also lands in the synchronization call itself
    // just before or after its spin (seen in a clean-clone run under load).
    let spinning: i64 = marked
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == "spin_wait"))
        .map(|s| s.count)
        .sum();
    assert!(
        spinning * 100 >= in_sync * 95,
        "{spinning} of {in_sync} marked samples are in the spin:
{summary}"
    );
    let whole: i64 = marked
        .iter()
        .filter(|s| {
            ["wait_for_gpu", "wait_for_streams"]
                .iter()
                .any(|caller| s.frames.iter().any(|f| f == caller))
                && s.frames.iter().any(|f| f == "main")
                && !s
                    .frames
                    .iter()
                    .any(|f| f == "[unknown]" || f == "[truncated]")
        })
        .map(|s| s.count)
        .sum();
    assert!(
        whole * 100 >= in_sync * 95,
        "{whole} of {in_sync} marked samples have their whole stack:\n{summary}"
    );
}

/// Which files are CUDA libraries is decided by their exported functions only.
#[test]
fn cuda_libraries_are_recognized_by_exported_symbols_only() {
    use profiler::gpu::discovery::probe_points;
    let dir = standins();
    let scratch = Scratch::new("gpu-symbols");
    let renamed = scratch.path("libcudart-abc123.so.12");
    std::fs::copy(dir.join("libcudart.so.12"), &renamed).expect("copy");
    let runtime: Vec<&str> = probe_points(&renamed)
        .expect("readable")
        .iter()
        .map(|p| p.symbol)
        .collect();
    for symbol in [
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "__cudaLaunchKernel",
        "__cudaGetKernel",
        "cudaMemcpy",
        "cudaMalloc",
        "cudaMallocAsync",
        "cudaFreeAsync",
        "cudaDeviceSynchronize",
    ] {
        assert!(
            runtime.contains(&symbol),
            "{symbol} missing from {runtime:?}"
        );
    }
    // Variants are probed by their own names; symbols the stand-in lacks are simply not probed.
    assert!(runtime.contains(&"cudaLaunchKernel_ptsz"), "{runtime:?}");
    for missing in [
        "cudaLaunchKernelExC_ptsz",
        "cudaMemcpy_ptds",
        "cudaMallocAsync_ptsz",
    ] {
        assert!(!runtime.contains(&missing), "{missing} in {runtime:?}");
    }
    // A library named like the runtime but exporting no launch function is not probed.
    let impostor = scratch.path("libcudart.so.12");
    std::fs::copy(nvml_standin(), &impostor).expect("copy");
    assert!(probe_points(&impostor).expect("readable").is_empty());
    // Not an ELF file: a clear error, not a panic.
    let text = scratch.path("libcuda.so.1");
    std::fs::write(&text, "not a library").expect("write");
    let error = probe_points(&text).expect_err("not ELF").to_string();
    assert!(error.contains("libcuda.so.1"), "{error}");
}

/// Python through ctypes: a renamed copy of the runtime (`libcudart-abc123.so.12`, found by its
/// symbols), loaded with dlopen after the profiler started; Python functions in the stacks.
#[test]
fn python_ctypes_launches_from_a_renamed_runtime_loaded_late() {
    let Some(python) = pyenv_python("3.11.7", "python3.11") else {
        assert!(
            !require_external(),
            "pyenv's Python 3.11.7 not found under $PYENV_ROOT or ~/.pyenv, and \
             PROFILER_REQUIRE_EXTERNAL=1"
        );
        eprintln!("skipped: pyenv's Python 3.11.7 not found under $PYENV_ROOT or ~/.pyenv");
        return;
    };
    let _guard = exclusive();
    let dir = standins();
    let scratch = Scratch::new("gpu-py");
    let renamed = scratch.path("libcudart-abc123.so.12");
    std::fs::copy(dir.join("libcudart.so.12"), &renamed).expect("copy runtime");
    let output = scratch.path("profile.pb.gz");
    let script = fixture_source("gpu/cuda_app.py");
    let library_path = dir.display().to_string();
    let mut fixture = spawn_waiting(
        &python,
        &[script.to_str().unwrap(), renamed.to_str().unwrap(), "5"],
        &[
            ("LD_LIBRARY_PATH", &library_path),
            ("CUDA_STANDIN_SYNC_MS", "20"),
        ],
    );
    let pid = fixture.id().to_string();
    let mut recording = record_pid(&pid, &output, &[]);
    recording.wait_for(&["sampler attached"], Duration::from_secs(60));
    // Only now does the script load the libraries.
    say(&mut fixture, "load\n");
    wait_for_probes(&mut recording, &["libcudart-abc123.so.12", "libcuda.so.1"]);
    say(&mut fixture, "go\n");
    read_done(&mut fixture);
    // Python function names are read from the live process: it exits after the recording.
    let log = recording.stop();
    say(&mut fixture, "exit\n");
    fixture.wait().expect("wait fixture");

    // Every call under its Python caller, itself under the module's code.
    let launches = profile_of(&output, "cuda_launch");
    let summary = top_stacks(&launches, 10);
    assert_eq!(total_count(&launches), 5 * 3, "{summary}\n{log}");
    assert_eq!(
        count_chain(&launches, &["<module>", "train_step", "launch_fused"]),
        5 * 3,
        "Python frames missing:\n{summary}"
    );
    assert_eq!(
        count_chain(&launches, &["cuLaunchKernel", "py_fused_softmax"]),
        5 * 3,
        "named by cuModuleGetFunction:\n{summary}\n{log}"
    );
    let copies = profile_of(&output, "cuda_memcpy");
    assert_eq!(
        count_chain(&copies, &["<module>", "train_step", "copy_inputs"]),
        5 * (64 << 10),
        "{}",
        top_stacks(&copies, 5)
    );
    let allocated = profile_of(&output, "cuda_alloc");
    assert_eq!(
        count_chain(&allocated, &["<module>", "allocate"]),
        64 << 10,
        "{}",
        top_stacks(&allocated, 5)
    );
    let waits = profile_of(&output, "cuda_sync");
    let blocked: i64 = count_chain(&waits, &["<module>", "train_step", "wait_for_gpu"]);
    assert!(
        blocked > 0 && blocked == total_count(&waits),
        "{}",
        top_stacks(&waits, 5)
    );
}

/// Only files exporting CUDA functions are probed, whatever their names: a library named
/// like the runtime that exports none is left alone, a copy of the driver under the runtime's
/// name is probed as the driver. Processes that make no CUDA call leave no CUDA profile.
#[test]
fn files_without_cuda_symbols_are_not_probed() {
    let _guard = exclusive();
    let dir = standins();
    let scratch = Scratch::new("gpu-none");
    let impostor_dir = scratch.path("impostor");
    let driver_dir = scratch.path("driver");
    std::fs::create_dir_all(&impostor_dir).expect("mkdir");
    std::fs::create_dir_all(&driver_dir).expect("mkdir");
    let impostor = impostor_dir.join("libcudart.so.12");
    std::fs::copy(nvml_standin(), &impostor).expect("copy");
    let renamed_driver = driver_dir.join("libcudart.so.12");
    std::fs::copy(dir.join("libcuda.so.1"), &renamed_driver).expect("copy");
    let driver_points = profiler::gpu::discovery::probe_points(&renamed_driver).expect("ELF");
    assert!(driver_points.iter().any(|p| p.symbol == "cuLaunchKernel"));
    assert!(!driver_points.iter().any(|p| p.symbol.starts_with("cuda")));
    // Two processes map them (preloaded), and make no CUDA call.
    let preloaded = |library: &Path| {
        spawn_with_env(
            Path::new("sleep"),
            &["60"],
            &[("LD_PRELOAD", library.to_str().expect("UTF-8 path"))],
        )
    };
    let sleepers = [preloaded(&impostor), preloaded(&renamed_driver)];
    // Both have mapped their library before the profiler's first scan.
    for sleeper in &sleepers {
        let maps = format!("/proc/{}/maps", sleeper.pid());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(&maps)
            .unwrap_or_default()
            .contains("libcudart.so.12")
        {
            assert!(Instant::now() < deadline, "{maps} never mapped the library");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let pids = format!("{},{}", sleepers[0].pid(), sleepers[1].pid());
    let output = scratch.path("profile.pb.gz");
    let mut recording = Recording::spawn(
        "record",
        &[
            "--duration",
            "3",
            "--pid",
            &pids,
            "--no-cache",
            "--output",
            output.to_str().unwrap(),
        ],
        &[],
    );
    let line = recording.wait_for(
        &["probes attached", renamed_driver.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert!(
        line.contains(&format!("probes={}", driver_points.len())),
        "{line}"
    );
    let log = recording.wait();
    assert!(
        !log.contains(impostor.to_str().unwrap()),
        "the impostor was probed:\n{log}"
    );
    for kind in ["cuda_launch", "cuda_sync", "cuda_memcpy", "cuda_alloc"] {
        assert!(
            !output
                .with_file_name(format!("profile.{kind}.pb.gz"))
                .exists(),
            "{kind} written for processes making no CUDA call"
        );
    }
}

/// A launch storm beyond the per-thread stack budget: every launch is counted, and every one
/// sits on the full stack: the first launch of the kernel gets a stack, those over the budget are
/// weighted onto the last stack of their kernel and thread. The counters agree.
#[test]
fn a_launch_storm_over_the_stack_budget_is_counted_in_full() {
    const LAUNCHES: i64 = 20_000;
    let _guard = exclusive();
    let dir = standins();
    let scratch = Scratch::new("gpu-storm");
    let output = scratch.path("profile.pb.gz");
    let mut fixture = spawn_waiting(&dir.join("launch_loop"), &[&LAUNCHES.to_string(), "0"], &[]);
    let pid = fixture.id().to_string();
    let mut recording = record_pid(&pid, &output, &["--cuda-stacks-per-second", "2"]);
    wait_for_probes(&mut recording, &["libcudart.so.12"]);
    say(&mut fixture, "go\n");
    let mut out = String::new();
    BufReader::new(fixture.stdout.as_mut().expect("piped"))
        .read_line(&mut out)
        .expect("read");
    let elapsed_ns: u64 = out
        .trim()
        .strip_prefix("elapsed_ns=")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output {out:?}"));
    fixture.wait().expect("wait fixture");
    let log = recording.stop();

    let launches = profile_of(&output, "cuda_launch");
    let summary = top_stacks(&launches, 5);
    assert_eq!(total_count(&launches), LAUNCHES, "{summary}\n{log}");
    assert_eq!(count_with(&launches, "bench_kernel"), LAUNCHES, "{summary}");
    assert_eq!(
        count_chain(&launches, &["main", "cudaLaunchKernel", "bench_kernel"]),
        LAUNCHES,
        "every launch on the full stack:\n{summary}"
    );
    let marker = "recording finished: CUDA";
    let stacks = log_number(&log, marker, "cuda_stacks") as i64;
    let first = log_number(&log, marker, "cuda_first_stacks") as i64;
    let over_budget = log_number(&log, marker, "cuda_stacks_rate_limited") as i64;
    // The first launch of the kernel, then a burst of 2 stacks and 2 per second of the run.
    let budget = 1 + 2 + 2 * elapsed_ns.div_ceil(1_000_000_000) as i64;
    assert_eq!(first, 1, "{log}");
    assert!(
        (1..=budget).contains(&stacks),
        "{stacks} stacks taken over {elapsed_ns} ns, budget {budget}:\n{log}"
    );
    assert_eq!(stacks + over_budget, LAUNCHES, "{log}");
    assert_eq!(
        log_number(&log, marker, "cuda_weighted_calls") as i64,
        over_budget,
        "{log}"
    );
    assert_eq!(log_number(&log, marker, "cuda_unattributed_calls"), 0);
    assert_eq!(log_number(&log, marker, "cuda_events_lost"), 0);
}

/// A plain HTTP/1.0 GET on loopback; returns the body.
fn http_get(address: &str, path: &str) -> String {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(address).expect("connect to the agent");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default()
}

/// Starts `profiler agent` with an HTTP server on a free loopback port; returns it and the
/// address.
fn start_agent(args: &[&str], env: &[(&str, &str)]) -> (Recording, String) {
    let mut all = vec!["--listen", "127.0.0.1:0", "--store", "off", "--no-cache"];
    all.extend_from_slice(args);
    let mut agent = Recording::spawn("agent", &all, env);
    let line = agent.wait_for(&["agent running"], Duration::from_secs(60));
    let address = line
        .split("url=http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("no url in {line:?}"))
        .to_string();
    (agent, address)
}

fn run(mut cmd: Command) {
    let output = cmd.output().expect("run build command");
    assert!(
        output.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn nvml_standin() -> PathBuf {
    build_nvml_standin("gpu/libnvidia-ml.so.1", &[])
}

/// The NVML stand-in without `nvmlDeviceGetPowerUsage`.
fn nvml_standin_without_power() -> PathBuf {
    build_nvml_standin(
        "gpu/no-power/libnvidia-ml.so.1",
        &["-DNVML_STANDIN_NO_POWER"],
    )
}

fn build_nvml_standin(name: &str, defines: &[&str]) -> PathBuf {
    cached_fixture(name, |out| {
        std::fs::create_dir_all(out.parent().expect("a directory")).expect("mkdir");
        let mut cmd = Command::new("gcc");
        cmd.args(STANDIN_FLAGS)
            .args(defines)
            .arg("-Wl,-soname,libnvidia-ml.so.1")
            .arg("-o")
            .arg(out)
            .arg(fixture_source("gpu/fake_nvml.c"));
        run(cmd);
    })
}

/// Polls `/metrics` until a line starts with `prefix`; returns the whole text.
fn wait_for_metric(address: &str, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = http_get(address, "/metrics");
        if text.lines().any(|l| l.starts_with(prefix)) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no {prefix} on /metrics:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn nvml_readings_are_served_with_dcgm_names_and_as_history() {
    let _guard = exclusive();
    let library = nvml_standin();
    // Named as a service is (OpenTelemetry's variable): the GPU process's metrics carry the
    // service_name its profiles have.
    let sleeper = spawn_with_env(
        Path::new("sleep"),
        &["60"],
        &[("OTEL_SERVICE_NAME", "vllm-decoder")],
    );
    let pid = sleeper.pid().to_string();
    let (agent, address) = start_agent(
        &[
            "--pid",
            &pid,
            "--nvml-library",
            library.to_str().unwrap(),
            "--nvml-interval",
            "0.2",
        ],
        &[("NVML_STANDIN_PID", &pid)],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let text = http_get(&address, "/metrics");
        if text.contains("gpu_process_sm_utilization_percent") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let labels0 = "gpu=\"0\",UUID=\"GPU-11111111-2222-3333-4444-555555555555\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\"";
    for (name, value) in [
        ("DCGM_FI_DEV_GPU_UTIL", "41"),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", "20"),
        ("DCGM_FI_DEV_FB_USED", "3072"),
        ("DCGM_FI_DEV_FB_RESERVED", "512"),
        ("DCGM_FI_DEV_GPU_TEMP", "63"),
        ("DCGM_FI_DEV_POWER_USAGE", "312.5"),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "123456789"),
        ("DCGM_FI_DEV_SM_CLOCK", "1980"),
        ("DCGM_FI_DEV_MEM_CLOCK", "2619"),
        ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "1500"),
        ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "2500"),
        ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "4"),
    ] {
        let prefix = format!("{name}{{{labels0},Hostname=");
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in /metrics:\n{metrics}"));
        assert!(line.ends_with(&format!("}} {value}")), "{line}");
    }
    assert!(
        metrics.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"1\""),
        "{metrics}"
    );
    assert!(metrics.lines().any(|l| l == "gpu_available 1"), "{metrics}");
    assert!(
        !metrics.contains("DCGM_FI_DEV_ECC"),
        "NotSupported readings are left out"
    );
    let process_line = format!(
        "gpu_process_memory_used_bytes{{pid=\"{pid}\",comm=\"sleep\",service_name=\"vllm-decoder\",gpu=\"0\""
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with(&process_line) && l.ends_with(" 1073741824")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("gpu_process_sm_utilization_percent")
                && l.contains("service_name=\"vllm-decoder\"")
                && l.ends_with(" 73")),
        "{metrics}"
    );

    let body = http_get(&address, "/api/gpu?from=0&until=99999999999999");
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(json["available"], true, "{body}");
    assert!(json["reason"].is_null(), "{body}");
    let gpus = json["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 2, "{body}");
    assert_eq!(gpus[0]["uuid"], "GPU-11111111-2222-3333-4444-555555555555");
    assert_eq!(gpus[0]["name"], "NVIDIA H100 80GB HBM3");
    let point = &gpus[0]["points"][0];
    assert_eq!(point["util"], 41, "{body}");
    assert_eq!(point["mem_util"], 20);
    assert_eq!(point["mem_used_bytes"], 3u64 << 30);
    assert_eq!(point["mem_total_bytes"], 80u64 << 30);
    assert!(point["t"].as_i64().unwrap() > 1_600_000_000_000);
    agent.stop();
}

#[test]
fn without_nvml_the_agent_runs_and_reports_gpu_unavailable() {
    let _guard = exclusive();
    let sleeper = spawn(Path::new("sleep"), &["60"]);
    let pid = sleeper.pid().to_string();
    let (agent, address) = start_agent(
        &[
            "--pid",
            &pid,
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ],
        &[],
    );
    let metrics = http_get(&address, "/metrics");
    assert!(metrics.lines().any(|l| l == "gpu_available 0"), "{metrics}");
    assert!(!metrics.contains("DCGM_FI"), "{metrics}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let json: serde_json::Value = loop {
        let json: serde_json::Value =
            serde_json::from_str(&http_get(&address, "/api/gpu")).expect("JSON");
        if !json["reason"].is_null() || Instant::now() > deadline {
            break json;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(json["available"], false);
    assert!(
        json["reason"]
            .as_str()
            .unwrap_or("")
            .contains("NVML is unavailable"),
        "{json}"
    );
    assert_said_once(&agent.stop(), "NVML is unavailable");
}

/// An NVML library without one optional function: the other readings are served, the missing
/// one is left out, and the agent says so once, not at every poll.
#[test]
fn an_nvml_function_the_library_lacks_is_left_out_and_reported_once() {
    let _guard = exclusive();
    let library = nvml_standin_without_power();
    let sleeper = spawn(Path::new("sleep"), &["60"]);
    let pid = sleeper.pid().to_string();
    let (agent, address) = start_agent(
        &[
            "--pid",
            &pid,
            "--nvml-library",
            library.to_str().unwrap(),
            "--nvml-interval",
            "0.1",
        ],
        &[],
    );
    // Several polls have happened once the history holds several points.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let json: serde_json::Value =
            serde_json::from_str(&http_get(&address, "/api/gpu?from=0&until=99999999999999"))
                .expect("JSON");
        let points = json["gpus"][0]["points"].as_array().map_or(0, Vec::len);
        if points >= 5 {
            break;
        }
        assert!(Instant::now() < deadline, "NVML not polled: {json}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let metrics = http_get(&address, "/metrics");
    assert!(metrics.lines().any(|l| l == "gpu_available 1"), "{metrics}");
    assert!(
        metrics.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\""),
        "{metrics}"
    );
    assert!(metrics.contains("DCGM_FI_DEV_SM_CLOCK{"), "{metrics}");
    assert!(!metrics.contains("DCGM_FI_DEV_POWER_USAGE"), "{metrics}");
    assert_said_once(&agent.stop(), "nvmlDeviceGetPowerUsage");
}

/// DCGM's profiling fields, from the stand-in's GPM functions (nvml.h's structures): `(name,
/// the stand-in's GPM value of the whole GPU)`, in GPM's units (percent, MiB/s).
const GPM_EXPECTED: &[(&str, f64)] = &[
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 87.5),
    ("DCGM_FI_PROF_SM_ACTIVE", 75.0),
    ("DCGM_FI_PROF_SM_OCCUPANCY", 37.5),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 50.0),
    ("DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE", 45.0),
    ("DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE", 1.25),
    ("DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE", 2.5),
    ("DCGM_FI_PROF_DRAM_ACTIVE", 62.5),
    ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", 5.0),
    ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", 12.5),
    ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", 7.5),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", 1024.0),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", 2048.0),
    ("DCGM_FI_PROF_NVLINK_TX_BYTES", 4096.0),
    ("DCGM_FI_PROF_NVLINK_RX_BYTES", 8192.0),
];

/// GPM's value in DCGM's unit: activity as a ratio 0-1, traffic in bytes per second.
fn in_dcgm_unit(name: &str, gpm: f64) -> f64 {
    if name.ends_with("_BYTES") {
        gpm * 1_048_576.0
    } else {
        gpm / 100.0
    }
}

/// The value of the one `/metrics` line of `name` whose labels start with `labels`.
fn metric_line_value(metrics: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}");
    let lines: Vec<&str> = metrics.lines().filter(|l| l.starts_with(&prefix)).collect();
    assert_eq!(lines.len(), 1, "{prefix}: {lines:?}\n{metrics}");
    lines[0]
        .rsplit_once(' ')
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or_else(|| panic!("no value in {:?}", lines[0]))
}

/// Starts the agent on the NVML stand-in, polling every 50 ms (shorter than GPM's 100-ms
/// window: the stand-in refuses closer samples) until GPM fields are served.
fn agent_with_gpm(env: &[(&str, &str)]) -> (Recording, String, String) {
    let library = nvml_standin();
    let sleeper = spawn(Path::new("sleep"), &["60"]);
    let pid = sleeper.pid().to_string();
    let (agent, address) = start_agent(
        &[
            "--pid",
            &pid,
            "--nvml-library",
            library.to_str().unwrap(),
            "--nvml-interval",
            "0.05",
        ],
        env,
    );
    let metrics = wait_for_metric(&address, "DCGM_FI_PROF_SM_ACTIVE{");
    drop(sleeper);
    (agent, address, metrics)
}

/// Every DCGM profiling field from GPM, in dcgm-exporter's names, units and labels, for the GPU
/// that has GPM; the one without (an Ampere part) has none, and `/api/gpu` and the log (once)
/// say why.
#[test]
fn gpm_gives_dcgm_profiling_fields_per_gpu() {
    let _guard = exclusive();
    let (agent, address, metrics) = agent_with_gpm(&[]);
    let labels0 = "gpu=\"0\",UUID=\"GPU-11111111-2222-3333-4444-555555555555\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=";
    for &(name, gpm) in GPM_EXPECTED {
        let value = metric_line_value(&metrics, name, labels0);
        let wanted = in_dcgm_unit(name, gpm);
        assert!(
            (value - wanted).abs() <= wanted * 1e-9,
            "{name}: {value}, wanted {wanted}"
        );
        assert!(
            metrics.contains(&format!("# TYPE {name} gauge")),
            "{name} has no TYPE line"
        );
        assert!(
            !metrics.contains(&format!("{name}{{gpu=\"1\"")),
            "GPU 1 has no GPM, yet {name} is served for it:\n{metrics}"
        );
    }
    assert!(
        !metrics.contains("GPU_I_ID"),
        "MIG labels without MIG:\n{metrics}"
    );
    let body = http_get(&address, "/api/gpu?from=0&until=99999999999999");
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let gpus = json["gpus"].as_array().expect("gpus");
    assert_eq!(gpus[0]["profiling"]["available"], true, "{body}");
    assert!(gpus[0]["profiling"]["reason"].is_null(), "{body}");
    assert_eq!(gpus[1]["profiling"]["available"], false, "{body}");
    let reason = gpus[1]["profiling"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("GPM"), "{body}");
    // Many polls later, still said once.
    std::thread::sleep(Duration::from_millis(500));
    assert_said_once(&agent.stop(), "DCGM profiling fields are off");
}

/// In MIG mode each GPU instance gets its own fields, labelled `GPU_I_ID` as dcgm-exporter
/// does, with that instance's values; the whole GPU is not reported beside them.
#[test]
fn gpm_gives_dcgm_profiling_fields_per_mig_instance() {
    let _guard = exclusive();
    let (agent, address, metrics) = agent_with_gpm(&[("NVML_STANDIN_MIG", "1")]);
    let labels0 = "gpu=\"0\",UUID=\"GPU-11111111-2222-3333-4444-555555555555\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=";
    // Both instances are sampled in the same poll, but wait for the second to have a window.
    let metrics = if metrics.contains("GPU_I_ID=\"2\"") {
        metrics
    } else {
        std::thread::sleep(Duration::from_millis(300));
        http_get(&address, "/metrics")
    };
    for &(name, gpm) in GPM_EXPECTED {
        let lines: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{{labels0}")))
            .collect();
        assert_eq!(
            lines.len(),
            2,
            "{name}: one line per GPU instance: {lines:?}"
        );
        for (instance, profile, share) in [(1, "3g.40gb", 0.5), (2, "2g.20gb", 0.25)] {
            // dcgm-exporter's MIG labels: the profile (from the driver's MIG device name) and id.
            let labels = format!(",GPU_I_PROFILE=\"{profile}\",GPU_I_ID=\"{instance}\"}}");
            let line = lines
                .iter()
                .find(|l| l.contains(&labels))
                .unwrap_or_else(|| panic!("{name}: no {labels}: {lines:?}"));
            let value: f64 = line
                .rsplit_once(' ')
                .and_then(|(_, v)| v.parse().ok())
                .expect("a value");
            let wanted = in_dcgm_unit(name, gpm * share);
            assert!(
                (value - wanted).abs() <= wanted * 1e-9,
                "{line}: wanted {wanted}"
            );
        }
    }
    agent.stop();
}

/// The profiles of a process NVML lists as using a GPU carry a `gpu` series label, and the
/// `cuda_alloc` profile of every window holds the device memory still allocated at its end.
#[test]
fn agent_profiles_of_a_gpu_process_carry_the_gpu_label_and_memory_in_use() {
    const ROUNDS: i64 = 4;
    let _guard = exclusive();
    let dir = standins();
    let scratch = Scratch::new("gpu-agent");
    let output_dir = scratch.path("profiles");
    let library = nvml_standin();
    let mut fixture = spawn_waiting(
        &dir.join("cuda_app"),
        &[&ROUNDS.to_string(), "linger"],
        &[("CUDA_STANDIN_SYNC_MS", "5")],
    );
    let pid = fixture.id().to_string();
    let (mut agent, address) = start_agent(
        &[
            "--pid",
            &pid,
            "--nvml-library",
            library.to_str().unwrap(),
            "--nvml-interval",
            "0.2",
            "--interval",
            "1",
            "--output-dir",
            output_dir.to_str().unwrap(),
        ],
        &[("NVML_STANDIN_PID", &pid)],
    );
    wait_for_probes(&mut agent, &["libcudart.so.12", "libcuda.so.1"]);
    // NVML lists the process before it makes its first call.
    wait_for_metric(
        &address,
        &format!("gpu_process_memory_used_bytes{{pid=\"{pid}\""),
    );
    say(&mut fixture, "go\n");
    read_done(&mut fixture);
    let done_ns = integration_tests::server_harness::unix_now_ns();

    let types = |profile: &proto::Profile| -> Vec<String> {
        profile
            .sample_type
            .iter()
            .map(|t| profile.string_table[t.r#type as usize].clone())
            .collect()
    };
    let comments = |profile: &proto::Profile| -> Vec<String> {
        profile
            .comment
            .iter()
            .map(|&c| profile.string_table[c as usize].clone())
            .collect()
    };
    // A window that began after the fixture finished: its end sees the final allocations.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (memory, launches) = loop {
        let profiles: Vec<proto::Profile> = std::fs::read_dir(&output_dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().ends_with(".pb.gz"))
                    .map(|p| decode_pprof(&p))
                    .collect()
            })
            .unwrap_or_default();
        let memory = profiles
            .iter()
            .find(|p| p.time_nanos > done_ns && types(p).contains(&"inuse_space".to_string()))
            .cloned();
        let launches: Vec<proto::Profile> = profiles
            .into_iter()
            .filter(|p| types(p) == ["launches"])
            .collect();
        if let Some(memory) = memory {
            break (memory, launches);
        }
        assert!(
            Instant::now() < deadline,
            "no cuda_alloc profile of a window after the work:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    say(&mut fixture, "exit\n");
    fixture.wait().expect("wait fixture");
    let log = agent.stop();

    assert!(
        comments(&memory).contains(&"gpu=0".to_string()),
        "{:?}",
        comments(&memory)
    );
    let in_use = stack_samples_of_type(&memory, "inuse_space");
    let summary = top_stacks(&in_use, 5);
    // Half the rounds' 64 KiB workspaces were freed; the others are still allocated.
    assert_eq!(
        total_count(&in_use),
        64 * KIB * ROUNDS / 2,
        "{summary}\n{log}"
    );
    assert_eq!(
        count_chain(&in_use, &["train_step", "cache_workspace", "cuMemAlloc_v2"]),
        64 * KIB * ROUNDS / 2,
        "{summary}"
    );
    assert_eq!(
        total_count(&stack_samples_of_type(&memory, "inuse_objects")),
        ROUNDS / 2
    );
    assert_eq!(
        total_count(&stack_samples_of_type(&memory, "alloc_space")),
        0,
        "nothing allocated in that window"
    );
    // The launches were profiled with the label too.
    assert!(!launches.is_empty(), "no cuda_launch profile:\n{log}");
    let launched: i64 = launches
        .iter()
        .map(|p| total_count(&stack_samples(p)))
        .sum();
    assert_eq!(launched, 18 * ROUNDS, "{log}");
    assert!(
        launches
            .iter()
            .all(|p| comments(p).contains(&"gpu=0".to_string())),
        "{:?}",
        launches.iter().map(comments).collect::<Vec<_>>()
    );
}

/// A recorder of attachments, which can fail chosen symbols' return probes, or everything as
/// when the CUDA programs do not load.
struct Recorder {
    attached: Vec<(&'static str, bool)>,
    fail_return_of: &'static str,
    programs_unavailable: bool,
    /// Lifecycle events lost so far, as the kernel's counter would say.
    lifecycle_events_lost: u64,
}

impl Recorder {
    /// One whose every attachment succeeds.
    fn attaching_everything() -> Self {
        Recorder {
            attached: Vec::new(),
            fail_return_of: "",
            programs_unavailable: false,
            lifecycle_events_lost: 0,
        }
    }
}

impl profiler::gpu::discovery::ProbeAttacher for Recorder {
    fn prepare(&mut self) -> Result<(), profiler::bpf::BpfError> {
        if self.programs_unavailable {
            return Err(profiler::bpf::BpfError::CudaNotLoaded);
        }
        Ok(())
    }

    fn attach(
        &mut self,
        _target: &Path,
        point: &profiler::gpu::discovery::ProbePoint,
        at_return: bool,
    ) -> Result<(), profiler::bpf::BpfError> {
        if at_return && point.symbol == self.fail_return_of {
            return Err(profiler::bpf::BpfError::UProbe {
                target: "test".into(),
                source: aya::programs::ProgramError::AlreadyAttached,
            });
        }
        self.attached.push((point.symbol, at_return));
        Ok(())
    }

    fn lifecycle_events_lost(&self) -> u64 {
        self.lifecycle_events_lost
    }
}

/// A /proc under `scratch` with one process mapping the stand-in runtime, its root being ours;
/// returns the runtime's path.
fn proc_with_the_runtime(scratch: &Scratch) -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    let runtime = standins().join("libcudart.so.12");
    let inode = std::fs::metadata(&runtime).expect("stat").ino();
    let process = scratch.path("proc/4242");
    std::fs::create_dir_all(&process).expect("mkdir");
    std::fs::write(
        process.join("maps"),
        format!(
            "7f0000000000-7f0000010000 r-xp 00000000 00:00 {inode} {}\n",
            runtime.display()
        ),
    )
    .expect("write maps");
    std::os::unix::fs::symlink("/", process.join("root")).expect("symlink");
    runtime
}

/// Return probes are attached before entry probes, so a call entered in between never leaves
/// a per-thread depth raised; an entry whose return probe failed is not attached at all.
#[test]
fn return_probes_are_attached_before_entry_probes() {
    let scratch = Scratch::new("gpu-attach-order");
    let runtime = proc_with_the_runtime(&scratch);
    let mut discovery = profiler::gpu::discovery::Discovery::new(scratch.path("proc"));
    let mut recorder = Recorder {
        fail_return_of: "__cudaGetKernel",
        ..Recorder::attaching_everything()
    };
    let users = discovery.scan(&mut recorder);
    assert_eq!(users.len(), 1);
    let points = profiler::gpu::discovery::probe_points(&runtime).expect("ELF");
    for point in &points {
        let position = |at_return| {
            recorder
                .attached
                .iter()
                .position(|&(symbol, r)| symbol == point.symbol && r == at_return)
        };
        if point.symbol == "__cudaGetKernel" {
            assert_eq!((position(true), position(false)), (None, None));
        } else {
            // Every call is reported at its return, when its result is known.
            let (ret, entry) = (position(true), position(false));
            assert!(
                matches!((ret, entry), (Some(r), Some(e)) if r < e),
                "{}: {:?}",
                point.symbol,
                recorder.attached
            );
        }
    }
    for symbol in [
        "cudaMalloc",
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
    ] {
        assert!(
            recorder.attached.contains(&(symbol, true)),
            "{symbol}: {:?}",
            recorder.attached
        );
    }
    assert_eq!(discovery.stats.attach_errors, 1);
}

/// With changes watched, a scan reads only the maps of new processes and of those reported
/// changed; lost announcements or lost lifecycle events make it read every process again.
/// Judged by what the scan finds after the files under the fake /proc change behind its back.
#[test]
fn scans_read_only_the_maps_that_may_have_changed() {
    let scratch = Scratch::new("gpu-scan-changes");
    proc_with_the_runtime(&scratch);
    let mut discovery = profiler::gpu::discovery::Discovery::new(scratch.path("proc"));
    discovery.watch_changes();
    let mut recorder = Recorder::attaching_everything();
    let pid = profiler::model::Pid(4242);
    assert_eq!(discovery.scan(&mut recorder), vec![pid]);
    assert_eq!(discovery.stats.maps_read, 1);

    // The process unmaps the runtime, unannounced: the scan keeps what it knew, unread.
    let maps = scratch.path("proc/4242/maps");
    let mapping_the_runtime = std::fs::read(&maps).expect("read maps");
    std::fs::write(&maps, "").expect("write maps");
    assert!(discovery.scan(&mut recorder).is_empty(), "no new user");
    assert!(discovery.users().contains(&pid));
    assert_eq!(
        (discovery.stats.maps_read, discovery.stats.maps_unchanged),
        (1, 1)
    );

    // Announced: read again, and no longer a user.
    discovery.note_changed(pid);
    discovery.scan(&mut recorder);
    assert!(discovery.users().is_empty());
    assert_eq!(discovery.stats.maps_read, 2);

    // Mapped again and announcements lost: every process is read.
    std::fs::write(&maps, &mapping_the_runtime).expect("write maps");
    discovery.note_unknown_changes();
    assert_eq!(discovery.scan(&mut recorder), vec![pid]);
    assert_eq!(discovery.stats.maps_read, 3);

    // Unmapped unannounced, then lifecycle events lost (a fork and an exit of a reused pid
    // look the same): every process is read, once.
    std::fs::write(&maps, "").expect("write maps");
    recorder.lifecycle_events_lost = 2;
    discovery.scan(&mut recorder);
    assert!(discovery.users().is_empty(), "read after the loss");
    assert_eq!(discovery.stats.maps_read, 4);
    std::fs::write(&maps, &mapping_the_runtime).expect("write maps");
    discovery.scan(&mut recorder);
    assert!(discovery.users().is_empty(), "no loss since: not read");
    assert_eq!(discovery.stats.maps_read, 4);
}

/// A process that exec'ed since the last scan and mapped only files known not to be CUDA
/// libraries (or anonymous code) is not read; one that mapped a file not known so, exec'ed before the last scan
/// began, or forked after its exec, is. Judged, as above, by what the scan finds after the
/// maps change behind its back.
#[test]
fn scans_trust_announced_execs_that_mapped_only_files_known_not_to_be_cuda() {
    use profiler::model::{MmapChange, Pid, monotonic_now_ns};
    use std::os::unix::fs::MetadataExt;
    let scratch = Scratch::new("gpu-scan-announced");
    let runtime = proc_with_the_runtime(&scratch);
    let inode_of = |path: &std::path::Path| std::fs::metadata(path).expect("stat").ino();
    let plain = std::path::PathBuf::from("/bin/true");
    let other = std::path::PathBuf::from("/bin/false");
    let maps_line = |path: &std::path::Path| {
        format!(
            "7f0000000000-7f0000010000 r-xp 00000000 00:00 {} {}\n",
            inode_of(path),
            path.display()
        )
    };
    let process = scratch.path("proc/4243");
    std::fs::create_dir_all(&process).expect("mkdir");
    std::os::unix::fs::symlink("/", process.join("root")).expect("symlink");
    let maps = process.join("maps");
    std::fs::write(&maps, maps_line(&plain)).expect("write maps");
    let mut discovery = profiler::gpu::discovery::Discovery::new(scratch.path("proc"));
    discovery.watch_changes();
    let mut recorder = Recorder::attaching_everything();
    let pid = Pid(4243);
    assert_eq!(discovery.scan(&mut recorder), vec![Pid(4242)]);
    assert_eq!(discovery.stats.maps_read, 2);
    // From now on the maps say it maps the runtime: only a read finds it.
    std::fs::write(&maps, maps_line(&runtime)).expect("write maps");
    let mapped = |path: &std::path::Path| MmapChange::Mapped {
        pid,
        path: std::sync::Arc::from(path.to_str().expect("utf-8")),
        inode: Some(inode_of(path)),
    };

    // Exec'ed since the last scan, then mapped a file known not to be a CUDA library.
    discovery.note_mmap_change(&MmapChange::Exec {
        pid,
        time_ns: monotonic_now_ns(),
    });
    discovery.note_mmap_change(&mapped(&plain));
    // Anonymous code (a JIT's) holds no library.
    discovery.note_mmap_change(&MmapChange::Mapped {
        pid,
        path: std::sync::Arc::from("//anon"),
        inode: None,
    });
    assert!(discovery.scan(&mut recorder).is_empty());
    assert_eq!(
        (discovery.stats.maps_read, discovery.stats.maps_unchanged),
        (2, 2),
        "not read"
    );

    // Exec'ed before the last scan began (its announcement late): read.
    let before_the_last_scan = monotonic_now_ns() - 1;
    discovery.scan(&mut recorder);
    discovery.note_exec(pid, before_the_last_scan);
    assert_eq!(discovery.scan(&mut recorder), vec![pid]);
    assert_eq!(discovery.stats.maps_read, 3);

    // Exec'ed, then (its pid reused) forked from a process that maps the runtime: read.
    std::fs::write(&maps, maps_line(&plain)).expect("write maps");
    let exec_ns = monotonic_now_ns();
    discovery.note_exec(pid, exec_ns);
    discovery.note_fork(pid, Pid(4242), exec_ns + 1);
    discovery.note_mappings_complete_before(monotonic_now_ns());
    discovery.scan(&mut recorder);
    assert!(!discovery.users().contains(&pid), "read: no runtime now");
    assert_eq!(discovery.stats.maps_read, 4);

    // Exec'ed and mapped a file never checked: read.
    std::fs::write(&maps, maps_line(&runtime)).expect("write maps");
    discovery.note_exec(pid, monotonic_now_ns());
    discovery.note_mmap_change(&mapped(&other));
    assert_eq!(discovery.scan(&mut recorder), vec![pid]);
    assert_eq!(discovery.stats.maps_read, 5);

    // Mapped the runtime, a file known to be one: read (the scan confirms it).
    discovery.note_mmap_change(&mapped(&runtime));
    discovery.scan(&mut recorder);
    assert!(discovery.users().contains(&pid));
    assert_eq!(discovery.stats.maps_read, 6);
}

/// A process under the fake /proc of `scratch` whose maps show `path` mapped.
fn fake_process(scratch: &Scratch, pid: u32, path: &Path) {
    use std::os::unix::fs::MetadataExt;
    let process = scratch.path(&format!("proc/{pid}"));
    std::fs::create_dir_all(&process).expect("mkdir");
    let _ = std::os::unix::fs::symlink("/", process.join("root"));
    let inode = std::fs::metadata(path).expect("stat").ino();
    std::fs::write(
        process.join("maps"),
        format!(
            "7f0000000000-7f0000010000 r-xp 00000000 00:00 {inode} {}\n",
            path.display()
        ),
    )
    .expect("write maps");
}

/// A process forked since the last scan from one known then not to map a CUDA library (read
/// by that scan, or itself forked so), with nothing unknown mapped since, is not read; one
/// forked from a process that maps one, from one that mapped an unknown file meanwhile,
/// before the last scan ended, or after the announcements read, is. Every child's maps show
/// the runtime, so the scan finds it only where it reads them.
#[test]
fn scans_trust_forks_from_processes_known_not_to_map_cuda() {
    use profiler::model::{MmapChange, Pid, monotonic_now_ns};
    use std::os::unix::fs::MetadataExt;
    let scratch = Scratch::new("gpu-scan-forks");
    let runtime = proc_with_the_runtime(&scratch);
    let user = Pid(4242);
    let plain = Path::new("/bin/true");
    let parent = Pid(5000);
    fake_process(&scratch, parent.0, plain);
    let mut discovery = profiler::gpu::discovery::Discovery::new(scratch.path("proc"));
    discovery.watch_changes();
    let mut recorder = Recorder::attaching_everything();
    assert_eq!(discovery.scan(&mut recorder), vec![user]);
    assert_eq!(discovery.stats.maps_read, 2);
    let mut child = 5000;
    let mut fork_from = |discovery: &mut profiler::gpu::discovery::Discovery, from: Pid| {
        child += 1;
        fake_process(&scratch, child, &runtime);
        discovery.note_fork(Pid(child), from, monotonic_now_ns());
        Pid(child)
    };

    // Forked from a process the last scan read, and a chain of forks from that child.
    let first = fork_from(&mut discovery, parent);
    discovery.note_mappings_complete_before(monotonic_now_ns());
    assert!(discovery.scan(&mut recorder).is_empty());
    assert_eq!(discovery.stats.maps_read, 2, "no child read");
    let second = fork_from(&mut discovery, first);
    let third = fork_from(&mut discovery, second);
    discovery.note_mappings_complete_before(monotonic_now_ns());
    assert!(discovery.scan(&mut recorder).is_empty());
    assert_eq!(discovery.stats.maps_read, 2, "no child read");
    assert!(!discovery.users().contains(&third));

    // Forked after the announcements read: its parent's last mappings may be unread.
    discovery.note_mappings_complete_before(monotonic_now_ns());
    let late = fork_from(&mut discovery, parent);
    assert_eq!(discovery.scan(&mut recorder), vec![late]);
    assert_eq!(discovery.stats.maps_read, 3);
    // From a process that maps the runtime.
    let of_user = fork_from(&mut discovery, user);
    discovery.note_mappings_complete_before(monotonic_now_ns());
    assert_eq!(discovery.scan(&mut recorder), vec![of_user]);
    assert_eq!(discovery.stats.maps_read, 4);

    // From a process that mapped a file never checked before the fork.
    discovery.note_mmap_change(&MmapChange::Mapped {
        pid: parent,
        path: std::sync::Arc::from("/bin/false"),
        inode: Some(std::fs::metadata("/bin/false").expect("stat").ino()),
    });
    let after_unknown = fork_from(&mut discovery, parent);
    discovery.note_mappings_complete_before(monotonic_now_ns());
    assert_eq!(discovery.scan(&mut recorder), vec![after_unknown]);
    assert_eq!(discovery.stats.maps_read, 6, "the parent and the child");

    // Forked before the last scan ended (announced late): its parent may have changed after
    // that scan read it.
    let during_last_scan = monotonic_now_ns();
    discovery.scan(&mut recorder);
    child += 1;
    fake_process(&scratch, child, &runtime);
    discovery.note_fork(Pid(child), parent, during_last_scan);
    discovery.note_mappings_complete_before(monotonic_now_ns());
    assert_eq!(discovery.scan(&mut recorder), vec![Pid(child)]);
}

/// When the CUDA programs cannot load, a CUDA library is skipped whole: no attempt per probe
/// (and no warning per probe), nothing counted as attached.
#[test]
fn without_cuda_programs_no_probe_is_attempted() {
    let scratch = Scratch::new("gpu-no-programs");
    proc_with_the_runtime(&scratch);
    let mut discovery = profiler::gpu::discovery::Discovery::new(scratch.path("proc"));
    let mut recorder = Recorder {
        programs_unavailable: true,
        ..Recorder::attaching_everything()
    };
    assert!(discovery.scan(&mut recorder).is_empty());
    assert!(recorder.attached.is_empty(), "{:?}", recorder.attached);
    assert_eq!(discovery.stats.libraries_attached, 0);
    assert_eq!(discovery.stats.attach_errors, 0);
    assert_eq!(discovery.stats.probes_attached, 0);
}

/// NVIDIA's real CUDA 13 runtime (libcudart.so.13 of the PyTorch venv `cargo xtask setup`
/// installs), or `None` (a failure where external pieces are required).
fn real_cuda_13_runtime() -> Option<PathBuf> {
    let venv = integration_tests::workspace_root().join(".tools/torch-venv/lib");
    let found = std::fs::read_dir(&venv).ok().and_then(|entries| {
        entries
            .flatten()
            .map(|entry| {
                entry
                    .path()
                    .join("site-packages/nvidia/cu13/lib/libcudart.so.13")
            })
            .find(|path| path.is_file())
    });
    if found.is_none() {
        assert!(
            !require_external(),
            "no libcudart.so.13 under {} (`cargo xtask setup` installs PyTorch's CUDA libraries)",
            venv.display()
        );
        eprintln!("skipping: no real CUDA 13 runtime under {}", venv.display());
    }
    found
}

/// On NVIDIA's real CUDA 13 runtime, `__cudaLaunchKernel` (what nvcc 13's kernel stubs call) is
/// a trampoline into `cudaLaunchKernel`: both probes fire for one launch. Each launch is counted
/// once, under the call its program made (on an H100, PyTorch's adds were counted twice before).
/// Without a driver every call fails; such calls still count as launches until failed calls
/// are classified (then this test counts them as failed calls of each function).
#[test]
fn a_launch_through_the_real_runtimes_trampoline_is_counted_once() {
    const BY_HANDLE: i64 = 3_000;
    const DIRECT: i64 = 1_000;
    let _guard = exclusive();
    let Some(runtime) = real_cuda_13_runtime() else {
        return;
    };
    let program = cached_fixture("gpu/real_runtime_launch", |out| {
        std::fs::create_dir_all(out.parent().expect("a directory")).expect("mkdir");
        let mut cmd = Command::new("gcc");
        cmd.args(["-O2", "-g", "-fno-omit-frame-pointer", "-o"])
            .arg(out)
            .arg(fixture_source("gpu/real_runtime_launch.c"))
            .arg("-ldl");
        run(cmd);
    });
    let scratch = Scratch::new("gpu-real-runtime");
    let output = scratch.path("profile.pb.gz");
    let runtime_arg = runtime.to_str().expect("UTF-8 path");
    let mut fixture = spawn_waiting(
        &program,
        &[runtime_arg, &BY_HANDLE.to_string(), &DIRECT.to_string()],
        &[],
    );
    let pid = fixture.id().to_string();
    let mut recording = record_pid(&pid, &output, &["--cuda-stacks-per-second", "100000"]);
    wait_for_probes(&mut recording, &["libcudart.so.13"]);
    say(&mut fixture, "go\n");
    let done = wait_done(&mut fixture);
    assert!(
        done.contains("handle_rc=35"),
        "the real runtime answered {done}"
    );
    let log = recording.stop();

    // Without a driver every launch failed: none is work, each is one failed call, named by
    // the call its program made.
    assert_eq!(
        total_count(&profile_if_written(&output, "cuda_launch")),
        0,
        "failed launches are no launches\n{log}"
    );
    let errors = profile_of(&output, "cuda_errors");
    let summary = top_stacks(&errors, 6);
    assert_eq!(
        total_count(&errors),
        BY_HANDLE + DIRECT,
        "every launch once:\n{summary}\n{log}"
    );
    assert_eq!(
        count_chain(
            &errors,
            &[
                "launch_by_handle",
                "__cudaLaunchKernel",
                "[cudaErrorInsufficientDriver]"
            ]
        ),
        BY_HANDLE,
        "{summary}"
    );
    assert_eq!(
        count_chain(
            &errors,
            &[
                "launch_directly",
                "cudaLaunchKernel",
                "[cudaErrorInsufficientDriver]"
            ]
        ),
        DIRECT,
        "{summary}"
    );
}

/// The samples of a profile kind, or none when the recording wrote no such profile.
fn profile_if_written(output: &Path, kind: &str) -> Vec<StackSample> {
    let path = output.with_file_name(format!("profile.{kind}.pb.gz"));
    if path.exists() {
        stack_samples(&decode_pprof(&path))
    } else {
        Vec::new()
    }
}

/// NVIDIA's real CUDA 12 runtime, from the `nvidia-cuda-runtime-cu12` wheel `cargo xtask setup`
/// installs, or `None` (a failure where external pieces are required).
fn real_cuda_12_runtime() -> Option<PathBuf> {
    let path = integration_tests::workspace_root()
        .join(".tools/cuda-runtime-cu12/nvidia/cuda_runtime/lib/libcudart.so.12");
    if path.is_file() {
        return Some(path);
    }
    assert!(
        !require_external(),
        "no {} (`cargo xtask setup` installs nvidia-cuda-runtime-cu12)",
        path.display()
    );
    eprintln!("skipping: no real CUDA 12 runtime at {}", path.display());
    None
}

/// NVIDIA's real libcudart.so.12 (its symbols versioned `@@libcudart.so.12`) without a driver:
/// every launch, copy, allocation, wait and free returns cudaErrorInsufficientDriver. None of
/// them is counted as work; each is a failed call of its function, labelled with its error, on
/// the stack that made it (the first failure of each kind gets a stack, the others are weighted
/// onto it, so even at the smallest budget every call has one).
#[test]
fn failed_calls_of_the_real_runtime_are_errors_not_work() {
    const CALLS: i64 = 500;
    let _guard = exclusive();
    let Some(runtime) = real_cuda_12_runtime() else {
        return;
    };
    // Without frame pointers: the stacks taken at the calls' returns unwind by the tables.
    let program = cached_fixture("gpu/real_runtime_calls_nofp", |out| {
        std::fs::create_dir_all(out.parent().expect("a directory")).expect("mkdir");
        let mut cmd = Command::new("gcc");
        cmd.args(["-O2", "-g", "-fomit-frame-pointer", "-o"])
            .arg(out)
            .arg(fixture_source("gpu/real_runtime_calls.c"))
            .arg("-ldl");
        run(cmd);
    });
    let scratch = Scratch::new("gpu-real-runtime-12");
    let output = scratch.path("profile.pb.gz");
    let runtime_arg = runtime.to_str().expect("UTF-8 path");
    let mut fixture = spawn_waiting(&program, &[runtime_arg, &CALLS.to_string()], &[]);
    let pid = fixture.id().to_string();
    let mut recording = record_pid(&pid, &output, &["--cuda-stacks-per-second", "1"]);
    wait_for_probes(&mut recording, &["libcudart.so.12"]);
    say(&mut fixture, "go\n");
    let done = wait_done(&mut fixture);
    for field in ["launch_rc", "memcpy_rc", "malloc_rc", "sync_rc", "free_rc"] {
        assert!(
            done.contains(&format!("{field}=35")),
            "the real runtime answered {done}"
        );
    }
    let log = recording.stop();

    for kind in ["cuda_launch", "cuda_memcpy", "cuda_alloc", "cuda_sync"] {
        assert_eq!(
            total_count(&profile_if_written(&output, kind)),
            0,
            "{kind}: failed calls are no work\n{log}"
        );
    }
    let path = output.with_file_name("profile.cuda_errors.pb.gz");
    assert!(path.exists(), "no cuda_errors profile:\n{log}");
    let profile = decode_pprof(&path);
    let errors = stack_samples(&profile);
    let summary = top_stacks(&errors, 8);
    assert_eq!(total_count(&errors), 5 * CALLS, "{summary}\n{log}");
    for (caller, function) in [
        ("fail_launches", "cudaLaunchKernel"),
        ("fail_copies", "cudaMemcpy"),
        ("fail_allocations", "cudaMalloc"),
        ("fail_waits", "cudaDeviceSynchronize"),
        ("fail_frees", "cudaFree"),
    ] {
        assert_eq!(
            count_chain(
                &errors,
                &["main", caller, function, "[cudaErrorInsufficientDriver]"]
            ),
            CALLS,
            "{function} from {caller}, on its stack:\n{summary}"
        );
    }
    // The error is also a label of each sample.
    let label_key = profile
        .string_table
        .iter()
        .position(|s| s == "cuda_error")
        .expect("a cuda_error label") as i64;
    let labelled: i64 = profile
        .sample
        .iter()
        .filter(|sample| {
            sample.label.iter().any(|label| {
                label.key == label_key
                    && profile.string_table[label.str as usize] == "cudaErrorInsufficientDriver"
            })
        })
        .map(|sample| sample.value[0])
        .sum();
    assert_eq!(labelled, 5 * CALLS);
}

/// `text` appears exactly once in the agent's `log`: said at the first occasion, not at every poll.
fn assert_said_once(log: &str, text: &str) {
    assert_eq!(log.matches(text).count(), 1, "{text:?} said once:\n{log}");
}
