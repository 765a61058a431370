//! A shared-memory connection's reading side: frames used in place or copied, and a peer that
//! corrupted the ring or lied about the sender (the end-to-end tests are in
//! `transports/tests/tcp_shm.rs`).

use std::sync::Arc;
use std::time::Duration;

use cohort_core::protocol::{Frame, FrameHeader, FrameKind};
use cohort_core::shm::{Consumer, Direction, Segment, SegmentHeader};
use cohort_core::{GroupId, Rank, SeqNo};

use super::link::{Assembler, BufferPool, CloseTally, Inbound};
use super::shm::ShmLink;
use super::socket::{FastReader, InPlace, ShmPath, ShmStep, Waited, readable};

#[test]
fn a_ring_position_the_peer_corrupted_closes_the_connection_naming_it() {
    let Pair { path, seg, mut asm, mut ring, socket, _theirs } = pair();
    assert!(matches!(path.step(&mut asm, &mut ring, Some(&socket)), ShmStep::Empty), "nothing yet");
    // Rank 3 writes ring 1 (acceptor to creator); it claims 5,000 bytes in a 4,096-byte ring.
    seg.scribble(Direction::FromAcceptor, 0, 5000);
    match path.step(&mut asm, &mut ring, Some(&socket)) {
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
    /// The ring we read (a reader holds it with the assembler).
    ring: Consumer,
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
    let link = ShmLink { segment: seg.clone(), creator: true };
    let path = ShmPath::new(&link, socket.clone());
    let ring = seg.consumer(link.incoming());
    let asm = Assembler::new(Rank(3), cohort_core::protocol::FrameLimits::new(1 << 20), BufferPool::with_limit(0));
    Pair { path, seg, asm, ring, socket, _theirs: theirs }
}

fn data_frame(seq: u64, payload: &[u8]) -> Vec<u8> {
    let header = FrameHeader::data(GroupId(0), SeqNo(seq), 0, Rank(3), payload.len() as u64);
    Frame { header, payload: payload.to_vec() }.encode()
}

#[test]
fn a_whole_data_frame_is_used_where_it_lies_and_anything_else_is_copied_alone() {
    let Pair { path, seg, mut asm, mut ring, _theirs, .. } = pair();
    let mut peer = seg.producer(Direction::FromAcceptor);
    let heartbeat = Frame { header: FrameHeader::heartbeat(Rank(3)), payload: Vec::new() }.encode();
    let (first, second) = (data_frame(1, &[7; 100]), data_frame(2, &[9; 60]));
    peer.write([&heartbeat[..], &first[..], &second[..3]]).unwrap();
    // The heartbeat goes to the assembler alone: the data frame after it stays in the ring.
    assert!(matches!(path.in_place(&mut asm, &mut ring, |_, _| panic!("not a data frame")), InPlace::Copied));
    assert!(matches!(asm.poll_frame(), Some(Ok(Inbound::Frame { header, .. })) if header.kind == FrameKind::Heartbeat));
    assert!(asm.poll_frame().is_none());
    let mut seen = Vec::new();
    let fed = path.in_place(&mut asm, &mut ring, |h, payload| {
        seen.push((h.seq, payload.to_vec()));
        true
    });
    assert!(matches!(fed, InPlace::Fed));
    assert_eq!(seen, vec![(SeqNo(1), vec![7; 100])]);
    // Three bytes of the next frame: nothing whole yet.
    assert!(matches!(path.in_place(&mut asm, &mut ring, |_, _| panic!("not whole")), InPlace::No));
    peer.write([&second[3..]]).unwrap();
    // Its collective does not run (the feeder says no): copied, and polled as usual.
    assert!(matches!(path.in_place(&mut asm, &mut ring, |_, _| false), InPlace::Copied));
    match asm.poll_frame() {
        Some(Ok(Inbound::Frame { header, payload, .. })) => assert_eq!((header.seq, payload), (SeqNo(2), vec![9; 60])),
        _ => panic!("the copied frame comes out of the assembler"),
    }
    assert!(matches!(path.in_place(&mut asm, &mut ring, |_, _| panic!("empty")), InPlace::No));
}

#[test]
fn a_frame_in_place_from_another_rank_ends_the_connection() {
    let Pair { path, seg, mut asm, mut ring, _theirs, .. } = pair();
    let mut peer = seg.producer(Direction::FromAcceptor);
    let header = FrameHeader::data(GroupId(0), SeqNo(1), 0, Rank(2), 4);
    peer.write([&Frame { header, payload: vec![0; 4] }.encode()[..]]).unwrap();
    match path.in_place(&mut asm, &mut ring, |_, _| panic!("refused before it is fed")) {
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

/// [`fast_reader`] over shared memory, with the segment, to play the peer's side of its ring.
async fn shm_reader(peer: Rank) -> (Arc<FastReader>, Segment, std::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let theirs = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
    let (ours, _) = listener.accept().await.unwrap();
    let fast = Arc::new(super::socket::take(ours).map_err(|(e, _)| e).unwrap());
    let seg = Segment::in_heap(4096).unwrap();
    seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: peer, group: GroupId(0) });
    let path = ShmPath::new(&ShmLink { segment: seg.clone(), creator: true }, fast.std());
    let asm = Assembler::new(peer, cohort_core::protocol::FrameLimits::new(1 << 20), BufferPool::with_limit(0));
    let tally = Arc::new(CloseTally::new(2));
    (Arc::new(FastReader::new(fast, asm, tally, false, Some(path))), seg, theirs.into_std().unwrap())
}

/// Hold `reader`'s ring and wait up to `within` for a frame `take` wants; what came of it, and
/// whether it came back before the deadline.
fn wait(reader: &FastReader, within: Duration, take: impl FnMut(&FrameHeader, &[u8]) -> bool) -> (Waited, bool) {
    let mut held = reader.hold().expect("nobody else reads the ring");
    let start = std::time::Instant::now();
    let waited = held.wait_for(within, false, take, || false);
    (waited, start.elapsed() < within)
}

#[tokio::test]
async fn a_spinning_wait_that_finds_nothing_for_a_while_asks_once_whether_to_yield() {
    let (reader, seg, _theirs) = shm_reader(Rank(3)).await;
    let asked = std::cell::Cell::new(0);
    let ask = |answer: bool| {
        let asked = &asked;
        move || {
            asked.set(asked.get() + 1);
            answer
        }
    };
    // Nothing comes: asked once, after the check's delay, whatever the answer; a wait that
    // yields from the start is not asked.
    for (yields, answer, want) in [(false, false, 1), (false, true, 1), (true, true, 0)] {
        asked.set(0);
        let mut held = reader.hold().unwrap();
        let start = std::time::Instant::now();
        let waited = held.wait_for(Duration::from_millis(20), yields, |_, _| false, ask(answer));
        assert!(matches!(waited, Waited::Late));
        assert!(start.elapsed() >= super::socket::SHARED_CORE_CHECK);
        assert_eq!(asked.get(), want, "yields {yields}, answer {answer}");
    }
    // What has come already is taken without it.
    asked.set(0);
    let mut peer = seg.producer(Direction::FromAcceptor);
    peer.write([&data_frame(7, b"abcd")[..]]).unwrap();
    let mut held = reader.hold().unwrap();
    let waited = held.wait_for(Duration::from_secs(5), false, |_, _| true, ask(true));
    assert!(matches!(waited, Waited::Took));
    assert_eq!(asked.get(), 0);
    // Where the peer says it runs, the other side reads.
    drop(held);
    assert_eq!(reader.cores(Some(2)), None, "the peer has not said");
    assert_eq!(seg.poller_core(Direction::FromAcceptor), Some(2), "this rank's core, where the peer reads it");
    seg.set_poller_core(Direction::FromCreator, Some(5));
    assert_eq!(reader.cores(None), Some(5));
    assert_eq!(seg.poller_core(Direction::FromAcceptor), None, "asleep");
}

#[tokio::test]
async fn a_held_ring_gives_a_data_frame_to_a_taker_that_wants_it_and_leaves_anything_else() {
    let (reader, seg, _theirs) = shm_reader(Rank(3)).await;
    let mut peer = seg.producer(Direction::FromAcceptor);
    let long = Duration::from_secs(5);
    // Nothing comes: the wait ends at its deadline.
    let (waited, early) = wait(&reader, Duration::from_millis(5), |_, _| panic!("nothing is there"));
    assert!(matches!(waited, Waited::Late) && !early);
    // A data frame the taker refuses stays where it lies: offered again, it is taken.
    peer.write([&data_frame(1, &[7; 100])[..]]).unwrap();
    let (waited, early) = wait(&reader, long, |h, _| {
        assert_eq!(h.seq, SeqNo(1));
        false
    });
    assert!(matches!(waited, Waited::Other) && early);
    let mut seen = Vec::new();
    let (waited, _) = wait(&reader, long, |h, payload| {
        seen.push((h.seq, payload.to_vec()));
        true
    });
    assert!(matches!(waited, Waited::Took));
    assert_eq!(seen, vec![(SeqNo(1), vec![7; 100])]);
    // Its room was released: the ring is empty again.
    let (waited, early) = wait(&reader, Duration::from_millis(5), |_, _| panic!("taken already"));
    assert!(matches!(waited, Waited::Late) && !early);
    // A heartbeat is never offered, and stays (every look finds it at once).
    let heartbeat = Frame { header: FrameHeader::heartbeat(Rank(3)), payload: Vec::new() }.encode();
    peer.write([&heartbeat[..], &data_frame(2, &[1; 8])[..]]).unwrap();
    for _ in 0..2 {
        let (waited, early) = wait(&reader, long, |_, _| panic!("not offered: a heartbeat comes first"));
        assert!(matches!(waited, Waited::Other) && early);
    }
}

#[tokio::test]
async fn a_held_ring_hands_over_a_frame_that_wraps_and_ends_on_a_lie_or_a_corrupt_position() {
    let (reader, seg, _theirs) = shm_reader(Rank(3)).await;
    let mut peer = seg.producer(Direction::FromAcceptor);
    let long = Duration::from_secs(5);
    // A scalar's frames come through the box, a line each: more of them than it has slots.
    for seq in 1..=40 {
        peer.write([&data_frame(seq, &[seq as u8; 4])[..]]).unwrap();
        let mut seen = None;
        let (waited, _) = wait(&reader, long, |h, payload| {
            seen = Some((h.seq, payload.to_vec()));
            true
        });
        assert!(matches!(waited, Waited::Took));
        assert_eq!(seen, Some((SeqNo(seq), vec![seq as u8; 4])));
    }
    // Frames too long for the box until the next one would cross the ring's end (4,096 bytes).
    let frame = data_frame(1, &[0; 12]);
    assert!(frame.len() > cohort_core::shm::BOX_BYTES);
    assert_ne!(4096 % frame.len(), 0, "a frame must straddle the end");
    let mut written = 0;
    while written + frame.len() <= 4096 {
        peer.write([&frame[..]]).unwrap();
        written += frame.len();
        let (waited, _) = wait(&reader, long, |_, _| true);
        assert!(matches!(waited, Waited::Took));
    }
    peer.write([&data_frame(2, &[0; 12])[..]]).unwrap();
    let (waited, early) = wait(&reader, long, |_, _| panic!("a wrapping frame is not offered"));
    assert!(matches!(waited, Waited::Other) && early, "left to the usual readers");

    let (reader, seg, _theirs) = shm_reader(Rank(3)).await;
    let header = FrameHeader::data(GroupId(0), SeqNo(1), 0, Rank(2), 4);
    seg.producer(Direction::FromAcceptor).write([&Frame { header, payload: vec![0; 4] }.encode()[..]]).unwrap();
    match wait(&reader, long, |_, _| panic!("refused before it is offered")).0 {
        Waited::End(Inbound::Closed { from, reason, clean }) => {
            assert_eq!((from, clean), (Rank(3), false));
            assert_eq!(reason, "frame on rank 3's connection claims to come from rank 2");
        }
        _ => panic!("a frame naming another sender must end the connection"),
    }
    assert!(reader.hold().is_none(), "after its last word the connection is not held again");

    let (reader, seg, _theirs) = shm_reader(Rank(3)).await;
    seg.scribble(Direction::FromAcceptor, 0, 5000);
    match wait(&reader, long, |_, _| panic!("nothing to offer")).0 {
        Waited::End(Inbound::Closed { from, reason, .. }) => {
            assert_eq!(from, Rank(3));
            assert!(reason.starts_with("shared ring corrupt: the writer's position 5000"), "{reason}");
        }
        _ => panic!("a corrupt ring must end the connection"),
    }
}

/// Spin until `done()`, yielding now and then: the test threads may share a core.
fn spin_until(mut done: impl FnMut() -> bool) {
    let mut k = 0u32;
    while !done() {
        k = k.wrapping_add(1);
        if k.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Both ends of a ring of 4,096 bytes.
fn ring_ends() -> (cohort_core::shm::Producer, cohort_core::shm::Consumer) {
    let seg = Segment::in_heap(4096).unwrap();
    seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: Rank(1), group: GroupId(0) });
    (seg.producer(Direction::FromCreator), seg.consumer(Direction::FromCreator))
}

/// A reader's request for a doorbell and a writer's message, raced once per message: either
/// the reader's look after its request sees the message, or the writer takes the request and
/// rings. A writer without the fence between its write and its look at the request loses some
/// of these races.
#[test]
fn a_doorbell_request_raced_with_a_message_is_never_lost() {
    let (p, c) = ring_ends();
    assert!(p.fences());
    let lost = raced_doorbells(p, c);
    assert_eq!(lost, 0, "{lost} doorbell requests were neither seen nor rung for");
}

/// The same race where this process takes part in `membarrier` (as it does wherever the kernel
/// has it): the reader runs the barrier between its request and its look, and the writer looks
/// at the request without a fence. Where the kernel lacks it, the writer keeps its fence, as
/// the transport's would.
#[test]
fn a_doorbell_request_raced_with_a_message_is_never_lost_with_the_readers_barrier_for_the_writers_fence() {
    let (mut p, mut c) = ring_ends();
    let light = super::shm::in_barriers();
    p.set_in_barriers(light);
    if light {
        c.set_sleep_barrier(super::shm::sleep_barrier);
    }
    assert_eq!(p.fences(), !light);
    let lost = raced_doorbells(p, c);
    assert_eq!(lost, 0, "{lost} doorbell requests were neither seen nor rung for (writer fences: {})", !light);
}

/// Race `c`'s doorbell requests with `p`'s messages, once per message, and count the requests
/// neither seen nor rung for (stopping at 3).
fn raced_doorbells(mut p: cohort_core::shm::Producer, mut c: cohort_core::shm::Consumer) -> u32 {
    use std::sync::atomic::{AtomicU64, Ordering};
    const N: u64 = 50_000;
    // `rung`: doorbells the writer rang; `taken`: messages whose request the writer has looked
    // for; `read`: messages the reader has.
    let (rung, taken, read) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (rung2, taken2, read2) = (rung.clone(), taken.clone(), read.clone());
    let reader = std::thread::spawn(move || {
        let mut lost = 0u32;
        let mut buf = [0u8; 8];
        for i in 1..=N {
            // A varying head start for the writer's message.
            for _ in 0..(i * 104_729 % 17) {
                std::hint::spin_loop();
            }
            // As a sleeper does: request, look, sleep until a doorbell, look again.
            loop {
                let before = rung2.load(Ordering::Acquire);
                if c.request_data().unwrap() {
                    c.cancel_data_request();
                    break;
                }
                // Not seen: the writer, once it has written message `i`, must have taken the
                // request and rung.
                spin_until(|| rung2.load(Ordering::Acquire) != before || taken2.load(Ordering::Acquire) >= i);
                if rung2.load(Ordering::Acquire) == before {
                    lost += 1;
                    c.cancel_data_request();
                    break;
                }
            }
            spin_until(|| c.read(&mut buf).unwrap() > 0);
            assert_eq!(u64::from_le_bytes(buf), i, "messages in order");
            read2.store(i, Ordering::Release);
            if lost >= 3 {
                break;
            }
        }
        lost
    });
    for i in 1..=N {
        spin_until(|| read.load(Ordering::Acquire) >= i - 1 || reader.is_finished());
        // And for the reader's request.
        for _ in 0..(i * 7919 % 13) {
            std::hint::spin_loop();
        }
        assert_eq!(p.write([&i.to_le_bytes()[..]]).unwrap(), 8);
        if p.take_data_request() {
            rung.fetch_add(1, Ordering::Release);
        }
        taken.store(i, Ordering::Release);
    }
    reader.join().unwrap()
}

/// The same race the other way round: a writer that has filled the ring asks for a doorbell
/// when room frees up, raced once per round with one read.
#[test]
fn a_space_request_raced_with_a_read_is_never_lost() {
    use std::sync::atomic::{AtomicU64, Ordering};
    const ROUNDS: u64 = 10_000;
    let (mut p, mut c) = ring_ends();
    let byte = |n: u64| (n % 251) as u8;
    // `filled`: rounds in which the writer has filled the ring; `rung`: doorbells for room;
    // `looked`: rounds in which the reader has read and looked for a request.
    let (filled, rung, looked) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (filled2, rung2, looked2) = (filled.clone(), rung.clone(), looked.clone());
    let reader = std::thread::spawn(move || {
        let mut got = 0u64;
        let mut buf = [0u8; 100];
        for r in 1..=ROUNDS {
            spin_until(|| filled2.load(Ordering::Acquire) >= r);
            // A varying head start for the writer's request.
            for _ in 0..(r * 104_729 % 41) {
                std::hint::spin_loop();
            }
            let n = c.read(&mut buf).unwrap();
            assert_eq!(n, 100, "a full ring holds more than 100 bytes");
            for (j, &b) in buf.iter().enumerate() {
                assert_eq!(b, byte(got + j as u64), "byte {}", got + j as u64);
            }
            got += 100;
            if c.take_space_request() {
                rung2.fetch_add(1, Ordering::Release);
            }
            looked2.store(r, Ordering::Release);
        }
    });
    let (mut sent, mut lost) = (0u64, 0u32);
    let mut write = |p: &mut cohort_core::shm::Producer| {
        let bytes: Vec<u8> = (sent..sent + 100).map(byte).collect();
        let n = p.write([&bytes[..]]).unwrap();
        sent += n as u64;
        n
    };
    for r in 1..=ROUNDS {
        while write(&mut p) > 0 {}
        filled.store(r, Ordering::Release);
        // And for the reader's read.
        for _ in 0..(r * 7919 % 37) {
            std::hint::spin_loop();
        }
        // As a waiting writer does: request, look, sleep until a doorbell, look again.
        loop {
            let before = rung.load(Ordering::Acquire);
            if p.request_space(100).unwrap() {
                break;
            }
            // Not seen: the reader, once it has read this round, must have taken the request
            // and rung.
            spin_until(|| rung.load(Ordering::Acquire) != before || looked.load(Ordering::Acquire) >= r);
            if rung.load(Ordering::Acquire) == before {
                lost += 1;
                break;
            }
        }
        if lost >= 3 {
            break;
        }
    }
    assert_eq!(lost, 0, "{lost} space requests were neither seen nor rung for");
    filled.store(ROUNDS, Ordering::Release);
    reader.join().unwrap();
}
