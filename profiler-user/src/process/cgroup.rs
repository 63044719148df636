//! Parsing /proc/PID/cgroup into the container, Kubernetes pod and systemd unit a process runs in.
//!
//! Container runtimes name cgroups after the 64-hex container id: `docker-<id>.scope`,
//! `cri-containerd-<id>.scope`, `crio-<id>.scope`, `libpod-<id>.scope` (systemd cgroup driver) or
//! a bare `<id>` directory (`/docker/<id>`, `/kubepods/<qos>/pod<uid>/<id>`, cgroupfs driver).
//! Kubernetes pods appear as `kubepods-<qos>-pod<uid with _>.slice` (systemd driver) or
//! `/kubepods/<qos>/pod<uid>/` (cgroupfs driver).

use std::{collections::HashMap, sync::Arc};

use crate::model::Pid;

/// What a process's cgroup membership says about where it runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupInfo {
    /// The cgroup v2 path (`0::<path>`), else the first v1 path.
    pub path: Option<String>,
    /// The full 64-hex container id.
    pub container_id: Option<String>,
    /// The Kubernetes pod uid, dash-separated.
    pub pod_uid: Option<String>,
    /// The innermost `*.service` unit under `system.slice` or `user.slice`.
    pub systemd_unit: Option<String>,
}

/// Prefixes container runtimes put before the container id in systemd scope names.
const SCOPE_PREFIXES: &[&str] = &["docker-", "cri-containerd-", "crio-", "libpod-"];

/// Parses the text of /proc/PID/cgroup. Malformed lines are skipped.
pub fn parse_cgroup(text: &str) -> CgroupInfo {
    let mut v2_path = None;
    let mut v1_paths = Vec::new();
    for line in text.lines() {
        // hierarchy-id:controllers:path; the path itself may contain ':'.
        let mut fields = line.splitn(3, ':');
        let (Some(hierarchy), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if path.is_empty() {
            continue;
        }
        if hierarchy == "0" && controllers.is_empty() {
            v2_path = Some(path);
        } else {
            v1_paths.push(path);
        }
    }
    // The v2 path is authoritative; v1 hierarchies fill in what it lacks (hybrid setups often
    // leave the v2 path at "/").
    let paths: Vec<&str> = v2_path.into_iter().chain(v1_paths).collect();
    CgroupInfo {
        path: paths.first().map(|p| (*p).to_owned()),
        container_id: paths.iter().find_map(|p| container_id_from_path(p)),
        pod_uid: paths.iter().find_map(|p| pod_uid_from_path(p)),
        systemd_unit: paths.iter().find_map(|p| systemd_unit_from_path(p)),
    }
}

/// [`parse_cgroup`] of the file's bytes (nothing is known of text that is not UTF-8).
pub fn parse_cgroup_bytes(raw: &[u8]) -> CgroupInfo {
    std::str::from_utf8(raw)
        .map(parse_cgroup)
        .unwrap_or_default()
}

fn is_container_id(candidate: &str) -> bool {
    candidate.len() == 64 && candidate.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Components of a cgroup path, innermost last. Components written as
/// `kubepods-...slice:cri-containerd:<id>` (containerd's systemd-driver naming seen from inside a
/// nested hierarchy) are split at ':' too.
fn components(path: &str) -> impl DoubleEndedIterator<Item = &str> {
    path.split('/')
        .flat_map(|c| c.split(':'))
        .filter(|c| !c.is_empty())
}

/// The innermost container id in a cgroup path.
pub fn container_id_from_path(path: &str) -> Option<String> {
    components(path).rev().find_map(|component| {
        let unscoped = component.strip_suffix(".scope").unwrap_or(component);
        let id = SCOPE_PREFIXES
            .iter()
            .find_map(|prefix| unscoped.strip_prefix(prefix))
            .unwrap_or(unscoped);
        is_container_id(id).then(|| id.to_ascii_lowercase())
    })
}

fn is_pod_uid(candidate: &str) -> bool {
    // A UUID (36 chars with dashes); tolerate the dashless 32-char form some tools emit.
    matches!(candidate.len(), 32 | 36)
        && candidate
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// The Kubernetes pod uid in a cgroup path.
pub fn pod_uid_from_path(path: &str) -> Option<String> {
    if !path.contains("kubepods") {
        return None;
    }
    components(path).rev().find_map(|component| {
        // systemd driver: kubepods-burstable-pod<uid_with_underscores>.slice
        let raw = if let Some(slice) = component.strip_suffix(".slice") {
            let (_, uid) = slice.rsplit_once("-pod")?;
            uid
        } else {
            // cgroupfs driver: pod<uid>
            component.strip_prefix("pod")?
        };
        let uid = raw.replace('_', "-");
        is_pod_uid(&uid).then(|| uid.to_ascii_lowercase())
    })
}

/// The innermost `*.service` unit of a path under `system.slice` or `user.slice`.
pub fn systemd_unit_from_path(path: &str) -> Option<String> {
    let mut parts = path.split('/').filter(|c| !c.is_empty());
    if !matches!(parts.next(), Some("system.slice" | "user.slice")) {
        return None;
    }
    parts
        .rfind(|c| c.len() > ".service".len() && c.ends_with(".service"))
        .map(str::to_owned)
}

/// What a process's cgroups are known to be from `since_ns` (`bpf_ktime_get_ns` time) on, as
/// long as none of its tasks moves to other cgroups: read from its /proc/PID/cgroup, or taken
/// from its parent at its fork (a child starts in the cgroups of the thread that forked it).
/// A fork child then gets its cgroups without a read of /proc, where the cgroup id of its
/// exec event does not say them all (a host with cgroup v1 hierarchies mounted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownCgroup {
    pub info: Arc<CgroupInfo>,
    pub since_ns: u64,
    /// The process's cgroup v2 id at `since_ns`, when known from its events: a child placed
    /// in another v2 cgroup at its birth (`clone3` with `CLONE_INTO_CGROUP`, which moves no
    /// task and fires no event) shows another id in its exec event.
    pub v2_id: Option<u64>,
    /// Every thread of the process is in these cgroups (known from its fork, when it had one
    /// thread; a thread moved since is an event). Read from /proc, they are its main
    /// thread's: another thread may have been moved before the agent started.
    pub all_threads: bool,
}

impl KnownCgroup {
    /// What the fork child of this process gets, forked at `forked_ns` by thread
    /// `parent_tid` of the process `parent` in its cgroup v2 `parent_cgroup_id`: the same
    /// cgroups when this knowledge held then, else `None` (read the child's from /proc).
    /// `moved_since` tells whether a task of `parent` moved at or after a time.
    pub fn for_child(
        &self,
        parent: Pid,
        parent_tid: u32,
        parent_cgroup_id: u64,
        forked_ns: u64,
        moved_since: impl FnOnce(u64) -> bool,
    ) -> Option<KnownCgroup> {
        let holds = self.since_ns <= forked_ns
            && (self.all_threads || parent_tid == parent.0)
            && self.v2_id.is_none_or(|id| id == parent_cgroup_id)
            && !moved_since(self.since_ns);
        holds.then(|| KnownCgroup {
            info: Arc::clone(&self.info),
            since_ns: forked_ns,
            v2_id: Some(parent_cgroup_id),
            all_threads: true,
        })
    }
}

/// Processes moved between cgroups kept at most; beyond, all are forgotten at once and every
/// cgroup known from before the latest move counts as changed.
pub const MAX_CGROUP_MOVES: usize = 4_096;

/// The latest move between cgroups of each process, as the kernel reported them, so that
/// [`KnownCgroup`]s from before are not used. A host moves processes between cgroups when a
/// service or container starts, rarely otherwise.
#[derive(Debug, Default)]
pub struct CgroupMoves {
    /// Whether the kernel reports every move and path change; when not, nothing known holds.
    tracked: bool,
    latest: HashMap<Pid, u64>,
    /// A cgroup known from this time or before counts as changed for every process (a cgroup
    /// renamed, a hierarchy mounted, moves forgotten beyond the bound, a move of a task the
    /// kernel could not name).
    changed_for_all_ns: u64,
}

impl CgroupMoves {
    /// From now on the kernel reports every move and path change.
    pub fn track(&mut self) {
        self.tracked = true;
    }

    /// A task of `pid` moved at `ktime_ns`; `None`: any process's cgroups may read otherwise.
    pub fn note(&mut self, pid: Option<Pid>, ktime_ns: u64) {
        let Some(pid) = pid else {
            self.changed_for_all_ns = self.changed_for_all_ns.max(ktime_ns);
            return;
        };
        if self.latest.len() >= MAX_CGROUP_MOVES && !self.latest.contains_key(&pid) {
            let forgotten = self.latest.drain().map(|(_, at)| at).max().unwrap_or(0);
            self.changed_for_all_ns = self.changed_for_all_ns.max(forgotten);
        }
        let latest = self.latest.entry(pid).or_insert(ktime_ns);
        *latest = (*latest).max(ktime_ns);
    }

    /// Whether what was known of `pid`'s cgroups at `since_ns` may no longer hold.
    pub fn moved_since(&self, pid: Pid, since_ns: u64) -> bool {
        !self.tracked
            || since_ns <= self.changed_for_all_ns
            || self.latest.get(&pid).is_some_and(|&at| at >= since_ns)
    }

    /// Processes whose latest move is kept.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moves are kept per process up to the bound; beyond, all are forgotten and what was
    /// known before the latest of them counts as changed for every process.
    #[test]
    fn cgroup_moves_are_bounded_and_forgetting_them_stays_on_the_safe_side() {
        let mut moves = CgroupMoves::default();
        assert!(moves.moved_since(Pid(1), 5), "untracked: nothing holds");
        moves.track();
        assert!(!moves.moved_since(Pid(1), 5));
        moves.note(Some(Pid(1)), 10);
        assert!(moves.moved_since(Pid(1), 5) && moves.moved_since(Pid(1), 10));
        assert!(!moves.moved_since(Pid(1), 11) && !moves.moved_since(Pid(2), 5));
        for pid in 2..=MAX_CGROUP_MOVES as u32 {
            moves.note(Some(Pid(pid)), 100 + u64::from(pid));
        }
        assert_eq!(moves.len(), MAX_CGROUP_MOVES);
        let latest = 100 + MAX_CGROUP_MOVES as u64;
        moves.note(Some(Pid(0)), latest + 50);
        assert_eq!(moves.len(), 1, "forgotten at once");
        assert!(
            moves.moved_since(Pid(7), latest),
            "forgotten moves count for everyone"
        );
        assert!(!moves.moved_since(Pid(7), latest + 1));
        assert!(moves.moved_since(Pid(0), latest + 50));
        moves.note(None, latest + 80);
        assert!(moves.moved_since(Pid(7), latest + 80) && !moves.moved_since(Pid(7), latest + 81));
    }

    const ID: &str = "4d3c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c";

    #[test]
    fn docker_systemd_driver_v2() {
        let info = parse_cgroup(&format!("0::/system.slice/docker-{ID}.scope\n"));
        assert_eq!(info.container_id.as_deref(), Some(ID));
        assert_eq!(info.pod_uid, None);
        // docker-<id>.scope is a scope, not a service.
        assert_eq!(info.systemd_unit, None);
        assert_eq!(info.path, Some(format!("/system.slice/docker-{ID}.scope")));
    }

    #[test]
    fn docker_cgroupfs_driver_v1() {
        let text = format!(
            "12:pids:/docker/{ID}\n11:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}\n0::/\n"
        );
        let info = parse_cgroup(&text);
        assert_eq!(info.container_id.as_deref(), Some(ID));
        assert_eq!(info.path.as_deref(), Some("/"));
    }

    #[test]
    fn containerd_kubernetes_systemd_driver_all_qos_classes() {
        let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let underscored = uid.replace('-', "_");
        for qos_slice in [
            format!("/kubepods.slice/kubepods-pod{underscored}.slice"),
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice"
            ),
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{underscored}.slice"
            ),
        ] {
            let info = parse_cgroup(&format!("0::{qos_slice}/cri-containerd-{ID}.scope\n"));
            assert_eq!(info.container_id.as_deref(), Some(ID), "{qos_slice}");
            assert_eq!(info.pod_uid.as_deref(), Some(uid), "{qos_slice}");
            assert_eq!(info.systemd_unit, None);
        }
    }

    #[test]
    fn containerd_kubernetes_cgroupfs_driver_all_qos_classes() {
        let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        for qos in ["", "burstable/", "besteffort/"] {
            let text = format!("11:cpu,cpuacct:/kubepods/{qos}pod{uid}/{ID}\n0::/\n");
            let info = parse_cgroup(&text);
            assert_eq!(info.container_id.as_deref(), Some(ID), "{qos}");
            assert_eq!(info.pod_uid.as_deref(), Some(uid), "{qos}");
        }
    }

    #[test]
    fn containerd_colon_form_inside_containerd_service() {
        let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let underscored = uid.replace('-', "_");
        let text = format!(
            "0::/system.slice/containerd.service/kubepods-burstable-pod{underscored}.slice:cri-containerd:{ID}\n"
        );
        let info = parse_cgroup(&text);
        assert_eq!(info.container_id.as_deref(), Some(ID));
        assert_eq!(info.pod_uid.as_deref(), Some(uid));
    }

    #[test]
    fn crio_and_podman() {
        let uid = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
        let crio = parse_cgroup(&format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/crio-{ID}.scope\n",
            uid.replace('-', "_")
        ));
        assert_eq!(crio.container_id.as_deref(), Some(ID));
        assert_eq!(crio.pod_uid.as_deref(), Some(uid));

        let podman = parse_cgroup(&format!(
            "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container\n"
        ));
        assert_eq!(podman.container_id.as_deref(), Some(ID));
        assert_eq!(podman.pod_uid, None);
        // The user manager is the only service on the path.
        assert_eq!(podman.systemd_unit.as_deref(), Some("user@1000.service"));
    }

    #[test]
    fn systemd_units() {
        assert_eq!(
            parse_cgroup("0::/system.slice/nginx.service\n")
                .systemd_unit
                .as_deref(),
            Some("nginx.service")
        );
        assert_eq!(
            parse_cgroup(
                "0::/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service\n"
            )
            .systemd_unit
            .as_deref(),
            Some("foo.service")
        );
        let v1 = "12:cpu:/\n1:name=systemd:/system.slice/postgresql@15-main.service\n";
        assert_eq!(
            parse_cgroup(v1).systemd_unit.as_deref(),
            Some("postgresql@15-main.service")
        );
        assert_eq!(parse_cgroup("0::/init.scope\n").systemd_unit, None);
        assert_eq!(
            parse_cgroup("0::/user.slice/user-0.slice/session-3.scope\n").systemd_unit,
            None
        );
        // Not under a systemd slice.
        assert_eq!(
            parse_cgroup("0::/custom/thing.service\n").systemd_unit,
            None
        );
    }

    #[test]
    fn not_a_container() {
        let info = parse_cgroup("0::/user.slice/user-0.slice/session-1.scope\n");
        assert_eq!(info.container_id, None);
        assert_eq!(info.pod_uid, None);
        // 63 hex characters is not an id.
        assert_eq!(
            container_id_from_path(&format!("/docker/{}", &ID[1..])),
            None
        );
    }

    #[test]
    fn garbage_does_not_panic() {
        for text in [
            "",
            "\n\n",
            ":::",
            "0::",
            "x",
            "0:::::",
            "1:cpu",
            "0::/kubepods/pod/",
        ] {
            let _ = parse_cgroup(text);
        }
        assert_eq!(parse_cgroup("garbage").path, None);
    }
}
