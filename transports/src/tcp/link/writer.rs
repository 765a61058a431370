//! The writer task of a connection: [`run_writer`] writes what its lane's queue holds,
//! coalescing small frames into one write, and tells each frame's hook once per batch.
//!
//! Why batches: the hook takes the group's state lock, so telling it once per write rather
//! than once per frame keeps the lock off the hot path. When the queue closes, the writer
//! sends what was held back and then a goodbye, so the peer knows the close is no crash.

use std::io;

use cohort_core::protocol::FrameHeader;
use cohort_core::work::Rank;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::{Inbound, LaneRx, OnWritten, Outbound, Written};
use crate::tcp::tunables::{COALESCE_LIMIT, WRITER_START};

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
    // Grown on demand rather than reserved up front: a job of N ranks has up to 2(N - 1)
    // connections per rank, most of which only ever carry heartbeats and small control frames,
    // so reserving the coalescing limit for each would hold tens of KiB per idle connection.
    // Once grown it keeps its capacity (at most the limit plus one frame), so a busy connection
    // pays for the growth once. It starts with room for a few small frames, allocated now, as
    // the connection starts: a runtime thread's first allocation maps fresh memory, which on a
    // host that backs memory lazily (a huge page zeroed and mapped in) takes milliseconds, and
    // at the first queued frame it would hold up the group's first collectives.
    let mut small = Vec::with_capacity(WRITER_START);
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use cohort_core::work::WorkId;
    use tokio::io::AsyncReadExt;

    use super::super::test_util::{data, expect_in_order, fast_lane};
    use super::super::{Corks, SendMode, Sent, lane};
    use super::*;
    use crate::tcp::tunables::STAGING;

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
}
