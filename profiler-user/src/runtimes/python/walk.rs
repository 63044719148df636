//! A userspace frame walker over `/proc/PID/mem`, like py-spy's: interpreters → thread states
//! → frame chains, following the [`PyLayout`] rules of each version. It is the tests' oracle
//! for the layouts and the BPF walk, and a fallback where BPF cannot walk. Every loop is
//! bounded and cycles are detected, so a corrupt or changing process cannot hang it.
use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use thiserror::Error;

use super::{
    code::{CodeError, CodeObject, PyFrameInfo, bytecode_offset, read_code_object},
    detect::PythonProcess,
    layout::{EntryMarker, FrameAnchor, InstructionUnit, PyLayout},
    memory::{MemoryError, ProcessMemory, ProcessMemoryExt},
};

pub const MAX_INTERPRETERS: usize = 64;
pub const MAX_THREADS: usize = 4096;
pub const MAX_FRAMES: usize = 4096;

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum WalkError {
    #[error("reading the runtime: {0}")]
    Runtime(#[source] MemoryError),
    #[error("no interpreter (the runtime is not initialised or is finalizing)")]
    NoInterpreter,
}

/// One frame as the walk saw it, before symbolization: what BPF will emit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawFrame {
    pub frame_addr: u64,
    pub code_addr: u64,
    /// The raw instruction field (sign-extended `f_lasti`, or an instruction pointer).
    pub instruction: u64,
    /// The first frame pushed by its C-level `_PyEval_EvalFrameDefault` call (3.11
    /// `is_entry`; 3.12+ the frame just above a shim). Always true ≤3.10.
    pub entry: bool,
}

/// How a frame chain ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChainEnd {
    /// A null `back`/`previous`.
    Complete,
    /// [`MAX_FRAMES`] reached.
    DepthLimit,
    /// A frame seen twice.
    Cycle,
    Unreadable(MemoryError),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyFrame {
    pub raw: RawFrame,
    pub info: Result<PyFrameInfo, CodeError>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyThreadStack {
    pub thread_state_addr: u64,
    /// `pthread_self()` of the thread.
    pub thread_id: u64,
    /// Kernel tid (3.11+).
    pub native_thread_id: Option<u32>,
    /// Innermost first.
    pub frames: Vec<PyFrame>,
    pub end: ChainEnd,
}

/// Walks the frame chain starting at `first_frame`, skipping 3.12+ shim frames (and frames
/// without code, such as 3.13's `Py_None` shims).
pub fn walk_frame_chain(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    first_frame: u64,
) -> (Vec<RawFrame>, ChainEnd) {
    let mut frames = Vec::new();
    let mut seen = HashSet::new();
    let mut frame = first_frame;
    let mut steps = 0;
    while frame != 0 {
        if steps >= MAX_FRAMES {
            return (frames, ChainEnd::DepthLimit);
        }
        steps += 1;
        if !seen.insert(frame) {
            return (frames, ChainEnd::Cycle);
        }
        let step = || -> Result<(u64, Option<RawFrame>), MemoryError> {
            let back = mem.read_u64(frame.wrapping_add(u64::from(layout.frame_back)))?;
            let is_shim = match layout.entry_marker {
                EntryMarker::ShimOwner { offset, value } => {
                    mem.read_u8(frame.wrapping_add(u64::from(offset)))? == value
                }
                _ => false,
            };
            if is_shim {
                return Ok((back, None));
            }
            let code_addr = mem.read_u64(frame.wrapping_add(u64::from(layout.frame_code)))?
                & !layout.stackref_tag_mask;
            let instruction = match layout.instruction_unit {
                InstructionUnit::InstructionPointer => {
                    mem.read_u64(frame.wrapping_add(u64::from(layout.frame_instruction)))?
                }
                // `int f_lasti`: sign-extend so -1 stays -1.
                _ => mem.read_i32(frame.wrapping_add(u64::from(layout.frame_instruction)))? as i64
                    as u64,
            };
            let entry = match layout.entry_marker {
                EntryMarker::None => true,
                EntryMarker::IsEntryFlag { offset } => {
                    mem.read_u8(frame.wrapping_add(u64::from(offset)))? != 0
                }
                // Decided when the shim below is seen.
                EntryMarker::ShimOwner { .. } => false,
            };
            Ok((
                back,
                Some(RawFrame {
                    frame_addr: frame,
                    code_addr,
                    instruction,
                    entry,
                }),
            ))
        };
        match step() {
            Ok((back, Some(raw))) => {
                if raw.code_addr != 0 {
                    frames.push(raw);
                }
                frame = back;
            }
            Ok((back, None)) => {
                // A shim: the frame above it began this C-level eval call.
                if let Some(last) = frames.last_mut() {
                    last.entry = true;
                }
                frame = back;
            }
            Err(error) => return (frames, ChainEnd::Unreadable(error)),
        }
    }
    (frames, ChainEnd::Complete)
}

/// The innermost frame of a thread state (0 when the thread runs no Python code).
pub fn thread_first_frame(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    thread_state: u64,
) -> Result<u64, MemoryError> {
    match layout.tstate_frame {
        FrameAnchor::ThreadFrame { offset } | FrameAnchor::ThreadCurrentFrame { offset } => {
            mem.read_u64(thread_state.wrapping_add(u64::from(offset)))
        }
        FrameAnchor::CFrame {
            cframe,
            current_frame,
        } => {
            let cframe = mem.read_u64(thread_state.wrapping_add(u64::from(cframe)))?;
            if cframe == 0 {
                return Ok(0);
            }
            mem.read_u64(cframe.wrapping_add(u64::from(current_frame)))
        }
    }
}

/// Thread state addresses of every interpreter, bounded.
pub fn thread_states(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    runtime_addr: u64,
) -> Result<Vec<u64>, WalkError> {
    let mut interp = mem
        .read_u64(runtime_addr.wrapping_add(u64::from(layout.runtime_interpreters_head)))
        .map_err(WalkError::Runtime)?;
    if interp == 0 {
        return Err(WalkError::NoInterpreter);
    }
    let mut threads = Vec::new();
    let mut seen = HashSet::new();
    let mut interpreters = 0;
    while interp != 0 && interpreters < MAX_INTERPRETERS && seen.insert(interp) {
        interpreters += 1;
        let Ok(mut tstate) =
            mem.read_u64(interp.wrapping_add(u64::from(layout.interp_threads_head)))
        else {
            break;
        };
        while tstate != 0 && threads.len() < MAX_THREADS && seen.insert(tstate) {
            threads.push(tstate);
            match mem.read_u64(tstate.wrapping_add(u64::from(layout.tstate_next))) {
                Ok(next) => tstate = next,
                Err(_) => break,
            }
        }
        interp = mem
            .read_u64(interp.wrapping_add(u64::from(layout.interp_next)))
            .unwrap_or(0);
    }
    Ok(threads)
}

/// Every thread's Python stack, symbolized.
pub fn walk_process(
    mem: &dyn ProcessMemory,
    process: &PythonProcess,
) -> Result<Vec<PyThreadStack>, WalkError> {
    let layout = &process.layout;
    let mut code_objects: HashMap<u64, Result<Arc<CodeObject>, CodeError>> = HashMap::new();
    let mut stacks = Vec::new();
    for thread_state in thread_states(mem, layout, process.runtime_addr)? {
        let thread_id = mem
            .read_u64(thread_state.wrapping_add(u64::from(layout.tstate_thread_id)))
            .unwrap_or(0);
        let native_thread_id = layout
            .tstate_native_thread_id
            .and_then(|offset| {
                mem.read_u64(thread_state.wrapping_add(u64::from(offset)))
                    .ok()
            })
            .map(|tid| tid as u32);
        let (raw_frames, end) = match thread_first_frame(mem, layout, thread_state) {
            Ok(first) => walk_frame_chain(mem, layout, first),
            Err(error) => (Vec::new(), ChainEnd::Unreadable(error)),
        };
        let frames = raw_frames
            .into_iter()
            .map(|raw| {
                let code = code_objects
                    .entry(raw.code_addr)
                    .or_insert_with(|| {
                        read_code_object(mem, layout, process.code_type_addr, raw.code_addr)
                            .map(Arc::new)
                    })
                    .clone();
                let info = code.map(|code| {
                    code.frame_info_at(bytecode_offset(
                        mem,
                        layout,
                        &code,
                        raw.code_addr,
                        raw.instruction,
                    ))
                });
                PyFrame { raw, info }
            })
            .collect();
        stacks.push(PyThreadStack {
            thread_state_addr: thread_state,
            thread_id,
            native_thread_id,
            frames,
            end,
        });
    }
    Ok(stacks)
}
