//! The streaming frame decoder: the one the TCP transport reads every connection with, and the
//! one the fuzzers, benches and properties drive.
//!
//! It is sans-IO and serves two ways of feeding it:
//! - **Reading into the decoder** ([`FrameDecoder::read_buf`], then [`FrameDecoder::advance`]):
//!   a connection's reads go straight into the decoder's staging buffer, or, for a large
//!   payload, straight into that payload's own buffer, so its bytes are never copied out of the
//!   staging buffer. This is how production reads, from a reader task or from a thread that
//!   busy-polls a socket.
//! - **Handing it bytes** ([`FrameDecoder::handle_bytes`]): copied in through the same read
//!   path, so the fuzzers exercise the code production runs.
//!
//! Payload buffers come from a [`PayloadBuffers`] source: fresh allocations by default, the
//! transport's buffer pool in production. A decoder made with
//! [`FrameDecoder::expect_source`] also refuses a frame whose header names another sender than
//! the connection's peer.

use std::collections::{TryReserveError, VecDeque};

use super::frame::{Frame, FrameError, FrameHeader, FrameLimits, HEADER_LEN};
use crate::work::Rank;

/// Default size of the staging buffer reads go into: 64 KiB. Payloads at least this large
/// that start a read are read straight into their own buffers.
pub const DEFAULT_STAGING: usize = 64 * 1024;

/// What the staging buffer starts at: most connections of a large job carry only heartbeats
/// and control frames, so the full size is reserved only once reads fill what there is.
const INITIAL_STAGING: usize = 1024;

/// Where a [`FrameDecoder`] gets the buffer for each payload.
pub trait PayloadBuffers {
    /// A buffer of exactly `len` bytes (its contents are overwritten), or the allocation's
    /// failure. Called once per frame, after its header passed the limits.
    fn take(&mut self, len: usize) -> Result<Vec<u8>, TryReserveError>;
}

/// Fresh zeroed buffers from the allocator: [`FrameDecoder::new`]'s source.
#[derive(Debug, Default, Clone, Copy)]
pub struct FreshBuffers;

impl PayloadBuffers for FreshBuffers {
    fn take(&mut self, len: usize) -> Result<Vec<u8>, TryReserveError> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)?;
        v.resize(len, 0);
        Ok(v)
    }
}

/// A streaming frame decoder: bytes in, whole [`Frame`]s out.
///
/// Calling contract, reading into it: drain [`FrameDecoder::poll_frame`] until `None`, read
/// into [`FrameDecoder::read_buf`] (never empty then), report the count with
/// [`FrameDecoder::advance`], and repeat. Or hand it bytes split anywhere with
/// [`FrameDecoder::handle_bytes`] and drain [`FrameDecoder::poll_frame`] after each. At end of
/// stream call [`FrameDecoder::handle_eof`] and drain once more: a frame cut short is reported.
///
/// Memory: a staging buffer (1 KiB at first, doubled each time a read fills it, up to 64 KiB
/// unless [`FrameDecoder::with_buffers`] says otherwise), at most one partial payload, and, when fed through `handle_bytes`, the frames decoded and not
/// polled yet. A payload's buffer is taken whole once its header passed the checks, so it can
/// be read into directly: at most [`FrameLimits::max_payload`] bytes, and a header announcing
/// more is refused before anything is allocated.
///
/// Failure is final: frames completed before the bad bytes are yielded first, then the error
/// exactly once, then `None` forever; later input is ignored. [`FrameDecoder::error`] keeps
/// the error for inspection.
#[derive(Debug)]
pub struct FrameDecoder<B: PayloadBuffers = FreshBuffers> {
    limits: FrameLimits,
    /// The connection's peer: a frame naming another source is refused.
    source: Option<Rank>,
    buffers: B,
    staging: Vec<u8>,
    /// The size `staging` grows to.
    max_staging: usize,
    /// The last read filled all the room `staging` had: grow it before the next.
    filled: bool,
    /// Unconsumed bytes are `staging[start..end]`.
    start: usize,
    end: usize,
    /// A frame whose header has arrived: its payload buffer and the bytes of it filled.
    partial: Option<Partial>,
    /// The last read_buf was the partial payload itself.
    direct: bool,
    /// The last payload was read (at least partly) straight into its own buffer: the next read
    /// takes only the next header, so that a large payload after it is read straight into its
    /// buffer too rather than partly into the staging buffer and copied from there.
    after_large: bool,
    /// Frames decoded by `handle_bytes` (to make room for its bytes) and not polled yet.
    ready: VecDeque<Frame>,
    eof: bool,
    failure: Option<Failure>,
}

#[derive(Debug)]
struct Partial {
    header: FrameHeader,
    payload: Vec<u8>,
    got: usize,
}

#[derive(Debug)]
struct Failure {
    error: FrameError,
    reported: bool,
}

impl FrameDecoder<FreshBuffers> {
    /// A decoder that accepts frames within `limits`, from any source, into fresh buffers.
    pub fn new(limits: FrameLimits) -> Self {
        FrameDecoder::with_buffers(limits, DEFAULT_STAGING, FreshBuffers)
    }
}

impl<B: PayloadBuffers> FrameDecoder<B> {
    /// A decoder whose staging buffer grows to `staging` bytes (at least [`HEADER_LEN`]) and
    /// that takes payload buffers from `buffers`.
    pub fn with_buffers(limits: FrameLimits, staging: usize, buffers: B) -> Self {
        let max_staging = staging.max(HEADER_LEN);
        FrameDecoder {
            limits,
            source: None,
            buffers,
            staging: vec![0; INITIAL_STAGING.clamp(HEADER_LEN, max_staging)],
            max_staging,
            filled: false,
            start: 0,
            end: 0,
            partial: None,
            direct: false,
            after_large: false,
            ready: VecDeque::new(),
            eof: false,
            failure: None,
        }
    }

    /// Refuse frames whose header names a source other than `peer` (the rank this connection
    /// was made with): [`FrameError::WrongSource`].
    pub fn expect_source(mut self, peer: Rank) -> Self {
        self.source = Some(peer);
        self
    }

    /// The limits this decoder enforces.
    pub fn limits(&self) -> FrameLimits {
        self.limits
    }

    /// Where the next read goes. Never empty after [`FrameDecoder::poll_frame`] returned
    /// `None`: the unconsumed bytes are then less than a header, or the rest of a payload is
    /// read straight into that payload's buffer.
    pub fn read_buf(&mut self) -> &mut [u8] {
        let buffered = self.end - self.start;
        let header_only = self.after_large && self.partial.is_none() && buffered < HEADER_LEN;
        if let Some(p) = &mut self.partial
            && buffered == 0
            && p.payload.len() - p.got >= self.max_staging
        {
            self.direct = true;
            return &mut p.payload[p.got..];
        }
        self.direct = false;
        if self.start > 0 {
            self.staging.copy_within(self.start..self.end, 0);
            self.end = buffered;
            self.start = 0;
        }
        if std::mem::take(&mut self.filled) && self.staging.len() < self.max_staging {
            let grown = (self.staging.len() * 2).min(self.max_staging);
            self.staging.resize(grown, 0);
        }
        if header_only {
            return &mut self.staging[buffered..HEADER_LEN];
        }
        &mut self.staging[self.end..]
    }

    /// `n` bytes were read into the last [`FrameDecoder::read_buf`]. Ignored after a failure
    /// or the end of the stream.
    pub fn advance(&mut self, n: usize) {
        if self.failure.is_some() || self.eof {
            return;
        }
        match &mut self.partial {
            Some(p) if self.direct => {
                p.got = (p.got + n).min(p.payload.len());
                self.after_large = true;
            }
            _ => {
                self.end = (self.end + n).min(self.staging.len());
                self.filled = self.end == self.staging.len();
            }
        }
        self.direct = false;
    }

    /// Feeds bytes received from the peer, split anywhere: they go through the same read path
    /// as [`FrameDecoder::read_buf`]. May queue frames, or an error (after which the rest of
    /// `bytes`, and every later call, is ignored). Drain [`FrameDecoder::poll_frame`] after.
    pub fn handle_bytes(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.failure.is_none() && !self.eof {
            // Decoding what is buffered first makes room, and keeps read_buf's promise.
            while let Some(next) = self.next_frame() {
                match next {
                    Ok(frame) => self.ready.push_back(frame),
                    Err(error) => {
                        self.failure = Some(Failure { error, reported: false });
                        return;
                    }
                }
            }
            let buf = self.read_buf();
            let n = buf.len().min(bytes.len());
            buf[..n].copy_from_slice(&bytes[..n]);
            self.advance(n);
            bytes = &bytes[n..];
        }
    }

    /// Tells the decoder the stream ended. Frames already whole are still yielded; then
    /// [`FrameError::TruncatedHeader`] or [`FrameError::TruncatedPayload`] if it ended inside
    /// a frame.
    pub fn handle_eof(&mut self) {
        self.eof = true;
    }

    /// The next decoded frame, or the decoder's error (once), or `None` when nothing is ready.
    pub fn poll_frame(&mut self) -> Option<Result<Frame, FrameError>> {
        if let Some(frame) = self.ready.pop_front() {
            return Some(Ok(frame));
        }
        if let Some(failure) = &mut self.failure {
            if failure.reported {
                return None;
            }
            failure.reported = true;
            return Some(Err(failure.error.clone()));
        }
        let next = match self.next_frame() {
            Some(next) => next,
            None if self.eof => Err(self.truncation()?),
            None => return None,
        };
        if let Err(error) = &next {
            self.failure = Some(Failure { error: error.clone(), reported: true });
        }
        Some(next)
    }

    /// The error that stopped this decoder, if one did.
    pub fn error(&self) -> Option<&FrameError> {
        self.failure.as_ref().map(|f| &f.error)
    }

    /// Whether [`FrameDecoder::peek_frame`] may take a frame: the decoder stands between
    /// frames with nothing buffered or queued, has not failed and has not seen the end.
    pub fn can_peek(&self) -> bool {
        self.failure.is_none() && !self.eof && self.ready.is_empty() && self.is_between_frames()
    }

    /// Whether the decoder stands between frames: no part of a header or payload is buffered
    /// (frames whole but not yet polled aside). True at a clean end of stream.
    pub fn is_between_frames(&self) -> bool {
        self.partial.is_none() && self.end == self.start
    }

    /// What the end of the stream cut short, if anything (after `next_frame` found nothing).
    fn truncation(&self) -> Option<FrameError> {
        match &self.partial {
            Some(p) => Some(FrameError::TruncatedPayload {
                kind: p.header.kind,
                received: p.got as u64,
                expected: p.header.payload_len,
            }),
            None if self.end > self.start => Some(FrameError::TruncatedHeader { received: self.end - self.start }),
            None => None,
        }
    }

    /// A whole frame at the start of `bytes`, decoded without copying its payload: the
    /// header, and the payload's length (the frame is the first [`HEADER_LEN`] + that many
    /// bytes of `bytes`; the payload follows the header). For a reader whose bytes already sit
    /// in memory it may use in place, such as a shared-memory ring.
    ///
    /// Only when the decoder stands between frames with nothing buffered or queued; `None`
    /// otherwise, or when `bytes` does not hold the whole frame: nothing changed, read the
    /// usual way. The header passes exactly the checks a read frame's does, and a header that
    /// fails them is this decoder's failure, as if it had been read (reported here once;
    /// [`FrameDecoder::poll_frame`] says `None` after it).
    pub fn peek_frame(&mut self, bytes: &[u8]) -> Option<Result<(FrameHeader, usize), FrameError>> {
        if !self.can_peek() {
            return None;
        }
        let head: &[u8; HEADER_LEN] = bytes.get(..HEADER_LEN)?.try_into().ok()?;
        match self.check_header(head) {
            Ok((header, len)) if bytes.len() - HEADER_LEN >= len => {
                self.after_large = false;
                Some(Ok((header, len)))
            }
            Ok(_) => None,
            Err(error) => {
                self.failure = Some(Failure { error: error.clone(), reported: true });
                Some(Err(error))
            }
        }
    }

    /// A header's checks: the frame's own (kind, limits) and the connection's source.
    fn check_header(&self, head: &[u8; HEADER_LEN]) -> Result<(FrameHeader, usize), FrameError> {
        let header = FrameHeader::decode(head, &self.limits)?;
        if let Some(expected) = self.source
            && header.source != expected
        {
            return Err(FrameError::WrongSource { expected, claimed: header.source });
        }
        let Ok(len) = usize::try_from(header.payload_len) else {
            // Only reachable where usize is narrower than the configured limit.
            return Err(FrameError::PayloadTooLarge { len: header.payload_len, limit: usize::MAX as u64 });
        };
        Ok((header, len))
    }

    /// The next frame the buffered bytes complete, if any.
    fn next_frame(&mut self) -> Option<Result<Frame, FrameError>> {
        loop {
            if let Some(p) = &mut self.partial {
                if p.got < p.payload.len() {
                    let n = (self.end - self.start).min(p.payload.len() - p.got);
                    if n == 0 {
                        return None;
                    }
                    p.payload[p.got..p.got + n].copy_from_slice(&self.staging[self.start..self.start + n]);
                    self.start += n;
                    p.got += n;
                    continue;
                }
                let Partial { header, payload, .. } = self.partial.take()?;
                return Some(Ok(Frame { header, payload }));
            }
            if self.end - self.start < HEADER_LEN {
                return None;
            }
            let mut head = [0u8; HEADER_LEN];
            head.copy_from_slice(&self.staging[self.start..self.start + HEADER_LEN]);
            self.start += HEADER_LEN;
            let (header, len) = match self.check_header(&head) {
                Ok(h) => h,
                Err(e) => return Some(Err(e)),
            };
            self.after_large = false;
            if len == 0 {
                return Some(Ok(Frame { header, payload: Vec::new() }));
            }
            match self.buffers.take(len) {
                Ok(payload) if payload.len() == len => self.partial = Some(Partial { header, payload, got: 0 }),
                Ok(_) | Err(_) => {
                    return Some(Err(FrameError::PayloadAlloc { kind: header.kind, len: header.payload_len }));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::FrameKind;
    use crate::work::{GroupId, SeqNo};

    fn data(seq: u64, len: usize, fill: u8) -> Frame {
        Frame { header: FrameHeader::data(GroupId(1), SeqNo(seq), 0, Rank(1), len as u64), payload: vec![fill; len] }
    }

    fn wire(frames: &[Frame]) -> Vec<u8> {
        frames.iter().flat_map(Frame::encode).collect()
    }

    /// Reads `bytes` into `dec` in pieces of the sizes in `reads` (cycled, each cut to what
    /// read_buf offers); the frames and the read sizes.
    fn read_all<B: PayloadBuffers>(
        dec: &mut FrameDecoder<B>,
        bytes: &[u8],
        reads: &[usize],
    ) -> (Vec<Frame>, Vec<usize>) {
        let (mut at, mut sizes, mut got) = (0, Vec::new(), Vec::new());
        let mut i = 0;
        loop {
            while let Some(next) = dec.poll_frame() {
                match next {
                    Ok(f) => got.push(f),
                    Err(_) => return (got, sizes),
                }
            }
            if at == bytes.len() {
                return (got, sizes);
            }
            let buf = dec.read_buf();
            assert!(!buf.is_empty(), "read_buf is never empty after a drain");
            let n = buf.len().min(bytes.len() - at).min(reads[i % reads.len()]);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            dec.advance(n);
            at += n;
            sizes.push(n);
            i += 1;
        }
    }

    #[test]
    fn after_a_payload_read_straight_into_its_buffer_the_next_read_takes_only_the_next_header() {
        let s = DEFAULT_STAGING;
        let frames = [data(1, s * 2, 1), data(2, s * 2, 2), data(3, 5, 3), data(4, 7, 4)];
        let mut dec = FrameDecoder::new(FrameLimits::new(1 << 30));
        let (got, sizes) = read_all(&mut dec, &wire(&frames), &[usize::MAX]);
        assert_eq!(got, frames);
        // The first read fills the (still small) staging buffer with header 1 and the start of
        // payload 1, the rest of payload 1 goes straight in; then header 2 alone, payload 2
        // straight in; then header 3 alone, and what is left (small frames) through the staging
        // buffer at once.
        let (p, i) = (s * 2, INITIAL_STAGING);
        assert_eq!(sizes, vec![i, p - (i - HEADER_LEN), HEADER_LEN, p, HEADER_LEN, 5 + HEADER_LEN + 7]);
    }

    #[test]
    fn the_staging_buffer_grows_only_while_reads_fill_it() {
        // A connection that only ever carries heartbeats keeps the small buffer.
        let beats: Vec<Frame> =
            (0..100).map(|_| Frame { header: FrameHeader::heartbeat(Rank(1)), payload: vec![] }).collect();
        let mut dec = FrameDecoder::new(FrameLimits::default());
        let (got, _) = read_all(&mut dec, &wire(&beats), &[HEADER_LEN]);
        assert_eq!(got.len(), 100);
        assert_eq!(dec.staging.len(), INITIAL_STAGING);
        // A busy one doubles it each time a read fills it, up to the limit, and no further.
        let busy: Vec<Frame> = (0..2000).map(|i| data(i, 200, 1)).collect();
        let mut dec = FrameDecoder::new(FrameLimits::default());
        let (got, sizes) = read_all(&mut dec, &wire(&busy), &[usize::MAX]);
        assert_eq!(got, busy);
        assert_eq!(dec.staging.len(), DEFAULT_STAGING);
        assert_eq!(sizes[0], INITIAL_STAGING);
        assert!(sizes.iter().all(|&n| n <= DEFAULT_STAGING), "{sizes:?}");
        assert!(sizes.iter().any(|&n| n > DEFAULT_STAGING / 2), "reads grew with the buffer: {sizes:?}");
    }

    #[test]
    fn a_frame_from_another_source_is_refused_when_the_peer_is_known() {
        let mut dec = FrameDecoder::new(FrameLimits::default()).expect_source(Rank(1));
        dec.handle_bytes(&wire(&[data(1, 3, 1)]));
        dec.handle_bytes(&FrameHeader::heartbeat(Rank(2)).encode());
        assert_eq!(dec.poll_frame(), Some(Ok(data(1, 3, 1))));
        let e = dec.poll_frame().unwrap().unwrap_err();
        assert_eq!(e, FrameError::WrongSource { expected: Rank(1), claimed: Rank(2) });
        assert_eq!(e.to_string(), "frame claims to come from rank 2 on the connection with rank 1");
        assert_eq!(dec.poll_frame(), None);
    }

    #[test]
    fn payload_buffers_come_from_the_source_once_per_frame_and_a_refusal_is_an_error() {
        #[derive(Default)]
        struct Counting(Vec<usize>, bool);
        impl PayloadBuffers for Counting {
            fn take(&mut self, len: usize) -> Result<Vec<u8>, TryReserveError> {
                self.0.push(len);
                if self.1 {
                    // An allocation that cannot succeed, to get a real TryReserveError.
                    return Vec::<u8>::new().try_reserve_exact(usize::MAX).map(|()| Vec::new());
                }
                Ok(vec![0xEE; len])
            }
        }
        let frames = [data(1, 10, 1), data(2, 0, 0), data(3, 100_000, 3)];
        let mut dec = FrameDecoder::with_buffers(FrameLimits::default(), 4096, Counting::default());
        let (got, _) = read_all(&mut dec, &wire(&frames), &[1000]);
        assert_eq!(got, frames);
        assert_eq!(dec.buffers.0, vec![10, 100_000], "one buffer per non-empty payload, of its length");

        let mut dec = FrameDecoder::with_buffers(FrameLimits::default(), 4096, Counting(Vec::new(), true));
        dec.handle_bytes(&wire(&[data(1, 10, 1)]));
        assert_eq!(dec.poll_frame(), Some(Err(FrameError::PayloadAlloc { kind: FrameKind::Data, len: 10 })));
    }

    #[test]
    fn a_header_over_the_limit_takes_no_buffer() {
        struct Never;
        impl PayloadBuffers for Never {
            fn take(&mut self, len: usize) -> Result<Vec<u8>, TryReserveError> {
                panic!("asked for {len} bytes")
            }
        }
        let mut header = FrameHeader::data(GroupId(1), SeqNo(1), 0, Rank(1), 0);
        header.payload_len = 1 << 60;
        let mut dec = FrameDecoder::with_buffers(FrameLimits::default(), 4096, Never);
        dec.handle_bytes(&header.encode());
        assert!(matches!(dec.poll_frame(), Some(Err(FrameError::PayloadTooLarge { .. }))));
    }

    #[test]
    fn frames_whole_at_the_end_of_the_stream_come_before_its_truncation() {
        let frames = [data(1, 3, 1), data(2, 4, 2)];
        let mut bytes = wire(&frames);
        bytes.extend_from_slice(&wire(&[data(3, 50, 3)])[..HEADER_LEN + 7]);
        let mut dec = FrameDecoder::new(FrameLimits::default());
        let buf = dec.read_buf();
        buf[..bytes.len()].copy_from_slice(&bytes);
        dec.advance(bytes.len());
        dec.handle_eof();
        assert_eq!(dec.poll_frame(), Some(Ok(frames[0].clone())));
        assert_eq!(dec.poll_frame(), Some(Ok(frames[1].clone())));
        let e = dec.poll_frame().unwrap().unwrap_err();
        assert_eq!(e, FrameError::TruncatedPayload { kind: FrameKind::Data, received: 7, expected: 50 });
        assert_eq!(dec.poll_frame(), None);
    }

    proptest::proptest! {
        #[test]
        fn any_split_of_the_stream_gives_the_same_frames_either_way(
            lens in proptest::collection::vec(0usize..3 * 4096, 0..6),
            reads in proptest::collection::vec(1usize..2 * 4096, 1..8),
        ) {
            let frames: Vec<_> = lens.iter().enumerate().map(|(i, &n)| data(i as u64, n, i as u8)).collect();
            let bytes = wire(&frames);
            let mut dec = FrameDecoder::with_buffers(FrameLimits::default(), 4096, FreshBuffers);
            let (got, _) = read_all(&mut dec, &bytes, &reads);
            proptest::prop_assert_eq!(&got, &frames);
            let mut dec = FrameDecoder::with_buffers(FrameLimits::default(), 4096, FreshBuffers);
            let mut fed = Vec::new();
            let mut at = 0;
            for (i, r) in reads.iter().cycle().enumerate() {
                if at == bytes.len() || i > bytes.len() + 1 {
                    break;
                }
                let n = (*r).min(bytes.len() - at);
                dec.handle_bytes(&bytes[at..at + n]);
                at += n;
                while let Some(f) = dec.poll_frame() {
                    fed.push(f.unwrap());
                }
            }
            dec.handle_eof();
            proptest::prop_assert_eq!(dec.poll_frame(), None);
            proptest::prop_assert_eq!(fed, frames);
        }

        /// A reader of a ring: the bytes arrive in pieces; whenever a whole frame is waiting at
        /// a frame boundary it is taken in place, else what waits is read the usual way.
        /// Together they give the frames that were sent, in order.
        #[test]
        fn frames_taken_in_place_and_frames_read_interleave_into_the_stream(
            lens in proptest::collection::vec(0usize..3 * 4096, 0..8),
            arrivals in proptest::collection::vec(1usize..3 * 4096, 1..8),
            reads in proptest::collection::vec(1usize..2 * 4096, 1..8),
        ) {
            let frames: Vec<_> = lens.iter().enumerate().map(|(i, &n)| data(i as u64, n, i as u8)).collect();
            let bytes = wire(&frames);
            let mut dec = FrameDecoder::with_buffers(FrameLimits::default(), 4096, FreshBuffers).expect_source(Rank(1));
            let (mut head, mut tail) = (0, 0);
            let mut got = Vec::new();
            let (mut arrive, mut read) = (arrivals.iter().cycle(), reads.iter().cycle());
            while got.len() < frames.len() {
                tail = (tail + arrive.next().unwrap()).min(bytes.len());
                loop {
                    while let Some(f) = dec.poll_frame() {
                        got.push(f.unwrap());
                    }
                    if let Some(peeked) = dec.peek_frame(&bytes[head..tail]) {
                        let (header, len) = peeked.unwrap();
                        let payload = bytes[head + HEADER_LEN..head + HEADER_LEN + len].to_vec();
                        got.push(Frame { header, payload });
                        head += HEADER_LEN + len;
                        continue;
                    }
                    if head == tail {
                        break;
                    }
                    let buf = dec.read_buf();
                    let n = buf.len().min(tail - head).min(*read.next().unwrap());
                    buf[..n].copy_from_slice(&bytes[head..head + n]);
                    dec.advance(n);
                    head += n;
                }
            }
            proptest::prop_assert_eq!(head, bytes.len());
            proptest::prop_assert!(dec.is_between_frames());
            proptest::prop_assert_eq!(got, frames);
        }
    }

    #[test]
    fn a_peeked_header_that_fails_its_checks_is_the_decoders_failure_once() {
        let mut dec = FrameDecoder::new(FrameLimits::default()).expect_source(Rank(2));
        let bytes = wire(&[data(0, 8, 1)]);
        assert_eq!(dec.peek_frame(&bytes[..HEADER_LEN - 1]), None, "not a whole header yet");
        assert_eq!(dec.peek_frame(&bytes), Some(Err(FrameError::WrongSource { expected: Rank(2), claimed: Rank(1) })));
        assert_eq!(dec.peek_frame(&bytes), None);
        dec.handle_bytes(&bytes);
        assert_eq!(dec.poll_frame(), None);
    }

    #[test]
    fn a_frame_is_peeked_only_whole_and_only_between_frames() {
        let mut dec = FrameDecoder::new(FrameLimits::default());
        let bytes = wire(&[data(0, 8, 1), data(1, 4, 2)]);
        let first = HEADER_LEN + 8;
        assert_eq!(dec.peek_frame(&bytes[..first - 1]), None, "payload cut short");
        let (header, len) = dec.peek_frame(&bytes).unwrap().unwrap();
        assert_eq!((header, len), (data(0, 8, 1).header, 8));
        // Part of the second frame read the usual way: peeking waits until it is whole.
        dec.handle_bytes(&bytes[first..first + 3]);
        assert_eq!(dec.peek_frame(&bytes[first + 3..]), None);
        dec.handle_bytes(&bytes[first + 3..]);
        assert_eq!(dec.poll_frame(), Some(Ok(data(1, 4, 2))));
        assert!(dec.is_between_frames());
    }
}
