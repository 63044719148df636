//! The system-wide CPU sampler.
//!
//! `sample_cpu` runs on the cpu-clock perf event of every online CPU. For the interrupted task it
//! records pid, tid, comm, cpu, the kernel stack and the user stack, and streams the record to
//! userspace through the `SAMPLES` ring buffer (see docs/architecture.md for why streaming rather
//! than in-kernel aggregation). Nothing is ever dropped silently: every way a sample can be lost
//! or degraded increments a counter in `STATS`.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod cuda;
#[cfg(target_arch = "bpf")]
mod off_cpu;
#[cfg(target_arch = "bpf")]
mod python;
#[cfg(target_arch = "bpf")]
mod sampler;
#[cfg(target_arch = "bpf")]
mod shared;
#[cfg(target_arch = "bpf")]
mod user_stack;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that can reach this, so it is never executed.
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
