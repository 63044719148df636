//! Kernel symbolization: blazesym's kallsyms source for names, plus a small index of kernel
//! module address ranges (blazesym does not report which module a kallsyms symbol belongs to).
use std::{
    collections::HashMap,
    fs::File,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    sync::Arc,
};

use blazesym::{
    MaybeDefault,
    symbolize::{
        self as bz, Input, Reason, Symbolized,
        source::{Kernel, Source},
    },
};
use tracing::{debug, warn};

/// The module address ranges, from the lowest to the highest symbol address of each module,
/// and where every symbol starts.
#[derive(Debug, Default)]
pub(super) struct ModuleIndex {
    ranges: Vec<ModuleRange>,
    /// Every distinct symbol address in the top 2 GiB (x86-64's kernel text, modules and BPF
    /// programs), as offsets from [`KERNEL_TEXT_BASE`], ascending: blazesym keeps every kallsyms
    /// line with a nonzero address, so none of its symbols starts between two neighbours here.
    symbol_starts: Vec<u32>,
}

/// Where the kernel's code addresses start on x86-64 (the top 2 GiB): offsets from it fit in 32
/// bits, half the memory of the addresses (120,000 symbols).
const KERNEL_TEXT_BASE: u64 = 0xffff_ffff_8000_0000;

#[derive(Debug)]
struct ModuleRange {
    first_symbol: u64,
    last_symbol: u64,
    name: Arc<str>,
}

impl ModuleIndex {
    pub(super) fn load(kallsyms: &Path) -> std::io::Result<Self> {
        let reader = BufReader::new(File::open(kallsyms)?);
        Self::parse(reader)
    }

    pub(super) fn parse(reader: impl BufRead) -> std::io::Result<Self> {
        let mut bounds: HashMap<String, (u64, u64)> = HashMap::new();
        let mut symbol_starts = Vec::new();
        for line in reader.lines() {
            let line = line?;
            let mut tokens = line.split_ascii_whitespace();
            let (Some(addr), Some(_kind), Some(_name)) =
                (tokens.next(), tokens.next(), tokens.next())
            else {
                continue;
            };
            let Ok(addr) = u64::from_str_radix(addr, 16) else {
                continue;
            };
            if addr == 0 {
                continue;
            }
            if let Some(offset) = addr.checked_sub(KERNEL_TEXT_BASE) {
                symbol_starts.push(offset as u32);
            }
            let Some(module) = tokens.next().filter(|module| module.starts_with('[')) else {
                continue;
            };
            let entry = bounds.entry(module.to_owned()).or_insert((addr, addr));
            entry.0 = entry.0.min(addr);
            entry.1 = entry.1.max(addr);
        }
        let mut ranges: Vec<ModuleRange> = bounds
            .into_iter()
            .map(|(name, (first_symbol, last_symbol))| ModuleRange {
                first_symbol,
                last_symbol,
                name: name.into(),
            })
            .collect();
        ranges.sort_by_key(|range| range.first_symbol);
        symbol_starts.sort_unstable();
        symbol_starts.dedup();
        Ok(Self {
            ranges,
            symbol_starts,
        })
    }

    /// The start of the last symbol at or below `addr`; `None` below the kernel's code or
    /// when no symbol there starts at or below it.
    fn symbol_start(&self, addr: u64) -> Option<u64> {
        // Every offset fits: the base is 2 GiB below the top of the address space.
        let offset = addr.checked_sub(KERNEL_TEXT_BASE)? as u32;
        let idx = self.symbol_starts.partition_point(|&start| start <= offset);
        let start = *self.symbol_starts.get(idx.checked_sub(1)?)?;
        Some(KERNEL_TEXT_BASE + u64::from(start))
    }

    /// The module (`[name]`) whose symbols include the one starting at `symbol_addr`.
    fn module_of(&self, symbol_addr: u64) -> Option<&Arc<str>> {
        let idx = self
            .ranges
            .partition_point(|range| range.first_symbol <= symbol_addr);
        let range = self.ranges.get(idx.checked_sub(1)?)?;
        (symbol_addr <= range.last_symbol).then_some(&range.name)
    }
}

/// Kernel symbol lookups.
#[derive(Debug)]
pub(super) struct KernelSymbols {
    kallsyms: PathBuf,
    /// An in-memory copy of `kallsyms` taken at first use, and the path blazesym reads it by.
    /// /proc/kallsyms is expensive to read (the kernel formats every symbol each time), so it is
    /// read once for both blazesym and the module index.
    snapshot: Option<(File, PathBuf)>,
    modules: Option<ModuleIndex>,
    /// The pseudo file name of core kernel symbols (as perf names it).
    core_kernel: Arc<str>,
    warned: bool,
}

/// A resolved kernel symbol.
pub(super) struct KernelSymbol {
    /// Where the symbol starts.
    pub(super) start: u64,
    pub(super) name: String,
    /// `[module]` for module symbols, `[kernel.kallsyms]` for the core kernel.
    pub(super) module: Arc<str>,
}

pub(super) enum KernelLookup {
    Found(KernelSymbol),
    NotFound,
    Failed,
}

impl KernelSymbols {
    pub(super) fn new(kallsyms: PathBuf) -> Self {
        Self {
            kallsyms,
            snapshot: None,
            modules: None,
            core_kernel: Arc::from("[kernel.kallsyms]"),
            warned: false,
        }
    }

    /// The start of the last kernel symbol at or below `addr` in the kallsyms text blazesym
    /// reads: addresses above it and below the next start are that symbol's, whichever
    /// blazesym would name them by.
    ///
    /// `None` without a snapshot: blazesym then reads kallsyms itself, which may have changed
    /// since this index read it.
    pub(super) fn symbol_start(&mut self, addr: u64) -> Option<u64> {
        self.take_snapshot();
        self.snapshot.as_ref()?;
        self.modules.as_ref()?.symbol_start(addr)
    }

    fn snapshot_path(&mut self) -> PathBuf {
        self.take_snapshot();
        match &self.snapshot {
            Some((_, path)) => path.clone(),
            None => self.kallsyms.clone(),
        }
    }

    /// Reads kallsyms once into a memfd, indexing modules on the way.
    fn take_snapshot(&mut self) {
        if self.snapshot.is_none() {
            match snapshot_kallsyms(&self.kallsyms) {
                Ok((file, path, modules)) => {
                    self.snapshot = Some((file, path));
                    self.modules = Some(modules);
                }
                Err(err) => debug!(error = %err, "cannot snapshot kallsyms; reading it directly"),
            }
        }
    }

    /// Makes blazesym parse the snapshot (its first lookup does) and builds the module index.
    pub(super) fn load(&mut self, resolver: &bz::Symbolizer) {
        // Any address does: the lookup parses the whole file before it searches.
        let _ = self.lookup(resolver, u64::MAX);
        self.module_index();
    }

    fn module_index(&mut self) -> &ModuleIndex {
        self.modules.get_or_insert_with(|| {
            ModuleIndex::load(&self.kallsyms).unwrap_or_else(|err| {
                debug!(error = %err, "cannot index kernel modules");
                ModuleIndex::default()
            })
        })
    }

    pub(super) fn lookup(&mut self, resolver: &bz::Symbolizer, addr: u64) -> KernelLookup {
        self.lookup_all(resolver, &[addr])
            .pop()
            .unwrap_or(KernelLookup::Failed)
    }

    /// Looks up `addrs` in one call, one result each in their order: blazesym checks the
    /// kallsyms file and its cache entry once a call (a `stat` and an open). A stack seldom
    /// has more than one kernel address to look up, so this saves little on real stacks; the
    /// functions remembered by their start (the symbolizer's) are what spare most calls.
    pub(super) fn lookup_all(
        &mut self,
        resolver: &bz::Symbolizer,
        addrs: &[u64],
    ) -> Vec<KernelLookup> {
        let kallsyms = self.snapshot_path();
        let source = Source::Kernel(Kernel {
            kallsyms: MaybeDefault::Some(kallsyms),
            // kallsyms has every symbol, including modules; vmlinux discovery would only add
            // disk probing and the risk of a mismatched image.
            vmlinux: MaybeDefault::None,
            debug_syms: false,
            ..Kernel::default()
        });
        let symbolized = match resolver.symbolize(&source, Input::AbsAddr(addrs)) {
            Ok(symbolized) => symbolized,
            Err(err) => {
                self.warn_failure(&err);
                return addrs.iter().map(|_| KernelLookup::Failed).collect();
            }
        };
        let core_kernel = self.core_kernel.clone();
        let modules = self.module_index();
        symbolized
            .into_iter()
            .map(|symbolized| match symbolized {
                Symbolized::Sym(sym) => KernelLookup::Found(KernelSymbol {
                    start: sym.addr,
                    module: modules
                        .module_of(sym.addr)
                        .cloned()
                        .unwrap_or_else(|| core_kernel.clone()),
                    name: sym.name.into_owned(),
                }),
                // An address's own error (the call as a whole worked).
                Symbolized::Unknown(Reason::IgnoredError) => KernelLookup::Failed,
                Symbolized::Unknown(_) => KernelLookup::NotFound,
            })
            .collect()
    }

    fn warn_failure(&mut self, err: &blazesym::Error) {
        if self.warned {
            debug!(error = %err, "kernel symbolization failed");
        } else {
            self.warned = true;
            warn!(kallsyms = %self.kallsyms.display(), error = %err, "kernel symbolization failed; kernel frames stay unsymbolized (further errors logged at debug level)");
        }
    }
}

fn snapshot_kallsyms(kallsyms: &Path) -> std::io::Result<(File, PathBuf, ModuleIndex)> {
    use std::io::{Read, Seek, Write};
    let mut text = Vec::new();
    File::open(kallsyms)?.read_to_end(&mut text)?;
    let modules = ModuleIndex::parse(&text[..])?;
    // SAFETY: memfd_create with a NUL-terminated name; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"profiler-kallsyms".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let mut file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.write_all(&text)?;
    file.rewind()?;
    let path = PathBuf::from(format!("/proc/self/fd/{fd}"));
    Ok((file, path, modules))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn module_index_finds_module_of_symbol() -> Result<(), Box<dyn std::error::Error>> {
        let mut kallsyms = tempfile::NamedTempFile::new()?;
        writeln!(kallsyms, "ffffffff81000000 T _text")?;
        writeln!(kallsyms, "ffffffff81001000 T do_syscall_64")?;
        writeln!(kallsyms, "ffffffffc0100000 t kvm_fn_a\t[kvm]")?;
        writeln!(kallsyms, "ffffffffc0100800 t kvm_fn_b\t[kvm]")?;
        writeln!(kallsyms, "ffffffffc0200000 t ext4_fn\t[ext4]")?;
        kallsyms.flush()?;
        let index = ModuleIndex::load(kallsyms.path())?;
        assert_eq!(index.module_of(0xffffffff81001000), None);
        assert_eq!(
            index.module_of(0xffffffffc0100800).map(|m| &**m),
            Some("[kvm]")
        );
        assert_eq!(
            index.module_of(0xffffffffc0200000).map(|m| &**m),
            Some("[ext4]")
        );
        assert_eq!(index.module_of(0xffffffffc0150000), None);
        Ok(())
    }

    #[test]
    fn symbol_starts_bound_each_symbol() -> Result<(), Box<dyn std::error::Error>> {
        let text = "0000000000000000 A fixed_percpu_data\n\
                    000000000001f000 A per_cpu_var\n\
                    ffffffff81000000 T _text\n\
                    ffffffff81000000 T startup_64\n\
                    ffffffff81001000 T do_syscall_64\n\
                    ffffffffc0100000 t kvm_fn_a\t[kvm]\n\
                    garbage line\n";
        let index = ModuleIndex::parse(text.as_bytes())?;
        assert_eq!(
            index.symbol_start(0xffffffff81000fff),
            Some(0xffffffff81000000)
        );
        assert_eq!(
            index.symbol_start(0xffffffff81001000),
            Some(0xffffffff81001000)
        );
        assert_eq!(
            index.symbol_start(0xffffffffc00fffff),
            Some(0xffffffff81001000)
        );
        assert_eq!(index.symbol_start(u64::MAX), Some(0xffffffffc0100000));
        // Below the first symbol of the kernel's code, and outside it.
        assert_eq!(index.symbol_start(0xffffffff80ffffff), None);
        assert_eq!(index.symbol_start(0x1f008), None);
        Ok(())
    }
}
