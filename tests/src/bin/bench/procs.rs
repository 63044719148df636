//! Child processes measured with `wait4` (their own rusage: CPU time and peak RSS), output
//! captured by reader threads, killed if the bench bails out early; and Ctrl-C handling so the
//! bench can restore the sysctl it changed.
use std::{
    io::Read,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result, bail};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Turns Ctrl-C into a flag (checked by the wait loops) instead of killing the bench outright,
/// so the sysctl guard still restores `kernel.bpf_stats_enabled`. The children are in the same
/// process group and get the SIGINT themselves.
pub fn catch_sigint() {
    // SAFETY: installs a handler that only stores to an atomic, which is async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
    }
}

pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// What `wait4` reports about a finished child.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    /// User + system CPU time.
    pub cpu: Duration,
    /// Peak resident set size (`ru_maxrss`), bytes.
    pub max_rss_bytes: u64,
    pub success: bool,
}

/// A finished child: its usage and everything it wrote.
#[derive(Debug, Default)]
pub struct Finished {
    pub usage: Usage,
    pub stdout: String,
    pub stderr: String,
}

/// A running child. Dropping it before it was reaped kills it.
pub struct Proc {
    pid: libc::pid_t,
    what: String,
    // Kept only so its handles stay alive; it is reaped with wait4, never through `Child`.
    _child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
    done: Option<Finished>,
}

fn read_all(mut reader: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = reader.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

impl Proc {
    /// Starts `cmd` with stdout and stderr captured (stdin closed).
    pub fn spawn(mut cmd: Command, what: &str) -> Result<Proc> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {what} ({:?})", cmd.get_program()))?;
        let stdout = child.stdout.take().map(read_all);
        let stderr = child.stderr.take().map(read_all);
        Ok(Proc {
            pid: child.id() as libc::pid_t,
            what: what.to_string(),
            _child: child,
            stdout,
            stderr,
            done: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    pub fn is_done(&self) -> bool {
        self.done.is_some()
    }

    /// Reaps the child if it has exited (never blocks). Returns whether it is done.
    pub fn poll(&mut self) -> Result<bool> {
        if self.done.is_none() {
            self.wait4(libc::WNOHANG)?;
        }
        Ok(self.done.is_some())
    }

    /// Waits for the child to exit (polling, so Ctrl-C is noticed) and returns what it left.
    pub fn wait(mut self) -> Result<Finished> {
        while !self.poll()? {
            check_interrupted()?;
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(self.done.take().unwrap_or_default())
    }

    fn wait4(&mut self, flags: libc::c_int) -> Result<()> {
        let mut status = 0;
        // SAFETY: wait4 fills the status and the rusage we pass; the pid is our own child.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let reaped = unsafe { libc::wait4(self.pid, &mut status, flags, &mut usage) };
        if reaped == 0 {
            return Ok(());
        }
        if reaped < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(err).with_context(|| format!("wait4 for {}", self.what));
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.max(0) as u64)
                + Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        let join = |handle: Option<JoinHandle<String>>| {
            handle.and_then(|h| h.join().ok()).unwrap_or_default()
        };
        self.done = Some(Finished {
            usage: Usage {
                cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
                // ru_maxrss is in KiB on Linux.
                max_rss_bytes: (usage.ru_maxrss.max(0) as u64) * 1024,
                success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            },
            stdout: join(self.stdout.take()),
            stderr: join(self.stderr.take()),
        });
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.done.is_none() {
            // SAFETY: the pid is our unreaped child, so it cannot have been reused.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// Collects `child`'s stderr, line by line, into a shared string (read while it runs: a
/// recording's log lines say when it is attached).
pub fn collect_stderr(child: &mut Child) -> Result<std::sync::Arc<std::sync::Mutex<String>>> {
    use std::io::{BufRead, BufReader};
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let pipe = child.stderr.take().context("stderr")?;
    let collected = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            collected.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    Ok(log)
}
