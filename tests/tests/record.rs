//! `profiler record` end to end: the real BPF program samples real fixture processes.
use std::{path::Path, process::Command, time::Duration};

use integration_tests::*;

const CHAIN: [&str; 5] = ["main", "level1", "level2", "level3", "level4"];

/// Records `pid` for `seconds` in folded format; returns the file's text.
fn record_folded(pid: u32, seconds: &str, tag: &str) -> String {
    let scratch = Scratch::new(tag);
    let out = scratch.path("stacks.folded");
    let pid = pid.to_string();
    assert_success(&run_profiler(&[
        "record",
        "-d",
        seconds,
        "-p",
        &pid,
        "--format",
        "folded",
        "-o",
        out.to_str().unwrap(),
    ]));
    std::fs::read_to_string(&out).unwrap()
}

#[test]
fn frame_pointer_chain_is_complete_and_sample_count_matches_frequency() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let running = spawn(&fixture, &["20"]);
    let scratch = Scratch::new("fp-chain");
    let out = scratch.path("profile.pb.gz");
    let pid = running.pid().to_string();
    let cpu_before = cpu_time_so_far(running.pid()).expect("fixture running");
    let wall_before = std::time::Instant::now();
    let output = run_profiler(&[
        "record",
        "--duration",
        "3",
        "--pid",
        &pid,
        "--output",
        out.to_str().unwrap(),
    ]);
    let cpu_share = (cpu_time_so_far(running.pid()).expect("fixture running") - cpu_before)
        .as_secs_f64()
        / wall_before.elapsed().as_secs_f64();
    assert_success(&output);

    let profile = decode_pprof(&out);
    let samples = readable_samples(&profile);
    let total: i64 = samples.iter().map(|s| s.values[0]).sum();
    let with_chain: i64 = samples
        .iter()
        .filter(|s| {
            let root_to_leaf: Vec<String> = s.functions.iter().rev().cloned().collect();
            find_chain(&root_to_leaf, &CHAIN).is_some()
        })
        .map(|s| s.values[0])
        .sum();
    assert!(total > 0, "no samples for the fixture");
    assert!(
        with_chain as f64 >= 0.95 * total as f64,
        "only {with_chain} of {total} samples have the chain {CHAIN:?}; samples: {:#?}",
        samples.iter().take(5).collect::<Vec<_>>()
    );
    // One busy thread at 100 Hz of the CPU time it got in the recorded duration (all of it on
    // a quiet machine; less when other work shares the CPUs).
    let expected = profile.duration_nanos as f64 / 1e9 * 100.0 * cpu_share;
    // A thread that has a CPU to itself is sampled at every tick (10 %: start and stop of the
    // window). One sharing CPUs is running at a given tick by chance, so the count is binomial
    // and the share was measured over a longer window: three standard deviations.
    let tolerance = if cpu_share > 0.9 {
        0.10 * expected
    } else {
        (0.10 * expected).max(3.0 * expected.sqrt())
    };
    assert!(
        (total as f64 - expected).abs() <= tolerance,
        "{total} samples, expected {expected:.0} ± {tolerance:.0} (the fixture had {:.0}% of a \
         CPU)",
        cpu_share * 100.0
    );
    // Every sample is the fixture's: --pid filters.
    assert!(
        samples
            .iter()
            .all(|s| s.num_labels.get("pid") == Some(&i64::from(running.pid())))
    );
    // cpu/nanoseconds = count × period.
    assert_eq!(profile.period, 10_000_000);
    assert!(
        samples
            .iter()
            .all(|s| s.values[1] == s.values[0] * 10_000_000)
    );
    // The executable's mapping carries its path and build id.
    let strings = &profile.string_table;
    let fixture_mapping = profile
        .mapping
        .iter()
        .find(|m| strings[m.filename as usize] == fixture.to_str().unwrap())
        .expect("mapping for the fixture executable");
    assert!(
        !strings[fixture_mapping.build_id as usize].is_empty(),
        "build id recorded"
    );
}

#[test]
fn folded_output_and_pid_filter() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let wanted = spawn(&fixture, &["20"]);
    let other = spawn(&fixture, &["20"]);
    let text = record_folded(wanted.pid(), "2", "folded");
    let stacks = parse_folded(&text);
    assert!(!stacks.is_empty());
    let comm = fixture.file_name().unwrap().to_str().unwrap();
    // `comm;root;...;leaf COUNT`: the process name first, then main ... level4.
    for stack in &stacks {
        assert_eq!(
            stack.frames[0],
            comm[..comm.len().min(15)],
            "root frame is the comm: {stack:?}"
        );
    }
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    let chained: u64 = stacks
        .iter()
        .filter(|s| find_chain(&s.frames, &CHAIN).is_some())
        .map(|s| s.count)
        .sum();
    assert!(
        chained as f64 >= 0.95 * total as f64,
        "{chained}/{total}:\n{text}"
    );
    // Two identical busy processes, but only one is sampled: about 100 Hz, not 200.
    assert!(
        total <= 230,
        "{total} samples: the second process was not filtered out"
    );
    drop(other);
}

#[test]
fn kernel_frames_for_a_syscall_heavy_process() {
    let _guard = exclusive();
    let fixture = fp_fixture("syscall_heavy.c");
    let running = spawn(&fixture, &["20"]);
    let stacks = parse_folded(&record_folded(running.pid(), "2", "kernel"));
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    let in_kernel: u64 = stacks
        .iter()
        .filter(|s| {
            // libc's read() wrapper has no frame of its own, so frame-pointer walking skips its
            // caller (read_zeroes) and continues at main.
            let user = s.frames.iter().position(|f| f == "main");
            let syscall = s
                .frames
                .iter()
                .position(|f| f.contains("do_syscall_64") || f.contains("entry_SYSCALL_64"));
            matches!((user, syscall), (Some(u), Some(k)) if k > u)
        })
        .map(|s| s.count)
        .sum();
    assert!(
        in_kernel as f64 >= 0.5 * total as f64,
        "{in_kernel}/{total} samples show kernel syscall frames below main"
    );
}

#[test]
fn process_that_exits_mid_record_is_still_symbolized() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let running = spawn(&fixture, &["60"]);
    let pid = running.pid();
    let scratch = Scratch::new("exits");
    let out = scratch.path("stacks.folded");
    let pid_arg = pid.to_string();
    // Sampling before the fixture goes: a debug build's start (every BPF program verified)
    // takes seconds on a busy machine, so the exit is timed from the attach, not from spawn.
    let recording = Recording::until_stopped(&[
        "-p",
        &pid_arg,
        "--format",
        "folded",
        "-o",
        out.to_str().unwrap(),
    ]);
    // About a second of its CPU sampled, however long the machine takes to give it.
    let cpu_sampled = cpu_got_while(
        &[pid],
        Wait::ForCpu {
            wanted: Duration::from_secs(1),
            at_most: Duration::from_secs(30),
        },
    );
    // It exits mid-record (killed, and reaped); the recorder symbolizes it afterwards.
    drop(running);
    std::thread::sleep(Duration::from_millis(500));
    recording.stop();
    let stacks = parse_folded(&std::fs::read_to_string(&out).unwrap());
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    // 100 Hz of the CPU time it got while sampled (its last 50 ms not counted above).
    let expected = (cpu_sampled.as_secs_f64() + 0.05) * 100.0;
    assert!(
        total >= 10 && (total as f64) >= 0.5 * expected && (total as f64) <= 1.5 * expected,
        "{total} samples for {cpu_sampled:?} of CPU while sampled"
    );
    let chained: u64 = stacks
        .iter()
        .filter(|s| find_chain(&s.frames, &CHAIN).is_some())
        .map(|s| s.count)
        .sum();
    assert!(
        chained as f64 >= 0.9 * total as f64,
        "symbolized chain in {chained}/{total}"
    );
}

#[test]
fn binary_in_a_private_mount_namespace_is_symbolized() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let scratch = Scratch::new("mntns");
    let hidden = scratch.path("hidden");
    std::fs::create_dir_all(&hidden).unwrap();
    // Inside its own mount namespace the fixture runs from a tmpfs mounted over `hidden`, so
    // its path does not exist in ours.
    let script = format!(
        "mount -t tmpfs tmpfs {dir} && cp {src} {dir}/ns_fixture && exec {dir}/ns_fixture 20",
        dir = hidden.display(),
        src = fixture.display()
    );
    let child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .spawn()
        .expect("unshare");
    let running = Running { child };
    std::thread::sleep(Duration::from_millis(500));
    let in_ns_path = hidden.join("ns_fixture");
    assert!(
        !in_ns_path.exists(),
        "{} must not exist in the root mount namespace",
        in_ns_path.display()
    );

    let out = scratch.path("profile.pb.gz");
    let pid = running.pid().to_string();
    let recording = Recording::until_stopped(&[
        "--frequency",
        SHAPE_SAMPLING_HZ,
        "-p",
        &pid,
        "-o",
        out.to_str().unwrap(),
    ]);
    let cpu = cpu_got_while(&[running.pid()], Wait::For(Duration::from_secs(2)));
    recording.stop();
    let profile = decode_pprof(&out);
    let samples = readable_samples(&profile);
    let total: i64 = samples.iter().map(|s| s.values[0]).sum();
    let chained: i64 = samples
        .iter()
        .filter(|s| {
            let root_to_leaf: Vec<String> = s.functions.iter().rev().cloned().collect();
            find_chain(&root_to_leaf, &CHAIN).is_some()
        })
        .map(|s| s.values[0])
        .sum();
    let floor = sample_floor(50, cpu, 0.5);
    assert!(
        total >= floor,
        "{total} samples, {floor} wanted for {cpu:?} of CPU"
    );
    assert!(
        chained as f64 >= 0.95 * total as f64,
        "{chained}/{total} symbolized through /proc/PID/root"
    );
    let strings = &profile.string_table;
    assert!(
        profile
            .mapping
            .iter()
            .any(|m| Path::new(&strings[m.filename as usize]) == in_ns_path),
        "the mapping keeps the path as the process sees it"
    );
}
