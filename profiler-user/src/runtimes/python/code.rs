//! Symbolizing code objects: (code object address, instruction) → qualname, file, line.
//!
//! A code object is read once (one read of its header, one per string, one for the line
//! table) into a [`CodeObject`], which then resolves any instruction offset without further
//! reads; [`CodeCache`] keeps them per (pid, address, fingerprint).
use std::sync::Arc;

use profiler_common::{CodeIdentity, PY_NAME_HEAD_BYTES, name_word};
use thiserror::Error;

use super::{
    layout::{InstructionUnit, LineTableFormat, PyLayout},
    memory::{MemoryError, ProcessMemory, ProcessMemoryExt},
};
use crate::{bounded::TwoGenerationCache, model::Pid};

/// Longest string (name, file name) read, in bytes.
pub const MAX_STRING_BYTES: usize = 4096;
/// Longest line table read.
pub const MAX_LINE_TABLE_BYTES: usize = 256 * 1024;

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CodeError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("object at {addr:#x} has type {found:#x}, not PyCode_Type {expected:#x}")]
    NotCode {
        addr: u64,
        found: u64,
        expected: u64,
    },
    #[error("string at {addr:#x}: {reason}")]
    BadString { addr: u64, reason: &'static str },
    #[error("line table at {addr:#x} has implausible size {size}")]
    BadLineTable { addr: u64, size: i64 },
    #[error(
        "code object at {addr:#x} is not the one sampled (fingerprint {found:#x}, sampled {sampled:#x}): its memory was reused"
    )]
    Replaced { addr: u64, found: u32, sampled: u32 },
    #[error("code object at {addr:#x} was freed (or changed while it was read)")]
    Freed { addr: u64 },
}

/// What a Python frame shows.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PyFrameInfo {
    /// `co_qualname` (3.11+, e.g. `Worker.spin`) or `co_name` (≤3.10).
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    /// `None` when the line table has no line for the instruction.
    pub line: Option<u32>,
    pub firstlineno: u32,
}

/// The parts of a code object needed to symbolize any of its instructions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeObject {
    /// What BPF records for this code object ([`CodeIdentity::fingerprint`]).
    pub fingerprint: u32,
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    pub firstlineno: i32,
    pub line_table: Box<[u8]>,
    pub line_table_format: LineTableFormat,
    /// Bytes of bytecode (`ob_size` code units of 2 bytes; 3.11+, else 0).
    pub bytecode_len: u64,
}

impl CodeObject {
    /// The line of the instruction at `byte_offset` in the bytecode; a negative offset (a
    /// frame that has not started) is the first line.
    pub fn line_at(&self, byte_offset: i64) -> Option<u32> {
        let line = if byte_offset < 0 {
            Some(self.firstlineno)
        } else {
            match self.line_table_format {
                LineTableFormat::Lnotab => {
                    Some(lnotab_line(&self.line_table, self.firstlineno, byte_offset))
                }
                LineTableFormat::LineTable310 => {
                    linetable310_line(&self.line_table, self.firstlineno, byte_offset)
                }
                LineTableFormat::Locations => {
                    locations_line(&self.line_table, self.firstlineno, byte_offset)
                }
            }
        };
        line.and_then(|line| u32::try_from(line).ok())
    }

    pub fn frame_info(&self, byte_offset: i64) -> PyFrameInfo {
        self.frame_info_at(Some(byte_offset))
    }

    /// Like [`frame_info`](Self::frame_info); `None` (an instruction in no known copy of the
    /// bytecode) has no line.
    pub fn frame_info_at(&self, byte_offset: Option<i64>) -> PyFrameInfo {
        PyFrameInfo {
            qualname: Arc::clone(&self.qualname),
            filename: Arc::clone(&self.filename),
            line: byte_offset.and_then(|offset| self.line_at(offset)),
            firstlineno: u32::try_from(self.firstlineno).unwrap_or(0),
        }
    }
}

/// Most per-thread bytecode copies looked at (one per thread index ever used).
const MAX_THREAD_BYTECODE_COPIES: u64 = 4096;

/// The byte offset of a frame's instruction into the bytecode it runs. In free-threaded 3.14+
/// a thread other than the first runs its own copy of the bytecode (`co_tlbc`), so an
/// instruction pointer outside `co_code_adaptive` is looked up among the copies. BPF keeps
/// only the low 32 bits of `instruction - code_addr`, so a copy matches when the pointer,
/// modulo 2^32, falls inside it; `None` when no copy (or more than one) does.
pub fn bytecode_offset(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    code: &CodeObject,
    code_addr: u64,
    instruction: u64,
) -> Option<i64> {
    let offset = instruction_byte_offset(layout, code_addr, instruction);
    let Some(tlbc_field) = layout.code_thread_bytecode else {
        return Some(offset);
    };
    if (0..code.bytecode_len as i64).contains(&offset) {
        return Some(offset);
    }
    let array = mem
        .read_u64(code_addr.wrapping_add(u64::from(tlbc_field)))
        .ok()?;
    // _PyCodeArray { Py_ssize_t size; char *entries[]; }
    let size = mem.read_u64(array).ok()?.min(MAX_THREAD_BYTECODE_COPIES);
    let entries = mem
        .read_vec(array.wrapping_add(8), size as usize * 8)
        .ok()?;
    let mut found = None;
    for entry in entries.chunks_exact(8) {
        let copy = u64::from_le_bytes(entry.try_into().ok()?);
        if copy == 0 {
            continue;
        }
        let into_copy = u64::from(instruction.wrapping_sub(copy) as u32);
        if into_copy < code.bytecode_len {
            if found.is_some() {
                return None;
            }
            found = Some(into_copy as i64);
        }
    }
    found
}

/// Byte offset into the bytecode of a frame's raw instruction field (see
/// [`InstructionUnit`]); `f_lasti` fields are sign-extended `int`s.
pub fn instruction_byte_offset(layout: &PyLayout, code_addr: u64, instruction: u64) -> i64 {
    match layout.instruction_unit {
        InstructionUnit::LastiBytes => instruction as i64,
        InstructionUnit::LastiCodeUnits => (instruction as i64).saturating_mul(2),
        InstructionUnit::InstructionPointer => {
            let bytecode = code_addr.wrapping_add(layout.code_bytecode.unwrap_or(0).into());
            instruction.wrapping_sub(bytecode) as i64
        }
    }
}

/// 3.8/3.9 `PyCode_Addr2Line` over `co_lnotab`.
pub fn lnotab_line(table: &[u8], firstlineno: i32, byte_offset: i64) -> i32 {
    let mut line = firstlineno;
    let mut addr: i64 = 0;
    for pair in table.chunks_exact(2) {
        addr += i64::from(pair[0]);
        if addr > byte_offset {
            break;
        }
        line += i32::from(pair[1] as i8);
    }
    line
}

/// 3.10 `PyCode_Addr2Line` over `co_linetable`: ranges of `pair[0]` bytes, line delta
/// `pair[1]` (-128: no line).
pub fn linetable310_line(table: &[u8], firstlineno: i32, byte_offset: i64) -> Option<i32> {
    let mut line = firstlineno;
    let mut end: i64 = 0;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += i64::from(pair[0]);
        let delta = pair[1] as i8;
        let range_line = if delta == -128 {
            None
        } else {
            line += i32::from(delta);
            Some(line)
        };
        if start <= byte_offset && byte_offset < end {
            return range_line;
        }
    }
    None
}

/// A PEP 657 varint: 6-bit chunks, least significant first, 0x40 = more follow.
fn read_varint(table: &[u8], pos: &mut usize) -> Option<u32> {
    let mut value: u32 = 0;
    let mut shift = 0;
    loop {
        let byte = *table.get(*pos)?;
        *pos += 1;
        value |= u32::from(byte & 0x3f).checked_shl(shift)?;
        if byte & 0x40 == 0 {
            return Some(value);
        }
        shift += 6;
        if shift > 30 {
            return None;
        }
    }
}

fn read_signed_varint(table: &[u8], pos: &mut usize) -> Option<i32> {
    let raw = read_varint(table, pos)?;
    let magnitude = (raw >> 1) as i32;
    Some(if raw & 1 != 0 { -magnitude } else { magnitude })
}

/// 3.11+ `PyCode_Addr2Line` over the PEP 657 location table. Each entry starts with a byte
/// `1 cccc lll`: `lll + 1` code units, code `cccc` says how the line changes.
pub fn locations_line(table: &[u8], firstlineno: i32, byte_offset: i64) -> Option<i32> {
    let target = byte_offset / 2;
    let mut line = firstlineno;
    let mut start: i64 = 0;
    let mut pos = 0;
    while pos < table.len() {
        let header = table[pos];
        if header & 0x80 == 0 {
            // Not an entry start: resynchronise on the next one, as CPython does.
            pos += 1;
            continue;
        }
        let code = (header >> 3) & 0x0f;
        let length = i64::from(header & 0x07) + 1;
        let mut after_header = pos + 1;
        let delta = match code {
            // No location.
            15 => 0,
            // Long form and no-column form start with the signed line delta.
            13 | 14 => read_signed_varint(table, &mut after_header)?,
            // One-line forms: line + 0, 1, 2.
            10..=12 => i32::from(code - 10),
            // Short forms: same line.
            _ => 0,
        };
        line = line.saturating_add(delta);
        let end = start + length;
        if start <= target && target < end {
            return (code != 15).then_some(line);
        }
        start = end;
        pos += 1;
        while pos < table.len() && table[pos] & 0x80 == 0 {
            pos += 1;
        }
    }
    None
}

/// A compact `str` object's length (code points) and data bytes, not decoded yet.
struct RawString {
    length: u64,
    ascii: bool,
    char_size: u64,
    data: Vec<u8>,
}

/// Reads a `str` object: compact ASCII, or compact UCS-1/2/4.
pub fn read_unicode(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    addr: u64,
) -> Result<String, CodeError> {
    decode_unicode(addr, read_raw_unicode(mem, layout, addr)?)
}

fn read_raw_unicode(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    addr: u64,
) -> Result<RawString, CodeError> {
    // The ASCII header (length, state) is a prefix of every compact string.
    let header = mem.read_vec(addr, layout.unicode_ascii_data as usize)?;
    let field = |offset: u32, size: usize| -> Option<u64> {
        let bytes = header.get(offset as usize..offset as usize + size)?;
        let mut buf = [0u8; 8];
        buf[..size].copy_from_slice(bytes);
        Some(u64::from_le_bytes(buf))
    };
    let bad = |reason| CodeError::BadString { addr, reason };
    let length = field(layout.unicode_length, 8).ok_or(bad("header"))?;
    let state = field(layout.unicode_state, 4).ok_or(bad("header"))?;
    // state bits: interned:2, kind:3, compact:1, ascii:1 (every version 3.8–3.14).
    let shift = u32::from(layout.unicode_kind_shift);
    let kind = (state >> shift) & 0x7;
    let compact = (state >> (shift + 3)) & 1 != 0;
    let ascii = (state >> (shift + 4)) & 1 != 0;
    if !compact {
        return Err(bad("not a compact string"));
    }
    let char_size: u64 = match kind {
        1 => 1,
        2 => 2,
        4 => 4,
        _ => return Err(bad("invalid kind")),
    };
    let byte_len = length.saturating_mul(char_size);
    if byte_len > MAX_STRING_BYTES as u64 {
        return Err(bad("too long"));
    }
    let data_offset = if ascii {
        layout.unicode_ascii_data
    } else {
        layout.unicode_compact_data
    };
    let data = mem.read_vec(addr.wrapping_add(u64::from(data_offset)), byte_len as usize)?;
    Ok(RawString {
        length,
        ascii,
        char_size,
        data,
    })
}

fn decode_unicode(addr: u64, raw: RawString) -> Result<String, CodeError> {
    let RawString {
        ascii,
        char_size,
        data,
        ..
    } = raw;
    let bad = |reason| CodeError::BadString { addr, reason };
    let text = match char_size {
        1 if ascii => {
            if !data.is_ascii() {
                return Err(bad("non-ASCII byte in an ASCII string"));
            }
            data.into_iter().map(char::from).collect()
        }
        // UCS-1 is Latin-1: every byte is the code point.
        1 => data.into_iter().map(char::from).collect(),
        2 => data
            .chunks_exact(2)
            .map(|c| char::from_u32(u16::from_le_bytes([c[0], c[1]]).into()).unwrap_or('\u{fffd}'))
            .collect(),
        _ => data
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).unwrap_or('\u{fffd}')
            })
            .collect(),
    };
    Ok(text)
}

/// Reads a `bytes` object's contents.
pub fn read_bytes_object(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    addr: u64,
) -> Result<Vec<u8>, CodeError> {
    let size = mem.read_u64(addr.wrapping_add(u64::from(layout.bytes_size)))? as i64;
    if !(0..=MAX_LINE_TABLE_BYTES as i64).contains(&size) {
        return Err(CodeError::BadLineTable { addr, size });
    }
    Ok(mem.read_vec(
        addr.wrapping_add(u64::from(layout.bytes_data)),
        size as usize,
    )?)
}

/// Reads the code object at `code_addr`, checking that its type is `PyCode_Type` (at
/// `code_type_addr` in the process).
pub fn read_code_object(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    code_type_addr: u64,
    code_addr: u64,
) -> Result<CodeObject, CodeError> {
    // One read covers every pointer and int field used.
    let fields = [
        layout.object_type,
        layout.code_firstlineno,
        layout.code_filename,
        layout.code_name,
        layout.code_qualname.unwrap_or(0),
        layout.code_line_table,
        layout.code_version.unwrap_or(0),
        layout.bytes_size,
    ];
    let header_len = fields.iter().max().copied().unwrap_or(0) as usize + 8;
    let header = mem.read_vec(code_addr, header_len)?;
    let pointer = |offset: u32| -> u64 {
        let at = offset as usize;
        header
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0)
    };
    let found = pointer(layout.object_type);
    if found != code_type_addr {
        return Err(CodeError::NotCode {
            addr: code_addr,
            found,
            expected: code_type_addr,
        });
    }
    // A freed object keeps its old fields until the memory is reused, but not its reference
    // count: the allocator's free list takes that word (a pointer, or 0 at the list's end).
    if !plausible_refcount(layout, &header) {
        return Err(CodeError::Freed { addr: code_addr });
    }
    let firstlineno = pointer(layout.code_firstlineno) as u32 as i32;
    let name_addr = pointer(layout.code_qualname.unwrap_or(layout.code_name));
    let name = read_raw_unicode(mem, layout, name_addr)?;
    let mut identity = CodeIdentity {
        firstlineno: firstlineno as u32,
        version: layout
            .code_version
            .map_or(0, |offset| pointer(offset) as u32),
        name: name_addr,
        filename: pointer(layout.code_filename),
        line_table: pointer(layout.code_line_table),
        ..CodeIdentity::default()
    };
    if identity.version == 0 {
        // The same words BPF takes: the data's head, zero past its end, and its last 8 bytes.
        identity.name_length = name.length;
        identity.name_head = [name_word(&name.data, 0), name_word(&name.data, 8)];
        if name.data.len() > PY_NAME_HEAD_BYTES {
            identity.name_tail = name_word(&name.data, name.data.len() - 8);
        }
    }
    let qualname = decode_unicode(name_addr, name)?;
    let filename = read_unicode(mem, layout, identity.filename)?;
    let line_table = read_bytes_object(mem, layout, identity.line_table)?;
    // The strings are the code object's only while it lives: read its header again, and take
    // what was read only if the object is still alive and unchanged (reference count aside).
    // Only the identity fields: others (3.11's warm-up counter, 3.12's instrumentation
    // version) change as the code runs.
    let again = mem.read_vec(code_addr, header_len)?;
    let same = |offset: u32, size: usize| {
        let at = offset as usize;
        again.get(at..at + size).is_some() && again.get(at..at + size) == header.get(at..at + size)
    };
    let unchanged = same(layout.object_type, 8)
        && same(layout.code_firstlineno, 4)
        && layout.code_version.is_none_or(|offset| same(offset, 4))
        && same(layout.code_qualname.unwrap_or(layout.code_name), 8)
        && same(layout.code_filename, 8)
        && same(layout.code_line_table, 8);
    if !plausible_refcount(layout, &again) || !unchanged {
        return Err(CodeError::Freed { addr: code_addr });
    }
    Ok(CodeObject {
        fingerprint: identity.fingerprint(),
        qualname: Arc::from(qualname),
        filename: Arc::from(filename),
        firstlineno,
        line_table: line_table.into_boxed_slice(),
        line_table_format: layout.line_table_format,
        bytecode_len: if layout.code_bytecode.is_some() {
            pointer(layout.bytes_size).min(MAX_BYTECODE_UNITS) * 2
        } else {
            0
        },
    })
}

/// More code units than any code object has (a sanity bound on `ob_size`).
const MAX_BYTECODE_UNITS: u64 = 1 << 24;

/// Whether an object header read at the object's address can be a live object's.
///
/// With the GIL, `ob_refcnt` is the first word: a count of at least 1 in its low half and
/// nothing in bits 32–47, where a free-list pointer has its high address bits (3.14 keeps flags
/// in bits 48–63; immortal counts fit in 32 bits). Free-threaded, the count is split into
/// `ob_ref_local` (u32 at 12) and `ob_ref_shared` (at 16, the count shifted left by 2): a dead
/// object has both at zero (the shared word keeps only its 2 flag bits).
fn plausible_refcount(layout: &PyLayout, header: &[u8]) -> bool {
    let word = |at: usize| {
        header
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    if layout.free_threaded {
        let local = word(8) >> 32;
        let shared = word(16);
        local != 0 || shared >> 2 != 0
    } else {
        let count = word(0);
        count as u32 != 0 && count & 0x0000_ffff_0000_0000 == 0
    }
}

/// Symbolizes one frame: reads the code object and resolves the frame's raw instruction
/// field (`f_lasti` or an instruction pointer, per `layout.instruction_unit`).
pub fn symbolize_code(
    mem: &dyn ProcessMemory,
    layout: &PyLayout,
    code_type_addr: u64,
    code_addr: u64,
    instruction: u64,
) -> Result<PyFrameInfo, CodeError> {
    let code = read_code_object(mem, layout, code_type_addr, code_addr)?;
    Ok(code.frame_info_at(bytecode_offset(mem, layout, &code, code_addr, instruction)))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    pid: Pid,
    code_addr: u64,
    fingerprint: u32,
}

/// Counters of a [`CodeCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodeCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub errors: u64,
    /// Code objects read whose fingerprint was not the sampled one (also in `errors`).
    pub replaced: u64,
}

/// Code objects by (pid, address, fingerprint), bounded to `capacity` entries in two
/// generations ([`TwoGenerationCache`]): eviction is O(1) and recently used entries survive.
#[derive(Debug)]
pub struct CodeCache {
    entries: TwoGenerationCache<CacheKey, Arc<CodeObject>>,
    /// The processes with entries, so the exit of every other process (hundreds a second on a
    /// busy host) costs a set lookup rather than a pass over the cache.
    pids: std::collections::HashSet<Pid>,
    stats: CodeCacheStats,
}

impl CodeCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: TwoGenerationCache::new(capacity),
            pids: std::collections::HashSet::new(),
            stats: CodeCacheStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn stats(&self) -> CodeCacheStats {
        self.stats
    }

    /// The code object, read through `mem` on a miss, when it is the one BPF fingerprinted:
    /// a code object freed and another allocated at its address has another fingerprint, and
    /// is an error (never cached), not a name.
    pub fn code_object(
        &mut self,
        mem: &dyn ProcessMemory,
        layout: &PyLayout,
        code_type_addr: u64,
        pid: Pid,
        code_addr: u64,
        fingerprint: u32,
    ) -> Result<Arc<CodeObject>, CodeError> {
        let key = CacheKey {
            pid,
            code_addr,
            fingerprint,
        };
        if let Some(code) = self.entries.get(&key) {
            self.stats.hits += 1;
            return Ok(code);
        }
        self.stats.misses += 1;
        let code = match read_code_object(mem, layout, code_type_addr, code_addr) {
            Ok(code) if code.fingerprint == fingerprint => Arc::new(code),
            Ok(code) => {
                self.stats.errors += 1;
                self.stats.replaced += 1;
                return Err(CodeError::Replaced {
                    addr: code_addr,
                    found: code.fingerprint,
                    sampled: fingerprint,
                });
            }
            Err(error) => {
                self.stats.errors += 1;
                return Err(error);
            }
        };
        if self.entries.insert(key, Arc::clone(&code)) {
            self.pids = self.entries.keys().map(|key| key.pid).collect();
        }
        self.pids.insert(pid);
        Ok(code)
    }

    /// Drops every entry of `pid` (process exited or exec'ed).
    pub fn forget_process(&mut self, pid: Pid) {
        if !self.pids.remove(&pid) {
            return;
        }
        self.entries.retain(|key, _| key.pid != pid);
    }
}
