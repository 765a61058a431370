use proptest::prelude::*;

use super::model::{Op, check};
use super::*;
use crate::tensor::{DType, Tensor};
use crate::work::OpType;

fn frame(from: u32, payload: u8) -> DataFrame<u8> {
    DataFrame { from: Rank(from), step: 0, tag: 0, payload }
}

#[test]
fn a_work_completes_once_its_data_is_done_and_its_last_frame_is_written() {
    let mut p: DataPlane<&str, u8> = DataPlane::new(4);
    p.track(WorkId(1), None, "send");
    p.queued(WorkId(1), Rank(1));
    p.queued(WorkId(1), Rank(2));
    assert!(!p.data_done(WorkId(1)), "two frames are still queued");
    assert!(!p.frames_written(Rank(1), 1));
    assert_eq!(p.work_written(WorkId(1), Rank(1), None), AfterWrite::Nothing);
    assert!(!p.frames_written(Rank(2), 1));
    assert_eq!(p.work_written(WorkId(1), Rank(2), None), AfterWrite::Complete);
    assert!(!p.data_done(WorkId(1)), "complete is reported once");
    assert_eq!(p.unwritten(), 0);
    assert_eq!(p.finish(WorkId(1), None).work, Some("send"));
    assert!(p.is_empty());
}

#[test]
fn a_failed_write_fails_its_work_naming_the_peer() {
    let mut p: DataPlane<(), u8> = DataPlane::new(4);
    p.track(WorkId(1), None, ());
    p.queued(WorkId(1), Rank(3));
    p.frames_written(Rank(3), 1);
    let after = p.work_written(WorkId(1), Rank(3), Some("broken pipe"));
    assert_eq!(after, AfterWrite::Fail(Completion::Failed { rank: Some(Rank(3)), message: "broken pipe".into() }));
}

#[test]
fn a_collective_stops_at_the_send_window_and_resumes_as_its_frames_are_written() {
    let mut p: DataPlane<(), u8> = DataPlane::new(2);
    p.track(WorkId(1), None, ());
    for _ in 0..2 {
        assert!(p.window_open(WorkId(1)));
        p.queued(WorkId(1), Rank(1));
    }
    assert!(!p.window_open(WorkId(1)), "two frames queued: the window is full");
    p.frames_written(Rank(1), 1);
    assert_eq!(p.work_written(WorkId(1), Rank(1), None), AfterWrite::Resume);
    assert!(p.window_open(WorkId(1)));
}

#[test]
fn early_frames_are_held_and_handed_over_in_order_and_old_ones_are_stale() {
    let mut p: DataPlane<(), u8> = DataPlane::new(4);
    p.track(WorkId(1), None, ());
    p.track(WorkId(2), None, ());
    assert_eq!(p.route(SeqNo(2), frame(1, 20)), Route::Held);
    assert_eq!(p.route(SeqNo(1), frame(1, 10)), Route::Held);
    assert_eq!(p.route(SeqNo(1), frame(2, 11)), Route::Held);
    assert_eq!(p.held(), 3);
    let early = p.launch(SeqNo(1), WorkId(1));
    p.launched();
    assert_eq!(early.iter().map(|f| f.payload).collect::<Vec<_>>(), [10, 11]);
    assert_eq!(p.route(SeqNo(1), frame(3, 12)), Route::Feed(WorkId(1), frame(3, 12)));
    assert!(p.finish(WorkId(1), Some(SeqNo(1))).stale.is_empty(), "seq 2's frame is not stale");
    assert_eq!(p.route(SeqNo(1), frame(3, 13)), Route::Stale(13));
    // A later collective finishing first (a failed group finishes works out of order) makes
    // every older frame stale.
    assert_eq!(p.finish(WorkId(2), Some(SeqNo(3))).stale, [20]);
    assert_eq!(p.held(), 0);
}

#[test]
fn a_collective_run_outside_the_plane_makes_its_frames_and_older_ones_stale_and_keeps_newer() {
    let mut p: DataPlane<(), u8> = DataPlane::new(4);
    assert_eq!(p.route(SeqNo(1), frame(1, 10)), Route::Held);
    assert_eq!(p.route(SeqNo(2), frame(1, 20)), Route::Held);
    assert_eq!(p.route(SeqNo(3), frame(1, 30)), Route::Held);
    let mut stale = vec![7];
    p.collective_ended(SeqNo(2), &mut stale);
    assert_eq!(stale, [7, 10, 20], "added to what the caller had");
    assert_eq!(p.held(), 1);
    assert_eq!(p.route(SeqNo(2), frame(2, 21)), Route::Stale(21));
    assert_eq!(p.launch(SeqNo(3), WorkId(1)).iter().map(|f| f.payload).collect::<Vec<_>>(), [30]);
    // An older collective ending later moves nothing back.
    p.collective_ended(SeqNo(1), &mut stale);
    assert_eq!(p.route(SeqNo(2), frame(3, 22)), Route::Stale(22));
}

#[test]
fn a_different_fingerprint_is_a_mismatch_for_the_census_not_a_failure() {
    let mut p: DataPlane<(), u8> = DataPlane::new(4);
    let mine = Fingerprint { op: OpType::Allreduce, dtype: Some(DType::F32), root: None };
    let theirs = Fingerprint { op: OpType::Broadcast, dtype: Some(DType::F32), root: Some(Rank(0)) };
    p.track(WorkId(1), Some(mine), ());
    assert_eq!(p.check(WorkId(1), SeqNo(4), Rank(2), mine.to_tag()), Ok(()));
    assert_eq!(p.check(WorkId(1), SeqNo(4), Rank(2), 0), Ok(()), "an untagged frame is not judged");
    let Err(Completion::Mismatch { rank, message }) = p.check(WorkId(1), SeqNo(4), Rank(2), theirs.to_tag()) else {
        panic!("expected a mismatch");
    };
    assert_eq!(rank, Rank(2));
    assert_eq!(
        message,
        "desync at seq 4: rank 2 is running broadcast(float32, root 0) while this rank runs all_reduce(float32)"
    );
}

#[test]
fn a_goodbye_with_frames_still_queued_departs_once_they_are_written() {
    let mut p: DataPlane<(), u8> = DataPlane::new(4);
    p.track(WorkId(1), None, ());
    p.queued(WorkId(1), Rank(1));
    p.queued(WorkId(1), Rank(1));
    assert_eq!(p.peer_closed(Rank(1), "goodbye", true), PeerClosed::Deferred);
    assert_eq!(p.peer_closed(Rank(1), "goodbye", true), PeerClosed::Again);
    assert!(!p.frames_written(Rank(1), 1));
    assert!(p.frames_written(Rank(1), 1), "the last frame written: the departure is due");
    assert!(!p.frames_written(Rank(1), 0), "and due once");
    assert_eq!(p.peer_closed(Rank(2), "goodbye", true), PeerClosed::Departed);
    assert_eq!(p.peer_closed(Rank(3), "reset by peer", false), PeerClosed::Lost);
}

#[test]
fn works_waiting_on_a_closed_peer_are_stranded_except_while_fed_their_early_frames() {
    let mut p: DataPlane<(), u8> = DataPlane::new(4);
    p.track(WorkId(1), None, ());
    p.peer_closed(Rank(2), "goodbye", true);
    assert_eq!(p.stranded(&[Rank(1)]), None);
    let _ = p.launch(SeqNo(1), WorkId(1));
    assert_eq!(p.stranded(&[Rank(1), Rank(2)]), None, "its early frames may be all it needs");
    p.launched();
    let Some(Completion::Failed { rank, message }) = p.stranded(&[Rank(1), Rank(2)]) else { panic!() };
    assert_eq!(rank, Some(Rank(2)));
    assert_eq!(message, "rank 2 is gone before sending its part (goodbye)");
    assert_eq!(p.recv_after_close(None, 0), None, "an any-source receive is not judged");
    let Some(Completion::Failed { message, .. }) = p.recv_after_close(Some(Rank(2)), 7) else { panic!() };
    assert_eq!(message, "nothing from rank 2 with tag 7 arrived before: goodbye");
}

#[test]
fn a_recv_of_the_wrong_size_names_both_sizes_and_the_sender() {
    let t = Tensor::zeros(DType::F32, &[3]).unwrap();
    assert_eq!(check_recv(Rank(1), 12, &t), Ok(()));
    let Err(Completion::Failed { rank, message }) = check_recv(Rank(1), 8, &t) else { panic!() };
    assert_eq!(rank, Some(Rank(1)));
    assert_eq!(message, "recv from rank 1: 8 bytes arrived for a tensor of 12 bytes (3 × float32)");
}

#[test]
fn the_model_doc_example_and_a_short_history_hold() {
    let ops = [
        Op::Submit { collective: true, fingerprint: 0 },
        Op::Submit { collective: false, fingerprint: 0 },
        Op::Arrive { seq: 0, from: 1, fingerprint: 1 },
        Op::Send { work: 1, to: 2 },
        Op::Close { peer: 2, clean: true },
        Op::Launch,
        Op::Arrive { seq: 0, from: 1, fingerprint: 0 },
        Op::Write { to: 2, n: 3, fail: false },
        Op::DataDone { work: 1 },
        Op::Finish,
        Op::Arrive { seq: 0, from: 3, fingerprint: 0 },
    ];
    check(&ops, 2).unwrap();
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<bool>(), any::<u8>()).prop_map(|(collective, fingerprint)| Op::Submit { collective, fingerprint }),
        Just(Op::Launch),
        (0u8..14, any::<u8>(), any::<u8>()).prop_map(|(seq, from, fingerprint)| Op::Arrive { seq, from, fingerprint }),
        (any::<u8>(), any::<u8>()).prop_map(|(work, to)| Op::Send { work, to }),
        (any::<u8>(), 0u8..4, proptest::bool::weighted(0.1)).prop_map(|(to, n, fail)| Op::Write { to, n, fail }),
        any::<u8>().prop_map(|work| Op::DataDone { work }),
        (any::<u8>(), any::<bool>()).prop_map(|(peer, clean)| Op::Close { peer, clean }),
        Just(Op::Finish),
    ]
}

proptest! {
    /// Every answer of the data plane matches the model: works complete once, only with their
    /// data done and every frame written; the window holds; frames are fed, held, or given
    /// back, each exactly once; goodbyes wait for queued frames.
    #[test]
    fn the_data_plane_keeps_its_rules_under_any_history(
        ops in proptest::collection::vec(op(), 0..120),
        window in 1usize..5,
    ) {
        if let Err(v) = check(&ops, window) {
            prop_assert!(false, "{v}");
        }
    }
}
