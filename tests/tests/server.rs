//! The embedded store and HTTP server as users meet them: the real `profiler server` (and
//! `profiler agent`) binary on a loopback port, real Pyroscope SDKs pushing into it, and queries
//! through the Connect API in both codecs.
use std::{
    collections::BTreeSet,
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use integration_tests::{server_harness::*, *};

/// How long the SDK programs burn CPU; each flushes at least once a second and again at exit.
const SDK_SECONDS: &str = "3";

/// The pyroscope-io install of `cargo xtask setup` and the interpreter it was installed for.
fn pyroscope_io() -> (PathBuf, PathBuf) {
    let dir = workspace_root().join(".tools").join("pyroscope-io");
    let interpreter = std::fs::read_to_string(dir.join("python-interpreter"))
        .map(|path| PathBuf::from(path.trim()))
        .unwrap_or_else(|err| {
            panic!(
                "pyroscope-io is not installed in {} ({err}): run `cargo xtask setup`",
                dir.display()
            )
        });
    (dir, interpreter)
}

fn assert_ran(output: &std::process::Output, what: &str) {
    assert!(
        output.status.success(),
        "{what} failed with {}:\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Polls until `check` returns Some, for data a client flushes asynchronously.
fn eventually<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What a test expects to find after a client pushed: its service, one tag and the function
/// it burned CPU in, for every profile type whose name starts with `type_prefix`.
struct Expected<'a> {
    service: &'a str,
    tag: (&'a str, &'a str),
    function: &'a str,
    type_prefix: &'a str,
}

/// Queries the pushed data with ProfileTypes, LabelValues and SelectMergeStacktraces, in the
/// protobuf and the JSON codec.
fn assert_queryable(client: &Client, expected: &Expected) {
    let types: Vec<String> = client
        .profile_types()
        .into_iter()
        .filter(|t| t.starts_with(expected.type_prefix))
        .collect();
    assert!(
        !types.is_empty(),
        "no `{}` profile type in {:?}",
        expected.type_prefix,
        client.profile_types()
    );
    let services = client.label_values("service_name", None);
    assert!(
        services.iter().any(|s| s == expected.service),
        "{services:?}"
    );
    let (tag, value) = expected.tag;
    let service_selector = format!(r#"{{service_name="{}"}}"#, expected.service);
    let values = client.label_values(tag, Some(&service_selector));
    assert_eq!(values, [value], "values of {tag}");
    let selector = format!(
        r#"{{service_name="{}", {tag}="{value}"}}"#,
        expected.service
    );
    let mut found_in = Vec::new();
    for profile_type in &types {
        let graph = client.merge(profile_type, &selector);
        if flamegraph_total_of(&graph, expected.function) > 0 {
            found_in.push(profile_type.clone());
        }
    }
    assert!(
        !found_in.is_empty(),
        "`{}` is in no flame graph of {selector}; names of {}: {:?}",
        expected.function,
        types[0],
        flamegraph_names(&client.merge(&types[0], &selector))
    );
    // A selector for another value of the tag matches nothing.
    let other = format!(
        r#"{{service_name="{}", {tag}!="{value}"}}"#,
        expected.service
    );
    assert_eq!(client.merge(&found_in[0], &other).total, 0);

    // The same through the JSON codec, as the web UI and Grafana's Drilldown app call it.
    let json_types = client.connect_json(
        "querier.v1.QuerierService/ProfileTypes",
        serde_json::json!({}),
    );
    let ids: Vec<&str> = json_types["profileTypes"]
        .as_array()
        .expect("profileTypes array")
        .iter()
        .filter_map(|t| t["ID"].as_str())
        .collect();
    assert!(ids.contains(&found_in[0].as_str()), "{json_types}");
    let json_values = client.connect_json(
        "querier.v1.QuerierService/LabelValues",
        serde_json::json!({"name": "service_name", "start": "1",
                           "end": (unix_now_ms() + 60_000).to_string()}),
    );
    assert!(
        json_values["names"]
            .as_array()
            .expect("names array")
            .iter()
            .any(|v| v == expected.service),
        "{json_values}"
    );
    let json_graph = client.connect_json(
        "querier.v1.QuerierService/SelectMergeStacktraces",
        serde_json::json!({
            "profileTypeID": found_in[0],
            "labelSelector": selector,
            "start": "1",
            "end": (unix_now_ms() + 60_000).to_string(),
        }),
    );
    let names = json_graph["flamegraph"]["names"]
        .as_array()
        .expect("flamegraph names");
    assert!(
        names
            .iter()
            .any(|n| n.as_str().is_some_and(|n| n.contains(expected.function))),
        "{json_graph}"
    );
    // 64-bit integers are strings in protobuf's canonical JSON.
    let total: i64 = json_graph["flamegraph"]["total"]
        .as_str()
        .expect("total as a string")
        .parse()
        .unwrap();
    assert_eq!(total, client.merge(&found_in[0], &selector).total);

    // LabelNames (Grafana's label picker): the service's own tag and the standard labels, and
    // none of another service's tags.
    let end = (unix_now_ms() + 60_000).to_string();
    let json_names = client.connect_json(
        "querier.v1.QuerierService/LabelNames",
        serde_json::json!({"matchers": [service_selector], "start": "1", "end": end}),
    );
    let names: Vec<&str> = json_names["names"]
        .as_array()
        .expect("names array")
        .iter()
        .map(|n| n.as_str().expect("label names are strings"))
        .collect();
    for label in [tag, "service_name", "__name__", "__profile_type__"] {
        assert!(names.contains(&label), "{label} not in {json_names}");
    }
    assert!(
        !names.contains(&"no_such_label"),
        "{json_names}: a label nobody sent"
    );
    let mut sorted = names.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(names, sorted, "sorted and unique: {json_names}");

    // SelectSeries (Grafana's time-series panel), grouped by the tag: one series labelled with
    // its value whose points add up to the merged flame graph's total, with 64-bit timestamps
    // as strings inside the range.
    let (start_ms, end_ms) = (1_i64, unix_now_ms() + 60_000);
    let json_series = client.connect_json(
        "querier.v1.QuerierService/SelectSeries",
        serde_json::json!({
            "profileTypeID": found_in[0],
            "labelSelector": selector,
            "start": start_ms.to_string(),
            "end": end_ms.to_string(),
            "groupBy": [tag],
            "step": 1.0,
        }),
    );
    let series = json_series["series"].as_array().expect("series array");
    assert_eq!(series.len(), 1, "{json_series}");
    assert_eq!(
        series[0]["labels"],
        serde_json::json!([{"name": tag, "value": value}]),
        "{json_series}"
    );
    let points = series[0]["points"].as_array().expect("points array");
    assert!(!points.is_empty(), "{json_series}");
    let mut sum = 0.0;
    for point in points {
        let timestamp: i64 = point["timestamp"]
            .as_str()
            .expect("timestamp as a string")
            .parse()
            .expect("timestamp is an integer");
        assert!((start_ms..=end_ms).contains(&timestamp), "{point}");
        sum += point["value"].as_f64().expect("value is a number");
    }
    let merged = client.merge(&found_in[0], &selector).total;
    assert_eq!(sum, merged as f64, "{json_series}");
}

#[test]
fn python_sdk_push_is_queryable() {
    let (sdk_dir, python) = pyroscope_io();
    let scratch = Scratch::new("python-sdk");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let output = Command::new(&python)
        .arg(fixture_source("pyroscope_sdk_app.py"))
        .args([
            &format!("http://{}", server.addr),
            "python-sdk-app",
            SDK_SECONDS,
        ])
        .env("PYTHONPATH", &sdk_dir)
        .output()
        .expect("run the Python SDK program");
    assert_ran(&output, "the pyroscope-io program");
    let client = server.client();
    // pyroscope-io pushes with Connect (push.v1), its request gzipped as a whole.
    eventually("the Python SDK's profiles", Duration::from_secs(30), || {
        client
            .label_values("service_name", None)
            .contains(&"python-sdk-app".to_string())
            .then_some(())
    });
    assert_queryable(
        &client,
        &Expected {
            service: "python-sdk-app",
            tag: ("region", "test-east"),
            function: "burn_cpu_in_python_fixture",
            type_prefix: "process_cpu:",
        },
    );
}

/// `SelectMergeSpanProfile` of some span ids, in the protobuf codec, as Grafana's data source
/// sends it for "traces to profiles" (grafana/grafana
/// pkg/tsdb/grafana-pyroscope-datasource/pyroscopeClient.go, `GetSpanProfile`: type, selector,
/// span ids, start and end in ms, max nodes; no format, so a flame graph).
fn span_profile(client: &Client, selector: &str, span_ids: &[String]) -> api::FlameGraph {
    let response: api::SelectMergeSpanProfileResponse = client.connect(
        "querier.v1.QuerierService/SelectMergeSpanProfile",
        &api::SelectMergeSpanProfileRequest {
            profile_type_id: "process_cpu:cpu:nanoseconds:cpu:nanoseconds".into(),
            label_selector: selector.into(),
            span_selector: span_ids.to_vec(),
            start: 1,
            end: unix_now_ms() + 3_600_000,
            max_nodes: Some(16_384),
            format: 0,
        },
    );
    response.flamegraph.unwrap_or_default()
}

/// The real pyroscope-otel span processor tags each root span's samples with `span_id`,
/// `span_name` and `trace_id`; the profile of a set of span ids holds their work and nothing
/// else, and none of the three becomes a series label.
#[test]
fn span_profiles_of_pyroscope_otel_hold_their_spans_work_only() {
    let (sdk_dir, python) = pyroscope_io();
    let scratch = Scratch::new("otel-sdk");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let output = Command::new(&python)
        .arg(fixture_source("pyroscope_otel_app.py"))
        .args([&format!("http://{}", server.addr), "otel-sdk-app", "6"])
        .env("PYTHONPATH", &sdk_dir)
        .output()
        .expect("run the pyroscope-otel program");
    assert_ran(&output, "the pyroscope-otel program");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let spans: std::collections::HashMap<String, Vec<String>> =
        serde_json::from_str(stdout.lines().last().unwrap_or_default())
            .unwrap_or_else(|err| panic!("span ids on the last line ({err}): {stdout}"));
    let (checkout, search) = (&spans["checkout"], &spans["search"]);
    let client = server.client();
    let selector = r#"{service_name="otel-sdk-app"}"#;
    let cpu = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
    // The SDK flushes at shutdown; wait until the checkout work is stored.
    eventually("the SDK's profiles", Duration::from_secs(30), || {
        let all = client.merge(cpu, selector);
        (flamegraph_total_of(&all, "checkout_request_work") > 0
            && flamegraph_total_of(&all, "search_request_work") > 0)
            .then_some(())
    });

    let (work, other, outside) = (
        "checkout_request_work",
        "search_request_work",
        "work_outside_any_span",
    );
    let of_checkout = span_profile(&client, selector, checkout);
    assert!(
        flamegraph_total_of(&of_checkout, work) > 0,
        "{:?}",
        flamegraph_names(&of_checkout)
    );
    for absent in [other, outside] {
        assert_eq!(
            flamegraph_total_of(&of_checkout, absent),
            0,
            "`{absent}` in the checkout spans' profile: {:?}",
            flamegraph_names(&of_checkout)
        );
    }
    let of_search = span_profile(&client, selector, search);
    assert!(flamegraph_total_of(&of_search, other) > 0);
    assert_eq!(flamegraph_total_of(&of_search, work), 0);
    assert_eq!(flamegraph_total_of(&of_search, outside), 0);
    // One span of each kind: only its own samples.
    let one = span_profile(&client, selector, &checkout[..1]);
    assert!(one.total <= of_checkout.total);
    // Both kinds together add up; the whole profile has more (the work outside spans).
    let both: Vec<String> = checkout.iter().chain(search).cloned().collect();
    let of_both = span_profile(&client, selector, &both);
    assert_eq!(of_both.total, of_checkout.total + of_search.total);
    let whole = client.merge(cpu, selector);
    assert!(flamegraph_total_of(&whole, outside) > 0);
    assert!(
        of_both.total < whole.total,
        "{} < {}",
        of_both.total,
        whole.total
    );
    // A span id nobody pushed selects nothing.
    assert_eq!(
        span_profile(&client, selector, &["00000000deadbeef".into()]).total,
        0
    );

    // The JSON codec, with the field names of the proto3 JSON mapping.
    let json = client.connect_json(
        "querier.v1.QuerierService/SelectMergeSpanProfile",
        serde_json::json!({
            "profileTypeID": cpu,
            "labelSelector": selector,
            "spanSelector": checkout,
            "start": "1",
            "end": (unix_now_ms() + 3_600_000).to_string(),
            "maxNodes": "16384",
        }),
    );
    assert_eq!(
        json["flamegraph"]["total"].as_str(),
        Some(of_checkout.total.to_string().as_str()),
        "{json}"
    );

    // Pyroscope's newer form: span and trace ids in SelectMergeStacktraces (fields 11 and 10).
    let merge_by = |span_ids: &[String], trace_ids: &[String]| {
        let response: api::SelectMergeStacktracesResponse = client.connect(
            "querier.v1.QuerierService/SelectMergeStacktraces",
            &api::SelectMergeStacktracesRequest {
                profile_type_id: cpu.into(),
                label_selector: selector.into(),
                start: 1,
                end: unix_now_ms() + 3_600_000,
                span_selector: span_ids.to_vec(),
                trace_id_selector: trace_ids.to_vec(),
                ..Default::default()
            },
        );
        response.flamegraph.unwrap_or_default().total
    };
    assert_eq!(merge_by(checkout, &[]), of_checkout.total);
    assert_eq!(merge_by(&[], &spans["checkout_traces"]), of_checkout.total);
    assert_eq!(merge_by(search, &spans["checkout_traces"]), 0);

    // A span_id matcher in a label selector selects the same samples (Pyroscope's frontend).
    let matcher = format!(
        r#"{{service_name="otel-sdk-app", span_id=~"{}"}}"#,
        checkout.join("|")
    );
    assert_eq!(client.merge(cpu, &matcher).total, of_checkout.total);

    // Span labels are kept with the samples, not as series labels.
    let names: api::LabelNamesResponse = client.connect(
        "querier.v1.QuerierService/LabelNames",
        &api::LabelNamesRequest {
            matchers: vec![selector.into()],
            start: 1,
            end: unix_now_ms() + 3_600_000,
        },
    );
    for label in ["span_id", "span_name", "trace_id"] {
        assert!(!names.names.iter().any(|n| n == label), "{:?}", names.names);
    }
    assert_eq!(client.label_values("sdk", Some(selector)), ["python-otel"]);
    // Their values are still listed.
    assert_eq!(
        client.label_values("span_name", Some(selector)),
        ["checkout", "search"]
    );
    let mut listed = client.label_values("span_id", Some(selector));
    let mut pushed = both.clone();
    listed.sort();
    pushed.sort();
    // A span the sampler never caught on a CPU has no samples, so it is not listed.
    assert!(listed.iter().all(|id| pushed.contains(id)), "{listed:?}");
    assert!(!listed.is_empty());
}

#[test]
fn node_sdk_push_is_queryable() {
    let js = workspace_root().join("tests").join("js");
    assert!(
        js.join("node_modules/@pyroscope/nodejs").is_dir(),
        "@pyroscope/nodejs is not installed in {}: run `cargo xtask setup`",
        js.display()
    );
    let scratch = Scratch::new("node-sdk");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let output = Command::new("node")
        .arg("pyroscope_sdk_app.mjs")
        .args([
            &format!("http://{}", server.addr),
            "node-sdk-app",
            SDK_SECONDS,
        ])
        .current_dir(&js)
        .output()
        .expect("run the Node.js SDK program");
    assert_ran(&output, "the @pyroscope/nodejs program");
    let client = server.client();
    // @pyroscope/nodejs sends gzipped pprof to the legacy /ingest with `name=app{tags}`.
    eventually(
        "the Node.js SDK's profiles",
        Duration::from_secs(30),
        || {
            client
                .label_values("service_name", None)
                .contains(&"node-sdk-app".to_string())
                .then_some(())
        },
    );
    assert_queryable(
        &client,
        &Expected {
            service: "node-sdk-app",
            tag: ("region", "test-west"),
            function: "burnCpuInNodeFixture",
            type_prefix: "wall:",
        },
    );
    // The SDK's own dotted tags arrive as labels too.
    assert_eq!(
        client.label_values(
            "process.runtime.name",
            Some(r#"{service_name="node-sdk-app"}"#)
        ),
        ["nodejs"]
    );
}

/// `profiler agent` with its store on: a fixture's function is queryable over HTTP afterwards.
#[test]
fn agent_profiles_are_queryable_over_http() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let running = spawn_with_env(
        &fixture,
        &["60"],
        &[("OTEL_SERVICE_NAME", "agent-store-check")],
    );
    let scratch = Scratch::new("agent-store");
    let data_dir = scratch.path("data");
    let pid = running.pid().to_string();
    let mut agent = Agent::start(&[
        "--interval",
        "1",
        "--pid",
        &pid,
        "--data-dir",
        data_dir.to_str().unwrap(),
    ]);
    let client = Client::new(agent.http_addr());
    let selector = r#"{service_name="agent-store-check"}"#;
    let graph = eventually(
        "the agent's profile of level4",
        Duration::from_secs(60),
        || {
            let graph = client.merge(CPU_TYPE, selector);
            (flamegraph_total_of(&graph, "level4") > 0).then_some(graph)
        },
    );
    let names = flamegraph_names(&graph);
    for function in ["main", "level1", "level2", "level3", "level4"] {
        assert!(names.iter().any(|n| n == function), "{function}: {names:?}");
    }
    // Most of the fixture's CPU time is in level4.
    assert!(
        flamegraph_total_of(&graph, "level4") * 2 > graph.total,
        "{names:?}"
    );
    assert!(
        client
            .label_values("service_name", None)
            .contains(&"agent-store-check".to_string())
    );
    let health: serde_json::Value =
        serde_json::from_slice(&client.get("/api/health").body).expect("health JSON");
    assert_eq!(health["store"]["enabled"], true, "{health}");
    let (status, stderr) = agent.stop();
    assert!(status.success(), "{stderr}");
    // Still there for a server started on the same directory after the agent stopped.
    let server = ServerProcess::start(&data_dir, &[]);
    assert!(flamegraph_total_of(&server.client().merge(CPU_TYPE, selector), "level4") > 0);
}

/// Under a low open-file limit the HTTP server gets a share of the descriptors and no more: a
/// flood of idle connections cannot leave the agent without descriptors for /proc and the
/// fixture's files (which turned every stack into `[truncated] ; [unknown]`).
#[test]
fn idle_connections_cannot_starve_the_agent_of_file_descriptors() {
    let _guard = exclusive();
    let fixture = fp_fixture("fp_chain.c");
    let scratch = Scratch::new("agent-fds");
    let data_dir = scratch.path("data");
    // The whole host: the fixture starts during the flood, so its snapshot needs descriptors
    // (/proc/PID/*, its binary and libraries) while the sockets are held.
    let mut agent = Agent::start_through(
        &["prlimit", "--nofile=600:600", "--"],
        &[
            "--interval",
            "1",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--http-header-timeout",
            "60s",
        ],
        &[],
    );
    // 600 - 256 reserved: a quarter, less the probes' 16, for connections.
    let log = agent.stderr();
    assert!(
        log.contains("open-file limit 600") && log.contains("70 HTTP connections"),
        "{log}"
    );
    let addr = agent.http_addr();
    // (A timeout: once a listener stops accepting, its backlog fills and a connect would wait.)
    let flood: Vec<std::net::TcpStream> = (0..700)
        .filter_map(|_| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok())
        .collect();
    // The most descriptors the agent holds while it accepts what it will of the flood.
    let descriptors = || {
        std::fs::read_dir(format!("/proc/{}/fd", agent.pid()))
            .map(|entries| entries.count())
            .unwrap_or(0)
    };
    let mut held = 0;
    for _ in 0..15 {
        std::thread::sleep(Duration::from_millis(200));
        held = held.max(descriptors());
    }
    assert!(
        held + 128 < 600,
        "the connections took the agent's descriptors: {held} of 600 open"
    );
    let flooded_at = unix_now_ns();
    let running = spawn_with_env(&fixture, &["60"], &[("OTEL_SERVICE_NAME", "fd-starved")]);
    std::thread::sleep(Duration::from_secs(4));
    let flood_end = unix_now_ns();
    drop(flood);
    drop(running);
    let client = Client::new(addr);
    let selector = r#"{service_name="fd-starved"}"#;
    let graph = eventually(
        "the fixture's samples taken during the flood",
        Duration::from_secs(30),
        || {
            let graph = client.merge_range(
                CPU_TYPE,
                selector,
                flooded_at / 1_000_000,
                flood_end / 1_000_000,
            );
            (graph.total > 0).then_some(graph)
        },
    );
    // Starved, every stack was `[truncated] ; [unknown]`; a process's first moments (ld.so)
    // may legitimately give a few such samples.
    let names = flamegraph_names(&graph);
    let broken =
        flamegraph_total_of(&graph, "[unknown]") + flamegraph_total_of(&graph, "[truncated]");
    assert!(
        broken * 10 < graph.total,
        "{broken} of {}: {names:?}",
        graph.total
    );
    assert!(
        flamegraph_total_of(&graph, "level4") * 2 > graph.total,
        "{names:?}"
    );
    let (status, stderr) = agent.stop();
    assert!(status.success(), "{stderr}");
}

/// A small profile whose only stack is `main;handle_request;<function>` with `value` ns.
fn marker_profile(function: &str, value: i64) -> proto::Profile {
    pprof_from_stacks(
        &[(
            vec!["main".into(), "handle_request".into(), function.into()],
            value,
        )],
        unix_now_ns(),
    )
}

/// The value of the profile numbered `seq` in the durability test: distinct per profile.
fn durable_value(seq: u64) -> i64 {
    (seq as i64 + 1) * 10_000_000
}

/// Pushes numbered profiles from several threads until the server stops answering; returns the
/// numbers that got a 2xx.
fn push_until_refused(client: &Client, next: &AtomicU64, writers: usize) -> Vec<u64> {
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for _ in 0..writers {
            let acknowledged = Arc::clone(&acknowledged);
            scope.spawn(move || {
                loop {
                    let seq = next.fetch_add(1, Ordering::SeqCst);
                    let request = push_request(
                        &[("service_name", "durable"), ("seq", &seq.to_string())],
                        &marker_profile(&format!("request_{}", seq % 7), durable_value(seq)),
                    );
                    match client.try_request(
                        "POST",
                        "/push.v1.PusherService/Push",
                        &[("Content-Type", "application/proto")],
                        Some(&prost::Message::encode_to_vec(&request)),
                    ) {
                        Ok(response) if response.status == 200 => {
                            acknowledged.lock().unwrap().push(seq);
                        }
                        Ok(response) => {
                            panic!("push {seq}: {} {}", response.status, response.text())
                        }
                        // The server was killed.
                        Err(_) => return,
                    }
                }
            });
        }
    });
    Arc::try_unwrap(acknowledged).unwrap().into_inner().unwrap()
}

#[test]
fn acknowledged_ingests_survive_kill_9() {
    let scratch = Scratch::new("kill9");
    let data_dir = scratch.path("data");
    let next = AtomicU64::new(0);
    let mut acknowledged: BTreeSet<u64> = BTreeSet::new();
    for round in 0..3 {
        let mut server = ServerProcess::start(&data_dir, &[]);
        let client = server.client();
        // Everything acknowledged in earlier rounds is back after the restart.
        if !acknowledged.is_empty() {
            assert_all_present(&client, &acknowledged, round);
        }
        let killed = AtomicBool::new(false);
        let before = acknowledged.len();
        let round_acks = std::thread::scope(|scope| {
            let pushing = scope.spawn(|| push_until_refused(&client, &next, 4));
            // Kill while the writers are mid-stream: after some acknowledgements, at a moment
            // that varies with scheduling.
            let deadline = Instant::now() + Duration::from_secs(60);
            while client
                .metric("profiler_store_profiles_ingested_total")
                .unwrap_or(0.0)
                < 40.0 + round as f64 * 17.0
            {
                assert!(Instant::now() < deadline, "the server ingests nothing");
                std::thread::sleep(Duration::from_millis(5));
            }
            server.process.kill9();
            killed.store(true, Ordering::SeqCst);
            pushing.join().unwrap()
        });
        assert!(killed.load(Ordering::SeqCst));
        acknowledged.extend(round_acks);
        assert!(
            acknowledged.len() > before,
            "round {round}: no acknowledged push"
        );
    }
    let mut server = ServerProcess::start(&data_dir, &[]);
    assert_all_present(&server.client(), &acknowledged, 3);
    let (status, stderr) = server.process.stop();
    assert!(status.success(), "{stderr}");
    // The file itself is intact, not only readable enough for the queries above.
    let db = rusqlite::Connection::open(data_dir.join("profiles.db")).unwrap();
    let integrity: String = db
        .query_row("PRAGMA integrity_check", [], |row| row.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
    let stored: i64 = db
        .query_row("SELECT COUNT(*) FROM profiles", [], |row| row.get(0))
        .unwrap();
    assert!(stored as usize >= acknowledged.len());
}

/// Every acknowledged push is queryable: its `seq` label value exists and the merged total
/// covers all acknowledged values (unacknowledged pushes may or may not have landed).
fn assert_all_present(client: &Client, acknowledged: &BTreeSet<u64>, round: usize) {
    let stored: BTreeSet<u64> = client
        .label_values("seq", Some(r#"{service_name="durable"}"#))
        .iter()
        .map(|v| v.parse().expect("numeric seq"))
        .collect();
    let missing: Vec<&u64> = acknowledged.difference(&stored).collect();
    assert!(
        missing.is_empty(),
        "after restart {round}: acknowledged but lost: {missing:?}"
    );
    let total = client.merge(CPU_TYPE, r#"{service_name="durable"}"#).total;
    let stored_sum: i64 = stored.iter().map(|&s| durable_value(s)).sum();
    assert_eq!(total, stored_sum, "each stored push counted exactly once");
    // One stored push, checked on its own.
    let last = acknowledged.iter().next_back().unwrap();
    let graph = client.merge(
        CPU_TYPE,
        &format!(r#"{{service_name="durable", seq="{last}"}}"#),
    );
    assert_eq!(graph.total, durable_value(*last));
    assert_eq!(
        flamegraph_total_of(&graph, &format!("request_{}", last % 7)),
        durable_value(*last)
    );
}

#[test]
fn concurrent_ingest_and_queries() {
    const WRITERS: usize = 4;
    const PUSHES: usize = 25;
    let scratch = Scratch::new("concurrent");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let client = server.client();
    let writers_done = AtomicBool::new(false);
    let expected_totals: Vec<i64> = std::thread::scope(|scope| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|writer| {
                let client = client.clone();
                scope.spawn(move || {
                    let service = format!("concurrent-{writer}");
                    let mut total = 0;
                    for push in 0..PUSHES {
                        let profile =
                            synthetic_service_profile(writer, push as u64, 300, unix_now_ns());
                        total += profile.sample.iter().map(|s| s.value[0]).sum::<i64>();
                        let response =
                            client.push(&push_request(&[("service_name", &service)], &profile));
                        assert_eq!(response.status, 200, "{}", response.text());
                    }
                    total
                })
            })
            .collect();
        let readers: Vec<_> = (0..3)
            .map(|reader| {
                let client = client.clone();
                let writers_done = &writers_done;
                scope.spawn(move || {
                    let selector = format!(r#"{{service_name="concurrent-{reader}"}}"#);
                    let mut last_total = 0;
                    let mut queries = 0;
                    while !writers_done.load(Ordering::SeqCst) {
                        // A reader sees whole pushes only, and never fewer than before.
                        let total = client.merge(CPU_TYPE, &selector).total;
                        assert!(total >= last_total, "{total} after {last_total}");
                        last_total = total;
                        let _ = client.label_values("service_name", None);
                        let _ = client.profile_types();
                        queries += 1;
                    }
                    queries
                })
            })
            .collect();
        let totals = writers.into_iter().map(|w| w.join().unwrap()).collect();
        writers_done.store(true, Ordering::SeqCst);
        for reader in readers {
            assert!(reader.join().unwrap() > 0);
        }
        totals
    });
    for (writer, expected) in expected_totals.iter().enumerate() {
        let selector = format!(r#"{{service_name="concurrent-{writer}"}}"#);
        assert_eq!(client.merge(CPU_TYPE, &selector).total, *expected);
    }
}

/// A folded upload of `service` at unix second `from`: `stacks` stacks `main;work_<i>` (the
/// same every time, so the stored profile is mostly its own blob) plus `main;<marker>`.
fn ingest_folded_at(client: &Client, service: &str, from: i64, marker: &str, stacks: usize) {
    let mut body = format!("main;{marker} 1\n");
    for i in 0..stacks {
        body.push_str(&format!("main;work_{i} {}\n", 1 + i % 7));
    }
    let response = client.post(
        &format!("/ingest?name={service}&from={from}&until={}", from + 15),
        "text/plain",
        body.as_bytes(),
    );
    assert_eq!(response.status, 200, "{}", response.text());
}

fn unix_now_s() -> i64 {
    unix_now_ns() / 1_000_000_000
}

/// `--retention` in the running binary: a profile older than the retention disappears from
/// queries within a few maintenance passes, a recent one stays, and /metrics counts it.
#[test]
fn retention_evicts_old_profiles_in_the_running_server() {
    let scratch = Scratch::new("retention");
    let server = ServerProcess::start(
        &scratch.path("data"),
        &["--retention", "1h", "--maintenance-interval", "1s"],
    );
    let client = server.client();
    assert_eq!(
        client.metric("profiler_store_profiles_evicted_total"),
        Some(0.0)
    );
    // Stored although old: the store accepts any time, retention removes it later.
    ingest_folded_at(&client, "aging", unix_now_s() - 2 * 3600, "old_work", 10);
    ingest_folded_at(&client, "aging", unix_now_s(), "new_work", 10);
    eventually(
        "the old profile's eviction",
        Duration::from_secs(60),
        || (client.metric("profiler_store_profiles_evicted_total")? >= 1.0).then_some(()),
    );
    let names = flamegraph_names(&client.merge(CPU_TYPE, r#"{service_name="aging"}"#));
    assert!(names.contains(&"new_work".to_owned()), "{names:?}");
    assert!(!names.contains(&"old_work".to_owned()), "{names:?}");
    assert_eq!(
        client.metric("profiler_store_profiles_evicted_total"),
        Some(1.0),
        "only the old profile"
    );
}

/// `--max-store-size` in the binary: at start a lowered cap deletes the oldest profiles until
/// the data fits, and while running ingest beyond the cap is evicted again, oldest first.
#[test]
fn size_cap_evicts_the_oldest_profiles() {
    const PROFILES: i64 = 40;
    const STACKS: usize = 2000;
    let scratch = Scratch::new("size-cap");
    let data_dir = scratch.path("data");
    let marker = |k: i64| format!("marker_{k:03}");
    let first = unix_now_s() - PROFILES * 60;
    let full_bytes = {
        let server = ServerProcess::start(&data_dir, &[]);
        let client = server.client();
        for k in 0..PROFILES {
            ingest_folded_at(&client, "sized", first + k * 60, &marker(k), STACKS);
        }
        client.metric("profiler_store_bytes").expect("store bytes")
    };
    let cap = (full_bytes / 2.0) as u64;
    let cap_flag = format!("{cap}B");
    let server = ServerProcess::start(
        &data_dir,
        &[
            "--max-store-size",
            &cap_flag,
            "--maintenance-interval",
            "1s",
        ],
    );
    let client = server.client();
    let evicted_at_start = client
        .metric("profiler_store_profiles_evicted_total")
        .expect("evicted counter");
    assert!(evicted_at_start >= 1.0, "nothing evicted at start");
    assert!(
        evicted_at_start < PROFILES as f64,
        "everything evicted: the cap of {cap} bytes is below the catalog"
    );
    let used = client.metric("profiler_store_bytes").expect("store bytes");
    assert!(
        used <= cap as f64,
        "{used} bytes in use over the cap of {cap}"
    );
    // The survivors are the newest profiles: a run of markers up to the last one.
    let survivors = |client: &Client| -> Vec<i64> {
        flamegraph_names(&client.merge(CPU_TYPE, r#"{service_name="sized"}"#))
            .iter()
            .filter_map(|name| name.strip_prefix("marker_")?.parse().ok())
            .collect()
    };
    let kept = survivors(&client);
    let oldest_kept = PROFILES - kept.len() as i64;
    assert_eq!(
        kept,
        (oldest_kept..PROFILES).collect::<Vec<_>>(),
        "not the newest ones kept"
    );
    assert_eq!(
        PROFILES - kept.len() as i64,
        evicted_at_start as i64,
        "the counter counts the evicted profiles"
    );

    // Running: newer profiles push the store over the cap again; the maintenance thread evicts
    // the oldest ones.
    // Minutes apart like the others (the last ones slightly in the future), so "oldest" is
    // never a tie.
    const MORE: i64 = 10;
    for k in PROFILES..PROFILES + MORE {
        ingest_folded_at(&client, "sized", first + k * 60, &marker(k), STACKS);
    }
    eventually("eviction while running", Duration::from_secs(60), || {
        let evicted = client.metric("profiler_store_profiles_evicted_total")?;
        let used = client.metric("profiler_store_bytes")?;
        (evicted > evicted_at_start && used <= cap as f64).then_some(())
    });
    let kept = survivors(&client);
    assert!(
        kept.contains(&(PROFILES + MORE - 1)),
        "the newest went: {kept:?}"
    );
    assert!(!kept.contains(&oldest_kept), "the oldest stayed: {kept:?}");
}

const MIB: usize = 1 << 20;

/// What is wrong, path, headers, body, expected status.
type BadRequest<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>, Vec<u8>, u16);

/// HTTP method, path, and the content type and body of a POST.
type Route<'a> = (&'a str, &'a str, Option<(&'a str, Vec<u8>)>);

fn gzip_of_zeros(len: usize) -> Vec<u8> {
    gzip(&vec![0u8; len])
}

/// Every kind of bad request gets a 4xx with a one-line JSON error, and changes nothing a query
/// can see. Uses the default limits (16 MiB bodies, also after decompression).
#[test]
fn bad_input_is_rejected_with_a_json_error_and_stores_nothing() {
    let scratch = Scratch::new("bad-input");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let client = server.client();
    let good = push_request(
        &[("service_name", "good")],
        &marker_profile("good_work", 10_000_000),
    );
    assert_eq!(client.push(&good).status, 200);
    let before = client.snapshot();
    assert_eq!(before.totals.get(CPU_TYPE), Some(&10_000_000));

    let push = "/push.v1.PusherService/Push";
    let merge = "/querier.v1.QuerierService/SelectMergeStacktraces";
    let valid_pprof = prost::Message::encode_to_vec(&marker_profile("bad_work", 1));
    let bad_raw_profile = |raw_profile: Vec<u8>| {
        let mut request = good.clone();
        request.series[0].samples[0].raw_profile = raw_profile;
        prost::Message::encode_to_vec(&request)
    };
    let bad_labels = |labels: &[(&str, &str)]| {
        let mut request = good.clone();
        request.series[0].labels = labels
            .iter()
            .map(|(name, value)| api::LabelPair {
                name: (*name).into(),
                value: (*value).into(),
            })
            .collect();
        prost::Message::encode_to_vec(&request)
    };
    let long_value = "v".repeat(2049);
    let merge_json = |selector: &str| {
        serde_json::json!({"profileTypeID": CPU_TYPE, "labelSelector": selector, "start": "1"})
            .to_string()
            .into_bytes()
    };
    let multipart = |field: &str, content: &[u8]| {
        let mut body = format!(
            "--XyZ\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"p\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n--XyZ--\r\n");
        body
    };
    let cases: Vec<BadRequest> = vec![
        (
            "malformed pprof in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_raw_profile(b"\x0a\xff\xff not a profile".to_vec()),
            400,
        ),
        (
            "pprof without string table",
            push,
            vec![("Content-Type", "application/proto")],
            bad_raw_profile(valid_pprof[..valid_pprof.len() / 2].to_vec()),
            400,
        ),
        (
            "malformed Push message",
            push,
            vec![("Content-Type", "application/proto")],
            b"\xff\xff\xff\xff".to_vec(),
            400,
        ),
        (
            "malformed Push JSON",
            push,
            vec![("Content-Type", "application/json")],
            b"{\"series\": [{\"samples\": 3}]}".to_vec(),
            400,
        ),
        (
            "label name with a brace in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_labels(&[("service_name", "bad"), ("env{x", "prod")]),
            400,
        ),
        (
            "label name with a quote in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_labels(&[("service_name", "bad"), ("a\"b", "prod")]),
            400,
        ),
        (
            "empty label name in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_labels(&[("service_name", "bad"), ("", "prod")]),
            400,
        ),
        (
            "label given twice in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_labels(&[("service_name", "bad"), ("service_name", "other")]),
            400,
        ),
        (
            "profile name with a colon in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_labels(&[("__name__", "process:cpu"), ("service_name", "bad")]),
            400,
        ),
        (
            "label value over 2048 bytes in Push",
            push,
            vec![("Content-Type", "application/proto")],
            bad_labels(&[("service_name", "bad"), ("env", &long_value)]),
            400,
        ),
        (
            "bad label name in Push JSON",
            push,
            vec![("Content-Type", "application/json")],
            serde_json::json!({"series": [{
                "labels": [{"name": "service_name", "value": "bad"}, {"name": "a=b", "value": "x"}],
                "samples": [{"rawProfile": base64::Engine::encode(
                    &base64::engine::general_purpose::STANDARD, gzip(&valid_pprof))}]}]})
            .to_string()
            .into_bytes(),
            400,
        ),
        (
            "wrong content type for Push",
            push,
            vec![("Content-Type", "text/plain")],
            prost::Message::encode_to_vec(&good),
            415,
        ),
        (
            "no content type for a query",
            merge,
            vec![],
            merge_json("{}"),
            415,
        ),
        (
            "unsupported content encoding",
            push,
            vec![
                ("Content-Type", "application/proto"),
                ("Content-Encoding", "br"),
            ],
            prost::Message::encode_to_vec(&good),
            415,
        ),
        (
            "malformed pprof on /ingest",
            "/ingest?name=bad&format=pprof",
            vec![("Content-Type", "application/octet-stream")],
            gzip(b"this is not a profile"),
            400,
        ),
        (
            "multipart without a profile field",
            "/ingest?name=bad",
            vec![("Content-Type", "multipart/form-data; boundary=XyZ")],
            multipart("other", &valid_pprof),
            400,
        ),
        (
            "multipart without a boundary",
            "/ingest?name=bad",
            vec![("Content-Type", "multipart/form-data")],
            multipart("profile", &valid_pprof),
            400,
        ),
        (
            "multipart profile that is not pprof",
            "/ingest?name=bad",
            vec![("Content-Type", "multipart/form-data; boundary=XyZ")],
            multipart("profile", b"\x08\x96\x01garbage"),
            400,
        ),
        (
            "multipart with format=folded",
            "/ingest?name=bad&format=folded",
            vec![("Content-Type", "multipart/form-data; boundary=XyZ")],
            multipart("profile", &valid_pprof),
            415,
        ),
        (
            "unsupported /ingest format",
            "/ingest?name=bad&format=jfr",
            vec![("Content-Type", "application/octet-stream")],
            valid_pprof.clone(),
            415,
        ),
        (
            "malformed folded text",
            "/ingest?name=bad",
            vec![("Content-Type", "text/plain")],
            b"main;work 12\nmain;other many\n".to_vec(),
            400,
        ),
        (
            "bad application name",
            "/ingest?name=bad%7Benv%3Dx&format=pprof",
            vec![("Content-Type", "application/octet-stream")],
            valid_pprof.clone(),
            400,
        ),
        (
            "body over 16 MiB",
            push,
            vec![("Content-Type", "application/proto")],
            vec![0u8; 16 * MIB + 1],
            413,
        ),
        (
            "gzipped body over 16 MiB after decompression",
            push,
            vec![
                ("Content-Type", "application/proto"),
                ("Content-Encoding", "gzip"),
            ],
            gzip_of_zeros(16 * MIB + 1),
            413,
        ),
        (
            "gzipped raw_profile over 16 MiB after decompression",
            push,
            vec![("Content-Type", "application/proto")],
            bad_raw_profile(gzip_of_zeros(17 * MIB)),
            413,
        ),
        (
            "gzipped pprof on /ingest over 16 MiB after decompression",
            "/ingest?name=bad&format=pprof",
            vec![("Content-Type", "application/octet-stream")],
            gzip_of_zeros(17 * MIB),
            413,
        ),
        (
            "folded body over 16 MiB",
            "/ingest?name=bad",
            vec![("Content-Type", "text/plain")],
            b"main;work 1\n".repeat(16 * MIB / 12 + 1),
            413,
        ),
        (
            "bad label selector syntax",
            merge,
            vec![("Content-Type", "application/json")],
            merge_json(r#"{service_name="good""#),
            400,
        ),
        (
            "bad label selector regex",
            merge,
            vec![("Content-Type", "application/json")],
            merge_json(r#"{service_name=~"(unclosed"}"#),
            400,
        ),
        (
            "bad matcher in LabelValues",
            "/querier.v1.QuerierService/LabelValues",
            vec![("Content-Type", "application/json")],
            br#"{"name": "service_name", "matchers": ["service_name=good"]}"#.to_vec(),
            400,
        ),
        (
            "bad profile type",
            merge,
            vec![("Content-Type", "application/json")],
            br#"{"profileTypeID": "cpu", "labelSelector": "{}"}"#.to_vec(),
            400,
        ),
        (
            "unknown querier method",
            "/querier.v1.QuerierService/DropEverything",
            vec![("Content-Type", "application/json")],
            b"{}".to_vec(),
            404,
        ),
        (
            "unknown Connect service",
            "/push.v1.PusherService/Delete",
            vec![("Content-Type", "application/proto")],
            prost::Message::encode_to_vec(&good),
            404,
        ),
    ];
    for (what, path, headers, body, expected) in &cases {
        let response = client.request("POST", path, headers, Some(body));
        assert_eq!(response.status, *expected, "{what}: {}", response.text());
        let (code, message) = response.json_error();
        assert!(!code.is_empty(), "{what}");
        assert!(
            !message.is_empty() && !message.contains('\n'),
            "{what}: not a one-line message: {message:?}"
        );
        assert_eq!(
            response.header("content-type"),
            Some("application/json"),
            "{what}"
        );
    }
    let wrong_method = client.get(push);
    assert_eq!(wrong_method.status, 405);
    wrong_method.json_error();
    assert_eq!(
        client.snapshot(),
        before,
        "a rejected request changed the store"
    );
    // The server is still healthy and accepts good data.
    assert_eq!(client.push(&good).status, 200);
    assert_eq!(
        client.merge(CPU_TYPE, r#"{service_name="good"}"#).total,
        20_000_000
    );
}

#[test]
fn listening_beyond_loopback_needs_a_token_or_explicit_consent() {
    let scratch = Scratch::new("listen");
    let data_dir = scratch.path("data");
    let data = data_dir.to_str().unwrap();
    let err = match ServerProcess::try_start(&["--listen", "0.0.0.0:0", "--data-dir", data]) {
        Ok(server) => panic!("listened on {} without a token", server.addr),
        Err(err) => err,
    };
    assert!(
        err.contains("--auth-token") && err.contains("--insecure-listen"),
        "{err}"
    );
    assert!(!data_dir.exists(), "refused before touching the disk");

    let with_token = ServerProcess::try_start(&[
        "--listen",
        "0.0.0.0:0",
        "--data-dir",
        data,
        "--auth-token",
        "remote-secret",
    ])
    .expect("starts with a token");
    assert!(with_token.addr.ip().is_unspecified());
    let loopback = |server: &ServerProcess| {
        Client::new(std::net::SocketAddr::from((
            [127, 0, 0, 1],
            server.addr.port(),
        )))
    };
    assert_eq!(loopback(&with_token).get("/api/health").status, 401);
    assert_eq!(
        loopback(&with_token)
            .with_token("remote-secret")
            .get("/api/health")
            .status,
        200
    );
    drop(with_token);

    let insecure = ServerProcess::try_start(&[
        "--listen",
        "0.0.0.0:0",
        "--data-dir",
        data,
        "--insecure-listen",
    ])
    .expect("starts with --insecure-listen");
    assert_eq!(loopback(&insecure).get("/api/health").status, 200);
}

/// The bearer token guards every route but /metrics; a browser gets a cookie from `/?token=`.
#[test]
fn token_is_checked_on_every_route_but_metrics() {
    // Characters that need escaping in a URL and are not allowed in a raw cookie value.
    let token = "s3cret+/= ;x";
    let token_in_url = "s3cret%2B%2F%3D%20%3Bx";
    let scratch = Scratch::new("token");
    let server = ServerProcess::start(&scratch.path("data"), &["--auth-token", token]);
    let anonymous = server.client();
    let authorized = server.client().with_token(token);
    let wrong = server.client().with_token("s3cret");
    let profile = push_request(
        &[("service_name", "guarded")],
        &marker_profile("guarded_work", 10_000_000),
    );
    let push_body = prost::Message::encode_to_vec(&profile);
    let pprof_download = format!("/api/pprof?query={CPU_TYPE}{{}}");
    let routes: Vec<Route> = vec![
        ("GET", "/", None),
        ("GET", "/index.html", None),
        ("GET", "/api/health", None),
        ("GET", &pprof_download, None),
        (
            "POST",
            "/push.v1.PusherService/Push",
            Some(("application/proto", push_body.clone())),
        ),
        (
            "POST",
            "/ingest?name=guarded&format=pprof",
            Some((
                "application/octet-stream",
                prost::Message::encode_to_vec(&marker_profile("guarded_work", 10_000_000)),
            )),
        ),
        (
            "POST",
            "/querier.v1.QuerierService/ProfileTypes",
            Some(("application/json", b"{}".to_vec())),
        ),
        (
            "POST",
            "/querier.v1.QuerierService/LabelValues",
            Some(("application/json", br#"{"name":"service_name"}"#.to_vec())),
        ),
        ("GET", "/no/such/page", None),
    ];
    let call =
        |client: &Client, method: &str, path: &str, body: &Option<(&str, Vec<u8>)>| match body {
            Some((content_type, body)) => {
                client.request(method, path, &[("Content-Type", *content_type)], Some(body))
            }
            None => client.request(method, path, &[], None),
        };
    for (method, path, body) in &routes {
        for client in [&anonymous, &wrong] {
            let response = call(client, method, path, body);
            assert_eq!(response.status, 401, "{method} {path}: {}", response.text());
            assert_eq!(response.header("www-authenticate"), Some("Bearer"));
            response.json_error();
        }
        let response = call(&authorized, method, path, body);
        assert_ne!(response.status, 401, "{method} {path}");
    }
    assert_eq!(anonymous.get("/metrics").status, 200);
    // Only the authorized requests stored anything.
    assert_eq!(
        authorized
            .merge(CPU_TYPE, r#"{service_name="guarded"}"#)
            .total,
        20_000_000
    );

    // A browser: a wrong token in the address gets no cookie.
    let rejected = anonymous.get("/?token=s3cret");
    assert_eq!(rejected.status, 401);
    assert_eq!(rejected.header("set-cookie"), None);
    // The right one sets an HttpOnly, SameSite=Strict cookie and redirects to the bare page.
    let login = anonymous.get(&format!("/?token={token_in_url}"));
    assert_eq!(login.status, 303, "{}", login.text());
    assert_eq!(login.header("location"), Some("/"));
    let set_cookie = login.header("set-cookie").expect("a cookie").to_owned();
    let attributes: Vec<&str> = set_cookie.split(';').map(str::trim).collect();
    assert!(attributes.contains(&"HttpOnly"), "{set_cookie}");
    assert!(attributes.contains(&"SameSite=Strict"), "{set_cookie}");
    assert!(attributes.contains(&"Path=/"), "{set_cookie}");
    let cookie = attributes[0];
    assert!(cookie.starts_with("profiler_token="), "{set_cookie}");
    let with_cookie = |path: &str, cookie: &str| {
        let header = format!("theme=dark; {cookie}");
        anonymous
            .request("GET", path, &[("Cookie", header.as_str())], None)
            .status
    };
    assert_eq!(with_cookie("/", cookie), 200);
    assert_eq!(with_cookie("/api/health", cookie), 200);
    let query = anonymous.request(
        "POST",
        "/querier.v1.QuerierService/ProfileTypes",
        &[("Content-Type", "application/json"), ("Cookie", cookie)],
        Some(b"{}"),
    );
    assert_eq!(query.status, 200, "{}", query.text());
    // A cookie with another value is refused.
    let forged = format!("{}00", cookie);
    assert_eq!(with_cookie("/api/health", &forged), 401);
    assert_eq!(with_cookie("/api/health", "profiler_token=s3cret"), 401);
    // The probes are open (a kubelet sends no token) and `profiler server` is ready at once.
    assert_eq!(anonymous.get("/healthz").status, 200);
    assert_eq!(anonymous.get("/readyz").status, 200);
}

/// `--auth-metrics`: /metrics needs the token too; the probes stay open. Without a token the
/// flag is refused, since it would protect nothing.
#[test]
fn auth_metrics_guards_metrics_with_the_token() {
    let scratch = Scratch::new("auth-metrics");
    let data_dir = scratch.path("data");
    let server = ServerProcess::start(&data_dir, &["--auth-token", "m3trics", "--auth-metrics"]);
    let anonymous = server.client();
    let response = anonymous.get("/metrics");
    assert_eq!(response.status, 401, "{}", response.text());
    assert_eq!(response.header("www-authenticate"), Some("Bearer"));
    response.json_error();
    let wrong = server.client().with_token("nope").get("/metrics");
    assert_eq!(wrong.status, 401);
    // Client::metric reads /metrics with the client's token.
    let authorized = server.client().with_token("m3trics");
    assert!(authorized.metric("profiler_http_requests_total").is_some());
    assert_eq!(anonymous.get("/healthz").status, 200);
    assert_eq!(anonymous.get("/readyz").status, 200);
    drop(server);

    let data = data_dir.to_str().unwrap();
    let err = match ServerProcess::try_start(&[
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data,
        "--auth-metrics",
    ]) {
        Ok(server) => panic!(
            "started on {} with --auth-metrics and no token",
            server.addr
        ),
        Err(err) => err,
    };
    assert!(err.contains("--auth-token"), "{err}");
}

/// Static routes serve only files embedded in the binary: no way to the file system.
#[test]
fn no_file_access_through_the_api() {
    let scratch = Scratch::new("traversal");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    assert_eq!(raw_get(server.addr, "/").0, 200);
    assert_eq!(raw_get(server.addr, "/index.html").0, 200);
    for target in [
        "/../Cargo.toml",
        "/../../../../../../etc/passwd",
        "/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/..%2f..%2f..%2fetc%2fpasswd",
        "/static/../../../../etc/passwd",
        "/index.html/../../Cargo.toml",
        "//etc/passwd",
        "/etc/passwd",
        "/proc/self/environ",
        "/api/../../profiles.db",
        "/profiles.db",
        "/ui/index.html",
        "/src/main.rs",
    ] {
        let (status, body) = raw_get(server.addr, target);
        assert_eq!(status, 404, "{target}: {body}");
        assert!(
            !body.contains("root:") && !body.contains("[workspace]"),
            "{target} leaked a file: {body}"
        );
    }
}

/// Opens a socket to `addr` that sends nothing.
fn idle_socket(addr: std::net::SocketAddr) -> std::net::TcpStream {
    let socket = std::net::TcpStream::connect(addr).expect("connect");
    socket
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    socket
}

/// Waits until the server closed `socket` (EOF or reset); returns how long that took.
fn wait_closed(socket: &mut std::net::TcpStream) -> Duration {
    use std::io::Read;
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match socket.read(&mut buf) {
            Ok(0) | Err(_) => return start.elapsed(),
            Ok(_) => {}
        }
    }
}

/// `--max-connections`: idle sockets fill the limit, yet the probes are answered (from the
/// reserve), other requests get a clear 503, later connections are closed and counted, and the
/// header timeout frees every slot the idle sockets held.
#[test]
fn idle_sockets_beyond_the_limit_do_not_stop_the_probes() {
    let scratch = Scratch::new("conn-limit");
    let server = ServerProcess::start(
        &scratch.path("data"),
        &[
            "--max-connections",
            "4",
            "--http-header-timeout",
            "3s",
            "--auth-token",
            "limit-token",
        ],
    );
    let mut idle: Vec<std::net::TcpStream> = (0..4).map(|_| idle_socket(server.addr)).collect();
    // Let the server accept them before the probes come.
    std::thread::sleep(Duration::from_millis(300));
    let client = server.client();
    for probe in ["/healthz", "/readyz"] {
        let response = client.get(probe);
        assert_eq!(response.status, 200, "{probe}: {}", response.text());
    }
    // Anything else over the limit: 503 with a JSON error, before the token is even looked at.
    let busy = client.get("/api/health");
    assert_eq!(busy.status, 503, "{}", busy.text());
    assert_eq!(busy.json_error().0, "unavailable");
    assert!(busy.text().contains("--max-connections"), "{}", busy.text());
    // Fill the probe reserve too: further connections are closed at once.
    idle.extend((0..40).map(|_| idle_socket(server.addr)));
    let mut extra = idle_socket(server.addr);
    let closed_after = wait_closed(&mut extra);
    assert!(
        closed_after < Duration::from_secs(2),
        "a connection beyond the limit and the reserve stayed open {closed_after:?}"
    );
    // The header timeout closes every idle socket, and the server serves normally again.
    for socket in &mut idle {
        let open_for = wait_closed(socket);
        assert!(open_for < Duration::from_secs(10), "{open_for:?}");
    }
    drop(idle);
    let authorized = server.client().with_token("limit-token");
    // (A slot is free a moment after its socket is seen closed.)
    eventually("a free connection slot", Duration::from_secs(5), || {
        (authorized.get("/api/health").status == 200).then_some(())
    });
    let rejected = authorized
        .metric("profiler_http_connections_rejected_total")
        .expect("rejected metric");
    assert!(rejected >= 2.0, "rejected {rejected}");
    let timeouts = authorized
        .metric("profiler_http_header_timeouts_total")
        .expect("header timeouts metric");
    assert!(timeouts >= 4.0, "header timeouts {timeouts}");
    assert!(
        authorized
            .metric("profiler_http_connections_open")
            .is_some_and(|open| open >= 1.0)
    );
}

/// A client that sends its request head a byte now and then is cut off after
/// `--http-header-timeout`, counted from its first byte, though it never stops sending.
#[test]
fn slow_header_connection_is_closed_after_the_timeout() {
    use std::io::Write;
    let scratch = Scratch::new("slow-header");
    let server = ServerProcess::start(&scratch.path("data"), &["--http-header-timeout", "2s"]);
    let mut socket = idle_socket(server.addr);
    let start = Instant::now();
    socket
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut closed = false;
    while start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(250));
        if socket.write_all(b"X-Slow: 1\r\n").is_err() {
            closed = true;
            break;
        }
    }
    let elapsed = start.elapsed();
    assert!(
        closed,
        "the slow client was still connected after {elapsed:?}"
    );
    assert!(
        elapsed >= Duration::from_millis(1500),
        "closed after only {elapsed:?}"
    );
    let client = server.client();
    assert!(
        client
            .metric("profiler_http_header_timeouts_total")
            .unwrap()
            >= 1.0
    );
    // A complete request on a kept-alive connection is not cut off by the header timeout
    // while the connection idles between requests (that is --http-idle-timeout).
    let mut keep = idle_socket(server.addr);
    let request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    keep.write_all(request).unwrap();
    let mut buf = [0u8; 4096];
    let n = std::io::Read::read(&mut keep, &mut buf).unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    std::thread::sleep(Duration::from_secs(3));
    keep.write_all(request).unwrap();
    let n = std::io::Read::read(&mut keep, &mut buf).unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "kept-alive connection closed by the header timeout: {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
}

/// Selectors are bounded: too many matchers (or selectors) get a 400 JSON error and a count.
#[test]
fn selector_with_too_many_matchers_is_refused() {
    let scratch = Scratch::new("matchers");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let client = server.client();
    let selector = |n: usize| {
        let matchers: Vec<String> = (0..n).map(|i| format!("l{i}=\"v\"")).collect();
        format!("{{{}}}", matchers.join(","))
    };
    let call = |body: serde_json::Value, method: &str| {
        client.request(
            "POST",
            &format!("/querier.v1.QuerierService/{method}"),
            &[("Content-Type", "application/json")],
            Some(body.to_string().as_bytes()),
        )
    };
    let ok = call(
        serde_json::json!({"matchers": [selector(64)]}),
        "LabelNames",
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    for (method, body) in [
        (
            "LabelNames",
            serde_json::json!({"matchers": [selector(200_000)]}),
        ),
        ("Series", serde_json::json!({"matchers": [selector(65)]})),
        (
            "LabelValues",
            serde_json::json!({"name": "service_name", "matchers": vec!["{}"; 65]}),
        ),
        (
            "SelectMergeStacktraces",
            serde_json::json!({"profileTypeID": CPU_TYPE, "labelSelector": selector(65),
                               "start": "1", "end": "2"}),
        ),
    ] {
        let started = Instant::now();
        let response = call(body, method);
        assert_eq!(response.status, 400, "{method}: {}", response.text());
        let (code, message) = response.json_error();
        assert_eq!(code, "invalid_argument");
        assert!(
            (message.contains("64") || message.contains("longer than the limit"))
                && !message.contains('\n'),
            "{method}: {message}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{method}");
    }
    assert_eq!(
        client.metric("profiler_http_selectors_rejected_total"),
        Some(4.0)
    );
}

/// The bearer scheme is case-insensitive.
#[test]
fn lower_case_bearer_is_accepted() {
    let scratch = Scratch::new("bearer-case");
    let server = ServerProcess::start(&scratch.path("data"), &["--auth-token", "CaseT0ken"]);
    let client = server.client();
    for scheme in ["bearer", "BEARER", "Bearer", "bEaReR"] {
        let header = format!("{scheme} CaseT0ken");
        let response = client.request("GET", "/api/health", &[("Authorization", &header)], None);
        assert_eq!(response.status, 200, "{scheme}: {}", response.text());
    }
    for wrong in [
        "bearer casetoken",
        "Basic CaseT0ken",
        "bearerCaseT0ken",
        "CaseT0ken",
    ] {
        let response = client.request("GET", "/api/health", &[("Authorization", wrong)], None);
        assert_eq!(response.status, 401, "{wrong}");
    }
}

/// Planted secrets in `--pyroscope-url` and `--auth-token` reach no log line, no stdout, no
/// cookie and no response: the agent runs with both, logs a failed push (to the URL with the
/// password) and sets the UI cookie; a bad URL with a password fails with a redacted error.
#[test]
fn planted_secrets_never_reach_any_output() {
    let _guard = exclusive();
    const URL_SECRET: &str = "Url5ecretPlanted";
    const TOKEN: &str = "T0kenSecretPlanted";
    let scratch = Scratch::new("secrets");
    // A port nobody listens on: pushes fail and are logged with the endpoint.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://profiles-user:{URL_SECRET}@127.0.0.1:{port}/");
    let stdout_path = scratch.path("stdout");
    let stderr_path = scratch.path("stderr");
    let mut command = Command::new(profiler_bin());
    command
        .args([
            "agent",
            "--pyroscope-url",
            &url,
            "--auth-token",
            TOKEN,
            "--store",
            "on",
            "--data-dir",
            scratch.path("data").to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "1",
            "--push-max-backoff",
            "1s",
            "--pid",
            &std::process::id().to_string(),
        ])
        .env("RUST_LOG", "debug")
        .env_remove("PROFILER_AUTH_TOKEN")
        .env_remove("PROFILER_PYROSCOPE_URL")
        .env_remove("PYROSCOPE_URL")
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    let mut child = command.spawn().expect("start the agent");
    let read = |path: &PathBuf| std::fs::read_to_string(path).unwrap_or_default();
    let addr = eventually("the agent's push attempt", Duration::from_secs(60), || {
        let log = read(&stderr_path);
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the agent exited with {status}:\n{log}");
        }
        (log.contains("cannot push to Pyroscope"))
            .then(|| log.lines().find_map(parse_listening_line))
            .flatten()
    });
    let client = Client::new(addr);
    let login = client.get(&format!("/?token={TOKEN}"));
    assert_eq!(login.status, 303, "{}", login.text());
    let set_cookie = login.header("set-cookie").expect("a cookie").to_owned();
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    let page = client.request("GET", "/", &[("Cookie", cookie.as_str())], None);
    assert_eq!(page.status, 200, "the cookie opens the UI");
    let health = client.request("GET", "/api/health", &[("Cookie", cookie.as_str())], None);
    assert_eq!(health.status, 200);
    let metrics = client.get("/metrics").text();
    send_signal(child.id(), SIGTERM);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}:\n{}", read(&stderr_path));
    let (stdout, stderr) = (read(&stdout_path), read(&stderr_path));
    assert!(
        stderr.contains("profiles-user:***@127.0.0.1"),
        "the URL is logged redacted:\n{stderr}"
    );
    let hex = |text: &str| -> String { text.bytes().map(|b| format!("{b:02x}")).collect() };
    let outputs = [
        ("stdout", stdout),
        ("stderr", stderr),
        ("set-cookie", set_cookie),
        ("login response", login.text()),
        ("/api/health", health.text()),
        ("/metrics", metrics),
    ];
    for secret in [URL_SECRET, TOKEN] {
        for encoded in [secret.to_owned(), hex(secret), secret.to_lowercase()] {
            for (name, output) in &outputs {
                assert!(
                    !output.to_lowercase().contains(&encoded.to_lowercase()),
                    "{name} contains the secret {secret} ({encoded}):\n{output}"
                );
            }
        }
    }

    // A malformed URL with a password: exit 2 and a one-line error, redacted.
    for bad in [
        format!("ftp://user:{URL_SECRET}@host"),
        format!("http://user:{URL_SECRET}@host/?q=1"),
    ] {
        let output = Command::new(profiler_bin())
            .args(["agent", "--pyroscope-url", &bad])
            .env_remove("PROFILER_PYROSCOPE_URL")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(output.status.code(), Some(2), "{text}");
        assert!(text.contains("--pyroscope-url"), "{text}");
        assert!(text.contains("user:***@host"), "{text}");
        assert!(!text.contains(URL_SECRET), "{text}");
    }
}

/// Issue 14, store: one overwritten 4 KiB page in the middle of a stopped server's
/// `profiles.db` and the restarted server still answers and accepts pushes; the damaged file is
/// kept aside as `profiles.db.corrupt-<UTC time>`.
#[test]
fn a_corrupt_store_is_moved_aside_and_the_server_keeps_serving() {
    use std::io::{Seek, SeekFrom, Write};
    let scratch = Scratch::new("corrupt-store");
    let data_dir = scratch.path("data");
    {
        let server = ServerProcess::start(&data_dir, &[]);
        let client = server.client();
        for k in 0..40 {
            ingest_folded_at(
                &client,
                "before",
                unix_now_s() - 60 + k,
                &format!("old_{k}"),
                3000,
            );
        }
        let mut server = server;
        let (status, stderr) = server.process.stop();
        assert!(status.success(), "{stderr}");
    }
    let db = data_dir.join("profiles.db");
    let len = std::fs::metadata(&db).unwrap().len();
    assert!(len >= 16 * 4096, "the store is only {len} bytes");
    let mut file = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
    file.seek(SeekFrom::Start(len / 4096 / 2 * 4096)).unwrap();
    file.write_all(&[0x5a; 4096]).unwrap();
    drop(file);

    let mut server = ServerProcess::start(&data_dir, &[]);
    let client = server.client();
    assert_eq!(client.get("/healthz").status, 200);
    let response = client.push(&push_request(
        &[("service_name", "after")],
        &marker_profile("fresh_work", 1_000_000),
    ));
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(
        flamegraph_total_of(
            &client.merge(CPU_TYPE, r#"{service_name="after"}"#),
            "fresh_work"
        ),
        1_000_000
    );
    let kept: Vec<String> = std::fs::read_dir(&data_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("profiles.db.corrupt-"))
        .collect();
    let moved = kept
        .iter()
        .find(|name| !name.ends_with("-wal") && !name.ends_with("-shm"))
        .unwrap_or_else(|| panic!("the corrupt database was not kept: {kept:?}"));
    assert_eq!(std::fs::metadata(data_dir.join(moved)).unwrap().len(), len);
    let (status, stderr) = server.process.stop();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("the database is corrupt") && stderr.contains(moved.as_str()),
        "the event is not logged:\n{stderr}"
    );
}

/// Issue 14, store: values and cardinality. 2^62 values merge to a saturated total (not a
/// wrapped 0), a negative value is a 400, a series with more labels than the limit is a 400 and
/// a push adding more services than the limit is a 429 that stores nothing of the push, while
/// earlier data stays queryable.
#[test]
fn store_limits_and_value_checks_over_http() {
    let scratch = Scratch::new("store-limits");
    let server = ServerProcess::start(&scratch.path("data"), &[]);
    let client = server.client();
    let big = 1i64 << 62;
    for _ in 0..4 {
        let response = client.push(&push_request(
            &[("service_name", "huge")],
            &marker_profile("huge_work", big),
        ));
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let graph = client.merge(CPU_TYPE, r#"{service_name="huge"}"#);
    assert_eq!(flamegraph_total_of(&graph, "huge_work"), i64::MAX);

    let response = client.push(&push_request(
        &[("service_name", "negative")],
        &marker_profile("negative_work", -5),
    ));
    assert_eq!(response.status, 400, "{}", response.text());
    let (code, message) = response.json_error();
    assert_eq!(code, "invalid_argument");
    assert!(message.contains("negative sample value -5"), "{message}");

    // 31 labels of the series' own (the default limit is 30).
    let names: Vec<String> = (0..30).map(|i| format!("label_{i}")).collect();
    let mut labels: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "x")).collect();
    labels.push(("service_name", "wide"));
    let response = client.push(&push_request(&labels, &marker_profile("wide_work", 1)));
    assert_eq!(response.status, 400, "{}", response.text());
    assert!(
        response
            .json_error()
            .1
            .contains("--max-label-names-per-series"),
        "{}",
        response.text()
    );

    // 1,000 services (the default limit) fit, with the one above; one push of 1,000 more is
    // refused as a whole.
    let many = |range: std::ops::Range<usize>| {
        let profile = marker_profile("many_work", 1);
        let mut request = push_request(&[("service_name", "s")], &profile);
        let template = request.series.pop().unwrap();
        for i in range {
            let mut series = template.clone();
            series.labels[1].value = format!("service_{i}");
            request.series.push(series);
        }
        request
    };
    let response = client.push(&many(0..999));
    assert_eq!(response.status, 200, "{}", response.text());
    let response = client.push(&many(999..1999));
    assert_eq!(response.status, 429, "{}", response.text());
    let (code, message) = response.json_error();
    assert_eq!(code, "resource_exhausted");
    assert!(message.contains("--max-services"), "{message}");
    let services = client.label_values("service_name", None);
    assert_eq!(
        services.len(),
        1000,
        "nothing of the refused push is stored"
    );
    // Existing services still take profiles.
    let response = client.push(&push_request(
        &[("service_name", "huge")],
        &marker_profile("huge_work", 1),
    ));
    assert_eq!(response.status, 200, "{}", response.text());
}
