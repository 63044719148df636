//! The Python part of the ABI: what the agent tells BPF about a CPython process
//! ([`PyProcInfo`], one per pid in `PYTHON_PROCESSES`) and what BPF records per Python frame
//! ([`PyFrameRecord`], appended to a sample).
//!
//! BPF knows no Python version: every offset it needs is a field of [`PyProcInfo`], filled by the
//! agent from its per-version layout rows. Supporting a new CPython is new data, not new code.

/// Deepest Python stack recorded (a power of two: BPF masks indexes with it).
pub const MAX_PYTHON_FRAMES: usize = 256;
/// Entries of `PYTHON_PROCESSES`.
pub const MAX_PYTHON_PROCESSES: u32 = 4096;
/// Entries of the `PYTHON_THREADS` LRU cache (thread id → thread state).
pub const MAX_PYTHON_THREADS: u32 = 16_384;
/// Steps of the thread-state scan for the sampled thread (one per thread state, plus one per
/// interpreter): threads further down the lists get no Python frames. CPython pushes new
/// thread states at the head, so the main thread is the last one; see docs/architecture.md
/// for the bound's cost.
pub const MAX_PYTHON_THREAD_SCAN: u32 = 1024;
/// Bytes of a frame read in one go: every field BPF uses lies below this in every layout.
pub const PYTHON_FRAME_READ_BYTES: usize = 128;

/// `PyProcInfo::anchor_kind`: `tstate->frame` (≤3.10) or `tstate->current_frame` (3.13+).
pub const PY_ANCHOR_DIRECT: u8 = 0;
/// `PyProcInfo::anchor_kind`: `tstate->cframe->current_frame` (3.11, 3.12).
pub const PY_ANCHOR_CFRAME: u8 = 1;

/// `PyProcInfo::instruction_kind`: `int f_lasti` (≤3.10), recorded sign-extended as is.
pub const PY_INSTRUCTION_LASTI: u8 = 0;
/// `PyProcInfo::instruction_kind`: a pointer into the code object (3.11+), recorded as its
/// distance from the code object's address.
pub const PY_INSTRUCTION_POINTER: u8 = 1;

/// `PyProcInfo::entry_kind`: every frame has its own eval call (≤3.10).
pub const PY_ENTRY_EVERY_FRAME: u8 = 0;
/// `PyProcInfo::entry_kind`: a `bool is_entry` at `entry_offset` (3.11).
pub const PY_ENTRY_FLAG: u8 = 1;
/// `PyProcInfo::entry_kind`: a shim frame whose `owner` byte at `entry_offset` equals
/// `shim_owner` marks each eval call (3.12+); shims are not recorded.
pub const PY_ENTRY_SHIM: u8 = 2;

/// Everything BPF needs to walk one process's Python stacks. Offsets are bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProcInfo {
    /// `&_PyRuntime` in the process.
    pub runtime_addr: u64,
    /// Bits to clear from a frame's code pointer (3.14's tagged `_PyStackRef`).
    pub code_tag_mask: u64,
    pub runtime_interpreters_head: u16,
    pub interp_next: u16,
    pub interp_threads_head: u16,
    pub tstate_next: u16,
    /// `pthread_t thread_id`, compared with the task's FS base (= `pthread_self()`): how BPF
    /// finds the sampled thread's state in every version and PID namespace.
    pub tstate_thread_id: u16,
    /// `native_thread_id` (3.11+), compared with the kernel tid only when the FS base offset
    /// is unknown; 0 when absent or when the process is in another PID namespace (its
    /// `native_thread_id`s are that namespace's numbers, not the kernel's).
    pub tstate_native_thread_id: u16,
    /// `frame` / `current_frame` / `cframe`, per `anchor_kind`.
    pub tstate_frame: u16,
    /// `current_frame` inside the `_PyCFrame` (`PY_ANCHOR_CFRAME` only).
    pub cframe_current_frame: u16,
    pub frame_code: u16,
    pub frame_back: u16,
    pub frame_instruction: u16,
    /// `is_entry` or `owner`, per `entry_kind`.
    pub entry_offset: u16,
    /// `co_firstlineno`, recorded as the code object's fingerprint.
    pub code_firstlineno: u16,
    pub anchor_kind: u8,
    pub instruction_kind: u8,
    pub entry_kind: u8,
    /// `FRAME_OWNED_BY_CSTACK` for `PY_ENTRY_SHIM`.
    pub shim_owner: u8,
    pub _pad: [u8; 2],
}

const _: () = assert!(core::mem::size_of::<PyProcInfo>() == 48);

/// [`PyFrameRecord::meta`]: the frame is the first of its C-level eval call.
pub const PY_FRAME_ENTRY: u32 = 1 << 31;
/// [`PyFrameRecord::meta`]: the bits holding `co_firstlineno`.
pub const PY_FRAME_FIRSTLINENO_MASK: u32 = PY_FRAME_ENTRY - 1;

/// One Python frame of a sample, innermost first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrameRecord {
    /// The code object's address.
    pub code: u64,
    /// `f_lasti` (`PY_INSTRUCTION_LASTI`) or instruction pointer − `code`.
    pub instruction: u32,
    /// `co_firstlineno` (low 31 bits) and `PY_FRAME_ENTRY`.
    pub meta: u32,
}

const _: () = assert!(core::mem::size_of::<PyFrameRecord>() == 16);

/// How long a thread found to have no thread state is not scanned again (milliseconds): a
/// process's non-Python threads (a framework's C++ workers) would otherwise cost a thread-list
/// scan per sample, yet a C thread may attach to the interpreter later.
pub const PY_NO_THREAD_STATE_RETRY_MS: u32 = 1000;

/// One cached thread state of `PYTHON_THREADS`, keyed by tid.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyThreadEntry {
    /// 0: the thread had none when last scanned.
    pub thread_state: u64,
    /// The process it belongs to: a reused tid of another process never matches.
    pub pid: u32,
    /// When the entry was written (`bpf_ktime_get_ns` in milliseconds, wrapping).
    pub checked_ms: u32,
}

const _: () = assert!(core::mem::size_of::<PyThreadEntry>() == 16);
