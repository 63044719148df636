//! Command-line errors: one clear line, a non-zero exit, nothing written.
use std::{process::Command, time::Duration};

use integration_tests::*;

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn bad_flag_values_are_rejected() {
    for (args, message) in [
        (
            &["record", "--duration", "1", "--frequency", "0"][..],
            "1..=1000",
        ),
        (
            &["record", "--duration", "1", "--frequency", "1001"][..],
            "1..=1000",
        ),
        (&["record", "--duration", "0"][..], "more than 0"),
        (
            &["record", "--duration", "1", "--pid", "x"][..],
            "not a process id",
        ),
        (
            &["record", "--duration", "1", "--format", "svg"][..],
            "pprof or folded",
        ),
        (
            &["agent", "--interval", "never"][..],
            "not a number of seconds",
        ),
    ] {
        let output = run_profiler(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(
            stderr(&output).contains(message),
            "{args:?}: {}",
            stderr(&output)
        );
    }
    let output = run_profiler_with_env(
        &["record", "--duration", "1"],
        &[("PROFILER_FREQUENCY", "5000")],
    );
    assert_eq!(
        output.status.code(),
        Some(2),
        "flags are read from the environment too"
    );
}

#[test]
fn unwritable_output_fails_before_sampling_and_writes_nothing() {
    let scratch = Scratch::new("unwritable");
    let file = scratch.path("a-file");
    std::fs::write(&file, b"x").unwrap();
    let target = file.join("profile.pb.gz");
    let output = run_profiler(&[
        "record",
        "--duration",
        "1",
        "--output",
        target.to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(1));
    let message = stderr(&output);
    assert!(
        message.contains("cannot write") && message.contains(target.to_str().unwrap()),
        "{message}"
    );
    assert_eq!(
        message
            .trim()
            .lines()
            .filter(|l| l.starts_with("error:"))
            .count(),
        1,
        "{message}"
    );
    assert_eq!(
        std::fs::read_dir(&scratch.0).unwrap().count(),
        1,
        "nothing but the original file"
    );
}

#[test]
fn missing_process_is_reported() {
    let output = run_profiler(&["record", "--duration", "1", "--pid", "999999999"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("no such process: 999999999"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn kernel_without_btf_is_reported() {
    let scratch = Scratch::new("nobtf");
    let out = scratch.path("p.pb.gz");
    let output = run_profiler_with_env(
        &["record", "--duration", "1", "-o", out.to_str().unwrap()],
        &[("PROFILER_BTF_PATH", "/nonexistent/vmlinux")],
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("no BTF"), "{}", stderr(&output));
    assert!(!out.exists());
}

#[test]
fn unprivileged_user_is_told_what_is_missing() {
    let scratch = Scratch::new("nonroot");
    // `nobody` needs to be able to reach the binary; drop every capability.
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ])
        .arg(profiler_bin())
        .args(["record", "--duration", "1", "--output"])
        .arg(scratch.path("p.pb.gz"))
        .current_dir("/")
        .output()
        .expect("setpriv (util-linux)");
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let message = stderr(&output);
    assert!(
        message.contains("root or the CAP_BPF and CAP_PERFMON"),
        "{message}"
    );
}

#[test]
fn sigint_flushes_and_exits_zero() {
    let _guard = exclusive();
    // A busy process, so the window before the signal surely holds samples (an idle machine
    // gives none).
    let busy = spawn(&fp_fixture("fp_chain.c"), &["30"]);
    let scratch = Scratch::new("sigint");
    let out = scratch.path("p.pb.gz");
    let recording = Recording::until_stopped(&["--output", out.to_str().unwrap()]);
    let cpu_before = cpu_time_so_far(busy.pid()).expect("busy fixture running");
    std::thread::sleep(Duration::from_millis(1500));
    let cpu = cpu_time_so_far(busy.pid()).expect("busy fixture running") - cpu_before;
    let log = recording.stop();
    let profile = decode_pprof(&out);
    let busy_pid = busy.pid() as i64;
    let busy_samples: i64 = stack_samples(&profile)
        .iter()
        .filter(|s| s.pid == Some(busy_pid))
        .map(|s| s.count)
        .sum();
    // 1.5 s at 100 Hz on a quiet machine; what the process got of the CPUs on a busy one
    // (the recording's start is in the measured time, hence the share).
    let floor = sample_floor(50, cpu, 0.4);
    assert!(
        busy_samples >= floor,
        "the interrupted recording holds the busy process's samples ({floor} wanted for {cpu:?} \
         of CPU), got {busy_samples}: {log}"
    );
    assert!(profile.duration_nanos < 30_000_000_000);
}

/// The binary allocates with jemalloc and its settings in main.rs are the ones in force: a
/// misspelt settings symbol would be ignored without a word.
#[test]
fn the_binary_allocates_with_jemalloc_as_configured() {
    let output =
        run_profiler_with_env(&["--version"], &[("_RJEM_MALLOC_CONF", "stats_print:true")]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stats = stderr(&output);
    for setting in [
        "opt.narenas: 2",
        "opt.dirty_decay_ms: 500",
        "opt.muzzy_decay_ms: 0",
        "opt.oversize_threshold: 1048576",
        "opt.abort_conf: true",
    ] {
        assert!(
            stats.contains(setting),
            "jemalloc's statistics at exit lack `{setting}`:\n{stats}"
        );
    }
}
