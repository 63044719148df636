//! py-spy, the reference the tests compare the walker with. Installed from PyPI into the
//! workspace's `target/py-spy` (no system-wide install); `cargo xtask setup` can call
//! [`install_py_spy`].
use std::{
    io,
    path::{Path, PathBuf},
    process::Command,
};

pub const PY_SPY_VERSION: &str = "0.4.3";

/// `<workspace>/target/py-spy`: `pip install --target` puts the binary in `bin/`.
pub fn py_spy_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join("target").join("py-spy")
}

/// The installed binary, if any.
pub fn find_py_spy(workspace_root: &Path) -> Option<PathBuf> {
    let binary = py_spy_dir(workspace_root).join("bin").join("py-spy");
    binary.is_file().then_some(binary)
}

/// Runs `<python> -m pip install --target <workspace>/target/py-spy py-spy==0.4.3` with any
/// Python that has pip (e.g. pyenv's), and returns the binary's path.
pub fn install_py_spy(python: &Path, workspace_root: &Path) -> io::Result<PathBuf> {
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(py_spy_dir(workspace_root))
        .arg(format!("py-spy=={PY_SPY_VERSION}"))
        .status()?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "pip install py-spy failed: {status}"
        )));
    }
    find_py_spy(workspace_root)
        .ok_or_else(|| io::Error::other("pip succeeded but bin/py-spy is missing"))
}
