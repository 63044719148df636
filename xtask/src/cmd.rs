//! Running external commands: every command is printed before it runs, and a failure becomes a
//! one-line error that names the command.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, ExitStatus};

use anyhow::{Context, Result, bail};

/// The command as a shell-like line, with the environment variables it sets explicitly.
pub fn display(cmd: &Command) -> String {
    let mut parts: Vec<String> = cmd
        .get_envs()
        .filter_map(|(key, value)| {
            Some(format!(
                "{}={}",
                key.to_string_lossy(),
                value?.to_string_lossy()
            ))
        })
        .collect();
    parts.push(cmd.get_program().to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(quote));
    let line = parts.join(" ");
    // Mention the directory only when it is not the one we run in.
    match cmd.get_current_dir() {
        Some(dir) if std::env::current_dir().ok().as_deref() != Some(dir) => {
            format!("(cd {} && {line})", dir.display())
        }
        _ => line,
    }
}

fn quote(arg: &OsStr) -> String {
    let arg = arg.to_string_lossy();
    if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || "'\"$`\\;&|<>*?".contains(c)) {
        format!("'{}'", arg.replace('\'', r"'\''"))
    } else {
        arg.into_owned()
    }
}

/// A short name for error messages: the program and its non-option arguments, e.g.
/// `apt-get install rustc-web` for `apt-get install -y --no-install-recommends rustc-web`.
pub fn short_name(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program());
    let program = program
        .file_name()
        .unwrap_or(program.as_os_str())
        .to_string_lossy()
        .into_owned();
    let words = cmd
        .get_args()
        .map(|arg| arg.to_string_lossy())
        .take_while(|arg| arg != "--")
        .filter(|arg| !arg.starts_with('-') && !arg.starts_with('/') && !arg.contains('='))
        .take(4)
        .map(|arg| arg.into_owned());
    std::iter::once(program)
        .chain(words)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Prints and runs `cmd`, returning its exit status whatever it is.
pub fn status(cmd: &mut Command) -> Result<ExitStatus> {
    println!("$ {}", display(cmd));
    cmd.status()
        .with_context(|| format!("cannot run {}", cmd.get_program().to_string_lossy()))
}

/// Prints and runs `cmd`; a non-zero exit is an error.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = status(cmd)?;
    if !status.success() {
        bail!("{} failed: {status}", short_name(cmd));
    }
    Ok(())
}

/// Prints and runs `cmd`, capturing its stdout; a non-zero exit is an error.
pub fn output(cmd: &mut Command) -> Result<String> {
    println!("$ {}", display(cmd));
    let output = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", cmd.get_program().to_string_lossy()))?;
    if !output.status.success() {
        bail!("{} failed: {}", short_name(cmd), output.status);
    }
    String::from_utf8(output.stdout)
        .with_context(|| format!("{} printed invalid UTF-8", short_name(cmd)))
}

/// The exit code a shell would report for `status` (128 + signal for a killed process).
pub fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(1),
        (None, None) => 1,
    }
}

/// Whether `name` is an executable somewhere in PATH.
pub fn in_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| {
        std::fs::metadata(dir.join(name))
            .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_name_drops_options_and_paths() {
        let mut cmd = Command::new("/usr/bin/apt-get");
        cmd.args([
            "install",
            "-y",
            "--no-install-recommends",
            "rustc-web",
            "cargo-web",
        ]);
        assert_eq!(short_name(&cmd), "apt-get install rustc-web cargo-web");
        let mut cmd = Command::new("cargo");
        cmd.args(["test", "--workspace", "--", "--nocapture"]);
        assert_eq!(short_name(&cmd), "cargo test");
    }

    #[test]
    fn display_shows_env_and_quotes() {
        let mut cmd = Command::new("cargo");
        cmd.env("LLVM_PREFIX", "/x").args(["install", "a b"]);
        assert_eq!(display(&cmd), "LLVM_PREFIX=/x cargo install 'a b'");
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGINT)), 130);
    }
}
