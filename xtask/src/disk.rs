//! Free disk space: a full disk otherwise shows half-way through an install or a link as
//! `No space left on device`.

use std::path::Path;

use anyhow::{Context, Result, bail};

/// The disk an install takes at its peak, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskNeed {
    /// The install, for messages.
    pub what: &'static str,
    /// What stays under the workspace.
    pub kept: u64,
    /// What it downloads into the temporary directory first (removed once installed).
    pub downloads: u64,
}

/// Fails with one line, before anything is downloaded, where `need` would not fit: a full
/// disk otherwise shows as pip's `No space left on device` half-way through the download.
pub fn check_disk_space(need: DiskNeed, workspace: &Path) -> Result<()> {
    let temp = std::env::temp_dir();
    let space_of = |path: &Path| {
        free_space(path)
            .with_context(|| format!("cannot read the free space of {}", path.display()))
    };
    let (kept_at, downloads_at) = (space_of(workspace)?, space_of(&temp)?);
    match disk_shortfall(need, kept_at, downloads_at) {
        None => Ok(()),
        Some(Shortfall::Workspace {
            needed,
            free,
            with_downloads,
        }) => bail!(
            "not enough disk space to install {}: it needs about {} on the filesystem of {}{}, \
             {} free there; free some space (e.g. `cargo clean`, old clones) and run `cargo xtask \
             setup` again",
            need.what,
            gigabytes(needed),
            workspace.display(),
            if with_downloads {
                format!(" (with its downloads in {})", temp.display())
            } else {
                String::new()
            },
            gigabytes(free)
        ),
        Some(Shortfall::Temp { needed, free }) => bail!(
            "not enough disk space to install {}: its downloads need about {} in {}, {} free \
             there; free some space there or point TMPDIR elsewhere and run `cargo xtask setup` again",
            need.what,
            gigabytes(needed),
            temp.display(),
            gigabytes(free)
        ),
    }
}

/// A filesystem's id and the bytes an unprivileged user may still write to it.
#[derive(Debug, Clone, Copy)]
pub struct FreeSpace {
    pub device: u64,
    pub free: u64,
}

pub fn free_space(path: &Path) -> Result<FreeSpace> {
    use std::os::unix::{ffi::OsStrExt, fs::MetadataExt};
    let device = std::fs::metadata(path)?.dev();
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut stats = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a NUL-terminated path and a buffer of the struct's size.
    if unsafe { libc::statvfs(c_path.as_ptr(), stats.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: statvfs succeeded, so it filled the struct.
    let stats = unsafe { stats.assume_init() };
    let free = stats.f_bavail.saturating_mul(stats.f_frsize);
    Ok(FreeSpace { device, free })
}

#[derive(Debug, PartialEq, Eq)]
enum Shortfall {
    /// `with_downloads`: the temporary directory is on that filesystem, `needed` counts both.
    Workspace {
        needed: u64,
        free: u64,
        with_downloads: bool,
    },
    Temp {
        needed: u64,
        free: u64,
    },
}

/// Where `need` does not fit: its downloads and what it keeps count together when the
/// temporary directory is on the workspace's filesystem.
fn disk_shortfall(need: DiskNeed, workspace: FreeSpace, temp: FreeSpace) -> Option<Shortfall> {
    if workspace.device == temp.device {
        let needed = need.kept + need.downloads;
        return (workspace.free < needed).then_some(Shortfall::Workspace {
            needed,
            free: workspace.free,
            with_downloads: true,
        });
    }
    if temp.free < need.downloads {
        return Some(Shortfall::Temp {
            needed: need.downloads,
            free: temp.free,
        });
    }
    (workspace.free < need.kept).then_some(Shortfall::Workspace {
        needed: need.kept,
        free: workspace.free,
        with_downloads: false,
    })
}

fn gigabytes(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_install_that_does_not_fit_says_where_space_is_short() {
        let need = DiskNeed {
            what: "torch",
            kept: 6_000,
            downloads: 3_000,
        };
        let on = |device, free| FreeSpace { device, free };
        // One filesystem: the downloads and what stays count together.
        assert_eq!(disk_shortfall(need, on(1, 9_000), on(1, 9_000)), None);
        assert_eq!(
            disk_shortfall(need, on(1, 8_999), on(1, 8_999)),
            Some(Shortfall::Workspace {
                needed: 9_000,
                free: 8_999,
                with_downloads: true
            })
        );
        // Two: each holds its own part.
        assert_eq!(disk_shortfall(need, on(1, 6_000), on(2, 3_000)), None);
        assert_eq!(
            disk_shortfall(need, on(1, 100_000), on(2, 2_999)),
            Some(Shortfall::Temp {
                needed: 3_000,
                free: 2_999
            })
        );
        assert_eq!(
            disk_shortfall(need, on(1, 5_999), on(2, 100_000)),
            Some(Shortfall::Workspace {
                needed: 6_000,
                free: 5_999,
                with_downloads: false
            })
        );
        // The real filesystem answers, and a missing path is an error, not zero.
        let here = free_space(Path::new(".")).expect("statvfs of the working directory");
        assert!(here.free > 0);
        assert!(free_space(Path::new("/no/such/dir")).is_err());
        assert_eq!(gigabytes(8_400_000_000), "8.4 GB");
    }
}
