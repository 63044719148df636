//! Tests of the unwind-table builder.
//!
//! - `real_libraries`: every PC of libc, libstdc++ and libpython3.11 against gimli's own rows.
//! - `fixture`: a tiny program built with gcc at test time (gaps, PLT, `_start`, rbp frames).
//! - `fuzz`: proptest mutations of real CFI, plus the committed corpus in
//!   `profiler-user/tests/corpus/eh_frame/`. Longer run:
//!   `PROPTEST_CASES=20000 cargo test -p profiler-user --release --lib unwinding::tables::tests::fuzz`.
//! - `cache`: the disk cache round trip and rejection of damaged files.
//! - `limits`: a synthetic ELF with hundreds of thousands of FDEs against the build limits
//!   (rejected before any row is decoded, the builder's allocations measured).
//!
//! The oracle below maps gimli's rows on its own (not through the builder's `map_rule`) and
//! applies the documented policies (gaps → `CFA_NONE`, overlapping FDEs: first start wins).

mod cache;
mod fixture;
mod fuzz;
mod limits;
mod real_libraries;

use std::path::PathBuf;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, EhFrame, EndianSlice, LittleEndian, Register, RegisterRule,
    UnwindContext, UnwindSection, UnwindTableRow,
};
use object::{Object, ObjectSection};
use profiler_common::unwind::{
    CFA_NONE, CFA_PLT, CFA_RBP, CFA_RBP_DEREF, CFA_RSP, RBP_AT_CFA, RBP_AT_RBP, RBP_UNCHANGED,
    UnwindRow,
};

use super::{Rule, UnwindTable};

/// ld's `.plt` CFA expressions (threshold `DW_OP_lit11`, or `DW_OP_lit10` with IBT).
const PLT_EXPRESSIONS: [[u8; 11]; 2] = [
    [0x77, 8, 0x80, 0, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22],
    [0x77, 8, 0x80, 0, 0x3f, 0x1a, 0x3a, 0x2a, 0x33, 0x24, 0x22],
];

fn requires_external() -> bool {
    std::env::var("PROFILER_REQUIRE_EXTERNAL").is_ok_and(|value| value == "1")
}

/// The bytes of a file the test needs from the machine; `None` (after printing why) when it is
/// missing and `PROFILER_REQUIRE_EXTERNAL=1` is not set.
fn external_file(path: &std::path::Path, what: &str) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(error) => {
            assert!(
                !requires_external(),
                "{what} ({}) is required: {error}",
                path.display()
            );
            eprintln!(
                "skipped: {what} not readable at {}: {error}",
                path.display()
            );
            None
        }
    }
}

fn pyenv_root() -> Option<PathBuf> {
    std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".pyenv")))
}

/// One FDE as gimli evaluates it, with the rules mapped by the oracle.
struct OracleFde {
    start: u64,
    end: u64,
    signal: bool,
    /// `(start, end, rule)` of every non-empty row.
    rows: Vec<(u64, u64, Rule)>,
}

/// Every FDE of the file's `.eh_frame`, evaluated by gimli.
fn oracle_fdes(elf: &[u8]) -> Vec<OracleFde> {
    let file = object::File::parse(elf).expect("ELF");
    let eh_frame_section = file.section_by_name(".eh_frame").expect(".eh_frame");
    let data = eh_frame_section.data().expect(".eh_frame data");
    let plt_ranges: Vec<(u64, u64)> = [".plt", ".plt.sec", ".plt.got"]
        .iter()
        .filter_map(|name| file.section_by_name(name))
        .map(|s| (s.address(), s.address() + s.size()))
        .collect();
    let mut eh_frame = EhFrame::new(data, LittleEndian);
    eh_frame.set_address_size(8);
    let mut bases = BaseAddresses::default().set_eh_frame(eh_frame_section.address());
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    if let Some(got) = file.section_by_name(".got") {
        bases = bases.set_got(got.address());
    }
    let mut context = UnwindContext::new();
    let mut fdes = Vec::new();
    let mut entries = eh_frame.entries(&bases);
    while let Some(entry) = entries.next().expect("CFI entry") {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let fde = partial
            .parse(|section, bases, offset| section.cie_from_offset(bases, offset))
            .expect("FDE");
        if fde.len() == 0 {
            continue;
        }
        let (start, end) = (fde.initial_address(), fde.end_address());
        let in_plt = plt_ranges
            .iter()
            .any(|&(plt_start, plt_end)| plt_start <= start && end <= plt_end);
        let return_address = fde.cie().return_address_register();
        let mut rows = Vec::new();
        if !fde.is_signal_trampoline() {
            let mut table = fde
                .rows(&eh_frame, &bases, &mut context)
                .expect("CFA program");
            while let Some(row) = table.next_row().expect("CFA row") {
                let (row_start, row_end) = (row.start_address(), row.end_address().min(end));
                if row_start < row_end {
                    let rule = oracle_rule(row, return_address, in_plt, &eh_frame);
                    rows.push((row_start, row_end, rule));
                }
            }
        }
        fdes.push(OracleFde {
            start,
            end,
            signal: fde.is_signal_trampoline(),
            rows,
        });
    }
    fdes
}

fn oracle_rule(
    row: &UnwindTableRow<usize>,
    return_address: Register,
    in_plt: bool,
    eh_frame: &EhFrame<EndianSlice<'_, LittleEndian>>,
) -> Rule {
    if row.register(return_address) == Some(RegisterRule::Undefined) {
        return Rule::END;
    }
    let cfa = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => match register.0 {
            7 => i16::try_from(*offset).ok().map(|offset| (CFA_RSP, offset)),
            6 => i16::try_from(*offset).ok().map(|offset| (CFA_RBP, offset)),
            _ => None,
        },
        CfaRule::Expression(expression) => {
            let bytes = expression.get(eh_frame).expect("expression").0.slice();
            if in_plt || PLT_EXPRESSIONS.iter().any(|plt| plt == bytes) {
                Some((CFA_PLT, 0))
            } else {
                // The word at RBP + n: evaluated by gimli with RBP = 0x1000 and memory that
                // answers `address + 1`, which only that expression turns into 0x1001 + n.
                evaluate(bytes, 0x1000, |address| address + 1)
                    .and_then(|value| i16::try_from(value.wrapping_sub(0x1001) as i64).ok())
                    .filter(|n| {
                        evaluate(bytes, 0x2000, |address| address + 1)
                            == Some(0x2001u64.wrapping_add(*n as i64 as u64))
                    })
                    .map(|n| (CFA_RBP_DEREF, n))
            }
        }
    };
    let Some((cfa_kind, cfa_offset)) = cfa else {
        return Rule::UNSUPPORTED;
    };
    let (rbp_kind, rbp_offset) = match row.register(Register(6)) {
        Some(RegisterRule::Offset(offset)) => match i16::try_from(offset) {
            Ok(offset) => (RBP_AT_CFA, offset),
            Err(_) => return Rule::UNSUPPORTED,
        },
        Some(RegisterRule::Expression(expression)) => {
            let bytes = expression.get(eh_frame).expect("expression").0.slice();
            // An address RBP + n: the same n for two values of RBP, and no memory read.
            let at = |rbp: u64| evaluate(bytes, rbp, |_| u64::MAX);
            match (at(0x1000), at(0x2000)) {
                (Some(a), Some(b)) if b.wrapping_sub(a) == 0x1000 => {
                    match i16::try_from(a.wrapping_sub(0x1000) as i64) {
                        Ok(n) => (RBP_AT_RBP, n),
                        Err(_) => return Rule::UNSUPPORTED,
                    }
                }
                _ => (RBP_UNCHANGED, 0),
            }
        }
        _ => (RBP_UNCHANGED, 0),
    };
    Rule {
        cfa_kind,
        rbp_kind,
        cfa_offset,
        rbp_offset,
    }
}

/// Evaluates a DWARF expression with gimli, RBP = `rbp` (any other register stops it) and
/// memory answered by `memory`; `None` if it needs anything else.
fn evaluate(bytes: &[u8], rbp: u64, memory: impl Fn(u64) -> u64) -> Option<u64> {
    let encoding = gimli::Encoding {
        address_size: 8,
        format: gimli::Format::Dwarf32,
        version: 4,
    };
    let expression = gimli::Expression(EndianSlice::new(bytes, LittleEndian));
    let mut evaluation = expression.evaluation(encoding);
    let mut result = evaluation.evaluate().ok()?;
    for _ in 0..8 {
        result = match result {
            gimli::EvaluationResult::Complete => {
                let pieces = evaluation.result();
                return match pieces.as_slice() {
                    [
                        gimli::Piece {
                            location: gimli::Location::Address { address },
                            ..
                        },
                    ] => Some(*address),
                    _ => None,
                };
            }
            gimli::EvaluationResult::RequiresRegister { register, .. } if register.0 == 6 => {
                evaluation
                    .resume_with_register(gimli::Value::Generic(rbp))
                    .ok()?
            }
            gimli::EvaluationResult::RequiresMemory { address, .. } => evaluation
                .resume_with_memory(gimli::Value::Generic(memory(address)))
                .ok()?,
            _ => return None,
        };
    }
    None
}

#[derive(Debug, Default)]
struct Coverage {
    fdes: usize,
    oracle_rows: usize,
    /// PCs inside FDEs whose lookup was compared with gimli's row.
    pcs_checked: u64,
    /// PCs between FDEs checked to have no rule (`CFA_NONE` or no page).
    gap_pcs_checked: u64,
    /// PCs of an FDE already covered by one starting earlier (first wins), not compared.
    overlapped_pcs: u64,
}

/// Compares `table.lookup` with gimli's rows for every PC of every FDE, and checks that PCs
/// between FDEs and after the last one have no rule.
fn check_against_oracle(elf: &[u8], table: &UnwindTable) -> Coverage {
    let mut fdes = oracle_fdes(elf);
    fdes.sort_by_key(|fde| fde.start);
    let mut coverage = Coverage {
        fdes: fdes.len(),
        oracle_rows: fdes.iter().map(|fde| fde.rows.len()).sum(),
        ..Coverage::default()
    };
    let mut mismatches = Vec::new();
    let mut check = |pc: u64, expected: Rule, found: Option<UnwindRow>| {
        if found.map(|row| Rule::of(&row)) != Some(expected) && mismatches.len() < 10 {
            mismatches.push(format!("{pc:#x}: expected {expected:?}, found {found:?}"));
        }
    };
    let mut covered_end: Option<u64> = None;
    for fde in &fdes {
        let from = match covered_end {
            Some(end) if end > fde.start => {
                coverage.overlapped_pcs += end.min(fde.end) - fde.start;
                end
            }
            Some(end) => {
                for pc in end..fde.start {
                    let found = table.lookup(pc);
                    if found.is_some_and(|row| row.cfa_kind != CFA_NONE) {
                        check(pc, Rule::NONE, found);
                    }
                    coverage.gap_pcs_checked += 1;
                }
                fde.start
            }
            None => fde.start,
        };
        if fde.signal {
            for pc in from..fde.end {
                check(pc, Rule::SIGNAL, table.lookup(pc));
                coverage.pcs_checked += 1;
            }
        }
        for &(start, end, rule) in &fde.rows {
            for pc in start.max(from)..end {
                check(pc, rule, table.lookup(pc));
                coverage.pcs_checked += 1;
            }
        }
        covered_end = Some(covered_end.map_or(fde.end, |end| end.max(fde.end)));
    }
    if let Some(end) = covered_end {
        for pc in end..end + 64 {
            let found = table.lookup(pc);
            if found.is_some_and(|row| row.cfa_kind != CFA_NONE) {
                check(pc, Rule::NONE, found);
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "lookup disagrees with gimli:\n{}",
        mismatches.join("\n")
    );
    coverage
}

/// Structural invariants every built table must have.
fn assert_well_formed(table: &UnwindTable) {
    let rows = table.rows();
    assert!(rows.windows(2).all(|w| w[0].address < w[1].address));
    assert!(rows.windows(2).all(|w| w[0].rule != w[1].rule), "merged");
    if let Some(last) = rows.last() {
        assert_eq!(last.rule, Rule::NONE, "end marker");
    }
    let pages = table.pages();
    assert!(
        pages.windows(2).all(|w| w[0].0 + 1 == w[1].0),
        "contiguous pages"
    );
    for (page, page_rows) in &pages {
        assert_eq!(
            page_rows.first().map(|r| r.pc_low),
            Some(0),
            "page {page:#x}"
        );
        assert!(page_rows.windows(2).all(|w| w[0].pc_low < w[1].pc_low));
    }
}
