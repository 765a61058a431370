//! Connecting a group: rendezvous through the store, a full mesh of checked connections, and
//! the tasks that serve them.
//!
//! Every rank listens, publishes `cohort/pg<G>/addr/<rank>` = `ip:port`, then dials every lower
//! rank and accepts every higher one. On each connection both sides write their
//! [`Handshake`](cohort_core::protocol::Handshake), read the other's, check it and answer with a
//! [`HandshakeReply`](cohort_core::protocol::HandshakeReply), so both
//! learn why a connection was refused (wrong world size, wrong group, duplicate rank…).
//! Each pair opens two sets of `connections_per_peer` connections, one per direction of bulk
//! data (each handshake carries its index, in `0..2 × connections_per_peer`): the lower rank
//! writes its large data frames on the first set, the higher on the second, and both write
//! everything else (control frames, p2p messages, small data frames) on connection 0 and read
//! from all. A rank's bulk writes then never share a socket with its peer's (on one shared
//! socket they contend for its lock), while small frames both ways keep sharing one, where each
//! side's data carries its acknowledgements. With `lazy_connect`, init only waits for every
//! rank's address and the mesh is built on first use (see `lazy`).
//!
//! The handshake, the store keys and the init error live in [`super::rendezvous`], and serving
//! a connection in [`super::attach`]; both are shared with the lazy mesh and splits.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use cohort_core::group::{GroupConfig, GroupState};
use cohort_core::protocol::{FailureRecord, HandshakeError, HandshakeExpectation, RejectReason};
use cohort_core::recorder::RecorderConfig;
use cohort_core::work::{GroupId, Rank};
use tokio::sync::Notify;

use super::attach::attach;
use super::link;
use super::options::TcpOptions;
use super::rendezvous::{
    Accepted, Conn, HandshakeFailure, InitError, accepted_handshake, addr_key, all_published_key, dial_one, error_key,
    is_misconfigured_rank, may_share_memory, published_count_key,
};
use super::state::DriverState;
use super::tunables::{HANDSHAKE_TIMEOUT, STORE_ERROR_POLL};
use super::{Inner, ProcessGroup, now};
use crate::net::{Listener, Net};
use crate::store::{Store, StoreError};

impl ProcessGroup {
    /// Connect rank `rank` of a `world_size`-rank group through `store` (group 0, the default
    /// group). Every rank calls this with the same store and world size. Must be called inside
    /// a tokio runtime (or turmoil host); the group's tasks run there.
    pub async fn connect<N: Net>(
        net: N,
        store: Arc<dyn Store>,
        rank: u32,
        world_size: u32,
        opts: TcpOptions,
    ) -> Result<ProcessGroup, InitError> {
        Self::connect_group(net, store, GroupId(0), rank, world_size, opts).await
    }

    /// [`ProcessGroup::connect`] for a group with its own id (sub-groups, splits).
    pub async fn connect_group<N: Net>(
        net: N,
        store: Arc<dyn Store>,
        gid: GroupId,
        rank: u32,
        world_size: u32,
        opts: TcpOptions,
    ) -> Result<ProcessGroup, InitError> {
        if world_size == 0 || rank >= world_size {
            return Err(InitError::BadRank { rank, world_size });
        }
        if !(1..=super::MAX_CONNECTIONS_PER_PEER).contains(&opts.connections_per_peer) {
            return Err(InitError::InvalidOption {
                option: "connections_per_peer",
                value: opts.connections_per_peer.to_string(),
                expected: format!("1 to {}", super::MAX_CONNECTIONS_PER_PEER),
            });
        }
        if opts.shared_memory && cohort_core::shm::segment_len(opts.shm_ring_bytes).is_err() {
            return Err(InitError::InvalidOption {
                option: "shm_ring_bytes",
                value: opts.shm_ring_bytes.to_string(),
                expected: "a power of two from 4096 to 1073741824".into(),
            });
        }
        // The quick path's clock calibrates while the group connects; not on a host with more
        // ranks than cores, where the calibrations of its ranks spin at once for a core each
        // and ran for up to their limit (200 ms), and where each look of a wait yields anyway.
        let ticks = (world_size > 1 && opts.shm_quick && !opts.oversubscribed && may_share_memory::<N>(&opts))
            .then(super::quick::calibrating)
            .flatten();
        let me = Rank(rank);
        let k = opts.connections_per_peer;
        let (streams, lazy_listener) = if world_size == 1 {
            ((0..world_size).map(|_| Vec::new()).collect(), None)
        } else {
            let listener = listen(&net, store.as_ref(), gid, me, &opts).await?;
            if opts.lazy_connect {
                await_addresses(store.as_ref(), gid, world_size, &opts).await?;
                ((0..world_size).map(|_| Vec::new()).collect(), Some(listener))
            } else {
                // Per peer: a set of connections each way, each a socket and an epoll set.
                let needed = 4 * u64::from(k) * u64::from(world_size - 1) + 64;
                if let Some(why) = super::socket::raise_open_files(needed) {
                    tracing::warn!(rank, world_size, "{why}");
                }
                (mesh(&net, &listener, store.as_ref(), gid, me, world_size, &opts).await?, None)
            }
        };

        let mut cfg = GroupConfig::new(world_size);
        cfg.group_id = gid;
        cfg.name = gid.0.to_string();
        cfg.desc = if gid.0 == 0 { "default_pg".into() } else { format!("group {gid}") };
        cfg.timeout = opts.timeout;
        cfg.error_handling = opts.error_handling;
        cfg.heartbeat = opts.heartbeat;
        cfg.max_in_flight = opts.max_in_flight;
        cfg.recorder = RecorderConfig::new(opts.trace_buffer_size);
        cfg.backend = super::BACKEND_NAME.into();
        cfg.lazy_peers = opts.lazy_connect;
        // The recorder's wall-clock anchor, read beside the group's epoch. It only appears in
        // dumps, never in decisions; the simulator fixes it so that dumps replay byte for byte.
        cfg.wall_epoch_ns = opts.wall_clock_anchor_ns.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        let group = GroupState::new(cfg, me, now());

        // Every connection to a peer counts in its tally, which turns their closes into one.
        let tallies = link::Tallies::new(world_size);
        let mut writers = super::state::Writers::new();
        let mut attached = Vec::new();
        for (peer, conns) in streams.into_iter().enumerate() {
            if conns.is_empty() {
                continue;
            }
            // This rank writes its large data frames on its direction's set, everything else on
            // connection 0; a connection it does not write on only needs a writer that says
            // goodbye (given once the driver exists).
            let k = usize::from(k);
            let lower = me.0 < peer as u32;
            let mine = if lower { 0..k } else { k..2 * k };
            let mut lanes = Vec::with_capacity(k + 1);
            // Over shared memory, everything goes on connection 0: the segment is its.
            let shared = conns.first().is_some_and(|(_, shm)| shm.is_some());
            for (index, (s, shm)) in conns.into_iter().enumerate() {
                if let Some(t) = tallies.get(Rank(peer as u32)) {
                    t.add();
                }
                if index == 0 || mine.contains(&index) {
                    let (tx, rx) = link::lane();
                    lanes.push(tx);
                    attached.push((Rank(peer as u32), s, Some(rx), index, shm));
                } else {
                    attached.push((Rank(peer as u32), s, None, index, shm));
                }
            }
            let bulk = if shared {
                0..0
            } else if lower {
                0..k
            } else {
                1..k + 1
            };
            writers.insert(Rank(peer as u32), link::Lanes::with_bulk(lanes, bulk));
        }
        let lazy = opts.lazy_connect.then_some(k);
        let secret = opts.auth.clone();
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| {
            let progress: crate::work::ProgressFn = Arc::new(super::Poller::new(weak.clone(), &opts));
            let polling = Mutex::new(super::Polling::new(opts.busy_poll));
            let quick = super::quick::Gate::new(world_size, opts.oversubscribed, group.epoch());
            let weak = weak.clone();
            let on_written: super::state::OnWritten = Arc::new(move |to, ids, outcome| {
                if let Some(inner) = weak.upgrade() {
                    inner.input(|st, fx| st.handle_written(now(), to, ids, outcome, fx));
                }
            });
            let pool = link::BufferPool::with_limit(opts.buffer_pool_bytes);
            let state = DriverState::new(group, writers, lazy, on_written, pool);
            Inner {
                rank: me,
                world_size,
                group_id: gid,
                opts,
                unwritten: state.writing_count(),
                corks: state.corks(),
                state: Mutex::new(state),
                timer: Notify::new(),
                hook: RwLock::new(None),
                hooked: Default::default(),
                store,
                runtime: tokio::runtime::Handle::current(),
                tasks: Mutex::new(Vec::new()),
                reader_tasks: Mutex::new(Vec::new()),
                writers: Mutex::new(Vec::new()),
                connector: super::split::connector(net.clone()),
                split_counts: super::split::SplitCounts::default(),
                lineage: Mutex::new(None),
                tallies,
                dialer: super::lazy::dialer(net.clone()),
                readers: RwLock::new(Vec::new()),
                polling,
                progress,
                looks: std::sync::atomic::AtomicU32::new(0),
                quick,
            }
        });
        for (peer, stream, rx, index, shm) in attached {
            let rx = rx.unwrap_or_else(|| inner.lock().idle_writer());
            attach(&inner, peer, stream, N::into_tcp, rx, index, shm);
        }
        let weak = Arc::downgrade(&inner);
        let mut tasks = vec![
            tokio::spawn(run_timer(weak.clone())),
            tokio::spawn(watch_store_errors(weak.clone())),
            tokio::spawn(inner.corks.clone().watch()),
        ];
        if let Some(listener) = lazy_listener {
            let expect = HandshakeExpectation::new(gid, me, world_size).with_connections_per_peer(k);
            let shm = may_share_memory::<N>(&inner.opts);
            tasks.push(tokio::spawn(super::lazy::serve_accepts(listener, weak, expect, secret, shm)));
        }
        inner.tasks.lock().unwrap_or_else(|p| p.into_inner()).extend(tasks);
        inner.timer.notify_one();
        if let Some(ticks) = ticks {
            // Only a panic fails it; the clock then reads the wall clock, as without a counter.
            let _ = ticks.await;
        }
        super::sigterm::register(Arc::downgrade(&inner) as std::sync::Weak<dyn super::sigterm::Report>);
        Ok(ProcessGroup::from_inner(inner))
    }
}

/// Sleep until the core's next deadline, fire it, repeat; woken early when a new input may
/// have moved the deadline.
async fn run_timer(weak: std::sync::Weak<Inner>) {
    loop {
        let (deadline, notified) = {
            let Some(inner) = weak.upgrade() else { return };
            let deadline = {
                let mut st = inner.lock();
                let d = st.group.poll_timeout();
                st.timer_armed(d);
                d
            };
            (deadline, inner_notified(&inner))
        };
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = notified => continue,
            () = sleep => {
                let Some(inner) = weak.upgrade() else { return };
                inner.input(|st, fx| st.handle_timeout(now(), fx));
            }
        }
    }
}

/// A future that resolves at the next `timer.notify_one()`; holds only a weak reference.
fn inner_notified(inner: &Arc<Inner>) -> impl std::future::Future<Output = ()> + use<> {
    let inner = inner.clone();
    async move { inner.timer.notified().await }
}

/// Learn of failures published through the store by ranks this one may not hear from.
async fn watch_store_errors(weak: std::sync::Weak<Inner>) {
    let (store, key, interval, world_size) = {
        let Some(inner) = weak.upgrade() else { return };
        let interval = inner.opts.heartbeat.map_or(STORE_ERROR_POLL, |h| h.interval);
        (inner.store.clone(), error_key(inner.group_id), interval, inner.world_size)
    };
    loop {
        tokio::time::sleep(interval).await;
        let Some(inner) = weak.upgrade() else { return };
        if inner.lock().group.failure().is_some() || inner.lock().group.is_aborted() {
            return;
        }
        drop(inner);
        if !matches!(store.check(&[key.as_str()]).await, Ok(true)) {
            continue;
        }
        let Ok(value) = store.get(&key).await else { continue };
        let Ok(FailureRecord { origin, blame, message }) = FailureRecord::decode(&value, world_size) else { continue };
        let Some(inner) = weak.upgrade() else { return };
        if origin == inner.rank {
            return;
        }
        let message = format!("(learned through the store) {message}");
        inner.input(|st, fx| st.handle_remote_error(now(), origin, blame, message, fx));
        return;
    }
}

/// Listen on any free port of the bind address and publish `ip:port` under this rank's key.
async fn listen<N: Net>(
    net: &N,
    store: &dyn Store,
    gid: GroupId,
    me: Rank,
    opts: &TcpOptions,
) -> Result<N::Listener, InitError> {
    let bind = SocketAddr::new(opts.bind_addr, 0);
    let listener = net.bind(bind).await.map_err(|source| InitError::Bind { addr: bind, source })?;
    let local = listener.local_addr().map_err(|source| InitError::Bind { addr: bind, source })?;
    let published = SocketAddr::new(opts.bind_addr, local.port());
    store.set(&addr_key(gid, me.0), published.to_string().as_bytes()).await?;
    Ok(listener)
}

/// Lazy rendezvous: wait until every rank has published its address (so that init still says
/// who is missing), without connecting to anyone. Each rank counts itself in; the one that
/// completes the count sets one key, which every rank waits for: O(1) store traffic a rank,
/// where waiting for every rank's key sent each rank's N keys to the store (a 4,096-rank job
/// held 1.4 GB of such requests at once). Only a timeout reads every key, to say who is missing.
async fn await_addresses(store: &dyn Store, gid: GroupId, world_size: u32, opts: &TcpOptions) -> Result<(), InitError> {
    let all = all_published_key(gid);
    if store.add(&published_count_key(gid), 1).await? >= i64::from(world_size) {
        store.set(&all, b"1").await?;
    }
    match store.wait(&[all.as_str()], opts.init_timeout).await {
        Ok(()) => Ok(()),
        Err(StoreError::Timeout { .. }) => Err(missing(store, gid, world_size, opts.init_timeout).await),
        Err(e) => Err(e.into()),
    }
}

/// Build the full mesh: `2 × connections_per_peer` streams per peer (the lower rank's
/// direction first), in connection order (none at this rank's own index).
async fn mesh<N: Net>(
    net: &N,
    listener: &N::Listener,
    store: &dyn Store,
    gid: GroupId,
    me: Rank,
    world_size: u32,
    opts: &TcpOptions,
) -> Result<Vec<Vec<Conn<N::Stream>>>, InitError> {
    let mut streams: Vec<Vec<Conn<N::Stream>>> = (0..world_size).map(|_| Vec::new()).collect();
    if world_size == 1 {
        return Ok(streams);
    }
    // Both directions' connections; the handshake counts them all.
    let k = 2 * opts.connections_per_peer;
    let expect = HandshakeExpectation::new(gid, me, world_size).with_connections_per_peer(k);
    let deadline = tokio::time::Instant::now() + opts.init_timeout;
    let higher = world_size - me.0 - 1;

    // Accept every higher rank's connections while dialing every lower one. Each accepted
    // connection does its handshake in its own task, bounded in time, so that a connection
    // that never speaks (or speaks garbage) holds up nobody: it is dropped with a warning. Only
    // a rank of this job that is misconfigured (wrong world size, impossible rank, another
    // number of connections per peer) fails the rendezvous.
    let accept = async {
        let mut got: BTreeMap<u32, BTreeMap<u16, Conn<N::Stream>>> = BTreeMap::new();
        // Connections refused for failing authentication, by the rank they claimed: a rank
        // that never connects is then reported with the reason.
        let mut refused: BTreeMap<u32, HandshakeError> = BTreeMap::new();
        let complete = |got: &BTreeMap<u32, BTreeMap<u16, Conn<N::Stream>>>| {
            got.values().filter(|conns| conns.len() == usize::from(k)).count() as u32
        };
        let mut pending: tokio::task::JoinSet<Accepted<N::Stream>> = tokio::task::JoinSet::new();
        while complete(&got) < higher {
            tokio::select! {
                biased;
                done = pending.join_next(), if !pending.is_empty() => {
                    let Some(Ok((remote, stream, result))) = done else { continue };
                    match result {
                        Ok((peer, index, shm)) if peer.0 > me.0 && !got.get(&peer.0).is_some_and(|c| c.contains_key(&index)) => {
                            got.entry(peer.0).or_default().insert(index, (stream, shm));
                        }
                        Ok((peer, index, _)) => {
                            tracing::warn!(%remote, "dropping a second connection {index} claiming rank {peer}");
                        }
                        Err(HandshakeFailure::Refused(e)) if is_misconfigured_rank(&e) => {
                            tracing::warn!(%remote, "refused a connection: {e}");
                            return Err(InitError::Handshake { peer: remote.to_string(), source: e });
                        }
                        Err(HandshakeFailure::Refused(e)) if e.reject_reason() == RejectReason::Auth => {
                            // Logged where it was refused. Not fatal: a party without the
                            // secret must not be able to stop the job's init.
                            if let Some(rank) = e.unauthenticated_rank() {
                                refused.insert(rank.0, e);
                            }
                        }
                        Err(e) => tracing::warn!(%remote, "dropped a connection that is no rank of this group: {e}"),
                    }
                }
                accepted = tokio::time::timeout_at(deadline, listener.accept()) => match accepted {
                    Ok(Ok((stream, remote))) => {
                        let limit = HANDSHAKE_TIMEOUT.min(opts.init_timeout);
                        let shm = may_share_memory::<N>(opts);
                        pending.spawn(accepted_handshake(stream, remote, expect, opts.auth.clone(), limit, shm));
                    }
                    Ok(Err(e)) => tracing::warn!("accept failed: {e}"),
                    Err(_) => break,
                },
            }
        }
        Ok((got, refused))
    };
    let dial = async {
        let mut got: BTreeMap<u32, BTreeMap<u16, Conn<N::Stream>>> = BTreeMap::new();
        for peer in 0..me.0 {
            let key = addr_key(gid, peer);
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if store.wait(&[key.as_str()], remaining).await.is_err() {
                return Err(missing(store, gid, world_size, opts.init_timeout).await);
            }
            let value = store.get(&key).await?;
            let text = String::from_utf8_lossy(&value).into_owned();
            let addr: SocketAddr = text.parse().map_err(|_| InitError::Unreachable {
                rank: peer,
                addr: text.clone(),
                reason: "the published address does not parse".into(),
                timeout: opts.init_timeout,
            })?;
            for index in 0..k {
                let conn =
                    dial_one(net, &expect.with_peer(Rank(peer)), peer, index, addr, &text, deadline, opts).await?;
                got.entry(peer).or_default().insert(index, conn);
            }
        }
        Ok(got)
    };
    let (accepted, dialed) = tokio::join!(accept, dial);
    let ((accepted, refused), dialed) = (accepted?, dialed?);
    let short: Vec<u32> =
        (me.0 + 1..world_size).filter(|p| accepted.get(p).map_or(0, BTreeMap::len) < usize::from(k)).collect();
    if !short.is_empty() {
        let err = missing(store, gid, world_size, opts.init_timeout).await;
        // Every rank published its address, yet some never connected: say who.
        if matches!(&err, InitError::Missing { missing, .. } if missing.is_empty()) {
            if let Some((&rank, e)) = short.iter().find_map(|r| refused.get_key_value(r)) {
                return Err(InitError::Handshake { peer: format!("rank {rank}"), source: e.clone() });
            }
            return Err(InitError::Unreachable {
                rank: short[0],
                addr: "(it dials this rank)".into(),
                reason: format!("ranks {short:?} joined the store but did not connect to rank {me}"),
                timeout: opts.init_timeout,
            });
        }
        return Err(err);
    }
    for (peer, conns) in accepted.into_iter().chain(dialed) {
        streams[peer as usize] = conns.into_values().collect();
    }
    Ok(streams)
}

async fn missing(store: &dyn Store, gid: GroupId, world_size: u32, timeout: Duration) -> InitError {
    let mut missing = Vec::new();
    for r in 0..world_size {
        if !matches!(store.check(&[addr_key(gid, r).as_str()]).await, Ok(true)) {
            missing.push(r);
        }
    }
    InitError::Missing { joined: world_size - missing.len() as u32, world_size, missing, timeout }
}
