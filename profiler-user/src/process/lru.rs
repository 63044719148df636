//! A small least-recently-used map over hashlink's linked hash map (already in the tree through
//! rusqlite): lookup, reordering and eviction of the oldest entry are all O(1), without the
//! allocation per use that an ordered index of use ticks costs.
use std::hash::Hash;

// Looked up for every sample (process snapshots, open files): a fast hash.
use foldhash::fast::RandomState;
use hashlink::LinkedHashMap;

#[derive(Debug)]
pub(crate) struct Lru<K, V> {
    /// Least recently used first.
    entries: LinkedHashMap<K, V, RandomState>,
    capacity: usize,
}

impl<K: Hash + Eq, V> Lru<K, V> {
    /// `capacity` is clamped to at least one entry.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: LinkedHashMap::with_hasher(RandomState::default()),
            capacity: capacity.max(1),
        }
    }

    /// A new capacity; entries beyond it go at the next insert.
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether `key` is held (its use order unchanged).
    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Returns the value and marks it most recently used.
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.to_back(key)
    }

    /// The value, its use order unchanged.
    pub(crate) fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key)
    }

    /// The least recently used entry.
    pub(crate) fn oldest(&self) -> Option<(&K, &V)> {
        self.entries.front()
    }

    /// Removes the least recently used entry.
    pub(crate) fn pop_oldest(&mut self) -> Option<(K, V)> {
        self.entries.pop_front()
    }

    /// Inserts (or replaces) a value as most recently used; returns the entries evicted to stay
    /// within capacity.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Vec<(K, V)> {
        self.entries.insert(key, value);
        let mut evicted = Vec::new();
        while self.entries.len() > self.capacity {
            let Some(oldest) = self.entries.pop_front() else {
                break;
            };
            evicted.push(oldest);
        }
        evicted
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        self.entries.remove(key)
    }

    /// Keeps only the entries for which `keep` returns true, without touching use order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        self.entries.retain(|key, value| keep(key, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut lru = Lru::new(2);
        assert!(lru.insert(1, "a").is_empty());
        assert!(lru.insert(2, "b").is_empty());
        assert!(lru.get_mut(&1).is_some());
        let evicted = lru.insert(3, "c");
        assert_eq!(evicted, vec![(2, "b")]);
        assert_eq!(lru.len(), 2);
        assert!(lru.get_mut(&2).is_none());
        lru.retain(|k, _| *k != 1);
        assert_eq!(lru.len(), 1);
        assert_eq!(lru.remove(&3), Some("c"));
        assert_eq!(lru.len(), 0);
    }
}
