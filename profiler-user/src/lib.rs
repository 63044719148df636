//! The profiling agent as a library; `main.rs` is a thin CLI on top.
//!
//! One module per pipeline stage, data flowing one way:
//! `sampling` → `unwinding` → `symbolization` → `aggregation` → `export`, with `process`
//! (per-process snapshots and labels) feeding unwinding, and `bpf` the only module touching aya.
pub mod agent;
pub mod aggregation;
pub mod bpf;
pub mod cli;
pub mod config;
pub mod export;
pub mod gpu;
pub mod model;
pub mod process;
pub mod runtimes;
pub mod sampling;
pub mod self_metrics;
pub mod server;
pub mod store;
pub mod symbolization;
pub mod unwinding;
