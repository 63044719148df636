//! Mixed Python/native stacks from the real BPF walk, on every interpreter available offline:
//! pyenv 3.8–3.13, Debian's static python3.11 and Debian sid's 3.14 (unpacked by setup). For
//! each, fixture processes sit in known stacks (a chain of functions and methods, a `sorted`
//! key callback called from C, a generator, an asyncio coroutine, recursion 200 deep, two busy
//! threads) while `profiler record` samples them; every sampled thread's Python frames must
//! equal what `py-spy dump --native` reports for the same thread, and the native frames between
//! Python frames must be there.
use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use integration_tests::{
    Scratch, assert_success, decode_pprof, exclusive, fixture_source, profiler_bin, proto,
    pyenv_python, require_external, run_profiler, send_signal, workspace_root,
};

const PYENV: &[(&str, &str)] = &[
    ("3.8.18", "python3.8"),
    ("3.9.18", "python3.9"),
    ("3.10.13", "python3.10"),
    ("3.11.7", "python3.11"),
    ("3.12.1", "python3.12"),
    ("3.13.0", "python3.13"),
];
const MODES: &[&str] = &[
    "chain",
    "sorted",
    "generator",
    "asyncio",
    "recursion",
    "threads",
];
const SIGINT: i32 = 2;

fn skip_or_fail(what: &str) {
    assert!(
        !require_external(),
        "{what} (PROFILER_REQUIRE_EXTERNAL=1 forbids skipping)"
    );
    eprintln!("skipping: {what}");
}

/// (label, interpreter) for every interpreter present.
fn interpreters() -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    for (version, executable) in PYENV {
        match pyenv_python(version, executable) {
            Some(path) => found.push((format!("pyenv {version}"), path)),
            None => skip_or_fail(&format!("pyenv Python {version} is not installed")),
        }
    }
    let debian = PathBuf::from("/usr/bin/python3.11");
    if debian.is_file() {
        found.push(("debian 3.11 (static, stripped)".into(), debian));
    } else {
        skip_or_fail("Debian's /usr/bin/python3.11 is not installed");
    }
    let sid = workspace_root().join(".tools/python3.14/usr/bin/python3.14");
    if sid.is_file() {
        found.push(("debian sid 3.14".into(), sid));
    } else {
        skip_or_fail("Python 3.14 is not unpacked under .tools (`cargo xtask setup` does it)");
    }
    found
}

fn py_spy() -> Option<PathBuf> {
    let path = workspace_root().join(".tools/py-spy/bin/py-spy");
    path.is_file().then_some(path)
}

fn fixture_script() -> PathBuf {
    fixture_source("python/stacks.py")
}

/// The line of the fixture marked `# HOT:<mode>`.
fn hot_line(mode: &str) -> u32 {
    let text = std::fs::read_to_string(fixture_script()).expect("fixture script");
    let marker = format!("# HOT:{mode}");
    text.lines()
        .position(|line| line.contains(&marker))
        .unwrap_or_else(|| panic!("no {marker} in the fixture")) as u32
        + 1
}

/// A fixture process in its hot loop; killed on drop.
struct Fixture {
    mode: &'static str,
    child: Child,
}

impl Fixture {
    fn start(python: &Path, mode: &'static str) -> Result<Fixture, String> {
        let mut child = Command::new(python)
            .arg(fixture_script())
            .arg(mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", python.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(line) if line == "ready" => {
                        let _ = ready_tx.send(());
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        let fixture = Fixture { mode, child };
        ready_rx
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| format!("{mode}: the fixture never printed ready"))?;
        Ok(fixture)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One frame of a recorded stack.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Frame {
    name: String,
    file: String,
    line: u64,
    python: bool,
    native: bool,
}

/// Each distinct stack of a thread (innermost first) with its sample count.
type Stacks = Vec<(Vec<Frame>, i64)>;
/// Per (pid, tid).
type ThreadStacks = HashMap<(i64, i64), Stacks>;

fn thread_stacks(profile: &proto::Profile) -> ThreadStacks {
    let string = |i: i64| {
        profile
            .string_table
            .get(i as usize)
            .cloned()
            .unwrap_or_default()
    };
    let functions: HashMap<u64, &proto::Function> =
        profile.function.iter().map(|f| (f.id, f)).collect();
    let locations: HashMap<u64, &proto::Location> =
        profile.location.iter().map(|l| (l.id, l)).collect();
    let mut stacks = ThreadStacks::new();
    for sample in &profile.sample {
        let label = |key: &str| {
            sample
                .label
                .iter()
                .find(|l| string(l.key) == key)
                .map(|l| l.num)
                .unwrap_or(-1)
        };
        let mut frames = Vec::new();
        for id in &sample.location_id {
            let location = locations[id];
            for line in &location.line {
                let function = functions[&line.function_id];
                frames.push(Frame {
                    name: string(function.name),
                    file: string(function.filename),
                    line: line.line as u64,
                    // Python frames have no mapping but a line; kernel frames have neither.
                    python: location.mapping_id == 0 && line.line > 0,
                    native: location.mapping_id != 0,
                });
            }
        }
        stacks
            .entry((label("pid"), label("tid")))
            .or_default()
            .push((frames, sample.value[0]));
    }
    stacks
}

type PyFrame = (String, String, u64);

fn python_frames(stack: &[Frame]) -> Vec<PyFrame> {
    stack
        .iter()
        .filter(|f| f.python)
        .map(|f| (f.name.clone(), f.file.clone(), f.line))
        .collect()
}

/// The most frequent full stack among those whose Python frames are the most frequent
/// Python stack of the thread.
fn dominant_stack(stacks: &Stacks) -> (Vec<PyFrame>, Vec<Frame>, i64) {
    let mut by_python: HashMap<Vec<PyFrame>, i64> = HashMap::new();
    for (frames, count) in stacks {
        *by_python.entry(python_frames(frames)).or_default() += count;
    }
    let (python, count) = by_python
        .into_iter()
        .max_by_key(|(_, count)| *count)
        .expect("at least one stack");
    let full = stacks
        .iter()
        .filter(|(frames, _)| python_frames(frames) == python)
        .max_by_key(|(_, count)| *count)
        .map(|(frames, _)| frames.clone())
        .expect("a stack with these Python frames");
    (python, full, count)
}

/// `py-spy dump --native` of `pid`: per OS thread id, its Python frames innermost first.
fn py_spy_dump(py_spy: &Path, pid: u32) -> Result<HashMap<i64, Vec<PyFrame>>, String> {
    let out = Command::new(py_spy)
        .args(["dump", "--native", "--json", "--pid"])
        .arg(pid.to_string())
        .output()
        .map_err(|e| format!("py-spy: {e}"))?;
    let threads: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "py-spy output: {e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let mut result = HashMap::new();
    for thread in threads.as_array().ok_or("py-spy: not an array")? {
        let tid = thread["os_thread_id"]
            .as_i64()
            .ok_or("py-spy: os_thread_id")?;
        let frames = thread["frames"]
            .as_array()
            .ok_or("py-spy: frames")?
            .iter()
            // Native frames carry the module they come from; Python frames do not.
            .filter(|f| f["module"].is_null())
            .map(|f| {
                (
                    f["name"].as_str().unwrap_or_default().to_owned(),
                    f["filename"].as_str().unwrap_or_default().to_owned(),
                    f["line"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        result.insert(tid, frames);
    }
    Ok(result)
}

/// The unqualified name (≤3.10 has no `co_qualname`).
fn short(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

fn names(frames: &[PyFrame]) -> Vec<&str> {
    frames.iter().map(|(name, _, _)| short(name)).collect()
}

/// What each mode's dominant stack must look like, beyond agreeing with py-spy.
fn check_mode(mode: &str, python: &[PyFrame], full: &[Frame]) -> Result<(), String> {
    let script = fixture_script().display().to_string();
    let hot = hot_line(mode);
    let innermost = python.first().ok_or("no Python frames")?;
    if innermost.1 != script || innermost.2 != u64::from(hot) {
        return Err(format!(
            "innermost Python frame {innermost:?} is not the hot line {script}:{hot}"
        ));
    }
    let names = names(python);
    let expect_prefix = |prefix: &[&str]| -> Result<(), String> {
        if names.starts_with(prefix) {
            Ok(())
        } else {
            Err(format!(
                "Python frames {names:?} do not start with {prefix:?}"
            ))
        }
    };
    match mode {
        "chain" => expect_prefix(&["spin", "middle", "outer", "main", "<module>"]),
        "generator" => expect_prefix(&["generator", "consume_generator", "main", "<module>"]),
        "threads" => expect_prefix(&["thread_spin", "run"]),
        "asyncio" => {
            let inner = names.iter().position(|n| *n == "inner_coroutine");
            let outer = names.iter().position(|n| *n == "outer_coroutine");
            let runner = names.iter().position(|n| *n == "run_asyncio");
            match (inner, outer, runner) {
                (Some(0), Some(o), Some(r)) if o < r => Ok(()),
                _ => Err(format!("asyncio stack out of order: {names:?}")),
            }
        }
        "recursion" => {
            let depth = names.iter().filter(|n| **n == "recurse").count();
            if depth == 200 && names[..200].iter().all(|n| *n == "recurse") {
                Ok(())
            } else {
                Err(format!("{depth} recurse frames, expected 200 innermost"))
            }
        }
        "sorted" => {
            expect_prefix(&["key_func", "sort_driver", "main", "<module>"])?;
            // `sorted` is C code calling back into Python: native frames sit between.
            let at = |name: &str| full.iter().position(|f| f.python && short(&f.name) == name);
            let (Some(key), Some(driver)) = (at("key_func"), at("sort_driver")) else {
                return Err("key_func/sort_driver missing from the full stack".into());
            };
            if full[key + 1..driver].iter().any(|f| f.native) {
                Ok(())
            } else {
                Err(format!(
                    "no native frame between key_func and sort_driver: {:?}",
                    &full[key..=driver]
                ))
            }
        }
        other => Err(format!("unknown mode {other}")),
    }
}

/// Records all fixtures of one interpreter at once and checks every sampled thread.
fn check_interpreter(python: &Path, py_spy: Option<&Path>, scratch: &Scratch) -> Vec<String> {
    let mut failures = Vec::new();
    let mut fixtures = Vec::new();
    for mode in MODES {
        match Fixture::start(python, mode) {
            Ok(fixture) => fixtures.push(fixture),
            Err(error) => failures.push(error),
        }
    }
    let pids: Vec<String> = fixtures.iter().map(|f| f.pid().to_string()).collect();
    let output = scratch.path("python.pb.gz");
    let run = run_profiler(&[
        "record",
        "--pid",
        &pids.join(","),
        "--duration",
        "3",
        "--output",
        output.to_str().expect("utf-8 path"),
    ]);
    assert_success(&run);
    let stacks = thread_stacks(&decode_pprof(&output));
    for fixture in &fixtures {
        let pid = i64::from(fixture.pid());
        let threads: Vec<(&(i64, i64), &Stacks)> =
            stacks.iter().filter(|((p, _), _)| *p == pid).collect();
        let oracle = match py_spy.map(|path| py_spy_dump(path, fixture.pid())) {
            Some(Ok(oracle)) => Some(oracle),
            Some(Err(error)) => {
                failures.push(format!("{}: {error}", fixture.mode));
                None
            }
            None => None,
        };
        let busy_threads = if fixture.mode == "threads" { 2 } else { 1 };
        let mut checked = 0;
        let mut seen = Vec::new();
        for ((_, tid), thread) in threads {
            let (python, full, count) = dominant_stack(thread);
            seen.push((*tid, count));
            // A thread sampled once or twice on its way to the hot loop is not the one to
            // check (the fixtures share two cores with each other and the profiler).
            if count < 3 {
                continue;
            }
            checked += 1;
            if let Err(error) = check_mode(fixture.mode, &python, &full) {
                failures.push(format!("{} tid {tid}: {error}", fixture.mode));
            }
            if let Some(oracle) = &oracle {
                match oracle.get(tid) {
                    Some(theirs) if *theirs == python => {}
                    Some(theirs) => failures.push(format!(
                        "{} tid {tid} differs from py-spy:\n  ours   {python:?}\n  py-spy {theirs:?}",
                        fixture.mode
                    )),
                    None => failures.push(format!(
                        "{} tid {tid}: py-spy does not see this thread",
                        fixture.mode
                    )),
                }
            }
        }
        if checked != busy_threads {
            failures.push(format!(
                "{}: {checked} threads with a steady stack, expected {busy_threads} (tid, samples): {seen:?}",
                fixture.mode
            ));
        }
    }
    failures
}

#[test]
fn python_stacks_agree_with_py_spy_on_every_interpreter() {
    let _guard = exclusive();
    let py_spy = py_spy();
    if py_spy.is_none() {
        skip_or_fail("py-spy is not installed under .tools/py-spy (`cargo xtask setup`)");
    }
    let scratch = Scratch::new("python-matrix");
    let mut failures = Vec::new();
    for (label, python) in interpreters() {
        for failure in check_interpreter(&python, py_spy.as_deref(), &scratch) {
            failures.push(format!("[{label}] {failure}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A Python process that starts while the profiler runs gets Python frames within 2 seconds.
#[test]
fn python_process_started_after_the_profiler_gets_python_frames_within_two_seconds() {
    let _guard = exclusive();
    let Some(python) = pyenv_python("3.12.1", "python3.12") else {
        skip_or_fail("pyenv Python 3.12.1 is not installed");
        return;
    };
    let scratch = Scratch::new("python-late");
    let output = scratch.path("late.folded");
    let mut profiler = Command::new(profiler_bin())
        .args([
            "record",
            "--duration",
            "60",
            "--format",
            "folded",
            "--output",
        ])
        .arg(&output)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start profiler");
    let stderr = profiler.stderr.take().expect("stderr");
    let (attached_tx, attached_rx) = mpsc::channel();
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("sampler attached") {
                let _ = attached_tx.send(());
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    attached_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the profiler attaches");
    let started = std::time::Instant::now();
    let fixture = Fixture::start(&python, "chain").expect("fixture starts");
    std::thread::sleep(Duration::from_secs(2).saturating_sub(started.elapsed()));
    send_signal(profiler.id(), SIGINT);
    let status = profiler.wait().expect("profiler exits");
    let log = log.join().expect("log reader");
    assert!(status.success(), "profiler failed:\n{log}");
    drop(fixture);
    let folded = std::fs::read_to_string(&output).expect("folded output");
    let hot = format!(
        "Worker.spin ({}:{})",
        fixture_script().display(),
        hot_line("chain")
    );
    let with_python: u64 = folded
        .lines()
        .filter(|line| line.contains(&hot))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(
        with_python >= 5,
        "only {with_python} samples with `{hot}` in the first 2 s of the process:\n{log}"
    );
}

/// A free-threaded interpreter (3.13t, here a stand-in library with the real
/// `_Py_DebugOffsets` header) is reported as unsupported, and its native stacks are kept.
#[test]
fn free_threaded_python_is_reported_and_keeps_native_stacks() {
    let _guard = exclusive();
    let library = integration_tests::cached_fixture("libpython3.13t.so.1.0", |out| {
        let status = Command::new("gcc")
            .args(["-O2", "-g", "-fPIC", "-shared", "-o"])
            .arg(out)
            .arg(fixture_source("python/free_threaded_runtime.c"))
            .status()
            .expect("gcc");
        assert!(
            status.success(),
            "building the stand-in libpython3.13t failed"
        );
    });
    let library_dir = library.parent().expect("fixture dir").to_path_buf();
    let program = integration_tests::cached_fixture("free-threaded-main", |out| {
        let status = Command::new("gcc")
            .args(["-O2", "-g", "-fno-omit-frame-pointer", "-o"])
            .arg(out)
            .arg(fixture_source("python/free_threaded_main.c"))
            .arg(&library)
            .arg(format!("-Wl,-rpath,{}", library_dir.display()))
            .status()
            .expect("gcc");
        assert!(
            status.success(),
            "building the free-threaded fixture failed"
        );
    });
    let running = integration_tests::spawn(&program, &["8"]);
    std::thread::sleep(Duration::from_millis(200));
    let scratch = Scratch::new("python-free-threaded");
    let output = scratch.path("ft.folded");
    let pid = running.pid().to_string();
    let run = integration_tests::run_profiler_with_env(
        &[
            "record",
            "--pid",
            &pid,
            "--duration",
            "2",
            "--format",
            "folded",
            "--output",
            output.to_str().expect("utf-8 path"),
        ],
        &[("RUST_LOG", "info"), ("NO_COLOR", "1")],
    );
    assert_success(&run);
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(
        log.contains("free-threaded Python 3.13 is not supported"),
        "no free-threaded report in the log:\n{log}"
    );
    let folded = std::fs::read_to_string(&output).expect("folded output");
    assert!(
        folded
            .lines()
            .any(|line| line.contains("free_threaded_loop;_PyEval_EvalFrameDefault")),
        "native stacks of the free-threaded process are missing:\n{folded}"
    );
}
