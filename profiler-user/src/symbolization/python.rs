//! Python frames: the code object is read from the process (through `/proc/PID/mem`) once per
//! (process, address, fingerprint) and gives the qualified name, file and line table; one
//! whose fingerprint differs from what BPF recorded is another code object, and the frame
//! stays `[unknown python]`.
use std::sync::Arc;

use crate::{
    model::{FrameKind, FrameLine, PythonFrameRef, SymbolizedFrame},
    runtimes::python::{CodeCache, PythonRuntime, code::bytecode_offset, tracker::raw_instruction},
};

use super::StringInterner;

/// Code objects kept across samples (two generations, so about this many).
pub(crate) const CODE_CACHE_ENTRIES: usize = 16_384;

/// Name of a Python frame whose code object could not be read (the process exited), or was
/// not the one that ran (freed, and another allocated at its address).
const UNKNOWN_PYTHON: &str = "[unknown python]";

pub(crate) fn symbolize_python(
    code_cache: &mut CodeCache,
    strings: &mut StringInterner,
    runtime: &PythonRuntime,
    frame: &PythonFrameRef,
) -> Option<SymbolizedFrame> {
    let layout = &runtime.process.layout;
    let code = code_cache
        .code_object(
            &runtime.memory,
            layout,
            runtime.process.code_type_addr,
            runtime.pid,
            frame.code_addr,
            frame.fingerprint,
        )
        .ok()?;
    let instruction = raw_instruction(layout, frame.code_addr, frame.instruction);
    let info = code.frame_info_at(bytecode_offset(
        &runtime.memory,
        layout,
        &code,
        frame.code_addr,
        instruction,
    ));
    Some(SymbolizedFrame {
        kind: FrameKind::Python,
        address: frame.code_addr,
        mapping: None,
        lines: vec![FrameLine {
            function: strings.intern(&info.qualname),
            system_name: None,
            file: Some(strings.intern(&info.filename)),
            line: info.line.unwrap_or(info.firstlineno),
        }],
        unsymbolized: false,
    })
}

pub(crate) fn unknown_python_frame(frame: &PythonFrameRef) -> SymbolizedFrame {
    SymbolizedFrame {
        kind: FrameKind::Python,
        address: frame.code_addr,
        mapping: None,
        lines: vec![FrameLine {
            function: Arc::from(UNKNOWN_PYTHON),
            system_name: None,
            file: None,
            line: 0,
        }],
        unsymbolized: true,
    }
}
