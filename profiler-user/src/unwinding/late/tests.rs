//! The late unwinder against hand-made stacks: each test lays out a stack copy word by word
//! and gives the rows by address, as the maps would.

use std::{collections::HashMap, sync::Arc};

use profiler_common::unwind::{
    CFA_END, CFA_NONE, CFA_RBP, CFA_RSP, CFA_SIGNAL, RBP_AT_CFA, RBP_UNCHANGED, SIGNAL_GREG_RBP,
    SIGNAL_GREG_RIP, SIGNAL_GREG_RSP, SIGNAL_MCONTEXT_OFFSET, UnwindRow,
};

use super::*;
use crate::model::{Pid, ProcessLabels, StackCopy, Tid};

const STACK: u64 = 0x7ffc_0000_0000;

/// Rows by exact PC (lookup address), and PCs whose table is still building.
#[derive(Default)]
struct Rows {
    rows: HashMap<u64, UnwindRow>,
    pending: Vec<u64>,
    lookups: usize,
}

impl LateRows for Rows {
    fn row_at(&mut self, _mapping: &Mapping, pc: u64) -> RowLookup {
        self.lookups += 1;
        if self.pending.contains(&pc) {
            return RowLookup::Pending;
        }
        self.rows
            .get(&pc)
            .map_or(RowLookup::NoTable, |row| RowLookup::Row(*row))
    }
}

fn row(cfa_kind: u8, cfa_offset: i16) -> UnwindRow {
    UnwindRow {
        pc_low: 0,
        cfa_kind,
        rbp_kind: RBP_UNCHANGED,
        cfa_offset,
        rbp_offset: 0,
    }
}

fn process() -> ProcessInfo {
    ProcessInfo {
        pid: Pid(7),
        start_time: 1,
        comm: "app".into(),
        labels: ProcessLabels::default(),
        mappings: vec![Mapping {
            start: 0x40_0000,
            end: 0x50_0000,
            file_offset: 0,
            file: None,
            name: Arc::from("[anon]"),
        }],
        is_kernel_thread: false,
    }
}

/// [`finish_walk`] against [`process`], with no newer snapshot to be had.
fn walk(s: &mut Sample, rows: &mut Rows, patience: Patience) -> Walk {
    finish_walk(s, &mut Arc::new(process()), rows, patience, &mut |_| None)
}

/// A sample whose BPF walk recorded `recorded` and stopped at its last frame, with registers
/// `rip`/`rsp`/`rbp` and the stack `words` from `rsp`.
fn sample(recorded: &[u64], rsp: u64, rbp: u64, exact_pc: bool, words: &[u64]) -> Sample {
    Sample {
        pid: Pid(7),
        tid: Tid(7),
        user_ips: recorded.to_vec(),
        stack_copy: Some(Box::new(StackCopy {
            rip: *recorded.last().expect("a stop frame"),
            rsp,
            rbp,
            exact_pc,
            bytes: words.iter().flat_map(|w| w.to_le_bytes()).collect(),
        })),
        ..Default::default()
    }
}

#[test]
fn finishes_a_walk_with_the_rows_and_the_copy() {
    // leaf 0x401000 (exact, CFA = RSP + 16: one push) → 0x402010 (CFA = RSP + 8) → 0x403010,
    // where the table says the stack ends.
    let mut rows = Rows::default();
    rows.rows.insert(0x40_1000, row(CFA_RSP, 16));
    rows.rows.insert(0x40_200f, row(CFA_RSP, 8));
    rows.rows.insert(0x40_300f, row(CFA_END, 0));
    let mut s = sample(
        &[0x40_1000],
        STACK,
        0,
        true,
        &[0xdead, 0x40_2010, 0x40_3010],
    );
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000, 0x40_2010, 0x40_3010]);
    assert!(!s.user_truncated);
    assert_eq!(s.fallback_frame, None);
    assert!(s.stack_copy.is_none(), "the copy is dropped once used");
}

#[test]
fn restores_rbp_from_the_frame_and_follows_an_rbp_based_caller() {
    // The leaf saved the caller's RBP at CFA - 16; the caller's CFA is RBP + 16.
    let mut rows = Rows::default();
    rows.rows.insert(
        0x40_1000,
        UnwindRow {
            rbp_kind: RBP_AT_CFA,
            rbp_offset: -16,
            ..row(CFA_RSP, 16)
        },
    );
    rows.rows.insert(0x40_200f, row(CFA_RBP, 16));
    rows.rows.insert(0x40_300f, row(CFA_END, 0));
    // STACK: [saved rbp = STACK + 0x20][ra 0x402010][pad][pad][caller's saved rbp][ra 0x403010]
    let words = [STACK + 0x20, 0x40_2010, 0, 0, 0, 0x40_3010];
    let mut s = sample(&[0x40_1000], STACK, 0x1234, true, &words);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000, 0x40_2010, 0x40_3010]);
    assert!(!s.user_truncated);
}

#[test]
fn waits_for_a_table_being_built_and_cuts_there_when_giving_up() {
    let mut rows = Rows::default();
    rows.rows.insert(0x40_1000, row(CFA_RSP, 8));
    rows.pending.push(0x40_200f);
    let words = [0x40_2010, 0x40_3010];
    let mut s = sample(&[0x40_1000], STACK, 0, true, &words);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Pending);
    assert_eq!(s.user_ips, vec![0x40_1000], "unchanged while pending");
    assert!(s.stack_copy.is_some());
    assert_eq!(walk(&mut s, &mut rows, Patience::GiveUp), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000, 0x40_2010]);
    assert!(
        s.user_truncated,
        "cut where the table was missing, and marked"
    );
}

#[test]
fn code_without_a_table_falls_back_to_frame_pointers_and_says_where() {
    // 0x401000 has no table: its caller comes from the RBP chain at STACK + 0x10.
    let mut rows = Rows::default();
    rows.rows.insert(0x40_200f, row(CFA_END, 0));
    let words = [0, 0, 0, 0x40_2010];
    let mut s = sample(&[0x40_0100, 0x40_1000], STACK, STACK + 0x10, false, &words);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_0100, 0x40_1000, 0x40_2010]);
    assert_eq!(
        s.fallback_frame,
        Some(1),
        "the stop frame's caller came from RBP"
    );
    assert!(!s.user_truncated);
}

#[test]
fn a_copy_that_ends_too_soon_or_frames_that_do_not_move_up_cut_the_stack() {
    let mut rows = Rows::default();
    rows.rows.insert(0x40_1000, row(CFA_RSP, 64));
    let mut s = sample(&[0x40_1000], STACK, 0, true, &[1, 2]);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000]);
    assert!(s.user_truncated, "the return address lies beyond the copy");

    // CFA = RBP + 16 with RBP below RSP: the caller would be deeper than the callee.
    let mut rows = Rows::default();
    rows.rows.insert(0x40_1000, row(CFA_RBP, 16));
    let words = [0x40_2010; 4];
    let mut s = sample(&[0x40_1000], STACK + 0x10, STACK - 0x100, true, &words);
    s.stack_copy.as_mut().unwrap().rsp = STACK;
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert!(s.user_truncated);
}

#[test]
fn a_signal_frame_resumes_at_the_interrupted_instruction() {
    // The handler returned into __restore_rt (0x401000); the ucontext at RSP holds the
    // interrupted registers, whose RIP is exact.
    let mut rows = Rows::default();
    rows.rows.insert(0x40_0fff, row(CFA_SIGNAL, 0));
    rows.rows.insert(0x40_3000, row(CFA_END, 0));
    let gregs = (SIGNAL_MCONTEXT_OFFSET / 8) as usize;
    let mut words = vec![0u64; gregs + 20];
    words[gregs + SIGNAL_GREG_RIP as usize] = 0x40_3000;
    words[gregs + SIGNAL_GREG_RSP as usize] = STACK + 0x1000;
    words[gregs + SIGNAL_GREG_RBP as usize] = 0;
    let mut s = sample(&[0x40_1000], STACK, 0, false, &words);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000, 0x40_3000]);
    assert!(!s.user_truncated);
}

#[test]
fn an_address_outside_every_mapping_uses_frame_pointers_and_a_gap_row_too() {
    let mut rows = Rows::default();
    rows.rows.insert(0x40_0fff, row(CFA_NONE, 0));
    // Frame pointers from 0x401000 (a gap row) reach 0x9000_0000, in no mapping, whose
    // RBP is 0: the end of the chain.
    let words = [0, 0x9000_0000];
    let mut s = sample(&[0x40_1000], STACK, STACK, false, &words);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000, 0x9000_0000]);
    assert_eq!(s.fallback_frame, Some(0));
    assert!(!s.user_truncated);
}

#[test]
fn a_caller_outside_the_snapshot_is_walked_against_a_newer_one_that_maps_it() {
    // leaf 0x401000 → 0x7f00_0000_1010 in a library mapped after the snapshot (libc, mapped by
    // ld.so after a snapshot of the binary and ld.so alone) → 0x402010, where the stack ends.
    let mut rows = Rows::default();
    rows.rows.insert(0x40_1000, row(CFA_RSP, 8));
    rows.rows.insert(0x7f00_0000_100f, row(CFA_RSP, 8));
    rows.rows.insert(0x40_200f, row(CFA_END, 0));
    let words = [0x7f00_0000_1010, 0x40_2010];
    let newer = {
        let mut info = process();
        info.mappings.push(Mapping {
            start: 0x7f00_0000_0000,
            end: 0x7f00_0010_0000,
            file_offset: 0,
            file: None,
            name: Arc::from("/lib/libc.so.6"),
        });
        Arc::new(info)
    };
    let mut asked = Vec::new();
    let mut refresh = |address: u64| {
        asked.push(address);
        Some(Arc::clone(&newer))
    };
    let mut s = sample(&[0x40_1000], STACK, 0, true, &words);
    let mut snapshot = Arc::new(process());
    assert_eq!(
        finish_walk(
            &mut s,
            &mut snapshot,
            &mut rows,
            Patience::Wait,
            &mut refresh
        ),
        Walk::Done
    );
    assert_eq!(s.user_ips, vec![0x40_1000, 0x7f00_0000_1010, 0x40_2010]);
    assert!(!s.user_truncated);
    assert_eq!(s.fallback_frame, None, "every caller from a table");
    assert_eq!(
        asked,
        vec![0x7f00_0000_100f],
        "asked once, for the return address's call"
    );
    assert!(
        Arc::ptr_eq(&snapshot, &newer),
        "the frames go with the newer snapshot"
    );

    // Without a newer snapshot the library frame has no table: the walk guesses from RBP (0:
    // the end) and says so.
    let mut s = sample(&[0x40_1000], STACK, 0, true, &words);
    assert_eq!(walk(&mut s, &mut rows, Patience::Wait), Walk::Done);
    assert_eq!(s.user_ips, vec![0x40_1000, 0x7f00_0000_1010]);
    assert_eq!(s.fallback_frame, Some(1));
}
