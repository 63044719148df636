use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::{query::Selection, selector::Selector, *};

const CPU: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
const SECOND: i64 = 1_000_000_000;
/// A fixed "now" so retention tests do not depend on the clock.
const NOW: i64 = 1_800_000_000 * SECOND;

fn profile(
    service: &str,
    extra: &[(&str, &str)],
    time_ns: i64,
    stacks: &[(&str, i64)],
) -> NewProfile {
    let mut names: Vec<String> = Vec::new();
    let stacks = stacks
        .iter()
        .map(|(folded, value)| {
            let path = folded
                .split(';')
                .map(|frame| match names.iter().position(|n| n == frame) {
                    Some(i) => i as u32,
                    None => {
                        names.push(frame.to_owned());
                        names.len() as u32 - 1
                    }
                })
                .collect();
            (path, *value)
        })
        .collect();
    let mut labels = vec![("service_name".to_owned(), service.to_owned())];
    labels.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    NewProfile {
        profile_type: Some(ProfileType::parse(CPU).unwrap()),
        labels,
        time_ns,
        duration_ns: 10 * SECOND,
        names,
        stacks,
    }
}

fn selection(selector: &str, start_ns: i64, end_ns: i64) -> Selection {
    Selection {
        profile_type: CPU.into(),
        selector: Selector::parse(selector).unwrap(),
        start_ns,
        end_ns,
    }
}

fn open(dir: &Path) -> Store {
    Store::open(StoreSettings::new(dir)).unwrap()
}

#[test]
fn merges_profiles_of_a_service_across_series_and_time() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store
        .ingest(&[
            profile(
                "api",
                &[("host", "a")],
                NOW,
                &[("main;work", 30), ("main;idle", 10)],
            ),
            profile(
                "api",
                &[("host", "b")],
                NOW + SECOND,
                &[("main;work", 5), ("main", 1)],
            ),
            profile("db", &[], NOW, &[("main;query", 100)]),
        ])
        .unwrap();
    store
        .ingest(&[profile(
            "api",
            &[("host", "a")],
            NOW + 60 * SECOND,
            &[("main;work;inner", 7)],
        )])
        .unwrap();

    let tree = store
        .merge(&selection(
            r#"{service_name="api"}"#,
            NOW,
            NOW + 60 * SECOND,
        ))
        .unwrap();
    assert_eq!(tree.total(), 53);
    assert_eq!(
        tree.folded(),
        vec![
            ("main".to_owned(), 1),
            ("main;idle".to_owned(), 10),
            ("main;work".to_owned(), 35),
            ("main;work;inner".to_owned(), 7),
        ]
    );
    // Time range and label selector both narrow it.
    let early = store
        .merge(&selection(
            r#"{service_name="api", host="a"}"#,
            NOW,
            NOW + SECOND,
        ))
        .unwrap();
    assert_eq!(early.total(), 40);
    assert_eq!(
        store
            .merge(&selection("{}", NOW - 10, NOW - 1))
            .unwrap()
            .total(),
        0
    );

    assert_eq!(
        store.label_values("service_name", &[], None),
        vec!["api", "db"]
    );
    let names = store.label_names(&[Selector::parse(r#"{service_name="db"}"#).unwrap()], None);
    assert!(names.contains(&"__profile_type__".to_owned()), "{names:?}");
    assert!(!names.contains(&"host".to_owned()), "{names:?}");
    let totals = store
        .totals(&selection(r#"{service_name="api"}"#, 0, i64::MAX))
        .unwrap();
    let points: Vec<(i64, i64)> = totals.into_iter().flat_map(|(_, p)| p).collect();
    assert_eq!(points.len(), 3);
}

#[test]
fn survives_reopen_and_keeps_interning() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        store
            .ingest(&[profile("api", &[], NOW, &[("a;b;c", 3)])])
            .unwrap();
    }
    let store = open(dir.path());
    store
        .ingest(&[profile("api", &[], NOW + 1, &[("a;b;c", 4), ("a;b;d", 1)])])
        .unwrap();
    let tree = store.merge(&selection("{}", 0, i64::MAX)).unwrap();
    assert_eq!(
        tree.folded(),
        vec![("a;b;c".to_owned(), 7), ("a;b;d".to_owned(), 1)]
    );
    assert_eq!(store.series(None).len(), 1);
}

#[test]
fn node_rows_of_older_stores_become_blocks() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        // Two writes: two blocks for `api`, one for `web`.
        store
            .ingest(&[
                profile("api", &[], NOW, &[("a;b;c", 3)]),
                profile("web", &[], NOW, &[("x;y", 1)]),
            ])
            .unwrap();
        store
            .ingest(&[profile("api", &[], NOW + 1, &[("a;b;d", 1), ("e", 2)])])
            .unwrap();
    }
    // Rewrite the file as the one-row-per-node layout stores used before node blocks.
    {
        let conn = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        conn.execute_batch(
            "CREATE TABLE nodes(space_id INTEGER NOT NULL, idx INTEGER NOT NULL, \
             parent INTEGER NOT NULL, name_id INTEGER NOT NULL, PRIMARY KEY(space_id, idx)) \
             WITHOUT ROWID;",
        )
        .unwrap();
        let blocks: Vec<(i64, i64, Vec<u8>)> = conn
            .prepare("SELECT space_id, first_idx, nodes FROM node_blocks")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(blocks.len(), 3, "{blocks:?}");
        for (space, first, bytes) in blocks {
            let mut idx = first;
            codec::decode_nodes(first as usize, &bytes, |parent, name| {
                conn.execute(
                    "INSERT INTO nodes VALUES (?, ?, ?, ?)",
                    params![space, idx, parent, name],
                )
                .unwrap();
                idx += 1;
            })
            .unwrap();
        }
        conn.execute_batch("DROP TABLE node_blocks;").unwrap();
    }
    let store = open(dir.path());
    let tree = store.merge(&selection("{}", 0, i64::MAX)).unwrap();
    assert_eq!(
        tree.folded(),
        vec![
            ("a;b;c".to_owned(), 3),
            ("a;b;d".to_owned(), 1),
            ("e".to_owned(), 2),
            ("x;y".to_owned(), 1)
        ]
    );
    // New nodes continue after the converted ones.
    store
        .ingest(&[profile("api", &[], NOW + 2, &[("a;f", 5)])])
        .unwrap();
    drop(store);
    let store = open(dir.path());
    let tree = store
        .merge(&selection(r#"{service_name="api"}"#, 0, i64::MAX))
        .unwrap();
    assert_eq!(
        tree.folded(),
        vec![
            ("a;b;c".to_owned(), 3),
            ("a;b;d".to_owned(), 1),
            ("a;f".to_owned(), 5),
            ("e".to_owned(), 2),
        ]
    );
}

#[test]
fn a_gap_between_node_blocks_is_reported_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        store
            .ingest(&[profile("api", &[], NOW, &[("a;b", 1)])])
            .unwrap();
        store
            .ingest(&[profile("api", &[], NOW + 1, &[("a;c", 1)])])
            .unwrap();
    }
    let conn = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
    conn.execute("DELETE FROM node_blocks WHERE first_idx = 1", [])
        .unwrap();
    drop(conn);
    let err = Store::open(StoreSettings::new(dir.path())).err().unwrap();
    assert!(err.to_string().contains("node blocks"), "{err}");
}

#[test]
fn retention_and_size_cap_delete_the_oldest() {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = StoreSettings::new(dir.path());
    settings.retention = Duration::from_secs(3600);
    let store = Store::open(settings).unwrap();
    store
        .ingest(&[profile("old", &[], NOW - 7200 * SECOND, &[("a", 1)])])
        .unwrap();
    store
        .ingest(&[profile("new", &[], NOW - 60 * SECOND, &[("a", 1)])])
        .unwrap();
    assert_eq!(store.enforce_limits_at(NOW).unwrap(), 1);
    assert_eq!(store.label_values("service_name", &[], None), vec!["new"]);
    drop(store);

    // A cap far below the data: the oldest go first until it fits.
    let mut settings = StoreSettings::new(dir.path());
    settings.max_bytes = 400 << 10;
    let store = Store::open(settings).unwrap();
    let big: Vec<(String, i64)> = (0..2000)
        .map(|i| (format!("main;f{i};g{}", i * 7), i + 1))
        .collect();
    let stacks: Vec<(&str, i64)> = big.iter().map(|(s, v)| (s.as_str(), *v)).collect();
    for i in 0..100 {
        store
            .ingest(&[profile("new", &[], NOW + i * SECOND, &stacks)])
            .unwrap();
    }
    assert!(store.used_bytes().unwrap() > 400 << 10);
    let deleted = store.enforce_limits_at(NOW).unwrap();
    assert!(deleted > 0 && deleted < 101, "{deleted}");
    assert!(store.used_bytes().unwrap() <= 400 << 10);
    let remaining = store.totals(&selection("{}", 0, i64::MAX)).unwrap();
    let times: Vec<i64> = remaining
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(t, _)| *t))
        .collect();
    assert_eq!(
        *times.last().unwrap(),
        NOW + 99 * SECOND,
        "the newest stays"
    );
    assert_eq!(times.len() as u64, 101 - deleted);
}

#[test]
fn a_failed_write_leaves_no_trace() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store
        .ingest(&[profile("api", &[], NOW, &[("a;b", 1)])])
        .unwrap();
    let writer = store.inner.writer.lock().unwrap();
    writer.pragma_update(None, "query_only", true).unwrap();
    drop(writer);
    assert!(
        store
            .ingest(&[profile("other", &[], NOW, &[("x;y", 1), ("a;c", 2)])])
            .is_err()
    );
    assert_eq!(store.counters().ingest_errors.load(Ordering::Relaxed), 1);
    store
        .inner
        .writer
        .lock()
        .unwrap()
        .pragma_update(None, "query_only", false)
        .unwrap();
    assert_eq!(store.label_values("service_name", &[], None), vec!["api"]);
    store
        .ingest(&[profile("api", &[], NOW + 1, &[("a;c", 2)])])
        .unwrap();
    drop(store);
    let store = open(dir.path());
    let tree = store.merge(&selection("{}", 0, i64::MAX)).unwrap();
    assert_eq!(
        tree.folded(),
        vec![("a;b".to_owned(), 1), ("a;c".to_owned(), 2)]
    );
}

#[test]
fn concurrent_ingest_and_queries() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let service = format!("svc{w}");
                    store
                        .ingest(&[profile(
                            &service,
                            &[],
                            NOW + i,
                            &[("main;work", 1), (&format!("main;f{i}"), 1)],
                        )])
                        .unwrap();
                }
            })
        })
        .collect();
    let reader = {
        let store = store.clone();
        std::thread::spawn(move || {
            let mut last = 0;
            for _ in 0..100 {
                let total = store.merge(&selection("{}", 0, i64::MAX)).unwrap().total();
                assert!(total >= last, "totals only grow: {total} < {last}");
                last = total;
            }
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    reader.join().unwrap();
    assert_eq!(
        store.merge(&selection("{}", 0, i64::MAX)).unwrap().total(),
        300
    );
}

const CRASH_DIR_ENV: &str = "PROFILER_STORE_CRASH_TEST_DIR";

/// The child side of the crash test: ingests forever, printing each acknowledged sequence number.
fn crash_child_ingest_loop(dir: &Path) -> ! {
    let store = open(dir);
    let stacks: Vec<(String, i64)> = (0..300)
        .map(|i| (format!("main;f{};g{i}", i % 17), 10))
        .collect();
    for seq in 0i64.. {
        let mut stacks: Vec<(&str, i64)> = stacks.iter().map(|(s, v)| (s.as_str(), *v)).collect();
        let unique = format!("main;seq{seq}");
        stacks.push((&unique, 1));
        store
            .ingest(&[profile("crash", &[], NOW + seq, &stacks)])
            .unwrap();
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "acked {seq}").unwrap();
        out.flush().unwrap();
    }
    unreachable!("the ingest loop only ends when the parent kills it")
}

#[test]
fn acknowledged_profiles_survive_sigkill() {
    // The same test binary, re-run with the directory set, is the child that gets killed.
    if let Some(dir) = std::env::var_os(CRASH_DIR_ENV) {
        crash_child_ingest_loop(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut acknowledged = -1i64;
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "store::tests::acknowledged_profiles_survive_sigkill",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_DIR_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let started = Instant::now();
        let target = 100 + round * 37;
        let mut seen_this_round = 0;
        for line in lines {
            let line = line.unwrap();
            if let Some(seq) = line.strip_prefix("acked ") {
                acknowledged = acknowledged.max(seq.parse().unwrap());
                seen_this_round += 1;
                if seen_this_round >= target {
                    break;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "child too slow"
            );
        }
        // SIGKILL while the child is in the middle of its next write.
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(seen_this_round >= target, "child stopped early");

        let store = open(dir.path());
        let integrity: String = store
            .with_reader(|c| Ok(c.query_row("PRAGMA integrity_check", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(integrity, "ok");
        // Sequence numbers restart per child; each round's acknowledged ones must all be there.
        let tree = store.merge(&selection("{}", 0, i64::MAX)).unwrap();
        let present: std::collections::HashSet<String> =
            tree.folded().into_iter().map(|(s, _)| s).collect();
        for seq in 0..seen_this_round {
            assert!(
                present.contains(&format!("main;seq{seq}")),
                "acknowledged profile {seq} lost in round {round}"
            );
        }
    }
}
