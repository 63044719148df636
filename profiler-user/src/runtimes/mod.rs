//! Language runtimes whose frames the profiler reads from process memory.
pub mod python;
