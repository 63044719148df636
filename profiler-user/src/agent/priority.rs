//! The priority of the threads that handle samples (`--sampling-nice`).
//!
//! A sample is only useful while its process and the mappings the kernel announced for it are
//! still known; on a busy host with short-lived processes that is seconds. At nice 0 the agent's
//! fair share of CPU there was less than its start-up work, samples were handled 15-20 s late,
//! and hundreds came out `[unknown]`. So the pipeline (the caller's thread), `sample-reader`,
//! the unwind-table builders and `nvml` run at a raised priority. The HTTP server, the store and
//! the exporter are started before and keep theirs: a query or an export never competes with the
//! workload at that priority.
//!
//! Linux keeps a nice value per thread and a new thread starts with its creator's, so raising
//! the caller's thread before it starts the sampling threads raises them all.

/// What [`raise_calling_thread`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Priority {
    /// The thread now runs at `to` (it ran at `from`).
    Raised { from: i32, to: i32 },
    /// The thread already ran at `nice` or higher: left as it was.
    Kept { nice: i32 },
    /// Raising was refused (no `CAP_SYS_NICE`, or `RLIMIT_NICE`): the thread runs at `nice`.
    Refused {
        nice: i32,
        error: std::io::ErrorKind,
    },
}

/// The nice value of thread `tid`.
fn thread_nice(tid: libc::pid_t) -> std::io::Result<i32> {
    // getpriority returns -1 both for nice -1 and for an error; errno tells them apart.
    // SAFETY: __errno_location points at this thread's errno.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority reads the scheduler's value for one thread id.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    let error = std::io::Error::last_os_error();
    match error.raw_os_error() {
        Some(0) | None => Ok(nice),
        Some(_) => Err(error),
    }
}

/// Raises the calling thread to nice `wanted` unless it already runs at that or higher
/// priority; threads it starts afterwards inherit the result. Never fails: a refusal is
/// reported and the agent runs on at the priority it has.
pub(crate) fn raise_calling_thread(wanted: i32) -> Priority {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let current = match thread_nice(tid) {
        Ok(nice) => nice,
        Err(err) => {
            return Priority::Refused {
                nice: 0,
                error: err.kind(),
            };
        }
    };
    if current <= wanted {
        return Priority::Kept { nice: current };
    }
    // SAFETY: setpriority changes one thread's nice value; `tid` is the calling thread.
    let status = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, wanted) };
    if status == 0 {
        Priority::Raised {
            from: current,
            to: wanted,
        }
    } else {
        Priority::Refused {
            nice: current,
            error: std::io::Error::last_os_error().kind(),
        }
    }
}

/// [`raise_calling_thread`], logged.
pub(crate) fn raise_sampling_threads(wanted: i32) {
    match raise_calling_thread(wanted) {
        Priority::Raised { from, to } => {
            tracing::info!(from, to, "sampling threads run at a raised priority (nice)")
        }
        Priority::Kept { nice } => {
            tracing::debug!(nice, wanted, "sampling threads keep their priority (nice)")
        }
        Priority::Refused { nice, error } => tracing::warn!(
            nice,
            wanted,
            "cannot raise the sampling threads' priority ({error}); they run at nice {nice}, \
             so on a busy host samples may be handled late (give the agent CAP_SYS_NICE, or set \
             --sampling-nice {nice})"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `work` on a thread of its own (a nice value is per thread), returning its result.
    fn on_new_thread<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(work).join().expect("the thread")
    }

    fn own_nice() -> i32 {
        // SAFETY: gettid has no preconditions.
        thread_nice(unsafe { libc::gettid() }).expect("getpriority")
    }

    fn set_own_nice(nice: i32) -> bool {
        // SAFETY: setpriority on the calling thread only.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) == 0 }
    }

    #[test]
    fn raises_the_thread_and_the_threads_it_starts_and_never_lowers_it() {
        let (outcome, after, child) = on_new_thread(|| {
            // A lower priority needs no privilege; raising back may (the test runs as root).
            assert!(set_own_nice(7));
            let outcome = raise_calling_thread(3);
            let child = on_new_thread(own_nice);
            (outcome, own_nice(), child)
        });
        // The tests run as root (they load BPF programs), so raising is permitted.
        assert_eq!(outcome, Priority::Raised { from: 7, to: 3 });
        assert_eq!(
            (after, child),
            (3, 3),
            "the thread, then the thread it started"
        );

        // A thread already at a higher priority than wanted keeps it.
        let (outcome, after) = on_new_thread(|| {
            assert!(set_own_nice(12));
            (raise_calling_thread(15), own_nice())
        });
        assert_eq!((outcome, after), (Priority::Kept { nice: 12 }, 12));
    }

    #[test]
    fn reads_nice_minus_one_as_a_value_not_an_error() {
        let nice = on_new_thread(|| {
            assert!(set_own_nice(-1), "the tests run as root");
            own_nice()
        });
        assert_eq!(nice, -1);
    }
}
