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
        period: 0,
        names,
        frames: Vec::new(),
        stacks,
        spans: Vec::new(),
        labelled: Vec::new(),
    }
}

fn selection(selector: &str, start_ns: i64, end_ns: i64) -> Selection {
    Selection::new(
        CPU.into(),
        Selector::parse(selector).unwrap(),
        start_ns,
        end_ns,
    )
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
    // Damaged: moved aside, and a fresh store starts.
    let store = open(dir.path());
    assert_eq!(
        store
            .counters()
            .databases_quarantined
            .load(Ordering::Relaxed),
        1
    );
    assert!(store.series(None).is_empty());
    assert!(
        quarantined_files(dir.path())
            .iter()
            .any(|name| name.starts_with("profiles.db.corrupt-") && !name.ends_with("-wal"))
    );
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

fn open_limited(dir: &Path, limits: StoreLimits) -> Store {
    Store::open_with(
        StoreSettings::new(dir),
        StoreOptions {
            limits,
            ..StoreOptions::default()
        },
    )
    .unwrap()
}

fn limit_of(result: Result<(), StoreError>) -> Limit {
    match result {
        Err(StoreError::Limit(err)) => {
            let message = err.to_string();
            assert!(!message.contains('\n'), "{message}");
            assert!(
                message.contains(err.limit().name().replace('_', "-").as_str()),
                "{message}"
            );
            err.limit()
        }
        other => panic!("expected a limit error, got {other:?}"),
    }
}

#[test]
fn cardinality_limits_refuse_new_series_only() {
    let dir = tempfile::tempdir().unwrap();
    let limits = StoreLimits {
        max_services: 2,
        max_series: 5,
        max_series_per_service: 3,
        max_label_values_per_name: 2,
        ..StoreLimits::default()
    };
    let store = open_limited(dir.path(), limits.clone());
    let one =
        |service: &str, pod: &str, t: i64| profile(service, &[("pod", pod)], t, &[("a;b", 1)]);
    store
        .ingest(&[one("a", "p1", NOW), one("a", "p2", NOW)])
        .unwrap();
    // A third value of `pod` in service a.
    assert_eq!(
        limit_of(store.ingest(&[one("a", "p3", NOW)])),
        Limit::LabelValuesPerName
    );
    // Without the label it is a third series, within the per-service limit.
    store
        .ingest(&[profile("a", &[], NOW, &[("a;b", 1)])])
        .unwrap();
    assert_eq!(
        limit_of(store.ingest(&[profile("a", &[("x", "1")], NOW, &[("a;b", 1)])])),
        Limit::SeriesPerService
    );
    store.ingest(&[one("b", "p1", NOW)]).unwrap();
    assert_eq!(
        limit_of(store.ingest(&[one("c", "p1", NOW)])),
        Limit::Services
    );
    store.ingest(&[one("b", "p2", NOW)]).unwrap();
    // Five series now: a sixth is refused even in a service with room.
    assert_eq!(
        limit_of(store.ingest(&[profile("b", &[], NOW, &[("a;b", 1)])])),
        Limit::Series
    );
    // A push with one acceptable and one refused profile stores neither, and undoes the first
    // one's catalog entries: existing series still take profiles, nothing stored is lost.
    assert_eq!(
        limit_of(store.ingest(&[one("a", "p1", NOW + 1), one("c", "p1", NOW + 1)])),
        Limit::Services
    );
    store
        .ingest(&[one("a", "p1", NOW + 2), one("b", "p2", NOW + 2)])
        .unwrap();
    let counters = store.counters();
    assert_eq!(counters.limit_rejections.get(Limit::Services), 2);
    assert_eq!(counters.limit_rejections.get(Limit::Series), 1);
    assert_eq!(counters.limit_rejections.get(Limit::SeriesPerService), 1);
    assert_eq!(counters.limit_rejections.get(Limit::LabelValuesPerName), 1);
    assert_eq!(counters.profiles_ingested.load(Ordering::Relaxed), 7);
    let metrics = counters.metric_values();
    assert!(
        metrics.contains(&(
            "profiler_store_limit_rejections_total{limit=\"max_services\"}".to_owned(),
            "Writes refused by a store limit (--max-services, --max-series...).",
            "counter",
            2.0
        )),
        "{metrics:?}"
    );
    assert_eq!(store.series(None).len(), 5);
    assert_eq!(
        store.merge(&selection("{}", 0, i64::MAX)).unwrap().total(),
        7
    );
    // The counts come back with the catalog after a restart.
    drop(store);
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_series: 0,
            max_series_per_service: 0,
            ..limits
        },
    );
    assert_eq!(
        limit_of(store.ingest(&[one("c", "p1", NOW)])),
        Limit::Services
    );
    assert_eq!(
        limit_of(store.ingest(&[one("a", "p9", NOW)])),
        Limit::LabelValuesPerName
    );
    store.ingest(&[one("a", "p2", NOW + 3)]).unwrap();
    // Retention frees room: the series and values of deleted profiles no longer count.
    store.enforce_limits_at(NOW + 8 * 86_400 * SECOND).unwrap();
    assert!(store.series(None).is_empty());
    store
        .ingest(&[one("c", "p1", NOW), one("d", "p1", NOW)])
        .unwrap();
}

#[test]
fn label_count_and_length_limits_are_client_errors() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_label_names_per_series: 3,
            max_label_name_length: 12,
            max_label_value_length: 10,
            ..StoreLimits::default()
        },
    );
    let with = |labels: &[(&str, &str)]| profile("svc", labels, NOW, &[("a", 1)]);
    // service_name + 2 labels = 3: fine; the derived `__*__` labels do not count.
    store.ingest(&[with(&[("a", "1"), ("b", "2")])]).unwrap();
    for (labels, limit) in [
        (
            vec![("a", "1"), ("b", "2"), ("c", "3")],
            Limit::LabelNamesPerSeries,
        ),
        (vec![("very_long_name", "1")], Limit::LabelNameLength),
        (vec![("a", "a value too long")], Limit::LabelValueLength),
    ] {
        let err = store.ingest(&[with(&labels)]).unwrap_err();
        assert!(err.is_client_error(), "{err}");
        assert_eq!(limit_of(Err(err)), limit);
        assert_eq!(store.counters().limit_rejections.get(limit), 1);
    }
    assert_eq!(store.profile_count().unwrap(), 1);
}

#[test]
fn deep_stacks_are_cut_under_a_truncated_frame() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_stack_depth: 3,
            ..StoreLimits::default()
        },
    );
    store
        .ingest(&[profile("svc", &[], NOW, &[("a;b;c;d;e", 5), ("a;b;c", 1)])])
        .unwrap();
    let tree = store.merge(&selection("{}", 0, i64::MAX)).unwrap();
    assert_eq!(
        tree.folded(),
        vec![("[truncated];d;e".to_owned(), 5), ("a;b;c".to_owned(), 1)]
    );
    assert_eq!(store.counters().stacks_truncated.load(Ordering::Relaxed), 1);
}

#[test]
fn huge_values_saturate_and_negative_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let big = 1i64 << 62;
    // Four samples of 2^62 in one profile, and four profiles of 2^62: never wrapped to 0.
    store
        .ingest(&[profile(
            "one",
            &[],
            NOW,
            &[("a;b", big), ("a;b", big), ("a;c", big), ("a;c", big)],
        )])
        .unwrap();
    let profiles: Vec<NewProfile> = (0..4)
        .map(|i| profile("many", &[], NOW + i, &[("a;b", big)]))
        .collect();
    store.ingest(&profiles).unwrap();
    for service in ["one", "many"] {
        let tree = store
            .merge(&selection(
                &format!("{{service_name=\"{service}\"}}"),
                0,
                i64::MAX,
            ))
            .unwrap();
        assert_eq!(tree.total(), i64::MAX, "{service}");
        assert!(tree.nodes.iter().all(|n| n.total >= 0 && n.self_value >= 0));
    }
    let totals = store.totals(&selection("{}", 0, i64::MAX)).unwrap();
    assert!(
        totals
            .iter()
            .flat_map(|(_, p)| p)
            .all(|&(_, total)| total > 0)
    );

    let err = store
        .ingest(&[profile("neg", &[], NOW, &[("a", 5), ("b", -1)])])
        .unwrap_err();
    assert!(
        matches!(err, StoreError::NegativeValue { value: -1 }),
        "{err}"
    );
    assert!(err.is_client_error());
    assert_eq!(
        store
            .counters()
            .negative_values_rejected
            .load(Ordering::Relaxed),
        1
    );
    assert_eq!(
        store.label_values("service_name", &[], None),
        vec!["many", "one"]
    );
}

/// Fills a store with enough profiles for a few hundred pages, and returns its file.
fn filled_store(dir: &Path) -> PathBuf {
    let store = open(dir);
    for i in 0..200 {
        let stacks: Vec<(String, i64)> = (0..200)
            .map(|k| (format!("main;f{i};g{k}"), k + 1))
            .collect();
        let stacks: Vec<(&str, i64)> = stacks.iter().map(|(s, v)| (s.as_str(), *v)).collect();
        store
            .ingest(&[profile("svc", &[("i", &i.to_string())], NOW + i, &stacks)])
            .unwrap();
    }
    let path = store.database_path().to_owned();
    drop(store);
    path
}

fn quarantined_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".corrupt-"))
        .collect();
    names.sort();
    names
}

#[test]
fn a_corrupt_database_is_moved_aside_and_replaced() {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let path = filled_store(dir.path());
    let len = std::fs::metadata(&path).unwrap().len();
    assert!(len > 64 * 4096, "{len}");
    let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.seek(SeekFrom::Start((len / 4096 / 2) * 4096)).unwrap();
    file.write_all(&[0xa5; 4096]).unwrap();
    drop(file);

    let store = open(dir.path());
    assert_eq!(
        store
            .counters()
            .databases_quarantined
            .load(Ordering::Relaxed),
        1
    );
    assert!(store.series(None).is_empty());
    store
        .ingest(&[profile("fresh", &[], NOW, &[("a;b", 1)])])
        .unwrap();
    assert_eq!(
        store.merge(&selection("{}", 0, i64::MAX)).unwrap().total(),
        1
    );
    let kept = quarantined_files(dir.path());
    // The database with its -wal and -shm files.
    assert!((1..=3).contains(&kept.len()), "{kept:?}");
    assert!(kept[0].starts_with("profiles.db.corrupt-2"), "{kept:?}");
    assert!(
        kept.iter().all(|name| name.starts_with(&kept[0])),
        "{kept:?}"
    );
    assert_eq!(
        std::fs::metadata(dir.path().join(&kept[0])).unwrap().len(),
        len
    );
    drop(store);
    // The fresh store is healthy: it reopens as it is.
    let store = open(dir.path());
    assert_eq!(
        store
            .counters()
            .databases_quarantined
            .load(Ordering::Relaxed),
        0
    );
    assert_eq!(store.label_values("service_name", &[], None), vec!["fresh"]);
}

#[test]
fn a_file_that_is_not_a_database_is_moved_aside_with_its_wal() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("profiles.db"), vec![0x42u8; 3 * 4096]).unwrap();
    std::fs::write(dir.path().join("profiles.db-wal"), b"junk").unwrap();
    let store = open(dir.path());
    assert_eq!(
        store
            .counters()
            .databases_quarantined
            .load(Ordering::Relaxed),
        1
    );
    store
        .ingest(&[profile("fresh", &[], NOW, &[("a", 1)])])
        .unwrap();
    let kept = quarantined_files(dir.path());
    assert!(
        kept.iter().all(|name| name.starts_with(&kept[0])),
        "{kept:?}"
    );
    let wal = kept
        .iter()
        .find(|name| name.ends_with("-wal"))
        .expect("the WAL kept");
    assert_eq!(std::fs::read(dir.path().join(wal)).unwrap(), b"junk");
    let db = std::fs::read(dir.path().join(&kept[0])).unwrap();
    assert_eq!(db, vec![0x42u8; 3 * 4096]);
}

#[test]
fn an_unusable_directory_is_an_error_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = Store::open(StoreSettings::new(&file)).err().unwrap();
    let message = err.to_string();
    assert!(
        message.contains("cannot open the profile store"),
        "{message}"
    );
    assert!(!err.is_corruption());
    assert!(std::error::Error::source(&err).is_some());
}

#[test]
fn disk_full_is_counted_and_the_write_undone() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store
        .ingest(&[profile("svc", &[], NOW, &[("a", 1)])])
        .unwrap();
    {
        let writer = store.inner.writer.lock().unwrap();
        let pages: i64 = writer
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .unwrap();
        writer.pragma_update(None, "max_page_count", pages).unwrap();
    }
    let stacks: Vec<String> = (0..5000)
        .map(|k| format!("main;function_number_{k}"))
        .collect();
    let stacks: Vec<(&str, i64)> = stacks.iter().map(|s| (s.as_str(), 1)).collect();
    let err = store
        .ingest(&[profile("svc", &[], NOW + 1, &stacks)])
        .unwrap_err();
    assert!(err.is_disk_full(), "{err}");
    let err = store
        .ingest(&[profile("svc", &[], NOW + 2, &stacks)])
        .unwrap_err();
    assert!(err.is_disk_full(), "{err}");
    assert_eq!(store.counters().disk_full_errors.load(Ordering::Relaxed), 2);
    // Space returns: ingest resumes.
    store
        .inner
        .writer
        .lock()
        .unwrap()
        .pragma_update(None, "max_page_count", 1i64 << 30)
        .unwrap();
    store
        .ingest(&[profile("svc", &[], NOW + 3, &stacks)])
        .unwrap();
    assert_eq!(store.profile_count().unwrap(), 2);
}

#[test]
fn utc_stamps() {
    let at = |secs: u64| utc_stamp(UNIX_EPOCH + Duration::from_secs(secs));
    assert_eq!(at(0), "19700101T000000Z");
    assert_eq!(at(1_800_000_000), "20270115T080000Z");
    assert_eq!(at(951_782_400 + 86_399), "20000229T235959Z");
}

#[test]
fn limit_flags_parse_from_the_environment() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        limits: limits::StoreLimitArgs,
    }
    let defaults = Cli::try_parse_from(["profiler"]).unwrap().limits;
    assert_eq!(defaults.limits(), StoreLimits::default());
    assert!(!defaults.no_store_check);
    let set = Cli::try_parse_from([
        "profiler",
        "--max-series-per-service",
        "7",
        "--max-services",
        "0",
    ])
    .unwrap()
    .limits
    .limits();
    assert_eq!((set.max_series_per_service, set.max_services), (7, 0));
}

/// A query over more call-tree nodes than `--max-query-nodes` is refused before it allocates,
/// counted, and answered as the client's error; a smaller one still merges.
#[test]
fn queries_over_the_node_limit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_query_nodes: 6,
            ..StoreLimits::default()
        },
    );
    // "small": root + a + b = 3 nodes; "big": root + 4 distinct leaves under x = 6 nodes.
    store
        .ingest(&[
            profile("small", &[], NOW, &[("a;b", 1)]),
            profile(
                "big",
                &[],
                NOW,
                &[("x;1", 1), ("x;2", 1), ("x;3", 1), ("x;4", 1)],
            ),
        ])
        .unwrap();
    let window = |selector| selection(selector, NOW - SECOND, NOW + SECOND);
    assert_eq!(
        store
            .merge(&window(r#"{service_name="small"}"#))
            .unwrap()
            .total(),
        1
    );
    assert_eq!(
        store
            .merge(&window(r#"{service_name="big"}"#))
            .unwrap()
            .total(),
        4
    );
    let error = store.merge(&window("{}")).unwrap_err();
    assert!(
        matches!(error, StoreError::QueryTooLarge { nodes: 9, limit: 6 }),
        "{error}"
    );
    assert!(error.is_client_error());
    assert!(error.to_string().contains("--max-query-nodes"), "{error}");
    assert_eq!(
        store.counters().queries_too_large.load(Ordering::Relaxed),
        1
    );
}

/// A service with off-CPU profiles gets a wall view: its CPU and off-CPU time in one tree. A
/// service with a `wall` profile of its own keeps it, and one without off-CPU data has none.
#[test]
fn wall_view_adds_cpu_and_off_cpu_time_of_a_service() {
    use super::query::{OFF_CPU_TYPE, WALL_TYPE};
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let of_type = |mut profile: NewProfile, id: &str| {
        profile.profile_type = Some(ProfileType::parse(id).unwrap());
        profile
    };
    store
        .ingest(&[
            profile("api", &[], NOW, &[("main;handle;parse", 30_000_000)]),
            of_type(
                profile(
                    "api",
                    &[],
                    NOW,
                    &[("main;handle;recv;__schedule", 70_000_000)],
                ),
                OFF_CPU_TYPE,
            ),
            // Only CPU data: no wall view.
            profile("batch", &[], NOW, &[("main;crunch", 10_000_000)]),
            // Its own wall profile (an SDK's), and off-CPU data too: its own is kept alone.
            of_type(profile("java", &[], NOW, &[("main;run", 5)]), WALL_TYPE),
            of_type(profile("java", &[], NOW, &[("main;wait", 7)]), OFF_CPU_TYPE),
            profile("java", &[], NOW, &[("main;spin", 11)]),
        ])
        .unwrap();
    let wall = |service: &str| {
        store
            .merge(&Selection::new(
                WALL_TYPE.into(),
                Selector::parse(&format!("{{service_name=\"{service}\"}}")).unwrap(),
                NOW - SECOND,
                NOW + SECOND,
            ))
            .unwrap()
    };
    let api = wall("api");
    assert_eq!(api.total(), 100_000_000);
    let folded = api.folded();
    assert!(folded.contains(&("main;handle;parse".to_owned(), 30_000_000)));
    assert!(folded.contains(&("main;handle;recv;__schedule".to_owned(), 70_000_000)));
    assert_eq!(wall("batch").total(), 0);
    assert_eq!(wall("java").folded(), vec![("main;run".to_owned(), 5)]);
}

#[test]
fn sqlite_memory_is_bounded_per_connection_and_in_all() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    // A negative argument reads the limit without changing it.
    // SAFETY: a read of a process-wide setting.
    let limit = unsafe { rusqlite::ffi::sqlite3_soft_heap_limit64(-1) };
    assert_eq!(limit, SQLITE_SOFT_HEAP_LIMIT_BYTES);
    let writer_cache: i64 = store
        .inner
        .writer
        .lock()
        .unwrap()
        .pragma_query_value(None, "cache_size", |row| row.get(0))
        .unwrap();
    let reader_cache = store
        .with_reader(|conn| {
            Ok(conn.pragma_query_value(None, "cache_size", |row| row.get::<_, i64>(0))?)
        })
        .unwrap();
    assert_eq!(writer_cache, WRITER_CACHE_KIB);
    assert_eq!(reader_cache, READER_CACHE_KIB);
}

#[test]
fn a_call_site_keeps_only_the_stacks_that_start_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store
        .ingest(&[
            profile(
                "api",
                &[],
                NOW,
                &[
                    ("main;work;inner", 7),
                    ("main;work", 5),
                    ("main;idle;work", 11),
                    ("main", 1),
                    ("other;main;work", 13),
                ],
            ),
            profile("api", &[], NOW + SECOND, &[("main;work;leaf", 2)]),
        ])
        .unwrap();
    let at = |call_site: &[&str]| {
        let mut selection = selection(r#"{service_name="api"}"#, NOW, NOW + SECOND);
        selection.call_site = call_site.iter().map(|name| name.to_string()).collect();
        selection
    };

    let tree = store.merge(&at(&["main", "work"])).unwrap();
    assert_eq!(tree.total(), 14);
    assert_eq!(
        tree.folded(),
        vec![
            ("main;work".to_owned(), 5),
            ("main;work;inner".to_owned(), 7),
            ("main;work;leaf".to_owned(), 2),
        ]
    );
    let points: Vec<(i64, i64)> = store
        .totals(&at(&["main", "work"]))
        .unwrap()
        .into_iter()
        .flat_map(|(_, points)| points)
        .collect();
    assert_eq!(points, vec![(NOW, 12), (NOW + SECOND, 2)]);

    // Not a prefix of any stack, or a name never stored: nothing.
    assert_eq!(store.merge(&at(&["work"])).unwrap().total(), 0);
    assert_eq!(store.merge(&at(&["main", "nowhere"])).unwrap().total(), 0);
    // No call site: everything.
    assert_eq!(store.merge(&at(&[])).unwrap().total(), 39);
}

/// A sample of [`labelled_pprof`]: root-first folded stack, value, string labels.
type LabelledSample<'a> = (&'a str, i64, &'a [(&'a str, &'a str)]);

/// A CPU pprof of the given samples.
fn labelled_pprof(samples: &[LabelledSample]) -> crate::wire::proto::Profile {
    use crate::wire::proto;
    let mut strings = vec![String::new()];
    let mut string = |text: &str| -> i64 {
        match strings.iter().position(|s| s == text) {
            Some(i) => i as i64,
            None => {
                strings.push(text.to_owned());
                strings.len() as i64 - 1
            }
        }
    };
    let sample_type = proto::ValueType {
        r#type: string("cpu"),
        unit: string("nanoseconds"),
    };
    let mut functions: Vec<proto::Function> = Vec::new();
    let mut out_samples = Vec::new();
    for (folded, value, labels) in samples {
        let mut location_id = Vec::new();
        for frame in folded.split(';') {
            let name = string(frame);
            let id = match functions.iter().find(|f| f.name == name) {
                Some(f) => f.id,
                None => {
                    let id = functions.len() as u64 + 1;
                    functions.push(proto::Function {
                        id,
                        name,
                        ..Default::default()
                    });
                    id
                }
            };
            location_id.push(id);
        }
        location_id.reverse();
        out_samples.push(proto::Sample {
            location_id,
            value: vec![*value],
            label: labels
                .iter()
                .map(|(k, v)| proto::Label {
                    key: string(k),
                    str: string(v),
                    ..Default::default()
                })
                .collect(),
        });
    }
    let location = functions
        .iter()
        .map(|f| proto::Location {
            id: f.id,
            line: vec![proto::Line {
                function_id: f.id,
                ..Default::default()
            }],
            ..Default::default()
        })
        .collect();
    proto::Profile {
        period_type: Some(sample_type.clone()),
        sample_type: vec![sample_type],
        sample: out_samples,
        location,
        function: functions,
        string_table: strings,
        time_nanos: NOW,
        ..Default::default()
    }
}

/// Frames that differ only in line or address are apart in a download's tree, and merged by
/// name in every other query exactly as if only names had been stored.
#[test]
fn frames_of_one_name_merge_like_names() {
    use crate::wire::proto;
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    // Stacks of six functions; each frame at one of three lines, each line at its address.
    let mut stacks: Vec<(Vec<(u64, u64)>, i64)> = Vec::new();
    for _ in 0..300 {
        let depth = 1 + next(6) as usize;
        let path = (0..depth).map(|_| (next(6), next(3))).collect();
        stacks.push((path, 10 * (1 + next(4) as i64)));
    }
    let name = |f: u64| format!("fn{f}");
    let mut strings = vec![String::new(), "/bin/app".to_owned(), "app.c".to_owned()];
    strings.extend((0..6).map(name));
    let functions = (0..6)
        .map(|f| proto::Function {
            id: f + 1,
            name: 3 + f as i64,
            filename: 2,
            ..Default::default()
        })
        .collect();
    let location = |f: u64, line: u64| proto::Location {
        id: 1 + f * 3 + line,
        mapping_id: 1,
        address: 0x1000 + f * 0x100 + line * 0x10,
        line: vec![proto::Line {
            function_id: f + 1,
            line: 10 + line as i64,
            column: 0,
        }],
        is_folded: false,
    };
    let pprof = proto::Profile {
        sample_type: vec![proto::ValueType { r#type: 0, unit: 0 }],
        sample: stacks
            .iter()
            .map(|(path, value)| proto::Sample {
                location_id: path.iter().rev().map(|&(f, l)| 1 + f * 3 + l).collect(),
                value: vec![*value],
                label: Vec::new(),
            })
            .collect(),
        mapping: vec![proto::Mapping {
            id: 1,
            memory_start: 0x1000,
            memory_limit: 0x2000,
            filename: 1,
            ..Default::default()
        }],
        location: (0..6)
            .flat_map(|f| (0..3).map(move |l| location(f, l)))
            .collect(),
        function: functions,
        string_table: strings,
        ..Default::default()
    };
    let labels = [("service_name".to_owned(), "frames".to_owned())];
    let mut with_frames = ingest::profiles_from_pprof(&pprof, "process_cpu", &labels, NOW).unwrap();
    with_frames[0].profile_type = Some(ProfileType::parse(CPU).unwrap());
    store.ingest(&with_frames).unwrap();
    let folded: Vec<(String, i64)> = stacks
        .iter()
        .map(|(path, value)| {
            let names: Vec<String> = path.iter().map(|&(f, _)| name(f)).collect();
            (names.join(";"), *value)
        })
        .collect();
    let folded: Vec<(&str, i64)> = folded.iter().map(|(s, v)| (s.as_str(), *v)).collect();
    store
        .ingest(&[profile("names", &[], NOW, &folded)])
        .unwrap();

    let of = |service: &str| selection(&format!(r#"{{service_name="{service}"}}"#), 0, i64::MAX);
    let by_name = store.merge(&of("frames")).unwrap();
    assert_eq!(
        by_name.folded(),
        store.merge(&of("names")).unwrap().folded()
    );
    assert!(by_name.frames.is_empty());
    let detailed = store.merge_with_frames(&of("frames")).unwrap();
    assert_eq!(detailed.total(), by_name.total());
    assert!(detailed.nodes.len() > by_name.nodes.len());
    // Each detailed node is one frame: line and address agree with the pprof's locations.
    for node in &detailed.nodes[1..] {
        let frame = &detailed.frames[node.frame as usize];
        let f: u64 = frame.name.trim_start_matches("fn").parse().unwrap();
        let line = frame.line as u64 - 10;
        assert_eq!(frame.address, f * 0x100 + line * 0x10, "{frame:?}");
        assert_eq!(frame.file.as_deref(), Some("app.c"));
        assert_eq!(frame.object.as_deref(), Some("/bin/app"));
    }
}

#[test]
fn span_samples_are_kept_per_span_and_selected_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let span = |id: &'static str, name: &'static str| -> [(&'static str, &'static str); 4] {
        [
            ("span_id", id),
            ("span_name", name),
            ("trace_id", "4bf92f3577b34da6a3ce929d0e0e4736"),
            ("region", "east"),
        ]
    };
    let (a, b) = (
        span("00000000000000aa", "GET /a"),
        span("00000000000000bb", "GET /b"),
    );
    let pprof = labelled_pprof(&[
        ("main;handle;work_a", 30, &a),
        ("main;handle;work_a", 5, &a),
        ("main;handle;work_b", 20, &b),
        ("main;background", 7, &[("region", "east")]),
        // Older SDKs name the span `profile_id`; an id that is not hex is no span.
        (
            "main;legacy",
            3,
            &[("profile_id", "cc"), ("region", "east")],
        ),
        ("main;odd", 2, &[("span_id", "not-hex"), ("region", "east")]),
    ]);
    let profiles = ingest::profiles_from_pprof(
        &pprof,
        "process_cpu",
        &[("service_name".to_owned(), "api".to_owned())],
        NOW,
    )
    .unwrap();
    // One series: the span labels split nothing.
    assert_eq!(profiles.len(), 1, "{profiles:#?}");
    store.ingest(&profiles).unwrap();
    let series = store.series(None);
    assert_eq!(series.len(), 1);
    let names: Vec<&str> = series[0].labels.iter().map(|(k, _)| k.as_str()).collect();
    for label in ["span_id", "span_name", "trace_id", "profile_id"] {
        assert!(!names.contains(&label), "{names:?}");
    }
    assert!(series[0].labels.contains(&("region".into(), "east".into())));

    let all = selection(r#"{service_name="api"}"#, NOW, NOW);
    assert_eq!(store.merge(&all).unwrap().total(), 67);
    let spans = |ids: &[u64]| store.merge(&all.clone().with_spans(ids.to_vec())).unwrap();
    assert_eq!(
        spans(&[0xaa]).folded(),
        vec![("main;handle;work_a".to_owned(), 35)]
    );
    assert_eq!(
        spans(&[0xbb, 0xaa, 0xbb]).folded(),
        vec![
            ("main;handle;work_a".to_owned(), 35),
            ("main;handle;work_b".to_owned(), 20)
        ]
    );
    assert_eq!(spans(&[0xcc]).folded(), vec![("main;legacy".to_owned(), 3)]);
    assert_eq!(spans(&[0xdd]).total(), 0);
    assert_eq!(spans(&[]).total(), 0);
    let points: Vec<(i64, i64)> = store
        .totals(&all.clone().with_spans(vec![0xbb]))
        .unwrap()
        .into_iter()
        .flat_map(|(_, points)| points)
        .collect();
    assert_eq!(points, vec![(NOW, 20)]);
    // Span and call site together: both must hold.
    let mut under_handle = all.clone().with_spans(vec![0xaa, 0xbb]);
    under_handle.call_site = vec!["main".into(), "handle".into(), "work_b".into()];
    assert_eq!(store.merge(&under_handle).unwrap().total(), 20);

    let values = |name: &str| store.span_label_values(name, &[], None).unwrap();
    assert_eq!(values("span_name"), ["GET /a", "GET /b"]);
    assert_eq!(
        values("span_id"),
        ["00000000000000aa", "00000000000000bb", "00000000000000cc"]
    );
    assert_eq!(values("trace_id"), ["4bf92f3577b34da6a3ce929d0e0e4736"]);
    assert!(values("region").is_empty());

    // Kept across a reopen.
    drop(store);
    let store = open(dir.path());
    assert_eq!(
        store
            .merge(&all.clone().with_spans(vec![0xbb]))
            .unwrap()
            .total(),
        20
    );
}

#[test]
fn a_store_from_before_span_profiles_gains_their_column() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        store
            .ingest(&[profile("api", &[], NOW, &[("main;old", 4)])])
            .unwrap();
    }
    {
        let conn = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        conn.execute_batch("ALTER TABLE profiles DROP COLUMN spans")
            .unwrap();
    }
    let store = open(dir.path());
    let all = selection("{}", 0, i64::MAX);
    assert_eq!(
        store.merge(&all).unwrap().folded(),
        vec![("main;old".to_owned(), 4)]
    );
    let pprof = labelled_pprof(&[("main;new", 6, &[("span_id", "0a")])]);
    let profiles = ingest::profiles_from_pprof(
        &pprof,
        "process_cpu",
        &[("service_name".to_owned(), "api".to_owned())],
        NOW,
    )
    .unwrap();
    store.ingest(&profiles).unwrap();
    assert_eq!(store.merge(&all).unwrap().total(), 10);
    assert_eq!(
        store
            .merge(&all.clone().with_spans(vec![10]))
            .unwrap()
            .folded(),
        vec![("main;new".to_owned(), 6)]
    );
}

/// A store written before frames and periods: nodes keyed by name id, no `frame_blocks`
/// table, no `period` column.
#[test]
fn a_store_from_before_frames_keeps_its_stacks_and_gains_frames() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        store
            .ingest(&[profile("api", &[], NOW, &[("main;old", 4), ("main", 1)])])
            .unwrap();
    }
    {
        let conn = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        conn.execute_batch("DROP TABLE frame_blocks; ALTER TABLE profiles DROP COLUMN period")
            .unwrap();
    }
    let store = open(dir.path());
    let all = selection("{}", 0, i64::MAX);
    let old = vec![("main".to_owned(), 1), ("main;old".to_owned(), 4)];
    assert_eq!(store.merge(&all).unwrap().folded(), old);
    let mut pprof = labelled_pprof(&[("main;new", 6, &[])]);
    pprof.period = 10_000_000;
    let profiles = ingest::profiles_from_pprof(
        &pprof,
        "process_cpu",
        &[("service_name".to_owned(), "api".to_owned())],
        NOW,
    )
    .unwrap();
    store.ingest(&profiles).unwrap();
    let with_frames = store.merge_with_frames(&all).unwrap();
    assert_eq!(
        with_frames.folded(),
        vec![
            ("main".to_owned(), 1),
            ("main;new".to_owned(), 6),
            ("main;old".to_owned(), 4)
        ]
    );
    // The old profiles had no period; the new one has.
    assert_eq!(with_frames.period, query::Period::Known(10_000_000));
    drop(store);
    // Opened again: the frames given to the old names were stored.
    assert_eq!(open(dir.path()).merge(&all).unwrap().total(), 11);
}

#[test]
fn merging_each_series_keeps_their_labels_apart_up_to_a_bound() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store
        .ingest(&[
            profile("api", &[("thread_name", "a")], NOW, &[("main;x", 3)]),
            profile("api", &[("thread_name", "b")], NOW, &[("main;y", 4)]),
            profile("api", &[("thread_name", "c")], NOW, &[("main;x", 5)]),
            profile("web", &[], NOW, &[("main;z", 9)]),
        ])
        .unwrap();
    let api = selection(r#"{service_name="api"}"#, NOW, NOW);
    assert!(store.merge_each_series(&api, 2).unwrap().is_none());
    let parts = store
        .merge_each_series(&api, 3)
        .unwrap()
        .expect("three series");
    let mut by_thread: Vec<(String, Vec<(String, i64)>)> = parts
        .iter()
        .map(|(series, tree)| {
            let thread = series
                .labels
                .iter()
                .find(|(k, _)| k == "thread_name")
                .map(|(_, v)| v.clone())
                .unwrap();
            (thread, tree.folded())
        })
        .collect();
    by_thread.sort();
    assert_eq!(
        by_thread,
        vec![
            ("a".to_owned(), vec![("main;x".to_owned(), 3)]),
            ("b".to_owned(), vec![("main;y".to_owned(), 4)]),
            ("c".to_owned(), vec![("main;x".to_owned(), 5)]),
        ]
    );
    assert_eq!(store.merge(&api).unwrap().total(), 12);
}

/// The whole-stack shortcut is keyed by a hash: an entry that points at another stack's leaf
/// (a collision) is never taken for this stack's node.
#[test]
fn a_stack_shortcut_that_collides_is_checked_against_the_tree() {
    let mut space = Space::new("cpu".into(), "svc".into());
    let a = space.node_of(&[1, 2, 3]);
    let b = space.node_of(&[1, 2, 4]);
    assert_ne!(a, b);
    assert_eq!(space.node_of(&[1, 2, 3]), a, "from the shortcut");
    // Pretend [1, 2, 4] hashed like [1, 2, 3]: its entry now names a's leaf.
    space.leaf_by_stack.insert(stack_hash(&[1, 2, 4]), a);
    assert_eq!(space.node_of(&[1, 2, 4]), b);
    // A shorter stack that is a prefix of a cached one is its own node.
    space.leaf_by_stack.insert(stack_hash(&[1, 2]), a);
    let prefix = space.node_of(&[1, 2]);
    assert_eq!(space.nodes[a as usize].0, prefix);
    assert_eq!(space.node_of(&[]), 0);
    assert_eq!(
        space.nodes.len(),
        5,
        "root, 1, 2, 3, 4: nothing added twice"
    );
}

/// Every (time, total) point of a selection, all series together, sorted.
fn sorted_totals(store: &Store, selection: &Selection) -> Vec<(i64, i64)> {
    let mut points: Vec<(i64, i64)> = store
        .totals(selection)
        .unwrap()
        .into_iter()
        .flat_map(|(_, points)| points)
        .collect();
    points.sort_unstable();
    points
}

/// Past `--max-catalog-nodes` a service whose call tree keeps growing has it sealed: its nodes
/// leave memory and are read from disk by queries, and stacks seen again get new nodes. A
/// service that keeps sending the same stacks is not sealed (its nodes would only be made
/// again). Every query answers as a store without the bound does: merged trees, downloads, a
/// call site's trees and totals, after more writes and after a reopen.
#[test]
fn sealed_call_trees_leave_memory_and_queries_answer_the_same() {
    let (bounded_dir, reference_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let options = StoreOptions {
        limits: StoreLimits {
            max_catalog_nodes: 8,
            ..StoreLimits::default()
        },
        // A generation's size is taken at its first write, so one that doubles after it is sealed.
        settle_age: Duration::ZERO,
        ..StoreOptions::default()
    };
    let open_bounded = || Store::open_with(StoreSettings::new(bounded_dir.path()), options.clone());
    let mut bounded = open_bounded().unwrap();
    let reference = open(reference_dir.path());
    // "api" adds three new stacks every round. "db" sends the same six and alternates between
    // two more: its tree alone is over the bound, but sealing it would only make it again.
    let write = |round: i64| {
        let new: Vec<String> = (0..3).map(|k| format!("main;work;b{round}_{k}")).collect();
        let scan = format!("run;scan{}", round % 2);
        let db: Vec<String> = (0..6).map(|k| format!("run;query;q{k}")).collect();
        let time_ns = NOW + round * SECOND;
        vec![
            profile(
                "api",
                &[],
                time_ns,
                &[
                    ("main;work;a", 3),
                    (&new[0], 2),
                    (&new[1], 1),
                    (&new[2], 4),
                    ("main;idle", 1),
                ],
            ),
            profile(
                "db",
                &[],
                time_ns,
                &[
                    (&db[0], 5),
                    (&db[1], 1),
                    (&db[2], 2),
                    (&db[3], 3),
                    (&db[4], 1),
                    (&db[5], 7),
                    (&scan, 1 + round),
                ],
            ),
        ]
    };
    let same_answers = |bounded: &Store, rounds: i64| {
        let end = NOW + rounds * SECOND;
        let at = |selector: &str, call_site: &[&str]| {
            let mut selection = selection(selector, NOW, end);
            selection.call_site = call_site.iter().map(|name| name.to_string()).collect();
            selection
        };
        for (selector, call_site) in [
            ("{}", &[][..]),
            (r#"{service_name="api"}"#, &[][..]),
            (r#"{service_name="api"}"#, &["main", "work"][..]),
            (r#"{service_name="db"}"#, &["run"][..]),
        ] {
            let selection = at(selector, call_site);
            let merged = bounded.merge(&selection).unwrap().folded();
            assert!(!merged.is_empty(), "{selector} {call_site:?}");
            assert_eq!(merged, reference.merge(&selection).unwrap().folded());
            assert_eq!(
                bounded.merge_with_frames(&selection).unwrap().folded(),
                reference.merge_with_frames(&selection).unwrap().folded()
            );
            assert_eq!(
                sorted_totals(bounded, &selection),
                sorted_totals(&reference, &selection),
                "{selector} {call_site:?}"
            );
        }
    };
    let sealed_of = |store: &Store, service: &str| -> u32 {
        let catalog = store.read_catalog();
        catalog
            .spaces
            .values()
            .find(|space| space.service_name == service)
            .map_or(0, |space| space.sealed)
    };
    for round in 0..8 {
        bounded.ingest(&write(round)).unwrap();
        reference.ingest(&write(round)).unwrap();
        same_answers(&bounded, round + 1);
    }
    assert!(
        sealed_of(&bounded, "api") > 0,
        "the growing tree was never sealed"
    );
    assert_eq!(sealed_of(&bounded, "db"), 0, "the steady tree was sealed");
    assert_eq!(
        bounded
            .counters()
            .node_trees_sealed_in_use
            .load(Ordering::Relaxed),
        0
    );
    assert!(
        bounded.counters().node_trees_sealed.load(Ordering::Relaxed) >= 2,
        "sealed once at most"
    );
    assert!(bounded.catalog_sizes().2 < reference.catalog_sizes().2);

    // At open every tree over the bound is loaded sealed.
    drop(bounded);
    bounded = open_bounded().unwrap();
    assert!(bounded.catalog_sizes().2 <= 8);
    same_answers(&bounded, 8);
    bounded.ingest(&write(8)).unwrap();
    reference.ingest(&write(8)).unwrap();
    same_answers(&bounded, 9);
}

const CPU_SAMPLES: &str = "process_cpu:samples:count:cpu:nanoseconds";

/// `profile` of another type: the same stacks, counted as samples.
fn profile_of_type(
    type_id: &str,
    service: &str,
    time_ns: i64,
    stacks: &[(&str, i64)],
) -> NewProfile {
    NewProfile {
        profile_type: Some(ProfileType::parse(type_id).unwrap()),
        ..profile(service, &[], time_ns, stacks)
    }
}

/// The sample types of one profile (the agent's `samples:count` and `cpu:nanoseconds`) share
/// their service's call tree: its nodes are kept (in memory and on disk) once, not once per
/// type, and each type still answers with its own values.
#[test]
fn the_sample_types_of_a_profile_share_one_call_tree() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let stacks_at = |round: i64| -> Vec<(String, i64)> {
        vec![
            ("main;work;a".to_owned(), 3),
            (format!("main;work;b{round}"), 2),
            ("main;idle".to_owned(), 1),
        ]
    };
    for round in 0..3 {
        let stacks = stacks_at(round);
        let counts: Vec<(&str, i64)> = stacks.iter().map(|(s, v)| (s.as_str(), *v)).collect();
        let nanos: Vec<(&str, i64)> = stacks
            .iter()
            .map(|(s, v)| (s.as_str(), v * 10_000_000))
            .collect();
        store
            .ingest(&[
                profile_of_type(CPU_SAMPLES, "api", NOW + round * SECOND, &counts),
                profile_of_type(CPU, "api", NOW + round * SECOND, &nanos),
                profile_of_type(CPU, "web", NOW + round * SECOND, &[("serve;parse", 5)]),
            ])
            .unwrap();
    }
    // api: root, main, work, a, b0, b1, b2, idle; web: root, serve, parse.
    assert_eq!(store.catalog_sizes().2, 8 + 3);
    let end = NOW + 3 * SECOND;
    let mut of_samples = selection(r#"{service_name="api"}"#, NOW, end);
    of_samples.profile_type = CPU_SAMPLES.to_owned();
    let merged = store.merge(&of_samples).unwrap().folded();
    assert_eq!(
        merged,
        [
            ("main;idle", 3),
            ("main;work;a", 9),
            ("main;work;b0", 2),
            ("main;work;b1", 2),
            ("main;work;b2", 2)
        ]
        .map(|(s, v)| (s.to_owned(), v))
        .into_iter()
        .collect::<Vec<_>>()
    );
    let nanos = store
        .merge(&selection(r#"{service_name="api"}"#, NOW, end))
        .unwrap()
        .folded();
    let scaled: Vec<(String, i64)> = merged
        .iter()
        .map(|(s, v)| (s.clone(), v * 10_000_000))
        .collect();
    assert_eq!(nanos, scaled);
    drop(store);
    let reopened = open(dir.path());
    assert_eq!(reopened.catalog_sizes().2, 8 + 3);
    assert_eq!(reopened.merge(&of_samples).unwrap().folded(), merged);
}

/// A store written with one call tree per sample type (before they were shared) answers as
/// before after it is opened, also after more writes: each existing series keeps writing into
/// its own tree, and a new series uses one of them.
#[test]
fn a_store_with_a_call_tree_per_sample_type_keeps_answering() {
    let (dir, reference_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let reference = open(reference_dir.path());
    let write = |store: &Store, round: i64, extra: &[(&str, &str)]| {
        let stack = format!("main;step{round}");
        let stacks = [(stack.as_str(), 1 + round), ("main;idle", 2)];
        let mut counts = profile_of_type(CPU_SAMPLES, "api", NOW + round * SECOND, &stacks);
        let mut nanos = profile_of_type(CPU, "api", NOW + round * SECOND, &stacks);
        for (k, v) in extra {
            counts.labels.push((k.to_string(), v.to_string()));
            nanos.labels.push((k.to_string(), v.to_string()));
        }
        store.ingest(&[counts, nanos]).unwrap();
    };
    {
        let store = open(dir.path());
        write(&store, 0, &[]);
        write(&reference, 0, &[]);
    }
    // Give the `samples:count` series a tree of its own, as stores written before had.
    {
        let conn = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        let shared: i64 = conn
            .query_row("SELECT id FROM spaces", [], |r| r.get(0))
            .unwrap();
        conn.execute_batch(&format!(
            "INSERT INTO spaces(id, profile_type, service_name) VALUES (9, '{CPU_SAMPLES}', 'api');
             INSERT INTO node_blocks(space_id, first_idx, nodes)
                 SELECT 9, first_idx, nodes FROM node_blocks WHERE space_id = {shared};
             UPDATE series SET space_id = 9 WHERE profile_type = '{CPU_SAMPLES}';"
        ))
        .unwrap();
    }
    let store = open(dir.path());
    assert_eq!(
        store.catalog_sizes().2,
        2 * 4,
        "two trees of root, main, step0, idle"
    );
    for round in 1..4 {
        write(&store, round, &[]);
        write(&reference, round, &[]);
    }
    // A new series of each type: both into one of the existing trees.
    write(&store, 4, &[("region", "eu")]);
    write(&reference, 4, &[("region", "eu")]);
    let end = NOW + 5 * SECOND;
    for type_id in [CPU, CPU_SAMPLES] {
        for selector in ["{}", r#"{region="eu"}"#] {
            let mut selection = selection(selector, NOW, end);
            selection.profile_type = type_id.to_owned();
            let answer = store.merge(&selection).unwrap().folded();
            assert!(!answer.is_empty(), "{type_id} {selector}");
            assert_eq!(answer, reference.merge(&selection).unwrap().folded());
        }
    }
    let spaces: i64 = store
        .with_reader(|conn| Ok(conn.query_row("SELECT count(*) FROM spaces", [], |r| r.get(0))?))
        .unwrap();
    assert_eq!(spaces, 2, "no third tree for the new series");
}

/// Trees in steady use may keep the nodes in memory past `--max-catalog-nodes`, but not past
/// four times it: many services whose trees never double (here none settles at all) still have the
/// largest sealed until the bound holds, and queries answer as a store without the bound does.
#[test]
fn call_trees_in_steady_use_are_sealed_past_four_times_the_bound() {
    let (bounded_dir, reference_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let options = StoreOptions {
        limits: StoreLimits {
            max_catalog_nodes: 8,
            ..StoreLimits::default()
        },
        settle_age: Duration::from_secs(3600),
        ..StoreOptions::default()
    };
    let bounded = Store::open_with(StoreSettings::new(bounded_dir.path()), options).unwrap();
    let reference = open(reference_dir.path());
    // Five services, each sending the same five stacks every round: 7 nodes a tree, 35 in all.
    let write = |round: i64| -> Vec<NewProfile> {
        (0..5)
            .map(|service| {
                let stacks: Vec<(String, i64)> = (0..5)
                    .map(|k| (format!("main;s{service}_f{k}"), 1 + k + round))
                    .collect();
                let stacks: Vec<(&str, i64)> =
                    stacks.iter().map(|(s, v)| (s.as_str(), *v)).collect();
                profile(&format!("svc{service}"), &[], NOW + round * SECOND, &stacks)
            })
            .collect()
    };
    for round in 0..3 {
        bounded.ingest(&write(round)).unwrap();
        reference.ingest(&write(round)).unwrap();
        let in_memory = bounded.catalog_sizes().2;
        assert!(in_memory <= 8, "round {round}: {in_memory} nodes in memory");
        assert_eq!(
            reference.catalog_sizes().2,
            35,
            "the reference is unbounded"
        );
        let selection = selection("{}", NOW, NOW + (round + 1) * SECOND);
        assert_eq!(
            bounded.merge(&selection).unwrap().folded(),
            reference.merge(&selection).unwrap().folded()
        );
        assert_eq!(
            sorted_totals(&bounded, &selection),
            sorted_totals(&reference, &selection)
        );
    }
    let counters = bounded.counters();
    assert!(counters.node_trees_sealed.load(Ordering::Relaxed) >= 12);
    assert_eq!(
        counters.node_trees_sealed_in_use.load(Ordering::Relaxed),
        counters.node_trees_sealed.load(Ordering::Relaxed),
        "every tree sealed here was in steady use"
    );
}

/// Every node's stack with a self value as frames (name, file, line, object, address), root
/// first: what a download shows.
fn detailed(tree: &query::MergedTree) -> Vec<(String, i64)> {
    let mut out: Vec<(String, i64)> = (1..tree.nodes.len())
        .filter(|&n| tree.nodes[n].self_value != 0)
        .map(|n| {
            let mut path = Vec::new();
            let mut node = n;
            while node != 0 {
                let frame = &tree.frames[tree.nodes[node].frame as usize];
                path.push(format!(
                    "{}@{:?}:{}:{:?}+{:x}",
                    frame.name, frame.file, frame.line, frame.object, frame.address
                ));
                node = tree.nodes[node].parent as usize;
            }
            path.reverse();
            (path.join(";"), tree.nodes[n].self_value)
        })
        .collect();
    out.sort();
    out
}

/// Past `--max-catalog-frames` the frames and names in memory are sealed, and the call trees
/// with them: they stay on disk, where queries read them, and a frame, name or node seen again
/// gets a new id. Every query answers
/// as a store without the bound does (names and frames merged by what they say, not by id):
/// merged trees, downloads with files and lines, a call site's trees and totals, after more
/// writes and after a reopen, which loads only the last generation.
#[test]
fn sealed_frames_and_names_leave_memory_and_queries_answer_the_same() {
    let (bounded_dir, reference_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let options = StoreOptions {
        limits: StoreLimits {
            max_catalog_frames: 4,
            ..StoreLimits::default()
        },
        ..StoreOptions::default()
    };
    let open_bounded = || Store::open_with(StoreSettings::new(bounded_dir.path()), options.clone());
    let mut bounded = open_bounded().unwrap();
    let reference = open(reference_dir.path());
    // Each function has its file, line and address in `app.so`; "api" adds three new functions
    // every round, "db" sends the same ones, so both old and new frames are written after seals.
    let with_frames = |mut profile: NewProfile| {
        let file = profile.names.len() as u32;
        profile.names.push("src/app.rs".into());
        let object = profile.names.len() as u32;
        profile.names.push("app.so".into());
        profile.frames = (0..file)
            .map(|name| {
                let text = &profile.names[name as usize];
                let line = text.bytes().map(u32::from).sum::<u32>();
                Frame {
                    file,
                    line,
                    object,
                    address: u64::from(line) * 16,
                    ..Frame::named(name)
                }
            })
            .collect();
        profile
    };
    let write = |round: i64| {
        let new: Vec<String> = (0..3).map(|k| format!("main;work;b{round}_{k}")).collect();
        let time_ns = NOW + round * SECOND;
        vec![
            with_frames(profile(
                "api",
                &[],
                time_ns,
                &[("main;work;a", 3), (&new[0], 2), (&new[1], 1), (&new[2], 4)],
            )),
            with_frames(profile(
                "db",
                &[],
                time_ns,
                &[("run;query;q0", 5), ("run;query;q1", 1 + round)],
            )),
        ]
    };
    let same_answers = |bounded: &Store, rounds: i64| {
        let end = NOW + rounds * SECOND;
        for (selector, call_site) in [
            ("{}", &[][..]),
            (r#"{service_name="api"}"#, &["main", "work"][..]),
            (r#"{service_name="db"}"#, &["run", "query", "q1"][..]),
        ] {
            let mut selection = selection(selector, NOW, end);
            selection.call_site = call_site.iter().map(|name| name.to_string()).collect();
            let merged = bounded.merge(&selection).unwrap().folded();
            assert!(!merged.is_empty(), "{selector} {call_site:?}");
            assert_eq!(merged, reference.merge(&selection).unwrap().folded());
            let downloaded = detailed(&bounded.merge_with_frames(&selection).unwrap());
            assert!(downloaded.iter().all(|(path, _)| path.contains("app.rs")));
            assert_eq!(
                downloaded,
                detailed(&reference.merge_with_frames(&selection).unwrap()),
                "{selector} {call_site:?}"
            );
            assert_eq!(
                sorted_totals(bounded, &selection),
                sorted_totals(&reference, &selection),
                "{selector} {call_site:?}"
            );
        }
    };
    for round in 0..8 {
        bounded.ingest(&write(round)).unwrap();
        reference.ingest(&write(round)).unwrap();
        same_answers(&bounded, round + 1);
        let (names, frames, nodes) = bounded.catalog_sizes();
        assert!(
            names <= 4 && frames <= 4,
            "{names} names, {frames} frames in memory"
        );
        // The trees went with the frames their nodes name: only each service's root is left.
        assert_eq!(nodes, 2, "nodes in memory after round {round}");
    }
    assert!(
        bounded
            .counters()
            .frame_generations_sealed
            .load(Ordering::Relaxed)
            >= 8,
        "sealed too rarely"
    );
    let (names, frames, _) = reference.catalog_sizes();
    assert!(names > 20 && frames > 20, "the reference keeps them all");

    drop(bounded);
    bounded = open_bounded().unwrap();
    let (names, frames, _) = bounded.catalog_sizes();
    assert!(
        names <= 4 && frames <= 4,
        "{names} names, {frames} frames after reopening"
    );
    same_answers(&bounded, 8);
    bounded.ingest(&write(8)).unwrap();
    reference.ingest(&write(8)).unwrap();
    same_answers(&bounded, 9);
}
