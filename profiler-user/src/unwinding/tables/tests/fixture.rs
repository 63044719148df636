//! A tiny program built with gcc at test time: frame-pointer-less and frame-pointer functions,
//! adjacent leaf functions (merging), padding between functions (gaps), a lazy `.plt` and
//! crt1's `_start`.

use std::process::Command;
use std::sync::OnceLock;

use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::unwind::{CFA_END, CFA_NONE, CFA_PLT, CFA_RBP, CFA_RSP, RBP_AT_CFA};

use super::{assert_well_formed, check_against_oracle, oracle_fdes, requires_external};
use crate::unwinding::tables::{CfiSource, Rule, TableRow, UnwindTable, build_table};

/// Built without frame pointers; sixteen one-row leaf functions packed back to back
/// (`-falign-functions=1`), so their identical rows merge.
const OMIT_FRAME_POINTER_C: &str = r#"
#include <stdio.h>
#include <string.h>
int fp_function(int n);
#define LEAF(k) __attribute__((noinline)) int leaf_##k(int x) { return x * (k + 3) + k; }
LEAF(0) LEAF(1) LEAF(2) LEAF(3) LEAF(4) LEAF(5) LEAF(6) LEAF(7)
LEAF(8) LEAF(9) LEAF(10) LEAF(11) LEAF(12) LEAF(13) LEAF(14) LEAF(15)
__attribute__((noinline, aligned(64))) long omit_function(long n) {
    char buf[64];
    snprintf(buf, sizeof buf, "%ld", n);
    return (long)strlen(buf) + fp_function((int)n) + puts(buf);
}
int main(int argc, char **argv) {
    (void)argv;
    return (int)omit_function(argc) + leaf_0(argc) + leaf_1(argc) + leaf_2(argc) + leaf_3(argc)
        + leaf_4(argc) + leaf_5(argc) + leaf_6(argc) + leaf_7(argc) + leaf_8(argc)
        + leaf_9(argc) + leaf_10(argc) + leaf_11(argc) + leaf_12(argc) + leaf_13(argc)
        + leaf_14(argc) + leaf_15(argc);
}
"#;

/// Built with frame pointers: `push rbp; mov rbp, rsp` gives `rbp + 16` CFA rows.
const FRAME_POINTER_C: &str = r#"
#include <stdio.h>
__attribute__((noinline, aligned(64))) int fp_function(int n) {
    volatile char buf[32];
    buf[0] = (char)n;
    printf("%d\n", n);
    return n + buf[0];
}
"#;

/// A caller for `fp_function`, for the program built wholly with frame pointers.
const FRAME_POINTER_MAIN_C: &str = r#"
int fp_function(int n);
int main(int argc, char **argv) {
    (void)argv;
    return fp_function(argc) + 1;
}
"#;

/// A library without frame pointers whose exported function calls a local leaf without
/// setting up any frame (GCC skips the stack alignment for a callee it knows needs none), so
/// every CFI row of the file is `CFA = RSP + 8` and yet a return address lies in it.
const FRAMELESS_CALLER_C: &str = r#"
volatile unsigned long frameless_sink;
static __attribute__((noinline, noclone)) unsigned long frameless_leaf(unsigned long n) {
    unsigned long x = 1;
    for (unsigned long i = 0; i < n; i++) x = x * 6364136223846793005UL + 1442695040888963407UL;
    frameless_sink = x;
    return x;
}
unsigned long frameless_outer(unsigned long n) {
    unsigned long r = frameless_leaf(n);
    return r ^ (r >> 7);
}
"#;

/// The fixture programs: `main` (CFI in `.eh_frame`), `debug_frame_only` (fp.c compiled
/// with `-g -fno-asynchronous-unwind-tables`, `.eh_frame` removed: CFI only in `.debug_frame`),
/// `all_frame_pointers` (every function built with frame pointers, leaves included) and
/// `frameless_caller` (a shared library, see [`FRAMELESS_CALLER_C`]).
struct Fixtures {
    main: Vec<u8>,
    debug_frame_only: Vec<u8>,
    all_frame_pointers: Vec<u8>,
    frameless_caller: Vec<u8>,
}

fn fixtures() -> Option<&'static Fixtures> {
    static FIXTURES: OnceLock<Result<Fixtures, String>> = OnceLock::new();
    match FIXTURES.get_or_init(build_fixtures) {
        Ok(fixtures) => Some(fixtures),
        Err(error) => {
            assert!(
                !requires_external(),
                "cannot build the gcc fixture: {error}"
            );
            eprintln!("skipped: cannot build the gcc fixture: {error}");
            None
        }
    }
}

/// The fixture executable's bytes; `None` if gcc is unavailable (and not required).
pub(super) fn fixture_elf() -> Option<&'static [u8]> {
    fixtures().map(|fixtures| &fixtures.main[..])
}

fn build_fixtures() -> Result<Fixtures, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let write = |name: &str, text: &str| {
        std::fs::write(dir.path().join(name), text).map_err(|e| e.to_string())
    };
    write("omit.c", OMIT_FRAME_POINTER_C)?;
    write("fp.c", FRAME_POINTER_C)?;
    write("fp_main.c", FRAME_POINTER_MAIN_C)?;
    write("frameless.c", FRAMELESS_CALLER_C)?;
    let run = |program: &str, args: &[&str]| -> Result<(), String> {
        let output = Command::new(program)
            .current_dir(dir.path())
            .args(args)
            .output()
            .map_err(|e| format!("{program}: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{program} {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    };
    let gcc = |args: &[&str]| run("gcc", args);
    let common = ["-O2", "-fcf-protection=none", "-c"];
    let unwind = ["-fasynchronous-unwind-tables"];
    gcc(&[
        &common[..],
        &unwind,
        &["-fomit-frame-pointer", "-falign-functions=1", "omit.c"],
    ]
    .concat())?;
    gcc(&[&common[..], &unwind, &["-fno-omit-frame-pointer", "fp.c"]].concat())?;
    // Lazy binding keeps the classic .plt with ld's CFA expression.
    gcc(&["-Wl,-z,lazy", "-o", "fixture", "omit.o", "fp.o"])?;
    gcc(&[
        &common[..],
        &[
            "-g",
            "-fno-asynchronous-unwind-tables",
            "-fno-omit-frame-pointer",
            "fp.c",
            "-o",
            "fp-debug.o",
        ],
    ]
    .concat())?;
    gcc(&["-o", "with-debug-frame", "omit.o", "fp-debug.o"])?;
    run(
        "objcopy",
        &[
            "--remove-section=.eh_frame",
            "--remove-section=.eh_frame_hdr",
            "with-debug-frame",
            "debug-frame-only",
        ],
    )?;
    let frame_pointers = ["-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"];
    for source in ["fp.c", "fp_main.c"] {
        let object = source.replace(".c", "-all-fp.o");
        gcc(&[
            &common[..],
            &unwind,
            &frame_pointers,
            &[source, "-o", &object],
        ]
        .concat())?;
    }
    gcc(&[
        "-Wl,-z,lazy",
        "-o",
        "all-fp",
        "fp-all-fp.o",
        "fp_main-all-fp.o",
    ])?;
    gcc(&[
        "-O2",
        "-fomit-frame-pointer",
        "-fcf-protection=none",
        "-shared",
        "-fPIC",
        "-o",
        "libframeless.so",
        "frameless.c",
    ])?;
    let read = |name: &str| std::fs::read(dir.path().join(name)).map_err(|e| e.to_string());
    Ok(Fixtures {
        main: read("fixture")?,
        debug_frame_only: read("debug-frame-only")?,
        all_frame_pointers: read("all-fp")?,
        frameless_caller: read("libframeless.so")?,
    })
}

struct Built {
    elf: &'static [u8],
    table: UnwindTable,
}

fn built() -> Option<Built> {
    let elf = fixture_elf()?;
    let table = build_table(elf).expect("fixture table builds");
    assert_well_formed(&table);
    Some(Built { elf, table })
}

fn symbol_range(elf: &[u8], name: &str) -> (u64, u64) {
    let file = object::File::parse(elf).expect("ELF");
    let symbol = file
        .symbols()
        .find(|symbol| symbol.name() == Ok(name))
        .unwrap_or_else(|| panic!("symbol {name}"));
    (symbol.address(), symbol.address() + symbol.size())
}

fn rows_in(table: &UnwindTable, (start, end): (u64, u64)) -> Vec<TableRow> {
    table
        .rows()
        .iter()
        .filter(|row| (start..end).contains(&row.address))
        .copied()
        .collect()
}

#[test]
fn fixture_lookup_matches_gimli_for_every_pc() {
    let Some(Built { elf, table }) = built() else {
        return;
    };
    let coverage = check_against_oracle(elf, &table);
    assert!(coverage.pcs_checked > 300, "{coverage:?}");
    assert!(
        coverage.gap_pcs_checked > 0,
        "padding between functions: {coverage:?}"
    );
}

#[test]
fn gaps_between_fdes_get_none_rows() {
    let Some(Built { elf, table }) = built() else {
        return;
    };
    let mut fdes = oracle_fdes(elf);
    fdes.sort_by_key(|fde| fde.start);
    let gaps: Vec<(u64, u64)> = fdes
        .windows(2)
        .filter(|pair| pair[0].end < pair[1].start)
        .map(|pair| (pair[0].end, pair[1].start))
        .collect();
    assert!(!gaps.is_empty(), "aligned functions leave padding");
    for (gap_start, gap_end) in gaps {
        assert!(
            table.rows().contains(&TableRow {
                address: gap_start,
                rule: Rule::NONE
            }),
            "CFA_NONE row at {gap_start:#x}"
        );
        for pc in gap_start..gap_end {
            assert_eq!(table.lookup(pc).map(|row| row.cfa_kind), Some(CFA_NONE));
        }
    }
    let last_end = fdes.iter().map(|fde| fde.end).max().expect("FDEs");
    assert_eq!(table.rows().last().map(|row| row.address), Some(last_end));
    let first_start = fdes[0].start;
    if first_start & 0xffff != 0 {
        assert_eq!(
            table.lookup(first_start - 1).map(|row| row.cfa_kind),
            Some(CFA_NONE),
            "before the first FDE in its page"
        );
    }
    assert_eq!(
        table.lookup((first_start & !0xffff).wrapping_sub(1)),
        None,
        "no page before the first FDE's page"
    );
}

#[test]
fn plt_rows_use_the_plt_rule() {
    let Some(Built { elf, table }) = built() else {
        return;
    };
    let file = object::File::parse(elf).expect("ELF");
    let plt = file.section_by_name(".plt").expect(".plt section");
    assert!(plt.size() >= 32, "PLT0 plus at least one entry");
    // PLT0 pushes and jumps: rsp+16, then rsp+24; the entries use ld's expression.
    let plt0 = table.lookup(plt.address()).expect("row for PLT0");
    assert_eq!((plt0.cfa_kind, plt0.cfa_offset), (CFA_RSP, 16));
    for pc in plt.address() + 16..plt.address() + plt.size() {
        assert_eq!(
            table.lookup(pc).map(|row| row.cfa_kind),
            Some(CFA_PLT),
            "{pc:#x}"
        );
    }
    assert!(table.stats().plt_rows >= 1);
    assert_eq!(table.stats().unsupported_cfa_expressions, 0);
}

#[test]
fn start_is_the_outermost_frame() {
    let Some(Built { elf, table }) = built() else {
        return;
    };
    let (start, end) = symbol_range(elf, "_start");
    let end = end.max(start + 1);
    for pc in start..end {
        assert_eq!(
            table.lookup(pc).map(|row| row.cfa_kind),
            Some(CFA_END),
            "{pc:#x}"
        );
    }
}

#[test]
fn frame_pointer_function_has_rbp_rows() {
    let Some(Built { elf, table }) = built() else {
        return;
    };
    let fp_rows = rows_in(&table, symbol_range(elf, "fp_function"));
    let rbp_frame = Rule {
        cfa_kind: CFA_RBP,
        rbp_kind: RBP_AT_CFA,
        cfa_offset: 16,
        rbp_offset: -16,
    };
    assert!(
        fp_rows.iter().any(|row| row.rule == rbp_frame),
        "CFA = rbp + 16, rbp saved at CFA - 16: {fp_rows:?}"
    );
    let omit_rows = rows_in(&table, symbol_range(elf, "omit_function"));
    assert!(
        omit_rows.len() > 1,
        "pushes change the CFA offset: {omit_rows:?}"
    );
    // rbp may be saved as a callee-saved register, but the CFA never uses it.
    assert!(
        omit_rows.iter().all(|row| row.rule.cfa_kind == CFA_RSP),
        "{omit_rows:?}"
    );
}

#[test]
fn merging_shrinks_the_adjacent_leaf_rows() {
    let Some(Built { elf, table }) = built() else {
        return;
    };
    let stats = table.stats();
    assert!(
        stats.rows_after_merge < stats.rows_before_merge,
        "{stats:?}"
    );
    let (first_leaf, _) = symbol_range(elf, "leaf_0");
    let (last_leaf, last_leaf_end) = symbol_range(elf, "leaf_15");
    let (low, high) = (first_leaf.min(last_leaf), first_leaf.max(last_leaf_end));
    let leaf_rows = rows_in(&table, (low, high));
    assert!(
        leaf_rows.len() < 4,
        "sixteen back-to-back leaves with one rule merge into one row: {leaf_rows:?}"
    );
    assert!(
        rows_in(&table, (low, high))
            .iter()
            .all(|row| row.rule.cfa_kind == CFA_RSP)
    );
}

#[test]
fn debug_frame_is_used_without_eh_frame() {
    let Some(fixtures) = fixtures() else {
        return;
    };
    let elf = &fixtures.debug_frame_only[..];
    let table = build_table(elf).expect("table from .debug_frame");
    assert_well_formed(&table);
    assert_eq!(table.stats().source, CfiSource::DebugFrame);
    assert_eq!(table.stats().fdes, 1, "only fp.c has CFI there");
    let (start, end) = symbol_range(elf, "fp_function");
    assert!(
        rows_in(&table, (start, end))
            .iter()
            .any(|row| row.rule.cfa_kind == CFA_RBP && row.rule.rbp_kind == RBP_AT_CFA)
    );
    assert_eq!(
        table
            .lookup(start)
            .map(|row| (row.cfa_kind, row.cfa_offset)),
        Some((CFA_RSP, 8))
    );
    let (omit_start, _) = symbol_range(elf, "omit_function");
    assert!(
        table
            .lookup(omit_start)
            .is_none_or(|row| row.cfa_kind == CFA_NONE),
        "no CFI for omit.c's functions"
    );
}

#[test]
fn frame_pointers_are_reliable_only_when_every_caller_keeps_the_frame() {
    let Some(fixtures) = fixtures() else { return };
    let all_fp = build_table(&fixtures.all_frame_pointers).expect("all-fp table builds");
    assert!(
        all_fp.frame_pointers_reliable(),
        "a program built with frame pointers throughout (its lazy PLT included): {:?}",
        all_fp.stats()
    );
    assert!(
        all_fp.stats().call_sites.call_sites >= 2,
        "{:?}",
        all_fp.stats()
    );
    // omit_function calls snprintf and puts from a frameless body (CFA = RSP + n).
    let mixed = build_table(&fixtures.main).expect("fixture table builds");
    let (omit_start, omit_end) = symbol_range(&fixtures.main, "omit_function");
    let (main_start, main_end) = symbol_range(&fixtures.main, "main");
    let first = mixed.stats().call_sites.first_frame_breaking_call;
    assert!(
        (omit_start..omit_end).contains(&first) || (main_start..main_end).contains(&first),
        "the first call outside a frame is in omit_function or main: {:?}",
        mixed.stats()
    );
    assert!(!mixed.frame_pointers_reliable());
}

/// Every row of this library keeps the "entry" rule `CFA = RSP + 8`, which row-based reasoning
/// took for frame-pointer code; the call from `frameless_outer` proves otherwise.
#[test]
fn a_call_made_without_a_frame_makes_frame_pointers_unreliable() {
    let Some(fixtures) = fixtures() else { return };
    let elf = &fixtures.frameless_caller[..];
    let table = build_table(elf).expect("library table builds");
    assert_well_formed(&table);
    let (outer_start, outer_end) = symbol_range(elf, "frameless_outer");
    let outer_rows = rows_in(&table, (outer_start, outer_end));
    assert!(
        outer_rows
            .iter()
            .all(|row| row.rule.cfa_kind == CFA_RSP && row.rule.cfa_offset == 8),
        "frameless_outer never moves RSP (GCC output changed?): {outer_rows:?}"
    );
    let first = table.stats().call_sites.first_frame_breaking_call;
    assert!(
        (outer_start..outer_end).contains(&first),
        "the call in frameless_outer ({outer_start:#x}..{outer_end:#x}) breaks the frame chain, \
         found {first:#x}: {:?}",
        table.stats()
    );
    assert!(!table.frame_pointers_reliable());
}
