//! Held-back frames: [`Corks`] lets a thread that submits a burst of small works send them
//! all with one write per connection.
//!
//! Why: on loopback one small write costs about as much as a large one (the sender's system
//! call also runs the receiver's side of TCP), so a burst of 16 small all-reduces written one
//! frame at a time pays sixteen times what one write would. The frames are held in each
//! connection's [`Gate`] and flushed when a thread waits, when a later frame
//! cannot be held back, or when the watcher's timer fires.

use std::sync::{Arc, Mutex};

use super::Gate;
use crate::tcp::tunables::CORK_TIMEOUT;

/// A group's held-back frames ([`SendMode::cork`](super::SendMode::cork)). A thread that submits several small works
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
    pub(super) fn hold(&self, gate: Arc<Gate>) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::super::test_util::{data, expect_in_order, fast_lane, wire};
    use super::super::{Outbound, SendMode, Sent};
    use super::*;
    use crate::tcp::tunables::STAGING;

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
}
