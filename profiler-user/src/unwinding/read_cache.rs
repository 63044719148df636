//! The late unwinder's reads of the placed unwind tables, kept in memory.
//!
//! A late walk reads, for every frame, a page entry and one or two row chunks back from the BPF
//! maps: each a `bpf()` syscall, a chunk 2 KiB copied out of the kernel. On a busy host most
//! late walks run in the same few libraries (libc, ld.so, the shell), so the same entries are
//! read hundreds of times a second. Every write goes through this wrapper, which drops the
//! entry it replaces first, so a cached read is always what BPF itself would read now.
use std::{cell::RefCell, rc::Rc};

// Looked up for every frame of every late walk: a fast hash.
use foldhash::HashMap;

use profiler_common::unwind::{MappingKey, MappingValue, PageEntry, PageKey, RowChunk};

use crate::bpf::{BpfError, UnwindMaps};

/// Row chunks kept (2 KiB each: 1 MiB in all).
pub const MAX_CACHED_CHUNKS: usize = 512;
/// Page entries kept, present or absent (a few bytes each).
pub const MAX_CACHED_PAGES: usize = 16_384;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadCacheStats {
    pub entries: u64,
    pub hits: u64,
    pub misses: u64,
}

#[derive(Default)]
struct Cached {
    pages: HashMap<PageKey, Option<PageEntry>>,
    chunks: HashMap<u32, Rc<RowChunk>>,
    hits: u64,
    misses: u64,
}

/// `M` with its table reads cached; writes pass through and invalidate.
pub struct CachedReads<M> {
    inner: M,
    cached: RefCell<Cached>,
}

impl<M: UnwindMaps> CachedReads<M> {
    pub fn new(inner: M) -> Self {
        Self {
            inner,
            cached: RefCell::default(),
        }
    }

    pub fn inner(&self) -> &M {
        &self.inner
    }

    pub fn stats(&self) -> ReadCacheStats {
        let cached = self.cached.borrow();
        ReadCacheStats {
            entries: (cached.pages.len() + cached.chunks.len()) as u64,
            hits: cached.hits,
            misses: cached.misses,
        }
    }
}

impl<M: UnwindMaps> UnwindMaps for CachedReads<M> {
    fn row_chunk_capacity(&self) -> u32 {
        self.inner.row_chunk_capacity()
    }

    fn write_row_chunk(&mut self, index: u32, chunk: &RowChunk) -> Result<(), BpfError> {
        // Dropped before the write: a failed write may have changed part of the chunk.
        self.cached.get_mut().chunks.remove(&index);
        self.inner.write_row_chunk(index, chunk)
    }

    fn insert_page(&mut self, key: PageKey, entry: PageEntry) -> Result<(), BpfError> {
        self.cached.get_mut().pages.remove(&key);
        self.inner.insert_page(key, entry)
    }

    fn remove_page(&mut self, key: PageKey) -> Result<(), BpfError> {
        self.cached.get_mut().pages.remove(&key);
        self.inner.remove_page(key)
    }

    fn insert_mapping(
        &mut self,
        prefix_len: u32,
        key: MappingKey,
        value: MappingValue,
    ) -> Result<(), BpfError> {
        self.inner.insert_mapping(prefix_len, key, value)
    }

    fn remove_mapping(&mut self, prefix_len: u32, key: MappingKey) -> Result<(), BpfError> {
        self.inner.remove_mapping(prefix_len, key)
    }

    fn insert_mappings(
        &mut self,
        entries: &[(u32, MappingKey, MappingValue)],
    ) -> Vec<(usize, BpfError)> {
        self.inner.insert_mappings(entries)
    }

    fn remove_mappings(&mut self, entries: &[(u32, MappingKey)]) {
        self.inner.remove_mappings(entries)
    }

    fn read_page(&self, key: PageKey) -> Result<Option<PageEntry>, BpfError> {
        if let Some(entry) = self.cached.borrow_mut().hit_page(&key) {
            return Ok(entry);
        }
        // Errors are not kept: the next read asks the kernel again.
        let entry = self.inner.read_page(key)?;
        let mut cached = self.cached.borrow_mut();
        cached.misses += 1;
        if cached.pages.len() >= MAX_CACHED_PAGES {
            cached.pages.clear();
        }
        cached.pages.insert(key, entry);
        Ok(entry)
    }

    fn read_row_chunk(&self, index: u32) -> Result<RowChunk, BpfError> {
        Ok(*self.shared_row_chunk(index)?)
    }
}

impl<M: UnwindMaps> CachedReads<M> {
    /// Chunk `index` of the row array, shared with the cache rather than copied (a binary
    /// search over a page's rows reads one or two chunks: copying 2 KiB out of the cache each
    /// time was 1.8 % of the agent's CPU on the host suite).
    pub fn shared_row_chunk(&self, index: u32) -> Result<Rc<RowChunk>, BpfError> {
        let mut cached = self.cached.borrow_mut();
        if let Some(chunk) = cached.chunks.get(&index) {
            let chunk = Rc::clone(chunk);
            cached.hits += 1;
            return Ok(chunk);
        }
        let chunk = Rc::new(self.inner.read_row_chunk(index)?);
        cached.misses += 1;
        if cached.chunks.len() >= MAX_CACHED_CHUNKS {
            cached.chunks.clear();
        }
        cached.chunks.insert(index, Rc::clone(&chunk));
        Ok(chunk)
    }
}

impl Cached {
    fn hit_page(&mut self, key: &PageKey) -> Option<Option<PageEntry>> {
        let entry = *self.pages.get(key)?;
        self.hits += 1;
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::unwind::{ROWS_PER_CHUNK, UnwindRow};
    use std::cell::Cell;

    /// Maps in memory that count the reads reaching them.
    #[derive(Default)]
    struct Counted {
        pages: HashMap<PageKey, PageEntry>,
        chunks: HashMap<u32, RowChunk>,
        reads: Cell<u32>,
    }

    impl UnwindMaps for Counted {
        fn row_chunk_capacity(&self) -> u32 {
            4
        }
        fn write_row_chunk(&mut self, index: u32, chunk: &RowChunk) -> Result<(), BpfError> {
            self.chunks.insert(index, *chunk);
            Ok(())
        }
        fn insert_page(&mut self, key: PageKey, entry: PageEntry) -> Result<(), BpfError> {
            self.pages.insert(key, entry);
            Ok(())
        }
        fn remove_page(&mut self, key: PageKey) -> Result<(), BpfError> {
            self.pages.remove(&key);
            Ok(())
        }
        fn insert_mapping(
            &mut self,
            _: u32,
            _: MappingKey,
            _: MappingValue,
        ) -> Result<(), BpfError> {
            Ok(())
        }
        fn remove_mapping(&mut self, _: u32, _: MappingKey) -> Result<(), BpfError> {
            Ok(())
        }
        fn read_page(&self, key: PageKey) -> Result<Option<PageEntry>, BpfError> {
            self.reads.set(self.reads.get() + 1);
            Ok(self.pages.get(&key).copied())
        }
        fn read_row_chunk(&self, index: u32) -> Result<RowChunk, BpfError> {
            self.reads.set(self.reads.get() + 1);
            Ok(self.chunks.get(&index).copied().unwrap_or(RowChunk {
                rows: [UnwindRow::default(); ROWS_PER_CHUNK],
            }))
        }
    }

    fn chunk_of(pc: u16) -> RowChunk {
        let mut chunk = RowChunk {
            rows: [UnwindRow::default(); ROWS_PER_CHUNK],
        };
        chunk.rows[0].pc_low = pc;
        chunk
    }

    #[test]
    fn repeated_reads_stay_in_memory_and_writes_are_seen_at_once() {
        let mut maps = CachedReads::new(Counted::default());
        let key = PageKey {
            table_id: 1,
            page: 7,
        };
        maps.write_row_chunk(2, &chunk_of(10)).unwrap();
        assert_eq!(maps.read_page(key).unwrap(), None);
        for _ in 0..5 {
            assert_eq!(maps.read_row_chunk(2).unwrap().rows[0].pc_low, 10);
            assert_eq!(maps.read_page(key).unwrap(), None);
        }
        assert_eq!(maps.inner().reads.get(), 2, "one kernel read per entry");
        assert_eq!(maps.stats().hits, 9, "the first read of each was a miss");

        // A chunk reused by another table and a page placed: the next reads see them.
        maps.write_row_chunk(2, &chunk_of(20)).unwrap();
        let entry = PageEntry {
            first_row: 3,
            row_count: 4,
        };
        maps.insert_page(key, entry).unwrap();
        assert_eq!(maps.read_row_chunk(2).unwrap().rows[0].pc_low, 20);
        assert_eq!(maps.read_page(key).unwrap(), Some(entry));
        maps.remove_page(key).unwrap();
        assert_eq!(maps.read_page(key).unwrap(), None);
        assert_eq!(maps.inner().reads.get(), 5);
    }

    #[test]
    fn a_shared_chunk_is_read_once_and_a_write_is_seen() {
        let mut maps = CachedReads::new(Counted::default());
        maps.write_row_chunk(3, &chunk_of(10)).unwrap();
        let first = maps.shared_row_chunk(3).unwrap();
        let second = maps.shared_row_chunk(3).unwrap();
        assert!(Rc::ptr_eq(&first, &second), "the cached chunk, not a copy");
        assert_eq!(maps.inner().reads.get(), 1, "one kernel read for the chunk");
        maps.write_row_chunk(3, &chunk_of(20)).unwrap();
        assert_eq!(maps.shared_row_chunk(3).unwrap().rows[0].pc_low, 20);
        // A chunk handed out keeps what it held when read.
        assert_eq!(first.rows[0].pc_low, 10);
        assert_eq!(maps.inner().reads.get(), 2);
    }

    #[test]
    fn the_cache_stays_within_its_bound() {
        let maps = CachedReads::new(Counted::default());
        for index in 0..(MAX_CACHED_CHUNKS as u32 * 3) {
            maps.read_row_chunk(index).unwrap();
        }
        for page in 0..(MAX_CACHED_PAGES as u32 * 2 + 5) {
            maps.read_page(PageKey { table_id: 1, page }).unwrap();
        }
        let stats = maps.stats();
        assert!(stats.entries as usize <= MAX_CACHED_CHUNKS + MAX_CACHED_PAGES);
        assert_eq!(stats.hits, 0);
    }
}
