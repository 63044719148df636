//! Stacks for the CUDA calls that came without one.
//!
//! BPF takes a stack for the first call of each kind on a thread (a kernel, a copy direction,
//! an error code: [`CudaStackKind`]) and then within the thread's budget. Every call without a
//! stack is weighted onto the last stack taken for its kind on its thread: its value is added
//! to that stack, so a profile's totals equal the calls made, and each call sits on a stack that
//! really launched the same kernel from the same thread. Where a kernel is launched from several
//! places, the stacks sampled stand for the others like CPU samples do for time: the share of
//! each place follows how often it was sampled. A kind whose stack was dropped (bounded map,
//! lost record) counts as `[stack not sampled]`, never on another kind's stack.
use std::sync::Arc;

use profiler_common::{CudaEventHeader, CudaStackKind};

use crate::{
    model::{ProcessInfo, Sample, SymbolizedFrame},
    process::lru::Lru,
};

/// Kinds remembered (per process and thread); the least recently used go first. As many as
/// BPF remembers kinds that had a stack, so a kind BPF takes no new first stack for still has
/// its stack here.
pub const MAX_CALL_STACKS: usize = profiler_common::MAX_CUDA_STACK_KINDS as usize;

/// A stack taken for one call, standing for the calls of its kind that follow.
#[derive(Debug)]
pub struct SampledStack {
    /// Caller frames, innermost first (without the call's own frames).
    pub frames: Vec<Arc<SymbolizedFrame>>,
    pub truncated: bool,
    pub process: Option<Arc<ProcessInfo>>,
    /// The sample's identity (pid, tid, thread name), without its addresses.
    pub sample: Sample,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallStackStats {
    /// Kinds with a stack held.
    pub entries: u64,
    /// Calls that came without a stack and were weighted onto their kind's stack.
    pub weighted_calls: u64,
    /// Calls that came without a stack and found none of their kind (`[stack not sampled]`).
    pub unattributed_calls: u64,
}

type Key = (u32, CudaStackKind);

pub struct CallStacks {
    stacks: Lru<Key, Arc<SampledStack>>,
    pub stats: CallStackStats,
}

impl Default for CallStacks {
    fn default() -> Self {
        Self::new(MAX_CALL_STACKS)
    }
}

fn key(header: &CudaEventHeader) -> Key {
    (
        header.pid,
        CudaStackKind::of(
            header.tid,
            header.call,
            header.flags,
            header.value,
            header.handle,
            header.aux,
        ),
    )
}

impl CallStacks {
    pub fn new(capacity: usize) -> Self {
        Self {
            stacks: Lru::new(capacity),
            stats: CallStackStats::default(),
        }
    }

    /// Keeps the stack a call came with for the calls of its kind that follow.
    pub fn remember(&mut self, header: &CudaEventHeader, stack: SampledStack) {
        let mut sample = stack.sample;
        sample.kernel_ips = Vec::new();
        sample.user_ips = Vec::new();
        sample.stack_copy = None;
        self.stacks
            .insert(key(header), Arc::new(SampledStack { sample, ..stack }));
        self.stats.entries = self.stacks.len() as u64;
    }

    /// The stack a call without one stands on, if its kind has one.
    pub fn stand_in(&mut self, header: &CudaEventHeader) -> Option<Arc<SampledStack>> {
        let found = self.stacks.get_mut(&key(header)).cloned();
        match found {
            Some(_) => self.stats.weighted_calls += 1,
            None => self.stats.unattributed_calls += 1,
        }
        found
    }

    /// Forgets the stacks of an exited process.
    pub fn forget_process(&mut self, pid: u32) {
        self.stacks.retain(|(owner, _), _| *owner != pid);
        self.stats.entries = self.stacks.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::{CALL_RT_LAUNCH, CALL_RT_MEMCPY, CUDA_EVENT_FAILED};

    fn launch(tid: u32, kernel: u64) -> CudaEventHeader {
        CudaEventHeader {
            pid: 7,
            tid,
            call: CALL_RT_LAUNCH,
            value: 1,
            handle: kernel,
            ..Default::default()
        }
    }

    fn stack(name: &str) -> SampledStack {
        SampledStack {
            frames: vec![SymbolizedFrame::synthetic(name)],
            truncated: false,
            process: None,
            sample: Sample::default(),
        }
    }

    #[test]
    fn calls_stand_on_the_last_stack_of_their_kernel_and_thread_only() {
        let mut stacks = CallStacks::new(16);
        stacks.remember(&launch(1, 0xa), stack("first_a"));
        stacks.remember(&launch(1, 0xb), stack("b"));
        stacks.remember(&launch(1, 0xa), stack("second_a"));
        let name =
            |s: Option<Arc<SampledStack>>| s.map(|s| s.frames[0].lines[0].function.to_string());
        assert_eq!(
            name(stacks.stand_in(&launch(1, 0xa))),
            Some("second_a".into())
        );
        assert_eq!(name(stacks.stand_in(&launch(1, 0xb))), Some("b".into()));
        // Another thread, another kernel, another call or a failure: no stand-in.
        assert_eq!(name(stacks.stand_in(&launch(2, 0xa))), None);
        assert_eq!(name(stacks.stand_in(&launch(1, 0xc))), None);
        let copy = CudaEventHeader {
            call: CALL_RT_MEMCPY,
            ..launch(1, 0xa)
        };
        assert_eq!(name(stacks.stand_in(&copy)), None);
        let failed = CudaEventHeader {
            flags: CUDA_EVENT_FAILED,
            value: 35,
            ..launch(1, 0xa)
        };
        assert_eq!(name(stacks.stand_in(&failed)), None);
        assert_eq!(stacks.stats.weighted_calls, 2);
        assert_eq!(stacks.stats.unattributed_calls, 4);
        stacks.forget_process(7);
        assert_eq!(stacks.stats.entries, 0);
    }

    #[test]
    fn the_map_is_bounded() {
        let mut stacks = CallStacks::new(4);
        for kernel in 0..10 {
            stacks.remember(&launch(1, kernel), stack("k"));
        }
        assert_eq!(stacks.stats.entries, 4);
        assert!(stacks.stand_in(&launch(1, 9)).is_some());
        assert!(stacks.stand_in(&launch(1, 0)).is_none());
    }
}
