//! The pieces of connecting that the eager mesh ([`super::connect`]), the lazy mesh
//! ([`super::lazy`]) and splits ([`super::split`]) share: the init error, the store keys of a
//! group's rendezvous, and the handshake with its dialing and accepting sides.
//!
//! Why a module of its own: it depends on none of those three, so they depend on it and not on
//! each other.

use std::net::SocketAddr;
use std::time::Duration;

use cohort_core::protocol::{
    AuthSecret, HANDSHAKE_LEN, Handshake, HandshakeError, HandshakeExpectation, HandshakeReply, PROOF_LEN,
    REPLY_PREFIX_LEN, ReplyPrefix, Role,
};
use cohort_core::work::{GroupId, Rank};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::options::TcpOptions;
use super::shm::{self as shmem, ShmLink};
use super::tunables::{DIAL_BACKOFF_MAX, DIAL_BACKOFF_MIN};
use crate::net::Net;
use crate::store::StoreError;

/// Why a group could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// Rank or world size out of range.
    #[error("invalid rank {rank} for world size {world_size}")]
    BadRank {
        /// The rank.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// The environment is incomplete or malformed (the error names the variable).
    #[error(transparent)]
    Env(#[from] crate::env::EnvError),
    /// An option is out of range.
    #[error("{option} is {value}, expected {expected}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// Its value.
        value: String,
        /// What it may be.
        expected: String,
    },
    /// The process group's runtime could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// Rank 0 could not host the store.
    #[error("rank 0 cannot host the store on port {port}: {source}")]
    HostStore {
        /// The port.
        port: u16,
        /// Why.
        source: crate::store::StoreServerError,
    },
    /// The store failed.
    #[error("store error during rendezvous: {0}")]
    Store(#[from] StoreError),
    /// Could not listen.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// Not every rank arrived before the init timeout.
    #[error("timed out after {} ms waiting for ranks: {joined}/{world_size} ranks joined; missing: {missing:?}", timeout.as_millis())]
    Missing {
        /// Ranks that published their address.
        joined: u32,
        /// The world size.
        world_size: u32,
        /// Ranks that did not.
        missing: Vec<u32>,
        /// The init timeout.
        timeout: Duration,
    },
    /// A peer published its address but could not be reached.
    #[error("cannot connect to rank {rank} at {addr} within {} ms: {reason}", timeout.as_millis())]
    Unreachable {
        /// The peer.
        rank: u32,
        /// Its address.
        addr: String,
        /// The last error.
        reason: String,
        /// The init timeout.
        timeout: Duration,
    },
    /// A handshake failed.
    #[error("handshake with {peer} failed: {source}")]
    Handshake {
        /// Who: "rank 2" or the remote address.
        peer: String,
        /// Why.
        source: HandshakeError,
    },
}

pub(crate) fn group_prefix(gid: GroupId) -> String {
    format!("cohort/pg{gid}/")
}

pub(crate) fn error_key(gid: GroupId) -> String {
    format!("{}error", group_prefix(gid))
}

pub(crate) fn addr_key(gid: GroupId, rank: u32) -> String {
    format!("{}addr/{rank}", group_prefix(gid))
}

/// The count of ranks that published their address (lazy rendezvous).
pub(crate) fn published_count_key(gid: GroupId) -> String {
    format!("{}addr_published", group_prefix(gid))
}

/// Set by the rank whose publication completed the count (lazy rendezvous).
pub(crate) fn all_published_key(gid: GroupId) -> String {
    format!("{}addr_all", group_prefix(gid))
}

/// Dial connection `index` to `peer` at `addr`, retrying with backoff until `deadline`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn dial_one<N: Net>(
    net: &N,
    expect: &HandshakeExpectation,
    peer: u32,
    index: u16,
    addr: SocketAddr,
    text: &str,
    deadline: tokio::time::Instant,
    opts: &TcpOptions,
) -> Result<(N::Stream, Option<ShmLink>), InitError> {
    let mut backoff = DIAL_BACKOFF_MIN;
    loop {
        // One attempt (connect, then handshake), bounded by the init deadline: a peer behind
        // a partition never answers, and must not hold init past its timeout.
        let attempt = async {
            match net.connect(&addr.ip().to_string(), addr.port()).await {
                Ok(mut s) => {
                    // A pair's first connection offers shared memory (see `shm`) when the peer
                    // may be on this host: it publishes this rank's address, or loopback. A
                    // segment for each remote peer would cost its memory for nothing.
                    let ip = addr.ip();
                    let here = ip.is_loopback() || ip == opts.bind_addr || opts.bind_addr.is_unspecified();
                    let plan = if may_share_memory::<N>(opts) && index == 0 && here {
                        match shmem::create(expect.rank, Rank(peer), expect.group, opts.shm_ring_bytes) {
                            Ok(created) => ShmPlan::Offer(created),
                            Err(e) => {
                                tracing::debug!(peer, "no shared-memory segment to offer: {e}");
                                ShmPlan::Off
                            }
                        }
                    } else {
                        ShmPlan::Off
                    };
                    let auth = opts.auth.as_ref().map(|k| (k, Role::Dialer));
                    match handshake_on(&mut s, expect, index, auth, plan).await {
                        Ok((_, _, shm)) => Ok((s, shm)),
                        Err(HandshakeFailure::Refused(e)) => Err(Err(e)),
                        Err(e) => Err(Ok(e.to_string())),
                    }
                }
                Err(e) => Err(Ok(e.to_string())),
            }
        };
        let err = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(Err(e))) => return Err(InitError::Handshake { peer: format!("rank {peer}"), source: e }),
            Ok(Err(Ok(e))) => e,
            Err(_) => "no answer before the init timeout".to_owned(),
        };
        if tokio::time::Instant::now() + backoff >= deadline {
            return Err(InitError::Unreachable {
                rank: peer,
                addr: text.to_owned(),
                reason: err,
                timeout: opts.init_timeout,
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(DIAL_BACKOFF_MAX);
    }
}

/// Whether this rank may share memory with peers of its host: on real sockets only, and when
/// the options allow it (see `shm`).
pub(crate) fn may_share_memory<N: Net>(opts: &TcpOptions) -> bool {
    N::SHARES_MEMORY && opts.shared_memory
}

/// A connection and the shared memory agreed on it, if any.
pub(crate) type Conn<S> = (S, Option<ShmLink>);

/// An accepted connection after its handshake: the remote address, the stream, and the peer's
/// rank, connection index and shared memory if agreed (or why it was refused).
pub(crate) type Accepted<S> = (SocketAddr, S, Result<(Rank, u16, Option<ShmLink>), HandshakeFailure>);

/// The accepting side's handshake on a fresh connection, bounded by `limit`, so that a
/// connection that never speaks holds up nobody. With a secret, the peer must prove it knows
/// it; one that fails is refused, and logged as an error naming the rank it claims.
/// `shared_memory`: this rank takes a peer's offer of shared memory (see `shm`).
pub(crate) async fn accepted_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    remote: SocketAddr,
    expect: HandshakeExpectation,
    secret: Option<AuthSecret>,
    limit: Duration,
    shared_memory: bool,
) -> Accepted<S> {
    let auth = secret.as_ref().map(|k| (k, Role::Acceptor));
    let plan = if shared_memory { ShmPlan::Answer } else { ShmPlan::Off };
    let result = match tokio::time::timeout(limit, handshake_on(&mut stream, &expect, 0, auth, plan)).await {
        Ok(r) => r,
        Err(_) => Err(HandshakeFailure::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no handshake within {} ms", limit.as_millis()),
        ))),
    };
    if let Err(HandshakeFailure::Refused(e)) = &result
        && e.unauthenticated_rank().is_some()
    {
        tracing::error!(%remote, "refused a connection that failed authentication: {e}");
    }
    (remote, stream, result)
}

/// Whether a refused handshake came from a rank of this job that is set up wrongly (which
/// fails the rendezvous on both sides at once, rather than at the init timeout), as opposed
/// to something that is not a rank of this group at all (dropped with a warning).
pub(crate) fn is_misconfigured_rank(e: &HandshakeError) -> bool {
    matches!(
        e,
        HandshakeError::WorldSizeMismatch { .. }
            | HandshakeError::ConnectionsPerPeerMismatch { .. }
            | HandshakeError::RankOutOfRange { .. }
            | HandshakeError::RankIsSelf { .. }
    )
}

/// How a handshake went wrong: the connection (worth retrying) or the peer's answer (not).
#[derive(Debug)]
pub(crate) enum HandshakeFailure {
    Io(std::io::Error),
    Refused(HandshakeError),
}

impl From<HandshakeError> for HandshakeFailure {
    fn from(e: HandshakeError) -> Self {
        HandshakeFailure::Refused(e)
    }
}

impl std::fmt::Display for HandshakeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeFailure::Io(e) => write!(f, "connection failed during the handshake: {e}"),
            HandshakeFailure::Refused(e) => write!(f, "{e}"),
        }
    }
}

/// What a side does about shared memory on a fresh connection.
pub(crate) enum ShmPlan {
    /// Nothing: the handshake's flag stays clear.
    Off,
    /// Offer this segment (the dialer of a pair's first connection).
    Offer(shmem::Created),
    /// Take an offer, if the dialer makes one (the acceptor).
    Answer,
}

/// Exchange and check handshakes on a fresh connection, sending connection index `index` (the
/// accepting side sends 0: the dialer's index is the one that counts); returns the peer's rank,
/// the index it sent, and the shared memory agreed (`plan`; both sides must have set the flag).
/// With `auth` (the secret, and whether this side dialled or accepted), both sides prove they
/// know the secret (see [`cohort_core::protocol::auth`]).
async fn handshake_on<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    expect: &HandshakeExpectation,
    index: u16,
    auth: Option<(&AuthSecret, Role)>,
    plan: ShmPlan,
) -> Result<(Rank, u16, Option<ShmLink>), HandshakeFailure> {
    let io = HandshakeFailure::Io;
    let expect = if auth.is_some() { expect.with_auth() } else { *expect };
    let mut mine = expect.handshake(index);
    mine.shares_memory = !matches!(plan, ShmPlan::Off);
    let i_share = mine.shares_memory;
    if auth.is_some() {
        mine.auth_nonce = Some(crate::net::fresh_nonce().map_err(io)?);
    }
    let mine = mine.encode();
    stream.write_all(&mine).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut buf = [0u8; HANDSHAKE_LEN];
    stream.read_exact(&mut buf).await.map_err(io)?;
    let theirs = Handshake::decode(&buf);
    let both_share = i_share && theirs.as_ref().is_ok_and(|h| h.shares_memory);
    let mut verdict =
        theirs.as_ref().map_err(Clone::clone).and_then(|hs| hs.check(&expect).map(|()| (hs.rank, hs.connection)));
    // The transcript both proofs cover: the dialler's handshake first.
    let (first, second) = match auth {
        Some((_, Role::Dialer)) => (&mine, &buf),
        _ => (&buf, &mine),
    };
    if let Some((secret, role)) = auth {
        stream.write_all(&cohort_core::protocol::proof(secret, role, first, second)).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
    }
    if let Ok(hs) = &theirs
        && hs.auth_nonce.is_some()
    {
        let mut proof = [0u8; PROOF_LEN];
        stream.read_exact(&mut proof).await.map_err(io)?;
        if let (Some((secret, role)), Ok(_)) = (auth, &verdict)
            && !cohort_core::protocol::verify(secret, role.peer(), first, second, &proof)
        {
            verdict = Err(HandshakeError::AuthMismatch { peer_rank: hs.rank });
        }
    }
    let reply = match &verdict {
        Ok(_) => HandshakeReply::Accept,
        Err(e) => HandshakeReply::reject(e),
    };
    stream.write_all(&reply.encode()).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut prefix = [0u8; REPLY_PREFIX_LEN];
    stream.read_exact(&mut prefix).await.map_err(io)?;
    let prefix = ReplyPrefix::decode(&prefix)?;
    let mut msg = vec![0u8; prefix.message_len()];
    stream.read_exact(&mut msg).await.map_err(io)?;
    let theirs = prefix.finish(&msg)?;
    let (rank, connection) = verdict?;
    theirs.into_result()?;
    let shm = match plan {
        ShmPlan::Offer(created) if both_share => shmem::offer(stream, created, rank).await.map_err(io)?,
        ShmPlan::Answer if both_share => shmem::answer(stream, expect.rank, rank, expect.group).await.map_err(io)?,
        _ => None,
    };
    Ok((rank, connection, shm))
}
