//! The CPython struct offsets a frame walk needs, as data: one [`PyLayout`] row per minor
//! version for 3.8–3.12 (read from the DWARF of pyenv builds, see `gen_layouts.sh`), and rows
//! built from `_Py_DebugOffsets` for 3.13+ (see `debug_offsets`). A new version is a new row.
//!
//! All offsets are for x86_64 release builds; free-threaded builds (3.13t+) come only from
//! `_Py_DebugOffsets`.
use profiler_common::{PYTHON_CODE_READ_BYTES, PYTHON_FRAME_READ_BYTES};

/// Where a thread state keeps its innermost frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameAnchor {
    /// `tstate->frame` (≤3.10), a `PyFrameObject*`.
    ThreadFrame { offset: u32 },
    /// `tstate->cframe->current_frame` (3.11, 3.12), a `_PyInterpreterFrame*`.
    CFrame { cframe: u32, current_frame: u32 },
    /// `tstate->current_frame` (3.13+), a `_PyInterpreterFrame*`.
    ThreadCurrentFrame { offset: u32 },
}

/// What the frame's instruction field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstructionUnit {
    /// `int f_lasti`, a byte offset into `co_code` (≤3.9); -1 before the first instruction.
    LastiBytes,
    /// `int f_lasti`, in 2-byte code units (3.10).
    LastiCodeUnits,
    /// A pointer into the code object's `co_code_adaptive` (`prev_instr` 3.11/3.12,
    /// `instr_ptr` 3.13+).
    InstructionPointer,
}

impl InstructionUnit {
    /// Size of the field in the frame.
    pub fn field_size(self) -> usize {
        match self {
            InstructionUnit::LastiBytes | InstructionUnit::LastiCodeUnits => 4,
            InstructionUnit::InstructionPointer => 8,
        }
    }
}

/// How the first frame of a C-level `_PyEval_EvalFrameDefault` call is recognised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMarker {
    /// ≤3.10: every `PyFrameObject` has its own eval call.
    None,
    /// 3.11: `bool is_entry` in the frame.
    IsEntryFlag { offset: u32 },
    /// 3.12+: the eval call pushes a shim frame whose `char owner` equals `value`
    /// (`FRAME_OWNED_BY_CSTACK`); the shim itself is not a Python frame.
    ShimOwner { offset: u32, value: u8 },
}

/// The encoding of the code object's line table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTableFormat {
    /// `co_lnotab` (≤3.9): pairs (byte increment u8, line increment i8).
    Lnotab,
    /// `co_linetable` (3.10): pairs (byte range length u8, line delta i8, -128 = no line).
    LineTable310,
    /// `co_linetable` (3.11+): the PEP 657 location table.
    Locations,
}

/// Field offsets (bytes) used to find threads, walk frames and symbolize code objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyLayout {
    /// (major, minor) this row describes.
    pub python: (u8, u8),
    // _PyRuntimeState
    pub runtime_interpreters_head: u32,
    /// `gilstate.tstate_current` (≤3.11): the thread holding the GIL.
    pub runtime_tstate_current: Option<u32>,
    /// The pthread key of `autoTSSkey` (`Py_tss_t` offset + 4).
    pub runtime_autotss_key: u32,
    // PyInterpreterState
    pub interp_next: u32,
    pub interp_threads_head: u32,
    // PyThreadState
    pub tstate_next: u32,
    pub tstate_frame: FrameAnchor,
    /// `pthread_t thread_id` (`pthread_self()`).
    pub tstate_thread_id: u32,
    /// The kernel tid (3.11+).
    pub tstate_native_thread_id: Option<u32>,
    // Frame (PyFrameObject ≤3.10, _PyInterpreterFrame 3.11+)
    pub frame_code: u32,
    pub frame_back: u32,
    pub frame_instruction: u32,
    pub instruction_unit: InstructionUnit,
    pub entry_marker: EntryMarker,
    /// Low bits of a tagged `_PyStackRef` to clear to get the object pointer (3.14), else 0.
    pub stackref_tag_mask: u64,
    // PyObject / PyCodeObject
    pub object_type: u32,
    pub code_firstlineno: u32,
    pub code_filename: u32,
    pub code_name: u32,
    /// `co_qualname` (3.11+).
    pub code_qualname: Option<u32>,
    pub code_line_table: u32,
    /// `co_version` (3.12+): a counter CPython bumps for every new code object, so a code
    /// object at a reused address tells itself apart.
    pub code_version: Option<u32>,
    pub line_table_format: LineTableFormat,
    /// `co_code_adaptive` (3.11+): where the bytecode starts inside the code object.
    pub code_bytecode: Option<u32>,
    /// `co_tlbc` (free-threaded 3.14+): a `_PyCodeArray*` of per-thread copies of the
    /// bytecode, into which other threads' instruction pointers point.
    pub code_thread_bytecode: Option<u32>,
    /// A free-threaded build (PEP 703): the object header is 32 bytes, and the reference count
    /// is split in `ob_ref_local` (u32 at 12) and `ob_ref_shared` (at 16).
    pub free_threaded: bool,
    // Strings and bytes
    pub unicode_length: u32,
    pub unicode_state: u32,
    /// Bit where `kind` starts in `state` (see [`UNICODE_KIND_SHIFT`]).
    pub unicode_kind_shift: u8,
    /// Data of a compact ASCII string: `sizeof(PyASCIIObject)`.
    pub unicode_ascii_data: u32,
    /// Data of a compact non-ASCII string: `sizeof(PyCompactUnicodeObject)`.
    pub unicode_compact_data: u32,
    pub bytes_size: u32,
    pub bytes_data: u32,
}

/// Where `co_version` lies after `co_firstlineno` in 3.12–3.14 (the ints `co_nlocalsplus`,
/// `co_framesize`, `co_nlocals`, `co_ncellvars`, `co_nfreevars` between); `_Py_DebugOffsets`
/// does not list it.
pub const CO_VERSION_AFTER_FIRSTLINENO: u32 = 24;

impl PyLayout {
    /// Bytes of a frame BPF reads: to the end of the last field it uses, no further (a frame
    /// ends where its data-stack chunk, and the mapping, may end).
    pub fn frame_read_bytes(&self) -> u32 {
        let instruction_end = self.frame_instruction + self.instruction_unit.field_size() as u32;
        let entry_end = match self.entry_marker {
            EntryMarker::None => 0,
            EntryMarker::IsEntryFlag { offset } | EntryMarker::ShimOwner { offset, .. } => {
                offset + 1
            }
        };
        [
            self.frame_code + 8,
            self.frame_back + 8,
            instruction_end,
            entry_end,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
        .min(PYTHON_FRAME_READ_BYTES as u32)
    }

    /// Bytes of a code object BPF reads for its fingerprint: to the end of the last identity
    /// field.
    pub fn code_read_bytes(&self) -> u32 {
        [
            self.code_firstlineno + 4,
            self.code_version.map_or(0, |offset| offset + 4),
            self.code_qualname.unwrap_or(self.code_name) + 8,
            self.code_filename + 8,
            self.code_line_table + 8,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
        .min(PYTHON_CODE_READ_BYTES as u32)
    }
}

/// `FRAME_OWNED_BY_CSTACK` in 3.12–3.14.
pub const FRAME_OWNED_BY_CSTACK: u8 = 3;

/// Common to every version: `ob_type`, `PyVarObject.ob_size`, `PyASCIIObject.length/state`,
/// `PyBytesObject.ob_sval`.
const OBJECT_TYPE: u32 = 8;
const VAR_SIZE: u32 = 16;
const UNICODE_LENGTH: u32 = 16;
const UNICODE_STATE: u32 = 32;
/// `state` starts with `interned:2`, then `kind:3`, `compact:1`, `ascii:1`.
pub const UNICODE_KIND_SHIFT: u8 = 2;
const BYTES_DATA: u32 = 32;

/// 3.8–3.10 share the `PyFrameObject` walk.
const fn frame_object_layout(
    minor: u8,
    tstate_current: u32,
    autotss: u32,
    lasti: u32,
    unit: InstructionUnit,
    line_table: LineTableFormat,
) -> PyLayout {
    PyLayout {
        python: (3, minor),
        runtime_interpreters_head: 32,
        runtime_tstate_current: Some(tstate_current),
        runtime_autotss_key: autotss + 4,
        interp_next: 0,
        interp_threads_head: 8,
        tstate_next: 8,
        tstate_frame: FrameAnchor::ThreadFrame { offset: 24 },
        tstate_thread_id: 176,
        tstate_native_thread_id: None,
        frame_code: 32,
        frame_back: 24,
        frame_instruction: lasti,
        instruction_unit: unit,
        entry_marker: EntryMarker::None,
        stackref_tag_mask: 0,
        object_type: OBJECT_TYPE,
        code_firstlineno: 40,
        code_filename: 104,
        code_name: 112,
        code_qualname: None,
        code_line_table: 120,
        code_version: None,
        line_table_format: line_table,
        code_bytecode: None,
        code_thread_bytecode: None,
        free_threaded: false,
        unicode_length: UNICODE_LENGTH,
        unicode_state: UNICODE_STATE,
        unicode_kind_shift: UNICODE_KIND_SHIFT,
        unicode_ascii_data: 48,
        unicode_compact_data: 72,
        bytes_size: VAR_SIZE,
        bytes_data: BYTES_DATA,
    }
}

pub const PY38: PyLayout = frame_object_layout(
    8,
    1368,
    1392,
    104,
    InstructionUnit::LastiBytes,
    LineTableFormat::Lnotab,
);
pub const PY39: PyLayout = frame_object_layout(
    9,
    568,
    584,
    104,
    InstructionUnit::LastiBytes,
    LineTableFormat::Lnotab,
);
pub const PY310: PyLayout = frame_object_layout(
    10,
    568,
    584,
    96,
    InstructionUnit::LastiCodeUnits,
    LineTableFormat::LineTable310,
);

pub const PY311: PyLayout = PyLayout {
    python: (3, 11),
    runtime_interpreters_head: 40,
    runtime_tstate_current: Some(576),
    runtime_autotss_key: 592 + 4,
    interp_next: 0,
    interp_threads_head: 16,
    tstate_next: 8,
    tstate_frame: FrameAnchor::CFrame {
        cframe: 56,
        current_frame: 8,
    },
    tstate_thread_id: 152,
    tstate_native_thread_id: Some(160),
    frame_code: 32,
    frame_back: 48,
    frame_instruction: 56,
    instruction_unit: InstructionUnit::InstructionPointer,
    entry_marker: EntryMarker::IsEntryFlag { offset: 68 },
    stackref_tag_mask: 0,
    object_type: OBJECT_TYPE,
    code_firstlineno: 72,
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_line_table: 136,
    code_version: None,
    line_table_format: LineTableFormat::Locations,
    code_bytecode: Some(184),
    code_thread_bytecode: None,
    free_threaded: false,
    unicode_length: UNICODE_LENGTH,
    unicode_state: UNICODE_STATE,
    unicode_kind_shift: UNICODE_KIND_SHIFT,
    unicode_ascii_data: 48,
    unicode_compact_data: 72,
    bytes_size: VAR_SIZE,
    bytes_data: BYTES_DATA,
};

pub const PY312: PyLayout = PyLayout {
    python: (3, 12),
    runtime_interpreters_head: 40,
    runtime_tstate_current: None,
    runtime_autotss_key: 1544 + 4,
    interp_next: 0,
    interp_threads_head: 72,
    tstate_next: 8,
    tstate_frame: FrameAnchor::CFrame {
        cframe: 56,
        current_frame: 0,
    },
    tstate_thread_id: 136,
    tstate_native_thread_id: Some(144),
    frame_code: 0,
    frame_back: 8,
    frame_instruction: 56,
    instruction_unit: InstructionUnit::InstructionPointer,
    entry_marker: EntryMarker::ShimOwner {
        offset: 70,
        value: FRAME_OWNED_BY_CSTACK,
    },
    stackref_tag_mask: 0,
    object_type: OBJECT_TYPE,
    code_firstlineno: 68,
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_line_table: 136,
    code_version: Some(CO_VERSION_AFTER_FIRSTLINENO + 68),
    line_table_format: LineTableFormat::Locations,
    code_bytecode: Some(192),
    code_thread_bytecode: None,
    free_threaded: false,
    unicode_length: UNICODE_LENGTH,
    unicode_state: UNICODE_STATE,
    unicode_kind_shift: UNICODE_KIND_SHIFT,
    unicode_ascii_data: 40,
    unicode_compact_data: 56,
    bytes_size: VAR_SIZE,
    bytes_data: BYTES_DATA,
};

/// The rows kept as data, for versions without `_Py_DebugOffsets`.
pub const LAYOUT_TABLE: &[PyLayout] = &[PY38, PY39, PY310, PY311, PY312];

/// The data row for `(major, minor)`, for 3.8–3.12.
pub fn layout_for(major: u8, minor: u8) -> Option<&'static PyLayout> {
    LAYOUT_TABLE.iter().find(|row| row.python == (major, minor))
}

/// What `_Py_DebugOffsets` (3.13+) does not describe: the `autoTSSkey` offset in `_PyRuntime`
/// (pthread key at +4), the shim owner value and the stack-reference tag mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DebugOffsetsOverlay {
    pub python: (u8, u8),
    pub runtime_autotss: u32,
    pub shim_owner: u8,
    pub stackref_tag_mask: u64,
    /// [`PyLayout::unicode_kind_shift`] of the free-threaded build: 3.14t makes `interned`
    /// a whole byte (atomic access), so `kind` starts at bit 8.
    pub free_threaded_unicode_kind_shift: u8,
}

pub const OVERLAYS: &[DebugOffsetsOverlay] = &[
    DebugOffsetsOverlay {
        python: (3, 13),
        runtime_autotss: 2160,
        shim_owner: FRAME_OWNED_BY_CSTACK,
        stackref_tag_mask: 0,
        free_threaded_unicode_kind_shift: UNICODE_KIND_SHIFT,
    },
    DebugOffsetsOverlay {
        python: (3, 14),
        runtime_autotss: 2336,
        shim_owner: FRAME_OWNED_BY_CSTACK,
        // Py_TAG_BITS: the low two bits of a _PyStackRef are flags.
        stackref_tag_mask: 0b11,
        free_threaded_unicode_kind_shift: 8,
    },
];

pub fn overlay_for(major: u8, minor: u8) -> Option<&'static DebugOffsetsOverlay> {
    OVERLAYS.iter().find(|row| row.python == (major, minor))
}
