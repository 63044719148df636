//! Mixed Python/native stacks from the real BPF walk, on every interpreter available offline:
//! pyenv 3.8–3.13, Debian's static python3.11, Debian sid's 3.14 (unpacked by setup) and
//! free-threaded 3.13t/3.14t (built by setup). For
//! each, fixture processes sit in known stacks (a chain of functions and methods, a `sorted`
//! key callback and a ctypes `qsort` callback called from C, a generator, an asyncio coroutine,
//! recursion 200 deep, two busy threads) while `profiler record` samples them. Every sampled
//! thread's Python frames must be the fixture's own (qualified names, and lines from the
//! fixture's `# HOT:`/`# AT:` markers) and equal what `py-spy dump --native` reports for the
//! same thread; the native frames between Python frames must be the C code that called back,
//! and no eval-loop frame may be left where Python frames replaced it.
//!
//! Free-threaded 3.13t and 3.14t (built by setup) run the same fixtures; py-spy does not read
//! them, so their own expectations are the check.
//!
//! Also: processes started after the profiler, in another PID namespace, with 300 threads, an
//! embedding program loading libpython late, and a process whose thread states fail the layout
//! self-check.
use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use integration_tests::{
    Agent, READY_TIMEOUT, Recording, Scratch, StackSample, assert_success, await_ready,
    build_fixture, cpu_time_so_far, decode_pprof, exclusive, find_chain, fixture_source,
    parse_folded, proto, pyenv_python, require_external, run_profiler, send_signal,
    server_harness::{Client, metric_value},
    stack_samples, top_stacks, workspace_root,
};

const PYENV: &[(&str, &str, (u8, u8))] = &[
    ("3.8.18", "python3.8", (3, 8)),
    ("3.9.18", "python3.9", (3, 9)),
    ("3.10.13", "python3.10", (3, 10)),
    ("3.11.7", "python3.11", (3, 11)),
    ("3.12.1", "python3.12", (3, 12)),
    ("3.13.0", "python3.13", (3, 13)),
];
const MODES: &[&str] = &[
    "chain",
    "sorted",
    "ctypes",
    "generator",
    "asyncio",
    "recursion",
    "threads",
];
const SIGSTOP: i32 = 19;
const SIGUSR1: i32 = 10;

fn skip_or_fail(what: &str) {
    assert!(
        !require_external(),
        "{what} (PROFILER_REQUIRE_EXTERNAL=1 forbids skipping)"
    );
    eprintln!("skipping: {what}");
}

/// An interpreter to run the fixtures under.
#[derive(Clone, Debug)]
struct Interpreter {
    label: String,
    path: PathBuf,
    /// (major, minor).
    version: (u8, u8),
    /// Stripped of `.symtab`: static functions of the interpreter have no names.
    stripped: bool,
    /// A free-threaded build (PEP 703), which py-spy does not read.
    free_threaded: bool,
}

fn debian_python311() -> Option<Interpreter> {
    let path = PathBuf::from("/usr/bin/python3.11");
    if path.is_file() {
        return Some(Interpreter {
            label: "debian 3.11 (static, stripped)".into(),
            path,
            version: (3, 11),
            stripped: true,
            free_threaded: false,
        });
    }
    skip_or_fail("Debian's /usr/bin/python3.11 is not installed");
    None
}

fn sid_python314() -> Option<Interpreter> {
    let path = workspace_root().join(".tools/python3.14/usr/bin/python3.14");
    if path.is_file() {
        return Some(Interpreter {
            label: "debian sid 3.14 (stripped)".into(),
            path,
            version: (3, 14),
            stripped: true,
            free_threaded: false,
        });
    }
    skip_or_fail("Python 3.14 is not unpacked under .tools (`cargo xtask setup` does it)");
    None
}

fn pyenv_interpreter(version: &str) -> Option<Interpreter> {
    let &(_, executable, minor) = PYENV
        .iter()
        .find(|(v, _, _)| *v == version)
        .expect("a known pyenv version");
    match pyenv_python(version, executable) {
        Some(path) => Some(Interpreter {
            label: format!("pyenv {version}"),
            path,
            version: minor,
            stripped: false,
            free_threaded: false,
        }),
        None => {
            skip_or_fail(&format!("pyenv Python {version} is not installed"));
            None
        }
    }
}

/// Free-threaded 3.13t and 3.14t, built from CPython's source by `cargo xtask setup`.
fn free_threaded_pythons() -> Vec<Interpreter> {
    [
        (13, ".tools/python3.13t/bin/python3.13t"),
        (14, ".tools/python3.14t/bin/python3.14t"),
    ]
    .into_iter()
    .filter_map(|(minor, path)| {
        let path = workspace_root().join(path);
        if path.is_file() {
            Some(Interpreter {
                label: format!("free-threaded 3.{minor}t"),
                path,
                version: (3, minor),
                stripped: false,
                free_threaded: true,
            })
        } else {
            skip_or_fail(&format!(
                "{} is not built (`cargo xtask setup` builds it)",
                path.display()
            ));
            None
        }
    })
    .collect()
}

/// Every interpreter present.
fn interpreters() -> Vec<Interpreter> {
    PYENV
        .iter()
        .filter_map(|(version, _, _)| pyenv_interpreter(version))
        .chain(debian_python311())
        .chain(sid_python314())
        .chain(free_threaded_pythons())
        .collect()
}

fn py_spy() -> Option<PathBuf> {
    let path = workspace_root().join(".tools/py-spy/bin/py-spy");
    path.is_file().then_some(path)
}

fn fixture_script() -> PathBuf {
    fixture_source("python/stacks.py")
}

/// The line of the fixture that ends with `marker`.
fn marker_line(marker: &str) -> u64 {
    let text = std::fs::read_to_string(fixture_script()).expect("fixture script");
    text.lines()
        .position(|line| line.trim_end().ends_with(marker))
        .unwrap_or_else(|| panic!("no line ending with {marker} in the fixture")) as u64
        + 1
}

/// The line of the fixture marked `# HOT:<mode>`.
fn hot_line(mode: &str) -> u64 {
    marker_line(&format!("# HOT:{mode}"))
}

/// The call site marked `# AT:<caller>`: where the frame of `caller` waits for its callee.
fn call_line(caller: &str) -> u64 {
    marker_line(&format!("# AT:{caller}"))
}

/// A fixture process in its hot loop; killed on drop.
struct Fixture {
    mode: &'static str,
    child: Child,
    /// The Python process: the child itself, or the child's child under `unshare --fork`.
    pid: u32,
}

impl Fixture {
    fn start(python: &Path, mode: &'static str) -> Result<Fixture, String> {
        let mut command = Command::new(python);
        command.arg(fixture_script()).arg(mode);
        Fixture::spawn(command, mode, false)
    }

    /// Runs `command`, which prints "ready" once its stack is set up; with `forks`, the
    /// Python process is the only child of the process started.
    fn spawn(mut command: Command, mode: &'static str, forks: bool) -> Result<Fixture, String> {
        let child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawn {command:?}: {e}"))?;
        let pid = child.id();
        let mut fixture = Fixture { mode, child, pid };
        await_ready(&mut fixture.child, READY_TIMEOUT).map_err(|e| format!("{mode}: {e}"))?;
        if forks {
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .map_err(|e| format!("children of {pid}: {e}"))?;
            fixture.pid = children
                .split_whitespace()
                .next()
                .and_then(|child| child.parse().ok())
                .ok_or_else(|| format!("{pid} has no child"))?;
        }
        Ok(fixture)
    }

    fn pid(&self) -> u32 {
        self.pid
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

/// `profiler record --pid PIDS --duration SECS` into `output`; the per-thread stacks it wrote
/// and its log.
fn record_threads(pids: &str, seconds: &str, output: &Path) -> (ThreadStacks, String) {
    let run = run_profiler(&[
        "record",
        "--pid",
        pids,
        "--duration",
        seconds,
        "--output",
        output.to_str().expect("utf-8 path"),
    ]);
    assert_success(&run);
    let log = String::from_utf8_lossy(&run.stderr).into_owned();
    (thread_stacks(&decode_pprof(output)), log)
}

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

/// Each pid's samples in a recording, for failure messages.
fn samples_by_pid(stacks: &ThreadStacks) -> Vec<(i64, i64)> {
    let mut by_pid: HashMap<i64, i64> = HashMap::new();
    for ((pid, _), thread) in stacks {
        *by_pid.entry(*pid).or_default() += thread.iter().map(|(_, count)| count).sum::<i64>();
    }
    let mut sorted: Vec<_> = by_pid.into_iter().collect();
    sorted.sort();
    sorted
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

/// A fixture frame as it must be recorded: `Class.method` from 3.11 (`co_qualname`), the
/// bare name before.
fn fixture_frame(version: (u8, u8), qualname: &str, line: u64) -> PyFrame {
    let name = if version >= (3, 11) {
        qualname
    } else {
        qualname.rsplit('.').next().unwrap_or(qualname)
    };
    (
        name.to_owned(),
        fixture_script().display().to_string(),
        line,
    )
}

/// The fixture frames of `mode`'s hot stack, innermost first: (qualname, line). `inner` must
/// start the Python stack and `outer` end it; `exact` says nothing else may be in between.
struct ExpectedFrames {
    inner: Vec<PyFrame>,
    outer: Vec<PyFrame>,
    exact: bool,
}

fn expected_frames(mode: &str, version: (u8, u8)) -> ExpectedFrames {
    let frame = |qualname: &str, line: u64| fixture_frame(version, qualname, line);
    let module = || frame("<module>", call_line("<module>"));
    let main = || frame("main", call_line(&format!("main:{mode}")));
    let (inner, outer, exact) = match mode {
        "chain" => (
            vec![
                frame("Worker.spin", hot_line(mode)),
                frame("middle", call_line("middle")),
                frame("outer", call_line("outer")),
                main(),
                module(),
            ],
            vec![],
            true,
        ),
        "sorted" => (
            vec![
                frame("key_func", hot_line(mode)),
                frame("sort_driver", call_line("sort_driver")),
                main(),
                module(),
            ],
            vec![],
            true,
        ),
        "ctypes" => (
            vec![
                frame("ctypes_compare", hot_line(mode)),
                frame("ctypes_driver", call_line("ctypes_driver")),
                main(),
                module(),
            ],
            vec![],
            true,
        ),
        "generator" => (
            vec![
                frame("generator", hot_line(mode)),
                frame("consume_generator", call_line("consume_generator")),
                main(),
                module(),
            ],
            vec![],
            true,
        ),
        // asyncio's own frames in between differ per version.
        "asyncio" => (
            vec![
                frame("inner_coroutine", hot_line(mode)),
                frame("outer_coroutine", call_line("outer_coroutine")),
            ],
            vec![
                frame("run_asyncio", call_line("run_asyncio")),
                main(),
                module(),
            ],
            false,
        ),
        "recursion" => {
            let mut inner = vec![frame("recurse", hot_line(mode))];
            inner.extend((1..200).map(|_| frame("recurse", call_line("recurse"))));
            inner.extend([main(), module()]);
            (inner, vec![], true)
        }
        // threading's frames below differ per version; py-spy checks them.
        "threads" => (vec![frame("thread_spin", hot_line(mode))], vec![], false),
        other => panic!("unknown mode {other}"),
    };
    ExpectedFrames {
        inner,
        outer,
        exact,
    }
}

/// The recorded Python frames against the fixture's own call sites.
fn check_python_frames(mode: &str, version: (u8, u8), python: &[PyFrame]) -> Result<(), String> {
    let expected = expected_frames(mode, version);
    let fits = python.starts_with(&expected.inner)
        && python.ends_with(&expected.outer)
        && python.len() >= expected.inner.len() + expected.outer.len()
        && (!expected.exact || python.len() == expected.inner.len() + expected.outer.len());
    if fits {
        return Ok(());
    }
    let show = |frames: &[PyFrame]| {
        frames
            .iter()
            .map(|(name, file, line)| format!("{name} ({file}:{line})"))
            .collect::<Vec<_>>()
            .join("\n    ")
    };
    Err(format!(
        "Python frames differ from the fixture's call sites:\n  recorded\n    {}\n  expected{}\n    {}{}",
        show(python),
        if expected.exact {
            ""
        } else {
            " (innermost, then outermost)"
        },
        show(&expected.inner),
        if expected.outer.is_empty() {
            String::new()
        } else {
            format!("\n    ...\n    {}", show(&expected.outer))
        }
    ))
}

/// The frames of `full` strictly between the Python frames named `inner` and `outer`.
fn frames_between<'a>(full: &'a [Frame], inner: &str, outer: &str) -> Result<&'a [Frame], String> {
    let at = |name: &str| full.iter().position(|f| f.python && short(&f.name) == name);
    match (at(inner), at(outer)) {
        (Some(i), Some(o)) if i < o => Ok(&full[i + 1..o]),
        _ => Err(format!("{inner}/{outer} missing from the full stack")),
    }
}

/// The unqualified name.
fn short(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

fn describe(frames: &[Frame]) -> String {
    frames
        .iter()
        .map(|f| {
            if f.python {
                format!("{} ({}:{})", f.name, f.file, f.line)
            } else {
                format!("{} [{}]", f.name, f.file)
            }
        })
        .collect::<Vec<_>>()
        .join("\n    ")
}

/// The interpreter's own native frames between `key_func` and `sort_driver`: `sorted` is
/// `builtin_sorted`, which sorts with `list.sort` (`list_sort_impl`). A stripped interpreter
/// names neither (they are static functions): there the frames only have to be the
/// interpreter's.
fn check_sorted_natives(interpreter: &Interpreter, full: &[Frame]) -> Result<(), String> {
    let between = frames_between(full, "key_func", "sort_driver")?;
    let natives: Vec<&Frame> = between.iter().filter(|f| f.native).collect();
    let named = |name: &str| natives.iter().any(|f| f.name == name);
    let ok = if interpreter.stripped {
        let interpreter_file = std::fs::canonicalize(&interpreter.path)
            .unwrap_or_else(|_| interpreter.path.clone())
            .display()
            .to_string();
        // builtin_sorted and list_sort at least.
        natives
            .iter()
            .filter(|f| f.file == interpreter_file)
            .count()
            >= 2
    } else {
        named("builtin_sorted") && named("list_sort_impl")
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the native frames between key_func and sort_driver are not sorted's:\n    {}",
            describe(between)
        ))
    }
}

/// `_ctypes` calling libc's `qsort` through libffi's `ffi_call`, and the comparison coming
/// back through libffi's closure trampoline and `_ctypes`, between `ctypes_compare` and
/// `ctypes_driver` (the exported names `ffi_call` and `qsort_r`/`__qsort_r` are there even in
/// stripped files).
fn check_ctypes_natives(full: &[Frame]) -> Result<(), String> {
    let between = frames_between(full, "ctypes_compare", "ctypes_driver")?;
    let from = |module: &str| {
        between
            .iter()
            .any(|f| f.native && file_name(&f.file).starts_with(module))
    };
    let named = |wanted: &str| between.iter().any(|f| f.native && f.name.contains(wanted));
    if from("libffi.so")
        && from("libc.so")
        && from("_ctypes")
        && named("ffi_call")
        && named("qsort")
    {
        Ok(())
    } else {
        Err(format!(
            "no _ctypes, libffi and libc frames between ctypes_compare and ctypes_driver:\n    {}",
            describe(between)
        ))
    }
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Every `_PyEval_EvalFrameDefault` frame must have been replaced by the Python frames it ran.
fn check_no_eval_frames(full: &[Frame]) -> Result<(), String> {
    match full
        .iter()
        .find(|f| f.native && f.name.starts_with("_PyEval_EvalFrameDefault"))
    {
        Some(frame) => Err(format!(
            "{} is left in a stack with Python frames:\n    {}",
            frame.name,
            describe(full)
        )),
        None => Ok(()),
    }
}

/// What each mode's dominant stack must look like, beyond agreeing with py-spy.
fn check_mode(
    interpreter: &Interpreter,
    mode: &str,
    python: &[PyFrame],
    full: &[Frame],
) -> Result<(), String> {
    check_python_frames(mode, interpreter.version, python)?;
    check_no_eval_frames(full)?;
    match mode {
        "sorted" => check_sorted_natives(interpreter, full),
        "ctypes" => check_ctypes_natives(full),
        _ => Ok(()),
    }
}

/// Records all fixtures of one interpreter at once and checks every sampled thread.
fn check_interpreter(
    interpreter: &Interpreter,
    py_spy: Option<&Path>,
    scratch: &Scratch,
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut fixtures = Vec::new();
    for mode in MODES {
        match Fixture::start(&interpreter.path, mode) {
            Ok(fixture) => fixtures.push(fixture),
            Err(error) => failures.push(error),
        }
    }
    let pids: Vec<String> = fixtures.iter().map(|f| f.pid().to_string()).collect();
    let output = scratch.path("python.pb.gz");
    let (stacks, _) = record_threads(&pids.join(","), "3", &output);
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
            if let Err(error) = check_mode(interpreter, fixture.mode, &python, &full) {
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
    for interpreter in interpreters() {
        // py-spy 0.4 finds no interpreter in free-threaded builds: there the fixture's own
        // expectations (names, lines from its markers, callers) are the check.
        let oracle = py_spy.as_deref().filter(|_| !interpreter.free_threaded);
        for failure in check_interpreter(&interpreter, oracle, &scratch) {
            failures.push(format!("[{}] {failure}", interpreter.label));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A Python process that starts while the profiler runs gets Python frames within 2 seconds
/// (of its CPU time: the same on a quiet machine, longer on a busy one),
/// on a shared libpython (pyenv 3.12), a static stripped executable (Debian's 3.11) and the
/// `_Py_DebugOffsets` path (sid's 3.14).
#[test]
fn python_process_started_after_the_profiler_gets_python_frames_within_two_seconds() {
    let _guard = exclusive();
    let interpreters: Vec<Interpreter> = pyenv_interpreter("3.12.1")
        .into_iter()
        .chain(debian_python311())
        .chain(sid_python314())
        .collect();
    let scratch = Scratch::new("python-late");
    let output = scratch.path("late.folded");
    let output_arg = output.to_str().expect("utf-8 path");
    let recorder = Recording::until_stopped(&["--format", "folded", "--output", output_arg]);
    let mut fixtures = Vec::new();
    for interpreter in &interpreters {
        let started = Instant::now();
        let fixture = Fixture::start(&interpreter.path, "chain").expect("fixture starts");
        // Its first 2 s: of CPU time, which on a busy machine take longer than 2 s of wall
        // time (at most 30 s).
        while cpu_time_so_far(fixture.pid()).is_some_and(|cpu| cpu < Duration::from_secs(2))
            && started.elapsed() < Duration::from_secs(30)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        // Stopped, not killed: every sample it has is from its first 2 s, and its memory is
        // still there for the symbolizer.
        send_signal(fixture.pid(), SIGSTOP);
        fixtures.push(fixture);
    }
    let log = recorder.stop();
    drop(fixtures);
    let folded = std::fs::read_to_string(&output).expect("folded output");
    let hot = format!(
        "Worker.spin ({}:{})",
        fixture_script().display(),
        hot_line("chain")
    );
    let mut failures = Vec::new();
    for interpreter in &interpreters {
        let comm = interpreter
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("interpreter file name");
        let with_python: u64 = parse_folded(&folded)
            .iter()
            .filter(|stack| stack.frames[0] == comm && stack.frames.contains(&hot))
            .map(|stack| stack.count)
            .sum();
        if with_python < 5 {
            failures.push(format!(
                "[{}] only {with_python} samples with `{hot}` in the first 2 s (CPU) of the process",
                interpreter.label
            ));
        }
    }
    assert!(failures.is_empty(), "{}\n{log}", failures.join("\n"));
}

/// Runs `profiler agent --pid PID` with profile files in `scratch` for a few intervals;
/// returns its /metrics text, its log and every sample of `pid` it wrote.
fn agent_run(pid: u32, scratch: &Scratch) -> (String, String, Vec<StackSample>) {
    let dir = scratch.path("profiles");
    std::fs::create_dir_all(&dir).expect("profile dir");
    let pid_arg = pid.to_string();
    let mut agent = Agent::start(&[
        "--pid",
        &pid_arg,
        "--interval",
        "1",
        "--no-cache",
        "--output-dir",
        dir.to_str().expect("utf-8 path"),
    ]);
    agent.wait_for_intervals(3, Duration::from_secs(60));
    let metrics = Client::new(agent.http_addr()).get("/metrics").text();
    let (status, log) = agent.stop();
    assert!(status.success(), "the agent failed ({status}):\n{log}");
    let mut samples = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("profile dir") {
        let path = entry.expect("dir entry").path();
        if path.to_string_lossy().ends_with(".pb.gz") {
            samples.extend(
                stack_samples(&decode_pprof(&path))
                    .into_iter()
                    .filter(|s| s.pid == Some(i64::from(pid))),
            );
        }
    }
    (metrics, log, samples)
}

const DISABLED_METRIC: &str = "profiler_python_processes_disabled_total";

/// pyenv 3.12's shared library, its prefix and include directory.
fn pyenv312_embedding() -> Option<(PathBuf, PathBuf, PathBuf)> {
    let Some(python) = pyenv_python("3.12.1", "python3.12") else {
        skip_or_fail("pyenv Python 3.12.1 is not installed");
        return None;
    };
    let prefix = python
        .parent()
        .and_then(Path::parent)
        .expect("pyenv layout")
        .to_path_buf();
    let library = prefix.join("lib/libpython3.12.so.1.0");
    if !library.is_file() {
        skip_or_fail("pyenv 3.12.1 has no shared libpython (built without --enable-shared)");
        return None;
    }
    let include = prefix.join("include/python3.12");
    Some((prefix, library, include))
}

/// `tests/fixtures/python/embed_python.c`, built against pyenv 3.12's headers.
fn embed_fixture(include: &Path) -> PathBuf {
    let include = format!("-I{}", include.display());
    build_fixture(
        "embed_python",
        "gcc",
        &[
            "-O2",
            "-g",
            "-fno-omit-frame-pointer",
            "-fno-optimize-sibling-calls",
            &include,
        ],
        &["python/embed_python.c"],
        &["-ldl"],
    )
}

fn embed_command(program: &Path, mode: &str, prefix: &Path, library: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .arg(mode)
        .arg(library)
        .arg(fixture_script())
        .arg("chain")
        .env("PYTHONHOME", prefix);
    command
}

/// A process whose thread states do not hold its threads' ids (an embedding program
/// overwrites them, as a wrong layout would read them) fails the self-check: Python frames off
/// with the reason logged and counted, native stacks kept.
#[test]
fn a_layout_that_does_not_match_keeps_native_stacks() {
    let _guard = exclusive();
    let Some((prefix, library, include)) = pyenv312_embedding() else {
        return;
    };
    let program = embed_fixture(&include);
    let fixture = Fixture::spawn(
        embed_command(&program, "corrupt", &prefix, &library),
        "corrupt",
        false,
    )
    .expect("the embedding fixture runs");
    let scratch = Scratch::new("python-mismatch");
    let (metrics, log, samples) = agent_run(fixture.pid(), &scratch);
    assert!(
        log.lines()
            .any(|line| line.contains(&format!("pid={}", fixture.pid()))
                && line.contains("the 3.12 layout does not match: no thread state's thread_id")),
        "no mismatch reason logged for pid {}:\n{log}",
        fixture.pid()
    );
    assert_eq!(
        metric_value(&metrics, DISABLED_METRIC),
        Some(1.0),
        "{DISABLED_METRIC} on /metrics:\n{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "profiler_python_processes"),
        Some(0.0)
    );
    let python_frames = samples
        .iter()
        .filter(|s| s.frames.iter().any(|f| f.contains("Worker.spin")))
        .count();
    assert_eq!(python_frames, 0, "{}", top_stacks(&samples, 10));
    assert!(
        samples.iter().any(
            |s| find_chain(&s.frames, &["main", "run_embedded"]).is_some()
                && s.frames
                    .iter()
                    .any(|f| f.starts_with("_PyEval_EvalFrameDefault"))
        ),
        "native stacks of the process are missing:\n{}",
        top_stacks(&samples, 10)
    );
}

/// An embedding program that loads libpython while being profiled gets Python frames on top
/// of its own native frames.
#[test]
fn libpython_loaded_late_by_an_embedding_program_gets_python_frames() {
    let _guard = exclusive();
    let Some((prefix, library, include)) = pyenv312_embedding() else {
        return;
    };
    let program = embed_fixture(&include);
    let mut command = embed_command(&program, "late", &prefix, &library);
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the embedding fixture");
    let stdout = child.stdout.take().expect("stdout");
    let running = integration_tests::Running { child };
    let (line_tx, line_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = line_tx.send(line);
        }
    });
    let wait_for = |wanted: &str| loop {
        match line_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) if line == wanted => break,
            Ok(_) => {}
            Err(_) => panic!("the embedding fixture never printed {wanted}"),
        }
    };
    wait_for("waiting");
    let scratch = Scratch::new("python-embedded");
    let output = scratch.path("embedded.pb.gz");
    let pid = running.pid().to_string();
    let recorder = Recording::until_stopped(&[
        "--pid",
        &pid,
        "--output",
        output.to_str().expect("utf-8 path"),
    ]);
    // Native samples first, so the process is known without libpython.
    std::thread::sleep(Duration::from_secs(1));
    send_signal(running.pid(), SIGUSR1);
    wait_for("ready");
    std::thread::sleep(Duration::from_secs(4));
    let log = recorder.stop();
    let profile = decode_pprof(&output);
    let samples = stack_samples(&profile);
    assert!(
        samples
            .iter()
            .any(|s| find_chain(&s.frames, &["main", "wait_for_signal"]).is_some()),
        "no sample before libpython was loaded:\n{}{log}",
        top_stacks(&samples, 10)
    );
    let (python, full, count) = thread_stacks(&profile)
        .into_iter()
        .filter(|((p, _), _)| p.to_string() == pid)
        .map(|(_, stacks)| dominant_stack(&stacks))
        .max_by_key(|(_, _, count)| *count)
        .expect("samples of the fixture");
    // The fixture's own frames, then runpy's (frozen in 3.12: lines of its own), then line 3
    // of the `<string>` that run_embedded gave PyRun_SimpleString (`runpy.run_path(...)`).
    let expected = expected_frames("chain", (3, 12));
    let names: Vec<&str> = python.iter().map(|(name, _, _)| name.as_str()).collect();
    assert!(
        python.starts_with(&expected.inner)
            && names[expected.inner.len()..]
                == ["_run_code", "_run_module_code", "run_path", "<module>"]
            && python.last() == Some(&("<module>".to_owned(), "<string>".to_owned(), 3)),
        "Python frames of the embedded interpreter ({count} samples):\n  {python:?}\n{log}"
    );
    check_no_eval_frames(&full).expect("eval frames replaced");
    // Root first: the embedding program's frames are below the outermost Python frame.
    let names: Vec<&str> = full.iter().rev().map(|f| f.name.as_str()).collect();
    let main = names.iter().position(|n| *n == "main");
    let embedded = names.iter().position(|n| *n == "run_embedded");
    let outermost_python = full.iter().rev().position(|f| f.python);
    assert!(
        matches!((main, embedded, outermost_python), (Some(m), Some(e), Some(p)) if m < e && e < p),
        "main/run_embedded are not below the Python frames:\n    {}",
        describe(&full)
    );
}

/// A Python process in its own PID namespace (as in a container): its `native_thread_id`s are
/// that namespace's numbers, not the kernel's, yet each of its threads is found.
#[test]
fn python_in_another_pid_namespace_gets_python_frames() {
    let _guard = exclusive();
    let scratch = Scratch::new("python-pidns");
    let mut fixtures = Vec::new();
    let mut failures = Vec::new();
    let interpreters = interpreters();
    for interpreter in &interpreters {
        let mut command = Command::new("unshare");
        command
            .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
            .arg(&interpreter.path)
            .arg(fixture_script())
            .arg("chain");
        match Fixture::spawn(command, "chain", true) {
            Ok(fixture) => fixtures.push((interpreter, fixture)),
            Err(error) => failures.push(format!("[{}] {error}", interpreter.label)),
        }
    }
    for (interpreter, fixture) in &fixtures {
        let status = std::fs::read_to_string(format!("/proc/{}/status", fixture.pid()))
            .expect("status of the namespaced fixture");
        let nspid = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .unwrap_or_default();
        assert_eq!(
            nspid.split_whitespace().last(),
            Some("1"),
            "[{}] the fixture is not pid 1 of a new namespace: NSpid {nspid}",
            interpreter.label
        );
    }
    // Ten busy fixtures share two CPUs with whatever else runs: one may get (almost) no CPU in
    // a 3 s recording. Each fixture's CPU time is read from the moment the sampler is attached
    // to the moment the recording is stopped, so a fixture without samples fails only when it
    // ran in that very window (each 10 ms of CPU is a sample on average at 100 Hz); one that
    // was starved in it is recorded again, with the others that still lack a verdict.
    let mut pending: Vec<usize> = (0..fixtures.len()).collect();
    let mut logs = String::new();
    for attempt in 1..=3 {
        if pending.is_empty() {
            break;
        }
        let pids: Vec<String> = pending
            .iter()
            .map(|&i| fixtures[i].1.pid().to_string())
            .collect();
        let output = scratch.path(&format!("pidns-{attempt}.pb.gz"));
        let recorder = Recording::until_stopped(&[
            "--pid",
            &pids.join(","),
            "--output",
            output.to_str().expect("utf-8 path"),
        ]);
        let cpu_before: Vec<Option<Duration>> = pending
            .iter()
            .map(|&i| cpu_time_so_far(fixtures[i].1.pid()))
            .collect();
        std::thread::sleep(Duration::from_secs(3));
        let cpu_in_window: Vec<Option<Duration>> = pending
            .iter()
            .zip(cpu_before)
            .map(|(&i, before)| {
                before
                    .zip(cpu_time_so_far(fixtures[i].1.pid()))
                    .map(|(before, after)| after.saturating_sub(before))
            })
            .collect();
        logs.push_str(&recorder.stop());
        let stacks = thread_stacks(&decode_pprof(&output));
        let mut starved = Vec::new();
        for (&i, cpu) in pending.iter().zip(cpu_in_window) {
            let (interpreter, fixture) = &fixtures[i];
            let pid = i64::from(fixture.pid());
            let dominant = stacks
                .iter()
                .filter(|((p, _), _)| *p == pid)
                .map(|(_, thread)| dominant_stack(thread))
                .max_by_key(|(_, _, count)| *count);
            let result = match (dominant, cpu) {
                (Some((python, full, _)), _) => check_mode(interpreter, "chain", &python, &full),
                (None, None) => Err("no samples: the fixture exited".to_owned()),
                (None, Some(cpu)) if cpu < Duration::from_millis(200) && attempt < 3 => {
                    starved.push(i);
                    Ok(())
                }
                (None, Some(cpu)) => Err(format!(
                    "no samples in {} ms of CPU time while the sampler was attached \
                     (attempt {attempt}; the recording's samples by pid: {:?})",
                    cpu.as_millis(),
                    samples_by_pid(&stacks)
                )),
            };
            if let Err(error) = result {
                failures.push(format!("[{}] pid {pid}: {error}", interpreter.label));
            }
        }
        pending = starved;
    }
    assert!(failures.is_empty(), "{}\n{logs}", failures.join("\n"));
}

/// CPython pushes new thread states at the head of its list, so the main thread's is the last:
/// with 300 more threads it is found only by a scan longer than 300 (the BPF bound is
/// `MAX_PYTHON_THREAD_SCAN`).
#[test]
fn the_main_thread_behind_300_thread_states_gets_python_frames() {
    let _guard = exclusive();
    let Some(interpreter) = pyenv_interpreter("3.12.1") else {
        return;
    };
    let threads = 300;
    assert!(threads < profiler_common::MAX_PYTHON_THREAD_SCAN as usize);
    let mut command = Command::new(&interpreter.path);
    command
        .arg(fixture_script())
        .arg("chain")
        .arg(threads.to_string());
    let fixture = Fixture::spawn(command, "chain", false).expect("fixture starts");
    let tasks = std::fs::read_dir(format!("/proc/{}/task", fixture.pid()))
        .expect("tasks")
        .count();
    assert_eq!(tasks, threads + 1);
    let scratch = Scratch::new("python-threads");
    let output = scratch.path("threads.pb.gz");
    let pid = fixture.pid().to_string();
    let (stacks, log) = record_threads(&pid, "2", &output);
    let main = stacks
        .get(&(i64::from(fixture.pid()), i64::from(fixture.pid())))
        .expect("samples of the main thread");
    let (python, full, _) = dominant_stack(main);
    check_mode(&interpreter, "chain", &python, &full)
        .unwrap_or_else(|error| panic!("main thread: {error}\n{log}"));
}
