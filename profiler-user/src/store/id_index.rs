//! Finds the id of a value kept in a `Vec` (its index) by the value itself, storing only the
//! ids: 4 bytes an entry where a map from values to ids would copy each value. The catalog
//! holds one entry per call-tree node and per frame for the life of the store, so this is most
//! of what it costs.
use std::hash::{BuildHasher, Hash};

use foldhash::fast::FixedState;
use hashbrown::HashTable;

#[derive(Debug, Default)]
pub(crate) struct IdIndex {
    ids: HashTable<u32>,
    hasher: FixedState,
}

impl IdIndex {
    fn hash<T: Hash>(&self, value: &T) -> u64 {
        self.hasher.hash_one(value)
    }

    /// The id of `value` in `values`, if indexed.
    pub(crate) fn find<T: Hash + Eq>(&self, values: &[T], value: &T) -> Option<u32> {
        self.ids
            .find(self.hash(value), |&id| {
                values.get(id as usize) == Some(value)
            })
            .copied()
    }

    /// Indexes `values[id]`. The ids of one value must be added once.
    pub(crate) fn insert<T: Hash>(&mut self, values: &[T], id: u32) {
        let Some(value) = values.get(id as usize) else {
            return;
        };
        let hash = self.hash(value);
        let Self { ids, hasher } = self;
        ids.insert_unique(hash, id, |&other| {
            values
                .get(other as usize)
                .map_or(0, |value| hasher.hash_one(value))
        });
    }

    /// Forgets `values[id]` (still in `values` when called).
    pub(crate) fn remove<T: Hash>(&mut self, values: &[T], id: u32) {
        let Some(value) = values.get(id as usize) else {
            return;
        };
        if let Ok(entry) = self.ids.find_entry(self.hash(value), |&other| other == id) {
            entry.remove();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_ids_by_value_and_forgets_them() {
        let mut values: Vec<(u32, u32)> = Vec::new();
        let mut index = IdIndex::default();
        for i in 0..10_000u32 {
            values.push((i / 7, i % 13));
            index.insert(&values, i);
        }
        assert_eq!(index.len(), 10_000);
        for (id, value) in values.iter().enumerate() {
            assert_eq!(index.find(&values, value), Some(id as u32));
        }
        assert_eq!(index.find(&values, &(u32::MAX, 0)), None);
        for id in (5_000..10_000).rev() {
            index.remove(&values, id);
            values.pop();
        }
        assert_eq!(index.len(), 5_000);
        assert_eq!(index.find(&values, &(4_999 / 7, 4_999 % 13)), Some(4_999));
        assert_eq!(index.find(&values, &(5_000 / 7, 5_000 % 13)), None);
        // Out of range ids are ignored.
        index.insert(&values, 1_000_000);
        index.remove(&values, 1_000_000);
        assert_eq!(index.len(), 5_000);
    }
}
