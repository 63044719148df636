//! Fuzzing the ingest parsers without nightly (cargo-fuzz needs it): property tests with a fixed
//! seed over random bytes, random structures and mutations of valid pprof, folded and multipart
//! bodies, thousands of cases each. Whatever the input, the parsers return a value or a one-line
//! error, never panic; what they accept can be stored; over HTTP every answer is a 2xx or a 4xx
//! with a JSON error, and the server keeps answering.
use std::sync::OnceLock;

use base64::Engine;
use integration_tests::{Scratch, proto, server_harness::*};
use profiler::{
    server::serve::{ServeConfig, Serving},
    store::{
        NewProfile, Store, StoreSettings, ingest,
        selector::{Selector, parse_app_name},
    },
};
use proptest::{
    prelude::*,
    test_runner::{Config, RngSeed, TestRunner},
};
use prost::Message;

const LIMIT: usize = 1 << 20;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(0x5eed_cafe),
        failure_persistence: None,
        ..Config::default()
    })
}

fn one_line(error: impl std::fmt::Display) -> Result<(), TestCaseError> {
    let text = error.to_string();
    prop_assert!(
        !text.is_empty() && !text.contains('\n'),
        "not a one-line error: {text:?}"
    );
    Ok(())
}

/// One store shared by the cases of this test binary (cases only add to it).
fn store() -> &'static Store {
    static STORE: OnceLock<(Scratch, Store)> = OnceLock::new();
    &STORE
        .get_or_init(|| {
            let scratch = Scratch::new("ingest-fuzz-store");
            let store = Store::open(StoreSettings::new(scratch.path("data"))).expect("open store");
            (scratch, store)
        })
        .1
}

/// The whole pprof path of the server: decode (gunzip with a limit), validate, split into
/// stored profiles, name, store.
fn check_pprof(bytes: &[u8]) -> Result<(), TestCaseError> {
    let profile = match ingest::decode_pprof(bytes, LIMIT) {
        Ok(profile) => profile,
        Err(err) => return one_line(err),
    };
    check_decoded_pprof(&profile)
}

fn check_decoded_pprof(profile: &proto::Profile) -> Result<(), TestCaseError> {
    if let Err(err) = ingest::validate_pprof(profile) {
        return one_line(err);
    }
    let name = ingest::derive_pprof_name(profile);
    let labels = vec![("service_name".to_owned(), "fuzz".to_owned())];
    match ingest::profiles_from_pprof(profile, &name, &labels, unix_now_ns()) {
        Ok(profiles) => store_them(&profiles),
        Err(err) => one_line(err),
    }
}

fn store_them(profiles: &[NewProfile]) -> Result<(), TestCaseError> {
    match store().ingest(profiles) {
        Ok(()) => Ok(()),
        // A profile type the store refuses is a clean error too.
        Err(err) => one_line(err),
    }
}

/// A valid profile to mutate: a few stacks, sample labels, two sample types.
fn seed_pprof() -> proto::Profile {
    let mut profile = pprof_from_stacks(
        &[
            (vec!["main".into(), "a".into(), "b".into()], 30_000_000),
            (vec!["main".into(), "a".into(), "c".into()], 10_000_000),
            (vec!["main".into(), "d".into()], 20_000_000),
        ],
        unix_now_ns(),
    );
    let key = profile.string_table.len() as i64;
    profile.string_table.push("thread_name".into());
    profile.string_table.push("worker".into());
    profile.string_table.push("samples".into());
    profile.string_table.push("count".into());
    profile.sample_type.insert(
        0,
        proto::ValueType {
            r#type: key + 2,
            unit: key + 3,
        },
    );
    for sample in &mut profile.sample {
        sample.value.insert(0, sample.value[0] / 10_000_000);
        sample.label.push(proto::Label {
            key,
            str: key + 1,
            ..Default::default()
        });
    }
    profile
}

/// A byte-level mutation: (kind, position, byte, length).
fn mutations() -> impl Strategy<Value = Vec<(u8, usize, u8, usize)>> {
    prop::collection::vec((0u8..5, any::<usize>(), any::<u8>(), 0usize..64), 1..8)
}

fn mutate(mut bytes: Vec<u8>, mutations: &[(u8, usize, u8, usize)]) -> Vec<u8> {
    for &(kind, position, byte, length) in mutations {
        let at = if bytes.is_empty() {
            0
        } else {
            position % bytes.len()
        };
        match kind {
            0 if !bytes.is_empty() => bytes[at] ^= 1 << (byte % 8),
            1 if !bytes.is_empty() => bytes[at] = byte,
            2 => bytes.truncate(at),
            3 => {
                let end = (at + length).min(bytes.len());
                bytes.drain(at..end);
            }
            _ => {
                let insert = std::iter::repeat_n(byte, length.max(1));
                bytes.splice(at..at, insert);
            }
        }
    }
    bytes
}

#[test]
fn random_bytes_as_pprof() {
    runner(3000)
        .run(&prop::collection::vec(any::<u8>(), 0..4096), |bytes| {
            check_pprof(&bytes)?;
            // The same behind a gzip header.
            check_pprof(&gzip(&bytes))
        })
        .unwrap();
}

#[test]
fn mutated_valid_pprof() {
    let valid = seed_pprof().encode_to_vec();
    check_pprof(&valid).unwrap();
    let gzipped = gzip(&valid);
    runner(5000)
        .run(&(mutations(), any::<bool>()), |(mutations, compressed)| {
            let base = if compressed { &gzipped } else { &valid };
            check_pprof(&mutate(base.clone(), &mutations))
        })
        .unwrap();
}

/// Profiles that decode but whose indexes, ids and values are arbitrary: ids 0 and dangling,
/// string indexes out of range or negative, value counts that do not match, extreme values.
fn arbitrary_profile() -> impl Strategy<Value = proto::Profile> {
    let index = prop_oneof![0i64..12, any::<i64>()];
    let id = prop_oneof![0u64..8, any::<u64>()];
    let value = prop_oneof![-5i64..100, any::<i64>(), Just(i64::MAX), Just(i64::MIN)];
    let value_type =
        (index.clone(), index.clone()).prop_map(|(r#type, unit)| proto::ValueType { r#type, unit });
    let label = (index.clone(), index.clone(), any::<i64>(), index.clone()).prop_map(
        |(key, str, num, num_unit)| proto::Label {
            key,
            str,
            num,
            num_unit,
        },
    );
    let sample = (
        prop::collection::vec(id.clone(), 0..6),
        prop::collection::vec(value, 0..3),
        prop::collection::vec(label, 0..3),
    )
        .prop_map(|(location_id, value, label)| proto::Sample {
            location_id,
            value,
            label,
        });
    let line = (id.clone(), any::<i64>()).prop_map(|(function_id, line)| proto::Line {
        function_id,
        line,
        column: 0,
    });
    let location = (
        id.clone(),
        id.clone(),
        any::<u64>(),
        prop::collection::vec(line, 0..3),
    )
        .prop_map(|(id, mapping_id, address, line)| proto::Location {
            id,
            mapping_id,
            address,
            line,
            is_folded: false,
        });
    let function = (id.clone(), index.clone(), index.clone(), index.clone()).prop_map(
        |(id, name, system_name, filename)| proto::Function {
            id,
            name,
            system_name,
            filename,
            start_line: 0,
        },
    );
    let mapping =
        (id, index.clone(), index.clone()).prop_map(|(id, filename, build_id)| proto::Mapping {
            id,
            filename,
            build_id,
            ..Default::default()
        });
    let strings = prop::collection::vec(
        prop_oneof![
            Just(String::new()),
            Just("cpu".to_owned()),
            Just("nanoseconds".to_owned()),
            Just("wall".to_owned()),
            Just("a:b".to_owned()),
            "[a-z_:{}=\",]{0,12}",
            any::<String>(),
        ],
        0..12,
    );
    (
        prop::collection::vec(value_type.clone(), 0..3),
        prop::collection::vec(sample, 0..8),
        prop::collection::vec(mapping, 0..3),
        prop::collection::vec(location, 0..8),
        prop::collection::vec(function, 0..8),
        strings,
        prop::option::of(value_type),
        any::<i64>(),
        any::<i64>(),
    )
        .prop_map(
            |(
                sample_type,
                sample,
                mapping,
                location,
                function,
                mut string_table,
                period_type,
                time_nanos,
                duration_nanos,
            )| {
                // Often valid at the start, so the later checks are reached.
                if string_table.first().is_some_and(|s| !s.is_empty()) && time_nanos % 2 == 0 {
                    string_table.insert(0, String::new());
                }
                proto::Profile {
                    sample_type,
                    sample,
                    mapping,
                    location,
                    function,
                    string_table,
                    period_type,
                    time_nanos,
                    duration_nanos,
                    ..Default::default()
                }
            },
        )
}

/// Profiles that pass validation but carry odd content: empty, unicode and colliding function
/// names, extreme and negative values, extra sample types, sample labels, any timestamp.
fn plausible_profile() -> impl Strategy<Value = proto::Profile> {
    let name = prop_oneof![
        "[a-c]{1,2}",
        Just(String::new()),
        Just("[unknown]".to_owned()),
        any::<String>()
    ];
    let value = prop_oneof![-5i64..100, any::<i64>(), Just(i64::MAX), Just(i64::MIN)];
    let stack = (prop::collection::vec(name, 0..6), value.clone());
    let sample_type = prop_oneof![
        Just("samples".to_owned()),
        Just("wall".to_owned()),
        Just("alloc_space".to_owned()),
        "[a-z_]{1,8}"
    ];
    (
        prop::collection::vec(stack, 0..10),
        prop::collection::vec((sample_type, value), 0..2),
        prop::collection::vec(("[a-z_]{1,4}", "[a-z]{0,3}"), 0..3),
        prop_oneof![Just(0i64), any::<i64>(), Just(i64::MAX)],
        any::<i64>(),
    )
        .prop_map(|(stacks, extra_types, labels, time, duration)| {
            let mut profile = pprof_from_stacks(&stacks, time);
            profile.duration_nanos = duration;
            for (sample_type, value) in extra_types {
                profile.string_table.push(sample_type);
                let index = profile.string_table.len() as i64 - 1;
                profile.sample_type.push(proto::ValueType {
                    r#type: index,
                    unit: index,
                });
                for sample in &mut profile.sample {
                    sample.value.push(value);
                }
            }
            for (i, (key, text)) in labels.into_iter().enumerate() {
                profile.string_table.push(key);
                profile.string_table.push(text);
                let key = profile.string_table.len() as i64 - 2;
                if let Some(sample) = profile.sample.get_mut(i) {
                    sample.label.push(proto::Label {
                        key,
                        str: key + 1,
                        ..Default::default()
                    });
                }
            }
            profile
        })
}

#[test]
fn plausible_pprof() {
    runner(4000)
        .run(&plausible_profile(), |profile| {
            check_decoded_pprof(&profile)?;
            check_pprof(&gzip(&profile.encode_to_vec()))
        })
        .unwrap();
}

#[test]
fn structurally_random_pprof() {
    runner(4000)
        .run(&arbitrary_profile(), |profile| {
            check_decoded_pprof(&profile)?;
            check_pprof(&profile.encode_to_vec())
        })
        .unwrap();
}

fn check_folded(
    body: &[u8],
    app: &str,
    sample_rate: u32,
    lines: bool,
) -> Result<(), TestCaseError> {
    let (service, profile_type, factor) = match ingest::text_profile_type(app, sample_rate) {
        Ok(parsed) => parsed,
        Err(err) => return one_line(err),
    };
    match ingest::parse_folded(body, lines, factor) {
        Ok((names, stacks)) => store_them(&[NewProfile {
            profile_type: Some(profile_type),
            labels: vec![("service_name".into(), service)],
            time_ns: unix_now_ns(),
            duration_ns: 10_000_000_000,
            period: factor,
            names,
            frames: Vec::new(),
            stacks,
            spans: Vec::new(),
            labelled: Vec::new(),
        }]),
        Err(err) => one_line(err),
    }
}

#[test]
fn folded_text() {
    let valid = b"main;a;b 3\nmain;a;c 1\r\nmain;d 2\n\nmain 9223372036854775807\n".to_vec();
    let app = prop_oneof![
        Just("fuzz-app".to_owned()),
        Just("fuzz-app.cpu".to_owned()),
        Just("fuzz-app.alloc_space".to_owned()),
        "[a-z.]{1,12}",
    ];
    let body = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        "[a-c;: \\n\\r0-9-]{0,200}".prop_map(String::into_bytes),
        mutations().prop_map(move |m| mutate(valid.clone(), &m)),
    ];
    runner(5000)
        .run(
            &(body, app, any::<u32>(), any::<bool>()),
            |(body, app, rate, lines)| check_folded(&body, &app, rate, lines),
        )
        .unwrap();
}

#[test]
fn selectors_app_names_and_times() {
    let selector_text = prop_oneof![
        r#"[{}a-z_. =!~"',|()*\[\]\\]{0,40}"#,
        any::<String>(),
        (
            r#"[a-z_]{1,8}"#,
            prop_oneof![Just("="), Just("!="), Just("=~"), Just("!~")],
            r#"[a-z().*|\[\]\\+?]{0,12}"#
        )
            .prop_map(|(name, op, value)| format!(r#"{{{name}{op}"{value}"}}"#)),
    ];
    let labels = vec![
        ("service_name".to_owned(), "api".to_owned()),
        ("env".to_owned(), "prod".to_owned()),
    ];
    runner(5000)
        .run(
            &(selector_text, "[a-z{}=,._/ -]{0,30}", any::<String>()),
            |(selector, app, time)| {
                match Selector::parse(&selector) {
                    Ok(parsed) => {
                        parsed.matches(&labels);
                    }
                    Err(err) => one_line(err)?,
                }
                match parse_app_name(&app) {
                    Ok((name, labels)) => {
                        let _ = ingest::validate_labels(&labels);
                        prop_assert!(!name.is_empty());
                    }
                    Err(err) => one_line(err)?,
                }
                let _ = ingest::parse_time(&time, unix_now_ns());
                Ok(())
            },
        )
        .unwrap();
}

/// An in-process server on a free loopback port with its own store.
fn serve() -> (Scratch, Serving, Client) {
    let scratch = Scratch::new("ingest-fuzz-http");
    let mut config = ServeConfig::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.max_body_bytes = LIMIT;
    if let Some(store) = &mut config.store {
        store.data_dir = scratch.path("data");
    }
    let serving = Serving::start(&config).expect("start the server");
    let client = Client::new(serving.local_addr());
    (scratch, serving, client)
}

fn check_http(
    client: &Client,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), TestCaseError> {
    let response = client
        .try_request("POST", path, headers, Some(body))
        .map_err(|err| TestCaseError::fail(format!("{path}: no answer: {err}")))?;
    match response.status {
        200..=299 => Ok(()),
        400..=499 => {
            let error: serde_json::Value =
                serde_json::from_slice(&response.body).map_err(|_| {
                    TestCaseError::fail(format!("{path}: not JSON: {}", response.text()))
                })?;
            prop_assert!(error["code"].is_string(), "{error}");
            one_line(error["message"].as_str().unwrap_or(""))
        }
        status => Err(TestCaseError::fail(format!(
            "{path}: {status} {}",
            response.text()
        ))),
    }
}

fn multipart_body(boundary: &str, profile: &[u8], config: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(profile);
    body.extend_from_slice(
        format!(
            "\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"sample_type_config\"; filename=\"c.json\"\r\n\
             Content-Type: application/json\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(config);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    body
}

#[test]
fn mutated_bodies_over_http() {
    let (_scratch, _serving, client) = serve();
    let pprof = gzip(&seed_pprof().encode_to_vec());
    let config = br#"{"samples":{"units":"samples","display-name":"cpu"}}"#;
    let multipart = multipart_body("XyZ", &pprof, config);
    assert_eq!(
        client
            .request(
                "POST",
                "/ingest?name=fuzz-multipart&format=pprof",
                &[("Content-Type", "multipart/form-data; boundary=XyZ")],
                Some(&multipart),
            )
            .status,
        200
    );
    let push = push_request(&[("service_name", "fuzz-push")], &seed_pprof()).encode_to_vec();
    let push_json = serde_json::json!({
        "series": [{"labels": [{"name": "service_name", "value": "fuzz-json"}],
                    "samples": [{"rawProfile": base64::engine::general_purpose::STANDARD.encode(&pprof)}]}]
    })
    .to_string()
    .into_bytes();
    let content_type = prop_oneof![
        Just("multipart/form-data; boundary=XyZ".to_owned()),
        Just("multipart/form-data; boundary=\"XyZ\"".to_owned()),
        Just("multipart/form-data".to_owned()),
        Just("application/octet-stream".to_owned()),
        "[a-z/;= -]{0,40}",
    ];
    let target = prop_oneof![
        Just("/ingest?name=fuzz-multipart&format=pprof"),
        Just("/ingest?name=fuzz-multipart"),
        Just("/ingest?name=fuzz%7Ba%3Db%7D&format=pprof&from=now-1h&until=now"),
    ];
    let folded = b"main;a;b 3\nmain;a;c 1\r\nmain;d 2\n\nmain 9223372036854775807\n".to_vec();
    assert_eq!(
        client
            .request(
                "POST",
                "/ingest?name=fuzz-folded.cpu&format=folded",
                &[("Content-Type", "text/plain")],
                Some(&folded),
            )
            .status,
        200
    );
    // Folded uploads: the body, the application name (with its type suffix and labels), the
    // format and the sample rate all fuzzed; names are percent-encoded as clients must.
    let folded_body = prop_oneof![
        mutations().prop_map(move |m| mutate(folded.clone(), &m)),
        "[a-c;: \\n\\r0-9-]{0,200}".prop_map(String::into_bytes),
    ];
    let folded_query = (
        r#"[a-z.{}=,_ "-]{0,24}"#,
        prop_oneof![Just(""), Just("&format=folded"), Just("&format=lines")],
        prop_oneof![
            Just(String::new()),
            any::<i64>().prop_map(|r| format!("&sampleRate={r}"))
        ],
    )
        .prop_map(|(app, format, rate)| {
            let app: String = app
                .bytes()
                .map(|b| match b {
                    b'a'..=b'z' | b'.' | b'_' | b'-' => (b as char).to_string(),
                    other => format!("%{other:02X}"),
                })
                .collect();
            format!("/ingest?name={app}{format}{rate}")
        });
    // A quarter of the cases on each body kind: multipart, Connect proto, Connect JSON, folded.
    let cases = (
        0u8..4,
        mutations(),
        content_type,
        target,
        folded_body,
        folded_query,
    );
    runner(4000)
        .run(
            &cases,
            |(kind, mutations, content_type, target, folded_body, folded_query)| match kind {
                0 => check_http(
                    &client,
                    target,
                    &[("Content-Type", content_type.as_str())],
                    &mutate(multipart.clone(), &mutations),
                ),
                1 => check_http(
                    &client,
                    "/push.v1.PusherService/Push",
                    &[("Content-Type", "application/proto")],
                    &mutate(push.clone(), &mutations),
                ),
                2 => check_http(
                    &client,
                    "/push.v1.PusherService/Push",
                    &[("Content-Type", "application/json")],
                    &mutate(push_json.clone(), &mutations),
                ),
                _ => check_http(
                    &client,
                    &folded_query,
                    &[("Content-Type", "text/plain")],
                    &folded_body,
                ),
            },
        )
        .unwrap();
    // Still serving, and what was accepted is queryable.
    assert_eq!(client.get("/api/health").status, 200);
    let services = client.label_values("service_name", None);
    for service in ["fuzz-multipart", "fuzz-folded"] {
        assert!(services.contains(&service.to_owned()), "{services:?}");
    }
    // The seed upload's stacks (its values saturate: one count is i64::MAX).
    let folded_names = flamegraph_names(&client.merge(CPU_TYPE, r#"{service_name="fuzz-folded"}"#));
    for name in ["main", "a", "b", "c", "d"] {
        assert!(folded_names.contains(&name.to_owned()), "{folded_names:?}");
    }
}

/// Queries over stored fuzzed data (extreme, negative and overflowing values, odd times and
/// names) and fuzzed query parameters: every Connect query method answers 200 or a JSON 4xx.
#[test]
fn queries_over_fuzzed_data() {
    let (_scratch, serving, client) = serve();
    let store = serving.store.clone().expect("store on");
    let stored = std::sync::atomic::AtomicUsize::new(0);
    runner(1500)
        .run(&plausible_profile(), |profile| {
            if ingest::validate_pprof(&profile).is_ok() {
                let name = ingest::derive_pprof_name(&profile);
                let labels = vec![("service_name".to_owned(), "fuzz".to_owned())];
                if let Ok(profiles) = ingest::profiles_from_pprof(&profile, &name, &labels, 1)
                    && store.ingest(&profiles).is_ok()
                {
                    stored.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Ok(())
        })
        .unwrap();
    let stored = stored.into_inner();
    assert!(
        stored > 100,
        "only {stored} fuzzed profiles were valid enough to store"
    );
    let mut types = client.profile_types();
    types.push(CPU_TYPE.to_owned());
    let time = prop_oneof![
        Just(0i64),
        Just(1i64),
        any::<i64>(),
        Just(i64::MAX),
        Just(i64::MIN)
    ];
    let cases = (
        prop::sample::select(types),
        prop_oneof![
            Just("{}".to_owned()),
            Just(r#"{service_name="fuzz"}"#.to_owned()),
            r#"\{[a-z_]{1,6}=~"[a-z.*]{0,4}"\}"#
        ],
        time.clone(),
        time,
        prop_oneof![Just(None), (any::<i64>()).prop_map(Some)],
        prop_oneof![Just(15.0f64), any::<f64>()],
        0u8..5,
    );
    runner(1500)
        .run(&cases, |(profile_type, selector, start, end, max_nodes, step, method)| {
            let merge = serde_json::json!({
                "profileTypeID": profile_type, "labelSelector": selector,
                "start": start.to_string(), "end": end.to_string(),
                "maxNodes": max_nodes.map(|n| n.to_string()),
            });
            let (path, body) = match method {
                0 => ("SelectMergeStacktraces", merge),
                1 => ("Diff", serde_json::json!({"left": merge, "right": merge})),
                2 => (
                    "SelectSeries",
                    serde_json::json!({
                        "profileTypeID": profile_type, "labelSelector": selector,
                        "start": start.to_string(), "end": end.to_string(),
                        "step": if step.is_finite() { serde_json::json!(step) } else { serde_json::json!(15) },
                        "groupBy": ["service_name"],
                    }),
                ),
                3 => {
                    let request = api::SelectMergeProfileRequest {
                        profile_type_id: profile_type.clone(),
                        label_selector: selector.clone(),
                        start,
                        end,
                        max_nodes,
                        stack_trace_selector: None,
                        ..Default::default()
                    };
                    return check_http(
                        &client,
                        "/querier.v1.QuerierService/SelectMergeProfile",
                        &[("Content-Type", "application/proto")],
                        &request.encode_to_vec(),
                    );
                }
                _ => ("LabelValues", serde_json::json!({"name": "service_name", "matchers": [selector],
                                                       "start": start.to_string(), "end": end.to_string()})),
            };
            check_http(
                &client,
                &format!("/querier.v1.QuerierService/{path}"),
                &[("Content-Type", "application/json")],
                body.to_string().as_bytes(),
            )
        })
        .unwrap();
    assert_eq!(client.get("/api/health").status, 200);
}
