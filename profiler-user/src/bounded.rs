//! A bounded cache for hot paths: two generations of a hash map.
//!
//! New entries go into the current generation; when it is full it becomes the previous one and
//! the old previous one is dropped. A hit in the previous generation moves the entry back into
//! the current one, so whatever was used within the last generation survives a turn and only
//! entries unused for a whole generation go. Compared with a least-recently-used list this costs
//! one hash lookup per hit and nothing per use, which matters where every frame of every sample
//! is looked up. The cache holds at most `capacity` entries (two generations of half of it).
//!
//! Each generation is a `hashbrown::HashTable` so an operation hashes its key once: a hit in the
//! previous generation moves the entry, and an insert checks both generations, which cost three
//! to five hashes of the key as maps (an exec's environment is a key of up to 4 KiB).
use std::{
    borrow::Borrow,
    hash::{BuildHasher, Hash},
};

use foldhash::fast::RandomState;
use hashbrown::HashTable;

#[derive(Debug)]
pub struct TwoGenerationCache<K, V> {
    current: HashTable<(K, V)>,
    previous: HashTable<(K, V)>,
    hasher: RandomState,
    generation: usize,
    evicted: u64,
}

/// Matches an entry by its key.
fn same_key<'k, K: Borrow<Q>, V, Q: Eq + ?Sized>(key: &'k Q) -> impl Fn(&(K, V)) -> bool + 'k {
    move |(other, _)| other.borrow() == key
}

impl<K: Hash + Eq, V: Clone> TwoGenerationCache<K, V> {
    /// The value of `key`, kept for another generation.
    pub fn get<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        if let Some((_, value)) = self.current.find(hash, same_key(key)) {
            return Some(value.clone());
        }
        let Ok(entry) = self.previous.find_entry(hash, same_key(key)) else {
            return None;
        };
        let ((key, value), _) = entry.remove();
        let kept = value.clone();
        self.insert_new(hash, key, value, |_, _| {});
        Some(kept)
    }
}

impl<K: Hash + Eq, V> TwoGenerationCache<K, V> {
    /// At most `capacity` entries (at least two: one a generation).
    pub fn new(capacity: usize) -> Self {
        Self {
            current: HashTable::new(),
            previous: HashTable::new(),
            hasher: RandomState::default(),
            generation: (capacity / 2).max(1),
            evicted: 0,
        }
    }

    /// Inserts (or replaces) `key`; a full generation first turns over. True when it did
    /// (entries unused for a generation are gone).
    pub fn insert(&mut self, key: K, value: V) -> bool {
        self.insert_evicting(key, value, |_, _| {})
    }

    /// [`Self::insert`], handing each entry that goes with a turn-over to `evicted`.
    pub fn insert_evicting(&mut self, key: K, value: V, evicted: impl FnMut(K, V)) -> bool {
        let hash = self.hasher.hash_one(&key);
        if let Ok(mut entry) = self.current.find_entry(hash, same_key(&key)) {
            entry.get_mut().1 = value;
            return false;
        }
        // A key is in one generation only: a stale value behind would come back once the new
        // one is removed.
        if let Ok(entry) = self.previous.find_entry(hash, same_key(&key)) {
            entry.remove();
        }
        self.insert_new(hash, key, value, evicted)
    }

    /// Inserts `key`, in neither generation, into the current one; true when it turned over.
    fn insert_new(&mut self, hash: u64, key: K, value: V, evicted: impl FnMut(K, V)) -> bool {
        let turned_over = turn_over_when_full(
            &mut self.current,
            &mut self.previous,
            self.generation,
            &mut self.evicted,
            evicted,
        );
        let hasher = &self.hasher;
        self.current
            .insert_unique(hash, (key, value), |(key, _)| hasher.hash_one(key));
        turned_over
    }

    /// The value of `key` to change in place, kept for another generation.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.get_mut_evicting(key, |_, _| {})
    }

    /// [`Self::get_mut`], handing each entry that goes with a turn-over (a hit in the previous
    /// generation moves into a full current one) to `evicted`.
    pub fn get_mut_evicting<Q>(&mut self, key: &Q, evicted: impl FnMut(K, V)) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Self {
            current,
            previous,
            hasher,
            generation,
            evicted: evicted_count,
        } = self;
        let hash = hasher.hash_one(key);
        // The table comes back from a miss, so a hit can return its borrow.
        let current = match current.find_entry(hash, same_key(key)) {
            Ok(entry) => return Some(&mut entry.into_mut().1),
            Err(absent) => absent.into_table(),
        };
        let Ok(entry) = previous.find_entry(hash, same_key(key)) else {
            return None;
        };
        let (moved, _) = entry.remove();
        turn_over_when_full(current, previous, *generation, evicted_count, evicted);
        let entry = current.insert_unique(hash, moved, |(key, _)| hasher.hash_one(key));
        Some(&mut entry.into_mut().1)
    }

    /// The value of `key` to change in place, its generation unchanged.
    pub fn peek_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        if let Some((_, value)) = self.current.find_mut(hash, same_key(key)) {
            return Some(value);
        }
        self.previous
            .find_mut(hash, same_key(key))
            .map(|(_, value)| value)
    }

    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        // In one generation at most (see `insert_evicting`).
        let entry = match self.current.find_entry(hash, same_key(key)) {
            Ok(entry) => entry,
            Err(_) => self.previous.find_entry(hash, same_key(key)).ok()?,
        };
        let ((_, value), _) = entry.remove();
        Some(value)
    }

    /// Keeps only the entries for which `keep` is true (not counted as evicted).
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        self.current.retain(|(key, value)| keep(key, value));
        self.previous.retain(|(key, value)| keep(key, value));
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.current
            .iter()
            .chain(self.previous.iter())
            .map(|(key, _)| key)
    }

    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries dropped with a generation so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

/// When the current generation holds `generation` entries, it becomes the previous one and the
/// previous one's entries go, each through `evicted`; true when it did. (A free function: the
/// caller may hold a borrow of another field.)
fn turn_over_when_full<K, V>(
    current: &mut HashTable<(K, V)>,
    previous: &mut HashTable<(K, V)>,
    generation: usize,
    evicted_count: &mut u64,
    mut evicted: impl FnMut(K, V),
) -> bool {
    if current.len() < generation {
        return false;
    }
    *evicted_count += previous.len() as u64;
    // The dropped generation's table is reused (same capacity) instead of growing a new one.
    let mut recycled = std::mem::take(previous);
    for (key, value) in recycled.drain() {
        evicted(key, value);
    }
    *previous = std::mem::replace(current, recycled);
    true
}

/// Values parsed from inputs that repeat byte for byte, kept by the input: an exec event's
/// environment (hundreds of execs a second on a busy host come from the same few parents), a
/// process's /proc/PID/cgroup (most processes share a few). A hit costs a hash and a compare of
/// the input instead of its parse, and can never be another input's value. Inputs longer than
/// [`MAX_PARSE_INPUT_BYTES`] are parsed every time, so the memory is bounded by the count.
#[derive(Debug)]
pub struct ParseMemo<V> {
    parsed: TwoGenerationCache<Box<[u8]>, V>,
    hits: u64,
}

/// The longest input a [`ParseMemo`] keeps (an exec event holds at most 4 KiB of environment).
pub const MAX_PARSE_INPUT_BYTES: usize = 4096;

impl<V: Clone> ParseMemo<V> {
    /// At most `capacity` inputs, in two generations.
    pub fn new(capacity: usize) -> Self {
        Self {
            parsed: TwoGenerationCache::new(capacity),
            hits: 0,
        }
    }

    /// `parse(input)`, from the memo when `input` was parsed lately.
    pub fn get_or_parse(&mut self, input: &[u8], parse: impl FnOnce(&[u8]) -> V) -> V {
        if input.len() > MAX_PARSE_INPUT_BYTES {
            return parse(input);
        }
        if let Some(value) = self.parsed.get(input) {
            self.hits += 1;
            return value;
        }
        let value = parse(input);
        self.parsed.insert(input.into(), value.clone());
        value
    }

    /// Inputs kept.
    pub fn len(&self) -> usize {
        self.parsed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parsed.is_empty()
    }

    /// Values that came from the memo without a parse.
    pub fn hits(&self) -> u64 {
        self.hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_at_most_its_capacity_and_keeps_what_is_used() {
        let mut cache = TwoGenerationCache::new(4);
        for key in 0..2 {
            cache.insert(key, key * 10);
        }
        // A full generation: 2 starts the next one, 0 and 1 are the previous one.
        cache.insert(2, 20);
        assert_eq!(cache.get(&0), Some(0), "a hit in the previous generation");
        // 1 was not used for a whole generation: gone with the next turn; 0 was moved forward.
        cache.insert(3, 30);
        assert_eq!(cache.get(&1), None);
        assert_eq!(cache.evicted(), 1);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(&0), Some(0));
        assert_eq!(cache.get(&2), Some(20));
        for key in 100..1_000 {
            cache.insert(key, key);
            assert!(cache.len() <= 4, "{} entries", cache.len());
        }
        assert_eq!(cache.get(&999), Some(999));
        cache.retain(|_, _| false);
        assert!(cache.is_empty());
    }

    #[test]
    fn changes_in_place_keep_each_key_in_one_generation_and_report_evictions() {
        let mut cache = TwoGenerationCache::new(4);
        let mut evicted = Vec::new();
        for key in 0..3 {
            cache.insert_evicting(key, vec![key], |key, value| evicted.push((key, value)));
        }
        // 0 and 1 are the previous generation, 2 the current one.
        cache.peek_mut(&1).unwrap().push(10);
        cache.get_mut(&0).unwrap().push(100);
        // Both generations full: 0 moved forward; 1 was only peeked at and goes next.
        assert!(cache.insert_evicting(3, vec![3], |key, value| evicted.push((key, value))));
        assert_eq!(evicted, vec![(1, vec![1, 10])]);
        assert_eq!(cache.get_mut(&0), Some(&mut vec![0, 100]));
        assert_eq!(cache.get_mut(&1), None);
        // A key replaced while in the previous generation is gone for good once removed.
        let mut cache = TwoGenerationCache::new(4);
        for key in 0..3 {
            cache.insert(key, key);
        }
        cache.insert(0, 50);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.remove(&0), Some(50));
        assert_eq!(cache.peek_mut(&0), None);
        assert_eq!(cache.get_mut(&0), None);
        // A hit in the previous generation moving into a full current one turns it over.
        let mut cache = TwoGenerationCache::new(4);
        for key in 0..4 {
            cache.insert(key, key);
        }
        let mut gone = Vec::new();
        assert_eq!(
            cache.get_mut_evicting(&0, |key, _| gone.push(key)),
            Some(&mut 0)
        );
        assert_eq!((gone, cache.len()), (vec![1], 3));
    }

    #[test]
    fn replacing_a_key_does_not_turn_a_generation_over() {
        let mut cache = TwoGenerationCache::new(2);
        cache.insert("a", 1);
        cache.insert("a", 2);
        assert_eq!(cache.evicted(), 0);
        assert_eq!(cache.get("a"), Some(2));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_parse_is_reused_only_for_the_same_bytes_within_the_bound() {
        let mut memo = ParseMemo::new(4);
        let parses = std::cell::Cell::new(0);
        let parse = |input: &[u8]| {
            parses.set(parses.get() + 1);
            String::from_utf8_lossy(input).to_uppercase()
        };
        assert_eq!(memo.get_or_parse(b"service=a", parse), "SERVICE=A");
        assert_eq!(memo.get_or_parse(b"service=a", parse), "SERVICE=A");
        // One byte off, or one longer: parsed, never the kept value.
        assert_eq!(memo.get_or_parse(b"service=b", parse), "SERVICE=B");
        assert_eq!(memo.get_or_parse(b"service=a\0", parse), "SERVICE=A\0");
        assert_eq!((memo.hits(), parses.get()), (1, 3));
        for n in 0..100 {
            let input = format!("n={n}");
            assert_eq!(
                memo.get_or_parse(input.as_bytes(), parse),
                input.to_uppercase()
            );
            assert!(memo.len() <= 4, "{} kept", memo.len());
        }
        // Too long to keep: parsed every time, nothing kept.
        let long = vec![b'x'; MAX_PARSE_INPUT_BYTES + 1];
        let kept = memo.len();
        memo.get_or_parse(&long, parse);
        memo.get_or_parse(&long, parse);
        assert_eq!((memo.len(), memo.hits(), parses.get()), (kept, 1, 105));
    }
}
