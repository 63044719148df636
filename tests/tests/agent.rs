//! `profiler agent`: one pprof per service per interval, flushed on SIGTERM.
use std::{
    process::{Command, Stdio},
    time::Duration,
};

use integration_tests::*;

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

#[test]
fn writes_per_service_profiles_every_interval_and_on_sigterm() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    // The fixture declares its service name the OpenTelemetry way.
    let child = Command::new(&fixture)
        .arg("20")
        .env("OTEL_SERVICE_NAME", "checkout")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let running = Running { child };
    let scratch = Scratch::new("agent");
    let dir = scratch.path("profiles");
    let pid = running.pid().to_string();
    let agent = Command::new(profiler_bin())
        .arg("agent")
        .args(agent_isolation_args(&[
            "--interval",
            "1",
            "--output-dir",
            dir.to_str().unwrap(),
            "--pid",
            &pid,
        ]))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Start-up (loading BPF, the first snapshots) takes a variable time on a busy machine: wait
    // for the first interval's file, then for two more intervals.
    let checkout_files = || {
        std::fs::read_dir(&dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with("checkout-"))
                    .count()
            })
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while checkout_files() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(2300));
    unsafe { libc_kill(agent.id() as i32, 15) };
    let output = agent.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let checkout: Vec<_> = files
        .iter()
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("checkout-")
        })
        .collect();
    // The first interval, two more, and the partial one flushed on SIGTERM.
    assert!(checkout.len() >= 3, "files: {files:?}");
    let mut total = 0;
    for file in &checkout {
        let profile = decode_pprof(file);
        let samples = readable_samples(&profile);
        total += samples.iter().map(|s| s.values[0]).sum::<i64>();
        assert!(
            samples
                .iter()
                .all(|s| s.functions.iter().any(|f| f == "level4" || f == "main"))
        );
        assert!(
            profile
                .comment
                .iter()
                .any(|&c| profile.string_table[c as usize] == "service_name=checkout")
        );
    }
    assert!(total >= 100, "{total} samples in {} files", checkout.len());
}
