//! The .eh_frame-unwinder scenarios: BPF cost per sample by stack depth (a workload without
//! frame pointers), and the agent's memory and table sharing with 100 processes mapping 50
//! distinct libraries (and 100 processes of one binary).
use std::{
    collections::{BTreeSet, HashMap, HashSet},
    fs::File,
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use integration_tests::{Scratch, build_c_fixture, fixture_dir, fixture_source, proto};

use crate::{
    BpfCost, bpf_cost, bpf_prog_stats,
    parse::{self, AgentCounters, AgentSummary, ProgStats},
    procs::{self, Finished, Proc, Usage},
    profiler_command, tail,
};

/// Frames of the depth workload's stack besides its recursion: `depth_leaf`, `main`,
/// `__libc_start_call_main`, `__libc_start_main`, `_start`.
const FIXED_FRAMES: usize = 5;
/// Total user frames per sample in the depth scenario.
pub const DEPTHS: &[usize] = &[10, 30, 50, 128];
/// Compiler flags of the unwinder scenarios' programs: no frame pointers, so only `.eh_frame`
/// describes their frames.
const NOFP: &[&str] = &["-O2", "-g", "-fomit-frame-pointer"];

/// Kernel addresses start here on x86_64; user addresses are below.
const KERNEL_START: u64 = 0xffff_8000_0000_0000;

// ---------------------------------------------------------------------------------------------
// Depth scenario

/// One depth's figures.
#[derive(Debug)]
pub struct DepthRun {
    /// Intended user frames per sample (recursion + [`FIXED_FRAMES`]).
    pub frames: usize,
    pub recursion: usize,
    pub workers: usize,
    pub bpf: BpfCost,
    pub agent: Option<AgentSummary>,
    pub counters: Option<AgentCounters>,
    pub usage: Usage,
    pub stacks: Option<StackFigures>,
}

impl DepthRun {
    /// The agent's whole-recording BPF run time divided by the samples BPF sent (the workers'):
    /// an upper bound of the cost per unwound sample, as the filtered runs are charged to them.
    pub fn ns_per_sent_sample(&self) -> Option<f64> {
        let sent = self.counters.as_ref()?.bpf("samples_sent");
        let agent = self.agent.as_ref()?;
        (sent > 0 && agent.bpf_run_time_ns > 0).then(|| agent.bpf_run_time_ns as f64 / sent as f64)
    }
}

/// What the profile says about the workers' stacks.
#[derive(Debug, Default)]
pub struct StackFigures {
    /// Samples of the workers (sum of pprof counts).
    pub samples: i64,
    /// Of those, samples whose innermost user frame is the hot loop (`depth_leaf`).
    pub in_hot_loop: i64,
    /// Mean user frames (unwound locations, not inlined functions) per worker sample.
    pub mean_user_frames: f64,
    pub min_user_frames: usize,
    pub max_user_frames: usize,
    /// Samples with the whole user stack: `depth_leaf` innermost, exactly `recursion` ×
    /// `depth_recurse`, `main`, `_start` outermost, no `[truncated]` marker.
    pub complete: i64,
    /// The most frequent incomplete stack, repeated frames collapsed (for the details).
    pub top_incomplete: Option<String>,
}

pub fn depth_workload() -> Result<PathBuf> {
    Ok(build_c_fixture(
        "bench_depth.c",
        "bench_depth-nofp",
        "gcc",
        NOFP,
    ))
}

pub fn run_depth(
    profiler: &Path,
    workload: &Path,
    cpus: usize,
    frames: usize,
    seconds: u64,
    scratch: &Scratch,
) -> Result<DepthRun> {
    let recursion = frames.saturating_sub(FIXED_FRAMES).max(1);
    // The workers outlive the recording (its start-up loads and verifies the BPF program) and
    // are killed when it is done.
    let mut workers = (0..cpus)
        .map(|i| {
            let mut cmd = Command::new(workload);
            cmd.arg((seconds + 30).to_string())
                .arg(recursion.to_string());
            Proc::spawn(cmd, &format!("depth worker {i}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let pids: Vec<String> = workers.iter().map(|w| w.pid().to_string()).collect();
    let output = scratch.path(&format!("depth-{frames}.pb.gz"));
    let mut cmd = profiler_command(profiler, "profiler=debug");
    cmd.arg("--duration")
        .arg(seconds.to_string())
        .arg("--no-cache")
        .arg("--output")
        .arg(&output)
        .arg("--pid")
        .arg(pids.join(","));
    let profiler = Proc::spawn(cmd, "profiler record")?;
    let (finished, window) = record(profiler, |_| {
        let mut all = true;
        for worker in workers.iter_mut() {
            all &= !worker.poll()?;
        }
        Ok(all)
    })?;
    for (i, worker) in workers.iter_mut().enumerate() {
        if worker.poll()? {
            bail!("depth worker {i} exited before the recording ended");
        }
    }
    drop(workers);
    if !finished.usage.success {
        bail!(
            "profiler record failed; its log:\n{}",
            tail(&finished.stderr, 20)
        );
    }
    let worker_pids: HashSet<i64> = pids.iter().filter_map(|p| p.parse().ok()).collect();
    let stacks = match read_pprof(&output) {
        Ok(profile) => Some(depth_stacks(&profile, &worker_pids, recursion)),
        Err(err) => {
            eprintln!("bench: warning: cannot read the depth profile: {err:#}");
            None
        }
    };
    Ok(DepthRun {
        frames,
        recursion,
        workers: cpus,
        bpf: bpf_cost(&window),
        agent: parse::parse_agent_summary(&finished.stderr),
        counters: parse::parse_agent_counters(&finished.stderr),
        usage: finished.usage,
        stacks,
    })
}

/// Waits for the profiler to exit, polling its BPF statistics once a second. `tick` runs on
/// every poll and says whether the workload is still complete; the polls form the window while
/// it returns true from the first poll on (it ends at the first false).
pub(crate) fn record(
    mut profiler: Proc,
    mut tick: impl FnMut(u32) -> Result<bool>,
) -> Result<(Finished, Vec<ProgStats>)> {
    let start = Instant::now();
    let mut window = Vec::new();
    let mut open = true;
    let mut n = 0u32;
    while !profiler.poll()? {
        procs::check_interrupted()?;
        let stats = bpf_prog_stats(profiler.pid());
        let complete = tick(n)?;
        open &= complete;
        if open && let Some(stats) = stats {
            window.push(stats);
        }
        n += 1;
        let next = start + Duration::from_secs(u64::from(n));
        while Instant::now() < next {
            procs::check_interrupted()?;
            if profiler.poll()? {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok((profiler.wait()?, window))
}

/// A decoded pprof profile (gzipped or not); errors instead of panics on odd input.
fn read_pprof(path: &Path) -> Result<proto::Profile> {
    use prost::Message;
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let raw = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut raw)
            .context("bad gzip")?;
        raw
    } else {
        bytes
    };
    proto::Profile::decode(&raw[..]).context("not a pprof profile")
}

/// One pprof sample: its pid label, its count, its functions root first and its user frames.
struct Stack {
    pid: Option<i64>,
    count: i64,
    functions: Vec<String>,
    /// Functions of the user locations only, root first.
    user_functions: Vec<String>,
    user_frames: usize,
}

fn stacks(profile: &proto::Profile) -> Vec<Stack> {
    let string = |i: i64| {
        usize::try_from(i)
            .ok()
            .and_then(|i| profile.string_table.get(i))
            .map_or("", String::as_str)
    };
    let functions: HashMap<u64, &str> = profile
        .function
        .iter()
        .map(|f| (f.id, string(f.name)))
        .collect();
    let locations: HashMap<u64, &proto::Location> =
        profile.location.iter().map(|l| (l.id, l)).collect();
    let pid_key = profile.string_table.iter().position(|s| s == "pid");
    profile
        .sample
        .iter()
        .map(|s| {
            let mut names = Vec::new();
            let mut user_names = Vec::new();
            let mut user_frames = 0;
            // Locations are leaf first, a location's lines innermost first.
            for location in s
                .location_id
                .iter()
                .rev()
                .filter_map(|id| locations.get(id))
            {
                let user = location.address != 0 && location.address < KERNEL_START;
                if user {
                    user_frames += 1;
                }
                for line in location.line.iter().rev() {
                    let name = functions
                        .get(&line.function_id)
                        .copied()
                        .unwrap_or("")
                        .to_string();
                    if user {
                        user_names.push(name.clone());
                    }
                    names.push(name);
                }
            }
            Stack {
                pid: s
                    .label
                    .iter()
                    .find(|l| usize::try_from(l.key).ok() == pid_key)
                    .map(|l| l.num),
                count: s.value.first().copied().unwrap_or(0),
                functions: names,
                user_functions: user_names,
                user_frames,
            }
        })
        .collect()
}

fn depth_stacks(profile: &proto::Profile, pids: &HashSet<i64>, recursion: usize) -> StackFigures {
    let mut figures = StackFigures {
        min_user_frames: usize::MAX,
        ..StackFigures::default()
    };
    let mut frame_sum = 0.0;
    let mut incomplete: HashMap<String, i64> = HashMap::new();
    for stack in stacks(profile) {
        if !stack.pid.is_some_and(|pid| pids.contains(&pid)) || stack.count <= 0 {
            continue;
        }
        figures.samples += stack.count;
        frame_sum += stack.user_frames as f64 * stack.count as f64;
        figures.min_user_frames = figures.min_user_frames.min(stack.user_frames);
        figures.max_user_frames = figures.max_user_frames.max(stack.user_frames);
        // The user part must be exactly _start → … → main → depth_recurse × recursion →
        // depth_leaf (kernel frames below the leaf, e.g. a sample taken on the way back from an
        // interrupt, do not matter).
        let u = &stack.user_functions;
        let leaf = u.last().is_some_and(|name| name == "depth_leaf");
        if leaf {
            figures.in_hot_loop += stack.count;
        }
        let recursions = u.iter().filter(|name| *name == "depth_recurse").count();
        let rooted =
            u.first().is_some_and(|name| name == "_start") && u.iter().any(|name| name == "main");
        let truncated = stack.functions.iter().any(|name| name == "[truncated]");
        if leaf && recursions == recursion && rooted && !truncated {
            figures.complete += stack.count;
        } else {
            *incomplete
                .entry(integration_tests::collapse_repeats(&stack.functions))
                .or_default() += stack.count;
        }
    }
    if figures.samples > 0 {
        figures.mean_user_frames = frame_sum / figures.samples as f64;
    } else {
        figures.min_user_frames = 0;
    }
    figures.top_incomplete = incomplete
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        .map(|(stack, count)| format!("{stack} ({count} samples)"));
    figures
}

// ---------------------------------------------------------------------------------------------
// Shared-table scenario

pub const SHARED_PROCESSES: usize = 100;
pub const SHARED_LIBRARIES: usize = 50;
/// Libraries each driver process opens: process i opens i, i+1, ..., i+4 (mod 50), so every
/// library is mapped by 10 processes.
pub const LIBRARIES_PER_PROCESS: usize = 5;
/// Each driver is busy this long every [`PERIOD_MS`]: 100 drivers keep about one CPU busy.
const BUSY_US: u64 = 1000;
const PERIOD_MS: u64 = 100;

#[derive(Debug)]
pub struct SharedRun {
    pub label: &'static str,
    pub processes: usize,
    /// Distinct generated libraries mapped by the drivers (0 in the one-binary variant).
    pub libraries: usize,
    /// Distinct executable files (device + inode, and the vDSO) mapped by the drivers.
    pub driver_files: usize,
    /// Distinct executable files mapped by all processes the profile has samples of, as read
    /// from /proc/PID/maps during the recording: the tables the agent can need.
    pub sampled_files: Option<usize>,
    /// Drivers with at least one sample in the profile.
    pub drivers_sampled: Option<usize>,
    /// All processes in the profile.
    pub processes_sampled: Option<usize>,
    /// The drivers' samples in the profile, and those whose user stack reaches `_start`
    /// without a `[truncated]` marker.
    pub driver_samples: i64,
    pub driver_complete: i64,
    /// Warnings, errors and `no unwind table` notes from the agent's log.
    pub notes: Vec<String>,
    pub usage: Usage,
    pub agent: Option<AgentSummary>,
    pub counters: Option<AgentCounters>,
    pub seconds: u64,
}

/// The driver and the 50 libraries, built into target/fixtures.
pub struct SharedFixtures {
    pub driver: PathBuf,
    pub libraries: Vec<PathBuf>,
}

pub fn shared_fixtures() -> Result<SharedFixtures> {
    let driver = build_c_fixture(
        "bench_shared_driver.c",
        "bench_shared_driver-nofp",
        "gcc",
        NOFP,
    );
    let dir = fixture_dir().join("bench_libs");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let source = fixture_source("bench_lib.c");
    let libraries: Vec<PathBuf> = (0..SHARED_LIBRARIES)
        .map(|i| dir.join(format!("libbench{i}.so")))
        .collect();
    // gcc in batches, a few at a time.
    for batch in libraries.chunks(8).enumerate() {
        let (b, paths) = batch;
        let mut children = Vec::new();
        for (j, path) in paths.iter().enumerate() {
            let index = b * 8 + j;
            let child = Command::new("gcc")
                .args(NOFP)
                .args(["-fPIC", "-shared"])
                .arg(format!("-DBENCH_LIB_INDEX={index}"))
                .arg("-o")
                .arg(path)
                .arg(&source)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("cannot run gcc")?;
            children.push((path, child));
        }
        for (path, child) in children {
            let out = child.wait_with_output().context("gcc")?;
            if !out.status.success() {
                bail!(
                    "building {} failed: {}",
                    path.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
    Ok(SharedFixtures { driver, libraries })
}

/// Child processes killed (SIGKILL) and reaped when dropped.
struct ChildGroup(Vec<Child>);

impl ChildGroup {
    fn pids(&self) -> Vec<u32> {
        self.0.iter().map(Child::id).collect()
    }

    /// The first child that has exited, with its status.
    fn first_exited(&mut self) -> Option<(usize, std::process::ExitStatus)> {
        self.0
            .iter_mut()
            .enumerate()
            .find_map(|(i, c)| c.try_wait().ok().flatten().map(|status| (i, status)))
    }
}

impl Drop for ChildGroup {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
        }
        for child in &mut self.0 {
            let _ = child.wait();
        }
    }
}

/// Executable file mappings of `pid` from /proc/PID/maps: `dev:inode` keys (and `[vdso]`).
fn executable_files(pid: u32) -> Option<BTreeSet<String>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut files = BTreeSet::new();
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(perms), Some(dev), Some(inode)) = (fields.get(1), fields.get(3), fields.get(4))
        else {
            continue;
        };
        if !perms.contains('x') {
            continue;
        }
        let path = fields.get(5).copied().unwrap_or("");
        if path == "[vdso]" {
            files.insert(path.to_string());
        } else if path.starts_with('/') && *inode != "0" {
            files.insert(format!("{dev}:{inode}"));
        }
    }
    Some(files)
}

/// The executable files of every process on the machine, by pid.
fn all_executable_files() -> HashMap<u32, BTreeSet<String>> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, executable_files(pid)?)))
        .filter(|(_, files)| !files.is_empty())
        .collect()
}

pub fn run_shared(
    profiler: &Path,
    fixtures: &SharedFixtures,
    with_libraries: bool,
    seconds: u64,
    scratch: &Scratch,
) -> Result<SharedRun> {
    let log_path = scratch.path("drivers.log");
    let log = File::create(&log_path).context("cannot create the drivers' log")?;
    let mut drivers = ChildGroup(Vec::new());
    for i in 0..SHARED_PROCESSES {
        let mut cmd = Command::new(&fixtures.driver);
        cmd.arg((seconds + 60).to_string())
            .arg(BUSY_US.to_string())
            .arg(PERIOD_MS.to_string());
        if with_libraries {
            for j in 0..LIBRARIES_PER_PROCESS {
                cmd.arg(&fixtures.libraries[(i + j) % fixtures.libraries.len()]);
            }
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.try_clone().context("log file")?)
            .spawn()
            .with_context(|| format!("cannot start {}", fixtures.driver.display()))?;
        drivers.0.push(child);
    }
    // Let every driver get past dlopen.
    std::thread::sleep(Duration::from_millis(1500));
    if let Some((i, status)) = drivers.first_exited() {
        let mut text = String::new();
        let _ = File::open(&log_path).and_then(|mut f| f.read_to_string(&mut text));
        bail!(
            "shared-table driver {i} exited early ({status}): {}",
            tail(&text, 5)
        );
    }
    let driver_pids = drivers.pids();
    let mut driver_files = BTreeSet::new();
    for &pid in &driver_pids {
        driver_files.extend(executable_files(pid).unwrap_or_default());
    }

    let output = scratch.path("shared.pb.gz");
    let mut cmd = profiler_command(profiler, "profiler=debug");
    cmd.arg("--duration")
        .arg(seconds.to_string())
        .arg("--no-cache")
        .arg("--output")
        .arg(&output);
    let profiler = Proc::spawn(cmd, "profiler record")?;
    let profiler_pid = profiler.pid();
    // Everyone's executable files (the agent's included), read once a second during the
    // recording and kept per pid, so processes sampled and gone before the end still count.
    let mut files_by_pid: HashMap<u32, BTreeSet<String>> = HashMap::new();
    let (finished, _) = record(profiler, |_| {
        for (pid, files) in all_executable_files() {
            files_by_pid.entry(pid).or_default().extend(files);
        }
        Ok(true)
    })?;
    for (pid, files) in all_executable_files() {
        files_by_pid.entry(pid).or_insert(files);
    }
    if let Some((i, status)) = drivers.first_exited() {
        eprintln!("bench: warning: driver {i} exited during the recording ({status})");
    }
    drop(drivers);
    if !finished.usage.success {
        bail!(
            "profiler record (pid {profiler_pid}) failed; its log:\n{}",
            tail(&finished.stderr, 20)
        );
    }

    let mut sampled_files = None;
    let mut drivers_sampled = None;
    let mut processes_sampled = None;
    let (mut driver_samples, mut driver_complete) = (0, 0);
    match read_pprof(&output) {
        Ok(profile) => {
            let stacks = stacks(&profile);
            let pids: BTreeSet<i64> = stacks.iter().filter_map(|s| s.pid).collect();
            let drivers: HashSet<i64> = driver_pids.iter().map(|&p| i64::from(p)).collect();
            for stack in &stacks {
                if stack.pid.is_some_and(|pid| drivers.contains(&pid)) {
                    driver_samples += stack.count;
                    if stack.user_functions.first().is_some_and(|f| f == "_start")
                        && !stack.functions.iter().any(|f| f == "[truncated]")
                    {
                        driver_complete += stack.count;
                    }
                }
            }
            drivers_sampled = Some(pids.iter().filter(|p| drivers.contains(p)).count());
            processes_sampled = Some(pids.len());
            let mut files = BTreeSet::new();
            for pid in &pids {
                if let Some(set) = u32::try_from(*pid).ok().and_then(|p| files_by_pid.get(&p)) {
                    files.extend(set.iter().cloned());
                }
            }
            sampled_files = Some(files.len());
        }
        Err(err) => eprintln!("bench: warning: cannot read the shared-table profile: {err:#}"),
    }
    Ok(SharedRun {
        label: if with_libraries {
            "100 processes, 50 distinct libraries"
        } else {
            "100 processes of one binary"
        },
        processes: SHARED_PROCESSES,
        libraries: if with_libraries {
            SHARED_LIBRARIES.min(fixtures.libraries.len())
        } else {
            0
        },
        driver_files: driver_files.len(),
        sampled_files,
        drivers_sampled,
        processes_sampled,
        driver_samples,
        driver_complete,
        notes: parse::notable_log_lines(&finished.stderr),
        agent: parse::parse_agent_summary(&finished.stderr),
        counters: parse::parse_agent_counters(&finished.stderr),
        usage: finished.usage,
        seconds,
    })
}
