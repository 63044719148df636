//! GPU attribution: CUDA libraries found by their exports and probed (`discovery`), the
//! probes' records turned into profile events (`events`), device memory still allocated
//! (`allocations`), and NVIDIA's counters (`nvml`, with the profiling counters of `gpm`).
pub mod allocations;
pub mod call_stacks;
pub mod discovery;
pub mod errors;
pub mod events;
pub mod gpm;
pub mod nvml;
