//! Point-to-point matching, sans-IO: which posted receive a payload that arrives completes, and
//! which held payload a newly posted receive takes.
//!
//! The rules, as c10d's backends keep them:
//! - Messages from one source with one tag are taken in the order they arrived.
//! - An arriving payload goes to the earliest-posted receive that accepts it: one that names
//!   its source and tag, or an any-source receive with its tag.
//! - A receive posted when payloads it accepts are already held takes the earliest-arrived of
//!   them (for an any-source receive, across every source).
//!
//! The driver keeps the receives' tensors and works; this keeps only ids, sources, tags and the
//! payloads no receive has taken yet.

use std::collections::{BTreeMap, VecDeque};

use crate::work::Rank;

/// Payloads from one source with one tag, oldest first, each with its arrival number.
type Held = VecDeque<(u64, Vec<u8>)>;

/// The p2p matching state of one rank in one group. `W` identifies a posted receive.
#[derive(Debug)]
pub struct Matcher<W> {
    /// Payloads no receive has taken yet, per (source, tag), oldest first, each with its
    /// arrival number.
    held: BTreeMap<(Rank, u32), Held>,
    arrivals: u64,
    /// Receives waiting for a payload, in posting order: (id, source or any, tag).
    posted: Vec<(W, Option<Rank>, u32)>,
}

impl<W> Default for Matcher<W> {
    fn default() -> Self {
        Matcher { held: BTreeMap::new(), arrivals: 0, posted: Vec::new() }
    }
}

impl<W: Copy + Eq> Matcher<W> {
    /// No receive posted, nothing held.
    pub fn new() -> Self {
        Matcher::default()
    }

    /// A payload from `from` with `tag` arrived: the earliest-posted receive that accepts it
    /// takes it (it is no longer posted), or it is held for a later receive (`None`).
    pub fn arrive(&mut self, from: Rank, tag: u32, payload: Vec<u8>) -> Option<(W, Vec<u8>)> {
        let accepts = |&(_, src, t): &(W, Option<Rank>, u32)| t == tag && src.is_none_or(|s| s == from);
        if let Some(i) = self.posted.iter().position(accepts) {
            let (id, _, _) = self.posted.remove(i);
            return Some((id, payload));
        }
        self.arrivals += 1;
        self.held.entry((from, tag)).or_default().push_back((self.arrivals, payload));
        None
    }

    /// The earliest-arrived held payload a receive from `from` (`None`: any source) with
    /// `tag` accepts, taken, with its source. `None` when nothing held matches: then
    /// [`Matcher::wait`] posts the receive (or the driver fails it, if its source is gone).
    pub fn take_held(&mut self, from: Option<Rank>, tag: u32) -> Option<(Rank, Vec<u8>)> {
        let key = match from {
            Some(src) => (src, tag),
            None => {
                *self
                    .held
                    .iter()
                    .filter(|((_, t), q)| *t == tag && !q.is_empty())
                    .min_by_key(|(_, q)| q.front().map_or(u64::MAX, |(n, _)| *n))?
                    .0
            }
        };
        let queue = self.held.get_mut(&key)?;
        let (_, payload) = queue.pop_front()?;
        if queue.is_empty() {
            self.held.remove(&key);
        }
        Some((key.0, payload))
    }

    /// Post receive `id` from `from` (`None`: any source) with `tag`: it waits for a payload.
    pub fn wait(&mut self, id: W, from: Option<Rank>, tag: u32) {
        self.posted.push((id, from, tag));
    }

    /// Receive `id` ended some other way (failed, aborted, timed out): it takes nothing more.
    pub fn forget(&mut self, id: W) {
        self.posted.retain(|&(w, _, _)| w != id);
    }

    /// The posted receives that wait for `peer` by name (any-source receives do not).
    pub fn waiting_for(&self, peer: Rank) -> Vec<W> {
        self.posted.iter().filter(|&&(_, src, _)| src == Some(peer)).map(|&(id, _, _)| id).collect()
    }

    /// Posted receives still waiting.
    pub fn posted(&self) -> usize {
        self.posted.len()
    }

    /// Payloads held for receives not posted yet.
    pub fn held(&self) -> usize {
        self.held.values().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_payload_goes_to_the_earliest_posted_receive_that_accepts_it() {
        let mut m = Matcher::new();
        m.wait(1, Some(Rank(2)), 7);
        m.wait(2, None, 7);
        m.wait(3, Some(Rank(1)), 7);
        assert_eq!(m.arrive(Rank(1), 7, vec![1]), Some((2, vec![1])), "the any-source receive was posted first");
        assert_eq!(m.arrive(Rank(1), 7, vec![2]), Some((3, vec![2])));
        assert_eq!(m.arrive(Rank(1), 8, vec![3]), None, "no receive takes tag 8: held");
        assert_eq!(m.waiting_for(Rank(2)), vec![1]);
        assert_eq!((m.posted(), m.held()), (1, 1));
        m.forget(1);
        assert_eq!(m.arrive(Rank(2), 7, vec![4]), None, "a forgotten receive takes nothing");
        assert_eq!(m.held(), 2);
    }

    #[test]
    fn a_new_receive_takes_the_earliest_arrived_payload_it_accepts() {
        let mut m: Matcher<u32> = Matcher::new();
        m.arrive(Rank(3), 0, vec![30]);
        m.arrive(Rank(1), 0, vec![10]);
        m.arrive(Rank(3), 0, vec![31]);
        m.arrive(Rank(1), 5, vec![15]);
        assert_eq!(m.take_held(None, 0), Some((Rank(3), vec![30])), "rank 3's arrived first");
        assert_eq!(m.take_held(Some(Rank(3)), 0), Some((Rank(3), vec![31])));
        assert_eq!(m.take_held(None, 0), Some((Rank(1), vec![10])));
        assert_eq!(m.take_held(None, 0), None);
        assert_eq!(m.take_held(Some(Rank(1)), 5), Some((Rank(1), vec![15])));
        assert_eq!(m.held(), 0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Arrive(u8, u8),
        Post(Option<u8>, u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..3, 0u8..2).prop_map(|(s, t)| Step::Arrive(s, t)),
            (proptest::option::of(0u8..3), 0u8..2).prop_map(|(s, t)| Step::Post(s, t)),
        ]
    }

    proptest! {
        /// Every payload is delivered at most once, to a receive that accepts it; per source
        /// and tag in arrival order; and nothing waits while a payload it accepts is held.
        #[test]
        fn matching_keeps_per_source_order_and_loses_nothing(steps in proptest::collection::vec(step(), 0..60)) {
            let mut m: Matcher<usize> = Matcher::new();
            let mut sent: BTreeMap<(u8, u8), u32> = BTreeMap::new();
            let mut got: BTreeMap<(u8, u8), Vec<u32>> = BTreeMap::new();
            let mut posts: Vec<(Option<u8>, u8)> = Vec::new();
            let mut delivered = 0usize;
            for s in steps {
                match s {
                    Step::Arrive(src, tag) => {
                        let n = sent.entry((src, tag)).or_default();
                        *n += 1;
                        let payload = n.to_le_bytes().to_vec();
                        if let Some((id, p)) = m.arrive(Rank(u32::from(src)), u32::from(tag), payload) {
                            let (want, t) = posts[id];
                            prop_assert!(t == tag && want.is_none_or(|w| w == src));
                            got.entry((src, tag)).or_default().push(u32::from_le_bytes(p[..4].try_into().unwrap()));
                            delivered += 1;
                        }
                    }
                    Step::Post(src, tag) => {
                        let id = posts.len();
                        posts.push((src, tag));
                        match m.take_held(src.map(|s| Rank(u32::from(s))), u32::from(tag)) {
                            Some((from, p)) => {
                                let from = u8::try_from(from.0).unwrap();
                                prop_assert!(src.is_none_or(|w| w == from));
                                got.entry((from, tag)).or_default().push(u32::from_le_bytes(p[..4].try_into().unwrap()));
                                delivered += 1;
                            }
                            None => m.wait(id, src.map(|s| Rank(u32::from(s))), u32::from(tag)),
                        }
                    }
                }
                // No posted receive waits while a payload it accepts is held.
                for &(_, src, tag) in &m.posted {
                    let takes = m.held.keys().any(|&(from, t)| t == tag && src.is_none_or(|s| s == from));
                    prop_assert!(!takes, "a receive from {:?} with tag {} waits beside a held payload", src, tag);
                }
            }
            for (key, seen) in &got {
                let expected: Vec<u32> = (1..=seen.len() as u32).collect();
                prop_assert_eq!(seen, &expected, "per-source order for {:?}", key);
            }
            let total: u32 = sent.values().sum();
            prop_assert_eq!(delivered + m.held(), total as usize, "every payload delivered or held");
            prop_assert_eq!(delivered + m.posted(), posts.len(), "every receive matched or waiting");
        }
    }
}
