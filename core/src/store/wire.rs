//! The TCPStore wire protocol, byte for byte as PyTorch speaks it.
//!
//! Matched against PyTorch 2.15 (`torch/csrc/distributed/c10d/TCPStore.cpp`,
//! `store/TCPStoreBackend.hpp`, `TCPStoreLibUvBackend.cpp`):
//!
//! - A request is one [`QueryType`] byte followed by its arguments. There is no framing and no
//!   request id: replies come back in request order, and a reply's shape is known only from the
//!   request that asked for it (see [`ReplyKind`]).
//! - Integers are the host's native encoding in PyTorch; every platform PyTorch ships on is
//!   little-endian, so this codec writes and reads little-endian. Key and value lengths are
//!   `uint64_t` (C++ `size_t`), counters and results are `int64_t`, the validation magic and
//!   the ping nonce are `uint32_t`, and the CHECK / WAIT responses are one byte.
//! - A string or a byte vector is its length (u64) followed by its bytes. Keys are arbitrary
//!   bytes (C++ `std::string`); PyTorch's client prefixes every user key with `/`.
//! - The counts of CHECK, WAIT and MULTI_GET are u64; MULTI_SET's count is written by PyTorch's
//!   client as `int64_t` and read by its server as `uint64_t` (the same bytes for any valid
//!   count). BARRIER's world size is `int64_t`.
//! - VALIDATE carries [`VALIDATION_MAGIC`] and gets no reply; PING carries a nonce that the
//!   server echoes. SET, APPEND, MULTI_SET, QUEUE_PUSH and VALIDATE get no reply at all.
//!
//! Decoding is total: any bytes give a request, "need more bytes" or a [`DecodeError`], never a
//! panic; nothing is allocated on a length prefix's say-so (a prefix above [`DecodeLimits`] is
//! refused as soon as it is read, and bytes are copied only once they have arrived).

use std::fmt;

/// The magic number a client sends in VALIDATE, its first request (`validationMagicNumber`).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The first byte of every request: PyTorch's `c10d::detail::QueryType`, in its wire order.
///
/// The variants are listed in wire order (their discriminants are the wire bytes), not
/// alphabetically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
#[non_exhaustive]
pub enum QueryType {
    /// `VALIDATE` (0): the handshake, carrying [`VALIDATION_MAGIC`].
    Validate = 0,
    /// `SET` (1).
    Set = 1,
    /// `COMPARE_SET` (2).
    CompareSet = 2,
    /// `GET` (3).
    Get = 3,
    /// `ADD` (4).
    Add = 4,
    /// `CHECK` (5).
    Check = 5,
    /// `WAIT` (6).
    Wait = 6,
    /// `GETNUMKEYS` (7).
    GetNumKeys = 7,
    /// `DELETE_KEY` (8).
    DeleteKey = 8,
    /// `APPEND` (9).
    Append = 9,
    /// `MULTI_GET` (10).
    MultiGet = 10,
    /// `MULTI_SET` (11).
    MultiSet = 11,
    /// `CANCEL_WAIT` (12).
    CancelWait = 12,
    /// `PING` (13).
    Ping = 13,
    /// `QUEUE_PUSH` (14).
    QueuePush = 14,
    /// `QUEUE_POP` (15).
    QueuePop = 15,
    /// `QUEUE_LEN` (16).
    QueueLen = 16,
    /// `LIST_KEYS` (17).
    ListKeys = 17,
    /// `BARRIER` (18).
    Barrier = 18,
    /// `COHORT_AUTH` (0xC0), cohort's own: a client's challenge, when the store has a secret
    /// (see [`Request::Auth`]). PyTorch's clients never send it.
    CohortAuth = 0xC0,
    /// `COHORT_AUTH_PROOF` (0xC1), cohort's own: a client's proof ([`Request::AuthProof`]).
    CohortAuthProof = 0xC1,
}

impl QueryType {
    /// The query type for a wire byte, or `None` for a byte PyTorch does not define.
    pub fn from_byte(byte: u8) -> Option<Self> {
        use QueryType::*;
        Some(match byte {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            18 => Barrier,
            0xC0 => CohortAuth,
            0xC1 => CohortAuthProof,
            _ => return None,
        })
    }

    /// PyTorch's name for it (`"COMPARE_SET"`).
    pub fn name(self) -> &'static str {
        use QueryType::*;
        match self {
            Validate => "VALIDATE",
            Set => "SET",
            CompareSet => "COMPARE_SET",
            Get => "GET",
            Add => "ADD",
            Check => "CHECK",
            Wait => "WAIT",
            GetNumKeys => "GETNUMKEYS",
            DeleteKey => "DELETE_KEY",
            Append => "APPEND",
            MultiGet => "MULTI_GET",
            MultiSet => "MULTI_SET",
            CancelWait => "CANCEL_WAIT",
            Ping => "PING",
            QueuePush => "QUEUE_PUSH",
            QueuePop => "QUEUE_POP",
            QueueLen => "QUEUE_LEN",
            ListKeys => "LIST_KEYS",
            Barrier => "BARRIER",
            CohortAuth => "COHORT_AUTH",
            CohortAuthProof => "COHORT_AUTH_PROOF",
        }
    }
}

impl fmt::Display for QueryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The reply to CHECK (`CheckResponseType`, one byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CheckResponse {
    /// `READY` (0): every key exists.
    Ready = 0,
    /// `NOT_READY` (1): some key is missing.
    NotReady = 1,
}

/// The reply to WAIT, CANCEL_WAIT and BARRIER (`WaitResponseType`, one byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WaitResponse {
    /// `STOP_WAITING` (0): the awaited keys exist (or the barrier is complete).
    StopWaiting = 0,
    /// `WAIT_CANCELED` (1): the acknowledgement of CANCEL_WAIT.
    WaitCanceled = 1,
}

/// One request, as a client sends it. Keys and values are raw bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
    /// VALIDATE: the first request of every connection. No reply.
    Validate {
        /// Must be [`VALIDATION_MAGIC`]; the server closes the connection otherwise.
        magic: u32,
    },
    /// SET key value. No reply.
    Set {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// COMPARE_SET key expected desired. Reply: bytes (the value now stored, see
    /// [`StoreState::compare_set`](super::StoreState::compare_set)).
    CompareSet {
        /// The key.
        key: Vec<u8>,
        /// The value the key must hold (empty: the key must be missing).
        expected: Vec<u8>,
        /// The value to store when it does.
        desired: Vec<u8>,
    },
    /// GET key. Reply: bytes (empty for a missing key; PyTorch's client WAITs first).
    Get {
        /// The key.
        key: Vec<u8>,
    },
    /// ADD key delta. Reply: i64, the new value.
    Add {
        /// The key.
        key: Vec<u8>,
        /// The amount added.
        delta: i64,
    },
    /// CHECK keys. Reply: [`CheckResponse`].
    Check {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// WAIT keys. Reply: [`WaitResponse::StopWaiting`] once every key exists (possibly at once).
    Wait {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// GETNUMKEYS. Reply: i64.
    GetNumKeys,
    /// DELETE_KEY key. Reply: i64, 1 if the key existed, else 0.
    DeleteKey {
        /// The key.
        key: Vec<u8>,
    },
    /// APPEND key value. No reply.
    Append {
        /// The key.
        key: Vec<u8>,
        /// The bytes appended.
        value: Vec<u8>,
    },
    /// MULTI_GET keys. Reply: one byte vector per key.
    MultiGet {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// MULTI_SET (key, value)…. No reply.
    MultiSet {
        /// The pairs, in order.
        items: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// CANCEL_WAIT. Reply: [`WaitResponse::WaitCanceled`].
    CancelWait,
    /// PING nonce. Reply: the nonce (u32).
    Ping {
        /// Echoed back.
        nonce: u32,
    },
    /// QUEUE_PUSH key value. No reply.
    QueuePush {
        /// The queue's name.
        key: Vec<u8>,
        /// The item.
        value: Vec<u8>,
    },
    /// QUEUE_POP key. Reply: i64 queue length before the pop, then the item if it was positive.
    QueuePop {
        /// The queue's name.
        key: Vec<u8>,
    },
    /// QUEUE_LEN key. Reply: i64.
    QueueLen {
        /// The queue's name.
        key: Vec<u8>,
    },
    /// LIST_KEYS. Reply: i64 count, then each key as a string.
    ListKeys,
    /// BARRIER key world_size. Reply: [`WaitResponse::StopWaiting`] once `world_size` clients
    /// have arrived.
    Barrier {
        /// The barrier's counter key.
        key: Vec<u8>,
        /// How many arrivals complete it.
        world_size: i64,
    },
    /// COHORT_AUTH nonce: the client's challenge to a store that has a secret, right after
    /// VALIDATE. Reply: bytes, the server's nonce then its proof (see
    /// [`crate::protocol::auth`]: [`Role::StoreServer`](crate::protocol::Role::StoreServer)
    /// over the client's nonce, then the server's).
    Auth {
        /// The client's fresh nonce ([`NONCE_LEN`](crate::protocol::NONCE_LEN) bytes).
        nonce: Vec<u8>,
    },
    /// COHORT_AUTH_PROOF proof: the client's proof over both nonces. Reply: i64 1; a wrong one
    /// closes the connection.
    AuthProof {
        /// The proof ([`PROOF_LEN`](crate::protocol::PROOF_LEN) bytes).
        proof: Vec<u8>,
    },
}

impl Request {
    /// The request's query type.
    pub fn query_type(&self) -> QueryType {
        match self {
            Request::Validate { .. } => QueryType::Validate,
            Request::Set { .. } => QueryType::Set,
            Request::CompareSet { .. } => QueryType::CompareSet,
            Request::Get { .. } => QueryType::Get,
            Request::Add { .. } => QueryType::Add,
            Request::Check { .. } => QueryType::Check,
            Request::Wait { .. } => QueryType::Wait,
            Request::GetNumKeys => QueryType::GetNumKeys,
            Request::DeleteKey { .. } => QueryType::DeleteKey,
            Request::Append { .. } => QueryType::Append,
            Request::MultiGet { .. } => QueryType::MultiGet,
            Request::MultiSet { .. } => QueryType::MultiSet,
            Request::CancelWait => QueryType::CancelWait,
            Request::Ping { .. } => QueryType::Ping,
            Request::QueuePush { .. } => QueryType::QueuePush,
            Request::QueuePop { .. } => QueryType::QueuePop,
            Request::QueueLen { .. } => QueryType::QueueLen,
            Request::ListKeys => QueryType::ListKeys,
            Request::Barrier { .. } => QueryType::Barrier,
            Request::Auth { .. } => QueryType::CohortAuth,
            Request::AuthProof { .. } => QueryType::CohortAuthProof,
        }
    }

    /// The shape of the reply the server sends, or `None` when it sends none.
    ///
    /// WAIT and BARRIER answer with [`ReplyKind::Wait`], but possibly much later.
    pub fn reply_kind(&self) -> Option<ReplyKind> {
        match self {
            Request::Validate { .. }
            | Request::Set { .. }
            | Request::Append { .. }
            | Request::MultiSet { .. }
            | Request::QueuePush { .. } => None,
            Request::CompareSet { .. } | Request::Get { .. } | Request::Auth { .. } => Some(ReplyKind::Bytes),
            Request::Add { .. }
            | Request::GetNumKeys
            | Request::DeleteKey { .. }
            | Request::QueueLen { .. }
            | Request::AuthProof { .. } => Some(ReplyKind::Int),
            Request::Check { .. } => Some(ReplyKind::Check),
            Request::Wait { .. } | Request::CancelWait | Request::Barrier { .. } => Some(ReplyKind::Wait),
            Request::MultiGet { keys } => Some(ReplyKind::MultiBytes(keys.len())),
            Request::Ping { .. } => Some(ReplyKind::Nonce),
            Request::QueuePop { .. } => Some(ReplyKind::QueuePop),
            Request::ListKeys => Some(ReplyKind::Keys),
        }
    }

    /// Appends the request's wire bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.query_type() as u8);
        match self {
            Request::Validate { magic } => out.extend_from_slice(&magic.to_le_bytes()),
            Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Add { key, delta } => {
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Request::MultiSet { items } => {
                out.extend_from_slice(&(items.len() as i64).to_le_bytes());
                for (key, value) in items {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Barrier { key, world_size } => {
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
            Request::Auth { nonce: bytes } | Request::AuthProof { proof: bytes } => put_bytes(out, bytes),
        }
    }

    /// The request's wire bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// The shape of a reply, which the wire does not carry: the client knows it from its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplyKind {
    /// One byte vector (COMPARE_SET, GET).
    Bytes,
    /// One [`CheckResponse`] byte (CHECK).
    Check,
    /// One i64 (ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN).
    Int,
    /// An i64 count, then that many strings (LIST_KEYS).
    Keys,
    /// This many byte vectors (MULTI_GET).
    MultiBytes(usize),
    /// One u32 (PING).
    Nonce,
    /// An i64 length, then one byte vector if it was positive (QUEUE_POP).
    QueuePop,
    /// One [`WaitResponse`] byte (WAIT, CANCEL_WAIT, BARRIER).
    Wait,
}

/// One reply, as the server sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// A byte vector.
    Bytes(Vec<u8>),
    /// A CHECK answer.
    Check(CheckResponse),
    /// An i64.
    Int(i64),
    /// LIST_KEYS' keys.
    Keys(Vec<Vec<u8>>),
    /// MULTI_GET's values, one per key.
    MultiBytes(Vec<Vec<u8>>),
    /// PING's echoed nonce.
    Nonce(u32),
    /// QUEUE_POP's answer.
    QueuePop {
        /// The queue's length before the pop.
        len: i64,
        /// The popped item, present when `len > 0`.
        value: Option<Vec<u8>>,
    },
    /// A WAIT / CANCEL_WAIT / BARRIER answer.
    Wait(WaitResponse),
}

impl Reply {
    /// The reply's shape.
    pub fn kind(&self) -> ReplyKind {
        match self {
            Reply::Bytes(_) => ReplyKind::Bytes,
            Reply::Check(_) => ReplyKind::Check,
            Reply::Int(_) => ReplyKind::Int,
            Reply::Keys(_) => ReplyKind::Keys,
            Reply::MultiBytes(values) => ReplyKind::MultiBytes(values.len()),
            Reply::Nonce(_) => ReplyKind::Nonce,
            Reply::QueuePop { .. } => ReplyKind::QueuePop,
            Reply::Wait(_) => ReplyKind::Wait,
        }
    }

    /// Appends the reply's wire bytes to `out`.
    ///
    /// A [`Reply::QueuePop`] writes its value only when `len > 0`, as PyTorch's server does.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Bytes(bytes) => put_bytes(out, bytes),
            Reply::Check(check) => out.push(*check as u8),
            Reply::Int(value) => out.extend_from_slice(&value.to_le_bytes()),
            Reply::Keys(keys) => {
                out.extend_from_slice(&(keys.len() as i64).to_le_bytes());
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Reply::MultiBytes(values) => {
                for value in values {
                    put_bytes(out, value);
                }
            }
            Reply::Nonce(nonce) => out.extend_from_slice(&nonce.to_le_bytes()),
            Reply::QueuePop { len, value } => {
                out.extend_from_slice(&len.to_le_bytes());
                if *len > 0 {
                    put_bytes(out, value.as_deref().unwrap_or_default());
                }
            }
            Reply::Wait(wait) => out.push(*wait as u8),
        }
    }

    /// The reply's wire bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// Bounds on what a decoder accepts. A length or count above its bound is refused as soon as it
/// is read, before any byte it announces is awaited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// The longest key, in bytes. Default 64 KiB (PyTorch's libuv server allows 8 KiB).
    pub max_key_len: u64,
    /// The longest value, in bytes. Default 64 MiB (PyTorch's libuv server allows 8 MiB).
    pub max_value_len: u64,
    /// The most keys in one CHECK, WAIT, MULTI_GET, MULTI_SET or LIST_KEYS reply. Default
    /// 131072, PyTorch's `MAX_KEY_COUNT`.
    pub max_key_count: u64,
    /// The largest whole message, in bytes. Default 256 MiB.
    pub max_message_len: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_key_len: 64 << 10,
            max_value_len: 64 << 20,
            max_key_count: 128 << 10,
            max_message_len: 256 << 20,
        }
    }
}

/// Why bytes could not be decoded. Every variant means the stream is unusable from here on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// A one-byte response was not one of its enum's values.
    #[error("invalid {what} response byte {byte}")]
    InvalidResponse {
        /// Which response (`"check"` or `"wait"`).
        what: &'static str,
        /// The byte received.
        byte: u8,
    },
    /// A key's length prefix is over [`DecodeLimits::max_key_len`].
    #[error("key length {len} exceeds the limit of {max} bytes")]
    KeyTooLong {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The message would be longer than [`DecodeLimits::max_message_len`].
    #[error("message of at least {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// How long the message would be, at least.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A reply's count was negative.
    #[error("negative {what} count {count}")]
    NegativeCount {
        /// What was counted.
        what: &'static str,
        /// The count received.
        count: i64,
    },
    /// A key count is over [`DecodeLimits::max_key_count`].
    #[error("key count {count} exceeds the limit of {max}")]
    TooManyKeys {
        /// The announced count (a negative i64 count reads as a huge one).
        count: u64,
        /// The limit.
        max: u64,
    },
    /// A request began with a byte that is no [`QueryType`].
    #[error("unknown query type {0}")]
    UnknownQueryType(u8),
    /// A value's length prefix is over [`DecodeLimits::max_value_len`].
    #[error("value length {len} exceeds the limit of {max} bytes")]
    ValueTooLong {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// Decodes one request from the front of `buf`.
///
/// Returns `Ok(Some((request, consumed)))` when a whole request is there, `Ok(None)` when more
/// bytes are needed, or the reason the bytes can never be a valid request.
pub fn decode_request(buf: &[u8], limits: &DecodeLimits) -> Result<Option<(Request, usize)>, DecodeError> {
    decode_front(buf, limits, parse_request)
}

/// Decodes one reply of shape `kind` from the front of `buf`.
///
/// Returns `Ok(Some((reply, consumed)))`, `Ok(None)` when more bytes are needed, or the reason
/// the bytes can never be a valid reply.
pub fn decode_reply(buf: &[u8], kind: ReplyKind, limits: &DecodeLimits) -> Result<Option<(Reply, usize)>, DecodeError> {
    decode_front(buf, limits, |c: &mut Cursor<'_>| parse_reply(c, kind))
}

/// A streaming request decoder for one connection (the server side): feed it bytes as they
/// arrive with [`extend`](Self::extend), then call [`decode`](Self::decode) until it returns
/// `Ok(None)`.
///
/// It remembers how many bytes the incomplete request needs at least, so a large value arriving
/// in many reads is not re-parsed on every read. After an error the connection must be closed.
#[derive(Debug, Clone)]
pub struct RequestDecoder {
    stream: Stream,
}

impl RequestDecoder {
    /// A decoder with these limits.
    pub fn new(limits: DecodeLimits) -> Self {
        RequestDecoder { stream: Stream::new(limits) }
    }

    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.stream.extend(bytes);
    }

    /// The next whole request, `Ok(None)` when more bytes are needed, or why the stream is bad.
    pub fn decode(&mut self) -> Result<Option<Request>, DecodeError> {
        self.stream.decode(parse_request)
    }

    /// How many received bytes are not yet decoded.
    pub fn buffered(&self) -> usize {
        self.stream.buffered()
    }
}

/// A streaming reply decoder for one connection (the client side): feed it bytes with
/// [`extend`](Self::extend) and ask for the reply the client expects with
/// [`decode`](Self::decode).
#[derive(Debug, Clone)]
pub struct ReplyDecoder {
    stream: Stream,
}

impl ReplyDecoder {
    /// A decoder with these limits.
    pub fn new(limits: DecodeLimits) -> Self {
        ReplyDecoder { stream: Stream::new(limits) }
    }

    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.stream.extend(bytes);
    }

    /// The next reply, decoded as `kind`; `Ok(None)` when more bytes are needed.
    ///
    /// Call it with the same `kind` until it returns a reply: the length hint it keeps assumes
    /// the same shape.
    pub fn decode(&mut self, kind: ReplyKind) -> Result<Option<Reply>, DecodeError> {
        self.stream.decode(move |c: &mut Cursor<'_>| parse_reply(c, kind))
    }

    /// How many received bytes are not yet decoded.
    pub fn buffered(&self) -> usize {
        self.stream.buffered()
    }

    /// Drops every buffered byte (after a connection is replaced).
    pub fn clear(&mut self) {
        self.stream = Stream::new(self.stream.limits);
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Why a parse stopped early.
enum Stop {
    /// The message needs at least this many bytes in all.
    Incomplete(usize),
    /// The bytes are invalid.
    Invalid(DecodeError),
}

impl From<DecodeError> for Stop {
    fn from(e: DecodeError) -> Self {
        Stop::Invalid(e)
    }
}

type Parsed<T> = Result<T, Stop>;

fn decode_front<T>(
    buf: &[u8],
    limits: &DecodeLimits,
    parse: impl Fn(&mut Cursor<'_>) -> Parsed<T>,
) -> Result<Option<(T, usize)>, DecodeError> {
    let mut cursor = Cursor::new(buf, limits);
    match parse(&mut cursor) {
        Ok(value) => Ok(Some((value, cursor.pos))),
        Err(Stop::Incomplete(_)) => Ok(None),
        Err(Stop::Invalid(e)) => Err(e),
    }
}

/// A read position over received bytes, with the limits that bound what it may be asked for.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a DecodeLimits,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], limits: &'a DecodeLimits) -> Self {
        Cursor { buf, pos: 0, limits }
    }

    fn take(&mut self, n: usize) -> Parsed<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(Stop::Invalid(DecodeError::MessageTooLarge { len: u64::MAX, max: self.limits.max_message_len }))?;
        if end as u64 > self.limits.max_message_len {
            return Err(DecodeError::MessageTooLarge { len: end as u64, max: self.limits.max_message_len }.into());
        }
        match self.buf.get(self.pos..end) {
            Some(bytes) => {
                self.pos = end;
                Ok(bytes)
            }
            None => Err(Stop::Incomplete(end)),
        }
    }

    fn array<const N: usize>(&mut self) -> Parsed<[u8; N]> {
        let bytes = self.take(N)?;
        Ok(bytes.try_into().expect("take returned exactly N bytes"))
    }

    fn u8(&mut self) -> Parsed<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Parsed<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Parsed<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Parsed<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed byte string of at most `max` bytes; `too_long` names the error.
    fn bytes_limited(&mut self, max: u64, too_long: fn(u64, u64) -> DecodeError) -> Parsed<Vec<u8>> {
        let len = self.u64()?;
        if len > max {
            return Err(too_long(len, max).into());
        }
        // `len <= max <= u64::MAX`; on 32-bit targets a length above usize::MAX is refused here.
        let len = usize::try_from(len).map_err(|_| Stop::Invalid(too_long(len, max)))?;
        Ok(self.take(len)?.to_vec())
    }

    fn key(&mut self) -> Parsed<Vec<u8>> {
        self.bytes_limited(self.limits.max_key_len, |len, max| DecodeError::KeyTooLong { len, max })
    }

    fn value(&mut self) -> Parsed<Vec<u8>> {
        self.bytes_limited(self.limits.max_value_len, |len, max| DecodeError::ValueTooLong { len, max })
    }

    fn count(&mut self) -> Parsed<usize> {
        let count = self.u64()?;
        let max = self.limits.max_key_count;
        if count > max {
            return Err(DecodeError::TooManyKeys { count, max }.into());
        }
        usize::try_from(count).map_err(|_| Stop::Invalid(DecodeError::TooManyKeys { count, max }))
    }

    fn keys(&mut self) -> Parsed<Vec<Vec<u8>>> {
        let count = self.count()?;
        // Grown as keys arrive, never reserved from the count.
        let mut keys = Vec::new();
        for _ in 0..count {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

fn parse_request(c: &mut Cursor<'_>) -> Parsed<Request> {
    let byte = c.u8()?;
    let query = QueryType::from_byte(byte).ok_or(DecodeError::UnknownQueryType(byte))?;
    Ok(match query {
        QueryType::Validate => Request::Validate { magic: c.u32()? },
        QueryType::Set => Request::Set { key: c.key()?, value: c.value()? },
        QueryType::CompareSet => Request::CompareSet { key: c.key()?, expected: c.value()?, desired: c.value()? },
        QueryType::Get => Request::Get { key: c.key()? },
        QueryType::Add => Request::Add { key: c.key()?, delta: c.i64()? },
        QueryType::Check => Request::Check { keys: c.keys()? },
        QueryType::Wait => Request::Wait { keys: c.keys()? },
        QueryType::GetNumKeys => Request::GetNumKeys,
        QueryType::DeleteKey => Request::DeleteKey { key: c.key()? },
        QueryType::Append => Request::Append { key: c.key()?, value: c.value()? },
        QueryType::MultiGet => Request::MultiGet { keys: c.keys()? },
        QueryType::MultiSet => {
            let count = c.count()?;
            let mut items = Vec::new();
            for _ in 0..count {
                let key = c.key()?;
                let value = c.value()?;
                items.push((key, value));
            }
            Request::MultiSet { items }
        }
        QueryType::CancelWait => Request::CancelWait,
        QueryType::Ping => Request::Ping { nonce: c.u32()? },
        QueryType::QueuePush => Request::QueuePush { key: c.key()?, value: c.value()? },
        QueryType::QueuePop => Request::QueuePop { key: c.key()? },
        QueryType::QueueLen => Request::QueueLen { key: c.key()? },
        QueryType::ListKeys => Request::ListKeys,
        QueryType::Barrier => Request::Barrier { key: c.key()?, world_size: c.i64()? },
        QueryType::CohortAuth => Request::Auth { nonce: c.key()? },
        QueryType::CohortAuthProof => Request::AuthProof { proof: c.key()? },
    })
}

fn parse_reply(c: &mut Cursor<'_>, kind: ReplyKind) -> Parsed<Reply> {
    Ok(match kind {
        ReplyKind::Bytes => Reply::Bytes(c.value()?),
        ReplyKind::Check => Reply::Check(match c.u8()? {
            0 => CheckResponse::Ready,
            1 => CheckResponse::NotReady,
            byte => return Err(DecodeError::InvalidResponse { what: "check", byte }.into()),
        }),
        ReplyKind::Int => Reply::Int(c.i64()?),
        ReplyKind::Keys => {
            let count = c.i64()?;
            if count < 0 {
                return Err(DecodeError::NegativeCount { what: "key", count }.into());
            }
            let max = c.limits.max_key_count;
            if count as u64 > max {
                return Err(DecodeError::TooManyKeys { count: count as u64, max }.into());
            }
            let mut keys = Vec::new();
            for _ in 0..count {
                keys.push(c.key()?);
            }
            Reply::Keys(keys)
        }
        ReplyKind::MultiBytes(count) => {
            let mut values = Vec::new();
            for _ in 0..count {
                values.push(c.value()?);
            }
            Reply::MultiBytes(values)
        }
        ReplyKind::Nonce => Reply::Nonce(c.u32()?),
        ReplyKind::QueuePop => {
            let len = c.i64()?;
            let value = if len > 0 { Some(c.value()?) } else { None };
            Reply::QueuePop { len, value }
        }
        ReplyKind::Wait => Reply::Wait(match c.u8()? {
            0 => WaitResponse::StopWaiting,
            1 => WaitResponse::WaitCanceled,
            byte => return Err(DecodeError::InvalidResponse { what: "wait", byte }.into()),
        }),
    })
}

/// The buffer behind both streaming decoders.
#[derive(Debug, Clone)]
struct Stream {
    buf: Vec<u8>,
    /// Bytes before `start` are decoded.
    start: usize,
    /// The pending message needs at least this many bytes after `start`.
    needed: usize,
    limits: DecodeLimits,
}

impl Stream {
    fn new(limits: DecodeLimits) -> Self {
        Stream { buf: Vec::new(), start: 0, needed: 0, limits }
    }

    fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    fn extend(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start >= self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    fn decode<T>(&mut self, parse: impl Fn(&mut Cursor<'_>) -> Parsed<T>) -> Result<Option<T>, DecodeError> {
        if self.buffered() == 0 || self.buffered() < self.needed {
            return Ok(None);
        }
        let mut cursor = Cursor::new(&self.buf[self.start..], &self.limits);
        match parse(&mut cursor) {
            Ok(value) => {
                self.start += cursor.pos;
                self.needed = 0;
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                }
                Ok(Some(value))
            }
            Err(Stop::Incomplete(needed)) => {
                self.needed = needed;
                Ok(None)
            }
            Err(Stop::Invalid(e)) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn sample_requests() -> Vec<Request> {
        vec![
            Request::Validate { magic: VALIDATION_MAGIC },
            Request::Set { key: k("/a"), value: k("1") },
            Request::CompareSet { key: k("/a"), expected: k(""), desired: k("x") },
            Request::Get { key: k("/a") },
            Request::Add { key: k("/n"), delta: -7 },
            Request::Check { keys: vec![k("/a"), k("/b")] },
            Request::Wait { keys: vec![k("/a")] },
            Request::GetNumKeys,
            Request::DeleteKey { key: k("/a") },
            Request::Append { key: k("/a"), value: vec![0, 255] },
            Request::MultiGet { keys: vec![k("/a"), k(""), k("/c")] },
            Request::MultiSet { items: vec![(k("/a"), k("1")), (k("/b"), Vec::new())] },
            Request::CancelWait,
            Request::Ping { nonce: 4242 },
            Request::QueuePush { key: k("/q"), value: k("item") },
            Request::QueuePop { key: k("/q") },
            Request::QueueLen { key: k("/q") },
            Request::ListKeys,
            Request::Barrier { key: k("/b"), world_size: 4 },
        ]
    }

    fn sample_replies() -> Vec<Reply> {
        vec![
            Reply::Bytes(k("value")),
            Reply::Bytes(Vec::new()),
            Reply::Check(CheckResponse::Ready),
            Reply::Check(CheckResponse::NotReady),
            Reply::Int(-3),
            Reply::Keys(vec![k("/a"), k("init/")]),
            Reply::MultiBytes(vec![k("x"), Vec::new()]),
            Reply::Nonce(7),
            Reply::QueuePop { len: 2, value: Some(k("item")) },
            Reply::QueuePop { len: 0, value: None },
            Reply::Wait(WaitResponse::StopWaiting),
            Reply::Wait(WaitResponse::WaitCanceled),
        ]
    }

    #[test]
    fn query_type_bytes_match_pytorch_enum_order() {
        for byte in 0..=18u8 {
            let query = QueryType::from_byte(byte).expect("defined");
            assert_eq!(query as u8, byte);
        }
        assert_eq!(QueryType::from_byte(19), None);
        assert_eq!(QueryType::Validate as u8, 0);
        assert_eq!(QueryType::CancelWait as u8, 12);
        assert_eq!(QueryType::Ping as u8, 13);
        assert_eq!(QueryType::Barrier as u8, 18);
        assert_eq!(QueryType::CompareSet.to_string(), "COMPARE_SET");
    }

    #[test]
    fn validate_and_set_encode_to_pytorch_bytes() {
        assert_eq!(Request::Validate { magic: VALIDATION_MAGIC }.to_bytes(), [0, 0xCE, 0xF7, 0x85, 0x3C]);
        let set = Request::Set { key: k("/k"), value: k("v") }.to_bytes();
        let mut expected = vec![1u8];
        expected.extend_from_slice(&2u64.to_le_bytes());
        expected.extend_from_slice(b"/k");
        expected.extend_from_slice(&1u64.to_le_bytes());
        expected.extend_from_slice(b"v");
        assert_eq!(set, expected);
        let add = Request::Add { key: k("n"), delta: 1 }.to_bytes();
        assert_eq!(add, [&[4u8][..], &1u64.to_le_bytes(), b"n", &1i64.to_le_bytes()].concat());
        assert_eq!(Request::CancelWait.to_bytes(), [12]);
        assert_eq!(Reply::Wait(WaitResponse::WaitCanceled).to_bytes(), [1]);
        assert_eq!(Reply::Check(CheckResponse::NotReady).to_bytes(), [1]);
    }

    #[test]
    fn every_request_round_trips() {
        let limits = DecodeLimits::default();
        for request in sample_requests() {
            let bytes = request.to_bytes();
            let (decoded, used) = decode_request(&bytes, &limits).unwrap().unwrap();
            assert_eq!(decoded, request);
            assert_eq!(used, bytes.len());
        }
    }

    #[test]
    fn every_reply_round_trips() {
        let limits = DecodeLimits::default();
        for reply in sample_replies() {
            let bytes = reply.to_bytes();
            let (decoded, used) = decode_reply(&bytes, reply.kind(), &limits).unwrap().unwrap();
            assert_eq!(decoded, reply);
            assert_eq!(used, bytes.len());
        }
    }

    #[test]
    fn every_proper_prefix_needs_more_bytes() {
        let limits = DecodeLimits::default();
        for request in sample_requests() {
            let bytes = request.to_bytes();
            for cut in 0..bytes.len() {
                assert_eq!(decode_request(&bytes[..cut], &limits), Ok(None), "{request:?} cut at {cut}");
            }
        }
        for reply in sample_replies() {
            let bytes = reply.to_bytes();
            for cut in 0..bytes.len() {
                assert_eq!(decode_reply(&bytes[..cut], reply.kind(), &limits), Ok(None), "{reply:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn reply_kinds_follow_the_request() {
        assert_eq!(Request::Set { key: k("a"), value: k("b") }.reply_kind(), None);
        assert_eq!(Request::Validate { magic: 0 }.reply_kind(), None);
        assert_eq!(Request::MultiSet { items: Vec::new() }.reply_kind(), None);
        assert_eq!(Request::Get { key: k("a") }.reply_kind(), Some(ReplyKind::Bytes));
        assert_eq!(Request::MultiGet { keys: vec![k("a"), k("b")] }.reply_kind(), Some(ReplyKind::MultiBytes(2)));
        assert_eq!(Request::CancelWait.reply_kind(), Some(ReplyKind::Wait));
        assert_eq!(Request::DeleteKey { key: k("a") }.reply_kind(), Some(ReplyKind::Int));
    }

    #[test]
    fn streaming_decoder_yields_requests_fed_byte_by_byte() {
        let requests = sample_requests();
        let bytes: Vec<u8> = requests.iter().flat_map(Request::to_bytes).collect();
        let mut decoder = RequestDecoder::new(DecodeLimits::default());
        let mut out = Vec::new();
        for byte in bytes {
            decoder.extend(&[byte]);
            while let Some(request) = decoder.decode().unwrap() {
                out.push(request);
            }
        }
        assert_eq!(out, requests);
        assert_eq!(decoder.buffered(), 0);
    }

    #[test]
    fn streaming_reply_decoder_handles_a_large_value_in_chunks() {
        let value = vec![7u8; 100_000];
        let bytes = Reply::Bytes(value.clone()).to_bytes();
        let mut decoder = ReplyDecoder::new(DecodeLimits::default());
        let mut got = None;
        for chunk in bytes.chunks(999) {
            assert!(got.is_none());
            decoder.extend(chunk);
            got = decoder.decode(ReplyKind::Bytes).unwrap();
        }
        assert_eq!(got, Some(Reply::Bytes(value)));
        assert_eq!(decoder.buffered(), 0);
    }

    #[test]
    fn a_key_length_of_2_pow_60_is_refused_at_once() {
        let mut bytes = vec![QueryType::Set as u8];
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        let err = decode_request(&bytes, &DecodeLimits::default()).unwrap_err();
        assert_eq!(err, DecodeError::KeyTooLong { len: 1 << 60, max: 64 << 10 });
        assert!(err.to_string().contains("1152921504606846976"), "{err}");
    }

    #[test]
    fn a_value_length_of_2_pow_60_is_refused_at_once() {
        let mut bytes = vec![QueryType::Set as u8];
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.push(b'k');
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        let mut decoder = RequestDecoder::new(DecodeLimits::default());
        decoder.extend(&bytes);
        assert_eq!(decoder.decode(), Err(DecodeError::ValueTooLong { len: 1 << 60, max: 64 << 20 }));
        let reply = (1u64 << 60).to_le_bytes();
        assert!(matches!(
            decode_reply(&reply, ReplyKind::Bytes, &DecodeLimits::default()),
            Err(DecodeError::ValueTooLong { .. })
        ));
    }

    #[test]
    fn unknown_query_types_are_refused() {
        for byte in [19u8, 100, 255] {
            assert_eq!(decode_request(&[byte], &DecodeLimits::default()), Err(DecodeError::UnknownQueryType(byte)));
        }
    }

    #[test]
    fn too_many_keys_are_refused_before_any_key_arrives() {
        let limits = DecodeLimits { max_key_count: 4, ..DecodeLimits::default() };
        for query in [QueryType::Check, QueryType::Wait, QueryType::MultiGet, QueryType::MultiSet] {
            let mut bytes = vec![query as u8];
            bytes.extend_from_slice(&5u64.to_le_bytes());
            assert_eq!(decode_request(&bytes, &limits), Err(DecodeError::TooManyKeys { count: 5, max: 4 }));
        }
        // PyTorch's client writes MULTI_SET's count as int64: -1 reads as 2^64 - 1.
        let mut bytes = vec![QueryType::MultiSet as u8];
        bytes.extend_from_slice(&(-1i64).to_le_bytes());
        assert!(matches!(decode_request(&bytes, &limits), Err(DecodeError::TooManyKeys { count: u64::MAX, .. })));
        let reply = 5i64.to_le_bytes();
        assert!(matches!(decode_reply(&reply, ReplyKind::Keys, &limits), Err(DecodeError::TooManyKeys { .. })));
    }

    #[test]
    fn messages_over_the_total_limit_are_refused() {
        let limits = DecodeLimits { max_message_len: 64, ..DecodeLimits::default() };
        let request = Request::MultiSet { items: (0..8).map(|i| (vec![i; 8], vec![i; 8])).collect() };
        assert!(matches!(decode_request(&request.to_bytes(), &limits), Err(DecodeError::MessageTooLarge { .. })));
        // Also when only the prefixes have arrived.
        let bytes = Request::Set { key: k("k"), value: vec![0; 100] }.to_bytes();
        assert!(matches!(decode_request(&bytes[..20], &limits), Err(DecodeError::MessageTooLarge { .. })));
    }

    #[test]
    fn invalid_response_bytes_and_negative_counts_are_refused() {
        let limits = DecodeLimits::default();
        assert_eq!(
            decode_reply(&[2], ReplyKind::Check, &limits),
            Err(DecodeError::InvalidResponse { what: "check", byte: 2 })
        );
        assert_eq!(
            decode_reply(&[9], ReplyKind::Wait, &limits),
            Err(DecodeError::InvalidResponse { what: "wait", byte: 9 })
        );
        assert_eq!(
            decode_reply(&(-2i64).to_le_bytes(), ReplyKind::Keys, &limits),
            Err(DecodeError::NegativeCount { what: "key", count: -2 })
        );
    }

    #[test]
    fn queue_pop_reply_carries_a_value_only_when_the_queue_had_one() {
        let limits = DecodeLimits::default();
        assert_eq!(Reply::QueuePop { len: 0, value: None }.to_bytes(), 0i64.to_le_bytes());
        let (reply, used) = decode_reply(&(-1i64).to_le_bytes(), ReplyKind::QueuePop, &limits).unwrap().unwrap();
        assert_eq!((reply, used), (Reply::QueuePop { len: -1, value: None }, 8));
    }

    #[test]
    fn reply_decoder_clear_drops_buffered_bytes() {
        let mut decoder = ReplyDecoder::new(DecodeLimits::default());
        decoder.extend(&[1, 2, 3]);
        decoder.clear();
        assert_eq!(decoder.buffered(), 0);
        decoder.extend(&5i64.to_le_bytes());
        assert_eq!(decoder.decode(ReplyKind::Int), Ok(Some(Reply::Int(5))));
    }

    fn bytes_strategy() -> impl Strategy<Value = Vec<u8>> + Clone {
        proptest::collection::vec(any::<u8>(), 0..12)
    }

    fn request_strategy() -> impl Strategy<Value = Request> {
        let keys = proptest::collection::vec(bytes_strategy(), 0..4);
        prop_oneof![
            any::<u32>().prop_map(|magic| Request::Validate { magic }),
            (bytes_strategy(), bytes_strategy()).prop_map(|(key, value)| Request::Set { key, value }),
            (bytes_strategy(), bytes_strategy(), bytes_strategy())
                .prop_map(|(key, expected, desired)| Request::CompareSet { key, expected, desired }),
            bytes_strategy().prop_map(|key| Request::Get { key }),
            (bytes_strategy(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
            keys.clone().prop_map(|keys| Request::Check { keys }),
            keys.clone().prop_map(|keys| Request::Wait { keys }),
            Just(Request::GetNumKeys),
            keys.prop_map(|keys| Request::MultiGet { keys }),
            proptest::collection::vec((bytes_strategy(), bytes_strategy()), 0..4)
                .prop_map(|items| Request::MultiSet { items }),
            Just(Request::CancelWait),
            any::<u32>().prop_map(|nonce| Request::Ping { nonce }),
            (bytes_strategy(), any::<i64>()).prop_map(|(key, world_size)| Request::Barrier { key, world_size }),
        ]
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let limits = DecodeLimits { max_key_len: 16, max_value_len: 16, max_key_count: 4, max_message_len: 128 };
            if let Ok(Some((_, used))) = decode_request(&bytes, &limits) {
                prop_assert!(used <= bytes.len());
            }
            for kind in [ReplyKind::Bytes, ReplyKind::Check, ReplyKind::Int, ReplyKind::Keys,
                         ReplyKind::MultiBytes(3), ReplyKind::Nonce, ReplyKind::QueuePop, ReplyKind::Wait] {
                if let Ok(Some((_, used))) = decode_reply(&bytes, kind, &limits) {
                    prop_assert!(used <= bytes.len());
                }
            }
        }

        #[test]
        fn requests_split_anywhere_decode_to_themselves(
            requests in proptest::collection::vec(request_strategy(), 1..5),
            chunk in 1usize..17,
        ) {
            let bytes: Vec<u8> = requests.iter().flat_map(Request::to_bytes).collect();
            let mut decoder = RequestDecoder::new(DecodeLimits::default());
            let mut out = Vec::new();
            for piece in bytes.chunks(chunk) {
                decoder.extend(piece);
                while let Some(request) = decoder.decode().unwrap() {
                    out.push(request);
                }
            }
            prop_assert_eq!(out, requests);
        }
    }
}
