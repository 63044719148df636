//! GPU attribution: the interface the pipeline calls and CUDA's implementation of it
//! (`attribution`), CUDA libraries found by their exports and probed (`discovery`), the probes'
//! records decoded and kernels named (`events`), failed calls (`errors`), the stacks calls
//! without one are weighted onto (`call_stacks`), device memory still allocated
//! (`allocations`), and NVIDIA's counters (`nvml`, with the profiling counters of `gpm`).
pub mod allocations;
pub mod attribution;
pub mod call_stacks;
pub mod discovery;
pub mod errors;
pub mod events;
pub mod gpm;
pub mod nvml;
