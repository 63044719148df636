//! Kubernetes namespace, pod and container names of a process, without asking the kubelet or the
//! API server.
//!
//! Only processes whose cgroup names a pod uid are looked at. Each field takes the first source
//! that gives a valid Kubernetes name:
//!
//! 1. **The container runtime's OCI bundle** on the host (read through `/proc/1/root`, the host's
//!    root when the agent shares the host's PID namespace): the annotations the kubelet passes to
//!    containerd (`/run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json`,
//!    `io.kubernetes.cri.{sandbox-namespace,sandbox-name,container-name}`) or CRI-O
//!    (`/run/containers/storage/overlay-containers/<id>/userdata/config.json`,
//!    `io.kubernetes.{pod.namespace,pod.name,container.name}`). Exact for all three.
//! 2. **The downward API**, when the pod spec exports it: `POD_NAMESPACE`, `POD_NAME` (and a
//!    `CONTAINER_NAME` some charts set) in the process's environment.
//! 3. **What every pod has**: the namespace from the mounted service-account token
//!    (`/proc/PID/root/var/run/secrets/kubernetes.io/serviceaccount/namespace`, absent with
//!    `automountServiceAccountToken: false`), and the pod name from the `HOSTNAME` variable or
//!    `/proc/PID/root/etc/hostname` (the kubelet sets the hostname to the pod name, except with
//!    `spec.hostname`, host networking, which gives the node's name and is ignored, or names longer
//!    than 63 characters, which are truncated).
use std::{
    collections::BTreeMap,
    fs::File,
    io::Read,
    path::{Path, PathBuf},
};

/// Labels of a process in a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubernetesNames {
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
}

impl KubernetesNames {
    /// Fills the fields still empty from `other`.
    fn or(self, other: KubernetesNames) -> KubernetesNames {
        KubernetesNames {
            namespace: self.namespace.or(other.namespace),
            pod: self.pod.or(other.pod),
            container: self.container.or(other.container),
        }
    }
}

/// The environment variables this module reads (the downward API's usual names).
pub const KUBERNETES_ENV_VARS: &[&str] = &["POD_NAMESPACE", "POD_NAME", "CONTAINER_NAME"];

/// OCI bundle config of a container, relative to the host's root, per runtime.
const RUNTIME_CONFIGS: &[&str] = &[
    "run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "run/containers/storage/overlay-containers/{id}/userdata/config.json",
];
/// Annotation names for (namespace, pod, container): containerd's, then CRI-O's.
const ANNOTATIONS: &[[&str; 3]] = &[
    [
        "io.kubernetes.cri.sandbox-namespace",
        "io.kubernetes.cri.sandbox-name",
        "io.kubernetes.cri.container-name",
    ],
    [
        "io.kubernetes.pod.namespace",
        "io.kubernetes.pod.name",
        "io.kubernetes.container.name",
    ],
];
/// An OCI config is a few KiB to a few hundred; anything larger is not read.
const MAX_CONFIG_BYTES: u64 = 4 << 20;
const SERVICE_ACCOUNT_NAMESPACE: &str = "var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// Everything the names are derived from; files are found under these directories.
#[derive(Clone, Copy, Debug)]
pub struct KubernetesSources<'a> {
    /// /proc/PID; `None` for a process known only from its exec event (gone, or its pid
    /// perhaps another process's by now): what its files would say is not known.
    pub process_dir: Option<&'a Path>,
    /// The host's root directory (/proc/1/root).
    pub host_root: &'a Path,
    pub container_id: Option<&'a str>,
    /// The process's environment, at least [`KUBERNETES_ENV_VARS`] and `HOSTNAME`.
    pub env: &'a BTreeMap<String, String>,
    /// The agent's host name: a pod hostname equal to it is the node's, not a pod name.
    pub host: &'a str,
}

/// The names of a process that runs in a pod (call only when its cgroup has a pod uid).
pub fn kubernetes_names(sources: &KubernetesSources<'_>) -> KubernetesNames {
    let runtime = sources
        .container_id
        .and_then(|id| runtime_names(sources.host_root, id))
        .unwrap_or_default();
    let env = |name: &str| sources.env.get(name).and_then(|v| valid_name(v));
    let downward = KubernetesNames {
        namespace: env("POD_NAMESPACE"),
        pod: env("POD_NAME"),
        container: env("CONTAINER_NAME"),
    };
    let not_the_node = |name: String| (name != sources.host).then_some(name);
    let pod_root = sources.process_dir.map(|dir| dir.join("root"));
    let pod_file = |path: &str| {
        let text = read_small(&pod_root.as_ref()?.join(path))?;
        valid_name(&text)
    };
    let fallback = KubernetesNames {
        namespace: pod_file(SERVICE_ACCOUNT_NAMESPACE),
        pod: env("HOSTNAME")
            .and_then(not_the_node)
            .or_else(|| pod_file("etc/hostname").and_then(not_the_node)),
        container: None,
    };
    runtime.or(downward).or(fallback)
}

/// The names in the runtime's OCI config of `container_id`, if one is found.
pub fn runtime_names(host_root: &Path, container_id: &str) -> Option<KubernetesNames> {
    if !container_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    RUNTIME_CONFIGS.iter().find_map(|template| {
        let path: PathBuf = host_root.join(template.replace("{id}", container_id));
        let mut text = Vec::new();
        File::open(&path)
            .ok()?
            .take(MAX_CONFIG_BYTES)
            .read_to_end(&mut text)
            .ok()?;
        names_from_oci_config(&text)
    })
}

/// The names in an OCI runtime config's annotations; `None` if it is not JSON or has none.
pub fn names_from_oci_config(json: &[u8]) -> Option<KubernetesNames> {
    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(default)]
        annotations: BTreeMap<String, String>,
    }
    let config: Config = serde_json::from_slice(json).ok()?;
    let names = ANNOTATIONS
        .iter()
        .map(|[namespace, pod, container]| {
            let get = |key: &str| config.annotations.get(key).and_then(|v| valid_name(v));
            KubernetesNames {
                namespace: get(namespace),
                pod: get(pod),
                container: get(container),
            }
        })
        .fold(KubernetesNames::default(), KubernetesNames::or);
    (names != KubernetesNames::default()).then_some(names)
}

/// The first line of a small file (names, hostnames).
fn read_small(path: &Path) -> Option<String> {
    let mut text = String::new();
    File::open(path)
        .ok()?
        .take(512)
        .read_to_string(&mut text)
        .ok()?;
    text.lines().next().map(str::to_owned)
}

/// A Kubernetes object name (RFC 1123 subdomain: lower-case alphanumerics, `-` and `.`, at most
/// 253 characters), trimmed; anything else is not taken for one.
fn valid_name(value: &str) -> Option<String> {
    let value = value.trim();
    let valid = !value.is_empty()
        && value.len() <= 253
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && value.as_bytes()[0].is_ascii_alphanumeric()
        && value.as_bytes()[value.len() - 1].is_ascii_alphanumeric();
    valid.then(|| value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4d3c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c";

    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            for sub in ["proc/42/root", "host"] {
                std::fs::create_dir_all(dir.path().join(sub)).unwrap();
            }
            Fixture { dir }
        }
        fn write(&self, relative: &str, text: &str) {
            let path = self.dir.path().join(relative);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        fn names(&self, env: &[(&str, &str)], container_id: Option<&str>) -> KubernetesNames {
            let env: BTreeMap<String, String> = env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            kubernetes_names(&KubernetesSources {
                process_dir: Some(&self.dir.path().join("proc/42")),
                host_root: &self.dir.path().join("host"),
                container_id,
                env: &env,
                host: "node-1",
            })
        }
    }

    fn names(namespace: &str, pod: &str, container: &str) -> KubernetesNames {
        let some = |v: &str| (!v.is_empty()).then(|| v.to_owned());
        KubernetesNames {
            namespace: some(namespace),
            pod: some(pod),
            container: some(container),
        }
    }

    #[test]
    fn containerd_annotations_win() {
        let fixture = Fixture::new();
        fixture.write(
            &format!("host/run/containerd/io.containerd.runtime.v2.task/k8s.io/{ID}/config.json"),
            r#"{"ociVersion":"1.2.0","process":{"env":["X=1"]},"annotations":{
                "io.kubernetes.cri.container-type":"container",
                "io.kubernetes.cri.container-name":"trainer",
                "io.kubernetes.cri.sandbox-name":"llama-train-7f9c-abcde",
                "io.kubernetes.cri.sandbox-namespace":"ml"}}"#,
        );
        fixture.write("proc/42/root/etc/hostname", "other-name\n");
        let found = fixture.names(&[("POD_NAMESPACE", "wrong"), ("HOSTNAME", "x")], Some(ID));
        assert_eq!(found, names("ml", "llama-train-7f9c-abcde", "trainer"));
    }

    #[test]
    fn crio_annotations() {
        let fixture = Fixture::new();
        fixture.write(
            &format!("host/run/containers/storage/overlay-containers/{ID}/userdata/config.json"),
            r#"{"annotations":{"io.kubernetes.pod.namespace":"kube-system",
                "io.kubernetes.pod.name":"coredns-5d78c9869d-6xq2k",
                "io.kubernetes.container.name":"coredns"}}"#,
        );
        assert_eq!(
            fixture.names(&[], Some(ID)),
            names("kube-system", "coredns-5d78c9869d-6xq2k", "coredns")
        );
    }

    #[test]
    fn downward_api_then_pod_files() {
        let fixture = Fixture::new();
        // No runtime config: the environment from the downward API.
        assert_eq!(
            fixture.names(
                &[
                    ("POD_NAMESPACE", "ml"),
                    ("POD_NAME", "worker-0"),
                    ("CONTAINER_NAME", "main")
                ],
                Some(ID)
            ),
            names("ml", "worker-0", "main")
        );
        // Nothing exported: the service-account namespace and the hostname.
        fixture.write(
            "proc/42/root/var/run/secrets/kubernetes.io/serviceaccount/namespace",
            "batch",
        );
        fixture.write("proc/42/root/etc/hostname", "job-x7k2p\n");
        assert_eq!(
            fixture.names(&[], Some(ID)),
            names("batch", "job-x7k2p", "")
        );
        // HOSTNAME comes before /etc/hostname; the node's own name is no pod name.
        assert_eq!(
            fixture.names(&[("HOSTNAME", "web-1")], None).pod.as_deref(),
            Some("web-1")
        );
        fixture.write("proc/42/root/etc/hostname", "node-1\n");
        assert_eq!(fixture.names(&[("HOSTNAME", "node-1")], None).pod, None);
    }

    #[test]
    fn invalid_values_are_not_names() {
        let fixture = Fixture::new();
        fixture.write(
            "proc/42/root/var/run/secrets/kubernetes.io/serviceaccount/namespace",
            "Not A Namespace",
        );
        let found = fixture.names(
            &[
                ("POD_NAME", "UPPER"),
                ("CONTAINER_NAME", "-dash"),
                ("HOSTNAME", ""),
            ],
            Some("../../etc"),
        );
        assert_eq!(found, KubernetesNames::default());
        assert_eq!(valid_name(&"a".repeat(254)), None);
        assert_eq!(valid_name(" ok.name-1\n").as_deref(), Some("ok.name-1"));
    }

    #[test]
    fn malformed_runtime_configs_are_ignored() {
        for text in [
            "",
            "not json",
            "[]",
            r#"{"annotations":{}}"#,
            r#"{"annotations":3}"#,
        ] {
            assert_eq!(names_from_oci_config(text.as_bytes()), None, "{text}");
        }
        let fixture = Fixture::new();
        fixture.write(
            &format!("host/run/containerd/io.containerd.runtime.v2.task/k8s.io/{ID}/config.json"),
            "{truncated",
        );
        fixture.write("proc/42/root/etc/hostname", "api-0");
        assert_eq!(fixture.names(&[], Some(ID)), names("", "api-0", ""));
    }
}
