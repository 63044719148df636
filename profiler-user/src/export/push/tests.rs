//! The pusher against real HTTP: our own Pyroscope-compatible server (with its store), and a
//! scripted responder for the status codes our server does not produce on demand.
use std::{
    collections::VecDeque,
    io::{BufRead, BufReader, Read, Write as _},
    net::TcpListener,
};

use clap::Parser;

use super::*;
use crate::{
    cli::{Cli, Command},
    config::AgentConfig,
    export::test_fixture,
    server::{AppState, HealthBoard, Server, ServerConfig},
    store::{Store, StoreSettings, ingest},
};

fn label<'a>(labels: &'a [LabelPair], name: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|l| l.name == name)
        .map(|l| l.value.as_str())
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

/// Polls `done` for up to a minute (the pusher works on its own thread).
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn requests_carry_the_profile_type_name_and_labels() {
    let mut profile = test_fixture::profile();
    profile.series_labels = vec![
        ("host".into(), "h1".into()),
        ("service_name".into(), "checkout".into()),
        ("__hidden".into(), "x".into()),
    ];
    let extra = [
        ("cluster".to_owned(), "prod".to_owned()),
        ("host".to_owned(), "ignored".to_owned()),
    ];
    let request = push_request(&profile, &extra);
    let series = &request.series[0];
    let names: Vec<&str> = series.labels.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["__name__", "cluster", "host", "service_name"]);
    assert_eq!(label(&series.labels, "__name__"), Some("process_cpu"));
    assert_eq!(
        label(&series.labels, "host"),
        Some("h1"),
        "the profile's own labels win"
    );
    assert_eq!(label(&series.labels, "cluster"), Some("prod"));
    let sample = &series.samples[0];
    assert_eq!(sample.id.len(), 36);
    assert_eq!(&sample.id[14..15], "4", "a version 4 UUID");
    assert!(
        sample.raw_profile.starts_with(&[0x1f, 0x8b]),
        "gzipped pprof"
    );
    let pprof = ingest::decode_pprof(&sample.raw_profile, 1 << 20).unwrap();
    assert_eq!(pprof, build_pprof(&profile));
    // Concatenated requests decode as one request with every series (how batches are built).
    let mut two = request.encode_to_vec();
    two.extend(request.encode_to_vec());
    assert_eq!(PushRequest::decode(&two[..]).unwrap().series.len(), 2);
}

#[test]
fn every_profile_kind_is_named_as_pyroscope_expects() {
    let mut profile = test_fixture::profile();
    let name = |profile: &Profile| {
        let request = push_request(profile, &[]);
        label(&request.series[0].labels, "__name__").map(str::to_owned)
    };
    profile.kind = crate::model::ProfileKind::Cpu;
    assert_eq!(name(&profile).as_deref(), Some("process_cpu"));
    for kind in crate::model::ProfileKind::CUDA {
        profile.kind = kind;
        let pushed = name(&profile).unwrap();
        assert_eq!(pushed, kind.name());
        assert!(!pushed.contains(':') && !pushed.contains('-') && !pushed.is_empty());
        // Every sample type becomes a series whose profile type ID Pyroscope (and our store)
        // accepts: no `-` or `:` in any part, the primary type first.
        let stored =
            ingest::profiles_from_pprof(&build_pprof(&profile), &pushed, &[], now_ns()).unwrap();
        let mut ids: Vec<String> = stored
            .iter()
            .map(|p| p.profile_type.as_ref().unwrap().id())
            .collect();
        ids.dedup();
        let expected: Vec<String> = kind
            .sample_types()
            .iter()
            .map(|(sample_type, unit)| {
                let (period_type, period_unit) = kind.period_type();
                format!("{pushed}:{sample_type}:{unit}:{period_type}:{period_unit}")
            })
            .collect();
        assert_eq!(
            ids,
            expected[..1],
            "the fixture's samples carry the primary value"
        );
        for id in &expected {
            let parsed = crate::store::ProfileType::parse(id).unwrap();
            assert_eq!(&parsed.id(), id);
            assert!(
                id.split(':')
                    .all(|part| !part.is_empty() && !part.contains('-'))
            );
        }
    }
    assert_eq!(
        crate::model::ProfileKind::CudaAlloc.sample_types()[0],
        ("alloc_space", "bytes")
    );
}

#[test]
fn labels_and_flags_are_validated() {
    assert_eq!(
        parse_label(" team = infra ").unwrap(),
        ("team".to_owned(), "infra".to_owned())
    );
    assert_eq!(parse_label("a.b=c=d").unwrap().1, "c=d");
    assert!(parse_label("team").unwrap_err().contains("NAME=VALUE"));
    assert!(
        parse_label("1x=y")
            .unwrap_err()
            .contains("not starting with a digit")
    );
    assert!(parse_label("a-b=y").is_err());
    assert!(parse_label("__name__=y").unwrap_err().contains("reserved"));
    assert!(parse_label("team=").unwrap_err().contains("1 to 2048"));

    let agent = |args: &[&str]| -> Result<AgentConfig, String> {
        let mut argv = vec!["profiler", "agent"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .command
        {
            Command::Agent(args) => Ok((*args).into()),
            _ => unreachable!(),
        }
    };
    // SAFETY: no other test of this binary reads or writes PYROSCOPE_URL.
    unsafe { std::env::remove_var("PYROSCOPE_URL") };
    let without = agent(&[]).unwrap();
    assert!(without.push.is_none());
    assert!(
        without.serve.store.is_some(),
        "the store is the default without a URL"
    );

    let with = agent(&[
        "--pyroscope-url",
        "http://pyro:4040/",
        "--pyroscope-token",
        "secret",
        "--pyroscope-tenant-id",
        "team-a",
        "--pyroscope-label",
        "env=dev",
        "--pyroscope-label",
        "dc=x1",
        "--push-queue-size",
        "1MiB",
        "--push-max-backoff",
        "2m",
        "--spool-dir",
        "/tmp/spool",
    ])
    .unwrap();
    assert!(
        with.serve.store.is_none(),
        "a URL turns the store off by default"
    );
    let push = with.push.unwrap();
    assert_eq!(push.url, "http://pyro:4040");
    assert_eq!(push.auth, PushAuth::Bearer("secret".into()));
    assert!(
        !format!("{push:?}").contains("secret"),
        "secrets stay out of logs"
    );
    assert_eq!(push.tenant_id.as_deref(), Some("team-a"));
    assert_eq!(push.extra_labels.len(), 2);
    assert_eq!(push.queue_bytes, 1 << 20);
    assert_eq!(push.max_backoff, Duration::from_secs(120));
    assert_eq!(push.spool.unwrap().max_bytes, DEFAULT_SPOOL_BYTES);

    let both = agent(&["--pyroscope-url", "http://pyro:4040", "--store", "on"]).unwrap();
    assert!(both.serve.store.is_some() && both.push.is_some());
    let basic = agent(&[
        "--pyroscope-url",
        "https://x.grafana.net",
        "--pyroscope-user",
        "123",
        "--pyroscope-password",
        "pw",
    ])
    .unwrap();
    assert_eq!(
        basic.push.unwrap().auth,
        PushAuth::Basic {
            user: "123".into(),
            password: "pw".into()
        }
    );

    assert!(
        agent(&["--pyroscope-url", "pyro:4040"])
            .unwrap_err()
            .contains("http://")
    );
    assert!(agent(&["--pyroscope-url", "http://p", "--pyroscope-user", "u"]).is_err());
    assert!(
        agent(&["--pyroscope-url", "http://p", "--pyroscope-label", "x"])
            .unwrap_err()
            .contains("NAME=VALUE")
    );
}

#[test]
fn pushes_reach_our_own_receiver_with_labels() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(StoreSettings::new(dir.path())).unwrap();
    let mut server_config = ServerConfig::new("127.0.0.1:0".parse().unwrap());
    server_config.auth_token = Some("t0ken".into());
    let server = Server::start(AppState {
        store: Some(store.clone()),
        health: Arc::new(HealthBoard::default()),
        config: Arc::new(server_config),
    })
    .unwrap();
    let mut config = PushConfig::new(format!("http://{}/", server.local_addr()));
    config.auth = PushAuth::Bearer("t0ken".into());
    config.extra_labels = vec![("cluster".into(), "c1".into())];
    let (pusher, mut sink) = Pusher::start(&config).unwrap();
    let mut profile = test_fixture::profile();
    for (i, service) in ["api", "worker", "api"].into_iter().enumerate() {
        profile.series_labels = vec![("service_name".into(), service.into())];
        profile.start_unix_ns = now_ns() + i as i64;
        sink.write(&profile).unwrap();
    }
    eventually("three profiles sent", || pusher.stats().sent == 3);
    pusher.finish();
    // The receiver stores one profile per sample type and distinct set of sample string labels.
    let per_profile = ingest::profiles_from_pprof(&build_pprof(&profile), "process_cpu", &[], 1)
        .unwrap()
        .len() as u64;
    assert!(per_profile >= 2);
    assert_eq!(store.profile_count().unwrap(), 3 * per_profile);
    let series = store.series(None);
    let services: std::collections::BTreeSet<&str> = series
        .iter()
        .filter_map(|s| s.labels.iter().find(|(k, _)| k == "service_name"))
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(services.into_iter().collect::<Vec<_>>(), ["api", "worker"]);
    assert!(series.iter().all(|s| {
        s.labels.contains(&("cluster".into(), "c1".into()))
            && s.labels
                .contains(&("__name__".into(), "process_cpu".into()))
    }));

    // A wrong token is a 401: dropped and counted, not retried.
    config.auth = PushAuth::Bearer("wrong".into());
    let (pusher, mut sink) = Pusher::start(&config).unwrap();
    sink.write(&profile).unwrap();
    eventually("the rejection", || pusher.stats().failed == 1);
    let m = pusher.stats();
    assert_eq!((m.sent, m.retries, m.queue_bytes), (0, 0, 0));
    pusher.finish();
    assert_eq!(store.profile_count().unwrap(), 3 * per_profile);
}

/// (request head, body) of each request received.
type Recorded = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// Answers each request with the next status of a script (then 200), recording the bodies and
/// headers it got.
struct ScriptedReceiver {
    url: String,
    requests: Recorded,
}

impl ScriptedReceiver {
    fn start(statuses: &[u16]) -> ScriptedReceiver {
        ScriptedReceiver::serve(TcpListener::bind("127.0.0.1:0").unwrap(), statuses)
    }

    fn serve(listener: TcpListener, statuses: &[u16]) -> ScriptedReceiver {
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let mut script: VecDeque<u16> = statuses.iter().copied().collect();
        let seen = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut head = String::new();
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = value.trim().parse().unwrap_or(0);
                    }
                    head.push_str(&line);
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    continue;
                }
                seen.lock().unwrap().push((head, body));
                let status = script.pop_front().unwrap_or(200);
                let message = r#"{"code":"x","message":"scripted"}"#;
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nRetry-After: 0\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{message}",
                    message.len()
                );
            }
        });
        ScriptedReceiver { url, requests }
    }

    fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

#[test]
fn retries_429_5xx_and_drops_other_4xx() {
    let receiver = ScriptedReceiver::start(&[503, 429, 500, 200, 400, 413]);
    let mut config = PushConfig::new(&receiver.url);
    config.max_backoff = Duration::from_millis(50);
    config.tenant_id = Some("tenant-7".into());
    config.auth = PushAuth::Basic {
        user: "u".into(),
        password: "p".into(),
    };
    let (pusher, mut sink) = Pusher::start(&config).unwrap();
    let profile = test_fixture::profile();
    sink.write(&profile).unwrap();
    eventually("the first profile", || pusher.stats().sent == 1);
    sink.write(&profile).unwrap();
    eventually("the second profile's rejection", || {
        pusher.stats().failed == 1
    });
    sink.write(&profile).unwrap();
    eventually("the third profile's rejection", || {
        pusher.stats().failed == 2
    });
    let m = pusher.stats();
    assert_eq!((m.sent, m.retries, m.dropped), (1, 3, 0));
    assert_eq!(receiver.count(), 6);
    pusher.finish();
    let requests = receiver.requests.lock().unwrap();
    let (head, body) = &requests[0];
    let head = head.to_ascii_lowercase();
    assert!(
        head.starts_with("post /push.v1.pusherservice/push "),
        "{head}"
    );
    assert!(head.contains("content-type: application/proto"));
    assert!(head.contains("connect-protocol-version: 1"));
    assert!(head.contains("x-scope-orgid: tenant-7"));
    assert!(head.contains("authorization: basic dtpw"), "base64 of u:p");
    // The retried request is the same request.
    assert_eq!(&requests[3].1, body);
    assert_eq!(PushRequest::decode(&body[..]).unwrap().series.len(), 1);
}

#[test]
fn a_rejected_batch_is_retried_profile_by_profile() {
    // The receiver is down while three profiles queue up, so they go as one batch; the batch is
    // refused, then each profile alone: the second is refused, the others arrive.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let mut config = PushConfig::new(format!("http://127.0.0.1:{port}"));
    config.max_backoff = Duration::from_millis(200);
    let (pusher, mut sink) = Pusher::start(&config).unwrap();
    let profile = test_fixture::profile();
    for _ in 0..3 {
        sink.write(&profile).unwrap();
    }
    eventually("a failed attempt", || pusher.stats().retries > 0);
    let receiver = ScriptedReceiver::serve(
        TcpListener::bind(("127.0.0.1", port)).unwrap(),
        &[400, 200, 422, 200],
    );
    eventually("all three handled", || {
        let m = pusher.stats();
        m.sent + m.failed == 3
    });
    let m = pusher.stats();
    assert_eq!((m.sent, m.failed), (2, 1));
    let requests = receiver.requests.lock().unwrap();
    let series = |i: usize| {
        PushRequest::decode(&requests[i].1[..])
            .unwrap()
            .series
            .len()
    };
    assert_eq!((series(0), series(1), series(2), series(3)), (3, 1, 1, 1));
    pusher.finish();
}

#[test]
fn without_a_spool_the_memory_bound_drops_the_oldest() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let mut config = PushConfig::new(format!("http://127.0.0.1:{port}"));
    let one = push_request(&test_fixture::profile(), &[])
        .encode_to_vec()
        .len() as u64;
    config.queue_bytes = one * 2 + one / 2;
    config.max_backoff = Duration::from_secs(30);
    let (pusher, mut sink) = Pusher::start(&config).unwrap();
    for _ in 0..5 {
        sink.write(&test_fixture::profile()).unwrap();
    }
    let m = pusher.stats();
    // Two fit; the first may be in flight (never dropped), so the bound can hold one more.
    assert!(m.dropped == 3 || m.dropped == 2, "{m:?}");
    assert!(m.queue_bytes <= config.queue_bytes + one);
    pusher.finish();
}
