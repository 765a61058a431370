//! Wire codecs of the TCP data plane: frames between ranks and the connection handshake.
//!
//! Everything here is a total function: any byte sequence decodes to `Ok` or to a typed error,
//! never a panic, and nothing is allocated on a peer's say-so beyond the configured limits.
//! All integers are little-endian.
//!
//! # Frames
//!
//! Every message on an established connection is a fixed [`HEADER_LEN`]-byte (40) header
//! followed by `payload_len` payload bytes. The header is laid out so that a driver can read it,
//! decide where the payload goes, and read the payload *directly* into its destination buffer;
//! and so that a sender can write header and payload with one vectored write, without copying
//! the payload. Every field is naturally aligned.
//!
//! | offset | size | field | meaning |
//! |---:|---:|---|---|
//! | 0 | 4 | magic | [`FRAME_MAGIC`], the bytes `CoHF` |
//! | 4 | 2 | version | [`PROTOCOL_VERSION`] |
//! | 6 | 1 | kind | [`FrameKind`]: 1 data, 2 p2p, 3 heartbeat, 4 error, 5 abort, 6 goodbye, 7 stuck |
//! | 7 | 1 | flags | [`FrameHeader::flags`]: no bits defined; senders write 0 |
//! | 8 | 4 | group | [`GroupId`](crate::work::GroupId) |
//! | 12 | 4 | source | [`Rank`](crate::work::Rank) of the sender |
//! | 16 | 8 | seq | [`SeqNo`](crate::work::SeqNo): collective or p2p sequence number |
//! | 24 | 4 | step | step of the collective's schedule |
//! | 28 | 4 | tag | send/recv tag (p2p frames) |
//! | 32 | 8 | payload_len | payload bytes that follow the header |
//!
//! [`FrameHeader::decode`] checks the magic, the version, the kind, the payload length against
//! [`FrameLimits::max_payload`] (1 GiB by default), that heartbeat and goodbye frames carry no
//! payload, and that error and abort messages (UTF-8 text, see [`decode_message`]) are at most
//! [`MAX_MESSAGE_LEN`] bytes. [`FrameDecoder`] is the streaming decoder over the same format:
//! the TCP transport reads every connection with it (large payloads straight into pooled
//! buffers, the sender checked against the connection's peer), and the fuzzers drive it.
//!
//! # Handshake
//!
//! The first bytes on every new connection, in both directions, are a fixed
//! [`HANDSHAKE_LEN`]-byte (56) [`Handshake`]:
//!
//! | offset | size | field | meaning |
//! |---:|---:|---|---|
//! | 0 | 4 | magic | [`HANDSHAKE_MAGIC`], the bytes `CoHS` |
//! | 4 | 2 | version | [`PROTOCOL_VERSION`] |
//! | 6 | 2 | connection | connection index: a pair of ranks may hold several connections |
//! | 8 | 4 | group | group id the connection serves |
//! | 12 | 4 | rank | the sender's rank |
//! | 16 | 4 | world size | the sender's world size |
//! | 20 | 1 | flags | bit 0: the sender authenticates (see [`auth`]); bit 1: it can share memory (see [`crate::shm`]); other bits 0 |
//! | 21 | 1 | connections per peer (both sides must agree) | 1 and up |
//! | 22 | 2 | reserved | 0 |
//! | 24 | 32 | auth challenge | the sender's fresh [`AuthNonce`], or 32 zero bytes |
//!
//! The magic and version keep their offsets in every version, and the handshake stays 56 bytes,
//! so a build always reads a peer's whole handshake and can name a version mismatch.
//!
//! Each side then checks the other's handshake ([`Handshake::check`]) and answers with a
//! [`HandshakeReply`]: a [`REPLY_PREFIX_LEN`]-byte (4) prefix and an optional UTF-8 message, so
//! that *both* sides learn why a connection was refused.
//!
//! | offset | size | field | meaning |
//! |---:|---:|---|---|
//! | 0 | 1 | code | 0: accept; otherwise a [`RejectReason`] code |
//! | 1 | 1 | reserved | 0 |
//! | 2 | 2 | message length | bytes of UTF-8 message that follow, at most [`MAX_REPLY_MESSAGE_LEN`]; 0 for accept |
//!
//! The connection sequence, for each side: write own handshake; read the peer's (decode and
//! check it); write the reply; read the peer's reply. The connection is up when both replies
//! accept. With a shared secret, each side also writes its [`PROOF_LEN`]-byte proof after
//! reading the peer's handshake, and reads and checks the peer's before writing its reply (see
//! [`auth`]): a side that authenticates writes a proof, a side whose peer's handshake has the
//! auth flag reads one.

pub mod auth;
mod control;
mod decoder;
mod failure;
mod frame;
mod handshake;

pub use auth::{AuthNonce, AuthSecret, NONCE_LEN, PROOF_LEN, Role, proof, verify};
pub use control::{ControlError, ControlFrame, decode_control, encode_control};
pub use decoder::{DEFAULT_STAGING, FrameDecoder, FreshBuffers, PayloadBuffers};
pub use failure::{FailureRecord, ProgressRecord, RecordError};
pub use frame::{
    FRAME_MAGIC, Fingerprint, Frame, FrameError, FrameHeader, FrameKind, FrameLimits, HEADER_LEN, MAX_MESSAGE_LEN,
    decode_message, truncate_message,
};
pub use handshake::{
    HANDSHAKE_LEN, HANDSHAKE_MAGIC, Handshake, HandshakeError, HandshakeExpectation, HandshakeReply,
    MAX_REPLY_MESSAGE_LEN, REPLY_PREFIX_LEN, RejectReason, ReplyPrefix,
};

/// The protocol version this build speaks, in frame headers and handshakes.
///
/// Two builds may meet only if they would run every call the same way: it changes with the
/// bytes on the wire and with the schedule a collective's size and group pick (the ranks of a
/// group choose theirs apart, from the same inputs, and a rank that picked another would wait
/// for frames its peers never send). A peer of another version is refused at the handshake,
/// with both versions named. Version 2: allreduces of a power-of-two group of at least four
/// ranks halve and double up to 1 MiB (version 1 ran a ring above 256 KiB).
pub const PROTOCOL_VERSION: u16 = 2;

/// Copies `N` bytes out of `bytes` at offset `at`. Offsets are compile-time constants of the
/// layouts above, so the bounds check folds away.
fn read_array<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}
