//! `profiler`: the command-line front end of the agent library.
use std::sync::{Arc, atomic::AtomicBool};

use clap::Parser;
use profiler::cli::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

// jemalloc, not glibc's malloc: on a busy host a sixth of the agent's CPU went to glibc's
// malloc and free (consolidating fast bins, unlinking chunks), and jemalloc cut the CPU per
// sample by about 15 % there (docs/benchmarks.md, suite `host`). mimalloc cut more but kept
// its per-thread pages: peak RSS 190 MiB.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings (`malloc_conf`), read at its first allocation. Two arenas, as for
/// glibc: the agent has a handful of busy threads. Freed pages go back to the system within
/// half a second (at 2 s, pages the table builds had freed and jemalloc not yet purged made
/// the anonymous RSS 57 MiB at 30 s of a busy host's start-up, against 40), and blocks of
/// 1 MiB or more (a large unwind table) at once, from an arena of their own. A setting
/// jemalloc does not know stops the agent at start.
#[unsafe(export_name = "_rjem_malloc_conf")]
static JEMALLOC_CONF: &u8 =
    &b"narenas:2,dirty_decay_ms:500,muzzy_decay_ms:0,oversize_threshold:1048576,abort_conf:true\0"
        [0];

/// jemalloc's statistics for the agent's heap metrics (refreshed by advancing its epoch).
fn jemalloc_heap_stats() -> Option<profiler::self_metrics::HeapStats> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    Some(profiler::self_metrics::HeapStats {
        allocated: stats::allocated::read().ok()? as u64,
        resident: stats::resident::read().ok()? as u64,
    })
}

fn main() {
    profiler::agent::tune_allocator();
    profiler::self_metrics::set_heap_stats_reader(jemalloc_heap_stats);
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(err) = signal_hook::flag::register(signal, stop.clone()) {
            eprintln!("error: cannot install the handler for signal {signal}: {err}");
            std::process::exit(1);
        }
    }
    let loads_nvml = matches!(cli.command, Command::Agent(_));
    let result = match cli.command {
        Command::Record(args) => profiler::agent::record(&args.into(), &stop).map(|_| ()),
        Command::Agent(args) => profiler::agent::run_agent(&(*args).into(), stop),
        Command::Server(args) => {
            profiler::server::serve::run_server(&args.into(), &stop).map_err(Into::into)
        }
    };
    let code = match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("error: {}", anyhow::Error::from(err));
            1
        }
    };
    if loads_nvml {
        // Everything is written and every Rust value dropped by now. NVIDIA's libraries
        // (NVML, and the CUDA driver it loads for GPM) crashed in their own exit-time teardown
        // on an H100 (SIGSEGV in nvmlShutdown, then at exit): leave without running C exit
        // handlers and library destructors.
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        // SAFETY: _exit ends the process at once; nothing of ours is left to run.
        unsafe { libc::_exit(code) };
    }
    std::process::exit(code);
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
