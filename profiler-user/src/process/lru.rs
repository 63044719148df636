//! A small least-recently-used map: a hash map plus an ordered index of use ticks, so both lookup
//! and eviction of the oldest entry are cheap even with tens of thousands of entries.
use std::{collections::BTreeMap, hash::Hash};

// Looked up for every sample (process snapshots, open files): a fast hash.
use foldhash::{HashMap, HashMapExt};

#[derive(Debug)]
pub(crate) struct Lru<K, V> {
    entries: HashMap<K, (V, u64)>,
    /// Use tick → key; the first entry is the least recently used.
    by_use: BTreeMap<u64, K>,
    next_tick: u64,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V> Lru<K, V> {
    /// `capacity` is clamped to at least one entry.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            next_tick: 0,
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

    fn bump(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    /// Returns the value and marks it most recently used.
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let tick = self.bump();
        let (value, used) = self.entries.get_mut(key)?;
        self.by_use.remove(used);
        *used = tick;
        self.by_use.insert(tick, key.clone());
        Some(value)
    }

    /// Inserts (or replaces) a value as most recently used; returns the entries evicted to stay
    /// within capacity.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Vec<(K, V)> {
        let tick = self.bump();
        if let Some((_, old_tick)) = self.entries.insert(key.clone(), (value, tick)) {
            self.by_use.remove(&old_tick);
        }
        self.by_use.insert(tick, key);
        let mut evicted = Vec::new();
        while self.entries.len() > self.capacity {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            if let Some((value, _)) = self.entries.remove(&oldest) {
                evicted.push((oldest, value));
            }
        }
        evicted
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let (value, tick) = self.entries.remove(key)?;
        self.by_use.remove(&tick);
        Some(value)
    }

    /// Keeps only the entries for which `keep` returns true, without touching use order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        let by_use = &mut self.by_use;
        self.entries.retain(|key, (value, tick)| {
            let kept = keep(key, value);
            if !kept {
                by_use.remove(tick);
            }
            kept
        });
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
