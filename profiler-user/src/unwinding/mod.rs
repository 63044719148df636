//! Stage ②: turns a sample's raw addresses into normalized frames.
//!
//! User addresses are resolved against the snapshot of the process's mappings into
//! (file, file offset), so symbolization works on file identity and keeps working after the
//! process exits. Return addresses are looked up at `ip - 1` so that a call at the very end of
//! a function (e.g. to a `noreturn` callee) is attributed to the caller, not to the next
//! function; the innermost address, the stopped instruction, as it is. The native user stack itself is unwound in BPF, by the tables built here from each
//! binary's `.eh_frame` (frame pointers only where a file provably keeps them), and finished
//! here (`late`) when BPF could not prove a caller.
pub mod late;
pub mod native;
pub mod read_cache;
pub mod tables;

use std::sync::Arc;

use crate::model::{Pid, ProcessInfo, Sample, UnwoundFrame, UnwoundStack};

/// Where unwinding gets process snapshots from (the process registry in the agent).
pub trait ProcessSource {
    fn lookup(&mut self, pid: Pid) -> Option<Arc<ProcessInfo>>;
    /// A fresh snapshot after `addr` was found in no mapping (dlopen or exec since the last
    /// one); rate-limited by the implementation.
    fn refresh_for_address(&mut self, pid: Pid, addr: u64) -> Option<Arc<ProcessInfo>>;
}

/// Counters of the unwinding stage.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnwindStats {
    pub stacks: u64,
    pub truncated_stacks: u64,
    /// User addresses that fell in no file-backed mapping even after a refresh.
    pub unmapped_frames: u64,
    /// Samples (with or without a user stack) of processes that were gone before their
    /// snapshot could be taken.
    pub unknown_processes: u64,
    /// Stacks cut at a frame whose table was not loaded yet: the callers BPF took from the
    /// frame-pointer chain there were guesses.
    pub guessed_callers_dropped: u64,
}

#[derive(Debug, Default)]
pub struct Unwinder {
    pub stats: UnwindStats,
}

impl Unwinder {
    /// Kernel frames (innermost first), then user frames (innermost first).
    pub fn unwind(
        &mut self,
        sample: &Sample,
        processes: &mut impl ProcessSource,
    ) -> (UnwoundStack, Option<Arc<ProcessInfo>>) {
        self.stats.stacks += 1;
        let mut frames = Vec::with_capacity(sample.kernel_ips.len() + sample.user_ips.len());
        frames.extend(sample.kernel_ips.iter().enumerate().map(|(depth, &ip)| {
            UnwoundFrame::Kernel(if depth == 0 { ip } else { ip.saturating_sub(1) })
        }));

        let mut process = if sample.user_ips.is_empty() {
            None
        } else {
            processes.lookup(sample.pid)
        };
        for (depth, &ip) in sample.user_ips.iter().enumerate() {
            let lookup = user_lookup_address(sample, depth, ip);
            let mut frame = resolve(process.as_deref(), ip, lookup);
            if matches!(frame, UnwoundFrame::UserUnmapped { name: None, .. })
                && let Some(fresh) = processes.refresh_for_address(sample.pid, lookup)
            {
                frame = resolve(Some(&fresh), ip, lookup);
                process = Some(fresh);
            }
            if matches!(frame, UnwoundFrame::UserUnmapped { .. }) {
                self.stats.unmapped_frames += 1;
            }
            frames.push(frame);
        }
        let truncated = sample.user_truncated || sample.kernel_truncated;
        if truncated {
            self.stats.truncated_stacks += 1;
        }
        let process = process.or_else(|| {
            if sample.user_ips.is_empty() {
                processes.lookup(sample.pid)
            } else {
                None
            }
        });
        // Kernel-only samples count too: a thread's last moments in `do_exit` have no user
        // stack, and without a process their service is a guess.
        if process.is_none() {
            self.stats.unknown_processes += 1;
        }
        (UnwoundStack { frames, truncated }, process)
    }
}

/// Where the user address at `depth` of `sample` is looked up in the mappings: a return
/// address belongs to the call before it, so one byte back. The innermost address is the
/// thread's saved instruction pointer, looked up as it is (as BPF's walk does): in user mode
/// or in an interrupt, the next instruction to run; in a page fault, the faulting one (often
/// a function's first, where one byte back is the function before it, or another library);
/// in a syscall, the one after `syscall`, in the same function and the same unwind row
/// (a syscall moves no stack pointer). Only a CUDA probe's caller is a return address.
pub fn user_lookup_address(sample: &Sample, depth: usize, ip: u64) -> u64 {
    if depth == 0 && !sample.user_leaf_is_return_address {
        ip
    } else {
        ip.saturating_sub(1)
    }
}

/// An exact address (not a return address) of `process`, such as a CUDA kernel's host stub.
pub fn resolve_address(process: &ProcessInfo, addr: u64) -> UnwoundFrame {
    resolve(Some(process), addr, addr)
}

fn resolve(process: Option<&ProcessInfo>, addr: u64, lookup: u64) -> UnwoundFrame {
    let Some(mapping) = process.and_then(|p| p.mapping_for(lookup)) else {
        return UnwoundFrame::UserUnmapped { addr, name: None };
    };
    match &mapping.file {
        Some(file) => UnwoundFrame::User {
            addr,
            file: file.clone(),
            file_offset: lookup - mapping.start + mapping.file_offset,
            mapping_start: mapping.start,
            mapping_end: mapping.end,
            mapping_offset: mapping.file_offset,
        },
        None => UnwoundFrame::UserUnmapped {
            addr,
            name: Some(mapping.name.clone()),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::{FileId, MappedFile, Mapping, ProcessLabels, Tid};

    struct FakeProcesses {
        first: Option<Arc<ProcessInfo>>,
        refreshed: Option<Arc<ProcessInfo>>,
        refreshes: usize,
    }

    impl ProcessSource for FakeProcesses {
        fn lookup(&mut self, _pid: Pid) -> Option<Arc<ProcessInfo>> {
            self.first.clone()
        }
        fn refresh_for_address(&mut self, _pid: Pid, _addr: u64) -> Option<Arc<ProcessInfo>> {
            self.refreshes += 1;
            self.refreshed.clone()
        }
    }

    fn file(ino: u64, path: &str) -> Arc<MappedFile> {
        Arc::new(MappedFile {
            id: FileId { dev: 1, ino },
            path: path.into(),
            open_path: PathBuf::from(path),
            build_id: None,
            handle: None,
        })
    }

    fn process(mappings: Vec<Mapping>) -> Arc<ProcessInfo> {
        Arc::new(ProcessInfo {
            pid: Pid(7),
            start_time: 1,
            comm: "app".into(),
            labels: ProcessLabels::default(),
            mappings,
            is_kernel_thread: false,
        })
    }

    fn mapping(
        start: u64,
        end: u64,
        offset: u64,
        file: Option<Arc<MappedFile>>,
        name: &str,
    ) -> Mapping {
        Mapping {
            start,
            end,
            file_offset: offset,
            file,
            name: name.into(),
        }
    }

    fn sample(kernel: Vec<u64>, user: Vec<u64>) -> Sample {
        Sample {
            ktime_ns: 0,
            pid: Pid(7),
            tid: Tid(7),
            cpu: 0,
            comm: "app".into(),
            kernel_ips: kernel,
            user_ips: user,
            ..Default::default()
        }
    }

    #[test]
    fn resolves_file_offsets_and_uses_ip_minus_one_for_return_addresses() {
        let exe = file(1, "/bin/app");
        let libc = file(2, "/lib/libc.so.6");
        let proc_ = process(vec![
            mapping(0x40_1000, 0x40_2000, 0x1000, Some(exe.clone()), "/bin/app"),
            mapping(
                0x7f00_0000_0000,
                0x7f00_0010_0000,
                0x2_8000,
                Some(libc),
                "/lib/libc.so.6",
            ),
            mapping(0x7fff_f000_0000, 0x7fff_f000_2000, 0, None, "[vdso]"),
        ]);
        let mut fake = FakeProcesses {
            first: Some(proc_),
            refreshed: None,
            refreshes: 0,
        };
        let mut unwinder = Unwinder::default();
        let (stack, _) = unwinder.unwind(
            &sample(vec![], vec![0x40_1010, 0x7f00_0000_0100, 0x7fff_f000_0010]),
            &mut fake,
        );
        match &stack.frames[0] {
            UnwoundFrame::User {
                file_offset, addr, ..
            } => {
                assert_eq!(
                    (*file_offset, *addr),
                    (0x1010, 0x40_1010),
                    "leaf of a user-mode sample is exact"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        match &stack.frames[1] {
            UnwoundFrame::User {
                file_offset, file, ..
            } => {
                assert_eq!(*file_offset, 0x2_8000 + 0xff);
                assert_eq!(&*file.path, "/lib/libc.so.6");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            matches!(&stack.frames[2], UnwoundFrame::UserUnmapped { name: Some(n), .. } if &**n == "[vdso]")
        );
        assert_eq!(
            fake.refreshes, 0,
            "special mappings do not trigger a refresh"
        );
    }

    #[test]
    fn under_kernel_frames_the_user_leaf_is_the_stopped_instruction() {
        // A page fault on the first instruction of a library's code (its `_init`, run by
        // ld.so): the saved instruction pointer is the mapping's first byte, and one byte back
        // is outside every mapping.
        let exe = file(1, "/bin/app");
        let lib = file(2, "/lib/libtinfo.so.6");
        let proc_ = process(vec![
            mapping(0x1000, 0x2000, 0, Some(exe), "/bin/app"),
            mapping(0x3000, 0x4000, 0x1000, Some(lib), "/lib/libtinfo.so.6"),
        ]);
        let mut fake = FakeProcesses {
            first: Some(proc_),
            refreshed: None,
            refreshes: 0,
        };
        let mut unwinder = Unwinder::default();
        let (stack, _) = unwinder.unwind(
            &sample(vec![0xffff_1000, 0xffff_2000], vec![0x3000, 0x1100]),
            &mut fake,
        );
        assert!(matches!(stack.frames[0], UnwoundFrame::Kernel(0xffff_1000)));
        assert!(matches!(stack.frames[1], UnwoundFrame::Kernel(0xffff_1fff)));
        assert!(
            matches!(
                &stack.frames[2],
                UnwoundFrame::User { file_offset: 0x1000, file, .. } if &*file.path == "/lib/libtinfo.so.6"
            ),
            "the faulting instruction itself: {:?}",
            stack.frames[2]
        );
        assert!(matches!(
            stack.frames[3],
            UnwoundFrame::User {
                file_offset: 0xff,
                ..
            }
        ));

        // A CUDA probe's stack starts at its caller's return address.
        let mut probe = sample(vec![], vec![0x1100]);
        probe.user_leaf_is_return_address = true;
        let (stack, _) = unwinder.unwind(&probe, &mut fake);
        assert!(matches!(
            stack.frames[0],
            UnwoundFrame::User {
                file_offset: 0xff,
                ..
            }
        ));
    }

    #[test]
    fn unknown_address_refreshes_the_snapshot_once() {
        let old = process(vec![mapping(
            0x1000,
            0x2000,
            0,
            Some(file(1, "/bin/app")),
            "/bin/app",
        )]);
        let new = process(vec![
            mapping(0x1000, 0x2000, 0, Some(file(1, "/bin/app")), "/bin/app"),
            mapping(
                0x9000,
                0xa000,
                0,
                Some(file(3, "/lib/plugin.so")),
                "/lib/plugin.so",
            ),
        ]);
        let mut fake = FakeProcesses {
            first: Some(old),
            refreshed: Some(new),
            refreshes: 0,
        };
        let mut unwinder = Unwinder::default();
        let (stack, process) = unwinder.unwind(&sample(vec![], vec![0x9010, 0x1010]), &mut fake);
        assert_eq!(fake.refreshes, 1);
        assert!(
            matches!(&stack.frames[0], UnwoundFrame::User { file, .. } if &*file.path == "/lib/plugin.so")
        );
        assert_eq!(process.unwrap().mappings.len(), 2);
        assert_eq!(unwinder.stats.unmapped_frames, 0);
    }

    #[test]
    fn vanished_process_keeps_frames_as_unmapped() {
        let mut fake = FakeProcesses {
            first: None,
            refreshed: None,
            refreshes: 0,
        };
        let mut unwinder = Unwinder::default();
        let (stack, process) = unwinder.unwind(&sample(vec![], vec![0x1234, 0x5678]), &mut fake);
        assert!(process.is_none());
        assert_eq!(stack.frames.len(), 2, "frames are kept, never dropped");
        assert_eq!(unwinder.stats.unknown_processes, 1);
        assert_eq!(unwinder.stats.unmapped_frames, 2);

        // A kernel-only sample (a thread exiting, its user memory gone) of a vanished process
        // counts as well; one of a known process does not.
        let (_, found) = unwinder.unwind(&sample(vec![0xffff_ffff_8100_0000], vec![]), &mut fake);
        assert!(found.is_none());
        assert_eq!(unwinder.stats.unknown_processes, 2);
        let mut known = FakeProcesses {
            first: Some(self::process(vec![])),
            refreshed: None,
            refreshes: 0,
        };
        let (_, found) = unwinder.unwind(&sample(vec![0xffff_ffff_8100_0000], vec![]), &mut known);
        assert!(found.is_some());
        assert_eq!(unwinder.stats.unknown_processes, 2);
    }
}
