//! User stacks of code built without frame pointers: what the table-driven `.eh_frame` unwinder
//! must get right. Every fixture here is built with `-O2 -fomit-frame-pointer` (or the Rust and
//! C++ equivalents), so frame-pointer walking sees only the leaf frame and these tests fail with
//! it; they pass once the BPF unwinder follows the CFI.
//!
//! Each assertion message lists the most frequent stacks seen (`root;...;leaf COUNT`, the root
//! being the process name), so a failure shows how the stacks were cut.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use integration_tests::*;

const CHAIN: [&str; 5] = ["main", "level1", "level2", "level3", "level4"];

thread_local! {
    /// CPU time the recorded processes got during this test thread's last [`record`].
    static RECORDED_CPU: std::cell::Cell<Option<Duration>> = const { std::cell::Cell::new(None) };
}

/// The sample count a check needs: `wanted`, or what the CPU time of the last recording can
/// give on a busy machine.
fn needed(wanted: i64) -> i64 {
    match RECORDED_CPU.get() {
        Some(cpu) => sample_floor(wanted, cpu, 0.4),
        None => wanted,
    }
}

/// The longest a [`record`] waits for its processes to get their CPU time. The fixtures run
/// 20 s from their start, so this leaves room for a slow start of the recorder.
const RECORD_AT_MOST: Duration = Duration::from_secs(12);

/// Records `pids` into a pprof profile and returns its samples: from the sampler's attaching
/// until they got `seconds` of CPU time each on average, which a quiet machine gives in about
/// that many seconds and a busy one in several times as many (at most [`RECORD_AT_MOST`], or until
/// one of them ends). The CPU time they got meanwhile is what [`needed`] judges by; at
/// [`SHAPE_SAMPLING_HZ`], whose counts follow it on a busy machine.
fn record(pids: &[u32], seconds: &str, tag: &str) -> Vec<StackSample> {
    let scratch = Scratch::new(tag);
    let out = scratch.path("profile.pb.gz");
    let mut args = vec!["--frequency".to_string(), SHAPE_SAMPLING_HZ.to_string()];
    for pid in pids {
        args.push("--pid".to_string());
        args.push(pid.to_string());
    }
    args.push("--output".to_string());
    args.push(out.to_str().expect("utf-8 path").to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let recording = Recording::until_stopped(&args);
    let wanted = Duration::from_secs_f64(seconds.parse().expect("seconds")) * pids.len() as u32;
    let got = cpu_got_while(
        pids,
        Wait::ForCpu {
            wanted,
            at_most: RECORD_AT_MOST.max(wanted),
        },
    );
    recording.stop();
    RECORDED_CPU.set(Some(got));
    stack_samples(&decode_pprof(&out))
}

/// The samples of one process.
fn of_pid(samples: &[StackSample], pid: u32) -> Vec<StackSample> {
    samples
        .iter()
        .filter(|s| s.pid == Some(i64::from(pid)))
        .cloned()
        .collect()
}

/// Asserts that at least `min_fraction` of the `samples` (weighted by count) satisfy `pred`;
/// the message names `what` and shows the top stacks overall and among the failing samples.
fn assert_fraction(
    samples: &[StackSample],
    min_fraction: f64,
    min_total: i64,
    what: &str,
    pred: impl Fn(&StackSample) -> bool,
) {
    let total = total_count(samples);
    let min_total = needed(min_total);
    assert!(
        total >= min_total,
        "too few samples to judge '{what}': {total} (need at least {min_total} for the CPU time \
         the fixture got); stacks seen:\n{}",
        top_stacks(samples, 5)
    );
    let (good, bad): (Vec<&StackSample>, Vec<&StackSample>) = samples.iter().partition(|s| pred(s));
    let matched = total_count(good.iter().copied());
    assert!(
        matched as f64 >= min_fraction * total as f64,
        "only {matched} of {total} samples ({:.1}%) {what} (need at least {:.0}%).\n\
         Top 5 stacks seen:\n{}Top 5 stacks that fail the check:\n{}",
        100.0 * matched as f64 / total as f64,
        100.0 * min_fraction,
        top_stacks(samples, 5),
        top_stacks(bad, 5)
    );
}

/// Position of the first frame equal to `name`.
fn position(frames: &[String], name: &str) -> Option<usize> {
    frames.iter().position(|f| f == name)
}

/// glibc's start frames above `main`-like frame at `main_index`: `__libc_start_call_main`, and
/// above it `__libc_start_main` (any of its aliases, e.g. `__libc_start_main_impl`) or `_start`.
fn has_libc_start_above(frames: &[String], main_index: usize) -> bool {
    let Some(call_main) = position(frames, "__libc_start_call_main") else {
        return false;
    };
    call_main < main_index
        && frames[..call_main]
            .iter()
            .any(|f| f.starts_with("__libc_start_main") || f == "_start")
}

/// Seconds since the epoch in nanoseconds, as pprof's `time_nanos`.
fn unix_nanos(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_nanos() as i64
}

#[test]
fn c_chain_without_frame_pointers_is_complete_down_to_libc_start() {
    let _guard = exclusive();
    let fixture = nofp_fixture("fp_chain.c");
    let running = spawn(&fixture, &["20"]);
    let samples = of_pid(&record(&[running.pid()], "3", "nofp-chain"), running.pid());
    assert_fraction(
        &samples,
        0.99,
        50,
        "have the chain main;level1;level2;level3;level4",
        |s| find_chain(&s.frames, &CHAIN).is_some(),
    );
    assert_fraction(
        &samples,
        0.99,
        50,
        "reach glibc's start frames (__libc_start_call_main, then __libc_start_main or _start) \
         above main",
        |s| position(&s.frames, "main").is_some_and(|m| has_libc_start_above(&s.frames, m)),
    );
}

#[test]
fn recursion_100_deep_is_complete() {
    const DEPTH: usize = 100;
    let _guard = exclusive();
    let fixture = nofp_fixture("recursion.c");
    let running = spawn(&fixture, &["20"]);
    let samples = of_pid(
        &record(&[running.pid()], "3", "nofp-recursion"),
        running.pid(),
    );
    // Number of consecutive `recurse` frames right below `main`, and whether `spin` follows.
    let shape = |s: &StackSample| {
        let main = position(&s.frames, "main")?;
        let rest = &s.frames[main + 1..];
        let depth = rest.iter().take_while(|f| *f == "recurse").count();
        Some((depth, rest.get(depth).is_some_and(|f| f == "spin")))
    };
    let mut depths: BTreeMap<String, i64> = BTreeMap::new();
    for sample in &samples {
        let key = match shape(sample) {
            Some((depth, true)) => format!("main;recurse×{depth};spin"),
            Some((depth, false)) => format!("main;recurse×{depth};(no spin)"),
            None => "no main".to_string(),
        };
        *depths.entry(key).or_default() += sample.count;
    }
    let total = total_count(&samples);
    let complete = depths
        .get(&format!("main;recurse×{DEPTH};spin"))
        .copied()
        .unwrap_or(0);
    assert!(total >= needed(50), "too few samples: {total}");
    assert!(
        complete as f64 >= 0.95 * total as f64,
        "only {complete} of {total} samples have main, exactly {DEPTH} recurse frames, then spin \
         (need 95%).\nShapes seen (samples): {depths:#?}\nTop 5 stacks:\n{}",
        top_stacks(&samples, 5)
    );
}

/// `main_source` built without frame pointers and linked (with an rpath) against
/// `lib<library>.so`, built from `lib<library>.c` without frame pointers too.
fn program_using_library(main_source: &str, library: &str) -> std::path::PathBuf {
    let shared = nofp_shared_library(&format!("lib{library}.c"));
    let dir = shared.parent().expect("fixture dir").to_str().unwrap();
    let rpath = format!("-Wl,-rpath,{dir}");
    build_fixture(
        &(main_source.trim_end_matches(".c").to_string() + "-nofp"),
        "gcc",
        NOFP_FLAGS,
        &[main_source],
        &["-L", dir, &format!("-l{library}"), &rpath],
    )
}

#[test]
fn call_through_the_plt_into_a_shared_library_without_frame_pointers() {
    let _guard = exclusive();
    let fixture = program_using_library("plt_main.c", "nofp");
    let running = spawn(&fixture, &["20"]);
    let samples = of_pid(&record(&[running.pid()], "2", "nofp-plt"), running.pid());
    assert_fraction(
        &samples,
        0.95,
        50,
        "have the chain main;lib_outer;lib_inner (main calls lib_outer through the PLT)",
        |s| find_chain(&s.frames, &["main", "lib_outer", "lib_inner"]).is_some(),
    );
}

/// A library whose functions keep no frame at all (every CFI row `CFA = RSP + 8`) and still
/// call each other: a return address in `frameless_outer` must be unwound by its row, not from
/// RBP, which the callers use as an ordinary register. At two recursion depths, so neither a
/// shallow nor a deep stack hides the cut.
#[test]
fn plt_call_into_a_library_whose_functions_keep_no_frame() {
    let _guard = exclusive();
    let fixture = program_using_library("frameless_main.c", "frameless");
    for depth in [1usize, 40] {
        let running = spawn(&fixture, &["20", &depth.to_string()]);
        let samples = of_pid(
            &record(&[running.pid()], "2", &format!("frameless-{depth}")),
            running.pid(),
        );
        // Samples inside the library: the leaf, or frameless_outer itself.
        let in_library: Vec<StackSample> = samples
            .iter()
            .filter(|s| {
                s.frames
                    .last()
                    .is_some_and(|leaf| leaf.starts_with("frameless_"))
            })
            .cloned()
            .collect();
        let mut chain = vec!["main"];
        chain.extend(std::iter::repeat_n("recurse", depth));
        chain.extend(["burn", "frameless_outer"]);
        assert_fraction(
            &in_library,
            0.95,
            30,
            &format!(
                "have main;recurse×{depth};burn;frameless_outer and glibc's start frames \
                 above main (burn calls frameless_outer through the PLT)"
            ),
            |s| {
                find_chain(&s.frames, &chain).is_some()
                    && position(&s.frames, "main")
                        .is_some_and(|m| has_libc_start_above(&s.frames, m))
                    && !s.frames.iter().any(|f| f == "[truncated]")
            },
        );
    }
}

#[test]
fn signal_handler_stacks_continue_through_the_signal_frame() {
    let _guard = exclusive();
    let fixture = nofp_fixture("signal_handler.c");
    let running = spawn(&fixture, &["20"]);
    let samples = of_pid(&record(&[running.pid()], "3", "nofp-signal"), running.pid());
    // The fixture faults into its handler once per ~3 ms loop round and spins ~3 ms there; the
    // leaf frame is right even without unwinding, so this checks the fixture, not the unwinder.
    let in_handler: Vec<StackSample> = samples
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == "handler_spin"))
        .cloned()
        .collect();
    let total = total_count(&samples);
    let handler_total = total_count(&in_handler);
    assert!(
        handler_total as f64 >= 0.2 * total as f64,
        "only {handler_total} of {total} samples are in handler_spin; stacks:\n{}",
        top_stacks(&samples, 5)
    );
    // main;interrupted_function;[signal frame, e.g. __restore_rt, and at most two more frames
    // if the signal interrupted a libc or vDSO call];signal_handler;handler_spin
    assert_fraction(
        &in_handler,
        0.90,
        20,
        "in the handler have main;interrupted_function;<signal frame>;signal_handler;handler_spin",
        |s| {
            let (Some(interrupted), Some(handler)) = (
                find_chain(&s.frames, &["main", "interrupted_function"]),
                find_chain(&s.frames, &["signal_handler", "handler_spin"]),
            ) else {
                return false;
            };
            handler > interrupted + 1 && handler - (interrupted + 2) <= 3
        },
    );
    let outside: Vec<StackSample> = samples
        .iter()
        .filter(|s| !s.frames.iter().any(|f| f == "handler_spin"))
        .cloned()
        .collect();
    assert_fraction(
        &outside,
        0.90,
        20,
        "outside the handler have main;interrupted_function",
        |s| find_chain(&s.frames, &["main", "interrupted_function"]).is_some(),
    );
}

#[test]
fn cpp_with_exceptions_is_demangled_and_complete() {
    let _guard = exclusive();
    let fixture = build_fixture(
        "exceptions-nofp",
        "g++",
        &["-O2", "-g", "-fomit-frame-pointer", "-fexceptions"],
        &["exceptions.cpp"],
        &[],
    );
    let running = spawn(&fixture, &["20"]);
    let samples = of_pid(&record(&[running.pid()], "3", "nofp-cpp"), running.pid());
    // Everything, including the samples inside the throw (libstdc++ and libgcc_s, also
    // without frame pointers), sits below main;app::Worker::run(double).
    assert_fraction(
        &samples,
        0.95,
        50,
        "have main;app::Worker::run(double)",
        |s| find_chain(&s.frames, &["main", "app::Worker::run(double)"]).is_some(),
    );
    assert_fraction(
        &samples,
        0.5,
        50,
        "have main;app::Worker::run(double);app::Worker::spin() (demangled, the hot method)",
        |s| {
            find_chain(
                &s.frames,
                &["main", "app::Worker::run(double)", "app::Worker::spin()"],
            )
            .is_some()
        },
    );
    let throwing = total_count(samples.iter().filter(|s| {
        find_chain(
            &s.frames,
            &["main", "app::Worker::run(double)", "app::Worker::step(int)"],
        )
        .is_some()
    }));
    assert!(
        throwing >= 3,
        "only {throwing} samples in the throw path main;app::Worker::run(double);\
         app::Worker::step(int);...; stacks:\n{}",
        top_stacks(&samples, 5)
    );
}

#[test]
fn rust_release_binary_is_demangled_and_complete() {
    let _guard = exclusive();
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_string());
    let fixture = build_fixture(
        "rust_chain-nofp",
        &rustc,
        &[
            "--edition",
            "2024",
            "--crate-name",
            "fixture",
            "-C",
            "opt-level=3",
            "-C",
            "force-frame-pointers=no",
            "-C",
            "debuginfo=1",
        ],
        &["rust_chain.rs"],
        &[],
    );
    let running = spawn(&fixture, &["20"]);
    let samples = of_pid(&record(&[running.pid()], "2", "nofp-rust"), running.pid());
    let chain = ["fixture::main", "fixture::a", "fixture::b", "fixture::c"];
    assert_fraction(
        &samples,
        0.95,
        50,
        "have fixture::main;fixture::a;fixture::b;fixture::c (demangled, no hash) below the C \
         main",
        |s| {
            find_chain(&s.frames, &chain).is_some_and(|i| s.frames[..i].iter().any(|f| f == "main"))
        },
    );
}

#[test]
fn stripped_binaries_keep_the_full_depth() {
    let _guard = exclusive();
    let reference = nofp_fixture("fp_chain.c");
    // -rdynamic puts main and level1..level4 into .dynsym, which strip keeps.
    let dynsym = stripped_copy(
        &build_fixture(
            "fp_chain-nofp-rdynamic",
            "gcc",
            &["-O2", "-g", "-fomit-frame-pointer", "-rdynamic"],
            &["fp_chain.c"],
            &[],
        ),
        "fp_chain-nofp-dynsym-stripped",
    );
    let bare = stripped_copy(&reference, "fp_chain-nofp-stripped");
    let runs = [
        spawn(&reference, &["20"]),
        spawn(&dynsym, &["20"]),
        spawn(&bare, &["20"]),
    ];
    let pids: Vec<u32> = runs.iter().map(Running::pid).collect();
    let samples = record(&pids, "3", "nofp-stripped");
    let [reference_samples, dynsym_samples, bare_samples] =
        [0, 1, 2].map(|i| of_pid(&samples, pids[i]));

    assert_fraction(
        &reference_samples,
        0.95,
        30,
        "of the unstripped reference have main;level1;level2;level3;level4",
        |s| find_chain(&s.frames, &CHAIN).is_some(),
    );
    // The reference depth: user frames of the complete stacks (_start ... level4).
    let mut depths: BTreeMap<usize, i64> = BTreeMap::new();
    for s in reference_samples
        .iter()
        .filter(|s| find_chain(&s.frames, &CHAIN).is_some())
    {
        *depths.entry(s.user_frames).or_default() += s.count;
    }
    let (&depth, _) = depths
        .iter()
        .max_by_key(|(_, count)| **count)
        .expect("complete reference stacks");

    assert_fraction(
        &dynsym_samples,
        0.95,
        30,
        &format!(
            "of the stripped -rdynamic binary have main;level1;...;level4 from .dynsym and \
             {depth} user frames like the unstripped one"
        ),
        |s| find_chain(&s.frames, &CHAIN).is_some() && s.user_frames == depth,
    );
    // Frames without a symbol: `bare!sub_<function start>` (its .eh_frame) or `bare+0x…`.
    let bare_name = bare.file_name().unwrap().to_str().unwrap();
    let (prefix, by_function) = (format!("{bare_name}+0x"), format!("{bare_name}!sub_"));
    assert_fraction(
        &bare_samples,
        0.95,
        30,
        &format!(
            "of the fully stripped binary have {depth} user frames like the unstripped one, \
             at least 5 of them ({prefix}…) in the binary"
        ),
        |s| {
            s.user_frames == depth
                && s.frames
                    .iter()
                    .filter(|f| f.starts_with(&prefix) || f.starts_with(&by_function))
                    .count()
                    >= 5
        },
    );
}

#[test]
fn pyenv_python_311_reaches_main_and_libc_start() {
    let Some(python) = pyenv_python("3.11.7", "python3.11") else {
        assert!(
            !require_external(),
            "pyenv's python 3.11.7 not found under $PYENV_ROOT or ~/.pyenv, and \
             PROFILER_REQUIRE_EXTERNAL=1"
        );
        println!("skipped: pyenv's python 3.11.7 not found under $PYENV_ROOT or ~/.pyenv");
        return;
    };
    let _guard = exclusive();
    let script = fixture_source("busy_loop.py");
    let running = spawn(&python, &[script.to_str().unwrap(), "20"]);
    let samples = of_pid(&record(&[running.pid()], "2", "nofp-python"), running.pid());
    // python3.11's main tail-calls Py_BytesMain, so either may be the lowest program frame. Once
    // Python frames are interleaved, the interpreter frame may show as the script's busy_loop.
    assert_fraction(
        &samples,
        0.95,
        50,
        "reach from _PyEval_EvalFrameDefault down to Py_BytesMain/main and glibc's start frames",
        |s| {
            let Some(eval) = s
                .frames
                .iter()
                .position(|f| f == "_PyEval_EvalFrameDefault" || f.contains("busy_loop"))
            else {
                return false;
            };
            let Some(main) = s.frames[..eval]
                .iter()
                .position(|f| f == "Py_BytesMain" || f == "main")
            else {
                return false;
            };
            has_libc_start_above(&s.frames, main)
        },
    );
}

/// PyTorch's Python from the virtual environment `cargo xtask setup` makes.
fn torch_python() -> Option<std::path::PathBuf> {
    let python = workspace_root().join(".tools/torch-venv/bin/python");
    python.is_file().then_some(python)
}

/// A real PyTorch CPU inference loop (libtorch_cpu without frame pointers, with stack-realigning
/// AVX functions, oneDNN, MKL, glibc malloc). Between the Python frames and the leaf the ATen
/// frames must be there, and stacks must not be cut, except where the leaf is code without
/// any unwind information: oneDNN's JIT-compiled kernels (`[anonymous code]`) and MKL's
/// hand-written ones (`mkl_*`), which keep no frame pointers either.
#[test]
fn pytorch_inference_keeps_aten_frames_between_python_and_the_leaf() {
    let Some(python) = torch_python() else {
        assert!(
            !require_external(),
            ".tools/torch-venv/bin/python is missing (cargo xtask setup installs it), and \
             PROFILER_REQUIRE_EXTERNAL=1"
        );
        println!("skipped: .tools/torch-venv is missing (cargo xtask setup installs it)");
        return;
    };
    let _guard = exclusive();
    let scratch = Scratch::new("torch-loop");
    let ready = scratch.path("ready");
    let script = fixture_source("python/torch_inference.py");
    let running = spawn(
        &python,
        &[script.to_str().unwrap(), "90", ready.to_str().unwrap()],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the PyTorch loop did not start within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let samples = of_pid(&record(&[running.pid()], "6", "torch"), running.pid());
    assert_fraction(
        &samples,
        0.95,
        100,
        "reach the script's <module> frame",
        |s| s.frames.iter().any(|f| f.starts_with("<module>")),
    );
    let without_unwind_info = |s: &StackSample| {
        s.frames.iter().any(|f| f == "[anonymous code]")
            || s.frames.last().is_some_and(|leaf| leaf.starts_with("mkl_"))
    };
    let described: Vec<StackSample> = samples
        .iter()
        .filter(|s| !without_unwind_info(s))
        .cloned()
        .collect();
    assert_fraction(
        &described,
        0.95,
        30,
        "are complete (no [truncated]) where every frame has unwind information",
        |s| !s.frames.iter().any(|f| f == "[truncated]"),
    );
    // The failure this guards against: `Conv2d._conv_forward ; _int_malloc`, the ATen frames
    // between the Python call and the allocator lost.
    const ALLOCATOR: [&str; 8] = [
        "malloc",
        "_int_malloc",
        "malloc_consolidate",
        "__libc_free",
        "_int_free",
        "cfree",
        "free",
        "operator new",
    ];
    let after_python = |s: &StackSample| -> Vec<String> {
        let last_python = s.files.iter().rposition(|f| f.ends_with(".py"));
        last_python.map_or_else(Vec::new, |i| s.frames[i + 1..].to_vec())
    };
    let allocating: Vec<StackSample> = described
        .iter()
        .filter(|s| {
            after_python(s)
                .iter()
                .any(|f| ALLOCATOR.contains(&f.as_str()))
        })
        .cloned()
        .collect();
    // How often the loop is caught in malloc varies; judge whatever samples there are.
    if allocating.is_empty() {
        println!("no sample in glibc's allocator this time; the check below judges ATen");
    } else {
        assert_fraction(
            &allocating,
            0.9,
            1,
            "that allocate below Python have the ATen (at::, c10::) frames that allocate",
            |s| {
                after_python(s)
                    .iter()
                    .any(|f| f.starts_with("at::") || f.starts_with("c10::"))
            },
        );
    }
    // And ATen is reached through torch's binding, with nothing lost on the way.
    let in_aten: Vec<StackSample> = described
        .iter()
        .filter(|s| after_python(s).iter().any(|f| f.starts_with("at::")))
        .cloned()
        .collect();
    assert_fraction(
        &in_aten,
        0.95,
        30,
        "in ATen have torch's Python binding (THPVariable_*) between Python and ATen",
        |s| {
            let below = after_python(s);
            let first_aten = below.iter().position(|f| f.starts_with("at::"));
            first_aten.is_some_and(|i| below[..i].iter().any(|f| f.contains("THPVariable_")))
        },
    );
}

/// The agent's samples of `service` from profiles that start at or after `from`.
fn agent_samples_from(dir: &Path, service: &str, from: SystemTime) -> (Vec<StackSample>, String) {
    let profiles = service_profiles(dir, service);
    let listing: String = profiles
        .iter()
        .map(|(path, p)| {
            format!(
                "  {} starts {:+.3} s after the threshold, {} samples\n",
                path.file_name().unwrap().to_string_lossy(),
                (p.time_nanos - unix_nanos(from)) as f64 / 1e9,
                total_count(&stack_samples(p))
            )
        })
        .collect();
    let samples = profiles
        .iter()
        .filter(|(_, p)| p.time_nanos >= unix_nanos(from))
        .flat_map(|(_, p)| stack_samples(p))
        .collect();
    (samples, listing)
}

/// A process the agent has never seen: BPF cannot unwind it before the agent registers it,
/// so it stops at the first frame and sends the stack, and the agent finishes the walk with
/// the tables. No sample may come out guessed or cut, the very first ones included.
#[test]
fn process_started_after_the_agent_is_unwound_from_its_first_sample() {
    let _guard = exclusive();
    let fixture = nofp_fixture("fp_chain.c");
    let scratch = Scratch::new("nofp-late-process");
    let dir = scratch.path("profiles");
    let mut agent = agent_writing_seconds(&dir);
    let service = format!("unwind-late-process-{}", std::process::id());
    let started = SystemTime::now();
    let mut running = spawn_with_env(&fixture, &["2.5"], &[("OTEL_SERVICE_NAME", &service)]);
    let (status, cpu) = running.wait_measuring_cpu();
    assert!(status.success(), "fixture failed: {status}");
    std::thread::sleep(Duration::from_millis(300));
    let (status, stderr) = agent.stop();
    assert!(status.success(), "agent failed with {status}:\n{stderr}");

    // Every profile of the service: its first window began up to an interval before it did.
    let (all, listing) = agent_samples_from(&dir, &service, started - Duration::from_secs(2));
    // Samples taken while the process exits: exit_mmap tears its memory down, so its user stack
    // may no longer be there to read (seen at load average 8: `_Exit` then `[truncated]`).
    let exiting = |s: &StackSample| s.frames.iter().any(|f| f == "do_exit");
    let (exits, samples): (Vec<StackSample>, Vec<StackSample>) =
        all.into_iter().partition(|s| exiting(s));
    // Those are whole (up to glibc's start) or marked cut, never guessed.
    for s in &exits {
        assert!(
            position(&s.frames, "__libc_start_call_main").is_some()
                || s.frames.iter().any(|f| f == "[truncated]"),
            "a sample in the exit path is neither whole nor marked: {}",
            s.frames.join(";")
        );
    }
    let floor = sample_floor(50, cpu, 0.6);
    assert!(
        total_count(&samples) >= floor,
        "too few samples of {service} ({floor} wanted for {cpu:?} of CPU); profiles:\n{listing}"
    );
    assert_fraction(
        &samples,
        0.97,
        floor,
        "from the first sample on have main;level1;level2;level3;level4 and glibc's start \
         frames, uncut",
        |s| {
            find_chain(&s.frames, &CHAIN).is_some()
                && position(&s.frames, "main").is_some_and(|m| has_libc_start_above(&s.frames, m))
                && !s.frames.iter().any(|f| f == "[truncated]")
        },
    );
}

/// An agent writing 1 s profiles to `dir` at [`SHAPE_SAMPLING_HZ`], past its start-up backlog
/// (so that profile start times track sample times).
fn agent_writing_seconds(dir: &Path) -> Agent {
    let mut agent = Agent::start(&[
        "--frequency",
        SHAPE_SAMPLING_HZ,
        "--interval",
        "1",
        "--output-dir",
        dir.to_str().expect("UTF-8 path"),
    ]);
    agent.wait_for_intervals(3, Duration::from_secs(30));
    agent
}

/// A run of tests/fixtures/dlopen_main.c (built without frame pointers, with libnofp2.c as its
/// plugin) under an agent writing 1 s profiles, and what it left.
struct DlopenRun {
    _scratch: Scratch,
    profiles: std::path::PathBuf,
    service: String,
    /// When the fixture said it had loaded the plugin.
    loaded: SystemTime,
    /// The fixture's CPU time `mark` after that, and in all.
    cpu_at_mark: Duration,
    cpu: Duration,
}

/// Runs the dlopen fixture for `seconds`, loading the plugin after `delay` (spinning until
/// then when `busy`, else sleeping), once the agent is past its start-up backlog (so profile
/// start times track sample times).
fn run_dlopen_fixture(
    tag: &str,
    seconds: &str,
    delay: &str,
    busy: bool,
    mark: Duration,
) -> DlopenRun {
    let plugin = nofp_shared_library("libnofp2.c");
    let fixture = build_fixture(
        "dlopen_main-nofp",
        "gcc",
        NOFP_FLAGS,
        &["dlopen_main.c"],
        &["-ldl"],
    );
    let scratch = Scratch::new(tag);
    let profiles = scratch.path("profiles");
    let mut agent = agent_writing_seconds(&profiles);
    let service = format!("unwind-{tag}-{}", std::process::id());
    let mut args = vec![seconds, delay, plugin.to_str().unwrap()];
    if busy {
        args.push("busy");
    }
    let child = Command::new(&fixture)
        .args(&args)
        .env("OTEL_SERVICE_NAME", &service)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the dlopen fixture");
    let mut running = Running { child };
    let mut line = String::new();
    BufReader::new(running.child.stdout.take().expect("stdout is piped"))
        .read_line(&mut line)
        .expect("read the fixture's stdout");
    let loaded = SystemTime::now();
    assert_eq!(
        line.trim(),
        "loaded",
        "the fixture did not dlopen its plugin"
    );
    std::thread::sleep(mark);
    let cpu_at_mark = cpu_time_so_far(running.pid()).unwrap_or_default();
    let (status, cpu) = running.wait_measuring_cpu();
    assert!(status.success(), "fixture failed: {status}");
    std::thread::sleep(Duration::from_millis(300));
    let (status, stderr) = agent.stop();
    assert!(status.success(), "agent failed with {status}:\n{stderr}");
    DlopenRun {
        _scratch: scratch,
        profiles,
        service,
        loaded,
        cpu_at_mark,
        cpu,
    }
}

#[test]
fn library_dlopened_after_the_agent_started_is_unwound_within_two_seconds() {
    let _guard = exclusive();
    // Runs 6 s in all: sleeps 1.5 s, dlopens the plugin, prints "loaded", spins in it. The CPU
    // time it got from 2 s after the dlopen on is what the judged profiles can hold.
    let run = run_dlopen_fixture("dlopen", "6", "1.5", false, Duration::from_secs(2));
    let service = &run.service;
    let threshold = run.loaded + Duration::from_secs(2);
    let (samples, listing) = agent_samples_from(&run.profiles, service, threshold);
    // Profiles start on interval boundaries after the threshold: up to 1 s of it is not judged.
    let floor = sample_floor(50, run.cpu.saturating_sub(run.cpu_at_mark), 0.4);
    assert!(
        total_count(&samples) >= floor,
        "too few samples of {service} in profiles starting 2 s after the dlopen ({floor} wanted); \
         profiles:\n{listing}"
    );
    assert_fraction(
        &samples,
        0.95,
        floor,
        "from 2 s after the dlopen on have main;call_plugin;plugin_outer;plugin_inner",
        |s| {
            find_chain(
                &s.frames,
                &["main", "call_plugin", "plugin_outer", "plugin_inner"],
            )
            .is_some()
        },
    );
}

/// A library loaded by a process the agent has already registered: BPF meets its code in no
/// registered mapping, finds it is in a file (not JIT code) and sends the stack rather than
/// guess the callers from RBP, and the agent finishes the walk once it has read the new mapping.
/// So the samples taken before the agent knew the library are whole too, not cut where the
/// library starts: every one (without the check, 1 to 5 of about 60 were cut on a quiet
/// machine).
#[test]
fn library_dlopened_by_a_registered_process_is_unwound_from_its_first_sample() {
    let _guard = exclusive();
    // Spins 1.5 s in main (sampled, so registered), dlopens the plugin and spins in it for the
    // last 0.6 s: a large share of those samples fall before the agent reads the new mapping.
    let run = run_dlopen_fixture("dlopen-registered", "2.1", "1.5", true, Duration::ZERO);
    let service = &run.service;
    let (samples, listing) = agent_samples_from(&run.profiles, service, UNIX_EPOCH);
    // Sampled before the dlopen: the process was registered when the plugin was loaded.
    let before: i64 = total_count(
        samples
            .iter()
            .filter(|s| s.frames.iter().any(|f| f == "spin_before_loading")),
    );
    assert!(
        before >= sample_floor(20, run.cpu_at_mark, 0.4),
        "too few samples of {service} before the dlopen ({before}); profiles:\n{listing}"
    );
    let in_plugin: Vec<StackSample> = samples
        .into_iter()
        .filter(|s| s.frames.iter().any(|f| f.starts_with("plugin_")))
        .collect();
    assert_fraction(
        &in_plugin,
        1.0,
        sample_floor(20, run.cpu.saturating_sub(run.cpu_at_mark), 0.4),
        "in the plugin have main;call_plugin;plugin_outer, uncut",
        |s| {
            find_chain(&s.frames, &["main", "call_plugin", "plugin_outer"]).is_some()
                && !s.frames.iter().any(|f| f == "[truncated]")
        },
    );
}

#[test]
fn program_exec_ed_by_a_profiled_process_is_unwound_with_its_own_tables() {
    let _guard = exclusive();
    let fixture = nofp_fixture("fp_chain.c");
    // A busy shell (sampled, so its own mappings get registered) that then execs the fixture
    // under the same pid.
    let script = format!(
        "i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done; exec {} 20",
        fixture.display()
    );
    let running = spawn(Path::new("/bin/sh"), &["-c", &script]);
    let samples = of_pid(&record(&[running.pid()], "5", "exec"), running.pid());
    let after_exec: Vec<StackSample> = samples
        .into_iter()
        .filter(|s| s.frames.iter().any(|f| f.starts_with("level")))
        .collect();
    assert_fraction(
        &after_exec,
        0.95,
        100,
        "have the chain main;level1;level2;level3;level4 after the exec",
        |s| find_chain(&s.frames, &CHAIN).is_some(),
    );
}
