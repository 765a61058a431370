//! A shared-memory connection whose peer corrupted the ring (the end-to-end tests are in
//! `transports/tests/tcp_shm.rs`).

use std::sync::Arc;

use cohort_core::shm::{Direction, Segment, SegmentHeader};
use cohort_core::{GroupId, Rank};

use super::link::{Assembler, BufferPool, Inbound};
use super::shm::ShmLink;
use super::socket::{ShmPath, ShmStep};

#[test]
fn a_ring_position_the_peer_corrupted_closes_the_connection_naming_it() {
    let seg = Segment::in_heap(4096).unwrap();
    seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: Rank(3), group: GroupId(0) });
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let _theirs = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (ours, _) = listener.accept().unwrap();
    ours.set_nonblocking(true).unwrap();
    let socket = Arc::new(ours);
    let path = ShmPath::new(&ShmLink { segment: seg.clone(), creator: true }, socket.clone());
    let mut asm = Assembler::new(Rank(3), cohort_core::protocol::FrameLimits::new(1 << 20), BufferPool::with_limit(0));
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
