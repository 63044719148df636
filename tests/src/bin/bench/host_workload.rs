//! The `host` suite's workload: fixtures built here, a generated C project rebuilt with
//! `make -j4` in a loop, and every part started in its own process group so that the whole tree
//! of a part (make's compilers, the spawner's children, `bash <(...)` substitutions) is killed
//! with it.
use std::{
    fmt::Write as _,
    fs::File,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use integration_tests::{fixture_dir, fixture_source, server_harness::SplitMix};

/// Exec storm: spawns per second asked of `host_spawner`.
pub const SPAWN_RATE: u32 = 400;
/// `host_threads` runs kept alive at once.
pub const THREAD_RUNS: u32 = 2;
/// Generated C files of the build loop.
pub const BUILD_FILES: usize = 200;
/// Recursion depth of the frameless-library fixture.
pub const FRAMELESS_DEPTH: usize = 8;
/// Thread names `host_threads` gives its threads (tests/fixtures/host_threads.c): a service
/// named like one of them took a thread's name for the program's.
pub const THREAD_NAMES: &[&str] = &[
    "sample-reader",
    "http",
    "lto cgu.1",
    "tokio-runtime-w",
    "rayon-worker-3",
    "pool-2",
];

/// The C programs of the suite, built into `target/fixtures/host/`.
pub struct Fixtures {
    pub spawner: PathBuf,
    pub burst: PathBuf,
    pub threads: PathBuf,
    pub fp_chain: PathBuf,
    pub nofp_chain: PathBuf,
    pub frameless: PathBuf,
}

fn gcc(args: &[&str], sources: &[PathBuf], out: &Path, trailing: &[String]) -> Result<()> {
    let mut cmd = Command::new("gcc");
    cmd.args(args)
        .arg("-o")
        .arg(out)
        .args(sources)
        .args(trailing);
    let output = cmd
        .output()
        .context("cannot run gcc (apt-get install gcc)")?;
    if !output.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// Builds the fixtures, every time (a few hundred ms), so they always match their sources.
/// The fixed chains use the flags of `fp_fixture`, `nofp_fixture` and `nofp_shared_library` in
/// tests/src/lib.rs; the names start with `host_` so their service names are unique.
pub fn build_fixtures() -> Result<Fixtures> {
    let dir = fixture_dir().join("host");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let fp = [
        "-O2",
        "-g",
        "-fno-omit-frame-pointer",
        "-fno-optimize-sibling-calls",
    ];
    let nofp = integration_tests::NOFP_FLAGS;
    let out = |name: &str| dir.join(name);
    let source = |name: &str| vec![fixture_source(name)];

    gcc(
        &["-O2", "-g"],
        &source("host_spawner.c"),
        &out("host_spawner"),
        &[],
    )?;
    gcc(
        &["-O2", "-g"],
        &source("host_burst.c"),
        &out("host_burst"),
        &[],
    )?;
    gcc(
        &["-O2", "-g", "-pthread"],
        &source("host_threads.c"),
        &out("host_threads"),
        &[],
    )?;
    gcc(&fp, &source("fp_chain.c"), &out("host_fp_chain_fp"), &[])?;
    gcc(nofp, &source("fp_chain.c"), &out("host_fp_chain_nofp"), &[])?;
    // tests/tests/unwind_no_fp.rs `program_using_library`: the frameless library built without
    // frame pointers as a shared library, and a caller (also without) linked against it.
    let mut library_flags = nofp.to_vec();
    library_flags.extend(["-fPIC", "-shared"]);
    gcc(
        &library_flags,
        &source("libframeless.c"),
        &out("libframeless.so"),
        &[],
    )?;
    let dir_text = dir.to_string_lossy();
    gcc(
        nofp,
        &source("frameless_main.c"),
        &out("host_frameless_main"),
        &[
            format!("-L{dir_text}"),
            "-lframeless".into(),
            format!("-Wl,-rpath,{dir_text}"),
        ],
    )?;
    Ok(Fixtures {
        spawner: out("host_spawner"),
        burst: out("host_burst"),
        threads: out("host_threads"),
        fp_chain: out("host_fp_chain_fp"),
        nofp_chain: out("host_fp_chain_nofp"),
        frameless: out("host_frameless_main"),
    })
}

/// Writes `files` generated C files, a `main.c` calling them and a Makefile into `dir`. The files
/// are small to medium (8-14 functions of loops, switches, libm and libc calls, 100-180 lines;
/// about 0.1 s each for gcc -O2 -g on an idle CPU), so a parallel build starts compilers all
/// the time.
pub fn generate_build_tree(dir: &Path, files: usize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut rng = SplitMix(0x5eed_b111d);
    let mut main = String::from("#include <stdio.h>\n\n");
    for unit in 0..files {
        let _ = writeln!(main, "int unit_{unit}_entry(int n);");
        let path = dir.join(format!("unit_{unit:03}.c"));
        std::fs::write(&path, generated_unit(unit, &mut rng))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    main.push_str("\nint main(void) {\n    long sum = 0;\n");
    for unit in 0..files {
        let _ = writeln!(main, "    sum += unit_{unit}_entry(64);");
    }
    main.push_str("    printf(\"%ld\\n\", sum);\n    return 0;\n}\n");
    std::fs::write(dir.join("main.c"), main).context("cannot write main.c")?;
    std::fs::write(
        dir.join("Makefile"),
        "CC = gcc\nCFLAGS = -O2 -g -Wall\nOBJS = $(patsubst %.c,%.o,$(wildcard unit_*.c)) main.o\n\n\
         app: $(OBJS)\n\t$(CC) -o $@ $(OBJS) -lm\n\n%.o: %.c\n\t$(CC) $(CFLAGS) -c -o $@ $<\n\n\
         clean:\n\trm -f *.o app\n",
    )
    .context("cannot write the Makefile")?;
    Ok(())
}

fn generated_unit(unit: usize, rng: &mut SplitMix) -> String {
    let mut c = String::from(
        "#include <math.h>\n#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n\n",
    );
    let _ = writeln!(
        c,
        "struct u{unit}_rec {{ int id; double weight; char name[32]; unsigned long flags; }};\n"
    );
    let _ = writeln!(
        c,
        "static int u{unit}_cmp(const void *a, const void *b) {{\n    \
         const struct u{unit}_rec *x = a, *y = b;\n    \
         return (x->weight > y->weight) - (x->weight < y->weight);\n}}\n"
    );
    let functions = 8 + (rng.below(7) as usize);
    for f in 0..functions {
        let (k1, k2, k3, k4) = (rng.below(97), rng.below(13), rng.below(1000), rng.below(7));
        match f % 3 {
            0 => {
                let _ = writeln!(
                    c,
                    "static double u{unit}_f{f}(struct u{unit}_rec *r, int n) {{\n    \
                     double acc = {k3}.0;\n    \
                     for (int k = 0; k < n; k++) {{\n        \
                     switch ((r[k].id + {k1}) % 5) {{\n        \
                     case 0: acc += sin(r[k].weight) * {k2}; break;\n        \
                     case 1: acc -= sqrt(fabs(r[k].weight) + {k4}); break;\n        \
                     case 2: r[k].flags ^= (unsigned long)k << {k2}; break;\n        \
                     case 3: snprintf(r[k].name, sizeof r[k].name, \"n%d-%d\", k, {k3}); break;\n        \
                     default: acc *= 1.0 + 1e-6 * (double)strlen(r[k].name);\n        \
                     }}\n    }}\n    \
                     qsort(r, (size_t)n, sizeof *r, u{unit}_cmp);\n    \
                     return acc;\n}}\n"
                );
            }
            1 => {
                let _ = writeln!(
                    c,
                    "static double u{unit}_f{f}(struct u{unit}_rec *r, int n) {{\n    \
                     double m[8][8], out[8][8];\n    \
                     for (int i = 0; i < 8; i++)\n        \
                     for (int j = 0; j < 8; j++) m[i][j] = r[(i * 8 + j) % n].weight + {k1};\n    \
                     for (int i = 0; i < 8; i++)\n        \
                     for (int j = 0; j < 8; j++) {{\n            \
                     double s = 0;\n            \
                     for (int k = 0; k < 8; k++) s += m[i][k] * m[k][j];\n            \
                     out[i][j] = s / ({k2} + 1.0);\n        \
                     }}\n    \
                     return out[{k4}][{k2} % 8] + out[{k2} % 8][{k4}];\n}}\n"
                );
            }
            _ => {
                let _ = writeln!(
                    c,
                    "static double u{unit}_f{f}(struct u{unit}_rec *r, int n) {{\n    \
                     char buf[128];\n    \
                     size_t total = 0;\n    \
                     for (int k = 0; k < n; k += {step}) {{\n        \
                     int len = snprintf(buf, sizeof buf, \"%s/%lu/%d\", r[k].name, r[k].flags, {k3});\n        \
                     for (int i = 0; i < len; i++) buf[i] = (char)(buf[i] ^ {k1});\n        \
                     total += strlen(buf) + (size_t)memchr(buf, {k2}, (size_t)len) % 3;\n    \
                     }}\n    \
                     return (double)total;\n}}\n",
                    step = 1 + k4
                );
            }
        }
    }
    let _ = writeln!(
        c,
        "int unit_{unit}_entry(int n) {{\n    \
         struct u{unit}_rec *r = calloc((size_t)n, sizeof *r);\n    \
         if (!r) return 0;\n    \
         for (int k = 0; k < n; k++) {{ r[k].id = k * {}; r[k].weight = k * 0.5; }}\n    \
         double acc = 0;",
        rng.below(50) + 1
    );
    for f in 0..functions {
        let _ = writeln!(c, "    acc += u{unit}_f{f}(r, n);");
    }
    c.push_str("    free(r);\n    return (int)acc;\n}\n");
    c
}

/// A child in its own process group: dropping it kills the whole group (SIGKILL) and reaps the
/// leader, so no part of the workload outlives the suite, also on error or Ctrl-C.
pub struct Group {
    child: Child,
    what: String,
    status: Option<ExitStatus>,
    /// When `exited` first saw it gone.
    pub exited_at: Option<Instant>,
}

impl Group {
    /// Starts `cmd` with stdin closed and stdout and stderr appended to `log`.
    pub fn spawn(mut cmd: Command, what: &str, log: &Path) -> Result<Group> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let err = out
            .try_clone()
            .context("cannot duplicate a log file handle")?;
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start {what} ({:?})", cmd.get_program()))?;
        Ok(Group {
            child,
            what: what.to_string(),
            status: None,
            exited_at: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn what(&self) -> &str {
        &self.what
    }

    /// The leader's exit status once it has exited (never blocks).
    pub fn exited(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .with_context(|| format!("cannot wait for {}", self.what))?;
            if self.status.is_some() {
                self.exited_at = Some(Instant::now());
            }
        }
        Ok(self.status)
    }

    /// Sends `signal` to the leader only and waits up to `timeout` for it to exit; kills the
    /// group when it does not. Returns the status and how long the exit took.
    pub fn stop(
        &mut self,
        signal: libc::c_int,
        timeout: Duration,
    ) -> Result<(ExitStatus, Duration)> {
        let started = Instant::now();
        if self.exited()?.is_none() {
            let pid = self.pid() as libc::pid_t;
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is our unreaped child.
            unsafe { libc::kill(pid, signal) };
        }
        while self.exited()?.is_none() {
            if started.elapsed() > timeout {
                eprintln!(
                    "bench: warning: {} did not exit {timeout:?} after signal {signal}; killing it",
                    self.what
                );
                self.kill_group();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let status = match self.status {
            Some(status) => status,
            None => self
                .child
                .wait()
                .with_context(|| format!("cannot wait for {}", self.what))?,
        };
        self.status = Some(status);
        Ok((status, started.elapsed()))
    }

    fn kill_group(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) has no memory-safety preconditions. The group id is the leader's pid;
        // Linux does not hand out a pid that is still a process group's id, so the signal can
        // only reach what is left of this group.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// What the build loop did.
#[derive(Clone, Debug, Default)]
pub struct BuildStats {
    /// Complete `make clean` + `make -j4` cycles.
    pub builds: u32,
    /// Object files compiled (each one gcc → cc1 → as), the unfinished build included.
    pub objects: u64,
    pub failures: u32,
    /// Seconds of each complete build (the `make -j4` part).
    pub build_seconds: Vec<f64>,
    pub last_error: Option<String>,
}

/// `make clean` then `make -j4` in the generated tree, over and over, on its own thread until
/// stopped. Dropping it stops it and kills the make in progress.
pub struct BuildLoop {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<BuildStats>>,
}

impl BuildLoop {
    pub fn start(dir: PathBuf, log: PathBuf) -> BuildLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || build_loop(&dir, &log, &flag));
        BuildLoop {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the loop (killing the make in progress) and returns what it did.
    pub fn finish(mut self) -> BuildStats {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for BuildLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn count_objects(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|ext| ext == "o"))
            .count() as u64
    })
}

fn build_loop(dir: &Path, log: &Path, stop: &AtomicBool) -> BuildStats {
    let mut stats = BuildStats::default();
    // Runs one make; None when stopped meanwhile (the make's group is then killed on drop).
    let make = |args: &[&str], stats: &mut BuildStats| -> Option<bool> {
        let mut cmd = Command::new("make");
        cmd.arg("-C").arg(dir).args(args);
        let mut group = match Group::spawn(cmd, "make", log) {
            Ok(group) => group,
            Err(err) => {
                stats.last_error = Some(format!("{err:#}"));
                return Some(false);
            }
        };
        loop {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            match group.exited() {
                Ok(Some(status)) => {
                    if !status.success() {
                        stats.last_error =
                            Some(format!("make {} failed ({status})", args.join(" ")));
                    }
                    return Some(status.success());
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(err) => {
                    stats.last_error = Some(format!("{err:#}"));
                    return Some(false);
                }
            }
        }
    };
    loop {
        let Some(cleaned) = make(&["-s", "clean"], &mut stats) else {
            return stats;
        };
        let started = Instant::now();
        let Some(built) = make(&["-s", "-j4", "app"], &mut stats) else {
            stats.objects += count_objects(dir);
            return stats;
        };
        stats.objects += count_objects(dir);
        if cleaned && built {
            stats.builds += 1;
            stats.build_seconds.push(started.elapsed().as_secs_f64());
        } else {
            stats.failures += 1;
            // Do not spin on a build that cannot succeed.
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// The last line of a part's log that starts with `seconds=` (the progress lines of the
/// spawner, the Python services and the PyTorch loop).
pub fn last_progress_line(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .rev()
        .find(|line| line.starts_with("seconds="))
        .map(str::to_string)
}

/// The value of `key=` in a progress line.
pub fn progress_value(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}
