//! One connection to one peer: a reader task that decodes frames and a writer task that sends
//! them. Both report to the group's driver through channels; neither makes a decision.

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cohort_core::protocol::{FrameHeader, FrameKind, FrameLimits, HEADER_LEN};
use cohort_core::work::Rank;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Payloads up to this size are copied next to their header and written with one call; larger
/// ones go out as header then payload, without a copy.
const COALESCE_LIMIT: usize = 64 * 1024;

/// Large frame buffers for reuse, shared by a group's readers (payloads of large frames) and
/// senders (the part of a chunk the socket did not take, queued for the writer).
///
/// Without it a rank would map fresh pages for chunks (the allocator hands large blocks back
/// to the kernel), and the page faults of a large collective can cost more than its copies.
/// Keeping what is given back is not enough either: the buffers a rank needs at once peak when
/// a peer that started a collective first sends its part before this rank has started it (each
/// chunk waits in a buffer until then), and every new peak would map and zero fresh pages in
/// the middle of a collective, which is slow where the host backs new memory slowly. So a
/// collective that receives large chunks first [`reserves`](BufferPool::reserve) buffers for
/// what it receives, made and touched at once, and the pool keeps what is given back while it holds
/// at most [`TcpOptions::buffer_pool_bytes`](super::TcpOptions::buffer_pool_bytes) (kept and out
/// in frames together); only buffers past that go back to the allocator.
///
/// Buffers below [`BufferPool::MIN`] are not kept.
#[derive(Clone, Debug)]
pub(crate) struct BufferPool(Arc<Mutex<PoolState>>);

#[derive(Debug)]
struct PoolState {
    /// Buffers given back; the one given back last at the end.
    kept: Vec<Vec<u8>>,
    /// Capacity of `kept`, summed.
    kept_bytes: usize,
    /// Capacity of the buffers handed out and not given back yet (made here or kept).
    out_bytes: usize,
    /// `kept_bytes + out_bytes` stays at most this, but while more are out at once.
    limit: usize,
    /// Capacity of a new buffer: at least the largest chunk reserved for, so that every kept
    /// buffer fits every chunk.
    size: usize,
}

impl PoolState {
    /// Bytes missing for `total` bytes in chunks of `chunk` (`None` if nothing is, or chunks
    /// this small or this large are not pooled).
    fn missing(&self, total: usize, chunk: usize) -> Option<usize> {
        if chunk < BufferPool::MIN || chunk > self.limit {
            return None;
        }
        let missing = total.min(self.limit).saturating_sub(self.kept_bytes + self.out_bytes);
        (missing > 0).then_some(missing)
    }
}

impl Default for BufferPool {
    fn default() -> Self {
        BufferPool::with_limit(BufferPool::DEFAULT_LIMIT)
    }
}

impl BufferPool {
    /// Smallest buffer worth keeping.
    pub(crate) const MIN: usize = 64 * 1024;
    /// Bytes a pool holds at most unless told otherwise.
    pub(crate) const DEFAULT_LIMIT: usize = 64 << 20;

    /// A pool that holds at most `limit` bytes of buffers (0: it keeps nothing).
    pub(crate) fn with_limit(limit: usize) -> Self {
        let state = PoolState { kept: Vec::new(), kept_bytes: 0, out_bytes: 0, limit, size: 0 };
        BufferPool(Arc::new(Mutex::new(state)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of `len` bytes, for a read to fill: a kept one when it is large enough (its old
    /// bytes are left in place, not cleared: the caller overwrites every one before using it),
    /// else a fresh zeroed one.
    pub(crate) fn take(&self, len: usize) -> Result<Vec<u8>, std::collections::TryReserveError> {
        let mut v = self.lend(len);
        if v.len() >= len {
            v.truncate(len);
            return Ok(v);
        }
        v.try_reserve_exact(len - v.len())?;
        v.resize(len, 0);
        Ok(v)
    }

    /// A buffer with room for `len` bytes, its contents as they were: the kept one given back
    /// last that has the room (likeliest still in cache), else a new one of at least the
    /// pool's buffer size. Below [`BufferPool::MIN`], a new empty one that the
    /// pool does not count.
    fn lend(&self, len: usize) -> Vec<u8> {
        if len < Self::MIN {
            return Vec::new();
        }
        let mut st = self.lock();
        if let Some(i) = st.kept.iter().rposition(|b| b.capacity() >= len) {
            let v = st.kept.swap_remove(i);
            st.kept_bytes -= v.capacity();
            st.out_bytes += v.capacity();
            return v;
        }
        let size = len.max(st.size);
        drop(st);
        let mut v = Vec::new();
        if v.try_reserve_exact(size).is_ok() {
            self.lock().out_bytes += v.capacity();
        }
        v
    }

    /// Keep `buf` for a later [`BufferPool::take`], if it is large and the pool's limit allows.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap < Self::MIN {
            return;
        }
        let mut st = self.lock();
        st.out_bytes = st.out_bytes.saturating_sub(cap);
        if st.kept_bytes + st.out_bytes + cap <= st.limit {
            st.kept.push(buf);
            st.kept_bytes += cap;
        } else {
            drop(st);
            drop(buf);
        }
    }

    /// Before a collective that receives `total` bytes in chunks of up to `chunk` bytes: make
    /// sure the pool holds buffers of at least `chunk` bytes for all of it, up to its limit,
    /// making the missing ones now and writing every page of them, so that no chunk of this
    /// collective or of later ones of its size waits for the kernel to map memory. Does
    /// nothing for chunks below [`BufferPool::MIN`] (they are not pooled), and nothing once
    /// the pool holds that much; a failed allocation just stops it (the rest are then made on
    /// demand).
    pub(crate) fn reserve(&self, total: usize, chunk: usize) {
        let (size, missing) = {
            let mut st = self.lock();
            let Some(missing) = st.missing(total, chunk) else { return };
            st.size = st.size.max(chunk);
            (st.size, missing.div_ceil(st.size))
        };
        let mut made = Vec::with_capacity(missing);
        for _ in 0..missing {
            let mut v = Vec::new();
            if v.try_reserve_exact(size).is_err() {
                break;
            }
            // Written, not just allocated: a zeroed allocation may be fresh pages, mapped on
            // first touch, which is the cost this avoids.
            v.resize(size, 0);
            made.push(v);
        }
        let mut st = self.lock();
        let room = st.limit.saturating_sub(st.kept_bytes + st.out_bytes);
        made.truncate(room / size);
        st.kept_bytes += made.iter().map(Vec::capacity).sum::<usize>();
        // Cold: handed out after the buffers given back, which are likelier in cache.
        st.kept.splice(0..0, made);
    }

    /// Whether [`BufferPool::reserve`] with these arguments would make buffers now (a cheap
    /// check, for a caller that reserves later, with no other lock held).
    pub(crate) fn needs_reserve(&self, total: usize, chunk: usize) -> bool {
        chunk >= Self::MIN && self.lock().missing(total, chunk).is_some()
    }

    /// Bytes of buffers the pool holds: kept, and out in frames.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        let st = self.lock();
        st.kept_bytes + st.out_bytes
    }

    /// `bytes` copied into a buffer that returns to this pool once written and dropped.
    pub(crate) fn bytes(&self, bytes: &[u8]) -> Bytes {
        if bytes.len() < Self::MIN {
            return Bytes::copy_from_slice(bytes);
        }
        let mut v = self.lend(bytes.len());
        v.clear();
        if v.try_reserve_exact(bytes.len()).is_err() {
            self.give(v);
            return Bytes::copy_from_slice(bytes);
        }
        v.extend_from_slice(bytes);
        Bytes::from_owner(Pooled { buf: v, pool: self.clone() })
    }
}

/// A pooled buffer lent to a [`Bytes`]; goes back to its pool when dropped.
struct Pooled {
    buf: Vec<u8>,
    pool: BufferPool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Frames up to this size may be written by the thread that sends them (see [`LaneTx::send`];
/// a collective's chunk, sent from its buffer with [`LaneTx::send_slice`], may be larger).
const DIRECT_LIMIT: usize = COALESCE_LIMIT;

/// The most bytes one connection holds back for a submitting thread (see [`Corks`]); a frame
/// that would take it past this goes out at once, what was held back ahead of it first.
const CORK_LIMIT: usize = COALESCE_LIMIT;

/// How long frames may stay held back when nobody waits for a work of the group: the watcher
/// ([`Corks::watch`]) writes them after this (tokio's timer rounds it up to its next tick).
pub(crate) const CORK_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1);

/// Where a frame went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Queued for the connection's writer task, which reports when it is written.
    Queued,
    /// Already on the socket, written by the sending thread, or held back for the next write
    /// (see [`Corks`]); nobody is told later.
    Written,
    /// The connection's writer is gone.
    Gone,
}

/// How a frame may go out (see [`LaneTx::send_slice`]); by default, through the writer task's
/// queue.
#[derive(Debug, Clone, Default)]
pub(crate) struct SendMode {
    /// The sending thread may write the frame itself when nothing is queued ahead of it.
    pub(crate) direct: bool,
    /// A small frame is held back with the connection's other small frames until a thread
    /// waits for a work of the group, or [`CORK_TIMEOUT`] passes (a thread that submits a
    /// burst of small works then sends them all with one write).
    pub(crate) cork: Option<Arc<Corks>>,
}

impl SendMode {
    /// Through the writer task's queue.
    pub(crate) const QUEUE: SendMode = SendMode { direct: false, cork: None };
    /// Written by the sending thread if nothing is queued ahead of it.
    #[cfg(test)]
    pub(crate) const DIRECT: SendMode = SendMode { direct: true, cork: None };
}

/// One connection as senders see it: the queue of its writer task and, on a real TCP socket,
/// the socket itself. A small frame with nothing queued ahead of it is written at once by the
/// thread that sends it, sparing a hop to the writer task (and on two cores, the wake-up that
/// hop costs), or held back to go out with the next ones ([`SendMode::cork`]); everything else,
/// including what a non-blocking write leaves unwritten, goes through the queue, so that
/// frames keep their order.
#[derive(Debug)]
pub(crate) struct LaneTx {
    tx: mpsc::UnboundedSender<Outbound>,
    gate: Arc<Gate>,
}

/// The writer task's end of a [`LaneTx`].
#[derive(Debug)]
pub(crate) struct LaneRx {
    pub(crate) rx: mpsc::UnboundedReceiver<Outbound>,
    pub(crate) gate: Arc<Gate>,
}

/// A new connection queue.
pub(crate) fn lane() -> (LaneTx, LaneRx) {
    let (tx, rx) = mpsc::unbounded_channel();
    let gate = Arc::new(Gate::default());
    gate.lock().tx = Some(tx.downgrade());
    (LaneTx { tx, gate: gate.clone() }, LaneRx { rx, gate })
}

/// Orders direct writes against the writer task: a frame may be written directly, or held
/// back, only when no frame is queued or being written; held-back bytes go out before
/// anything queued after them.
#[derive(Debug, Default)]
pub(crate) struct Gate(Mutex<GateState>);

#[derive(Debug, Default)]
struct GateState {
    /// Frames handed to the writer task and not yet written by it.
    queued: usize,
    /// The socket, once known to be a real TCP socket (the one the writer task writes to).
    socket: Option<Arc<std::net::TcpStream>>,
    /// Whole frames held back (see [`Corks`]). Never non-empty while `queued` is not 0.
    cork: Vec<u8>,
    /// The gate is on its group's [`Corks`] list.
    listed: bool,
    /// The writer task's queue, for what a flush leaves unwritten (weak: the queue closes
    /// when the driver drops its [`LaneTx`]).
    tx: Option<mpsc::WeakUnboundedSender<Outbound>>,
}

impl GateState {
    /// Write the held-back bytes now; what the socket does not take goes to the writer's
    /// queue (ahead of anything queued later). False if that queue is gone (the bytes stay for
    /// the writer's last write, see [`Gate::close`]).
    fn unload(&mut self) -> bool {
        if self.cork.is_empty() {
            return true;
        }
        let done = self.socket.as_ref().map_or(0, |s| write_now(s, &self.cork, &[]));
        if done == self.cork.len() {
            self.cork.clear();
            return true;
        }
        let rest = Outbound::bytes(Bytes::copy_from_slice(&self.cork[done..]));
        let queued =
            self.tx.as_ref().and_then(mpsc::WeakUnboundedSender::upgrade).is_some_and(|tx| tx.send(rest).is_ok());
        if !queued {
            self.cork.drain(..done);
            return false;
        }
        self.cork.clear();
        self.queued += 1;
        true
    }
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Let senders write to `socket` themselves (it must be non-blocking).
    pub(crate) fn open(&self, socket: Arc<std::net::TcpStream>) {
        self.lock().socket = Some(socket);
    }

    /// The writer task wrote (or gave up on) `n` queued frames.
    pub(crate) fn written(&self, n: usize) {
        let mut g = self.lock();
        g.queued = g.queued.saturating_sub(n);
    }

    /// Write what is held back (see [`Corks::flush`]).
    fn flush(&self) {
        let mut g = self.lock();
        g.listed = false;
        g.unload();
    }

    /// The writer task is done with its queue (every sender is gone, so nothing is held back
    /// after this): the bytes still held back, for its last write.
    pub(crate) fn close(&self) -> Vec<u8> {
        std::mem::take(&mut self.lock().cork)
    }
}

/// A group's held-back frames ([`SendMode::cork`]). A thread that submits several small works
/// in a row (16 all-reduces, then a wait for each) would otherwise write one frame per submit,
/// and on loopback one small write costs about as much as one large one (the sender's system
/// call also runs the receiver's side of TCP). So the frames of a submit that follows another
/// with no wait in between (a burst; [`Corks::in_burst`]) are held back per connection, and go
/// out together when a thread waits for (or asks about) a work of the group, when a later frame
/// on the connection cannot be held back, or, if none of that happens, once the watcher task's
/// [`CORK_TIMEOUT`] has passed. A submit right after a wait writes at once when the submits
/// before that wait were one (the common submit-then-wait: holding its frame back would only
/// move the write into the wait, and arming the watcher for it would cost a wake-up), and is
/// held back too when they were a burst (see [`Corks::in_burst`]).
#[derive(Debug, Default)]
pub(crate) struct Corks {
    /// Submits since someone last waited for a work (see [`Corks::in_burst`]).
    submits: std::sync::atomic::AtomicU32,
    /// The last wait that followed any submits followed a burst (more than one).
    after_burst: std::sync::atomic::AtomicBool,
    /// Gates with bytes held back.
    held: Mutex<Vec<Arc<Gate>>>,
    /// `held` is not empty (read without its lock by every flush).
    any: std::sync::atomic::AtomicBool,
    /// The watcher has been told of held-back bytes and has not flushed since.
    armed: std::sync::atomic::AtomicBool,
    /// Wakes the watcher.
    wake: tokio::sync::Notify,
}

impl Corks {
    fn held(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Gate>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `gate` holds bytes back now (called under its lock).
    fn hold(&self, gate: Arc<Gate>) {
        use std::sync::atomic::Ordering::SeqCst;
        {
            let mut held = self.held();
            held.push(gate);
            self.any.store(true, SeqCst);
        }
        if !self.armed.swap(true, SeqCst) {
            self.wake.notify_one();
        }
    }

    /// A user submits a work: whether its frames are held back. They are when it follows
    /// another submit with no wait since, and when the submits before the last wait were a
    /// burst too: a thread that submits works in bursts then sends each burst in one write,
    /// not two (16 works in flight: one `writev` per burst instead of two, each of which, on
    /// loopback, also runs the peer's side of TCP). A thread that submits one work and waits
    /// writes at once. A lone work after a run of bursts waits for its wait, or for
    /// [`CORK_TIMEOUT`] if nobody waits; its wait then ends the bursts.
    pub(crate) fn in_burst(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.submits.fetch_add(1, Relaxed) > 0 || self.after_burst.load(Relaxed)
    }

    /// Someone waits for or asks about a work: write every held-back frame of the group now.
    pub(crate) fn flush(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let submits = self.submits.swap(0, Relaxed);
        if submits > 0 {
            self.after_burst.store(submits > 1, Relaxed);
        }
        self.write_held();
    }

    /// Write every held-back frame of the group now.
    fn write_held(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.any.load(SeqCst) {
            return;
        }
        let gates = {
            let mut held = self.held();
            self.any.store(false, SeqCst);
            std::mem::take(&mut *held)
        };
        for gate in gates {
            gate.flush();
        }
    }

    /// The watcher: once told of held-back bytes, wait [`CORK_TIMEOUT`] and write whatever
    /// is still held back, so that a work nobody waits for still goes out.
    pub(crate) async fn watch(self: Arc<Self>) {
        loop {
            self.wake.notified().await;
            tokio::time::sleep(CORK_TIMEOUT).await;
            self.armed.store(false, std::sync::atomic::Ordering::SeqCst);
            self.write_held();
        }
    }
}

impl LaneTx {
    /// Write `out` now, hold it back, or queue it, as `mode` allows (see [`SendMode`]).
    pub(crate) fn send(&self, out: Outbound, mode: SendMode) -> Sent {
        let Outbound { header, payload, written, .. } = out;
        // Only small frames are written by the sender here (see [`DIRECT_LIMIT`]).
        let mode = SendMode { direct: mode.direct && payload.len() <= DIRECT_LIMIT, ..mode };
        self.send_slice(header, &payload, written, mode, |rest| payload.slice(payload.len() - rest.len()..))
    }

    /// Send `header` and `payload` as `mode` allows, if nothing is queued ahead of them: held
    /// back if `mode.cork` and the connection's held-back bytes stay within [`CORK_LIMIT`], else
    /// written now if `mode.direct` (straight from the caller's memory, after what was held
    /// back); queue what is left (or everything) as `own` makes it: an owned copy of the bytes
    /// it is given.
    pub(crate) fn send_slice(
        &self,
        header: FrameHeader,
        payload: &[u8],
        written: Option<Written>,
        mode: SendMode,
        own: impl FnOnce(&[u8]) -> Bytes,
    ) -> Sent {
        let mut g = self.gate.lock();
        let head = header.encode();
        if let Some(corks) = &mode.cork
            && g.queued == 0
            && !self.tx.is_closed()
            && g.socket.is_some()
            && g.cork.len() + HEADER_LEN + payload.len() <= CORK_LIMIT
        {
            g.cork.extend_from_slice(&head);
            g.cork.extend_from_slice(payload);
            if !std::mem::replace(&mut g.listed, true) {
                corks.hold(self.gate.clone());
            }
            return Sent::Written;
        }
        // What is held back goes first.
        if !g.unload() {
            return Sent::Gone;
        }
        let mut done = 0;
        if mode.direct
            && g.queued == 0
            && !self.tx.is_closed()
            && let Some(socket) = g.socket.clone()
        {
            done = write_now(&socket, &head, payload);
            if done == HEADER_LEN + payload.len() {
                return Sent::Written;
            }
        }
        let skip = done.min(HEADER_LEN);
        let rest = own(&payload[done - skip..]);
        if self.tx.send(Outbound { header, payload: rest, written, skip }).is_err() {
            return Sent::Gone;
        }
        g.queued += 1;
        Sent::Queued
    }
}

/// Write as much of `head` then `payload` as the non-blocking `socket` takes now; the count.
/// A failure stops it like a full socket: the writer task meets it again and reports it.
fn write_now(socket: &std::net::TcpStream, head: &[u8], payload: &[u8]) -> usize {
    let total = head.len() + payload.len();
    let mut done = 0;
    while done < total {
        let (h, p) =
            if done < head.len() { (&head[done..], payload) } else { (&[][..], &payload[done - head.len()..]) };
        match (&*socket).write_vectored(&[io::IoSlice::new(h), io::IoSlice::new(p)]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    done
}

/// The connections to one peer, as the driver writes to them: one queue per connection.
/// Large data frames go round robin over its bulk lanes; everything else (control frames,
/// point-to-point messages, small data frames) keeps to the first, so that its order holds.
/// Data frames may arrive in any order: the schedule executor places a chunk by its step and
/// sender.
#[derive(Debug)]
pub(crate) struct Lanes {
    lanes: Vec<LaneTx>,
    /// The lanes large data frames go round robin over.
    bulk: std::ops::Range<usize>,
    next: std::sync::atomic::AtomicUsize,
}

impl Lanes {
    /// Large data frames round robin over every lane.
    pub(crate) fn new(lanes: Vec<LaneTx>) -> Self {
        let bulk = 0..lanes.len();
        Lanes::with_bulk(lanes, bulk)
    }

    /// Large data frames round robin over the lanes of `bulk` (a range of `lanes`, clamped to
    /// it; lane 0 when it is empty), everything else on lane 0.
    pub(crate) fn with_bulk(lanes: Vec<LaneTx>, bulk: std::ops::Range<usize>) -> Self {
        let bulk = bulk.start.min(lanes.len())..bulk.end.min(lanes.len());
        Lanes { lanes, bulk, next: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// Send `out` on its connection as `mode` allows (see [`LaneTx::send`]).
    pub(crate) fn send(&self, out: Outbound, mode: SendMode) -> Sent {
        self.lane_for(&out.header, out.payload.len()).map_or(Sent::Gone, |tx| tx.send(out, mode))
    }

    /// The connection a frame with `header` and a payload of `len` bytes goes on.
    pub(crate) fn lane_for(&self, header: &FrameHeader, len: usize) -> Option<&LaneTx> {
        let n = self.bulk.len();
        let lane = if n > 0 && header.kind == FrameKind::Data && len > COALESCE_LIMIT {
            self.bulk.start + self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n
        } else {
            0
        };
        self.lanes.get(lane)
    }
}

/// Turns the closes of one peer's several connections into the one close the driver hears:
/// the first unclean one at once (a crash or reset is a crash however many connections see
/// it), a clean one only when every connection has said goodbye (frames may still be on the
/// others until then).
pub(crate) struct CloseTally {
    open: std::sync::atomic::AtomicUsize,
    reported: std::sync::atomic::AtomicBool,
}

impl CloseTally {
    pub(crate) fn new(connections: usize) -> Self {
        CloseTally {
            open: std::sync::atomic::AtomicUsize::new(connections),
            reported: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Count one more connection to the peer.
    pub(crate) fn add(&self) {
        self.open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether `inbound` should reach the driver.
    pub(crate) fn pass(&self, inbound: &Inbound) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        match inbound {
            Inbound::Frame { .. } => true,
            Inbound::Closed { clean: false, .. } => !self.reported.swap(true, SeqCst),
            Inbound::Closed { clean: true, .. } => {
                self.open.fetch_sub(1, SeqCst) == 1 && !self.reported.swap(true, SeqCst)
            }
        }
    }
}

/// What a reader hands the driver.
#[derive(Debug)]
pub(crate) enum Inbound {
    /// A frame arrived.
    Frame {
        /// The peer.
        from: Rank,
        /// Its header (already validated).
        header: FrameHeader,
        /// Its payload.
        payload: Vec<u8>,
    },
    /// The connection ended: EOF, reset, a malformed frame, or a goodbye.
    Closed {
        /// The peer.
        from: Rank,
        /// Why, in words for the error message.
        reason: String,
        /// Whether the peer said goodbye first (a clean shutdown, not a failure).
        clean: bool,
    },
}

/// Told once frames are on the socket (`Ok`) or can no longer get there (`Err`): the peer,
/// and the works the frames belong to (one entry per frame, in order). A writer tells it once
/// per batch of frames it wrote together.
pub(crate) type OnWritten =
    std::sync::Arc<dyn Fn(Rank, &[cohort_core::work::WorkId], Result<(), String>) + Send + Sync>;

/// Who wants to know that a frame is written: its work, and the hook to tell.
pub(crate) struct Written {
    pub(crate) id: cohort_core::work::WorkId,
    pub(crate) hook: OnWritten,
}

/// The frames a writer wrote together, to be told to their hook in one call.
#[derive(Default)]
struct WrittenBatch {
    ids: Vec<cohort_core::work::WorkId>,
    hook: Option<OnWritten>,
}

impl WrittenBatch {
    fn push(&mut self, written: Option<Written>) {
        if let Some(Written { id, hook }) = written {
            self.ids.push(id);
            self.hook.get_or_insert(hook);
        }
    }

    fn tell(&mut self, to: Rank, outcome: Result<(), String>) {
        if let Some(hook) = &self.hook
            && !self.ids.is_empty()
        {
            hook(to, &self.ids, outcome);
        }
        self.ids.clear();
    }
}

/// A frame to send: header plus payload, and who wants to know when it is written.
pub(crate) struct Outbound {
    pub(crate) header: FrameHeader,
    pub(crate) payload: Bytes,
    pub(crate) written: Option<Written>,
    /// Bytes of the header already written by the sender (see [`LaneTx::send_slice`]); then
    /// `payload` holds only the part of the payload still to write.
    pub(crate) skip: usize,
}

impl Outbound {
    pub(crate) fn new(header: FrameHeader, payload: Bytes, written: Option<Written>) -> Self {
        Outbound { header, payload, written, skip: 0 }
    }

    /// Bytes of whole frames, headers included (held back, see [`Corks`]): nothing of
    /// `header` is left to write, and nobody is told when they are written.
    fn bytes(frames: Bytes) -> Self {
        Outbound { header: FrameHeader::heartbeat(Rank(0)), payload: frames, written: None, skip: HEADER_LEN }
    }
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound").field("header", &self.header).field("len", &self.payload.len()).finish()
    }
}

/// Read frames from `stream` until it ends, handing each to `deliver` (which returns false
/// once nobody listens any more).
pub(crate) async fn run_reader<R>(
    from: Rank,
    mut stream: R,
    limits: FrameLimits,
    pool: BufferPool,
    mut deliver: impl FnMut(Inbound) -> bool,
) where
    R: AsyncRead + Unpin,
{
    let mut asm = Assembler::new(from, limits, pool);
    loop {
        while let Some(next) = asm.poll_frame() {
            match next {
                Ok(frame) => {
                    if !deliver(frame) {
                        return; // the driver is gone
                    }
                }
                Err(last) => {
                    let _ = deliver(last);
                    return;
                }
            }
        }
        match stream.read(asm.read_buf()).await {
            Ok(0) => {
                let _ = deliver(asm.eof());
                return;
            }
            Ok(n) => asm.advance(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = deliver(asm.read_error(&e));
                return;
            }
        }
    }
}

/// Bytes a connection's reads are staged in; larger payloads are read straight into their own
/// buffer.
const STAGING: usize = 64 * 1024;

/// Turns the bytes of one connection into frames, whatever the reads deliver (sans-IO: the
/// caller reads into [`Assembler::read_buf`], reports [`Assembler::advance`], then takes what
/// became complete from [`Assembler::poll_frame`]).
pub(crate) struct Assembler {
    from: Rank,
    limits: FrameLimits,
    pool: BufferPool,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// A frame whose header has arrived: its header, its payload buffer, bytes of it filled.
    partial: Option<(FrameHeader, Vec<u8>, usize)>,
    /// The last read_buf was the partial payload itself.
    direct: bool,
    /// The last frame's payload was read (at least partly) straight into its own buffer: the
    /// next read takes only the next header, so that a large payload after it is read straight
    /// into its buffer too rather than partly into the staging buffer and copied from there.
    after_large: bool,
    /// A last frame (goodbye, malformed) was returned: nothing more comes.
    ended: bool,
}

impl Assembler {
    pub(crate) fn new(from: Rank, limits: FrameLimits, pool: BufferPool) -> Self {
        Assembler {
            from,
            limits,
            pool,
            buf: vec![0; STAGING].into_boxed_slice(),
            start: 0,
            end: 0,
            partial: None,
            direct: false,
            after_large: false,
            ended: false,
        }
    }

    /// The next complete frame, if the bytes read so far hold one. `Err` is the connection's
    /// last word (a goodbye, or a malformed frame): nothing more comes after it.
    pub(crate) fn poll_frame(&mut self) -> Option<Result<Inbound, Inbound>> {
        if self.ended {
            return None;
        }
        loop {
            if let Some((_, payload, got)) = &mut self.partial {
                if *got < payload.len() {
                    let n = (self.end - self.start).min(payload.len() - *got);
                    if n == 0 {
                        return None;
                    }
                    payload[*got..*got + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                    self.start += n;
                    *got += n;
                    continue;
                }
                let (header, payload, _) = self.partial.take()?;
                return Some(self.complete(header, payload));
            }
            if self.end - self.start < HEADER_LEN {
                return None;
            }
            let from = self.from;
            let mut head = [0u8; HEADER_LEN];
            head.copy_from_slice(&self.buf[self.start..self.start + HEADER_LEN]);
            self.start += HEADER_LEN;
            let header = match FrameHeader::decode(&head, &self.limits) {
                Ok(h) => h,
                Err(e) => return Some(self.last(format!("malformed frame from rank {from}: {e}"), false)),
            };
            if header.source != from {
                let claim = header.source;
                return Some(
                    self.last(format!("frame on rank {from}'s connection claims to come from rank {claim}"), false),
                );
            }
            // The length was checked against the frame limit by decode.
            let len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
            self.after_large = false;
            if len == 0 {
                return Some(self.complete(header, Vec::new()));
            }
            match self.pool.take(len) {
                Ok(payload) => self.partial = Some((header, payload, 0)),
                Err(e) => {
                    return Some(
                        self.last(format!("cannot allocate {len} bytes for a frame from rank {from}: {e}"), false),
                    );
                }
            }
        }
    }

    fn complete(&mut self, header: FrameHeader, payload: Vec<u8>) -> Result<Inbound, Inbound> {
        let from = self.from;
        if header.kind == FrameKind::Goodbye {
            return self.last(format!("rank {from} closed the connection"), true);
        }
        Ok(Inbound::Frame { from, header, payload })
    }

    fn last(&mut self, reason: String, clean: bool) -> Result<Inbound, Inbound> {
        self.ended = true;
        Err(Inbound::Closed { from: self.from, reason, clean })
    }

    /// Where the next read goes (never empty). Call [`Assembler::poll_frame`] until `None`
    /// first.
    pub(crate) fn read_buf(&mut self) -> &mut [u8] {
        let buffered = self.end - self.start;
        let header_only = self.after_large && self.partial.is_none() && buffered < HEADER_LEN;
        if let Some((_, payload, got)) = &mut self.partial
            && buffered == 0
            && payload.len() - *got >= self.buf.len()
        {
            self.direct = true;
            return &mut payload[*got..];
        }
        self.direct = false;
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end = buffered;
            self.start = 0;
        }
        if header_only {
            return &mut self.buf[buffered..HEADER_LEN];
        }
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into the last [`Assembler::read_buf`].
    pub(crate) fn advance(&mut self, n: usize) {
        match &mut self.partial {
            Some((_, _, got)) if self.direct => {
                *got += n;
                self.after_large = true;
            }
            _ => self.end = (self.end + n).min(self.buf.len()),
        }
    }

    /// What the end of the stream means here.
    pub(crate) fn eof(&self) -> Inbound {
        let between = self.partial.is_none() && self.end == self.start;
        let e = io::Error::from(io::ErrorKind::UnexpectedEof);
        Inbound::Closed { from: self.from, reason: describe_read_error(&e, between), clean: false }
    }

    /// What a failed read means here.
    pub(crate) fn read_error(&self, e: &io::Error) -> Inbound {
        Inbound::Closed { from: self.from, reason: describe_read_error(e, false), clean: false }
    }
}

fn describe_read_error(e: &io::Error, between_frames: bool) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof if between_frames => {
            "connection closed (EOF): the peer process exited or crashed".into()
        }
        io::ErrorKind::UnexpectedEof => "connection closed (EOF) in the middle of a frame".into(),
        io::ErrorKind::ConnectionReset => "connection reset by peer".into(),
        _ => format!("read failed: {e}"),
    }
}

/// Write every frame from `rx` to `stream`; on a write error, report it and stop.
pub(crate) async fn run_writer<W>(
    me: Rank,
    to: Rank,
    mut stream: W,
    lane: LaneRx,
    errors: mpsc::UnboundedSender<Inbound>,
) where
    W: AsyncWrite + Unpin,
{
    let LaneRx { mut rx, gate } = lane;
    let mut small = Vec::with_capacity(HEADER_LEN + COALESCE_LIMIT);
    let mut notify = WrittenBatch::default();
    while let Some(first) = rx.recv().await {
        let mut batch = 0;
        // Coalesce every small frame already queued into one write.
        small.clear();
        let mut next = Some(first);
        let mut result = Ok(());
        while let Some(mut out) = next.take() {
            batch += 1;
            notify.push(out.written.take());
            if out.payload.len() <= COALESCE_LIMIT {
                small.extend_from_slice(out.header.encode().get(out.skip..).unwrap_or_default());
                small.extend_from_slice(&out.payload);
                if small.len() < COALESCE_LIMIT {
                    next = rx.try_recv().ok();
                }
            } else {
                if !small.is_empty() {
                    result = stream.write_all(&small).await;
                    small.clear();
                    if result.is_err() {
                        break;
                    }
                }
                result = write_large(&mut stream, &out).await;
                if result.is_err() {
                    break;
                }
                next = rx.try_recv().ok();
            }
        }
        if result.is_ok() && !small.is_empty() {
            result = stream.write_all(&small).await;
        }
        if result.is_ok() {
            result = stream.flush().await;
        }
        gate.written(batch);
        let outcome = result.as_ref().map(|_| ()).map_err(|e| format!("write to rank {to} failed: {e}"));
        notify.tell(to, outcome);
        if let Err(e) = result {
            let reason = match e.kind() {
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                    format!("connection to rank {to} broken: {e}")
                }
                _ => format!("write to rank {to} failed: {e}"),
            };
            let _ = errors.send(Inbound::Closed { from: to, reason: reason.clone(), clean: false });
            rx.close();
            // Closed: what is still queued comes out at once, then `None`.
            while let Some(mut out) = rx.recv().await {
                notify.push(out.written.take());
            }
            notify.tell(to, Err(reason));
            return;
        }
    }
    // The driver closed the channel: what was held back, then a goodbye, so the peer knows this
    // is no crash.
    let held = gate.close();
    if !held.is_empty() {
        let _ = stream.write_all(&held).await;
    }
    let _ = stream.write_all(&FrameHeader::goodbye(me).encode()).await;
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
}

async fn write_large<W: AsyncWrite + Unpin>(stream: &mut W, out: &Outbound) -> io::Result<()> {
    stream.write_all(out.header.encode().get(out.skip..).unwrap_or_default()).await?;
    stream.write_all(&out.payload).await
}

#[cfg(test)]
mod tests {
    use cohort_core::work::{GroupId, SeqNo, WorkId};
    use std::sync::Mutex;
    use tokio::io::AsyncReadExt;

    use super::*;

    fn frame(kind: FrameKind, len: usize) -> Outbound {
        let mut header = FrameHeader::data(GroupId(0), SeqNo(1), 0, Rank(0), len as u64);
        header.kind = kind;
        Outbound::new(header, Bytes::from(vec![0u8; len]), None)
    }

    #[test]
    fn large_data_frames_go_round_robin_and_the_rest_keep_to_the_first_connection() {
        let (txs, mut rxs): (Vec<_>, Vec<_>) = (0..3).map(|_| lane()).unzip();
        let lanes = Lanes::new(txs);
        let big = COALESCE_LIMIT + 1;
        for _ in 0..6 {
            assert_eq!(lanes.send(frame(FrameKind::Data, big), SendMode::QUEUE), Sent::Queued);
        }
        assert_eq!(lanes.send(frame(FrameKind::Data, 16), SendMode::QUEUE), Sent::Queued);
        assert_eq!(lanes.send(frame(FrameKind::P2p, big), SendMode::QUEUE), Sent::Queued);
        assert_eq!(lanes.send(frame(FrameKind::Error, 8), SendMode::QUEUE), Sent::Queued);
        let counts: Vec<usize> = rxs.iter_mut().map(|r| std::iter::from_fn(|| r.rx.try_recv().ok()).count()).collect();
        assert_eq!(counts, vec![2 + 3, 2, 2]);
        drop(rxs);
        assert_eq!(lanes.send(frame(FrameKind::Data, 16), SendMode::QUEUE), Sent::Gone, "a closed connection refuses");
    }

    #[test]
    fn with_bulk_lanes_large_data_frames_keep_to_them_and_the_rest_to_the_first_connection() {
        // The higher rank of a pair: the shared connection 0, then its own direction's two.
        let (txs, mut rxs): (Vec<_>, Vec<_>) = (0..3).map(|_| lane()).unzip();
        let lanes = Lanes::with_bulk(txs, 1..3);
        let big = COALESCE_LIMIT + 1;
        for _ in 0..4 {
            assert_eq!(lanes.send(frame(FrameKind::Data, big), SendMode::QUEUE), Sent::Queued);
        }
        assert_eq!(lanes.send(frame(FrameKind::Data, 16), SendMode::QUEUE), Sent::Queued);
        assert_eq!(lanes.send(frame(FrameKind::P2p, big), SendMode::QUEUE), Sent::Queued);
        let counts: Vec<usize> = rxs.iter_mut().map(|r| std::iter::from_fn(|| r.rx.try_recv().ok()).count()).collect();
        assert_eq!(counts, vec![2, 2, 2]);
        // A bulk range past the lanes is clamped; an empty one sends everything on the first.
        let (txs, mut rxs): (Vec<_>, Vec<_>) = (0..2).map(|_| lane()).unzip();
        let lanes = Lanes::with_bulk(txs, 2..5);
        assert_eq!(lanes.send(frame(FrameKind::Data, big), SendMode::QUEUE), Sent::Queued);
        let counts: Vec<usize> = rxs.iter_mut().map(|r| std::iter::from_fn(|| r.rx.try_recv().ok()).count()).collect();
        assert_eq!(counts, vec![1, 0]);
    }

    impl BufferPool {
        /// (buffers kept, bytes kept, bytes out)
        fn counts(&self) -> (usize, usize, usize) {
            let st = self.lock();
            (st.kept.len(), st.kept_bytes, st.out_bytes)
        }
    }

    #[test]
    fn large_buffers_are_reused_and_small_ones_are_not_kept() {
        let pool = BufferPool::default();
        let mut a = pool.take(BufferPool::MIN).unwrap();
        a[0] = 7;
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(BufferPool::MIN - 1).unwrap();
        assert_eq!(b.len(), BufferPool::MIN - 1);
        assert!(b.iter().all(|&x| x == 0), "a small take is fresh and zeroed");
        let c = pool.take(BufferPool::MIN).unwrap();
        assert_eq!(c.as_ptr(), ptr, "the kept buffer comes back");
        assert_eq!((c.len(), c[0]), (BufferPool::MIN, 7), "as it was: a read overwrites it");
        assert_eq!(pool.counts(), (0, 0, BufferPool::MIN), "it is out");
        pool.give(b);
        assert_eq!(pool.counts().0, 0, "small buffers are not kept");
        pool.give(c);
        assert_eq!(pool.counts(), (1, BufferPool::MIN, 0));
        // A pooled Bytes returns its buffer when the last handle drops.
        let payload = vec![3u8; BufferPool::MIN];
        let bytes = pool.bytes(&payload);
        assert_eq!(&bytes[..], &payload[..]);
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(pool.counts(), (0, 0, BufferPool::MIN));
        drop(clone);
        assert_eq!(pool.counts(), (1, BufferPool::MIN, 0));
    }

    #[test]
    fn a_pool_holds_at_most_its_limit_kept_and_out_together() {
        let pool = BufferPool::with_limit(3 * BufferPool::MIN);
        let out: Vec<Vec<u8>> = (0..5).map(|_| pool.take(BufferPool::MIN).unwrap()).collect();
        assert_eq!(pool.counts(), (0, 0, 5 * BufferPool::MIN), "a peak above the limit is served");
        for b in out {
            pool.give(b);
        }
        assert_eq!(pool.counts(), (3, 3 * BufferPool::MIN, 0), "and shrinks back to the limit");
        let none = BufferPool::with_limit(0);
        none.give(none.take(BufferPool::MIN).unwrap());
        assert_eq!(none.counts(), (0, 0, 0), "a limit of 0 keeps nothing");
    }

    #[test]
    fn reserve_makes_buffers_for_a_collective_up_to_the_limit_once() {
        let chunk = 2 * BufferPool::MIN;
        let pool = BufferPool::with_limit(10 * chunk);
        pool.reserve(4 * chunk + 1, chunk);
        assert_eq!(pool.counts(), (5, 5 * chunk, 0), "rounded up to whole buffers");
        {
            let st = pool.lock();
            assert!(st.kept.iter().all(|b| b.capacity() >= chunk && b.len() == chunk), "written, not just allocated");
        }
        pool.reserve(4 * chunk, chunk);
        assert_eq!(pool.counts().0, 5, "nothing more once it holds that much");
        // Buffers out count as held.
        let taken: Vec<Vec<u8>> = (0..5).map(|_| pool.take(chunk).unwrap()).collect();
        pool.reserve(6 * chunk, chunk);
        assert_eq!(pool.counts(), (1, chunk, 5 * chunk));
        drop(taken); // lost, not given back: the pool still counts them out
        pool.reserve(100 * chunk, chunk);
        assert_eq!(pool.counts(), (5, 5 * chunk, 5 * chunk), "never past the limit");
        // New buffers are made at the reserved size, so any kept one fits any chunk.
        let small = BufferPool::with_limit(10 * chunk);
        small.reserve(chunk, chunk);
        let b = small.take(chunk).unwrap();
        let c = small.take(BufferPool::MIN).unwrap();
        assert!(c.capacity() >= chunk, "a fresh buffer has the reserved size");
        drop((b, c));
        // Nothing for small chunks or chunks past the limit.
        let p = BufferPool::with_limit(chunk);
        p.reserve(10 * chunk, BufferPool::MIN - 1);
        p.reserve(10 * chunk, 2 * chunk);
        assert_eq!(p.counts(), (0, 0, 0));
    }

    fn data(seq: u64, len: usize, fill: u8) -> (FrameHeader, Vec<u8>) {
        (FrameHeader::data(GroupId(0), SeqNo(seq), 0, Rank(1), len as u64), vec![fill; len])
    }

    fn wire(frames: &[(FrameHeader, Vec<u8>)]) -> Vec<u8> {
        frames.iter().flat_map(|(h, p)| h.encode().into_iter().chain(p.iter().copied())).collect()
    }

    /// Feed `bytes` to an assembler in reads of the given sizes (cycled); every frame and the
    /// last word, in order.
    fn assemble(bytes: &[u8], reads: &[usize]) -> (Vec<(FrameHeader, Vec<u8>)>, Option<Inbound>) {
        let mut asm = Assembler::new(Rank(1), FrameLimits::new(1 << 30), BufferPool::default());
        let (mut frames, mut at, mut i) = (Vec::new(), 0, 0);
        loop {
            while let Some(next) = asm.poll_frame() {
                match next {
                    Ok(Inbound::Frame { header, payload, .. }) => frames.push((header, payload)),
                    Ok(other) => panic!("not a frame: {other:?}"),
                    Err(last) => return (frames, Some(last)),
                }
            }
            if at == bytes.len() {
                return (frames, Some(asm.eof()));
            }
            let buf = asm.read_buf();
            let n = reads[i % reads.len()].clamp(1, buf.len()).min(bytes.len() - at);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            asm.advance(n);
            at += n;
            i += 1;
        }
    }

    fn reason(last: Option<Inbound>) -> (String, bool) {
        match last {
            Some(Inbound::Closed { reason, clean, .. }) => (reason, clean),
            other => panic!("no close: {other:?}"),
        }
    }

    #[test]
    fn the_assembler_rebuilds_frames_from_any_reads_and_names_how_the_stream_ended() {
        let frames =
            vec![data(1, 0, 0), data(2, 5, 7), data(3, STAGING * 3 + 11, 9), data(4, 1, 1), data(5, STAGING, 2)];
        let bytes = wire(&frames);
        for reads in [&[1usize][..], &[7, 13], &[STAGING], &[usize::MAX], &[HEADER_LEN - 1, 100_000]] {
            let (got, last) = assemble(&bytes, reads);
            assert_eq!(got, frames, "reads {reads:?}");
            assert_eq!(reason(last), ("connection closed (EOF): the peer process exited or crashed".into(), false));
        }
        // Cut inside a header, inside a payload.
        for cut in [bytes.len() - 3, HEADER_LEN + 2] {
            let (_, last) = assemble(&bytes[..cut], &[4096]);
            assert_eq!(reason(last).0, "connection closed (EOF) in the middle of a frame");
        }
        // A goodbye is a clean last word; nothing after it is read.
        let mut bye = wire(&frames[..2]);
        bye.extend_from_slice(&FrameHeader::goodbye(Rank(1)).encode());
        bye.extend_from_slice(&wire(&frames[2..]));
        let (got, last) = assemble(&bye, &[3]);
        assert_eq!(got, frames[..2]);
        assert_eq!(reason(last), ("rank 1 closed the connection".into(), true));
        // A frame claiming another sender, and garbage.
        let (_, last) = assemble(&FrameHeader::heartbeat(Rank(2)).encode(), &[64]);
        assert_eq!(reason(last).0, "frame on rank 1's connection claims to come from rank 2");
        let (_, last) = assemble(&[0xAB; HEADER_LEN], &[64]);
        assert!(reason(last).0.starts_with("malformed frame from rank 1: "));
    }

    #[test]
    fn after_a_payload_read_straight_into_its_buffer_the_next_read_takes_only_the_next_header() {
        let frames = [data(1, STAGING * 2, 1), data(2, STAGING * 2, 2), data(3, 5, 3), data(4, 7, 4)];
        let bytes = wire(&frames);
        let mut asm = Assembler::new(Rank(1), FrameLimits::new(1 << 30), BufferPool::default());
        let (mut at, mut sizes, mut got) = (0, Vec::new(), Vec::new());
        while at < bytes.len() {
            let buf = asm.read_buf();
            let n = buf.len().min(bytes.len() - at);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            asm.advance(n);
            at += n;
            sizes.push(n);
            while let Some(Ok(Inbound::Frame { header, payload, .. })) = asm.poll_frame() {
                got.push((header, payload));
            }
        }
        assert_eq!(got, frames);
        // The first read fills the staging buffer (header and the start of payload 1), the rest of
        // payload 1 goes straight in; then header 2 alone, payload 2 straight in; then header 3
        // alone, and what is left (small frames) through the staging buffer in one read.
        let p = STAGING * 2;
        assert_eq!(sizes, vec![STAGING, p - (STAGING - HEADER_LEN), HEADER_LEN, p, HEADER_LEN, 5 + HEADER_LEN + 7]);
    }

    proptest::proptest! {
        #[test]
        fn any_split_of_the_stream_gives_the_same_frames(
            lens in proptest::collection::vec(0usize..3 * STAGING, 0..6),
            reads in proptest::collection::vec(1usize..2 * STAGING, 1..8),
        ) {
            let frames: Vec<_> = lens.iter().enumerate().map(|(i, &n)| data(i as u64, n, i as u8)).collect();
            let (got, _) = assemble(&wire(&frames), &reads);
            proptest::prop_assert_eq!(got, frames);
        }

        #[test]
        fn whatever_a_peer_sends_ends_in_frames_and_one_last_word_never_a_panic(
            valid in proptest::collection::vec(0usize..2000, 0..3),
            garbage in proptest::collection::vec(proptest::num::u8::ANY, 0..4 * HEADER_LEN),
            reads in proptest::collection::vec(1usize..4096, 1..4),
        ) {
            let frames: Vec<_> = valid.iter().enumerate().map(|(i, &n)| data(i as u64, n, 1)).collect();
            let mut bytes = wire(&frames);
            bytes.extend_from_slice(&garbage);
            let (got, last) = assemble(&bytes, &reads);
            proptest::prop_assert!(got.len() >= frames.len());
            proptest::prop_assert_eq!(&got[..frames.len()], &frames[..]);
            let closed = matches!(last, Some(Inbound::Closed { .. }));
            proptest::prop_assert!(closed, "the stream ends with a close");
        }
    }

    /// A loopback pair of real sockets, the first as tokio's.
    async fn socket_pair() -> (tokio::net::TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (rx, _) = listener.accept().unwrap();
        (tx, rx)
    }

    /// A lane on a real socket with its writer task running: the lane, the peer's end, the
    /// writer.
    async fn fast_lane() -> (LaneTx, std::net::TcpStream, tokio::task::JoinHandle<()>) {
        let (tx, rx) = socket_pair().await;
        let fast = Arc::new(super::super::socket::take(tx).map_err(|(e, _)| e).unwrap());
        let (lane_tx, lane_rx) = lane();
        lane_rx.gate.open(fast.std());
        let (err_tx, _err_rx) = mpsc::unbounded_channel();
        let w = super::super::socket::SharedWrite(fast);
        (lane_tx, rx, tokio::spawn(run_writer(Rank(1), Rank(0), w, lane_rx, err_tx)))
    }

    /// Read `rx` to its end while the (closed) lane's `writer` finishes: exactly `frames`, whole
    /// and in order, then the goodbye.
    async fn expect_in_order(
        rx: std::net::TcpStream,
        writer: tokio::task::JoinHandle<()>,
        frames: &[(FrameHeader, Vec<u8>)],
    ) {
        let reader = std::thread::spawn(move || {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut &rx, &mut bytes).unwrap();
            bytes
        });
        writer.await.unwrap();
        let mut want = wire(frames);
        want.extend_from_slice(&FrameHeader::goodbye(Rank(1)).encode());
        let got = tokio::task::spawn_blocking(move || reader.join().unwrap()).await.unwrap();
        let (got_frames, last) = assemble(&got, &[STAGING]);
        assert_eq!(got_frames.len(), frames.len());
        assert!(got_frames == frames, "frames arrive whole and in order");
        assert!(reason(last).1, "and the goodbye last");
        assert_eq!(got, want);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn direct_writes_and_queued_frames_keep_their_order_even_against_a_full_socket() {
        let (lane_tx, rx, writer) = fast_lane().await;
        // Nobody reads yet: small frames are written directly until the socket is full, and the
        // one that meets the full buffer (written in part, or not at all) goes to the writer
        // task; everything after it is queued behind, small or large, and must arrive in order.
        let mut frames = Vec::new();
        let mut direct = 0;
        let mut i = 0u64;
        loop {
            let (h, p) = data(i, 1000, i as u8);
            i += 1;
            let sent = lane_tx.send(Outbound::new(h, Bytes::from(p.clone()), None), SendMode::DIRECT);
            frames.push((h, p));
            match sent {
                Sent::Written => direct += 1,
                Sent::Queued => break,
                Sent::Gone => panic!("the writer is alive"),
            }
        }
        assert!(direct > 0, "the first frames find room in the socket");
        for j in 0..50u64 {
            let (h, p) = if j % 5 == 0 {
                data(i + j, 3 * STAGING, j as u8)
            } else {
                data(i + j, (j as usize * 37) % 900, j as u8)
            };
            assert_eq!(lane_tx.send(Outbound::new(h, Bytes::from(p.clone()), None), SendMode::DIRECT), Sent::Queued);
            frames.push((h, p));
        }
        drop(lane_tx);
        expect_in_order(rx, writer, &frames).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_back_direct_and_queued_frames_keep_their_order_even_against_a_full_socket() {
        let (lane_tx, rx, writer) = fast_lane().await;
        let corks = Arc::new(Corks::default());
        // Nobody reads until the end: the socket fills up while frames are held back, written
        // directly, queued and flushed in a mix; they must all arrive whole and in order.
        let mut frames = Vec::new();
        let mut held = 0;
        for i in 0..4000u64 {
            // Small frames first (nothing is queued yet, so frames are held back), then large
            // and queued ones in between.
            let len = match i % 13 {
                0 if i >= 200 => 3 * STAGING,
                k => (k as usize * 311 + i as usize) % 2000,
            };
            let (h, p) = data(i, len, i as u8);
            let mode = match i % 7 {
                0 => SendMode::DIRECT,
                1 if i >= 200 => SendMode::QUEUE,
                _ => SendMode { direct: true, cork: Some(corks.clone()) },
            };
            let cork = mode.cork.is_some();
            let sent = lane_tx.send(Outbound::new(h, Bytes::from(p.clone()), None), mode);
            assert_ne!(sent, Sent::Gone, "the writer is alive");
            held += usize::from(cork && sent == Sent::Written);
            frames.push((h, p));
            if i % 50 == 49 {
                corks.flush();
            }
        }
        assert!(held > 0, "some frames were held back");
        corks.flush();
        drop(lane_tx);
        expect_in_order(rx, writer, &frames).await;
    }

    #[test]
    fn a_burst_s_first_submit_is_held_back_only_after_a_burst() {
        let corks = Corks::default();
        assert!(!corks.in_burst(), "a first submit writes at once");
        corks.flush();
        assert!(!corks.in_burst(), "submit, wait, submit: at once");
        assert!(corks.in_burst(), "a second submit with no wait since is held back");
        corks.flush();
        corks.flush();
        assert!(corks.in_burst(), "the wait before followed a burst: the next burst's first is held");
        corks.flush();
        assert!(!corks.in_burst(), "the wait before followed one submit: at once again");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_back_frames_go_out_without_a_flush_once_the_watcher_s_time_is_up() {
        let (lane_tx, rx, writer) = fast_lane().await;
        let corks = Arc::new(Corks::default());
        let watcher = tokio::spawn(corks.clone().watch());
        let frames: Vec<_> = (0..3u64).map(|i| data(i, 10, i as u8)).collect();
        for (h, p) in &frames {
            let sent = lane_tx.send(
                Outbound::new(*h, Bytes::from(p.clone()), None),
                SendMode { direct: true, cork: Some(corks.clone()) },
            );
            assert_eq!(sent, Sent::Written, "a small frame on an idle connection is held back");
        }
        let want = wire(&frames);
        let got = tokio::task::spawn_blocking(move || {
            let mut got = vec![0u8; want.len()];
            rx.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
            std::io::Read::read_exact(&mut &rx, &mut got).map(|()| (got, want))
        })
        .await
        .unwrap();
        let (got, want) = got.expect("the watcher writes held-back frames nobody flushed");
        assert_eq!(got, want);
        watcher.abort();
        drop(lane_tx);
        writer.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_closing_writer_sends_what_was_held_back_before_its_goodbye() {
        let (lane_tx, rx, writer) = fast_lane().await;
        let corks = Arc::new(Corks::default());
        let frames = vec![data(7, 100, 7)];
        let (h, p) = &frames[0];
        let sent = lane_tx.send(
            Outbound::new(*h, Bytes::from(p.clone()), None),
            SendMode { direct: true, cork: Some(corks.clone()) },
        );
        assert_eq!(sent, Sent::Written);
        drop(lane_tx);
        expect_in_order(rx, writer, &frames).await;
    }

    /// Every call of a hook: (peer, works, ok).
    type Calls = Arc<Mutex<Vec<(Rank, Vec<WorkId>, bool)>>>;

    /// A hook that records every call.
    fn recording_hook() -> (OnWritten, Calls) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let c = calls.clone();
        let hook: OnWritten = Arc::new(move |to, ids: &[WorkId], outcome: Result<(), String>| {
            c.lock().unwrap().push((to, ids.to_vec(), outcome.is_ok()));
        });
        (hook, calls)
    }

    #[tokio::test]
    async fn the_writer_tells_every_frame_written_in_order_batching_what_it_wrote_together() {
        let (hook, calls) = recording_hook();
        let (lane_tx, lane_rx) = lane();
        // Queued before the writer starts, so that it finds them together.
        for i in 0..20u64 {
            let (h, p) = data(i, if i == 7 { 3 * STAGING } else { 100 }, 1);
            let written = Some(Written { id: WorkId(i), hook: hook.clone() });
            assert_eq!(lane_tx.send(Outbound::new(h, Bytes::from(p), written), SendMode::QUEUE), Sent::Queued);
        }
        drop(lane_tx);
        let (w, mut r) = tokio::io::duplex(1 << 20);
        let (err_tx, _err_rx) = mpsc::unbounded_channel();
        run_writer(Rank(1), Rank(0), w, lane_rx, err_tx).await;
        let mut bytes = Vec::new();
        r.read_to_end(&mut bytes).await.unwrap();
        let calls = calls.lock().unwrap().clone();
        assert!(calls.len() < 20, "frames written together are told together: {} calls", calls.len());
        assert!(calls.iter().all(|(to, ids, ok)| *to == Rank(0) && *ok && !ids.is_empty()));
        let ids: Vec<WorkId> = calls.into_iter().flat_map(|(_, ids, _)| ids).collect();
        assert_eq!(ids, (0..20).map(WorkId).collect::<Vec<_>>(), "each frame once, in order");
    }

    #[tokio::test]
    async fn frames_a_failed_writer_cannot_write_are_told_failed_each_once() {
        let (hook, calls) = recording_hook();
        let (lane_tx, lane_rx) = lane();
        for i in 0..10u64 {
            let (h, p) = data(i, 100, 1);
            let written = Some(Written { id: WorkId(i), hook: hook.clone() });
            lane_tx.send(Outbound::new(h, Bytes::from(p), written), SendMode::QUEUE);
        }
        let (w, r) = tokio::io::duplex(64);
        drop(r);
        let (err_tx, mut err_rx) = mpsc::unbounded_channel();
        let writer = tokio::spawn(run_writer(Rank(1), Rank(0), w, lane_rx, err_tx));
        assert!(matches!(err_rx.recv().await, Some(Inbound::Closed { clean: false, .. })));
        // Frames queued after the failure are refused or told failed too.
        let (h, p) = data(10, 100, 1);
        let late =
            lane_tx.send(Outbound::new(h, Bytes::from(p), Some(Written { id: WorkId(10), hook })), SendMode::QUEUE);
        drop(lane_tx);
        writer.await.unwrap();
        let calls = calls.lock().unwrap().clone();
        assert!(calls.iter().all(|(_, _, ok)| !ok), "{calls:?}");
        let ids: Vec<WorkId> = calls.into_iter().flat_map(|(_, ids, _)| ids).collect();
        let told = if late == Sent::Gone { 10 } else { 11 };
        assert_eq!(ids, (0..told).map(WorkId).collect::<Vec<_>>());
    }

    fn closed(clean: bool) -> Inbound {
        Inbound::Closed { from: Rank(1), reason: String::new(), clean }
    }

    #[test]
    fn a_peer_closes_once_cleanly_after_every_goodbye_or_at_its_first_crash() {
        let t = CloseTally::new(3);
        assert!(!t.pass(&closed(true)));
        assert!(t.pass(&Inbound::Frame {
            from: Rank(1),
            header: FrameHeader::heartbeat(Rank(1)),
            payload: Vec::new()
        }));
        assert!(!t.pass(&closed(true)));
        assert!(t.pass(&closed(true)), "the last goodbye closes the peer");
        assert!(!t.pass(&closed(false)), "only once");

        let t = CloseTally::new(3);
        assert!(!t.pass(&closed(true)));
        assert!(t.pass(&closed(false)), "a crash on any connection closes the peer at once");
        assert!(!t.pass(&closed(true)));
        assert!(!t.pass(&closed(false)));
    }
}
