//! Registry tests: against a hand-made proc root, and against real processes (run as root).
use std::{
    fs,
    io::ErrorKind,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::{Child, Command},
    thread,
    time::Duration,
};

use super::*;
use crate::model::{ExecRecord, FileId, LabelEnv, Pid, monotonic_now_ns};

const CONTAINER_ID: &str = "4d3c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c";

fn stat_line(pid: u32, comm: &str, flags: u64, start_time: u64) -> String {
    // Fields 3..=21, then start time (22), then a few more.
    format!(
        "{pid} ({comm}) S 1 {pid} {pid} 0 -1 {flags} 10 0 0 0 5 3 0 0 20 0 1 0 {start_time} 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n"
    )
}

/// Writes /proc/PID files for a fake user process under `root`.
fn write_fake_process(root: &Path, pid: u32, start_time: u64, maps: &str) -> PathBuf {
    let dir = root.join(pid.to_string());
    fs::create_dir_all(&dir).expect("create fake process dir");
    fs::write(
        dir.join("stat"),
        stat_line(pid, "my (weird) app", 0x0040_0100, start_time),
    )
    .expect("write stat");
    fs::write(dir.join("comm"), "my (weird) app\n").expect("write comm");
    fs::write(
        dir.join("cmdline"),
        b"/usr/bin/python3\0-u\0/srv/app/worker.py\0",
    )
    .expect("write cmdline");
    fs::write(dir.join("environ"), b"PATH=/bin\0HOSTNAME=web-1\0").expect("write environ");
    fs::write(
        dir.join("cgroup"),
        format!("0::/system.slice/docker-{CONTAINER_ID}.scope\n"),
    )
    .expect("write cgroup");
    fs::write(dir.join("maps"), maps).expect("write maps");
    dir
}

fn fake_registry(root: &Path, recheck_interval: Duration) -> ProcessRegistry {
    ProcessRegistry::with_config(
        root.to_path_buf(),
        "node-1".to_owned(),
        RegistryConfig {
            recheck_interval,
            ..RegistryConfig::default()
        },
    )
}

const ANON_MAPS: &str = "00001000-00002000 r-xp 00000000 00:00 0 \n";

#[test]
fn parses_stat_with_tricky_names() {
    let stat = parse_stat(&stat_line(7, "a) b (c", 0x0020_0040, 12345)).expect("parses");
    assert_eq!(stat.comm, "a) b (c");
    assert_eq!(stat.flags, 0x0020_0040);
    assert_eq!(stat.start_time, 12345);
    assert_eq!(parse_stat("7 (x) S 1 2"), None);
    assert_eq!(parse_stat(""), None);
    assert_eq!(parse_stat(")("), None);
}

#[test]
fn fake_process_snapshot() {
    let root = tempfile::tempdir().expect("tempdir");
    let maps = "\
00001000-00002000 r-xp 00000000 00:00 0
00400000-00500000 r-xp 00001000 08:01 424242     /opt/not-there/app (deleted)
00600000-00700000 rw-p 00000000 08:01 424242     /opt/not-there/app (deleted)
7ffd1000-7ffd3000 r-xp 00000000 00:00 0          [vdso]
";
    write_fake_process(root.path(), 100, 5000, maps);
    let mut registry = fake_registry(root.path(), Duration::from_secs(1));
    let info = registry.lookup(Pid(100)).expect("snapshot");
    assert_eq!(info.pid, Pid(100));
    assert_eq!(info.start_time, 5000);
    assert_eq!(&*info.comm, "my (weird) app");
    assert!(!info.is_kernel_thread);
    // A container: HOSTNAME names it.
    assert_eq!(info.labels.service_name, "web-1");
    assert_eq!(info.labels.container_id.as_deref(), Some(CONTAINER_ID));
    assert_eq!(info.labels.executable, "", "no exe link in the fake root");
    let names: Vec<&str> = info.mappings.iter().map(|m| &*m.name).collect();
    assert_eq!(names, ["[anon]", "/opt/not-there/app (deleted)", "[vdso]"]);
    // The file is nowhere to be opened: the mapping stays, without a file.
    assert!(info.mappings.iter().all(|m| m.file.is_none()));
    assert_eq!(info.mappings[1].file_offset, 0x1000);
    assert!(info.mapping_for(0x0040_0010).is_some());
    let stats = registry.stats();
    assert_eq!(stats.snapshots_taken, 1);
    assert_eq!(stats.lookups_failed, 0);
}

/// containerd's OCI config of container [`CONTAINER_ID`] (namespace `ml`, pod `web-1`,
/// container `api`) under the fake /proc root's host root: <proc root>/1/root, as /proc/1/root
/// is for an agent with host PID.
fn write_containerd_config(proc_root: &Path) {
    let bundle = proc_root.join(format!(
        "1/root/run/containerd/io.containerd.runtime.v2.task/k8s.io/{CONTAINER_ID}"
    ));
    fs::create_dir_all(&bundle).unwrap();
    fs::write(
        bundle.join("config.json"),
        r#"{"annotations":{"io.kubernetes.cri.sandbox-namespace":"ml",
            "io.kubernetes.cri.sandbox-name":"web-1","io.kubernetes.cri.container-name":"api"}}"#,
    )
    .unwrap();
}

#[test]
fn pod_process_gets_kubernetes_labels_from_the_runtime_config() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 200, 5000, ANON_MAPS);
    let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    fs::write(
        dir.join("cgroup"),
        format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{CONTAINER_ID}.scope\n",
            uid.replace('-', "_")
        ),
    )
    .unwrap();
    write_containerd_config(root.path());
    let mut registry = fake_registry(root.path(), Duration::from_secs(1));
    let labels = &registry.lookup(Pid(200)).expect("snapshot").labels;
    assert_eq!(labels.pod_uid.as_deref(), Some(uid));
    assert_eq!(labels.namespace.as_deref(), Some("ml"));
    assert_eq!(labels.pod.as_deref(), Some("web-1"));
    assert_eq!(labels.container.as_deref(), Some("api"));
    assert_eq!(labels.service_name, "ml/api");

    // Outside a pod nothing is looked up, even with the same variables in the environment.
    write_fake_process(root.path(), 201, 5000, ANON_MAPS);
    fs::write(
        root.path().join("201/environ"),
        b"POD_NAMESPACE=ml\0POD_NAME=web-1\0",
    )
    .unwrap();
    let labels = &registry.lookup(Pid(201)).expect("snapshot").labels;
    assert_eq!((&labels.namespace, &labels.pod), (&None, &None));
}

#[test]
fn lookup_of_missing_pid_fails() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    assert!(registry.lookup(Pid(4242)).is_none());
    assert_eq!(registry.stats().lookups_failed, 1);
    assert!(registry.is_empty());
}

/// A process in a pod gone before its first lookup keeps its pod's names: the container
/// runtime's config is found by the container id of the cgroup its exec event recorded. Its
/// pid's /proc entry is not read (it may be another process's by now).
#[test]
fn a_pod_process_gone_before_its_lookup_is_named_by_the_runtime_config() {
    let root = tempfile::tempdir().expect("tempdir");
    let cgroups = tempfile::tempdir().expect("tempdir");
    let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    let scope = cgroups.path().join(format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{CONTAINER_ID}.scope",
        uid.replace('-', "_")
    ));
    fs::create_dir_all(&scope).expect("a cgroup directory");
    // A second container of the pod, whose config the runtime does not have.
    let other = "9d3c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c";
    let other_scope = scope.with_file_name(format!("cri-containerd-{other}.scope"));
    fs::create_dir_all(&other_scope).expect("a cgroup directory");
    write_containerd_config(root.path());
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    registry.cgroups = CgroupPaths::from_mountinfo(&format!(
        "30 1 0:26 / {} rw - cgroup2 cgroup2 rw\n",
        cgroups.path().display()
    ));
    let cgroup_id = fs::metadata(&scope).expect("cgroup").ino();
    registry.record_exec(
        Pid(700),
        Arc::new(ExecRecord {
            cgroup_id,
            ..registry_record("curl")
        }),
    );
    let info = registry
        .lookup(Pid(700))
        .expect("a snapshot from the event");
    assert_eq!(registry.stats().snapshots_from_events, 1);
    let labels = &info.labels;
    assert_eq!(labels.pod_uid.as_deref(), Some(uid));
    assert_eq!(labels.container_id.as_deref(), Some(CONTAINER_ID));
    assert_eq!(labels.namespace.as_deref(), Some("ml"));
    assert_eq!(labels.pod.as_deref(), Some("web-1"));
    assert_eq!(labels.container.as_deref(), Some("api"));
    assert_eq!(labels.service_name, "ml/api");

    // The program a pid ran before its exec, in the container the runtime has no config of:
    // the pid's /proc entry is the new program's, and its host name file is not read for the
    // old one's pod name.
    let execed = write_fake_process(root.path(), 701, 5000, ANON_MAPS);
    fs::create_dir_all(execed.join("root/etc")).expect("mkdir");
    fs::write(execed.join("root/etc/hostname"), "not-the-pod\n").expect("write");
    registry.record_exec(
        Pid(701),
        Arc::new(ExecRecord {
            cgroup_id: fs::metadata(&other_scope).expect("cgroup").ino(),
            ..registry_record("curl")
        }),
    );
    let before = registry
        .snapshot_before_exec(Pid(701), 1, 3)
        .expect("the program before the exec");
    assert_eq!(before.labels.container_id.as_deref(), Some(other));
    assert_eq!(before.labels.pod_uid.as_deref(), Some(uid));
    assert_eq!(before.labels.pod, None);
}

/// /bin/sleep's path with links resolved, and an exec event of it (at 1 ns, its code mapped at
/// 0x5555_0000_2000).
fn exec_of_sleep() -> (PathBuf, ExecRecord) {
    let sleep = fs::canonicalize("/bin/sleep").expect("sleep");
    let metadata = fs::metadata(&sleep).expect("sleep metadata");
    let record = ExecRecord {
        filename: "/bin/sleep".into(),
        args: ["sleep", "0.01"].into_iter().collect(),
        args_complete: true,
        comm: "sleep".into(),
        cgroup_id: 0,
        exe: Some(FileId {
            dev: metadata.dev(),
            ino: metadata.ino(),
        }),
        code: Some((0x5555_0000_2000, 0x5555_0000_9000)),
        exec_ns: 1,
        label_env: None,
    };
    (sleep, record)
}

/// A process gone from /proc before its first lookup, known only from its exec event: named
/// after its program (not its thread), with its executable and the code range mapped.
#[test]
fn exec_event_names_a_process_gone_before_its_snapshot() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let (sleep, record) = exec_of_sleep();
    let metadata = fs::metadata(&sleep).expect("sleep metadata");
    registry.record_exec(Pid(500), Arc::new(record.clone()));
    // The service its environment named at the exec, though /proc has nothing left of it.
    let configured = ExecRecord {
        label_env: Some(LabelEnv::from_environ(
            b"PATH=/bin\0OTEL_SERVICE_NAME=nightly-report\0",
        )),
        ..record
    };
    registry.record_exec(Pid(502), Arc::new(configured));
    let named = registry
        .lookup(Pid(502))
        .expect("a snapshot from the event");
    assert_eq!(named.labels.service_name, "nightly-report");
    assert_eq!(named.labels.executable, sleep.to_string_lossy());
    let info = registry
        .lookup(Pid(500))
        .expect("a snapshot from the event");
    assert_eq!(info.labels.service_name, "sleep");
    assert_eq!(info.labels.executable, sleep.to_string_lossy());
    assert_eq!(&*info.comm, "sleep");
    assert_eq!(info.mappings.len(), 1, "the main executable's code");
    let mapping = &info.mappings[0];
    assert_eq!(
        (mapping.start, mapping.end),
        (0x5555_0000_2000, 0x5555_0000_9000)
    );
    assert!(
        mapping
            .file
            .as_ref()
            .is_some_and(|f| f.id.ino == metadata.ino())
    );
    assert_eq!(registry.stats().snapshots_from_events, 2);
    // Later lookups reuse it.
    assert!(Arc::ptr_eq(
        &info,
        &registry.lookup(Pid(500)).expect("kept")
    ));

    // The same event for a file replaced on disk since: no mapping, still the name.
    let replaced = ExecRecord {
        exe: Some(FileId {
            dev: metadata.dev(),
            ino: metadata.ino() + 1,
        }),
        ..registry_record("sleep")
    };
    registry.record_exec(Pid(501), Arc::new(replaced));
    let info = registry.lookup(Pid(501)).expect("named anyway");
    assert!(info.mappings.is_empty());
    assert_eq!(info.labels.service_name, "sleep");
}

/// A program deleted the moment it exits (a configure check, a build's test program) is
/// still symbolized: its exec event opens it while it is on disk.
#[test]
fn executable_deleted_after_its_exec_stays_readable() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let dir = tempfile::tempdir().expect("tempdir");
    let program = dir.path().join("conftest");
    fs::copy("/bin/sleep", &program).expect("copy a program");
    let metadata = fs::metadata(&program).expect("metadata");
    let record = ExecRecord {
        filename: program.to_string_lossy().into_owned(),
        exe: Some(FileId {
            dev: metadata.dev(),
            ino: metadata.ino(),
        }),
        ..registry_record("conftest")
    };
    registry.record_exec(Pid(600), Arc::new(record));
    fs::remove_file(&program).expect("delete the program");
    let info = registry
        .lookup(Pid(600))
        .expect("a snapshot from the event");
    let file = info.mappings[0]
        .file
        .as_ref()
        .expect("the deleted program, opened");
    assert_eq!(file.id.ino, metadata.ino());
    assert!(
        file.handle.is_some(),
        "readable through the handle opened at exec"
    );
}

fn registry_record(program: &str) -> ExecRecord {
    ExecRecord {
        filename: format!("/bin/{program}"),
        args: [program].into_iter().collect(),
        args_complete: true,
        comm: program.into(),
        code: Some((0x1000, 0x2000)),
        ..ExecRecord::default()
    }
}

/// A child forked without exec that exits before its lookup is its parent's program: the
/// parent's name and mappings under the child's pid, whatever the child named its thread.
/// A live process's command line and cgroup come from its exec event when the event holds
/// them whole (two /proc reads fewer for each new process) and is of the program the process
/// runs, else from /proc.
#[test]
fn a_complete_exec_event_says_who_a_live_process_is() {
    let root = tempfile::tempdir().expect("tempdir");
    let cgroups = tempfile::tempdir().expect("tempdir");
    let unit = cgroups.path().join("system.slice").join("checkout.service");
    fs::create_dir_all(&unit).expect("a cgroup directory");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    registry.cgroups = CgroupPaths::from_mountinfo(&format!(
        "30 1 0:26 / {} rw - cgroup2 cgroup2 rw\n",
        cgroups.path().display()
    ));
    let exec = |complete| ExecRecord {
        filename: "/usr/bin/python3".into(),
        args: ["/usr/bin/python3", "/srv/app/from_exec.py"]
            .into_iter()
            .collect(),
        args_complete: complete,
        cgroup_id: fs::metadata(&unit).expect("cgroup").ino(),
        ..registry_record("python3")
    };
    // 102 runs another program (its name says so) than the one its last exec event recorded:
    // a later exec's event was lost.
    for (pid, complete, comm) in [
        (100, true, "python3"),
        (101, false, "python3"),
        (102, true, "node"),
    ] {
        let dir = write_fake_process(root.path(), pid, 5000, ANON_MAPS);
        fs::write(dir.join("stat"), stat_line(pid, comm, 0x0040_0100, 5000)).expect("write");
        // Outside any container, so the systemd unit, else the script, names the service.
        fs::write(dir.join("environ"), b"PATH=/bin\0").expect("write");
        fs::write(dir.join("cgroup"), b"0::/user.slice\n").expect("write");
        fs::write(
            dir.join("cmdline"),
            b"/usr/bin/python3\0/srv/app/from_proc.py\0",
        )
        .expect("write");
        // Alive: its executable is there (read after its memory is gone, the exec event would
        // name it, the case of another test).
        std::os::unix::fs::symlink("/usr/bin/python3", dir.join("exe")).expect("symlink");
        registry.record_exec(Pid(pid), Arc::new(exec(complete)));
    }
    let whole = registry.lookup(Pid(100)).expect("snapshot");
    assert_eq!(
        whole.labels.systemd_unit.as_deref(),
        Some("checkout.service")
    );
    assert_eq!(whole.labels.service_name, "checkout");
    assert_eq!(registry.stats().cmdlines_from_exec, 1);

    // Arguments cut by the event's buffer: /proc says it all. The cgroup id still counts.
    let cut = registry.lookup(Pid(101)).expect("snapshot");
    assert_eq!(cut.labels.service_name, "checkout");
    assert_eq!(registry.stats().cmdlines_from_exec, 1);
    let other = registry.lookup(Pid(102)).expect("snapshot");
    assert_eq!(
        other.labels.systemd_unit, None,
        "/proc's cgroup, not the event's"
    );
    assert_eq!(registry.stats().cmdlines_from_exec, 1);
    registry.cgroups = CgroupPaths::with_root(None);
    for pid in [100, 101, 102] {
        registry.forget(Pid(pid));
    }
    let named = |registry: &mut ProcessRegistry, pid| {
        registry
            .lookup(Pid(pid))
            .expect("snapshot")
            .labels
            .service_name
            .clone()
    };
    assert_eq!(named(&mut registry, 100), "from_exec");
    assert_eq!(named(&mut registry, 101), "from_proc");
    assert_eq!(named(&mut registry, 102), "from_proc");
    let stats = registry.stats();
    assert_eq!(
        (stats.snapshots_taken, stats.snapshots_from_events),
        (6, 0),
        "read from /proc, not built from the events"
    );
}

#[test]
fn fork_event_gives_a_vanished_child_its_parent_snapshot() {
    let root = tempfile::tempdir().expect("tempdir");
    let maps = "00400000-00452000 r-xp 00000000 00:00 0 
";
    write_fake_process(root.path(), 600, 77, maps);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let parent = registry.lookup(Pid(600)).expect("parent");
    registry.record_fork(Pid(601), Pid(600), forked_at(0));
    // A child whose parent the registry had not seen at the fork: read then.
    write_fake_process(root.path(), 700, 78, maps);
    registry.record_fork(Pid(701), Pid(700), forked_at(0));
    for (child, parent_pid) in [(601, 600), (701, 700)] {
        let info = registry.lookup(Pid(child)).expect("the parent's snapshot");
        assert_eq!(info.pid, Pid(child));
        assert_eq!(
            info.labels.service_name, parent.labels.service_name,
            "{parent_pid}"
        );
        assert_eq!(info.mappings.len(), 1);
    }
    // A fork with no known parent at all: nothing to build from.
    registry.record_fork(Pid(801), Pid(800), forked_at(0));
    assert!(registry.lookup(Pid(801)).is_none());
}

/// A child gone before its lookup, whose parent exec'ed another program after the fork (a shell
/// forks for `<(…)`, then execs its last command in place): it is the parent's program before
/// that exec, not the one the parent's pid runs now, whose mappings are another address
/// space's.
#[test]
fn a_fork_child_is_its_parents_program_at_the_fork_not_after_a_later_exec() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let (parent, child) = (Pid(900), Pid(901));
    registry.record_exec(
        parent,
        Arc::new(ExecRecord {
            exec_ns: 100,
            ..registry_record("shell_before")
        }),
    );
    registry.record_fork(child, parent, forked_at(150));
    registry.record_exec(
        parent,
        Arc::new(ExecRecord {
            exec_ns: 200,
            ..registry_record("program_after")
        }),
    );
    let info = registry.lookup(child).expect("built from the events");
    assert_eq!(info.pid, child);
    assert_eq!(&*info.comm, "shell_before");
    assert_eq!(info.labels.service_name, "shell_before");

    // Forked after the second exec: that program.
    let later = Pid(902);
    registry.record_fork(later, parent, forked_at(250));
    let info = registry.lookup(later).expect("built from the events");
    assert_eq!(info.labels.service_name, "program_after");
}

/// A process read while it exits (its memory gone, its state still running) is named by its
/// exec event, not read as a nameless process with no mappings; with no event it is unknown.
#[test]
fn exiting_process_is_named_by_its_exec_event() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    for pid in [510, 511] {
        let dir = write_fake_process(root.path(), pid, 5000, "");
        // What /proc shows once exit_mm has run: no command line, environment or executable.
        fs::write(dir.join("cmdline"), b"").expect("write");
        fs::write(dir.join("environ"), b"").expect("write");
    }
    registry.record_exec(Pid(510), Arc::new(registry_record("host_threads")));
    let info = registry
        .lookup(Pid(510))
        .expect("a snapshot from the event");
    assert_eq!(info.labels.service_name, "host_threads");
    assert_eq!(info.labels.executable, "/bin/host_threads");
    let stats = registry.stats();
    assert_eq!((stats.snapshots_taken, stats.snapshots_from_events), (0, 1));
    assert!(
        registry.lookup(Pid(511)).is_none(),
        "without an event nothing says who it was"
    );
}

#[test]
fn pid_reuse_takes_a_new_snapshot() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let first = registry.lookup(Pid(100)).expect("snapshot");
    // Same start time: the same snapshot.
    let again = registry.lookup(Pid(100)).expect("snapshot");
    assert!(Arc::ptr_eq(&first, &again));

    fs::write(dir.join("stat"), stat_line(100, "other", 0x0040_0100, 9000)).expect("write");
    let second = registry.lookup(Pid(100)).expect("new snapshot");
    assert_eq!(second.start_time, 9000);
    assert_eq!(first.start_time, 5000, "the old snapshot is untouched");
    let stats = registry.stats();
    assert_eq!(stats.pid_reuse, 1);
    assert_eq!(stats.snapshots_taken, 2);
}

#[test]
fn snapshot_taken_mid_exec_is_retaken() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    fs::write(dir.join("cmdline"), b"").expect("write");
    fs::write(dir.join("environ"), b"").expect("write");
    // Mid-exec the new executable is already set.
    std::os::unix::fs::symlink("/usr/bin/true", dir.join("exe")).expect("symlink");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let first = registry.lookup(Pid(100)).expect("snapshot");
    assert!(!first.is_kernel_thread, "flags say user process");
    assert_eq!(first.labels.service_name, "4d3c8b7a6f5e");

    fs::write(dir.join("environ"), b"OTEL_SERVICE_NAME=late\0").expect("write");
    fs::write(dir.join("cmdline"), b"app\0").expect("write");
    let second = registry.lookup(Pid(100)).expect("snapshot");
    assert_eq!(second.labels.service_name, "late");
    let third = registry.lookup(Pid(100)).expect("snapshot");
    assert!(Arc::ptr_eq(&second, &third), "complete snapshots are kept");
    assert_eq!(registry.stats().snapshots_taken, 2);
    assert_eq!(registry.stats().pid_reuse, 0);
}

#[test]
fn pid_reuse_check_is_rate_limited() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    let mut registry = fake_registry(root.path(), Duration::from_secs(3600));
    let first = registry.lookup(Pid(100)).expect("snapshot");
    fs::write(dir.join("stat"), stat_line(100, "other", 0x0040_0100, 9000)).expect("write");
    let second = registry.lookup(Pid(100)).expect("snapshot");
    assert!(
        Arc::ptr_eq(&first, &second),
        "stat not re-read within the interval"
    );
    assert_eq!(registry.stats().pid_reuse, 0);
}

#[test]
fn vanished_process_is_kept_until_unused_for_an_interval() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    write_fake_process(root.path(), 200, 6000, ANON_MAPS);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let first = registry.lookup(Pid(100)).expect("snapshot");
    registry.lookup(Pid(200)).expect("snapshot");
    fs::remove_dir_all(&dir).expect("remove");

    // Gone, but in-flight samples still get the snapshot.
    let after_exit = registry.lookup(Pid(100)).expect("kept snapshot");
    assert!(Arc::ptr_eq(&first, &after_exit));
    assert_eq!(registry.stats().lookups_failed, 0);

    registry.evict_exited();
    assert_eq!(
        registry.len(),
        2,
        "used during the interval that just ended"
    );
    registry.evict_exited();
    assert_eq!(registry.len(), 1, "unused for a whole interval and gone");
    // The live process survives any number of intervals.
    registry.evict_exited();
    assert_eq!(registry.len(), 1);
    assert!(registry.lookup(Pid(100)).is_none());
}

/// A sample handled while its process's exit is read but not applied is of the process that
/// exited: its snapshot comes from its events, whatever /proc shows by then (nothing, or a
/// later process given the pid). A fork read after that exit hands the pid to /proc again.
#[test]
fn a_process_whose_exit_is_read_is_built_from_its_events_not_proc() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let (sleep, exited) = exec_of_sleep();
    for pid in [600, 601] {
        registry.record_exec(Pid(pid), Arc::new(exited.clone()));
        // By now a later process has the pid in /proc.
        write_fake_process(root.path(), pid, 5000, ANON_MAPS);
        registry.note_exit_read(Pid(pid), 10);
    }
    let info = registry.lookup(Pid(600)).expect("from its events");
    assert_eq!(&*info.comm, "sleep", "not the later process in /proc");
    assert_eq!(info.labels.executable, sleep.to_string_lossy());
    let stats = registry.stats();
    assert_eq!((stats.exits_known_at_lookup, stats.exits_ahead), (1, 2));
    // Applied: nothing of it is held any more.
    registry.record_exit(Pid(600), 10);
    assert_eq!(registry.stats().exits_ahead, 1);
    // 601's pid was forked again after its exit: /proc tells the later process.
    registry.note_fork_read(Pid(601), 11);
    assert_eq!(registry.stats().exits_ahead, 0);
    let later = registry.lookup(Pid(601)).expect("from /proc");
    assert_ne!(&*later.comm, "sleep");
    assert_eq!(registry.stats().exits_known_at_lookup, 1);
}

#[test]
fn a_snapshot_whose_exit_was_applied_is_evicted_without_asking_proc() {
    let root = tempfile::tempdir().expect("tempdir");
    // Both stay in the fake /proc: only the exit events tell them gone.
    write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    write_fake_process(root.path(), 200, 6000, ANON_MAPS);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let before = monotonic_now_ns();
    registry.lookup(Pid(100)).expect("snapshot");
    registry.lookup(Pid(200)).expect("snapshot");
    // 100 exits after its snapshot; 200's exit is older than its snapshot (an earlier process
    // with that pid), which says nothing of the one snapshotted.
    registry.record_exit(Pid(100), monotonic_now_ns());
    registry.record_exit(Pid(200), before);
    registry.evict_exited();
    assert_eq!(
        registry.len(),
        2,
        "used during the interval that just ended"
    );
    registry.evict_exited();
    assert!(!registry.has_snapshot(Pid(100)), "exited and unused");
    assert!(registry.has_snapshot(Pid(200)), "its /proc entry is there");
}

#[test]
fn refresh_for_address_rereads_maps() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let first = registry.lookup(Pid(100)).expect("snapshot");
    assert!(first.mapping_for(0x5000).is_none());

    fs::write(
        dir.join("maps"),
        format!("{ANON_MAPS}00005000-00006000 r-xp 00000000 00:00 0 [anon:jit]\n"),
    )
    .expect("write");
    let refreshed = registry
        .refresh_for_address(Pid(100), 0x5000)
        .expect("snapshot");
    assert_eq!(
        refreshed.mapping_for(0x5000).map(|m| &*m.name),
        Some("[anon:jit]")
    );
    assert_eq!(registry.stats().refreshes, 1);
    // Later lookups return the refreshed snapshot.
    let looked_up = registry.lookup(Pid(100)).expect("snapshot");
    assert!(Arc::ptr_eq(&refreshed, &looked_up));
    // An address that is mapped needs no refresh.
    registry.refresh_for_address(Pid(100), 0x5000);
    assert_eq!(registry.stats().refreshes, 1);
}

#[test]
fn refresh_for_address_is_rate_limited_and_survives_exit() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_fake_process(root.path(), 100, 5000, ANON_MAPS);
    let mut registry = fake_registry(root.path(), Duration::from_secs(3600));
    let first = registry.lookup(Pid(100)).expect("snapshot");
    fs::write(
        dir.join("maps"),
        "00005000-00006000 r-xp 00000000 00:00 0\n",
    )
    .expect("write");
    let same = registry
        .refresh_for_address(Pid(100), 0x5000)
        .expect("snapshot");
    assert!(Arc::ptr_eq(&first, &same));
    assert_eq!(registry.stats().refreshes, 0);

    let mut unlimited = fake_registry(root.path(), Duration::ZERO);
    let before = unlimited.lookup(Pid(100)).expect("snapshot");
    fs::remove_dir_all(&dir).expect("remove");
    let after = unlimited
        .refresh_for_address(Pid(100), 0x9000)
        .expect("old snapshot");
    assert!(Arc::ptr_eq(&before, &after));
}

#[test]
fn process_count_is_bounded() {
    let root = tempfile::tempdir().expect("tempdir");
    for pid in [100, 101, 102] {
        write_fake_process(root.path(), pid, 5000, ANON_MAPS);
    }
    let mut registry = ProcessRegistry::with_config(
        root.path().to_path_buf(),
        "h".to_owned(),
        RegistryConfig {
            max_processes: 2,
            ..RegistryConfig::default()
        },
    );
    for pid in [100, 101, 102] {
        assert!(registry.lookup(Pid(pid)).is_some());
    }
    assert_eq!(registry.len(), 2);
}

/// Copies `source` into `dir`, returning the copy's path and inode.
fn copy_file(source: &str, destination: &Path) -> u64 {
    if let Some(parent) = destination.parent() {
        fs::create_dir_all(parent).expect("create dir");
    }
    fs::copy(source, destination).expect("copy");
    fs::metadata(destination).expect("stat copy").ino()
}

fn build_id_of(path: &Path) -> Option<String> {
    files::read_build_id(&fs::File::open(path).ok()?)
}

#[test]
fn file_opened_through_process_root_and_inode_checked() {
    let root = tempfile::tempdir().expect("tempdir");
    let inside = "/opt/profiler-test-not-on-host/tool";
    let copy = root
        .path()
        .join("100/root")
        .join(inside.trim_start_matches('/'));
    let inode = copy_file("/bin/sleep", &copy);
    let maps = format!(
        "00400000-00500000 r-xp 00000000 08:01 {inode}  {inside}\n\
         00600000-00700000 r-xp 00000000 08:01 {}  {inside}\n",
        inode + 1
    );
    write_fake_process(root.path(), 100, 5000, &maps);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let info = registry.lookup(Pid(100)).expect("snapshot");
    let file = info.mappings[0]
        .file
        .as_ref()
        .expect("opened through root/");
    let metadata = fs::metadata(&copy).expect("stat");
    assert_eq!(
        file.id,
        FileId {
            dev: metadata.dev(),
            ino: metadata.ino()
        }
    );
    assert_eq!(&*file.path, inside);
    // Not visible at that path in our namespace: the kept descriptor.
    assert!(
        file.open_path.starts_with("/proc/self/fd/"),
        "{:?}",
        file.open_path
    );
    assert_eq!(
        file.build_id,
        build_id_of(Path::new("/bin/sleep")).map(Arc::from)
    );
    assert!(file.build_id.is_some());
    // Same path, other inode (replaced on disk): not the mapped file.
    assert!(info.mappings[1].file.is_none());
    assert_eq!(registry.stats().cached_files, 1);
}

#[test]
fn file_cache_is_bounded_and_shared() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut maps = String::new();
    for (index, name) in ["a", "b"].iter().enumerate() {
        let inside = format!("/opt/profiler-test-not-on-host/{name}");
        let copy = root
            .path()
            .join("100/root")
            .join(inside.trim_start_matches('/'));
        let inode = copy_file("/bin/true", &copy);
        maps.push_str(&format!(
            "{:08x}-{:08x} r-xp 00000000 08:01 {inode}  {inside}\n",
            0x10_0000 * (index + 1),
            0x10_0000 * (index + 1) + 0x1000
        ));
    }
    write_fake_process(root.path(), 100, 5000, &maps);
    // A second process, seeing the same files through its own root.
    let second_dir = write_fake_process(root.path(), 101, 5000, &maps);
    std::os::unix::fs::symlink(root.path().join("100/root"), second_dir.join("root"))
        .expect("symlink root");

    let mut shared = fake_registry(root.path(), Duration::ZERO);
    let first = shared.lookup(Pid(100)).expect("snapshot");
    let second = shared.lookup(Pid(101)).expect("snapshot");
    for (a, b) in first.mappings.iter().zip(&second.mappings) {
        let (Some(a), Some(b)) = (&a.file, &b.file) else {
            panic!("files not opened: {:?}", first.mappings);
        };
        assert!(Arc::ptr_eq(a, b), "one MappedFile per FileId");
    }
    assert_eq!(shared.stats().cached_files, 2);

    let mut bounded = ProcessRegistry::with_config(
        root.path().to_path_buf(),
        "h".to_owned(),
        RegistryConfig {
            max_open_files: 1,
            ..RegistryConfig::default()
        },
    );
    let info = bounded.lookup(Pid(100)).expect("snapshot");
    // Evicted from the cache, still held by the snapshot.
    assert!(info.mappings.iter().all(|m| m.file.is_some()));
    assert_eq!(bounded.stats().cached_files, 1);
}

/// A file already open is found by the device and inode its maps line names, without any
/// lookup in /proc: the second process has neither map_files nor a root to look through.
#[test]
fn cached_files_are_found_by_the_device_and_inode_of_the_maps_line() {
    use std::os::unix::fs::MetadataExt;
    let root = tempfile::tempdir().expect("tempdir");
    let inside = "/opt/profiler-test-not-on-host/app";
    let copy = root
        .path()
        .join("100/root")
        .join(inside.trim_start_matches('/'));
    let inode = copy_file("/bin/true", &copy);
    let dev = std::fs::metadata(&copy).expect("stat").dev();
    let maps = format!(
        "00100000-00101000 r-xp 00000000 {:x}:{:x} {inode}  {inside}\n",
        libc::major(dev),
        libc::minor(dev)
    );
    write_fake_process(root.path(), 100, 5000, &maps);
    write_fake_process(root.path(), 102, 5000, &maps);
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    let first = registry.lookup(Pid(100)).expect("snapshot");
    let second = registry.lookup(Pid(102)).expect("snapshot");
    let (Some(a), Some(b)) = (&first.mappings[0].file, &second.mappings[0].file) else {
        panic!("not opened: {first:?} {second:?}");
    };
    assert!(Arc::ptr_eq(a, b));
    // An unknown inode on that device is not taken for it.
    let other = format!(
        "00100000-00101000 r-xp 00000000 {:x}:{:x} {}  {inside}\n",
        libc::major(dev),
        libc::minor(dev),
        inode + 1
    );
    write_fake_process(root.path(), 103, 5000, &other);
    let third = registry.lookup(Pid(103)).expect("snapshot");
    assert!(third.mappings[0].file.is_none(), "{third:?}");
}

// ---- Live processes ----

/// A child process killed when the test ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Running {
    fn pid(&self) -> Pid {
        Pid(self.0.id())
    }
}

/// Spawns, retrying while a freshly copied binary is still open for writing in a forked child
/// of a concurrently running test (ETXTBSY).
fn spawn(command: &mut Command) -> Running {
    for _ in 0..50 {
        match command.spawn() {
            Ok(child) => return Running(child),
            Err(error) if error.raw_os_error() == Some(libc::ETXTBSY) => {
                thread::sleep(Duration::from_millis(20));
            }
            Err(error) => panic!("spawn {command:?}: {error}"),
        }
    }
    panic!("spawn {command:?}: text file busy");
}

fn live_registry() -> ProcessRegistry {
    ProcessRegistry::new(PathBuf::from("/proc"), "profiler-test-host".to_owned())
}

/// A real CPython binary, not a pyenv-style shell shim that would exec it later.
fn python() -> PathBuf {
    let system = PathBuf::from("/usr/bin/python3");
    if system.exists() {
        return system;
    }
    let output = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 available");
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// Waits until the process runs an executable named `prefix...` and the kernel has written its
/// command line (spawn returns before `execve` has finished setting up the new program).
fn wait_for_exe(pid: Pid, prefix: &str) {
    for _ in 0..250 {
        let runs_it = fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| {
            exe.file_name()
                .is_some_and(|name| name.to_string_lossy().starts_with(prefix))
        });
        let has_cmdline = fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty());
        if runs_it && has_cmdline {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("{pid} never ran {prefix}");
}

#[test]
fn live_otel_service_name_from_environment() {
    let child = spawn(
        Command::new("sleep")
            .arg("30")
            .env("OTEL_SERVICE_NAME", "checkout"),
    );
    wait_for_exe(child.pid(), "sleep");
    let mut registry = live_registry();
    let info = registry.lookup(child.pid()).expect("snapshot");
    assert_eq!(info.labels.service_name, "checkout");
    assert!(!info.is_kernel_thread);
    let exe = fs::read_link(format!("/proc/{}/exe", child.pid())).expect("exe");
    assert_eq!(info.labels.executable, exe.to_string_lossy());
    assert_eq!(&*info.comm, "sleep");
}

#[test]
fn live_python_script_and_inline_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("train.py");
    fs::write(&script, "import time\ntime.sleep(30)\n").expect("write script");
    let python = python();

    let script_child = spawn(
        Command::new(&python)
            .arg(&script)
            .env_remove("OTEL_SERVICE_NAME"),
    );
    wait_for_exe(script_child.pid(), "python");
    let inline_child = spawn(
        Command::new(&python)
            .args(["-c", "import time; time.sleep(30)"])
            .env_remove("OTEL_SERVICE_NAME"),
    );
    wait_for_exe(inline_child.pid(), "python");

    let mut registry = live_registry();
    let info = registry.lookup(script_child.pid()).expect("snapshot");
    assert_eq!(info.labels.service_name, "train");
    let inline = registry.lookup(inline_child.pid()).expect("snapshot");
    assert!(
        inline.labels.service_name.starts_with("python"),
        "{}",
        inline.labels.service_name
    );
}

fn readelf_build_id(path: &Path) -> Option<String> {
    let output = Command::new("readelf").arg("-n").arg(path).output().ok()?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| {
            line.trim()
                .strip_prefix("Build ID:")
                .map(|id| id.trim().to_owned())
        })
}

#[test]
fn live_mappings_contain_the_executable() {
    let child = spawn(Command::new("sleep").arg("30"));
    wait_for_exe(child.pid(), "sleep");
    let exe = fs::read_link(format!("/proc/{}/exe", child.pid())).expect("exe");
    let mut registry = live_registry();
    let info = registry.lookup(child.pid()).expect("snapshot");
    let exe_str = exe.to_string_lossy();
    let mapping = info
        .mappings
        .iter()
        .find(|m| *m.name == exe_str)
        .unwrap_or_else(|| panic!("no mapping of {exe_str} in {:?}", info.mappings));
    let file = mapping.file.as_ref().expect("file opened");
    let metadata = fs::metadata(&exe).expect("stat exe");
    assert_eq!(
        file.id,
        FileId {
            dev: metadata.dev(),
            ino: metadata.ino()
        }
    );
    assert_eq!(
        file.open_path, exe,
        "same file visible at the same path here"
    );
    let expected = readelf_build_id(&exe).expect("readelf shows a build id");
    assert_eq!(file.build_id.as_deref(), Some(expected.as_str()));
    assert!(info.mappings.iter().any(|m| &*m.name == "[vdso]"));
    assert!(info.mappings.windows(2).all(|w| w[0].end <= w[1].start));
    assert!(registry.stats().open_files >= 1);
}

#[test]
fn live_deleted_executable_stays_readable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let copy = dir.path().join("sleep-deleted");
    copy_file("/bin/sleep", &copy);
    let expected_build_id = build_id_of(&copy).expect("sleep has a build id");
    let child = spawn(Command::new(&copy).arg("30"));
    // Wait until the kernel has mapped the copy (exec done) before deleting it.
    wait_for_exe(child.pid(), "sleep-deleted");
    fs::remove_file(&copy).expect("delete");

    let mut registry = live_registry();
    let info = registry.lookup(child.pid()).expect("snapshot");
    let mapping = info
        .mappings
        .iter()
        .find(|m| m.name.ends_with("sleep-deleted (deleted)"))
        .unwrap_or_else(|| panic!("no deleted mapping in {:?}", info.mappings));
    let file = mapping.file.as_ref().expect("opened through map_files");
    assert_eq!(&*file.path, copy.to_string_lossy());
    assert!(
        file.open_path.starts_with("/proc/self/fd/"),
        "{:?}",
        file.open_path
    );
    match fs::File::open(&file.open_path) {
        Ok(_) => {}
        Err(error) if error.kind() == ErrorKind::NotFound => panic!("open_path vanished"),
        Err(error) => panic!("open_path unreadable: {error}"),
    }
    assert_eq!(file.build_id.as_deref(), Some(expected_build_id.as_str()));
    assert_eq!(build_id_of(&file.open_path), Some(expected_build_id));
    assert_eq!(info.labels.service_name, "sleep-deleted");
}

#[test]
fn live_kthreadd_is_a_kernel_thread() {
    let mut registry = live_registry();
    let info = registry.lookup(Pid(2)).expect("kthreadd");
    assert!(info.is_kernel_thread);
    assert_eq!(info.labels.service_name, "kernel");
    assert_eq!(info.labels.executable, "");
    assert!(info.mappings.is_empty());
}

// ---- Open file descriptors (the `open_files` metric) ----

#[test]
fn file_links_count_paths_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, target) in [
        ("3", "/usr/lib/x86_64-linux-gnu/libc.so.6"),
        ("4", "/tmp/gone (deleted)"),
        ("5", "socket:[12345]"),
        ("6", "pipe:[678]"),
        ("7", "anon_inode:bpf-map"),
        ("8", "anon_inode:[perf_event]"),
        ("9", "/proc/4242/fd"),
    ] {
        std::os::unix::fs::symlink(target, dir.path().join(name)).expect("symlink");
    }
    assert_eq!(super::files::count_file_links(dir.path()), 2);
}

/// Every file held open is one descriptor, counted once (the cache's own count missed files
/// held by snapshots and the symbolizer, and a file the cache held was not two).
#[test]
fn open_file_descriptors_follow_what_the_process_holds() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    const HELD: u64 = 64;
    let dir = tempfile::tempdir().expect("tempdir");
    for i in 0..HELD {
        std::fs::File::create(dir.path().join(format!("f{i}"))).expect("create");
    }
    // A child holds the files and closes them when told: tests running in parallel open and
    // close files in this process, so counting our own descriptors would race with them.
    let script = r#"
        for i in $(seq 0 63); do eval "exec $((i + 10))<\"$1/f$i\""; done
        echo held; read -r _
        for i in $(seq 10 73); do eval "exec $i<&-"; done
        echo closed; read -r _
    "#;
    let mut child = Command::new("bash")
        .args(["-c", script, "bash"])
        .arg(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("bash");
    let fd_dir = PathBuf::from(format!("/proc/{}/fd", child.id()));
    let mut to_child = child.stdin.take().expect("stdin");
    let mut from_child = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut step = |expected: &str| {
        let line = from_child.next().expect("a line").expect("read");
        assert_eq!(line, expected);
        let counted = super::files::count_file_links(&fd_dir);
        let descriptors = std::fs::read_dir(&fd_dir).expect("fd dir").count() as u64;
        (counted, descriptors)
    };
    let (held, descriptors) = step("held");
    to_child.write_all(b"\n").expect("write");
    let (after, _) = step("closed");
    drop(to_child);
    child.wait().expect("wait");
    assert_eq!(
        held - after,
        HELD,
        "{held} counted while held, {after} after"
    );
    // Its stdin and stdout are pipes: descriptors, not files.
    assert!(
        held + 2 <= descriptors,
        "{held} files among {descriptors} descriptors"
    );
    // This process's own count sees at least the file it holds while counting.
    let holding = std::fs::File::open(dir.path().join("f0")).expect("open");
    assert!(super::files::open_file_descriptors() >= 1);
    drop(holding);
}

#[test]
fn file_descriptors_are_split_so_no_user_can_take_them_all() {
    use super::files::{FD_RESERVE, FdBudget};
    // A generous limit leaves the asked values alone.
    let roomy = FdBudget::split(20_000, 1024, 4096, 16);
    assert_eq!((roomy.connections, roomy.mapped_files), (1024, 4096));
    // The common soft limit of 1024: a quarter of the spare for connections (less the probes'
    // reserve), half for mapped files; their sum stays below the limit with the reserve.
    let tight = FdBudget::split(1024, 1024, 4096, 16);
    assert_eq!((tight.connections, tight.mapped_files), (176, 384));
    assert!(
        (tight.connections + 16 + tight.mapped_files) as u64 + FD_RESERVE <= tight.limit,
        "{tight:?}"
    );
    // Absurdly low: still at least one of each.
    let starved = FdBudget::split(100, 1024, 4096, 16);
    assert_eq!((starved.connections, starved.mapped_files), (1, 1));
}

/// A registry of the real /proc that reads the kernel's mmap announcements; `None` (the test
/// skipped, with a line saying so) where perf events need privileges the test lacks.
fn registry_watching_mmaps(recheck_interval: Duration) -> Option<ProcessRegistry> {
    let cpus: Vec<u32> = (0..thread::available_parallelism().map_or(1, |n| n.get()))
        .map(|c| c as u32)
        .collect();
    let events = match MmapEvents::open(&cpus) {
        Ok(events) => events,
        Err(error) if error.raw_os_error() == Some(libc::EACCES) => {
            eprintln!("skipped: perf events need privileges ({error})");
            return None;
        }
        Err(error) => panic!("cannot open perf events: {error}"),
    };
    let mut registry = ProcessRegistry::with_config(
        PathBuf::from("/proc"),
        "profiler-test-host".to_owned(),
        RegistryConfig {
            recheck_interval,
            ..RegistryConfig::default()
        },
    );
    registry.watch_mmaps(events);
    Some(registry)
}

/// A process exec'ed while the kernel announces mmaps gets its snapshot's mappings from the
/// announcements, the same as /proc/PID/maps lists; an address in none of them rereads the maps
/// file.
#[test]
fn live_mappings_from_announcements_match_the_maps_file() {
    let Some(mut registry) = registry_watching_mmaps(Duration::ZERO) else {
        return;
    };
    let child = spawn(Command::new("sleep").arg("30"));
    let pid = child.pid();
    wait_for_exe(pid, "sleep");
    // The dynamic loader maps libc after the exec.
    for _ in 0..250 {
        if fs::read_to_string(format!("/proc/{pid}/maps"))
            .is_ok_and(|maps| maps.contains("libc.so"))
        {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    registry.drain_mmaps();
    let exe = fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    registry.record_exec(pid, Arc::new(sleep_exec_record(pid, None)));

    let info = registry.lookup(pid).expect("snapshot");
    assert_eq!(registry.stats().maps_from_announcements, 1);
    // Who it is came from the exec event, not /proc/PID/stat and exe, and is what /proc says.
    assert_eq!(registry.stats().identities_from_exec, 1);
    let mut files = FileCache::new(64);
    let from_proc = read_process(
        pid,
        Path::new(&format!("/proc/{pid}")),
        "profiler-test-host",
        &mut files,
    )
    .expect("read /proc")
    .info;
    assert_eq!(info.labels, from_proc.labels);
    assert_eq!(info.comm, from_proc.comm);
    let from_maps = from_proc.mappings;
    // No mmap makes the legacy vsyscall page: only the maps file lists it.
    let described = |mappings: &[Mapping]| -> Vec<(u64, u64, u64, String, Option<FileId>)> {
        mappings
            .iter()
            .filter(|m| &*m.name != "[vsyscall]")
            .map(|m| {
                (
                    m.start,
                    m.end,
                    m.file_offset,
                    m.name.to_string(),
                    m.file.as_ref().map(|f| f.id),
                )
            })
            .collect()
    };
    assert_eq!(described(&info.mappings), described(&from_maps));
    assert!(
        info.mappings.iter().any(|m| m.name.contains("libc.so")),
        "{:?}",
        info.mappings
    );
    assert_eq!(info.labels.executable, exe.to_string_lossy());

    // The recheck reads its start time, which is before the exec: the same process.
    let again = registry.lookup(pid).expect("still running");
    assert!(Arc::ptr_eq(&info, &again));
    assert_eq!(
        (registry.stats().pid_reuse, registry.stats().snapshots_taken),
        (0, 1)
    );

    // Announcements never say what was unmapped: an unknown address rereads the maps file.
    registry
        .refresh_for_address(pid, 0x10)
        .expect("still running");
    let stats = registry.stats();
    assert_eq!((stats.refreshes, stats.maps_from_announcements), (1, 1));
}

/// A shell forks (for `<(…)`) and then execs another program in place; its fork child exits
/// unread. When the child's sample is resolved, the shell's exec event may still wait behind
/// samples taken before it, but the kernel has announced the exec: the child is the shell's
/// program at the fork, not what /proc shows of its parent by then.
#[test]
fn a_fork_child_is_not_given_its_parents_program_after_an_exec_not_yet_applied() {
    let Some(mut registry) = registry_watching_mmaps(Duration::ZERO) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let made = Command::new("mkfifo")
        .arg(dir.path().join("child"))
        .arg(dir.path().join("parent"))
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let script =
        r#"( read x < "$1/child" ) & echo $! > "$1/pid"; read y < "$1/parent"; exec sleep 30"#;
    let parent = spawn(
        Command::new("bash")
            .args(["-c", script, "bash"])
            .arg(dir.path()),
    );
    let pid_file = dir.path().join("pid");
    let mut child = None;
    for _ in 0..250 {
        child = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|text| text.trim().parse::<u32>().ok());
        if child.is_some() {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    let child = Pid(child.expect("the shell forked"));
    // The shell's exec event and the fork, as the agent applies them.
    let forked_ns = monotonic_now_ns();
    registry.drain_mmaps();
    let bash = fs::read_link(format!("/proc/{}/exe", parent.pid())).expect("exe");
    registry.record_exec(
        parent.pid(),
        Arc::new(ExecRecord {
            filename: bash.to_string_lossy().into_owned(),
            comm: "bash".into(),
            exec_ns: forked_ns,
            ..ExecRecord::default()
        }),
    );
    registry.record_fork(child, parent.pid(), forked_at(forked_ns));

    // The shell execs `sleep` (its event not applied), then the child exits unread.
    fs::write(dir.path().join("parent"), "go\n").expect("write fifo");
    wait_for_exe(parent.pid(), "sleep");
    fs::write(dir.path().join("child"), "go\n").expect("write fifo");
    for _ in 0..250 {
        let gone = fs::read_to_string(format!("/proc/{child}/stat")).map_or(true, |stat| {
            parse_stat(&stat).is_some_and(|s| s.state == 'Z')
        });
        if gone {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }

    // The pipeline reads the rings before a process's first lookup.
    registry.drain_mmaps();
    let info = registry.lookup(child).expect("built from the events");
    let names: Vec<&str> = info.mappings.iter().map(|m| &*m.name).collect();
    assert!(
        names.iter().any(|name| name.ends_with("/bash")),
        "the shell's code: {names:?}"
    );
    assert!(
        !names.iter().any(|name| name.ends_with("/sleep")),
        "not the program the shell exec'ed since: {names:?}"
    );
    assert_eq!(info.labels.service_name, "bash");
}

/// A library loaded after the snapshot (as `import torch` loads dozens): an address in it
/// retakes the snapshot at once when the kernel announced the mapping, not only after the
/// recheck interval; an address nothing was announced at waits for the interval.
#[test]
fn code_announced_since_the_snapshot_refreshes_it_at_once() {
    let Some(mut registry) = registry_watching_mmaps(Duration::from_secs(3600)) else {
        return;
    };
    let me = Pid(std::process::id());
    let before = registry.lookup(me).expect("own snapshot");
    let refreshes = registry.stats().refreshes;

    // Nothing announced there: within the interval the snapshot stays.
    let unmapped = 0x1000;
    assert!(before.mapping_for(unmapped).is_none());
    let same = registry
        .refresh_for_address(me, unmapped)
        .expect("snapshot");
    assert!(Arc::ptr_eq(&same, &before));
    assert_eq!(registry.stats().refreshes, refreshes);

    // An executable mapping of a file, as a dlopen makes.
    let library = std::env::current_exe().expect("own executable");
    let file = fs::File::open(&library).expect("open own executable");
    let mapped =
        unsafe { memmap2::MmapOptions::new().len(4096).map_exec(&file) }.expect("map executable");
    let address = mapped.as_ptr() as u64;
    assert!(
        before.mapping_for(address).is_none(),
        "{address:#x} in {:?}",
        before.mapping_for(address).map(|m| &m.name)
    );
    let after = registry.refresh_for_address(me, address).expect("snapshot");
    let stats = registry.stats();
    drop(mapped);
    assert!(
        after.mapping_for(address).is_some(),
        "{address:#x} not in the refreshed snapshot"
    );
    assert_eq!(stats.refreshes, refreshes + 1);
    assert_eq!(stats.refreshes_announced, 1);

    // The announcement is older than the new snapshot: it does not retake it again.
    registry
        .refresh_for_address(me, unmapped)
        .expect("snapshot");
    assert_eq!(registry.stats().refreshes, refreshes + 1);
}

/// A snapshot taken before the process mapped a library (as one taken while ld.so is still
/// loading them), then the process maps it, runs code there and exits before the agent looks:
/// /proc is gone, but the mmap the kernel announced places the address, so the refreshed
/// snapshot has the library and keeps the name read before.
#[test]
fn a_gone_process_is_refreshed_from_its_announced_mappings() {
    use std::io::{BufRead, BufReader, Write};
    let library = Path::new("/usr/lib/x86_64-linux-gnu/libuuid.so.1");
    if !library.exists() {
        eprintln!("skipped: {} not installed", library.display());
        return;
    }
    let Some(mut registry) = registry_watching_mmaps(Duration::from_secs(3600)) else {
        return;
    };
    // python3 does not link libuuid: it is mapped only when the script loads it.
    let script = "import sys, ctypes\n\
                  print('ready', flush=True)\n\
                  sys.stdin.readline()\n\
                  lib = ctypes.CDLL(sys.argv[1])\n\
                  print(hex(ctypes.cast(lib.uuid_generate, ctypes.c_void_p).value), flush=True)\n";
    let mut child = Command::new("python3")
        .args(["-c", script, &library.to_string_lossy()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run python3");
    let pid = Pid(child.id());
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).expect("ready line");
    assert_eq!(line.trim(), "ready");
    let before = registry.lookup(pid).expect("snapshot of the running child");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    line.clear();
    stdout.read_line(&mut line).expect("address line");
    let address = u64::from_str_radix(line.trim().trim_start_matches("0x"), 16)
        .unwrap_or_else(|_| panic!("address from the child: {line:?}"));
    child.wait().expect("child exits");
    assert!(
        before.mapping_for(address).is_none(),
        "{address:#x} in {:?}",
        before.mapping_for(address).map(|m| &m.name)
    );

    let after = registry
        .refresh_for_address(pid, address)
        .expect("a snapshot");
    let mapping = after
        .mapping_for(address)
        .unwrap_or_else(|| panic!("{address:#x} not placed after the refresh"));
    assert!(
        mapping.name.contains("libuuid.so"),
        "mapped as {}",
        mapping.name
    );
    assert!(mapping.file.is_some(), "no file for {}", mapping.name);
    assert_eq!(after.comm, before.comm);
    assert_eq!(after.labels, before.labels);
    assert_eq!(registry.stats().refreshes_from_announcements, 1);
}

/// A child gone before its lookup whose parent, not read at the fork, exited since and whose
/// pid another process got: /proc shows that other process under the parent's pid. The child is
/// its parent's program by the parent's own identity from before the fork, else left unknown;
/// never given the other process's program.
#[test]
fn a_fork_child_is_not_given_the_process_that_got_its_parents_pid() {
    let Some(mut registry) = registry_watching_mmaps(Duration::ZERO) else {
        return;
    };
    // The process now holding the parent's pid.
    let holder = spawn(Command::new("sleep").arg("30"));
    let parent = holder.pid();
    wait_for_exe(parent, "sleep");
    let child = Pid(unused_pid(&[]));
    let forked_ns = monotonic_now_ns();
    registry.record_fork(child, parent, forked_at(forked_ns));

    // Before the parent's pid changed hands, /proc shows the parent itself.
    let info = registry.lookup(child).expect("the parent read from /proc");
    assert!(info.mappings.iter().any(|m| m.name.ends_with("/sleep")));

    // Two more children, forked when the registry held no snapshot of the parent; the parent
    // exits and a new process gets its pid before they are looked up.
    registry.forget(parent);
    let second = Pid(unused_pid(&[child.0]));
    let third = Pid(unused_pid(&[child.0, second.0]));
    registry.record_fork(second, parent, forked_at(forked_ns));
    registry.record_fork(third, parent, forked_at(forked_ns));
    registry.note_process_boundary(parent, forked_ns + 1);
    registry.note_process_boundary(parent, forked_ns + 2);
    assert!(
        registry.lookup(second).is_none(),
        "not /proc, which shows the program now running under the parent's pid"
    );
    // Nor a snapshot of the pid taken after it changed hands.
    assert!(registry.lookup(parent).is_some());
    assert!(
        registry.lookup(third).is_none(),
        "not the snapshot of the process that got the parent's pid"
    );
    assert_eq!(registry.stats().parents_gone_since_fork, 2);
    drop(holder);

    // A parent gone from /proc whose exec event is from before the fork: the child is that
    // program.
    let exited = Pid(unused_pid(&[child.0, second.0, third.0]));
    let orphan = Pid(unused_pid(&[child.0, second.0, third.0, exited.0]));
    registry.record_exec(
        exited,
        Arc::new(ExecRecord {
            exec_ns: forked_ns - 100,
            ..registry_record("shell_before")
        }),
    );
    registry.record_fork(orphan, exited, forked_at(forked_ns));
    registry.note_process_boundary(exited, forked_ns + 1);
    let info = registry
        .lookup(orphan)
        .expect("built from the parent's exec event");
    assert_eq!(info.labels.service_name, "shell_before");
    // Unless the identity held for the pid is the next process's, forked after the child.
    let reused = Pid(unused_pid(&[
        child.0, second.0, third.0, exited.0, orphan.0,
    ]));
    let other_orphan = Pid(unused_pid(&[
        child.0, second.0, third.0, exited.0, orphan.0, reused.0,
    ]));
    registry.record_exec(
        reused,
        Arc::new(ExecRecord {
            exec_ns: forked_ns - 100,
            ..registry_record("shell_before")
        }),
    );
    registry.record_fork(other_orphan, reused, forked_at(forked_ns));
    registry.note_process_boundary(reused, forked_ns + 1);
    registry.record_fork(reused, exited, forked_at(forked_ns + 2));
    // The next process's identity is not taken: what the parent ran at the fork, kept with
    // the child then, is.
    let info = registry
        .lookup(other_orphan)
        .expect("named by the parent's program at the fork");
    assert_eq!(info.labels.service_name, "shell_before");
    assert_eq!(registry.stats().parents_from_fork_time, 1);

    // A parent that exited long before its child: its identity is forgotten a minute after
    // its exit, and the child, first looked up after that, is still its program.
    let mut taken = vec![
        child.0,
        second.0,
        third.0,
        exited.0,
        orphan.0,
        reused.0,
        other_orphan.0,
    ];
    let late_orphan = Pid(unused_pid(&taken));
    taken.push(late_orphan.0);
    let long_lived_parent = Pid(unused_pid(&taken));
    registry.record_exec(
        long_lived_parent,
        Arc::new(ExecRecord {
            exec_ns: forked_ns + 10,
            ..registry_record("supervisor")
        }),
    );
    registry.record_fork(late_orphan, long_lived_parent, forked_at(forked_ns + 20));
    registry.note_process_boundary(long_lived_parent, forked_ns + 30);
    registry.record_exit(long_lived_parent, forked_ns + 30);
    let a_minute_later = forked_ns + 30 + EXITED_PROCESS_RETENTION_NS + 1;
    registry.record_exit(Pid(unused_pid(&[])), a_minute_later);
    assert!(registry.stats().identities_expired >= 1);
    let info = registry
        .lookup(late_orphan)
        .expect("named by the parent's program at the fork");
    assert_eq!(info.labels.service_name, "supervisor");
    assert_eq!(registry.stats().parents_from_fork_time, 2);
    assert_eq!(registry.stats().parents_gone_since_fork, 2);
}

/// A pid no process has now and not in `taken` (pids count up from the last one given out,
/// far below this range).
fn unused_pid(taken: &[u32]) -> u32 {
    (4_000_000..4_194_000)
        .find(|pid| !taken.contains(pid) && !Path::new(&format!("/proc/{pid}")).exists())
        .expect("a free pid")
}

/// A running process whose exec event held its whole environment is labelled from that copy
/// (/proc/PID/environ is not read again); without one, from /proc/PID/environ.
#[test]
fn a_running_process_takes_its_labels_environment_from_its_exec_event_when_whole() {
    let mut registry = live_registry();
    let spawn_named = |service: &str| {
        let child = spawn(
            Command::new("sleep")
                .arg("30")
                .env("OTEL_SERVICE_NAME", service),
        );
        wait_for_exe(child.pid(), "sleep");
        child
    };
    let whole = spawn_named("from-proc");
    let at_exec = LabelEnv::from_environ(b"OTEL_SERVICE_NAME=at-exec");
    registry.record_exec(
        whole.pid(),
        Arc::new(sleep_exec_record(whole.pid(), Some(at_exec))),
    );
    let info = registry.lookup(whole.pid()).expect("snapshot");
    assert_eq!(info.labels.service_name, "at-exec");

    let too_large = spawn_named("from-proc");
    registry.record_exec(
        too_large.pid(),
        Arc::new(sleep_exec_record(too_large.pid(), None)),
    );
    let info = registry.lookup(too_large.pid()).expect("snapshot");
    assert_eq!(info.labels.service_name, "from-proc");
}

/// The exec event of a running `sleep 30` (its executable as /proc shows it), read after the
/// exec: the image the announcements started for it.
fn sleep_exec_record(pid: Pid, label_env: Option<LabelEnv>) -> ExecRecord {
    let exe = fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    let metadata = fs::metadata(&exe).expect("stat exe");
    ExecRecord {
        filename: exe.to_string_lossy().into_owned(),
        args: ["sleep", "30"].into_iter().collect(),
        args_complete: true,
        comm: "sleep".to_owned(),
        cgroup_id: 0,
        exe: Some(FileId {
            dev: metadata.dev(),
            ino: metadata.ino(),
        }),
        code: None,
        exec_ns: monotonic_now_ns(),
        label_env,
    }
}

/// A snapshot from an exec event tells its process from a later one with the pid by the exec's
/// time: a process that started before the exec (or in its clock tick) is the one that
/// exec'ed, one that started after it is another.
#[test]
fn a_process_known_by_its_exec_is_told_from_a_later_one_by_its_start_time() {
    let exec_ns = monotonic_now_ns();
    let exec_tick = boottime_ticks_of_monotonic(exec_ns).expect("clocks");
    let own_start = parse_stat(&fs::read_to_string("/proc/self/stat").expect("stat"))
        .expect("parse stat")
        .start_time;
    let start = ProcessStart::ExecedAt(exec_ns);
    assert!(own_start <= exec_tick, "{own_start} > {exec_tick}");
    assert!(start.is(own_start));
    assert!(start.is(exec_tick));
    assert!(!start.is(exec_tick + 1));
    assert!(ProcessStart::Read(own_start).is(own_start));
    assert!(!ProcessStart::Read(own_start).is(own_start + 1));
}

/// A fork at `forked_ns`, its thread and cgroup v2 id left 0 (not the parent's own).
fn forked_at(forked_ns: u64) -> ForkOrigin {
    ForkOrigin {
        forked_ns,
        ..ForkOrigin::default()
    }
}

/// Where cgroup v1 hierarchies are mounted (the exec event's v2 id does not say them all), a
/// fork child's cgroups are its parent's as read from /proc before the fork, without a read
/// of the child's: while no task of either moved since (nor any cgroup was renamed), when
/// the parent's main thread forked (/proc shows that thread's; another may have been moved
/// before the agent started), and when the child's exec shows the v2 cgroup the parent was
/// in (not placed elsewhere at its birth). Otherwise the child's own file is read. Every
/// child's file here names another container than its parent's, so the labels tell which.
#[test]
fn a_fork_childs_cgroups_are_its_parents_while_no_task_moved() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    registry.cgroups = CgroupPaths::with_root(None);
    registry.track_cgroup_changes(true);
    let child_container = "ab".repeat(32);
    let hybrid = |id: &str| format!("4:memory:/docker/{id}\n1:name=systemd:/\n0::/\n");
    let write_process = |pid: u32, container: &str| {
        let dir = write_fake_process(root.path(), pid, 5000, ANON_MAPS);
        fs::write(dir.join("stat"), stat_line(pid, "sleep", 0x0040_0100, 5000)).expect("stat");
        fs::write(dir.join("cgroup"), hybrid(container)).expect("cgroup");
        std::os::unix::fs::symlink("/bin/sleep", dir.join("exe")).expect("symlink");
    };
    write_process(500, CONTAINER_ID);
    let parent = registry.lookup(Pid(500)).expect("the parent's snapshot");
    assert_eq!(parent.labels.container_id.as_deref(), Some(CONTAINER_ID));
    let v2_id = 77;
    // Forks `child` (its /proc entry written when `alive`; now unless `forked_ns` says when),
    // which execs in v2 cgroup `exec_cgroup_id`; `between` runs between the fork and the exec.
    // Its container.
    let child = |registry: &mut ProcessRegistry,
                 pid: u32,
                 parent: u32,
                 parent_tid: u32,
                 exec_cgroup_id: u64,
                 alive: bool,
                 forked_ns: Option<u64>,
                 between: &dyn Fn(&mut ProcessRegistry)| {
        if alive {
            write_process(pid, &child_container);
        }
        let forked_ns = forked_ns.unwrap_or_else(monotonic_now_ns);
        let origin = ForkOrigin {
            forked_ns,
            parent_tid,
            parent_cgroup_id: v2_id,
        };
        registry.record_fork(Pid(pid), Pid(parent), origin);
        between(registry);
        let record = ExecRecord {
            cgroup_id: exec_cgroup_id,
            exec_ns: monotonic_now_ns(),
            ..registry_record("sleep")
        };
        registry.record_exec(Pid(pid), Arc::new(record));
        let info = registry.lookup(Pid(pid)).expect("the child's snapshot");
        info.labels.container_id.clone().unwrap_or_default()
    };
    let nothing = |_: &mut ProcessRegistry| {};
    assert_eq!(
        child(&mut registry, 501, 500, 500, v2_id, true, None, &nothing),
        CONTAINER_ID,
        "forked by the main thread: the parent's"
    );
    assert_eq!(registry.stats().cgroups_from_fork, 1);
    assert_eq!(
        child(&mut registry, 502, 501, 9999, v2_id, true, None, &nothing),
        CONTAINER_ID,
        "a child's child, by any thread (all of the child's are where it was forked)"
    );
    assert_eq!(
        child(&mut registry, 503, 500, 9999, v2_id, true, None, &nothing),
        child_container,
        "forked by another thread than the one /proc showed: read"
    );
    assert_eq!(
        child(
            &mut registry,
            504,
            500,
            500,
            v2_id + 1,
            true,
            None,
            &nothing
        ),
        child_container,
        "exec'ed in another v2 cgroup than the parent forked in: read"
    );
    let moved = |registry: &mut ProcessRegistry| {
        registry.note_cgroup_change(Some(Pid(505)), monotonic_now_ns(), None)
    };
    assert_eq!(
        child(&mut registry, 505, 500, 500, v2_id, true, None, &moved),
        child_container,
        "moved after its fork: read"
    );
    assert_eq!(
        child(&mut registry, 506, 500, 500, v2_id, false, None, &nothing),
        CONTAINER_ID,
        "gone before its lookup: the parent's all the same"
    );
    assert_eq!(
        registry.stats().cgroups_from_fork,
        2,
        "/proc read for the gone one"
    );
    // The parent moves. A child it forked before the agent read of the move (whose fork is
    // applied after) takes neither the cgroups known before nor those read at the move: its
    // own are read. One forked since takes those read at the move; and the parent's own
    // snapshot is read again at its next check.
    let third_container = "cd".repeat(32);
    fs::write(root.path().join("500/cgroup"), hybrid(&third_container)).expect("cgroup");
    let moved_ns = monotonic_now_ns();
    let forked_ns = monotonic_now_ns();
    registry.note_cgroup_change(Some(Pid(500)), moved_ns, None);
    assert_eq!(
        child(
            &mut registry,
            507,
            500,
            500,
            v2_id,
            true,
            Some(forked_ns),
            &nothing
        ),
        child_container,
        "forked between its parent's move and the agent's read of it: read"
    );
    assert_eq!(
        child(&mut registry, 508, 500, 500, v2_id, true, None, &nothing),
        third_container,
        "forked after the agent read of the move: the parent's, read then"
    );
    let moved_parent = registry.lookup(Pid(500)).expect("the parent's snapshot");
    assert_eq!(
        moved_parent.labels.container_id.as_deref(),
        Some(third_container.as_str()),
        "the parent's labels after its move"
    );
    assert_eq!(
        child(&mut registry, 509, 501, 9999, v2_id, true, None, &nothing),
        CONTAINER_ID,
        "a move of its parent's parent does not concern a child's child"
    );
    registry.note_cgroup_change(None, monotonic_now_ns(), None);
    assert_eq!(
        child(&mut registry, 510, 501, 9999, v2_id, true, None, &nothing),
        child_container,
        "a cgroup renamed since: read"
    );
    assert_eq!(registry.stats().cgroups_from_fork, 4);

    let mut untracked = fake_registry(root.path(), Duration::ZERO);
    untracked.cgroups = CgroupPaths::with_root(None);
    untracked.lookup(Pid(500)).expect("the parent's snapshot");
    assert_eq!(
        child(&mut untracked, 511, 500, 500, v2_id, true, None, &nothing),
        child_container,
        "moves not traced: read"
    );
}

/// Where the kernel's move event says where the process went (the hierarchy and path), its
/// cgroups after the move are known from the move on, without a read of /proc: a child forked
/// between the move and the agent's read of it, gone before its own lookup, is labelled with
/// the container its parent moved to, and so is the child of a process known only from its
/// events (moved before its first sample, as a container's first process is). A move of one
/// thread, or a destination the agent cannot read as /proc would (another cgroup namespace),
/// leaves the children to read their own.
#[test]
fn a_move_with_its_destination_gives_the_new_cgroups_to_children_forked_after_it() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut registry = fake_registry(root.path(), Duration::ZERO);
    registry.cgroups = CgroupPaths::with_root(None);
    registry.track_cgroup_changes(true);
    let hybrid = |id: &str| format!("4:memory:/docker/{id}\n1:name=systemd:/\n0::/\n");
    let dir = write_fake_process(root.path(), 500, 5000, ANON_MAPS);
    fs::write(dir.join("stat"), stat_line(500, "sleep", 0x0040_0100, 5000)).expect("stat");
    fs::write(dir.join("cgroup"), hybrid(CONTAINER_ID)).expect("cgroup");
    std::os::unix::fs::symlink("/bin/sleep", dir.join("exe")).expect("symlink");
    registry.lookup(Pid(500)).expect("the parent's snapshot");
    let v2_id = 77;
    // A child of `parent` forked now by its main thread, exec'ed and gone before its lookup:
    // its container.
    let gone_child = |registry: &mut ProcessRegistry, pid: u32, parent: u32| {
        let origin = ForkOrigin {
            forked_ns: monotonic_now_ns(),
            parent_tid: parent,
            parent_cgroup_id: v2_id,
        };
        registry.record_fork(Pid(pid), Pid(parent), origin);
        let record = ExecRecord {
            cgroup_id: v2_id,
            exec_ns: monotonic_now_ns(),
            ..registry_record("sleep")
        };
        registry.record_exec(Pid(pid), Arc::new(record));
        let info = registry
            .lookup(Pid(pid))
            .expect("the child from its events");
        info.labels.container_id.clone().unwrap_or_default()
    };
    // The kernel moves every thread of `pid` to `destination` now: the event read, then
    // applied in its turn.
    let move_now = |registry: &mut ProcessRegistry, pid: u32, destination: &CgroupMove| {
        let moved_ns = monotonic_now_ns();
        registry.note_cgroup_change(Some(Pid(pid)), moved_ns, Some(destination));
        registry.apply_cgroup_move(Pid(pid), moved_ns, Some(destination));
    };
    // /proc says yet another container for the parent from now on: what the children get
    // comes from the event, not from a read.
    fs::write(dir.join("cgroup"), hybrid(&"ef".repeat(32))).expect("cgroup");
    let moved_to = |container: &str, threadgroup: bool| CgroupMove {
        tid: 500,
        threadgroup,
        hierarchy_id: 4,
        path: format!("/docker/{container}").into(),
    };
    let second = "cd".repeat(32);
    let destination = moved_to(&second, true);
    move_now(&mut registry, 500, &destination);
    assert_eq!(
        gone_child(&mut registry, 601, 500),
        second,
        "forked after the move, before any read of /proc"
    );
    assert_eq!(registry.stats().cgroups_from_moves, 1);
    assert_eq!(
        gone_child(&mut registry, 602, 601),
        second,
        "the child's child: the cgroups it inherited"
    );
    // 601 is known only from its events; it moves, then forks.
    let third = "ab".repeat(32);
    let destination = CgroupMove {
        tid: 601,
        ..moved_to(&third, true)
    };
    move_now(&mut registry, 601, &destination);
    assert_eq!(
        gone_child(&mut registry, 603, 601),
        third,
        "a process known from its events, moved"
    );
    assert_eq!(registry.stats().cgroups_from_moves, 2);
    // One thread of the parent moves: the destination is not the process's; its cgroups are
    // read at the move, as without a destination.
    let one_thread = moved_to(&third, false);
    move_now(&mut registry, 500, &one_thread);
    assert_eq!(
        gone_child(&mut registry, 604, 500),
        "ef".repeat(32),
        "after a move of one thread: read at the move, not the destination"
    );
    assert_eq!(registry.stats().cgroups_from_moves, 2);
    // In another cgroup namespace a destination is not what /proc says.
    let mut elsewhere = fake_registry(root.path(), Duration::ZERO);
    elsewhere.cgroups = CgroupPaths::with_root(None);
    elsewhere.track_cgroup_changes(false);
    fs::write(dir.join("cgroup"), hybrid(CONTAINER_ID)).expect("cgroup");
    elsewhere.lookup(Pid(500)).expect("the parent's snapshot");
    fs::write(dir.join("cgroup"), hybrid(&"ef".repeat(32))).expect("cgroup");
    let destination = moved_to(&second, true);
    move_now(&mut elsewhere, 500, &destination);
    assert_eq!(
        gone_child(&mut elsewhere, 605, 500),
        "ef".repeat(32),
        "the destination not used: the parent's cgroups read at the move"
    );
    assert_eq!(elsewhere.stats().cgroups_from_moves, 0);
}
