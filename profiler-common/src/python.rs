//! The Python part of the ABI: what the agent tells BPF about a CPython process
//! ([`PyProcInfo`], one per pid in `PYTHON_PROCESSES`) and what BPF records per Python frame
//! ([`PyFrameRecord`], appended to a sample).
//!
//! BPF knows no Python version: every offset it needs is a field of [`PyProcInfo`], filled by the
//! agent from its per-version layout rows. Supporting a new CPython is new data, not new code.

/// Deepest Python stack recorded (a power of two: BPF masks indexes with it). Deeper stacks
/// keep their innermost frames and are flagged `SAMPLE_PYTHON_TRUNCATED`.
pub const MAX_PYTHON_FRAMES: usize = 1024;
/// Entries of `PYTHON_PROCESSES`.
pub const MAX_PYTHON_PROCESSES: u32 = 4096;
/// Entries of the `PYTHON_THREADS` LRU cache (thread id → thread state).
pub const MAX_PYTHON_THREADS: u32 = 16_384;
/// Steps of the thread-state scan for the sampled thread (one per thread state, plus one per
/// interpreter): threads further down the lists get no Python frames. CPython pushes new
/// thread states at the head, so the main thread is the last one; see docs/architecture.md
/// for the bound's cost.
pub const MAX_PYTHON_THREAD_SCAN: u32 = 1024;
/// Room for a frame read in one go: every field BPF uses lies below this in every layout. BPF
/// reads only `PyProcInfo::frame_read_bytes` of it: a frame at the end of a data-stack chunk
/// is followed by unmapped memory, and a longer read there fails.
pub const PYTHON_FRAME_READ_BYTES: usize = 128;
/// Room for a code object's header (up to `co_linetable`, free-threaded headers included).
pub const PYTHON_CODE_READ_BYTES: usize = 256;
/// Room for a string's header and the first [`PY_NAME_HEAD_BYTES`] of its ASCII data.
pub const PYTHON_NAME_READ_BYTES: usize = 128;
/// Bytes of a name's data that go into a code fingerprint (plus its last 8 bytes).
pub const PY_NAME_HEAD_BYTES: usize = 16;

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
    /// The code object fields of its fingerprint (see [`CodeIdentity`]).
    pub code_firstlineno: u16,
    /// `co_version` (3.12+), 0 when the version has none.
    pub code_version: u16,
    /// `co_qualname` where the version has it, else `co_name`: the name the agent shows.
    pub code_name: u16,
    pub code_filename: u16,
    pub code_line_table: u16,
    /// `PyASCIIObject.length` and `.state`; where compact ASCII and non-ASCII data start.
    pub unicode_length: u8,
    pub unicode_state: u8,
    pub unicode_ascii_data: u8,
    pub unicode_compact_data: u8,
    pub anchor_kind: u8,
    pub instruction_kind: u8,
    pub entry_kind: u8,
    /// `FRAME_OWNED_BY_CSTACK` for `PY_ENTRY_SHIM`.
    pub shim_owner: u8,
    /// Bytes of a frame to read: up to the end of the last field used.
    pub frame_read_bytes: u8,
    /// Bytes of a code object to read: up to the end of the last identity field.
    pub code_read_bytes: u16,
    /// Bytes of a name string to read: its header and [`PY_NAME_HEAD_BYTES`] of ASCII data.
    pub name_read_bytes: u8,
    /// Where `kind` starts in the string's `state` bits (2; 8 in free-threaded 3.14+, where
    /// `interned` is a whole byte); `compact` and `ascii` follow it at +3 and +4.
    pub unicode_kind_shift: u8,
}

const _: () = assert!(core::mem::size_of::<PyProcInfo>() == 64);

/// [`PyFrameRecord::meta`]: the frame is the first of its C-level eval call.
pub const PY_FRAME_ENTRY: u32 = 1 << 31;
/// [`PyFrameRecord::meta`]: the bits holding the code object's fingerprint.
pub const PY_FRAME_FINGERPRINT_MASK: u32 = PY_FRAME_ENTRY - 1;

/// What identifies a code object at the moment BPF reads it, so the agent, reading the code
/// object later, can prove it is the same one and not another allocated at the freed address.
///
/// `co_version` (3.12+) is a counter CPython bumps for every code object it creates, which
/// settles it alone. Without it (3.8–3.11, or once the counter is exhausted) the name's
/// length, first [`PY_NAME_HEAD_BYTES`] and last 8 bytes stand in: a reused address then also
/// needs the same first line, the same name, file and line table addresses, and a name equal
/// at both ends to pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodeIdentity {
    pub firstlineno: u32,
    pub version: u32,
    pub name: u64,
    pub filename: u64,
    pub line_table: u64,
    /// `PyASCIIObject.length` of the name (only when `version` is 0).
    pub name_length: u64,
    /// The name's data bytes 0..8 and 8..16, zero past its end (only when `version` is 0).
    pub name_head: [u64; 2],
    /// The name's last 8 data bytes when it has more than 16 (only when `version` is 0).
    pub name_tail: u64,
}

#[inline(always)]
fn fingerprint_mix(hash: u64, word: u64) -> u64 {
    let mixed = (hash ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    mixed ^ (mixed >> 29)
}

impl CodeIdentity {
    /// The 31-bit fingerprint recorded in [`PyFrameRecord::meta`]; never 0, which BPF records
    /// when it could not read the code object (and which therefore proves nothing).
    #[inline(always)]
    pub fn fingerprint(&self) -> u32 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        hash = fingerprint_mix(
            hash,
            u64::from(self.firstlineno) | u64::from(self.version) << 32,
        );
        hash = fingerprint_mix(hash, self.name);
        hash = fingerprint_mix(hash, self.filename);
        hash = fingerprint_mix(hash, self.line_table);
        if self.version == 0 {
            hash = fingerprint_mix(hash, self.name_length);
            hash = fingerprint_mix(hash, self.name_head[0]);
            hash = fingerprint_mix(hash, self.name_head[1]);
            hash = fingerprint_mix(hash, self.name_tail);
        }
        let folded = ((hash >> 32) ^ hash) as u32 & PY_FRAME_FINGERPRINT_MASK;
        if folded == 0 { 1 } else { folded }
    }
}

/// Little-endian word of `bytes[at..at + 8]`, zero past the end of `bytes`.
#[inline(always)]
pub fn name_word(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    let mut i = 0;
    while i < 8 {
        if let Some(&byte) = bytes.get(at + i) {
            word[i] = byte;
        }
        i += 1;
    }
    u64::from_le_bytes(word)
}

/// One Python frame of a sample, innermost first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrameRecord {
    /// The code object's address.
    pub code: u64,
    /// `f_lasti` (`PY_INSTRUCTION_LASTI`) or instruction pointer − `code`.
    pub instruction: u32,
    /// The code object's fingerprint (low 31 bits, [`CodeIdentity::fingerprint`], 0 when it
    /// could not be read) and `PY_FRAME_ENTRY`.
    pub meta: u32,
}

const _: () = assert!(core::mem::size_of::<PyFrameRecord>() == 16);

/// How long a thread found to have no thread state is not scanned again (milliseconds): a
/// process's non-Python threads (a framework's C++ workers) would otherwise cost a thread-list
/// scan per sample, yet a C thread may attach to the interpreter later. Short, because a new
/// Python thread is often first seen (blocked on the GIL, by the off-CPU program) in the
/// moment before its state is bound to it: with a second here, a two-thread program lost
/// half of one thread's Python frames for its first second.
pub const PY_NO_THREAD_STATE_RETRY_MS: u32 = 200;

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
