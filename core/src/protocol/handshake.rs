//! The connection handshake and its reply.

use std::fmt;

use super::auth::AuthNonce;
use super::{PROTOCOL_VERSION, read_array};
use crate::work::{GroupId, Rank};

/// Size of an encoded [`Handshake`] in bytes.
pub const HANDSHAKE_LEN: usize = 56;

/// The first four bytes of every handshake: `CoHS` on the wire (distinct from the frame magic).
pub const HANDSHAKE_MAGIC: u32 = u32::from_le_bytes(*b"CoHS");

/// Size of a [`HandshakeReply`]'s fixed prefix in bytes.
pub const REPLY_PREFIX_LEN: usize = 4;

/// Largest message a rejecting [`HandshakeReply`] carries, in bytes. Longer ones are cut on a
/// character boundary when encoded and refused when decoded.
pub const MAX_REPLY_MESSAGE_LEN: usize = 4096;

/// Flag bit: the sender authenticates; the handshake carries its challenge.
const FLAG_AUTH: u8 = 0b1;

/// Flag bit: the sender can share memory with a peer on its host (see
/// [`crate::shm`]); when both sides of a pair's first connection set it, the dialer offers a
/// segment right after the replies.
const FLAG_SHM: u8 = 0b10;

/// What a rank says about itself when it opens (or accepts) a connection. See the
/// [module docs](super) for the layout and the connection sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handshake {
    /// The group the connection serves.
    pub group: GroupId,
    /// The sender's rank.
    pub rank: Rank,
    /// The sender's world size.
    pub world_size: u32,
    /// Which of the connections between this pair of ranks this is (0-based).
    pub connection: u16,
    /// How many connections the sender opens to each peer (both sides must agree).
    pub connections_per_peer: u8,
    /// The sender's challenge, when it authenticates (see [`super::auth`]).
    pub auth_nonce: Option<AuthNonce>,
    /// The sender can share memory with a peer on its host (see [`crate::shm`]).
    pub shares_memory: bool,
}

impl Handshake {
    /// The handshake's [`HANDSHAKE_LEN`] bytes, version [`PROTOCOL_VERSION`].
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut out = [0u8; HANDSHAKE_LEN];
        out[0..4].copy_from_slice(&HANDSHAKE_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&self.connection.to_le_bytes());
        out[8..12].copy_from_slice(&self.group.0.to_le_bytes());
        out[12..16].copy_from_slice(&self.rank.0.to_le_bytes());
        out[16..20].copy_from_slice(&self.world_size.to_le_bytes());
        out[21] = self.connections_per_peer;
        if self.shares_memory {
            out[20] |= FLAG_SHM;
        }
        if let Some(nonce) = &self.auth_nonce {
            out[20] |= FLAG_AUTH;
            out[24..56].copy_from_slice(&nonce.0);
        }
        out
    }

    /// Decodes a handshake. Total: refuses a bad magic, another protocol version, unknown flag
    /// bits, non-zero reserved bytes, and challenge bytes without the auth flag. Whether the
    /// handshake fits this rank is [`Handshake::check`]'s business.
    pub fn decode(bytes: &[u8; HANDSHAKE_LEN]) -> Result<Handshake, HandshakeError> {
        let magic = u32::from_le_bytes(read_array(bytes, 0));
        if magic != HANDSHAKE_MAGIC {
            return Err(HandshakeError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes(read_array(bytes, 4));
        if version != PROTOCOL_VERSION {
            return Err(HandshakeError::VersionMismatch { peer: version });
        }
        let flags = bytes[20];
        if flags & !(FLAG_AUTH | FLAG_SHM) != 0 {
            return Err(HandshakeError::UnknownFlags { flags });
        }
        if let Some((offset, found)) = (22..24).map(|i| (i, bytes[i])).find(|&(_, b)| b != 0) {
            return Err(HandshakeError::ReservedNotZero { offset, found });
        }
        let nonce: [u8; 32] = read_array(bytes, 24);
        let auth_nonce = if flags & FLAG_AUTH != 0 {
            Some(AuthNonce(nonce))
        } else if nonce.iter().any(|&b| b != 0) {
            return Err(HandshakeError::StrayAuthNonce);
        } else {
            None
        };
        Ok(Handshake {
            group: GroupId(u32::from_le_bytes(read_array(bytes, 8))),
            rank: Rank(u32::from_le_bytes(read_array(bytes, 12))),
            world_size: u32::from_le_bytes(read_array(bytes, 16)),
            connection: u16::from_le_bytes(read_array(bytes, 6)),
            connections_per_peer: bytes[21],
            auth_nonce,
            shares_memory: flags & FLAG_SHM != 0,
        })
    }

    /// Checks a peer's handshake against what this rank expects. Reports the first mismatch,
    /// in this order: group, world size, rank out of range, rank equal to this rank, rank other
    /// than the one dialled, connection index, authentication (whether both sides
    /// authenticate; the proofs that follow are checked by [`super::auth::verify`]).
    pub fn check(&self, expected: &HandshakeExpectation) -> Result<(), HandshakeError> {
        if self.group != expected.group {
            return Err(HandshakeError::GroupMismatch { peer: self.group, ours: expected.group });
        }
        if self.world_size != expected.world_size {
            return Err(HandshakeError::WorldSizeMismatch {
                peer_rank: self.rank,
                peer: self.world_size,
                ours: expected.world_size,
            });
        }
        if self.rank.0 >= expected.world_size {
            return Err(HandshakeError::RankOutOfRange { peer: self.rank, world_size: expected.world_size });
        }
        if self.rank == expected.rank {
            return Err(HandshakeError::RankIsSelf { peer: self.rank });
        }
        if let Some(dialled) = expected.peer
            && dialled != self.rank
        {
            return Err(HandshakeError::UnexpectedRank { peer: self.rank, dialled });
        }
        if u16::from(self.connections_per_peer) != expected.connections_per_peer {
            return Err(HandshakeError::ConnectionsPerPeerMismatch {
                peer_rank: self.rank,
                peer: self.connections_per_peer.into(),
                ours: expected.connections_per_peer,
            });
        }
        if self.connection >= expected.connections_per_peer {
            return Err(HandshakeError::ConnectionIndexOutOfRange {
                connection: self.connection,
                connections_per_peer: expected.connections_per_peer,
            });
        }
        match (self.auth_nonce.is_some(), expected.auth) {
            (false, false) | (true, true) => Ok(()),
            (false, true) => Err(HandshakeError::MissingAuth { peer_rank: self.rank }),
            (true, false) => Err(HandshakeError::UnexpectedAuth { peer_rank: self.rank }),
        }
    }
}

/// What this rank expects of a peer's [`Handshake`] on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeExpectation {
    /// The group the connection serves.
    pub group: GroupId,
    /// This rank (a peer claiming it is refused).
    pub rank: Rank,
    /// This rank's world size.
    pub world_size: u32,
    /// The rank this side dialled, if it dialled; `None` on the accepting side.
    pub peer: Option<Rank>,
    /// How many connections each pair of ranks opens; connection indices run below it.
    pub connections_per_peer: u16,
    /// Whether every peer must authenticate (this rank has a secret).
    pub auth: bool,
}

impl HandshakeExpectation {
    /// An expectation for `rank` of a `world_size`-rank `group`: any peer rank, one connection
    /// per peer, no authentication.
    pub const fn new(group: GroupId, rank: Rank, world_size: u32) -> Self {
        HandshakeExpectation { group, rank, world_size, peer: None, connections_per_peer: 1, auth: false }
    }

    /// The same, for a connection this side dialled to `peer`.
    pub const fn with_peer(mut self, peer: Rank) -> Self {
        self.peer = Some(peer);
        self
    }

    /// The same, with `connections_per_peer` connections between each pair of ranks.
    pub const fn with_connections_per_peer(mut self, connections_per_peer: u16) -> Self {
        self.connections_per_peer = connections_per_peer;
        self
    }

    /// The same, requiring peers to authenticate.
    pub const fn with_auth(mut self) -> Self {
        self.auth = true;
        self
    }

    /// The handshake this rank sends on connection `connection`, without a challenge (a rank
    /// that authenticates sets [`Handshake::auth_nonce`] to a fresh one).
    pub const fn handshake(&self, connection: u16) -> Handshake {
        Handshake {
            group: self.group,
            rank: self.rank,
            world_size: self.world_size,
            connection,
            connections_per_peer: if self.connections_per_peer > u8::MAX as u16 {
                u8::MAX
            } else {
                self.connections_per_peer as u8
            },
            auth_nonce: None,
            shares_memory: false,
        }
    }
}

/// Why a handshake was refused, as sent in a [`HandshakeReply`]. The wire code of each reason
/// is given in its doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// Code 7. Authentication missing, unexpected or failed.
    Auth,
    /// Code 1. The handshake did not decode (magic, flags, reserved bytes).
    BadHandshake,
    /// Code 6. Connection index out of range.
    ConnectionIndex,
    /// Code 3. The peer is in another group.
    GroupMismatch,
    /// Code 8. Refused by the driver for a reason of its own (a duplicate connection…).
    Other,
    /// Code 5. The peer's rank is out of range, this rank's, or not the one dialled.
    RankMismatch,
    /// Code 2. Another protocol version.
    VersionMismatch,
    /// Code 4. The peer has another world size.
    WorldSizeMismatch,
}

impl RejectReason {
    /// Every reason, in declaration order.
    pub const ALL: [RejectReason; 8] = [
        RejectReason::Auth,
        RejectReason::BadHandshake,
        RejectReason::ConnectionIndex,
        RejectReason::GroupMismatch,
        RejectReason::Other,
        RejectReason::RankMismatch,
        RejectReason::VersionMismatch,
        RejectReason::WorldSizeMismatch,
    ];

    /// The reason's code on the wire (never 0, which means accept).
    pub const fn code(self) -> u8 {
        match self {
            RejectReason::BadHandshake => 1,
            RejectReason::VersionMismatch => 2,
            RejectReason::GroupMismatch => 3,
            RejectReason::WorldSizeMismatch => 4,
            RejectReason::RankMismatch => 5,
            RejectReason::ConnectionIndex => 6,
            RejectReason::Auth => 7,
            RejectReason::Other => 8,
        }
    }

    /// The reason with wire code `code`, if there is one.
    pub const fn from_code(code: u8) -> Option<RejectReason> {
        match code {
            1 => Some(RejectReason::BadHandshake),
            2 => Some(RejectReason::VersionMismatch),
            3 => Some(RejectReason::GroupMismatch),
            4 => Some(RejectReason::WorldSizeMismatch),
            5 => Some(RejectReason::RankMismatch),
            6 => Some(RejectReason::ConnectionIndex),
            7 => Some(RejectReason::Auth),
            8 => Some(RejectReason::Other),
            _ => None,
        }
    }

    /// Lower-case name, as used in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            RejectReason::Auth => "authentication",
            RejectReason::BadHandshake => "bad handshake",
            RejectReason::ConnectionIndex => "connection index",
            RejectReason::GroupMismatch => "group mismatch",
            RejectReason::Other => "refused",
            RejectReason::RankMismatch => "rank mismatch",
            RejectReason::VersionMismatch => "version mismatch",
            RejectReason::WorldSizeMismatch => "world size mismatch",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The answer to a peer's handshake, so that both sides learn why a connection was refused.
/// See the [module docs](super) for the layout.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HandshakeReply {
    /// The handshake was accepted.
    Accept,
    /// The handshake was refused.
    Reject {
        /// Why, as a code.
        reason: RejectReason,
        /// Why, in words (at most [`MAX_REPLY_MESSAGE_LEN`] bytes of UTF-8), from the refusing
        /// side's point of view: "peer" in it is the side that receives the reply.
        message: String,
    },
}

impl HandshakeReply {
    /// The rejection that reports `error` to the peer.
    pub fn reject(error: &HandshakeError) -> HandshakeReply {
        HandshakeReply::Reject { reason: error.reject_reason(), message: error.to_string() }
    }

    /// The reply's bytes: [`REPLY_PREFIX_LEN`] bytes and the message, cut to
    /// [`MAX_REPLY_MESSAGE_LEN`] bytes on a character boundary.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            HandshakeReply::Accept => vec![0; REPLY_PREFIX_LEN],
            HandshakeReply::Reject { reason, message } => {
                let message = &message[..message.floor_char_boundary(MAX_REPLY_MESSAGE_LEN)];
                // The cut above keeps the length within MAX_REPLY_MESSAGE_LEN, below u16::MAX.
                let len = message.len() as u16;
                let mut out = Vec::with_capacity(REPLY_PREFIX_LEN + message.len());
                out.extend_from_slice(&[reason.code(), 0]);
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(message.as_bytes());
                out
            }
        }
    }

    /// Decodes a whole reply (prefix and message, nothing more). Total.
    pub fn decode(bytes: &[u8]) -> Result<HandshakeReply, HandshakeError> {
        let Some((prefix, message)) = bytes.split_first_chunk::<REPLY_PREFIX_LEN>() else {
            return Err(HandshakeError::ReplyLength { expected: REPLY_PREFIX_LEN, found: bytes.len() });
        };
        ReplyPrefix::decode(prefix)?.finish(message)
    }

    /// `Ok` for an accept, [`HandshakeError::Rejected`] for a rejection.
    pub fn into_result(self) -> Result<(), HandshakeError> {
        match self {
            HandshakeReply::Accept => Ok(()),
            HandshakeReply::Reject { reason, message } => Err(HandshakeError::Rejected { reason, message }),
        }
    }
}

/// A decoded reply prefix: whether the reply accepts, and how many message bytes follow. A
/// driver reads [`REPLY_PREFIX_LEN`] bytes, decodes them, reads
/// [`ReplyPrefix::message_len`] more and hands them to [`ReplyPrefix::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyPrefix {
    reason: Option<RejectReason>,
    message_len: u16,
}

impl ReplyPrefix {
    /// Decodes a reply prefix. Total: refuses unknown codes, a non-zero reserved byte, an
    /// accept announcing a message, and a message over [`MAX_REPLY_MESSAGE_LEN`] bytes.
    pub fn decode(bytes: &[u8; REPLY_PREFIX_LEN]) -> Result<ReplyPrefix, HandshakeError> {
        let code = bytes[0];
        let reason = match code {
            0 => None,
            _ => Some(RejectReason::from_code(code).ok_or(HandshakeError::UnknownReplyCode { code })?),
        };
        if bytes[1] != 0 {
            return Err(HandshakeError::ReplyReservedNotZero { found: bytes[1] });
        }
        let message_len = u16::from_le_bytes(read_array(bytes, 2));
        if reason.is_none() && message_len != 0 {
            return Err(HandshakeError::AcceptWithMessage { len: message_len });
        }
        if usize::from(message_len) > MAX_REPLY_MESSAGE_LEN {
            return Err(HandshakeError::ReplyMessageTooLong { len: message_len });
        }
        Ok(ReplyPrefix { reason, message_len })
    }

    /// How many message bytes follow the prefix.
    pub fn message_len(&self) -> usize {
        usize::from(self.message_len)
    }

    /// The whole reply, given the message bytes that followed the prefix (exactly
    /// [`ReplyPrefix::message_len`] of them, UTF-8).
    pub fn finish(self, message: &[u8]) -> Result<HandshakeReply, HandshakeError> {
        if message.len() != self.message_len() {
            return Err(HandshakeError::ReplyLength {
                expected: REPLY_PREFIX_LEN + self.message_len(),
                found: REPLY_PREFIX_LEN + message.len(),
            });
        }
        let Some(reason) = self.reason else {
            return Ok(HandshakeReply::Accept);
        };
        let message = std::str::from_utf8(message)
            .map_err(|e| HandshakeError::ReplyMessageNotUtf8 { valid_up_to: e.valid_up_to() })?;
        Ok(HandshakeReply::Reject { reason, message: message.to_owned() })
    }
}

/// A handshake or handshake reply that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The first four bytes are not [`HANDSHAKE_MAGIC`]: the peer does not speak this protocol.
    #[error("bad handshake magic {found:#010x} (expected {HANDSHAKE_MAGIC:#010x}): the peer is not a cohort rank")]
    BadMagic {
        /// The magic received.
        found: u32,
    },
    /// The peer speaks another protocol version.
    #[error("protocol version {peer} from peer, this build speaks {PROTOCOL_VERSION}")]
    VersionMismatch {
        /// The peer's version.
        peer: u16,
    },
    /// Flag bits this version does not define.
    #[error("unknown handshake flags {flags:#04x}")]
    UnknownFlags {
        /// The flags byte received.
        flags: u8,
    },
    /// A reserved handshake byte is not zero.
    #[error("handshake reserved byte {offset} is {found:#04x}, expected 0")]
    ReservedNotZero {
        /// Offset of the byte in the handshake.
        offset: usize,
        /// Its value.
        found: u8,
    },
    /// Challenge bytes without the flag that says the sender authenticates.
    #[error("handshake carries auth challenge bytes but its auth flag is clear")]
    StrayAuthNonce,
    /// The peer serves another group.
    #[error("peer says group {peer}, this connection is for group {ours}")]
    GroupMismatch {
        /// The peer's group.
        peer: GroupId,
        /// This connection's group.
        ours: GroupId,
    },
    /// The peer has another world size.
    #[error("peer rank {peer_rank} says world size {peer}, this rank has {ours}")]
    WorldSizeMismatch {
        /// The peer's rank.
        peer_rank: Rank,
        /// The peer's world size.
        peer: u32,
        /// This rank's world size.
        ours: u32,
    },
    /// The peer's rank is not below the world size.
    #[error("peer claims rank {peer} but world size is {world_size}")]
    RankOutOfRange {
        /// The rank claimed.
        peer: Rank,
        /// The world size.
        world_size: u32,
    },
    /// The peer claims this rank's own rank.
    #[error("peer claims to be rank {peer}, which is this rank")]
    RankIsSelf {
        /// The rank claimed.
        peer: Rank,
    },
    /// The peer is not the rank this side dialled.
    #[error("peer claims rank {peer}, but this connection was dialled to rank {dialled}")]
    UnexpectedRank {
        /// The rank claimed.
        peer: Rank,
        /// The rank dialled.
        dialled: Rank,
    },
    /// The connection index is not below the configured connections per peer.
    #[error("peer opened connection {connection}, but only {connections_per_peer} connections per peer are configured")]
    ConnectionIndexOutOfRange {
        /// The index received.
        connection: u16,
        /// The configured connections per peer.
        connections_per_peer: u16,
    },
    /// The peer opens another number of connections to each peer.
    #[error(
        "peer rank {peer_rank} opens {peer} connection(s) per peer, this rank opens {ours}: every rank must use the same number"
    )]
    ConnectionsPerPeerMismatch {
        /// The peer's rank.
        peer_rank: Rank,
        /// The peer's connections per peer.
        peer: u16,
        /// This rank's.
        ours: u16,
    },
    /// The peer's proof is wrong: the two sides have different secrets.
    #[error(
        "peer rank {peer_rank}'s proof of the shared secret is wrong: the two sides have different secrets (COHORT_AUTH_TOKEN)"
    )]
    AuthMismatch {
        /// The rank the peer claims.
        peer_rank: Rank,
    },
    /// This rank requires authentication and the peer does not authenticate.
    #[error("peer rank {peer_rank} does not authenticate, and this rank requires it (COHORT_AUTH_TOKEN is set here)")]
    MissingAuth {
        /// The rank the peer claims.
        peer_rank: Rank,
    },
    /// The peer authenticates and this rank has no secret.
    #[error("peer rank {peer_rank} authenticates, and this rank has no secret (COHORT_AUTH_TOKEN is not set here)")]
    UnexpectedAuth {
        /// The rank the peer claims.
        peer_rank: Rank,
    },
    /// The peer refused this side's handshake.
    #[error("the peer refused the handshake ({reason}): {message}")]
    Rejected {
        /// Its reason code.
        reason: RejectReason,
        /// Its message, from its point of view ("peer" is this side).
        message: String,
    },
    /// A reply code that names no [`RejectReason`].
    #[error("unknown handshake reply code {code}")]
    UnknownReplyCode {
        /// The code received.
        code: u8,
    },
    /// The reply's reserved byte is not zero.
    #[error("handshake reply reserved byte is {found:#04x}, expected 0")]
    ReplyReservedNotZero {
        /// Its value.
        found: u8,
    },
    /// An accepting reply announces a message.
    #[error("handshake accept announces a {len}-byte message, accepts carry none")]
    AcceptWithMessage {
        /// The length announced.
        len: u16,
    },
    /// A reply message over [`MAX_REPLY_MESSAGE_LEN`] bytes.
    #[error("handshake reply message of {len} bytes exceeds the limit of {MAX_REPLY_MESSAGE_LEN}")]
    ReplyMessageTooLong {
        /// The length announced.
        len: u16,
    },
    /// A reply message that is not UTF-8.
    #[error("handshake reply message is not valid utf-8 (valid up to byte {valid_up_to})")]
    ReplyMessageNotUtf8 {
        /// Length of the valid UTF-8 prefix.
        valid_up_to: usize,
    },
    /// A reply of the wrong length.
    #[error("handshake reply is {found} bytes, expected {expected}")]
    ReplyLength {
        /// The length its prefix announces (or the prefix length, when even that is missing).
        expected: usize,
        /// The length received.
        found: usize,
    },
}

impl HandshakeError {
    /// The rank a peer claimed, when it is refused for how it authenticated (a wrong proof,
    /// none where one is required, one where none is).
    pub fn unauthenticated_rank(&self) -> Option<Rank> {
        match self {
            HandshakeError::AuthMismatch { peer_rank }
            | HandshakeError::MissingAuth { peer_rank }
            | HandshakeError::UnexpectedAuth { peer_rank } => Some(*peer_rank),
            _ => None,
        }
    }

    /// The reason code that reports this error to the peer in a [`HandshakeReply`].
    pub fn reject_reason(&self) -> RejectReason {
        match self {
            HandshakeError::VersionMismatch { .. } => RejectReason::VersionMismatch,
            HandshakeError::GroupMismatch { .. } => RejectReason::GroupMismatch,
            HandshakeError::WorldSizeMismatch { .. } => RejectReason::WorldSizeMismatch,
            HandshakeError::RankOutOfRange { .. }
            | HandshakeError::RankIsSelf { .. }
            | HandshakeError::UnexpectedRank { .. } => RejectReason::RankMismatch,
            HandshakeError::ConnectionIndexOutOfRange { .. } | HandshakeError::ConnectionsPerPeerMismatch { .. } => {
                RejectReason::ConnectionIndex
            }
            HandshakeError::AuthMismatch { .. }
            | HandshakeError::MissingAuth { .. }
            | HandshakeError::UnexpectedAuth { .. } => RejectReason::Auth,
            HandshakeError::BadMagic { .. }
            | HandshakeError::UnknownFlags { .. }
            | HandshakeError::ReservedNotZero { .. }
            | HandshakeError::StrayAuthNonce => RejectReason::BadHandshake,
            HandshakeError::Rejected { .. }
            | HandshakeError::UnknownReplyCode { .. }
            | HandshakeError::ReplyReservedNotZero { .. }
            | HandshakeError::AcceptWithMessage { .. }
            | HandshakeError::ReplyMessageTooLong { .. }
            | HandshakeError::ReplyMessageNotUtf8 { .. }
            | HandshakeError::ReplyLength { .. } => RejectReason::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONCE: AuthNonce = AuthNonce([7; 32]);

    fn expectation() -> HandshakeExpectation {
        HandshakeExpectation::new(GroupId(0), Rank(0), 4).with_connections_per_peer(2)
    }

    fn peer() -> Handshake {
        HandshakeExpectation::new(GroupId(0), Rank(2), 4).with_connections_per_peer(2).handshake(1)
    }

    fn check(h: Handshake, e: HandshakeExpectation) -> String {
        h.check(&e).unwrap_err().to_string()
    }

    #[test]
    fn handshake_round_trips_with_and_without_a_challenge() {
        let plain = peer();
        assert_eq!(Handshake::decode(&plain.encode()), Ok(plain));
        let with_nonce = Handshake { auth_nonce: Some(NONCE), ..peer() };
        assert_eq!(Handshake::decode(&with_nonce.encode()), Ok(with_nonce));
        let sharing = Handshake { shares_memory: true, ..with_nonce };
        assert_eq!(Handshake::decode(&sharing.encode()), Ok(sharing));
    }

    #[test]
    fn handshake_layout_matches_the_documented_offsets() {
        let h = Handshake {
            group: GroupId(0x0a0b_0c0d),
            rank: Rank(3),
            world_size: 8,
            connection: 0x0102,
            connections_per_peer: 4,
            auth_nonce: Some(AuthNonce([0xee; 32])),
            shares_memory: true,
        };
        let b = h.encode();
        assert_eq!(&b[0..4], b"CoHS");
        assert_eq!(&b[4..6], &[2, 0]);
        assert_eq!(&b[6..8], &[2, 1]);
        assert_eq!(&b[8..12], &[0x0d, 0x0c, 0x0b, 0x0a]);
        assert_eq!(&b[12..16], &[3, 0, 0, 0]);
        assert_eq!(&b[16..20], &[8, 0, 0, 0]);
        assert_eq!(&b[20..24], &[3, 4, 0, 0], "flags: auth and shared memory");
        assert_eq!(&b[24..56], &[0xee; 32]);
    }

    #[test]
    fn decode_refuses_bad_magic_including_a_frame() {
        let mut b = peer().encode();
        b[0..4].copy_from_slice(b"CoHF");
        let err = Handshake::decode(&b).unwrap_err();
        assert_eq!(err, HandshakeError::BadMagic { found: u32::from_le_bytes(*b"CoHF") });
        assert_eq!(
            err.to_string(),
            "bad handshake magic 0x46486f43 (expected 0x53486f43): the peer is not a cohort rank"
        );
    }

    #[test]
    fn decode_names_a_version_mismatch() {
        let mut b = peer().encode();
        b[4..6].copy_from_slice(&1u16.to_le_bytes());
        let err = Handshake::decode(&b).unwrap_err();
        assert_eq!(err, HandshakeError::VersionMismatch { peer: 1 });
        assert_eq!(err.to_string(), "protocol version 1 from peer, this build speaks 2");
    }

    #[test]
    fn decode_refuses_unknown_flags_reserved_bytes_and_stray_challenges() {
        let mut b = peer().encode();
        b[20] = 0x05;
        assert_eq!(Handshake::decode(&b), Err(HandshakeError::UnknownFlags { flags: 0x05 }));
        assert_eq!(HandshakeError::UnknownFlags { flags: 5 }.to_string(), "unknown handshake flags 0x05");

        let mut b = peer().encode();
        b[22] = 9;
        let err = Handshake::decode(&b).unwrap_err();
        assert_eq!(err, HandshakeError::ReservedNotZero { offset: 22, found: 9 });
        assert_eq!(err.to_string(), "handshake reserved byte 22 is 0x09, expected 0");

        let mut b = peer().encode();
        b[40] = 1;
        let err = Handshake::decode(&b).unwrap_err();
        assert_eq!(err, HandshakeError::StrayAuthNonce);
        assert_eq!(err.to_string(), "handshake carries auth challenge bytes but its auth flag is clear");
    }

    #[test]
    fn check_accepts_a_matching_peer() {
        assert_eq!(peer().check(&expectation()), Ok(()));
        assert_eq!(peer().check(&expectation().with_peer(Rank(2))), Ok(()));
        let with_nonce = Handshake { auth_nonce: Some(NONCE), ..peer() };
        assert_eq!(with_nonce.check(&expectation().with_auth()), Ok(()));
    }

    #[test]
    fn check_names_a_group_mismatch() {
        let h = Handshake { group: GroupId(1), ..peer() };
        assert_eq!(check(h, expectation()), "peer says group 1, this connection is for group 0");
    }

    #[test]
    fn check_names_a_world_size_mismatch() {
        let h = Handshake { world_size: 3, ..peer() };
        assert_eq!(check(h, expectation()), "peer rank 2 says world size 3, this rank has 4");
    }

    #[test]
    fn check_refuses_ranks_out_of_range_self_and_not_dialled() {
        let h = Handshake { rank: Rank(5), ..peer() };
        assert_eq!(check(h, expectation()), "peer claims rank 5 but world size is 4");
        let h = Handshake { rank: Rank(0), ..peer() };
        assert_eq!(check(h, expectation()), "peer claims to be rank 0, which is this rank");
        assert_eq!(
            check(peer(), expectation().with_peer(Rank(3))),
            "peer claims rank 2, but this connection was dialled to rank 3"
        );
    }

    #[test]
    fn check_refuses_connection_indices_out_of_range() {
        let h = Handshake { connection: 2, ..peer() };
        assert_eq!(check(h, expectation()), "peer opened connection 2, but only 2 connections per peer are configured");
    }

    #[test]
    fn check_names_a_connections_per_peer_mismatch() {
        let h = Handshake { connections_per_peer: 1, connection: 0, ..peer() };
        assert_eq!(
            check(h, expectation()),
            "peer rank 2 opens 1 connection(s) per peer, this rank opens 2: every rank must use the same number"
        );
        assert_eq!(h.check(&expectation().with_connections_per_peer(1)), Ok(()));
    }

    #[test]
    fn check_refuses_a_peer_that_authenticates_differently() {
        let with_nonce = Handshake { auth_nonce: Some(NONCE), ..peer() };
        assert_eq!(
            check(peer(), expectation().with_auth()),
            "peer rank 2 does not authenticate, and this rank requires it (COHORT_AUTH_TOKEN is set here)"
        );
        assert_eq!(
            check(with_nonce, expectation()),
            "peer rank 2 authenticates, and this rank has no secret (COHORT_AUTH_TOKEN is not set here)"
        );
    }

    #[test]
    fn replies_round_trip_and_both_sides_learn_the_reason() {
        assert_eq!(HandshakeReply::Accept.encode(), vec![0; REPLY_PREFIX_LEN]);
        assert_eq!(HandshakeReply::decode(&HandshakeReply::Accept.encode()), Ok(HandshakeReply::Accept));

        let refused = Handshake { world_size: 3, ..peer() };
        let err = refused.check(&expectation()).unwrap_err();
        let reply = HandshakeReply::reject(&err);
        let decoded = HandshakeReply::decode(&reply.encode()).unwrap();
        assert_eq!(decoded, reply);
        let on_the_other_side = decoded.into_result().unwrap_err();
        assert_eq!(
            on_the_other_side.to_string(),
            "the peer refused the handshake (world size mismatch): peer rank 2 says world size 3, this rank has 4"
        );
        assert_eq!(HandshakeReply::Accept.into_result(), Ok(()));
    }

    #[test]
    fn every_reject_reason_round_trips() {
        for reason in RejectReason::ALL {
            assert_eq!(RejectReason::from_code(reason.code()), Some(reason));
            let reply = HandshakeReply::Reject { reason, message: reason.to_string() };
            assert_eq!(HandshakeReply::decode(&reply.encode()), Ok(reply));
        }
        assert_eq!(RejectReason::from_code(0), None);
    }

    #[test]
    fn long_reply_messages_are_cut_on_a_char_boundary() {
        let message = format!("x{}", "é".repeat(MAX_REPLY_MESSAGE_LEN));
        let reply = HandshakeReply::Reject { reason: RejectReason::Other, message };
        let bytes = reply.encode();
        assert_eq!(bytes.len(), REPLY_PREFIX_LEN + MAX_REPLY_MESSAGE_LEN - 1);
        let HandshakeReply::Reject { message, .. } = HandshakeReply::decode(&bytes).unwrap() else {
            panic!("expected a rejection")
        };
        assert_eq!(message.len(), MAX_REPLY_MESSAGE_LEN - 1);
    }

    #[test]
    fn reply_decode_refuses_every_malformed_reply() {
        let cases: [(&[u8], HandshakeError, &str); 7] = [
            (&[9, 0, 0, 0], HandshakeError::UnknownReplyCode { code: 9 }, "unknown handshake reply code 9"),
            (
                &[0, 1, 0, 0],
                HandshakeError::ReplyReservedNotZero { found: 1 },
                "handshake reply reserved byte is 0x01, expected 0",
            ),
            (
                &[0, 0, 2, 0, b'h', b'i'],
                HandshakeError::AcceptWithMessage { len: 2 },
                "handshake accept announces a 2-byte message, accepts carry none",
            ),
            (
                &[8, 0, 0x01, 0x10],
                HandshakeError::ReplyMessageTooLong { len: 4097 },
                "handshake reply message of 4097 bytes exceeds the limit of 4096",
            ),
            (
                &[8, 0, 2, 0, 0xff, 0xfe],
                HandshakeError::ReplyMessageNotUtf8 { valid_up_to: 0 },
                "handshake reply message is not valid utf-8 (valid up to byte 0)",
            ),
            (
                &[8, 0, 3, 0, b'a'],
                HandshakeError::ReplyLength { expected: 7, found: 5 },
                "handshake reply is 5 bytes, expected 7",
            ),
            (&[0, 0], HandshakeError::ReplyLength { expected: 4, found: 2 }, "handshake reply is 2 bytes, expected 4"),
        ];
        for (bytes, error, message) in cases {
            assert_eq!(HandshakeReply::decode(bytes), Err(error.clone()), "{bytes:?}");
            assert_eq!(error.to_string(), message);
        }
    }

    #[test]
    fn reply_prefix_tells_how_much_message_follows() {
        let reply = HandshakeReply::Reject { reason: RejectReason::Auth, message: "wrong proof".into() };
        let bytes = reply.encode();
        let prefix = ReplyPrefix::decode(bytes.first_chunk().expect("a reply has a prefix")).unwrap();
        assert_eq!(prefix.message_len(), "wrong proof".len());
        assert_eq!(prefix.finish(&bytes[REPLY_PREFIX_LEN..]), Ok(reply));
    }

    #[test]
    fn every_error_maps_to_the_reason_the_peer_is_told() {
        let cases = [
            (HandshakeError::BadMagic { found: 0 }, RejectReason::BadHandshake),
            (HandshakeError::VersionMismatch { peer: 1 }, RejectReason::VersionMismatch),
            (HandshakeError::GroupMismatch { peer: GroupId(1), ours: GroupId(0) }, RejectReason::GroupMismatch),
            (
                HandshakeError::WorldSizeMismatch { peer_rank: Rank(1), peer: 2, ours: 3 },
                RejectReason::WorldSizeMismatch,
            ),
            (HandshakeError::RankIsSelf { peer: Rank(0) }, RejectReason::RankMismatch),
            (
                HandshakeError::ConnectionIndexOutOfRange { connection: 3, connections_per_peer: 1 },
                RejectReason::ConnectionIndex,
            ),
            (
                HandshakeError::ConnectionsPerPeerMismatch { peer_rank: Rank(1), peer: 1, ours: 2 },
                RejectReason::ConnectionIndex,
            ),
            (HandshakeError::MissingAuth { peer_rank: Rank(1) }, RejectReason::Auth),
            (HandshakeError::ReplyLength { expected: 4, found: 0 }, RejectReason::Other),
        ];
        for (error, reason) in cases {
            assert_eq!(error.reject_reason(), reason, "{error}");
            assert_eq!(HandshakeReply::reject(&error), HandshakeReply::Reject { reason, message: error.to_string() });
        }
    }
}
