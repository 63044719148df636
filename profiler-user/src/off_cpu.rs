//! Off-CPU time and GIL waits: the off-CPU program's records (`profiler_common::off_cpu`)
//! paired into profile events.
//!
//! A sampled block arrives twice: its stack when the thread was switched out
//! (`OFF_CPU_BLOCKED`), then its duration when it was switched in (`OFF_CPU_WOKEN`). The stack
//! waits here, undecoded work left for later, until its duration comes; only a block at least
//! `min_block` long is then unwound and symbolized (through [`PipelineAccess::probe_stack`],
//! as a probe's stack is). Its value is the duration divided by the sampling probability, so
//! the profile's total estimates all the time the process's threads were blocked.
//!
//! A block whose stack waits in `take_gil` (CPython taking the GIL back) is also a `gil_wait`
//! event, with the same stack and value.
use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::Duration,
};

use profiler_common::{OFF_CPU_BLOCKED, OFF_CPU_HEADER_BYTES, OFF_CPU_WOKEN, OffCpuHeader};

use crate::{
    bpf::OffCpuRing,
    model::{
        FrameKind, PipelineAccess, ProfileEvent, ProfileKind, Sample, SampleValues, SymbolizedFrame,
    },
    sampling::decode_sample,
};

/// Blocks whose stack waits for their duration, at most (oldest dropped first).
pub const MAX_PENDING_BLOCKS: usize = 16_384;
/// Bytes of their samples (stack copies included), at most.
pub const MAX_PENDING_BYTES: usize = 32 << 20;

/// What off-CPU profiling samples and keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OffCpuSettings {
    /// The share of blocking switches whose stack is taken (0 < p ≤ 1).
    pub probability: f64,
    /// Blocks shorter than this are counted in a metric, not in the profile.
    pub min_block: Duration,
    /// Also file CPython's GIL waits as `gil_wait`.
    pub gil_wait: bool,
}

/// The probability is validated finite (`cli`), so equality is total.
impl Eq for OffCpuSettings {}

impl Default for OffCpuSettings {
    fn default() -> Self {
        OffCpuSettings {
            probability: DEFAULT_OFF_CPU_PROBABILITY,
            min_block: Duration::ZERO,
            gil_wait: true,
        }
    }
}

/// The share of blocking switches whose stack is taken by default.
pub const DEFAULT_OFF_CPU_PROBABILITY: f64 = 0.05;

/// What the off-CPU stage counted; all counters since the start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OffCpuStats {
    /// Blocks in the profile, and the time they measured (before scaling by the probability).
    pub blocks: u64,
    pub blocked_ns: u64,
    /// Of those, waits for the GIL.
    pub gil_waits: u64,
    /// Blocks shorter than `min_block`, left out.
    pub short_blocks: u64,
    /// Durations whose stack never came (its record lost, or dropped from `pending`).
    pub unpaired: u64,
    /// Stacks dropped from `pending` by its bounds (their thread blocked for long, or exited).
    pub evicted: u64,
    pub decode_errors: u64,
    /// Gauges: stacks waiting for their duration, and their bytes.
    pub pending: u64,
    pub pending_bytes: u64,
}

/// A decoded off-CPU record.
#[derive(Debug)]
enum OffCpuRecord {
    Blocked { key: BlockKey, sample: Sample },
    Woken { key: BlockKey, duration_ns: u64 },
}

/// A block: its thread and its switch-out time.
type BlockKey = (u32, u64);

fn decode(bytes: &[u8]) -> Option<OffCpuRecord> {
    let header_bytes = bytes.get(..OFF_CPU_HEADER_BYTES)?;
    // SAFETY: length checked; OffCpuHeader is plain old data.
    let header: OffCpuHeader = unsafe { std::ptr::read_unaligned(header_bytes.as_ptr().cast()) };
    let key = (header.tid, header.blocked_ns);
    match header.kind {
        OFF_CPU_BLOCKED => {
            let sample = decode_sample(&bytes[OFF_CPU_HEADER_BYTES..]).ok()?;
            (sample.tid.0 == header.tid).then_some(OffCpuRecord::Blocked { key, sample })
        }
        OFF_CPU_WOKEN => Some(OffCpuRecord::Woken {
            key,
            duration_ns: header.duration_ns,
        }),
        _ => None,
    }
}

/// Bytes a waiting sample holds (what the bounds count).
fn sample_bytes(sample: &Sample) -> usize {
    std::mem::size_of::<Sample>()
        + 8 * (sample.kernel_ips.len() + sample.user_ips.len())
        + std::mem::size_of_val(sample.python_frames.as_slice())
        + sample
            .stack_copy
            .as_ref()
            .map_or(0, |copy| copy.bytes.len())
}

/// Pairs the off-CPU records and turns the blocks into `off_cpu` and `gil_wait` events.
pub struct OffCpu {
    ring: OffCpuRing,
    settings: OffCpuSettings,
    pending: HashMap<BlockKey, (Sample, usize)>,
    /// Insertion order of `pending` (keys already paired are skipped when met).
    order: VecDeque<BlockKey>,
    pending_bytes: usize,
    stats: OffCpuStats,
}

impl OffCpu {
    /// The profile kinds its events go to.
    pub fn kinds(&self) -> &'static [ProfileKind] {
        if self.settings.gil_wait {
            &[ProfileKind::OffCpu, ProfileKind::GilWait]
        } else {
            &[ProfileKind::OffCpu]
        }
    }

    pub fn new(ring: OffCpuRing, settings: OffCpuSettings) -> Self {
        OffCpu {
            ring,
            settings,
            pending: HashMap::new(),
            order: VecDeque::new(),
            pending_bytes: 0,
            stats: OffCpuStats::default(),
        }
    }

    pub fn stats(&self) -> OffCpuStats {
        OffCpuStats {
            pending: self.pending.len() as u64,
            pending_bytes: self.pending_bytes as u64,
            ..self.stats.clone()
        }
    }

    /// Takes the records in since the last poll and turns each finished block into events.
    pub fn poll(&mut self, pipeline: &mut dyn PipelineAccess, events: &mut Vec<ProfileEvent>) {
        let mut records = Vec::new();
        let mut errors = 0;
        self.ring.drain(|bytes| match decode(bytes) {
            Some(record) => records.push(record),
            None => errors += 1,
        });
        self.stats.decode_errors += errors;
        for record in records {
            match record {
                OffCpuRecord::Blocked { key, sample } => self.hold(key, sample),
                OffCpuRecord::Woken { key, duration_ns } => {
                    let Some((sample, bytes)) = self.pending.remove(&key) else {
                        self.stats.unpaired += 1;
                        continue;
                    };
                    self.pending_bytes -= bytes;
                    self.finish(pipeline, sample, duration_ns, events);
                }
            }
        }
        // Keys paired since are dropped from the order once they reach its front.
        while self
            .order
            .front()
            .is_some_and(|key| !self.pending.contains_key(key))
        {
            self.order.pop_front();
        }
    }

    fn hold(&mut self, key: BlockKey, sample: Sample) {
        let bytes = sample_bytes(&sample);
        while self.pending.len() >= MAX_PENDING_BLOCKS
            || (self.pending_bytes + bytes > MAX_PENDING_BYTES && !self.pending.is_empty())
        {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some((_, dropped)) = self.pending.remove(&oldest) {
                self.pending_bytes -= dropped;
                self.stats.evicted += 1;
            }
        }
        if let Some((_, replaced)) = self.pending.insert(key, (sample, bytes)) {
            self.pending_bytes -= replaced;
        }
        self.pending_bytes += bytes;
        self.order.push_back(key);
    }

    fn finish(
        &mut self,
        pipeline: &mut dyn PipelineAccess,
        mut sample: Sample,
        duration_ns: u64,
        events: &mut Vec<ProfileEvent>,
    ) {
        if duration_ns < self.settings.min_block.as_nanos() as u64 {
            self.stats.short_blocks += 1;
            return;
        }
        self.stats.blocks += 1;
        self.stats.blocked_ns += duration_ns;
        // A process that mostly waits may never be sampled on a CPU: its blocks register it
        // (unwind tables, Python), so BPF unwinds its next stacks itself, Python frames too.
        pipeline.prepare_process(sample.pid);
        let (mut frames, process, truncated) = pipeline.probe_stack(&mut sample);
        drop_tracing_frames(&mut frames);
        let mut values = SampleValues::default();
        values[0] = (duration_ns as f64 / self.settings.probability).round() as u64;
        // Free-threaded builds have no GIL: their waits in the thread-state machinery are not
        // GIL waits, even where a stripped build hides the function names.
        if self.settings.gil_wait
            && waits_for_gil(&frames)
            && !pipeline.free_threaded_python(sample.pid)
        {
            self.stats.gil_waits += 1;
            events.push(ProfileEvent {
                kind: ProfileKind::GilWait,
                process: process.clone(),
                sample: sample.clone(),
                frames: frames.clone(),
                truncated,
                values,
                label: None,
            });
        }
        events.push(ProfileEvent {
            kind: ProfileKind::OffCpu,
            process,
            sample,
            frames,
            truncated,
            values,
            label: None,
        });
    }
}

/// Drops the innermost kernel frames that are the tracepoint's and the program's own (the BPF
/// program, `bpf_trace_run4`, `__traceiter_sched_switch`), so a stack ends where the thread
/// blocked: in the scheduler (`__schedule`).
fn drop_tracing_frames(frames: &mut Vec<Arc<SymbolizedFrame>>) {
    let tracing = frames
        .iter()
        .take_while(|frame| {
            frame.kind == FrameKind::Kernel
                && frame.lines.last().is_some_and(|line| {
                    let name = &*line.function;
                    name.starts_with("bpf_")
                        || name.starts_with("__bpf")
                        || name.starts_with("__traceiter")
                        || name.starts_with("__probestub")
                })
        })
        .count();
    frames.drain(..tracing);
}

/// CPython functions that wait for the GIL when they call into a condition-variable wait
/// (`take_gil` itself, and its callers for builds that inline it).
const GIL_TAKERS: [&str; 8] = [
    "take_gil",
    "_PyThreadState_Attach",
    "PyEval_RestoreThread",
    "PyEval_AcquireThread",
    "PyEval_AcquireLock",
    "_PyEval_EvalFrameDefault",
    "_Py_HandlePending",
    "eval_frame_handle_pending",
];

/// Whether a blocked stack (innermost first) waits for the GIL: below the kernel frames and
/// the C library's condition-variable and futex frames, the first named frame is one of
/// [`GIL_TAKERS`], or `take_gil` is among its inlined functions. In a stripped interpreter
/// `take_gil` (a static function) has no name, nor have the C library's internals below
/// `pthread_cond_wait`: up to four nameless frames below the wait and three above it (the
/// interpreter's static helpers) are passed over. Free-threaded CPython has no GIL and no `take_gil`; the caller
/// also leaves out the processes it knows to be free-threaded.
pub fn waits_for_gil(frames: &[Arc<SymbolizedFrame>]) -> bool {
    let mut waited = false;
    let (mut nameless_below, mut nameless_above) = (0, 0);
    for frame in frames {
        match frame.kind {
            FrameKind::Kernel => continue,
            FrameKind::Python | FrameKind::Synthetic => return false,
            FrameKind::Native => {}
        }
        if frame.lines.iter().any(|line| &*line.function == "take_gil") {
            return true;
        }
        if frame.unsymbolized {
            let (count, limit) = if waited {
                (&mut nameless_above, 3)
            } else {
                (&mut nameless_below, 4)
            };
            *count += 1;
            if *count > limit {
                return false;
            }
            continue;
        }
        let function = frame.lines.last().map_or("", |line| &*line.function);
        if is_wait_primitive(function) {
            waited = true;
            continue;
        }
        return waited && GIL_TAKERS.contains(&function);
    }
    false
}

/// glibc's condition-variable and futex internals a blocked thread sits in.
fn is_wait_primitive(function: &str) -> bool {
    let bare = function.trim_start_matches('_');
    bare.starts_with("pthread_cond")
        || bare.starts_with("futex")
        || bare.starts_with("lll_")
        || bare.starts_with("GI___futex")
        || bare.starts_with("GI___pthread_cond")
        || bare.starts_with("GI___lll")
        || bare == "syscall"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FrameLine;

    fn frame(kind: FrameKind, names: &[&str]) -> Arc<SymbolizedFrame> {
        Arc::new(SymbolizedFrame {
            kind,
            address: 1,
            mapping: None,
            lines: names
                .iter()
                .map(|name| FrameLine {
                    function: (*name).into(),
                    system_name: None,
                    file: None,
                    line: 0,
                })
                .collect(),
            unsymbolized: false,
        })
    }

    #[test]
    fn a_thread_in_take_gil_waits_for_the_gil() {
        let frames = [
            frame(FrameKind::Kernel, &["schedule"]),
            frame(FrameKind::Kernel, &["futex_wait"]),
            frame(FrameKind::Native, &["__futex_abstimed_wait_common"]),
            frame(FrameKind::Native, &["___pthread_cond_timedwait"]),
            frame(FrameKind::Native, &["take_gil"]),
            frame(FrameKind::Native, &["PyEval_RestoreThread"]),
            frame(FrameKind::Python, &["worker"]),
        ];
        assert!(waits_for_gil(&frames));
    }

    #[test]
    fn an_inlined_take_gil_is_found_under_its_caller() {
        let inlined = [
            frame(FrameKind::Native, &["pthread_cond_timedwait"]),
            frame(FrameKind::Native, &["PyEval_RestoreThread"]),
        ];
        assert!(waits_for_gil(&inlined));
        let with_lines = [
            frame(FrameKind::Native, &["pthread_cond_timedwait"]),
            frame(FrameKind::Native, &["take_gil", "_PyEval_EvalFrameDefault"]),
        ];
        assert!(waits_for_gil(&with_lines));
        // A stripped interpreter: take_gil has no name, its caller is exported.
        let mut nameless = (*frame(FrameKind::Native, &["python3.14+0x2a1f0"])).clone();
        nameless.unsymbolized = true;
        let stripped = [
            frame(FrameKind::Native, &["___pthread_cond_timedwait"]),
            Arc::new(nameless.clone()),
            frame(FrameKind::Native, &["_PyThreadState_Attach"]),
        ];
        assert!(waits_for_gil(&stripped));
        // Stripped C library internals below the named wait, as Debian's libc has them.
        let stripped_libc = [
            Arc::new(nameless.clone()),
            Arc::new(nameless.clone()),
            frame(FrameKind::Native, &["pthread_cond_wait"]),
            Arc::new(nameless.clone()),
            frame(FrameKind::Native, &["_Py_HandlePending"]),
        ];
        assert!(waits_for_gil(&stripped_libc));
        // Nameless frames prove nothing: no named wait, or too many of them.
        let no_wait = [
            Arc::new(nameless.clone()),
            frame(FrameKind::Native, &["PyEval_RestoreThread"]),
        ];
        assert!(!waits_for_gil(&no_wait));
        let unknown = [
            frame(FrameKind::Native, &["___pthread_cond_timedwait"]),
            Arc::new(nameless.clone()),
            Arc::new(nameless.clone()),
            Arc::new(nameless.clone()),
            Arc::new(nameless),
            frame(FrameKind::Native, &["PyEval_RestoreThread"]),
        ];
        assert!(!waits_for_gil(&unknown));
    }

    #[test]
    fn other_waits_are_not_gil_waits() {
        // A Python thread sleeping, or reading a pipe, with the GIL released.
        let sleeping = [
            frame(FrameKind::Kernel, &["do_nanosleep"]),
            frame(FrameKind::Native, &["clock_nanosleep"]),
            frame(FrameKind::Native, &["pysleep"]),
            frame(FrameKind::Python, &["main"]),
        ];
        assert!(!waits_for_gil(&sleeping));
        // A lock's own wait is not the GIL's, even under the eval loop.
        let lock = [
            frame(FrameKind::Native, &["futex_wait"]),
            frame(FrameKind::Native, &["PyThread_acquire_lock_timed"]),
            frame(FrameKind::Native, &["_PyEval_EvalFrameDefault"]),
        ];
        assert!(!waits_for_gil(&lock));
        // The eval loop calling nothing that waits is not blocked on the GIL.
        assert!(!waits_for_gil(&[frame(
            FrameKind::Native,
            &["_PyEval_EvalFrameDefault"]
        )]));
    }

    #[test]
    fn the_programs_own_frames_are_dropped_from_a_blocked_stack() {
        let mut frames = vec![
            frame(
                FrameKind::Kernel,
                &["bpf_prog_a8686c91f0799ce9_off_cpu_switch"],
            ),
            frame(FrameKind::Kernel, &["bpf_trace_run4"]),
            frame(FrameKind::Kernel, &["__schedule"]),
            frame(FrameKind::Kernel, &["schedule"]),
            frame(FrameKind::Kernel, &["bpf_sys_bpf"]),
            frame(FrameKind::Native, &["main"]),
        ];
        drop_tracing_frames(&mut frames);
        let names: Vec<&str> = frames.iter().map(|f| &*f.lines[0].function).collect();
        assert_eq!(names, ["__schedule", "schedule", "bpf_sys_bpf", "main"]);
    }

    #[test]
    fn records_decode_and_damaged_ones_do_not() {
        let woken = OffCpuHeader {
            kind: OFF_CPU_WOKEN,
            tid: 7,
            pid: 5,
            _pad: 0,
            blocked_ns: 100,
            duration_ns: 2_000,
        };
        // SAFETY: plain old data viewed as bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&raw const woken).cast::<u8>(),
                std::mem::size_of::<OffCpuHeader>(),
            )
        };
        assert!(matches!(
            decode(bytes),
            Some(OffCpuRecord::Woken {
                key: (7, 100),
                duration_ns: 2_000
            })
        ));
        assert!(decode(&bytes[..10]).is_none());
        let mut unknown = bytes.to_vec();
        unknown[0] = 9;
        assert!(decode(&unknown).is_none());
        // A blocked record whose sample is cut short is an error, not a panic.
        let mut blocked = bytes.to_vec();
        blocked[0] = OFF_CPU_BLOCKED as u8;
        blocked.extend_from_slice(&[0; 12]);
        assert!(decode(&blocked).is_none());
    }
}
