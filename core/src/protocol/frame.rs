//! Data-plane frames: the fixed header and its checks (the streaming decoder is in
//! `decoder.rs`).

use std::fmt;

use super::{PROTOCOL_VERSION, read_array};
use crate::work::{GroupId, Rank, SeqNo};

/// Size of an encoded [`FrameHeader`] in bytes.
pub const HEADER_LEN: usize = 40;

/// The first four bytes of every frame: `CoHF` on the wire.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"CoHF");

/// Largest error or abort message, in bytes. Longer messages are cut by [`truncate_message`]
/// before they are sent, and refused by [`FrameHeader::decode`] when received.
pub const MAX_MESSAGE_LEN: u64 = 64 * 1024;

/// Default [`FrameLimits::max_payload`]: 1 GiB.
const DEFAULT_MAX_PAYLOAD: u64 = 1 << 30;

/// What a frame carries. The wire code of each kind is given in its doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrameKind {
    /// Code 5. The sender aborted the group; the payload is the UTF-8 reason.
    Abort,
    /// Code 1. A chunk of a collective, for step `step` of collective `seq`.
    Data,
    /// Code 4. The sender failed; the payload is a UTF-8 message naming why.
    Error,
    /// Code 6. Clean shutdown of the connection; no payload.
    Goodbye,
    /// Code 3. Liveness; no payload.
    Heartbeat,
    /// Code 2. A send/recv payload; `tag` is meaningful.
    P2p,
    /// Code 7. The sender's collective `seq` has run half its timeout; the payload lists the
    /// ranks it still waits for, as little-endian u32s.
    Stuck,
    /// Code 8. The sender's vote in the desync census of collective `seq`: its signature
    /// there (15 bytes), or nothing if it has not reached it.
    Census,
}

impl FrameKind {
    /// Every kind, in declaration order.
    pub const ALL: [FrameKind; 8] = [
        FrameKind::Abort,
        FrameKind::Census,
        FrameKind::Data,
        FrameKind::Error,
        FrameKind::Goodbye,
        FrameKind::Heartbeat,
        FrameKind::P2p,
        FrameKind::Stuck,
    ];

    /// The kind's code on the wire.
    pub const fn code(self) -> u8 {
        match self {
            FrameKind::Data => 1,
            FrameKind::P2p => 2,
            FrameKind::Heartbeat => 3,
            FrameKind::Error => 4,
            FrameKind::Abort => 5,
            FrameKind::Goodbye => 6,
            FrameKind::Stuck => 7,
            FrameKind::Census => 8,
        }
    }

    /// The kind with wire code `code`, if there is one.
    pub const fn from_code(code: u8) -> Option<FrameKind> {
        match code {
            1 => Some(FrameKind::Data),
            2 => Some(FrameKind::P2p),
            3 => Some(FrameKind::Heartbeat),
            4 => Some(FrameKind::Error),
            5 => Some(FrameKind::Abort),
            6 => Some(FrameKind::Goodbye),
            7 => Some(FrameKind::Stuck),
            8 => Some(FrameKind::Census),
            _ => None,
        }
    }

    /// Whether frames of this kind may carry a payload (heartbeat and goodbye may not).
    pub const fn takes_payload(self) -> bool {
        !matches!(self, FrameKind::Heartbeat | FrameKind::Goodbye)
    }

    /// Whether the payload is a UTF-8 message of at most [`MAX_MESSAGE_LEN`] bytes (error and
    /// abort).
    pub const fn is_message(self) -> bool {
        matches!(self, FrameKind::Error | FrameKind::Abort)
    }

    /// Lower-case name, as used in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            FrameKind::Abort => "abort",
            FrameKind::Data => "data",
            FrameKind::Error => "error",
            FrameKind::Goodbye => "goodbye",
            FrameKind::Heartbeat => "heartbeat",
            FrameKind::P2p => "p2p",
            FrameKind::Stuck => "stuck",
            FrameKind::Census => "census",
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a receiver accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest payload a frame may announce, in bytes (default 1 GiB). A larger announcement
    /// is refused before anything is allocated for it.
    pub max_payload: u64,
}

impl FrameLimits {
    /// Limits with the given largest payload.
    pub const fn new(max_payload: u64) -> Self {
        FrameLimits { max_payload }
    }
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits::new(DEFAULT_MAX_PAYLOAD)
    }
}

/// A frame's fixed-size header. See the [module docs](super) for the layout.
///
/// Sending: `header.encode()` gives the [`HEADER_LEN`] bytes to write before the payload (one
/// vectored write of header and payload, no copy). Receiving: read [`HEADER_LEN`] bytes,
/// [`FrameHeader::decode`] them, then read exactly `payload_len` bytes wherever they belong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Flag bits. Version 1 defines none: senders write 0 and receivers pass them through
    /// unchanged, so a driver can see what a peer set.
    pub flags: u8,
    /// The process group the frame belongs to.
    pub group: GroupId,
    /// The sender's rank.
    pub source: Rank,
    /// The collective's (data) or the point-to-point op's (p2p) sequence number.
    pub seq: SeqNo,
    /// The step of the collective's schedule this chunk belongs to.
    pub step: u32,
    /// The send/recv tag (p2p frames); on data frames, the sender's [`Fingerprint`] (0: none).
    pub tag: u32,
    /// How many payload bytes follow the header.
    pub payload_len: u64,
}

impl FrameHeader {
    /// A data frame: a chunk of `payload_len` bytes for `step` of collective `seq`.
    pub const fn data(group: GroupId, seq: SeqNo, step: u32, source: Rank, payload_len: u64) -> Self {
        FrameHeader { kind: FrameKind::Data, flags: 0, group, source, seq, step, tag: 0, payload_len }
    }

    /// A point-to-point frame: `payload_len` bytes of send/recv op `seq` with `tag`.
    pub const fn p2p(group: GroupId, seq: SeqNo, source: Rank, tag: u32, payload_len: u64) -> Self {
        FrameHeader { kind: FrameKind::P2p, flags: 0, group, source, seq, step: 0, tag, payload_len }
    }

    /// A heartbeat from `source` (group 0, no payload).
    pub const fn heartbeat(source: Rank) -> Self {
        FrameHeader::empty(FrameKind::Heartbeat, source)
    }

    /// A goodbye from `source`: it closes the connection cleanly (group 0, no payload).
    pub const fn goodbye(source: Rank) -> Self {
        FrameHeader::empty(FrameKind::Goodbye, source)
    }

    const fn empty(kind: FrameKind, source: Rank) -> Self {
        FrameHeader { kind, flags: 0, group: GroupId(0), source, seq: SeqNo(0), step: 0, tag: 0, payload_len: 0 }
    }

    /// The header's [`HEADER_LEN`] bytes, version [`PROTOCOL_VERSION`]. Never fails: whether
    /// the receiver accepts it is [`FrameHeader::validate`]'s business.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        self.encode_into(&mut out);
        out
    }

    /// Writes the header's bytes into `out` (see [`FrameHeader::encode`]).
    pub fn encode_into(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6] = self.kind.code();
        out[7] = self.flags;
        out[8..12].copy_from_slice(&self.group.0.to_le_bytes());
        out[12..16].copy_from_slice(&self.source.0.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.0.to_le_bytes());
        out[24..28].copy_from_slice(&self.step.to_le_bytes());
        out[28..32].copy_from_slice(&self.tag.to_le_bytes());
        out[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
    }

    /// Decodes and validates a header: magic, version, kind, then the payload length as
    /// [`FrameHeader::validate`] does. Total: any bytes give `Ok` or an error.
    pub fn decode(bytes: &[u8; HEADER_LEN], limits: &FrameLimits) -> Result<FrameHeader, FrameError> {
        let magic = u32::from_le_bytes(read_array(bytes, 0));
        if magic != FRAME_MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes(read_array(bytes, 4));
        if version != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion { found: version });
        }
        let kind = FrameKind::from_code(bytes[6]).ok_or(FrameError::UnknownKind { found: bytes[6] })?;
        let header = FrameHeader {
            kind,
            flags: bytes[7],
            group: GroupId(u32::from_le_bytes(read_array(bytes, 8))),
            source: Rank(u32::from_le_bytes(read_array(bytes, 12))),
            seq: SeqNo(u64::from_le_bytes(read_array(bytes, 16))),
            step: u32::from_le_bytes(read_array(bytes, 24)),
            tag: u32::from_le_bytes(read_array(bytes, 28)),
            payload_len: u64::from_le_bytes(read_array(bytes, 32)),
        };
        header.validate(limits)?;
        Ok(header)
    }

    /// Checks the payload length: at most `limits.max_payload`, zero for heartbeat and goodbye,
    /// at most [`MAX_MESSAGE_LEN`] for error and abort. Senders may call it before writing.
    pub fn validate(&self, limits: &FrameLimits) -> Result<(), FrameError> {
        let len = self.payload_len;
        if len > limits.max_payload {
            return Err(FrameError::PayloadTooLarge { len, limit: limits.max_payload });
        }
        if len > 0 && !self.kind.takes_payload() {
            return Err(FrameError::UnexpectedPayload { kind: self.kind, len });
        }
        if self.kind.is_message() && len > MAX_MESSAGE_LEN {
            return Err(FrameError::MessageTooLong { kind: self.kind, len, limit: MAX_MESSAGE_LEN });
        }
        Ok(())
    }
}

/// A whole frame, header and owned payload: what [`FrameDecoder`](super::FrameDecoder) yields.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The header; `header.payload_len == payload.len()` for frames from the decoder.
    pub header: FrameHeader,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

impl Frame {
    /// An error frame: `source` failed during collective `seq` of `group`, because of `message`
    /// (cut to [`MAX_MESSAGE_LEN`] bytes on a character boundary).
    pub fn error(group: GroupId, seq: SeqNo, source: Rank, message: &str) -> Frame {
        Frame::message(FrameKind::Error, group, seq, source, message)
    }

    /// An abort frame: `source` aborted `group` for `reason` (cut to [`MAX_MESSAGE_LEN`] bytes
    /// on a character boundary).
    pub fn abort(group: GroupId, source: Rank, reason: &str) -> Frame {
        Frame::message(FrameKind::Abort, group, SeqNo(0), source, reason)
    }

    fn message(kind: FrameKind, group: GroupId, seq: SeqNo, source: Rank, text: &str) -> Frame {
        let payload = truncate_message(text).as_bytes().to_vec();
        let header =
            FrameHeader { kind, flags: 0, group, source, seq, step: 0, tag: 0, payload_len: payload.len() as u64 };
        Frame { header, payload }
    }

    /// The message of an error or abort frame (see [`decode_message`]).
    pub fn text(&self) -> Result<&str, FrameError> {
        decode_message(self.header.kind, &self.payload)
    }

    /// Header and payload in one buffer. This copies the payload; the data path writes
    /// [`FrameHeader::encode`] and the payload with one vectored write instead.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        out.extend_from_slice(&self.header.encode());
        out.extend_from_slice(&self.payload);
        out
    }
}

/// Reads the UTF-8 message an error or abort frame carries. Refuses other kinds, messages over
/// [`MAX_MESSAGE_LEN`] bytes, and bytes that are not UTF-8.
pub fn decode_message(kind: FrameKind, payload: &[u8]) -> Result<&str, FrameError> {
    if !kind.is_message() {
        return Err(FrameError::NotAMessage { kind });
    }
    let len = payload.len() as u64;
    if len > MAX_MESSAGE_LEN {
        return Err(FrameError::MessageTooLong { kind, len, limit: MAX_MESSAGE_LEN });
    }
    std::str::from_utf8(payload).map_err(|e| FrameError::MessageNotUtf8 { kind, valid_up_to: e.valid_up_to() })
}

/// `message` cut to at most [`MAX_MESSAGE_LEN`] bytes, on a character boundary.
pub fn truncate_message(message: &str) -> &str {
    // MAX_MESSAGE_LEN (64 KiB) fits every usize this crate builds for.
    &message[..message.floor_char_boundary(MAX_MESSAGE_LEN as usize)]
}

/// A frame that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`FRAME_MAGIC`].
    #[error("bad frame magic {found:#010x} (expected {FRAME_MAGIC:#010x})")]
    BadMagic {
        /// The magic received.
        found: u32,
    },
    /// The frame's version is not [`PROTOCOL_VERSION`].
    #[error("frame protocol version {found} from peer, this build speaks {PROTOCOL_VERSION}")]
    UnsupportedVersion {
        /// The version received.
        found: u16,
    },
    /// The kind byte names no [`FrameKind`].
    #[error("unknown frame kind {found}")]
    UnknownKind {
        /// The kind code received.
        found: u8,
    },
    /// The payload length is over [`FrameLimits::max_payload`].
    #[error("frame payload of {len} bytes exceeds the limit of {limit}")]
    PayloadTooLarge {
        /// The length announced.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A heartbeat or goodbye frame announces a payload.
    #[error("{kind} frame announces {len} payload bytes, but {kind} frames carry none")]
    UnexpectedPayload {
        /// The frame's kind.
        kind: FrameKind,
        /// The length announced.
        len: u64,
    },
    /// An error or abort message is over [`MAX_MESSAGE_LEN`] bytes.
    #[error("{kind} message of {len} bytes exceeds the limit of {limit}")]
    MessageTooLong {
        /// The frame's kind.
        kind: FrameKind,
        /// The message length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// An error or abort message is not valid UTF-8.
    #[error("{kind} message is not valid utf-8 (valid up to byte {valid_up_to})")]
    MessageNotUtf8 {
        /// The frame's kind.
        kind: FrameKind,
        /// Length of the valid UTF-8 prefix.
        valid_up_to: usize,
    },
    /// [`decode_message`] was asked for the message of a frame kind that has none.
    #[error("{kind} frames carry no message")]
    NotAMessage {
        /// The frame's kind.
        kind: FrameKind,
    },
    /// The stream ended inside a frame header.
    #[error("connection closed {received} bytes into a {HEADER_LEN}-byte frame header")]
    TruncatedHeader {
        /// Header bytes received.
        received: usize,
    },
    /// The stream ended inside a frame payload.
    #[error("connection closed after {received} of the {expected} payload bytes of a {kind} frame")]
    TruncatedPayload {
        /// The frame's kind.
        kind: FrameKind,
        /// Payload bytes received.
        received: u64,
        /// Payload bytes announced.
        expected: u64,
    },
    /// A frame on a connection with one peer names another as its source.
    #[error("frame claims to come from rank {claimed} on the connection with rank {expected}")]
    WrongSource {
        /// The connection's peer.
        expected: Rank,
        /// The source the header names.
        claimed: Rank,
    },
    /// No buffer could be had for a payload within the limits.
    #[error("cannot allocate {len} bytes for a {kind} frame's payload")]
    PayloadAlloc {
        /// The frame's kind.
        kind: FrameKind,
        /// The payload length announced.
        len: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::FrameDecoder;

    fn header_bytes(header: &FrameHeader) -> [u8; HEADER_LEN] {
        header.encode()
    }

    fn sample() -> FrameHeader {
        FrameHeader::data(GroupId(3), SeqNo(0x0102_0304_0506_0708), 9, Rank(2), 4096)
    }

    #[test]
    fn header_round_trips_every_kind() {
        let limits = FrameLimits::default();
        for kind in FrameKind::ALL {
            let mut header = sample();
            header.kind = kind;
            header.flags = 0xa5;
            header.tag = 77;
            header.payload_len = if kind.takes_payload() { 12 } else { 0 };
            assert_eq!(FrameHeader::decode(&header.encode(), &limits), Ok(header));
        }
    }

    #[test]
    fn header_layout_matches_the_documented_offsets() {
        let header = FrameHeader {
            kind: FrameKind::P2p,
            flags: 0x80,
            group: GroupId(0x1122_3344),
            source: Rank(0x5566_7788),
            seq: SeqNo(0x0102_0304_0506_0708),
            step: 0x99aa_bbcc,
            tag: 0xddee_ff00,
            payload_len: 0x0000_0001_0000_0002,
        };
        let b = header.encode();
        assert_eq!(&b[0..4], b"CoHF");
        assert_eq!(&b[4..6], &[2, 0]);
        assert_eq!(b[6], 2);
        assert_eq!(b[7], 0x80);
        assert_eq!(&b[8..12], &[0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[12..16], &[0x88, 0x77, 0x66, 0x55]);
        assert_eq!(&b[16..24], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[24..28], &[0xcc, 0xbb, 0xaa, 0x99]);
        assert_eq!(&b[28..32], &[0x00, 0xff, 0xee, 0xdd]);
        assert_eq!(&b[32..40], &[2, 0, 0, 0, 1, 0, 0, 0]);
    }

    #[test]
    fn decode_refuses_bad_magic_and_names_it() {
        let mut b = header_bytes(&sample());
        b[0..4].copy_from_slice(&0x1234_5678u32.to_le_bytes());
        let err = FrameHeader::decode(&b, &FrameLimits::default()).unwrap_err();
        assert_eq!(err, FrameError::BadMagic { found: 0x1234_5678 });
        assert_eq!(err.to_string(), "bad frame magic 0x12345678 (expected 0x46486f43)");
    }

    #[test]
    fn decode_refuses_other_versions() {
        let mut b = header_bytes(&sample());
        b[4..6].copy_from_slice(&1u16.to_le_bytes());
        let err = FrameHeader::decode(&b, &FrameLimits::default()).unwrap_err();
        assert_eq!(err, FrameError::UnsupportedVersion { found: 1 });
        assert_eq!(err.to_string(), "frame protocol version 1 from peer, this build speaks 2");
    }

    #[test]
    fn decode_refuses_unknown_kinds() {
        for code in [0u8, 9, 255] {
            let mut b = header_bytes(&sample());
            b[6] = code;
            let err = FrameHeader::decode(&b, &FrameLimits::default()).unwrap_err();
            assert_eq!(err, FrameError::UnknownKind { found: code });
            assert_eq!(err.to_string(), format!("unknown frame kind {code}"));
        }
    }

    #[test]
    fn decode_refuses_payloads_over_the_limit() {
        let mut header = sample();
        header.payload_len = 1 << 60;
        let err = FrameHeader::decode(&header.encode(), &FrameLimits::default()).unwrap_err();
        assert_eq!(err.to_string(), "frame payload of 1152921504606846976 bytes exceeds the limit of 1073741824");
        header.payload_len = 101;
        let err = FrameHeader::decode(&header.encode(), &FrameLimits::new(100)).unwrap_err();
        assert_eq!(err, FrameError::PayloadTooLarge { len: 101, limit: 100 });
        header.payload_len = 100;
        assert_eq!(FrameHeader::decode(&header.encode(), &FrameLimits::new(100)), Ok(header));
    }

    #[test]
    fn decode_refuses_payload_on_heartbeat_and_goodbye() {
        for header in [FrameHeader::heartbeat(Rank(1)), FrameHeader::goodbye(Rank(1))] {
            let mut header = header;
            header.payload_len = 1;
            let err = FrameHeader::decode(&header.encode(), &FrameLimits::default()).unwrap_err();
            assert_eq!(err, FrameError::UnexpectedPayload { kind: header.kind, len: 1 });
        }
        let err = FrameError::UnexpectedPayload { kind: FrameKind::Heartbeat, len: 5 };
        assert_eq!(err.to_string(), "heartbeat frame announces 5 payload bytes, but heartbeat frames carry none");
    }

    #[test]
    fn decode_refuses_long_error_and_abort_messages() {
        for kind in [FrameKind::Error, FrameKind::Abort] {
            let mut header = sample();
            header.kind = kind;
            header.payload_len = MAX_MESSAGE_LEN;
            assert!(FrameHeader::decode(&header.encode(), &FrameLimits::default()).is_ok());
            header.payload_len = MAX_MESSAGE_LEN + 1;
            let err = FrameHeader::decode(&header.encode(), &FrameLimits::default()).unwrap_err();
            assert_eq!(err, FrameError::MessageTooLong { kind, len: MAX_MESSAGE_LEN + 1, limit: MAX_MESSAGE_LEN });
        }
        let err = FrameError::MessageTooLong { kind: FrameKind::Abort, len: 65537, limit: 65536 };
        assert_eq!(err.to_string(), "abort message of 65537 bytes exceeds the limit of 65536");
    }

    #[test]
    fn messages_round_trip_and_bad_utf8_is_an_error() {
        let frame = Frame::error(GroupId(0), SeqNo(4), Rank(1), "reduce failed: dtype mismatch");
        assert_eq!(frame.text(), Ok("reduce failed: dtype mismatch"));
        assert_eq!(frame.header.payload_len, frame.payload.len() as u64);
        let abort = Frame::abort(GroupId(2), Rank(0), "user called abort");
        assert_eq!(abort.header.kind, FrameKind::Abort);
        assert_eq!(abort.text(), Ok("user called abort"));

        let err = decode_message(FrameKind::Error, b"ok\xffno").unwrap_err();
        assert_eq!(err, FrameError::MessageNotUtf8 { kind: FrameKind::Error, valid_up_to: 2 });
        assert_eq!(err.to_string(), "error message is not valid utf-8 (valid up to byte 2)");
    }

    #[test]
    fn decode_message_refuses_other_kinds_and_long_payloads() {
        let err = decode_message(FrameKind::Data, b"x").unwrap_err();
        assert_eq!(err.to_string(), "data frames carry no message");
        let long = vec![b'a'; MAX_MESSAGE_LEN as usize + 1];
        assert!(matches!(decode_message(FrameKind::Abort, &long), Err(FrameError::MessageTooLong { .. })));
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        // 'é' is two bytes; an odd limit position would split one.
        let long = format!("x{}", "é".repeat(MAX_MESSAGE_LEN as usize));
        let cut = truncate_message(&long);
        assert!(cut.len() <= MAX_MESSAGE_LEN as usize);
        assert_eq!(cut.len(), MAX_MESSAGE_LEN as usize - 1);
        let frame = Frame::abort(GroupId(0), Rank(0), &long);
        assert_eq!(frame.text(), Ok(cut));
        assert_eq!(truncate_message("short"), "short");
    }

    #[test]
    fn validate_agrees_with_decode() {
        let mut header = sample();
        header.payload_len = 10;
        assert_eq!(header.validate(&FrameLimits::new(9)), Err(FrameError::PayloadTooLarge { len: 10, limit: 9 }));
        assert_eq!(header.validate(&FrameLimits::new(10)), Ok(()));
    }

    #[test]
    fn decoder_yields_frames_fed_byte_by_byte() {
        let frames = [
            Frame { header: FrameHeader::p2p(GroupId(1), SeqNo(2), Rank(3), 4, 3), payload: vec![1, 2, 3] },
            Frame { header: FrameHeader::heartbeat(Rank(3)), payload: vec![] },
            Frame::error(GroupId(1), SeqNo(5), Rank(3), "boom"),
        ];
        let stream: Vec<u8> = frames.iter().flat_map(Frame::encode).collect();
        let mut decoder = FrameDecoder::new(FrameLimits::default());
        let mut out = Vec::new();
        for byte in &stream {
            decoder.handle_bytes(std::slice::from_ref(byte));
            while let Some(frame) = decoder.poll_frame() {
                out.push(frame.unwrap());
            }
        }
        assert_eq!(out, frames);
        assert!(decoder.is_between_frames());
        decoder.handle_eof();
        assert_eq!(decoder.poll_frame(), None);
    }

    #[test]
    fn decoder_yields_earlier_frames_then_the_error_once_then_none() {
        let good = Frame { header: sample(), payload: vec![7; 4096] };
        let mut stream = good.encode();
        stream.extend_from_slice(&[0u8; HEADER_LEN]);
        let mut decoder = FrameDecoder::new(FrameLimits::default());
        decoder.handle_bytes(&stream);
        assert_eq!(decoder.poll_frame(), Some(Ok(good.clone())));
        assert_eq!(decoder.poll_frame(), Some(Err(FrameError::BadMagic { found: 0 })));
        assert_eq!(decoder.poll_frame(), None);
        decoder.handle_bytes(&good.encode());
        decoder.handle_eof();
        assert_eq!(decoder.poll_frame(), None);
        assert_eq!(decoder.error(), Some(&FrameError::BadMagic { found: 0 }));
    }

    #[test]
    fn decoder_refuses_a_huge_announcement_without_allocating() {
        let mut header = sample();
        header.payload_len = 1 << 60;
        let mut decoder = FrameDecoder::new(FrameLimits::default());
        decoder.handle_bytes(&header.encode());
        assert!(matches!(decoder.poll_frame(), Some(Err(FrameError::PayloadTooLarge { .. }))));
        assert!(decoder.is_between_frames(), "nothing was kept of it");
    }

    #[test]
    fn decoder_reports_a_stream_cut_inside_a_header() {
        let mut decoder = FrameDecoder::new(FrameLimits::default());
        decoder.handle_bytes(&sample().encode()[..12]);
        assert!(!decoder.is_between_frames());
        decoder.handle_eof();
        let err = decoder.poll_frame().unwrap().unwrap_err();
        assert_eq!(err, FrameError::TruncatedHeader { received: 12 });
        assert_eq!(err.to_string(), "connection closed 12 bytes into a 40-byte frame header");
        assert_eq!(decoder.poll_frame(), None);
    }

    #[test]
    fn decoder_reports_a_stream_cut_inside_a_payload() {
        let mut decoder = FrameDecoder::new(FrameLimits::default());
        let frame = Frame { header: sample(), payload: vec![0; 4096] };
        decoder.handle_bytes(&frame.encode()[..HEADER_LEN + 100]);
        decoder.handle_eof();
        let err = decoder.poll_frame().unwrap().unwrap_err();
        assert_eq!(err, FrameError::TruncatedPayload { kind: FrameKind::Data, received: 100, expected: 4096 });
        assert_eq!(err.to_string(), "connection closed after 100 of the 4096 payload bytes of a data frame");
    }

    #[test]
    fn decoder_applies_its_limits() {
        let frame = Frame { header: sample(), payload: vec![0; 4096] };
        let mut decoder = FrameDecoder::new(FrameLimits::new(4095));
        assert_eq!(decoder.limits(), FrameLimits::new(4095));
        decoder.handle_bytes(&frame.encode());
        assert_eq!(decoder.poll_frame(), Some(Err(FrameError::PayloadTooLarge { len: 4096, limit: 4095 })));
    }

    #[test]
    fn kind_codes_round_trip() {
        for kind in FrameKind::ALL {
            assert_eq!(FrameKind::from_code(kind.code()), Some(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        assert_eq!(FrameKind::from_code(0), None);
    }
}

/// What a data frame's `tag` carries: the sender's op, dtype and root for the collective, so
/// that a rank running something else at the same sequence number fails naming both (a
/// desync) instead of combining bytes that mean different things — an f32 and an i32 tensor
/// of one size, or a broadcast and a reduce-scatter, can have identical frames. Tag 0 means
/// "not given" and is never checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    /// The op.
    pub op: crate::work::OpType,
    /// The first input's dtype (none for a barrier).
    pub dtype: Option<crate::tensor::DType>,
    /// The root, for rooted collectives.
    pub root: Option<Rank>,
}

impl Fingerprint {
    /// As a frame tag: op index + 1 in bits 0-7, dtype code + 1 in 8-15, root + 1 in 16-31.
    pub fn to_tag(self) -> u32 {
        let op = crate::work::OpType::ALL.iter().position(|o| *o == self.op).map_or(0, |i| i as u32 + 1);
        let dtype = self.dtype.map_or(0, |d| u32::from(d.code()) + 1);
        let root = self.root.map_or(0, |r| (r.0 + 1).min(0xFFFF));
        op | (dtype << 8) | (root << 16)
    }

    /// From a frame tag; `None` for 0 or an op this build does not know.
    pub fn from_tag(tag: u32) -> Option<Fingerprint> {
        let op = *crate::work::OpType::ALL.get(((tag & 0xFF) as usize).checked_sub(1)?)?;
        let dtype = match (tag >> 8) & 0xFF {
            0 => None,
            code => Some(crate::tensor::DType::from_code(code as u8 - 1)?),
        };
        let root = (tag >> 16).checked_sub(1).map(Rank);
        Some(Fingerprint { op, dtype, root })
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.op)?;
        match (self.dtype, self.root) {
            (Some(d), Some(r)) => write!(f, "({d}, root {r})"),
            (Some(d), None) => write!(f, "({d})"),
            (None, Some(r)) => write!(f, "(root {r})"),
            (None, None) => Ok(()),
        }
    }
}

#[cfg(test)]
mod fingerprint_tests {
    use super::*;
    use crate::tensor::DType;
    use crate::work::OpType;

    #[test]
    fn fingerprints_round_trip_through_a_tag_and_print_readably() {
        for op in OpType::ALL {
            for dtype in [None, Some(DType::F32), Some(DType::Bf16)] {
                for root in [None, Some(Rank(0)), Some(Rank(63))] {
                    let fp = Fingerprint { op, dtype, root };
                    assert_ne!(fp.to_tag(), 0);
                    assert_eq!(Fingerprint::from_tag(fp.to_tag()), Some(fp));
                }
            }
        }
        assert_eq!(Fingerprint::from_tag(0), None);
        assert_eq!(Fingerprint::from_tag(0xFF), None);
        let fp = Fingerprint { op: OpType::Broadcast, dtype: Some(DType::F16), root: Some(Rank(2)) };
        assert_eq!(fp.to_string(), "broadcast(float16, root 2)");
    }
}
