//! CPython 3.14 for the Python-stack tests: no Debian 12 package has it, so setup fetches
//! Debian sid's packages with `apt-get download` (a private sources list and state, the
//! machine's apt configuration untouched), unpacks them under `.tools/python3.14` and points
//! the binary at the unpacked (newer) glibc with patchelf.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::cmd;

/// Where the unpacked interpreter lives; the tests look for `usr/bin/python3.14` below it.
pub const PYTHON314_DIR: &str = ".tools/python3.14";
const SID_MIRROR: &str = "http://deb.debian.org/debian";
/// The interpreter, its standard library, and the sid glibc, expat and zlib it links against.
const PACKAGES: &[&str] = &[
    "python3.14-minimal",
    "libpython3.14-minimal",
    "libpython3.14-stdlib",
    "libc6",
    "libexpat1",
    "zlib1g",
];

/// `program` (apt-get or apt-cache) on a private sources list and state under `state`, the
/// machine's apt configuration untouched.
pub fn private_apt(program: &str, sources: &Path, state: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .arg("-o")
        .arg(format!("Dir::Etc::SourceList={}", sources.display()))
        .args(["-o", "Dir::Etc::SourceParts=/dev/null"])
        .arg("-o")
        .arg(format!("Dir::State={}", state.display()))
        .args(["-o", "Dir::State::status=/dev/null"])
        .arg("-o")
        .arg(format!("Dir::Cache={}", state.display()))
        .args(["-o", "APT::Sandbox::User=root", "-q"]);
    command
}

pub fn python314_binary(workspace: &Path) -> PathBuf {
    workspace.join(PYTHON314_DIR).join("usr/bin/python3.14")
}

pub fn python314_missing(workspace: &Path) -> bool {
    !python314_binary(workspace).is_file()
}

pub fn install_python314(workspace: &Path) -> Result<()> {
    let root = workspace.join(PYTHON314_DIR);
    let apt = workspace.join(".tools/sid-apt");
    let _ = std::fs::remove_dir_all(&root);
    for dir in ["lists/partial", "archives/partial", "debs"] {
        std::fs::create_dir_all(apt.join(dir))?;
    }
    let sources = apt.join("sources.list");
    std::fs::write(
        &sources,
        format!("deb [trusted=yes] {SID_MIRROR} sid main\n"),
    )?;
    cmd::run(private_apt("apt-get", &sources, &apt).arg("update"))
        .context("apt-get update (Debian sid)")?;
    let debs = apt.join("debs");
    cmd::run(
        private_apt("apt-get", &sources, &apt)
            .current_dir(&debs)
            .arg("download")
            .args(PACKAGES),
    )
    .context("apt-get download (Debian sid Python 3.14)")?;
    for entry in std::fs::read_dir(&debs)? {
        let deb = entry?.path();
        if deb.extension().is_some_and(|e| e == "deb") {
            cmd::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
        }
    }
    let libs = root.join("usr/lib/x86_64-linux-gnu");
    cmd::run(
        Command::new("patchelf")
            .arg("--set-interpreter")
            .arg(libs.join("ld-linux-x86-64.so.2"))
            .arg("--set-rpath")
            .arg(&libs)
            .arg(python314_binary(workspace)),
    )?;
    cmd::run(
        Command::new(python314_binary(workspace)).args(["-c", "import asyncio, ctypes, threading"]),
    )
    .context("the unpacked Python 3.14 does not run")?;
    let _ = std::fs::remove_dir_all(&apt);
    Ok(())
}
