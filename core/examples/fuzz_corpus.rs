//! Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/) with the production encoders:
//! the frames, handshakes, store requests and replies, and flight-recorder dumps the real
//! tests exchange. Each seed carries the small prefix its target reads first (see the target).
//!
//! `cargo run -p cohort-core --example fuzz_corpus -- fuzz/corpus`

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cohort_core::group::{Collective, Completion, GroupConfig, GroupState, TensorSpec};
use cohort_core::protocol::{AuthNonce, Frame, FrameHeader, Handshake, HandshakeError, HandshakeReply};
use cohort_core::store::{Reply, Request};
use cohort_core::{DType, GroupId, OpType, Rank, SeqNo};

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).expect("create the corpus folder");
    std::fs::write(d.join(name), bytes).expect("write a seed");
}

fn main() {
    let dir: PathBuf = std::env::args().nth(1).unwrap_or_else(|| "fuzz/corpus".into()).into();

    // Data plane: a ring allreduce's chunks, p2p, heartbeats, errors, goodbye, back to back.
    let mut stream = Vec::new();
    for step in 0..3u32 {
        let payload = vec![step as u8; 64];
        stream.extend_from_slice(&FrameHeader::data(GroupId(0), SeqNo(7), step, Rank(1), 64).encode());
        stream.extend_from_slice(&payload);
    }
    stream.extend_from_slice(&FrameHeader::p2p(GroupId(0), SeqNo(2), Rank(1), 5, 4).encode());
    stream.extend_from_slice(&[1, 2, 3, 4]);
    stream.extend_from_slice(&FrameHeader::heartbeat(Rank(1)).encode());
    stream.extend_from_slice(
        &Frame::error(GroupId(0), SeqNo(7), Rank(1), "rank 1: watchdog caught collective operation timeout").encode(),
    );
    stream.extend_from_slice(&Frame::abort(GroupId(3), Rank(1), "aborted by the user").encode());
    stream.extend_from_slice(&FrameHeader::goodbye(Rank(1)).encode());
    // frame_decode reads (piece: u16, limit: u32) first.
    let mut seed = vec![40, 0, 0, 0, 1, 0];
    seed.extend_from_slice(&stream);
    write(&dir, "frame_decode", "session", &seed);
    let mut one = vec![7, 0, 0, 0, 1, 0];
    one.extend_from_slice(&FrameHeader::heartbeat(Rank(3)).encode());
    write(&dir, "frame_decode", "heartbeat", &one);

    // Handshakes: plain, with a token, and the replies.
    let hs = Handshake {
        group: GroupId(0),
        rank: Rank(1),
        world_size: 4,
        connection: 0,
        connections_per_peer: 1,
        auth_nonce: None,
        shares_memory: false,
    };
    write(&dir, "handshake_decode", "plain", &hs.encode());
    let sharing = Handshake { shares_memory: true, ..hs };
    write(&dir, "handshake_decode", "shares_memory", &sharing.encode());
    let token = Handshake { auth_nonce: Some(AuthNonce([7; 32])), connection: 1, ..hs };
    write(&dir, "handshake_decode", "token", &token.encode());
    write(&dir, "handshake_decode", "accept", &HandshakeReply::Accept.encode());
    let wrong = HandshakeError::WorldSizeMismatch { peer_rank: Rank(1), peer: 3, ours: 4 };
    write(&dir, "handshake_decode", "reject", &HandshakeReply::reject(&wrong).encode());

    // Store: the requests a rendezvous sends (VALIDATE first, as torch's client does).
    let k = |s: &str| s.as_bytes().to_vec();
    let requests = vec![
        Request::Validate { magic: 0x3C85_F7CE },
        Request::Set { key: k("cohort/0/addr/1"), value: k("127.0.0.1:41234") },
        Request::Get { key: k("cohort/0/addr/0") },
        Request::Add { key: k("cohort/0/joined"), delta: 1 },
        Request::CompareSet { key: k("cohort/0/error"), expected: vec![], desired: k("1\nrank 1 failed") },
        Request::Check { keys: vec![k("a"), k("b")] },
        Request::Wait { keys: vec![k("cohort/0/addr/3")] },
        Request::GetNumKeys,
        Request::DeleteKey { key: k("a") },
        Request::Append { key: k("log"), value: k("x") },
        Request::MultiGet { keys: vec![k("a"), k("log")] },
        Request::MultiSet { items: vec![(k("a"), k("1")), (k("b"), k("2"))] },
        Request::CancelWait,
        Request::Ping { nonce: 42 },
    ];
    let mut session = vec![3u8]; // store_request reads a piece size first
    for r in &requests {
        r.encode(&mut session);
        let mut single = vec![200u8];
        r.encode(&mut single);
        write(&dir, "store_request", &format!("{:?}", r.query_type()).to_lowercase(), &single);
    }
    write(&dir, "store_request", "session", &session);
    let replies = [
        (0u8, Reply::Bytes(k("127.0.0.1:41234"))),
        (2, Reply::Int(4)),
        (3, Reply::Keys(vec![k("a"), k("b")])),
        (4, Reply::MultiBytes(vec![k("1"), k("2")])),
        (5, Reply::Nonce(42)),
        (6, Reply::QueuePop { len: 1, value: Some(k("x")) }),
    ];
    for (which, reply) in replies {
        let mut seed = vec![which, 2];
        reply.encode(&mut seed);
        write(&dir, "store_reply", &format!("{which}"), &seed);
    }

    // Flight recorder: a group that ran, failed and timed out, dumped as the ranks dump it.
    #[allow(clippy::disallowed_methods)] // the example's one epoch
    let t0 = Instant::now();
    let mut g = GroupState::new(GroupConfig::new(4), Rank(0), t0);
    let spec = || vec![TensorSpec::new(DType::F32, &[1024])];
    let a = g.submit(t0, Collective::new(OpType::Allreduce).inputs(spec())).expect("submit");
    let b = g.submit(t0, Collective::new(OpType::Broadcast).inputs(spec()).root(Rank(0))).expect("submit");
    let _c = g.submit(t0, Collective::new(OpType::Allreduce).inputs(spec())).expect("submit");
    while g.poll_launch().is_some() {}
    g.handle_started(t0 + Duration::from_millis(1), a);
    g.handle_completion(t0 + Duration::from_millis(2), a, Completion::Success);
    g.handle_started(t0 + Duration::from_millis(3), b);
    g.handle_timeout(t0 + Duration::from_secs(1900));
    let mut seed = vec![4u8];
    seed.extend_from_slice(g.dump().to_json().as_bytes());
    write(&dir, "recorder_load", "cohort_dump", &seed);

    // Shared memory: an offer, an answer and a segment header, each as the start of an input.
    let offer =
        cohort_core::shm::Offer { boot_id: [9; 16], nonce: 5, capacity: 1 << 22, name: "cohort-42-0abc".into() };
    write(&dir, "shm_ring", "offer", &offer.encode());
    write(&dir, "shm_ring", "answer", &cohort_core::shm::Answer::Accept.encode());
    let header = cohort_core::shm::SegmentHeader {
        nonce: 5,
        capacity: 1 << 22,
        creator: Rank(0),
        acceptor: Rank(1),
        group: GroupId(0),
    };
    write(&dir, "shm_ring", "header", &header.encode());
    println!("seed corpora written under {}", dir.display());
}
