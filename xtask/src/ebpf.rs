//! The shared eBPF build recipe (also `include!`d by profiler-user's build script), so that xtask
//! installs bpf-linker exactly where the build looks for it.
#![allow(dead_code)] // xtask uses only part of the recipe.

include!("../../profiler-user/ebpf_build.rs");
