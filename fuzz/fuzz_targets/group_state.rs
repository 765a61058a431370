//! The core `GroupState` fed arbitrary sequences of submits, messages, completions, peer
//! events, aborts and time: no panic, every work terminal exactly once and in issue order,
//! nothing accepted after the group failed, and the flight recorder agrees with the events.
#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use cohort_core::group::{
    Collective, Completion, ControlMsg, Event, GroupConfig, GroupState, HeartbeatConfig, TensorSpec,
};
use cohort_core::{DType, ErrorHandling, OpType, Rank, SeqNo, WorkId, WorkState};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Input {
    SubmitAllreduce(u8),
    SubmitSend(u8),
    SubmitRecv(u8),
    Start(u8),
    Waiting(u8, u8),
    Succeed(u8),
    Fail(u8, Option<u8>),
    PeerLost(u8),
    PeerDeparted(u8),
    PeerActivity(u8),
    RemoteError(u8, Option<u8>),
    Mismatch(u8, u8),
    /// A census vote: from, seq, and the signature's bytes (decoded as a peer's would be).
    Census(u8, u8, Vec<u8>),
    RemoteAbort(u8),
    RemoteStuck(u8, u8, Vec<u8>),
    Abort,
    Advance(u16),
}

#[derive(Debug, Arbitrary)]
struct Case {
    world: u8,
    mode: u8,
    heartbeats: bool,
    max_in_flight: u8,
    inputs: Vec<Input>,
}

fuzz_target!(|case: Case| {
    let world = u32::from(case.world % 7) + 1;
    let mut cfg = GroupConfig::new(world);
    cfg.error_handling = match case.mode % 4 {
        0 => ErrorHandling::NoHandling,
        1 => ErrorHandling::TearDown,
        2 => ErrorHandling::CleanUpOnly,
        _ => ErrorHandling::SkipCleanUp,
    };
    cfg.timeout = Duration::from_millis(5_000);
    cfg.max_in_flight = usize::from(case.max_in_flight % 4) + 1;
    cfg.heartbeat = case
        .heartbeats
        .then_some(HeartbeatConfig { interval: Duration::from_millis(200), dead_after: Duration::from_millis(1_500) });
    #[allow(clippy::disallowed_methods)]
    let t0 = Instant::now();
    let me = Rank(0);
    let mut g = GroupState::new(cfg, me, t0);
    let mut now = t0;
    let mut submitted: Vec<WorkId> = Vec::new();
    let mut finished: Vec<WorkId> = Vec::new();
    let mut outcomes: Vec<WorkState> = Vec::new();
    let mut closed = false;
    let rank = |r: u8| Rank(u32::from(r) % world);

    for inp in case.inputs.into_iter().take(400) {
        let pick = |i: u8| (!submitted.is_empty()).then(|| submitted[usize::from(i) % submitted.len()]);
        match inp {
            Input::SubmitAllreduce(n) | Input::SubmitSend(n) | Input::SubmitRecv(n) => {
                let spec = vec![TensorSpec::new(DType::F32, &[usize::from(n)])];
                let c = match inp {
                    Input::SubmitSend(_) => Collective::new(OpType::Send).inputs(spec).peer(rank(n), 0),
                    Input::SubmitRecv(_) => Collective::new(OpType::Recv).outputs(spec).peer(rank(n), 0),
                    _ => Collective::new(OpType::Allreduce).inputs(spec),
                };
                if let Ok(id) = g.submit(now, c) {
                    assert!(!closed, "a failed or aborted group accepted a submit");
                    assert!(submitted.last().is_none_or(|last| *last < id));
                    submitted.push(id);
                }
            }
            Input::Start(i) => {
                if let Some(id) = pick(i) {
                    g.handle_started(now, id)
                }
            }
            Input::Waiting(i, r) => {
                if let Some(id) = pick(i) {
                    g.handle_waiting_on(now, id, &[rank(r)])
                }
            }
            Input::Succeed(i) => {
                if let Some(id) = pick(i) {
                    g.handle_completion(now, id, Completion::Success)
                }
            }
            Input::Fail(i, r) => {
                if let Some(id) = pick(i) {
                    let failed = Completion::Failed { rank: r.map(rank), message: "injected".into() };
                    g.handle_completion(now, id, failed)
                }
            }
            Input::PeerLost(r) => g.handle_peer_lost(now, rank(r), "EOF".into()),
            Input::PeerDeparted(r) => g.handle_peer_departed(now, rank(r)),
            Input::PeerActivity(r) => g.handle_peer_activity(now, rank(r)),
            Input::RemoteError(r, c) => {
                let blame = cohort_core::Blame::from_option(c.map(rank));
                g.handle_message(now, rank(r), ControlMsg::Error { origin: rank(r), blame, message: "remote".into() })
            }
            Input::Mismatch(i, r) => {
                if let Some(id) = pick(i) {
                    g.handle_completion(now, id, Completion::Mismatch { rank: rank(r), message: "injected".into() })
                }
            }
            Input::Census(r, seq, bytes) => {
                let frame = cohort_core::protocol::decode_control(
                    cohort_core::protocol::FrameKind::Census,
                    SeqNo(u64::from(seq)),
                    &bytes,
                    world,
                );
                if let Ok(Some(msg)) = frame {
                    g.handle_message(now, rank(r), msg);
                }
            }
            Input::RemoteAbort(r) => g.handle_message(now, rank(r), ControlMsg::Abort { reason: "remote".into() }),
            Input::RemoteStuck(r, seq, on) => {
                let waiting_on = on.into_iter().map(|o| Rank(u32::from(o))).collect();
                g.handle_message(now, rank(r), ControlMsg::Stuck { seq: SeqNo(u64::from(seq)), waiting_on })
            }
            Input::Abort => g.handle_abort(now, "fuzz".into()),
            Input::Advance(ms) => {
                now += Duration::from_millis(u64::from(ms));
                if let Some(deadline) = g.poll_timeout()
                    && deadline <= now
                {
                    g.handle_timeout(now);
                }
            }
        }
        while let Some(t) = g.poll_transmit() {
            assert_ne!(t.to, me, "a transmit to itself");
        }
        while g.poll_launch().is_some() {}
        while let Some(e) = g.poll_event() {
            match e {
                Event::WorkFinished(s) => {
                    assert!(s.lifecycle.state().is_terminal());
                    assert_eq!(s.lifecycle.state(), s.result.terminal_state());
                    assert!(!finished.contains(&s.id), "finished twice");
                    assert!(finished.last().is_none_or(|last| *last < s.id), "out of issue order");
                    finished.push(s.id);
                    outcomes.push(s.lifecycle.state());
                }
                Event::GroupFailed(_) | Event::GroupAborted { .. } => closed = true,
                _ => {}
            }
        }
        assert_eq!(g.in_flight(), submitted.len() - finished.len());
    }
    g.handle_abort(now, "end".into());
    while let Some(e) = g.poll_event() {
        if let Event::WorkFinished(s) = e {
            assert!(!finished.contains(&s.id));
            finished.push(s.id);
            outcomes.push(s.lifecycle.state());
        }
    }
    assert_eq!(finished, submitted, "every submitted work ended exactly once");
    let dump = g.dump();
    // Collectives refused after the group failed are recorded too (failed at once): leave them
    // out here, and check that each carries the group's blame.
    let refused = |e: &&cohort_core::recorder::DumpEntry| {
        e.cohort_error.as_deref().is_some_and(|m| m.contains("refused: the group had failed"))
    };
    assert!(dump.entries.iter().filter(refused).all(|e| e.cohort_blame.is_some()));
    let recorded: Vec<_> = dump.entries.iter().filter(|e| !refused(e)).map(|e| (e.op_id, e.cohort_state)).collect();
    let tail = recorded.len().min(submitted.len());
    let expected: Vec<_> = submitted.iter().zip(&outcomes).map(|(id, s)| (id.0, Some(*s))).collect();
    // The ring keeps the newest entries (2000 by default: all of them here).
    assert_eq!(recorded[recorded.len() - tail..], expected[expected.len() - tail..]);
});
