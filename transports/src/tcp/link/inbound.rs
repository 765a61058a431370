//! What a connection hands the driver ([`Inbound`]: a frame, or the connection's end) and
//! [`CloseTally`], which folds the ends of a peer's several connections into one.
//!
//! Why: with several connections per peer, the driver must hear of a crash once and at once,
//! and of a clean goodbye only when every connection has said it (frames may still be in
//! flight on the others until then).

use cohort_core::protocol::FrameHeader;
use cohort_core::work::Rank;

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

/// The [`CloseTally`] of each peer this rank has connections with, made at its first
/// connection: nothing for peers it never connects to.
pub(crate) struct Tallies {
    world_size: u32,
    by_peer: std::sync::Mutex<std::collections::BTreeMap<Rank, std::sync::Arc<CloseTally>>>,
}

impl Tallies {
    pub(crate) fn new(world_size: u32) -> Self {
        Tallies { world_size, by_peer: Default::default() }
    }

    /// `peer`'s tally (made now if it has none); `None` for a rank outside the group.
    pub(crate) fn get(&self, peer: Rank) -> Option<std::sync::Arc<CloseTally>> {
        if peer.0 >= self.world_size {
            return None;
        }
        let mut map = self.by_peer.lock().unwrap_or_else(|p| p.into_inner());
        Some(map.entry(peer).or_insert_with(|| std::sync::Arc::new(CloseTally::new(0))).clone())
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

#[cfg(test)]
mod tests {
    use super::*;

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
