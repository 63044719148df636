//! Validated settings, independent of the command line that produced them.
use std::{path::PathBuf, time::Duration};

use crate::export::OutputFormat;

/// Settings shared by every mode that samples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SamplingConfig {
    /// Samples per second per CPU (1–1000).
    pub frequency_hz: u64,
    /// Only these processes (and their threads); empty means every process.
    pub pids: Vec<u32>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            frequency_hz: 100,
            pids: Vec::new(),
        }
    }
}

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
    pub output_dir: PathBuf,
}

/// Where the agent keeps profiles when no other output is configured.
pub const DEFAULT_OUTPUT_DIR: &str = "/var/lib/profiler/profiles";
