//! Helpers shared by the link's unit tests: frames on the wire, an assembler fed in chosen
//! reads, and a lane on a real loopback socket with its writer task.

use std::sync::Arc;

use cohort_core::protocol::{FrameHeader, FrameLimits};
use cohort_core::work::{GroupId, Rank, SeqNo};
use tokio::sync::mpsc;

use super::{Assembler, BufferPool, Inbound, LaneTx, lane, run_writer};
use crate::tcp::tunables::STAGING;

pub(super) fn data(seq: u64, len: usize, fill: u8) -> (FrameHeader, Vec<u8>) {
    (FrameHeader::data(GroupId(0), SeqNo(seq), 0, Rank(1), len as u64), vec![fill; len])
}

pub(super) fn wire(frames: &[(FrameHeader, Vec<u8>)]) -> Vec<u8> {
    frames.iter().flat_map(|(h, p)| h.encode().into_iter().chain(p.iter().copied())).collect()
}

/// Feed `bytes` to an assembler in reads of the given sizes (cycled); every frame and the
/// last word, in order.
pub(super) fn assemble(bytes: &[u8], reads: &[usize]) -> (Vec<(FrameHeader, Vec<u8>)>, Option<Inbound>) {
    let mut asm = Assembler::new(Rank(1), FrameLimits::new(1 << 30), BufferPool::default());
    let (mut frames, mut at, mut i) = (Vec::new(), 0, 0);
    loop {
        while let Some(next) = asm.poll_frame() {
            match next {
                Ok(Inbound::Frame { header, payload, .. }) => frames.push((header, payload)),
                Ok(other) => panic!("not a frame: {other:?}"),
                Err(last) => return (frames, Some(last)),
            }
        }
        if at == bytes.len() {
            return (frames, Some(asm.eof()));
        }
        let buf = asm.read_buf();
        let n = reads[i % reads.len()].clamp(1, buf.len()).min(bytes.len() - at);
        buf[..n].copy_from_slice(&bytes[at..at + n]);
        asm.advance(n);
        at += n;
        i += 1;
    }
}

pub(super) fn reason(last: Option<Inbound>) -> (String, bool) {
    match last {
        Some(Inbound::Closed { reason, clean, .. }) => (reason, clean),
        other => panic!("no close: {other:?}"),
    }
}

/// A loopback pair of real sockets, the first as tokio's.
async fn socket_pair() -> (tokio::net::TcpStream, std::net::TcpStream) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tx = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
    let (rx, _) = listener.accept().unwrap();
    (tx, rx)
}

/// A lane on a real socket with its writer task running: the lane, the peer's end, the
/// writer.
pub(super) async fn fast_lane() -> (LaneTx, std::net::TcpStream, tokio::task::JoinHandle<()>) {
    let (tx, rx) = socket_pair().await;
    let fast = Arc::new(crate::tcp::socket::take(tx).map_err(|(e, _)| e).unwrap());
    let (lane_tx, lane_rx) = lane();
    lane_rx.gate.open(fast.std());
    let (err_tx, _err_rx) = mpsc::unbounded_channel();
    let w = crate::tcp::socket::SharedWrite(fast);
    (lane_tx, rx, tokio::spawn(run_writer(Rank(1), Rank(0), w, lane_rx, err_tx)))
}

/// Read `rx` to its end while the (closed) lane's `writer` finishes: exactly `frames`, whole
/// and in order, then the goodbye.
pub(super) async fn expect_in_order(
    rx: std::net::TcpStream,
    writer: tokio::task::JoinHandle<()>,
    frames: &[(FrameHeader, Vec<u8>)],
) {
    let reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut &rx, &mut bytes).unwrap();
        bytes
    });
    writer.await.unwrap();
    let mut want = wire(frames);
    want.extend_from_slice(&FrameHeader::goodbye(Rank(1)).encode());
    let got = tokio::task::spawn_blocking(move || reader.join().unwrap()).await.unwrap();
    let (got_frames, last) = assemble(&got, &[STAGING]);
    assert_eq!(got_frames.len(), frames.len());
    assert!(got_frames == frames, "frames arrive whole and in order");
    assert!(reason(last).1, "and the goodbye last");
    assert_eq!(got, want);
}
