// The one recipe that builds the eBPF object, `include!`d by profiler-user's build script and by
// `cargo xtask build-ebpf`, so both produce the same object: Debian's rustc-web (with a
// prebuilt `core` for bpfel-unknown-none) compiles, bpf-linker 0.13 (built against the same
// LLVM 22 by `cargo xtask setup`) links.

/// Overrides the object the agent embeds (for builds on machines without the eBPF toolchain).
pub const EBPF_OBJECT_ENV: &str = "PROFILER_EBPF_OBJECT";
/// Version of bpf-linker that `cargo xtask setup` installs under `.tools/`.
pub const BPF_LINKER_VERSION: &str = "0.13.0";
/// Debian's compiler, which ships the BPF `core`.
pub const EBPF_RUSTC: &str = "/usr/bin/rustc";
pub const EBPF_CARGO: &str = "/usr/bin/cargo";
pub const EBPF_CORE_DIR: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";

pub fn bpf_linker_dir(workspace: &std::path::Path) -> std::path::PathBuf {
    workspace
        .join(".tools")
        .join(format!("bpf-linker-{BPF_LINKER_VERSION}"))
        .join("bin")
}

/// What is missing for an eBPF build, if anything, as a list of human-readable items.
pub fn ebpf_toolchain_missing(workspace: &std::path::Path) -> Vec<String> {
    let mut missing = Vec::new();
    if !std::path::Path::new(EBPF_RUSTC).exists() || !std::path::Path::new(EBPF_CARGO).exists() {
        missing.push(format!("Debian's rustc-web/cargo-web ({EBPF_RUSTC})"));
    }
    if !std::path::Path::new(EBPF_CORE_DIR).exists() {
        missing.push(format!(
            "the BPF core library ({EBPF_CORE_DIR}, libstd-rust-web-dev-bpf)"
        ));
    }
    if !bpf_linker_dir(workspace).join("bpf-linker").exists() {
        missing.push(format!(
            "bpf-linker {BPF_LINKER_VERSION} in {}",
            bpf_linker_dir(workspace).display()
        ));
    }
    missing
}

/// Builds profiler-ebpf and returns the path of the object.
pub fn build_ebpf(workspace: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let missing = ebpf_toolchain_missing(workspace);
    if !missing.is_empty() {
        return Err(format!(
            "the eBPF toolchain is not installed (missing: {}); run `cargo xtask setup`",
            missing.join(", ")
        ));
    }
    let target_dir = workspace.join("target").join("ebpf");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bpf_linker_dir(workspace)];
    paths.extend(std::env::split_paths(&path));
    let path = std::env::join_paths(paths).map_err(|err| err.to_string())?;
    let rustflags = [
        "--cfg=bpf_target_arch=\"x86_64\"",
        "-Cdebuginfo=2",
        "-Clink-arg=--btf",
        // The BPF code gets no clippy run (Debian's toolchain has none): rustc's own warnings
        // and the workspace lints fail its build instead of scrolling by unseen.
        "-Dwarnings",
    ]
    .join("\x1f");
    let mut cmd = std::process::Command::new(EBPF_CARGO);
    cmd.current_dir(workspace)
        .args(["build", "--package", "profiler-ebpf", "--bins", "--release"])
        .args(["--target", "bpfel-unknown-none", "--target-dir"])
        .arg(&target_dir)
        .env("PATH", path)
        .env("RUSTC", EBPF_RUSTC)
        // aya-ebpf uses unstable features; allow them for that one crate only.
        .env("RUSTC_BOOTSTRAP", "aya_ebpf")
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags);
    for var in [
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "RUSTUP_TOOLCHAIN",
        "CARGO",
    ] {
        cmd.env_remove(var);
    }
    // Cargo sets these for build scripts; they must not leak into the nested build.
    let inherited: Vec<_> = std::env::vars_os()
        .map(|(key, _)| key)
        .filter(|key| {
            let key = key.to_string_lossy();
            key.starts_with("CARGO_CFG_")
                || key.starts_with("CARGO_FEATURE_")
                || key.starts_with("CARGO_PKG_")
                || key == "OUT_DIR"
                || key == "TARGET"
                || key == "HOST"
                || key == "PROFILE"
                || key == "OPT_LEVEL"
                || key == "DEBUG"
                || key == "NUM_JOBS"
                || key == "CARGO_MANIFEST_DIR"
                || key == "CARGO_MANIFEST_PATH"
                || key == "CARGO_ENCODED_RUSTFLAGS"
        })
        .collect();
    for key in inherited {
        if key != "CARGO_ENCODED_RUSTFLAGS" {
            cmd.env_remove(key);
        }
    }
    let output = cmd
        .output()
        .map_err(|err| format!("cannot run {EBPF_CARGO}: {err}"))?;
    if !output.status.success() {
        return Err(format!(
            "building profiler-ebpf failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(target_dir
        .join("bpfel-unknown-none")
        .join("release")
        .join("profiler-ebpf"))
}
