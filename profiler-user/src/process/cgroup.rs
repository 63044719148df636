//! Parsing /proc/PID/cgroup into the container, Kubernetes pod and systemd unit a process runs in.
//!
//! Container runtimes name cgroups after the 64-hex container id: `docker-<id>.scope`,
//! `cri-containerd-<id>.scope`, `crio-<id>.scope`, `libpod-<id>.scope` (systemd cgroup driver) or
//! a bare `<id>` directory (`/docker/<id>`, `/kubepods/<qos>/pod<uid>/<id>`, cgroupfs driver).
//! Kubernetes pods appear as `kubepods-<qos>-pod<uid with _>.slice` (systemd driver) or
//! `/kubepods/<qos>/pod<uid>/` (cgroupfs driver).

use std::{collections::HashMap, sync::Arc};

use crate::model::{CgroupMove, Pid};

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
/// long as none of its tasks moves to other cgroups: read from its /proc/PID/cgroup, taken
/// from its parent at its fork (a child starts in the cgroups of the thread that forked it),
/// or made from what was known before its move and the move's destination.
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
    /// The /proc/PID/cgroup text `info` was parsed from (`None`: not UTF-8), so a move the
    /// kernel reports with its destination can be applied to it.
    pub text: Option<Arc<str>>,
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
            text: self.text.clone(),
        })
    }

    /// What is known of a process's cgroups when it is read from /proc again (`read`): this
    /// earlier knowledge where it still holds (`moved_since` its time says no task moved) and
    /// the read says the same, so it stays known from its earlier time on (a child forked
    /// between then and the read keeps it); else the read.
    pub fn kept_across(
        &self,
        read: Option<KnownCgroup>,
        moved_since: impl FnOnce(u64) -> bool,
    ) -> Option<KnownCgroup> {
        match read {
            Some(read)
                if self.text.is_some()
                    && read.text == self.text
                    && read.since_ns >= self.since_ns
                    && !moved_since(self.since_ns) =>
            {
                Some(self.clone())
            }
            read => read,
        }
    }

    /// What these cgroups are from just after `moved` at `moved_ns`: the text with the moved
    /// hierarchy's path replaced (`parse` makes it a [`CgroupInfo`]). `None` where that is not
    /// provable: one thread moved alone (the others stay), this knowledge is from after the
    /// move, or the text is not kept or has no single line for the hierarchy (one mounted
    /// since is an event of its own).
    pub fn after_move(
        &self,
        moved: &CgroupMove,
        moved_ns: u64,
        parse: impl FnOnce(&str) -> CgroupInfo,
    ) -> Option<KnownCgroup> {
        if !moved.threadgroup || self.since_ns > moved_ns {
            return None;
        }
        let text = moved_text(self.text.as_deref()?, moved.hierarchy_id, &moved.path)?;
        Some(KnownCgroup {
            info: Arc::new(parse(&text)),
            since_ns: moved_ns + 1,
            // A v2 move: whatever v2 id the process had is past; its fork events tell the
            // new one.
            v2_id: self.v2_id.filter(|_| moved.hierarchy_id != 0),
            all_threads: self.all_threads,
            text: Some(text.into()),
        })
    }
}

/// A /proc/PID/cgroup `text` after its process moved to `path` in hierarchy `hierarchy_id`:
/// that hierarchy's one line with its path replaced. `None` when the text has no such line, or
/// more than one, or `path` cannot be a cgroup path (a line break in it).
pub fn moved_text(text: &str, hierarchy_id: u32, path: &str) -> Option<String> {
    if path.contains('\n') {
        return None;
    }
    let id = hierarchy_id.to_string();
    let mut out = String::with_capacity(text.len() + path.len());
    let mut replaced = false;
    for line in text.split_inclusive('\n') {
        let mut fields = line.splitn(3, ':');
        match (fields.next(), fields.next(), fields.next()) {
            (Some(line_id), Some(controllers), Some(_)) if line_id == id => {
                if replaced {
                    return None;
                }
                replaced = true;
                out.push_str(line_id);
                out.push(':');
                out.push_str(controllers);
                out.push(':');
                out.push_str(path);
                if line.ends_with('\n') {
                    out.push('\n');
                }
            }
            _ => out.push_str(line),
        }
    }
    replaced.then_some(out)
}

/// The inode number of the initial cgroup namespace (`PROC_CGROUP_INIT_INO` in the kernel's
/// `proc_ns.h`): fixed, so the agent can tell it is in it without looking at another process.
const INITIAL_CGROUP_NAMESPACE_INODE: u64 = 0xEFFF_FFFB;

/// Whether the agent is in the initial cgroup namespace, where /proc/PID/cgroup shows each
/// path from its hierarchy's root, as the kernel's move events do (in another, from that
/// namespace's root).
pub fn in_initial_cgroup_namespace() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/cgroup")
        .is_ok_and(|namespace| namespace.ino() == INITIAL_CGROUP_NAMESPACE_INODE)
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

    fn moved(hierarchy_id: u32, path: &str, threadgroup: bool) -> CgroupMove {
        CgroupMove {
            tid: 500,
            threadgroup,
            hierarchy_id,
            path: path.into(),
        }
    }

    const HYBRID: &str = "4:memory:/docker/a\n2:cpu,cpuacct:/\n1:name=systemd:/user.slice\n0::/\n";

    /// A move replaces its hierarchy's one line, path and all (a ':' in it included), and
    /// leaves the rest as it was; a hierarchy the text lacks or names twice, or a path that
    /// cannot be one, tells nothing.
    #[test]
    fn a_move_rewrites_its_hierarchys_line_only() {
        assert_eq!(
            moved_text(HYBRID, 4, "/kubepods/pod1/b:c").as_deref(),
            Some(
                "4:memory:/kubepods/pod1/b:c\n2:cpu,cpuacct:/\n1:name=systemd:/user.slice\n0::/\n"
            )
        );
        assert_eq!(
            moved_text(HYBRID, 0, "/system.slice/x.service").as_deref(),
            Some(
                "4:memory:/docker/a\n2:cpu,cpuacct:/\n1:name=systemd:/user.slice\n0::/system.slice/x.service\n"
            )
        );
        assert_eq!(
            moved_text("0::/a", 0, "/b").as_deref(),
            Some("0::/b"),
            "no final line break"
        );
        assert_eq!(moved_text(HYBRID, 7, "/x"), None, "no such hierarchy");
        assert_eq!(moved_text("3:pids:/a\n3:pids:/b\n", 3, "/x"), None, "twice");
        assert_eq!(moved_text(HYBRID, 4, "/x\n0::/y"), None, "a line break");
        assert_eq!(moved_text("", 0, "/x"), None);
    }

    /// What a move makes of known cgroups: only a move of every thread, of knowledge from
    /// before it, with its text kept; known from just after it; a v2 move forgets the v2 id.
    #[test]
    fn known_cgroups_after_a_move() {
        let known = KnownCgroup {
            info: Arc::new(parse_cgroup(HYBRID)),
            since_ns: 100,
            v2_id: Some(77),
            all_threads: true,
            text: Some(HYBRID.into()),
        };
        let container = "cd".repeat(32);
        let to_container = moved(4, &format!("/docker/{container}"), true);
        let after = known
            .after_move(&to_container, 150, parse_cgroup)
            .expect("a move of every thread");
        assert_eq!(after.info.container_id.as_deref(), Some(container.as_str()));
        assert_eq!(after.info.systemd_unit, None);
        assert_eq!(
            (after.since_ns, after.v2_id, after.all_threads),
            (151, Some(77), true)
        );
        assert_eq!(
            after.info.as_ref(),
            &parse_cgroup(after.text.as_deref().unwrap())
        );
        let v2 = known
            .after_move(
                &moved(0, "/system.slice/x.service", true),
                150,
                parse_cgroup,
            )
            .expect("a v2 move");
        assert_eq!(v2.info.path.as_deref(), Some("/system.slice/x.service"));
        assert_eq!(v2.info.systemd_unit.as_deref(), Some("x.service"));
        assert_eq!(v2.v2_id, None, "the new v2 id comes with the forks");
        assert_eq!(
            known.after_move(&moved(4, "/x", false), 150, parse_cgroup),
            None,
            "one thread moved alone"
        );
        assert_eq!(
            known.after_move(&to_container, 99, parse_cgroup),
            None,
            "known from after the move"
        );
        let textless = KnownCgroup {
            text: None,
            ..known.clone()
        };
        assert_eq!(textless.after_move(&to_container, 150, parse_cgroup), None);
    }

    /// Read again with the same text, known cgroups keep their earlier time (a child forked
    /// between then and the read keeps them), unless a task moved since; another text, or a
    /// read older than the knowledge, is taken as read.
    #[test]
    fn known_cgroups_read_again_keep_their_time_while_they_hold() {
        let known = |since_ns: u64, text: &str| KnownCgroup {
            info: Arc::new(parse_cgroup(text)),
            since_ns,
            v2_id: None,
            all_threads: false,
            text: Some(text.into()),
        };
        let before = KnownCgroup {
            all_threads: true,
            ..known(100, HYBRID)
        };
        let no_move = |_: u64| false;
        assert_eq!(
            before.kept_across(Some(known(500, HYBRID)), no_move),
            Some(before.clone())
        );
        let other = "0::/elsewhere\n";
        assert_eq!(
            before.kept_across(Some(known(500, other)), no_move),
            Some(known(500, other))
        );
        assert_eq!(
            before.kept_across(Some(known(500, HYBRID)), |since| since <= 100),
            Some(known(500, HYBRID)),
            "moved since"
        );
        assert_eq!(before.kept_across(None, no_move), None, "nothing read");
        assert_eq!(
            before.kept_across(Some(known(50, HYBRID)), no_move),
            Some(known(50, HYBRID)),
            "a read from before"
        );
    }

    proptest::proptest! {
        /// Any text, hierarchy and path: no panic; a rewrite keeps every other line and has
        /// the path on the hierarchy's line.
        #[test]
        fn moved_text_never_panics_and_touches_one_line(
            text in "([0-9]{1,2}:[a-z,=]{0,8}:[/a-z:]{0,8}\n?){0,5}",
            id in 0u32..12,
            path in "/[a-z:\n/]{0,8}",
        ) {
            if let Some(out) = moved_text(&text, id, &path) {
                let before: Vec<&str> = text.lines().collect();
                let after: Vec<&str> = out.lines().collect();
                proptest::prop_assert_eq!(before.len(), after.len());
                let mut changed = 0;
                for (old, new) in before.iter().zip(&after) {
                    if old.split(':').next() == Some(id.to_string().as_str()) {
                        changed += 1;
                        let prefix = old.splitn(3, ':').take(2).collect::<Vec<_>>().join(":");
                        proptest::prop_assert_eq!(new.to_string(), format!("{prefix}:{path}"));
                    } else {
                        proptest::prop_assert_eq!(old, new);
                    }
                }
                proptest::prop_assert_eq!(changed, 1);
            }
        }
    }
}
