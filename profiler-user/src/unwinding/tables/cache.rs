//! Built tables on disk, keyed by build id (files without one are not cached).
//!
//! File format (little-endian), version 2:
//! `magic "PFUNWTAB"` · `version u32` · `reserved u32 (0)` · 13 × `u64` stats ·
//! `row count u64` · rows (`address u64, cfa_kind u8, rbp_kind u8, cfa_offset i16,
//! rbp_offset i16, 2 zero bytes`) · `FNV-1a 64 checksum u64` of everything before it.
//!
//! Entries are written to a temporary file and renamed, so a reader sees a whole file or none.
//! A file that fails any check (size, magic, version, checksum, table invariants) is deleted and
//! treated as missing: the table is simply rebuilt.

use std::fs;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    CallSiteCheck, CfiSource, MAX_ROWS, MappedInput, Rule, TableError, TableRow, TableStats,
    UnwindTable,
};

const MAGIC: [u8; 8] = *b"PFUNWTAB";
const FORMAT_VERSION: u32 = 6;
const STATS_FIELDS: usize = 16;
const HEADER_BYTES: usize = 8 + 4 + 4 + STATS_FIELDS * 8 + 8;
const ROW_BYTES: usize = 16;
const CHECKSUM_BYTES: usize = 8;
/// How much of an entry is read between two releases of its pages.
const RELEASE_EVERY_BYTES: usize = 4 << 20;
const MAX_FILE_BYTES: u64 = (HEADER_BYTES + MAX_ROWS * ROW_BYTES + CHECKSUM_BYTES) as u64;
const FILE_EXTENSION: &str = "unwt";

/// Longest build id accepted as a key (GNU build ids are 20 bytes, 40 hex digits).
const MAX_BUILD_ID_LEN: usize = 128;

/// Distinguishes temporary files of concurrent stores in one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("build id {0:?} is not a hex string of at most {MAX_BUILD_ID_LEN} digits")]
    InvalidBuildId(String),
    #[error("cannot write the cache entry {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// A directory of cached tables.
#[derive(Clone, Debug)]
pub struct TableCache {
    dir: PathBuf,
}

impl TableCache {
    /// The directory is created by the first [`store`](Self::store).
    pub fn new(dir: impl Into<PathBuf>) -> TableCache {
        TableCache { dir: dir.into() }
    }

    /// Where the entry for `build_id` lives; `None` for ids that are not plain hex.
    pub fn entry_path(&self, build_id: &str) -> Option<PathBuf> {
        is_valid_build_id(build_id).then(|| self.dir.join(format!("{build_id}.{FILE_EXTENSION}")))
    }

    /// The cached table, if a valid entry exists; an invalid entry is deleted.
    pub fn load(&self, build_id: &str) -> Option<UnwindTable> {
        let path = self.entry_path(build_id)?;
        let size = fs::metadata(&path).ok()?.len();
        let decoded = if size > MAX_FILE_BYTES {
            Err(TableError::InvalidRows("cache file too large"))
        } else {
            // Mapped, not read into memory: a large library's entry is tens of MiB (42 MiB for
            // libtorch_cpu). The pages read are let go of as the decode goes, so the entry
            // never sits in the agent's RSS all at once.
            let mapped = fs::File::open(&path).and_then(|file| {
                // SAFETY: a private read-only mapping; a file truncated under it would fault,
                // which entries renamed into place complete are not.
                unsafe { memmap2::Mmap::map(&file) }
            });
            match mapped {
                Ok(bytes) => {
                    // SAFETY: a read-only file mapping, alive for the whole decode.
                    let input = unsafe { MappedInput::new(&bytes) };
                    decode(&bytes, &|| input.release())
                }
                Err(error) => {
                    tracing::debug!(path = %path.display(), %error, "unreadable unwind-table cache entry");
                    return None;
                }
            }
        };
        match decoded {
            Ok(table) => Some(table),
            Err(error) => {
                tracing::debug!(path = %path.display(), %error, "discarding unwind-table cache entry");
                let _ = fs::remove_file(&path);
                None
            }
        }
    }

    pub fn store(&self, build_id: &str, table: &UnwindTable) -> Result<(), CacheError> {
        let path = self
            .entry_path(build_id)
            .ok_or_else(|| CacheError::InvalidBuildId(build_id.to_owned()))?;
        let temp = self.dir.join(format!(
            ".{build_id}.{}.{}.tmp",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let write = || -> io::Result<()> {
            fs::create_dir_all(&self.dir)?;
            let mut file = io::BufWriter::new(fs::File::create(&temp)?);
            encode(table, &mut file)?;
            let file = file.into_inner().map_err(io::IntoInnerError::into_error)?;
            file.sync_all()?;
            fs::rename(&temp, &path)
        };
        write().map_err(|source| {
            let _ = fs::remove_file(&temp);
            CacheError::Write {
                path: path.clone(),
                source,
            }
        })
    }
}

fn is_valid_build_id(build_id: &str) -> bool {
    !build_id.is_empty()
        && build_id.len() <= MAX_BUILD_ID_LEN
        && build_id.bytes().all(|b| b.is_ascii_hexdigit())
}

fn stats_fields(stats: &TableStats) -> [u64; STATS_FIELDS] {
    [
        match stats.source {
            CfiSource::None => 0,
            CfiSource::EhFrame => 1,
            CfiSource::DebugFrame => 2,
        },
        stats.fdes,
        stats.signal_fdes,
        stats.empty_fdes,
        stats.overlapping_fdes,
        stats.rows_before_merge,
        stats.rows_after_merge,
        stats.plt_rows,
        stats.unsupported_cfa_expressions,
        stats.unsupported_cfa_registers,
        stats.offsets_out_of_range,
        stats.unsupported_rbp_rules,
        stats.call_sites.code_bytes,
        stats.call_sites.call_sites,
        stats.call_sites.first_frame_breaking_call,
        stats.malformed_fdes,
    ]
}

fn stats_from_fields(fields: [u64; STATS_FIELDS]) -> Result<TableStats, TableError> {
    let source = match fields[0] {
        0 => CfiSource::None,
        1 => CfiSource::EhFrame,
        2 => CfiSource::DebugFrame,
        _ => return Err(TableError::InvalidRows("unknown CFI source")),
    };
    Ok(TableStats {
        source,
        fdes: fields[1],
        signal_fdes: fields[2],
        empty_fdes: fields[3],
        overlapping_fdes: fields[4],
        rows_before_merge: fields[5],
        rows_after_merge: fields[6],
        plt_rows: fields[7],
        unsupported_cfa_expressions: fields[8],
        unsupported_cfa_registers: fields[9],
        offsets_out_of_range: fields[10],
        unsupported_rbp_rules: fields[11],
        call_sites: CallSiteCheck {
            code_bytes: fields[12],
            call_sites: fields[13],
            first_frame_breaking_call: fields[14],
        },
        malformed_fdes: fields[15],
        // How the build went, not what the table is: not kept.
        row_bound: 0,
        row_vector_growths: 0,
    })
}

/// Writes the entry to `out` as it goes (a large table is never held twice in memory).
fn encode(table: &UnwindTable, out: &mut impl Write) -> io::Result<()> {
    let mut out = Checksummed {
        out,
        hasher: crc32fast::Hasher::new(),
    };
    out.write_all(&MAGIC)?;
    out.write_all(&FORMAT_VERSION.to_le_bytes())?;
    out.write_all(&0u32.to_le_bytes())?;
    for field in stats_fields(table.stats()) {
        out.write_all(&field.to_le_bytes())?;
    }
    out.write_all(&(table.row_count() as u64).to_le_bytes())?;
    for row in table.paged().table_rows() {
        let mut bytes = [0u8; ROW_BYTES];
        bytes[..8].copy_from_slice(&row.address.to_le_bytes());
        bytes[8] = row.rule.cfa_kind;
        bytes[9] = row.rule.rbp_kind;
        bytes[10..12].copy_from_slice(&row.rule.cfa_offset.to_le_bytes());
        bytes[12..14].copy_from_slice(&row.rule.rbp_offset.to_le_bytes());
        out.write_all(&bytes)?;
    }
    let checksum = u64::from(out.hasher.clone().finalize());
    out.out.write_all(&checksum.to_le_bytes())
}

/// A writer that checksums what goes through it.
struct Checksummed<'a, W: Write> {
    out: &'a mut W,
    hasher: crc32fast::Hasher,
}

impl<W: Write> Write for Checksummed<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let written = self.out.write(bytes)?;
        self.hasher.update(&bytes[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// Reads little-endian fields from a byte slice, failing instead of panicking at the end.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], TableError> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(TableError::InvalidRows("cache file truncated"))?;
        self.0 = rest;
        Ok(*head)
    }

    fn u64(&mut self) -> Result<u64, TableError> {
        self.take().map(u64::from_le_bytes)
    }
}

/// Decodes an entry; `release` is called after every few MiB read (the input's pages may go).
pub(super) fn decode(bytes: &[u8], release: &dyn Fn()) -> Result<UnwindTable, TableError> {
    let (content, checksum) = bytes
        .split_last_chunk::<CHECKSUM_BYTES>()
        .ok_or(TableError::InvalidRows("cache file truncated"))?;
    let mut crc = crc32fast::Hasher::new();
    for chunk in content.chunks(RELEASE_EVERY_BYTES) {
        crc.update(chunk);
        release();
    }
    if u64::from(crc.finalize()) != u64::from_le_bytes(*checksum) {
        return Err(TableError::InvalidRows("cache checksum mismatch"));
    }
    let mut fields = Fields(content);
    if fields.take::<8>()? != MAGIC {
        return Err(TableError::InvalidRows("not an unwind-table cache file"));
    }
    if u32::from_le_bytes(fields.take()?) != FORMAT_VERSION {
        return Err(TableError::InvalidRows("unknown cache format version"));
    }
    let _reserved = fields.take::<4>()?;
    let mut stats = [0u64; STATS_FIELDS];
    for field in &mut stats {
        *field = fields.u64()?;
    }
    let stats = stats_from_fields(stats)?;
    let row_count = fields.u64()?;
    let expected_len = usize::try_from(row_count)
        .ok()
        .filter(|&count| count <= MAX_ROWS)
        .map(|count| count * ROW_BYTES);
    if expected_len != Some(fields.0.len()) || stats.rows_after_merge != row_count {
        return Err(TableError::InvalidRows("cache row count does not match"));
    }
    let rows = fields
        .0
        .chunks_exact(ROW_BYTES)
        .enumerate()
        .map(|(index, row)| {
            if index % (RELEASE_EVERY_BYTES / ROW_BYTES) == 0 {
                release();
            }
            let address = u64::from_le_bytes(std::array::from_fn(|index| row[index]));
            let rule = Rule {
                cfa_kind: row[8],
                rbp_kind: row[9],
                cfa_offset: i16::from_le_bytes([row[10], row[11]]),
                rbp_offset: i16::from_le_bytes([row[12], row[13]]),
            };
            TableRow { address, rule }
        });
    UnwindTable::from_rows(rows, stats)
}
