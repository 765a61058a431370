//! The shared-memory segment as a hostile peer sees it: between our writes and reads the peer
//! may set any ring position, flag or word of a box slot to any value. Nothing panics or touches memory outside the
//! segment; a position that breaks the ring's invariant is an error; and as long as the peer
//! touches nothing, the bytes come out as they went in. The offer, its answer and the segment
//! header decode totally, and what decodes encodes back to the same bytes.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use cohort_core::shm::{ANSWER_LEN, Answer, Direction, HEADER_LEN, OFFER_LEN, Offer, Segment, SegmentHeader, ShmError};
use cohort_core::{GroupId, Rank};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    Write(u16),
    Read(u16),
    /// Read in place, using up to this many of the bytes seen.
    ReadInPlace(u16),
    RequestData,
    /// For a write of this many bytes.
    RequestSpace(u16),
    /// The consumer says where its waiting thread runs (`None`: it sleeps).
    PollerCore(Option<u32>),
    /// The peer scribbles: field 0 tail, 1 head, 2 want_data, 3 want_space, 4 box_head, 5
    /// poller_core, 6 sleep_barrier, of either ring.
    Scribble {
        ring: bool,
        field: u8,
        value: u64,
    },
    /// The peer scribbles on a word of either ring's box (16 slots of 8 words: the stamp and
    /// length, the position, then the bytes).
    ScribbleBox {
        ring: bool,
        word: u16,
        value: u64,
    },
}

fuzz_target!(|bytes: &[u8]| {
    if let Some(h) = bytes.first_chunk::<HEADER_LEN>()
        && let Ok(hdr) = SegmentHeader::decode(h)
    {
        assert_eq!(&hdr.encode(), h);
    }
    if let Some(fixed) = bytes.first_chunk::<OFFER_LEN>()
        && let Ok(len) = Offer::name_len(fixed)
    {
        let rest = &bytes[OFFER_LEN..];
        if let Ok(offer) = Offer::decode(fixed, &rest[..len.min(rest.len())]) {
            let again = offer.encode();
            assert_eq!(Offer::decode(again[..OFFER_LEN].try_into().unwrap(), &again[OFFER_LEN..]).unwrap(), offer);
        }
    }
    if let Some(a) = bytes.first_chunk::<ANSWER_LEN>()
        && let Ok(answer) = Answer::decode(a)
    {
        assert_eq!(&answer.encode(), a);
    }

    let mut u = Unstructured::new(bytes);
    let Ok(ops) = Vec::<Op>::arbitrary(&mut u) else { return };
    let seg = Segment::in_heap(4096).expect("a heap segment");
    seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: Rank(1), group: GroupId(0) });
    let mut p = seg.producer(Direction::FromCreator);
    // Whatever the peer writes in `sleep_barrier`, the producer looks at a request with a
    // fence or without one.
    p.set_in_barriers(true);
    let mut c = seg.consumer(Direction::FromCreator);
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    let mut scribbled = false;
    // What each ring's poller core should read (the consumer's word, unless the peer wrote it).
    let mut cores: [Option<Option<u32>>; 2] = [Some(None), Some(None)];
    let mut buf = vec![0u8; u16::MAX as usize];
    for (i, op) in ops.into_iter().enumerate() {
        match op {
            Op::Write(n) => {
                let chunk: Vec<u8> = (0..n as usize).map(|j| (i + j) as u8).collect();
                match p.write([&chunk[..]]) {
                    Ok(w) => {
                        assert!(w <= chunk.len());
                        sent.extend_from_slice(&chunk[..w]);
                    }
                    Err(e) => assert!(scribbled && matches!(e, ShmError::Corrupt(_)), "{e}"),
                }
                let _ = p.take_data_request();
            }
            Op::Read(n) => match c.read(&mut buf[..n as usize]) {
                Ok(r) => {
                    assert!(r <= n as usize);
                    got.extend_from_slice(&buf[..r]);
                    let _ = c.take_space_request();
                }
                Err(e) => assert!(scribbled && matches!(e, ShmError::Corrupt(_)), "{e}"),
            },
            Op::ReadInPlace(n) => {
                let used = c.read_in_place(|b| {
                    assert!(b.len() <= 4096, "saw {} bytes of a 4096-byte ring", b.len());
                    let k = (n as usize).min(b.len());
                    got.extend_from_slice(&b[..k]);
                    (n as usize, ())
                });
                match used {
                    Ok(()) => {
                        let _ = c.take_space_request();
                    }
                    Err(e) => assert!(scribbled && matches!(e, ShmError::Corrupt(_)), "{e}"),
                }
            }
            Op::RequestData => {
                let _ = c.request_data();
            }
            Op::RequestSpace(want) => {
                let _ = p.request_space(want as usize);
            }
            Op::PollerCore(core) => {
                seg.set_poller_core(Direction::FromCreator, core);
                cores[0] = Some(core.map(|c| c.min(u32::MAX - 1)));
            }
            Op::Scribble { ring, field, value } => {
                let dir = if ring { Direction::FromAcceptor } else { Direction::FromCreator };
                // The peer's view: its own producer/consumer over the same memory, moved by
                // whole values through the only fields the layout has.
                seg.scribble(dir, field % 7, value);
                scribbled |= !ring && matches!(field % 7, 0 | 1 | 4);
                if field % 7 == 5 {
                    cores[usize::from(ring)] = None;
                }
            }
            Op::ScribbleBox { ring, word, value } => {
                let dir = if ring { Direction::FromAcceptor } else { Direction::FromCreator };
                seg.scribble_box(dir, word, value);
                scribbled |= !ring;
            }
        }
        // Any word reads as a core or none, and the consumer's own word reads back as written:
        // nothing else touches it.
        for (k, dir) in [Direction::FromCreator, Direction::FromAcceptor].into_iter().enumerate() {
            let core = seg.poller_core(dir);
            if let Some(want) = cores[k] {
                assert_eq!(core, want, "ring {k}'s poller core");
            }
        }
        // The spinning reader's quick look reads the same memory a hostile peer writes.
        let empty = c.looks_empty();
        if !scribbled {
            assert!(got.len() <= sent.len());
            assert_eq!(got[..], sent[..got.len()], "bytes came out as they went in");
            assert_eq!(empty, c.available() == Ok(0), "the quick look says empty exactly when nothing waits");
        }
    }
});
