//! The web UI: the flame-graph data code's unit tests (`node --test`), and the whole page in
//! headless Chromium (Debian's, driven by playwright-core) against a real `profiler agent`
//! profiling a fixture with distinctive function names.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use integration_tests::*;

const CHROMIUM: &str = "/usr/bin/chromium";
const WORKLOAD_SERVICE: &str = "ui-test-workload";
const OTHER_SERVICE: &str = "ui-test-other";
/// The agent runs with a token, so the test also covers the browser's login through `/?token=`.
const TOKEN: &str = "ui-test-token";

fn js_dir() -> PathBuf {
    workspace_root().join("tests").join("js")
}

/// Whether `what` exists; a missing one skips the test unless PROFILER_REQUIRE_EXTERNAL=1.
fn present(path: &Path, what: &str) -> bool {
    if path.exists() {
        return true;
    }
    assert!(
        !require_external(),
        "{what} is missing at {} (run `cargo xtask setup`); PROFILER_REQUIRE_EXTERNAL=1 forbids skipping",
        path.display()
    );
    eprintln!("skipped: {what} is missing at {}", path.display());
    false
}

fn node_output(args: &[&str]) -> std::process::Output {
    Command::new("node")
        .args(args)
        .current_dir(js_dir())
        .output()
        .expect("run node (installed by `cargo xtask setup`)")
}

#[test]
fn flamegraph_data_unit_tests_pass() {
    let output = node_output(&["--test", "flamegraph.test.mjs"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "node --test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Guard against a run that found no tests.
    assert!(
        stdout.contains("# pass") && !stdout.contains("# pass 0"),
        "{stdout}"
    );
}

/// The agent, stopped with SIGTERM when dropped; its log is kept for failure messages.
struct Agent {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Agent {
    /// Starts `profiler agent` on a free loopback port and returns once it serves HTTP.
    fn start(data_dir: &Path, pids: &[u32]) -> (Agent, String) {
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let mut child = Command::new(profiler_bin())
            .args([
                "agent",
                "--listen",
                "127.0.0.1:0",
                "--interval",
                "2",
                // The other service sleeps most of the time: its wall view is checked.
                "--off-cpu",
                "--off-cpu-probability",
                "0.2",
                "--data-dir",
            ])
            .arg(data_dir)
            .args(["--pid", &pids.join(",")])
            .args(["--auth-token", TOKEN])
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start profiler agent");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (address_tx, address_rx) = mpsc::channel();
        let thread_log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(address) = served_address(&line) {
                    let _ = address_tx.send(address);
                }
                thread_log.lock().unwrap().push(line);
            }
        });
        let agent = Agent { child, log };
        // Loading BPF and the first snapshots take a variable time on a busy machine.
        let address = address_rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("the agent never served HTTP:\n{}", agent.log_text()));
        (agent, address)
    }

    fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child's.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// `http://127.0.0.1:PORT` from the agent's "web UI at http://…/" log line.
fn served_address(line: &str) -> Option<String> {
    let rest = &line[line.find("web UI at http://")? + "web UI at http://".len()..];
    let address: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
        .collect();
    address.contains(':').then(|| format!("http://{address}"))
}

#[test]
fn served_address_is_read_from_the_log() {
    assert_eq!(
        served_address(
            "INFO profiler::server: HTTP server listening: web UI at http://127.0.0.1:41234/ addr=127.0.0.1:41234"
        ),
        Some("http://127.0.0.1:41234".to_owned())
    );
    assert_eq!(served_address("INFO agent running"), None);
}

#[test]
fn web_ui_in_headless_chromium() {
    let playwright = js_dir().join("node_modules").join("playwright-core");
    if !present(Path::new(CHROMIUM), "Debian's chromium")
        || !present(&playwright, "playwright-core (npm)")
    {
        return;
    }
    let _guard = exclusive();
    let fixture = fp_fixture("ui_workload.c");
    let workload = spawn_with_env(
        &fixture,
        &["600"],
        &[("OTEL_SERVICE_NAME", WORKLOAD_SERVICE)],
    );
    let other = spawn_with_env(
        &fixture,
        &["other", "600"],
        &[("OTEL_SERVICE_NAME", OTHER_SERVICE)],
    );
    let scratch = Scratch::new("ui");
    let (agent, url) = Agent::start(&scratch.path("data"), &[workload.pid(), other.pid()]);

    let screenshots = workspace_root().join("target").join("ui-screenshots");
    let config = serde_json::json!({
        "url": url,
        "token": TOKEN,
        "workloadPid": workload.pid(),
        "service": WORKLOAD_SERVICE,
        "otherService": OTHER_SERVICE,
        "functions": {
            "main": "ui_fixture_main_loop",
            "phaseOne": "ui_fixture_parse_orders",
            "phaseTwo": "ui_fixture_render_invoices",
            "leaf": "ui_fixture_checksum",
            "other": "ui_fixture_other_service",
        },
        "screenshots": screenshots,
    });
    let output = node_output(&["ui-test.mjs", &config.to_string()]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "the browser test failed:\n{stdout}\n{stderr}\n--- agent log ---\n{}",
        agent.log_text()
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
    for name in ["flamegraph", "zoom", "search", "compare", "sandwich"] {
        let shot = screenshots.join(format!("{name}.png"));
        let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
        assert!(size > 10_000, "{} is missing or blank", shot.display());
    }
}
