//! The key test: for every PC that real libraries' CFI covers, the table's lookup (the BPF
//! search) gives the rule gimli computes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use object::{Object, ObjectSection};
use profiler_common::unwind::{CFA_SIGNAL, PAGE_SHIFT};

use super::{assert_well_formed, check_against_oracle, external_file, oracle_fdes, pyenv_root};
use crate::unwinding::tables::{CfiSource, UnwindTable, build_table};

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";
const LIBSTDCXX: &str = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6";

fn libpython311() -> Option<PathBuf> {
    pyenv_root().map(|root| root.join("versions/3.11.7/lib/libpython3.11.so.1.0"))
}

/// Builds the table of `path` and compares it with gimli for every covered PC.
fn check_library(path: &Path, what: &str, min_pcs: u64, min_rows: usize) {
    let Some(elf) = external_file(path, what) else {
        return;
    };
    let started = Instant::now();
    let table = build_table(&elf).expect("table builds");
    let build_time = started.elapsed();
    let stats = table.stats();
    assert_eq!(stats.source, CfiSource::EhFrame);
    assert_well_formed(&table);
    let stored = table.paged().rows().len() as u64;
    assert!(
        stored <= stats.row_bound,
        "{what}: {stored} rows; {stats:?}"
    );
    // Distribution builds omit frame pointers: decoding finds a call made outside a frame
    // (libc is not decoded at all: its signal trampoline rules it out first).
    if stats.signal_fdes == 0 {
        assert_ne!(
            stats.call_sites.first_frame_breaking_call, 0,
            "{what}: {stats:?}"
        );
    }
    assert!(!table.frame_pointers_reliable());
    let coverage = check_against_oracle(&elf, &table);
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    eprintln!(
        "{what}: {} FDEs, {} gimli rows, {} rows merged, {} pages, {} bytes; {} PCs checked, \
         {} gap PCs, {} overlapped; built in {build_time:?} ({profile} build); {stats:?}",
        coverage.fdes,
        coverage.oracle_rows,
        table.row_count(),
        table.page_count(),
        table.memory_bytes(),
        coverage.pcs_checked,
        coverage.gap_pcs_checked,
        coverage.overlapped_pcs,
    );
    assert!(
        coverage.pcs_checked > min_pcs,
        "{what}: only {} PCs checked",
        coverage.pcs_checked
    );
    assert!(
        table.row_count() > min_rows,
        "{what}: {} rows",
        table.row_count()
    );
    assert_eq!(coverage.overlapped_pcs, 0, "{what} has no overlapping FDEs");
    assert_eq!(
        stats.fdes as usize,
        coverage.fdes + stats.empty_fdes as usize
    );
}

#[test]
fn libc_lookup_matches_gimli_for_every_pc() {
    check_library(Path::new(LIBC), "libc", 1_000_000, 10_000);
}

#[test]
fn libstdcxx_lookup_matches_gimli_for_every_pc() {
    check_library(Path::new(LIBSTDCXX), "libstdc++", 700_000, 10_000);
}

#[test]
fn libpython_lookup_matches_gimli_for_every_pc() {
    let path = libpython311().unwrap_or_default();
    check_library(&path, "pyenv libpython3.11", 1_500_000, 30_000);
}

/// glibc's `__restore_rt` is not exported; its FDE is the one with the `S` augmentation. It
/// covers a nop plus `mov $15, %rax; syscall`, so it must end with a `syscall` instruction.
#[test]
fn libc_restore_rt_is_a_signal_frame() {
    let Some(elf) = external_file(Path::new(LIBC), "libc") else {
        return;
    };
    let table = build_table(&elf).expect("table builds");
    assert_eq!(table.stats().signal_fdes, 1);
    // A signal trampoline needs the table, so the file never qualifies for the frame-pointer
    // shortcut (and its code is not even decoded).
    assert!(!table.frame_pointers_reliable());
    assert_eq!(table.stats().call_sites.code_bytes, 0);
    let signal_fdes: Vec<_> = oracle_fdes(&elf)
        .into_iter()
        .filter(|fde| fde.signal)
        .collect();
    assert_eq!(signal_fdes.len(), 1, "one signal trampoline in libc");
    let (start, end) = (signal_fdes[0].start, signal_fdes[0].end);
    assert!(end - start <= 16, "tiny range {start:#x}..{end:#x}");

    let file = object::File::parse(&*elf).expect("ELF");
    let text = file.section_by_name(".text").expect(".text");
    let code = text.data().expect(".text data");
    let end_in_text = usize::try_from(end - text.address()).expect("offset");
    assert_eq!(
        &code[end_in_text - 2..end_in_text],
        &[0x0f, 0x05],
        "ends with syscall"
    );
    for pc in start..end {
        assert_eq!(table.lookup(pc).map(|row| row.cfa_kind), Some(CFA_SIGNAL));
    }
    // The rows around it are ordinary ones (or gaps), not signal frames.
    assert_ne!(table.lookup(end).map(|row| row.cfa_kind), Some(CFA_SIGNAL));
    assert_ne!(
        table.lookup(start - 1).map(|row| row.cfa_kind),
        Some(CFA_SIGNAL)
    );
    // The page holding it exists and starts at offset 0.
    let page = u32::try_from(start >> PAGE_SHIFT).expect("page");
    assert!(
        table
            .pages()
            .iter()
            .any(|(number, rows)| *number == page && rows[0].pc_low == 0)
    );
}

/// The table of a library of `.tools/torch-venv` (`cargo xtask setup`), at `relative` to its
/// site-packages; `None` (the test skipped) where the venv is not installed.
fn torch_venv_table(relative: &str) -> Option<UnwindTable> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../.tools/torch-venv/lib/python3.11/site-packages")
        .join(relative);
    let elf = external_file(
        &path,
        &format!("{relative} of the torch venv (cargo xtask setup)"),
    )?;
    Some(build_table(&elf).expect("table builds"))
}

/// NVIDIA's libnvrtc (from PyTorch's CUDA wheels in `.tools/torch-venv`) has FDEs whose
/// programs gimli cannot evaluate ("invalid context for call frame instruction"): the table
/// is built anyway, those FDEs' ranges without CFI, and every other FDE's rows are gimli's.
/// Before, one such FDE failed the whole library (seen on an H100 host).
#[test]
fn a_library_with_malformed_fde_programs_keeps_the_rest_of_its_table() {
    let Some(table) = torch_venv_table("nvidia/cu13/lib/libnvrtc.so.13") else {
        return;
    };
    let stats = table.stats();
    eprintln!("libnvrtc: {} rows; {stats:?}", table.row_count());
    assert!(stats.malformed_fdes > 0, "{stats:?}");
    assert!(stats.malformed_fdes * 100 < stats.fdes, "{stats:?}");
    assert!(table.row_count() > 100_000, "{} rows", table.row_count());
    assert!(!table.frame_pointers_reliable());
    assert_well_formed(&table);
}

/// The largest library the agent meets (libtorch_cpu, 2.7 M rows, from `.tools/torch-venv`):
/// its rows are reserved at once, so the row vector is never copied to grow (each copy held
/// both vectors, up to 52 MiB), and the bound it is reserved at holds.
#[test]
fn a_large_table_is_built_without_growing_its_rows_by_copies() {
    let Some(table) = torch_venv_table("torch/lib/libtorch_cpu.so") else {
        return;
    };
    let stats = table.stats();
    let stored = table.paged().rows().len() as u64;
    eprintln!("libtorch_cpu: {stored} rows; {stats:?}");
    assert!(stored > 1_000_000, "{stored} rows");
    assert!(stored <= stats.row_bound, "{stats:?}");
    assert_eq!(stats.row_vector_growths, 0, "{stats:?}");
    assert_well_formed(&table);
}
