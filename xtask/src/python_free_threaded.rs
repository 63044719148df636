//! Free-threaded CPython 3.13t and 3.14t (PEP 703) for the Python-stack tests. No registry ships
//! them for Debian, so setup builds them from the CPython source in Debian's source packages
//! (`python3.13_*.orig.tar.xz`, the upstream tarball), configured `--disable-gil`, into
//! `.tools/python3.13t` and `.tools/python3.14t`. About two minutes each on 2 cores.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd;
use crate::python314::private_apt;

const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";
/// Suites whose source indexes list candidate tarballs; a mirror may lack the newest one.
const SUITES: &[&str] = &["sid", "forky", "trixie"];

/// Tarballs known to be on the mirror, tried after those the indexes list: a mirror's pool can
/// lag its indexes (the newest versions listed are then missing). (minor, version, SHA-256).
const PINNED_TARBALLS: &[(&str, &str, &str)] = &[
    (
        "3.13",
        "3.13.15",
        "1e66a7945a48390ee4c2a4268a0e4185884059a13c4aab6d148aa208deea4a76",
    ),
    (
        "3.13",
        "3.13.5",
        "93e583f243454e6e9e4588ca2c2662206ad961659863277afcdb96801647d640",
    ),
    (
        "3.14",
        "3.14.7",
        "3b48dac8fb59f62eaa67ac83c1eb12bda1b7a08406dd286e252c11a66be27f81",
    ),
    (
        "3.14",
        "3.14.5",
        "7e32597b99e5d9a39abed35de4693fa169df3e5850d4c334337ffd6a19a36db6",
    ),
];

/// The free-threaded interpreters the tests use: (minor version, install directory).
pub const FREE_THREADED_PYTHONS: &[(&str, &str)] = &[
    ("3.13", ".tools/python3.13t"),
    ("3.14", ".tools/python3.14t"),
];

/// `bin/python3.Xt` under the install directory of `minor`.
pub fn free_threaded_binary(workspace: &Path, minor: &str) -> PathBuf {
    let dir = FREE_THREADED_PYTHONS
        .iter()
        .find(|(version, _)| *version == minor)
        .map_or(".tools/unknown", |(_, dir)| dir);
    workspace.join(dir).join(format!("bin/python{minor}t"))
}

/// The minor versions whose interpreter is not installed.
pub fn free_threaded_missing(workspace: &Path) -> Vec<&'static str> {
    FREE_THREADED_PYTHONS
        .iter()
        .filter(|(minor, _)| !free_threaded_binary(workspace, minor).is_file())
        .map(|(minor, _)| *minor)
        .collect()
}

/// One `.orig.tar.xz` listed in a Sources index.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SourceTarball {
    /// Upstream version, e.g. `3.13.5`.
    version: Vec<u32>,
    url: String,
    sha256: String,
}

pub fn install_free_threaded(workspace: &Path) -> Result<()> {
    let apt = workspace.join(".tools/free-threaded-apt");
    let _ = std::fs::remove_dir_all(&apt);
    for dir in ["lists/partial", "archives/partial"] {
        std::fs::create_dir_all(apt.join(dir))?;
    }
    let sources = apt.join("sources.list");
    let lines: String = SUITES
        .iter()
        .map(|suite| format!("deb-src [trusted=yes] {DEBIAN_MIRROR} {suite} main\n"))
        .collect();
    std::fs::write(&sources, lines)?;
    let indexes = cmd::run(private_apt("apt-get", &sources, &apt).arg("update"));
    if let Err(error) = &indexes {
        println!("warning: Debian's source indexes: {error:#}; trying the pinned tarballs only");
    }
    for minor in free_threaded_missing(workspace) {
        let listing = if indexes.is_ok() {
            cmd::output(
                private_apt("apt-cache", &sources, &apt)
                    .arg("showsrc")
                    .arg(format!("python{minor}")),
            )
            .unwrap_or_default()
        } else {
            String::new()
        };
        let mut candidates = orig_tarballs(&listing);
        for &(pinned_minor, version, sha256) in PINNED_TARBALLS {
            let Some(parsed) = parse_version(version) else {
                continue;
            };
            if pinned_minor == minor && !candidates.iter().any(|c| c.version == parsed) {
                candidates.push(SourceTarball {
                    version: parsed,
                    url: format!(
                        "{DEBIAN_MIRROR}/pool/main/p/python{minor}/python{minor}_{version}.orig.tar.xz"
                    ),
                    sha256: sha256.to_owned(),
                });
            }
        }
        let tarball = apt.join(format!("python{minor}.orig.tar.xz"));
        let source = candidates
            .iter()
            .find(|candidate| download(candidate, &tarball).is_ok())
            .with_context(|| {
                format!(
                    "no CPython {minor} source tarball could be downloaded (tried {})",
                    candidates
                        .iter()
                        .map(|c| c.url.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        build(workspace, minor, source, &tarball, &apt)?;
    }
    let _ = std::fs::remove_dir_all(&apt);
    Ok(())
}

fn download(source: &SourceTarball, to: &Path) -> Result<()> {
    cmd::run(
        Command::new("/usr/lib/apt/apt-helper")
            .arg("download-file")
            .arg(&source.url)
            .arg(to)
            .arg(format!("SHA256:{}", source.sha256)),
    )
}

fn build(
    workspace: &Path,
    minor: &str,
    source: &SourceTarball,
    tarball: &Path,
    scratch: &Path,
) -> Result<()> {
    let prefix = free_threaded_binary(workspace, minor)
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .context("install directory")?;
    let _ = std::fs::remove_dir_all(&prefix);
    let tree = scratch.join(format!("cpython-{minor}"));
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(&tree)?;
    cmd::run(
        Command::new("tar")
            .arg("-xf")
            .arg(tarball)
            .arg("-C")
            .arg(&tree)
            .arg("--strip-components=1"),
    )?;
    println!(
        "building free-threaded CPython {} (about two minutes)",
        version_text(&source.version)
    );
    cmd::run(
        Command::new("./configure")
            .current_dir(&tree)
            .arg("--disable-gil")
            .arg(format!("--prefix={}", prefix.display()))
            .arg("--without-ensurepip")
            .stdout(std::process::Stdio::null()),
    )?;
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    cmd::run(
        Command::new("make")
            .current_dir(&tree)
            .arg(format!("-j{jobs}"))
            .stdout(std::process::Stdio::null()),
    )?;
    cmd::run(
        Command::new("make")
            .current_dir(&tree)
            .arg("install")
            .stdout(std::process::Stdio::null()),
    )?;
    let _ = std::fs::remove_dir_all(&tree);
    // The static library (80 MB) only serves embedding; the tests run the binary.
    let config = prefix
        .join("lib")
        .join(format!("python{minor}t"))
        .join(format!("config-{minor}t-x86_64-linux-gnu"));
    let _ = std::fs::remove_file(config.join(format!("libpython{minor}t.a")));
    let binary = free_threaded_binary(workspace, minor);
    cmd::run(Command::new(&binary).args([
        "-c",
        "import asyncio, ctypes, sys, threading; assert not sys._is_gil_enabled()",
    ]))
    .with_context(|| format!("the built free-threaded Python {minor} does not run"))?;
    if !binary.is_file() {
        bail!("{} missing after the build", binary.display());
    }
    Ok(())
}

fn version_text(version: &[u32]) -> String {
    version
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

/// The upstream tarballs an `apt-cache showsrc` listing names, newest first, without repeats.
fn orig_tarballs(listing: &str) -> Vec<SourceTarball> {
    let mut found: Vec<SourceTarball> = Vec::new();
    for stanza in listing.split("\n\n") {
        let Some(directory) = stanza
            .lines()
            .find_map(|line| line.strip_prefix("Directory: "))
        else {
            continue;
        };
        let mut in_sha256 = false;
        for line in stanza.lines() {
            if !line.starts_with(' ') {
                in_sha256 = line.starts_with("Checksums-Sha256:");
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [sha256, _size, name] = fields[..] else {
                continue;
            };
            let Some(version) = name
                .split_once('_')
                .and_then(|(_, rest)| rest.strip_suffix(".orig.tar.xz"))
                .and_then(parse_version)
            else {
                continue;
            };
            if in_sha256 && !found.iter().any(|f| f.version == version) {
                found.push(SourceTarball {
                    version,
                    url: format!("{DEBIAN_MIRROR}/{}/{name}", directory.trim()),
                    sha256: sha256.to_owned(),
                });
            }
        }
    }
    found.sort_by(|a, b| b.version.cmp(&a.version));
    found
}

/// `3.13.5` → [3, 13, 5]; release candidates and other suffixes are not candidates.
fn parse_version(text: &str) -> Option<Vec<u32>> {
    text.split('.').map(|part| part.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orig_tarballs_are_listed_newest_first_from_every_stanza() {
        let listing = "Package: python3.13\nVersion: 3.13.5-2\nDirectory: pool/main/p/python3.13\n\
Files:\n 00 1 python3.13_3.13.5.orig.tar.xz\nChecksums-Sha256:\n aaa 23000 python3.13_3.13.5.orig.tar.xz\n \
bbb 500 python3.13_3.13.5-2.debian.tar.xz\n\n\
Package: python3.13\nVersion: 3.13.18-1\nDirectory: pool/main/p/python3.13\n\
Checksums-Sha256:\n ccc 23100 python3.13_3.13.18.orig.tar.xz\n ddd 10 python3.13_3.13.18~rc1.orig.tar.xz\n\n\
Package: python3.13\nVersion: 3.13.5-2\nDirectory: pool/main/p/python3.13\n\
Checksums-Sha256:\n aaa 23000 python3.13_3.13.5.orig.tar.xz\n";
        let found = orig_tarballs(listing);
        assert_eq!(
            found,
            vec![
                SourceTarball {
                    version: vec![3, 13, 18],
                    url: format!(
                        "{DEBIAN_MIRROR}/pool/main/p/python3.13/python3.13_3.13.18.orig.tar.xz"
                    ),
                    sha256: "ccc".into(),
                },
                SourceTarball {
                    version: vec![3, 13, 5],
                    url: format!(
                        "{DEBIAN_MIRROR}/pool/main/p/python3.13/python3.13_3.13.5.orig.tar.xz"
                    ),
                    sha256: "aaa".into(),
                },
            ]
        );
    }
}
