//! The fabric: how emulated ranks meet. NCCL moves collective data over NVLink, PCIe or the
//! network; the emulation moves it through a [`Fabric`], either in process memory
//! ([`MemFabric`]) or through a store ([`StoreFabric`]: over a [`TcpStore`](crate::TcpStore)
//! client it crosses processes, and inside the simulator it crosses the simulated network).
//!
//! Every method returns a boxed `'static` future, so the trait stays object-safe and the
//! emulation can hold an `Arc<dyn Fabric>`. Nothing here blocks a thread, reads the wall clock
//! or spawns threads: futures wait on tokio primitives and tokio's clock only.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};

use crate::nccl::device::NcclError;
use crate::store::Store;

/// The future every [`Fabric`] method returns.
pub type FabricFuture<T> = Pin<Box<dyn Future<Output = Result<T, NcclError>> + Send + 'static>>;

/// How emulated ranks exchange bytes: an allgather rendezvous and first-in-first-out channels.
///
/// Calling a method posts the request; awaiting the future waits for its answer. Requests on
/// one key are ordered by the order of the *calls* from one process (not by when their futures
/// are first polled), so a caller that issues several sends on one key and then awaits them
/// together keeps their order.
///
/// Dropping a future before it resolves withdraws what it posted where that is still possible:
/// an exchange that has not gathered every rank takes its contribution back, a send that no
/// receive has taken takes its message back, a receive stops waiting. This is what lets an
/// aborted rank leave its peers hanging, as a real aborted NCCL rank does.
pub trait Fabric: Send + Sync + fmt::Debug {
    /// Contributes `data` as `rank` of `world` to the exchange named `key` and resolves, once
    /// every rank has contributed, to every rank's data in rank order (an allgather
    /// rendezvous). A key names one exchange; it may be reused once every rank has read it.
    fn exchange(&self, key: String, rank: u32, world: u32, data: Vec<u8>) -> FabricFuture<Vec<Vec<u8>>>;

    /// Puts `data` on the channel `key`; resolves once a [`Fabric::recv`] took it (a
    /// rendezvous, like an NCCL send that completes when the receiver has the data).
    fn send(&self, key: String, data: Vec<u8>) -> FabricFuture<()>;

    /// Takes the oldest message on the channel `key`, waiting for one to be sent.
    fn recv(&self, key: String) -> FabricFuture<Vec<u8>>;
}

// ---- MemFabric -------------------------------------------------------------------------------

/// A [`Fabric`] in process memory: every emulated rank of a test shares one.
#[derive(Debug, Default)]
pub struct MemFabric {
    inner: Arc<MemInner>,
}

impl MemFabric {
    /// An empty fabric.
    pub fn new() -> Arc<MemFabric> {
        Arc::new(MemFabric::default())
    }

    /// How many exchanges and channels hold state (pending or unread); zero once everything
    /// posted has been taken. For tests that check cleanup.
    pub fn pending(&self) -> usize {
        let s = self.inner.lock();
        s.exchanges.len() + s.channels.len()
    }
}

#[derive(Debug, Default)]
struct MemInner {
    state: Mutex<MemState>,
    /// Woken on every change; waiters re-check their own condition.
    changed: Notify,
}

impl MemInner {
    fn lock(&self) -> MutexGuard<'_, MemState> {
        // Every update below is a few container operations that cannot panic halfway.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug, Default)]
struct MemState {
    exchanges: BTreeMap<String, MemExchange>,
    channels: BTreeMap<String, MemChannel>,
    next_id: u64,
}

#[derive(Debug)]
struct MemExchange {
    world: u32,
    slots: Vec<Option<Vec<u8>>>,
    joined: u32,
    /// Every rank's data, once all joined.
    result: Option<Arc<Vec<Vec<u8>>>>,
    /// Ranks that have not read the result yet; the last one removes the exchange.
    unread: u32,
}

#[derive(Debug, Default)]
struct MemChannel {
    /// Messages not taken yet, oldest first; `None` marks one whose sender already finished
    /// (a receive that was dropped after it was matched gave it back).
    sends: VecDeque<(Option<u64>, Vec<u8>)>,
    /// Receives waiting for a message, oldest first.
    recvs: VecDeque<u64>,
    /// Sends whose message was taken.
    taken: BTreeSet<u64>,
    /// Messages matched to a receive, not yet returned by it.
    delivered: BTreeMap<u64, Vec<u8>>,
}

impl MemChannel {
    fn pair(&mut self) {
        while !self.sends.is_empty() && !self.recvs.is_empty() {
            let (sender, data) = self.sends.pop_front().expect("checked non-empty");
            let receiver = self.recvs.pop_front().expect("checked non-empty");
            self.delivered.insert(receiver, data);
            if let Some(sender) = sender {
                self.taken.insert(sender);
            }
        }
    }

    fn is_idle(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty() && self.taken.is_empty() && self.delivered.is_empty()
    }
}

impl MemState {
    fn channel(&mut self, key: &str) -> &mut MemChannel {
        self.channels.entry(key.to_owned()).or_default()
    }

    fn tidy_channel(&mut self, key: &str) {
        if self.channels.get(key).is_some_and(MemChannel::is_idle) {
            self.channels.remove(key);
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

/// Undoes what a [`MemFabric`] request posted when its future is dropped unanswered.
struct MemGuard {
    inner: Arc<MemInner>,
    key: String,
    what: MemRequest,
    done: bool,
}

#[derive(Clone, Copy)]
enum MemRequest {
    Exchange { rank: u32 },
    Send { id: u64 },
    Recv { id: u64 },
}

impl MemGuard {
    /// The request was answered: nothing to undo.
    fn disarm(&mut self) {
        self.done = true;
    }
}

impl Drop for MemGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut s = self.inner.lock();
        match self.what {
            MemRequest::Exchange { rank } => {
                let Some(x) = s.exchanges.get_mut(&self.key) else { return };
                if x.result.is_none() {
                    // Not everyone came yet: take the contribution back.
                    if let Some(slot) = x.slots.get_mut(rank as usize)
                        && slot.take().is_some()
                    {
                        x.joined -= 1;
                    }
                    if x.joined == 0 {
                        s.exchanges.remove(&self.key);
                    }
                } else {
                    x.unread = x.unread.saturating_sub(1);
                    if x.unread == 0 {
                        s.exchanges.remove(&self.key);
                    }
                }
            }
            MemRequest::Send { id } => {
                let ch = s.channel(&self.key);
                ch.sends.retain(|(sender, _)| *sender != Some(id));
                ch.taken.remove(&id);
                s.tidy_channel(&self.key);
            }
            MemRequest::Recv { id } => {
                let ch = s.channel(&self.key);
                ch.recvs.retain(|r| *r != id);
                if let Some(data) = ch.delivered.remove(&id) {
                    // Matched but never returned: the message goes back to the head of the line.
                    ch.sends.push_front((None, data));
                    ch.pair();
                }
                s.tidy_channel(&self.key);
            }
        }
        drop(s);
        self.inner.changed.notify_waiters();
    }
}

impl Fabric for MemFabric {
    fn exchange(&self, key: String, rank: u32, world: u32, data: Vec<u8>) -> FabricFuture<Vec<Vec<u8>>> {
        let inner = self.inner.clone();
        let posted = (|| {
            if rank >= world {
                return Err(NcclError::Invalid(format!("fabric exchange {key}: rank {rank} of world size {world}")));
            }
            let mut s = inner.lock();
            let x = s.exchanges.entry(key.clone()).or_insert_with(|| MemExchange {
                world,
                slots: vec![None; world as usize],
                joined: 0,
                result: None,
                unread: 0,
            });
            if x.world != world {
                return Err(NcclError::Invalid(format!(
                    "fabric exchange {key}: rank {rank} says world size {world}, an earlier rank said {}",
                    x.world
                )));
            }
            if x.result.is_some() || x.slots[rank as usize].is_some() {
                return Err(NcclError::Invalid(format!("fabric exchange {key}: rank {rank} joined twice")));
            }
            x.slots[rank as usize] = Some(data);
            x.joined += 1;
            if x.joined == world {
                let all = x.slots.iter_mut().map(|s| s.take().expect("every rank joined")).collect();
                x.result = Some(Arc::new(all));
                x.unread = world;
            }
            Ok(())
        })();
        if let Err(e) = posted {
            return Box::pin(async move { Err(e) });
        }
        inner.changed.notify_waiters();
        let mut guard = MemGuard { inner, key, what: MemRequest::Exchange { rank }, done: false };
        Box::pin(async move {
            let inner = guard.inner.clone();
            loop {
                let notified = inner.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let mut s = inner.lock();
                    let x = s.exchanges.get_mut(&guard.key).expect("an exchange stays until its ranks read it");
                    if let Some(all) = x.result.clone() {
                        x.unread -= 1;
                        if x.unread == 0 {
                            s.exchanges.remove(&guard.key);
                        }
                        guard.disarm();
                        return Ok(all.as_ref().clone());
                    }
                }
                notified.await;
            }
        })
    }

    fn send(&self, key: String, data: Vec<u8>) -> FabricFuture<()> {
        let inner = self.inner.clone();
        let id = {
            let mut s = inner.lock();
            let id = s.next_id();
            let ch = s.channel(&key);
            ch.sends.push_back((Some(id), data));
            ch.pair();
            id
        };
        inner.changed.notify_waiters();
        let mut guard = MemGuard { inner, key, what: MemRequest::Send { id }, done: false };
        Box::pin(async move {
            let inner = guard.inner.clone();
            loop {
                let notified = inner.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let mut s = inner.lock();
                    if s.channel(&guard.key).taken.remove(&id) {
                        s.tidy_channel(&guard.key);
                        guard.disarm();
                        return Ok(());
                    }
                }
                notified.await;
            }
        })
    }

    fn recv(&self, key: String) -> FabricFuture<Vec<u8>> {
        let inner = self.inner.clone();
        let id = {
            let mut s = inner.lock();
            let id = s.next_id();
            let ch = s.channel(&key);
            ch.recvs.push_back(id);
            ch.pair();
            id
        };
        inner.changed.notify_waiters();
        let mut guard = MemGuard { inner, key, what: MemRequest::Recv { id }, done: false };
        Box::pin(async move {
            let inner = guard.inner.clone();
            loop {
                let notified = inner.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let mut s = inner.lock();
                    if let Some(data) = s.channel(&guard.key).delivered.remove(&id) {
                        s.tidy_channel(&guard.key);
                        guard.disarm();
                        drop(s);
                        // The sender waits for `taken`, set when the pair was made.
                        inner.changed.notify_waiters();
                        return Ok(data);
                    }
                }
                notified.await;
            }
        })
    }
}

// ---- StoreFabric -----------------------------------------------------------------------------

/// The longest pause between two polls of the store.
const MAX_POLL: Duration = Duration::from_millis(20);

/// A value no key of the fabric ever holds: `compare_set(key, ABSENT, ABSENT)` reads a key
/// without waiting for it and without changing it, and answers `ABSENT` when it is missing.
const ABSENT: &[u8] = b"\0cohort-emu-absent\0";

/// A [`Fabric`] over a [`Store`]: with a [`TcpStore`](crate::TcpStore) client it joins ranks
/// in different processes; over the simulator's network it is deterministic.
///
/// Keys live under a prefix (default `emu/`). It only ever makes short store calls (set, add,
/// compare_set, check, delete, and `get`/`multi_get` of keys known to exist) and polls with a
/// backoff of 1 to 20 ms on tokio's clock: a [`TcpStore`](crate::TcpStore) client runs one call
/// at a time, so a blocking WAIT for data that never comes (a hung collective) would stall every
/// other rank sharing the client. Every request runs in its own tokio task so that a store call
/// is never cut in half when the caller drops the future (a client cut mid-call would read the
/// next reply out of step); the task notices the drop between calls, withdraws and ends.
/// A request made inside a tokio runtime starts at once; one made outside starts when its
/// future is first polled, which needs a runtime.
///
/// Keys are cleaned up once every reader has read them: an exchange's keys by its last reader,
/// a message's by its receiver and sender. Two counters per channel stay (the send count and
/// the receive cursor), and an exchange abandoned by every rank leaves its member list.
pub struct StoreFabric {
    store: Arc<dyn Store>,
    prefix: String,
    /// The latest send and receive of this process per channel: a later one claims its place
    /// in the channel only after the earlier one did, so call order is channel order.
    order: Mutex<BTreeMap<String, oneshot::Receiver<()>>>,
}

impl fmt::Debug for StoreFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreFabric").field("store", &self.store).field("prefix", &self.prefix).finish()
    }
}

impl StoreFabric {
    /// A fabric over `store`, under the key prefix `emu/`.
    pub fn new(store: Arc<dyn Store>) -> Arc<StoreFabric> {
        Self::with_prefix(store, "emu/")
    }

    /// A fabric over `store` whose keys all start with `prefix`.
    pub fn with_prefix(store: Arc<dyn Store>, prefix: impl Into<String>) -> Arc<StoreFabric> {
        Arc::new(StoreFabric { store, prefix: prefix.into(), order: Mutex::new(BTreeMap::new()) })
    }

    /// Links a request into its channel's order: it waits on the returned receiver (the
    /// previous request's turn) and fires the sender (by dropping it) once it has its place.
    fn link(&self, side: &str, key: &str) -> (Option<oneshot::Receiver<()>>, oneshot::Sender<()>) {
        let (tx, rx) = oneshot::channel();
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        let prev = order.insert(format!("{side}{key}"), rx);
        (prev, tx)
    }

    /// Runs `job` in its own task; dropping the returned future asks the task to stop (see the
    /// type's docs).
    fn run<T, F, Fut>(&self, job: F) -> FabricFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(Arc<dyn Store>, Poller) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, NcclError>> + Send + 'static,
    {
        let store = self.store.clone();
        let cancel = Arc::new(Cancel::default());
        let guard = CancelOnDrop(cancel.clone());
        let poller = Poller { cancel, delay: Duration::from_millis(1) };
        let (tx, rx) = oneshot::channel();
        let task = async move {
            let _ = tx.send(job(store, poller).await);
        };
        // The request is posted when the method is called (the trait's contract), so the task
        // starts now when there is a runtime to start it on, else at the first poll.
        let deferred = match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(task);
                None
            }
            Err(_) => Some(task),
        };
        Box::pin(async move {
            let _guard = guard;
            if let Some(task) = deferred {
                tokio::spawn(task);
            }
            rx.await.unwrap_or_else(|_| Err(NcclError::Store("a fabric task ended without an answer".into())))
        })
    }
}

impl Fabric for StoreFabric {
    fn exchange(&self, key: String, rank: u32, world: u32, data: Vec<u8>) -> FabricFuture<Vec<Vec<u8>>> {
        if rank >= world {
            return Box::pin(async move {
                Err(NcclError::Invalid(format!("fabric exchange {key}: rank {rank} of world size {world}")))
            });
        }
        let base = format!("{}x/{key}", self.prefix);
        self.run(move |store, poller| store_exchange(store, base, rank, world, data, poller))
    }

    fn send(&self, key: String, data: Vec<u8>) -> FabricFuture<()> {
        let (prev, turn) = self.link("s:", &key);
        let base = format!("{}p/{key}", self.prefix);
        self.run(move |store, poller| store_send(store, base, data, prev, turn, poller))
    }

    fn recv(&self, key: String) -> FabricFuture<Vec<u8>> {
        let (prev, turn) = self.link("r:", &key);
        let base = format!("{}p/{key}", self.prefix);
        self.run(move |store, poller| store_recv(store, base, prev, turn, poller))
    }
}

/// Set when the caller dropped its future.
#[derive(Debug, Default)]
struct Cancel {
    flag: AtomicBool,
    notify: Notify,
}

struct CancelOnDrop(Arc<Cancel>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.flag.store(true, Ordering::SeqCst);
        // notify_one keeps a permit, so a task that is not waiting yet still wakes.
        self.0.notify.notify_one();
    }
}

/// Paces a task's polls and tells it when its caller went away.
struct Poller {
    cancel: Arc<Cancel>,
    delay: Duration,
}

impl Poller {
    fn is_cancelled(&self) -> bool {
        self.cancel.flag.load(Ordering::SeqCst)
    }

    /// Waits before the next poll (1 ms, doubling up to 20 ms); false if the caller went away.
    async fn pause(&mut self) -> bool {
        if self.is_cancelled() {
            return false;
        }
        tokio::select! {
            biased;
            () = self.cancel.notify.notified() => {}
            () = tokio::time::sleep(self.delay) => {}
        }
        self.delay = (self.delay * 2).min(MAX_POLL);
        !self.is_cancelled()
    }
}

fn store_err(e: crate::store::StoreError) -> NcclError {
    NcclError::Store(e.to_string())
}

/// Reads `key` without waiting for it and without changing it.
async fn peek(store: &dyn Store, key: &str) -> Result<Option<Vec<u8>>, NcclError> {
    let v = store.compare_set(key, ABSENT, ABSENT).await.map_err(store_err)?;
    Ok(if v == ABSENT { None } else { Some(v) })
}

/// An exchange's member list: `j` then `,rank` per rank that joined, in joining order. Only
/// the rank itself adds or removes its entry, so a compare-and-set that returns exactly the
/// list it asked for succeeded.
fn parse_members(key: &str, v: &[u8]) -> Result<Vec<u32>, NcclError> {
    let bad =
        || NcclError::Store(format!("fabric key {key} holds {:?}, not a member list", String::from_utf8_lossy(v)));
    let s = std::str::from_utf8(v).map_err(|_| bad())?;
    let rest = s.strip_prefix('j').ok_or_else(bad)?;
    rest.split(',').skip(1).map(|r| r.parse::<u32>().map_err(|_| bad())).collect()
}

fn encode_members(members: &[u32]) -> Vec<u8> {
    let mut s = String::from("j");
    for m in members {
        s.push_str(&format!(",{m}"));
    }
    s.into_bytes()
}

async fn store_exchange(
    store: Arc<dyn Store>,
    base: String,
    rank: u32,
    world: u32,
    data: Vec<u8>,
    mut poller: Poller,
) -> Result<Vec<Vec<u8>>, NcclError> {
    let store = &*store;
    let data_key = |r: u32| format!("{base}/d{r}");
    let members_key = format!("{base}/n");
    store.set(&data_key(rank), &data).await.map_err(store_err)?;
    // Join: add this rank to the member list.
    loop {
        let current = peek(store, &members_key).await?;
        let (expected, mut members) = match current {
            None => (Vec::new(), Vec::new()),
            Some(v) => {
                let m = parse_members(&members_key, &v)?;
                (v, m)
            }
        };
        if members.contains(&rank) || members.len() >= world as usize {
            return Err(NcclError::Invalid(format!("fabric exchange {base}: rank {rank} joined twice")));
        }
        members.push(rank);
        let desired = encode_members(&members);
        if store.compare_set(&members_key, &expected, &desired).await.map_err(store_err)? == desired {
            break;
        }
    }
    // Wait until every rank joined: from then on nobody can withdraw.
    loop {
        let v = peek(store, &members_key).await?.unwrap_or_default();
        if parse_members(&members_key, &v)?.len() >= world as usize {
            break;
        }
        if !poller.pause().await {
            return withdraw(store, &base, rank, world).await;
        }
    }
    let keys: Vec<String> = (0..world).map(data_key).collect();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    // Every data key exists: a rank writes its own before joining and only a withdrawing rank
    // (before the list filled up) deletes it.
    let all = store.multi_get(&names).await.map_err(store_err)?;
    finish_read(store, &base, world).await?;
    Ok(all)
}

/// The caller of an exchange went away: takes this rank out of the member list unless every
/// rank already joined (then it only counts itself as a reader).
async fn withdraw(store: &dyn Store, base: &str, rank: u32, world: u32) -> Result<Vec<Vec<u8>>, NcclError> {
    let members_key = format!("{base}/n");
    loop {
        let v = peek(store, &members_key).await?.unwrap_or_default();
        let members = parse_members(&members_key, &v)?;
        if members.len() >= world as usize {
            finish_read(store, base, world).await?;
            break;
        }
        let rest: Vec<u32> = members.iter().copied().filter(|m| *m != rank).collect();
        let desired = encode_members(&rest);
        if store.compare_set(&members_key, &v, &desired).await.map_err(store_err)? == desired {
            store.delete_key(&format!("{base}/d{rank}")).await.map_err(store_err)?;
            break;
        }
    }
    Err(NcclError::Aborted)
}

/// Counts one reader; the last one deletes the exchange's keys.
async fn finish_read(store: &dyn Store, base: &str, world: u32) -> Result<(), NcclError> {
    let readers_key = format!("{base}/r");
    if store.add(&readers_key, 1).await.map_err(store_err)? >= i64::from(world) {
        for r in 0..world {
            store.delete_key(&format!("{base}/d{r}")).await.map_err(store_err)?;
        }
        store.delete_key(&format!("{base}/n")).await.map_err(store_err)?;
        store.delete_key(&readers_key).await.map_err(store_err)?;
    }
    Ok(())
}

const TAKEN: &[u8] = b"taken";
const GONE: &[u8] = b"gone";

/// A send: claims the next number on the channel (`s`), writes the message (`m<k>`) and waits
/// for its receiver to mark it taken (`t<k>`); a sender that goes away first marks it gone.
async fn store_send(
    store: Arc<dyn Store>,
    base: String,
    data: Vec<u8>,
    prev: Option<oneshot::Receiver<()>>,
    turn: oneshot::Sender<()>,
    mut poller: Poller,
) -> Result<(), NcclError> {
    let store = &*store;
    if let Some(prev) = prev {
        // Err only means the earlier send went away without claiming: our turn either way.
        let _ = prev.await;
    }
    if poller.is_cancelled() {
        return Err(NcclError::Aborted);
    }
    let k = store.add(&format!("{base}/s"), 1).await.map_err(store_err)?;
    drop(turn);
    let (msg_key, state_key) = (format!("{base}/m{k}"), format!("{base}/t{k}"));
    store.set(&msg_key, &data).await.map_err(store_err)?;
    loop {
        if peek(store, &state_key).await?.as_deref() == Some(TAKEN) {
            store.delete_key(&state_key).await.map_err(store_err)?;
            return Ok(());
        }
        if !poller.pause().await {
            if store.compare_set(&state_key, b"", GONE).await.map_err(store_err)? == TAKEN {
                store.delete_key(&state_key).await.map_err(store_err)?;
            } else {
                store.delete_key(&msg_key).await.map_err(store_err)?;
            }
            return Err(NcclError::Aborted);
        }
    }
}

/// A receive: reads the cursor (`r`, the last message taken), takes message `r + 1` by marking
/// it taken, skips one its sender withdrew, and moves the cursor on.
async fn store_recv(
    store: Arc<dyn Store>,
    base: String,
    prev: Option<oneshot::Receiver<()>>,
    turn: oneshot::Sender<()>,
    mut poller: Poller,
) -> Result<Vec<u8>, NcclError> {
    let store = &*store;
    if let Some(prev) = prev {
        let _ = prev.await;
    }
    let cursor_key = format!("{base}/r");
    loop {
        if poller.is_cancelled() {
            return Err(NcclError::Aborted);
        }
        let cursor = peek(store, &cursor_key).await?;
        let last: u64 = match &cursor {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| NcclError::Store(format!("fabric key {cursor_key} holds {v:?}, not a count")))?,
        };
        let k = last + 1;
        let (msg_key, state_key) = (format!("{base}/m{k}"), format!("{base}/t{k}"));
        let advance = async {
            let expected = cursor.clone().unwrap_or_default();
            store.compare_set(&cursor_key, &expected, k.to_string().as_bytes()).await.map_err(store_err)
        };
        match peek(store, &state_key).await?.as_deref() {
            Some(GONE) => {
                advance.await?;
                store.delete_key(&state_key).await.map_err(store_err)?;
                continue;
            }
            Some(_) => {}
            None => {
                if store.check(&[&msg_key]).await.map_err(store_err)? {
                    if store.compare_set(&state_key, b"", TAKEN).await.map_err(store_err)? == TAKEN {
                        // Ours: the sender can no longer withdraw it, so the message stays.
                        let data = store.get(&msg_key).await.map_err(store_err)?;
                        store.delete_key(&msg_key).await.map_err(store_err)?;
                        advance.await?;
                        drop(turn);
                        return Ok(data);
                    }
                    // The sender withdrew it just now: the next round skips it.
                    continue;
                }
            }
        }
        if !poller.pause().await {
            return Err(NcclError::Aborted);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::{MemoryStore, TcpStore, TcpStoreConfig, TcpStoreServer, TcpStoreServerConfig};

    fn fabrics(store: Arc<dyn Store>) -> Vec<(&'static str, Arc<dyn Fabric>)> {
        vec![("mem", MemFabric::new()), ("store", StoreFabric::new(store))]
    }

    async fn exchange_and_channels_work(fabric: Arc<dyn Fabric>) {
        // Exchange: three ranks, posted in any order, read in rank order.
        let futs: Vec<_> = [2u32, 0, 1].iter().map(|&r| fabric.exchange("x".into(), r, 3, vec![r as u8; 2])).collect();
        for f in futs {
            assert_eq!(f.await.unwrap(), vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
        }
        // The key can be reused once read.
        let a = fabric.exchange("x".into(), 0, 1, vec![9]);
        assert_eq!(a.await.unwrap(), vec![vec![9]]);
        // Channels: FIFO by call order; a send resolves once taken.
        let s1 = fabric.send("c".into(), vec![1]);
        let s2 = fabric.send("c".into(), vec![2, 2]);
        let r1 = fabric.recv("c".into());
        let r2 = fabric.recv("c".into());
        let (a, b, c, d) = tokio::join!(s2, r2, s1, r1);
        assert_eq!((a.unwrap(), b.unwrap(), c.unwrap(), d.unwrap()), ((), vec![2, 2], (), vec![1]));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_fabrics_exchange_in_rank_order_and_keep_channels_fifo() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        for (name, fabric) in fabrics(store.clone()) {
            tokio::time::timeout(Duration::from_secs(10), exchange_and_channels_work(fabric))
                .await
                .unwrap_or_else(|_| panic!("{name} fabric timed out"));
        }
        // Only the two counters of channel `c` are left in the store.
        assert_eq!(store.num_keys().await.unwrap(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_fabric_works_over_a_tcp_store() {
        let server = TcpStoreServer::bind(crate::TokioNet, TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        let client = |port| async move {
            let cfg = TcpStoreConfig::new("127.0.0.1", port).with_timeout(Duration::from_secs(10));
            Arc::new(TcpStore::connect(cfg).await.unwrap()) as Arc<dyn Store>
        };
        let fabric = StoreFabric::new(client(server.port()).await);
        tokio::time::timeout(Duration::from_secs(10), exchange_and_channels_work(fabric)).await.unwrap();
        // Two processes' worth of clients on one exchange.
        let (a, b) = (StoreFabric::new(client(server.port()).await), StoreFabric::new(client(server.port()).await));
        let (x, y) = tokio::join!(a.exchange("y".into(), 0, 2, vec![0]), b.exchange("y".into(), 1, 2, vec![1]));
        assert_eq!(x.unwrap(), y.unwrap());
        assert_eq!(server.num_keys(), 2, "only channel c's two counters stay");
        server.shutdown().await;
    }

    async fn dropped_requests_withdraw(fabric: Arc<dyn Fabric>) {
        // An exchange dropped before everyone came takes its contribution back: a later rank 1
        // then waits for a new rank 0.
        let early = fabric.exchange("w".into(), 0, 2, vec![1]);
        let mut early = Box::pin(early);
        assert!(tokio::time::timeout(Duration::from_millis(30), &mut early).await.is_err());
        drop(early);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut late = fabric.exchange("w".into(), 1, 2, vec![2]);
        assert!(tokio::time::timeout(Duration::from_millis(60), &mut late).await.is_err(), "nobody is there");
        let again = fabric.exchange("w".into(), 0, 2, vec![3]);
        let (a, b) = tokio::join!(late, again);
        assert_eq!(a.unwrap(), vec![vec![3], vec![2]]);
        assert_eq!(b.unwrap(), vec![vec![3], vec![2]]);
        // A send dropped before it was taken is withdrawn: the receiver gets the next one.
        let mut s1 = fabric.send("q".into(), vec![1]);
        assert!(tokio::time::timeout(Duration::from_millis(30), &mut s1).await.is_err());
        drop(s1);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s2 = fabric.send("q".into(), vec![2]);
        let r = fabric.recv("q".into());
        let (s2, r) = tokio::join!(s2, r);
        s2.unwrap();
        assert_eq!(r.unwrap(), vec![2]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_requests_withdraw_what_they_posted() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        for (name, fabric) in fabrics(store.clone()) {
            tokio::time::timeout(Duration::from_secs(10), dropped_requests_withdraw(fabric.clone()))
                .await
                .unwrap_or_else(|_| panic!("{name} fabric timed out"));
        }
        let mem = MemFabric::new();
        dropped_requests_withdraw(mem.clone()).await;
        assert_eq!(mem.pending(), 0, "nothing is left behind");
    }

    #[tokio::test]
    async fn bad_ranks_and_duplicates_are_refused() {
        let fabric = MemFabric::new();
        assert!(matches!(fabric.exchange("k".into(), 2, 2, vec![]).await, Err(NcclError::Invalid(_))));
        let _first = fabric.exchange("k".into(), 0, 2, vec![]);
        let e = fabric.exchange("k".into(), 0, 2, vec![]).await.unwrap_err();
        assert!(e.to_string().contains("joined twice"), "{e}");
        let e = fabric.exchange("k".into(), 1, 3, vec![]).await.unwrap_err();
        assert!(e.to_string().contains("world size 3"), "{e}");
        let store = StoreFabric::new(Arc::new(MemoryStore::new()));
        assert!(matches!(store.exchange("k".into(), 5, 2, vec![]).await, Err(NcclError::Invalid(_))));
    }
}
