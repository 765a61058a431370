//! Attaching a connection to a group: the writer and reader tasks that serve it, on the fast
//! path ([`super::socket`]) when it is a real TCP socket.
//!
//! Why a module of its own: both the eager mesh ([`super::connect`]) and the lazy one
//! ([`super::lazy`]) attach connections, and the fast path must not depend on either.

use std::sync::Arc;

use cohort_core::protocol::FrameLimits;
use cohort_core::work::Rank;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use super::Inner;
use super::link;
use super::shm::ShmLink;
use super::socket;
use super::state::deliver;

/// Serve one connection to `peer`: a writer task writes what `rx` queues (and says goodbye when
/// the driver closes it), a reader task feeds what arrives to the driver through the peer's
/// close tally. The caller has counted the connection in the tally. A stream that `into_tcp`
/// (the network's [`Net::into_tcp`](crate::net::Net::into_tcp)) finds to be a real TCP socket
/// takes the fast path (see [`super::socket`]). `index`: the connection's place in the peer's
/// set (connection 0 carries the small frames of both directions). `shm`: the shared memory
/// the pair agreed on for this connection, whose rings then carry its frames (only on the fast
/// path: a connection that cannot take it is closed, since the peer writes to the ring).
pub(crate) fn attach<S>(
    inner: &Arc<Inner>,
    peer: Rank,
    stream: S,
    into_tcp: fn(S) -> Result<tokio::net::TcpStream, S>,
    rx: link::LaneRx,
    index: usize,
    shm: Option<ShmLink>,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let tcp = match into_tcp(stream) {
        Err(stream) if shm.is_none() => return attach_generic(inner, peer, stream, rx),
        Err(_) => return refuse(inner, peer, "shared memory was agreed on a connection that is no TCP socket".into()),
        Ok(tcp) => tcp,
    };
    let taken = {
        let _runtime = inner.runtime.enter();
        socket::take(tcp)
    };
    match taken {
        Ok(fast) => attach_fast(inner, peer, fast, rx, index == 0, shm.as_ref()),
        Err((e, Some(tcp))) if shm.is_none() => {
            tracing::debug!(%peer, "no fast path for this connection ({e})");
            attach_generic(inner, peer, tcp, rx);
        }
        Err((e, _)) => refuse(inner, peer, format!("could not take the socket: {e}")),
    }
}

/// Close a connection that cannot be served, through the peer's tally.
fn refuse(inner: &Arc<Inner>, peer: Rank, reason: String) {
    let Some(tally) = inner.tallies.get(peer) else { return };
    let closed = link::Inbound::Closed { from: peer, reason, clean: false };
    if tally.pass(&closed) {
        inner.input(|st, fx| deliver(st, fx, closed));
    }
}

fn attach_generic<S>(inner: &Arc<Inner>, peer: Rank, stream: S, rx: link::LaneRx)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (r, w) = tokio::io::split(stream);
    let limits = FrameLimits::new(inner.opts.max_frame);
    let Some(tally) = inner.tallies.get(peer) else { return };
    let weak = Arc::downgrade(inner);
    let pool = inner.lock().pool.clone();
    let err_tx = spawn_error_relay(inner, tally.clone());
    let writer = inner.runtime.spawn(link::run_writer(inner.rank, peer, w, rx, err_tx));
    let reader = inner.runtime.spawn(async move {
        link::run_reader(peer, r, limits, pool, |inbound| {
            let Some(inner) = weak.upgrade() else { return false };
            if tally.pass(&inbound) {
                inner.input(|st, fx| deliver(st, fx, inbound));
            }
            true
        })
        .await
    });
    inner.writers.lock().unwrap_or_else(|p| p.into_inner()).push(writer);
    inner.reader_tasks.lock().unwrap_or_else(|p| p.into_inner()).push(reader);
}

fn attach_fast(
    inner: &Arc<Inner>,
    peer: Rank,
    fast: socket::FastSocket,
    rx: link::LaneRx,
    shared: bool,
    shm: Option<&ShmLink>,
) {
    let Some(tally) = inner.tallies.get(peer) else { return };
    let fast = Arc::new(fast);
    let limits = FrameLimits::new(inner.opts.max_frame);
    let pool = inner.lock().pool.clone();
    let asm = link::Assembler::new(peer, limits, pool);
    let path = shm.map(|link| socket::ShmPath::new(link, fast.std()));
    let reader = Arc::new(socket::FastReader::new(fast.clone(), asm, tally.clone(), shared, path.clone()));
    socket::FastReader::join(&mut inner.readers.write().unwrap_or_else(|p| p.into_inner()), reader.clone());
    if shm.is_some() {
        inner.quick.attach(peer, &reader);
    }
    let err_tx = spawn_error_relay(inner, tally);
    let writer = match path {
        Some(path) => {
            rx.gate.open(path.wire());
            let w = socket::ShmWrite(path);
            inner.runtime.spawn(link::run_writer(inner.rank, peer, w, rx, err_tx))
        }
        None => {
            rx.gate.open(fast.std());
            let w = socket::SharedWrite(fast);
            inner.runtime.spawn(link::run_writer(inner.rank, peer, w, rx, err_tx))
        }
    };
    let reader = inner.runtime.spawn(socket::run_reader(reader, Arc::downgrade(inner), peer));
    inner.writers.lock().unwrap_or_else(|p| p.into_inner()).push(writer);
    inner.reader_tasks.lock().unwrap_or_else(|p| p.into_inner()).push(reader);
}

/// A task that feeds a writer's failure to the driver through the peer's close tally.
fn spawn_error_relay(inner: &Arc<Inner>, tally: Arc<link::CloseTally>) -> mpsc::UnboundedSender<link::Inbound> {
    let weak = Arc::downgrade(inner);
    let (err_tx, mut err_rx) = mpsc::unbounded_channel();
    let errors = inner.runtime.spawn(async move {
        while let Some(inbound) = err_rx.recv().await {
            let Some(inner) = weak.upgrade() else { return };
            if tally.pass(&inbound) {
                inner.input(|st, fx| deliver(st, fx, inbound));
            }
        }
    });
    inner.tasks.lock().unwrap_or_else(|p| p.into_inner()).push(errors);
    err_tx
}
