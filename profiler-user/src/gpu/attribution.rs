//! The seam between the CPU pipeline and an accelerator's call attribution.
//!
//! The pipeline calls an [`Accelerator`] (CUDA's is [`CudaAttribution`]; a ROCm/HIP or Level
//! Zero one would implement the same trait): at every poll it finds new libraries and turns the
//! probes' records into [`ProfileEvent`]s, at every window's end it adds what is still held
//! (device memory in use) and starts the next window. It reaches the pipeline only through
//! [`PipelineAccess`]: processes, their stacks and symbols. The events are aggregated by the
//! pipeline, one aggregator per [`Accelerator::kinds`].
use std::{sync::Arc, time::Instant};

use profiler_common::{CUDA_EVENT_FAILED, CudaEventHeader};

use super::{
    allocations::{AllocationStats, LiveAllocations},
    call_stacks::{CallStackStats, CallStacks, SampledStack},
    discovery::{Discovery, DiscoveryStats, function_name},
    errors::FailedCalls,
    events::{
        CudaRecord, KernelNames, KernelRef, NameStats, decode_cuda_record, direction_frame,
        is_free, profile_kind,
    },
};
pub use crate::model::{PipelineAccess, ProfileEvent};
use crate::{
    bpf::{CudaEventRing, LifecycleEvent, Sampler},
    model::{Pid, ProcessInfo, ProfileKind, Sample, SymbolizedFrame, Tid},
};

/// The frame standing for the stack of a call whose stack was not taken and has no stand-in.
pub const STACK_NOT_SAMPLED_FRAME: &str = "[stack not sampled]";

/// What an accelerator reports about itself.
#[derive(Clone, Debug, Default)]
pub struct AcceleratorStats {
    pub discovery: DiscoveryStats,
    pub decode_errors: u64,
    pub names: NameStats,
    pub allocations: AllocationStats,
    pub call_stacks: CallStackStats,
    /// (function, error, calls).
    pub failed_calls: Vec<(&'static str, String, u64)>,
}

/// What the pipeline calls for one accelerator vendor's attribution.
pub trait Accelerator {
    /// The profile kinds its events go to.
    fn kinds(&self) -> &'static [ProfileKind];
    /// Finds new libraries (attaching probes through `probes`, when given) and turns the
    /// records in since the last poll into events. `lifecycle` holds the exits, execs and
    /// forks drained since. Returns `false` when the accelerator's probes cannot work here
    /// (logged): the pipeline drops it.
    fn poll(
        &mut self,
        pipeline: &mut dyn PipelineAccess,
        probes: Option<&mut Sampler>,
        lifecycle: &[LifecycleEvent],
        events: &mut Vec<ProfileEvent>,
    ) -> bool;
    /// Calls made after `end_ns` (`bpf_ktime_get_ns` time) belong to the next window.
    fn end_window_at(&mut self, end_ns: u64);
    /// The window ends: the records up to its end, then what is still held at the end.
    fn finish_window(&mut self, pipeline: &mut dyn PipelineAccess, events: &mut Vec<ProfileEvent>);
    /// The next window starts: the calls kept back from the last one.
    fn start_window(&mut self, pipeline: &mut dyn PipelineAccess, events: &mut Vec<ProfileEvent>);
    fn stats(&self) -> AcceleratorStats;
}

/// CUDA: library discovery, the probes' records, kernel names, live device allocations, the
/// stacks calls without one are weighted onto, failed calls.
pub struct CudaAttribution {
    /// The probes' records; `None` until the first CUDA library is probed.
    ring: Option<CudaEventRing>,
    discovery: Discovery,
    names: KernelNames,
    allocations: LiveAllocations,
    call_stacks: CallStacks,
    /// The end of the current window in `bpf_ktime_get_ns` time, once known: calls made after
    /// it wait in `deferred` for the next window, so a profile counts exactly its duration.
    window_end_ns: Option<u64>,
    deferred: Vec<CudaRecord>,
    failed: FailedCalls,
    decode_errors: u64,
}

impl CudaAttribution {
    /// `watch_changes`: the pipeline reports which processes' mappings changed
    /// ([`PipelineAccess::changed_processes`]), so a scan reads only their maps.
    pub fn new(watch_changes: bool) -> Self {
        let mut discovery = Discovery::new("/proc".into());
        if watch_changes {
            discovery.watch_changes();
        }
        CudaAttribution {
            ring: None,
            discovery,
            names: KernelNames::default(),
            allocations: LiveAllocations::default(),
            call_stacks: CallStacks::default(),
            window_end_ns: None,
            deferred: Vec::new(),
            failed: FailedCalls::default(),
            decode_errors: 0,
        }
    }
}

impl Accelerator for CudaAttribution {
    fn kinds(&self) -> &'static [ProfileKind] {
        &ProfileKind::CUDA
    }

    fn poll(
        &mut self,
        pipeline: &mut dyn PipelineAccess,
        probes: Option<&mut Sampler>,
        lifecycle: &[LifecycleEvent],
        events: &mut Vec<ProfileEvent>,
    ) -> bool {
        match pipeline.changed_processes() {
            Some(changed) => {
                changed
                    .changes
                    .iter()
                    .for_each(|change| self.discovery.note_mmap_change(change));
                self.discovery
                    .note_mappings_complete_before(changed.complete_before_ns);
            }
            None => self.discovery.note_unknown_changes(),
        }
        // A fork inherits its parent's mappings without announcing them.
        for event in lifecycle {
            let pid = Pid(event.pid());
            match event {
                LifecycleEvent::Execed { ktime_ns, .. } => self.discovery.note_exec(pid, *ktime_ns),
                LifecycleEvent::Forked {
                    parent, ktime_ns, ..
                } => self.discovery.note_fork(pid, Pid(*parent), *ktime_ns),
                LifecycleEvent::Exited { ktime_ns, .. } => self.discovery.note_exit(pid, *ktime_ns),
                LifecycleEvent::CgroupChanged { .. } => {}
            }
        }
        let new_users = match probes {
            Some(sampler) => {
                let new_users = self.discovery.maybe_scan(sampler);
                if sampler.cuda_unavailable() {
                    // The programs failed to load (logged once): stop scanning for libraries.
                    return false;
                }
                if self.ring.is_none() {
                    self.ring = sampler.take_cuda_ring();
                }
                new_users
            }
            None => Vec::new(),
        };
        self.drain(pipeline, lifecycle, &new_users, events);
        for event in lifecycle {
            // Whatever a process allocated before it exited or exec'ed, the driver released.
            if matches!(
                event,
                LifecycleEvent::Exited { .. } | LifecycleEvent::Execed { .. }
            ) {
                self.allocations
                    .release_process(Pid(event.pid()), event.ktime_ns());
                self.call_stacks.forget_process(event.pid());
            }
        }
        true
    }

    fn end_window_at(&mut self, end_ns: u64) {
        self.window_end_ns = Some(self.window_end_ns.map_or(end_ns, |set| set.min(end_ns)));
    }

    fn finish_window(&mut self, pipeline: &mut dyn PipelineAccess, events: &mut Vec<ProfileEvent>) {
        self.drain(pipeline, &[], &[], events);
        // The memory still allocated: `inuse_*` values, by allocating stack.
        for (site, objects, bytes) in self.allocations.in_use() {
            events.push(ProfileEvent {
                kind: ProfileKind::CudaAlloc,
                process: site.process.clone(),
                sample: site.sample.clone(),
                frames: site.frames.clone(),
                truncated: site.truncated,
                values: [0, 0, bytes, objects],
                label: None,
            });
        }
        self.allocations.prune_sites();
    }

    fn start_window(&mut self, pipeline: &mut dyn PipelineAccess, events: &mut Vec<ProfileEvent>) {
        self.window_end_ns = None;
        for record in std::mem::take(&mut self.deferred) {
            self.handle(pipeline, record, events);
        }
    }

    fn stats(&self) -> AcceleratorStats {
        AcceleratorStats {
            discovery: self.discovery.stats,
            decode_errors: self.decode_errors,
            names: self.names.stats,
            allocations: self.allocations.stats(),
            call_stacks: self.call_stacks.stats,
            failed_calls: self
                .failed
                .counts()
                .map(|(function, error, calls)| (function, error.to_owned(), calls))
                .collect(),
        }
    }
}

impl CudaAttribution {
    /// Drains the probes' records into events.
    fn drain(
        &mut self,
        pipeline: &mut dyn PipelineAccess,
        lifecycle: &[LifecycleEvent],
        new_users: &[Pid],
        events: &mut Vec<ProfileEvent>,
    ) {
        let mut records = Vec::new();
        let mut errors = 0;
        if let Some(ring) = &mut self.ring {
            ring.drain(|bytes| match decode_cuda_record(bytes) {
                Ok(record) => records.push(record),
                Err(_) => errors += 1,
            });
        }
        self.decode_errors += errors;
        let now = Instant::now();
        let mut naming: Vec<Pid> = records
            .iter()
            .filter_map(|record| match record {
                CudaRecord::Name { header, .. } => Some(Pid(header.pid)),
                CudaRecord::Call { .. } => None,
            })
            .collect();
        naming.sort_unstable();
        naming.dedup();
        self.names.begin_batch(lifecycle, &naming, now);
        // A process that uses CUDA gets its unwind tables now, so even the stacks of its
        // first calls are unwound from tables rather than frame pointers.
        for &pid in new_users {
            pipeline.prepare_process(pid);
        }
        // Names first: a handle named in this batch names the launches of the whole batch.
        let (names, calls): (Vec<CudaRecord>, Vec<CudaRecord>) = records
            .into_iter()
            .partition(|r| matches!(r, CudaRecord::Name { .. }));
        for record in names.into_iter().chain(calls) {
            self.handle(pipeline, record, events);
        }
        self.names.end_batch(now);
    }

    fn handle(
        &mut self,
        pipeline: &mut dyn PipelineAccess,
        record: CudaRecord,
        events: &mut Vec<ProfileEvent>,
    ) {
        if let CudaRecord::Call { header, .. } = &record
            && self.window_end_ns.is_some_and(|end| header.ktime_ns > end)
        {
            self.deferred.push(record);
            return;
        }
        let (header, stack) = match record {
            CudaRecord::Name { header, name } => {
                tracing::debug!(
                    pid = header.pid,
                    handle = header.handle,
                    stub = header.aux,
                    name,
                    ktime = header.ktime_ns,
                    "kernel handle named"
                );
                self.names.learn(&header, &name);
                return;
            }
            CudaRecord::Call { header, stack } => (header, stack),
        };
        let failed = header.flags & CUDA_EVENT_FAILED != 0;
        if is_free(header.call) && !failed {
            self.allocations.freed(Pid(header.pid), header.handle);
            return;
        }
        let kind = if failed {
            ProfileKind::CudaError
        } else {
            let Some(kind) = profile_kind(header.call) else {
                return;
            };
            kind
        };
        let pid = Pid(header.pid);
        let (mut frames, process, truncated, sample) = match stack {
            Some(mut sample) => {
                // The call is counted now, with the stack as far as it can be unwound now.
                let (frames, process, truncated) = pipeline.probe_stack(&mut sample);
                self.call_stacks.remember(
                    &header,
                    SampledStack {
                        frames: frames.clone(),
                        truncated,
                        process: process.clone(),
                        sample: sample.clone(),
                    },
                );
                (frames, process, truncated, sample)
            }
            // Weighted onto the last stack of its kind on its thread (gpu::call_stacks).
            None => match self.call_stacks.stand_in(&header) {
                Some(stack) => (
                    stack.frames.clone(),
                    stack.process.clone(),
                    stack.truncated,
                    stack.sample.clone(),
                ),
                None => {
                    let process = pipeline.process(pid);
                    let sample = Sample {
                        ktime_ns: header.ktime_ns,
                        pid,
                        tid: Tid(header.tid),
                        cpu: 0,
                        comm: process
                            .as_ref()
                            .map_or_else(|| Arc::from("unknown"), |p| p.comm.clone()),
                        ..Default::default()
                    };
                    (
                        vec![pipeline.synthetic(STACK_NOT_SAMPLED_FRAME)],
                        process,
                        false,
                        sample,
                    )
                }
            },
        };
        let mut leaf = Vec::with_capacity(frames.len() + 3);
        let mut label = None;
        if failed {
            let error = self.failed.count(header.call, header.value);
            leaf.push(pipeline.synthetic(&format!("[{error}]")));
            label = Some(("cuda_error", Arc::from(error)));
        } else {
            match kind {
                ProfileKind::CudaLaunch => {
                    leaf.push(self.kernel_frame(pipeline, &header, process.as_ref()))
                }
                ProfileKind::CudaMemcpy => {
                    leaf.push(pipeline.synthetic(direction_frame(header.aux)))
                }
                _ => {}
            }
        }
        leaf.push(pipeline.synthetic(function_name(header.call)));
        leaf.append(&mut frames);
        // In the order of the kind's sample types; an allocation is one object of its bytes.
        let values = if kind == ProfileKind::CudaAlloc {
            let site = self
                .allocations
                .site(process.clone(), &sample, leaf.clone(), truncated);
            self.allocations
                .allocated(pid, header.handle, header.value, header.ktime_ns, site);
            [header.value, 1, 0, 0]
        } else if failed {
            [1, 0, 0, 0]
        } else {
            [header.value, 0, 0, 0]
        };
        events.push(ProfileEvent {
            kind,
            process,
            sample,
            frames: leaf,
            truncated,
            values,
            label,
        });
    }

    /// The launched kernel as a frame: the host stub symbolized, a name learned from the
    /// driver, else `kernel@0x…`.
    fn kernel_frame(
        &mut self,
        pipeline: &mut dyn PipelineAccess,
        header: &CudaEventHeader,
        process: Option<&Arc<ProcessInfo>>,
    ) -> Arc<SymbolizedFrame> {
        match self.names.kernel(header) {
            KernelRef::Stub(stub) => pipeline
                .symbol_at(Pid(header.pid), process, stub)
                .unwrap_or_else(|| pipeline.synthetic(&format!("kernel@{stub:#x}"))),
            KernelRef::Named(name) => pipeline.synthetic(&name),
            KernelRef::Unknown(handle) => pipeline.synthetic(&format!("kernel@{handle:#x}")),
            KernelRef::Graph(exec) => pipeline.synthetic(&format!("graph@{exec:#x}")),
        }
    }
}
