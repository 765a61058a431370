//! Control messages ([`ControlMsg`]) as frames: what every driver sends and reads, in one
//! place, so that the TCP backend and the fuzzers run the same codec.
//!
//! | message | kind | `seq` | payload |
//! |---|---|---|---|
//! | heartbeat | heartbeat | 0 | none |
//! | error | error | 0 | UTF-8 `origin\nblame\nmessage` (the blame as [`Blame::encode`]) |
//! | abort | abort | 0 | UTF-8 reason |
//! | stuck | stuck | the collective | the ranks it waits for, little-endian u32s |
//! | census | census | the collective | a [`Signature`] (15 bytes), or none |
//!
//! Decoding is total: bytes from a peer give a message or a [`ControlError`], never a panic.

use crate::census::Signature;
use crate::group::ControlMsg;
use crate::protocol::frame::{FrameKind, decode_message, truncate_message};
use crate::work::{Blame, Rank, SeqNo};

/// A control message's frame fields (the header's other fields are the sender's and group's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlFrame {
    /// The frame kind.
    pub kind: FrameKind,
    /// The header's sequence number.
    pub seq: SeqNo,
    /// The payload.
    pub payload: Vec<u8>,
}

/// A control frame that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {kind} frame: {reason}")]
pub struct ControlError {
    /// The frame kind.
    pub kind: FrameKind,
    /// What is wrong.
    pub reason: String,
}

/// `msg` as a frame.
pub fn encode_control(msg: &ControlMsg) -> ControlFrame {
    let frame = |kind, seq, payload| ControlFrame { kind, seq, payload };
    match msg {
        ControlMsg::Heartbeat => frame(FrameKind::Heartbeat, SeqNo(0), Vec::new()),
        ControlMsg::Error { origin, blame, message } => {
            let text = format!("{}\n{}\n{message}", origin.0, blame.encode());
            frame(FrameKind::Error, SeqNo(0), truncate_message(&text).as_bytes().to_vec())
        }
        ControlMsg::Abort { reason } => frame(FrameKind::Abort, SeqNo(0), truncate_message(reason).as_bytes().to_vec()),
        ControlMsg::Stuck { seq, waiting_on } => {
            frame(FrameKind::Stuck, *seq, waiting_on.iter().flat_map(|r| r.0.to_le_bytes()).collect())
        }
        ControlMsg::Census { seq, sig } => {
            frame(FrameKind::Census, *seq, sig.map(|s| s.encode().to_vec()).unwrap_or_default())
        }
    }
}

/// The control message in a frame of `kind` with sequence number `seq`, from a group of
/// `world_size` ranks. `Ok(None)` for kinds that are not control messages (data, p2p,
/// goodbye).
pub fn decode_control(
    kind: FrameKind,
    seq: SeqNo,
    payload: &[u8],
    world_size: u32,
) -> Result<Option<ControlMsg>, ControlError> {
    let bad = |reason: String| ControlError { kind, reason };
    let msg = match kind {
        FrameKind::Data | FrameKind::P2p | FrameKind::Goodbye => return Ok(None),
        FrameKind::Heartbeat => ControlMsg::Heartbeat,
        FrameKind::Error => {
            let text = decode_message(kind, payload).map_err(|e| bad(e.to_string()))?;
            let mut parts = text.splitn(3, '\n');
            let (Some(origin), Some(blame), Some(message)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad("expected origin, blame and message on three lines".into()));
            };
            let origin = match origin.parse::<u32>() {
                Ok(r) if r < world_size => Rank(r),
                _ => return Err(bad(format!("origin {origin:?} is not a rank of a group of {world_size}"))),
            };
            let blame = Blame::parse(blame, world_size).map_err(|e| bad(e.to_string()))?;
            ControlMsg::Error { origin, blame, message: message.to_owned() }
        }
        FrameKind::Abort => {
            let reason = decode_message(kind, payload).map_err(|e| bad(e.to_string()))?;
            ControlMsg::Abort { reason: reason.to_owned() }
        }
        FrameKind::Stuck => {
            if !payload.len().is_multiple_of(4) || payload.len() / 4 > world_size as usize {
                return Err(bad(format!("{} bytes is not a list of at most {world_size} ranks", payload.len())));
            }
            let waiting_on: Vec<Rank> =
                payload.chunks_exact(4).map(|c| Rank(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect();
            if let Some(r) = waiting_on.iter().find(|r| r.0 >= world_size) {
                return Err(bad(format!("rank {r} is not in a group of {world_size}")));
            }
            ControlMsg::Stuck { seq, waiting_on }
        }
        FrameKind::Census => {
            let sig = match payload {
                [] => None,
                bytes => Some(Signature::decode(bytes).map_err(|e| bad(e.to_string()))?),
            };
            if sig.and_then(|s| s.root).is_some_and(|r| r.0 >= world_size) {
                return Err(bad(format!("the root is not in a group of {world_size}")));
            }
            ControlMsg::Census { seq, sig }
        }
    };
    Ok(Some(msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use crate::work::OpType;

    fn round_trip(msg: ControlMsg) {
        let f = encode_control(&msg);
        assert_eq!(decode_control(f.kind, f.seq, &f.payload, 8), Ok(Some(msg)));
    }

    #[test]
    fn every_control_message_round_trips() {
        round_trip(ControlMsg::Heartbeat);
        round_trip(ControlMsg::Error {
            origin: Rank(3),
            blame: Blame::cut([Rank(0), Rank(3)], [Rank(1), Rank(2)]),
            message: "two\nlines".into(),
        });
        round_trip(ControlMsg::Error { origin: Rank(0), blame: Blame::nobody(), message: String::new() });
        round_trip(ControlMsg::Abort { reason: "user".into() });
        round_trip(ControlMsg::Stuck { seq: SeqNo(9), waiting_on: vec![Rank(2), Rank(7)] });
        round_trip(ControlMsg::Census { seq: SeqNo(4), sig: None });
        let sig = Signature { op: OpType::Broadcast, dtype: Some(DType::F16), root: Some(Rank(5)), numel: 17 };
        round_trip(ControlMsg::Census { seq: SeqNo(4), sig: Some(sig) });
    }

    #[test]
    fn bad_control_frames_are_errors_naming_what_is_wrong() {
        let err = |kind, payload: &[u8]| decode_control(kind, SeqNo(1), payload, 4).unwrap_err().to_string();
        assert!(err(FrameKind::Error, b"9\n1\nx").contains("origin \"9\" is not a rank of a group of 4"));
        assert!(err(FrameKind::Error, b"1\n7\nx").contains("is not a rank of a group of 4"));
        assert!(err(FrameKind::Error, b"1\n2").contains("three lines"));
        assert!(err(FrameKind::Stuck, &[1, 0, 0]).contains("not a list"));
        assert!(err(FrameKind::Stuck, &5u32.to_le_bytes()).contains("rank 5 is not in a group of 4"));
        assert!(err(FrameKind::Census, &[0; 3]).contains("15 bytes"));
        assert_eq!(decode_control(FrameKind::Data, SeqNo(1), b"anything", 4), Ok(None));
    }
}
