//! Hostile CFI must give an error or a well-formed table, never a panic or a hang.
//!
//! The corpus (`profiler-user/tests/corpus/eh_frame/`, see its README) holds raw `.eh_frame`
//! section bytes (`debug_frame-*` files: `.debug_frame` bytes), read as if the section were at
//! [`CORPUS_SECTION_ADDRESS`]. `ok-*` files must build, `err-*` files must be rejected, others
//! may do either. proptest's case count comes from `PROPTEST_CASES` (default 256), e.g.
//! `PROPTEST_CASES=20000 cargo test -p profiler-user --release --lib unwinding::tables::tests::fuzz`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use object::{Object, ObjectSection};
use profiler_common::unwind::{CFA_PLT, CFA_RSP, RBP_AT_CFA, RBP_UNCHANGED};
use proptest::prelude::*;

use super::fixture::fixture_elf;
use crate::unwinding::tables::builder::{CfiSection, build_from_cfi};
use crate::unwinding::tables::{CfiSource, Rule, TableError, TableRow, UnwindTable, build_table};

const CORPUS_SECTION_ADDRESS: u64 = 0x2000;
const CORPUS_TEXT_ADDRESS: u64 = 0x1000;
/// The corpus's `.plt` section.
#[allow(clippy::single_range_in_vec_init)]
const CORPUS_PLT_RANGES: &[std::ops::Range<u64>] = &[0x1020..0x1060];
const SEED: &str = "ok-gcc-fixture.eh_frame";
/// Generous for debug builds on a loaded CI machine; real inputs take milliseconds.
const TIME_LIMIT: Duration = Duration::from_secs(5);

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/eh_frame")
}

fn corpus_files() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(corpus_dir())
        .expect("corpus directory")
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(&path).expect("corpus file"))
        })
        .filter(|(name, _)| !name.ends_with(".md"))
        .collect();
    files.sort();
    files
}

fn seed() -> Vec<u8> {
    std::fs::read(corpus_dir().join(SEED)).expect("seed corpus file")
}

fn build_raw(bytes: &[u8], source: CfiSource) -> Result<UnwindTable, TableError> {
    build_from_cfi(&CfiSection {
        source,
        data: bytes,
        address: CORPUS_SECTION_ADDRESS,
        text_address: Some(CORPUS_TEXT_ADDRESS),
        got_address: Some(0x4000),
        plt_ranges: CORPUS_PLT_RANGES,
    })
}

/// Runs `build` within the time limit and checks what a successful build returns.
fn check_outcome(
    what: &str,
    build: impl FnOnce() -> Result<UnwindTable, TableError>,
) -> Result<UnwindTable, TableError> {
    let started = Instant::now();
    let outcome = build();
    assert!(
        started.elapsed() < TIME_LIMIT,
        "{what}: took {:?}",
        started.elapsed()
    );
    if let Ok(table) = &outcome {
        let rows = table.rows();
        assert!(
            rows.windows(2).all(|w| w[0].address < w[1].address),
            "{what}"
        );
        assert!(
            rows.last().is_none_or(|row| row.rule == Rule::NONE),
            "{what}"
        );
        // Every row is found where it starts (rows at the end marker's address have no page
        // when it falls on a page boundary).
        for row in &rows[..rows.len().saturating_sub(1)] {
            let found = table.lookup(row.address).map(|found| Rule::of(&found));
            assert_eq!(found, Some(row.rule), "{what}: row at {:#x}", row.address);
        }
        assert!(table.stats().rows_after_merge as usize == rows.len());
        // The reservation's bound holds for any input that builds.
        let stored = table.paged().rows().len() as u64;
        assert!(
            stored <= table.stats().row_bound,
            "{what}: {stored} rows, {:?}",
            table.stats()
        );
    }
    outcome
}

#[test]
fn corpus_files_build_or_fail_cleanly() {
    let files = corpus_files();
    assert!(files.iter().any(|(name, _)| name == SEED), "seed present");
    let total: usize = files.iter().map(|(_, bytes)| bytes.len()).sum();
    assert!(total < 50 * 1024, "corpus stays small: {total} bytes");
    for (name, bytes) in &files {
        let source = if name.contains("debug_frame") {
            CfiSource::DebugFrame
        } else {
            CfiSource::EhFrame
        };
        let outcome = check_outcome(name, || build_raw(bytes, source));
        if name.starts_with("ok-") {
            let table = outcome
                .as_ref()
                .unwrap_or_else(|error| panic!("{name}: {error}"));
            assert!(table.row_count() > 0, "{name}");
        } else if name.starts_with("err-") {
            assert!(outcome.is_err(), "{name} is rejected");
        }
        match &outcome {
            // Error messages are one line.
            Err(error) => {
                eprintln!("{name}: {error}");
                assert!(!error.to_string().contains('\n'), "{name}: {error}");
            }
            Ok(table) => eprintln!("{name}: {} rows", table.row_count()),
        }
    }
}

/// Mutations applied to a seed: bit flips, an overwritten run of bytes, a truncation.
#[derive(Debug, Clone)]
struct Mutation {
    flips: Vec<(usize, u8)>,
    splice: Option<(usize, Vec<u8>)>,
    truncate_to: Option<usize>,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    (
        prop::collection::vec((any::<usize>(), 0u8..8), 0..6),
        prop::option::of((any::<usize>(), prop::collection::vec(any::<u8>(), 1..24))),
        prop::option::weighted(0.3, any::<usize>()),
    )
        .prop_map(|(flips, splice, truncate_to)| Mutation {
            flips: flips.into_iter().map(|(at, bit)| (at, 1 << bit)).collect(),
            splice,
            truncate_to,
        })
}

impl Mutation {
    /// Applies the mutation to `bytes[range]`.
    fn apply(&self, bytes: &mut Vec<u8>, range: std::ops::Range<usize>) {
        let len = range.len();
        if len == 0 {
            return;
        }
        for &(at, mask) in &self.flips {
            bytes[range.start + at % len] ^= mask;
        }
        if let Some((at, data)) = &self.splice {
            let at = at % len;
            for (offset, byte) in data.iter().enumerate().take(len - at) {
                bytes[range.start + at + offset] = *byte;
            }
        }
        if let Some(keep) = self.truncate_to {
            bytes.truncate(range.start + keep % (len + 1));
        }
    }
}

proptest! {
    #[test]
    fn mutated_eh_frame_never_panics(mutation in mutation()) {
        let mut bytes = seed();
        let len = bytes.len();
        mutation.apply(&mut bytes, 0..len);
        let _ = check_outcome("mutated .eh_frame", || build_raw(&bytes, CfiSource::EhFrame));
        let _ = check_outcome("mutated as .debug_frame", || build_raw(&bytes, CfiSource::DebugFrame));
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = check_outcome("random .eh_frame", || build_raw(&bytes, CfiSource::EhFrame));
        let _ = check_outcome("random .debug_frame", || build_raw(&bytes, CfiSource::DebugFrame));
        let _ = check_outcome("random ELF", || build_table(&bytes));
    }

    /// Mutations inside the `.eh_frame` of a real ELF file (the gcc fixture), or truncations
    /// of the whole file.
    #[test]
    fn mutated_elf_never_panics(mutation in mutation(), whole_file in prop::bool::weighted(0.2)) {
        let Some(elf) = fixture_elf() else {
            return Ok(());
        };
        let file = object::File::parse(elf).expect("fixture ELF");
        let (offset, size) = file
            .section_by_name(".eh_frame")
            .and_then(|section| section.file_range())
            .expect(".eh_frame in the file");
        let mut bytes = elf.to_vec();
        let range = if whole_file {
            0..bytes.len()
        } else {
            offset as usize..(offset + size) as usize
        };
        mutation.apply(&mut bytes, range);
        let _ = check_outcome("mutated ELF", || build_table(&bytes));
    }
}

/// The hand-made corpus inputs (see `make_eh_frame_corpus.py`) give the documented rules.
#[test]
fn corpus_inputs_give_the_documented_rules() {
    let build = |name: &str| {
        let bytes = std::fs::read(corpus_dir().join(name)).expect("corpus file");
        let source = if name.contains("debug_frame") {
            CfiSource::DebugFrame
        } else {
            CfiSource::EhFrame
        };
        build_raw(&bytes, source).unwrap_or_else(|error| panic!("{name}: {error}"))
    };
    let rsp = |offset| Rule {
        cfa_kind: CFA_RSP,
        rbp_kind: RBP_UNCHANGED,
        cfa_offset: offset,
        rbp_offset: 0,
    };
    let rule_at = |table: &UnwindTable, pc| table.lookup(pc).map(|row| Rule::of(&row));

    // First start wins: the FDE at 0x1180 only covers 0x1200.., where its row in effect at
    // 0x1200 continues; the nested FDE and the duplicate start are ignored.
    let table = build("ok-overlapping-fdes.eh_frame");
    assert_eq!(table.stats().overlapping_fdes, 3);
    for (pc, rule) in [
        (0x1100, rsp(8)),
        (0x1110, rsp(16)),
        (0x11ff, rsp(16)),
        (0x1200, rsp(48)),
        (0x127f, rsp(48)),
        (0x1280, Rule::NONE),
    ] {
        assert_eq!(rule_at(&table, pc), Some(rule), "{pc:#x}");
    }

    let table = build("ok-unsupported-rules.eh_frame");
    let stats = table.stats();
    assert_eq!(
        (
            stats.unsupported_cfa_expressions,
            stats.unsupported_cfa_registers,
            stats.offsets_out_of_range,
            stats.unsupported_rbp_rules,
            stats.plt_rows,
        ),
        (1, 1, 1, 1, 1),
        "{stats:?}"
    );
    for (pc, rule) in [
        (0x1000, Rule::UNSUPPORTED),
        (0x100b, Rule::UNSUPPORTED),
        (0x100c, rsp(16)),
        (0x1010, Rule::NONE),
        (0x1040, Rule::special(CFA_PLT)),
        (0x105f, Rule::special(CFA_PLT)),
    ] {
        assert_eq!(rule_at(&table, pc), Some(rule), "{pc:#x}");
    }
    assert_eq!(
        table
            .rows()
            .iter()
            .filter(|row| row.rule == Rule::UNSUPPORTED)
            .count(),
        1,
        "neighbouring unsupported rows merge"
    );

    // A program gimli cannot run costs its own FDE's range, not the file's table.
    let table = build("ok-one-malformed-fde.eh_frame");
    assert_eq!(table.stats().malformed_fdes, 1);
    for (pc, rule) in [
        (0x1000, rsp(8)),
        (0x1004, rsp(16)),
        (0x100f, rsp(16)),
        (0x1010, Rule::NONE),
        (0x101f, Rule::NONE),
        (0x1080, rsp(8)),
        (0x1082, rsp(24)),
        (0x1090, Rule::NONE),
    ] {
        assert_eq!(rule_at(&table, pc), Some(rule), "{pc:#x}");
    }
    assert!(!table.frame_pointers_reliable());

    let table = build("ok-signal-frame.eh_frame");
    assert_eq!(table.stats().signal_fdes, 1);
    assert!((0x1000..0x1009).all(|pc| rule_at(&table, pc) == Some(Rule::SIGNAL)));
    assert_eq!(rule_at(&table, 0x1009), Some(Rule::NONE));

    let table = build("ok-outermost-frame.eh_frame");
    assert!((0x1000..0x1010).all(|pc| rule_at(&table, pc) == Some(Rule::END)));

    let table = build("ok-advance-past-end.eh_frame");
    assert_eq!(
        table.rows(),
        &[
            TableRow {
                address: 0x1000,
                rule: rsp(8)
            },
            TableRow {
                address: 0x1010,
                rule: Rule::NONE
            },
        ]
    );

    let table = build("ok-debug_frame-basic.debug_frame");
    assert_eq!(table.stats().source, CfiSource::DebugFrame);
    assert_eq!(rule_at(&table, 0x1000), Some(rsp(8)));
    let saved_rbp = Rule {
        rbp_kind: RBP_AT_CFA,
        rbp_offset: -16,
        ..rsp(16)
    };
    assert_eq!(rule_at(&table, 0x101f), Some(saved_rbp));
    assert_eq!(rule_at(&table, 0x1020), Some(Rule::NONE));
}
