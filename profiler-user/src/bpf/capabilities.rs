//! Fail fast, with one clear line, when the agent cannot work on this machine.
use std::path::Path;

use super::BpfError;

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capabilities of this process, from /proc/self/status.
fn effective_capabilities() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    parse_cap_eff(&status).unwrap_or(0)
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find(|line| line.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

fn missing_capabilities(effective: u64) -> Vec<&'static str> {
    let has = |cap: u32| effective & (1 << cap) != 0;
    // CAP_SYS_ADMIN implies both on kernels older than 5.8 and still suffices on newer ones.
    if has(CAP_SYS_ADMIN) {
        return Vec::new();
    }
    let mut missing = Vec::new();
    if !has(CAP_BPF) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_PERFMON) {
        missing.push("CAP_PERFMON");
    }
    missing
}

pub fn check_privileges() -> Result<(), BpfError> {
    let missing = missing_capabilities(effective_capabilities());
    if missing.is_empty() {
        Ok(())
    } else {
        Err(BpfError::MissingPrivileges {
            missing: missing.join(", "),
        })
    }
}

pub fn check_kernel_support(btf_path: &Path) -> Result<(), BpfError> {
    if !btf_path.exists() {
        return Err(BpfError::NoBtf {
            path: btf_path.to_path_buf(),
        });
    }
    // An invalid command on a kernel with BPF fails with EINVAL (or EPERM); without BPF support
    // the syscall itself is missing (ENOSYS).
    // SAFETY: BPF_PROG_LOAD-independent probe with a null attribute pointer and size 0.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, -1i64, std::ptr::null::<u8>(), 0u32) };
    if ret < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSYS) {
            return Err(BpfError::NoBpf(err));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_effective_capabilities() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(parse_cap_eff(status), Some(0x1ff_ffff_ffff));
        assert_eq!(parse_cap_eff("Name: x\n"), None);
    }

    #[test]
    fn names_missing_capabilities() {
        assert!(missing_capabilities(1 << CAP_SYS_ADMIN).is_empty());
        assert!(missing_capabilities((1 << CAP_BPF) | (1 << CAP_PERFMON)).is_empty());
        assert_eq!(missing_capabilities(1 << CAP_BPF), vec!["CAP_PERFMON"]);
        assert_eq!(missing_capabilities(0), vec!["CAP_BPF", "CAP_PERFMON"]);
    }
}
