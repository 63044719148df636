//! `_Py_DebugOffsets` (3.13+): CPython puts its own struct offsets at the start of
//! `_PyRuntime`, in initialised data, so they can be read from the ELF file before the process
//! is touched. The struct grows between versions (3.14 adds `threads_main`, `stackpointer`,
//! `tlbc_index`, `co_tlbc`, …), so each version has its own table of where each field sits.
use thiserror::Error;

use super::layout::{
    EntryMarker, FrameAnchor, InstructionUnit, LineTableFormat, PyLayout, overlay_for,
};

pub const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DebugOffsetsError {
    #[error("no _Py_DebugOffsets: the cookie is not \"xdebugpy\"")]
    NoCookie,
    #[error("_Py_DebugOffsets truncated: {len} bytes, version {version:#x} needs {needed}")]
    Truncated {
        len: usize,
        needed: usize,
        version: u64,
    },
    #[error("_Py_DebugOffsets of unknown Python {major}.{minor} (version {version:#x})")]
    UnknownVersion { version: u64, major: u8, minor: u8 },
    #[error("_Py_DebugOffsets field {field} = {value} is implausible")]
    Implausible { field: &'static str, value: u64 },
}

/// Where each field this crate uses sits inside `_Py_DebugOffsets` of one version.
struct FieldPositions {
    python: (u8, u8),
    /// Bytes the struct must have for every field below to be inside.
    size: usize,
    runtime_interpreters_head: usize,
    interp_next: usize,
    interp_threads_head: usize,
    tstate_next: usize,
    tstate_current_frame: usize,
    tstate_thread_id: usize,
    tstate_native_thread_id: usize,
    frame_previous: usize,
    frame_executable: usize,
    frame_instr_ptr: usize,
    frame_owner: usize,
    code_filename: usize,
    code_name: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_firstlineno: usize,
    code_co_code_adaptive: usize,
    /// `co_tlbc` (3.14+): the per-thread bytecode copies of free-threaded builds.
    code_co_tlbc: Option<usize>,
    pyobject_ob_type: usize,
    bytes_ob_size: usize,
    bytes_ob_sval: usize,
    unicode_state: usize,
    unicode_length: usize,
    unicode_asciiobject_size: usize,
}

/// 3.13.x (checked against the DWARF of pyenv's 3.13.0 with `ptype/o`).
const POSITIONS_313: FieldPositions = FieldPositions {
    python: (3, 13),
    size: 584,
    runtime_interpreters_head: 40,
    interp_next: 64,
    interp_threads_head: 72,
    tstate_next: 168,
    tstate_current_frame: 184,
    tstate_thread_id: 192,
    tstate_native_thread_id: 200,
    frame_previous: 232,
    frame_executable: 240,
    frame_instr_ptr: 248,
    frame_owner: 264,
    code_filename: 280,
    code_name: 288,
    code_qualname: 296,
    code_linetable: 304,
    code_firstlineno: 312,
    code_co_code_adaptive: 344,
    code_co_tlbc: None,
    pyobject_ob_type: 360,
    bytes_ob_size: 520,
    bytes_ob_sval: 528,
    unicode_state: 544,
    unicode_length: 552,
    unicode_asciiobject_size: 560,
};

/// 3.14.x: interpreter_state gains threads_main, code_object_generation and tlbc_generation,
/// interpreter_frame gains stackpointer and tlbc_index, code_object gains co_tlbc, and a
/// set_object section comes before dict_object. From CPython 3.14's pycore_debug_offsets.h.
const POSITIONS_314: FieldPositions = FieldPositions {
    python: (3, 14),
    size: 648,
    runtime_interpreters_head: 40,
    interp_next: 64,
    interp_threads_head: 72,
    tstate_next: 192,
    tstate_current_frame: 208,
    tstate_thread_id: 216,
    tstate_native_thread_id: 224,
    frame_previous: 256,
    frame_executable: 264,
    frame_instr_ptr: 272,
    frame_owner: 288,
    code_filename: 320,
    code_name: 328,
    code_qualname: 336,
    code_linetable: 344,
    code_firstlineno: 352,
    code_co_code_adaptive: 384,
    code_co_tlbc: Some(392),
    pyobject_ob_type: 408,
    bytes_ob_size: 600,
    bytes_ob_sval: 608,
    unicode_state: 624,
    unicode_length: 632,
    unicode_asciiobject_size: 640,
};

const KNOWN_POSITIONS: &[FieldPositions] = &[POSITIONS_313, POSITIONS_314];

/// The header common to every version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DebugOffsetsHeader {
    /// `PY_VERSION_HEX`.
    pub version_hex: u64,
    pub free_threaded: bool,
}

impl DebugOffsetsHeader {
    /// (major, minor, micro).
    pub fn version(&self) -> (u8, u8, u8) {
        version_from_hex(self.version_hex)
    }
}

/// (major, minor, micro) of a `PY_VERSION_HEX`.
pub fn version_from_hex(hex: u64) -> (u8, u8, u8) {
    ((hex >> 24) as u8, (hex >> 16) as u8, (hex >> 8) as u8)
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let slice = bytes.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(slice.try_into().ok()?))
}

/// Reads the cookie, version and free-threading flag.
pub fn parse_header(bytes: &[u8]) -> Result<DebugOffsetsHeader, DebugOffsetsError> {
    if bytes.get(..8) != Some(DEBUG_COOKIE.as_slice()) {
        return Err(DebugOffsetsError::NoCookie);
    }
    let (Some(version_hex), Some(free_threaded)) = (read_u64(bytes, 8), read_u64(bytes, 16)) else {
        return Err(DebugOffsetsError::Truncated {
            len: bytes.len(),
            needed: 24,
            version: 0,
        });
    };
    Ok(DebugOffsetsHeader {
        version_hex,
        free_threaded: free_threaded != 0,
    })
}

/// The [`PyLayout`] described by `bytes`, the start of `_PyRuntime` (at least
/// [`MAX_DEBUG_OFFSETS_SIZE`] bytes when available). Never panics on garbage.
pub fn parse_debug_offsets(
    bytes: &[u8],
) -> Result<(DebugOffsetsHeader, PyLayout), DebugOffsetsError> {
    let header = parse_header(bytes)?;
    let (major, minor, _) = header.version();
    let unknown = DebugOffsetsError::UnknownVersion {
        version: header.version_hex,
        major,
        minor,
    };
    let positions = KNOWN_POSITIONS
        .iter()
        .find(|p| p.python == (major, minor))
        .ok_or(unknown.clone())?;
    let overlay = overlay_for(major, minor).ok_or(unknown)?;
    if bytes.len() < positions.size {
        return Err(DebugOffsetsError::Truncated {
            len: bytes.len(),
            needed: positions.size,
            version: header.version_hex,
        });
    }
    // Every field is an offset inside a struct of a few KiB at most (PyInterpreterState is the
    // largest, ~100 KiB in 3.13): anything bigger means we are reading the wrong layout.
    let field = |name: &'static str, at: usize| -> Result<u32, DebugOffsetsError> {
        let value = read_u64(bytes, at).ok_or(DebugOffsetsError::Truncated {
            len: bytes.len(),
            needed: at + 8,
            version: header.version_hex,
        })?;
        u32::try_from(value)
            .ok()
            .filter(|v| *v < 1 << 20)
            .ok_or(DebugOffsetsError::Implausible { field: name, value })
    };
    let expect = |name: &'static str, value: u32, wanted: u32| {
        if value == wanted {
            Ok(value)
        } else {
            Err(DebugOffsetsError::Implausible {
                field: name,
                value: value.into(),
            })
        }
    };
    // A free-threaded object header has ob_tid, ob_mutex, ob_gc_bits and a split reference
    // count before ob_type: 16 bytes more.
    let header_extra = if header.free_threaded { 16 } else { 0 };
    let ascii_size = field(
        "unicode_object.asciiobject_size",
        positions.unicode_asciiobject_size,
    )?;
    let layout = PyLayout {
        python: (major, minor),
        runtime_interpreters_head: field(
            "runtime_state.interpreters_head",
            positions.runtime_interpreters_head,
        )?,
        runtime_tstate_current: None,
        runtime_autotss_key: overlay.runtime_autotss + 4,
        interp_next: field("interpreter_state.next", positions.interp_next)?,
        interp_threads_head: field(
            "interpreter_state.threads_head",
            positions.interp_threads_head,
        )?,
        tstate_next: field("thread_state.next", positions.tstate_next)?,
        tstate_frame: FrameAnchor::ThreadCurrentFrame {
            offset: field("thread_state.current_frame", positions.tstate_current_frame)?,
        },
        tstate_thread_id: field("thread_state.thread_id", positions.tstate_thread_id)?,
        tstate_native_thread_id: Some(field(
            "thread_state.native_thread_id",
            positions.tstate_native_thread_id,
        )?),
        frame_code: field("interpreter_frame.executable", positions.frame_executable)?,
        frame_back: field("interpreter_frame.previous", positions.frame_previous)?,
        frame_instruction: field("interpreter_frame.instr_ptr", positions.frame_instr_ptr)?,
        instruction_unit: InstructionUnit::InstructionPointer,
        entry_marker: EntryMarker::ShimOwner {
            offset: field("interpreter_frame.owner", positions.frame_owner)?,
            value: overlay.shim_owner,
        },
        stackref_tag_mask: overlay.stackref_tag_mask,
        // Fixed by the C ABI of PyObject; a different value means a wrong table.
        object_type: expect(
            "pyobject.ob_type",
            field("pyobject.ob_type", positions.pyobject_ob_type)?,
            8 + header_extra,
        )?,
        code_firstlineno: field("code_object.firstlineno", positions.code_firstlineno)?,
        code_filename: field("code_object.filename", positions.code_filename)?,
        code_name: field("code_object.name", positions.code_name)?,
        code_qualname: Some(field("code_object.qualname", positions.code_qualname)?),
        code_line_table: field("code_object.linetable", positions.code_linetable)?,
        code_version: Some(
            field("code_object.firstlineno", positions.code_firstlineno)?
                + super::layout::CO_VERSION_AFTER_FIRSTLINENO,
        ),
        line_table_format: LineTableFormat::Locations,
        code_bytecode: Some(field(
            "code_object.co_code_adaptive",
            positions.code_co_code_adaptive,
        )?),
        // Only free-threaded builds fill it; with the GIL it is 0 (no copies).
        code_thread_bytecode: match positions.code_co_tlbc {
            Some(at) if header.free_threaded => Some(field("code_object.co_tlbc", at)?),
            _ => None,
        },
        free_threaded: header.free_threaded,
        unicode_length: field("unicode_object.length", positions.unicode_length)?,
        unicode_state: field("unicode_object.state", positions.unicode_state)?,
        unicode_kind_shift: if header.free_threaded {
            overlay.free_threaded_unicode_kind_shift
        } else {
            super::layout::UNICODE_KIND_SHIFT
        },
        unicode_ascii_data: ascii_size,
        // PyCompactUnicodeObject adds utf8_length and utf8 to PyASCIIObject (3.12+).
        unicode_compact_data: ascii_size + 16,
        bytes_size: expect(
            "bytes_object.ob_size",
            field("bytes_object.ob_size", positions.bytes_ob_size)?,
            16 + header_extra,
        )?,
        bytes_data: field("bytes_object.ob_sval", positions.bytes_ob_sval)?,
    };
    Ok((header, layout))
}

/// Bytes to read at `_PyRuntime` to cover every known version's `_Py_DebugOffsets`.
pub const MAX_DEBUG_OFFSETS_SIZE: usize = 1024;
