//! Harness for the server tests and the `store` benchmark: a real `profiler server` process
//! found by the address it logs, a small blocking HTTP client for the ingest and Connect query
//! API, and synthetic pprof profiles.
use std::{
    collections::BTreeMap,
    io::{BufRead, Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

pub use profiler::wire::api;
use prost::Message;

use crate::{SIGTERM, profiler_bin, proto, send_signal};

/// The profile type the agent and the synthetic profiles use.
pub const CPU_TYPE: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";

/// Environment variables of the server flags, removed so a developer's settings cannot change
/// what a test starts.
pub const SERVER_ENV: &[&str] = &[
    "PROFILER_LISTEN",
    "PROFILER_STORE",
    "PROFILER_DATA_DIR",
    "PROFILER_RETENTION",
    "PROFILER_MAX_STORE_SIZE",
    "PROFILER_AUTH_TOKEN",
    "PROFILER_INSECURE_LISTEN",
    "PROFILER_MAX_BODY_SIZE",
    "PROFILER_MAINTENANCE_INTERVAL",
    "PROFILER_AUTH_METRICS",
];

pub fn unix_now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

pub fn unix_now_ms() -> i64 {
    unix_now_ns() / 1_000_000
}

/// The address in a `listening on ADDR` log line.
pub fn parse_listening_line(line: &str) -> Option<SocketAddr> {
    let rest = &line[line.find("listening on ")? + "listening on ".len()..];
    let addr = rest.split(|c: char| c == ',' || c.is_whitespace()).next()?;
    addr.parse().ok()
}

/// A child process whose stderr is collected in the background.
pub struct LoggedChild {
    child: Option<Child>,
    stderr: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl LoggedChild {
    pub fn spawn(mut command: Command) -> LoggedChild {
        let mut child = command
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {command:?}: {err}"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let pipe = child.stderr.take().expect("stderr is piped");
        let collected = Arc::clone(&stderr);
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                let mut text = collected.lock().unwrap_or_else(|p| p.into_inner());
                text.push_str(&line);
                text.push('\n');
            }
        });
        LoggedChild {
            child: Some(child),
            stderr,
            reader: Some(reader),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("child still running").id()
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether the process has exited (reaped).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits until the stderr has a line for which `find` returns something, or the process
    /// exits or `timeout` passes (then Err with the stderr so far).
    pub fn wait_for_line<T>(
        &mut self,
        timeout: Duration,
        find: impl Fn(&str) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = self.stderr().lines().find_map(&find) {
                return Ok(found);
            }
            if let Some(status) = self.exited() {
                // Let the reader drain what the process wrote before it exited.
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                if let Some(found) = self.stderr().lines().find_map(&find) {
                    return Ok(found);
                }
                return Err(format!("exited with {status}:\n{}", self.stderr()));
            }
            if Instant::now() > deadline {
                return Err(format!("timed out after {timeout:?}:\n{}", self.stderr()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no chance to flush or close anything.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }

    /// SIGTERM and wait; returns the exit status and stderr.
    pub fn stop(&mut self) -> (ExitStatus, String) {
        self.stop_with(SIGTERM)
    }

    /// Sends `signal` and waits; returns the exit status and stderr.
    pub fn stop_with(&mut self, signal: i32) -> (ExitStatus, String) {
        send_signal(self.pid(), signal);
        self.wait()
    }

    /// Waits for the process to exit; returns the exit status and its whole stderr.
    pub fn wait(&mut self) -> (ExitStatus, String) {
        let mut child = self.child.take().expect("child still running");
        let status = child.wait().expect("wait for the child");
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        (status, self.stderr())
    }
}

impl Drop for LoggedChild {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A running `profiler server`.
pub struct ServerProcess {
    pub process: LoggedChild,
    pub addr: SocketAddr,
}

impl ServerProcess {
    /// `profiler server --listen 127.0.0.1:0 --data-dir DATA_DIR EXTRA`, once it listens.
    pub fn start(data_dir: &Path, extra: &[&str]) -> ServerProcess {
        Self::start_with(&profiler_bin(), data_dir, extra)
    }

    /// Like [`ServerProcess::start`] with another `profiler` binary (the benchmark's release one).
    pub fn start_with(binary: &Path, data_dir: &Path, extra: &[&str]) -> ServerProcess {
        let mut args = vec!["--listen", "127.0.0.1:0", "--data-dir"];
        let data_dir = data_dir.to_str().expect("UTF-8 data dir");
        args.push(data_dir);
        args.extend_from_slice(extra);
        Self::try_start_with(binary, &args)
            .unwrap_or_else(|err| panic!("profiler server did not start: {err}"))
    }

    /// `profiler server ARGS` exactly; Err with its stderr if it exits before listening.
    pub fn try_start(args: &[&str]) -> Result<ServerProcess, String> {
        Self::try_start_with(&profiler_bin(), args)
    }

    pub fn try_start_with(binary: &Path, args: &[&str]) -> Result<ServerProcess, String> {
        Self::try_start_subcommand(binary, "server", args)
    }

    /// `BINARY SUBCOMMAND ARGS` (`server`, or `agent` with its HTTP server) once it listens;
    /// Err with its stderr if it exits before.
    pub fn try_start_subcommand(
        binary: &Path,
        subcommand: &str,
        args: &[&str],
    ) -> Result<ServerProcess, String> {
        let mut command = Command::new(binary);
        command.arg(subcommand).args(args).env("RUST_LOG", "info");
        for var in SERVER_ENV {
            command.env_remove(var);
        }
        let mut process = LoggedChild::spawn(command);
        let addr = process.wait_for_line(Duration::from_secs(30), parse_listening_line)?;
        Ok(ServerProcess { process, addr })
    }

    pub fn client(&self) -> Client {
        Client::new(self.addr)
    }
}

/// An HTTP response, whatever its status.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as Connect's JSON error (`{"code", "message"}`); panics otherwise.
    pub fn json_error(&self) -> (String, String) {
        let value: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!(
                "status {}: body is not a JSON error ({err}): {}",
                self.status,
                self.text()
            )
        });
        let field = |name: &str| {
            value[name]
                .as_str()
                .unwrap_or_else(|| panic!("JSON error without `{name}`: {value}"))
                .to_owned()
        };
        (field("code"), field("message"))
    }
}

/// A blocking HTTP client for one server; redirects are not followed.
#[derive(Clone)]
pub struct Client {
    pub addr: SocketAddr,
    pub token: Option<String>,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client {
            addr,
            token: None,
            agent: ureq::AgentBuilder::new()
                .redirects(0)
                .timeout(Duration::from_secs(120))
                .build(),
        }
    }

    pub fn with_token(mut self, token: &str) -> Client {
        self.token = Some(token.to_owned());
        self
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Any request; transport errors panic, HTTP errors are returned.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> HttpResponse {
        self.try_request(method, path, headers, body)
            .unwrap_or_else(|err| panic!("{method} {path}: {err}"))
    }

    /// Like [`Client::request`], with transport errors (connection refused or reset) as Err.
    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<HttpResponse, String> {
        let mut request = self.agent.request(method, &self.url(path));
        if let Some(token) = &self.token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        for (name, value) in headers {
            request = request.set(name, value);
        }
        let result = match body {
            Some(body) => request.send_bytes(body),
            None => request.call(),
        };
        let response = match result {
            Ok(response) => response,
            Err(ureq::Error::Status(_, response)) => response,
            Err(err) => return Err(err.to_string()),
        };
        let status = response.status();
        let headers = response
            .headers_names()
            .into_iter()
            .filter_map(|name| {
                let value = response.header(&name)?.to_owned();
                Some((name, value))
            })
            .collect();
        let mut body = Vec::new();
        response
            .into_reader()
            .take(1 << 30)
            .read_to_end(&mut body)
            .map_err(|err| err.to_string())?;
        Ok(HttpResponse {
            status,
            headers,
            body,
        })
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        self.request("GET", path, &[], None)
    }

    pub fn post(&self, path: &str, content_type: &str, body: &[u8]) -> HttpResponse {
        self.request("POST", path, &[("Content-Type", content_type)], Some(body))
    }

    /// A Connect unary call with the protobuf codec; panics unless 200.
    pub fn connect<Req: Message, Resp: Message + Default>(
        &self,
        service_method: &str,
        request: &Req,
    ) -> Resp {
        let response = self.post(
            &format!("/{service_method}"),
            "application/proto",
            &request.encode_to_vec(),
        );
        assert_eq!(
            response.status,
            200,
            "{service_method}: {}",
            response.text()
        );
        Resp::decode(response.body.as_slice())
            .unwrap_or_else(|err| panic!("{service_method}: undecodable response: {err}"))
    }

    /// A Connect unary call with the JSON codec; panics unless 200.
    pub fn connect_json(
        &self,
        service_method: &str,
        request: serde_json::Value,
    ) -> serde_json::Value {
        let response = self.post(
            &format!("/{service_method}"),
            "application/json",
            request.to_string().as_bytes(),
        );
        assert_eq!(
            response.status,
            200,
            "{service_method}: {}",
            response.text()
        );
        serde_json::from_slice(&response.body)
            .unwrap_or_else(|err| panic!("{service_method}: response is not JSON: {err}"))
    }

    pub fn push(&self, request: &api::PushRequest) -> HttpResponse {
        self.post(
            "/push.v1.PusherService/Push",
            "application/proto",
            &request.encode_to_vec(),
        )
    }

    pub fn profile_types(&self) -> Vec<String> {
        let response: api::ProfileTypesResponse = self.connect(
            "querier.v1.QuerierService/ProfileTypes",
            &api::ProfileTypesRequest::default(),
        );
        response.profile_types.into_iter().map(|t| t.id).collect()
    }

    /// Values of label `name` over all stored time, optionally only in series matching `matcher`.
    pub fn label_values(&self, name: &str, matcher: Option<&str>) -> Vec<String> {
        let response: api::LabelValuesResponse = self.connect(
            "querier.v1.QuerierService/LabelValues",
            &api::LabelValuesRequest {
                name: name.into(),
                matchers: matcher.map(str::to_owned).into_iter().collect(),
                start: 1,
                end: unix_now_ms() + 3_600_000,
            },
        );
        response.names
    }

    /// The merged flame graph of `profile_type` and `selector` from `start_ms` to `end_ms`.
    pub fn merge_range(
        &self,
        profile_type: &str,
        selector: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> api::FlameGraph {
        let response: api::SelectMergeStacktracesResponse = self.connect(
            "querier.v1.QuerierService/SelectMergeStacktraces",
            &api::SelectMergeStacktracesRequest {
                profile_type_id: profile_type.into(),
                label_selector: selector.into(),
                start: start_ms,
                end: end_ms,
                max_nodes: Some(1 << 20),
                format: 1,
                stack_trace_selector: None,
                ..Default::default()
            },
        );
        response.flamegraph.unwrap_or_default()
    }

    /// The merged flame graph over all stored time.
    pub fn merge(&self, profile_type: &str, selector: &str) -> api::FlameGraph {
        self.merge_range(profile_type, selector, 1, unix_now_ms() + 3_600_000)
    }

    /// Everything queries can see, to prove a rejected request changed nothing.
    pub fn snapshot(&self) -> StoreSnapshot {
        let series: api::SeriesResponse = self.connect(
            "querier.v1.QuerierService/Series",
            &api::SeriesRequest {
                start: 1,
                end: unix_now_ms() + 3_600_000,
                ..Default::default()
            },
        );
        let types = self.profile_types();
        let totals = types
            .iter()
            .map(|t| (t.clone(), self.merge(t, "{}").total))
            .collect();
        StoreSnapshot {
            series: series
                .labels_set
                .into_iter()
                .map(|l| l.labels.into_iter().map(|p| (p.name, p.value)).collect())
                .collect(),
            totals,
            ingested: self.metric("profiler_store_profiles_ingested_total"),
        }
    }

    /// One value from /metrics.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let response = self.get("/metrics");
        assert_eq!(response.status, 200, "{}", response.text());
        metric_value(&response.text(), name)
    }
}

/// The value of the unlabelled metric `name` in a /metrics text.
pub fn metric_value(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let (metric, value) = line.split_once(' ')?;
        (metric == name).then(|| value.trim().parse().ok())?
    })
}

/// Series, per-type totals and the ingest counter of a store, as queries report them.
#[derive(Debug, PartialEq)]
pub struct StoreSnapshot {
    pub series: Vec<Vec<(String, String)>>,
    pub totals: BTreeMap<String, i64>,
    pub ingested: Option<f64>,
}

/// Function names of a flame graph's nodes (every node, any depth).
pub fn flamegraph_names(graph: &api::FlameGraph) -> Vec<String> {
    let mut names: Vec<String> = graph
        .levels
        .iter()
        .flat_map(|level| level.values.chunks(4).map(|node| node[3]))
        .filter_map(|index| graph.names.get(index as usize).cloned())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The total of the nodes whose name contains `needle` and that have no such ancestor.
pub fn flamegraph_total_of(graph: &api::FlameGraph, needle: &str) -> i64 {
    // Nodes are (x delta, total, self, name); rebuild absolute x to tell nesting.
    let mut total = 0;
    let mut counted: Vec<(i64, i64)> = Vec::new();
    for level in &graph.levels {
        let mut previous_end = 0;
        for node in level.values.chunks(4) {
            let x = previous_end + node[0];
            let width = node[1];
            previous_end = x + width;
            let name = graph.names.get(node[3] as usize).map_or("", String::as_str);
            let inside = counted.iter().any(|&(s, e)| x >= s && x + width <= e);
            if name.contains(needle) && !inside {
                total += width;
                counted.push((x, x + width));
            }
        }
    }
    total
}

/// Sends `GET TARGET` exactly as given (no client-side path normalization) and returns the
/// status code and the body (with any chunked framing left in).
pub fn raw_get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("write request");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in the response to {target}: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned());
    (status, body)
}

/// splitmix64: a small deterministic generator for synthetic data.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Builds a pprof profile from stacks given as function names, root first, with one
/// `cpu/nanoseconds` value each.
pub fn pprof_from_stacks(stacks: &[(Vec<String>, i64)], time_ns: i64) -> proto::Profile {
    let mut strings: Vec<String> = vec![String::new()];
    let mut string_ids: std::collections::HashMap<String, i64> = Default::default();
    let mut intern = |s: &str, strings: &mut Vec<String>| -> i64 {
        *string_ids.entry(s.to_owned()).or_insert_with(|| {
            strings.push(s.to_owned());
            strings.len() as i64 - 1
        })
    };
    let cpu = intern("cpu", &mut strings);
    let nanoseconds = intern("nanoseconds", &mut strings);
    let binary = intern("/usr/bin/synthetic", &mut strings);
    let mut functions: Vec<proto::Function> = Vec::new();
    let mut function_ids: std::collections::HashMap<String, u64> = Default::default();
    let mut samples = Vec::with_capacity(stacks.len());
    for (frames, value) in stacks {
        let mut location_id = Vec::with_capacity(frames.len());
        // pprof lists a sample's locations leaf first.
        for frame in frames.iter().rev() {
            let id = match function_ids.get(frame) {
                Some(&id) => id,
                None => {
                    let id = functions.len() as u64 + 1;
                    let name = intern(frame, &mut strings);
                    functions.push(proto::Function {
                        id,
                        name,
                        system_name: name,
                        ..Default::default()
                    });
                    function_ids.insert(frame.clone(), id);
                    id
                }
            };
            location_id.push(id);
        }
        samples.push(proto::Sample {
            location_id,
            value: vec![*value],
            label: Vec::new(),
        });
    }
    // One location per function, at an address of its own that every profile agrees on
    // (as a real binary's), from the function's name.
    let address_of = |name: &str| {
        let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        0x40_0000 + (hash % 0x3f_0000) / 0x10 * 0x10
    };
    let locations = functions
        .iter()
        .map(|f| proto::Location {
            id: f.id,
            mapping_id: 1,
            address: address_of(&strings[f.name as usize]),
            line: vec![proto::Line {
                function_id: f.id,
                line: 0,
                column: 0,
            }],
            is_folded: false,
        })
        .collect();
    proto::Profile {
        sample_type: vec![proto::ValueType {
            r#type: cpu,
            unit: nanoseconds,
        }],
        sample: samples,
        mapping: vec![proto::Mapping {
            id: 1,
            memory_start: 0x40_0000,
            memory_limit: 0x80_0000,
            filename: binary,
            has_functions: true,
            ..Default::default()
        }],
        location: locations,
        function: functions,
        string_table: strings,
        time_nanos: time_ns,
        duration_nanos: 15_000_000_000,
        period_type: Some(proto::ValueType {
            r#type: cpu,
            unit: nanoseconds,
        }),
        period: 10_000_000,
        ..Default::default()
    }
}

/// A service's call stacks: `count` distinct stacks 8-40 frames deep over a few thousand
/// functions, sharing prefixes like real call trees. The same `service` gives the same stacks.
pub fn service_stack_pool(service: usize, count: usize) -> Vec<Vec<String>> {
    const FUNCTIONS: u64 = 3000;
    let mut rng = SplitMix((service as u64 + 1).wrapping_mul(0x1234_5678_9abc_def1));
    let name = |i: u64| format!("svc{service}::module{}::function_{i}", i % 37);
    // Each stack starts as a copy of an earlier one cut at a random depth.
    let mut paths: Vec<Vec<u64>> = Vec::with_capacity(count);
    let mut seen = std::collections::HashSet::new();
    while paths.len() < count {
        let mut path: Vec<u64> = match paths.len() {
            0 => vec![0],
            n => {
                let base = &paths[rng.below(n as u64) as usize];
                let keep = 1 + rng.below(base.len() as u64) as usize;
                base[..keep].to_vec()
            }
        };
        let depth = 8 + rng.below(33) as usize;
        while path.len() < depth {
            path.push(rng.below(FUNCTIONS));
        }
        if seen.insert(path.clone()) {
            paths.push(path);
        }
    }
    paths
        .into_iter()
        .map(|path| path.into_iter().map(name).collect())
        .collect()
}

/// A realistic interval profile of a service: `stacks` of the service's twice as many stacks
/// ([`service_stack_pool`]), so consecutive profiles share most stacks, with skewed sample
/// counts at 100 Hz (few hot stacks, many seen once or twice). `seed` varies the pick.
pub fn synthetic_service_profile(
    service: usize,
    seed: u64,
    stacks: usize,
    time_ns: i64,
) -> proto::Profile {
    let pool = service_stack_pool(service, stacks * 2);
    synthetic_profile_from_pool(&pool, seed, stacks, time_ns)
}

/// [`synthetic_service_profile`] with the pool computed once by the caller.
pub fn synthetic_profile_from_pool(
    pool: &[Vec<String>],
    seed: u64,
    stacks: usize,
    time_ns: i64,
) -> proto::Profile {
    let stacks = stacks.min(pool.len());
    let mut rng = SplitMix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed);
    let mut order: Vec<usize> = (0..pool.len()).collect();
    for i in 0..stacks {
        let j = i + rng.below((pool.len() - i) as u64) as usize;
        order.swap(i, j);
    }
    let picked: Vec<(Vec<String>, i64)> = order[..stacks]
        .iter()
        .map(|&index| {
            let r = rng.below(1000);
            let samples = if r < 900 {
                1 + rng.below(2)
            } else if r < 990 {
                3 + rng.below(30)
            } else {
                50 + rng.below(300)
            };
            (pool[index].clone(), samples as i64 * 10_000_000)
        })
        .collect();
    pprof_from_stacks(&picked, time_ns)
}

/// A Connect Push request of one series with `labels` (besides `__name__=process_cpu`) and one
/// gzipped pprof.
pub fn push_request(labels: &[(&str, &str)], profile: &proto::Profile) -> api::PushRequest {
    let mut pairs = vec![api::LabelPair {
        name: "__name__".into(),
        value: "process_cpu".into(),
    }];
    pairs.extend(labels.iter().map(|(name, value)| api::LabelPair {
        name: (*name).into(),
        value: (*value).into(),
    }));
    api::PushRequest {
        series: vec![api::RawProfileSeries {
            labels: pairs,
            samples: vec![api::RawSample {
                raw_profile: gzip(&profile.encode_to_vec()),
                id: String::new(),
            }],
        }],
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).expect("gzip into memory");
    encoder.finish().expect("gzip into memory")
}
