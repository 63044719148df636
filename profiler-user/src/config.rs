//! Validated settings, independent of the command line that produced them.
use std::{path::PathBuf, time::Duration};

pub use crate::off_cpu::OffCpuSettings;
use crate::{
    export::{OutputFormat, push::PushConfig},
    server::serve::ServeConfig,
};

/// Settings shared by every mode that samples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SamplingConfig {
    /// Samples per second per CPU (1–1000).
    pub frequency_hz: u64,
    /// Only these processes (and their threads); empty means every process.
    pub pids: Vec<u32>,
    /// BPF memory for unwind tables, in bytes.
    pub unwind_table_bytes: u64,
    /// Where built unwind tables are cached by build id; `None` disables the cache.
    pub cache_dir: Option<PathBuf>,
    /// Symbolize native frames with DWARF source files, lines and inlined functions.
    pub source_lines: bool,
    /// Walk CPython frames in BPF and show Python functions, files and lines.
    pub python_frames: bool,
    /// CUDA attribution and NVML counters.
    pub gpu: GpuConfig,
    /// Off-CPU and GIL-wait profiles (`None`: off).
    pub off_cpu: Option<OffCpuSettings>,
    /// The nice value the threads that handle samples run at, at most (they are raised to it,
    /// never lowered).
    pub sampling_nice: i32,
}

/// CUDA uprobes and NVML polling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuConfig {
    /// Probe CUDA libraries and poll NVML (`--no-gpu` turns both off).
    pub enabled: bool,
    /// Stacks taken per thread and second for CUDA calls; calls beyond it are still counted.
    pub cuda_stacks_per_second: u32,
    /// NVML library to open instead of `libnvidia-ml.so.1` from the loader's search path.
    pub nvml_library: Option<PathBuf>,
    /// How often NVML is polled.
    pub nvml_interval: Duration,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            enabled: true,
            cuda_stacks_per_second: DEFAULT_CUDA_STACKS_PER_SECOND,
            nvml_library: None,
            nvml_interval: Duration::from_secs(1),
        }
    }
}

/// Default stack budget per thread for CUDA calls.
pub const DEFAULT_CUDA_STACKS_PER_SECOND: u32 = 200;

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            frequency_hz: 100,
            pids: Vec::new(),
            unwind_table_bytes: DEFAULT_UNWIND_TABLE_MIB << 20,
            cache_dir: Some(PathBuf::from(DEFAULT_CACHE_DIR)),
            source_lines: false,
            python_frames: true,
            gpu: GpuConfig::default(),
            off_cpu: None,
            sampling_nice: DEFAULT_SAMPLING_NICE,
        }
    }
}

/// Default nice value of the threads that handle samples. On a busy host (load 20-40 on 2
/// CPUs) the agent's fair share at nice 0 was less than its start-up work: samples were handled
/// 15-20 s late, after their processes had exited, and 300-550 came out `[unknown]`; at -5 at
/// most 4 did (docs/benchmarks.md). Their steady work is 5-6 % of one CPU, 15-20 % more per
/// sample than at 0.
pub const DEFAULT_SAMPLING_NICE: i32 = -5;

/// Default BPF memory budget for unwind tables (MiB). A CUDA PyTorch process alone needs
/// about 60 MiB of rows (libtorch_cpu 2.7 M rows, libtorch_cuda, cuBLAS, libpython...; an
/// H100 host measured 7.4 M rows in use): with 32 MiB its tables evicted each other and 73 %
/// of its CPU samples were cut short (docs/benchmarks.md). Kernel memory, not the agent's RSS.
pub const DEFAULT_UNWIND_TABLE_MIB: u64 = 128;
/// Default directory of the unwind-table cache.
pub const DEFAULT_CACHE_DIR: &str = "/var/cache/profiler";

impl SamplingConfig {
    pub fn period_ns(&self) -> i64 {
        1_000_000_000 / self.frequency_hz.max(1) as i64
    }
}

/// `profiler record`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordConfig {
    pub sampling: SamplingConfig,
    pub duration: Duration,
    pub output: PathBuf,
    pub format: OutputFormat,
}

/// `profiler agent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    pub sampling: SamplingConfig,
    pub interval: Duration,
    /// Optional pprof file output, besides the store.
    pub output_dir: Option<PathBuf>,
    /// The embedded store and HTTP server.
    pub serve: ServeConfig,
    /// Push to Pyroscope (`--pyroscope-url`).
    pub push: Option<PushConfig>,
}
