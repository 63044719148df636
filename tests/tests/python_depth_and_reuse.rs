//! Python frames that are never wrong: deep stacks complete to their root up to the recorded
//! limit (and cut, marked and counted beyond it), and code objects freed while samples of them
//! are in flight never lend their address's next occupant's name to a frame (py-spy, sampling
//! the same process at the same time, is the oracle for the names).
use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, Instant},
};

use integration_tests::{
    READY_TIMEOUT, Recording, Running, SHAPE_SAMPLING_HZ, Scratch, Wait, await_ready,
    cpu_got_while, exclusive, fixture_source, parse_folded, pyenv_python, require_external,
    sample_floor, workspace_root,
};

/// Python frames BPF records; deeper stacks keep their innermost frames.
const MAX_PYTHON_FRAMES: usize = profiler_common::MAX_PYTHON_FRAMES;

/// (label, interpreter, one Python frame per eval-loop call: ≤3.10)
fn interpreters() -> Vec<(String, PathBuf, bool)> {
    let mut found = Vec::new();
    for (version, executable, old) in [
        ("3.8.18", "python3.8", true),
        ("3.11.7", "python3.11", false),
        ("3.12.1", "python3.12", false),
        ("3.13.0", "python3.13", false),
    ] {
        match pyenv_python(version, executable) {
            Some(path) => found.push((format!("pyenv {version}"), path, old)),
            None => missing(&format!("pyenv Python {version}")),
        }
    }
    let sid = workspace_root().join(".tools/python3.14/usr/bin/python3.14");
    if sid.is_file() {
        found.push(("debian sid 3.14".into(), sid, false));
    } else {
        missing("Python 3.14 under .tools (`cargo xtask setup` unpacks it)");
    }
    for minor in ["3.13", "3.14"] {
        let path = workspace_root().join(format!(".tools/python{minor}t/bin/python{minor}t"));
        if path.is_file() {
            found.push((format!("free-threaded {minor}t"), path, false));
        } else {
            missing(&format!(
                "free-threaded Python {minor}t under .tools (`cargo xtask setup` builds it)"
            ));
        }
    }
    found
}

fn missing(what: &str) {
    assert!(
        !require_external(),
        "{what} is not installed (PROFILER_REQUIRE_EXTERNAL=1 forbids skipping)"
    );
    eprintln!("skipping {what}: not installed");
}

/// Records `pid` for `seconds` in folded format: the stacks (root first), the log, and the
/// CPU time the process got while the sampler was attached (so a slow start of the recorder
/// on a busy machine does not count as time the fixture could have been sampled). At
/// [`SHAPE_SAMPLING_HZ`], whose counts follow the CPU time on a busy machine.
fn record(pid: u32, seconds: u64, scratch: &Scratch) -> (Vec<Vec<String>>, String, Duration) {
    let out = scratch.path("stacks.folded");
    let recording = Recording::until_stopped(&[
        "--frequency",
        SHAPE_SAMPLING_HZ,
        "--pid",
        &pid.to_string(),
        "--format",
        "folded",
        "--output",
        out.to_str().expect("UTF-8 scratch path"),
    ]);
    let cpu = cpu_got_while(&[pid], Wait::For(Duration::from_secs(seconds)));
    let log = recording.stop();
    let text = std::fs::read_to_string(&out).expect("the folded output");
    let mut stacks = Vec::new();
    for stack in parse_folded(&text) {
        for _ in 0..stack.count {
            stacks.push(stack.frames.clone());
        }
    }
    (stacks, log, cpu)
}

/// A Python frame of the folded output, `name (file:line)`: its name and file.
fn python_frame(frame: &str) -> Option<(&str, &str)> {
    let (name, place) = frame.strip_suffix(')')?.rsplit_once(" (")?;
    let (file, line) = place.rsplit_once(':')?;
    line.parse::<u32>().ok()?;
    Some((name, file))
}

/// `tests/fixtures/python/SCRIPT 600` under `interpreter` (killed when dropped),
/// once it says it is past its start-up (imports; the free-threaded 3.13t's slow start on a
/// busy machine), so that what is recorded is its steady work; with the lines it prints after.
fn spawn_script(interpreter: &PathBuf, script: &str) -> (Running, Receiver<String>) {
    let mut child = Command::new(interpreter)
        .arg(fixture_source(&format!("python/{script}")))
        .arg("600")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("start {script}: {error}"));
    let lines = await_ready(&mut child, READY_TIMEOUT);
    let running = Running { child };
    (
        running,
        lines.unwrap_or_else(|error| panic!("{script}: {error}")),
    )
}

/// `deep.py DEPTH` spinning at the bottom of a DEPTH-frame Python stack.
fn spawn_deep(interpreter: &PathBuf, depth: usize) -> Running {
    let mut child = Command::new(interpreter)
        .arg(fixture_source("python/deep.py"))
        .args([&depth.to_string(), "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start deep.py");
    // It says so once the whole stack is built.
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("deep.py's first line");
    assert_eq!(line.trim(), "spinning", "deep.py did not start");
    Running { child }
}

/// Records `deep.py` at `depth` for 2 s: its samples in `spin` (at least as many as its CPU
/// time allows) and the recorder's log.
fn spinning_samples(
    label: &str,
    interpreter: &PathBuf,
    depth: usize,
) -> (Vec<Vec<String>>, String) {
    let running = spawn_deep(interpreter, depth);
    let scratch = Scratch::new("python-deep");
    let (stacks, log, cpu) = record(running.pid(), 2, &scratch);
    let floor = sample_floor(30, cpu, 0.5);
    let spinning: Vec<Vec<String>> = stacks
        .into_iter()
        .filter(|stack| stack.iter().any(|f| f.starts_with("spin (")))
        .collect();
    assert!(
        spinning.len() as i64 >= floor,
        "{label}, depth {depth}: {} samples in spin, {floor} wanted for {cpu:?} of CPU:\n{log}",
        spinning.len()
    );
    (spinning, log)
}

/// The Python frames of `stack` (root first): the `deep.py` ones by name, others verbatim.
fn deep_frames(stack: &[String]) -> Vec<String> {
    stack
        .iter()
        .filter_map(|frame| {
            if frame == "[unknown python]" {
                return Some(frame.clone());
            }
            python_frame(frame).map(|(name, _)| name.to_owned())
        })
        .collect()
}

/// `text` without its terminal colour sequences (`ESC [ … m`).
fn strip_colours(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

#[test]
fn python_stacks_up_to_the_limit_are_complete_to_their_root() {
    let _guard = exclusive();
    for (label, interpreter, old) in interpreters() {
        for depth in [300, 900, MAX_PYTHON_FRAMES] {
            let (spinning, _) = spinning_samples(&label, &interpreter, depth);
            let mut expected = vec!["<module>".to_owned(), "main".to_owned()];
            expected.extend(std::iter::repeat_n("descend".to_owned(), depth - 3));
            expected.push("spin".to_owned());
            for stack in &spinning {
                let python = deep_frames(stack);
                assert!(
                    python == expected,
                    "{label}, depth {depth}: {} Python frames, {} wanted; root side {:?}, leaf side {:?}",
                    python.len(),
                    expected.len(),
                    &python[..python.len().min(4)],
                    &python[python.len().saturating_sub(3)..]
                );
                // ≤3.10 runs one C eval call per Python frame: that native stack is deeper
                // than the native limit, and saying so is right. 3.11+ has no such excuse.
                assert!(
                    old || !stack.iter().any(|f| f == "[truncated]"),
                    "{label}, depth {depth}: marked truncated: {:?}",
                    &stack[..stack.len().min(6)]
                );
            }
        }
    }
}

#[test]
fn python_stacks_beyond_the_limit_keep_the_leaf_and_mark_the_cut() {
    let _guard = exclusive();
    let depth = MAX_PYTHON_FRAMES + 100;
    for (label, interpreter, _) in interpreters() {
        let (spinning, log) = spinning_samples(&label, &interpreter, depth);
        let mut expected = vec!["descend".to_owned(); MAX_PYTHON_FRAMES - 1];
        expected.push("spin".to_owned());
        for stack in &spinning {
            assert_eq!(
                deep_frames(stack),
                expected,
                "{label}: the innermost {MAX_PYTHON_FRAMES} frames, nothing else"
            );
            // The cut is marked where the missing frames would be: at the root.
            assert_eq!(
                stack.get(1).map(String::as_str),
                Some("[truncated]"),
                "{label}: {:?}",
                &stack[..stack.len().min(4)]
            );
        }
        let counted: u64 = strip_colours(&log)
            .split_whitespace()
            .find_map(|field| field.strip_prefix("truncated_stacks="))
            .and_then(|n| n.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
            .unwrap_or_else(|| panic!("{label}: no truncated_stacks in the log:\n{log}"));
        assert!(
            counted >= spinning.len() as u64,
            "{label}: {counted} truncated stacks counted, {} cut",
            spinning.len()
        );
    }
}

/// How the churn fixture's samples name their frames: samples in all, samples with a
/// `work_<i>` frame of `<gen-<i>>`, and every frame named after code that never ran (a decoy)
/// or a `work_<i>` in another round's file.
#[derive(Debug, Default)]
struct ChurnNames {
    samples: u64,
    named: u64,
    wrong: Vec<String>,
}

impl ChurnNames {
    fn of(stacks: impl IntoIterator<Item = (Vec<String>, u64)>) -> Self {
        let mut names = Self::default();
        for (stack, count) in stacks {
            names.samples += count;
            let mut named = false;
            for frame in &stack {
                let Some((name, file)) = python_frame(frame) else {
                    continue;
                };
                // Never called: a frame with this name is another code object's.
                if name.starts_with("never_run_") || file.starts_with("<decoy-") {
                    names.wrong.push(frame.clone());
                } else if let Some(round) = name.strip_prefix("work_") {
                    if file == format!("<gen-{round}>") {
                        named = true;
                    } else {
                        names.wrong.push(frame.clone());
                    }
                }
            }
            names.named += u64::from(named) * count;
        }
        names
    }

    fn named_share(&self) -> f64 {
        self.named as f64 / self.samples.max(1) as f64
    }
}

/// `py-spy record` of `pid` (with `follow`, of the interpreters it starts too) for `seconds` at
/// 100 Hz in its raw (folded) format, into `py-spy.folded` of `scratch`, in its default blocking
/// mode (it stops the process for each sample, so what it reads is whole): the oracle for the
/// names. `None` where py-spy is not installed (allowed only outside CI).
fn py_spy_record(
    pid: u32,
    seconds: u32,
    follow: bool,
    scratch: &Scratch,
) -> Option<std::process::Child> {
    let py_spy = workspace_root().join(".tools/py-spy/bin/py-spy");
    if !py_spy.is_file() {
        missing("py-spy under .tools/py-spy (`cargo xtask setup` installs it)");
        return None;
    }
    let mut command = Command::new(py_spy);
    command.args(["record", "--format", "raw", "--rate", "100"]);
    if follow {
        command.arg("--subprocesses");
    }
    command
        .arg("--duration")
        .arg(seconds.to_string())
        .arg("--output")
        .arg(scratch.path("py-spy.folded"))
        .arg("--pid")
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_or_else(|error| panic!("start py-spy: {error}"), Some)
}

#[test]
fn freed_code_objects_never_lend_their_name_to_a_frame() {
    let _guard = exclusive();
    for (label, interpreter, _) in interpreters() {
        let (running, _) = spawn_script(&interpreter, "code_churn.py");
        let scratch = Scratch::new("python-churn");
        // py-spy 0.4 reads no free-threaded build; elsewhere it samples 3 s beside ours.
        let oracle = if label.starts_with("free-threaded") {
            None
        } else {
            py_spy_record(running.pid(), 3, false, &scratch)
        };
        let (stacks, log, cpu) = record(running.pid(), 3, &scratch);
        let floor = sample_floor(100, cpu, 0.5);
        assert!(
            stacks.len() as i64 >= floor,
            "{label}: {} samples, {floor} wanted for {cpu:?} of CPU:\n{log}",
            stacks.len()
        );
        let ours = ChurnNames::of(stacks.into_iter().map(|stack| (stack, 1)));
        assert!(
            ours.wrong.is_empty(),
            "{label}: frames named after code objects that did not run there: {:?}",
            &ours.wrong[..ours.wrong.len().min(5)]
        );
        // Samples of a work_<i> handled after it was freed are `[unknown python]` (how many
        // depends on how busy the machine is); the others must name it, so the check above
        // is not passed by naming nothing.
        assert!(
            ours.named * 5 >= ours.samples,
            "{label}: only {} of {} samples name a work_<i> frame",
            ours.named,
            ours.samples
        );
        let Some(py_spy) = oracle else {
            continue;
        };
        let output = py_spy.wait_with_output().expect("wait for py-spy");
        assert!(
            output.status.success(),
            "{label}: py-spy failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = std::fs::read_to_string(scratch.path("py-spy.folded")).expect("py-spy output");
        let theirs = ChurnNames::of(
            parse_folded(&text)
                .into_iter()
                .map(|stack| (stack.frames, stack.count)),
        );
        // The oracle: the fixture does what it says (py-spy, which stops the process to read
        // it, names no decoy either and finds the work_<i> functions running).
        assert!(
            theirs.wrong.is_empty() && theirs.named * 2 >= theirs.samples,
            "{label}: py-spy disagrees with the fixture: {theirs:?}"
        );
        // We name as many samples as py-spy does, less those whose code was freed before the
        // agent read it (shown `[unknown python]`, never wrong).
        assert!(
            ours.named_share() >= theirs.named_share() * 0.5,
            "{label}: {:.0} % of our samples name work_<i>, {:.0} % of py-spy's",
            ours.named_share() * 100.0,
            theirs.named_share() * 100.0
        );
        eprintln!(
            "{label}: work_<i> named in {}/{} of our samples, {}/{} of py-spy's; wrong names 0 and 0",
            ours.named, ours.samples, theirs.named, theirs.samples
        );
    }
}

/// The import machinery runs each module's `<module>` code once and frees it, and the
/// functions the module defines often land where it was. Under a whole-host recording of
/// fresh interpreters importing large packages, what a source loader's `exec_module` runs
/// through `_call_with_frames_removed` (`exec` of the module's code) must be a module body,
/// never a function of the module. Judged on the Python frames alone, in the order BPF walked
/// them; 3.11+ only, whose qualified names tell `_LoaderBasics.exec_module` (source modules)
/// from an extension loader's, whose init may call any function. py-spy, following the same
/// interpreters, is held to the same check as the oracle.
#[test]
fn imports_show_module_bodies_not_the_functions_defined_where_they_were() {
    let _guard = exclusive();
    let mut interpreters: Vec<(String, PathBuf)> = interpreters()
        .into_iter()
        .filter(|(label, _, old)| !old && !label.contains("3.8"))
        .map(|(label, path, _)| (label, path))
        .collect();
    let torch_python = workspace_root().join(".tools/torch-venv/bin/python");
    if torch_python.is_file() {
        interpreters.push(("PyTorch venv (numpy)".into(), torch_python));
    } else {
        missing("the PyTorch venv (`cargo xtask setup` installs it)");
    }
    for (label, interpreter) in interpreters {
        let (running, imports) = spawn_script(&interpreter, "import_churn.py");
        let scratch = Scratch::new("python-imports");
        // py-spy follows the same interpreters (it stops each to read it): the oracle.
        let oracle = if label.starts_with("free-threaded") {
            None
        } else {
            py_spy_record(running.pid(), 5, true, &scratch)
        };
        let out = scratch.path("host.folded");
        let recording = Recording::until_stopped(&[
            "--frequency",
            SHAPE_SAMPLING_HZ,
            "--format",
            "folded",
            "--output",
            out.to_str().expect("UTF-8 scratch path"),
        ]);
        // At least 5 s (py-spy's time) and two imports ended while the sampler was attached,
        // so one import ran whole inside the recording however slowly a busy machine runs it.
        let attached = Instant::now();
        while imports.try_recv().is_ok() {}
        for _ in 0..2 {
            imports
                .recv_timeout(Duration::from_secs(300))
                .unwrap_or_else(|error| panic!("{label}: no import ended in 300 s: {error}"));
        }
        std::thread::sleep(Duration::from_secs(5).saturating_sub(attached.elapsed()));
        let log = recording.stop();
        let theirs = oracle.map(|py_spy| {
            let output = py_spy.wait_with_output().expect("wait for py-spy");
            assert!(
                output.status.success(),
                "{label}: py-spy failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let text =
                std::fs::read_to_string(scratch.path("py-spy.folded")).expect("py-spy output");
            ExecutedBodies::of(&text)
        });
        drop(running);
        let ours = ExecutedBodies::of(&std::fs::read_to_string(&out).expect("the folded output"));
        assert!(
            ours.functions.is_empty(),
            "{label}: a source module's exec ran a function, not a module body:\n{}",
            ours.functions[..ours.functions.len().min(3)].join("\n")
        );
        assert!(
            ours.module_bodies >= 5,
            "{label}: {} samples of module bodies run by the import machinery:\n{log}",
            ours.module_bodies
        );
        if let Some(theirs) = theirs {
            // The oracle agrees that the check is right: py-spy sees module bodies there too,
            // and never a function.
            assert!(
                theirs.functions.is_empty() && theirs.module_bodies >= 5,
                "{label}: py-spy: {} module bodies, functions {:?}",
                theirs.module_bodies,
                &theirs.functions[..theirs.functions.len().min(3)]
            );
            eprintln!(
                "{label}: module bodies under exec_module: ours {}, py-spy {}; functions there: 0 and 0",
                ours.module_bodies, theirs.module_bodies
            );
        }
    }
}

/// What a source loader's `exec_module` ran through `_call_with_frames_removed` in a folded
/// profile (ours or py-spy's, root first): samples of module bodies (`<module>`), and every
/// stack where it ran something else, which would be a wrong name (`[unknown python]`, the
/// honest answer for a freed body, is neither).
#[derive(Debug, Default)]
struct ExecutedBodies {
    module_bodies: u64,
    functions: Vec<String>,
}

impl ExecutedBodies {
    fn of(folded: &str) -> Self {
        let mut found = Self::default();
        for stack in parse_folded(folded) {
            let python: Vec<&str> = stack
                .frames
                .iter()
                .filter_map(|f| {
                    if f == "[unknown python]" {
                        Some(f.as_str())
                    } else {
                        python_frame(f).map(|(name, _)| name)
                    }
                })
                .collect();
            for run in python.windows(3) {
                if run[0] != "_LoaderBasics.exec_module" || run[1] != "_call_with_frames_removed" {
                    continue;
                }
                match run[2] {
                    "<module>" => found.module_bodies += stack.count,
                    "[unknown python]" => {}
                    _ => found.functions.push(stack.frames.join(";")),
                }
            }
        }
        found
    }
}

/// Generators and coroutines switch frames in `send`/`next`: every sample of them keeps its
/// whole chain, from `<module>` to the generator or coroutine running, with nothing unknown.
#[test]
fn generator_and_coroutine_switches_keep_whole_stacks() {
    let _guard = exclusive();
    for (label, interpreter, _) in interpreters() {
        let (running, _) = spawn_script(&interpreter, "generators.py");
        let scratch = Scratch::new("python-generators");
        let (stacks, log, cpu) = record(running.pid(), 4, &scratch);
        let floor = sample_floor(200, cpu, 0.5);
        assert!(
            stacks.len() as i64 >= floor,
            "{label}: {} samples, {floor} wanted for {cpu:?} of CPU:\n{log}",
            stacks.len()
        );
        let (mut generators, mut coroutines) = (0, 0);
        for stack in &stacks {
            let python = deep_frames(stack);
            // The steady loop only: start-up imports may rightly show a freed module body
            // as `[unknown python]`.
            if !python.iter().any(|f| f == "consume" || f == "coro_driver") {
                continue;
            }
            let context = || format!("{label}: {}", stack.join(";"));
            assert!(
                !python.iter().any(|f| f == "[unknown python]"),
                "{}",
                context()
            );
            assert_eq!(python[0], "<module>", "{}", context());
            // Python frames only, root first: each generator or coroutine under its caller.
            for (at, frame) in python.iter().enumerate() {
                let caller = at.checked_sub(1).map(|i| python[i].as_str());
                match frame.as_str() {
                    "leaf_gen" => {
                        assert_eq!(caller, Some("middle_gen"), "{}", context());
                        generators += 1;
                    }
                    "middle_gen" => assert_eq!(caller, Some("consume"), "{}", context()),
                    "inner" => {
                        assert_eq!(caller, Some("outer"), "{}", context());
                        coroutines += 1;
                    }
                    _ => {}
                }
            }
        }
        assert!(
            generators >= 10 && coroutines >= 10,
            "{label}: {generators} samples in leaf_gen, {coroutines} in inner"
        );
    }
}
