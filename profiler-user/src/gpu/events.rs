//! Records of the CUDA probes → [`CudaRecord`], and what they mean for the profiles: which
//! profile kind an event adds to, the frames it ends with, and the kernel names learned.
use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use profiler_common::{
    CALL_DRV_ALLOC, CALL_DRV_FREE, CALL_DRV_GRAPH_LAUNCH, CALL_DRV_LAUNCH, CALL_DRV_LAUNCH_EX,
    CALL_DRV_MEMCPY, CALL_DRV_MEMCPY_DTOD, CALL_DRV_MEMCPY_DTOH, CALL_DRV_MEMCPY_HTOD,
    CALL_DRV_SYNC, CALL_RT_FREE, CALL_RT_GRAPH_LAUNCH, CALL_RT_LAUNCH, CALL_RT_LAUNCH_EXC,
    CALL_RT_LAUNCH_HANDLE, CALL_RT_MALLOC, CALL_RT_MEMCPY, CALL_RT_SYNC, CUDA_EVENT_HAS_STACK,
    CUDA_EVENT_HEADER_BYTES, CUDA_EVENT_KNOWN_FLAGS, CUDA_EVENT_NAME, CudaEventHeader,
    KERNEL_NAME_BYTES, MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE,
    MEMCPY_HOST_TO_HOST,
};

use crate::{
    bpf::LifecycleEvent,
    model::{Pid, ProfileKind, Sample},
    sampling::{DecodeError, decode_sample},
};

/// One decoded record of the `CUDA_EVENTS` ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaRecord {
    /// A reported call; `stack` is present when the thread's stack budget allowed one.
    Call {
        header: CudaEventHeader,
        stack: Option<Sample>,
    },
    /// A handle learned at the return of `__cudaGetKernel` (stub in `header.aux`) or
    /// `cuModuleGetFunction` / `cuLibraryGetKernel` (`name`).
    Name {
        header: CudaEventHeader,
        name: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CudaDecodeError {
    #[error("CUDA record has {0} bytes, fewer than its header")]
    Short(usize),
    #[error("CUDA record has unknown flag bits {0:#x}")]
    UnknownFlags(u32),
    #[error("CUDA record's stack: {0}")]
    Stack(#[from] DecodeError),
}

pub fn decode_cuda_record(bytes: &[u8]) -> Result<CudaRecord, CudaDecodeError> {
    if bytes.len() < CUDA_EVENT_HEADER_BYTES {
        return Err(CudaDecodeError::Short(bytes.len()));
    }
    // SAFETY: length checked; plain old data read unaligned.
    let header: CudaEventHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    if header.flags & !CUDA_EVENT_KNOWN_FLAGS != 0 {
        return Err(CudaDecodeError::UnknownFlags(
            header.flags & !CUDA_EVENT_KNOWN_FLAGS,
        ));
    }
    let rest = &bytes[CUDA_EVENT_HEADER_BYTES..];
    if header.flags & CUDA_EVENT_NAME != 0 {
        let raw = &rest[..rest.len().min(KERNEL_NAME_BYTES)];
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        return Ok(CudaRecord::Name {
            header,
            name: String::from_utf8_lossy(&raw[..end]).into_owned(),
        });
    }
    let stack = if header.flags & CUDA_EVENT_HAS_STACK != 0 {
        Some(decode_sample(rest)?)
    } else {
        None
    };
    Ok(CudaRecord::Call { header, stack })
}

/// The profile a call adds to, or `None` for calls that only mark state or, as frees, only
/// update the live allocations ([`is_free`]).
pub fn profile_kind(call: u32) -> Option<ProfileKind> {
    match call & 0xff {
        CALL_RT_LAUNCH
        | CALL_RT_LAUNCH_EXC
        | CALL_RT_LAUNCH_HANDLE
        | CALL_DRV_LAUNCH
        | CALL_DRV_LAUNCH_EX
        | CALL_RT_GRAPH_LAUNCH
        | CALL_DRV_GRAPH_LAUNCH => Some(ProfileKind::CudaLaunch),
        CALL_RT_SYNC | CALL_DRV_SYNC => Some(ProfileKind::CudaSync),
        CALL_RT_MEMCPY | CALL_DRV_MEMCPY | CALL_DRV_MEMCPY_HTOD | CALL_DRV_MEMCPY_DTOH
        | CALL_DRV_MEMCPY_DTOD => Some(ProfileKind::CudaMemcpy),
        CALL_RT_MALLOC | CALL_DRV_ALLOC => Some(ProfileKind::CudaAlloc),
        _ => None,
    }
}

/// Whether a call frees device memory (`handle` is the pointer).
pub fn is_free(call: u32) -> bool {
    matches!(call & 0xff, CALL_RT_FREE | CALL_DRV_FREE)
}

/// The frame naming a copy's direction (`cudaMemcpyKind`).
pub fn direction_frame(kind: u64) -> &'static str {
    match kind as u32 {
        MEMCPY_HOST_TO_HOST => "[host to host]",
        MEMCPY_HOST_TO_DEVICE => "[host to device]",
        MEMCPY_DEVICE_TO_HOST => "[device to host]",
        MEMCPY_DEVICE_TO_DEVICE => "[device to device]",
        _ => "[direction from addresses]",
    }
}

/// How a launch's kernel is to be named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelRef {
    /// Symbolize this host stub address in the process.
    Stub(u64),
    /// A name learned from the driver.
    Named(Arc<str>),
    /// Nothing known: shown as `kernel@0x…`.
    Unknown(u64),
    /// A graph launch: its kernels are not visible to launch probes.
    Graph(u64),
}

/// Handle → name maps of one program of one process.
#[derive(Debug, Default)]
struct Names {
    stubs: HashMap<u64, u64>,
    names: HashMap<u64, Arc<str>>,
}

impl Names {
    fn len(&self) -> usize {
        self.stubs.len() + self.names.len()
    }

    fn contains(&self, handle: u64) -> bool {
        self.stubs.contains_key(&handle) || self.names.contains_key(&handle)
    }
}

/// The names of a program that exec'ed or exited, kept for records made before that.
#[derive(Debug)]
struct EndedProgram {
    /// `bpf_ktime_get_ns()` of the exec or exit: records older than this were this program's.
    ended_ns: u64,
    /// When the names are dropped.
    forget_at: Instant,
    names: Names,
}

#[derive(Debug, Default)]
struct ProcessNames {
    current: Names,
    /// Oldest first.
    ended: Vec<EndedProgram>,
}

impl ProcessNames {
    /// The names that applied at `ktime_ns`.
    fn at(&self, ktime_ns: u64) -> &Names {
        self.ended
            .iter()
            .find(|program| ktime_ns < program.ended_ns)
            .map_or(&self.current, |program| &program.names)
    }

    fn at_mut(&mut self, ktime_ns: u64) -> &mut Names {
        match self
            .ended
            .iter()
            .position(|program| ktime_ns < program.ended_ns)
        {
            Some(i) => &mut self.ended[i].names,
            None => &mut self.current,
        }
    }

    fn is_empty(&self) -> bool {
        self.current.len() == 0 && self.ended.is_empty()
    }
}

/// Counters of the kernel-name maps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NameStats {
    /// Handles named.
    pub learned: u64,
    /// Names not kept because their process already had [`MAX_NAMES_PER_PROCESS`].
    pub dropped: u64,
    /// Names held now (gauge).
    pub held: u64,
}

/// Names one process may hold (a program creating kernels without end cannot grow the agent).
pub const MAX_NAMES_PER_PROCESS: usize = 65_536;
/// How long the names of a program that exited or exec'ed are kept for its records still on
/// their way (the agent drains the lifecycle events before the CUDA records, so normally none
/// are; this covers records handled in a later batch).
pub const ENDED_PROGRAM_GRACE: Duration = Duration::from_secs(5);

/// Handle → name maps learned per process, split by program: an exec or exit at time T ends
/// the names for records made after T (a new program, or a new process reusing the pid), while
/// records made before T still find them for [`ENDED_PROGRAM_GRACE`].
///
/// The agent applies one poll's input in this order: [`KernelNames::begin_batch`] with the
/// lifecycle events drained *before* the CUDA records (so every record a process made before
/// exiting is in the batch), the batch's names, its calls, then [`KernelNames::end_batch`].
#[derive(Debug, Default)]
pub struct KernelNames {
    processes: HashMap<Pid, ProcessNames>,
    pub stats: NameStats,
}

impl KernelNames {
    pub fn learn(&mut self, header: &CudaEventHeader, name: &str) {
        if name.is_empty() && header.aux == 0 {
            return;
        }
        let names = self
            .processes
            .entry(Pid(header.pid))
            .or_default()
            .at_mut(header.ktime_ns);
        if names.len() >= MAX_NAMES_PER_PROCESS && !names.contains(header.handle) {
            self.stats.dropped += 1;
            return;
        }
        if !name.is_empty() {
            names.names.insert(header.handle, name.into());
        } else {
            names.stubs.insert(header.handle, header.aux);
        }
        self.stats.learned += 1;
    }

    /// Lifecycle events drained before this batch's records: each ends the process's current
    /// program at the event's time, for a process with names and for one that names handles
    /// in this batch (`naming`: those names may be from before the event). The others, most
    /// of the hundreds of execs and exits a second of a busy host, are skipped.
    pub fn begin_batch(&mut self, lifecycle: &[LifecycleEvent], naming: &[Pid], now: Instant) {
        for event in lifecycle {
            if !matches!(
                event,
                LifecycleEvent::Exited { .. } | LifecycleEvent::Execed { .. }
            ) {
                continue;
            }
            let (pid, ktime_ns) = (Pid(event.pid()), event.ktime_ns());
            if !self.processes.contains_key(&pid) && !naming.contains(&pid) {
                continue;
            }
            let process = self.processes.entry(pid).or_default();
            let names = std::mem::take(&mut process.current);
            process.ended.push(EndedProgram {
                ended_ns: ktime_ns,
                forget_at: now + ENDED_PROGRAM_GRACE,
                names,
            });
            process.ended.sort_by_key(|program| program.ended_ns);
        }
    }

    /// Drops the names of programs that ended more than the grace period ago, and the marks
    /// of programs that ended without names (most processes never use CUDA).
    pub fn end_batch(&mut self, now: Instant) {
        self.processes.retain(|_, process| {
            process
                .ended
                .retain(|program| now < program.forget_at && program.names.len() > 0);
            !process.is_empty()
        });
        self.stats.held = self
            .processes
            .values()
            .map(|p| p.current.len() + p.ended.iter().map(|e| e.names.len()).sum::<usize>())
            .sum::<usize>() as u64;
    }

    /// How to name the kernel of a launch event.
    pub fn kernel(&self, header: &CudaEventHeader) -> KernelRef {
        match header.call & 0xff {
            CALL_RT_LAUNCH | CALL_RT_LAUNCH_EXC => return KernelRef::Stub(header.handle),
            CALL_RT_GRAPH_LAUNCH | CALL_DRV_GRAPH_LAUNCH => {
                return KernelRef::Graph(header.handle);
            }
            _ => {}
        }
        let names = self
            .processes
            .get(&Pid(header.pid))
            .map(|process| process.at(header.ktime_ns));
        if let Some(stub) = names.and_then(|n| n.stubs.get(&header.handle)) {
            KernelRef::Stub(*stub)
        } else if let Some(name) = names.and_then(|n| n.names.get(&header.handle)) {
            KernelRef::Named(name.clone())
        } else {
            KernelRef::Unknown(header.handle)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::{CALL_DRV_GET_FUNCTION, CALL_RT_GET_KERNEL};

    fn header(call: u32, handle: u64, aux: u64) -> CudaEventHeader {
        CudaEventHeader {
            pid: 7,
            tid: 7,
            call,
            handle,
            aux,
            ..Default::default()
        }
    }

    #[test]
    fn header_only_and_name_records_decode() {
        let h = header(CALL_RT_MEMCPY, 0, 1);
        let bytes =
            unsafe { std::slice::from_raw_parts((&h as *const CudaEventHeader).cast::<u8>(), 48) };
        assert_eq!(
            decode_cuda_record(bytes),
            Ok(CudaRecord::Call {
                header: h,
                stack: None
            })
        );
        let mut named = bytes.to_vec();
        named[44] = CUDA_EVENT_NAME as u8;
        named.extend_from_slice(b"triton_poi_fused_add_0\0garbage");
        match decode_cuda_record(&named) {
            Ok(CudaRecord::Name { name, .. }) => assert_eq!(name, "triton_poi_fused_add_0"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decode_cuda_record(&bytes[..10]),
            Err(CudaDecodeError::Short(10))
        );
        let mut bad = bytes.to_vec();
        bad[47] = 0x80;
        assert!(matches!(
            decode_cuda_record(&bad),
            Err(CudaDecodeError::UnknownFlags(_))
        ));
    }

    #[test]
    fn kernels_are_named_by_stub_learned_name_or_handle() {
        let mut names = KernelNames::default();
        assert_eq!(
            names.kernel(&header(CALL_RT_LAUNCH, 0x1000, 0)),
            KernelRef::Stub(0x1000)
        );
        assert_eq!(
            names.kernel(&header(CALL_DRV_LAUNCH, 0xabc, 0)),
            KernelRef::Unknown(0xabc)
        );
        names.learn(&header(CALL_DRV_GET_FUNCTION, 0xabc, 0), "gemm");
        assert_eq!(
            names.kernel(&header(CALL_DRV_LAUNCH, 0xabc, 0)),
            KernelRef::Named("gemm".into())
        );
        names.learn(&header(CALL_RT_GET_KERNEL, 0x55, 0x2000), "");
        assert_eq!(
            names.kernel(&header(CALL_RT_LAUNCH_HANDLE, 0x55, 0)),
            KernelRef::Stub(0x2000)
        );
        assert_eq!(names.stats.learned, 2);
        assert_eq!(
            profile_kind(CALL_RT_SYNC | (3 << 8)),
            Some(ProfileKind::CudaSync)
        );
        assert!(is_free(CALL_DRV_FREE | (7 << 8)));
        assert_eq!(profile_kind(CALL_DRV_FREE), None);
    }

    fn at(call: u32, handle: u64, ktime_ns: u64) -> CudaEventHeader {
        CudaEventHeader {
            ktime_ns,
            ..header(call, handle, 0)
        }
    }

    /// The agent drains lifecycle events before the CUDA ring, so a process's exit can be seen
    /// before the records it made just before exiting: those must still be named.
    #[test]
    fn names_survive_an_exit_seen_before_the_records_made_before_it() {
        let mut names = KernelNames::default();
        let start = Instant::now();
        // Batch 1: the handles are named.
        names.begin_batch(&[], &[], start);
        names.learn(&at(CALL_DRV_GET_FUNCTION, 0xabc, 100), "triton_fused_add");
        let mut stub_name = at(CALL_RT_GET_KERNEL, 0x55, 110);
        stub_name.aux = 0x2000;
        names.learn(&stub_name, "");
        names.end_batch(start);
        // Batch 2: the exit comes first, then the launches the process made before it.
        let exit = LifecycleEvent::Exited {
            pid: 7,
            ktime_ns: 1_000,
        };
        names.begin_batch(&[exit], &[], start);
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 900)),
            KernelRef::Named("triton_fused_add".into())
        );
        assert_eq!(
            names.kernel(&at(CALL_RT_LAUNCH_HANDLE, 0x55, 950)),
            KernelRef::Stub(0x2000)
        );
        // A new process reusing the pid is not named after the old one.
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 1_100)),
            KernelRef::Unknown(0xabc)
        );
        names.end_batch(start);
        // Records handled in a later batch, within the grace period, are still named.
        names.begin_batch(&[], &[], start + Duration::from_secs(1));
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 990)),
            KernelRef::Named("triton_fused_add".into())
        );
        names.end_batch(start + Duration::from_secs(1));
        assert_eq!(names.stats.held, 2);
        // After it, the names are gone.
        names.end_batch(start + ENDED_PROGRAM_GRACE);
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 990)),
            KernelRef::Unknown(0xabc)
        );
        assert_eq!(names.stats.held, 0);
    }

    /// A name and the exit of its process in one batch: the name is the old program's only.
    #[test]
    fn a_name_in_the_same_batch_as_the_exit_belongs_to_the_ended_program() {
        let mut names = KernelNames::default();
        let now = Instant::now();
        let exit = LifecycleEvent::Exited {
            pid: 7,
            ktime_ns: 1_000,
        };
        names.begin_batch(&[exit], &[Pid(7)], now);
        names.learn(&at(CALL_DRV_GET_FUNCTION, 0xabc, 500), "gemm");
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 900)),
            KernelRef::Named("gemm".into())
        );
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 1_100)),
            KernelRef::Unknown(0xabc)
        );
        names.end_batch(now);
        // Exits of processes that never named anything leave nothing behind.
        names.begin_batch(
            &[LifecycleEvent::Exited {
                pid: 99,
                ktime_ns: 2_000,
            }],
            &[],
            now,
        );
        names.end_batch(now);
        assert!(!names.processes.contains_key(&Pid(99)));
    }

    #[test]
    fn an_exec_splits_names_between_the_old_and_the_new_program() {
        let mut names = KernelNames::default();
        let now = Instant::now();
        names.learn(&at(CALL_DRV_GET_FUNCTION, 0xabc, 100), "old_kernel");
        let exec = LifecycleEvent::Execed {
            pid: 7,
            ktime_ns: 500,
            program: None,
        };
        // The batch holds the exec, a launch of the old program, and the new program naming
        // the same handle value and launching it.
        names.begin_batch(&[exec], &[Pid(7)], now);
        names.learn(&at(CALL_DRV_GET_FUNCTION, 0xabc, 600), "new_kernel");
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 400)),
            KernelRef::Named("old_kernel".into())
        );
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 700)),
            KernelRef::Named("new_kernel".into())
        );
        names.end_batch(now + ENDED_PROGRAM_GRACE);
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 0xabc, 700)),
            KernelRef::Named("new_kernel".into()),
            "the running program keeps its names"
        );
    }

    #[test]
    fn names_are_capped_per_process_not_globally() {
        let mut names = KernelNames::default();
        for handle in 0..MAX_NAMES_PER_PROCESS as u64 + 10 {
            names.learn(&at(CALL_DRV_GET_FUNCTION, handle + 1, 1), "k");
        }
        assert_eq!(names.stats.dropped, 10);
        let mut other = at(CALL_DRV_GET_FUNCTION, 0x99, 1);
        other.pid = 8;
        names.learn(&other, "other_process_kernel");
        let mut launch = at(CALL_DRV_LAUNCH, 0x99, 2);
        launch.pid = 8;
        assert_eq!(
            names.kernel(&launch),
            KernelRef::Named("other_process_kernel".into())
        );
        assert_eq!(
            names.kernel(&at(CALL_DRV_LAUNCH, 1, 2)),
            KernelRef::Named("k".into()),
            "names learned before the cap stay"
        );
        // Renaming a known handle at the cap is allowed.
        names.learn(&at(CALL_DRV_GET_FUNCTION, 1, 3), "renamed");
        assert_eq!(names.stats.dropped, 10);
    }
}
