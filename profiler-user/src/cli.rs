//! Command line: clap definitions, validation, and conversion into [`crate::config`] types.
//! Every flag can also be set through a `PROFILER_*` environment variable.
use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    config::{
        AgentConfig, DEFAULT_CACHE_DIR, DEFAULT_CUDA_STACKS_PER_SECOND, DEFAULT_SAMPLING_NICE,
        DEFAULT_UNWIND_TABLE_MIB, GpuConfig, OffCpuSettings, RecordConfig, SamplingConfig,
    },
    export::{OutputFormat, push::PushArgs},
    off_cpu::DEFAULT_OFF_CPU_PROBABILITY,
    server::serve::{ServerArgs, Switch},
};

#[derive(Debug, Parser)]
#[command(
    name = "profiler",
    version,
    about = "System-wide eBPF CPU profiler: samples every process at 100 Hz, no instrumentation",
    long_about = "System-wide eBPF CPU profiler.\n\nSamples the kernel and user stacks of every process \
                  (or the ones given with --pid) on the cpu-clock event of every CPU, symbolizes them \
                  and writes pprof profiles. Needs root, or CAP_BPF and CAP_PERFMON."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log output format.
    #[arg(long, env = "PROFILER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Profile for a fixed time and write one profile file.
    Record(RecordArgs),
    /// Profile continuously; every interval store one profile per service and serve the web UI.
    Agent(Box<AgentArgs>),
    /// Only the profile store and HTTP server (web UI, Pyroscope-compatible ingest and query
    /// API), without sampling.
    Server(ServerArgs),
}

#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Samples per second on each CPU (1-1000).
    #[arg(long, short = 'F', env = "PROFILER_FREQUENCY", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub frequency: u64,
    /// Only profile this process and its threads; repeat for several (environment: comma-separated).
    #[arg(long = "pid", short = 'p', env = "PROFILER_PID", value_delimiter = ',', value_parser = parse_pid)]
    pub pids: Vec<u32>,
    /// Kernel memory for native unwind tables, in MiB; least-recently-used tables are evicted
    /// beyond it.
    #[arg(long, env = "PROFILER_UNWIND_TABLE_MEMORY", default_value_t = DEFAULT_UNWIND_TABLE_MIB, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub unwind_table_memory: u64,
    /// Directory where built unwind tables are cached by build id.
    #[arg(long, env = "PROFILER_CACHE_DIR", default_value = DEFAULT_CACHE_DIR)]
    pub cache_dir: PathBuf,
    /// Do not read or write the unwind-table cache.
    #[arg(long, env = "PROFILER_NO_CACHE")]
    pub no_cache: bool,
    /// Add source files, line numbers and inlined functions to native frames from DWARF debug
    /// info (more agent memory and CPU per new binary).
    #[arg(long, env = "PROFILER_SOURCE_LINES")]
    pub source_lines: bool,
    /// Show native frames only for Python processes (no CPython frame walk).
    #[arg(long, env = "PROFILER_NO_PYTHON")]
    pub no_python: bool,
    /// Neither probe CUDA libraries nor poll NVML.
    #[arg(long, env = "PROFILER_NO_GPU")]
    pub no_gpu: bool,
    /// Stacks taken per thread and second for CUDA calls (launches, copies, allocations,
    /// synchronizations), besides the first call of each kernel or kind on a thread; the calls
    /// beyond it are weighted onto the last stack of their kind. 0 takes none.
    #[arg(long, env = "PROFILER_CUDA_STACKS_PER_SECOND", default_value_t = DEFAULT_CUDA_STACKS_PER_SECOND)]
    pub cuda_stacks_per_second: u32,
    /// NVML library to open instead of libnvidia-ml.so.1 from the loader's search path.
    #[arg(long, env = "PROFILER_NVML_LIBRARY")]
    pub nvml_library: Option<PathBuf>,
    /// Seconds between NVML polls (fractions allowed).
    #[arg(long, env = "PROFILER_NVML_INTERVAL", default_value = "1", value_parser = parse_seconds)]
    pub nvml_interval: Duration,
    /// Also profile where threads wait: time switched out (`off_cpu`) and, for CPython, time
    /// waiting for the GIL (`gil_wait`), under the stack each thread blocked at.
    #[arg(long, env = "PROFILER_OFF_CPU")]
    pub off_cpu: bool,
    /// Share of blocking context switches whose stack is taken (0-1]; each one's time counts
    /// 1/share, so totals are estimates of all the time blocked.
    #[arg(long, env = "PROFILER_OFF_CPU_PROBABILITY", default_value_t = DEFAULT_OFF_CPU_PROBABILITY, value_parser = parse_probability)]
    pub off_cpu_probability: f64,
    /// Leave out blocks shorter than this many microseconds (counted in a metric).
    #[arg(long, env = "PROFILER_OFF_CPU_MIN_BLOCK_US", default_value_t = 0)]
    pub off_cpu_min_block_us: u64,
    /// With --off-cpu, do not file CPython's GIL waits as their own `gil_wait` profile (they
    /// stay in `off_cpu`).
    #[arg(long, env = "PROFILER_NO_GIL_WAIT")]
    pub no_gil_wait: bool,
    /// Nice value (-20 to 19) the threads that handle samples run at, at most: raised to it
    /// when started lower, never lowered. The HTTP server, store and exporter keep theirs.
    #[arg(long, env = "PROFILER_SAMPLING_NICE", default_value_t = DEFAULT_SAMPLING_NICE, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub sampling_nice: i32,
}

fn parse_probability(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(p) if p.is_finite() && p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!(
            "'{text}' is not a probability above 0 and at most 1"
        )),
    }
}

#[derive(Debug, Args)]
pub struct RecordArgs {
    /// How long to record, in seconds (fractions allowed).
    #[arg(long, short = 'd', env = "PROFILER_DURATION", value_parser = parse_seconds)]
    pub duration: Duration,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Where to write the profile.
    #[arg(
        long,
        short = 'o',
        env = "PROFILER_OUTPUT",
        default_value = "profile.pb.gz"
    )]
    pub output: PathBuf,
    /// Output format: gzipped pprof, or folded stacks (`comm;root;...;leaf COUNT` per line).
    #[arg(long, short = 'f', env = "PROFILER_FORMAT", default_value = "pprof", value_parser = parse_format)]
    pub format: OutputFormat,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Seconds per profile: every interval one profile per service is written.
    #[arg(long, env = "PROFILER_INTERVAL", default_value = "15", value_parser = parse_seconds)]
    pub interval: Duration,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Also write each interval's per-service profiles as pprof files into this directory.
    #[arg(long, env = "PROFILER_OUTPUT_DIR")]
    pub output_dir: Option<PathBuf>,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub push: PushArgs,
}

fn parse_pid(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("'{text}' is not a process id (a positive integer)")),
        Ok(pid) => Ok(pid),
    }
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a number of seconds"))?;
    if !seconds.is_finite() || seconds <= 0.0 || seconds > 7.0 * 86_400.0 {
        return Err(format!(
            "'{text}' must be more than 0 and at most one week of seconds"
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

fn parse_format(text: &str) -> Result<OutputFormat, String> {
    text.parse::<OutputFormat>()
        .map_err(|_| format!("'{text}' is not a format (pprof or folded)"))
}

impl SamplingArgs {
    fn into_config(self) -> SamplingConfig {
        let mut pids = self.pids;
        pids.sort_unstable();
        pids.dedup();
        SamplingConfig {
            frequency_hz: self.frequency,
            pids,
            unwind_table_bytes: self.unwind_table_memory << 20,
            cache_dir: (!self.no_cache).then_some(self.cache_dir),
            source_lines: self.source_lines,
            python_frames: !self.no_python,
            gpu: GpuConfig {
                enabled: !self.no_gpu,
                cuda_stacks_per_second: self.cuda_stacks_per_second,
                nvml_library: self.nvml_library,
                nvml_interval: self.nvml_interval,
            },
            off_cpu: self.off_cpu.then(|| OffCpuSettings {
                probability: self.off_cpu_probability,
                min_block: Duration::from_micros(self.off_cpu_min_block_us),
                gil_wait: !self.no_gil_wait,
            }),
            sampling_nice: self.sampling_nice,
        }
    }
}

impl From<RecordArgs> for RecordConfig {
    fn from(args: RecordArgs) -> Self {
        RecordConfig {
            sampling: args.sampling.into_config(),
            duration: args.duration,
            output: args.output,
            format: args.format,
        }
    }
}

impl From<AgentArgs> for AgentConfig {
    fn from(args: AgentArgs) -> Self {
        let push = args.push.into_config();
        // Pushing to Pyroscope replaces the embedded store unless --store on asks for both.
        let store_default = if push.is_some() {
            Switch::Off
        } else {
            Switch::On
        };
        AgentConfig {
            sampling: args.sampling.into_config(),
            interval: args.interval,
            output_dir: args.output_dir,
            serve: args.server.into_config(store_default),
            push,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_flag_has_an_environment_variable() {
        for sub in Cli::command().get_subcommands() {
            for arg in sub.get_arguments() {
                if arg
                    .get_long()
                    .is_some_and(|l| l != "help" && l != "version")
                {
                    assert!(
                        arg.get_env().is_some(),
                        "--{} of {} has no env var",
                        arg.get_long().unwrap(),
                        sub.get_name()
                    );
                }
            }
        }
    }

    #[test]
    fn every_flag_is_documented_with_its_environment_variable() {
        let doc = include_str!("../../docs/configuration.md");
        let command = Cli::command();
        let arguments = command.get_arguments().chain(
            command
                .get_subcommands()
                .flat_map(|sub| sub.get_arguments()),
        );
        for arg in arguments {
            let Some(long) = arg.get_long().filter(|l| *l != "help" && *l != "version") else {
                continue;
            };
            assert!(
                doc.contains(&format!("`--{long}")),
                "--{long} is not in docs/configuration.md"
            );
            if let Some(env) = arg.get_env() {
                let env = env.to_string_lossy();
                assert!(
                    doc.contains(&format!("`{env}`")),
                    "{env} (--{long}) is not in docs/configuration.md"
                );
            }
        }
    }

    #[test]
    fn parses_record_arguments() {
        let cli = Cli::try_parse_from([
            "profiler",
            "record",
            "--duration",
            "2.5",
            "-p",
            "10",
            "--pid",
            "3",
            "--pid",
            "10",
            "-F",
            "99",
            "--format",
            "folded",
        ])
        .unwrap();
        let Command::Record(args) = cli.command else {
            panic!("not record")
        };
        let config = RecordConfig::from(args);
        assert_eq!(config.duration, Duration::from_millis(2500));
        assert_eq!(config.sampling.frequency_hz, 99);
        assert_eq!(config.sampling.pids, vec![3, 10]);
        assert_eq!(config.sampling.unwind_table_bytes, 128 << 20);
        assert_eq!(config.format, OutputFormat::Folded);
        assert_eq!(config.output, PathBuf::from("profile.pb.gz"));
    }

    #[test]
    fn rejects_bad_values_with_clear_messages() {
        let error = |args: &[&str]| Cli::try_parse_from(args).unwrap_err().to_string();
        assert!(error(&["profiler", "record", "--duration", "5", "-F", "0"]).contains("1..=1000"));
        assert!(
            error(&["profiler", "record", "--duration", "5", "-F", "5000"]).contains("1..=1000")
        );
        assert!(error(&["profiler", "record", "--duration=-1"]).contains("more than 0"));
        assert!(
            error(&["profiler", "record", "--duration", "soon"])
                .contains("not a number of seconds")
        );
        assert!(
            error(&["profiler", "record", "--duration", "1", "--pid", "abc"])
                .contains("not a process id")
        );
        assert!(
            error(&["profiler", "record", "--duration", "1", "--format", "svg"])
                .contains("pprof or folded")
        );
        assert!(error(&["profiler", "record"]).contains("--duration"));
    }
}
