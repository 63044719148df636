// Empty on purpose: the eBPF program lives in main.rs. The lib target lets `cargo clippy
// --workspace` compile this crate for the host without a second panic handler.
#![cfg_attr(target_arch = "bpf", no_std)]
