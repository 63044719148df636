//! The profiling agent as a library; `main.rs` is a thin CLI on top (`profiler record`,
//! `profiler agent`, `profiler server`).
//!
//! One module per job, from the top layer to the bottom one; a module imports only modules
//! below it. docs/architecture.md ("Modules of profiler-user") lists each module's imports and
//! the few that still point up.
//!
//! | module | its one job |
//! |---|---|
//! | `cli` | The command line: clap flags, validation, conversion into `config` types. |
//! | `agent` | Wires the stages for `record` and `agent`; starts and stops the threads. |
//! | `config` | Validated settings, independent of the command line. |
//! | `server` | The HTTP server: ingest, query API, web UI, `/metrics`, probes. |
//! | `self_metrics` | The agent's own health in one struct, logged and served on `/metrics`. |
//! | `store` | The embedded SQLite profile store and the sink for the agent's profiles. |
//! | `export` | Profiles → pprof or folded files; pushing to Grafana Pyroscope (`push`). |
//! | `aggregation` | Counts identical stacks per series over one interval. |
//! | `gpu` | The accelerator interface the pipeline calls and CUDA's implementation: libraries probed, records turned into profile events; NVML and GPM. |
//! | `off_cpu` | Off-CPU and GIL-wait time: the scheduler program's records paired into profile events. |
//! | `symbolization` | Unwound frames → function names (blazesym, kallsyms, Python code). |
//! | `sampling` | The `sample-reader` thread: ring buffer → decoded samples → channel. |
//! | `unwinding` | Addresses → (file, offset); the unwind tables BPF uses; late walks. |
//! | `runtimes` | Language runtimes read from process memory (CPython). |
//! | `process` | Per-process snapshots, open files and labels. |
//! | `bpf` | The only module that uses aya: loads, attaches, exposes maps and rings. |
//! | `model` | The types the stages pass to each other. |
//! | `wire` | The pprof and Pyroscope messages other programs read and write. |
//! | `units` | Ages and sizes as flags write them (`7d`, `10GiB`). |
//!
//! One CPU sample goes `sampling` → `process` → `unwinding` (with `runtimes`) →
//! `symbolization` → `aggregation` → `store` and `export`.
//!
//! Threads (docs/architecture.md, "Threads"): the pipeline runs on the caller's thread and owns
//! the `!Send` blazesym symbolizer; `sample-reader` drains the sample ring; `unwind-tables`
//! builds unwind tables; in agent mode `exporter` writes each interval's profiles, `pusher`
//! sends them to Pyroscope, `nvml` polls the GPUs, `http-server` drives the HTTP server's tokio
//! runtime (its threads are named `http`), and `store-maintenance` enforces retention and the
//! size cap.
pub mod agent;
pub mod aggregation;
pub mod bounded;
pub mod bpf;
pub mod cli;
pub mod config;
pub mod export;
pub mod gpu;
pub mod model;
pub mod off_cpu;
pub mod process;
pub mod runtimes;
pub mod sampling;
pub mod self_metrics;
pub mod server;
pub mod store;
pub mod symbolization;
#[cfg(test)]
pub(crate) mod test_support;
pub mod units;
pub mod unwinding;
pub mod wire;
