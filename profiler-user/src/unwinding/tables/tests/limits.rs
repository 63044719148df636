//! The build limits against a synthetic ELF whose `.eh_frame` holds many small FDEs: a table
//! that cannot fit is rejected before it is materialized, and the builder's own allocations
//! (measured by a counting allocator, per thread) stay within [`BuildLimits::working_bytes`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::unwinding::tables::{
    BuildLimits, TableError, build_table, build_table_within, check_fde_count,
};

/// Counts the bytes each thread has allocated and not freed, and their peak.
struct CountingAllocator;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| {
            if now > peak.get() {
                peak.set(now);
            }
        });
    });
}

// SAFETY: every call goes to `System`; only the counting is added.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            note(layout.size() as isize);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            note(layout.size() as isize);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Runs `f` and returns its result with the most bytes it held allocated at once (on this
/// thread, beyond what was allocated before).
fn peak_allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(base));
    let result = f();
    let peak = PEAK.with(Cell::get);
    (result, (peak - base).max(0) as usize)
}

const EH_FRAME_ADDRESS: u64 = 0x10_0000;
const CODE_ADDRESS: u64 = 0x1000_0000;
/// Each FDE covers 16 bytes with two rules (`rsp+8`, then `rsp+16` from its second byte) and
/// is followed by a 16-byte gap: three merged rows an FDE.
const FDE_SPACING: u64 = 32;
const ROWS_PER_FDE: usize = 3;

/// A minimal x86_64 ELF (section headers only: `.eh_frame`, `.shstrtab`) whose `.eh_frame`
/// has one CIE and `fdes` FDEs of 20 bytes each.
fn synthetic_elf(fdes: usize) -> Vec<u8> {
    synthetic_elf_claiming(fdes, None)
}

/// [`synthetic_elf`], with an `.eh_frame_hdr` whose header claims `claimed` FDEs (its table
/// left out).
fn synthetic_elf_claiming(fdes: usize, claimed: Option<u32>) -> Vec<u8> {
    let mut eh = Vec::with_capacity(24 + fdes * 20 + 4);
    // CIE: id 0, version 1, "zR", code align 1, data align -8, RA r16, FDE pointers
    // pcrel|sdata4; CFA = rsp + 8, RA at CFA - 8; two DW_CFA_nop.
    let cie: [u8; 20] = [
        0, 0, 0, 0, 1, b'z', b'R', 0, 1, 0x78, 16, 1, 0x1b, 0x0c, 7, 8, 0x90, 1, 0, 0,
    ];
    eh.extend((cie.len() as u32).to_le_bytes());
    eh.extend(cie);
    for index in 0..fdes {
        let start = eh.len();
        eh.extend(16u32.to_le_bytes());
        // The CIE pointer: from this field back to the CIE at offset 0.
        eh.extend(((start + 4) as u32).to_le_bytes());
        let pc = CODE_ADDRESS + index as u64 * FDE_SPACING;
        let field = EH_FRAME_ADDRESS + eh.len() as u64;
        eh.extend(((pc as i64 - field as i64) as i32).to_le_bytes());
        eh.extend(16u32.to_le_bytes());
        // No augmentation data; DW_CFA_advance_loc 1; DW_CFA_def_cfa_offset 16.
        eh.extend([0, 0x41, 0x0e, 0x10]);
    }
    eh.extend(0u32.to_le_bytes());
    // version 1, eh_frame_ptr pcrel|sdata4, fde_count udata4, table datarel|sdata4.
    let hdr: Option<Vec<u8>> = claimed.map(|count| {
        let mut hdr = vec![1, 0x1b, 0x03, 0x3b];
        hdr.extend(0i32.to_le_bytes());
        hdr.extend(count.to_le_bytes());
        hdr
    });

    let shstrtab = b"\0.eh_frame\0.shstrtab\0.eh_frame_hdr\0";
    // (name, type, flags, address, bytes)
    let mut sections: Vec<(u32, u32, u64, u64, &[u8])> =
        vec![(1, 1, 2, EH_FRAME_ADDRESS, &eh), (11, 3, 0, 0, shstrtab)];
    if let Some(hdr) = &hdr {
        sections.push((21, 1, 2, EH_FRAME_ADDRESS - 0x1000, hdr));
    }
    let mut elf = vec![0u8; 0x1000];
    let mut placed = Vec::new();
    for (_, _, _, _, bytes) in &sections {
        placed.push(elf.len());
        elf.extend_from_slice(bytes);
    }
    elf.resize(elf.len().next_multiple_of(8), 0);
    let headers_offset = elf.len();
    elf.extend([0u8; 64]); // the null section
    for ((name, kind, flags, address, bytes), offset) in sections.iter().zip(&placed) {
        elf.extend(name.to_le_bytes());
        elf.extend(kind.to_le_bytes());
        elf.extend(flags.to_le_bytes());
        elf.extend(address.to_le_bytes());
        elf.extend((*offset as u64).to_le_bytes());
        elf.extend((bytes.len() as u64).to_le_bytes());
        elf.extend([0u8; 8]); // link, info
        elf.extend(8u64.to_le_bytes()); // align
        elf.extend(0u64.to_le_bytes()); // entsize
    }
    let put = |elf: &mut Vec<u8>, at: usize, bytes: &[u8]| {
        elf[at..at + bytes.len()].copy_from_slice(bytes)
    };
    put(&mut elf, 0, &[0x7f, b'E', b'L', b'F', 2, 1, 1]);
    put(&mut elf, 16, &3u16.to_le_bytes()); // ET_DYN
    put(&mut elf, 18, &62u16.to_le_bytes()); // EM_X86_64
    put(&mut elf, 20, &1u32.to_le_bytes());
    put(&mut elf, 40, &(headers_offset as u64).to_le_bytes()); // e_shoff
    put(&mut elf, 52, &64u16.to_le_bytes()); // e_ehsize
    put(&mut elf, 54, &56u16.to_le_bytes()); // e_phentsize
    put(&mut elf, 58, &64u16.to_le_bytes()); // e_shentsize
    put(&mut elf, 60, &(sections.len() as u16 + 1).to_le_bytes()); // e_shnum
    put(&mut elf, 62, &2u16.to_le_bytes()); // e_shstrndx
    elf
}

fn budget_limits(max_rows: usize) -> BuildLimits {
    BuildLimits {
        max_rows,
        ..BuildLimits::default()
    }
}

#[test]
fn synthetic_elf_builds_within_the_default_limits() {
    let elf = synthetic_elf(1000);
    let table = build_table(&elf).expect("synthetic table builds");
    assert_eq!(table.stats().fdes, 1000);
    // Three rows an FDE, plus the page start rows.
    assert!(
        table.row_count() >= 1000 * ROWS_PER_FDE,
        "{}",
        table.row_count()
    );
    let first = table
        .lookup(CODE_ADDRESS + 1)
        .expect("row in the first FDE");
    assert_eq!(first.cfa_offset, 16);
}

/// 200,000 FDEs (a 4 MB `.eh_frame`, 600,000 rows) against a 64 Ki-row budget: rejected from
/// the count, before any row is decoded, allocating next to nothing; with the fixed bounds
/// only, the same file is built and takes megabytes (so the measurement can tell).
#[test]
fn a_file_with_more_fdes_than_the_budget_is_rejected_before_building() {
    let fdes = 200_000;
    let elf = synthetic_elf(fdes);
    let limits = budget_limits(1 << 16);
    let (outcome, peak) = peak_allocated(|| build_table_within(&elf, &limits));
    match outcome {
        Err(TableError::TooLarge {
            what,
            count,
            limit,
            rows_decoded,
        }) => {
            assert_eq!(what, "FDEs");
            assert_eq!(count, fdes as u64);
            assert_eq!(limit, limits.max_fdes() as u64);
            assert_eq!(rows_decoded, 0, "rejected before any row was decoded");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(outcome_is_too_large(&elf, &limits));
    assert!(
        peak < 256 << 10,
        "the rejection allocated {peak} bytes (the input is {} bytes)",
        elf.len()
    );

    let (built, unbounded_peak) = peak_allocated(|| build_table(&elf));
    let built = built.expect("builds without a budget");
    assert!(built.row_count() >= fdes * ROWS_PER_FDE);
    assert!(
        unbounded_peak > fdes * 16,
        "a full build holds the FDE index and the rows: {unbounded_peak} bytes"
    );
}

fn outcome_is_too_large(elf: &[u8], limits: &BuildLimits) -> bool {
    build_table_within(elf, limits).is_err_and(|err| err.is_too_large())
}

/// FDEs within the count bound whose rows pass the row budget: the build stops where the rows
/// reach the budget, and never allocated more than the working-memory bound.
#[test]
fn rows_over_the_budget_stop_the_build_within_its_working_memory() {
    let max_rows = 1 << 16;
    let limits = budget_limits(max_rows);
    let fdes = limits.max_fdes() - 10;
    assert!(fdes * ROWS_PER_FDE > max_rows);
    let elf = synthetic_elf(fdes);
    let (outcome, peak) = peak_allocated(|| build_table_within(&elf, &limits));
    match outcome {
        Err(TableError::TooLarge {
            what, rows_decoded, ..
        }) => {
            assert_eq!(what, "rows");
            assert_eq!(rows_decoded, max_rows as u64, "stopped at the budget");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(
        peak <= limits.working_bytes(),
        "peak {peak} bytes over the bound {}",
        limits.working_bytes()
    );
    // The FDE index and at most the budget's rows (8 bytes each), with slack for the rest.
    assert!(
        peak <= fdes * 16 + max_rows * 8 * 3 / 2 + (256 << 10),
        "peak {peak} bytes"
    );

    // A budget with room builds the same file.
    let roomy = budget_limits(fdes * ROWS_PER_FDE * 2);
    let table = build_table_within(&elf, &roomy).expect("fits a larger budget");
    assert!(table.paged().rows().len() <= roomy.max_rows);
}

/// The linker's FDE count in `.eh_frame_hdr` rejects a file without reading `.eh_frame`; a
/// header claiming fewer FDEs than there are does not get a file past the count.
#[test]
fn the_count_in_eh_frame_hdr_rejects_without_reading_eh_frame() {
    let limits = budget_limits(1 << 16);
    let claims_many = synthetic_elf_claiming(1000, Some(1_000_000));
    match build_table_within(&claims_many, &limits) {
        Err(TableError::TooLarge {
            what,
            count,
            rows_decoded,
            ..
        }) => {
            assert_eq!(what, "FDEs in .eh_frame_hdr");
            assert_eq!((count, rows_decoded), (1_000_000, 0));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // Honest and within the budget: builds.
    let honest = synthetic_elf_claiming(1000, Some(1000));
    assert!(build_table_within(&honest, &limits).is_ok());
    // Lying low: the count of the entries themselves rejects it.
    let lies = synthetic_elf_claiming(100_000, Some(10));
    assert!(matches!(
        build_table_within(&lies, &limits),
        Err(TableError::TooLarge { what: "FDEs", .. })
    ));
}

/// The agent's check before it builds, reading `.eh_frame` from the file rather than a mapping:
/// it counts exactly the FDEs the builder would (the bound passes at the count, fails one
/// below), and honours `.eh_frame_hdr`'s count.
#[test]
fn the_count_read_from_the_file_matches_the_builders() {
    let check = |elf: &[u8], max_fdes: usize| {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("synthetic.so");
        std::fs::write(&path, elf).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        let parsed = object::File::parse(elf).expect("ELF");
        check_fde_count(&parsed, &file, &budget_limits(max_fdes * 2))
    };
    // Over several 64 KiB buffers.
    let fdes = 20_000;
    let elf = synthetic_elf(fdes);
    assert!(check(&elf, fdes).is_ok());
    match check(&elf, fdes - 1) {
        Err(TableError::TooLarge {
            what,
            count,
            rows_decoded,
            ..
        }) => assert_eq!((what, count, rows_decoded), ("FDEs", fdes as u64, 0)),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(matches!(
        build_table_within(&elf, &budget_limits((fdes - 1) * 2)),
        Err(TableError::TooLarge { what: "FDEs", .. })
    ));
    let claims_many = synthetic_elf_claiming(10, Some(1_000_000));
    assert!(matches!(
        check(&claims_many, 1000),
        Err(TableError::TooLarge {
            what: "FDEs in .eh_frame_hdr",
            ..
        })
    ));
}

#[test]
fn a_cancelled_build_stops() {
    let elf = synthetic_elf(10_000);
    let cancel = Arc::new(AtomicBool::new(true));
    let limits = BuildLimits {
        cancel: Some(cancel),
        ..BuildLimits::default()
    };
    assert!(matches!(
        build_table_within(&elf, &limits),
        Err(TableError::Cancelled)
    ));
}

#[test]
fn a_mapped_input_is_let_go_of_while_the_table_is_built() {
    use std::io::Write;
    let elf = synthetic_elf(100_000);
    let mut file = tempfile::tempfile().expect("temp file");
    file.write_all(&elf).expect("write");
    // SAFETY: a private temporary file, not changed while mapped.
    let mapped = unsafe { memmap2::Mmap::map(&file) }.expect("map");
    let expected = build_table(&elf).expect("built from memory");

    let limits = BuildLimits {
        // SAFETY: `mapped` is a read-only file mapping that outlives the build.
        mapped_input: Some(unsafe { super::super::MappedInput::new(&mapped) }),
        ..BuildLimits::default()
    };
    let table = build_table_within(&mapped, &limits).expect("built from the mapping");
    let resident = crate::test_support::resident_bytes_of_mapping(mapped.as_ptr());

    assert_eq!(table.row_count(), expected.row_count());
    assert_eq!(table.stats().fdes, expected.stats().fdes);
    for address in [CODE_ADDRESS + 1, CODE_ADDRESS + 50_000 * 16 + 3] {
        assert_eq!(
            table.lookup(address),
            expected.lookup(address),
            "{address:#x}"
        );
    }
    // The whole file was read (it is 2 MB); what stays resident is what the last stretch
    // of FDEs after the last checkpoint touched.
    assert!(
        resident < elf.len() as u64 / 4,
        "{resident} of {} bytes still resident",
        elf.len()
    );
}
