//! `profiler agent`: one pprof per service per interval, flushed on SIGTERM; and on the whole
//! host with its store on, a running process's flame graph served over HTTP.
use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use integration_tests::{server_harness::*, *};

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
    let cpu_before = cpu_time_so_far(running.pid()).expect("fixture running");
    std::thread::sleep(Duration::from_millis(2300));
    // What the profiles after the first one can hold at least: the CPU time the fixture got.
    let cpu = cpu_time_so_far(running.pid()).expect("fixture running") - cpu_before;
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
    let floor = sample_floor(100, cpu, 0.8);
    assert!(
        total >= floor,
        "{total} samples in {} files, {floor} wanted for {cpu:?} of the fixture's CPU",
        checkout.len()
    );
}

/// The "done when" of the store and web UI: `profiler agent` with no `--pid` (every process on
/// the host) and its store on serves a running program's functions under its service through
/// the query API the web UI uses. On the way, `/readyz` answers 503 until sampling runs and
/// 200 from then on, while `/healthz` answers 200 throughout.
#[test]
fn whole_host_agent_serves_a_running_process_through_the_query_api() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let service = "whole-host-check";
    let running = spawn_with_env(&fixture, &["300"], &[("OTEL_SERVICE_NAME", service)]);
    // A second busy process that names no service: the whole host means it is sampled too,
    // under a name of its own. (On a quiet machine nothing else may be running.)
    let bystander_service = "whole-host-bystander";
    let _bystander = spawn_with_env(
        &fixture,
        &["300"],
        &[("OTEL_SERVICE_NAME", bystander_service)],
    );
    let scratch = Scratch::new("agent-whole-host");
    let data_dir = scratch.path("data");
    let ServerProcess {
        process: mut agent,
        addr,
    } = ServerProcess::try_start_subcommand(
        &profiler_bin(),
        "agent",
        &[
            "--interval",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data_dir.to_str().expect("UTF-8 scratch path"),
            // Native source lines, for the download's check below.
            "--source-lines",
        ],
    )
    .unwrap_or_else(|err| panic!("the agent did not listen: {err}"));
    let client = Client::new(addr);

    // From the moment it listens: 503 (with a JSON error) until sampling runs, then 200.
    let mut readiness = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = client.get("/readyz");
        match ready.status {
            200 => {}
            503 => {
                let (code, message) = ready.json_error();
                assert_eq!(code, "unavailable", "{message}");
            }
            other => panic!("/readyz answered {other}: {}", ready.text()),
        }
        readiness.push(ready.status);
        assert_eq!(
            client.get("/healthz").status,
            200,
            "liveness while starting"
        );
        if ready.status == 200 {
            break;
        }
        assert!(
            agent.exited().is_none(),
            "the agent exited:\n{}",
            agent.stderr()
        );
        assert!(
            Instant::now() < deadline,
            "not ready after 120 s:\n{}",
            agent.stderr()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The agent logs this before it turns ready (read through a pipe, so it may arrive a
    // little after the 200).
    agent
        .wait_for_line(Duration::from_secs(30), |line| {
            line.contains("sampler attached").then_some(())
        })
        .unwrap_or_else(|err| panic!("ready, but no `sampler attached`: {err}"));
    // How many 503s the loop saw depends on how long loading BPF took; the unit tests check
    // the 503 itself (server::tests::readiness_follows_the_agent_and_liveness_does_not).
    eprintln!(
        "readiness: {} answers of 503, then 200",
        readiness.len() - 1
    );

    let selector = format!(r#"{{service_name="{service}"}}"#);
    let deadline = Instant::now() + Duration::from_secs(120);
    let graph = loop {
        let graph = client.merge(CPU_TYPE, &selector);
        if flamegraph_total_of(&graph, "level4") > 0 {
            break graph;
        }
        assert!(
            Instant::now() < deadline,
            "no level4 of {service} after 120 s; services {:?}:\n{}",
            client.label_values("service_name", None),
            agent.stderr()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let names = flamegraph_names(&graph);
    for function in ["main", "level1", "level2", "level3", "level4"] {
        assert!(names.iter().any(|n| n == function), "{function}: {names:?}");
    }
    // The whole host: the other busy process, which no flag named, is there too. It may
    // land in a later interval than the first one that had the fixture.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let services = client.label_values("service_name", None);
        assert!(services.contains(&service.to_owned()), "{services:?}");
        if services.iter().any(|s| s == bystander_service) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {services:?} after 60 s: not the whole host"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // The web UI's own calls: the service picker (JSON LabelValues) and its flame graph (JSON
    // SelectMergeStacktraces) name the fixture's function.
    let end = (unix_now_ms() + 60_000).to_string();
    let picker = client.connect_json(
        "querier.v1.QuerierService/LabelValues",
        serde_json::json!({"name": "service_name", "start": "1", "end": end}),
    );
    assert!(
        picker["names"]
            .as_array()
            .is_some_and(|names| names.iter().any(|n| n == service)),
        "{picker}"
    );
    let ui_graph = client.connect_json(
        "querier.v1.QuerierService/SelectMergeStacktraces",
        serde_json::json!({"profileTypeID": CPU_TYPE, "labelSelector": selector,
                           "start": "1", "end": end}),
    );
    assert!(
        ui_graph["flamegraph"]["names"]
            .as_array()
            .is_some_and(|names| names.iter().any(|n| n == "level4")),
        "{ui_graph}"
    );
    assert_eq!(
        client.get("/readyz").status,
        200,
        "still ready while sampling"
    );
    // The binary reports its heap as jemalloc sees it, from its first published metrics on:
    // what is allocated, within the pages held resident.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (allocated, resident) = loop {
        let heap = (
            client.metric("profiler_agent_heap_allocated_bytes"),
            client.metric("profiler_agent_heap_resident_bytes"),
        );
        if let (Some(allocated), Some(resident)) = heap {
            break (allocated, resident);
        }
        assert!(
            Instant::now() < deadline,
            "no heap metrics on /metrics after 60 s:\n{}\n{}",
            client.get("/metrics").text(),
            agent.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        allocated > 1e6 && allocated <= resident,
        "heap: {allocated} bytes allocated, {resident} resident"
    );

    let (status, stderr) = agent.stop();
    assert!(status.success(), "{stderr}");

    // The download keeps what the agent knew of each frame, and an independent pprof reader
    // sees the flame graph's total (read from the stopped agent's store, so both see the same).
    let server = ServerProcess::start(&data_dir, &[]);
    let client = server.client();
    let end_ms = unix_now_ms() + 3_600_000;
    let graph_total = client.merge_range(CPU_TYPE, &selector, 1, end_ms).total;
    assert!(graph_total > 0);
    let query = format!("{CPU_TYPE}{selector}")
        .replace('{', "%7B")
        .replace('}', "%7D")
        .replace('"', "%22")
        .replace('=', "%3D");
    let download = client.get(&format!("/api/pprof?query={query}&from=1&until={end_ms}"));
    assert_eq!(download.status, 200, "{}", download.text());
    let Some(summary) = independent_pprof_summary(&download.body) else {
        return;
    };
    assert_eq!(summary["totals"], serde_json::json!([graph_total]));
    assert_eq!(summary["period"], 10_000_000, "100 Hz in nanoseconds");
    let fixture_name = fixture.file_name().unwrap().to_str().unwrap().to_owned();
    let samples = summary["samples"].as_array().unwrap();
    let level4: Vec<&serde_json::Value> = samples
        .iter()
        .flat_map(|sample| sample["frames"].as_array().unwrap())
        .filter(|frame| frame["function"] == "level4")
        .collect();
    assert!(!level4.is_empty(), "no level4 frame in the download");
    // Each sample keeps its process and thread (the single-threaded fixture: tid = pid).
    for sample in samples {
        let labels = &sample["labels"];
        assert!(
            labels["pid"].as_i64().is_some() && labels["tid"].as_i64().is_some(),
            "{sample}"
        );
    }
    let fixture_pid = i64::from(running.pid());
    assert!(
        samples.iter().any(|s| s["functions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "level4")
            && s["labels"]["pid"] == fixture_pid
            && s["labels"]["tid"] == fixture_pid),
        "no level4 sample of pid {fixture_pid}"
    );
    for frame in &level4 {
        assert!(
            frame["file"].as_str().unwrap().ends_with("fp_chain.c")
                && frame["line"].as_i64().unwrap() > 0
                && frame["address"].as_i64().unwrap() > 0
                && frame["object"].as_str().unwrap().ends_with(&fixture_name),
            "{frame}"
        );
    }
    let mapping = summary["mappings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["filename"].as_str().unwrap().ends_with(&fixture_name))
        .expect("the fixture's mapping");
    let build_id = mapping["buildId"].as_str().unwrap();
    assert!(
        build_id.len() >= 16 && build_id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{mapping}"
    );
}

/// Every profile file in `dir`, decoded, by the service its name starts with.
fn all_profiles(dir: &std::path::Path) -> Vec<(String, proto::Profile)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("profiles dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // `<service>-<unix seconds>[-N].pb.gz`: the service is what precedes the timestamp.
        let service = name
            .rsplit_once(".pb.gz")
            .map(|(stem, _)| stem)
            .and_then(|stem| {
                let parts: Vec<&str> = stem.split('-').collect();
                let time = parts
                    .iter()
                    .rposition(|p| p.len() >= 9 && p.bytes().all(|b| b.is_ascii_digit()))?;
                Some(parts[..time].join("-"))
            })
            .unwrap_or(name.clone());
        out.push((service, decode_pprof(&path)));
    }
    out
}

/// The CPU time short_lived.c reports its children got (`children_cpu_ms=N`).
fn short_lived_children_cpu_ms(output: &std::process::Output) -> i64 {
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .strip_prefix("children_cpu_ms=")
        .and_then(|ms| ms.parse::<i64>().ok())
        .expect("the fixture reports its children's CPU time")
}

/// Processes that live for tens of milliseconds and rename their thread (as a compiler's
/// workers or a test helper do), exec'ed or forked without exec, all gone before the agent
/// reads /proc (it is stopped meanwhile; BPF keeps sampling into the ring): each is named
/// after its program, never its thread, and its own code is symbolized.
#[test]
fn short_lived_processes_keep_their_program_name() {
    let _guard = exclusive();
    let fixture = nofp_fixture("short_lived.c");
    let program = fixture.file_name().unwrap().to_string_lossy().into_owned();
    let scratch = Scratch::new("short-lived");
    let dir = scratch.path("profiles");
    let mut agent = Agent::start(&["--interval", "1", "--output-dir", dir.to_str().unwrap()]);
    agent.wait_for_intervals(2, Duration::from_secs(30));
    // SIGSTOP freezes every thread of the agent; the kernel side goes on sampling and
    // recording exec and fork events into the rings until SIGCONT.
    unsafe { libc_kill(agent.pid() as i32, 19) };
    let mut children_cpu_ms = 0;
    for mode in ["exec", "fork"] {
        let output = Command::new(&fixture)
            .args([mode, "12", "30"])
            .output()
            .expect("run the fixture");
        assert!(output.status.success(), "{mode}: {}", output.status);
        children_cpu_ms += short_lived_children_cpu_ms(&output);
    }
    unsafe { libc_kill(agent.pid() as i32, 18) };
    std::thread::sleep(Duration::from_millis(2500));
    let (status, log) = agent.stop();
    assert!(status.success(), "agent failed with {status}:\n{log}");

    let mut burn_samples_by_service: std::collections::BTreeMap<String, i64> = Default::default();
    let mut executables = std::collections::BTreeSet::new();
    let mut complete = 0;
    let mut rooted = 0;
    let mut unrooted = std::collections::BTreeMap::<String, i64>::new();
    for (service, profile) in all_profiles(&dir) {
        for sample in readable_samples(&profile) {
            if !sample.functions.iter().any(|f| f == "short_burn") {
                continue;
            }
            let count = sample.values[0];
            *burn_samples_by_service.entry(service.clone()).or_default() += count;
            if let Some(executable) = sample.str_labels.get("executable") {
                executables.insert(executable.clone());
            }
            // Innermost first: short_burn called by short_work.
            let burn = sample
                .functions
                .iter()
                .position(|f| f == "short_burn")
                .unwrap();
            if sample
                .functions
                .get(burn + 1)
                .is_some_and(|f| f == "short_work")
            {
                complete += count;
            }
            // glibc's start above main: libc was mapped by the dynamic loader after the exec
            // event, and only the kernel's mmap announcements say where.
            if sample
                .functions
                .iter()
                .any(|f| f == "__libc_start_call_main")
            {
                rooted += count;
            } else {
                let stack: Vec<&str> = sample.functions.iter().rev().map(String::as_str).collect();
                *unrooted.entry(stack.join(";")).or_default() += count;
            }
        }
    }
    let total: i64 = burn_samples_by_service.values().sum();
    // 100 Hz of the CPU the children really got (most of it in short_burn).
    let expected = children_cpu_ms / 10;
    assert!(
        total * 2 >= expected && total >= 5,
        "too few samples in short_burn for {children_cpu_ms} ms of the children's CPU: \
         {burn_samples_by_service:?}"
    );
    let named = burn_samples_by_service.get(&program).copied().unwrap_or(0);
    assert!(
        named as f64 >= 0.97 * total as f64,
        "short-lived processes named after their thread or anything but {program}: \
         {burn_samples_by_service:?}"
    );
    assert!(
        complete as f64 >= 0.95 * total as f64,
        "only {complete} of {total} samples have short_work -> short_burn symbolized"
    );
    assert!(
        rooted as f64 >= 0.95 * total as f64,
        "only {rooted} of {total} samples of processes gone before the agent looked reach \
         __libc_start_call_main (libc's frames); others: {unrooted:#?}"
    );
    if !executables.is_empty() {
        assert!(
            executables.iter().all(|e| e.ends_with(&program)),
            "executable labels: {executables:?}"
        );
    }
}

/// Processes started with `OTEL_SERVICE_NAME` that exit before the agent reads /proc (it is
/// stopped meanwhile) are named by it: the exec event carries their environment.
#[test]
fn short_lived_processes_keep_the_service_their_environment_names() {
    let _guard = exclusive();
    let fixture = nofp_fixture("short_lived.c");
    let scratch = Scratch::new("short-lived-env");
    let dir = scratch.path("profiles");
    let service = "nightly-report";
    let mut agent = Agent::start(&["--interval", "1", "--output-dir", dir.to_str().unwrap()]);
    agent.wait_for_intervals(2, Duration::from_secs(30));
    unsafe { libc_kill(agent.pid() as i32, 19) };
    // A small environment, as a container's or a unit's is (the event holds up to 4 KiB).
    let output = Command::new(&fixture)
        .args(["exec", "12", "30"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("OTEL_SERVICE_NAME", service)
        .output()
        .expect("run the fixture");
    unsafe { libc_kill(agent.pid() as i32, 18) };
    assert!(output.status.success(), "{}", output.status);
    let children_cpu_ms = short_lived_children_cpu_ms(&output);
    std::thread::sleep(Duration::from_millis(2500));
    let (status, log) = agent.stop();
    assert!(status.success(), "agent failed with {status}:\n{log}");

    let mut burn_samples_by_service: std::collections::BTreeMap<String, i64> = Default::default();
    for (name, profile) in all_profiles(&dir) {
        for sample in readable_samples(&profile) {
            if sample.functions.iter().any(|f| f == "short_burn") {
                *burn_samples_by_service.entry(name.clone()).or_default() += sample.values[0];
            }
        }
    }
    let total: i64 = burn_samples_by_service.values().sum();
    assert!(
        total * 2 >= children_cpu_ms / 10 && total >= 5,
        "too few samples in short_burn for {children_cpu_ms} ms of the children's CPU: \
         {burn_samples_by_service:?}"
    );
    let named = burn_samples_by_service.get(service).copied().unwrap_or(0);
    assert!(
        named as f64 >= 0.97 * total as f64,
        "short-lived processes not named {service}: {burn_samples_by_service:?}"
    );
}

/// A sample taken in an exec (here: while the exec tears down the child's copy of a large
/// address space) has the old program's user registers and name. The process runs the new
/// program by the time the agent reads /proc, so the sample is resolved against the program
/// before the exec (the parent's, from the fork event): its service and `execve` in libc,
/// never the new program's name with `[unknown]` frames. A sample the child gave before its
/// exec (30 ms of CPU in the parent's code first) is walked against the parent's program to
/// `main`, not cut where the exec came after it.
#[test]
fn samples_before_and_in_an_exec_belong_to_the_program_before_it() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let _guard = exclusive();
    let fixture = nofp_fixture("exec_from_large.c");
    let program = fixture.file_name().unwrap().to_string_lossy().into_owned();
    let scratch = Scratch::new("exec-from-large");
    let dir = scratch.path("profiles");
    let mut agent = Agent::start(&["--interval", "1", "--output-dir", dir.to_str().unwrap()]);
    agent.wait_for_intervals(2, Duration::from_secs(30));
    // Frozen while the children exec: when it handles their samples, /proc shows `sleep`.
    unsafe { libc_kill(agent.pid() as i32, 19) };
    let mut child = Command::new(&fixture)
        .args(["768", "16", "60", "30"])
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("run the fixture");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("the fixture reports its spawns");
    unsafe { libc_kill(agent.pid() as i32, 18) };
    std::thread::sleep(Duration::from_millis(3000));
    // A walk still held for its table at the stop is finished as far as it goes: on a busy
    // machine the tables may take longer than those 3 s, so the stop waits for them.
    let client = Client::new(agent.http_addr());
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.metric("profiler_late_walks_held") != Some(0.0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, log) = agent.stop();
    // The fixture and its sleeping children.
    unsafe { libc_kill(-(child.id() as i32), 9) };
    let _ = child.wait();
    assert!(status.success(), "agent failed with {status}:\n{log}");
    assert!(line.starts_with("spawned=16"), "fixture: {line}");

    // Samples in the exec's teardown of the old address space, by service.
    let mut by_service: std::collections::BTreeMap<String, i64> = Default::default();
    let mut with_execve = 0;
    let mut unknown = Vec::new();
    // Samples of the children before their exec: by service, and those walked to `_start`.
    let mut busy_by_service: std::collections::BTreeMap<String, i64> = Default::default();
    let mut busy_complete = 0;
    let mut busy_incomplete = Vec::new();
    for (service, profile) in all_profiles(&dir) {
        if service != program && service != "sleep" {
            continue;
        }
        for sample in readable_samples(&profile) {
            // Leaf first.
            let at = |name: &str| sample.functions.iter().position(|f| f == name);
            if let Some(busy) = at("child_busy") {
                let count = sample.values[0];
                *busy_by_service.entry(service.clone()).or_default() += count;
                let chain = matches!(
                    (at("child_before_exec"), at("main"), at("_start")),
                    (Some(before), Some(main), Some(start)) if busy < before && before < main && main < start
                );
                let cut = sample
                    .functions
                    .iter()
                    .any(|f| f == "[truncated]" || f.starts_with("[unknown"));
                if chain && !cut {
                    busy_complete += count;
                } else {
                    busy_incomplete.push(sample.functions.join(";"));
                }
            }
            let in_exec = sample.functions.iter().any(|f| f == "begin_new_exec")
                && sample.functions.iter().any(|f| f == "exit_mmap");
            if !in_exec {
                continue;
            }
            let count = sample.values[0];
            *by_service.entry(service.clone()).or_default() += count;
            if sample.functions.iter().any(|f| f == "execve") {
                with_execve += count;
            }
            if sample.functions.iter().any(|f| f.starts_with("[unknown")) {
                unknown.push(sample.functions.join(";"));
            }
        }
    }
    let total: i64 = by_service.values().sum();
    assert!(
        total >= 3,
        "too few samples in the children's execs ({line}): {by_service:?}"
    );
    let before = by_service.get(&program).copied().unwrap_or(0);
    assert_eq!(
        before, total,
        "samples in an exec named after the program it starts: {by_service:?}"
    );
    assert!(
        with_execve as f64 >= 0.9 * total as f64,
        "only {with_execve} of {total} samples in an exec have the old program's execve"
    );
    assert!(unknown.is_empty(), "unknown frames: {unknown:#?}");

    // 16 children × 30 ms of CPU: about 48 samples at 100 Hz.
    let busy_total: i64 = busy_by_service.values().sum();
    assert!(
        busy_total >= 10,
        "too few samples of the children before their exec: {busy_by_service:?}"
    );
    assert_eq!(
        busy_by_service.get(&program).copied().unwrap_or(0),
        busy_total,
        "samples before an exec named after the program it starts: {busy_by_service:?}"
    );
    assert!(
        busy_complete as f64 >= 0.95 * busy_total as f64,
        "only {busy_complete} of {busy_total} samples before the exec walked to _start: \
         {busy_incomplete:#?}"
    );
}

/// A busy host: processes starting all the time (every one a new snapshot, new tables to build,
/// new files to symbolize) and a CPU-bound fixture. SIGTERM must end the agent within 10 s
/// (Kubernetes gives 30 before SIGKILL), with the interval under way written: the interval is
/// long (60 s), so the only profile of the fixture's service is the one flushed at the stop.
#[test]
fn stops_within_ten_seconds_of_sigterm_on_a_busy_host_flushing_the_interval() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let cpu = Command::new(&fixture)
        .arg("60")
        .env("OTEL_SERVICE_NAME", "busy-stop")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let cpu = Running { child: cpu };
    // Three shells starting /bin/true (and one a shell pipeline) without a pause.
    let churn: Vec<Running> = (0..3)
        .map(|_| Running {
            child: Command::new("sh")
                .args(["-c", "while :; do /bin/true; echo x | cat >/dev/null; done"])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        })
        .collect();
    let scratch = Scratch::new("agent-stop");
    let dir = scratch.path("profiles");
    let agent = Command::new(profiler_bin())
        .arg("agent")
        .args(agent_isolation_args(&[
            "--interval",
            "60",
            "--output-dir",
            dir.to_str().unwrap(),
        ]))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let it get busy: start-up, then several seconds of the churn.
    std::thread::sleep(Duration::from_secs(8));
    let sent = Instant::now();
    unsafe { libc_kill(agent.id() as i32, 15) };
    let pid = agent.id();
    let output = std::thread::scope(|scope| {
        let waiter = scope.spawn(move || agent.wait_with_output().unwrap());
        while !waiter.is_finished() && sent.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if !waiter.is_finished() {
            send_signal(pid, 9);
        }
        waiter.join().unwrap()
    });
    let took = sent.elapsed();
    drop(churn);
    drop(cpu);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        took < Duration::from_secs(10),
        "stopped {took:?} after SIGTERM\n{stderr}"
    );
    let flushed: Vec<_> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with("busy-stop-")
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        flushed.len(),
        1,
        "the interval under way, written at the stop: {flushed:?}"
    );
    let samples = readable_samples(&decode_pprof(&flushed[0]));
    assert!(
        samples.iter().map(|s| s.values[0]).sum::<i64>() > 0,
        "the flushed interval holds the fixture's samples"
    );
    eprintln!("stopped {took:?} after SIGTERM");
}

/// Each thread of process `pid`: its name and nice value (`/proc/PID/task/TID/stat`, field 19).
fn thread_priorities(pid: u32) -> Vec<(String, i32)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the agent's threads");
    let mut threads: Vec<(String, i32)> = tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("stat")).ok())
        .map(|stat| {
            let open = stat.find('(').expect("( in stat");
            let close = stat.rfind(')').expect(") in stat");
            let name = stat[open + 1..close].to_owned();
            // After the name: field 3 (state) onwards; the nice value is field 19.
            let nice = stat[close + 1..]
                .split_whitespace()
                .nth(19 - 3)
                .and_then(|field| field.parse().ok())
                .expect("the nice field");
            (name, nice)
        })
        .collect();
    threads.sort();
    threads
}

/// `--sampling-nice`: the threads that handle samples (the pipeline on the main thread,
/// `sample-reader`, the unwind-table builders) run at the raised priority, the HTTP server's
/// and the exporter's at the agent's own. Without `CAP_SYS_NICE` the agent says so and runs on.
#[test]
fn the_threads_that_handle_samples_run_at_the_raised_priority_and_only_they() {
    let _guard = exclusive();
    let own_nice = thread_priorities(std::process::id())[0].1;
    let sampling = ["profiler", "sample-reader", "unwind-tables", "unwind-large"];
    let serving = ["http", "http-server", "exporter"];
    let mut agent = Agent::start(&["--sampling-nice", "-7", "--no-gpu"]);
    // The sample reader is started by then.
    agent.wait_for("agent running", Duration::from_secs(60));
    let threads = thread_priorities(agent.pid());
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    for name in sampling.iter().chain(&serving) {
        assert!(
            threads.iter().any(|(thread, _)| thread == name),
            "no thread {name}: {threads:?}"
        );
    }
    for (thread, nice) in &threads {
        if sampling.contains(&thread.as_str()) {
            assert_eq!(*nice, -7, "{thread}: {threads:?}");
        } else if serving.contains(&thread.as_str()) {
            assert_eq!(*nice, own_nice, "{thread}: {threads:?}");
        }
    }

    // Without CAP_SYS_NICE (and RLIMIT_NICE 0): a warning, the agent's own priority, samples.
    let mut agent = Agent::start_through(
        &[
            "setpriv",
            "--bounding-set",
            "-sys_nice",
            "--inh-caps",
            "-sys_nice",
            "prlimit",
            "--nice=0",
            "--",
        ],
        &["--sampling-nice", "-7", "--no-gpu"],
        &[],
    );
    // The sample reader is started by then.
    agent.wait_for("agent running", Duration::from_secs(60));
    let threads = thread_priorities(agent.pid());
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("cannot raise the sampling threads' priority"),
        "no warning:\n{log}"
    );
    assert!(
        threads.iter().all(|(_, nice)| *nice == own_nice),
        "{threads:?}"
    );
}

/// A cgroup directory this test made, removed (empty by then) when dropped.
struct TestCgroup(std::path::PathBuf);

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Children of a parent in one container's cgroup are labelled with that container, and
/// children it forks after it moved to another container's cgroup with the other: the agent
/// takes a child's cgroups from its parent (instead of reading /proc/PID/cgroup, where cgroup
/// v1 hierarchies are mounted) only while the kernel reported no move since, or from the
/// move's destination as the kernel reported it.
#[test]
fn children_forked_after_their_parent_moved_cgroups_are_labelled_with_the_new_ones() {
    let _guard = exclusive();
    // A v1 hierarchy where one is mounted (the case that takes cgroups from the parent), else
    // the v2 root.
    let v1 = std::path::Path::new("/sys/fs/cgroup/memory");
    let hierarchy = match v1.join("cgroup.procs").exists() {
        true => v1.to_path_buf(),
        false => std::path::PathBuf::from("/sys/fs/cgroup"),
    };
    let containers = ["a1".repeat(32), "b2".repeat(32)];
    let cgroups: Vec<TestCgroup> = containers
        .iter()
        .map(|id| {
            let dir = hierarchy.join(format!("docker-{id}.scope"));
            std::fs::create_dir_all(&dir).expect("make a test cgroup");
            TestCgroup(dir)
        })
        .collect();
    let fixture = nofp_fixture("short_lived.c");
    let scratch = Scratch::new("cgroup-moves");
    // One copy of the program per container, so each sample's process (its root frame) tells
    // its phase.
    let phases = ["short_first", "short_second"];
    let programs: Vec<std::path::PathBuf> = phases
        .iter()
        .map(|name| {
            let copy = scratch.path(name);
            std::fs::copy(&fixture, &copy).expect("copy the fixture");
            copy
        })
        .collect();
    let (first_done, moved) = (scratch.path("first-done"), scratch.path("moved"));
    // The parent burns CPU between children, so the agent samples and snapshots it.
    let script = format!(
        "echo $$ > {first_cgroup}/cgroup.procs
         burn() {{ local i=0; while (( i < 20000 )); do i=$((i + 1)); done; }}
         for i in $(seq 30); do burn; {first} child 25; done
         touch {first_done}
         while [ ! -e {moved} ]; do burn; done
         for i in $(seq 30); do burn; {second} child 25; done",
        first_cgroup = cgroups[0].0.display(),
        first = programs[0].display(),
        second = programs[1].display(),
        first_done = first_done.display(),
        moved = moved.display(),
    );
    let dir = scratch.path("profiles");
    let mut agent = Agent::start(&["--interval", "1", "--output-dir", dir.to_str().unwrap()]);
    agent.wait_for_intervals(2, Duration::from_secs(30));
    let mut parent = Command::new("bash")
        .args(["-c", &script])
        .spawn()
        .expect("start the parent");
    let deadline = Instant::now() + Duration::from_secs(300);
    while !first_done.exists() {
        assert!(
            Instant::now() < deadline,
            "the parent's first children took 300 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(cgroups[1].0.join("cgroup.procs"), parent.id().to_string())
        .expect("move the parent");
    std::fs::write(&moved, b"").expect("tell the parent");
    assert!(parent.wait().expect("the parent").success());
    std::thread::sleep(Duration::from_millis(2500));
    let client = Client::new(agent.http_addr());
    let from_fork = client.metric("profiler_process_cgroups_from_fork_total");
    let from_moves = client.metric("profiler_process_cgroups_from_moves_total");
    let (status, log) = agent.stop();
    assert!(status.success(), "agent failed with {status}:\n{log}");

    // (samples, of them labelled with the container, with the other container) per phase;
    // the rest are labelled with none: children that exited before the agent read them,
    // forked before it read of the move (their cgroups unproven).
    let mut by_phase = [(0i64, 0i64, 0i64); 2];
    let mut unlabelled = std::collections::BTreeMap::<String, i64>::new();
    // A container's processes are its service, named after its id's first 12 digits.
    let services = containers.each_ref().map(|id| id[..12].to_owned());
    for (service, profile) in all_profiles(&dir) {
        for sample in readable_samples(&profile) {
            if !sample.functions.iter().any(|f| f == "short_burn") {
                continue;
            }
            let Some(phase) = sample
                .functions
                .last()
                .and_then(|root| phases.iter().position(|name| root == name))
            else {
                continue;
            };
            let count = sample.values[0];
            by_phase[phase].0 += count;
            if service == services[phase] {
                by_phase[phase].1 += count;
            } else if service == services[1 - phase] {
                by_phase[phase].2 += count;
            } else {
                *unlabelled
                    .entry(format!("{}: {service}", phases[phase]))
                    .or_default() += count;
            }
        }
    }
    for (phase, (total, right, other)) in by_phase.iter().enumerate() {
        assert!(
            *total >= 5,
            "too few samples of the children, phase {phase}: {by_phase:?}"
        );
        assert_eq!(
            *other, 0,
            "children labelled with the container their parent was not in at their fork \
             (phase {phase}): {by_phase:?}"
        );
        assert!(
            *right * 2 >= *total,
            "children not labelled with their container (phase {phase}): {by_phase:?}, \
             {unlabelled:?}"
        );
    }
    if hierarchy == v1 {
        assert!(
            from_fork.is_some_and(|count| count > 0.0),
            "no child's cgroups came from its parent: {from_fork:?}"
        );
        // The move event says where the parent went: its cgroups after the move are known
        // from the move on, so no child of the second phase is left to read its own (and,
        // gone by then, to go unlabelled), however soon after the move it was forked.
        assert!(
            from_moves.is_some_and(|count| count > 0.0),
            "the parent's move was not applied from its destination: {from_moves:?}"
        );
        assert_eq!(
            by_phase[1].1, by_phase[1].0,
            "children forked after the move, not all labelled with its destination: \
             {by_phase:?}, {unlabelled:?}"
        );
    }
    drop(cgroups);
}
