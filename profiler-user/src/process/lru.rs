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

    /// A new capacity; the least recently used entries beyond it go now (and are returned).
    pub(crate) fn set_capacity(&mut self, capacity: usize) -> Vec<(K, V)> {
        self.capacity = capacity.max(1);
        let mut evicted = Vec::new();
        while self.entries.len() > self.capacity {
            let Some(oldest) = self.entries.pop_front() else {
                break;
            };
            evicted.push(oldest);
        }
        evicted
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

    /// Inserts (or replaces) a value as most recently used; returns the entry evicted to stay
    /// within capacity (at most one: the capacity holds between inserts). Without a vector
    /// for it: full caches evict at nearly every insert, hundreds a second on a busy host.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<(K, V)> {
        self.entries.insert(key, value);
        if self.entries.len() > self.capacity {
            self.entries.pop_front()
        } else {
            None
        }
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
        assert!(lru.insert(1, "a").is_none());
        assert!(lru.insert(2, "b").is_none());
        assert!(lru.get_mut(&1).is_some());
        let evicted = lru.insert(3, "c");
        assert_eq!(evicted, Some((2, "b")));
        assert_eq!(lru.len(), 2);
        assert!(lru.get_mut(&2).is_none());
        lru.retain(|k, _| *k != 1);
        assert_eq!(lru.len(), 1);
        assert_eq!(lru.remove(&3), Some("c"));
        assert_eq!(lru.len(), 0);
    }

    #[test]
    fn a_smaller_capacity_evicts_the_least_recently_used_at_once() {
        let mut lru = Lru::new(4);
        for key in 0..4 {
            lru.insert(key, key * 10);
        }
        assert!(lru.get_mut(&0).is_some());
        assert_eq!(lru.set_capacity(2), vec![(1, 10), (2, 20)]);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.insert(4, 40), Some((3, 30)));
        assert!(lru.contains_key(&0) && lru.contains_key(&4));
    }
}
