//! Push to Pyroscope end to end: the real agent (real BPF) profiles a fixture and pushes to a
//! `profiler server` (our Pyroscope-compatible ingest, proven with the real SDKs elsewhere);
//! the receiver is stopped for `PROFILER_TEST_PUSH_OUTAGE_SECS` (default 60) seconds and every
//! interval's profile must still arrive exactly once, also when the agent restarts with a spool
//! during the outage.
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use integration_tests::{
    server_harness::{Client, ServerProcess, unix_now_ms as unix_ms},
    *,
};
use profiler::wire::api::{SelectSeriesRequest, SelectSeriesResponse};

const CPU: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";

fn outage() -> Duration {
    let secs = std::env::var("PROFILER_TEST_PUSH_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `profiler server` on a fixed port and data directory, so it can be restarted.
struct Receiver {
    server: Option<ServerProcess>,
    port: u16,
    data_dir: PathBuf,
    extra: Vec<String>,
}

impl Receiver {
    fn start(port: u16, data_dir: &Path, extra: &[&str]) -> Receiver {
        let mut receiver = Receiver {
            server: None,
            port,
            data_dir: data_dir.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        receiver.restart();
        receiver
    }

    fn restart(&mut self) {
        assert!(self.server.is_none());
        let listen = format!("127.0.0.1:{}", self.port);
        let mut args = vec!["--listen", &listen, "--data-dir"];
        args.push(self.data_dir.to_str().unwrap());
        args.extend(self.extra.iter().map(String::as_str));
        let server = ServerProcess::try_start(&args)
            .unwrap_or_else(|err| panic!("the receiver did not start: {err}"));
        self.server = Some(server);
    }

    fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let (status, stderr) = server.process.stop();
            assert!(
                status.success(),
                "the receiver exited with {status}:\n{stderr}"
            );
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// SelectSeries over Connect/protobuf.
    fn select_series(
        &self,
        token: Option<&str>,
        request: &SelectSeriesRequest,
    ) -> SelectSeriesResponse {
        let mut client = Client::new(self.server.as_ref().expect("the receiver runs").addr);
        if let Some(token) = token {
            client = client.with_token(token);
        }
        client.connect("querier.v1.QuerierService/SelectSeries", request)
    }

    /// Per stored profile of `service` (one point per profile with a 1 ms step): its time in ms
    /// and how many profiles share that millisecond (sum / average of the totals).
    fn profiles_of(
        &self,
        token: Option<&str>,
        service: &str,
        from_ms: i64,
        to_ms: i64,
    ) -> BTreeMap<i64, f64> {
        let mut request = SelectSeriesRequest {
            profile_type_id: CPU.into(),
            label_selector: format!("{{service_name=\"{service}\"}}"),
            start: from_ms,
            end: to_ms,
            step: 0.001,
            ..Default::default()
        };
        let sums = self.select_series(token, &request);
        request.aggregation = Some(1);
        let averages = self.select_series(token, &request);
        let points = |r: &SelectSeriesResponse| -> Vec<(i64, f64)> {
            r.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| (p.timestamp, p.value)))
                .collect()
        };
        let average: BTreeMap<i64, f64> = points(&averages).into_iter().collect();
        points(&sums)
            .into_iter()
            .map(|(t, sum)| (t, sum / average[&t]))
            .collect()
    }

    /// The label sets of `service`'s series.
    fn labels_of(&self, service: &str, group_by: &[&str]) -> Vec<Vec<(String, String)>> {
        let now = unix_ms();
        let request = SelectSeriesRequest {
            profile_type_id: CPU.into(),
            label_selector: format!("{{service_name=\"{service}\"}}"),
            start: now - 3_600_000,
            end: now + 60_000,
            step: 60.0,
            group_by: group_by.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        self.select_series(None, &request)
            .series
            .into_iter()
            .map(|s| s.labels.into_iter().map(|l| (l.name, l.value)).collect())
            .collect()
    }
}

/// The start times (ns) of the profiles of `service` the agent queued for push, from its
/// debug log (`profile queued for push service=... time_ns=...`).
fn queued_profiles(log: &str, service: &str) -> Vec<i64> {
    log.lines()
        .filter(|l| {
            l.contains("profile queued for push") && l.contains(&format!("service=\"{service}\""))
        })
        .map(|l| {
            let field = l.split("time_ns=").nth(1).expect("time_ns field");
            field
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

const PUSH_LOG: (&str, &str) = ("RUST_LOG", "info,profiler::export::push=debug");

fn busy_fixture(service: &str) -> Running {
    let fixture = fp_fixture("fp_chain.c");
    spawn_with_env(&fixture, &["3600"], &[("OTEL_SERVICE_NAME", service)])
}

fn agent_args(url: &str, pid: u32, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--pyroscope-url",
        url,
        "--store",
        "off",
        "--listen",
        "127.0.0.1:0",
        "--interval",
        "2",
        "--push-max-backoff",
        "3s",
        "--pid",
        &pid.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn start_agent(args: &[String]) -> Agent {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Agent::start_with_env(&args, &[PUSH_LOG])
}

/// Waits until `service` has at least `n` profiles in the receiver.
fn wait_for_profiles(
    receiver: &Receiver,
    token: Option<&str>,
    service: &str,
    n: usize,
    since_ms: i64,
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let count = receiver
            .profiles_of(token, service, since_ms, unix_ms() + 60_000)
            .len();
        if count >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {count} of {n} profiles of {service} arrived"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every profile the agent(s) queued arrived exactly once, and nothing else did.
fn assert_exactly_once(receiver: &Receiver, service: &str, queued_ns: &[i64]) {
    let queued_ms: BTreeSet<i64> = queued_ns
        .iter()
        .map(|ns| (ns + 999_999).div_euclid(1_000_000))
        .collect();
    assert_eq!(queued_ms.len(), queued_ns.len(), "distinct profile times");
    let from = queued_ms.first().unwrap() - 1000;
    let to = queued_ms.last().unwrap() + 1000;
    let deadline = Instant::now() + Duration::from_secs(120);
    let stored = loop {
        let stored = receiver.profiles_of(None, service, from, to);
        if stored.len() >= queued_ms.len() || Instant::now() > deadline {
            break stored;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let stored_ms: BTreeSet<i64> = stored.keys().copied().collect();
    let missing: Vec<_> = queued_ms.difference(&stored_ms).collect();
    let unexpected: Vec<_> = stored_ms.difference(&queued_ms).collect();
    assert!(
        missing.is_empty() && unexpected.is_empty(),
        "{} queued, {} stored; missing {missing:?}, unexpected {unexpected:?}",
        queued_ms.len(),
        stored_ms.len()
    );
    let duplicated: Vec<_> = stored.iter().filter(|(_, n)| **n != 1.0).collect();
    assert!(
        duplicated.is_empty(),
        "stored more than once: {duplicated:?}"
    );
}

fn intervals(log: &str) -> usize {
    log.lines()
        .filter(|line| line.contains("self_metrics") && line.contains(" interval "))
        .count()
}

#[test]
fn every_interval_arrives_once_with_labels_across_a_receiver_outage() {
    let _guard = exclusive();
    let service = "push-outage";
    let fixture = busy_fixture(service);
    let scratch = Scratch::new("push-outage");
    let mut receiver = Receiver::start(free_port(), &scratch.path("receiver"), &[]);
    let started_ms = unix_ms();
    let mut agent = start_agent(&agent_args(
        &receiver.url(),
        fixture.pid(),
        &[
            "--pyroscope-label",
            "cluster=ci",
            "--pyroscope-label",
            "host=not-this",
        ],
    ));
    wait_for_profiles(&receiver, None, service, 2, started_ms);

    // The labels: service_name from the process, the agent's own (host wins over the extra
    // label of the same name), the extra ones.
    let labels = receiver.labels_of(service, &["service_name", "cluster", "host", "executable"]);
    assert_eq!(labels.len(), 1, "{labels:?}");
    let value = |name: &str| {
        labels[0]
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(value("cluster").as_deref(), Some("ci"));
    let executable = fp_fixture("fp_chain.c").display().to_string();
    assert_eq!(value("executable"), Some(executable));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(value("host").as_deref(), Some(host.trim()));

    receiver.stop();
    let intervals_before = agent.intervals_flushed();
    std::thread::sleep(outage());
    let during = agent.intervals_flushed() - intervals_before;
    assert!(
        during >= 2,
        "the agent kept sampling during the outage ({during} intervals)"
    );
    receiver.restart();
    let resumed = agent.intervals_flushed();
    agent.wait_for_intervals(resumed + 3, Duration::from_secs(60));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("cannot push to Pyroscope, retrying"), "{log}");
    assert!(log.contains("pushing to Pyroscope works again"), "{log}");

    let queued = queued_profiles(&log, service);
    assert!(queued.len() >= 5, "{log}");
    let flushed = intervals(&log);
    // One profile per interval, plus the partial interval flushed at exit when it had samples.
    assert!(
        queued.len() == flushed || queued.len() == flushed + 1,
        "{} profiles queued for {flushed} intervals",
        queued.len()
    );
    assert_exactly_once(&receiver, service, &queued);
    drop(fixture);
}

#[test]
fn spooled_profiles_survive_an_agent_restart_during_an_outage() {
    let _guard = exclusive();
    let service = "push-spool";
    let fixture = busy_fixture(service);
    let scratch = Scratch::new("push-spool");
    let spool = scratch.path("spool");
    let spool_arg = spool.to_str().unwrap();
    let mut receiver = Receiver::start(free_port(), &scratch.path("receiver"), &[]);
    let args = agent_args(&receiver.url(), fixture.pid(), &["--spool-dir", spool_arg]);
    let started_ms = unix_ms();
    let mut first = start_agent(&args);
    wait_for_profiles(&receiver, None, service, 1, started_ms);

    receiver.stop();
    let outage_started = Instant::now();
    let before = first.intervals_flushed();
    first.wait_for_intervals(before + 3, Duration::from_secs(60));
    let (status, first_log) = first.stop();
    assert!(status.success(), "{first_log}");
    assert!(first_log.contains("stay in the spool"), "{first_log}");
    let spooled = std::fs::read_dir(&spool)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "push")
        })
        .count();
    assert!(spooled >= 3, "{spooled} profiles in the spool");

    let mut second = start_agent(&args);
    let rest = outage().saturating_sub(outage_started.elapsed());
    std::thread::sleep(rest.max(Duration::from_secs(4)));
    receiver.restart();
    let resumed = second.intervals_flushed();
    second.wait_for_intervals(resumed + 3, Duration::from_secs(60));
    let (status, second_log) = second.stop();
    assert!(status.success(), "{second_log}");
    assert!(
        second_log.contains("sending profiles spooled by an earlier run"),
        "{second_log}"
    );

    let mut queued = queued_profiles(&first_log, service);
    queued.extend(queued_profiles(&second_log, service));
    assert!(queued.len() >= intervals(&first_log) + intervals(&second_log));
    assert_exactly_once(&receiver, service, &queued);
    let left: Vec<_> = std::fs::read_dir(&spool)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| !n.to_string_lossy().starts_with('.'))
        .collect();
    assert!(
        left.is_empty(),
        "the spool is empty once everything arrived: {left:?}"
    );
    drop(fixture);
}

/// `PYROSCOPE_URL` from the environment (no flag) turns push on, and `--store on` keeps the
/// embedded store beside it: every interval's profile reaches the receiver and the agent's
/// own store, exactly once each.
#[test]
fn pyroscope_url_from_the_environment_and_the_store_both_get_every_interval() {
    let _guard = exclusive();
    let service = "push-and-store";
    let fixture = busy_fixture(service);
    let scratch = Scratch::new("push-and-store");
    let receiver = Receiver::start(free_port(), &scratch.path("receiver"), &[]);
    let local = scratch.path("local");
    let pid = fixture.pid().to_string();
    let args = [
        "--store",
        "on",
        "--data-dir",
        local.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--interval",
        "2",
        "--pid",
        &pid,
    ];
    let url = receiver.url();
    let started_ms = unix_ms();
    let mut agent = Agent::start_with_env(&args, &[PUSH_LOG, ("PYROSCOPE_URL", &url)]);
    wait_for_profiles(&receiver, None, service, 3, started_ms);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let queued = queued_profiles(&log, service);
    assert!(queued.len() >= 3, "{log}");
    assert_exactly_once(&receiver, service, &queued);
    // The agent's store, read by a server on its directory after the agent stopped.
    let store = Receiver::start(free_port(), &local, &[]);
    assert_exactly_once(&store, service, &queued);
    drop(fixture);
}

/// The request line and headers of each request a proxy forwarded.
type Heads = Arc<Mutex<Vec<String>>>;

/// Forwards HTTP/1.1 requests to `upstream`, recording their headers (one request per
/// connection is enough for this test: the response closes the connection).
fn recording_proxy(upstream: std::net::SocketAddr) -> (String, Heads) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            let _ = reader.read_line(&mut request_line);
            let mut headers = Vec::new();
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let (name, value) = line.trim_end().split_once(':').unwrap_or((&line, ""));
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
                headers.push((name.to_owned(), value.trim().to_owned()));
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            seen.lock().unwrap().push(format!(
                "{}{}",
                request_line,
                headers
                    .iter()
                    .map(|(k, v)| format!("{}: {v}\n", k.to_ascii_lowercase()))
                    .collect::<String>()
            ));
            let path = request_line.split(' ').nth(1).unwrap_or("/").to_owned();
            let forwarded: Vec<(&str, &str)> = headers
                .iter()
                .filter(|(name, _)| {
                    !matches!(
                        name.to_ascii_lowercase().as_str(),
                        "host" | "content-length" | "connection"
                    )
                })
                .map(|(name, value)| (name.as_str(), value.as_str()))
                .collect();
            let Ok(response) =
                Client::new(upstream).try_request("POST", &path, &forwarded, Some(&body))
            else {
                continue;
            };
            let (status, answer) = (response.status, response.body);
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                answer.len()
            );
            let _ = stream.write_all(&answer);
        }
    });
    (url, heads)
}

#[test]
fn bearer_token_and_tenant_reach_the_receiver_and_rejections_are_counted() {
    let _guard = exclusive();
    let service = "push-auth";
    let fixture = busy_fixture(service);
    let scratch = Scratch::new("push-auth");
    let token = "s3cret-token";
    let receiver = Receiver::start(
        free_port(),
        &scratch.path("receiver"),
        &["--auth-token", token],
    );
    let (proxy_url, heads) = recording_proxy(receiver.server.as_ref().unwrap().addr);
    let started_ms = unix_ms();
    let mut agent = start_agent(&agent_args(
        &proxy_url,
        fixture.pid(),
        &[
            "--pyroscope-token",
            token,
            "--pyroscope-tenant-id",
            "team-a",
        ],
    ));
    wait_for_profiles(&receiver, Some(token), service, 2, started_ms);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(!log.contains(token), "the token stays out of the log");
    let heads = heads.lock().unwrap().clone();
    let push = heads
        .iter()
        .find(|h| h.starts_with("POST /push.v1.PusherService/Push "))
        .expect("a push went through the proxy");
    assert!(
        push.contains(&format!("authorization: Bearer {token}\n")),
        "{push}"
    );
    assert!(push.contains("x-scope-orgid: team-a\n"), "{push}");
    assert!(push.contains("content-type: application/proto\n"), "{push}");

    // A wrong token: every profile is refused (401), dropped, counted on /metrics, not retried.
    let mut agent = start_agent(&agent_args(
        &receiver.url(),
        fixture.pid(),
        &["--pyroscope-token", "wrong"],
    ));
    let agent_http = Client::new(agent.http_addr());
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let text = agent_http.get("/metrics").text();
        let failed = text
            .lines()
            .find_map(|l| l.strip_prefix("profiler_push_failed_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if failed >= 1.0 {
            break text;
        }
        assert!(Instant::now() < deadline, "no rejection counted:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        metrics.contains("profiler_push_sent_total 0\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("profiler_push_retries_total 0\n"),
        "{metrics}"
    );
    let (_, log) = agent.stop();
    assert!(
        log.contains("Pyroscope rejected a profile (HTTP 401)"),
        "{log}"
    );
    drop(fixture);
}
