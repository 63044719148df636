//! The symbolization stage: [`UnwoundFrame`]s → [`SymbolizedFrame`]s.
//!
//! One long-lived [`Symbolizer`] owns a blazesym symbolizer (which is `!Send`, so the agent keeps
//! it on one thread) and a cache of finished frames keyed by file identity: `(FileId,
//! file_offset)` for user frames, the address for kernel frames. Frames that cannot be
//! symbolized are kept with a placeholder name (`libfoo.so+0x1234`, `[vdso]`, `[unknown]`,
//! `[unknown kernel]`), never dropped; blazesym errors never abort symbolization.
//!
//! A cached user frame carries the address and mapping of the first occurrence of its key; the
//! two stay consistent with each other (address - start + offset = file offset), which is what
//! pprof consumers use.
mod demangle;
#[cfg(test)]
mod fixtures;
mod functions;
mod kernel;
mod native;
mod python;
#[cfg(test)]
mod tests;

use std::{ops::Range, path::PathBuf, sync::Arc};

use blazesym::symbolize as bz;
// Every frame of every sample is looked up here: a fast hash matters more than DoS resistance
// for keys that come from our own BPF program.
use foldhash::{HashMap, HashMapExt, HashSet};

use crate::{
    bounded::TwoGenerationCache,
    model::{
        FileId, FrameKind, FrameLine, MappedFile, MappingInfo, Pid, SymbolizedFrame, UnwoundFrame,
        UnwoundStack,
    },
    process::maps::ANONYMOUS_NAME,
    runtimes::python::{CodeCache, PythonRuntime},
};

/// Errors reading a file's ELF layout (they only make its frames unsymbolized).
#[derive(Debug, thiserror::Error)]
pub enum SymbolizationError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse ELF file {path}: {source}")]
    Elf {
        path: PathBuf,
        source: object::read::Error,
    },
}

/// The frame of an address in executable memory that no file backs (JIT-compiled code).
pub const ANONYMOUS_CODE_FRAME: &str = "[anonymous code]";

/// Default bound of the frame cache. A busy host (compilers, hundreds of short-lived programs a
/// second, Python services, PyTorch) reuses about 10,000 frames a minute; what is used once goes
/// with its generation instead of piling up (a stripped compiler makes a new frame for every
/// address it is sampled at).
pub const DEFAULT_MAX_CACHED_FRAMES: usize = 16_384;
/// Functions of stripped files remembered over all files (about 150 bytes each with their
/// frame lines, whose names the frames share: 2.4 MiB at most; see
/// `functions::FunctionIndex::remember`); beyond, all are forgotten and remembered again as
/// they are sampled.
pub const MAX_FUNCTION_RANGES: usize = 16_384;
/// Kernel functions remembered by their start, in two generations (about 100 bytes each with
/// their frame line, whose name the frames share: under 1 MiB). The kernel's text has about
/// 120,000 symbols; a busy host samples a few thousand of them.
pub const MAX_KERNEL_FUNCTIONS: usize = 8_192;
/// Mappings remembered for the frames' pprof mappings (a few hundred bytes each).
const MAX_CACHED_MAPPINGS: usize = 8_192;

/// How the [`Symbolizer`] works.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolizerOptions {
    /// Demangle C++ and Rust names (the raw name goes to `FrameLine::system_name`).
    pub demangle: bool,
    /// Report functions inlined at an address as extra frame lines.
    pub inline_frames: bool,
    /// Directories searched for separate debug files (`.build-id/xx/….debug` and debug links).
    pub debug_dirs: Vec<PathBuf>,
    /// The kallsyms file used for kernel frames.
    pub kallsyms_path: PathBuf,
    /// The frame cache holds at most this many entries: two generations of half as many, so a
    /// frame not used for a whole generation goes (and is symbolized again when it comes back).
    pub max_cached_frames: usize,
    /// What the files' parsed symbol tables may cost together (estimated from their sizes);
    /// beyond, the least recently used files' are dropped and read again when needed.
    pub max_resolver_bytes: u64,
    /// A file's parsed symbol tables unused for this long are dropped whatever the total
    /// (read again when needed): the programs a busy host runs now and then would otherwise
    /// add theirs until `max_resolver_bytes`, the agent's memory growing for as long.
    pub resolver_idle: std::time::Duration,
    /// Files whose symbol source is remembered at most.
    pub max_files: usize,
    /// Read DWARF for source files, lines and inlined functions. Costs memory and CPU for
    /// every binary with debug info; without it names come from the ELF symbol tables.
    pub source_lines: bool,
}

impl Default for SymbolizerOptions {
    fn default() -> Self {
        Self {
            demangle: true,
            inline_frames: true,
            debug_dirs: vec![PathBuf::from("/usr/lib/debug")],
            kallsyms_path: PathBuf::from("/proc/kallsyms"),
            max_cached_frames: DEFAULT_MAX_CACHED_FRAMES,
            max_resolver_bytes: 48 << 20,
            resolver_idle: RESOLVER_IDLE,
            max_files: 4096,
            source_lines: true,
        }
    }
}

/// Counters of a [`Symbolizer`], cumulative since creation except `cache_entries`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SymbolizerStats {
    /// Lookups (cache misses) that found a symbol.
    pub frames_symbolized: u64,
    /// Frames left unsymbolized: failed lookups plus frames outside any file mapping.
    pub misses: u64,
    /// Of the misses, frames named after the start of the function (`.eh_frame` FDE) that
    /// holds them (`module!sub_<address>`) rather than by their own offset.
    pub named_by_function_start: u64,
    /// Frames answered from the cache.
    pub cache_hits: u64,
    /// Native frames looked up in their files (cache misses), and the wall time those lookups
    /// took, waits for the disk included: a file whose pages are read again at every lookup
    /// shows here.
    pub native_lookups: u64,
    pub native_lookup_time: std::time::Duration,
    /// The CPU time of those lookups (the wall time of a thread on a loaded host counts its
    /// waits for a CPU too).
    pub native_lookup_cpu_time: std::time::Duration,
    /// Of those, the lookups that first read a file's symbol tables (a new resolver), and
    /// their time: what a lookup costs is otherwise hidden by these.
    pub file_loads: u64,
    pub file_load_time: std::time::Duration,
    /// Of the lookups' time, that of naming frames without a symbol by the function start
    /// (`.eh_frame_hdr`'s search table, read in the file's mapping).
    pub function_start_time: std::time::Duration,
    /// Frames named from a remembered function (`functions::FunctionIndex`) without a
    /// lookup (counted in `misses` and `named_by_function_start`, or `frames_symbolized`, as
    /// the lookup would have been).
    pub function_range_hits: u64,
    /// Functions remembered over all files (bounded by [`MAX_FUNCTION_RANGES`]), and the
    /// times they were all forgotten for that bound.
    pub function_ranges: usize,
    pub function_ranges_cleared: u64,
    /// Frames currently cached.
    pub cache_entries: usize,
    /// Lookups that failed with an error (unreadable or malformed file, bad kallsyms).
    pub errors: u64,
    /// Frames dropped from the cache to stay within `max_cached_frames`.
    pub cache_evicted: u64,
    /// Files whose parsed symbol tables are held, and their estimated bytes (bounded by
    /// `max_resolver_bytes`); files dropped for that bound or unused for `resolver_idle`.
    pub resolvers: usize,
    pub resolver_bytes: u64,
    pub resolvers_dropped: u64,
    /// Python code objects cached (bounded by `python::CODE_CACHE_ENTRIES`).
    pub python_code_entries: usize,
    /// Function names cached by raw symbol name (bounded by
    /// `demangle::MAX_NAMED_FUNCTIONS`), and the lookups they answered without demangling.
    pub function_names: usize,
    pub function_name_hits: u64,
    /// Kernel functions remembered by their start (bounded by [`MAX_KERNEL_FUNCTIONS`]), and
    /// the frames they named without a lookup (counted in `frames_symbolized` too).
    pub kernel_functions: usize,
    pub kernel_function_hits: u64,
    /// Distinct strings interned (bounded by `MAX_INTERNED_STRINGS`).
    pub interned_strings: usize,
    /// Times symbol files' pages were given back (`Symbolizer::release_file_pages`).
    pub file_page_releases: u64,
    /// Of the mappings given back, the symbolizer's own (their pages kept in the page cache).
    pub own_mapping_releases: u64,
}

/// The frames of a stack, every slot filled. Sized at once: collected through `flatten`, the
/// vector grew by reallocation, for every sample.
fn all_symbolized(slots: Vec<Option<Arc<SymbolizedFrame>>>) -> Vec<Arc<SymbolizedFrame>> {
    let mut frames = Vec::with_capacity(slots.len());
    frames.extend(slots.into_iter().flatten());
    frames
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum FrameKey {
    User {
        file: FileId,
        file_offset: u64,
    },
    Python {
        pid: Pid,
        code_addr: u64,
        fingerprint: u32,
        instruction: u32,
    },
    Kernel(u64),
}

/// Hands out one shared `Arc<str>` per distinct string (names and paths repeat a lot). Only a
/// saving, in two generations ([`TwoGenerationCache`]): a string not asked for during a whole
/// generation is forgotten (the frames holding it keep theirs), so the interner holds about the
/// strings of the frames in use, at most [`MAX_INTERNED_STRINGS`]. It used to start over at
/// 65,536 strings: up to about 6 MiB, mostly names of frames long gone from the frame cache,
/// and the agent's memory growing with every new name until then.
#[derive(Debug)]
pub(crate) struct StringInterner {
    strings: TwoGenerationCache<Arc<str>, Arc<str>>,
}

/// Distinct strings the interner remembers (about 100 bytes each): as many as the frame cache
/// holds frames ([`DEFAULT_MAX_CACHED_FRAMES`]).
const MAX_INTERNED_STRINGS: usize = 16_384;

impl Default for StringInterner {
    fn default() -> Self {
        Self::new(MAX_INTERNED_STRINGS)
    }
}

impl StringInterner {
    fn new(capacity: usize) -> Self {
        Self {
            strings: TwoGenerationCache::new(capacity),
        }
    }

    pub(crate) fn intern(&mut self, value: &str) -> Arc<str> {
        if let Some(existing) = self.strings.get(value) {
            return existing;
        }
        let interned: Arc<str> = Arc::from(value);
        self.strings
            .insert(Arc::clone(&interned), Arc::clone(&interned));
        interned
    }

    pub(crate) fn len(&self) -> usize {
        self.strings.len()
    }
}

/// Turns unwound frames into symbolized frames, caching the results.
pub struct Symbolizer {
    options: SymbolizerOptions,
    /// For kernel frames; each file has its own (`native::FileState::resolver`).
    resolver: bz::Symbolizer,
    /// Estimated bytes of the file resolvers held, and the lookup tick (for least recently
    /// used eviction).
    resolver_bytes: u64,
    tick: u64,
    frames: TwoGenerationCache<FrameKey, Arc<SymbolizedFrame>>,
    /// Kernel functions by their first address (see `in_remembered_kernel_function`).
    kernel_functions: TwoGenerationCache<u64, FrameLine>,
    /// Shared by the frames of one mapping; each process maps its files at its own addresses.
    mappings: TwoGenerationCache<(FileId, u64), Arc<MappingInfo>>,
    files: HashMap<FileId, native::FileState>,
    /// Functions remembered by the files' indexes, together.
    function_ranges: usize,
    /// Off only in tests, to compare with what lookups alone make of the same addresses.
    remember_functions: bool,
    kernel: kernel::KernelSymbols,
    strings: StringInterner,
    function_names: demangle::FunctionNames,
    python_code: CodeCache,
    stats: SymbolizerStats,
    unknown_name: Arc<str>,
    unknown_kernel_name: Arc<str>,
    file_pages: FilePageWatch,
}

/// File-backed memory the agent may gain between two releases of symbol files' pages. The
/// file-backed RSS moves within this band, so it is as much of the RSS growth as a measurement
/// can show. A release is cheap now that the symbolizer's own mappings (nearly all of it) keep
/// their pages in the page cache, but at 2 MiB there is about one a second on a busy host:
/// 300 s host-benchmark runs measured 205, 220 and 236 µs of CPU per sample at 2 MiB against 193
/// and 212 at 6 MiB (perhaps 5-9 % more, near the runs' spread), and a file-backed part of the
/// growth after warm-up of 0.8-7.0 % (3 % on average) against 2-10 % (7 %; docs/benchmarks.md,
/// k5-k11). The growth is the closer of the two targets, so the smaller band is kept.
pub const FILE_PAGES_SLACK_BYTES: u64 = 2 << 20;
/// A resolver at least this costly (a symbol table of 3 MiB or more: libtorch_cpu's is 13 MiB)
/// has the symbol files' pages given back right after it is made.
const LARGE_RESOLVER_BYTES: u64 = 1 << 20;
/// How long a file's parsed symbol tables stay unused before they go. The frame cache answers
/// the frames seen often, so a file in use misses it every few seconds on a busy host (new
/// addresses, frames evicted); one idle for two minutes is a program that ran once or runs
/// now and then, whose tables cost a few milliseconds to read again (13 ms on average on the
/// host suite).
pub const RESOLVER_IDLE: std::time::Duration = std::time::Duration::from_secs(120);
/// How often the agent's file-backed RSS is looked at.
const FILE_PAGES_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The pages of symbol files looked up since the last release may stay resident up to this
/// much above the file-backed RSS a release of every file left (see
/// [`Symbolizer::release_file_pages_when_grown`]).
pub const FILE_PAGES_IN_USE_BYTES: u64 = 6 << 20;

/// When symbol files' pages were last given back, and what file-backed RSS was left then.
#[derive(Debug)]
struct FilePageWatch {
    checked_at: std::time::Instant,
    released_at: std::time::Instant,
    resident_after_release: u64,
    /// After the last release of every file's pages (the floor: the agent's binary, rings).
    resident_after_full_release: u64,
    /// Releases so far.
    releases: u64,
}

/// The agent's own mappings of the files `ids` now, as (file, start, end); `None` when
/// /proc/self/maps cannot be read.
fn own_mappings_of(ids: &[FileId]) -> Option<Vec<(FileId, u64, u64)>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    Some(
        maps.lines()
            .filter_map(crate::process::maps::parse_maps_line)
            .filter_map(|entry| {
                let id = FileId {
                    dev: entry.dev?,
                    ino: entry.inode,
                };
                ids.contains(&id).then_some((id, entry.start, entry.end))
            })
            .collect(),
    )
}

/// The agent's file-backed and shared resident bytes (`shared` of /proc/self/statm).
fn resident_file_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_ascii_whitespace().nth(2)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page_size = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    Some(pages * page_size)
}

impl Symbolizer {
    pub fn new(options: SymbolizerOptions) -> Self {
        let max_cached_frames = options.max_cached_frames;
        let resolver = build_resolver(&options);
        let kernel = kernel::KernelSymbols::new(options.kallsyms_path.clone());
        Self {
            options,
            resolver,
            resolver_bytes: 0,
            tick: 0,
            frames: TwoGenerationCache::new(max_cached_frames),
            kernel_functions: TwoGenerationCache::new(MAX_KERNEL_FUNCTIONS),
            mappings: TwoGenerationCache::new(MAX_CACHED_MAPPINGS),
            files: HashMap::new(),
            function_ranges: 0,
            remember_functions: true,
            kernel,
            strings: StringInterner::default(),
            function_names: demangle::FunctionNames::new(demangle::MAX_NAMED_FUNCTIONS),
            python_code: CodeCache::new(python::CODE_CACHE_ENTRIES),
            stats: SymbolizerStats::default(),
            unknown_name: Arc::from("[unknown]"),
            unknown_kernel_name: Arc::from("[unknown kernel]"),
            file_pages: FilePageWatch {
                checked_at: std::time::Instant::now(),
                released_at: std::time::Instant::now(),
                resident_after_release: 0,
                resident_after_full_release: 0,
                releases: 0,
            },
        }
    }

    /// Gives back symbol files' pages ([`Self::release_file_pages`]) once the agent's
    /// file-backed RSS has grown by [`FILE_PAGES_SLACK_BYTES`] since the last time. The files
    /// looked up since the last release keep theirs while the RSS stays within
    /// [`FILE_PAGES_IN_USE_BYTES`] of the floor a release of every file left (the agent's
    /// binary, rings): giving back pages the next lookups fault in again at once cost the
    /// unmapping and the faults for nothing (a release about once a second on the host
    /// suite). The RSS stays within the two bands of its floor, whatever the pace of new
    /// symbols. Looks at most once a second; returns the bytes advised.
    pub fn release_file_pages_when_grown(&mut self) -> u64 {
        if self.file_pages.checked_at.elapsed() < FILE_PAGES_CHECK_EVERY {
            return 0;
        }
        self.file_pages.checked_at = std::time::Instant::now();
        self.drop_idle_resolvers();
        let Some(resident) = resident_file_bytes() else {
            return 0;
        };
        if resident < self.file_pages.resident_after_release + FILE_PAGES_SLACK_BYTES {
            return 0;
        }
        self.release_file_pages_beyond(Some(self.file_pages.released_at))
    }

    /// A symbolizer that looks up every address, remembering no function.
    #[cfg(test)]
    pub(crate) fn without_remembered_functions(options: SymbolizerOptions) -> Self {
        Self {
            remember_functions: false,
            ..Self::new(options)
        }
    }

    /// Reads and indexes the kernel's symbols now rather than at the first kernel frame.
    pub fn load_kernel_symbols(&mut self) {
        self.kernel.load(&self.resolver);
    }

    pub fn stats(&self) -> SymbolizerStats {
        SymbolizerStats {
            file_page_releases: self.file_pages.releases,
            cache_entries: self.frames.len(),
            cache_evicted: self.frames.evicted(),
            resolvers: self.files.values().filter(|f| f.resolver.is_some()).count(),
            resolver_bytes: self.resolver_bytes,
            python_code_entries: self.python_code.len(),
            function_names: self.function_names.len(),
            kernel_functions: self.kernel_functions.len(),
            function_name_hits: self.function_names.hits(),
            interned_strings: self.strings.len(),
            function_ranges: self.function_ranges,
            ..self.stats
        }
    }

    /// Symbolizes every frame of `stack`, innermost first (same length and order as the stack).
    pub fn symbolize_stack(&mut self, stack: &UnwoundStack) -> Vec<Arc<SymbolizedFrame>> {
        self.symbolize_frames(&stack.frames)
    }

    /// Symbolizes `frames` (same length and order).
    pub fn symbolize_frames(&mut self, frames: &[UnwoundFrame]) -> Vec<Arc<SymbolizedFrame>> {
        // Kernel frames the cache lacks are looked up together (see `KernelSymbols::lookup_all`).
        // Each missing address with the index's start of its symbol.
        let mut kernel_misses: Vec<(u64, Option<u64>)> = Vec::new();
        let mut symbolized: Vec<Option<Arc<SymbolizedFrame>>> = frames
            .iter()
            .map(|frame| match frame {
                UnwoundFrame::Kernel(addr) => match self.known_kernel_frame(*addr) {
                    Ok(known) => Some(known),
                    Err(index_start) => {
                        if !kernel_misses.iter().any(|(missing, _)| missing == addr) {
                            kernel_misses.push((*addr, index_start));
                        }
                        None
                    }
                },
                frame => Some(self.symbolize(frame)),
            })
            .collect();
        if kernel_misses.is_empty() {
            return all_symbolized(symbolized);
        }
        let addrs: Vec<u64> = kernel_misses.iter().map(|&(addr, _)| addr).collect();
        let lookups = self.kernel.lookup_all(&self.resolver, &addrs);
        let looked_up: Vec<_> = kernel_misses
            .into_iter()
            .zip(lookups)
            .map(|((addr, index_start), lookup)| {
                let frame = self.kernel_frame(addr, lookup, index_start);
                (addr, self.remember(FrameKey::Kernel(addr), frame))
            })
            .collect();
        // Every empty slot is a kernel frame just looked up.
        for (slot, frame) in symbolized.iter_mut().zip(frames) {
            if let (None, UnwoundFrame::Kernel(addr)) = (&slot, frame) {
                *slot = looked_up
                    .iter()
                    .find(|(looked_up, _)| looked_up == addr)
                    .map(|(_, frame)| Arc::clone(frame));
            }
        }
        all_symbolized(symbolized)
    }

    /// Symbolizes one frame; a repeated key returns the same `Arc` (until the cache is reset).
    pub fn symbolize(&mut self, frame: &UnwoundFrame) -> Arc<SymbolizedFrame> {
        match frame {
            UnwoundFrame::Kernel(addr) => match self.known_kernel_frame(*addr) {
                Ok(known) => known,
                Err(index_start) => {
                    let lookup = self.kernel.lookup(&self.resolver, *addr);
                    let frame = self.kernel_frame(*addr, lookup, index_start);
                    self.remember(FrameKey::Kernel(*addr), frame)
                }
            },
            UnwoundFrame::User {
                addr,
                file,
                file_offset,
                mapping_start,
                mapping_end,
                mapping_offset,
            } => {
                let key = FrameKey::User {
                    file: file.id,
                    file_offset: *file_offset,
                };
                if let Some(cached) = self.cached(&key) {
                    return cached;
                }
                let mapping =
                    self.mapping_info(file, *mapping_start, *mapping_end, *mapping_offset);
                if let Some(symbolized) =
                    self.in_remembered_function(*addr, file, *file_offset, &mapping)
                {
                    return self.remember(key, symbolized);
                }
                let started = std::time::Instant::now();
                let cpu_before = crate::model::thread_cpu_time();
                let symbolized = self.symbolize_user(*addr, file, *file_offset, mapping);
                self.stats.native_lookups += 1;
                self.stats.native_lookup_time += started.elapsed();
                self.stats.native_lookup_cpu_time +=
                    crate::model::thread_cpu_time().saturating_sub(cpu_before);
                self.remember(key, symbolized)
            }
            UnwoundFrame::Python { frame, runtime } => {
                let Some(runtime) = runtime.get::<PythonRuntime>() else {
                    // Only the Python runtime makes Python frames.
                    self.stats.misses += 1;
                    return Arc::new(python::unknown_python_frame(frame));
                };
                let key = FrameKey::Python {
                    pid: runtime.pid,
                    code_addr: frame.code_addr,
                    fingerprint: frame.fingerprint,
                    instruction: frame.instruction,
                };
                if let Some(cached) = self.cached(&key) {
                    return cached;
                }
                match python::symbolize_python(
                    &mut self.python_code,
                    &mut self.strings,
                    runtime,
                    frame,
                ) {
                    Some(symbolized) => {
                        self.stats.frames_symbolized += 1;
                        self.remember(key, symbolized)
                    }
                    // Not cached: the process may have been between two states of the object.
                    None => {
                        self.stats.misses += 1;
                        Arc::new(python::unknown_python_frame(frame))
                    }
                }
            }
            UnwoundFrame::UserUnmapped { addr, name } => {
                // Not cached: the address is all there is, and the frame is cheap to build.
                self.stats.misses += 1;
                let function = match name.as_deref() {
                    None | Some("") => Arc::clone(&self.unknown_name),
                    // Executable memory without a file: JIT-compiled code (oneDNN's kernels,
                    // V8, the JVM), which has no symbols and no unwind tables.
                    Some(ANONYMOUS_NAME) => self.strings.intern(ANONYMOUS_CODE_FRAME),
                    Some(name) => self.strings.intern(name),
                };
                Arc::new(SymbolizedFrame {
                    kind: FrameKind::Native,
                    address: *addr,
                    mapping: None,
                    lines: vec![FrameLine {
                        function,
                        system_name: None,
                        file: None,
                        line: 0,
                    }],
                    unsymbolized: true,
                })
            }
        }
    }

    fn cached(&mut self, key: &FrameKey) -> Option<Arc<SymbolizedFrame>> {
        let cached = self.frames.get(key);
        if cached.is_some() {
            self.stats.cache_hits += 1;
        }
        cached
    }

    fn remember(&mut self, key: FrameKey, frame: SymbolizedFrame) -> Arc<SymbolizedFrame> {
        let frame = Arc::new(frame);
        self.frames.insert(key, Arc::clone(&frame));
        frame
    }

    /// Drops what was read from a process that exited or exec'ed.
    pub fn forget_process(&mut self, pid: Pid) {
        self.python_code.forget_process(pid);
    }

    /// Gives back the pages of the files blazesym maps to read symbol names (a large C++
    /// library's string table is tens of MiB, all of it resident after a while; blazesym maps
    /// files shared, `r--s`). Called by [`Self::release_file_pages_when_grown`]; returns the
    /// bytes of the mappings advised.
    ///
    /// The symbolizer's own mappings (blazesym's, told apart when made, and the function
    /// indexes') get `MADV_DONTNEED`: their pages leave the RSS and stay in the page cache, so
    /// the next lookups map them again without reading the disk. That advice zeroes whatever
    /// private memory is at the range by then, so it is only given to a range that stays the
    /// same mapping: only this symbolizer, on this thread, unmaps them (dropping a resolver or
    /// an index, which forgets its range first), and the range must still be that file's
    /// mapping in /proc/self/maps. Any other read-only mapping of a large file gets
    /// `MADV_PAGEOUT`, safe whatever is mapped there by the time of the advice (another thread
    /// may unmap it meanwhile and the range be reused for fresh heap memory), but which also
    /// drops the pages from the page cache: a lookup then waits for the disk, one page a fault
    /// (0.5 to 7 ms a lookup on the host suite, where these faults were 6.6 % of the agent's
    /// CPU). Files the agent runs (its binary, its libraries) or writes (the store) are left
    /// alone.
    pub fn release_file_pages(&mut self) -> u64 {
        self.release_file_pages_beyond(None)
    }

    /// [`Self::release_file_pages`], but with `in_use_since`, the symbolizer's mappings of
    /// files looked up since then are given back only when the file-backed RSS is still
    /// [`FILE_PAGES_IN_USE_BYTES`] above the floor after the others went. Notes the release
    /// and the file-backed RSS it left.
    fn release_file_pages_beyond(&mut self, in_use_since: Option<std::time::Instant>) -> u64 {
        self.file_pages.releases += 1;
        let (released, resident) = self.advise_file_mappings(in_use_since);
        self.file_pages.released_at = std::time::Instant::now();
        if let Some(resident) = resident {
            self.file_pages.resident_after_release = resident;
        }
        released
    }

    /// Advises the large read-only file mappings of [`Self::release_file_pages_beyond`];
    /// returns the bytes advised and the file-backed RSS after (`None`: not readable).
    fn advise_file_mappings(
        &mut self,
        in_use_since: Option<std::time::Instant>,
    ) -> (u64, Option<u64>) {
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
            return (0, resident_file_bytes());
        };
        let entries: Vec<_> = maps
            .lines()
            .filter_map(crate::process::maps::parse_maps_line)
            .collect();
        let kept: HashSet<(Option<u64>, u64)> = entries
            .iter()
            .filter(|entry| entry.perms.contains(['w', 'x']))
            .map(|entry| (entry.dev, entry.inode))
            .collect();
        // Each own mapping (start, file mapped) with whether its file was looked up since
        // `in_use_since`.
        let own: HashMap<(u64, FileId), bool> = self
            .files
            .iter()
            .flat_map(|(id, state)| {
                let in_use = in_use_since.is_some_and(|since| state.used_at >= since);
                let index = state
                    .functions
                    .as_ref()
                    .and_then(Option::as_ref)
                    .map(|index| ((index.mapped_start(), *id), in_use));
                let blazesym = state
                    .own_mappings
                    .iter()
                    .map(move |&(file, start)| ((start, file), in_use));
                blazesym.chain(index)
            })
            .collect();
        let mut released = 0;
        let mut in_use = Vec::new();
        for entry in &entries {
            let length = entry.end - entry.start;
            if !entry.perms.starts_with("r--")
                || length < (256 << 10)
                || entry.inode == 0
                || !entry.pathname.starts_with('/')
                || kept.contains(&(entry.dev, entry.inode))
            {
                continue;
            }
            let own_mapping = entry.dev.and_then(|dev| {
                own.get(&(
                    entry.start,
                    FileId {
                        dev,
                        ino: entry.inode,
                    },
                ))
            });
            if own_mapping == Some(&true) {
                in_use.push((entry.start, length));
                continue;
            }
            released += self.advise_file_pages(entry.start, length, own_mapping.is_some());
        }
        let mut resident = resident_file_bytes();
        let full = self.file_pages.resident_after_full_release + FILE_PAGES_IN_USE_BYTES;
        if !in_use.is_empty() && resident.is_none_or(|resident| resident >= full) {
            for (start, length) in in_use.drain(..) {
                released += self.advise_file_pages(start, length, true);
            }
            resident = resident_file_bytes();
        }
        if in_use.is_empty()
            && let Some(resident) = resident
        {
            // Every file's pages went: the floor.
            self.file_pages.resident_after_full_release = resident;
        }
        (released, resident)
    }

    /// Gives back the pages of one read-only file mapping (see [`Self::release_file_pages`]
    /// for `ours`); returns `length` when the advice was taken.
    fn advise_file_pages(&mut self, start: u64, length: u64, ours: bool) -> u64 {
        // Read back one page at a time: a lookup touches a few scattered pages of the symbol
        // and string tables (a binary search), and the readahead of each fault on them read
        // tens of pages (6.7 % of the agent's CPU on the host suite), which grew the
        // file-backed RSS back towards the next release.
        // SAFETY: an access-pattern hint changes no memory contents, whatever is mapped there
        // by now.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                length as usize,
                libc::MADV_RANDOM,
            )
        };
        let advice = if ours {
            self.stats.own_mapping_releases += 1;
            libc::MADV_DONTNEED
        } else {
            libc::MADV_PAGEOUT
        };
        // SAFETY: page-out changes no memory contents, whatever is mapped there by now;
        // `MADV_DONTNEED` is only given to the symbolizer's own read-only file mappings, which
        // stay mapped until this symbolizer drops them (see `release_file_pages`).
        if unsafe { libc::madvise(start as *mut libc::c_void, length as usize, advice) } == 0 {
            length
        } else {
            0
        }
    }

    /// Drops the parsed tables of the least recently used files until their estimated cost is
    /// within `max_resolver_bytes` (`keep`, just used, stays).
    fn bound_resolvers(&mut self, keep: FileId) {
        while self.resolver_bytes > self.options.max_resolver_bytes {
            let Some((&id, _)) = self
                .files
                .iter()
                .filter(|(id, state)| **id != keep && state.resolver.is_some())
                .min_by_key(|(_, state)| state.used)
            else {
                break;
            };
            self.drop_resolver(id);
            self.stats.resolvers_dropped += 1;
        }
    }

    /// Drops the parsed tables of files not looked up for [`SymbolizerOptions::resolver_idle`].
    pub fn drop_idle_resolvers(&mut self) {
        let idle = self.options.resolver_idle;
        let ids: Vec<FileId> = self
            .files
            .iter()
            .filter(|(_, state)| state.resolver.is_some() && state.used_at.elapsed() >= idle)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.drop_resolver(id);
            self.stats.resolvers_dropped += 1;
        }
    }

    /// Drops one file's parsed tables (and its function index); the file stays known.
    fn drop_resolver(&mut self, id: FileId) {
        if let Some(state) = self.files.get_mut(&id) {
            if state.resolver.take().is_some() {
                self.resolver_bytes = self.resolver_bytes.saturating_sub(state.cost);
            }
            state.own_mappings.clear();
            if let Some(Some(index)) = state.functions.take() {
                self.function_ranges -= index.remembered_len();
                self.resolver_bytes = self
                    .resolver_bytes
                    .saturating_sub(index.heap_bytes() as u64);
            }
        }
    }

    /// Forgets the least recently used file altogether (over `max_files`).
    fn forget_least_recent_file(&mut self) {
        let Some((&id, _)) = self.files.iter().min_by_key(|(_, state)| state.used) else {
            return;
        };
        self.drop_resolver(id);
        self.files.remove(&id);
    }

    /// The function (FDE) that holds `file_offset` of a file whose symbols do not name it, as
    /// virtual addresses; the file's index is mapped at its first such address and let go of
    /// with its resolver.
    fn function_of(&mut self, file: &MappedFile, file_offset: u64) -> Option<Range<u64>> {
        let vaddr = self
            .files
            .get(&file.id)?
            .layout
            .as_ref()?
            .file_offset_to_vaddr(file_offset)?;
        self.function_index(file)?.function_of(vaddr)
    }

    /// The function index of a known `file`, opened (mapped) at its first use.
    fn function_index(&mut self, file: &MappedFile) -> Option<&mut functions::FunctionIndex> {
        let state = self.files.get_mut(&file.id)?;
        if state.functions.is_none() {
            // Functions are remembered only where the binary's own symbols are all a lookup
            // reads (`functions` checks that they are `.dynsym` alone).
            let symbols_only_in_binary = matches!(state.source, native::SymbolSource::Binary)
                && state
                    .layout
                    .as_ref()
                    .is_some_and(|layout| !layout.has_dwarf);
            let index =
                functions::FunctionIndex::open(&file.readable_path(), symbols_only_in_binary);
            if let Some(index) = &index {
                self.resolver_bytes += index.heap_bytes() as u64;
            }
            state.functions = Some(index);
        }
        state.functions.as_mut()?.as_mut()
    }

    /// Remembers `function` of `file` with what its address got where every address of it
    /// gets the same (`FunctionIndex::remember`), within [`MAX_FUNCTION_RANGES`] over all
    /// files.
    fn remember_function(
        &mut self,
        file: &MappedFile,
        function: Range<u64>,
        named_by: NamedBy,
        remembered: RememberedFunction,
    ) {
        if !self.remember_functions {
            return;
        }
        if self.function_ranges >= MAX_FUNCTION_RANGES {
            for state in self.files.values_mut() {
                if let Some(Some(index)) = &mut state.functions {
                    index.forget_remembered();
                }
            }
            self.function_ranges = 0;
            self.stats.function_ranges_cleared += 1;
        }
        // A file whose every frame so far had a symbol has no index yet: none is mapped for
        // its symbols alone (libraries named by their symbols stay as they were).
        let index = match named_by {
            NamedBy::FunctionStart => self.function_index(file),
            NamedBy::Symbol => self
                .files
                .get_mut(&file.id)
                .and_then(|state| state.functions.as_mut()?.as_mut()),
        };
        let Some(index) = index else {
            return;
        };
        let before = index.remembered_len();
        index.remember(function, named_by, Arc::new(remembered));
        let after = index.remembered_len();
        self.function_ranges = self.function_ranges - before + after;
    }

    /// The frame of an address in a remembered function of `file`: what a lookup would make
    /// of it, without the lookup.
    fn in_remembered_function(
        &mut self,
        addr: u64,
        file: &MappedFile,
        file_offset: u64,
        mapping: &Arc<MappingInfo>,
    ) -> Option<SymbolizedFrame> {
        if self.function_ranges == 0 {
            return None;
        }
        let state = self.files.get_mut(&file.id)?;
        let vaddr = state.layout.as_ref()?.file_offset_to_vaddr(file_offset)?;
        let remembered = Arc::clone(state.functions.as_ref()?.as_ref()?.remembered(vaddr)?);
        self.tick += 1;
        state.used = self.tick;
        state.used_at = std::time::Instant::now();
        if remembered.unsymbolized {
            self.stats.misses += 1;
            self.stats.named_by_function_start += 1;
        } else {
            self.stats.frames_symbolized += 1;
        }
        self.stats.function_range_hits += 1;
        Some(SymbolizedFrame {
            kind: FrameKind::Native,
            address: addr,
            mapping: Some(Arc::clone(mapping)),
            lines: remembered.lines.clone(),
            unsymbolized: remembered.unsymbolized,
        })
    }

    fn mapping_info(
        &mut self,
        file: &MappedFile,
        start: u64,
        limit: u64,
        file_offset: u64,
    ) -> Arc<MappingInfo> {
        let key = (file.id, start);
        if let Some(mapping) = self.mappings.get(&key) {
            return mapping;
        }
        let mapping = Arc::new(MappingInfo {
            start,
            limit,
            file_offset,
            filename: Arc::clone(&file.path),
            build_id: file.build_id.clone(),
        });
        self.mappings.insert(key, Arc::clone(&mapping));
        mapping
    }

    fn symbolize_user(
        &mut self,
        addr: u64,
        file: &MappedFile,
        file_offset: u64,
        mapping: Arc<MappingInfo>,
    ) -> SymbolizedFrame {
        if !self.files.contains_key(&file.id) && self.files.len() >= self.options.max_files {
            self.forget_least_recent_file();
        }
        self.tick += 1;
        let state = self.files.entry(file.id).or_insert_with(|| {
            native::FileState::new(file, &self.options.debug_dirs, self.options.source_lines)
        });
        state.used = self.tick;
        state.used_at = std::time::Instant::now();
        let had_resolver = state.resolver.is_some();
        // A new resolver maps the file (or its debug file) on this lookup: the one mapping of
        // each that appears meanwhile is blazesym's, as long as no other thread maps it
        // meanwhile (the table builder maps the same files, under the same lock).
        let before = (!had_resolver && !state.failed).then(|| {
            let watched = state.mapped_files(file.id);
            let guard = crate::process::files::lock_file_mappings();
            let before = own_mappings_of(&watched);
            (guard, watched, before)
        });
        let started = std::time::Instant::now();
        let mut ctx = native::LookupContext {
            strings: &mut self.strings,
            function_names: &mut self.function_names,
            debug_dirs: &self.options.debug_dirs,
            inline_frames: self.options.inline_frames,
            demangle: self.options.demangle,
            debug_info: self.options.source_lines,
        };
        let lookup = native::lookup_user(&mut ctx, state, file, file_offset);
        if let Some((guard, watched, Some(before))) = before
            && state.resolver.is_some()
            && !matches!(lookup, native::UserLookup::Failed)
        {
            let after = own_mappings_of(&watched).unwrap_or_default();
            drop(guard);
            state.own_mappings = watched
                .iter()
                .filter_map(|&id| {
                    let mut new = after
                        .iter()
                        .filter(|mapping| mapping.0 == id && !before.contains(mapping));
                    match (new.next(), new.next()) {
                        (Some(&(_, start, _)), None) => Some((id, start)),
                        _ => None,
                    }
                })
                .collect();
        }
        if !had_resolver && state.resolver.is_some() {
            let cost = state.cost;
            self.resolver_bytes += cost;
            self.bound_resolvers(file.id);
            if cost >= LARGE_RESOLVER_BYTES {
                // A large symbol table was just read through its file mapping: its pages go
                // back now, not at the next check, so they do not add up with whatever else is
                // resident at the time (the same library's unwind table being built).
                self.release_file_pages();
            }
            self.stats.file_loads += 1;
            self.stats.file_load_time += started.elapsed();
        }
        let not_found = matches!(lookup, native::UserLookup::NotFound);
        let (lines, symbol) = match lookup {
            native::UserLookup::Found(lines, symbol) if !lines.is_empty() => (Some(lines), symbol),
            native::UserLookup::Found(..) | native::UserLookup::NotFound => (None, None),
            native::UserLookup::Failed => {
                self.stats.errors += 1;
                (None, None)
            }
        };
        if let Some(lines) = lines {
            self.stats.frames_symbolized += 1;
            if let Some(symbol) = symbol {
                let remembered = RememberedFunction {
                    lines: lines.clone(),
                    unsymbolized: false,
                };
                self.remember_function(file, symbol, NamedBy::Symbol, remembered);
            }
            return SymbolizedFrame {
                kind: FrameKind::Native,
                address: addr,
                mapping: Some(mapping),
                lines,
                unsymbolized: false,
            };
        }
        self.stats.misses += 1;
        let basename = file.path.rsplit('/').next().unwrap_or(&file.path);
        let searched = std::time::Instant::now();
        let function = self.function_of(file, file_offset);
        self.stats.function_start_time += searched.elapsed();
        let name: Arc<str> = match &function {
            Some(function) => {
                self.stats.named_by_function_start += 1;
                Arc::from(format!("{basename}!sub_{:x}", function.start))
            }
            None => Arc::from(format!("{basename}+0x{file_offset:x}")),
        };
        let frame = SymbolizedFrame {
            kind: FrameKind::Native,
            address: addr,
            mapping: Some(mapping),
            lines: vec![FrameLine {
                function: name,
                system_name: None,
                file: Some(Arc::clone(&file.path)),
                line: 0,
            }],
            unsymbolized: true,
        };
        // Only after a lookup that found no symbol: a failed one says nothing of the others.
        if let Some(function) = function
            && not_found
        {
            let remembered = RememberedFunction {
                lines: frame.lines.clone(),
                unsymbolized: true,
            };
            self.remember_function(file, function, NamedBy::FunctionStart, remembered);
        }
        frame
    }

    /// The frame of kernel address `addr` from the frame cache or a remembered function
    /// (then cached); otherwise (`Err`) what [`Self::in_remembered_kernel_function`] says for
    /// the lookup.
    fn known_kernel_frame(&mut self, addr: u64) -> Result<Arc<SymbolizedFrame>, Option<u64>> {
        let key = FrameKey::Kernel(addr);
        if let Some(cached) = self.cached(&key) {
            return Ok(cached);
        }
        let symbolized = self.in_remembered_kernel_function(addr)?;
        Ok(self.remember(key, symbolized))
    }

    /// `addr` named by the kernel function it is in when that function was looked up before
    /// at another address (a sampled kernel instruction is seldom at an address seen before,
    /// and blazesym checks its kallsyms file at every call: an open and a `stat` of a
    /// /proc/self/fd link, 3 % of the agent's CPU on the host suite). An address at a symbol's
    /// very start is left to blazesym, which picks among the symbols that start there.
    /// Otherwise (`Err`) the start of `addr`'s symbol in the index, if any, for
    /// [`Self::kernel_frame`] to remember the function by.
    fn in_remembered_kernel_function(&mut self, addr: u64) -> Result<SymbolizedFrame, Option<u64>> {
        let Some(start) = self.kernel.symbol_start(addr) else {
            return Err(None);
        };
        if start == addr {
            return Err(Some(start));
        }
        let Some(line) = self.kernel_functions.get(&start) else {
            return Err(Some(start));
        };
        self.stats.frames_symbolized += 1;
        self.stats.kernel_function_hits += 1;
        Ok(SymbolizedFrame {
            kind: FrameKind::Kernel,
            address: addr,
            mapping: None,
            lines: vec![line],
            unsymbolized: false,
        })
    }

    /// The frame blazesym's `lookup` of `addr` gives; its function is remembered where
    /// `index_start`, the index's start of `addr`'s symbol, is blazesym's too.
    fn kernel_frame(
        &mut self,
        addr: u64,
        lookup: kernel::KernelLookup,
        index_start: Option<u64>,
    ) -> SymbolizedFrame {
        let (line, unsymbolized) = match lookup {
            kernel::KernelLookup::Found(symbol) => {
                self.stats.frames_symbolized += 1;
                let line = FrameLine {
                    function: self.strings.intern(&symbol.name),
                    system_name: None,
                    file: Some(symbol.module),
                    line: 0,
                };
                // Remembered only where this index and blazesym agree on the symbol's start.
                if symbol.start < addr && index_start == Some(symbol.start) {
                    self.kernel_functions.insert(symbol.start, line.clone());
                }
                (line, false)
            }
            lookup @ (kernel::KernelLookup::NotFound | kernel::KernelLookup::Failed) => {
                if matches!(lookup, kernel::KernelLookup::Failed) {
                    self.stats.errors += 1;
                }
                self.stats.misses += 1;
                let line = FrameLine {
                    function: Arc::clone(&self.unknown_kernel_name),
                    system_name: None,
                    file: None,
                    line: 0,
                };
                (line, true)
            }
        };
        SymbolizedFrame {
            kind: FrameKind::Kernel,
            address: addr,
            mapping: None,
            lines: vec![line],
            unsymbolized,
        }
    }
}

/// What every address of a remembered function is named (see `FunctionIndex::remember`).
#[derive(Debug)]
pub(crate) struct RememberedFunction {
    lines: Vec<FrameLine>,
    unsymbolized: bool,
}

pub(crate) use functions::NamedBy;

fn build_resolver(options: &SymbolizerOptions) -> bz::Symbolizer {
    bz::Symbolizer::builder()
        // Demangling is ours, so the raw name stays available as `system_name`.
        .enable_demangling(false)
        .enable_code_info(options.source_lines)
        .enable_inlined_fns(options.source_lines && options.inline_frames)
        .set_debug_dirs(Some(&options.debug_dirs))
        .build()
}
