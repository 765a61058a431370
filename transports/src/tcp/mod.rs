//! The TCP backend: a [`ProcessGroup`] over a full mesh of TCP connections — what Gloo is to
//! c10d, with cohort's failure detection.
//!
//! # How it runs
//!
//! The group's [`DriverState`](state::DriverState) (the core's `GroupState`, the flight
//! recorder, running schedules, point-to-point matching) sits behind one mutex. Every input
//! takes the lock, feeds the core one input and drains its outputs: a user call submits
//! directly from the caller's thread or task (so a `Work` knows its sequence number at once),
//! one reader task per peer feeds frames, and one timer task sleeps until the core's next
//! deadline. Writer tasks, one per peer, send queued frames. Works are finished after the lock
//! is released, so waiters and hooks never run under it.
//!
//! Everything goes through [`Net`](crate::net::Net) and `tokio::time`, so the same code runs on
//! real sockets and inside the turmoil simulator.
//!
//! A rank process SIGTERMed (as `cohort launch` does after `--grace`) first prints, for each of
//! its live groups, the oldest unfinished work and whom it waited for, and dumps the flight
//! recorder when `COHORT_DUMP_ON_FAILURE` is set; it then dies of SIGTERM as before. The first
//! group (TCP or NCCL) installs this once per process; `COHORT_SIGTERM_REPORT=0` turns it off.
//! See `sigterm.rs`.

mod attach;
mod collective;
mod connect;
mod device;
mod init;
mod lazy;
mod link;
mod monitored;
mod options;
mod quick;
mod rendezvous;
mod shm;
#[cfg(test)]
mod shm_tests;
pub(crate) mod sigterm;
mod socket;
mod sparse;
mod split;
mod state;
mod tunables;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use cohort_core::group::{Collective, SubmitError, TensorSpec};
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::Tensor;
use cohort_core::work::{Blame, GroupId, OpType, Rank};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

pub use device::{DeviceProcessGroup, DeviceSubmitError};
pub use init::{InitConfig, init_process_group, init_process_group_with, rendezvous_store, runtime};
pub use monitored::{MONITORED_BARRIER_TAG, MonitoredBarrierError};
pub use options::{
    BUSY_POLL_MAX_BYTES, EnvError, MAX_CONNECTIONS_PER_PEER, MAX_IO_THREADS, TcpOptions, resolve_bind_addr,
};
pub use rendezvous::InitError;
pub use sparse::{SparseError, SparseTensor};
pub use split::{Lineage, NEXT_GROUP_ID_KEY, SplitError};

use self::collective::Request;
use self::state::{DriverState, Effects, Payload};
use self::tunables::MAX_POLL_FACTOR;
use crate::store::Store;
use crate::work::{CompletionHook, Work};

pub use tunables::SHUTDOWN_FLUSH;

/// The backend name in flight-recorder profiling names (`tcp:all_reduce`).
pub const BACKEND_NAME: &str = "tcp";

/// The current time as the core wants it: tokio's clock (turmoil drives it in the simulator).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

pub(crate) struct Inner {
    rank: Rank,
    world_size: u32,
    group_id: GroupId,
    opts: TcpOptions,
    state: Mutex<DriverState>,
    timer: Notify,
    hook: RwLock<Option<CompletionHook>>,
    /// Whether `hook` was ever set: a submit reads `hook` only then, and takes no lock for it
    /// otherwise ([`Inner::completion_hook`]).
    hooked: std::sync::atomic::AtomicBool,
    store: Arc<dyn Store>,
    runtime: tokio::runtime::Handle,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The writer tasks: shutting down waits for them to flush and say goodbye.
    writers: Mutex<Vec<JoinHandle<()>>>,
    /// The reader tasks: shutting down waits for them to hear each peer's goodbye (or end of
    /// stream), so that no connection is dropped with the peer's frames still arriving.
    reader_tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Connects new groups (splits, merges) over the same network as this one.
    connector: split::Connector,
    /// How many splits over each rank set this rank made from this group.
    split_counts: split::SplitCounts,
    /// Where this group came from, if it was split or merged from another.
    lineage: Mutex<Option<split::Lineage>>,
    /// Per peer: turns the closes of its connections into one.
    tallies: link::Tallies,
    /// Dials a peer on first use (lazy connection).
    dialer: lazy::Dialer,
    /// The reading sides of this group's real TCP connections, which a thread waiting for a
    /// work of up to [`BUSY_POLL_MAX_BYTES`] may drain itself (see [`socket`]).
    readers: RwLock<Vec<Arc<socket::FastReader>>>,
    /// How many threads are polling the readers, and when the last one finished its work.
    polling: Mutex<Polling>,
    /// [`Inner::progress`] and friends as a work's progress function (one for every work of
    /// the group).
    progress: crate::work::ProgressFn,
    /// Frames of this rank waiting for the writer tasks ([`DriverState::writing_count`]).
    unwritten: Arc<std::sync::atomic::AtomicUsize>,
    /// Small frames held back for one write ([`DriverState::corks`]).
    corks: Arc<link::Corks>,
    /// Polling threads' looks at the readers, counted to look at shared-memory sockets now and
    /// then only (see [`socket::readable`]).
    looks: std::sync::atomic::AtomicU32,
    /// Small allreduces over shared memory run in their submit call (see [`quick`]).
    quick: quick::Gate,
}

/// Who waits for a group's works, for its fast connections (see [`socket::FastReader`]):
/// threads polling the sockets, and threads or tasks sleeping until the runtime ends a work;
/// and for how long a thread may poll.
///
/// The time adapts. A thread that stopped polling and then slept a short while (less than
/// [`MAX_POLL_FACTOR`] times [`TcpOptions::busy_poll`]) would have done better to poll on: its
/// sleep cost two wake-ups, and on a busy host the wake-ups are what is slow (the peer, polling
/// meanwhile, gives up in turn, and the two ranks take turns sleeping, each wake-up taking
/// longer than the setting). Such a sleep doubles the time, up to that cap. A longer sleep
/// after a poll that heard nothing (the peers are late or silent) halves it, down to the
/// setting. A longer sleep after a poll that delivered frames leaves it as it is: the work was
/// moving, only slowly (a large collective of ranks sharing cores, or a job's first
/// collectives, whose buffers are new), and a shorter poll hands the rest of such works to the
/// reader tasks, whose hand-offs between tasks make them slower still, which keeps the time
/// short (`docs/performance.md`, "The four-rank bulk slow start"). The price is paid where one
/// peer is late at every collective while the others' frames come: each such wait may poll
/// up to the cap. A work that ends while its thread polls changes nothing.
///
/// It starts at the cap. A job's first waits are where its ranks are least in step: a rank
/// that slept in the barrier before the first collective wakes 50–300 µs after its peer on a
/// virtual machine, and a peer that gave up after the setting slept in turn, each sleep
/// costing both ranks a wake-up, until four short sleeps had doubled the time to where it no
/// longer slept (`docs/performance.md`, "The first 500 over TCP: sleeps and a shared core").
#[derive(Debug)]
pub(crate) struct Polling {
    active: usize,
    sleepers: usize,
    last_finished: Option<std::time::Instant>,
    base: std::time::Duration,
    budget: std::time::Duration,
}

impl Polling {
    pub(crate) fn new(base: std::time::Duration) -> Self {
        Polling { active: 0, sleepers: 0, last_finished: None, base, budget: base * MAX_POLL_FACTOR }
    }

    /// A thread that had polled for all its time (`moved`: and delivered frames meanwhile)
    /// woke after sleeping `slept`.
    fn adapt(&mut self, slept: std::time::Duration, moved: bool) {
        let cap = self.base * MAX_POLL_FACTOR;
        if slept < cap {
            self.budget = (self.budget * 2).min(cap);
        } else if !moved {
            self.budget = (self.budget / 2).max(self.base);
        }
    }

    /// Whether the reader tasks must listen now: someone sleeps and nobody polls for them.
    fn relied_on(&self) -> bool {
        self.sleepers > 0 && self.active == 0
    }

    /// [`Inner::rearm_in`] at `now`, given when the last work ended in its submit call.
    fn rearm(&self, quick_ended: Option<Instant>, now: Instant) -> socket::Rearm {
        if self.relied_on() {
            return socket::Rearm::Now;
        }
        if self.active > 0 {
            return socket::Rearm::WhilePolling;
        }
        let Some(last) = self.last_finished.max(quick_ended) else { return socket::Rearm::Now };
        match tunables::REARM_GRACE.checked_sub(now.saturating_duration_since(last)).filter(|d| !d.is_zero()) {
            Some(left) => socket::Rearm::After(left),
            None => socket::Rearm::Now,
        }
    }
}

/// [`Inner`]'s side of [`crate::work::Progress`], with the group's yield interval (see
/// [`TcpOptions::oversubscribed`]) and the rank's own core (see [`TcpOptions::home_core`]),
/// fixed for its life.
pub(crate) struct Poller {
    inner: std::sync::Weak<Inner>,
    yield_every: std::time::Duration,
    home: Option<usize>,
}

impl Poller {
    pub(crate) fn new(inner: std::sync::Weak<Inner>, opts: &TcpOptions) -> Poller {
        let yield_every = if opts.oversubscribed { std::time::Duration::ZERO } else { crate::work::YIELD_EVERY };
        Poller { inner, yield_every, home: opts.home_core.and_then(crate::work::home_core) }
    }
}

impl crate::work::Progress for Poller {
    fn begin(&self) -> std::time::Duration {
        let Some(inner) = self.inner.upgrade() else { return std::time::Duration::ZERO };
        let mut p = inner.polls();
        p.active += 1;
        p.budget
    }

    fn yield_every(&self) -> std::time::Duration {
        self.yield_every
    }

    fn poll(&self, first: bool) -> Option<bool> {
        self.inner.upgrade().and_then(|inner| inner.progress(first))
    }

    fn stop(&self, finished: bool) {
        let Some(inner) = self.inner.upgrade() else { return };
        let mut p = inner.polls();
        p.active = p.active.saturating_sub(1);
        if finished {
            p.last_finished = Some(std::time::Instant::now());
        }
        if p.relied_on() {
            drop(p);
            inner.rearm_readers();
        }
    }

    fn sleep(&self) {
        let Some(inner) = self.inner.upgrade() else { return };
        // A sleeping thread takes no core from a peer's (see `CoreMoves`).
        inner.quick.neighbours(inner.rank, None);
        let mut p = inner.polls();
        p.sleepers += 1;
        if p.relied_on() {
            drop(p);
            inner.rearm_readers();
        }
    }

    fn woke(&self, time: std::time::Duration, polled: crate::work::Polled) {
        let Some(inner) = self.inner.upgrade() else { return };
        let mut p = inner.polls();
        p.sleepers = p.sleepers.saturating_sub(1);
        if polled.spent {
            p.adapt(time, polled.moved);
        }
    }

    fn flush(&self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.corks.flush();
        }
    }

    fn polls_on(&self, core: u32) -> crate::work::Neighbours {
        let Some(inner) = self.inner.upgrade() else { return crate::work::Neighbours::default() };
        let mut near = inner.quick.neighbours(inner.rank, Some(core));
        if !near.known {
            near.home = crate::work::Home::of(self.home, core);
        }
        near
    }

    fn home(&self) -> Option<usize> {
        let home = self.home?;
        let inner = self.inner.upgrade()?;
        (!inner.quick.any_reader()).then_some(home)
    }
}

/// Effects of inputs run under other locks, to be applied once every lock is released.
#[derive(Default)]
pub(crate) struct Deferred {
    effects: Effects,
    dials: Vec<(Rank, Vec<link::LaneRx>)>,
}

impl Deferred {
    /// Empty, with nothing allocated: dropping it would only look at its empty fields. (Every
    /// field is named here, so that one added later is not left out of the question.)
    pub(crate) fn is_vacant(&self) -> bool {
        let Deferred { effects, dials } = self;
        dials.capacity() == 0 && effects.is_vacant()
    }
}

impl Inner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, DriverState> {
        // Every critical section leaves the state consistent before anything can panic inside
        // it (the core's methods do not panic on any input), so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The completion hook, if one was set; no lock is taken while none has been.
    pub(crate) fn completion_hook(&self) -> Option<CompletionHook> {
        let hooked = self.hooked.load(std::sync::atomic::Ordering::Acquire);
        hooked.then(|| self.hook.read().unwrap_or_else(|p| p.into_inner()).clone()).flatten()
    }

    /// Run one input under the lock, then perform its effects outside it.
    pub(crate) fn input<T>(self: &Arc<Self>, f: impl FnOnce(&mut DriverState, &mut Effects) -> T) -> T {
        let mut acc = Deferred::default();
        let out = self.input_into(&mut acc, f);
        self.finish_inputs(&mut acc);
        out
    }

    /// Run one input under the lock, gathering its effects in `acc` for
    /// [`Inner::finish_inputs`] (for callers that hold another lock).
    pub(crate) fn input_into<T>(&self, acc: &mut Deferred, f: impl FnOnce(&mut DriverState, &mut Effects) -> T) -> T {
        let mut st = self.lock();
        let earlier = std::mem::take(&mut acc.effects.rearm_timer);
        let out = f(&mut st, &mut acc.effects);
        acc.effects.rearm_timer = earlier || (acc.effects.rearm_timer && st.timer_needs_wake());
        if st.has_dial_requests() {
            acc.dials.extend(st.take_dial_requests());
        }
        out
    }

    /// Perform the effects gathered by [`Inner::input_into`], leaving `acc` empty. Call with
    /// no lock held.
    ///
    /// Inlined, and `acc` is borrowed, so that a caller with nothing gathered (a small work
    /// ended in its submit call, most often) neither calls nor copies the gathering.
    #[inline]
    pub(crate) fn finish_inputs(self: &Arc<Self>, acc: &mut Deferred) {
        if acc.dials.is_empty() && acc.effects.is_empty() {
            return;
        }
        self.perform(std::mem::take(acc));
    }

    fn perform(self: &Arc<Self>, acc: Deferred) {
        for (peer, lanes) in acc.dials {
            (self.dialer)(self.clone(), peer, lanes);
        }
        self.apply(acc.effects);
    }

    /// Read what has arrived on every fast connection and feed it, from a thread waiting for a
    /// work; whether anything was delivered, or `None` if this rank's own frames wait for the
    /// writer tasks, or a reader task holds frames it read and has not delivered yet: a polling
    /// thread would only keep them from the CPU (on a host with as many busy threads as cores,
    /// for a whole time slice), so it had better yield.
    ///
    /// On a wait's `first` look, with one peer, it reads the connection that carries small
    /// frames without asking `poll(2)` which have bytes: in a run of small works what it waits
    /// for has usually arrived already, and the `poll` would be a third system call per work
    /// besides the write and the read. With several peers it asks `poll` at once: one `poll`
    /// costs less than a read of each peer, most of them empty. Later looks ask `poll` first,
    /// so that a thread spinning on an empty socket does not contend with the peer's packets
    /// for its lock.
    pub(crate) fn progress(self: &Arc<Self>, first: bool) -> Option<bool> {
        if self.unwritten.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            return None;
        }
        let mut acc = Deferred::default();
        let mut delivered = false;
        let mut task_draining = false;
        {
            let readers = self.readers.read().unwrap_or_else(|p| p.into_inner());
            let mut shared = readers.iter().filter(|r| r.shared());
            let only = if first { shared.next().filter(|_| shared.next().is_none()) } else { None };
            if let Some(r) = only {
                delivered = r.drain(self, true, &mut acc);
            } else {
                // Shared-memory sockets carry only doorbells and their end: seldom.
                let looks = self.looks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let sockets = looks.is_multiple_of(tunables::SOCKET_LOOK_EVERY);
                for (r, ready) in readers.iter().zip(socket::readable(&readers, sockets)) {
                    if ready {
                        delivered |= r.drain(self, true, &mut acc);
                    }
                }
            }
            if !delivered {
                task_draining = readers.iter().any(|r| r.task_draining());
            }
        }
        self.finish_inputs(&mut acc);
        // A reader task holds what arrived: let it have the CPU rather than poll an empty socket.
        if task_draining { None } else { Some(delivered) }
    }

    fn polls(&self) -> MutexGuard<'_, Polling> {
        self.polling.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a reader task whose epoll set fired should leave it unarmed: while threads
    /// poll, and for [`tunables::REARM_GRACE`] after the last finished its work (a work ended
    /// in its submit call counts: its thread read the ring as a polling thread does).
    pub(crate) fn rearm_in(&self) -> socket::Rearm {
        self.polls().rearm(self.quick.last_ended(), Instant::now())
    }

    /// Let every reader task hear of the next bytes again (someone now relies on them).
    pub(crate) fn rearm_readers(&self) {
        for r in self.readers.read().unwrap_or_else(|p| p.into_inner()).iter() {
            r.arm();
        }
    }

    /// A fast connection ended: stop draining it (and let its socket close).
    pub(crate) fn forget_reader(&self, reader: &Arc<socket::FastReader>) {
        self.readers.write().unwrap_or_else(|p| p.into_inner()).retain(|r| !Arc::ptr_eq(r, reader));
    }

    fn apply(self: &Arc<Self>, effects: Effects) {
        if effects.rearm_timer {
            self.timer.notify_one();
        }
        for (pool, bytes, chunk) in effects.reserve {
            pool.reserve(bytes, chunk);
        }
        // Dump before the works complete: a caller that sees the error and exits at once still
        // leaves its flight recorder on disk.
        if let Some((origin, blame, message)) = effects.failed {
            self.on_failure(origin, blame, message);
        }
        effects.finished.complete();
        if let Some(cause) = effects.tear_down {
            self.dump_recorder("tear down");
            tracing::error!("tearing the process down (error handling mode): {cause}");
            eprintln!("cohort: rank {}: tearing the process down: {cause}", self.rank);
            std::process::abort();
        }
    }

    /// The group failed or was aborted: dump the recorder, publish the cause through the store
    /// (first writer wins) so ranks that never saw the failure learn its origin, close links.
    fn on_failure(self: &Arc<Self>, origin: Rank, blame: Blame, message: String) {
        self.dump_recorder("failure");
        self.lock().close_links();
        let store = self.store.clone();
        let key = rendezvous::error_key(self.group_id);
        let value = cohort_core::protocol::FailureRecord { origin, blame, message }.encode();
        self.runtime.spawn(async move {
            if let Err(e) = store.compare_set(&key, b"", &value).await {
                tracing::warn!("could not publish the failure through the store: {e}");
            }
        });
    }

    fn dump_recorder(&self, why: &str) {
        if self.opts.dump_prefix.is_none() {
            return;
        }
        let json = self.lock().dump_json();
        self.write_dump(json, why);
    }

    /// Write a flight-recorder dump to `<dump prefix><rank>.json`: `None` without a dump
    /// prefix, else the path written or why it was not.
    fn write_dump(&self, json: String, why: &str) -> Option<Result<String, String>> {
        let prefix = self.opts.dump_prefix.as_ref()?;
        Some(sigterm::dump_file(prefix, self.rank, &json, why))
    }
}

/// A process group over TCP. Cheap to clone; every clone is the same group.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
    keep: Arc<Keep>,
}

/// What a group made by [`init_process_group`] owns besides itself: the store it hosts and
/// the runtime its tasks run on.
#[derive(Default)]
struct Keep {
    server: Option<crate::store::TcpStoreServer>,
    runtime: Option<Arc<tokio::runtime::Runtime>>,
}

impl Drop for Keep {
    fn drop(&mut self) {
        drop(self.server.take());
        if let Some(rt) = self.runtime.take().and_then(|rt| Arc::try_unwrap(rt).ok()) {
            // Dropping a runtime blocks on its tasks, and panics inside async code.
            rt.shutdown_background();
        }
    }
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .field("group", &self.inner.group_id)
            .finish()
    }
}

impl ProcessGroup {
    pub(crate) fn from_inner(inner: Arc<Inner>) -> Self {
        ProcessGroup { inner, keep: Arc::new(Keep::default()) }
    }

    /// Keep `server` and `runtime` alive as long as this group.
    pub(crate) fn with_owned(
        self,
        server: Option<crate::store::TcpStoreServer>,
        runtime: Option<Arc<tokio::runtime::Runtime>>,
    ) -> Self {
        let ProcessGroup { inner, keep } = self;
        let mut keep = Arc::try_unwrap(keep).unwrap_or_default();
        if server.is_some() {
            keep.server = server;
        }
        if runtime.is_some() {
            keep.runtime = runtime;
        }
        ProcessGroup { inner, keep: Arc::new(keep) }
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    /// The group's id.
    pub fn group_id(&self) -> GroupId {
        self.inner.group_id
    }

    /// The peers this rank exchanges frames with through shared memory now (same host, both
    /// allowing it: see [`TcpOptions::shared_memory`]), in rank order. Under lazy connection,
    /// only peers connected so far.
    pub fn shared_memory_peers(&self) -> Vec<Rank> {
        let readers = self.inner.readers.read().unwrap_or_else(|p| p.into_inner());
        let mut peers: Vec<Rank> = readers.iter().filter_map(|r| r.shared_memory_peer()).collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// The options the group runs with.
    pub fn options(&self) -> &TcpOptions {
        &self.inner.opts
    }

    /// Where this group came from: `None` for a group connected directly, the parent and the
    /// members' parent ranks for a [`ProcessGroup::split_group`].
    pub fn lineage(&self) -> Option<Lineage> {
        self.inner.lineage.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// This group's rank `rank` in the parent it was split from (torch's `get_global_rank`
    /// for one level); `None` for a group that was not split, or a rank out of range.
    pub fn parent_rank(&self, rank: u32) -> Option<u32> {
        let lineage = self.inner.lineage.lock().unwrap_or_else(|p| p.into_inner());
        lineage.as_ref()?.parent_ranks.as_ref()?.get(rank as usize).copied()
    }

    fn set_lineage(&self, lineage: Lineage) {
        *self.inner.lineage.lock().unwrap_or_else(|p| p.into_inner()) = Some(lineage);
    }

    /// The store the group rendezvoused through.
    pub fn store(&self) -> Arc<dyn Store> {
        self.inner.store.clone()
    }

    /// Call `hook` with every finished work (c10d's `register_on_completion_hook`).
    pub fn set_completion_hook(&self, hook: impl Fn(&crate::work::WorkInfo) + Send + Sync + 'static) {
        *self.inner.hook.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(hook));
        self.inner.hooked.store(true, std::sync::atomic::Ordering::Release);
    }

    /// The flight recorder as JSON in PyTorch's schema (version 2.10).
    pub fn flight_recorder_json(&self) -> String {
        self.inner.lock().dump_json()
    }

    /// Run `fut` on this group's runtime as a [`Work`] (for compound works, such as a
    /// communication hook that chains collectives); its failure keeps the [`WorkResult`] of
    /// whatever failed inside it.
    pub fn spawn_work<F>(&self, op: OpType, fut: F) -> Work
    where
        F: std::future::Future<Output = Result<Vec<Tensor>, cohort_core::work::WorkResult>> + Send + 'static,
    {
        Work::from_work_future(&self.inner.runtime, op, fut)
    }

    /// The last collective sequence number handed out on this group (0 before the first), as
    /// torch's `_get_sequence_number_for_group`; the next collective gets `seq() + 1`.
    pub fn seq(&self) -> cohort_core::work::SeqNo {
        self.inner.lock().group.seq()
    }

    /// The peers this rank is connected to: every peer, unless the group connects lazily
    /// ([`TcpOptions::lazy_connect`]), where it is the peers talked to so far.
    pub fn connected_peers(&self) -> Vec<Rank> {
        let st = self.inner.lock();
        (0..self.inner.world_size).map(Rank).filter(|&r| st.group.is_connected(r)).collect()
    }

    /// The group's first failure, if it failed.
    pub fn failure(&self) -> Option<cohort_core::group::GroupFailure> {
        self.inner.lock().group.failure().cloned()
    }

    /// Abort the group: every unfinished work ends Aborted, later calls are refused, peers are
    /// told.
    pub fn abort(&self, reason: &str) {
        let reason = reason.to_owned();
        self.inner.input(|st, fx| st.handle_abort(now(), reason, fx));
    }

    /// Close the group cleanly: unfinished works are aborted, queued frames are written, and
    /// peers see a goodbye rather than a crash. Outside an async context this waits (up to
    /// [`SHUTDOWN_FLUSH`]) for the writes, so the process may exit right after; inside one,
    /// use [`ProcessGroup::shutdown_async`].
    pub fn shutdown(&self) {
        self.abort_quietly();
        if tokio::runtime::Handle::try_current().is_err() {
            let deadline = std::time::Instant::now() + SHUTDOWN_FLUSH;
            let writers = std::mem::take(&mut *self.inner.writers.lock().unwrap_or_else(|p| p.into_inner()));
            let readers = std::mem::take(&mut *self.inner.reader_tasks.lock().unwrap_or_else(|p| p.into_inner()));
            let busy = |tasks: &[JoinHandle<()>]| tasks.iter().any(|t| !t.is_finished());
            while (busy(&writers) || busy(&readers)) && std::time::Instant::now() < deadline {
                std::thread::sleep(tunables::SHUTDOWN_POLL);
            }
            readers.iter().for_each(JoinHandle::abort);
        }
        self.stop_tasks();
    }

    /// [`ProcessGroup::shutdown`] for async code: waits (up to [`SHUTDOWN_FLUSH`]) for the
    /// writer tasks to flush and say goodbye, and for the readers to hear the peers' goodbyes.
    pub async fn shutdown_async(&self) {
        self.abort_quietly();
        let writers = std::mem::take(&mut *self.inner.writers.lock().unwrap_or_else(|p| p.into_inner()));
        let readers = std::mem::take(&mut *self.inner.reader_tasks.lock().unwrap_or_else(|p| p.into_inner()));
        let aborts: Vec<_> = readers.iter().map(JoinHandle::abort_handle).collect();
        let _ = tokio::time::timeout(SHUTDOWN_FLUSH, async {
            for t in writers.into_iter().chain(readers) {
                let _ = t.await;
            }
        })
        .await;
        aborts.iter().for_each(tokio::task::AbortHandle::abort);
        self.stop_tasks();
    }

    /// Stop every task still running. Why readers are waited for first: a connection dropped
    /// while the peer still sends (a heartbeat, its last frames) is reset, and a reset throws
    /// away what the peer has not read yet, this rank's goodbye included, so a peer still in a
    /// collective would see a reset where this rank left cleanly, and blame it. Each peer
    /// answers a goodbye with its own, so the wait is a round trip.
    fn stop_tasks(&self) {
        for t in self.inner.tasks.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            t.abort();
        }
        for t in self.inner.reader_tasks.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            t.abort();
        }
        self.inner.readers.write().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn abort_quietly(&self) {
        self.inner.input(|st, fx| {
            st.close_links();
            st.handle_abort(now(), "the process group was shut down".into(), fx);
            fx.failed = None;
        });
    }

    fn submit(&self, collective: Collective, payload: Payload) -> Result<Work, SubmitError> {
        let hook = self.inner.completion_hook();
        let bytes: usize =
            collective.inputs.iter().chain(&collective.outputs).map(|t| t.numel() * t.dtype.size()).sum();
        let work = self.inner.input(|st, fx| st.submit(now(), collective, payload, hook, fx))?;
        let poll = !self.inner.opts.busy_poll.is_zero()
            && bytes <= BUSY_POLL_MAX_BYTES
            && !self.inner.readers.read().unwrap_or_else(|p| p.into_inner()).is_empty();
        work.set_progress(self.inner.progress.clone(), poll);
        Ok(work)
    }

    fn collective(&self, collective: Collective, request: Request) -> Result<Work, SubmitError> {
        self.submit(collective, Payload::Collective { request: Box::new(request), run: None })
    }

    // ---- collectives ----

    /// Reduce `tensors` across ranks with `op`; every rank gets the result. Several tensors on
    /// one rank are reduced together (as Gloo does) and every one receives the result.
    pub fn allreduce(&self, tensors: Vec<Tensor>, op: ReduceOp) -> Result<Work, SubmitError> {
        if quick::open(&self.inner, &tensors) {
            quick::allreduce(&self.inner, tensors, op)
        } else {
            self.collective(allreduce_collective(&tensors), Request::allreduce(tensors, op))
        }
    }

    /// Allreduce tensors of different shapes (one dtype) as one flat buffer.
    pub fn allreduce_coalesced(&self, tensors: Vec<Tensor>, op: ReduceOp) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::AllreduceCoalesced).inputs(specs(&tensors));
        self.collective(c, Request::allreduce_coalesced(tensors, op))
    }

    /// Copy `root`'s tensors to every rank.
    pub fn broadcast(&self, tensors: Vec<Tensor>, root: u32) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::Broadcast).inputs(specs(&tensors)).root(Rank(root));
        self.collective(c, Request::broadcast(tensors, Rank(root)))
    }

    /// Reduce `tensors` to `root` with `op`. Only the root's result is meaningful: other ranks'
    /// tensors come back holding partial reductions, as with Gloo.
    pub fn reduce(&self, tensors: Vec<Tensor>, root: u32, op: ReduceOp) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::Reduce).inputs(specs(&tensors)).root(Rank(root));
        self.collective(c, Request::reduce(tensors, Rank(root), op))
    }

    /// Gather every rank's `input`; the result is one tensor per rank, in rank order.
    pub fn allgather(&self, input: Tensor) -> Result<Work, SubmitError> {
        let out = TensorSpec::new(input.dtype(), input.shape());
        let c =
            Collective::new(OpType::Allgather).inputs(vec![out.clone()]).outputs(vec![out; self.world_size() as usize]);
        self.collective(c, Request::allgather(input, false, None))
    }

    /// `allgather_coalesced`: gather every rank's `inputs` (one dtype, any shapes) in one
    /// operation. The result is rank-major: rank 0's tensors in input order, then rank 1's, and
    /// so on (`world_size × inputs.len()` tensors). Every rank must pass the same shapes.
    pub fn allgather_coalesced(&self, inputs: Vec<Tensor>) -> Result<Work, SubmitError> {
        let n = self.world_size() as usize;
        let outputs = (0..n).flat_map(|_| specs(&inputs)).collect();
        let c = Collective::new(OpType::AllgatherCoalesced).inputs(specs(&inputs)).outputs(outputs);
        self.collective(c, Request::allgather_coalesced(inputs))
    }

    /// Gather every rank's `input` into one tensor of `world_size × numel` elements
    /// (`all_gather_into_tensor`).
    pub fn allgather_into_tensor(&self, input: Tensor) -> Result<Work, SubmitError> {
        let n = self.world_size() as usize;
        let out = TensorSpec::new(input.dtype(), &[input.numel().saturating_mul(n)]);
        let c =
            Collective::new(OpType::AllgatherIntoTensor).inputs(specs(std::slice::from_ref(&input))).outputs(vec![out]);
        self.collective(c, Request::allgather(input, true, None))
    }

    /// [`ProcessGroup::allgather_into_tensor`] into `output` (`world_size × numel` elements of
    /// the input's dtype, any shape), which the collective fills in place and returns: torch's
    /// `_allgather_base`. A buffer borrowed from the caller ([`HostBuffer::borrowed`]) is
    /// written directly, with no copy.
    ///
    /// [`HostBuffer::borrowed`]: cohort_core::tensor::HostBuffer::borrowed
    pub fn allgather_base(&self, output: Tensor, input: Tensor) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::AllgatherIntoTensor)
            .inputs(specs(std::slice::from_ref(&input)))
            .outputs(specs(std::slice::from_ref(&output)));
        self.collective(c, Request::allgather(input, true, Some(output)))
    }

    /// Gather every rank's `input` to `root`: the root's result is one tensor per rank, other
    /// ranks' results are empty.
    pub fn gather(&self, input: Tensor, root: u32) -> Result<Work, SubmitError> {
        let spec = TensorSpec::new(input.dtype(), input.shape());
        let outputs = if root == self.rank().0 { vec![spec.clone(); self.world_size() as usize] } else { Vec::new() };
        let c = Collective::new(OpType::Gather).inputs(vec![spec]).outputs(outputs).root(Rank(root));
        self.collective(c, Request::gather(input, Rank(root)))
    }

    /// Scatter `inputs` (one per rank, on the root; empty elsewhere) from `root`; every rank
    /// receives its piece into `output`.
    pub fn scatter(&self, output: Tensor, inputs: Vec<Tensor>, root: u32) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::Scatter)
            .inputs(specs(&inputs))
            .outputs(specs(std::slice::from_ref(&output)))
            .root(Rank(root));
        self.collective(c, Request::scatter(output, inputs, Rank(root)))
    }

    /// Reduce `inputs` (one per rank) with `op`; rank r receives the reduction of everyone's
    /// `inputs[r]`.
    pub fn reduce_scatter(&self, inputs: Vec<Tensor>, op: ReduceOp) -> Result<Work, SubmitError> {
        let out = inputs.first().map(|t| TensorSpec::new(t.dtype(), t.shape())).into_iter().collect();
        let c = Collective::new(OpType::ReduceScatter).inputs(specs(&inputs)).outputs(out);
        self.collective(c, Request::reduce_scatter(inputs, op, false, None))
    }

    /// Reduce one flat `input` of `world_size × k` elements; rank r receives elements
    /// `[r·k, (r+1)·k)` of the reduction (`reduce_scatter_tensor`).
    pub fn reduce_scatter_tensor(&self, input: Tensor, op: ReduceOp) -> Result<Work, SubmitError> {
        let n = self.world_size() as usize;
        let out = TensorSpec::new(input.dtype(), &[input.numel() / n.max(1)]);
        let c =
            Collective::new(OpType::ReduceScatterTensor).inputs(specs(std::slice::from_ref(&input))).outputs(vec![out]);
        self.collective(c, Request::reduce_scatter(vec![input], op, true, None))
    }

    /// [`ProcessGroup::reduce_scatter_tensor`] into `output` (`numel / world_size` elements of
    /// the input's dtype, any shape), which the collective fills in place and returns: torch's
    /// `_reduce_scatter_base`.
    pub fn reduce_scatter_base(&self, output: Tensor, input: Tensor, op: ReduceOp) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::ReduceScatterTensor)
            .inputs(specs(std::slice::from_ref(&input)))
            .outputs(specs(std::slice::from_ref(&output)));
        self.collective(c, Request::reduce_scatter(vec![input], op, true, Some(output)))
    }

    /// Send `inputs[r]` to rank r and receive rank r's piece into `outputs[r]`.
    pub fn alltoall(&self, outputs: Vec<Tensor>, inputs: Vec<Tensor>) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::Alltoall).inputs(specs(&inputs)).outputs(specs(&outputs));
        self.collective(c, Request::alltoall(outputs, inputs))
    }

    /// `all_to_all_single`: split `input` by `input_splits` (elements per rank; `None` = equal),
    /// send piece r to rank r, and receive into `output` split by `output_splits`.
    pub fn alltoall_base(
        &self,
        output: Tensor,
        input: Tensor,
        output_splits: Option<Vec<usize>>,
        input_splits: Option<Vec<usize>>,
    ) -> Result<Work, SubmitError> {
        let n = self.world_size() as usize;
        let even = |numel: usize| vec![numel / n.max(1); n];
        let splits = match (input_splits, output_splits) {
            (None, None) => None,
            (i, o) => Some((i.unwrap_or_else(|| even(input.numel())), o.unwrap_or_else(|| even(output.numel())))),
        };
        let mut c = Collective::new(OpType::AlltoallBase)
            .inputs(specs(std::slice::from_ref(&input)))
            .outputs(specs(std::slice::from_ref(&output)));
        c.splits = splits.clone();
        let (ins, outs) = splits.unwrap_or_else(|| (even(input.numel()), even(output.numel())));
        self.collective(c, Request::alltoall_base(output, input, ins, outs))
    }

    /// Block until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<Work, SubmitError> {
        self.collective(Collective::new(OpType::Barrier), Request::barrier())
    }

    // ---- point to point ----

    /// Send `tensor` to `dst` with `tag`. Completes once the bytes are handed to the connection.
    pub fn send(&self, tensor: Tensor, dst: u32, tag: u32) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::Send).inputs(specs(std::slice::from_ref(&tensor))).peer(Rank(dst), tag);
        self.submit(c, Payload::Send { peer: Rank(dst), tag, tensor })
    }

    /// Receive into `tensor` from `src` with `tag`; the result holds the filled tensor.
    pub fn recv(&self, tensor: Tensor, src: u32, tag: u32) -> Result<Work, SubmitError> {
        let c = Collective::new(OpType::Recv).inputs(specs(std::slice::from_ref(&tensor))).peer(Rank(src), tag);
        self.submit(c, Payload::Recv { peer: Some(Rank(src)), tag, tensor: Some(tensor) })
    }

    /// Receive into `tensor` from whichever rank sends first with `tag`;
    /// [`Work::source_rank`] tells which.
    pub fn recv_anysource(&self, tensor: Tensor, tag: u32) -> Result<Work, SubmitError> {
        let mut c = Collective::new(OpType::RecvAnySource).inputs(specs(std::slice::from_ref(&tensor)));
        c.tag = tag;
        self.submit(c, Payload::Recv { peer: None, tag, tensor: Some(tensor) })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            t.abort();
        }
        // Writers are left to finish: their channels are closed, so they flush and say goodbye.
    }
}

fn specs(tensors: &[Tensor]) -> Vec<TensorSpec> {
    tensors.iter().map(|t| TensorSpec::new(t.dtype(), t.shape())).collect()
}

/// The description of an allreduce of `tensors`.
fn allreduce_collective(tensors: &[Tensor]) -> Collective {
    Collective::new(OpType::Allreduce).inputs(specs(tensors))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{MAX_POLL_FACTOR, Polling};

    #[test]
    fn the_polling_time_doubles_after_short_sleeps_and_halves_after_long_ones_within_bounds() {
        let base = Duration::from_micros(50);
        let mut p = Polling::new(base);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR, "it starts at the cap");
        p.adapt(base * MAX_POLL_FACTOR, false);
        p.adapt(base * MAX_POLL_FACTOR, false);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR / 4, "sleeps as long as the cap halve it");
        p.adapt(base * 4, false);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR / 2, "a sleep shorter than the cap doubles it");
        for _ in 0..10 {
            p.adapt(Duration::ZERO, false);
        }
        assert_eq!(p.budget, base * MAX_POLL_FACTOR, "up to the cap");
        p.adapt(base * MAX_POLL_FACTOR, false);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR / 2, "a sleep as long as the cap halves it");
        for _ in 0..10 {
            p.adapt(Duration::from_secs(1), false);
        }
        assert_eq!(p.budget, base, "down to the setting");
        let mut off = Polling::new(Duration::ZERO);
        off.adapt(Duration::ZERO, false);
        assert_eq!(off.budget, Duration::ZERO, "polling that is off stays off");
    }

    /// A long sleep after a poll that delivered frames (a slow work, not a silent peer) leaves
    /// the time as it is, at the cap or below it; a short one still doubles it.
    #[test]
    fn a_long_sleep_after_a_poll_that_moved_the_work_on_keeps_the_polling_time() {
        let base = Duration::from_micros(50);
        let mut p = Polling::new(base);
        for _ in 0..10 {
            p.adapt(Duration::from_millis(20), true);
        }
        assert_eq!(p.budget, base * MAX_POLL_FACTOR, "slow works that moved keep the cap");
        p.adapt(Duration::from_secs(1), false);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR / 2, "a silent wait halves it");
        p.adapt(Duration::from_secs(1), true);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR / 2, "and a moving one keeps what is left");
        p.adapt(Duration::ZERO, true);
        assert_eq!(p.budget, base * MAX_POLL_FACTOR, "a short sleep doubles it as before");
    }

    /// A collective that receives large chunks finds buffers for all of it held by the pool
    /// the moment it is submitted (not made one by one as its chunks arrive, mid-collective),
    /// up to the group's limit; a small one reserves nothing.
    #[test]
    fn a_large_collective_reserves_its_receive_buffers_when_it_starts() {
        use std::sync::Arc;

        use cohort_core::{ReduceOp, Tensor};

        use crate::{MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};

        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        for (limit, want) in [(64 << 20, 4 << 20), (3 << 20, 3 << 20)] {
            let opts =
                TcpOptions { buffer_pool_bytes: limit, timeout: Duration::from_secs(20), ..TcpOptions::default() };
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let pgs: Vec<ProcessGroup> = runtime.block_on(async {
                let joins: Vec<_> = (0..2u32)
                    .map(|r| {
                        let (store, opts) = (store.clone(), opts.clone());
                        tokio::spawn(async move { ProcessGroup::connect(TokioNet, store, r, 2, opts).await })
                    })
                    .collect();
                let mut out = Vec::new();
                for j in joins {
                    out.push(j.await.unwrap().expect("connect"));
                }
                out
            });
            // Both ranks look at their pool after the small collective before either sends
            // large chunks (which the other would read into pooled buffers).
            let looked = Arc::new(std::sync::Barrier::new(2));
            let threads: Vec<_> = pgs
                .into_iter()
                .map(|pg| {
                    let looked = looked.clone();
                    std::thread::spawn(move || {
                        let held = || pg.inner.lock().pool.held();
                        let small = pg.allreduce(vec![Tensor::from_slice(&[1.0f32; 16])], ReduceOp::Sum).unwrap();
                        small.wait().unwrap();
                        assert_eq!(held(), 0, "a small collective reserves nothing");
                        looked.wait();
                        // 4 MiB of f32 over 2 ranks: this rank receives the other half twice.
                        let big = vec![pg.rank().0 as f32; 1 << 20];
                        let work = pg.allreduce(vec![Tensor::from_slice(&big)], ReduceOp::Sum).unwrap();
                        assert!(held() >= want, "held {} at submit, want {want}", held());
                        let out = work.result().unwrap();
                        assert!(out[0].to_f64s().iter().all(|&x| x == 1.0));
                        pg.shutdown();
                    })
                })
                .collect();
            for t in threads {
                t.join().expect("a rank thread");
            }
        }
    }

    #[test]
    fn the_readers_are_relied_on_when_someone_sleeps_and_nobody_polls() {
        let mut p = Polling::new(Duration::from_micros(50));
        assert!(!p.relied_on());
        p.sleepers = 1;
        assert!(p.relied_on());
        p.active = 1;
        assert!(!p.relied_on(), "a polling thread reads for the sleeper");
    }

    #[test]
    fn a_work_ended_in_its_submit_call_holds_the_reader_tasks_off_as_a_polled_one_does() {
        use super::socket::Rearm;
        use super::tunables::REARM_GRACE;
        let now = std::time::Instant::now();
        let ms = Duration::from_millis;
        let mut p = Polling::new(Duration::from_micros(50));
        assert_eq!(p.rearm(None, now), Rearm::Now, "nothing ended yet");
        assert_eq!(p.rearm(Some(now), now), Rearm::After(REARM_GRACE), "one ended in its call just now");
        assert_eq!(p.rearm(Some(now - ms(5)), now), Rearm::Now, "its grace has passed");
        p.last_finished = Some(now - ms(5));
        assert_eq!(p.rearm(Some(now), now), Rearm::After(REARM_GRACE), "the later of the two counts");
        p.last_finished = Some(now);
        assert_eq!(p.rearm(Some(now - ms(5)), now), Rearm::After(REARM_GRACE));
        assert_eq!(p.rearm(None, now), Rearm::After(REARM_GRACE));
        p.active = 1;
        assert_eq!(p.rearm(Some(now), now), Rearm::WhilePolling);
        p.sleepers = 1;
        p.active = 0;
        assert_eq!(p.rearm(Some(now), now), Rearm::Now, "a sleeper relies on the readers");
    }
}
