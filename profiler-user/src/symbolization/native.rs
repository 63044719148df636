//! Native (ELF) user-space symbolization: deciding once per file where its symbols come from,
//! asking blazesym, and turning its answers into [`FrameLine`]s.
//!
//! blazesym on its own reads `.symtab`/`.dynsym`, embedded DWARF and `.gnu_debuglink` targets
//! (next to the binary and under the debug dirs, preceded by a build-id lookup that only runs
//! when the binary has a debug link and is readable at its canonical path). Added here:
//! build-id debug files for binaries without a debug link, and debug-link targets in the
//! binary's `.debug/` directory and for binaries only reachable through `/proc/self/fd/N`.
//! Such separate debug files are queried with virtual offsets computed from the binary's
//! PT_LOAD segments, since their file layout differs from the binary's.
use std::{
    fs::File,
    path::{Path, PathBuf},
    sync::Arc,
};

use blazesym::symbolize::{
    self as bz, CodeInfo, Input, Sym, Symbolized,
    source::{Elf, Source},
};
use object::read::ReadCache;
use tracing::{debug, warn};

use super::{
    StringInterner,
    demangle::{FunctionName, FunctionNames},
};
use crate::{
    model::{FileId, FrameLine, MappedFile},
    process::elf_headers::{ElfHeaders, LoadSegment},
};

/// What a file's resolver costs besides its tables' size (blazesym's own structures).
const RESOLVER_OVERHEAD_BYTES: u64 = 64 << 10;

/// After this many consecutive failures, a file is given up on (its frames stay unsymbolized).
const MAX_CONSECUTIVE_ERRORS_PER_FILE: u32 = 16;

/// The parts of a binary's ELF headers needed to pick and address a symbol source.
#[derive(Clone, Debug, Default)]
pub(super) struct ElfLayout {
    loads: Vec<LoadSegment>,
    pub(super) has_dwarf: bool,
    build_id: Option<String>,
    debuglink: Option<String>,
    /// Bytes of the symbol and string tables (and of the DWARF sections), what symbolizing
    /// the file makes blazesym read and index.
    symbol_bytes: u64,
    debug_bytes: u64,
}

impl ElfLayout {
    pub(super) fn read(path: &Path) -> Result<Self, super::SymbolizationError> {
        let file = File::open(path).map_err(|source| super::SymbolizationError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        // The headers only: a whole parse copies the symbol tables through the cache.
        let cache = ReadCache::new(file);
        let elf = ElfHeaders::parse(&cache).map_err(|source| super::SymbolizationError::Elf {
            path: path.to_path_buf(),
            source,
        })?;
        let loads = elf.loads.clone();
        let has_dwarf = elf
            .section(".debug_info")
            .is_some_and(|section| section.uncompressed_size > 0);
        let build_id = elf.build_id.as_deref().map(hex);
        let debuglink = elf
            .debuglink
            .as_deref()
            .map(|name| String::from_utf8_lossy(name).into_owned());
        // A compressed section (a distribution's debug files) is held decompressed.
        let size_of = |names: &[&str]| {
            names
                .iter()
                .filter_map(|name| elf.section(name))
                .map(|section| section.uncompressed_size)
                .sum::<u64>()
        };
        Ok(Self {
            loads,
            has_dwarf,
            build_id,
            debuglink,
            // blazesym indexes the symbols (a 24-byte ELF entry takes about 8 bytes of index;
            // libtorch_cpu's 30 MiB .symtab, 4 MiB measured) and maps the file for the names,
            // whose pages `Symbolizer::release_file_pages` gives back.
            symbol_bytes: size_of(&[".symtab", ".dynsym"]) / 3,
            debug_bytes: size_of(&[".debug_info", ".debug_line", ".debug_str", ".debug_abbrev"]),
        })
    }

    /// What the file's tables cost a resolver that reads them: the index blazesym builds is
    /// about the size of the tables it reads.
    fn tables_bytes(&self, debug_info: bool) -> u64 {
        self.symbol_bytes + if debug_info { self.debug_bytes } else { 0 }
    }

    /// Converts a file offset of the binary into the virtual address its symbols use.
    pub(super) fn file_offset_to_vaddr(&self, file_offset: u64) -> Option<u64> {
        self.loads.iter().find_map(|load| {
            let delta = file_offset.checked_sub(load.file_offset)?;
            (delta < load.file_size).then(|| load.vaddr.wrapping_add(delta))
        })
    }
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Where the symbols of one file come from.
#[derive(Clone, Debug)]
pub(super) enum SymbolSource {
    /// The binary itself; blazesym follows its `.gnu_debuglink` on its own.
    Binary,
    /// A separate debug file we located; queried by virtual address (through the binary's
    /// [`FileState::layout`]), falling back to the binary. `debug_file` is its identity when
    /// it could be read, so that blazesym's mapping of it is told apart like the binary's.
    SeparateDebugFile {
        debug_path: PathBuf,
        debug_file: Option<FileId>,
    },
}

/// Per-file state, created the first time a file is seen.
pub(super) struct FileState {
    pub(super) source: SymbolSource,
    /// The file's own blazesym symbolizer, which caches what it parsed of the file (and of its
    /// debug file): dropped, and its memory with it, when the file has not been used for a
    /// while and the budget is needed (see `Symbolizer`).
    pub(super) resolver: Option<bz::Symbolizer>,
    /// The path `resolver` reads the binary by ([`MappedFile::readable_path`] when the resolver
    /// was made; it keeps the file it opened by it).
    binary_path: PathBuf,
    /// What holding the resolver is estimated to cost, in bytes.
    pub(super) cost: u64,
    /// The binary's load segments, to turn file offsets into addresses (`None`: unreadable).
    pub(super) layout: Option<ElfLayout>,
    /// Its functions' index from `.eh_frame_hdr`, mapped at the first address without a
    /// symbol (`Some(None)`: the file has none) and dropped with the resolver.
    pub(super) functions: Option<Option<super::functions::FunctionIndex>>,
    /// Where blazesym's own mappings start, of the binary and of its separate debug file,
    /// made by `resolver` (see `Symbolizer::release_file_pages`): each file's one new mapping
    /// when the resolver was made; a file whose mapping could not be told apart is missing.
    pub(super) own_mappings: Vec<(FileId, u64)>,
    /// When the file was last looked up (the symbolizer's tick, and the time).
    pub(super) used: u64,
    pub(super) used_at: std::time::Instant,
    /// Whether a warning was logged for this file already (one per file).
    warned: bool,
    consecutive_errors: u32,
    /// Set once the file is given up on.
    pub(super) failed: bool,
}

impl FileState {
    /// The files the resolver of `binary` maps: the binary, and its separate debug file.
    pub(super) fn mapped_files(&self, binary: FileId) -> Vec<FileId> {
        let debug_file = match &self.source {
            SymbolSource::SeparateDebugFile { debug_file, .. } => *debug_file,
            SymbolSource::Binary => None,
        };
        std::iter::once(binary).chain(debug_file).collect()
    }

    pub(super) fn new(file: &MappedFile, debug_dirs: &[PathBuf], debug_info: bool) -> Self {
        let binary_path = file.readable_path();
        let layout = ElfLayout::read(&binary_path)
            .inspect_err(|err| debug!(file = %file.path, error = %err, "cannot read ELF layout"))
            // blazesym reports its own error on the first lookup.
            .ok();
        let mut cost = RESOLVER_OVERHEAD_BYTES
            + layout
                .as_ref()
                .map_or(0, |layout| layout.tables_bytes(debug_info));
        let source = match &layout {
            Some(layout) if !layout.has_dwarf => {
                match find_separate_debug_file(file, layout, debug_dirs) {
                    Some(debug_path) => {
                        debug!(file = %file.path, debug_file = %debug_path.display(), "using separate debug file");
                        let debug_file = std::fs::metadata(&debug_path)
                            .ok()
                            .map(|metadata| FileId::of(&metadata));
                        // Its tables and DWARF are what a lookup reads then (libc6-dbg's
                        // DWARF is 8 MiB once decompressed).
                        if let Ok(debug_layout) = ElfLayout::read(&debug_path) {
                            cost += debug_layout.tables_bytes(debug_info);
                        }
                        SymbolSource::SeparateDebugFile {
                            debug_path,
                            debug_file,
                        }
                    }
                    None => SymbolSource::Binary,
                }
            }
            _ => SymbolSource::Binary,
        };
        Self {
            source,
            resolver: None,
            binary_path,
            cost,
            layout,
            functions: None,
            own_mappings: Vec::new(),
            used: 0,
            used_at: std::time::Instant::now(),
            warned: false,
            consecutive_errors: 0,
            failed: false,
        }
    }
}

/// Looks for a debug file by build id (`<dir>/.build-id/ab/cdef….debug`), then by debug link
/// (`<bindir>/<link>`, `<bindir>/.debug/<link>`, `<dir>/<bindir>/<link>`, `<dir>/<link>`).
fn find_separate_debug_file(
    file: &MappedFile,
    layout: &ElfLayout,
    debug_dirs: &[PathBuf],
) -> Option<PathBuf> {
    let build_id = file.build_id.as_deref().or(layout.build_id.as_deref());
    if let Some(build_id) = build_id.filter(|id| id.len() > 2 && id.is_ascii()) {
        let (head, tail) = build_id.split_at(2);
        let found = debug_dirs
            .iter()
            .map(|dir| {
                dir.join(".build-id")
                    .join(head)
                    .join(format!("{tail}.debug"))
            })
            .find(|candidate| candidate.is_file());
        if found.is_some() {
            return found;
        }
    }

    let link = layout.debuglink.as_deref()?;
    // The debug link is a bare file name; anything else is not trustworthy.
    if link.is_empty() || link.contains('/') {
        return None;
    }
    let mut binary_dirs = Vec::new();
    if let Ok(real) = file.open_path.canonicalize() {
        binary_dirs.extend(real.parent().map(Path::to_path_buf));
    }
    binary_dirs.extend(Path::new(&*file.path).parent().map(Path::to_path_buf));
    binary_dirs.dedup();

    let mut candidates = Vec::new();
    for dir in &binary_dirs {
        candidates.push(dir.join(link));
        candidates.push(dir.join(".debug").join(link));
    }
    for debug_dir in debug_dirs {
        for dir in &binary_dirs {
            candidates.push(
                debug_dir
                    .join(dir.strip_prefix("/").unwrap_or(dir))
                    .join(link),
            );
        }
        candidates.push(debug_dir.join(link));
    }
    let real_binary = file.open_path.canonicalize().ok();
    candidates.into_iter().find(|candidate| {
        candidate.is_file()
            && real_binary.as_deref() != candidate.canonicalize().ok().as_deref()
            && debug_file_matches(candidate, build_id)
    })
}

/// A debug-link candidate must carry the binary's build id when both have one (a cheap stand-in
/// for gdb's CRC check).
fn debug_file_matches(candidate: &Path, binary_build_id: Option<&str>) -> bool {
    let Some(expected) = binary_build_id else {
        return true;
    };
    match ElfLayout::read(candidate) {
        Ok(layout) => layout
            .build_id
            .as_deref()
            .is_none_or(|actual| actual == expected),
        Err(_) => false,
    }
}

/// What a lookup for one user frame produced.
pub(super) enum UserLookup {
    /// The frame's lines, and the addresses of the symbol found when its name is all the
    /// lookup gave (an ELF symbol of the binary with a size: no source line, no inlined
    /// function), so every address of the symbol may get the same lines.
    Found(Vec<FrameLine>, Option<std::ops::Range<u64>>),
    NotFound,
    /// blazesym failed (the frame stays unsymbolized; counted as an error).
    Failed,
}

pub(super) struct LookupContext<'a> {
    pub(super) strings: &'a mut StringInterner,
    pub(super) function_names: &'a mut FunctionNames,
    /// For a file's resolver, made on its first lookup.
    pub(super) debug_dirs: &'a [PathBuf],
    pub(super) inline_frames: bool,
    pub(super) demangle: bool,
    /// Use DWARF (source lines, inlined functions) rather than only ELF symbol tables.
    pub(super) debug_info: bool,
}

/// A blazesym symbolizer for one file (and its separate debug file).
pub(super) fn resolver(
    debug_info: bool,
    inline_frames: bool,
    debug_dirs: &[PathBuf],
) -> bz::Symbolizer {
    bz::Symbolizer::builder()
        // Demangling is ours, so the raw name stays available as `system_name`.
        .enable_demangling(false)
        // The resolver serves one file (one device and inode): it keeps the file it opened
        // first. Reloading would stat the path at every lookup, and read a file that replaced
        // it there (a rebuilt binary, an upgraded package) for addresses of the old one.
        .enable_auto_reload(false)
        .enable_code_info(debug_info)
        .enable_inlined_fns(debug_info && inline_frames)
        .set_debug_dirs(Some(debug_dirs))
        .build()
}

fn elf_source(path: &std::path::Path, debug_info: bool) -> Source<'static> {
    let mut elf = Elf::new(path);
    elf.debug_syms = debug_info;
    Source::Elf(elf)
}

/// Symbolizes `file_offset` of `file`, never panicking on bad input.
pub(super) fn lookup_user(
    ctx: &mut LookupContext<'_>,
    state: &mut FileState,
    file: &MappedFile,
    file_offset: u64,
) -> UserLookup {
    if state.failed {
        return UserLookup::NotFound;
    }
    let resolver = match state.resolver.take() {
        Some(resolver) => resolver,
        None => {
            // Chosen again with each new resolver: a descriptor path chosen for an earlier one
            // may name another file by now.
            state.binary_path = file.readable_path();
            resolver(ctx.debug_info, ctx.inline_frames, ctx.debug_dirs)
        }
    };
    let lookup = lookup_with(ctx, state, &resolver, file, file_offset);
    state.resolver = Some(resolver);
    lookup
}

fn lookup_with(
    ctx: &mut LookupContext<'_>,
    state: &mut FileState,
    resolver: &bz::Symbolizer,
    file: &MappedFile,
    file_offset: u64,
) -> UserLookup {
    let mut failed = false;

    if let SymbolSource::SeparateDebugFile { debug_path, .. } = &state.source
        && let Some(vaddr) = state
            .layout
            .as_ref()
            .and_then(|layout| layout.file_offset_to_vaddr(file_offset))
    {
        let source = elf_source(debug_path, ctx.debug_info);
        match resolver.symbolize_single(&source, Input::VirtOffset(vaddr)) {
            Ok(Symbolized::Sym(sym)) => {
                state.consecutive_errors = 0;
                return UserLookup::Found(frame_lines(ctx, &sym, &file.path), None);
            }
            Ok(Symbolized::Unknown(_)) => {}
            Err(err) => {
                // A broken debug file: stop using it, the binary may still have symbols.
                warn_once(
                    state,
                    file,
                    &format!("debug file {}: {err}", debug_path.display()),
                );
                state.source = SymbolSource::Binary;
                failed = true;
            }
        }
    }

    let source = elf_source(&state.binary_path, ctx.debug_info);
    match resolver.symbolize_single(&source, Input::FileOffset(file_offset)) {
        Ok(Symbolized::Sym(sym)) => {
            state.consecutive_errors = 0;
            let name_only = sym.code_info.is_none() && sym.inlined.is_empty();
            let symbol = sym
                .size
                .filter(|&size| name_only && size > 0)
                .map(|size| sym.addr..sym.addr.saturating_add(size as u64));
            UserLookup::Found(frame_lines(ctx, &sym, &file.path), symbol)
        }
        Ok(Symbolized::Unknown(_)) if !failed => UserLookup::NotFound,
        Ok(Symbolized::Unknown(_)) => UserLookup::Failed,
        Err(err) => {
            warn_once(state, file, &err.to_string());
            state.consecutive_errors += 1;
            let unreadable = matches!(
                err.kind(),
                blazesym::ErrorKind::NotFound | blazesym::ErrorKind::PermissionDenied
            );
            if unreadable || state.consecutive_errors >= MAX_CONSECUTIVE_ERRORS_PER_FILE {
                debug!(file = %file.path, "giving up on symbolizing file");
                state.failed = true;
            }
            UserLookup::Failed
        }
    }
}

fn warn_once(state: &mut FileState, file: &MappedFile, error: &str) {
    if state.warned {
        debug!(file = %file.path, %error, "symbolization failed");
    } else {
        state.warned = true;
        warn!(file = %file.path, %error, "symbolization failed; frames of this file stay unsymbolized (further errors for it are logged at debug level)");
    }
}

/// Converts a blazesym symbol into frame lines, innermost (deepest inlined) first.
fn frame_lines(
    ctx: &mut LookupContext<'_>,
    sym: &Sym<'_>,
    module_path: &Arc<str>,
) -> Vec<FrameLine> {
    // blazesym reports inlined functions outermost first, each with the location inside it, and
    // `sym.code_info` as the location inside the outer function.
    let mut lines = Vec::with_capacity(sym.inlined.len() + 1);
    for inlined in sym.inlined.iter().rev() {
        lines.push(make_line(
            ctx,
            &inlined.name,
            inlined.code_info.as_ref(),
            module_path,
        ));
    }
    lines.push(make_line(
        ctx,
        &sym.name,
        sym.code_info.as_deref(),
        module_path,
    ));
    lines
}

fn make_line(
    ctx: &mut LookupContext<'_>,
    raw_name: &str,
    code_info: Option<&CodeInfo<'_>>,
    module_path: &Arc<str>,
) -> FrameLine {
    let FunctionName {
        function,
        system_name,
    } = ctx.function_names.name(ctx.strings, raw_name, ctx.demangle);
    let (file, line) = match code_info {
        Some(info) => {
            let path = info.to_path();
            (
                ctx.strings.intern(&path.to_string_lossy()),
                info.line.unwrap_or(0),
            )
        }
        None => (Arc::clone(module_path), 0),
    };
    FrameLine {
        function,
        system_name,
        file: Some(file),
        line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_offsets_map_through_load_segments() {
        let layout = ElfLayout {
            loads: vec![
                LoadSegment {
                    file_offset: 0,
                    file_size: 0x1000,
                    vaddr: 0,
                    executable: false,
                },
                LoadSegment {
                    file_offset: 0x1000,
                    file_size: 0x2000,
                    vaddr: 0x41000,
                    executable: true,
                },
            ],
            ..ElfLayout::default()
        };
        assert_eq!(layout.file_offset_to_vaddr(0x10), Some(0x10));
        assert_eq!(layout.file_offset_to_vaddr(0x1234), Some(0x41234));
        assert_eq!(layout.file_offset_to_vaddr(0x3000), None);
    }
}
