//! [`SeqMap`]: an ordered map for keys handed out in increasing order — work ids, sequence
//! numbers — that leave roughly in the order they came.
//!
//! The tables of works in flight were B-trees: every submit inserted at the right end and
//! every finished work removed the leftmost key, which shifts a whole leaf of 200–300-byte
//! entries (`memmove` was a sixth of a zero-element allreduce's CPU time). Here an entry is a
//! slot in a ring buffer at `key - base`: insert at the end, lookup, and removal of the oldest
//! are O(1) and move nothing else.
//!
//! Keys must be dense: memory grows with the span between the oldest and the newest key held
//! (a removed key in the middle leaves an empty slot until the keys before it leave).

use std::collections::VecDeque;
use std::fmt;
use std::marker::PhantomData;

use crate::work::{SeqNo, WorkId};

/// A key a [`SeqMap`] can index: a counter.
pub(crate) trait SeqKey: Copy + Ord {
    /// The counter's value.
    fn index(self) -> u64;
    /// The key with counter value `index`.
    fn from_index(index: u64) -> Self;
}

impl SeqKey for WorkId {
    fn index(self) -> u64 {
        self.0
    }

    fn from_index(index: u64) -> Self {
        WorkId(index)
    }
}

impl SeqKey for SeqNo {
    fn index(self) -> u64 {
        self.0
    }

    fn from_index(index: u64) -> Self {
        SeqNo(index)
    }
}

/// An ordered map over dense counter keys (see the [module docs](self)).
///
/// Invariant: the first and the last slot are occupied (or there are no slots).
pub(crate) struct SeqMap<K, V> {
    base: u64,
    slots: VecDeque<Option<V>>,
    len: usize,
    _key: PhantomData<K>,
}

impl<K: SeqKey, V> Default for SeqMap<K, V> {
    fn default() -> Self {
        SeqMap { base: 0, slots: VecDeque::new(), len: 0, _key: PhantomData }
    }
}

impl<K: SeqKey + fmt::Debug, V: fmt::Debug> fmt::Debug for SeqMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: SeqKey, V> SeqMap<K, V> {
    /// An empty map.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn slot(&self, key: K) -> Option<usize> {
        let offset = key.index().checked_sub(self.base)?;
        usize::try_from(offset).ok().filter(|&i| i < self.slots.len())
    }

    /// The entry at `key`.
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.slot(*key).and_then(|i| self.slots[i].as_ref())
    }

    /// The entry at `key`, mutably.
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.slot(*key).and_then(|i| self.slots[i].as_mut())
    }

    /// Whether `key` has an entry.
    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Insert `value` at `key`, returning the value it replaces. O(1) at or just past either
    /// end; a key far from the others makes room for every key in between.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        let k = key.index();
        if self.slots.is_empty() {
            self.base = k;
        }
        if k < self.base {
            let gap = usize::try_from(self.base - k).expect("keys of one map are dense");
            self.slots.reserve(gap);
            for _ in 1..gap {
                self.slots.push_front(None);
            }
            self.slots.push_front(Some(value));
            self.base = k;
            self.len += 1;
            return None;
        }
        let i = usize::try_from(k - self.base).expect("keys of one map are dense");
        if i >= self.slots.len() {
            self.slots.resize_with(i, || None);
            self.slots.push_back(Some(value));
            self.len += 1;
            return None;
        }
        let old = self.slots[i].replace(value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Remove and return the entry at `key`.
    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.slot(*key)?;
        let value = self.slots[i].take()?;
        self.len -= 1;
        self.trim();
        Some(value)
    }

    /// Drop empty slots at both ends, restoring the invariant.
    fn trim(&mut self) {
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.base += 1;
        }
        while matches!(self.slots.back(), Some(None)) {
            self.slots.pop_back();
        }
    }

    /// The entry with the smallest key.
    pub(crate) fn first(&self) -> Option<(K, &V)> {
        self.slots.front().and_then(Option::as_ref).map(|v| (K::from_index(self.base), v))
    }

    /// The entry with the smallest key, mutably.
    pub(crate) fn first_mut(&mut self) -> Option<(K, &mut V)> {
        let base = self.base;
        self.slots.front_mut().and_then(Option::as_mut).map(|v| (K::from_index(base), v))
    }

    /// Remove and return the entry with the smallest key.
    pub(crate) fn pop_first(&mut self) -> Option<(K, V)> {
        let key = K::from_index(self.base);
        let value = self.slots.front_mut()?.take()?;
        self.len -= 1;
        self.trim();
        Some((key, value))
    }

    /// Entries in key order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (K, &V)> + '_ {
        let base = self.base;
        self.slots.iter().enumerate().filter_map(move |(i, v)| v.as_ref().map(|v| (K::from_index(base + i as u64), v)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Insert at the next key past the newest (or at `newest - back` when `back` > 0).
        Insert {
            back: u8,
        },
        Remove(u8),
        PopFirst,
        Mutate(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..3).prop_map(|b| Op::Insert { back: if b == 2 { 3 } else { 0 } }),
            2 => any::<u8>().prop_map(Op::Remove),
            2 => Just(Op::PopFirst),
            1 => any::<u8>().prop_map(Op::Mutate),
        ]
    }

    proptest! {
        /// Every operation agrees with a B-tree map, whatever the order of removals.
        #[test]
        fn behaves_like_an_ordered_map(start in 0u64..1000, ops in prop::collection::vec(op(), 0..200)) {
            let mut map: SeqMap<WorkId, u64> = SeqMap::new();
            let mut model: BTreeMap<WorkId, u64> = BTreeMap::new();
            let mut next = start;
            for (n, op) in ops.into_iter().enumerate() {
                let n = n as u64;
                match op {
                    Op::Insert { back } => {
                        let key = WorkId(next.saturating_sub(u64::from(back)));
                        next += 1;
                        prop_assert_eq!(map.insert(key, n), model.insert(key, n));
                    }
                    Op::Remove(pick) => {
                        let key = model.keys().nth(usize::from(pick) % model.len().max(1)).copied().unwrap_or(WorkId(next));
                        prop_assert_eq!(map.remove(&key), model.remove(&key));
                        prop_assert_eq!(map.remove(&key), None);
                    }
                    Op::PopFirst => prop_assert_eq!(map.pop_first(), model.pop_first()),
                    Op::Mutate(pick) => {
                        let key = model.keys().nth(usize::from(pick) % model.len().max(1)).copied().unwrap_or(WorkId(next));
                        if let Some(v) = model.get_mut(&key) { *v += 1000; }
                        if let Some(v) = map.get_mut(&key) { *v += 1000; }
                    }
                }
                prop_assert_eq!(map.len(), model.len());
                prop_assert_eq!(map.is_empty(), model.is_empty());
                prop_assert_eq!(map.first().map(|(k, v)| (k, *v)), model.first_key_value().map(|(k, v)| (*k, *v)));
                let got: Vec<(WorkId, u64)> = map.iter().map(|(k, v)| (k, *v)).collect();
                let want: Vec<(WorkId, u64)> = model.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(got, want);
                for k in next.saturating_sub(5)..next + 2 {
                    prop_assert_eq!(map.get(&WorkId(k)), model.get(&WorkId(k)));
                }
                // Slots are kept only between the oldest and newest keys held.
                let span = match (model.first_key_value(), model.last_key_value()) {
                    (Some((a, _)), Some((b, _))) => (b.0 - a.0 + 1) as usize,
                    _ => 0,
                };
                prop_assert_eq!(map.slots.len(), span);
            }
        }
    }

    #[test]
    fn a_key_below_the_oldest_makes_room_in_front() {
        let mut map: SeqMap<SeqNo, &str> = SeqMap::new();
        map.insert(SeqNo(10), "ten");
        map.insert(SeqNo(7), "seven");
        assert_eq!(map.iter().collect::<Vec<_>>(), vec![(SeqNo(7), &"seven"), (SeqNo(10), &"ten")]);
        assert_eq!(map.first_mut().map(|(k, _)| k), Some(SeqNo(7)));
        if let Some((_, v)) = map.first_mut() {
            *v = "x";
        }
        assert_eq!(map.pop_first(), Some((SeqNo(7), "x")));
        assert_eq!(map.first().map(|(k, _)| k), Some(SeqNo(10)));
    }
}
