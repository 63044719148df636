//! Project tasks: `cargo xtask setup | build-ebpf | run | test | bench` (alias in .cargo/config.toml).

mod cmd;
mod disk;
mod ebpf;
mod python314;
mod python_free_threaded;
mod setup;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Project tasks for the eBPF profiler"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the build and the tests need, skipping what is present (apt needs root)
    Setup,
    /// Build the eBPF object and print its path
    BuildEbpf,
    /// Build the agent (release) and run `profiler agent [ARGS...]`
    Run {
        /// Arguments for `profiler agent`, after `--`
        #[arg(last = true)]
        args: Vec<OsString>,
    },
    /// Build everything and run all tests, including the root-only BPF integration tests
    Test {
        /// Extra arguments for `cargo test`, after `--` (e.g. `-- -p profiler-user -- --nocapture`)
        #[arg(last = true)]
        args: Vec<OsString>,
    },
    /// Run the benchmark harness (the `bench` binary of integration-tests)
    Bench {
        /// Arguments for the harness, after `--`
        #[arg(last = true)]
        args: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    let workspace = workspace();
    match cli.task {
        Task::Setup => setup::setup(&workspace, false)?,
        Task::BuildEbpf => {
            setup::ensure(&workspace)?;
            // ebpf_build.rs runs this (capturing its output) with RUSTC=/usr/bin/rustc,
            // RUSTC_BOOTSTRAP=aya_ebpf and bpf-linker first in PATH.
            println!(
                "$ {} build --package profiler-ebpf --bins --release --target bpfel-unknown-none --target-dir {}",
                ebpf::EBPF_CARGO,
                workspace.join("target").join("ebpf").display()
            );
            let object = ebpf::build_ebpf(&workspace).map_err(anyhow::Error::msg)?;
            println!("{}", object.display());
        }
        Task::Run { args } => {
            setup::ensure(&workspace)?;
            cmd::run(cargo_in(&workspace).args(["build", "--release", "-p", "profiler-user"]))?;
            let profiler = target_dir(&workspace).join("release").join("profiler");
            // The child shares our process group, so Ctrl-C reaches it directly; we only have to
            // survive the signal long enough to report its exit code.
            survive_sigint();
            let status = cmd::status(Command::new(&profiler).arg("agent").args(args))?;
            return Ok(ExitCode::from(cmd::exit_code(status)));
        }
        Task::Test { args } => {
            warn_if_disk_is_short(&workspace);
            setup::ensure(&workspace)?;
            cmd::run(cargo_in(&workspace).args(["build", "--workspace", "--all-targets"]))?;
            cmd::run(
                cargo_in(&workspace)
                    .env("PROFILER_REQUIRE_EXTERNAL", "1")
                    .env("RUST_BACKTRACE", "1")
                    .args(["test", "--workspace", "--all-targets", "--no-fail-fast"])
                    .args(args),
            )?;
        }
        Task::Bench { args } => {
            setup::ensure(&workspace)?;
            if !has_bench_binary(&workspace)? {
                bail!(
                    "benchmark harness not built yet: the integration-tests package has no `bench` binary"
                );
            }
            let status = cmd::status(
                cargo_in(&workspace)
                    .args([
                        "run",
                        "--release",
                        "-p",
                        "integration-tests",
                        "--bin",
                        "bench",
                        "--",
                    ])
                    .args(args),
            )?;
            return Ok(ExitCode::from(cmd::exit_code(status)));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Free space a fresh `cargo xtask test` needs: about 6 GB of installs under `.tools` and 4 GB
/// of build output (measured on a clean clone).
const TEST_DISK_NEEDED_GIB: u64 = 12;

/// Says up front when the disk is too short for setup and the test build, which otherwise fail
/// deep inside a linker with "No space left on device".
fn warn_if_disk_is_short(workspace: &Path) {
    let Ok(disk::FreeSpace { free, .. }) = disk::free_space(workspace) else {
        return;
    };
    let free_gib = free >> 30;
    if free_gib < TEST_DISK_NEEDED_GIB {
        eprintln!(
            "warning: {free_gib} GiB free under {}; setup and the test build need about \
             {TEST_DISK_NEEDED_GIB} GiB",
            workspace.display()
        );
    }
}

/// The workspace root: xtask's parent directory. Cargo sets CARGO_MANIFEST_DIR for `cargo run`;
/// the compile-time value covers running the binary directly.
fn workspace() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}

fn target_dir(workspace: &std::path::Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), |dir| workspace.join(dir))
}

/// The cargo that runs xtask (set by `cargo run`), so nested builds use the same toolchain.
pub fn cargo() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

fn cargo_in(workspace: &std::path::Path) -> Command {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(workspace);
    cmd
}

fn has_bench_binary(workspace: &std::path::Path) -> Result<bool> {
    let metadata =
        cmd::output(cargo_in(workspace).args(["metadata", "--no-deps", "--format-version", "1"]))?;
    let metadata: serde_json::Value =
        serde_json::from_str(&metadata).context("cannot parse `cargo metadata` output")?;
    let packages = metadata["packages"]
        .as_array()
        .context("`cargo metadata` lists no packages")?;
    Ok(packages
        .iter()
        .filter(|package| package["name"] == "integration-tests")
        .any(|package| {
            package["targets"].as_array().is_some_and(|targets| {
                targets.iter().any(|target| {
                    target["name"] == "bench"
                        && target["kind"]
                            .as_array()
                            .is_some_and(|kinds| kinds.iter().any(|kind| kind == "bin"))
                })
            })
        }))
}

extern "C" fn on_sigint(_: libc::c_int) {}

/// Catches SIGINT with a no-op handler (not SIG_IGN, which children would inherit).
fn survive_sigint() {
    // SAFETY: installs a handler that does nothing, which is async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
    }
}
