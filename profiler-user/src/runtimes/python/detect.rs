//! Recognising a CPython process from its snapshot, using only the ELF files it maps: which
//! file defines `_PyRuntime` (a shared libpython or a static executable), the version, the
//! [`PyLayout`], and where the runtime, `PyCode_Type` and the eval loop are in the process.
use std::{ops::Range, path::Path, sync::Arc};

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};
use thiserror::Error;

use super::{
    debug_offsets::{
        DEBUG_COOKIE, DebugOffsetsError, MAX_DEBUG_OFFSETS_SIZE, parse_debug_offsets,
        version_from_hex,
    },
    layout::{PyLayout, layout_for},
};
use crate::model::{MappedFile, ProcessInfo};

#[derive(Debug, Error)]
pub enum DetectError {
    #[error("no mapped file defines _PyRuntime")]
    NotPython,
    #[error("cannot read {path}: {source}")]
    UnreadableFile {
        path: Arc<str>,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} defines _PyRuntime but not {symbol}")]
    MissingSymbol {
        path: Arc<str>,
        symbol: &'static str,
    },
    #[error("cannot tell the Python version of {path}")]
    UnknownVersion { path: Arc<str> },
    #[error("Python {}.{} is not supported (no layout)", .version.0, .version.1)]
    UnsupportedVersion { version: (u8, u8, u8) },
    #[error("free-threaded Python {}.{} is not supported: {reason}", .version.0, .version.1)]
    FreeThreaded {
        version: (u8, u8, u8),
        reason: &'static str,
    },
    #[error("_Py_DebugOffsets of {path}: {source}")]
    DebugOffsets {
        path: Arc<str>,
        #[source]
        source: DebugOffsetsError,
    },
    #[error("no load bias for {path}: none of its mappings matches a PT_LOAD segment")]
    NoLoadBias { path: Arc<str> },
}

/// How the version was learnt, most precise first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionSource {
    DebugOffsets,
    /// The `Py_Version` constant (3.11+).
    PyVersionSymbol,
    /// The `PY_VERSION` string ("3.9.18") in the file's read-only data.
    VersionString,
    /// Only the file name (`libpython3.X`, `python3.X`): micro is 0.
    FileName,
}

/// A CPython process the walker and BPF can handle.
#[derive(Clone, Debug)]
pub struct PythonProcess {
    /// (major, minor, micro).
    pub version: (u8, u8, u8),
    pub version_source: VersionSource,
    pub layout: PyLayout,
    /// `&_PyRuntime` in the process.
    pub runtime_addr: u64,
    /// `&PyCode_Type` in the process: the `ob_type` of every code object.
    pub code_type_addr: u64,
    /// `&_Py_NoneStruct` in the process (3.13 shim frames point at it).
    pub none_addr: Option<u64>,
    /// The file defining `_PyRuntime` and its load bias (process address − ELF address).
    pub interpreter_file: Arc<MappedFile>,
    pub load_bias: u64,
    /// `_PyEval_EvalFrameDefault` and its `.cold` part, in process addresses.
    pub eval_frame_ranges: Vec<Range<u64>>,
}

/// What the ELF file says, before any process is involved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterpreterElf {
    pub version: (u8, u8, u8),
    pub version_source: VersionSource,
    pub layout: PyLayout,
    /// ELF virtual addresses.
    pub runtime: u64,
    pub code_type: u64,
    pub none: Option<u64>,
    pub eval_frame: Vec<Range<u64>>,
    /// PT_LOAD segments as (file offset, virtual address, file size).
    pub segments: Vec<(u64, u64, u64)>,
}

const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

/// Finds the interpreter of `process`. Only files whose name mentions python, then the
/// executable, are opened: other processes cost a string comparison per mapping.
pub fn detect_python(process: &ProcessInfo) -> Result<PythonProcess, DetectError> {
    detect_python_with(process, &mut |file| {
        inspect_interpreter_elf(&file.readable_path(), &file.path)
    })
}

/// Reads one mapped file: `Ok(None)` when it is not an interpreter.
pub type InspectFile<'a> =
    dyn FnMut(&Arc<MappedFile>) -> Result<Option<InterpreterElf>, DetectError> + 'a;

/// [`detect_python`] with the ELF inspection supplied by the caller (the agent caches it by
/// file identity, so a shared executable is parsed once, not once per process).
pub fn detect_python_with(
    process: &ProcessInfo,
    inspect: &mut InspectFile<'_>,
) -> Result<PythonProcess, DetectError> {
    let files = || process.mappings.iter().filter_map(|m| m.file.as_ref());
    let mut candidates: Vec<&Arc<MappedFile>> = Vec::new();
    let python_named = files().filter(|file| file_name(&file.path).contains("python"));
    let executable = files().filter(|file| *file.path == *process.labels.executable);
    for file in python_named.chain(executable) {
        if !candidates.iter().any(|known| known.id == file.id) {
            candidates.push(file);
        }
    }
    for file in candidates {
        let elf = match inspect(file)? {
            Some(elf) => elf,
            None => continue,
        };
        let load_bias = process
            .mappings
            .iter()
            .filter(|m| m.file.as_ref().is_some_and(|f| f.id == file.id))
            .find_map(|m| load_bias(&elf.segments, m.start, m.file_offset))
            .ok_or_else(|| DetectError::NoLoadBias {
                path: Arc::clone(&file.path),
            })?;
        let at = |addr: u64| addr.wrapping_add(load_bias);
        return Ok(PythonProcess {
            version: elf.version,
            version_source: elf.version_source,
            layout: elf.layout,
            runtime_addr: at(elf.runtime),
            code_type_addr: at(elf.code_type),
            none_addr: elf.none.map(at),
            interpreter_file: Arc::clone(file),
            load_bias,
            eval_frame_ranges: elf
                .eval_frame
                .iter()
                .map(|r| at(r.start)..at(r.end))
                .collect(),
        });
    }
    Err(DetectError::NotPython)
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// process address − ELF address, for a mapping of `file_offset` at `start` (as in the native
/// unwinder: the kernel maps a segment from its page-aligned file offset).
pub fn load_bias(segments: &[(u64, u64, u64)], start: u64, file_offset: u64) -> Option<u64> {
    let &(offset, vaddr, _) = segments
        .iter()
        .find(|(offset, _, _)| offset & !0xfff == file_offset)
        .or_else(|| {
            segments
                .iter()
                .find(|(offset, _, size)| (*offset..offset + size.max(&1)).contains(&file_offset))
        })?;
    Some(
        start
            .wrapping_sub(file_offset)
            .wrapping_sub(vaddr.wrapping_sub(offset)),
    )
}

/// Reads an ELF file: `Ok(None)` when it does not define `_PyRuntime` (not an interpreter).
pub fn inspect_interpreter_elf(
    open_path: &Path,
    display_path: &Arc<str>,
) -> Result<Option<InterpreterElf>, DetectError> {
    let unreadable = |source| DetectError::UnreadableFile {
        path: Arc::clone(display_path),
        source,
    };
    let handle = std::fs::File::open(open_path).map_err(unreadable)?;
    // SAFETY: read-only private mapping of a file the agent holds open; see native.rs.
    let mapped = unsafe { memmap2::Mmap::map(&handle) }.map_err(unreadable)?;
    let elf = match object::File::parse(&*mapped) {
        Ok(elf) => elf,
        // Not an ELF file (a script named python-something): not an interpreter.
        Err(_) => return Ok(None),
    };
    inspect_parsed_elf(&elf, display_path)
}

struct Symbols {
    runtime: Option<u64>,
    code_type: Option<u64>,
    none: Option<u64>,
    py_version: Option<u64>,
    eval_frame: Vec<Range<u64>>,
}

fn collect_symbols(elf: &object::File<'_>) -> Symbols {
    let mut symbols = Symbols {
        runtime: None,
        code_type: None,
        none: None,
        py_version: None,
        eval_frame: Vec::new(),
    };
    let mut note = |name: &str, address: u64, size: u64, kind: SymbolKind| match name {
        "_PyRuntime" => symbols.runtime = Some(address),
        "PyCode_Type" => symbols.code_type = Some(address),
        "_Py_NoneStruct" => symbols.none = Some(address),
        "Py_Version" => symbols.py_version = Some(address),
        _ if kind == SymbolKind::Text
            && size > 0
            && (name == EVAL_FRAME
                || name
                    .strip_prefix(EVAL_FRAME)
                    .is_some_and(|rest| rest.starts_with(".cold"))) =>
        {
            let range = address..address + size;
            if !symbols.eval_frame.contains(&range) {
                symbols.eval_frame.push(range);
            }
        }
        _ => {}
    };
    // .dynsym has everything but `.cold` parts, which only .symtab (unstripped) names.
    for symbol in elf.dynamic_symbols().chain(elf.symbols()) {
        if symbol.is_undefined() {
            continue;
        }
        if let Ok(name) = symbol.name() {
            note(name, symbol.address(), symbol.size(), symbol.kind());
        }
    }
    // A stripped file names only the hot part; find the cold parts it jumps to.
    if symbols.eval_frame.len() == 1 {
        let hot = symbols.eval_frame[0].clone();
        for cold in cold_parts(elf, &hot) {
            if !symbols.eval_frame.contains(&cold) {
                symbols.eval_frame.push(cold);
            }
        }
    }
    symbols.eval_frame.sort_by_key(|r| r.start);
    symbols
}

/// The `.cold` parts of the function at `hot`, found without symbols: GCC moves rarely run
/// blocks (with some builds, most of the eval loop) into a separate function-like range with
/// its own FDE, reached by jumps from the hot part. A rel32 `jmp`/`jcc` in the hot code whose
/// target is exactly the start of another FDE marks one. Scanning bytes rather than decoding
/// instructions can only add ranges that start where the hot code jumps to.
fn cold_parts(elf: &object::File<'_>, hot: &Range<u64>) -> Vec<Range<u64>> {
    use object::ObjectSection;
    let Some(code) = file_bytes_at(elf, hot.start, hot.end - hot.start) else {
        return Vec::new();
    };
    let Some(eh_frame) = elf.section_by_name(".eh_frame") else {
        return Vec::new();
    };
    let Ok(data) = eh_frame.data() else {
        return Vec::new();
    };
    let section = gimli::EhFrame::new(data, gimli::LittleEndian);
    let mut bases = gimli::BaseAddresses::default().set_eh_frame(eh_frame.address());
    if let Some(text) = elf.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    let mut fde_ends = std::collections::HashMap::new();
    let mut entries = gimli::UnwindSection::entries(&section, &bases);
    while let Ok(Some(entry)) = entries.next() {
        if let gimli::CieOrFde::Fde(partial) = entry
            && let Ok(fde) = partial.parse(gimli::UnwindSection::cie_from_offset)
        {
            fde_ends.insert(fde.initial_address(), fde.end_address());
        }
    }
    let mut parts = Vec::new();
    for at in 0..code.len() {
        let (opcode_len, rel) = match code[at..] {
            [0xe9, a, b, c, d, ..] => (5, i32::from_le_bytes([a, b, c, d])),
            [0x0f, 0x80..=0x8f, a, b, c, d, ..] => (6, i32::from_le_bytes([a, b, c, d])),
            _ => continue,
        };
        let target = (hot.start + (at + opcode_len) as u64).wrapping_add(rel as i64 as u64);
        if hot.contains(&target) {
            continue;
        }
        if let Some(&end) = fde_ends.get(&target) {
            let range = target..end;
            if !parts.contains(&range) {
                parts.push(range);
            }
        }
    }
    parts
}

/// Bytes at ELF virtual address `addr` from the file's initialised data, if any.
fn file_bytes_at<'data>(elf: &object::File<'data>, addr: u64, len: u64) -> Option<&'data [u8]> {
    elf.segments()
        .find_map(|segment| segment.data_range(addr, len).ok().flatten())
}

/// Like [`file_bytes_at`], shortened to what the segment holds (`_PyRuntime` may straddle the
/// end of .data's file image).
fn file_bytes_up_to<'data>(elf: &object::File<'data>, addr: u64, len: u64) -> Option<&'data [u8]> {
    elf.segments().find_map(|segment| {
        let (start, size) = (segment.address(), segment.size());
        if !(start..start + size).contains(&addr) {
            return None;
        }
        let data = segment.data().ok()?;
        let from = usize::try_from(addr - start).ok()?;
        let to = from.saturating_add(len as usize).min(data.len());
        data.get(from..to)
    })
}

/// The `PY_VERSION` string of `minor` ("3.9.18") in the file's read-only data. The linker
/// merges string tails, so it may end a longer string ("/root/.pyenv/versions/3.9.18").
fn find_version_string(elf: &object::File<'_>, major: u8, minor: u8) -> Option<(u8, u8, u8)> {
    use object::ObjectSection;
    let prefix = format!("{major}.{minor}.");
    let section = elf.section_by_name(".rodata")?;
    let data = section.data().ok()?;
    let micro_of = |s: &[u8]| -> Option<u8> {
        let at = s
            .windows(prefix.len())
            .rposition(|window| window == prefix.as_bytes())?;
        // "3.9.18" must not continue a longer number ("13.9.18").
        if at > 0 && matches!(s[at - 1], b'0'..=b'9' | b'.') {
            return None;
        }
        let micro = &s[at + prefix.len()..];
        if micro.is_empty() || micro.len() > 3 || !micro.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(micro).ok()?.parse().ok()
    };
    let strings = || data.split(|b| *b == 0);
    // An exact "3.M.N" string first, else a merged tail.
    strings()
        .filter(|s| s.starts_with(prefix.as_bytes()))
        .find_map(micro_of)
        .or_else(|| strings().find_map(micro_of))
        .map(|micro| (major, minor, micro))
}

/// (major, minor, free-threaded) from a name like `libpython3.13t.so.1.0` or `python3.11`.
pub fn version_from_file_name(path: &str) -> Option<(u8, u8, bool)> {
    let name = file_name(path);
    let rest = name
        .strip_prefix("libpython")
        .or_else(|| name.strip_prefix("python"))?;
    let (major, rest) = rest.split_once('.')?;
    let major: u8 = major.parse().ok()?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let minor: u8 = digits.parse().ok()?;
    let free_threaded = rest[digits.len()..].starts_with('t');
    Some((major, minor, free_threaded))
}

fn inspect_parsed_elf(
    elf: &object::File<'_>,
    path: &Arc<str>,
) -> Result<Option<InterpreterElf>, DetectError> {
    let symbols = collect_symbols(elf);
    let Some(runtime) = symbols.runtime else {
        return Ok(None);
    };
    let missing = |symbol| DetectError::MissingSymbol {
        path: Arc::clone(path),
        symbol,
    };
    let code_type = symbols.code_type.ok_or(missing("PyCode_Type"))?;
    if symbols.eval_frame.is_empty() {
        return Err(missing(EVAL_FRAME));
    }
    let from_name = version_from_file_name(path);

    let (version, version_source, layout) =
        match file_bytes_up_to(elf, runtime, MAX_DEBUG_OFFSETS_SIZE as u64) {
            Some(bytes) if bytes.starts_with(DEBUG_COOKIE) => {
                let header = super::debug_offsets::parse_header(bytes).map_err(|source| {
                    DetectError::DebugOffsets {
                        path: Arc::clone(path),
                        source,
                    }
                })?;
                let version = header.version();
                let (_, layout) = parse_debug_offsets(bytes).map_err(|source| match source {
                    DebugOffsetsError::UnknownVersion { .. } => {
                        DetectError::UnsupportedVersion { version }
                    }
                    source => DetectError::DebugOffsets {
                        path: Arc::clone(path),
                        source,
                    },
                })?;
                (version, VersionSource::DebugOffsets, layout)
            }
            _ => {
                let (version, source) = match symbols
                    .py_version
                    .and_then(|addr| file_bytes_at(elf, addr, 4))
                    .and_then(|bytes| bytes.try_into().ok())
                    .map(u32::from_le_bytes)
                {
                    Some(hex) => (version_from_hex(hex.into()), VersionSource::PyVersionSymbol),
                    None => {
                        let (major, minor, _) = from_name.ok_or(DetectError::UnknownVersion {
                            path: Arc::clone(path),
                        })?;
                        match find_version_string(elf, major, minor) {
                            Some(version) => (version, VersionSource::VersionString),
                            None => ((major, minor, 0), VersionSource::FileName),
                        }
                    }
                };
                let layout = layout_for(version.0, version.1)
                    .ok_or(DetectError::UnsupportedVersion { version })?;
                (version, source, *layout)
            }
        };
    // Free-threaded builds are walked only from their own `_Py_DebugOffsets`: a `t` build
    // whose offsets do not say so would be read with the GIL build's object header.
    if from_name.is_some_and(|(_, _, free_threaded)| free_threaded) && !layout.free_threaded {
        return Err(DetectError::FreeThreaded {
            version,
            reason: "the file name ends in 't' but no _Py_DebugOffsets says free-threaded",
        });
    }
    Ok(Some(InterpreterElf {
        version,
        version_source,
        layout,
        runtime,
        code_type,
        none: symbols.none,
        eval_frame: symbols.eval_frame,
        segments: elf
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                (offset, s.address(), size)
            })
            .collect(),
    }))
}
