//! The interpreter matrix: run `tests/fixtures/python/stacks.py` under every interpreter
//! present (pyenv 3.8–3.13, Debian's static python3.11, Debian sid's 3.14 unpacked under
//! `.tools/python3.14` by `cargo xtask setup`), stop it, and check detection, the userspace
//! walk and, when installed, py-spy's view of the same stopped process.
//!
//! Missing interpreters or py-spy are skipped with a message unless
//! `PROFILER_REQUIRE_EXTERNAL=1`, which turns a skip into a failure.
use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use super::super::{
    code::instruction_byte_offset,
    detect::{PythonProcess, VersionSource, detect_python},
    layout::{EntryMarker, FrameAnchor, layout_for},
    memory::ProcMemory,
    py_spy::find_py_spy,
    walk::{ChainEnd, PyThreadStack, walk_process},
};
use crate::{
    model::{Pid, ProcessInfo},
    process::{files::FileCache, read_process},
};

const PYENV_VERSIONS: &[&str] = &["3.8.18", "3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0"];
const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";
/// Where `cargo xtask setup` unpacks Debian sid's CPython 3.14 (xtask/src/python314.rs).
const SID_PYTHON: &str = ".tools/python3.14/usr/bin/python3.14";
/// Where `cargo xtask setup` builds free-threaded 3.13t and 3.14t
/// (xtask/src/python_free_threaded.rs).
const FREE_THREADED_PYTHONS: &[&str] = &[
    ".tools/python3.13t/bin/python3.13t",
    ".tools/python3.14t/bin/python3.14t",
];

fn require_external() -> bool {
    std::env::var("PROFILER_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1")
}

fn skip(what: &str) {
    assert!(
        !require_external(),
        "{what} (PROFILER_REQUIRE_EXTERNAL=1 forbids skipping)"
    );
    eprintln!("skipped: {what}");
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn fixture_path() -> PathBuf {
    workspace_root().join("tests/fixtures/python/stacks.py")
}

/// The interpreters to test: (label, path).
fn interpreters() -> Vec<(String, PathBuf)> {
    let pyenv_root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".pyenv")));
    let mut found = Vec::new();
    for version in PYENV_VERSIONS {
        let minor: String = version.split('.').take(2).collect::<Vec<_>>().join(".");
        let path = pyenv_root.as_ref().map(|root| {
            root.join("versions")
                .join(version)
                .join("bin")
                .join(format!("python{minor}"))
        });
        match path {
            Some(path) if path.is_file() => found.push((format!("pyenv {version}"), path)),
            _ => skip(&format!("pyenv Python {version} not installed")),
        }
    }
    match std::fs::canonicalize(DEBIAN_PYTHON) {
        Ok(path) if path == Path::new(DEBIAN_PYTHON) => {
            found.push(("debian 3.11".to_owned(), path));
        }
        _ => skip(&format!(
            "{DEBIAN_PYTHON} (Debian's static build) not present"
        )),
    }
    let sid = workspace_root().join(SID_PYTHON);
    if sid.is_file() {
        found.push(("debian sid 3.14".to_owned(), sid));
    } else {
        skip("Python 3.14 is not unpacked under .tools (`cargo xtask setup` does it)");
    }
    for path in FREE_THREADED_PYTHONS {
        let path = workspace_root().join(path);
        match path.file_name().and_then(|name| name.to_str()) {
            Some(name) if path.is_file() => found.push((format!("free-threaded {name}"), path)),
            _ => skip(&format!(
                "{} is not built (`cargo xtask setup` does it)",
                path.display()
            )),
        }
    }
    found
}

fn hot_line(marker: &str) -> u32 {
    let text = std::fs::read_to_string(fixture_path()).expect("fixture");
    let index = text
        .lines()
        .position(|line| line.contains(marker))
        .unwrap_or_else(|| panic!("no {marker} in the fixture"));
    index as u32 + 1
}

/// A fixture process, killed on drop.
struct Fixture {
    child: Child,
    /// ("lasti", co_name, byte offset) lines printed before "ready": the instruction each
    /// caller frame is suspended at, innermost first, as CPython itself reports it.
    caller_offsets: Vec<(String, i64)>,
}

impl Fixture {
    fn start(python: &Path, mode: &str, threads: usize) -> Result<Fixture, String> {
        let mut child = Command::new(python)
            .arg(fixture_path())
            .arg(mode)
            .arg(threads.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", python.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut fixture = Fixture {
            child,
            caller_offsets: Vec::new(),
        };
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut offsets = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line == "ready" {
                    let _ = ready_tx.send(std::mem::take(&mut offsets));
                } else if let ["lasti", name, offset] = line.split(' ').collect::<Vec<_>>()[..]
                    && let Ok(offset) = offset.parse()
                {
                    offsets.push((name.to_owned(), offset));
                }
            }
        });
        // Generous: under CPU contention the free-threaded 3.13t spins on `sched_yield` at
        // start-up, which took 32-42 s to reach "ready" in asyncio mode at load average 8 on
        // 2 CPUs (0.2 s on a quiet machine).
        fixture.caller_offsets = ready_rx
            .recv_timeout(Duration::from_secs(180))
            .map_err(|_| format!("{mode}: the fixture never printed ready"))?;
        // Let the main thread enter its hot loop after the print.
        std::thread::sleep(Duration::from_millis(150));
        Ok(fixture)
    }

    fn pid(&self) -> Pid {
        Pid(self.child.id())
    }

    /// SIGSTOP, then wait until every thread is stopped.
    fn stop(&self) -> Result<(), String> {
        // SAFETY: kill(2) on our own child's pid.
        if unsafe { libc::kill(self.child.id() as i32, libc::SIGSTOP) } != 0 {
            return Err("SIGSTOP failed".into());
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if task_ids(self.pid()).iter().all(|tid| {
                std::fs::read_to_string(format!("/proc/{}/task/{tid}/stat", self.pid()))
                    .ok()
                    .and_then(|stat| {
                        let after = stat.rfind(')')?;
                        stat.get(after + 2..after + 3).map(|s| s == "T")
                    })
                    .unwrap_or(false)
            }) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Err("the fixture did not stop".into())
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn task_ids(pid: Pid) -> BTreeSet<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn interpreter_version(python: &Path) -> Result<(u8, u8, u8), String> {
    let out = Command::new(python)
        .args(["-c", "import sys; print('%d %d %d' % sys.version_info[:3])"])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let parts: Vec<u8> = text
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    match parts[..] {
        [a, b, c] => Ok((a, b, c)),
        _ => Err(format!("cannot run {}: {text}", python.display())),
    }
}

/// What a frame must be: (qualname, file is the fixture, line when checked).
struct Expected<'a> {
    qualname: &'a str,
    line: Option<u32>,
}

fn fixture_frame(qualname: &str, line: Option<u32>) -> Expected<'_> {
    Expected { qualname, line }
}

/// Checks one thread's frames against `innermost` (from the top) and `outermost` (from the
/// bottom; all fixture frames).
fn check_stack(
    stack: &PyThreadStack,
    innermost: &[Expected<'_>],
    outermost: &[Expected<'_>],
) -> Result<(), String> {
    let fixture = fixture_path();
    let fixture = fixture.to_str().expect("utf-8 path");
    let describe = || {
        stack
            .frames
            .iter()
            .map(|f| match &f.info {
                Ok(info) => format!("{}:{}:{:?}", info.qualname, info.filename, info.line),
                Err(e) => format!("<{e}>"),
            })
            .collect::<Vec<_>>()
            .join("\n  ")
    };
    if stack.end != ChainEnd::Complete {
        return Err(format!(
            "chain ended with {:?}:\n  {}",
            stack.end,
            describe()
        ));
    }
    if stack.frames.len() < innermost.len() + outermost.len() {
        return Err(format!("too few frames:\n  {}", describe()));
    }
    let bottom = stack.frames.len() - outermost.len();
    let pairs = innermost
        .iter()
        .zip(&stack.frames)
        .chain(outermost.iter().zip(&stack.frames[bottom..]));
    for (expected, frame) in pairs {
        let info = frame
            .info
            .as_ref()
            .map_err(|e| format!("{e}:\n  {}", describe()))?;
        let line_ok = expected.line.is_none_or(|line| info.line == Some(line));
        if &*info.qualname != expected.qualname || &*info.filename != fixture || !line_ok {
            return Err(format!(
                "expected {} (line {:?}) in the fixture, got:\n  {}",
                expected.qualname,
                expected.line,
                describe()
            ));
        }
    }
    Ok(())
}

/// What one interpreter is expected to show for `mode`; the checks return a description of
/// the first mismatch.
type Check = fn(&Scenario, &[PyThreadStack]) -> Result<(), String>;

struct Scenario {
    threads: usize,
    version: (u8, u8, u8),
    pid: Pid,
}

impl Scenario {
    /// `Class.method` from 3.11 (co_qualname), `method` before.
    fn qualname<'a>(&self, qualified: &'a str) -> &'a str {
        if self.version.1 >= 11 {
            qualified
        } else {
            qualified.rsplit('.').next().unwrap_or(qualified)
        }
    }
}

fn main_thread(stacks: &[PyThreadStack]) -> Result<&PyThreadStack, String> {
    // The main thread state is the oldest, so the last in the list.
    stacks.last().ok_or_else(|| "no thread states".to_owned())
}

fn check_chain(s: &Scenario, stacks: &[PyThreadStack]) -> Result<(), String> {
    let main = main_thread(stacks)?;
    check_stack(
        main,
        &[
            fixture_frame(s.qualname("Worker.spin"), Some(hot_line("# HOT:chain"))),
            fixture_frame("middle", None),
            fixture_frame("outer", None),
            fixture_frame("main", None),
            fixture_frame("<module>", None),
        ],
        &[],
    )?;
    if stacks.len() != s.threads + 1 {
        return Err(format!(
            "{} thread states, expected {}",
            stacks.len(),
            s.threads + 1
        ));
    }
    for thread in &stacks[..stacks.len() - 1] {
        check_stack(
            thread,
            &[fixture_frame("sleeper", Some(hot_line("# SLEEP")))],
            &[],
        )?;
    }
    if s.version.1 >= 11 {
        let native: BTreeSet<u32> = stacks.iter().filter_map(|t| t.native_thread_id).collect();
        let tasks = task_ids(s.pid);
        if native != tasks {
            return Err(format!(
                "native thread ids {native:?} != /proc tasks {tasks:?}"
            ));
        }
    }
    Ok(())
}

fn check_sorted(_: &Scenario, stacks: &[PyThreadStack]) -> Result<(), String> {
    check_stack(
        main_thread(stacks)?,
        &[
            fixture_frame("key_func", Some(hot_line("# HOT:sorted"))),
            fixture_frame("sort_driver", None),
            fixture_frame("main", None),
            fixture_frame("<module>", None),
        ],
        &[],
    )
}

fn check_ctypes(_: &Scenario, stacks: &[PyThreadStack]) -> Result<(), String> {
    check_stack(
        main_thread(stacks)?,
        &[
            fixture_frame("ctypes_compare", Some(hot_line("# HOT:ctypes"))),
            fixture_frame("ctypes_driver", None),
            fixture_frame("main", None),
            fixture_frame("<module>", None),
        ],
        &[],
    )
}

fn check_generator(_: &Scenario, stacks: &[PyThreadStack]) -> Result<(), String> {
    check_stack(
        main_thread(stacks)?,
        &[
            fixture_frame("generator", Some(hot_line("# HOT:generator"))),
            fixture_frame("consume_generator", None),
            fixture_frame("main", None),
            fixture_frame("<module>", None),
        ],
        &[],
    )
}

fn check_asyncio(_: &Scenario, stacks: &[PyThreadStack]) -> Result<(), String> {
    // asyncio's own frames in between differ per version.
    check_stack(
        main_thread(stacks)?,
        &[
            fixture_frame("inner_coroutine", Some(hot_line("# HOT:asyncio"))),
            fixture_frame("outer_coroutine", None),
        ],
        &[
            fixture_frame("run_asyncio", None),
            fixture_frame("main", None),
            fixture_frame("<module>", None),
        ],
    )
}

fn check_recursion(_: &Scenario, stacks: &[PyThreadStack]) -> Result<(), String> {
    let main = main_thread(stacks)?;
    let mut expected = vec![fixture_frame("recurse", Some(hot_line("# HOT:recursion")))];
    expected.extend((1..200).map(|_| fixture_frame("recurse", None)));
    expected.extend([fixture_frame("main", None), fixture_frame("<module>", None)]);
    if main.frames.len() != expected.len() {
        return Err(format!(
            "{} frames, expected {}",
            main.frames.len(),
            expected.len()
        ));
    }
    check_stack(main, &expected, &[])
}

fn check_detection(
    process: &PythonProcess,
    snapshot: &ProcessInfo,
    version: (u8, u8, u8),
    free_threaded: bool,
) -> Result<(), String> {
    if process.version.0 != version.0 || process.version.1 != version.1 {
        return Err(format!(
            "detected {:?}, expected {version:?}",
            process.version
        ));
    }
    if process.version_source != VersionSource::FileName && process.version != version {
        return Err(format!(
            "detected {:?} from {:?}, expected {version:?}",
            process.version, process.version_source
        ));
    }
    if process.eval_frame_ranges.is_empty() {
        return Err("no _PyEval_EvalFrameDefault range".into());
    }
    // The eval loop must land in an executable mapping of the interpreter file: checks the
    // load bias (PIE executable, shared library).
    for range in &process.eval_frame_ranges {
        let in_interpreter = snapshot.mapping_for(range.start).is_some_and(|m| {
            m.file
                .as_ref()
                .is_some_and(|f| f.id == process.interpreter_file.id)
                && range.end <= m.end
        });
        if !in_interpreter {
            return Err(format!(
                "eval range {range:x?} outside the interpreter's code"
            ));
        }
    }
    match layout_for(version.0, version.1) {
        Some(row) if *row != process.layout => {
            Err(format!("layout {:?} != table row {row:?}", process.layout))
        }
        Some(_) => Ok(()),
        // 3.13 and 3.14 from _Py_DebugOffsets: the values docs/python-layouts.md §3.1 and §5 list (from
        // DWARF for 3.13, from Debian's 3.14 for 3.14); free-threaded ones from the DWARF of
        // the 3.13t/3.14t builds (`ptype/o` in gdb): a 32-byte object header, and in 3.14t
        // `tlbc_index` before the frame's owner and `co_tlbc` before the bytecode.
        None if version.1 == 13 || version.1 == 14 => {
            let layout = &process.layout;
            let got = (
                layout.runtime_interpreters_head,
                layout.interp_threads_head,
                layout.tstate_frame,
                layout.tstate_thread_id,
                layout.tstate_native_thread_id,
                layout.frame_instruction,
                layout.entry_marker,
                layout.code_bytecode,
                layout.unicode_ascii_data,
                layout.stackref_tag_mask,
                layout.free_threaded,
                layout.code_thread_bytecode,
            );
            let want = match (version.1, free_threaded) {
                (13, false) => (
                    632,
                    7344,
                    FrameAnchor::ThreadCurrentFrame { offset: 72 },
                    152,
                    Some(160),
                    56,
                    EntryMarker::ShimOwner {
                        offset: 70,
                        value: 3,
                    },
                    Some(200),
                    40,
                    0,
                    false,
                    None,
                ),
                (13, true) => (
                    632,
                    7344,
                    FrameAnchor::ThreadCurrentFrame { offset: 72 },
                    152,
                    Some(160),
                    56,
                    EntryMarker::ShimOwner {
                        offset: 70,
                        value: 3,
                    },
                    Some(216),
                    56,
                    0,
                    true,
                    None,
                ),
                (_, false) => (
                    808,
                    7344,
                    FrameAnchor::ThreadCurrentFrame { offset: 72 },
                    152,
                    Some(160),
                    56,
                    EntryMarker::ShimOwner {
                        offset: 74,
                        value: 3,
                    },
                    Some(208),
                    40,
                    3,
                    false,
                    None,
                ),
                (_, true) => (
                    808,
                    7344,
                    FrameAnchor::ThreadCurrentFrame { offset: 72 },
                    152,
                    Some(160),
                    56,
                    EntryMarker::ShimOwner {
                        offset: 78,
                        value: 3,
                    },
                    Some(232),
                    56,
                    3,
                    true,
                    Some(224),
                ),
            };
            if got == want {
                Ok(())
            } else {
                Err(format!("3.{} layout {got:?} != {want:?}", version.1))
            }
        }
        None => Err(format!("no expectations for {version:?}")),
    }
}

/// py-spy's frames of every thread of the stopped process, compared with ours.
fn compare_with_py_spy(py_spy: &Path, pid: Pid, stacks: &[PyThreadStack]) -> Result<(), String> {
    let out = Command::new(py_spy)
        .args(["dump", "--json", "--nonblocking", "--pid"])
        .arg(pid.0.to_string())
        .output()
        .map_err(|e| format!("py-spy: {e}"))?;
    let threads: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "py-spy output: {e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let threads = threads.as_array().ok_or("py-spy: not an array")?;
    if threads.len() != stacks.len() {
        return Err(format!(
            "py-spy sees {} threads, we see {}",
            threads.len(),
            stacks.len()
        ));
    }
    for thread in threads {
        let thread_id = thread["thread_id"].as_u64().ok_or("py-spy: thread_id")?;
        let ours = stacks
            .iter()
            .find(|s| s.thread_id == thread_id)
            .ok_or_else(|| format!("py-spy thread {thread_id:#x} not found by the walker"))?;
        let theirs: Vec<(String, String, u64)> = thread["frames"]
            .as_array()
            .ok_or("py-spy: frames")?
            .iter()
            .map(|f| {
                (
                    f["name"].as_str().unwrap_or_default().to_owned(),
                    f["filename"].as_str().unwrap_or_default().to_owned(),
                    f["line"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        let mine: Vec<(String, String, u64)> = ours
            .frames
            .iter()
            .map(|f| match &f.info {
                Ok(info) => (
                    info.qualname.to_string(),
                    info.filename.to_string(),
                    u64::from(info.line.unwrap_or(0)),
                ),
                Err(e) => (format!("<{e}>"), String::new(), 0),
            })
            .collect();
        if mine != theirs {
            return Err(format!(
                "thread {thread_id:#x} differs from py-spy:\n ours   {mine:?}\n py-spy {theirs:?}"
            ));
        }
    }
    Ok(())
}

/// Runs `mode` under every interpreter and fails with every mismatch found.
fn run_matrix(mode: &'static str, threads: usize, check: Check) {
    let py_spy = find_py_spy(&workspace_root());
    if py_spy.is_none() {
        skip("py-spy not installed under .tools/py-spy (`cargo xtask setup` installs it)");
    }
    let mut failures = Vec::new();
    for (label, python) in interpreters() {
        let result = (|| -> Result<String, String> {
            let version = interpreter_version(&python)?;
            let fixture = Fixture::start(&python, mode, threads)?;
            fixture.stop()?;
            let pid = fixture.pid();
            let mut files = FileCache::new(64);
            let snapshot =
                read_process(pid, Path::new(&format!("/proc/{pid}")), "host", &mut files)
                    .map_err(|e| e.to_string())?;
            let process = detect_python(&snapshot.info).map_err(|e| format!("detect: {e}"))?;
            let free_threaded = python
                .file_name()
                .is_some_and(|name| name.to_string_lossy().ends_with('t'));
            check_detection(&process, &snapshot.info, version, free_threaded)?;
            let mem = ProcMemory::open(pid).map_err(|e| e.to_string())?;
            let stacks = walk_process(&mem, &process).map_err(|e| e.to_string())?;
            check(
                &Scenario {
                    threads,
                    version,
                    pid,
                },
                &stacks,
            )?;
            if mode == "chain" {
                check_caller_offsets(&process, &stacks, &fixture.caller_offsets)?;
            }
            // py-spy (0.4) does not read free-threaded builds ("Failed to find a python
            // interpreter"): there the fixture's own expectations are the only check.
            let py_spy = py_spy.as_ref().filter(|_| !free_threaded);
            if let Some(py_spy) = py_spy {
                compare_with_py_spy(py_spy, pid, &stacks)?;
            }
            Ok(format!(
                "{:?} from {:?}, py-spy {}",
                process.version,
                process.version_source,
                if py_spy.is_some() {
                    "agrees"
                } else if free_threaded {
                    "does not support free-threaded builds"
                } else {
                    "skipped"
                }
            ))
        })();
        match result {
            Ok(summary) => eprintln!("{mode}: {label}: ok ({summary})"),
            Err(error) => failures.push(format!("{mode}: {label}: {error}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The walker's instruction offsets of the callers of `Worker.spin` must be the `f_lasti`
/// CPython reported for them: this pins the instruction field, its unit and (3.11+) the
/// bytecode start, which a line check alone could miss by a code unit.
fn check_caller_offsets(
    process: &PythonProcess,
    stacks: &[PyThreadStack],
    expected: &[(String, i64)],
) -> Result<(), String> {
    let main = main_thread(stacks)?;
    let ours: Vec<(String, i64)> = main
        .frames
        .iter()
        .skip(1)
        .map(|frame| {
            let name = match &frame.info {
                Ok(info) => info
                    .qualname
                    .rsplit('.')
                    .next()
                    .unwrap_or_default()
                    .to_owned(),
                Err(e) => format!("<{e}>"),
            };
            let offset = instruction_byte_offset(
                &process.layout,
                frame.raw.code_addr,
                frame.raw.instruction,
            );
            (name, offset)
        })
        .collect();
    if expected.is_empty() || ours != expected {
        return Err(format!(
            "caller instruction offsets differ from CPython's f_lasti:\n ours    {ours:?}\n CPython {expected:?}"
        ));
    }
    Ok(())
}

#[test]
fn python_chain_and_threads() {
    run_matrix("chain", 3, check_chain);
}

#[test]
fn python_sorted_key_callback() {
    run_matrix("sorted", 0, check_sorted);
}

#[test]
fn python_ctypes_callback() {
    run_matrix("ctypes", 0, check_ctypes);
}

#[test]
fn python_generator() {
    run_matrix("generator", 0, check_generator);
}

#[test]
fn python_asyncio_coroutine() {
    run_matrix("asyncio", 0, check_asyncio);
}

#[test]
fn python_recursion_200() {
    run_matrix("recursion", 0, check_recursion);
}

/// A process without Python: a clear "not Python", and the 3.12 file's `.cold` part is found.
#[test]
fn non_python_process_and_cold_ranges() {
    let mut child = Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let pid = Pid(child.id());
    let mut files = FileCache::new(16);
    let snapshot = read_process(pid, Path::new(&format!("/proc/{pid}")), "host", &mut files);
    let _ = child.kill();
    let _ = child.wait();
    let snapshot = snapshot.expect("snapshot of sleep");
    assert!(matches!(
        detect_python(&snapshot.info),
        Err(super::super::DetectError::NotPython)
    ));

    let lib = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")))
        .map(|root| root.join("versions/3.12.1/lib/libpython3.12.so.1.0"));
    let Some(lib) = lib.filter(|lib| lib.is_file()) else {
        skip("pyenv 3.12.1 not installed");
        return;
    };
    let elf = super::super::detect::inspect_interpreter_elf(&lib, &std::sync::Arc::from("lib"))
        .expect("readable")
        .expect("defines _PyRuntime");
    assert_eq!(elf.version, (3, 12, 1));
    // pyenv's GCC build splits the eval loop: the main part and `.cold`.
    assert_eq!(elf.eval_frame.len(), 2, "{:x?}", elf.eval_frame);
}
