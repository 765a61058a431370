//! The records ranks publish through the store, where every rank can read them even when it
//! cannot hear from the rank that wrote them: a group's first failure, and (NCCL's desync
//! debug) how far each rank got.
//!
//! Both are text, so that a person reading the store sees what happened. Decoding is total:
//! any bytes give a record or an error, never a panic.

use crate::work::{Blame, Rank, SeqNo};

/// Why a store record did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// A field is missing or does not parse.
    #[error("malformed {record} record: {reason}")]
    Malformed {
        /// Which record.
        record: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// A group's first failure, as published through the store (first writer wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureRecord {
    /// The rank that failed first and published it.
    pub origin: Rank,
    /// Whom it blamed.
    pub blame: Blame,
    /// What happened.
    pub message: String,
}

impl FailureRecord {
    /// `origin\nblame\nmessage`, the blame as [`Blame::encode`] writes it.
    pub fn encode(&self) -> Vec<u8> {
        format!("{}\n{}\n{}", self.origin.0, self.blame.encode(), self.message).into_bytes()
    }

    /// The record in `bytes`, written by a rank of a group of `world_size`.
    pub fn decode(bytes: &[u8], world_size: u32) -> Result<FailureRecord, RecordError> {
        let bad = |reason: &str| RecordError::Malformed { record: "failure", reason: reason.into() };
        let text = String::from_utf8_lossy(bytes);
        let mut parts = text.splitn(3, '\n');
        let (Some(origin), Some(blame), Some(message)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("expected origin, blame and message on three lines"));
        };
        let origin = match origin.parse::<u32>() {
            Ok(r) if r < world_size => Rank(r),
            _ => return Err(bad("the origin is not a rank of the group")),
        };
        let blame = Blame::parse(blame, world_size).map_err(|e| bad(&e.to_string()))?;
        Ok(FailureRecord { origin, blame, message: message.to_owned() })
    }
}

/// How far one rank got in a group's collectives: the last sequence number it enqueued, whose
/// kernel started, and that completed (0 for none), as c10d's desync debug publishes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressRecord {
    /// Last collective enqueued.
    pub enqueued: SeqNo,
    /// Last collective whose kernel started.
    pub started: SeqNo,
    /// Last collective completed.
    pub completed: SeqNo,
}

impl ProgressRecord {
    /// A rank that has enqueued nothing yet.
    pub const NONE: ProgressRecord = ProgressRecord { enqueued: SeqNo(0), started: SeqNo(0), completed: SeqNo(0) };

    /// `enqueued started completed`, as decimal numbers.
    pub fn encode(&self) -> Vec<u8> {
        format!("{} {} {}", self.enqueued.0, self.started.0, self.completed.0).into_bytes()
    }

    /// The record in `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<ProgressRecord, RecordError> {
        let bad = |reason: &str| RecordError::Malformed { record: "progress", reason: reason.into() };
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not text"))?;
        let nums: Vec<u64> = text
            .split(' ')
            .map(|n| n.parse::<u64>().map_err(|_| bad("expected three sequence numbers")))
            .collect::<Result<_, _>>()?;
        let [enqueued, started, completed] = nums[..] else {
            return Err(bad("expected three sequence numbers"));
        };
        Ok(ProgressRecord { enqueued: SeqNo(enqueued), started: SeqNo(started), completed: SeqNo(completed) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_records_round_trip_and_bad_ones_are_errors() {
        let r = FailureRecord { origin: Rank(3), blame: Blame::rank(Rank(1)), message: "a\nmulti-line cause".into() };
        assert_eq!(FailureRecord::decode(&r.encode(), 4), Ok(r));
        let r = FailureRecord { origin: Rank(0), blame: Blame::nobody(), message: String::new() };
        assert_eq!(r.encode(), b"0\n?\n");
        assert_eq!(FailureRecord::decode(&r.encode(), 4), Ok(r));
        let r =
            FailureRecord { origin: Rank(0), blame: Blame::cut([Rank(0)], [Rank(1), Rank(2)]), message: "cut".into() };
        assert_eq!(FailureRecord::decode(&r.encode(), 4), Ok(r));
        assert_eq!(FailureRecord::decode(b"1\n-\nm", 4).map(|r| r.blame), Ok(Blame::nobody()));
        for bad in [&b""[..], b"1\n2", b"x\n-\nm", b"1\ny\nm", b"\xff\n-\nm", b"4\n1\nm", b"1\n4\nm"] {
            assert!(FailureRecord::decode(bad, 4).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn progress_records_round_trip_and_bad_ones_are_errors() {
        let r = ProgressRecord { enqueued: SeqNo(9), started: SeqNo(8), completed: SeqNo(7) };
        assert_eq!(r.encode(), b"9 8 7");
        assert_eq!(ProgressRecord::decode(&r.encode()), Ok(r));
        for bad in [&b""[..], b"1 2", b"1 2 3 4", b"1 2 x", b"1  2 3", b"\xff"] {
            assert!(ProgressRecord::decode(bad).is_err(), "{bad:?}");
        }
    }
}
