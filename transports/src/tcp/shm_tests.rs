//! A shared-memory connection's reading side: frames used in place or copied, and a peer that
//! corrupted the ring or lied about the sender (the end-to-end tests are in
//! `transports/tests/tcp_shm.rs`).

use std::sync::Arc;

use cohort_core::protocol::{Frame, FrameHeader, FrameKind};
use cohort_core::shm::{Direction, Segment, SegmentHeader};
use cohort_core::{GroupId, Rank, SeqNo};

use super::link::{Assembler, BufferPool, CloseTally, Inbound};
use super::shm::ShmLink;
use super::socket::{FastReader, InPlace, ShmPath, ShmStep, readable};

#[test]
fn a_ring_position_the_peer_corrupted_closes_the_connection_naming_it() {
    let Pair { path, seg, mut asm, socket, _theirs } = pair();
    assert!(matches!(path.step(&mut asm, Some(&socket)), ShmStep::Empty), "nothing yet");
    // Rank 3 writes ring 1 (acceptor to creator); it claims 5,000 bytes in a 4,096-byte ring.
    seg.scribble(Direction::FromAcceptor, 0, 5000);
    match path.step(&mut asm, Some(&socket)) {
        ShmStep::End(Inbound::Closed { from, reason, clean }) => {
            assert_eq!(from, Rank(3));
            assert!(!clean);
            assert_eq!(
                reason,
                "shared ring corrupt: the writer's position 5000 is not within 4096 bytes ahead of the reader's 0 (from rank 3's shared memory)"
            );
        }
        _ => panic!("a corrupt ring must end the connection"),
    }
}

/// Our reading side of a heap segment whose peer is rank 3.
struct Pair {
    path: Arc<ShmPath>,
    seg: Segment,
    asm: Assembler,
    /// Our end of the pair's socket.
    socket: Arc<std::net::TcpStream>,
    /// The peer's end: bind it, or the peer hangs up.
    _theirs: std::net::TcpStream,
}

fn pair() -> Pair {
    let seg = Segment::in_heap(4096).unwrap();
    seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: Rank(3), group: GroupId(0) });
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let theirs = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (ours, _) = listener.accept().unwrap();
    ours.set_nonblocking(true).unwrap();
    let socket = Arc::new(ours);
    let path = ShmPath::new(&ShmLink { segment: seg.clone(), creator: true }, socket.clone());
    let asm = Assembler::new(Rank(3), cohort_core::protocol::FrameLimits::new(1 << 20), BufferPool::with_limit(0));
    Pair { path, seg, asm, socket, _theirs: theirs }
}

fn data_frame(seq: u64, payload: &[u8]) -> Vec<u8> {
    let header = FrameHeader::data(GroupId(0), SeqNo(seq), 0, Rank(3), payload.len() as u64);
    Frame { header, payload: payload.to_vec() }.encode()
}

#[test]
fn a_whole_data_frame_is_used_where_it_lies_and_anything_else_is_copied_alone() {
    let Pair { path, seg, mut asm, _theirs, .. } = pair();
    let mut peer = seg.producer(Direction::FromAcceptor);
    let heartbeat = Frame { header: FrameHeader::heartbeat(Rank(3)), payload: Vec::new() }.encode();
    let (first, second) = (data_frame(1, &[7; 100]), data_frame(2, &[9; 60]));
    peer.write([&heartbeat[..], &first[..], &second[..3]]).unwrap();
    // The heartbeat goes to the assembler alone: the data frame after it stays in the ring.
    assert!(matches!(path.in_place(&mut asm, |_, _| panic!("not a data frame")), InPlace::Copied));
    assert!(matches!(asm.poll_frame(), Some(Ok(Inbound::Frame { header, .. })) if header.kind == FrameKind::Heartbeat));
    assert!(asm.poll_frame().is_none());
    let mut seen = Vec::new();
    let fed = path.in_place(&mut asm, |h, payload| {
        seen.push((h.seq, payload.to_vec()));
        true
    });
    assert!(matches!(fed, InPlace::Fed));
    assert_eq!(seen, vec![(SeqNo(1), vec![7; 100])]);
    // Three bytes of the next frame: nothing whole yet.
    assert!(matches!(path.in_place(&mut asm, |_, _| panic!("not whole")), InPlace::No));
    peer.write([&second[3..]]).unwrap();
    // Its collective does not run (the feeder says no): copied, and polled as usual.
    assert!(matches!(path.in_place(&mut asm, |_, _| false), InPlace::Copied));
    match asm.poll_frame() {
        Some(Ok(Inbound::Frame { header, payload, .. })) => assert_eq!((header.seq, payload), (SeqNo(2), vec![9; 60])),
        _ => panic!("the copied frame comes out of the assembler"),
    }
    assert!(matches!(path.in_place(&mut asm, |_, _| panic!("empty")), InPlace::No));
}

#[test]
fn a_frame_in_place_from_another_rank_ends_the_connection() {
    let Pair { path, seg, mut asm, _theirs, .. } = pair();
    let mut peer = seg.producer(Direction::FromAcceptor);
    let header = FrameHeader::data(GroupId(0), SeqNo(1), 0, Rank(2), 4);
    peer.write([&Frame { header, payload: vec![0; 4] }.encode()[..]]).unwrap();
    match path.in_place(&mut asm, |_, _| panic!("refused before it is fed")) {
        InPlace::End(Inbound::Closed { from, reason, clean }) => {
            assert_eq!((from, clean), (Rank(3), false));
            assert_eq!(reason, "frame on rank 3's connection claims to come from rank 2");
        }
        _ => panic!("a frame naming another sender must end the connection"),
    }
    assert!(asm.poll_frame().is_none(), "nothing more after the last word");
}

/// A fast reader of a real socket from `peer` (over shared memory if `shm`), and the peer's end.
async fn fast_reader(peer: Rank, shm: bool) -> (Arc<FastReader>, std::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let theirs = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
    let (ours, _) = listener.accept().await.unwrap();
    let fast = Arc::new(super::socket::take(ours).map_err(|(e, _)| e).unwrap());
    let path = shm.then(|| {
        let seg = Segment::in_heap(4096).unwrap();
        seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: peer, group: GroupId(0) });
        ShmPath::new(&ShmLink { segment: seg, creator: true }, fast.std())
    });
    let asm = Assembler::new(peer, cohort_core::protocol::FrameLimits::new(1 << 20), BufferPool::with_limit(0));
    let tally = Arc::new(CloseTally::new(2));
    (Arc::new(FastReader::new(fast, asm, tally, !shm, path)), theirs.into_std().unwrap())
}

#[tokio::test]
async fn a_shared_memory_peers_other_connections_are_asked_about_only_with_the_shared_memory_socket() {
    use std::io::Write;
    // Rank 3 shares memory; its plain connection joins before and after the shared one, and
    // rank 5 is on TCP alone.
    let (early, mut early_end) = fast_reader(Rank(3), false).await;
    let (ring, _ring_end) = fast_reader(Rank(3), true).await;
    let (late, mut late_end) = fast_reader(Rank(3), false).await;
    let (tcp, mut tcp_end) = fast_reader(Rank(5), false).await;
    let mut readers = Vec::new();
    for r in [&early, &ring, &late, &tcp] {
        FastReader::join(&mut readers, r.clone());
    }
    for end in [&mut early_end, &mut late_end, &mut tcp_end] {
        end.write_all(b"x").unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let seldom: Vec<bool> = readable(&readers, false).collect();
    assert_eq!(seldom, [false, false, false, true], "between socket looks only rank 5's plain connection is asked");
    let all: Vec<bool> = readable(&readers, true).collect();
    assert_eq!(all, [true, false, true, true], "a socket look asks every connection");
}
