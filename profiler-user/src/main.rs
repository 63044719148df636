//! `profiler`: the command-line front end of the agent library.
use std::sync::{Arc, atomic::AtomicBool};

use clap::Parser;
use profiler::cli::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

fn main() {
    profiler::agent::tune_allocator();
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(err) = signal_hook::flag::register(signal, stop.clone()) {
            eprintln!("error: cannot install the handler for signal {signal}: {err}");
            std::process::exit(1);
        }
    }
    let result = match cli.command {
        Command::Record(args) => profiler::agent::record(&args.into(), &stop).map(|_| ()),
        Command::Agent(args) => profiler::agent::run_agent(&(*args).into(), stop),
        Command::Server(args) => {
            profiler::server::serve::run_server(&args.into(), &stop).map_err(Into::into)
        }
    };
    if let Err(err) = result {
        eprintln!("error: {}", anyhow::Error::from(err));
        std::process::exit(1);
    }
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
