//! py-spy, the reference the tests compare the walker with. `cargo xtask setup` installs it
//! from PyPI into the workspace's `.tools/py-spy` (no system-wide install).
use std::path::{Path, PathBuf};

pub const PY_SPY_VERSION: &str = "0.4.3";

/// `<workspace>/.tools/py-spy`: `pip install --target` puts the binary in `bin/`.
pub fn py_spy_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join(".tools").join("py-spy")
}

/// The installed binary, if any.
pub fn find_py_spy(workspace_root: &Path) -> Option<PathBuf> {
    let binary = py_spy_dir(workspace_root).join("bin").join("py-spy");
    binary.is_file().then_some(binary)
}
