//! The disk cache: round trip, and damaged entries are rejected and deleted.

use profiler_common::unwind::{CFA_RBP, CFA_RSP, RBP_AT_CFA, RBP_UNCHANGED};

use super::fixture::fixture_elf;
use crate::unwinding::tables::{
    CacheError, CfiSource, Rule, TableCache, TableRow, TableStats, UnwindTable, build_table,
};

const BUILD_ID: &str = "0123456789abcdef0123456789abcdef01234567";

fn synthetic_table() -> UnwindTable {
    let rsp = |offset| Rule {
        cfa_kind: CFA_RSP,
        rbp_kind: RBP_UNCHANGED,
        cfa_offset: offset,
        rbp_offset: 0,
    };
    let rows = vec![
        TableRow {
            address: 0x1000,
            rule: rsp(8),
        },
        TableRow {
            address: 0x1004,
            rule: Rule {
                cfa_kind: CFA_RBP,
                rbp_kind: RBP_AT_CFA,
                cfa_offset: 16,
                rbp_offset: -16,
            },
        },
        TableRow {
            address: 0x1_0040,
            rule: Rule::NONE,
        },
        TableRow {
            address: 0x1_0080,
            rule: rsp(-32768),
        },
        TableRow {
            address: 0x1_00c0,
            rule: Rule::NONE,
        },
    ];
    let stats = TableStats {
        source: CfiSource::DebugFrame,
        fdes: 3,
        rows_before_merge: 7,
        rows_after_merge: 5,
        unsupported_rbp_rules: 2,
        ..TableStats::default()
    };
    UnwindTable::from_rows(rows, stats).expect("valid rows")
}

fn assert_same(loaded: &UnwindTable, original: &UnwindTable) {
    assert_eq!(loaded.rows(), original.rows());
    // The build's own figures (its row bound and growths) are not kept.
    let kept = |stats: &TableStats| TableStats {
        row_bound: 0,
        row_vector_growths: 0,
        ..stats.clone()
    };
    assert_eq!(kept(loaded.stats()), kept(original.stats()));
    assert_eq!(loaded.pages(), original.pages());
}

#[test]
fn round_trip_keeps_rows_and_stats() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = TableCache::new(dir.path().join("tables"));
    assert!(cache.load(BUILD_ID).is_none(), "empty cache");

    let table = synthetic_table();
    cache.store(BUILD_ID, &table).expect("store");
    assert_same(&cache.load(BUILD_ID).expect("cached"), &table);

    if let Some(elf) = fixture_elf() {
        let built = build_table(elf).expect("fixture table");
        cache.store("abcdef", &built).expect("store");
        assert_same(&cache.load("abcdef").expect("cached"), &built);
    }
    let empty = UnwindTable::from_rows(Vec::new(), TableStats::default()).expect("empty");
    cache.store("00", &empty).expect("store");
    assert_eq!(cache.load("00").expect("cached").row_count(), 0);

    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("tables"))
        .expect("dir")
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary files left");
}

#[test]
fn damaged_entries_are_rejected_and_removed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = TableCache::new(dir.path());
    let table = synthetic_table();
    let path = cache.entry_path(BUILD_ID).expect("valid id");
    cache.store(BUILD_ID, &table).expect("store");
    let good = std::fs::read(&path).expect("entry");

    let mut damaged: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("truncated", good[..good.len() - 9].to_vec()),
        ("garbage", vec![0x55; good.len()]),
        ("one byte longer", [&good[..], &[0]].concat()),
    ];
    for index in [0, 9, 20, good.len() / 2, good.len() - 1] {
        let mut bytes = good.clone();
        bytes[index] ^= 0x10;
        damaged.push(("bit flip", bytes));
    }
    // Well-formed files (valid checksum) with bad content.
    let with_checksum = |mut bytes: Vec<u8>| {
        let content_len = bytes.len() - 8;
        let checksum = u64::from(crc32fast::hash(&bytes[..content_len]));
        bytes[content_len..].copy_from_slice(&checksum.to_le_bytes());
        bytes
    };
    let mut future_version = good.clone();
    future_version[8] += 1;
    damaged.push(("future version", with_checksum(future_version)));
    let rows_start = good.len() - 8 - 5 * 16;
    let mut unsorted = good.clone();
    unsorted[rows_start..rows_start + 8].copy_from_slice(&0x2_0000u64.to_le_bytes());
    damaged.push(("unsorted rows", with_checksum(unsorted)));
    let mut bad_kind = good.clone();
    bad_kind[rows_start + 8] = 200;
    damaged.push(("unknown rule kind", with_checksum(bad_kind)));
    let mut huge_count = good.clone();
    let count_at = rows_start - 8;
    huge_count[count_at..count_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    damaged.push(("huge row count", with_checksum(huge_count)));

    for (what, bytes) in damaged {
        std::fs::write(&path, &bytes).expect("write damaged entry");
        assert!(cache.load(BUILD_ID).is_none(), "{what} is rejected");
        assert!(!path.exists(), "{what} entry is removed");
    }
    std::fs::write(&path, &good).expect("restore");
    assert!(
        cache.load(BUILD_ID).is_some(),
        "the test's checksum helper matches"
    );
}

#[test]
fn build_ids_must_be_hex() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = TableCache::new(dir.path());
    let table = synthetic_table();
    for id in ["", "../etc/passwd", "abc/def", "xyz", &"a".repeat(129)] {
        assert!(matches!(
            cache.store(id, &table),
            Err(CacheError::InvalidBuildId(_))
        ));
        assert!(cache.load(id).is_none());
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("dir").count(),
        0,
        "nothing written"
    );
}

#[test]
fn a_large_entry_is_let_go_of_while_it_is_decoded() {
    // 400,000 rows: a 6 MiB entry, read in two passes (checksum, rows).
    let rows: Vec<TableRow> = (0..400_000u64)
        .map(|index| TableRow {
            address: 0x10_0000 + index * 4,
            rule: if index % 2 == 0 {
                Rule {
                    cfa_kind: CFA_RSP,
                    rbp_kind: RBP_UNCHANGED,
                    cfa_offset: 8,
                    rbp_offset: 0,
                }
            } else {
                Rule::NONE
            },
        })
        .collect();
    let stats = TableStats {
        source: CfiSource::EhFrame,
        rows_after_merge: rows.len() as u64,
        ..TableStats::default()
    };
    let table = UnwindTable::from_rows(rows, stats).expect("valid rows");
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = TableCache::new(dir.path().to_path_buf());
    cache.store(BUILD_ID, &table).expect("stored");
    let path = cache.entry_path(BUILD_ID).expect("path");
    let file = std::fs::File::open(&path).expect("entry");
    // SAFETY: the test's own entry, unchanged while mapped.
    let mapped = unsafe { memmap2::Mmap::map(&file) }.expect("map");
    let input = unsafe { crate::unwinding::tables::MappedInput::new(&mapped) };

    let loaded =
        crate::unwinding::tables::cache::decode(&mapped, &|| input.release()).expect("decoded");

    assert_same(&loaded, &table);
    let resident = crate::test_support::resident_bytes_of_mapping(mapped.as_ptr());
    assert!(
        resident < mapped.len() as u64 / 2,
        "{resident} of {} bytes still resident",
        mapped.len()
    );
}
