//! The send side of a connection: its queue to the writer task ([`LaneTx`], [`LaneRx`]), the
//! [`Gate`] that orders direct writes and held-back bytes against that queue, and [`Lanes`],
//! which picks the connection a frame to a peer goes on.
//!
//! Why: a small frame with nothing queued ahead of it is cheapest written by the thread that
//! sends it (no hop to the writer task, no wake-up); everything else goes through the queue so
//! that frames keep their order. Large data frames spread over several connections so that the
//! two ranks of a pair never contend for one socket.

use std::io::{self, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use bytes::Bytes;
use cohort_core::protocol::{FrameHeader, FrameKind, HEADER_LEN};
use tokio::sync::mpsc;

use super::{Corks, Outbound, Written};
use crate::tcp::tunables::{COALESCE_LIMIT, CORK_LIMIT, DIRECT_LIMIT};

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
    /// waits for a work of the group, or [`CORK_TIMEOUT`](crate::tcp::tunables::CORK_TIMEOUT) passes (a thread that submits a
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
pub(crate) struct Gate {
    state: Mutex<GateState>,
    /// What the writer task writes to, once known to take direct writes: a real TCP socket,
    /// or the connection's shared-memory ring.
    socket: OnceLock<Arc<dyn Wire>>,
    /// Whether anything is ahead of a frame a sender would write now: the frames queued and
    /// not yet written, plus one while bytes are held back, as every release of `state`
    /// leaves them ([`GateGuard`]). A whole frame's write ([`LaneTx::try_write_whole`]) reads
    /// this instead of taking the lock: a frame sent after another (in any thread's order)
    /// sees that one counted here until the writer task has written it, and what is queued or
    /// held back meanwhile by a sender not ordered with this one has no order to keep.
    ahead: AtomicUsize,
}

/// The gate's state, held; its release leaves [`Gate::ahead`] saying what it holds.
struct GateGuard<'a> {
    state: MutexGuard<'a, GateState>,
    ahead: &'a AtomicUsize,
}

impl std::ops::Deref for GateGuard<'_> {
    type Target = GateState;
    fn deref(&self) -> &GateState {
        &self.state
    }
}

impl std::ops::DerefMut for GateGuard<'_> {
    fn deref_mut(&mut self) -> &mut GateState {
        &mut self.state
    }
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        // Stored while the lock is still held (the guard's fields are dropped after this).
        let ahead = self.state.queued + usize::from(!self.state.cork.is_empty());
        self.ahead.store(ahead, Ordering::Release);
    }
}

#[derive(Debug, Default)]
struct GateState {
    /// Frames handed to the writer task and not yet written by it.
    queued: usize,
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
    /// the writer's last write, see [`Gate::close`]). `socket`: the gate's.
    fn unload(&mut self, socket: Option<&Arc<dyn Wire>>) -> bool {
        if self.cork.is_empty() {
            return true;
        }
        let done = socket.map_or(0, |s| write_now(s, &self.cork, &[]));
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
    fn lock(&self) -> GateGuard<'_> {
        GateGuard { state: self.state.lock().unwrap_or_else(|p| p.into_inner()), ahead: &self.ahead }
    }

    /// Let senders write to `socket` themselves (the one the writer task writes to). A
    /// connection's writer writes to one thing all its life: a second call changes nothing.
    pub(crate) fn open(&self, socket: Arc<dyn Wire>) {
        let _ = self.socket.set(socket);
    }

    /// The writer task wrote (or gave up on) `n` queued frames.
    pub(crate) fn written(&self, n: usize) {
        let mut g = self.lock();
        g.queued = g.queued.saturating_sub(n);
    }

    /// Write what is held back (see [`Corks::flush`]).
    pub(super) fn flush(&self) {
        let mut g = self.lock();
        g.listed = false;
        g.unload(self.socket.get());
    }

    /// The writer task is done with its queue (every sender is gone, so nothing is held back
    /// after this): the bytes still held back, for its last write.
    pub(crate) fn close(&self) -> Vec<u8> {
        std::mem::take(&mut self.lock().cork)
    }
}

impl LaneTx {
    /// Write `out` now, hold it back, or queue it, as `mode` allows (see [`SendMode`]).
    pub(crate) fn send(&self, out: Outbound, mode: SendMode) -> Sent {
        let Outbound { header, payload, written, .. } = out;
        // Only small frames are written by the sender here (see [`DIRECT_LIMIT`]).
        let mode = SendMode { direct: mode.direct && payload.len() <= DIRECT_LIMIT, ..mode };
        self.send_slice(header, &payload, || written, mode, |rest| payload.slice(payload.len() - rest.len()..))
    }

    /// Write `frame` (a whole frame's bytes, header first) now and whole, where `mode` lets the
    /// sender write, nothing is queued or held back ahead of it, and the connection's wire takes
    /// all of it at once ([`Wire::try_write_whole`]): true if it went. False leaves nothing
    /// written, for [`LaneTx::send_slice`] to send it as it sends any frame. A small frame's
    /// shortest way out: no lock of the gate ([`Gate::ahead`]), no vector of slices, no partial
    /// write to queue.
    pub(crate) fn try_write_whole(&self, frame: &[u8], mode: &SendMode) -> bool {
        if !mode.direct || mode.cork.is_some() {
            return false;
        }
        self.gate.ahead.load(Ordering::Acquire) == 0
            && !self.tx.is_closed()
            && self.gate.socket.get().is_some_and(|socket| socket.try_write_whole(frame))
    }

    /// Send `header` and `payload` as `mode` allows, if nothing is queued ahead of them: held
    /// back if `mode.cork` and the connection's held-back bytes stay within [`CORK_LIMIT`], else
    /// written now if `mode.direct` (straight from the caller's memory, after what was held
    /// back); queue what is left (or everything) as `own` makes it: an owned copy of the bytes
    /// it is given. `written` is asked for only when the frame is queued: a frame written or
    /// held back here is never reported written.
    pub(crate) fn send_slice(
        &self,
        header: FrameHeader,
        payload: &[u8],
        written: impl FnOnce() -> Option<Written>,
        mode: SendMode,
        own: impl FnOnce(&[u8]) -> Bytes,
    ) -> Sent {
        let mut g = self.gate.lock();
        let head = header.encode();
        if let Some(corks) = &mode.cork
            && g.queued == 0
            && !self.tx.is_closed()
            && self.gate.socket.get().is_some()
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
        if !g.unload(self.gate.socket.get()) {
            return Sent::Gone;
        }
        let mut done = 0;
        if mode.direct
            && g.queued == 0
            && !self.tx.is_closed()
            && let Some(socket) = self.gate.socket.get()
        {
            done = write_now(socket, &head, payload);
            if done == HEADER_LEN + payload.len() {
                return Sent::Written;
            }
        }
        let skip = done.min(HEADER_LEN);
        let rest = own(&payload[done - skip..]);
        if self.tx.send(Outbound { header, payload: rest, written: written(), skip }).is_err() {
            return Sent::Gone;
        }
        g.queued += 1;
        Sent::Queued
    }
}

/// Where a sending thread may write a frame itself: whatever the connection's writer task
/// writes to, written without blocking.
pub(crate) trait Wire: Send + Sync + std::fmt::Debug {
    /// Write as much of `bufs` as fits now (0, or `WouldBlock`, when nothing does).
    fn try_write(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize>;

    /// Write all of `frame` now, or nothing: true if it went. A wire that cannot promise one or
    /// the other (a socket may take part of a write) writes nothing and says false.
    fn try_write_whole(&self, frame: &[u8]) -> bool {
        let _ = frame;
        false
    }
}

impl Wire for std::net::TcpStream {
    /// The socket must be non-blocking.
    fn try_write(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
}

/// Write as much of `head` then `payload` as `socket` takes now; the count. A failure stops it
/// like a full socket: the writer task meets it again and reports it.
fn write_now(socket: &Arc<dyn Wire>, head: &[u8], payload: &[u8]) -> usize {
    let total = head.len() + payload.len();
    let mut done = 0;
    while done < total {
        let (h, p) =
            if done < head.len() { (&head[done..], payload) } else { (&[][..], &payload[done - head.len()..]) };
        match socket.try_write(&[io::IoSlice::new(h), io::IoSlice::new(p)]) {
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

#[cfg(test)]
mod tests {
    use cohort_core::work::{GroupId, Rank, SeqNo};

    use super::super::test_util::{data, expect_in_order, fast_lane};
    use super::*;
    use crate::tcp::tunables::STAGING;

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

    /// A wire that takes whole writes while `open`, and keeps what it took.
    #[derive(Debug, Default)]
    struct Whole {
        open: std::sync::atomic::AtomicBool,
        took: Mutex<Vec<Vec<u8>>>,
    }

    impl Wire for Whole {
        fn try_write(&self, _: &[io::IoSlice<'_>]) -> io::Result<usize> {
            Ok(0)
        }

        fn try_write_whole(&self, frame: &[u8]) -> bool {
            let open = self.open.load(std::sync::atomic::Ordering::Relaxed);
            if open {
                self.took.lock().unwrap().push(frame.to_vec());
            }
            open
        }
    }

    #[test]
    fn a_whole_frame_is_written_at_once_only_where_nothing_is_ahead_of_it_and_the_wire_takes_it() {
        let (tx, mut rx) = lane();
        let wire = Arc::new(Whole::default());
        let bytes = |i: u8| vec![i; 44];
        assert!(!tx.try_write_whole(&bytes(0), &SendMode::DIRECT), "no wire to write to yet");
        tx.gate.open(wire.clone());
        assert!(!tx.try_write_whole(&bytes(1), &SendMode::DIRECT), "the wire refuses");
        wire.open.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(tx.try_write_whole(&bytes(2), &SendMode::DIRECT));
        assert!(!tx.try_write_whole(&bytes(3), &SendMode::QUEUE), "the mode does not let the sender write");
        // A frame queued for the writer task: nothing is written past it until it is written.
        assert_eq!(tx.send(frame(FrameKind::Data, 16), SendMode::QUEUE), Sent::Queued);
        assert!(!tx.try_write_whole(&bytes(4), &SendMode::DIRECT), "a frame is queued ahead");
        assert!(rx.rx.try_recv().is_ok());
        rx.gate.written(1);
        assert!(tx.try_write_whole(&bytes(5), &SendMode::DIRECT));
        // Bytes held back go first: the frame takes the usual way behind them.
        tx.gate.lock().cork.extend_from_slice(&bytes(6));
        assert!(!tx.try_write_whole(&bytes(7), &SendMode::DIRECT), "bytes are held back ahead");
        tx.gate.lock().cork.clear();
        drop(rx);
        assert!(!tx.try_write_whole(&bytes(8), &SendMode::DIRECT), "the writer task is gone");
        assert_eq!(*wire.took.lock().unwrap(), vec![bytes(2), bytes(5)]);
    }

    /// A wire that takes every whole write, and keeps the number each frame starts with.
    #[derive(Debug, Default)]
    struct Numbered(Mutex<Vec<u32>>);

    impl Numbered {
        fn took(&self, bytes: &[u8]) {
            let n = u32::from_le_bytes(bytes[..4].try_into().expect("a numbered frame"));
            self.0.lock().unwrap().push(n);
        }
    }

    impl Wire for Numbered {
        fn try_write(&self, _: &[io::IoSlice<'_>]) -> io::Result<usize> {
            Ok(0)
        }

        fn try_write_whole(&self, frame: &[u8]) -> bool {
            self.took(frame);
            true
        }
    }

    #[test]
    fn whole_writes_that_skip_the_gates_lock_never_pass_a_frame_queued_before_them() {
        // One thread sends numbered frames, some through the writer's queue and the rest
        // written whole where nothing is ahead (else queued, as the driver does); another is
        // the writer task, which writes what is queued to the same wire, then says so. The wire
        // must see them in the order sent.
        const FRAMES: u32 = 20_000;
        let (tx, mut rx) = lane();
        let wire = Arc::new(Numbered::default());
        tx.gate.open(wire.clone());
        let numbered = |n: u32| {
            let header = FrameHeader::data(GroupId(0), SeqNo(u64::from(n)), 0, Rank(0), 4);
            Outbound::new(header, Bytes::copy_from_slice(&n.to_le_bytes()), None)
        };
        let writer = {
            let wire = wire.clone();
            std::thread::spawn(move || {
                while let Some(out) = rx.rx.blocking_recv() {
                    wire.took(&out.payload);
                    rx.gate.written(1);
                }
            })
        };
        let mut whole = 0;
        for n in 0..FRAMES {
            if n % 6 == 1 {
                // Now and then the writer catches up first, so that some frames surely go whole
                // however the threads are scheduled; the others race it.
                while tx.gate.ahead.load(Ordering::Acquire) != 0 {
                    std::thread::yield_now();
                }
            }
            if n % 3 == 0 || !tx.try_write_whole(&n.to_le_bytes(), &SendMode::DIRECT) {
                assert_eq!(tx.send(numbered(n), SendMode::QUEUE), Sent::Queued);
            } else {
                whole += 1;
            }
        }
        drop(tx);
        writer.join().unwrap();
        let took = wire.0.lock().unwrap();
        assert_eq!(took.len(), FRAMES as usize);
        assert!(took.iter().copied().eq(0..FRAMES), "frames out of order");
        assert!(whole > 0, "some frames went whole (the test would prove nothing otherwise)");
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
}
