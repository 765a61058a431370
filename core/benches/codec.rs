//! Frame codec benchmarks: header encode and decode, and the streaming decoder's throughput on
//! 64 KiB frames fed in 64 KiB reads.
//!
//! `cargo bench -p cohort-core --bench codec -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use cohort_core::protocol::{Frame, FrameDecoder, FrameHeader, FrameLimits, HEADER_LEN};
use cohort_core::{GroupId, Rank, SeqNo};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const FRAME_PAYLOAD: usize = 64 * 1024;
const FRAMES_PER_STREAM: usize = 64;
const READ_SIZE: usize = 64 * 1024;

fn header() -> FrameHeader {
    FrameHeader::data(GroupId(1), SeqNo(42), 3, Rank(5), FRAME_PAYLOAD as u64)
}

fn header_codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("frame_header");
    group.throughput(Throughput::Elements(1));
    let header = header();
    group.bench_function("encode", |b| b.iter(|| black_box(&header).encode()));
    let bytes = header.encode();
    let limits = FrameLimits::default();
    group.bench_function("decode", |b| b.iter(|| FrameHeader::decode(black_box(&bytes), &limits)));
    group.finish();
}

fn streaming_decoder(c: &mut Criterion) {
    let frames: Vec<Frame> = (0..FRAMES_PER_STREAM)
        .map(|i| {
            let mut header = header();
            header.seq = SeqNo(i as u64);
            Frame { header, payload: vec![i as u8; FRAME_PAYLOAD] }
        })
        .collect();
    let stream: Vec<u8> = frames.iter().flat_map(Frame::encode).collect();
    assert_eq!(stream.len(), FRAMES_PER_STREAM * (HEADER_LEN + FRAME_PAYLOAD));

    let mut group = c.benchmark_group("frame_decoder");
    group.throughput(Throughput::Bytes(stream.len() as u64));
    group.bench_function("64KiB_frames_64KiB_reads", |b| {
        b.iter(|| {
            let mut decoder = FrameDecoder::new(FrameLimits::default());
            let mut payload_bytes = 0;
            for read in stream.chunks(READ_SIZE) {
                decoder.handle_bytes(black_box(read));
                while let Some(frame) = decoder.poll_frame() {
                    let frame = frame.expect("the stream holds valid frames");
                    payload_bytes += frame.payload.len();
                }
            }
            assert_eq!(payload_bytes, FRAMES_PER_STREAM * FRAME_PAYLOAD);
        })
    });
    group.finish();
}

criterion_group!(benches, header_codec, streaming_decoder);
criterion_main!(benches);
