//! Series labels for a process, above all `service_name`.
//!
//! `service_name` is decided in this order; the first rule that yields a non-empty name wins:
//!
//! 1. **Explicit configuration in the process's own environment**: `OTEL_SERVICE_NAME`, else
//!    `service.name` in `OTEL_RESOURCE_ATTRIBUTES` (OpenTelemetry's own precedence), else
//!    `PYROSCOPE_APPLICATION_NAME` with a Pyroscope-style `{tag=value,...}` suffix removed.
//! 2. **Where it runs**:
//!    - in a Kubernetes pod (a pod uid in its cgroup): `<namespace>/<container>` when both are
//!      known (stable across restarts and replicas, as Grafana Alloy names them), else the pod
//!      name, else `pod-<first 8 characters of the uid>` (sources: [`super::kubernetes`]);
//!    - in a container: the `HOSTNAME` environment variable, else the 12-character container id
//!      prefix (as `docker ps` shows it);
//!    - in a systemd service: the unit name without `.service` (`nginx.service` → `nginx`),
//!      except generic units that say nothing about the program (`user@*.service`,
//!      `session-*.scope`, `init.scope`).
//!
//!    A `HOSTNAME` equal to the agent's own host name is ignored: it is inherited from a host
//!    shell or a host-network container, not a pod or container name.
//! 3. **What it runs**: for interpreters, the script or module (`python3 -m uvicorn app:api` →
//!    `uvicorn`, `python3 /srv/app/main.py` → `main`, `node server.js` → `server`, likewise ruby,
//!    perl, php and shells; `java -jar foo.jar` → `foo`, a Java main class → its last dotted
//!    component); inline code (`python3 -c ...`, `node -e ...`, `bash -c ...`), stdin or a
//!    script read from a file descriptor (`bash <(...)` runs `/dev/fd/63`) gives the
//!    interpreter's name (of its executable: `dash` for `/bin/sh`). Otherwise the basename of the executable (for a program run from a
//!    memfd, which has no file name, argv[0]), else the process name (comm).
//!
//! Kernel threads are always `kernel`.
use std::collections::BTreeMap;

use super::{cgroup::CgroupInfo, kubernetes::KubernetesNames};
use crate::model::ProcessLabels;

/// `PF_KTHREAD` in the flags field of /proc/PID/stat.
pub const PF_KTHREAD: u64 = 0x0020_0000;

// Defined with the exec record, which keeps them from the exec event.
pub use crate::model::{LABEL_ENV_VARS, parse_environ};

/// The service name of kernel threads.
pub const KERNEL_SERVICE_NAME: &str = "kernel";

/// Everything labels are derived from, read from /proc by the caller.
#[derive(Clone, Debug)]
pub struct LabelInputs<'a> {
    /// /proc/PID/cmdline split at NUL.
    pub cmdline: &'a [String],
    /// The subset of the environment named in [`LABEL_ENV_VARS`].
    pub env: &'a BTreeMap<String, String>,
    /// The executable path as the process sees it (readlink /proc/PID/exe), if readable.
    pub exe: Option<&'a str>,
    /// The process name.
    pub comm: &'a str,
    pub cgroup: &'a CgroupInfo,
    /// Namespace, pod and container names (empty outside pods).
    pub kubernetes: &'a KubernetesNames,
    /// The agent's host name.
    pub host: &'a str,
    pub is_kernel_thread: bool,
}

/// A process is a kernel thread when the kernel says so (`PF_KTHREAD`). Only without its stat
/// flags is having neither a command line nor an executable taken as the sign: an exiting user
/// process has neither either.
pub fn is_kernel_thread(stat_flags: Option<u64>, cmdline_is_empty: bool, has_exe: bool) -> bool {
    match stat_flags {
        Some(flags) => flags & PF_KTHREAD != 0,
        None => cmdline_is_empty && !has_exe,
    }
}

/// Splits the NUL-separated /proc/PID/cmdline into arguments.
pub fn parse_cmdline(raw: &[u8]) -> Vec<String> {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    if raw.is_empty() {
        return Vec::new();
    }
    raw.split(|b| *b == 0)
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect()
}

/// Derives all labels of a process.
pub fn derive_labels(inputs: &LabelInputs<'_>) -> ProcessLabels {
    if inputs.is_kernel_thread {
        return ProcessLabels {
            service_name: KERNEL_SERVICE_NAME.to_owned(),
            executable: String::new(),
            ..ProcessLabels::default()
        };
    }
    ProcessLabels {
        service_name: service_name(inputs),
        executable: inputs.exe.unwrap_or_default().to_owned(),
        container_id: inputs.cgroup.container_id.clone(),
        pod_uid: inputs.cgroup.pod_uid.clone(),
        systemd_unit: inputs.cgroup.systemd_unit.clone(),
        namespace: inputs.kubernetes.namespace.clone(),
        pod: inputs.kubernetes.pod.clone(),
        container: inputs.kubernetes.container.clone(),
    }
}

/// The `service_name` label (see the module documentation for the precedence).
pub fn service_name(inputs: &LabelInputs<'_>) -> String {
    if inputs.is_kernel_thread {
        return KERNEL_SERVICE_NAME.to_owned();
    }
    configured_name(inputs.env)
        .or_else(|| placement_name(inputs))
        .or_else(|| program_name(inputs))
        .unwrap_or_else(|| inputs.comm.to_owned())
}

fn non_empty(value: &str) -> Option<&str> {
    let value = value.trim();
    (!value.is_empty()).then_some(value)
}

fn configured_name(env: &BTreeMap<String, String>) -> Option<String> {
    if let Some(name) = env.get("OTEL_SERVICE_NAME").and_then(|v| non_empty(v)) {
        return Some(name.to_owned());
    }
    if let Some(name) = env
        .get("OTEL_RESOURCE_ATTRIBUTES")
        .and_then(|attributes| resource_attribute(attributes, "service.name"))
    {
        return Some(name);
    }
    let pyroscope = env.get("PYROSCOPE_APPLICATION_NAME")?;
    // "app{env=prod,region=eu}" → "app"
    let name = match pyroscope.find('{') {
        Some(brace) if pyroscope.trim_end().ends_with('}') => &pyroscope[..brace],
        _ => pyroscope.as_str(),
    };
    non_empty(name).map(str::to_owned)
}

/// The value of `key` in an `OTEL_RESOURCE_ATTRIBUTES` list (`k1=v1,k2=v2`, values
/// percent-encoded); the last occurrence wins, as in the OpenTelemetry SDKs.
fn resource_attribute(attributes: &str, key: &str) -> Option<String> {
    let value = attributes
        .split(',')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim())
        .next_back()?;
    non_empty(&percent_decode(value)).map(str::to_owned)
}

/// `%XX` escapes decoded; an invalid escape or a non-UTF-8 result is kept as written.
pub(crate) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 3;
            }
            (byte, _, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| text.to_owned())
}

fn placement_name(inputs: &LabelInputs<'_>) -> Option<String> {
    let own_hostname = inputs
        .env
        .get("HOSTNAME")
        .and_then(|h| non_empty(h))
        .filter(|h| *h != inputs.host);
    let cgroup = inputs.cgroup;
    if let Some(uid) = &cgroup.pod_uid {
        let kubernetes = inputs.kubernetes;
        if let (Some(namespace), Some(container)) = (&kubernetes.namespace, &kubernetes.container) {
            return Some(format!("{namespace}/{container}"));
        }
        return Some(match kubernetes.pod.as_deref().or(own_hostname) {
            Some(pod_name) => pod_name.to_owned(),
            None => format!("pod-{}", prefix(uid, 8)),
        });
    }
    if let Some(id) = &cgroup.container_id {
        return Some(match own_hostname {
            Some(name) => name.to_owned(),
            None => prefix(id, 12).to_owned(),
        });
    }
    let unit = cgroup.systemd_unit.as_deref()?;
    if is_generic_unit(unit) {
        return None;
    }
    non_empty(unit.strip_suffix(".service").unwrap_or(unit)).map(str::to_owned)
}

fn prefix(text: &str, chars: usize) -> &str {
    text.char_indices()
        .nth(chars)
        .map_or(text, |(end, _)| &text[..end])
}

/// Units shared by unrelated programs, which would lump them into one service.
fn is_generic_unit(unit: &str) -> bool {
    unit.starts_with("user@")
        || unit.starts_with("session-")
        || unit.starts_with("user-runtime-dir@")
        || unit == "init.scope"
}

fn basename(path: &str) -> &str {
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    let path = path.trim_end_matches('/');
    path.rsplit('/').next().unwrap_or(path)
}

fn strip_extension<'a>(name: &'a str, extensions: &[&str]) -> &'a str {
    extensions
        .iter()
        .find_map(|ext| name.strip_suffix(ext).filter(|stem| !stem.is_empty()))
        .unwrap_or(name)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Interpreter {
    Python,
    Node,
    Ruby,
    Perl,
    Php,
    Shell,
    Java,
}

/// `name` is `base` optionally followed by a version like `3`, `3.12`, `5.36.0`.
fn is_versioned(name: &str, base: &str) -> bool {
    name.strip_prefix(base)
        .is_some_and(|version| version.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
}

fn interpreter_of(name: &str) -> Option<Interpreter> {
    Some(match name {
        _ if is_versioned(name, "python") || is_versioned(name, "pypy") => Interpreter::Python,
        "node" | "nodejs" => Interpreter::Node,
        _ if is_versioned(name, "ruby") => Interpreter::Ruby,
        _ if is_versioned(name, "perl") => Interpreter::Perl,
        _ if is_versioned(name, "php") => Interpreter::Php,
        "sh" | "bash" | "dash" | "zsh" | "ksh" | "ash" => Interpreter::Shell,
        "java" => Interpreter::Java,
        _ => return None,
    })
}

/// What an interpreter runs, per its command-line conventions.
enum Runs<'a> {
    /// A script file.
    Script(&'a str),
    /// A module or class given by name (`python -m`, java main class).
    Named(&'a str),
    /// Inline code, stdin, or nothing recognizable: name the interpreter itself.
    Itself,
}

/// How an interpreter's options are spelled.
struct OptionRules {
    /// Options whose argument is the next word (when not attached, like `-Xdev`).
    takes_argument: &'static [&'static str],
    /// Options that mean the program is given inline (`-c`, `-e`).
    inline_code: &'static [&'static str],
    /// Options whose argument names the module to run (`-m`).
    module: &'static [&'static str],
    /// Options whose argument is the script file (`php -f file`).
    script: &'static [&'static str],
}

fn rules(interpreter: Interpreter) -> OptionRules {
    match interpreter {
        Interpreter::Python => OptionRules {
            takes_argument: &["-X", "-W", "-Q", "--check-hash-based-pycs"],
            inline_code: &["-c"],
            module: &["-m"],
            script: &[],
        },
        Interpreter::Node => OptionRules {
            takes_argument: &[
                "-r",
                "--require",
                "--import",
                "--loader",
                "--experimental-loader",
                "--env-file",
                "--title",
                "--conditions",
                "-C",
            ],
            inline_code: &["-e", "--eval", "-p", "--print"],
            module: &[],
            script: &[],
        },
        Interpreter::Ruby => OptionRules {
            takes_argument: &["-I", "-r", "-C", "-E", "--encoding"],
            inline_code: &["-e"],
            module: &[],
            script: &[],
        },
        Interpreter::Perl => OptionRules {
            takes_argument: &["-I", "-M", "-m", "-C"],
            inline_code: &["-e", "-E"],
            module: &[],
            script: &[],
        },
        Interpreter::Php => OptionRules {
            takes_argument: &["-c", "-d", "-z", "-t", "-S"],
            inline_code: &["-r", "-R", "-B", "-E"],
            module: &[],
            script: &["-f"],
        },
        Interpreter::Shell => OptionRules {
            takes_argument: &["-o", "+o", "-O", "+O", "--rcfile", "--init-file"],
            inline_code: &["-c"],
            module: &[],
            script: &[],
        },
        Interpreter::Java => OptionRules {
            takes_argument: &[
                "-cp",
                "-classpath",
                "--class-path",
                "-p",
                "--module-path",
                "--upgrade-module-path",
                "--add-modules",
                "--add-opens",
                "--add-exports",
                "--add-reads",
                "--enable-native-access",
                "--limit-modules",
            ],
            inline_code: &[],
            module: &["-m", "--module"],
            script: &["-jar"],
        },
    }
}

fn what_it_runs(interpreter: Interpreter, args: &[String]) -> Runs<'_> {
    let rules = rules(interpreter);
    let mut args = args.iter().map(String::as_str);
    while let Some(arg) = args.next() {
        if arg == "--" {
            return args.next().map_or(Runs::Itself, Runs::Script);
        }
        if arg == "-" || (!arg.starts_with('-') && !arg.starts_with('+')) {
            return if arg == "-" || is_file_descriptor(arg) {
                Runs::Itself
            } else {
                Runs::Script(arg)
            };
        }
        // `--module=foo.Main`, `-mmodule`: an attached argument.
        let (option, attached) = match arg.split_once('=') {
            Some((option, value)) if arg.starts_with("--") => (option, Some(value)),
            _ => (arg, None),
        };
        if rules.inline_code.contains(&option) {
            return Runs::Itself;
        }
        if rules.module.contains(&option) {
            return attached
                .or_else(|| args.next())
                .map_or(Runs::Itself, Runs::Named);
        }
        if rules.script.contains(&option) {
            return attached
                .or_else(|| args.next())
                .map_or(Runs::Itself, Runs::Script);
        }
        if rules.takes_argument.contains(&option) {
            if attached.is_none() {
                args.next();
            }
            continue;
        }
        // Single-dash short options with the argument attached: `-mhttp.server`, `-cprint(1)`.
        if !arg.starts_with("--") && arg.len() > 2 && arg.is_char_boundary(2) {
            let (short, rest) = arg.split_at(2);
            if rules.module.contains(&short) && interpreter != Interpreter::Java {
                return Runs::Named(rest);
            }
            if rules.inline_code.contains(&short) {
                return Runs::Itself;
            }
        }
        // Any other option (flags, `-Dkey=value`, `-Xmx1g`, `-u`, `-XX:+UseG1GC`) is skipped.
    }
    Runs::Itself
}

/// A script path that names an open file descriptor, not a file: `bash <(...)` runs
/// `/dev/fd/63`, `python3 /dev/stdin`.
fn is_file_descriptor(path: &str) -> bool {
    let fd_number = |rest: &str| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit());
    path.strip_prefix("/dev/fd/").is_some_and(fd_number)
        || matches!(path, "/dev/stdin" | "/proc/self/fd/0")
        || path
            .strip_prefix("/proc/")
            .and_then(|rest| rest.split_once("/fd/"))
            .is_some_and(|(_, fd)| fd_number(fd))
}

fn program_name(inputs: &LabelInputs<'_>) -> Option<String> {
    let exe_name = inputs.exe.map(basename).and_then(non_empty);
    // A program run from a memfd (runc and sandboxes re-exec themselves that way) has no file
    // name (`/memfd:NAME (deleted)`, where NAME may contain slashes); argv[0] names it.
    if inputs
        .exe
        .is_some_and(|exe| exe.trim_start_matches('/').starts_with("memfd:"))
    {
        let argv0 = inputs.cmdline.first().map(|a| basename(a));
        return argv0
            .and_then(non_empty)
            .or_else(|| non_empty(inputs.comm))
            .map(str::to_owned);
    }
    let argv0_name = inputs
        .cmdline
        .first()
        .map(|a| basename(a))
        .and_then(non_empty);
    // The executable is authoritative; argv[0] covers an unreadable exe link.
    let interpreter = exe_name
        .and_then(interpreter_of)
        .or_else(|| argv0_name.and_then(interpreter_of));
    if let Some(interpreter) = interpreter {
        let interpreter_name = exe_name.or(argv0_name).unwrap_or(inputs.comm);
        let args = inputs.cmdline.get(1..).unwrap_or_default();
        let name = match what_it_runs(interpreter, args) {
            Runs::Script(path) => script_name(interpreter, path),
            Runs::Named(name) if interpreter == Interpreter::Java => {
                // `module/com.example.Main` → `Main`
                let class = name.rsplit('/').next().unwrap_or(name);
                class.rsplit('.').next().unwrap_or(class)
            }
            Runs::Named(module) => module,
            Runs::Itself => interpreter_name,
        };
        if let Some(name) = non_empty(name) {
            return Some(name.to_owned());
        }
    }
    exe_name
        .or_else(|| non_empty(inputs.comm))
        .map(str::to_owned)
}

fn script_name(interpreter: Interpreter, path: &str) -> &str {
    let file = basename(path);
    match interpreter {
        Interpreter::Python => strip_extension(file, &[".pyc", ".pyz", ".py"]),
        Interpreter::Node => strip_extension(file, &[".mjs", ".cjs", ".js", ".ts"]),
        Interpreter::Ruby => strip_extension(file, &[".rb"]),
        Interpreter::Perl => strip_extension(file, &[".pl"]),
        Interpreter::Php => strip_extension(file, &[".php"]),
        Interpreter::Shell => strip_extension(file, &[".sh", ".bash"]),
        // A jar file, or a main class given without options (`java com.example.Main`).
        Interpreter::Java => match file.strip_suffix(".jar") {
            Some(stem) if !stem.is_empty() => stem,
            _ => file.rsplit('.').next().unwrap_or(file),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// The service name of a host process (no container, no unit) running `cmdline`.
    fn program(exe: &str, cmdline: &str) -> String {
        let cmdline = args(cmdline);
        let env = BTreeMap::new();
        let cgroup = CgroupInfo::default();
        service_name(&LabelInputs {
            cmdline: &cmdline,
            env: &env,
            exe: Some(exe),
            comm: "comm",
            cgroup: &cgroup,
            kubernetes: &KubernetesNames::default(),
            host: "node-1",
            is_kernel_thread: false,
        })
    }

    const ID: &str = "4d3c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c";
    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

    #[test]
    fn environment_beats_everything() {
        let cmdline = args("python3 train.py");
        let cgroup = CgroupInfo {
            container_id: Some(ID.to_owned()),
            pod_uid: Some(UID.to_owned()),
            systemd_unit: Some("nginx.service".to_owned()),
            path: None,
        };
        let mut environment = env(&[
            ("OTEL_SERVICE_NAME", "checkout"),
            ("PYROSCOPE_APPLICATION_NAME", "pyro{env=prod}"),
            ("HOSTNAME", "web-7d9f"),
        ]);
        let name = |environment: &BTreeMap<String, String>| {
            service_name(&LabelInputs {
                cmdline: &cmdline,
                env: environment,
                exe: Some("/usr/bin/python3.11"),
                comm: "python3",
                cgroup: &cgroup,
                kubernetes: &KubernetesNames::default(),
                host: "node-1",
                is_kernel_thread: false,
            })
        };
        assert_eq!(name(&environment), "checkout");
        environment.insert("OTEL_SERVICE_NAME".into(), "  ".into());
        environment.insert(
            "OTEL_RESOURCE_ATTRIBUTES".into(),
            "deployment.environment=prod,service.name=cart%20api, team=x".into(),
        );
        assert_eq!(name(&environment), "cart api", "percent-decoded");
        environment.insert(
            "OTEL_RESOURCE_ATTRIBUTES".into(),
            "service.name=a,service.name=b".into(),
        );
        assert_eq!(name(&environment), "b", "the last one wins");
        environment.insert(
            "OTEL_RESOURCE_ATTRIBUTES".into(),
            "service.name=,x=%zz".into(),
        );
        assert_eq!(
            name(&environment),
            "pyro",
            "an empty service.name is no name"
        );
        environment.remove("OTEL_RESOURCE_ATTRIBUTES");
        assert_eq!(name(&environment), "pyro");
        environment.insert("PYROSCOPE_APPLICATION_NAME".into(), "plain.cpu".into());
        assert_eq!(name(&environment), "plain.cpu");
        environment.remove("PYROSCOPE_APPLICATION_NAME");
        // Pod name from HOSTNAME.
        assert_eq!(name(&environment), "web-7d9f");
    }

    #[test]
    fn placement_rules() {
        let cmdline = args("/app/server --port 80");
        let check = |cgroup: CgroupInfo, environment: &[(&str, &str)], expected: &str| {
            let environment = env(environment);
            let got = service_name(&LabelInputs {
                cmdline: &cmdline,
                env: &environment,
                exe: Some("/app/server"),
                comm: "server",
                cgroup: &cgroup,
                kubernetes: &KubernetesNames::default(),
                host: "node-1",
                is_kernel_thread: false,
            });
            assert_eq!(got, expected, "{cgroup:?} {environment:?}");
        };
        let pod = CgroupInfo {
            container_id: Some(ID.to_owned()),
            pod_uid: Some(UID.to_owned()),
            ..CgroupInfo::default()
        };
        check(
            pod.clone(),
            &[("HOSTNAME", "checkout-5f7c9")],
            "checkout-5f7c9",
        );
        check(pod.clone(), &[], "pod-0f1e2d3c");
        // hostNetwork pods inherit the node's name: not a pod name.
        check(pod, &[("HOSTNAME", "node-1")], "pod-0f1e2d3c");

        let container = CgroupInfo {
            container_id: Some(ID.to_owned()),
            ..CgroupInfo::default()
        };
        check(
            container.clone(),
            &[("HOSTNAME", "redis-cache")],
            "redis-cache",
        );
        check(container.clone(), &[], "4d3c8b7a6f5e");
        check(container, &[("HOSTNAME", "node-1")], "4d3c8b7a6f5e");

        let unit = |name: &str| CgroupInfo {
            systemd_unit: Some(name.to_owned()),
            ..CgroupInfo::default()
        };
        check(unit("nginx.service"), &[], "nginx");
        check(
            unit("postgresql@15-main.service"),
            &[],
            "postgresql@15-main",
        );
        // Generic units fall through to the program.
        check(unit("user@0.service"), &[], "server");
        check(
            unit("user@1000.service"),
            &[("HOSTNAME", "laptop")],
            "server",
        );
        check(CgroupInfo::default(), &[("HOSTNAME", "laptop")], "server");
    }

    #[test]
    fn the_kubernetes_variables_are_kept() {
        for name in super::super::kubernetes::KUBERNETES_ENV_VARS {
            assert!(LABEL_ENV_VARS.contains(name), "{name}");
        }
        let kept = parse_environ(b"POD_NAME=web-0\0POD_NAMESPACE=shop\0CONTAINER_NAME=app\0X=1");
        assert_eq!(kept.len(), 3);
    }

    #[test]
    fn kubernetes_names_become_labels_and_the_service_name() {
        let cmdline = args("/app/server");
        let environment = env(&[("HOSTNAME", "trainer-7f9c-abcde")]);
        let pod = CgroupInfo {
            container_id: Some(ID.to_owned()),
            pod_uid: Some(UID.to_owned()),
            ..CgroupInfo::default()
        };
        let some = |v: &str| Some(v.to_owned());
        let full = KubernetesNames {
            namespace: some("ml"),
            pod: some("trainer-7f9c-abcde"),
            container: some("trainer"),
        };
        let labels_with = |kubernetes: &KubernetesNames| {
            derive_labels(&LabelInputs {
                cmdline: &cmdline,
                env: &environment,
                exe: Some("/app/server"),
                comm: "server",
                cgroup: &pod,
                kubernetes,
                host: "node-1",
                is_kernel_thread: false,
            })
        };
        let labels = labels_with(&full);
        // Stable across replicas and restarts, unlike the pod name.
        assert_eq!(labels.service_name, "ml/trainer");
        assert_eq!(labels.namespace.as_deref(), Some("ml"));
        assert_eq!(labels.pod.as_deref(), Some("trainer-7f9c-abcde"));
        assert_eq!(labels.container.as_deref(), Some("trainer"));
        assert_eq!(labels.pod_uid.as_deref(), Some(UID));
        // Without the container name: the pod name.
        let no_container = KubernetesNames {
            container: None,
            pod: some("trainer-0"),
            ..full.clone()
        };
        assert_eq!(labels_with(&no_container).service_name, "trainer-0");
        assert_eq!(
            labels_with(&KubernetesNames::default()).service_name,
            "trainer-7f9c-abcde"
        );
    }

    #[test]
    fn python_programs() {
        assert_eq!(
            program("/usr/bin/python3.11", "python3 -m uvicorn app:api"),
            "uvicorn"
        );
        assert_eq!(program("/usr/bin/python3.11", "python3 train.py"), "train");
        // Executables without a file: argv[0], else the memfd's own name.
        assert_eq!(
            program(
                "/memfd:sealed-91173221a7ea (deleted)",
                "tools/binary_backend --uid 0"
            ),
            "binary_backend"
        );
        assert_eq!(
            program("/memfd:runc_cloned:/proc/self/exe (deleted)", "runc init"),
            "runc"
        );
        assert_eq!(
            program("/memfd:runc_cloned:/proc/self/exe (deleted)", ""),
            "comm"
        );
        assert_eq!(
            program("/usr/bin/python3.11", "python3 /srv/app/main.py --x 1"),
            "main"
        );
        assert_eq!(
            program("/usr/bin/python3", "python -u -X dev app.py"),
            "app"
        );
        assert_eq!(
            program("/usr/bin/python3", "python -W ignore -Xdev app.py"),
            "app"
        );
        assert_eq!(
            program("/usr/bin/python3", "python -mhttp.server"),
            "http.server"
        );
        assert_eq!(
            program("/usr/bin/python3.11", "python3 -c print(1)"),
            "python3.11"
        );
        assert_eq!(program("/usr/bin/python3.11", "python3"), "python3.11");
        assert_eq!(
            program("/usr/bin/python3.11", "python3 - < x"),
            "python3.11"
        );
        assert_eq!(program("/usr/bin/python3.11", "python3 -- run.py"), "run");
        // A script read from a file descriptor is no name: the interpreter is.
        assert_eq!(program("/usr/bin/bash", "bash /dev/fd/63"), "bash");
        assert_eq!(
            program("/usr/bin/bash", "bash -x /proc/self/fd/3 arg"),
            "bash"
        );
        assert_eq!(
            program("/usr/bin/python3.11", "python3 /dev/stdin"),
            "python3.11"
        );
        assert_eq!(
            program("/usr/bin/bash", "bash /dev/fdx/3"),
            "3",
            "not a descriptor path"
        );
        // Console scripts: the interpreter runs the wrapper script.
        assert_eq!(
            program(
                "/usr/bin/python3.11",
                "/usr/bin/python3 /usr/local/bin/gunicorn app:app"
            ),
            "gunicorn"
        );
        // exe unreadable: argv[0] identifies the interpreter.
        let cmdline = args("/opt/py/bin/python3.12 job.py");
        let environment = BTreeMap::new();
        let cgroup = CgroupInfo::default();
        let inputs = LabelInputs {
            cmdline: &cmdline,
            env: &environment,
            exe: None,
            comm: "python3.12",
            cgroup: &cgroup,
            kubernetes: &KubernetesNames::default(),
            host: "h",
            is_kernel_thread: false,
        };
        assert_eq!(service_name(&inputs), "job");
    }

    #[test]
    fn other_interpreters() {
        assert_eq!(program("/usr/bin/node", "node script.js"), "script");
        assert_eq!(
            program(
                "/usr/bin/node",
                "node --inspect=9229 -r dotenv/config srv.mjs"
            ),
            "srv"
        );
        assert_eq!(program("/usr/bin/node", "node -e 1"), "node");
        assert_eq!(
            program("/usr/bin/ruby3.1", "ruby -I lib bin/rails.rb"),
            "rails"
        );
        assert_eq!(
            program("/usr/bin/perl", "perl -w /usr/sbin/tool.pl"),
            "tool"
        );
        assert_eq!(
            program("/usr/bin/php8.2", "php -d x=1 artisan.php"),
            "artisan"
        );
        assert_eq!(program("/usr/bin/php8.2", "php -f /srv/cron.php"), "cron");
        assert_eq!(program("/usr/bin/bash", "bash /opt/backup.sh"), "backup");
        assert_eq!(program("/usr/bin/dash", "sh -e deploy"), "deploy");
        assert_eq!(program("/usr/bin/bash", "bash -c sleep"), "bash");
        assert_eq!(
            program(
                "/usr/lib/jvm/bin/java",
                "java -Xmx1g -Dx=y -jar /srv/foo.jar --port 1"
            ),
            "foo"
        );
        assert_eq!(
            program(
                "/usr/lib/jvm/bin/java",
                "java -cp /a.jar:/b.jar -XX:+UseG1GC org.apache.catalina.startup.Bootstrap start"
            ),
            "Bootstrap"
        );
        assert_eq!(
            program(
                "/usr/bin/java",
                "java --module-path mods -m app.mod/com.example.Main"
            ),
            "Main"
        );
        assert_eq!(program("/usr/bin/java", "java -version"), "java");
    }

    #[test]
    fn plain_programs_and_fallbacks() {
        assert_eq!(
            program("/usr/sbin/nginx", "nginx: master process /usr/sbin/nginx"),
            "nginx"
        );
        assert_eq!(program("/tmp/x/sleep (deleted)", "sleep 30"), "sleep");
        // Neither exe nor cmdline: comm.
        let environment = BTreeMap::new();
        let cgroup = CgroupInfo::default();
        let inputs = LabelInputs {
            cmdline: &[],
            env: &environment,
            exe: None,
            comm: "worker",
            cgroup: &cgroup,
            kubernetes: &KubernetesNames::default(),
            host: "h",
            is_kernel_thread: false,
        };
        assert_eq!(service_name(&inputs), "worker");
        let kernel = LabelInputs {
            is_kernel_thread: true,
            ..inputs.clone()
        };
        let labels = derive_labels(&kernel);
        assert_eq!(labels.service_name, "kernel");
        assert_eq!(labels.executable, "");
    }

    #[test]
    fn kernel_thread_detection() {
        assert!(is_kernel_thread(Some(0x0020_8040), false, false));
        assert!(!is_kernel_thread(Some(0x0040_0100), false, true));
        assert!(is_kernel_thread(None, true, false));
        assert!(!is_kernel_thread(None, true, true));
        // With the flags known they decide: an exiting user process has no command line and
        // no executable either.
        assert!(!is_kernel_thread(Some(0x0040_0104), true, false));
    }

    #[test]
    fn environ_and_cmdline_parsing() {
        let environ = b"PATH=/bin\0OTEL_SERVICE_NAME=a=b\0HOSTNAME=web\0garbage\0\xff=\x00";
        let parsed = parse_environ(environ);
        assert_eq!(
            parsed.get("OTEL_SERVICE_NAME").map(String::as_str),
            Some("a=b")
        );
        assert_eq!(parsed.get("HOSTNAME").map(String::as_str), Some("web"));
        assert_eq!(parsed.len(), 2);
        assert_eq!(
            parse_cmdline(b"python3\0-c\0\0x\0"),
            vec!["python3", "-c", "", "x"]
        );
        assert!(parse_cmdline(b"").is_empty());
    }

    /// A label variable is found by its whole name at the start of a variable, wherever it is
    /// (first, last, between others), and one set twice has its last value (Python's
    /// `os.environ`); a name that is part of another variable's name or value is not it.
    #[test]
    fn label_variables_are_found_by_their_whole_name_and_the_last_value_wins() {
        let environ = b"HOSTNAME=first\0MYHOSTNAME=no\0POD_NAMESPACE=ns\0X=\0POD_NAME=\0\
            HOSTNAME=second\0CARGO=x HOSTNAME=no\0CONTAINER_NAME=c";
        let parsed = parse_environ(environ);
        let get = |name: &str| parsed.get(name).map(String::as_str);
        assert_eq!(get("HOSTNAME"), Some("second"));
        assert_eq!(get("POD_NAMESPACE"), Some("ns"));
        assert_eq!(get("POD_NAME"), Some(""));
        assert_eq!(
            get("CONTAINER_NAME"),
            Some("c"),
            "the last variable, no NUL after"
        );
        assert_eq!(parsed.len(), 4);
        let at_start = parse_environ(b"OTEL_SERVICE_NAME=svc\0PATH=/bin\0");
        assert_eq!(
            at_start.get("OTEL_SERVICE_NAME").map(String::as_str),
            Some("svc")
        );
        assert_eq!(at_start.len(), 1);
        assert!(parse_environ(b"OTEL_SERVICE_NAMEX=1\0OTEL_SERVICE_NAME").is_empty());
        assert!(parse_environ(b"").is_empty());
    }
}
