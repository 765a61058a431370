//! The desync census: when a rank finds that a peer's part of a collective does not fit its
//! own, it does not blame that peer (the peer may be the one rank that is right). It asks
//! every rank what it runs at that sequence number, and the ranks that disagree with the
//! majority are the deviants.
//!
//! This module holds the votes and the verdict; [`GroupState`](crate::group::GroupState)
//! sends and receives the votes ([`ControlMsg::Census`](crate::group::ControlMsg::Census)).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::group::Collective;
use crate::tensor::DType;
use crate::work::{Blame, OpType, Rank};

/// What a rank runs at one collective, as far as peers must agree on it: the op, the first
/// input's dtype, the root, and the number of input elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Signature {
    /// The op.
    pub op: OpType,
    /// The first input's dtype (none for a barrier).
    pub dtype: Option<DType>,
    /// The root, for rooted collectives.
    pub root: Option<Rank>,
    /// Input elements, all inputs together.
    pub numel: u64,
}

impl Signature {
    /// The signature of `c`.
    pub fn of(c: &Collective) -> Signature {
        Signature { op: c.op, dtype: c.inputs.first().map(|t| t.dtype), root: c.root, numel: c.numel_in() as u64 }
    }

    /// 15 bytes: op index, dtype code (255: none), root (u32::MAX: none), numel, little-endian.
    pub fn encode(&self) -> [u8; 15] {
        let mut out = [0u8; 15];
        out[0] = OpType::ALL.iter().position(|o| *o == self.op).map_or(255, |i| i as u8);
        out[1] = self.dtype.map_or(255, DType::code);
        out[2..6].copy_from_slice(&self.root.map_or(u32::MAX, |r| r.0).to_le_bytes());
        out[6..14].copy_from_slice(&self.numel.to_le_bytes());
        out
    }

    /// A signature from [`Signature::encode`]'s bytes (the last byte is reserved).
    pub fn decode(bytes: &[u8]) -> Result<Signature, SignatureError> {
        let bytes: &[u8; 15] = bytes.try_into().map_err(|_| SignatureError::Length(bytes.len()))?;
        let op = *OpType::ALL.get(bytes[0] as usize).ok_or(SignatureError::Op(bytes[0]))?;
        let dtype = match bytes[1] {
            255 => None,
            code => Some(DType::from_code(code).ok_or(SignatureError::DType(code))?),
        };
        let root = match u32::from_le_bytes([bytes[2], bytes[3], bytes[4], bytes[5]]) {
            u32::MAX => None,
            r => Some(Rank(r)),
        };
        let mut numel = [0u8; 8];
        numel.copy_from_slice(&bytes[6..14]);
        Ok(Signature { op, dtype, root, numel: u64::from_le_bytes(numel) })
    }
}

/// Bytes [`Signature::decode`] cannot read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// Not 15 bytes.
    #[error("a signature is 15 bytes, not {0}")]
    Length(usize),
    /// An op code this build does not know.
    #[error("unknown op code {0}")]
    Op(u8),
    /// A dtype code this build does not know.
    #[error("unknown dtype code {0}")]
    DType(u8),
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.op)?;
        if let Some(d) = self.dtype {
            write!(f, "{d}, ")?;
        }
        write!(f, "{} elements", self.numel)?;
        if let Some(r) = self.root {
            write!(f, ", root {r}")?;
        }
        f.write_str(")")
    }
}

/// The votes for one collective: each rank's signature there, or `None` for a rank that has
/// not reached it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Votes {
    votes: BTreeMap<Rank, Option<Signature>>,
}

/// The census's finding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Whom it blames.
    pub blame: Blame,
    /// What each side runs, for the message.
    pub message: String,
}

impl Votes {
    /// Rank `rank` runs `sig` (a later vote from the same rank replaces its earlier one).
    pub fn insert(&mut self, rank: Rank, sig: Option<Signature>) {
        self.votes.insert(rank, sig);
    }

    /// Whether `rank` has voted.
    pub fn has(&self, rank: Rank) -> bool {
        self.votes.contains_key(&rank)
    }

    /// Whether `rank` has voted with a signature (it has reached the collective).
    pub fn has_signature(&self, rank: Rank) -> bool {
        self.votes.get(&rank).is_some_and(Option::is_some)
    }

    /// `rank`'s vote: `Some(None)` if it has not reached the collective, `None` if it has not
    /// voted.
    pub fn get(&self, rank: Rank) -> Option<Option<Signature>> {
        self.votes.get(&rank).copied()
    }

    /// How many ranks have voted.
    pub fn len(&self) -> usize {
        self.votes.len()
    }

    /// Whether nobody has voted.
    pub fn is_empty(&self) -> bool {
        self.votes.is_empty()
    }

    /// The verdict on the votes so far, in a group of `world_size`:
    /// - one signature held by more ranks than any other: the ranks holding another one are
    ///   the deviants;
    /// - in a two-rank group that disagrees, both ranks (no majority can say which deviated);
    /// - otherwise (a tie between the most common signatures): undecided, every rank that
    ///   holds one of the tied signatures suspected;
    /// - everyone agrees: `None` (the census found no desync).
    ///
    /// Ranks that have not reached the collective are not counted: being behind is not a
    /// desync.
    pub fn verdict(&self, world_size: u32) -> Option<Verdict> {
        let mut groups: Vec<(Signature, Vec<Rank>)> = Vec::new();
        for (&rank, sig) in &self.votes {
            let Some(sig) = sig else { continue };
            match groups.iter_mut().find(|(s, _)| s == sig) {
                Some((_, ranks)) => ranks.push(rank),
                None => groups.push((*sig, vec![rank])),
            }
        }
        if groups.len() < 2 {
            return None;
        }
        groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.1.cmp(&b.1)));
        let sides = groups
            .iter()
            .map(|(sig, ranks)| format!("rank(s) {} run {sig}", crate::work::rank_ranges(ranks)))
            .collect::<Vec<_>>()
            .join("; ");
        let top = groups[0].1.len();
        let tied: Vec<Rank> =
            groups.iter().filter(|(_, r)| r.len() == top).flat_map(|(_, r)| r.iter().copied()).collect();
        let blame = if groups[1].1.len() < top {
            Blame::ranks(groups[1..].iter().flat_map(|(_, r)| r.iter().copied()))
        } else if world_size == 2 {
            Blame::ranks(tied)
        } else {
            Blame::undecided(tied)
        };
        let message = match &blame {
            Blame::Ranks { ranks } if groups[1].1.len() < top => {
                format!(
                    "desync: {sides}; the majority runs {}, so {} deviated",
                    groups[0].0,
                    Blame::ranks(ranks.clone())
                )
            }
            _ => format!("desync: {sides}; no majority says which deviated"),
        };
        Some(Verdict { blame, message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(op: OpType, numel: u64) -> Option<Signature> {
        Some(Signature { op, dtype: Some(DType::F32), root: None, numel })
    }

    #[test]
    fn the_minority_is_the_deviant_not_the_rank_that_noticed() {
        let mut v = Votes::default();
        for r in [0, 1, 3] {
            v.insert(Rank(r), sig(OpType::Allreduce, 1024));
        }
        v.insert(Rank(2), sig(OpType::Broadcast, 1024));
        let verdict = v.verdict(4).unwrap();
        assert_eq!(verdict.blame, Blame::rank(Rank(2)));
        assert!(verdict.message.contains("rank(s) [2] run broadcast(float32, 1024 elements)"), "{}", verdict.message);
        assert!(verdict.message.ends_with("so rank 2 deviated"), "{}", verdict.message);
    }

    #[test]
    fn two_ranks_that_disagree_are_both_named_and_larger_ties_are_undecided() {
        let mut v = Votes::default();
        v.insert(Rank(0), sig(OpType::Allreduce, 8));
        v.insert(Rank(1), sig(OpType::Allreduce, 17));
        assert_eq!(v.verdict(2).unwrap().blame, Blame::ranks([Rank(0), Rank(1)]));
        let mut v = Votes::default();
        v.insert(Rank(0), sig(OpType::Allreduce, 8));
        v.insert(Rank(1), sig(OpType::Allreduce, 8));
        v.insert(Rank(2), sig(OpType::Allreduce, 17));
        v.insert(Rank(3), sig(OpType::Allreduce, 17));
        let verdict = v.verdict(4).unwrap();
        assert_eq!(verdict.blame, Blame::undecided((0..4).map(Rank)));
        assert!(verdict.message.contains("no majority"), "{}", verdict.message);
    }

    #[test]
    fn agreement_and_ranks_behind_are_no_desync() {
        let mut v = Votes::default();
        v.insert(Rank(0), sig(OpType::Allreduce, 8));
        v.insert(Rank(1), None);
        v.insert(Rank(2), sig(OpType::Allreduce, 8));
        assert_eq!(v.verdict(3), None);
        v.insert(Rank(1), sig(OpType::Barrier, 0));
        assert_eq!(v.verdict(3).unwrap().blame, Blame::rank(Rank(1)));
    }

    #[test]
    fn signatures_round_trip_and_bad_bytes_are_errors() {
        for op in OpType::ALL {
            for dtype in [None, Some(DType::Bf16)] {
                for root in [None, Some(Rank(7))] {
                    let s = Signature { op, dtype, root, numel: u64::MAX - 3 };
                    assert_eq!(Signature::decode(&s.encode()), Ok(s));
                }
            }
        }
        assert!(Signature::decode(&[0; 14]).is_err());
        let mut bad = Signature::of(&Collective::new(OpType::Barrier)).encode();
        bad[0] = 200;
        assert!(Signature::decode(&bad).is_err());
        bad[0] = 0;
        bad[1] = 200;
        assert!(Signature::decode(&bad).is_err());
    }
}
