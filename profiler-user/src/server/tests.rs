//! The server over real HTTP on a loopback port, backed by a real store in a temp directory.
use std::io::Write;

use prost::Message;

use super::*;
use crate::{
    export::{pprof::build_pprof, test_fixture},
    store::StoreSettings,
    wire::{api::*, proto},
};

const CPU: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";

struct TestServer {
    server: Server,
    store: Store,
    health: Arc<HealthBoard>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    fn start() -> TestServer {
        Self::with_config(|_| {})
    }

    fn with_config(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(StoreSettings::new(dir.path())).unwrap();
        let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap());
        adjust(&mut config);
        let health = Arc::new(HealthBoard::default());
        let server = Server::start(AppState {
            store: Some(store.clone()),
            health: health.clone(),
            config: Arc::new(config),
        })
        .unwrap();
        TestServer {
            server,
            store,
            health,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.server.local_addr())
    }

    fn post(&self, path: &str, content_type: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let response = ureq2::post(&self.url(path))
            .set("Content-Type", content_type)
            .send_bytes(body);
        read(response)
    }

    fn get(&self, path: &str) -> (u16, Vec<u8>) {
        read(ureq2::get(&self.url(path)).call())
    }

    fn query<Req: prost::Message + serde::Serialize, Resp: prost::Message + Default>(
        &self,
        method: &str,
        request: &Req,
    ) -> Resp {
        let (status, body) = self.post(
            &format!("/querier.v1.QuerierService/{method}"),
            "application/proto",
            &request.encode_to_vec(),
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        Resp::decode(body.as_slice()).unwrap()
    }

    fn query_json(&self, method: &str, request: serde_json::Value) -> serde_json::Value {
        let (status, body) = self.post(
            &format!("/querier.v1.QuerierService/{method}"),
            "application/json",
            request.to_string().as_bytes(),
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }

    fn profile_count(&self) -> u64 {
        self.store.profile_count().unwrap()
    }
}

fn read(response: Result<ureq2::Response, ureq2::Error>) -> (u16, Vec<u8>) {
    let response = match response {
        Ok(response) => response,
        Err(ureq2::Error::Status(_, response)) => response,
        Err(err) => panic!("{err}"),
    };
    let status = response.status();
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut response.into_reader(), &mut body).unwrap();
    (status, body)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

/// The shared export fixture with a current timestamp, as pprof bytes.
fn fixture_pprof() -> Vec<u8> {
    let mut profile = test_fixture::profile();
    profile.start_unix_ns = now_ns();
    build_pprof(&profile).encode_to_vec()
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

fn push_request(service: &str, raw_profile: Vec<u8>) -> PushRequest {
    PushRequest {
        series: vec![RawProfileSeries {
            labels: vec![
                LabelPair {
                    name: "__name__".into(),
                    value: "process_cpu".into(),
                },
                LabelPair {
                    name: "service_name".into(),
                    value: service.into(),
                },
                LabelPair {
                    name: "env".into(),
                    value: "test".into(),
                },
            ],
            samples: vec![RawSample {
                raw_profile,
                id: "id-1".into(),
            }],
        }],
    }
}

fn merge_request(selector: &str) -> SelectMergeStacktracesRequest {
    SelectMergeStacktracesRequest {
        profile_type_id: CPU.into(),
        label_selector: selector.into(),
        start: now_ns() / 1_000_000 - 3_600_000,
        end: now_ns() / 1_000_000 + 60_000,
        max_nodes: None,
        format: 1,
        stack_trace_selector: None,
        ..Default::default()
    }
}

fn assert_json_error(status: u16, body: &[u8], expected_status: u16, needle: &str) {
    assert_eq!(status, expected_status, "{}", String::from_utf8_lossy(body));
    let error: serde_json::Value = serde_json::from_slice(body).expect("a JSON error body");
    let message = error["message"].as_str().unwrap();
    assert!(error["code"].is_string());
    assert!(message.contains(needle), "`{needle}` not in `{message}`");
}

/// Pyroscope's tree bytes as (folded path, self value) pairs, read as its `UnmarshalTree` does.
fn read_tree_bytes(bytes: &[u8]) -> Vec<(String, i64)> {
    let mut at = 0;
    let read_varint = |at: &mut usize| {
        let value = prost::encoding::decode_varint(&mut &bytes[*at..]).expect("a uvarint");
        *at += prost::encoding::encoded_len_varint(value);
        value
    };
    let mut out = Vec::new();
    // (path of the parent) per child still to read.
    let mut parents: Vec<Option<String>> = vec![None];
    while let Some(parent) = parents.pop() {
        let name_len = read_varint(&mut at) as usize;
        let name = String::from_utf8(bytes[at..at + name_len].to_vec()).unwrap();
        at += name_len;
        let self_value = read_varint(&mut at) as i64;
        let children = read_varint(&mut at);
        let path = match (&parent, name.is_empty()) {
            (None, true) => String::new(),
            (Some(p), _) if p.is_empty() => name,
            (Some(p), _) => format!("{p};{name}"),
            (None, false) => panic!("the first node is the nameless root"),
        };
        if self_value > 0 {
            out.push((path.clone(), self_value));
        }
        for _ in 0..children {
            parents.push(Some(path.clone()));
        }
    }
    assert_eq!(at, bytes.len(), "trailing bytes");
    out
}

#[test]
fn push_then_query_in_both_codecs() {
    let server = TestServer::start();
    // Protobuf, gzipped as a whole like pyroscope-rs does.
    let body = gzip(&push_request("api", fixture_pprof()).encode_to_vec());
    let response = ureq2::post(&server.url("/push.v1.PusherService/Push"))
        .set("Content-Type", "application/proto")
        .set("Content-Encoding", "gzip")
        .send_bytes(&body);
    let (status, body) = read(response);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(body.is_empty());
    // JSON with a gzipped raw profile, like the documented example.
    let json = serde_json::json!({"series": [{"labels": [
        {"name": "__name__", "value": "process_cpu"}, {"name": "service_name", "value": "web"}],
        "samples": [{"ID": "x", "rawProfile": base64::Engine::encode(&base64::engine::general_purpose::STANDARD, gzip(&fixture_pprof()))}]}]});
    let (status, body) = server.post(
        "/push.v1.PusherService/Push",
        "application/json",
        json.to_string().as_bytes(),
    );
    assert_eq!((status, body.as_slice()), (200, b"{}".as_slice()));

    let types: ProfileTypesResponse = server.query("ProfileTypes", &ProfileTypesRequest::default());
    assert!(
        types
            .profile_types
            .iter()
            .any(|t| t.id == CPU && t.sample_unit == "nanoseconds"),
        "{types:?}"
    );
    let services: LabelValuesResponse = server.query(
        "LabelValues",
        &LabelValuesRequest {
            name: "service_name".into(),
            ..Default::default()
        },
    );
    assert_eq!(services.names, vec!["api", "web"]);
    let names: LabelNamesResponse = server.query(
        "LabelNames",
        &LabelNamesRequest {
            matchers: vec![r#"{service_name="api"}"#.into()],
            ..Default::default()
        },
    );
    for expected in ["env", "service_name", "thread_name", "__profile_type__"] {
        assert!(
            names.names.contains(&expected.to_owned()),
            "{expected} in {:?}",
            names.names
        );
    }

    let merged: SelectMergeStacktracesResponse = server.query(
        "SelectMergeStacktraces",
        &merge_request(r#"{service_name="api"}"#),
    );
    let graph = merged.flamegraph.unwrap();
    assert_eq!(graph.total, 11 * test_fixture::PERIOD_NS);
    assert_eq!(graph.names[0], "total");
    for function in ["myapp", "main", "outer_fn", "inner_helper", "do_syscall_64"] {
        assert!(
            graph.names.contains(&function.to_owned()),
            "{function} in {:?}",
            graph.names
        );
    }
    // The same in JSON, with 64-bit numbers as strings.
    let json = server.query_json(
        "SelectMergeStacktraces",
        serde_json::json!({"profileTypeID": CPU, "labelSelector": "{service_name=\"web\"}",
            "start": (now_ns() / 1_000_000 - 3_600_000).to_string(), "end": (now_ns() / 1_000_000 + 1000).to_string()}),
    );
    assert_eq!(
        json["flamegraph"]["total"],
        (11 * test_fixture::PERIOD_NS).to_string()
    );
    assert_eq!(
        json["flamegraph"]["levels"][0]["values"][1],
        (11 * test_fixture::PERIOD_NS).to_string()
    );

    let series: SelectSeriesResponse = server.query(
        "SelectSeries",
        &SelectSeriesRequest {
            profile_type_id: CPU.into(),
            label_selector: "{}".into(),
            start: now_ns() / 1_000_000 - 3_600_000,
            end: now_ns() / 1_000_000 + 60_000,
            group_by: vec!["service_name".into()],
            step: 15.0,
            ..Default::default()
        },
    );
    assert_eq!(series.series.len(), 2);
    let api_total: f64 = series.series[0].points.iter().map(|p| p.value).sum();
    assert_eq!(series.series[0].labels[0].value, "api");
    assert_eq!(api_total, (11 * test_fixture::PERIOD_NS) as f64);

    let all_series: SeriesResponse = server.query(
        "Series",
        &SeriesRequest {
            matchers: vec![format!("{{__profile_type__=\"{CPU}\"}}")],
            label_names: vec!["service_name".into(), "__profile_type__".into()],
            ..Default::default()
        },
    );
    assert_eq!(all_series.labels_set.len(), 2, "{all_series:?}");

    let diff: DiffResponse = server.query(
        "Diff",
        &DiffRequest {
            left: Some(merge_request(r#"{service_name="api"}"#)),
            right: Some(merge_request(r#"{service_name="nothing"}"#)),
        },
    );
    let diff = diff.flamegraph.unwrap();
    assert_eq!(
        (diff.left_ticks, diff.right_ticks),
        (11 * test_fixture::PERIOD_NS, 0)
    );

    // format=TREE: Pyroscope's tree bytes, read back as its UnmarshalTree does (a stack of
    // parents; each node pushes itself once per child), with the same totals.
    let mut tree_request = merge_request(r#"{service_name="api"}"#);
    tree_request.format = 2;
    let response: SelectMergeStacktracesResponse =
        server.query("SelectMergeStacktraces", &tree_request);
    assert!(response.flamegraph.is_none());
    let folded = read_tree_bytes(&response.tree);
    let total: i64 = folded.iter().map(|(_, v)| v).sum();
    assert_eq!(total, 11 * test_fixture::PERIOD_NS, "{folded:?}");
    assert!(
        folded.iter().all(|(path, _)| !path.starts_with(';')),
        "{folded:?}"
    );
    let json = server.query_json(
        "SelectMergeStacktraces",
        serde_json::json!({"profileTypeID": CPU, "labelSelector": r#"{service_name="api"}"#,
                           "start": tree_request.start.to_string(), "end": tree_request.end.to_string(),
                           "format": "PROFILE_FORMAT_TREE"}),
    );
    let bytes = base64::Engine::decode(
        &base64::engine::general_purpose::STANDARD,
        json["tree"].as_str().expect("tree bytes in base64"),
    )
    .unwrap();
    assert_eq!(bytes, response.tree);
    // Cut to the largest node: the rest is summed into `other`, the total kept.
    tree_request.max_nodes = Some(1);
    let cut: SelectMergeStacktracesResponse = server.query("SelectMergeStacktraces", &tree_request);
    let cut = read_tree_bytes(&cut.tree);
    assert_eq!(cut.iter().map(|(_, v)| v).sum::<i64>(), total, "{cut:?}");
    assert!(
        cut.iter().any(|(path, _)| path.ends_with("other")),
        "{cut:?}"
    );

    // SelectMergeProfile answers a pprof with the same stacks.
    let request = SelectMergeProfileRequest {
        profile_type_id: CPU.into(),
        label_selector: r#"{service_name="api"}"#.into(),
        start: merge_request("").start,
        end: merge_request("").end,
        max_nodes: None,
        stack_trace_selector: None,
        ..Default::default()
    };
    let (status, body) = server.post(
        "/querier.v1.QuerierService/SelectMergeProfile",
        "application/proto",
        &request.encode_to_vec(),
    );
    assert_eq!(status, 200);
    let pprof = proto::Profile::decode(body.as_slice()).unwrap();
    assert_eq!(
        pprof.sample.iter().map(|s| s.value[0]).sum::<i64>(),
        11 * test_fixture::PERIOD_NS
    );
    // Each sample carries its series' labels: per `thread_name`, the samples add up to that
    // thread's merge; the derived `__*__` labels stay out.
    let label_of = |sample: &proto::Sample, key: &str| {
        sample
            .label
            .iter()
            .find(|l| pprof.string_table[l.key as usize] == key)
            .map(|l| pprof.string_table[l.str as usize].clone())
    };
    for thread in ["worker", "other"] {
        let in_pprof: i64 = pprof
            .sample
            .iter()
            .filter(|s| label_of(s, "thread_name").as_deref() == Some(thread))
            .map(|s| s.value[0])
            .sum();
        let merged: SelectMergeStacktracesResponse = server.query(
            "SelectMergeStacktraces",
            &merge_request(&format!(
                r#"{{service_name="api", thread_name="{thread}"}}"#
            )),
        );
        assert!(in_pprof > 0, "{thread}");
        assert_eq!(in_pprof, merged.flamegraph.unwrap().total, "{thread}");
    }
    assert!(pprof.sample.iter().all(|s| {
        label_of(s, "service_name").as_deref() == Some("api")
            && label_of(s, "env").as_deref() == Some("test")
    }));
    assert!(!pprof.string_table.iter().any(|s| s.starts_with("__")));
    // Over Connect JSON: the same profile in proto3's JSON form (64-bit integers as strings),
    // as Drilldown's pprof export decodes it.
    let (status, body) = server.post(
        "/querier.v1.QuerierService/SelectMergeProfile",
        "application/json",
        serde_json::to_string(&request).unwrap().as_bytes(),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let total: i64 = json["sample"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["value"][0].as_str().unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(total, 11 * test_fixture::PERIOD_NS);
    assert_eq!(
        json["stringTable"].as_array().unwrap().len(),
        pprof.string_table.len()
    );
    let first_location = &json["location"][0];
    assert!(first_location["id"].is_string() && first_location["line"].is_array());
    assert_eq!(json["period"], serde_json::json!(pprof.period.to_string()));

    // AnalyzeQuery: what that query reads (the request Grafana's data source sends, Connect
    // JSON with the query as `<type>{selector}`).
    let analysis = server.query_json(
        "AnalyzeQuery",
        serde_json::json!({
            "start": request.start.to_string(),
            "end": request.end.to_string(),
            "query": format!("{CPU}{{service_name=\"api\"}}"),
        }),
    );
    let scope = &analysis["queryScopes"][0];
    assert_eq!(scope["componentType"], "embedded store", "{analysis}");
    // The pushes above made three series of `api` (different label sets).
    assert_eq!(scope["seriesCount"], "3", "{analysis}");
    assert_eq!(
        analysis["queryImpact"]["totalQueriedSeries"], "3",
        "{analysis}"
    );
    let profiles: u64 = scope["profileCount"].as_str().unwrap().parse().unwrap();
    let bytes: u64 = scope["profileBytes"].as_str().unwrap().parse().unwrap();
    let in_range: u64 = analysis["queryImpact"]["totalBytesInTimeRange"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        profiles >= 1 && bytes > 0 && in_range >= bytes,
        "{analysis}"
    );
    let nothing = server.query_json(
        "AnalyzeQuery",
        serde_json::json!({"start": "1", "end": "2", "query": format!("{CPU}{{}}")}),
    );
    assert_eq!(nothing["queryScopes"][0]["profileCount"], "0", "{nothing}");
    let (status, body) = server.get(&format!(
        "/api/pprof?query={}%7Bservice_name%3D%22api%22%7D",
        CPU
    ));
    assert_eq!(status, 200);
    assert_eq!(&body[..2], &[0x1f, 0x8b]);
}

#[test]
fn legacy_ingest_accepts_pprof_multipart_and_folded() {
    let server = TestServer::start();
    let (status, body) = server.post(
        "/ingest?name=raw%7Benv%3Ddev%7D&format=pprof&spyName=test",
        "binary/octet-stream",
        &gzip(&fixture_pprof()),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    let boundary = "XYZboundary";
    let mut multipart = Vec::new();
    write!(multipart, "--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\nContent-Type: application/octet-stream\r\n\r\n").unwrap();
    multipart.extend(gzip(&fixture_pprof()));
    write!(multipart, "\r\n--{boundary}--\r\n").unwrap();
    let (status, body) = server.post(
        "/ingest?name=multi&from=now-10s&until=now",
        &format!("multipart/form-data; boundary={boundary}"),
        &multipart,
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    let (status, _) = server.post(
        "/ingest?name=folded.cpu&sampleRate=100",
        "text/plain",
        b"main;work 3\nmain;idle 1\n",
    );
    assert_eq!(status, 200);

    let services: LabelValuesResponse = server.query(
        "LabelValues",
        &LabelValuesRequest {
            name: "service_name".into(),
            ..Default::default()
        },
    );
    assert_eq!(services.names, vec!["folded", "multi", "raw"]);
    let spies: LabelValuesResponse = server.query(
        "LabelValues",
        &LabelValuesRequest {
            name: "pyroscope_spy".into(),
            ..Default::default()
        },
    );
    assert_eq!(spies.names, vec!["test"]);
    let folded: SelectMergeStacktracesResponse = server.query(
        "SelectMergeStacktraces",
        &merge_request(r#"{service_name="folded"}"#),
    );
    // 4 samples at 100 Hz.
    assert_eq!(folded.flamegraph.unwrap().total, 40_000_000);
}

#[test]
fn bad_input_gets_a_json_4xx_and_stores_nothing() {
    let server = TestServer::with_config(|c| c.max_body_bytes = 64 << 10);
    let push = "/push.v1.PusherService/Push";
    let cases: Vec<(&str, String, Vec<u8>, u16, &str)> = vec![
        (
            push,
            "application/proto".into(),
            push_request("x", b"not a pprof".to_vec()).encode_to_vec(),
            400,
            "malformed pprof",
        ),
        (
            push,
            "application/proto".into(),
            b"\xff\xff\xff".to_vec(),
            400,
            "malformed protobuf",
        ),
        (
            push,
            "application/json".into(),
            b"{\"series\": 5}".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            push,
            "text/html".into(),
            b"x".to_vec(),
            415,
            "unsupported Content-Type",
        ),
        (
            push,
            "application/proto".into(),
            vec![0u8; 65 << 10],
            413,
            "larger than",
        ),
        (
            "/ingest?name=a%7Bb%7D&format=pprof",
            "binary/octet-stream".into(),
            fixture_pprof(),
            400,
            "invalid application name",
        ),
        (
            "/ingest?format=pprof",
            "binary/octet-stream".into(),
            fixture_pprof(),
            400,
            "missing query parameter `name`",
        ),
        (
            "/ingest?name=a&format=pprof",
            "binary/octet-stream".into(),
            gzip(b"garbage"),
            400,
            "malformed pprof",
        ),
        (
            "/ingest?name=a&format=jfr",
            "binary/octet-stream".into(),
            b"x".to_vec(),
            415,
            "not supported",
        ),
        (
            "/ingest?name=a.weird",
            "text/plain".into(),
            b"a;b 1\n".to_vec(),
            400,
            "unknown profile type",
        ),
        (
            "/ingest?name=a",
            "text/plain".into(),
            b"a;b one\n".to_vec(),
            400,
            "malformed folded",
        ),
        (
            "/querier.v1.QuerierService/SelectMergeStacktraces",
            "application/json".into(),
            serde_json::json!({"profileTypeID": CPU, "labelSelector": "{service_name=}"})
                .to_string()
                .into_bytes(),
            400,
            "invalid label selector",
        ),
        (
            "/querier.v1.QuerierService/SelectMergeStacktraces",
            "application/json".into(),
            serde_json::json!({"profileTypeID": "cpu", "labelSelector": "{}"})
                .to_string()
                .into_bytes(),
            400,
            "invalid profile type",
        ),
        (
            "/querier.v1.QuerierService/NoSuchMethod",
            "application/json".into(),
            b"{}".to_vec(),
            404,
            "unknown method",
        ),
        (
            "/querier.v1.QuerierService/SelectMergeSpanProfile",
            "application/json".into(),
            serde_json::json!({"profileTypeID": CPU, "labelSelector": "{}",
                               "spanSelector": ["9a517183f26a089d", "not-a-span"]})
            .to_string()
            .into_bytes(),
            400,
            "`not-a-span` is not a span id",
        ),
        (
            "/querier.v1.QuerierService/SelectMergeStacktraces",
            "application/json".into(),
            serde_json::json!({"profileTypeID": CPU,
                               "labelSelector": r#"{span_id!="9a517183f26a089d"}"#})
            .to_string()
            .into_bytes(),
            400,
            "span_id can only be selected with = or =~",
        ),
        (
            // Out of scope, and says why (docs/grafana.md).
            "/querier.v1.QuerierService/SelectHeatmap",
            "application/json".into(),
            serde_json::json!({"profileTypeID": CPU, "labelSelector": "{}", "step": 15,
                               "queryType": "HEATMAP_QUERY_TYPE_INDIVIDUAL"})
            .to_string()
            .into_bytes(),
            501,
            "span exemplars",
        ),
        (
            "/no/such/endpoint",
            "application/json".into(),
            b"{}".to_vec(),
            404,
            "no such endpoint",
        ),
    ];
    for (path, content_type, body, status, needle) in cases {
        let (got_status, got_body) = server.post(path, &content_type, &body);
        assert_json_error(got_status, &got_body, status, needle);
    }
    // A gzip bomb: 60 KiB on the wire, 8 MiB inflated.
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(&vec![0u8; 8 << 20]).unwrap();
    let bomb = encoder.finish().unwrap();
    assert!(bomb.len() < 64 << 10);
    let (status, body) = read(
        ureq2::post(&server.url(push))
            .set("Content-Type", "application/proto")
            .set("Content-Encoding", "gzip")
            .send_bytes(&bomb),
    );
    assert_json_error(status, &body, 413, "larger than");
    // One bad sample in a batch rejects the whole batch.
    let mut batch = push_request("good", fixture_pprof());
    batch.series[0].samples.push(RawSample {
        raw_profile: b"bad".to_vec(),
        id: String::new(),
    });
    let (status, body) = server.post(push, "application/proto", &batch.encode_to_vec());
    assert_json_error(status, &body, 400, "malformed pprof");
    // Wrong HTTP method.
    let (status, body) = server.get(push);
    assert_json_error(status, &body, 405, "not allowed");
    assert_eq!(server.profile_count(), 0, "nothing stored");
}

#[test]
fn token_guards_everything_but_metrics() {
    let server = TestServer::with_config(|c| c.auth_token = Some("s3cret".into()));
    let (status, body) = server.get("/api/health");
    assert_json_error(status, &body, 401, "bearer token");
    let (status, _) = server.post("/push.v1.PusherService/Push", "application/proto", &[]);
    assert_eq!(status, 401);
    let wrong = ureq2::get(&server.url("/api/health"))
        .set("Authorization", "Bearer nope")
        .call();
    assert_eq!(read(wrong).0, 401);
    let right = ureq2::get(&server.url("/api/health"))
        .set("Authorization", "Bearer s3cret")
        .call();
    assert_eq!(read(right).0, 200);
    let (status, body) = server.get("/metrics");
    assert_eq!(status, 200);
    assert!(
        String::from_utf8(body)
            .unwrap()
            .contains("profiler_http_requests_total")
    );
    // The probes answer without the token (a kubelet has none).
    assert_eq!(server.get("/healthz").0, 200);
    server.health.set_ready(true);
    assert_eq!(server.get("/readyz").0, 200);
}

/// Sends one HTTP/1.1 request on `stream` and reads its response: (status, headers in lower
/// case, body).
fn exchange(
    stream: &mut std::net::TcpStream,
    target: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    use std::io::{BufRead, Read};
    write!(
        stream,
        "POST {target} HTTP/1.1\r\nHost: test\r\nContent-Length: {}\r\n{headers}\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(body).unwrap();
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    let mut head = String::new();
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "{target}: the connection closed before a response"
        );
        if line == "\r\n" {
            break;
        }
        head.push_str(&line.to_ascii_lowercase());
    }
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    (status, head, body)
}

#[test]
fn a_request_rejected_early_leaves_the_connection_usable() {
    let server = TestServer::start();
    let mut stream = std::net::TcpStream::connect(server.server.local_addr()).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let big = b"main;work 1\n".repeat(50_000);
    let text = "Content-Type: text/plain\r\n";
    // Rejected for its application name, before the handler needs the body.
    let (status, _, body) = exchange(&mut stream, "/ingest?name=%7Bbad", text, &big);
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    // The same kept-alive connection answers the next request.
    let (status, _, body) = exchange(&mut stream, "/ingest?name=good", text, b"main;work 1\n");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(server.profile_count(), 1);

    // A refused token leaves the body unread: the server says it closes the connection. (A
    // small body, which the server has received whole before it answers: a large one could
    // meet a closed socket while still being written.)
    let guarded = TestServer::with_config(|c| c.auth_token = Some("t".into()));
    let mut stream = std::net::TcpStream::connect(guarded.server.local_addr()).unwrap();
    let (status, head, _) = exchange(&mut stream, "/ingest?name=good", text, b"main;work 1\n");
    assert_eq!(status, 401);
    assert!(head.contains("connection: close"), "{head}");
}

#[test]
fn auth_metrics_puts_metrics_behind_the_token() {
    let server = TestServer::with_config(|c| {
        c.auth_token = Some("s3cret".into());
        c.auth_metrics = true;
    });
    let (status, body) = server.get("/metrics");
    assert_json_error(status, &body, 401, "bearer token");
    let right = ureq2::get(&server.url("/metrics"))
        .set("Authorization", "Bearer s3cret")
        .call();
    let (status, body) = read(right);
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains("profiler_http_requests_total"));
    assert_eq!(server.get("/healthz").0, 200, "probes stay open");
}

#[test]
fn readiness_follows_the_agent_and_liveness_does_not() {
    let server = TestServer::start();
    let (status, body) = server.get("/readyz");
    assert_json_error(status, &body, 503, "not ready");
    let (status, body) = server.get("/healthz");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()["status"],
        "alive"
    );
    server.health.set_ready(true);
    let (status, body) = server.get("/readyz");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()["status"],
        "ready"
    );
    server.health.set_ready(false);
    assert_eq!(server.get("/readyz").0, 503);
    // Probe answers are not counted as server errors.
    assert_eq!(server.health.http_errors.load(Ordering::Relaxed), 0);
}

#[test]
fn non_loopback_needs_a_token_or_explicit_consent() {
    let mut config = ServerConfig::new("0.0.0.0:4040".parse().unwrap());
    let err = config.check().unwrap_err().to_string();
    assert!(
        err.contains("--auth-token") && err.contains("--insecure-listen"),
        "{err}"
    );
    config.auth_token = Some("t".into());
    assert!(config.check().is_ok());
    config.auth_token = None;
    config.insecure_listen = true;
    assert!(config.check().is_ok());
    assert!(
        ServerConfig::new("[::1]:4040".parse().unwrap())
            .check()
            .is_ok()
    );
}

#[test]
fn metrics_health_and_ui() {
    let server = TestServer::start();
    let (status, _) = server.post(
        "/push.v1.PusherService/Push",
        "application/proto",
        &push_request("api", fixture_pprof()).encode_to_vec(),
    );
    assert_eq!(status, 200);
    let (status, body) = server.get("/metrics");
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert!(
        text.contains("# TYPE profiler_store_profiles_ingested_total counter"),
        "{text}"
    );
    let ingested = text
        .lines()
        .find(|l| l.starts_with("profiler_store_profiles_ingested_total "))
        .unwrap();
    assert_ne!(ingested, "profiler_store_profiles_ingested_total 0");
    // SQLite's own memory, within its soft limit (the store has its caches by now).
    let sqlite_bytes: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("profiler_store_sqlite_memory_bytes "))
        .expect("the SQLite memory gauge")
        .parse()
        .unwrap();
    assert!(
        sqlite_bytes > 0 && sqlite_bytes <= crate::store::SQLITE_SOFT_HEAP_LIMIT_BYTES as u64,
        "{sqlite_bytes}"
    );
    // The catalog gauges count what the push added: its frames and their nodes.
    let gauge = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("profiler_store_catalog_{name} ")))
            .unwrap_or_else(|| panic!("the catalog gauge {name}"))
            .parse()
            .unwrap()
    };
    let (names, frames, nodes) = (gauge("names"), gauge("frames"), gauge("nodes"));
    assert!(
        names > 0 && frames > 0 && nodes > 0,
        "{names} {frames} {nodes}"
    );

    let (status, body) = server.get("/api/health");
    assert_eq!(status, 200);
    let health: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(health["status"], "ok");
    assert!(health["store"]["profiles_ingested"].as_u64().unwrap() > 0);
    assert!(health["samples"]["dropped"].is_u64());

    let (status, body) = server.get("/");
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains("<html"));
    // Only embedded files: no way to reach the file system.
    for path in [
        "/../Cargo.toml",
        "/%2e%2e/Cargo.toml",
        "/etc/passwd",
        "/ui/index.html/..",
    ] {
        let (status, _) = server.get(path);
        assert_eq!(status, 404, "{path}");
    }
}

#[test]
fn bearer_scheme_is_case_insensitive() {
    assert_eq!(bearer_credentials("Bearer abc"), Some("abc"));
    assert_eq!(bearer_credentials("bearer abc"), Some("abc"));
    assert_eq!(bearer_credentials("BEARER  abc"), Some("abc"));
    assert_eq!(bearer_credentials("Basic abc"), None);
    assert_eq!(bearer_credentials("Bearerabc"), None);
    assert_eq!(bearer_credentials("abc"), None);
}

#[test]
fn session_cookie_is_an_hmac_not_the_token() {
    let token = "s3cret-token";
    let cookie = session::cookie_value(token);
    assert_eq!(cookie.len(), 64, "hex of a SHA-256 HMAC");
    let hex: String = token.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(!cookie.contains(&hex) && !cookie.contains(token));
    assert!(session::verify(token, cookie.as_bytes()));
    assert!(session::verify(token, cookie.to_uppercase().as_bytes()));
    assert!(!session::verify("other", cookie.as_bytes()));
    assert!(!session::verify(token, hex.as_bytes()), "the old cookie");
    assert!(!session::verify(token, &cookie.as_bytes()[..62]));
    assert!(!session::verify(token, b"zz"));
    assert_ne!(session::cookie_value("other"), cookie);

    let server = TestServer::with_config(|c| c.auth_token = Some(token.into()));
    let agent = ureq2::AgentBuilder::new().redirects(0).build();
    let login = read(agent.get(&server.url("/?token=s3cret-token")).call());
    assert_eq!(login.0, 303);
    let with_cookie = |value: &str| {
        read(
            agent
                .get(&server.url("/api/health"))
                .set("Cookie", &format!("{TOKEN_COOKIE}={value}"))
                .call(),
        )
        .0
    };
    assert_eq!(with_cookie(&cookie), 200);
    assert_eq!(with_cookie(&hex), 401);
}

#[test]
fn a_query_past_the_timeout_gets_a_503_and_the_probes_still_answer() {
    let server = TestServer::with_config(|c| c.query_timeout = std::time::Duration::from_secs(1));
    // Every query turn taken, as by heavy queries still running.
    let turns = server
        .health
        .queries
        .clone()
        .try_acquire_many_owned(MAX_CONCURRENT_QUERIES as u32)
        .unwrap();
    let query = std::thread::spawn({
        let url = server.url("/querier.v1.QuerierService/LabelNames");
        move || {
            let started = std::time::Instant::now();
            let response = ureq2::post(&url)
                .set("Content-Type", "application/json")
                .send_bytes(b"{}");
            (read(response), started.elapsed())
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let started = std::time::Instant::now();
    assert_eq!(server.get("/healthz").0, 200);
    assert_eq!(server.get("/metrics").0, 200);
    assert!(started.elapsed() < std::time::Duration::from_millis(900));
    let ((status, body), took) = query.join().unwrap();
    assert_json_error(status, &body, 503, "--query-timeout");
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["code"], "deadline_exceeded");
    assert!(took >= std::time::Duration::from_millis(900), "{took:?}");
    assert_eq!(
        server.health.query_timeouts.load(Ordering::Relaxed),
        1,
        "counted"
    );
    let (_, metrics) = server.get("/metrics");
    let metrics = String::from_utf8(metrics).unwrap();
    assert!(
        metrics.contains("\nprofiler_http_query_timeouts_total 1\n"),
        "{metrics}"
    );
    // With the turns back, queries run again.
    drop(turns);
    let (status, _) = server.post(
        "/querier.v1.QuerierService/LabelNames",
        "application/json",
        b"{}",
    );
    assert_eq!(status, 200);
}

#[test]
fn too_many_matchers_are_a_400_and_counted() {
    let server = TestServer::start();
    let matchers: Vec<String> = (0..65).map(|i| format!("l{i}=\"v\"")).collect();
    let body = serde_json::json!({"matchers": [format!("{{{}}}", matchers.join(","))]});
    let (status, body) = server.post(
        "/querier.v1.QuerierService/Series",
        "application/json",
        body.to_string().as_bytes(),
    );
    assert_json_error(status, &body, 400, "more than 64 matchers");
    assert_eq!(server.health.selectors_rejected.load(Ordering::Relaxed), 1);
}

/// Pyroscope's HTTP render API in flamebearer JSON: `/pyroscope/render` for one selection and
/// `/pyroscope/render-diff` as Grafana's Profiles Drilldown asks for its diff view (its
/// `DiffProfileApiClient`: `leftQuery`, `leftFrom`, `leftUntil`, `rightQuery`, `rightFrom`,
/// `rightUntil` in Unix milliseconds, and `max-nodes`).
#[test]
fn render_and_render_diff_answer_flamebearer_json() {
    let server = TestServer::start();
    for (range, folded) in [
        (
            "from=now-10m&until=now-9m",
            &b"main;work 3\nmain;idle 1\n"[..],
        ),
        (
            "from=now-3m&until=now-2m",
            &b"main;work 1\nmain;idle 3\n"[..],
        ),
    ] {
        let (status, body) = server.post(
            &format!("/ingest?name=folded.cpu&sampleRate=100&{range}"),
            "text/plain",
            folded,
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    let cpu = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
    let query = |text: &str| -> String {
        text.replace('{', "%7B")
            .replace('}', "%7D")
            .replace('"', "%22")
            .replace('=', "%3D")
    };
    let selector = query(&format!(r#"{cpu}{{service_name="folded"}}"#));

    let (status, body) = server.get(&format!(
        "/pyroscope/render?query={selector}&from=now-1h&until=now&format=json"
    ));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let single: serde_json::Value = serde_json::from_slice(&body).unwrap();
    // 8 samples at 100 Hz, in nanoseconds.
    assert_eq!(single["flamebearer"]["numTicks"], 80_000_000, "{single}");
    let names: Vec<&str> = single["flamebearer"]["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    for name in ["main", "work", "idle"] {
        assert!(names.contains(&name), "{names:?}");
    }
    let levels = single["flamebearer"]["levels"].as_array().unwrap();
    assert_eq!(levels[0][1], 80_000_000, "the root level holds the total");
    assert!(levels.iter().all(|l| l.as_array().unwrap().len() % 4 == 0));
    assert_eq!(single["metadata"]["format"], "single");
    assert_eq!(single["metadata"]["units"], "samples");
    let timeline_total: f64 = single["timeline"]["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert_eq!(timeline_total, 80_000_000.0, "{}", single["timeline"]);

    let now_ms = now_ns() / 1_000_000;
    let (status, body) = server.get(&format!(
        "/pyroscope/render-diff?leftQuery={selector}&leftFrom={}&leftUntil={}&rightQuery={selector}&rightFrom={}&rightUntil={now_ms}&max-nodes=16384",
        now_ms - 11 * 60_000,
        now_ms - 8 * 60_000,
        now_ms - 4 * 60_000,
    ));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let diff: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(diff["metadata"]["format"], "double");
    assert_eq!(diff["leftTicks"], 40_000_000, "{diff}");
    assert_eq!(diff["rightTicks"], 40_000_000, "{diff}");
    let names: Vec<&str> = diff["flamebearer"]["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    // `work`: 3 samples on the left, 1 on the right.
    let work = names.iter().position(|n| *n == "work").expect("work") as i64;
    let node = diff["flamebearer"]["levels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|level| {
            level
                .as_array()
                .unwrap()
                .chunks(7)
                .map(|c| c.iter().map(|v| v.as_i64().unwrap()).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        })
        .find(|node| node[6] == work)
        .expect("a work node");
    assert_eq!((node[1], node[4]), (30_000_000, 10_000_000), "{node:?}");

    let (status, body) = server.get(&format!("/pyroscope/render?query={selector}&format=dot"));
    assert_json_error(status, &body, 501, "only json");
    let (status, body) = server.get("/pyroscope/render-diff?leftQuery=process_cpu:cpu:nanoseconds:cpu:nanoseconds&rightQuery=memory:alloc_space:bytes:space:bytes");
    assert_json_error(status, &body, 400, "same profile type");
}

/// `stack_trace_selector.call_site` keeps only the stacks that start with the call site, in
/// SelectMergeStacktraces (protobuf), SelectSeries (JSON) and Diff; a Go PGO selector is refused
/// with 501 rather than answered with the whole profile. Request shapes as Grafana's Pyroscope
/// data source and Profiles Drilldown send them (`types.v1.StackTraceSelector` of
/// grafana/pyroscope api/types/v1/types.proto).
#[test]
fn a_call_site_selects_the_stacks_under_it() {
    use crate::wire::api::{Location, StackTraceSelector};
    let server = TestServer::start();
    let body = push_request("api", fixture_pprof()).encode_to_vec();
    let (status, _) = server.post("/push.v1.PusherService/Push", "application/proto", &body);
    assert_eq!(status, 200);
    let tree_of = |selector: Option<StackTraceSelector>| {
        let mut request = merge_request(r#"{service_name="api"}"#);
        request.format = 2;
        request.stack_trace_selector = selector;
        let response: SelectMergeStacktracesResponse =
            server.query("SelectMergeStacktraces", &request);
        read_tree_bytes(&response.tree)
    };
    let everything = tree_of(None);
    // The call site: the first three frames of the heaviest stack (the fixture has a frame
    // whose name holds a `;`, in another stack).
    let deepest = everything
        .iter()
        .max_by_key(|(_, value)| *value)
        .expect("stacks");
    let site: Vec<&str> = deepest.0.split(';').take(3).collect();
    assert_eq!(site.len(), 3, "{everything:?}");
    let expected: Vec<(String, i64)> = everything
        .iter()
        .filter(|(path, _)| path.split(';').take(3).eq(site.iter().copied()))
        .cloned()
        .collect();
    let expected_total: i64 = expected.iter().map(|(_, value)| value).sum();
    assert!(expected.len() < everything.len(), "{everything:?}");
    let selector = |names: &[&str]| {
        Some(StackTraceSelector {
            call_site: names
                .iter()
                .map(|name| Location {
                    name: name.to_string(),
                })
                .collect(),
            go_pgo: None,
        })
    };

    let mut selected = tree_of(selector(&site));
    selected.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(selected, expected_sorted);
    assert!(tree_of(selector(&[site[1]])).is_empty());
    assert!(tree_of(selector(&[site[0], "no such function"])).is_empty());

    let series = server.query_json(
        "SelectSeries",
        serde_json::json!({
            "profileTypeID": CPU,
            "labelSelector": r#"{service_name="api"}"#,
            "start": merge_request("{}").start.to_string(),
            "end": merge_request("{}").end.to_string(),
            "step": 3600,
            "stackTraceSelector": {"callSite": site.iter().map(|name| serde_json::json!({"name": name})).collect::<Vec<_>>()},
        }),
    );
    let points: f64 = series["series"][0]["points"]
        .as_array()
        .expect("points")
        .iter()
        .map(|point| point["value"].as_f64().unwrap())
        .sum();
    assert_eq!(points, expected_total as f64, "{series}");

    let diff: DiffResponse = server.query(
        "Diff",
        &DiffRequest {
            left: Some(SelectMergeStacktracesRequest {
                stack_trace_selector: selector(&site),
                ..merge_request(r#"{service_name="api"}"#)
            }),
            right: Some(merge_request(r#"{service_name="api"}"#)),
        },
    );
    let diff = diff.flamegraph.unwrap();
    assert_eq!(
        (diff.left_ticks, diff.right_ticks),
        (
            expected_total,
            everything.iter().map(|(_, value)| value).sum()
        )
    );

    let mut pgo = merge_request("{}");
    pgo.stack_trace_selector = Some(StackTraceSelector {
        call_site: Vec::new(),
        go_pgo: Some(crate::wire::api::GoPgo {
            keep_locations: 5,
            aggregate_callees: true,
        }),
    });
    let (status, body) = server.post(
        "/querier.v1.QuerierService/SelectMergeStacktraces",
        "application/proto",
        &pgo.encode_to_vec(),
    );
    assert_json_error(status, &body, 501, "go_pgo");
    // A pprof answers it: every sample keeps at most its 2 leaf-most locations, same total.
    let profile_request = |go_pgo| crate::wire::api::SelectMergeProfileRequest {
        profile_type_id: CPU.into(),
        label_selector: "{}".into(),
        start: now_ns() / 1_000_000 - 3_600_000,
        end: now_ns() / 1_000_000 + 60_000,
        stack_trace_selector: Some(StackTraceSelector {
            call_site: Vec::new(),
            go_pgo,
        }),
        ..Default::default()
    };
    let download = |request: crate::wire::api::SelectMergeProfileRequest| {
        let (status, body) = server.post(
            "/querier.v1.QuerierService/SelectMergeProfile",
            "application/proto",
            &request.encode_to_vec(),
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        proto::Profile::decode(body.as_slice()).unwrap()
    };
    let whole = download(profile_request(None));
    let shaped = download(profile_request(Some(crate::wire::api::GoPgo {
        keep_locations: 2,
        aggregate_callees: true,
    })));
    let total = |p: &proto::Profile| p.sample.iter().map(|s| s.value[0]).sum::<i64>();
    assert_eq!(total(&shaped), total(&whole));
    assert!(whole.sample.iter().any(|s| s.location_id.len() > 2));
    assert!(shaped.sample.iter().all(|s| s.location_id.len() <= 2));
}

/// `settings.v1.SettingsService`, which Profiles Drilldown keeps its preferences in: Set and Get
/// in both codecs, kept in the store (a reopened store has them), an outdated write refused.
#[test]
fn settings_are_set_got_and_kept() {
    use crate::wire::api::{GetSettingsResponse, SetSettingsRequest, SetSettingsResponse, Setting};
    let server = TestServer::start();
    let (status, body) = server.post(
        "/settings.v1.SettingsService/Set",
        "application/json",
        br#"{"setting":{"name":"pluginSettings","value":"{\"maxNodes\":16384}","modifiedAt":"1700000000000"}}"#,
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["setting"]["name"], "pluginSettings");
    let request = SetSettingsRequest {
        setting: Some(Setting {
            name: "theme".into(),
            value: "dark".into(),
            modified_at: 0,
        }),
    };
    let (status, body) = server.post(
        "/settings.v1.SettingsService/Set",
        "application/proto",
        &request.encode_to_vec(),
    );
    assert_eq!(status, 200);
    let stamped = SetSettingsResponse::decode(body.as_slice()).unwrap();
    assert!(
        stamped.setting.unwrap().modified_at > 1_700_000_000_000,
        "stamped now"
    );
    // Older than what is stored: refused, and the stored value stays.
    let (status, body) = server.post(
        "/settings.v1.SettingsService/Set",
        "application/json",
        br#"{"setting":{"name":"pluginSettings","value":"old","modifiedAt":"1600000000000"}}"#,
    );
    assert_json_error(status, &body, 400, "after this change");

    let (status, body) = server.post("/settings.v1.SettingsService/Get", "application/proto", &[]);
    assert_eq!(status, 200);
    let got = GetSettingsResponse::decode(body.as_slice()).unwrap();
    let names: Vec<(&str, &str)> = got
        .settings
        .iter()
        .map(|s| (s.name.as_str(), s.value.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("pluginSettings", r#"{"maxNodes":16384}"#),
            ("theme", "dark")
        ]
    );
    // The store keeps them across a restart.
    let reopened = Store::open(StoreSettings::new(server._dir.path())).unwrap();
    assert_eq!(reopened.user_settings().unwrap().len(), 2);
    let (status, body) = server.post(
        "/settings.v1.SettingsService/Nope",
        "application/json",
        b"{}",
    );
    assert_json_error(status, &body, 404, "Nope");
}
