//! Properties of the wire codecs: round trips, totality on arbitrary bytes, and streaming
//! decoding that does not care where the byte stream is split.

use cohort_core::protocol::{
    AuthNonce, FRAME_MAGIC, Frame, FrameDecoder, FrameError, FrameHeader, FrameKind, FrameLimits, HANDSHAKE_LEN,
    HANDSHAKE_MAGIC, HEADER_LEN, Handshake, HandshakeReply, MAX_MESSAGE_LEN, PROTOCOL_VERSION, RejectReason,
};
use cohort_core::{GroupId, Rank, SeqNo};
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Records the largest single allocation made on each thread, so a test can show that a
/// decoder did not allocate on a header's say-so.
struct LargestAllocation;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping only
// touches a const-initialised thread-local `Cell`, which does not allocate.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(layout.size())));
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc` is passed on as is.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// The largest single allocation `f` makes on this thread.
fn largest_allocation_in(f: impl FnOnce()) -> usize {
    LARGEST.with(|largest| largest.set(0));
    f();
    LARGEST.with(Cell::get)
}

fn kind() -> impl Strategy<Value = FrameKind> {
    prop::sample::select(FrameKind::ALL.to_vec())
}

/// Any header that decodes under the default limits.
fn valid_header() -> impl Strategy<Value = FrameHeader> {
    (kind(), any::<u8>(), any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<u64>()).prop_map(
        |(kind, flags, group, source, seq, step, tag, len)| {
            let payload_len = match kind {
                FrameKind::Heartbeat | FrameKind::Goodbye => 0,
                FrameKind::Error | FrameKind::Abort => len % (MAX_MESSAGE_LEN + 1),
                FrameKind::Data | FrameKind::P2p | FrameKind::Stuck | FrameKind::Census => {
                    len % (FrameLimits::default().max_payload + 1)
                }
            };
            FrameHeader {
                kind,
                flags,
                group: GroupId(group),
                source: Rank(source),
                seq: SeqNo(seq),
                step,
                tag,
                payload_len,
            }
        },
    )
}

/// A small valid frame: header fields arbitrary, payload short (a UTF-8 message for error and
/// abort frames).
fn small_frame() -> impl Strategy<Value = Frame> {
    (valid_header(), prop::collection::vec(any::<u8>(), 0..300), "[a-zé✓ ]{0,40}").prop_map(
        |(mut header, bytes, text)| {
            let payload = match header.kind {
                FrameKind::Heartbeat | FrameKind::Goodbye => Vec::new(),
                FrameKind::Error | FrameKind::Abort => text.into_bytes(),
                FrameKind::Data | FrameKind::P2p | FrameKind::Stuck | FrameKind::Census => bytes,
            };
            header.payload_len = payload.len() as u64;
            Frame { header, payload }
        },
    )
}

fn handshake() -> impl Strategy<Value = Handshake> {
    (
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u16>(), any::<u8>()),
        prop::option::of(any::<[u8; 32]>()),
        any::<bool>(),
    )
        .prop_map(|((group, rank, world_size, connection, connections_per_peer), token, shares_memory)| {
            Handshake {
                group: GroupId(group),
                rank: Rank(rank),
                world_size,
                connection,
                connections_per_peer,
                auth_nonce: token.map(AuthNonce),
                shares_memory,
            }
        })
}

/// Header bytes with the right magic and version, so that arbitrary bytes reach the deeper
/// checks.
fn plausible_header_bytes() -> impl Strategy<Value = [u8; HEADER_LEN]> {
    (any::<[u8; HEADER_LEN]>(), 0u8..8).prop_map(|(mut bytes, kind)| {
        bytes[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        bytes[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        bytes[6] = kind;
        bytes
    })
}

/// Splits `bytes` at the given (unsorted, possibly repeated) cut points.
fn split_at_points(bytes: &[u8], cuts: &[prop::sample::Index]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
    points.sort_unstable();
    let mut pieces = Vec::new();
    let mut start = 0;
    for point in points.into_iter().chain([bytes.len()]) {
        pieces.push(bytes[start..point].to_vec());
        start = point;
    }
    pieces
}

/// Feeds `pieces` one at a time, draining after each, then ends the stream.
fn decode_all(limits: FrameLimits, pieces: &[Vec<u8>]) -> Vec<Result<Frame, FrameError>> {
    let mut decoder = FrameDecoder::new(limits);
    let mut out = Vec::new();
    for piece in pieces {
        decoder.handle_bytes(piece);
        while let Some(item) = decoder.poll_frame() {
            out.push(item);
        }
    }
    decoder.handle_eof();
    while let Some(item) = decoder.poll_frame() {
        out.push(item);
    }
    out
}

proptest! {
    #[test]
    fn header_round_trips(header in valid_header()) {
        prop_assert_eq!(FrameHeader::decode(&header.encode(), &FrameLimits::default()), Ok(header));
    }

    #[test]
    fn handshake_round_trips(h in handshake()) {
        prop_assert_eq!(Handshake::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn reply_round_trips(code in 1u8..=8, message in "\\PC{0,200}") {
        let reason = RejectReason::from_code(code).expect("codes 1..=8 are reasons");
        let reply = HandshakeReply::Reject { reason, message };
        prop_assert_eq!(HandshakeReply::decode(&reply.encode()), Ok(reply));
    }

    #[test]
    fn header_decode_is_total_on_arbitrary_bytes(bytes in any::<[u8; HEADER_LEN]>(), max in any::<u64>()) {
        let _ = FrameHeader::decode(&bytes, &FrameLimits::new(max));
    }

    #[test]
    fn header_decode_accepts_only_what_validate_accepts(bytes in plausible_header_bytes(), max in 0u64..1 << 20) {
        let limits = FrameLimits::new(max);
        if let Ok(header) = FrameHeader::decode(&bytes, &limits) {
            prop_assert!(header.payload_len <= max);
            prop_assert_eq!(header.validate(&limits), Ok(()));
            prop_assert_eq!(header.encode(), bytes);
        }
    }

    #[test]
    fn handshake_decode_is_total_on_arbitrary_bytes(bytes in any::<[u8; HANDSHAKE_LEN]>()) {
        let _ = Handshake::decode(&bytes);
    }

    #[test]
    fn handshake_decode_of_plausible_bytes_reencodes_exactly(mut bytes in any::<[u8; HANDSHAKE_LEN]>()) {
        bytes[0..4].copy_from_slice(&HANDSHAKE_MAGIC.to_le_bytes());
        bytes[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        if let Ok(h) = Handshake::decode(&bytes) {
            prop_assert_eq!(h.encode(), bytes);
        }
    }

    #[test]
    fn reply_decode_is_total_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = HandshakeReply::decode(&bytes);
    }

    #[test]
    fn streaming_decoder_is_total_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..2048),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let out = decode_all(FrameLimits::new(4096), &split_at_points(&bytes, &cuts));
        // At most one error, and it is the last thing yielded.
        let errors = out.iter().filter(|item| item.is_err()).count();
        prop_assert!(errors <= 1);
        if errors == 1 {
            prop_assert!(out.last().is_some_and(|item| item.is_err()));
        }
    }

    #[test]
    fn streaming_decoder_is_total_on_plausible_headers_and_junk(
        header in plausible_header_bytes(),
        rest in prop::collection::vec(any::<u8>(), 0..512),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&rest);
        let out = decode_all(FrameLimits::new(300), &split_at_points(&bytes, &cuts));
        for frame in out.iter().flatten() {
            prop_assert_eq!(frame.payload.len() as u64, frame.header.payload_len);
        }
    }

    #[test]
    fn streaming_decode_of_split_valid_frames_yields_exactly_those_frames(
        frames in prop::collection::vec(small_frame(), 0..12),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..24),
    ) {
        let stream: Vec<u8> = frames.iter().flat_map(Frame::encode).collect();
        let out: Result<Vec<Frame>, FrameError> =
            decode_all(FrameLimits::default(), &split_at_points(&stream, &cuts)).into_iter().collect();
        prop_assert_eq!(out, Ok(frames.clone()));
        for frame in frames.iter().filter(|f| f.header.kind.is_message()) {
            prop_assert!(frame.text().is_ok());
        }
    }

    #[test]
    fn a_stream_cut_inside_a_frame_is_reported_at_eof(
        frame in small_frame(),
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = frame.encode();
        let cut = cut.index(bytes.len());
        let out = decode_all(FrameLimits::default(), &[bytes[..cut].to_vec()]);
        prop_assert_eq!(out.len(), usize::from(cut > 0));
        if cut > 0 {
            let truncated = matches!(
                out[0],
                Err(FrameError::TruncatedHeader { .. } | FrameError::TruncatedPayload { .. })
            );
            prop_assert!(truncated, "{:?}", out[0]);
        }
    }

    #[test]
    fn a_huge_announcement_is_refused_before_its_payload(
        mut header in valid_header(),
        kind in prop::sample::select(vec![FrameKind::Data, FrameKind::P2p]),
        extra in 0u64..1 << 20,
    ) {
        header.kind = kind;
        header.payload_len = (1u64 << 60) + extra;
        let encoded = header.encode();
        let junk = vec![0u8; 1024];
        let mut decoder = FrameDecoder::new(FrameLimits::default());
        let mut out = Vec::with_capacity(4);
        let largest = largest_allocation_in(|| {
            decoder.handle_bytes(&encoded);
            decoder.handle_bytes(&junk);
            while let Some(item) = decoder.poll_frame() {
                out.push(item);
            }
        });
        prop_assert_eq!(out, vec![Err(FrameError::PayloadTooLarge { len: header.payload_len, limit: 1 << 30 })]);
        prop_assert!(largest < 4096, "the decoder allocated {} bytes", largest);
    }
}

/// The probe behind `a_huge_announcement_is_refused_before_its_payload` does see the payload
/// buffer of a frame that is accepted.
#[test]
fn allocation_probe_sees_the_buffer_of_an_accepted_payload() {
    let header = FrameHeader::data(GroupId(0), SeqNo(1), 0, Rank(1), 1 << 20);
    let encoded = header.encode();
    let mut decoder = FrameDecoder::new(FrameLimits::default());
    let largest = largest_allocation_in(|| {
        decoder.handle_bytes(&encoded);
        assert_eq!(decoder.poll_frame(), None);
    });
    // An accepted header gets its whole payload buffer, so that the payload can be read
    // straight into it.
    assert!(largest >= 1 << 20, "largest allocation {largest}");
}
