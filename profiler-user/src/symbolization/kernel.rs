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
        self as bz, Input, Symbolized,
        source::{Kernel, Source},
    },
};
use tracing::{debug, warn};

/// The module address ranges, from the lowest to the highest symbol address of each module.
#[derive(Debug, Default)]
pub(super) struct ModuleIndex {
    ranges: Vec<ModuleRange>,
}

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
        for line in reader.lines() {
            let line = line?;
            let mut tokens = line.split_ascii_whitespace();
            let (Some(addr), Some(_kind), Some(_name), Some(module)) =
                (tokens.next(), tokens.next(), tokens.next(), tokens.next())
            else {
                continue;
            };
            let Ok(addr) = u64::from_str_radix(addr, 16) else {
                continue;
            };
            if addr == 0 || !module.starts_with('[') {
                continue;
            }
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
        Ok(Self { ranges })
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

    /// Reads kallsyms once into a memfd, indexing modules on the way.
    fn snapshot_path(&mut self) -> PathBuf {
        if self.snapshot.is_none() {
            match snapshot_kallsyms(&self.kallsyms) {
                Ok((file, path, modules)) => {
                    self.snapshot = Some((file, path));
                    self.modules = Some(modules);
                }
                Err(err) => debug!(error = %err, "cannot snapshot kallsyms; reading it directly"),
            }
        }
        match &self.snapshot {
            Some((_, path)) => path.clone(),
            None => self.kallsyms.clone(),
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
        let kallsyms = self.snapshot_path();
        let source = Source::Kernel(Kernel {
            kallsyms: MaybeDefault::Some(kallsyms),
            // kallsyms has every symbol, including modules; vmlinux discovery would only add
            // disk probing and the risk of a mismatched image.
            vmlinux: MaybeDefault::None,
            debug_syms: false,
            ..Kernel::default()
        });
        match resolver.symbolize_single(&source, Input::AbsAddr(addr)) {
            Ok(Symbolized::Sym(sym)) => {
                let core_kernel = self.core_kernel.clone();
                let module = self
                    .module_index()
                    .module_of(sym.addr)
                    .cloned()
                    .unwrap_or(core_kernel);
                KernelLookup::Found(KernelSymbol {
                    name: sym.name.into_owned(),
                    module,
                })
            }
            Ok(Symbolized::Unknown(_)) => KernelLookup::NotFound,
            Err(err) => {
                if self.warned {
                    debug!(error = %err, "kernel symbolization failed");
                } else {
                    self.warned = true;
                    warn!(kallsyms = %self.kallsyms.display(), error = %err, "kernel symbolization failed; kernel frames stay unsymbolized (further errors logged at debug level)");
                }
                KernelLookup::Failed
            }
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
}
