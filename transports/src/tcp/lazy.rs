//! Lazy connection (`TcpOptions::lazy_connect`, Gloo's lazy init): a peer is dialed the first
//! time this rank has something to send it, and connections from peers are accepted for the
//! group's whole life.
//!
//! Either side may connect first, or both at once. Each rank writes to a peer over one set of
//! connections only (its lanes: the set it dialed, or the first set it accepted from that peer
//! if it had none) and reads from every connection with that peer, so the order of what it
//! writes holds. A set it accepted while it already had lanes is only read from; its writer
//! still says goodbye on shutdown, so that the peer sees a clean close.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use cohort_core::protocol::{AuthSecret, HandshakeExpectation, RejectReason};
use cohort_core::work::Rank;

use super::attach::attach;
use super::link::{Inbound, LaneRx};
use super::rendezvous::{
    Accepted, Conn, HandshakeFailure, accepted_handshake, addr_key, dial_one, is_misconfigured_rank,
};
use super::state::deliver;
use super::tunables::{ACCEPT_RETRY, HANDSHAKE_TIMEOUT};
use super::{Inner, now};
use crate::net::{Listener, Net};

/// Dials `peer` for the group, then serves the new connections with the given queues.
pub(crate) type Dialer = Arc<dyn Fn(Arc<Inner>, Rank, Vec<LaneRx>) + Send + Sync>;

pub(crate) fn dialer<N: Net>(net: N) -> Dialer {
    Arc::new(move |inner, peer, lanes| {
        let net = net.clone();
        let runtime = inner.runtime.clone();
        runtime.spawn(dial(net, inner, peer, lanes));
    })
}

async fn dial<N: Net>(net: N, inner: Arc<Inner>, peer: Rank, lanes: Vec<LaneRx>) {
    let opts = &inner.opts;
    let k = lanes.len() as u16;
    let expect = HandshakeExpectation::new(inner.group_id, inner.rank, inner.world_size)
        .with_connections_per_peer(k)
        .with_peer(peer);
    let deadline = tokio::time::Instant::now() + opts.init_timeout;
    let key = addr_key(inner.group_id, peer.0);
    let result: Result<Vec<Conn<N::Stream>>, String> = async {
        let value = inner.store.get(&key).await.map_err(|e| format!("cannot read its address from the store: {e}"))?;
        let text = String::from_utf8_lossy(&value).into_owned();
        let addr = text.parse().map_err(|_| format!("its published address {text:?} does not parse"))?;
        let mut streams = Vec::with_capacity(lanes.len());
        for index in 0..k {
            let s =
                dial_one(&net, &expect, peer.0, index, addr, &text, deadline, opts).await.map_err(|e| e.to_string())?;
            streams.push(s);
        }
        Ok(streams)
    }
    .await;
    let tally = inner.tallies.get(peer);
    match result {
        Ok(streams) => {
            if let Some(tally) = &tally {
                streams.iter().for_each(|_| tally.add());
            }
            for (index, ((stream, shm), rx)) in streams.into_iter().zip(lanes).enumerate() {
                attach(&inner, peer, stream, N::into_tcp, rx, index, shm);
            }
            inner.input(|st, fx| st.peer_connected(now(), peer, fx));
        }
        Err(e) => {
            let inbound =
                Inbound::Closed { from: peer, reason: format!("cannot connect to rank {peer}: {e}"), clean: false };
            if tally.is_some_and(|t| t.pass(&inbound)) {
                inner.input(|st, fx| deliver(st, fx, inbound));
            }
        }
    }
}

/// Accept peers' connections for as long as the group lives. Each does its handshake in its
/// own bounded task; a peer's connections are served once its whole set has arrived.
pub(crate) async fn serve_accepts<L: Listener>(
    listener: L,
    weak: Weak<Inner>,
    expect: HandshakeExpectation,
    secret: Option<AuthSecret>,
    shared_memory: bool,
) {
    let k = usize::from(expect.connections_per_peer);
    let mut sets: BTreeMap<u32, BTreeMap<u16, Conn<L::Stream>>> = BTreeMap::new();
    let mut pending: tokio::task::JoinSet<Accepted<L::Stream>> = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            biased;
            done = pending.join_next(), if !pending.is_empty() => {
                let Some(Ok((remote, stream, result))) = done else { continue };
                let Some(inner) = weak.upgrade() else { return };
                match result {
                    Ok((peer, index, shm)) => {
                        let set = sets.entry(peer.0).or_default();
                        if set.contains_key(&index) {
                            tracing::warn!(%remote, "dropping a second connection {index} from rank {peer}");
                            continue;
                        }
                        if let Some(tally) = inner.tallies.get(peer) {
                            tally.add();
                        }
                        set.insert(index, (stream, shm));
                        if set.len() == k {
                            let streams: Vec<_> = sets.remove(&peer.0).unwrap_or_default().into_values().collect();
                            serve_set(&inner, peer, streams, L::into_tcp);
                        }
                    }
                    Err(HandshakeFailure::Refused(e)) if is_misconfigured_rank(&e) => {
                        tracing::error!(%remote, "refused a connection from a misconfigured rank: {e}");
                    }
                    Err(HandshakeFailure::Refused(e)) if e.reject_reason() == RejectReason::Auth => {} // logged
                    Err(e) => tracing::warn!(%remote, "dropped a connection that is no rank of this group: {e}"),
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, remote)) => {
                    pending.spawn(accepted_handshake(
                        stream,
                        remote,
                        expect,
                        secret.clone(),
                        HANDSHAKE_TIMEOUT,
                        shared_memory,
                    ));
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
            },
        }
    }
}

/// Serve a full set of connections accepted from `peer`: as this rank's lanes to it if it has
/// none yet, else read-only.
fn serve_set<S>(
    inner: &Arc<Inner>,
    peer: Rank,
    streams: Vec<Conn<S>>,
    into_tcp: fn(S) -> Result<tokio::net::TcpStream, S>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let n = streams.len();
    let mut queues = inner.input(|st, _| st.accept_lanes(now(), peer, n)).map(Vec::into_iter);
    for (index, (stream, shm)) in streams.into_iter().enumerate() {
        let rx = match queues.as_mut().and_then(Iterator::next) {
            Some(rx) => rx,
            None => inner.lock().idle_writer(),
        };
        attach(inner, peer, stream, into_tcp, rx, index, shm);
    }
    inner.timer.notify_one();
}
