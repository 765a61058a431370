//! One connection to one peer: a reader task that decodes frames and a writer task that sends
//! them. Both report to the group's driver through channels; neither makes a decision.

use std::io;

use bytes::Bytes;
use cohort_core::protocol::{FrameHeader, FrameKind, FrameLimits, HEADER_LEN};
use cohort_core::work::Rank;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

/// Payloads up to this size are copied next to their header and written with one call; larger
/// ones go out as header then payload, without a copy.
const COALESCE_LIMIT: usize = 64 * 1024;

/// Large frame buffers for reuse: receiving or sending a chunk of a big collective would
/// otherwise map fresh pages for every chunk (the allocator hands large blocks back to the
/// kernel), and page faults were the largest cost of a 64 MiB allreduce. Buffers below
/// [`BufferPool::MIN`] are not kept; at most [`BufferPool::KEEP`] are.
#[derive(Clone, Debug, Default)]
pub(crate) struct BufferPool(std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

impl BufferPool {
    /// Smallest buffer worth keeping.
    pub(crate) const MIN: usize = 64 * 1024;
    /// Most buffers kept.
    pub(crate) const KEEP: usize = 32;

    /// A buffer of `len` zero bytes, reusing a kept one when it is large enough.
    pub(crate) fn take(&self, len: usize) -> Result<Vec<u8>, std::collections::TryReserveError> {
        let mut v = self.empty(len);
        v.try_reserve_exact(len)?;
        v.resize(len, 0);
        Ok(v)
    }

    /// An empty buffer, with room for `len` bytes when a kept one has it.
    fn empty(&self, len: usize) -> Vec<u8> {
        if len < Self::MIN {
            return Vec::new();
        }
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut v = match kept.iter().position(|b| b.capacity() >= len) {
            Some(i) => kept.swap_remove(i),
            None => Vec::new(),
        };
        v.clear();
        v
    }

    /// Keep `buf` for a later [`BufferPool::take`], if it is large and there is room.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() >= Self::MIN {
            let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if kept.len() < Self::KEEP {
                kept.push(buf);
            }
        }
    }

    /// `bytes` copied into a buffer that returns to this pool once written and dropped.
    pub(crate) fn bytes(&self, bytes: &[u8]) -> Bytes {
        if bytes.len() < Self::MIN {
            return Bytes::copy_from_slice(bytes);
        }
        let mut v = self.empty(bytes.len());
        if v.try_reserve_exact(bytes.len()).is_err() {
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

/// The connections to one peer, as the driver writes to them: one queue per connection.
/// Large data frames go round robin over them; everything else (control frames, point-to-point
/// messages, small data frames) keeps to the first, so that its order holds. Data frames may
/// arrive in any order: the schedule executor places a chunk by its step and sender.
#[derive(Debug)]
pub(crate) struct Lanes {
    lanes: Vec<mpsc::UnboundedSender<Outbound>>,
    next: std::sync::atomic::AtomicUsize,
}

impl Lanes {
    pub(crate) fn new(lanes: Vec<mpsc::UnboundedSender<Outbound>>) -> Self {
        Lanes { lanes, next: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// Queue `out` on its connection; false if that connection's writer is gone.
    pub(crate) fn send(&self, out: Outbound) -> bool {
        let n = self.lanes.len();
        let lane = if n > 1 && out.header.kind == FrameKind::Data && out.payload.len() > COALESCE_LIMIT {
            self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n
        } else {
            0
        };
        self.lanes.get(lane).is_some_and(|tx| tx.send(out).is_ok())
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

/// Called once a frame is on the socket (`Ok`) or can no longer get there (`Err`).
pub(crate) type Written = Box<dyn FnOnce(Result<(), String>) + Send + Sync>;

/// A frame to send: header plus payload, and who wants to know when it is written.
pub(crate) struct Outbound {
    pub(crate) header: FrameHeader,
    pub(crate) payload: Bytes,
    pub(crate) written: Option<Written>,
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
    stream: R,
    limits: FrameLimits,
    pool: BufferPool,
    mut deliver: impl FnMut(Inbound) -> bool,
) where
    R: AsyncRead + Unpin,
{
    let mut reader = BufReader::with_capacity(256 * 1024, stream);
    let mut head = [0u8; HEADER_LEN];
    loop {
        if let Err(e) = reader.read_exact(&mut head).await {
            let reason = describe_read_error(&e, true);
            let _ = deliver(Inbound::Closed { from, reason, clean: false });
            return;
        }
        let header = match FrameHeader::decode(&head, &limits) {
            Ok(h) => h,
            Err(e) => {
                let _ = deliver(Inbound::Closed {
                    from,
                    reason: format!("malformed frame from rank {from}: {e}"),
                    clean: false,
                });
                return;
            }
        };
        if header.source != from {
            let reason = format!("frame on rank {from}'s connection claims to come from rank {}", header.source);
            let _ = deliver(Inbound::Closed { from, reason, clean: false });
            return;
        }
        // The length was checked against the frame limit by decode.
        let len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
        let mut payload = Vec::new();
        if len > 0 {
            payload = match pool.take(len) {
                Ok(v) => v,
                Err(e) => {
                    let _ = deliver(Inbound::Closed {
                        from,
                        reason: format!("cannot allocate {len} bytes for a frame from rank {from}: {e}"),
                        clean: false,
                    });
                    return;
                }
            };
            if let Err(e) = reader.read_exact(&mut payload).await {
                let reason = describe_read_error(&e, false);
                let _ = deliver(Inbound::Closed { from, reason, clean: false });
                return;
            }
        }
        if header.kind == FrameKind::Goodbye {
            let _ =
                deliver(Inbound::Closed { from, reason: format!("rank {from} closed the connection"), clean: true });
            return;
        }
        if !deliver(Inbound::Frame { from, header, payload }) {
            return; // the driver is gone
        }
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
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    errors: mpsc::UnboundedSender<Inbound>,
) where
    W: AsyncWrite + Unpin,
{
    let mut small = Vec::with_capacity(HEADER_LEN + COALESCE_LIMIT);
    let mut notify: Vec<Written> = Vec::new();
    while let Some(first) = rx.recv().await {
        // Coalesce every small frame already queued into one write.
        small.clear();
        let mut next = Some(first);
        let mut result = Ok(());
        while let Some(mut out) = next.take() {
            notify.extend(out.written.take());
            if out.payload.len() <= COALESCE_LIMIT {
                small.extend_from_slice(&out.header.encode());
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
        let outcome = result.as_ref().map(|_| ()).map_err(|e| format!("write to rank {to} failed: {e}"));
        for done in notify.drain(..) {
            done(outcome.clone());
        }
        if let Err(e) = result {
            let reason = match e.kind() {
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                    format!("connection to rank {to} broken: {e}")
                }
                _ => format!("write to rank {to} failed: {e}"),
            };
            let _ = errors.send(Inbound::Closed { from: to, reason: reason.clone(), clean: false });
            rx.close();
            while let Some(mut out) = rx.recv().await {
                if let Some(done) = out.written.take() {
                    done(Err(reason.clone()));
                }
            }
            return;
        }
    }
    // The driver closed the channel: say goodbye so the peer knows this is no crash.
    let _ = stream.write_all(&FrameHeader::goodbye(me).encode()).await;
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
}

async fn write_large<W: AsyncWrite + Unpin>(stream: &mut W, out: &Outbound) -> io::Result<()> {
    stream.write_all(&out.header.encode()).await?;
    stream.write_all(&out.payload).await
}

#[cfg(test)]
mod tests {
    use cohort_core::work::{GroupId, SeqNo};

    use super::*;

    fn frame(kind: FrameKind, len: usize) -> Outbound {
        let mut header = FrameHeader::data(GroupId(0), SeqNo(1), 0, Rank(0), len as u64);
        header.kind = kind;
        Outbound { header, payload: Bytes::from(vec![0u8; len]), written: None }
    }

    #[test]
    fn large_data_frames_go_round_robin_and_the_rest_keep_to_the_first_connection() {
        let (txs, mut rxs): (Vec<_>, Vec<_>) = (0..3).map(|_| mpsc::unbounded_channel()).unzip();
        let lanes = Lanes::new(txs);
        let big = COALESCE_LIMIT + 1;
        for _ in 0..6 {
            assert!(lanes.send(frame(FrameKind::Data, big)));
        }
        assert!(lanes.send(frame(FrameKind::Data, 16)));
        assert!(lanes.send(frame(FrameKind::P2p, big)));
        assert!(lanes.send(frame(FrameKind::Error, 8)));
        let counts: Vec<usize> = rxs.iter_mut().map(|rx| std::iter::from_fn(|| rx.try_recv().ok()).count()).collect();
        assert_eq!(counts, vec![2 + 3, 2, 2]);
        drop(rxs);
        assert!(!lanes.send(frame(FrameKind::Data, 16)), "a closed connection refuses");
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
        assert!(c.iter().all(|&x| x == 0), "zeroed again");
        pool.give(b);
        assert!(pool.0.lock().unwrap().is_empty(), "small buffers are not kept");
        // A pooled Bytes returns its buffer when the last handle drops.
        let payload = vec![3u8; BufferPool::MIN];
        let bytes = pool.bytes(&payload);
        assert_eq!(&bytes[..], &payload[..]);
        let clone = bytes.clone();
        drop(bytes);
        assert!(pool.0.lock().unwrap().is_empty());
        drop(clone);
        assert_eq!(pool.0.lock().unwrap().len(), 1);
        for _ in 0..BufferPool::KEEP + 5 {
            pool.give(vec![0; BufferPool::MIN]);
        }
        assert_eq!(pool.0.lock().unwrap().len(), BufferPool::KEEP);
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
