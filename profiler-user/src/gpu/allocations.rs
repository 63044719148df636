//! Device memory still allocated, by allocating stack: the `inuse_*` half of the `cuda_alloc`
//! memory profile. Allocation records carry the device pointer (read at the call's return);
//! free records name it, so the agent pairs them here. Bounded: past [`MAX_LIVE_ALLOCATIONS`]
//! new allocations are profiled as allocated but not tracked, and counted.
use std::{collections::HashMap, sync::Arc};

use crate::model::{Pid, ProcessInfo, Sample, SymbolizedFrame};

/// Live allocations tracked at most (about 100 bytes each, plus their shared stacks).
pub const MAX_LIVE_ALLOCATIONS: usize = 262_144;

/// Where an allocation was made: what the aggregator needs to add it again at every window's
/// end while it lives. Shared by the allocations made from one stack.
#[derive(Debug)]
pub struct AllocationSite {
    pub process: Option<Arc<ProcessInfo>>,
    /// The allocating thread (pid, tid, name); no addresses.
    pub sample: Sample,
    /// Innermost first, the API function as the leaf.
    pub frames: Vec<Arc<SymbolizedFrame>>,
    pub truncated: bool,
}

/// A site's identity: the thread and its frames (the symbolizer returns one `Arc` per frame).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SiteKey {
    pid: Pid,
    tid: u32,
    frames: Vec<usize>,
    truncated: bool,
}

#[derive(Debug)]
struct Live {
    bytes: u64,
    /// `bpf_ktime_get_ns()` at the allocation's return.
    ktime_ns: u64,
    site: Arc<AllocationSite>,
}

/// Counters for self-metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocationStats {
    pub allocations: u64,
    pub allocated_bytes: u64,
    /// Frees of tracked allocations and their bytes.
    pub frees: u64,
    pub freed_bytes: u64,
    /// Frees of pointers not tracked (allocated before the agent started, or not tracked
    /// because the map was full).
    pub untracked_frees: u64,
    /// Allocations not tracked because [`MAX_LIVE_ALLOCATIONS`] were live.
    pub overflow: u64,
    /// Allocations released by their process's exit or exec, and their bytes.
    pub released: u64,
    pub released_bytes: u64,
    /// Gauges: tracked allocations alive now and their bytes.
    pub live: u64,
    pub live_bytes: u64,
}

/// The tracked allocations, by process and device pointer. Per process, so an exit (of any
/// process on the host) only looks at that process's allocations.
#[derive(Debug)]
pub struct LiveAllocations {
    /// foldhash: every exit and exec on the host releases its process here.
    live: foldhash::HashMap<Pid, HashMap<u64, Live>>,
    /// Allocations in `live`, all processes together.
    live_count: usize,
    sites: HashMap<SiteKey, Arc<AllocationSite>>,
    capacity: usize,
    stats: AllocationStats,
}

impl Default for LiveAllocations {
    fn default() -> Self {
        LiveAllocations::new(MAX_LIVE_ALLOCATIONS)
    }
}

impl LiveAllocations {
    pub fn new(capacity: usize) -> Self {
        LiveAllocations {
            live: foldhash::HashMap::default(),
            live_count: 0,
            sites: HashMap::new(),
            capacity,
            stats: AllocationStats::default(),
        }
    }

    pub fn stats(&self) -> AllocationStats {
        AllocationStats {
            live: self.live_count as u64,
            live_bytes: self
                .live
                .values()
                .flat_map(HashMap::values)
                .map(|l| l.bytes)
                .sum(),
            ..self.stats
        }
    }

    /// The shared site for this stack of this thread.
    pub fn site(
        &mut self,
        process: Option<Arc<ProcessInfo>>,
        sample: &Sample,
        frames: Vec<Arc<SymbolizedFrame>>,
        truncated: bool,
    ) -> Arc<AllocationSite> {
        let key = SiteKey {
            pid: sample.pid,
            tid: sample.tid.0,
            frames: frames.iter().map(|f| Arc::as_ptr(f) as usize).collect(),
            truncated,
        };
        if let Some(site) = self.sites.get(&key) {
            return site.clone();
        }
        let site = Arc::new(AllocationSite {
            process,
            sample: Sample {
                ktime_ns: sample.ktime_ns,
                pid: sample.pid,
                tid: sample.tid,
                cpu: sample.cpu,
                comm: sample.comm.clone(),
                ..Sample::default()
            },
            frames,
            truncated,
        });
        self.sites.insert(key, site.clone());
        site
    }

    /// `bytes` at `pointer` were allocated from `site`.
    pub fn allocated(
        &mut self,
        pid: Pid,
        pointer: u64,
        bytes: u64,
        ktime_ns: u64,
        site: Arc<AllocationSite>,
    ) {
        self.stats.allocations += 1;
        self.stats.allocated_bytes = self.stats.allocated_bytes.saturating_add(bytes);
        let known = self
            .live
            .get(&pid)
            .is_some_and(|process| process.contains_key(&pointer));
        if self.live_count >= self.capacity && !known {
            self.stats.overflow += 1;
            return;
        }
        // A pointer handed out again without a free seen in between (a missed free): the new
        // allocation replaces the old one.
        let replaced = self.live.entry(pid).or_default().insert(
            pointer,
            Live {
                bytes,
                ktime_ns,
                site,
            },
        );
        if replaced.is_none() {
            self.live_count += 1;
        }
    }

    /// `pointer` was freed; returns the bytes it held when it was tracked.
    pub fn freed(&mut self, pid: Pid, pointer: u64) -> Option<u64> {
        let removed = self
            .live
            .get_mut(&pid)
            .and_then(|process| process.remove(&pointer));
        if removed.is_some() && self.live.get(&pid).is_some_and(HashMap::is_empty) {
            self.live.remove(&pid);
        }
        match removed {
            Some(live) => {
                self.live_count -= 1;
                self.stats.frees += 1;
                self.stats.freed_bytes = self.stats.freed_bytes.saturating_add(live.bytes);
                Some(live.bytes)
            }
            None => {
                self.stats.untracked_frees += 1;
                None
            }
        }
    }

    /// The process exited or exec'ed at `ktime_ns`: the driver released what it allocated
    /// before (allocations after are a new program's or a new process's).
    pub fn release_process(&mut self, pid: Pid, ktime_ns: u64) {
        let Some(process) = self.live.get_mut(&pid) else {
            return;
        };
        let stats = &mut self.stats;
        let before = process.len();
        process.retain(|_, live| {
            let released = live.ktime_ns < ktime_ns;
            if released {
                stats.released += 1;
                stats.released_bytes = stats.released_bytes.saturating_add(live.bytes);
            }
            !released
        });
        self.live_count -= before - process.len();
        if process.is_empty() {
            self.live.remove(&pid);
        }
    }

    /// What is allocated now, per site: (site, allocations, bytes).
    pub fn in_use(&self) -> Vec<(Arc<AllocationSite>, u64, u64)> {
        let mut by_site: HashMap<usize, (Arc<AllocationSite>, u64, u64)> = HashMap::new();
        for live in self.live.values().flat_map(HashMap::values) {
            let entry = by_site
                .entry(Arc::as_ptr(&live.site) as usize)
                .or_insert_with(|| (live.site.clone(), 0, 0));
            entry.1 += 1;
            entry.2 = entry.2.saturating_add(live.bytes);
        }
        by_site.into_values().collect()
    }

    /// Forgets sites no live allocation uses (call once per window).
    pub fn prune_sites(&mut self) {
        self.sites.retain(|_, site| Arc::strong_count(site) > 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{aggregation::synthetic_frame, model::Tid};

    fn sample(pid: u32, tid: u32) -> Sample {
        Sample {
            pid: Pid(pid),
            tid: Tid(tid),
            comm: "worker".into(),
            user_ips: vec![1, 2, 3],
            ..Sample::default()
        }
    }

    #[test]
    fn frees_pair_with_allocations_and_live_memory_is_grouped_by_site() {
        let mut allocations = LiveAllocations::new(10);
        let (api, caller) = (synthetic_frame("cudaMalloc"), synthetic_frame("train_step"));
        let site = allocations.site(
            None,
            &sample(7, 8),
            vec![api.clone(), caller.clone()],
            false,
        );
        let same = allocations.site(None, &sample(7, 8), vec![api.clone(), caller], false);
        assert!(Arc::ptr_eq(&site, &same), "one site per stack");
        assert!(site.sample.user_ips.is_empty(), "no addresses kept");
        let other = allocations.site(None, &sample(7, 8), vec![api], false);
        allocations.allocated(Pid(7), 0x1000, 4096, 10, site.clone());
        allocations.allocated(Pid(7), 0x2000, 8192, 11, site.clone());
        allocations.allocated(Pid(7), 0x3000, 100, 12, other.clone());
        // Same pointer value in another process: another allocation.
        allocations.allocated(Pid(9), 0x1000, 1, 13, other.clone());
        assert_eq!(allocations.freed(Pid(7), 0x1000), Some(4096));
        assert_eq!(allocations.freed(Pid(7), 0x1000), None, "freed once");
        assert_eq!(allocations.freed(Pid(7), 0x9999), None);
        let mut in_use: Vec<(u64, u64)> = allocations
            .in_use()
            .iter()
            .map(|(_, objects, bytes)| (*objects, *bytes))
            .collect();
        in_use.sort();
        assert_eq!(in_use, [(1, 8192), (2, 101)]);
        let stats = allocations.stats();
        assert_eq!(
            (stats.allocations, stats.allocated_bytes),
            (4, 4096 + 8192 + 100 + 1)
        );
        assert_eq!((stats.frees, stats.freed_bytes), (1, 4096));
        assert_eq!(stats.untracked_frees, 2);
        assert_eq!((stats.live, stats.live_bytes), (3, 8192 + 100 + 1));
        // The process exits at time 12: what it allocated before is released, later
        // allocations (a new process with the pid) stay.
        allocations.release_process(Pid(7), 12);
        let stats = allocations.stats();
        assert_eq!((stats.released, stats.released_bytes), (1, 8192));
        assert_eq!((stats.live, stats.live_bytes), (2, 101));
        // A process with nothing left is forgotten; a process never seen costs nothing.
        allocations.release_process(Pid(9), 100);
        allocations.release_process(Pid(11), 100);
        assert!(!allocations.live.contains_key(&Pid(9)));
        assert_eq!(allocations.stats().live, 1);
        drop((site, same));
        allocations.prune_sites();
        assert_eq!(allocations.sites.len(), 1, "only the site still in use");
    }

    #[test]
    fn the_map_is_bounded_and_overflow_counted() {
        let mut allocations = LiveAllocations::new(2);
        let site = allocations.site(None, &sample(1, 1), Vec::new(), false);
        for pointer in 1..=5 {
            allocations.allocated(Pid(1), pointer, 10, 0, site.clone());
        }
        let stats = allocations.stats();
        assert_eq!((stats.allocations, stats.allocated_bytes), (5, 50));
        assert_eq!(stats.overflow, 3);
        assert_eq!(stats.live, 2);
        // Untracked pointers freed later are counted, never subtracted.
        assert_eq!(allocations.freed(Pid(1), 5), None);
        assert_eq!(allocations.stats().untracked_frees, 1);
    }
}
