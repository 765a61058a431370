//! What senders hand a connection: a frame to send ([`Outbound`]) and who wants to know once
//! it is written ([`Written`], [`OnWritten`]).
//!
//! Why: a work completes only once its frames are on the socket, so each frame may carry its
//! work's id and a hook, which the writer calls once per batch it wrote together.

use bytes::Bytes;
use cohort_core::protocol::{FrameHeader, HEADER_LEN};
use cohort_core::work::Rank;

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

/// A frame to send: header plus payload, and who wants to know when it is written.
pub(crate) struct Outbound {
    pub(crate) header: FrameHeader,
    pub(crate) payload: Bytes,
    pub(crate) written: Option<Written>,
    /// Bytes of the header already written by the sender (see [`LaneTx::send_slice`](super::LaneTx::send_slice)); then
    /// `payload` holds only the part of the payload still to write.
    pub(crate) skip: usize,
}

impl Outbound {
    pub(crate) fn new(header: FrameHeader, payload: Bytes, written: Option<Written>) -> Self {
        Outbound { header, payload, written, skip: 0 }
    }

    /// Bytes of whole frames, headers included (held back, see [`Corks`](super::Corks)): nothing of
    /// `header` is left to write, and nobody is told when they are written.
    pub(super) fn bytes(frames: Bytes) -> Self {
        Outbound { header: FrameHeader::heartbeat(Rank(0)), payload: frames, written: None, skip: HEADER_LEN }
    }
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound").field("header", &self.header).field("len", &self.payload.len()).finish()
    }
}
