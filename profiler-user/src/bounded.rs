//! A bounded cache for hot paths: two generations of a hash map.
//!
//! New entries go into the current generation; when it is full it becomes the previous one and
//! the old previous one is dropped. A hit in the previous generation moves the entry back into
//! the current one, so whatever was used within the last generation survives a turn and only
//! entries unused for a whole generation go. Compared with a least-recently-used list this costs
//! one hash lookup per hit and nothing per use, which matters where every frame of every sample
//! is looked up. The cache holds at most `capacity` entries (two generations of half of it).
use std::{borrow::Borrow, hash::Hash};

use foldhash::{HashMap, HashMapExt};

#[derive(Debug)]
pub struct TwoGenerationCache<K, V> {
    current: HashMap<K, V>,
    previous: HashMap<K, V>,
    generation: usize,
    evicted: u64,
}

impl<K: Hash + Eq, V: Clone> TwoGenerationCache<K, V> {
    /// At most `capacity` entries (at least two: one a generation).
    pub fn new(capacity: usize) -> Self {
        Self {
            current: HashMap::new(),
            previous: HashMap::new(),
            generation: (capacity / 2).max(1),
            evicted: 0,
        }
    }

    /// The value of `key`, kept for another generation.
    pub fn get<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some(value) = self.current.get(key) {
            return Some(value.clone());
        }
        let (key, value) = self.previous.remove_entry(key)?;
        self.insert(key, value.clone());
        Some(value)
    }

    /// Inserts (or replaces) `key`; a full generation first turns over. True when it did
    /// (entries unused for a generation are gone).
    pub fn insert(&mut self, key: K, value: V) -> bool {
        let turned_over = self.current.len() >= self.generation && !self.current.contains_key(&key);
        if turned_over {
            self.turn_over();
        }
        self.current.insert(key, value);
        turned_over
    }

    /// Keeps only the entries for which `keep` is true (not counted as evicted).
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        self.current.retain(|key, value| keep(key, value));
        self.previous.retain(|key, value| keep(key, value));
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.current.keys().chain(self.previous.keys())
    }

    /// The current generation becomes the previous one; the previous one's entries go.
    fn turn_over(&mut self) {
        self.evicted += self.previous.len() as u64;
        // The dropped generation's table is reused (same capacity) instead of growing a new one.
        let mut recycled = std::mem::take(&mut self.previous);
        recycled.clear();
        self.previous = std::mem::replace(&mut self.current, recycled);
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
    fn replacing_a_key_does_not_turn_a_generation_over() {
        let mut cache = TwoGenerationCache::new(2);
        cache.insert("a", 1);
        cache.insert("a", 2);
        assert_eq!(cache.evicted(), 0);
        assert_eq!(cache.get("a"), Some(2));
        assert_eq!(cache.len(), 1);
    }
}
