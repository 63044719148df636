//! The agent's own health, kept in one place: the eBPF program's per-cause counters, each
//! stage's counters, and the agent's CPU time and memory. Logged every interval; a later
//! /metrics endpoint only has to render [`SelfMetrics::values`].
use std::time::Duration;

use crate::{
    bpf::BpfStats,
    process::mmap_events::MmapLogStats,
    runtimes::python::PythonStats,
    unwinding::{late::LateWalkStats, native::NativeTableStats},
};

/// One metric value with its Prometheus-style name and help text.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricValue {
    pub name: String,
    pub help: &'static str,
    pub value: f64,
    /// `counter` or `gauge`.
    pub kind: &'static str,
}

/// Everything the agent reports about itself at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SelfMetrics {
    pub bpf: BpfStats,
    /// Kernel-accounted run time and count of the sampler program (with kernel.bpf_stats_enabled).
    pub bpf_run_time_ns: u64,
    pub bpf_run_count: u64,
    pub samples_received: u64,
    pub samples_processed: u64,
    pub decode_errors: u64,
    /// Samples lost between the ring-buffer reader and the pipeline.
    pub agent_queue_full: u64,
    /// Samples whose stack copy the reader dropped (the queued copies were at their bound):
    /// kept, with the stack cut where BPF stopped.
    pub stack_copies_shed: u64,
    pub truncated_stacks: u64,
    pub unmapped_frames: u64,
    pub unknown_processes: u64,
    pub frames_symbolized: u64,
    pub symbolization_misses: u64,
    /// Misses named after the function (FDE) that holds them: `module!sub_<address>`.
    pub symbolization_misses_by_function: u64,
    pub symbolization_errors: u64,
    pub symbol_cache_entries: u64,
    /// Frames dropped from the symbol cache for its bound (symbolized again when they recur).
    pub symbol_cache_evicted: u64,
    /// Native frames looked up in their files (symbol cache misses) and the wall time taken.
    pub symbol_lookups: u64,
    pub symbol_lookup_time: Duration,
    pub symbol_lookup_cpu_time: Duration,
    /// Of the lookups, those that first read a file's symbol tables, and their time.
    pub symbol_file_loads: u64,
    pub symbol_file_load_time: Duration,
    /// Of the lookups' time, naming frames without a symbol by their function's start.
    pub symbol_function_start_time: Duration,
    /// Files whose parsed symbol tables are held, their estimated bytes (bounded), and how many
    /// were dropped for the bound.
    pub symbol_files: u64,
    pub symbol_file_bytes: u64,
    pub symbol_files_dropped: u64,
    /// Times the pages of symbol files were given back (page-out) to keep the file-backed RSS
    /// in its band.
    pub symbol_file_page_releases: u64,
    /// Python code objects cached (bounded).
    pub python_code_objects: u64,
    /// Function names cached by raw symbol name (bounded), and the lookups they answered.
    pub symbol_function_names: u64,
    pub symbol_function_name_hits: u64,
    /// Kernel functions remembered by their start (bounded), and the frames they named
    /// without a lookup.
    pub symbol_kernel_functions: u64,
    pub symbol_kernel_function_hits: u64,
    /// Functions of stripped files remembered (bounded), the frames they named without a
    /// lookup, and the times all were forgotten for the bound.
    pub symbol_function_ranges: u64,
    pub symbol_function_range_hits: u64,
    pub symbol_function_ranges_cleared: u64,
    /// Distinct names and paths the symbolizer shares between its frames (bounded).
    pub symbol_interned_strings: u64,
    /// Exec environments kept with their labels (bounded), and the exec events whose labels
    /// came from one of them without a parse.
    pub exec_environments: u64,
    pub exec_environments_reused: u64,
    pub processes_tracked: u64,
    /// File descriptors the process holds for files (/proc/self/fd), all users together.
    pub open_files: u64,
    /// Snapshots built from exec and fork events (/proc was gone), and identities held.
    pub process_snapshots_from_events: u64,
    /// Of those, the ones of a process whose exit was read already (/proc not asked), and
    /// the exits read and not yet applied (bounded).
    pub process_exits_known_at_lookup: u64,
    pub process_exits_ahead: u64,
    /// Snapshots of the program a process ran before the exec a sample was taken in.
    pub process_snapshots_before_exec: u64,
    /// Fork children left unknown: their parent exited (or its pid changed hands) before it
    /// was read, and was not known at the fork.
    pub process_parents_gone_since_fork: u64,
    /// Fork children named by what their parent ran at the fork, its identity gone since.
    pub process_parents_from_fork_time: u64,
    pub process_identities: u64,
    /// Of those, exited processes' (kept a minute after the exit, at most
    /// `MAX_EXITED_IDENTITIES`), and how many were forgotten for their age.
    pub process_exited_identities: u64,
    pub process_identities_expired: u64,
    /// Cgroup directory names remembered (bounded).
    pub cgroup_paths: u64,
    /// /proc/PID/cgroup texts kept parsed (bounded), and the reads they saved a parse.
    pub cgroup_texts: u64,
    pub cgroup_texts_reused: u64,
    /// Snapshots of live processes whose cgroups came from their parent at their fork, not
    /// /proc/PID/cgroup; processes whose latest move between cgroups is kept (bounded).
    pub process_cgroups_from_fork: u64,
    pub cgroup_moves: u64,
    /// Running processes' cgroups known anew from a move's destination as the kernel reported
    /// it, without reading /proc/PID/cgroup.
    pub process_cgroups_from_moves: u64,
    /// Exec'ed paths remembered with their links resolved (bounded).
    pub executable_paths: u64,
    /// Snapshots from events whose libraries came from the kernel's mmap announcements.
    pub process_snapshots_from_announced_mmaps: u64,
    /// Snapshots of live processes whose mappings came from the announcements, not /proc.
    pub process_maps_from_announcements: u64,
    /// Snapshots of live processes whose command line came from their exec event, not /proc.
    pub process_cmdlines_from_exec: u64,
    /// Snapshots of live processes whose identity came from their exec event, not
    /// /proc/PID/stat and exe.
    pub process_identities_from_exec: u64,
    /// Snapshots taken from /proc, for any reason.
    pub process_snapshots: u64,
    /// Snapshots retaken for an address in none of their mappings, and of those the ones
    /// retaken at once because code was announced there since.
    pub process_refreshes: u64,
    pub process_refreshes_announced: u64,
    pub process_refreshes_from_announcements: u64,
    pub announced_mmaps: MmapLogStats,
    pub pid_filter_entries: u32,
    pub pid_filter_capacity: u32,
    pub profiles_written: u64,
    pub export_errors: u64,
    /// Embedded store and HTTP server (filled in by the server when it reports).
    pub store_profiles_ingested: u64,
    pub store_ingest_errors: u64,
    pub store_profiles_evicted: u64,
    pub store_bytes: u64,
    /// Memory SQLite holds (its page caches and statements), against its soft limit.
    pub store_sqlite_memory_bytes: u64,
    /// The store's in-memory catalog: strings, frames, call-tree nodes.
    pub store_catalog_names: u64,
    pub store_catalog_frames: u64,
    pub store_catalog_nodes: u64,
    pub http_requests: u64,
    pub http_errors: u64,
    /// Push to Pyroscope: profiles accepted, rejected (4xx, dropped), failed attempts retried,
    /// profiles dropped by the queue bounds or unreadable in the spool, bytes queued in memory
    /// and on disk.
    pub push_sent: u64,
    pub push_failed: u64,
    pub push_retries: u64,
    pub push_dropped: u64,
    pub push_queue_bytes: u64,
    pub spool_bytes: u64,
    pub native_tables: NativeTableStats,
    /// User walks BPF left to the agent rather than guess (see `unwinding::late`).
    pub late_walks: LateWalkStats,
    /// Stacks cut where a frame's table was not loaded and BPF had guessed the callers.
    pub guessed_callers_dropped: u64,
    pub python: PythonStats,
    /// CUDA library discovery.
    pub cuda: crate::gpu::discovery::DiscoveryStats,
    /// CUDA probe records that did not decode.
    pub cuda_decode_errors: u64,
    /// Kernel names learned from the probes.
    pub cuda_names: crate::gpu::events::NameStats,
    /// Device allocations and frees paired by the agent.
    pub cuda_allocations: crate::gpu::allocations::AllocationStats,
    /// Stacks that CUDA calls without one are weighted onto.
    pub cuda_call_stacks: crate::gpu::call_stacks::CallStackStats,
    /// CUDA calls that returned an error: (function, error, calls).
    pub cuda_failed_calls: Vec<(&'static str, String, u64)>,
    /// NVML polls (device, GPM and process readings) and their cost.
    pub nvml_polls: crate::gpu::nvml::PollStats,
    /// Off-CPU blocks paired, left out and waiting.
    pub off_cpu: crate::off_cpu::OffCpuStats,
    /// Kernel-accounted run time and count of the off-CPU program (every context switch).
    pub off_cpu_run_time_ns: u64,
    pub off_cpu_run_count: u64,
    pub agent_cpu: Duration,
    pub agent_rss_bytes: u64,
    pub agent_peak_rss_bytes: u64,
    /// The allocator's own view of the agent's heap, where the program installed a reader
    /// ([`set_heap_stats_reader`]): what is allocated, against the pages it holds resident.
    pub heap: Option<HeapStats>,
}

/// The heap as the allocator sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeapStats {
    /// Bytes the program holds allocated.
    pub allocated: u64,
    /// Bytes of the allocator's pages resident in memory: the allocations, the allocator's
    /// metadata, and what fragmentation and freed pages not yet given back leave around them.
    pub resident: u64,
}

/// Reads the heap's statistics; installed once by the program that knows its allocator.
static HEAP_STATS_READER: std::sync::OnceLock<fn() -> Option<HeapStats>> =
    std::sync::OnceLock::new();

/// Installs the program's heap statistics reader (the `profiler` binary: jemalloc's). A
/// library user without one reports no heap metrics. Later calls are ignored.
pub fn set_heap_stats_reader(reader: fn() -> Option<HeapStats>) {
    let _ = HEAP_STATS_READER.set(reader);
}

/// The heap's statistics now, if a reader is installed and answers.
pub fn heap_stats() -> Option<HeapStats> {
    HEAP_STATS_READER.get().and_then(|read| read())
}

const FAILED_CALLS_HELP: &str =
    "CUDA calls that returned an error, by function and error (not counted as work)";

/// Metrics rendered only with labels, once they have a series: (name, type).
pub const LABELLED_METRICS: [(&str, &str); 1] = [("cuda_failed_calls_total", "counter")];

impl SelfMetrics {
    /// Samples lost anywhere between the perf event and the pipeline.
    pub fn samples_dropped(&self) -> u64 {
        self.bpf.get(profiler_common::STAT_RINGBUF_FULL)
            + self.agent_queue_full
            + self.decode_errors
    }

    pub fn values(&self) -> Vec<MetricValue> {
        let mut out = Vec::new();
        let mut push = |name: &str, help: &'static str, value: f64, kind: &'static str| {
            out.push(MetricValue {
                name: format!("profiler_{name}"),
                help,
                value,
                kind,
            });
        };
        for (name, value) in self.bpf.named() {
            let kind = if name == "ringbuf_pending_bytes" {
                "gauge"
            } else {
                "counter"
            };
            push(
                &format!("bpf_{name}"),
                "Counter kept by the eBPF sampler",
                value as f64,
                kind,
            );
        }
        push(
            "bpf_program_run_time_ns_total",
            "Kernel-accounted run time of the sampler (kernel.bpf_stats_enabled)",
            self.bpf_run_time_ns as f64,
            "counter",
        );
        push(
            "bpf_program_runs_total",
            "Kernel-accounted runs of the sampler (kernel.bpf_stats_enabled)",
            self.bpf_run_count as f64,
            "counter",
        );
        push(
            "python_processes",
            "Python processes whose Python frames are recorded",
            self.python.active as f64,
            "gauge",
        );
        push(
            "python_processes_pending",
            "Python processes waiting for their interpreter to initialise",
            self.python.pending as f64,
            "gauge",
        );
        push(
            "python_processes_disabled_total",
            "Python processes left to native stacks (unsupported build or failed layout self-check)",
            self.python.disabled as f64,
            "counter",
        );
        push(
            "python_frames_total",
            "Python frames put into stacks",
            self.python.frames as f64,
            "counter",
        );
        push(
            "python_truncated_stacks_total",
            "Samples cut only because their Python stack was deeper than recorded (innermost frames kept, the cut marked [truncated]; included in truncated_stacks_total)",
            self.python.truncated_stacks as f64,
            "counter",
        );
        push(
            "cuda_libraries_probed",
            "CUDA runtime and driver files with probes attached",
            self.cuda.libraries_attached as f64,
            "gauge",
        );
        push(
            "cuda_probes_attached",
            "CUDA functions probed over all files",
            self.cuda.probes_attached as f64,
            "gauge",
        );
        push(
            "cuda_attach_errors_total",
            "CUDA probes that could not be attached",
            self.cuda.attach_errors as f64,
            "counter",
        );
        push(
            "cuda_processes",
            "Processes mapping a CUDA library at the last scan",
            self.cuda.processes_using_cuda as f64,
            "gauge",
        );
        push(
            "cuda_scan_maps_read_total",
            "Process maps read by the CUDA library scans",
            self.cuda.maps_read as f64,
            "counter",
        );
        push(
            "cuda_scan_maps_unchanged_total",
            "Processes a CUDA library scan did not read (nothing announced since the scan before; or an exec, or a fork from a process proven not to map a CUDA library, since it, and only files known not to be CUDA libraries mapped after)",
            self.cuda.maps_unchanged as f64,
            "counter",
        );
        push(
            "cuda_decode_errors_total",
            "CUDA probe records that did not decode",
            self.cuda_decode_errors as f64,
            "counter",
        );
        let names = &self.cuda_names;
        let memory = &self.cuda_allocations;
        for (name, help, value, kind) in [
            (
                "cuda_kernel_names",
                "Kernel handle names held (per process, by program)",
                names.held,
                "gauge",
            ),
            (
                "cuda_kernel_names_dropped_total",
                "Kernel names not kept because their process held the most allowed",
                names.dropped,
                "counter",
            ),
            (
                "cuda_allocated_bytes_total",
                "Device memory allocated through the probed CUDA calls",
                memory.allocated_bytes,
                "counter",
            ),
            (
                "cuda_freed_bytes_total",
                "Device memory freed, of the allocations the agent tracked",
                memory.freed_bytes,
                "counter",
            ),
            (
                "cuda_released_bytes_total",
                "Device memory of tracked allocations released by their process's exit or exec",
                memory.released_bytes,
                "counter",
            ),
            (
                "cuda_in_use_bytes",
                "Device memory of tracked allocations not freed yet",
                memory.live_bytes,
                "gauge",
            ),
            (
                "cuda_live_allocations",
                "Tracked device allocations not freed yet",
                memory.live,
                "gauge",
            ),
            (
                "cuda_untracked_frees_total",
                "Frees of pointers the agent did not track (allocated before it started, or over the limit)",
                memory.untracked_frees,
                "counter",
            ),
            (
                "cuda_allocations_untracked_total",
                "Allocations not tracked because the live-allocation map was full",
                memory.overflow,
                "counter",
            ),
            (
                "nvml_polls_total",
                "NVML polls made (device, GPM profiling and per-process readings)",
                self.nvml_polls.polls,
                "counter",
            ),
            (
                "off_cpu_blocks_total",
                "Sampled blocks (a thread switched out, then in again) counted in off_cpu",
                self.off_cpu.blocks,
                "counter",
            ),
            (
                "off_cpu_blocked_ns_total",
                "Nanoseconds the sampled blocks lasted (before scaling by the sampling probability)",
                self.off_cpu.blocked_ns,
                "counter",
            ),
            (
                "off_cpu_gil_waits_total",
                "Sampled blocks that waited for the CPython GIL (also in gil_wait)",
                self.off_cpu.gil_waits,
                "counter",
            ),
            (
                "off_cpu_short_blocks_total",
                "Sampled blocks shorter than --off-cpu-min-block-us, left out",
                self.off_cpu.short_blocks,
                "counter",
            ),
            (
                "off_cpu_unpaired_total",
                "Block durations whose stack record was lost or dropped (not counted)",
                self.off_cpu.unpaired,
                "counter",
            ),
            (
                "off_cpu_evicted_total",
                "Block stacks dropped while waiting for their duration (bounds reached)",
                self.off_cpu.evicted,
                "counter",
            ),
            (
                "off_cpu_decode_errors_total",
                "Off-CPU records that did not decode",
                self.off_cpu.decode_errors,
                "counter",
            ),
            (
                "off_cpu_pending_blocks",
                "Block stacks waiting for their thread to run again (bounded)",
                self.off_cpu.pending,
                "gauge",
            ),
            (
                "off_cpu_pending_bytes",
                "Bytes of the block stacks waiting (bounded)",
                self.off_cpu.pending_bytes,
                "gauge",
            ),
            (
                "off_cpu_program_run_time_ns_total",
                "Kernel-accounted run time of the off-CPU program (kernel.bpf_stats_enabled)",
                self.off_cpu_run_time_ns,
                "counter",
            ),
            (
                "off_cpu_program_runs_total",
                "Kernel-accounted runs of the off-CPU program: context switches seen",
                self.off_cpu_run_count,
                "counter",
            ),
            (
                "cuda_call_stacks",
                "Stacks held for the CUDA calls of their kind that come without one (bounded)",
                self.cuda_call_stacks.entries,
                "gauge",
            ),
            (
                "cuda_weighted_calls_total",
                "CUDA calls without a stack weighted onto the last stack of their kind and thread",
                self.cuda_call_stacks.weighted_calls,
                "counter",
            ),
            (
                "cuda_unattributed_calls_total",
                "CUDA calls without a stack that found no stack of their kind ([stack not sampled])",
                self.cuda_call_stacks.unattributed_calls,
                "counter",
            ),
        ] {
            push(name, help, value as f64, kind);
        }
        for (function, error, calls) in &self.cuda_failed_calls {
            push(
                &format!("cuda_failed_calls_total{{function=\"{function}\",error=\"{error}\"}}"),
                FAILED_CALLS_HELP,
                *calls as f64,
                "counter",
            );
        }
        push(
            "samples_received_total",
            "Samples read from the ring buffer",
            self.samples_received as f64,
            "counter",
        );
        push(
            "samples_processed_total",
            "Samples unwound, symbolized and aggregated",
            self.samples_processed as f64,
            "counter",
        );
        push(
            "samples_dropped_total",
            "Samples lost (ring buffer full, agent queue full, undecodable)",
            self.samples_dropped() as f64,
            "counter",
        );
        push(
            "decode_errors_total",
            "Ring-buffer records that did not decode",
            self.decode_errors as f64,
            "counter",
        );
        push(
            "agent_queue_full_total",
            "Samples dropped because the pipeline lagged",
            self.agent_queue_full as f64,
            "counter",
        );
        push(
            "stack_copies_shed_total",
            "Samples queued without their stack copy (the queued copies were at their bound), their stacks cut where the kernel stopped",
            self.stack_copies_shed as f64,
            "counter",
        );
        push(
            "truncated_stacks_total",
            "Stacks cut short by the depth limit",
            self.truncated_stacks as f64,
            "counter",
        );
        push(
            "unmapped_frames_total",
            "User frames outside any file mapping",
            self.unmapped_frames as f64,
            "counter",
        );
        push(
            "unknown_processes_total",
            "Samples of processes gone before their snapshot",
            self.unknown_processes as f64,
            "counter",
        );
        push(
            "frames_symbolized_total",
            "Distinct frames symbolized",
            self.frames_symbolized as f64,
            "counter",
        );
        push(
            "symbolization_misses_total",
            "Frames without a symbol: module!sub_<function start>, module+offset or [unknown]",
            self.symbolization_misses as f64,
            "counter",
        );
        push(
            "symbolization_misses_by_function_total",
            "Frames without a symbol named after the .eh_frame function that holds them (module!sub_<address>)",
            self.symbolization_misses_by_function as f64,
            "counter",
        );
        push(
            "symbolization_errors_total",
            "Files the symbolizer could not read",
            self.symbolization_errors as f64,
            "counter",
        );
        push(
            "symbol_cache_entries",
            "Entries in the symbol cache",
            self.symbol_cache_entries as f64,
            "gauge",
        );
        push(
            "symbol_cache_evicted_total",
            "Frames dropped from the symbol cache for its bound",
            self.symbol_cache_evicted as f64,
            "counter",
        );
        push(
            "symbol_lookups_total",
            "Native frames looked up in their files (symbol cache misses)",
            self.symbol_lookups as f64,
            "counter",
        );
        push(
            "symbol_lookup_seconds_total",
            "Wall time of the native symbol lookups, waits for the disk included",
            self.symbol_lookup_time.as_secs_f64(),
            "counter",
        );
        push(
            "symbol_lookup_cpu_seconds_total",
            "CPU time of the native symbol lookups",
            self.symbol_lookup_cpu_time.as_secs_f64(),
            "counter",
        );
        push(
            "symbol_file_loads_total",
            "Of the native symbol lookups, those that first read a file's symbol tables",
            self.symbol_file_loads as f64,
            "counter",
        );
        push(
            "symbol_file_load_seconds_total",
            "Wall time of the lookups that first read a file's symbol tables",
            self.symbol_file_load_time.as_secs_f64(),
            "counter",
        );
        push(
            "symbol_function_start_seconds_total",
            "Of the lookups' wall time, naming frames without a symbol by their function's start (.eh_frame_hdr)",
            self.symbol_function_start_time.as_secs_f64(),
            "counter",
        );
        push(
            "processes_tracked",
            "Process snapshots held",
            self.processes_tracked as f64,
            "gauge",
        );
        push(
            "open_files",
            "File descriptors the agent holds for files (counted in /proc/self/fd)",
            self.open_files as f64,
            "gauge",
        );
        push(
            "bpf_pid_filter_entries",
            "Entries in the PID_FILTER map",
            f64::from(self.pid_filter_entries),
            "gauge",
        );
        push(
            "bpf_pid_filter_capacity",
            "Capacity of the PID_FILTER map",
            f64::from(self.pid_filter_capacity),
            "gauge",
        );
        push(
            "profiles_written_total",
            "Profiles handed to the output",
            self.profiles_written as f64,
            "counter",
        );
        push(
            "export_errors_total",
            "Profiles the output failed to take",
            self.export_errors as f64,
            "counter",
        );
        for (name, help, value, kind) in [
            (
                "store_profiles_ingested_total",
                "Profiles stored in the embedded store",
                self.store_profiles_ingested,
                "counter",
            ),
            (
                "store_ingest_errors_total",
                "Writes the embedded store failed",
                self.store_ingest_errors,
                "counter",
            ),
            (
                "store_profiles_evicted_total",
                "Profiles deleted by retention or the size cap",
                self.store_profiles_evicted,
                "counter",
            ),
            (
                "store_bytes",
                "Bytes of data in the embedded store",
                self.store_bytes,
                "gauge",
            ),
            (
                "store_sqlite_memory_bytes",
                "Bytes of memory SQLite holds (page caches, statements); soft limit 24 MiB",
                self.store_sqlite_memory_bytes,
                "gauge",
            ),
            (
                "store_catalog_names",
                "Strings of the embedded store's frames held in memory (names, files, objects)",
                self.store_catalog_names,
                "gauge",
            ),
            (
                "store_catalog_frames",
                "Frames of the embedded store held in memory",
                self.store_catalog_frames,
                "gauge",
            ),
            (
                "store_catalog_nodes",
                "Call-tree nodes of the embedded store held in memory, all stack spaces",
                self.store_catalog_nodes,
                "gauge",
            ),
            (
                "http_requests_total",
                "HTTP requests served",
                self.http_requests,
                "counter",
            ),
            (
                "http_errors_total",
                "HTTP requests answered with an error status",
                self.http_errors,
                "counter",
            ),
            (
                "push_sent_total",
                "Profiles accepted by Pyroscope",
                self.push_sent,
                "counter",
            ),
            (
                "push_failed_total",
                "Profiles Pyroscope rejected (4xx other than 408/429), dropped",
                self.push_failed,
                "counter",
            ),
            (
                "push_retries_total",
                "Push attempts that failed and were retried (network errors, 408, 429, 5xx)",
                self.push_retries,
                "counter",
            ),
            (
                "push_dropped_total",
                "Profiles dropped by the push queue bounds or unreadable in the spool",
                self.push_dropped,
                "counter",
            ),
            (
                "push_queue_bytes",
                "Bytes of profiles waiting in the in-memory push queue",
                self.push_queue_bytes,
                "gauge",
            ),
            (
                "spool_bytes",
                "Bytes of profiles waiting in the disk spool",
                self.spool_bytes,
                "gauge",
            ),
        ] {
            push(name, help, value as f64, kind);
        }
        let tables = &self.native_tables;
        let late = &self.late_walks;
        for (name, help, value, kind) in [
            (
                "unwind_table_slots",
                "Files the unwind-table manager knows (bounded; placed, waiting, building, unusable)",
                tables.table_slots,
                "gauge",
            ),
            (
                "unwind_table_rows",
                "Rows of unwind tables in the BPF row array",
                tables.rows_in_use,
                "gauge",
            ),
            (
                "unwind_table_row_capacity",
                "Capacity of the BPF row array (--unwind-table-memory)",
                tables.row_capacity,
                "gauge",
            ),
            (
                "unwind_tables_placed_total",
                "Unwind tables written into the BPF maps",
                tables.tables_loaded,
                "counter",
            ),
            (
                "unwind_tables_evicted_total",
                "Unwind tables evicted from the BPF maps to make room",
                tables.tables_evicted,
                "counter",
            ),
            (
                "unwind_tables_deferred_total",
                "Unwind-table placements put off for lack of room",
                tables.tables_deferred,
                "counter",
            ),
            (
                "unwind_tables_demanded_total",
                "Unwind tables asked for by a sample that needed them",
                tables.tables_demanded,
                "counter",
            ),
            (
                "unwind_tables_failed_total",
                "Files whose unwind table could not be built (frame pointers used)",
                tables.tables_failed,
                "counter",
            ),
            (
                "unwind_tables_too_large_total",
                "Files whose unwind table alone exceeds the budget (frame pointers used)",
                tables.tables_too_large,
                "counter",
            ),
            (
                "unwind_read_cache_entries",
                "Page entries and row chunks the late unwinder keeps from the BPF maps (bounded)",
                tables.read_cache.entries,
                "gauge",
            ),
            (
                "unwind_read_cache_hits_total",
                "Late-walk reads of the unwind tables answered without a syscall",
                tables.read_cache.hits,
                "counter",
            ),
            (
                "unwind_read_cache_misses_total",
                "Late-walk reads of the unwind tables read from the BPF maps",
                tables.read_cache.misses,
                "counter",
            ),
            (
                "processes_registered",
                "Processes whose mappings BPF unwinds with",
                tables.processes_registered,
                "gauge",
            ),
            (
                "process_registrations_total",
                "Processes registered for BPF to unwind with, at their fourth sample",
                tables.registrations,
                "counter",
            ),
            (
                "symbol_files",
                "Files whose parsed symbol tables the symbolizer holds",
                self.symbol_files,
                "gauge",
            ),
            (
                "symbol_file_bytes",
                "Estimated bytes of the parsed symbol tables held (bounded)",
                self.symbol_file_bytes,
                "gauge",
            ),
            (
                "python_code_objects",
                "Python code objects cached (names, files, line tables; bounded)",
                self.python_code_objects,
                "gauge",
            ),
            (
                "symbol_function_names",
                "Function names cached by raw symbol name, demangled once (bounded)",
                self.symbol_function_names,
                "gauge",
            ),
            (
                "symbol_function_name_hits_total",
                "Symbol lookups whose function name came from the name cache (not demangled again)",
                self.symbol_function_name_hits,
                "counter",
            ),
            (
                "symbol_kernel_functions",
                "Kernel functions remembered by their start address (bounded)",
                self.symbol_kernel_functions,
                "gauge",
            ),
            (
                "symbol_kernel_function_hits_total",
                "Kernel frames named from a remembered function without a kallsyms lookup",
                self.symbol_kernel_function_hits,
                "counter",
            ),
            (
                "symbol_function_ranges",
                "Functions of stripped files remembered by their address range (bounded)",
                self.symbol_function_ranges,
                "gauge",
            ),
            (
                "symbol_function_range_hits_total",
                "Frames named after a remembered function's start without a symbol lookup",
                self.symbol_function_range_hits,
                "counter",
            ),
            (
                "symbol_function_ranges_cleared_total",
                "Times every remembered function was forgotten to stay within the bound",
                self.symbol_function_ranges_cleared,
                "counter",
            ),
            (
                "exec_environments",
                "Exec environments kept with their label variables, byte for byte (bounded)",
                self.exec_environments,
                "gauge",
            ),
            (
                "exec_environments_reused_total",
                "Exec events whose label variables came from a kept environment without a parse",
                self.exec_environments_reused,
                "counter",
            ),
            (
                "symbol_interned_strings",
                "Distinct function names and paths shared by the symbolized frames (bounded)",
                self.symbol_interned_strings,
                "gauge",
            ),
            (
                "symbol_file_page_releases_total",
                "Times the pages of symbol files were given back to keep the file-backed RSS in its band",
                self.symbol_file_page_releases,
                "counter",
            ),
            (
                "symbol_files_dropped_total",
                "Parsed symbol tables dropped to stay within their bound or unused for 2 minutes (read again when needed)",
                self.symbol_files_dropped,
                "counter",
            ),
            (
                "process_snapshots_from_events_total",
                "Snapshots of processes gone from /proc, built from their exec or fork event",
                self.process_snapshots_from_events,
                "counter",
            ),
            (
                "process_exits_known_at_lookup_total",
                "Snapshots built from the events of a process whose exit was read already, without asking /proc",
                self.process_exits_known_at_lookup,
                "counter",
            ),
            (
                "process_exits_ahead",
                "Process exits read from the ring and waiting to be applied after the samples before them (bounded)",
                self.process_exits_ahead,
                "gauge",
            ),
            (
                "process_snapshots_before_exec_total",
                "Samples taken in an exec, resolved against the program before it (from its fork or exec event)",
                self.process_snapshots_before_exec,
                "counter",
            ),
            (
                "process_parents_gone_since_fork_total",
                "Fork children left unknown: their parent exited or its pid was reused before it was read",
                self.process_parents_gone_since_fork,
                "counter",
            ),
            (
                "process_parents_from_fork_time_total",
                "Fork children named by what their parent ran at the fork, the parent's identity gone since",
                self.process_parents_from_fork_time,
                "counter",
            ),
            (
                "process_identities",
                "Exec and fork identities held for processes that may exit unseen (bounded)",
                self.process_identities,
                "gauge",
            ),
            (
                "process_exited_identities",
                "Of those, identities of exited processes, kept for a minute after the exit (bounded)",
                self.process_exited_identities,
                "gauge",
            ),
            (
                "process_identities_expired_total",
                "Identities of exited processes forgotten a minute after their exit",
                self.process_identities_expired,
                "counter",
            ),
            (
                "process_snapshots_from_announced_mmaps_total",
                "Snapshots of processes gone from /proc whose libraries came from mmap announcements",
                self.process_snapshots_from_announced_mmaps,
                "counter",
            ),
            (
                "process_snapshots_total",
                "Process snapshots read from /proc (new processes, pid reuse, refreshes)",
                self.process_snapshots,
                "counter",
            ),
            (
                "process_refreshes_total",
                "Process snapshots retaken for a sampled address in none of their mappings",
                self.process_refreshes,
                "counter",
            ),
            (
                "process_refreshes_announced_total",
                "Of those, retaken before the recheck interval because the kernel announced code mapped at the address since the snapshot",
                self.process_refreshes_announced,
                "counter",
            ),
            (
                "process_refreshes_from_announcements_total",
                "Of those, for a process gone from /proc: the mappings announced for its program placed the address",
                self.process_refreshes_from_announcements,
                "counter",
            ),
            (
                "process_maps_from_announcements_total",
                "Snapshots of live processes whose mappings came from mmap announcements instead of /proc/PID/maps",
                self.process_maps_from_announcements,
                "counter",
            ),
            (
                "process_cmdlines_from_exec_total",
                "Snapshots of live processes whose command line came from their exec event instead of /proc/PID/cmdline",
                self.process_cmdlines_from_exec,
                "counter",
            ),
            (
                "process_identities_from_exec_total",
                "Snapshots of live processes whose name, executable and labels came from their exec event and the mmap announcements instead of /proc/PID/stat and exe",
                self.process_identities_from_exec,
                "counter",
            ),
            (
                "announced_mmap_processes",
                "Processes whose announced executable mmaps are held (bounded)",
                self.announced_mmaps.processes,
                "gauge",
            ),
            (
                "announced_mmaps",
                "Announced executable mmaps held (bounded)",
                self.announced_mmaps.mappings,
                "gauge",
            ),
            (
                "announced_mmaps_lost_total",
                "mmap announcements the kernel dropped because the ring was full",
                self.announced_mmaps.records_lost,
                "counter",
            ),
            (
                "announced_mmap_processes_expired_total",
                "Processes whose announced mmaps were dropped a minute after their exit",
                self.announced_mmaps.expired_processes,
                "counter",
            ),
            (
                "cgroup_paths",
                "Cgroup directory names remembered for service labels (bounded)",
                self.cgroup_paths,
                "gauge",
            ),
            (
                "cgroup_texts",
                "/proc/PID/cgroup texts kept with what they say, byte for byte (bounded)",
                self.cgroup_texts,
                "gauge",
            ),
            (
                "cgroup_texts_reused_total",
                "/proc/PID/cgroup reads whose meaning came from a kept text without a parse",
                self.cgroup_texts_reused,
                "counter",
            ),
            (
                "process_cgroups_from_fork_total",
                "Snapshots of live processes whose cgroups came from their parent at their fork (no task moved since) instead of /proc/PID/cgroup",
                self.process_cgroups_from_fork,
                "counter",
            ),
            (
                "process_cgroups_from_moves_total",
                "Running processes' cgroups known anew from the destination of their move as the kernel reported it, without reading /proc/PID/cgroup",
                self.process_cgroups_from_moves,
                "counter",
            ),
            (
                "cgroup_moves",
                "Processes whose latest move between cgroups is kept, so that what was known of their cgroups before is not used (bounded)",
                self.cgroup_moves,
                "gauge",
            ),
            (
                "process_executable_paths",
                "Exec'ed paths remembered with their symbolic links resolved (bounded)",
                self.executable_paths,
                "gauge",
            ),
            (
                "late_walks_total",
                "User stacks BPF left to the agent to finish from a stack copy",
                late.finished,
                "counter",
            ),
            (
                "late_walks_cut_total",
                "Late walks cut where a table was still missing after the wait",
                late.gave_up,
                "counter",
            ),
            (
                "late_walks_without_process_total",
                "Late walks impossible: the process was gone before its mappings were read",
                late.no_process,
                "counter",
            ),
            (
                "late_walks_before_exec_total",
                "Late walks of samples taken before their process's exec, against the program before it",
                late.before_exec_walked,
                "counter",
            ),
            (
                "late_walks_in_exec_total",
                "Stack copies of samples taken inside an exec syscall, not walked (cut at the exec)",
                late.in_exec_not_walked,
                "counter",
            ),
            (
                "late_walks_refreshed_total",
                "Late walks that reached an address their snapshot did not map and went on against a newer snapshot",
                late.refreshed_mid_walk,
                "counter",
            ),
            (
                "exec_samples_cut_at_new_program_total",
                "Samples taken inside an exec whose user addresses were the new program's entry, dropped (the stack ends [truncated])",
                late.in_exec_new_program_cut,
                "counter",
            ),
            (
                "exec_during_first_lookup_total",
                "Samples of a process first read from /proc while it exec'ed (the read shows the new program), resolved against the program before the exec",
                late.exec_during_first_lookup,
                "counter",
            ),
            (
                "late_walks_over_bound_total",
                "Late walks cut because the held stack copies reached their bound",
                late.over_bound,
                "counter",
            ),
            (
                "late_walks_held",
                "Samples waiting for a table to finish their walk",
                late.held,
                "gauge",
            ),
            (
                "late_walks_held_bytes",
                "Bytes of stack copies held (bounded)",
                late.held_bytes,
                "gauge",
            ),
            (
                "guessed_callers_dropped_total",
                "Stacks cut at a frame whose table was not loaded (frame-pointer guesses dropped)",
                self.guessed_callers_dropped,
                "counter",
            ),
        ] {
            push(name, help, value as f64, kind);
        }
        push(
            "nvml_poll_cpu_seconds_total",
            "CPU time NVML polls used (the cost of GPU metrics, GPM included)",
            self.nvml_polls.cpu_time.as_secs_f64(),
            "counter",
        );
        push(
            "agent_cpu_seconds_total",
            "CPU time used by the agent",
            self.agent_cpu.as_secs_f64(),
            "counter",
        );
        push(
            "agent_rss_bytes",
            "Resident memory of the agent",
            self.agent_rss_bytes as f64,
            "gauge",
        );
        push(
            "agent_peak_rss_bytes",
            "Peak resident memory of the agent",
            self.agent_peak_rss_bytes as f64,
            "gauge",
        );
        if let Some(heap) = self.heap {
            push(
                "agent_heap_allocated_bytes",
                "Heap bytes the agent holds allocated (the allocator's statistics)",
                heap.allocated as f64,
                "gauge",
            );
            push(
                "agent_heap_resident_bytes",
                "Resident bytes of the allocator's pages: allocations, metadata, fragmentation and freed pages not yet given back",
                heap.resident as f64,
                "gauge",
            );
        }
        out
    }

    pub fn log(&self, what: &str) {
        tracing::debug!(counters = ?self.bpf.named(), tables = ?self.native_tables, "{what}: BPF counters");
        tracing::info!(
            samples_seen = self.bpf.get(profiler_common::STAT_SAMPLES_SEEN),
            samples_processed = self.samples_processed,
            samples_dropped = self.samples_dropped(),
            ringbuf_full = self.bpf.get(profiler_common::STAT_RINGBUF_FULL),
            ringbuf_pending_bytes = self.bpf.get(profiler_common::STAT_RINGBUF_PENDING_BYTES),
            truncated_stacks = self.truncated_stacks,
            unmapped_frames = self.unmapped_frames,
            unknown_processes = self.unknown_processes,
            // Exec, fork and exit events the kernel could not queue: processes they were of
            // may end up without a name (`unknown_processes`).
            process_events_lost = self.bpf.get(profiler_common::STAT_EVENTS_LOST),
            symbolization_misses = self.symbolization_misses,
            symbol_file_page_releases = self.symbol_file_page_releases,
            processes = self.processes_tracked,
            unwind_complete = self.bpf.get(profiler_common::STAT_UNWIND_COMPLETE),
            unwind_tables = self.native_tables.tables_loaded,
            unwind_rows = self.native_tables.rows_in_use,
            python_processes = self.python.active,
            python_processes_disabled = self.python.disabled,
            agent_cpu_us = self.agent_cpu.as_micros() as u64,
            bpf_run_time_ns = self.bpf_run_time_ns,
            bpf_run_count = self.bpf_run_count,
            rss_bytes = self.agent_rss_bytes,
            peak_rss_bytes = self.agent_peak_rss_bytes,
            "{what}"
        );
        let off_cpu_switches = self.bpf.get(profiler_common::STAT_OFF_CPU_SWITCHES);
        if off_cpu_switches > 0 || self.off_cpu.blocks > 0 {
            tracing::info!(
                off_cpu_switches,
                off_cpu_stacks = self.bpf.get(profiler_common::STAT_OFF_CPU_STACKS),
                off_cpu_lost = self.bpf.get(profiler_common::STAT_OFF_CPU_LOST),
                off_cpu_blocks = self.off_cpu.blocks,
                off_cpu_blocked_ns = self.off_cpu.blocked_ns,
                off_cpu_gil_waits = self.off_cpu.gil_waits,
                off_cpu_unpaired = self.off_cpu.unpaired,
                off_cpu_evicted = self.off_cpu.evicted,
                off_cpu_program_runs = self.off_cpu_run_count,
                off_cpu_program_run_time_ns = self.off_cpu_run_time_ns,
                "{what}: off-CPU"
            );
        }
        if self.cuda.libraries_attached > 0 {
            let memory = &self.cuda_allocations;
            tracing::info!(
                cuda_events = self.bpf.get(profiler_common::STAT_CUDA_EVENTS),
                cuda_stacks = self.bpf.get(profiler_common::STAT_CUDA_STACKS),
                cuda_first_stacks = self.bpf.get(profiler_common::STAT_CUDA_FIRST_STACKS),
                cuda_failed = self.bpf.get(profiler_common::STAT_CUDA_FAILED),
                cuda_weighted_calls = self.cuda_call_stacks.weighted_calls,
                cuda_unattributed_calls = self.cuda_call_stacks.unattributed_calls,
                cuda_stacks_rate_limited =
                    self.bpf.get(profiler_common::STAT_CUDA_STACKS_RATE_LIMITED),
                cuda_events_lost = self.bpf.get(profiler_common::STAT_CUDA_EVENTS_LOST),
                cuda_names = self.bpf.get(profiler_common::STAT_CUDA_NAMES),
                cuda_unreadable_results =
                    self.bpf.get(profiler_common::STAT_CUDA_UNREADABLE_RESULTS),
                cuda_allocations = memory.allocations,
                cuda_allocated_bytes = memory.allocated_bytes,
                cuda_frees = memory.frees,
                cuda_freed_bytes = memory.freed_bytes,
                cuda_released_bytes = memory.released_bytes,
                cuda_in_use_bytes = memory.live_bytes,
                cuda_untracked_frees = memory.untracked_frees,
                cuda_allocations_untracked = memory.overflow,
                "{what}: CUDA"
            );
        }
    }
}

/// CPU time (user + system) of this process so far.
pub fn process_cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// (current, peak) resident set size in bytes, from /proc/self/status.
pub fn process_rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
            * 1024
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_own_cpu_and_memory() {
        let before = process_cpu_time();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(process_cpu_time() > before);
        let (rss, peak) = process_rss();
        assert!(rss > 0 && peak >= rss);
    }

    /// The docs that name metrics.
    const METRIC_DOCS: [&str; 3] = [
        "docs/architecture.md",
        "docs/configuration.md",
        "docs/troubleshooting.md",
    ];

    fn doc(path: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path);
        std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
    }

    /// `(name, type)` of each row of the metrics reference table in docs/architecture.md.
    fn reference_table(architecture: &str) -> Vec<(String, String)> {
        let start = architecture
            .find("<!-- metrics-reference:start -->")
            .expect("metrics reference start marker");
        let end = architecture
            .find("<!-- metrics-reference:end -->")
            .expect("metrics reference end marker");
        architecture[start..end]
            .lines()
            .filter_map(|line| {
                let mut cells = line.split('|').map(str::trim).skip(1);
                let name = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
                let kind = cells.next()?;
                Some((name.to_owned(), kind.to_owned()))
            })
            .collect()
    }

    /// Backticked words in `text` that name a metric: a `profiler_` prefix, or a counter's
    /// `_total` suffix (the prefix dropped).
    fn metric_mentions(text: &str) -> Vec<String> {
        text.split('`')
            .skip(1)
            .step_by(2)
            // `name{label}`: the metric's name.
            .map(|word| word.split('{').next().unwrap_or(word))
            .filter(|word| {
                !word.is_empty()
                    && word
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                    && (word.starts_with("profiler_") || word.ends_with("_total"))
                    && *word != "profiler_"
                    && !NOT_METRICS.contains(word)
            })
            .map(|word| word.trim_start_matches("profiler_").to_owned())
            .collect()
    }

    /// Backticked `profiler_` words in the docs that are not metrics.
    const NOT_METRICS: [&str; 1] = ["profiler_token"];

    /// `(name, kind)` of the HTTP server's own metrics, which `/metrics` renders after
    /// [`SelfMetrics::values`] (`server::handlers::server_metrics`): read from its source, the
    /// name and kind literals of each entry.
    /// The HTTP server's and the store's own metrics, as `/metrics` renders them beside the
    /// agent's: (name without labels, type), each name once.
    fn server_metrics() -> Vec<(String, &'static str)> {
        let health = crate::server::HealthBoard::default();
        let mut metrics: Vec<(String, &'static str)> =
            crate::server::handlers::server_metrics(&health)
                .into_iter()
                .chain(crate::store::StoreCounters::default().metric_values())
                .map(|(series, _, kind, _)| {
                    // A labelled series counts under its metric's name.
                    let name = series.split('{').next().unwrap_or(&series).to_owned();
                    (name, kind)
                })
                .collect();
        metrics.sort();
        metrics.dedup();
        metrics
    }

    #[test]
    fn every_metric_is_documented_and_every_documented_metric_exists() {
        // With a heap reader installed, as in the binary, so its metrics are rendered too.
        let with_heap = SelfMetrics {
            heap: Some(HeapStats::default()),
            ..SelfMetrics::default()
        };
        let rendered: Vec<(String, &str)> = with_heap
            .values()
            .into_iter()
            .map(|v| (v.name, v.kind))
            .chain(server_metrics())
            .chain(
                LABELLED_METRICS
                    .iter()
                    .map(|(name, kind)| (format!("profiler_{name}"), *kind)),
            )
            .collect();
        let exported: std::collections::BTreeMap<String, &str> = rendered
            .iter()
            .map(|(name, kind)| {
                let name = name.strip_prefix("profiler_").expect("prefix").to_owned();
                (name, *kind)
            })
            .collect();
        assert_eq!(exported.len(), rendered.len(), "a metric is exported twice");
        assert!(exported.contains_key("unwind_tables_too_large_total"));
        let architecture = doc("docs/architecture.md");
        let table = reference_table(&architecture);
        let documented: std::collections::BTreeMap<String, String> =
            table.iter().cloned().collect();
        assert_eq!(
            documented.len(),
            table.len(),
            "a metric is documented twice"
        );

        let undocumented: Vec<&String> = exported
            .keys()
            .filter(|name| !documented.contains_key(*name))
            .collect();
        assert!(
            undocumented.is_empty(),
            "exported but not in the metrics reference of docs/architecture.md: {undocumented:?}"
        );
        let missing: Vec<&String> = documented
            .keys()
            .filter(|name| !exported.contains_key(*name))
            .collect();
        assert!(
            missing.is_empty(),
            "documented but not exported: {missing:?}"
        );
        for (name, kind) in &documented {
            assert_eq!(exported[name], kind, "type of {name}");
        }
        for path in METRIC_DOCS {
            let unknown: Vec<String> = metric_mentions(&doc(path))
                .into_iter()
                .filter(|name| !exported.contains_key(name))
                .collect();
            assert!(
                unknown.is_empty(),
                "{path} names metrics the agent does not export: {unknown:?}"
            );
        }
    }

    #[test]
    fn metric_mentions_are_found_in_backticks() {
        let text = "see `profiler_open_files` and `unwind_tables_too_large_total`, \
                    `profiler_limit_rejections_total{limit}`, \
                    not `--unwind-table-memory` or `open_files_total_bytes` or `profiler_`";
        assert_eq!(
            metric_mentions(text),
            vec![
                "open_files".to_owned(),
                "unwind_tables_too_large_total".to_owned(),
                "limit_rejections_total".to_owned()
            ]
        );
    }

    #[test]
    fn dropped_samples_sum_every_cause() {
        let mut m = SelfMetrics::default();
        m.bpf.counters[profiler_common::STAT_RINGBUF_FULL as usize] = 3;
        m.agent_queue_full = 4;
        m.decode_errors = 1;
        assert_eq!(m.samples_dropped(), 8);
        let values = m.values();
        let dropped = values
            .iter()
            .find(|v| v.name == "profiler_samples_dropped_total")
            .unwrap();
        assert_eq!(dropped.value, 8.0);
        assert!(
            values
                .iter()
                .any(|v| v.name == "profiler_bpf_ringbuf_full" && v.value == 3.0)
        );
    }
}
