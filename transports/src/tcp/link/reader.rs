//! The receive side of a connection: [`Assembler`], which turns whatever the reads deliver into
//! the driver's [`Inbound`] through core's sans-IO [`FrameDecoder`], and [`run_reader`], the
//! reader task that drives it from an async stream.
//!
//! Why sans-IO: the same assembler serves the reader task and, on a real socket, threads that
//! busy-poll the socket themselves (see `socket.rs`); both read into [`Assembler::read_buf`] and
//! take frames from [`Assembler::poll_frame`]. A large payload is read straight into a pooled
//! buffer of its own, never copied out of the staging buffer.

use std::collections::TryReserveError;
use std::io;

use cohort_core::protocol::{Frame, FrameDecoder, FrameError, FrameHeader, FrameKind, FrameLimits, PayloadBuffers};
use cohort_core::work::Rank;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::{BufferPool, Inbound};
use crate::tcp::tunables::STAGING;

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

/// One connection's frames, as the driver wants them: core's [`FrameDecoder`] (the decoder the
/// fuzzers drive) reading into pooled payload buffers and checking every frame's sender
/// against the connection's peer, with a goodbye or a malformed frame turned into the
/// connection's last word (sans-IO: the caller reads into [`Assembler::read_buf`], reports
/// [`Assembler::advance`], then takes what became complete from [`Assembler::poll_frame`]).
pub(crate) struct Assembler {
    from: Rank,
    decoder: FrameDecoder<BufferPool>,
    /// A last frame (goodbye, malformed) was returned: nothing more comes.
    ended: bool,
}

impl PayloadBuffers for BufferPool {
    fn take(&mut self, len: usize) -> Result<Vec<u8>, TryReserveError> {
        BufferPool::take(self, len)
    }
}

impl Assembler {
    pub(crate) fn new(from: Rank, limits: FrameLimits, pool: BufferPool) -> Self {
        let decoder = FrameDecoder::with_buffers(limits, STAGING, pool).expect_source(from);
        Assembler { from, decoder, ended: false }
    }

    /// The next complete frame, if the bytes read so far hold one. `Err` is the connection's
    /// last word (a goodbye, or a malformed frame): nothing more comes after it.
    pub(crate) fn poll_frame(&mut self) -> Option<Result<Inbound, Inbound>> {
        if self.ended {
            return None;
        }
        let from = self.from;
        match self.decoder.poll_frame()? {
            Ok(Frame { header, .. }) if header.kind == FrameKind::Goodbye => {
                Some(self.last(format!("rank {from} closed the connection"), true))
            }
            Ok(Frame { header, payload }) => Some(Ok(Inbound::Frame { from, header, payload })),
            Err(e) => Some(Err(self.failed(e))),
        }
    }

    /// The connection's last word for the decoder's failure `e`.
    fn failed(&mut self, e: FrameError) -> Inbound {
        let from = self.from;
        let reason = match e {
            FrameError::WrongSource { claimed, .. } => {
                format!("frame on rank {from}'s connection claims to come from rank {claimed}")
            }
            FrameError::PayloadAlloc { len, .. } => format!("cannot allocate {len} bytes for a frame from rank {from}"),
            e => format!("malformed frame from rank {from}: {e}"),
        };
        self.last(reason, false).unwrap_or_else(|last| last)
    }

    fn last(&mut self, reason: String, clean: bool) -> Result<Inbound, Inbound> {
        self.ended = true;
        Err(Inbound::Closed { from: self.from, reason, clean })
    }

    /// A whole frame at the start of `bytes`, for use in place (see core's
    /// [`FrameDecoder::peek_frame`]): its header and payload length. `Err` is the connection's
    /// last word, as from [`Assembler::poll_frame`] (only data frames are taken in place, so a
    /// goodbye never comes this way).
    pub(crate) fn peek_frame(&mut self, bytes: &[u8]) -> Option<Result<(FrameHeader, usize), Inbound>> {
        if self.ended {
            return None;
        }
        match self.decoder.peek_frame(bytes)? {
            Ok(found) => Some(Ok(found)),
            Err(e) => Some(Err(self.failed(e))),
        }
    }

    /// Whether [`Assembler::peek_frame`] may take a frame (see core's
    /// [`FrameDecoder::can_peek`]).
    pub(crate) fn can_peek(&self) -> bool {
        !self.ended && self.decoder.can_peek()
    }

    /// Hand the decoder `bytes` through its own read path (frames they complete are then
    /// polled as usual).
    pub(crate) fn handle_bytes(&mut self, bytes: &[u8]) {
        self.decoder.handle_bytes(bytes);
    }

    /// Where the next read goes (never empty). Call [`Assembler::poll_frame`] until `None`
    /// first.
    pub(crate) fn read_buf(&mut self) -> &mut [u8] {
        self.decoder.read_buf()
    }

    /// `n` bytes were read into the last [`Assembler::read_buf`].
    pub(crate) fn advance(&mut self, n: usize) {
        self.decoder.advance(n);
    }

    /// The peer whose frames these are.
    pub(crate) fn from(&self) -> Rank {
        self.from
    }

    /// What the end of the stream means here.
    pub(crate) fn eof(&self) -> Inbound {
        let between = self.decoder.is_between_frames();
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

#[cfg(test)]
mod tests {
    use cohort_core::work::Rank;

    use cohort_core::protocol::{FrameHeader, HEADER_LEN};

    use super::super::test_util::{assemble, data, reason, wire};
    use super::*;

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
}
