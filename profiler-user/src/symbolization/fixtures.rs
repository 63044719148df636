//! Test fixtures: ELF files built at test time with gcc, g++ and rustc into a temp dir, and
//! helpers to find symbol file offsets and to build the frames the symbolizer consumes.
use std::{
    error::Error,
    fs::File,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
};

use object::{Object, ObjectSegment, ObjectSymbol};

use crate::model::{FileId, MappedFile, UnwoundFrame};

pub(super) type TestResult<T = ()> = Result<T, Box<dyn Error>>;

/// Where fixture frames pretend the file is mapped.
pub(super) const FIXTURE_MAPPING_START: u64 = 0x5555_0000_0000;

/// A temp dir holding built fixtures; deleted on drop.
pub(super) struct FixtureDir {
    dir: tempfile::TempDir,
}

impl FixtureDir {
    pub(super) fn new() -> TestResult<Self> {
        Ok(Self {
            dir: tempfile::tempdir()?,
        })
    }

    pub(super) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes `source` to `source_name` and compiles it with `compiler` into `output_name`.
    pub(super) fn compile(
        &self,
        compiler: &str,
        source_name: &str,
        source: &str,
        output_name: &str,
        args: &[&str],
    ) -> TestResult<PathBuf> {
        let source_path = self.path().join(source_name);
        std::fs::write(&source_path, source)?;
        let output = self.path().join(output_name);
        let mut command = Command::new(compiler);
        command.args(args).arg("-o").arg(&output).arg(&source_path);
        run(&mut command)?;
        Ok(output)
    }

    /// Copies `path` to `name` in the fixture dir.
    pub(super) fn copy(&self, path: &Path, name: &str) -> TestResult<PathBuf> {
        let copy = self.path().join(name);
        std::fs::copy(path, &copy)?;
        Ok(copy)
    }
}

/// Runs `command`, failing with its stderr when it does not succeed.
pub(super) fn run(command: &mut Command) -> TestResult {
    let output = command.output()?;
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(())
}

/// A function symbol of a fixture: where it is in the file and how big.
#[derive(Clone, Debug)]
pub(super) struct FixtureSymbol {
    pub(super) raw_name: String,
    /// The symbol's virtual address in the file.
    pub(super) address: u64,
    pub(super) file_offset: u64,
    pub(super) size: u64,
}

/// Finds the first symbol (`.symtab`, then `.dynsym`) whose raw name satisfies `matches`, and
/// converts its address to a file offset through the containing PT_LOAD segment.
pub(super) fn find_symbol(
    path: &Path,
    matches: impl Fn(&str) -> bool,
) -> TestResult<FixtureSymbol> {
    let data = std::fs::read(path)?;
    let elf = object::File::parse(&*data)?;
    let symbol = elf
        .symbols()
        .chain(elf.dynamic_symbols())
        .find(|symbol| symbol.name().is_ok_and(&matches) && symbol.address() != 0)
        .ok_or_else(|| format!("no matching symbol in {}", path.display()))?;
    let address = symbol.address();
    let file_offset = elf
        .segments()
        .find_map(|segment| {
            let (offset, size) = segment.file_range();
            let delta = address.checked_sub(segment.address())?;
            (delta < size).then_some(offset + delta)
        })
        .ok_or_else(|| format!("symbol address {address:#x} is in no segment"))?;
    Ok(FixtureSymbol {
        raw_name: symbol.name()?.to_owned(),
        address,
        file_offset,
        size: symbol.size(),
    })
}

/// Finds a symbol by exact raw name.
pub(super) fn symbol_named(path: &Path, name: &str) -> TestResult<FixtureSymbol> {
    find_symbol(path, |candidate| candidate == name)
}

/// The lower-case hex GNU build id of `path`.
pub(super) fn read_build_id(path: &Path) -> TestResult<Option<String>> {
    let data = std::fs::read(path)?;
    let elf = object::File::parse(&*data)?;
    Ok(elf.build_id()?.map(super::native::hex))
}

/// Opens `path` the way the process stage would.
pub(super) fn mapped_file(path: &Path) -> TestResult<Arc<MappedFile>> {
    let handle = File::open(path)?;
    let metadata = handle.metadata()?;
    Ok(Arc::new(MappedFile {
        id: FileId {
            dev: metadata.dev(),
            ino: metadata.ino(),
        },
        path: Arc::from(path.to_string_lossy().as_ref()),
        open_path: path.to_path_buf(),
        // Not an ELF file (a malformed-file fixture): no build id, like the process stage.
        build_id: read_build_id(path).ok().flatten().map(Arc::from),
        handle: Some(handle),
    }))
}

/// A user frame at `file_offset` of `file`, mapped at [`FIXTURE_MAPPING_START`] from offset 0.
pub(super) fn user_frame(file: &Arc<MappedFile>, file_offset: u64) -> UnwoundFrame {
    UnwoundFrame::User {
        addr: FIXTURE_MAPPING_START + file_offset,
        file: Arc::clone(file),
        file_offset,
        mapping_start: FIXTURE_MAPPING_START,
        mapping_end: FIXTURE_MAPPING_START + 0x10_0000,
        mapping_offset: 0,
    }
}

/// The 1-based number of the first line of `source` containing `needle`.
pub(super) fn line_of(source: &str, needle: &str) -> TestResult<u32> {
    let index = source
        .lines()
        .position(|line| line.contains(needle))
        .ok_or_else(|| format!("{needle:?} not in source"))?;
    Ok(u32::try_from(index + 1)?)
}
