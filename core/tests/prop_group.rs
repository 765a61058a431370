//! The property kept forever: every submitted work reaches exactly one terminal state, works
//! finish in issue order, after the group fails or aborts every submit is refused, and the
//! flight recorder agrees with the events — for any sequence of inputs, in every
//! error-handling mode.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use cohort_core::group::{
    Collective, Completion, ControlMsg, ErrorHandling, Event, GroupConfig, GroupState, HeartbeatConfig, TensorSpec,
};
use cohort_core::{DType, EntryState, OpType, Rank, WorkId, WorkState};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Input {
    SubmitAllreduce,
    SubmitSend(u32),
    Start(usize),
    Waiting(usize, u32),
    Succeed(usize),
    Fail(usize, Option<u32>),
    PeerLost(u32),
    PeerDeparted(u32),
    PeerActivity(u32),
    RemoteError(u32),
    RemoteAbort(u32),
    Abort,
    Advance(u64),
}

fn input(world: u32) -> impl Strategy<Value = Input> {
    prop_oneof![
        4 => Just(Input::SubmitAllreduce),
        2 => (0..world).prop_map(Input::SubmitSend),
        3 => (0..16usize).prop_map(Input::Start),
        1 => (0..16usize, 0..world).prop_map(|(w, r)| Input::Waiting(w, r)),
        4 => (0..16usize).prop_map(Input::Succeed),
        1 => (0..16usize, proptest::option::of(0..world)).prop_map(|(w, r)| Input::Fail(w, r)),
        1 => (0..world).prop_map(Input::PeerLost),
        1 => (0..world).prop_map(Input::PeerDeparted),
        2 => (0..world).prop_map(Input::PeerActivity),
        1 => (0..world).prop_map(Input::RemoteError),
        1 => (0..world).prop_map(Input::RemoteAbort),
        1 => Just(Input::Abort),
        3 => (0..3_000u64).prop_map(Input::Advance),
    ]
}

fn mode() -> impl Strategy<Value = ErrorHandling> {
    prop_oneof![
        Just(ErrorHandling::NoHandling),
        Just(ErrorHandling::TearDown),
        Just(ErrorHandling::CleanUpOnly),
        Just(ErrorHandling::SkipCleanUp),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_work_ends_exactly_once_in_issue_order(
        world in 2u32..6,
        mode in mode(),
        heartbeats in any::<bool>(),
        max_in_flight in 1usize..4,
        inputs in proptest::collection::vec(input(5), 0..120),
    ) {
        let mut cfg = GroupConfig::new(world);
        cfg.error_handling = mode;
        cfg.timeout = Duration::from_millis(5_000);
        cfg.max_in_flight = max_in_flight;
        cfg.heartbeat = heartbeats.then_some(HeartbeatConfig { interval: Duration::from_millis(200), dead_after: Duration::from_millis(1_500) });
        #[allow(clippy::disallowed_methods)] // the test's one epoch
        let t0 = Instant::now();
        let me = Rank(0);
        let mut g = GroupState::new(cfg, me, t0);
        let mut now = t0;
        let mut submitted: Vec<WorkId> = Vec::new();
        let mut launched: BTreeSet<WorkId> = BTreeSet::new();
        let mut finished: Vec<WorkId> = Vec::new();
        let mut outcomes: Vec<(WorkId, WorkState, bool)> = Vec::new();
        let mut closed = false;
        let mut refused = 0usize;

        for inp in inputs {
            let pick = |i: usize| -> Option<WorkId> { (!submitted.is_empty()).then(|| submitted[i % submitted.len()]) };
            match inp {
                Input::SubmitAllreduce | Input::SubmitSend(_) => {
                    let c = match inp {
                        Input::SubmitSend(peer) => Collective::new(OpType::Send).inputs(vec![TensorSpec::new(DType::F32, &[4])]).peer(Rank(peer % world), 0),
                        _ => Collective::new(OpType::Allreduce).inputs(vec![TensorSpec::new(DType::F32, &[4])]),
                    };
                    let valid = c.validate(me, world).is_ok();
                    match g.submit(now, c) {
                        Ok(id) => {
                            prop_assert!(!closed, "a failed or aborted group accepted a submit");
                            prop_assert!(submitted.last().is_none_or(|last| *last < id));
                            submitted.push(id);
                        }
                        Err(cohort_core::group::SubmitError::GroupFailed { .. }) if valid => refused += 1,
                        Err(_) => {}
                    }
                }
                Input::Start(i) => if let Some(id) = pick(i) { g.handle_started(now, id) },
                Input::Waiting(i, r) => if let Some(id) = pick(i) { g.handle_waiting_on(now, id, &[Rank(r % world)]) },
                Input::Succeed(i) => if let Some(id) = pick(i) { g.handle_completion(now, id, Completion::Success) },
                Input::Fail(i, r) => if let Some(id) = pick(i) {
                    g.handle_completion(now, id, Completion::Failed { rank: r.map(|r| Rank(r % world)), message: "injected".into() })
                },
                Input::PeerLost(r) => g.handle_peer_lost(now, Rank(r % world), "EOF".into()),
                Input::PeerDeparted(r) => g.handle_peer_departed(now, Rank(r % world)),
                Input::PeerActivity(r) => g.handle_peer_activity(now, Rank(r % world)),
                Input::RemoteError(r) => g.handle_message(now, Rank(r % world), ControlMsg::Error { origin: Rank(r % world), blame: cohort_core::Blame::nobody(), message: "remote".into() }),
                Input::RemoteAbort(r) => g.handle_message(now, Rank(r % world), ControlMsg::Abort { reason: "remote".into() }),
                Input::Abort => g.handle_abort(now, "test".into()),
                Input::Advance(ms) => {
                    now += Duration::from_millis(ms);
                    if let Some(deadline) = g.poll_timeout()
                        && deadline <= now { g.handle_timeout(now); }
                }
            }
            while let Some(t) = g.poll_transmit() {
                prop_assert_ne!(t.to, me);
            }
            while let Some(l) = g.poll_launch() {
                prop_assert!(launched.insert(l.id), "launched twice");
            }
            while let Some(e) = g.poll_event() {
                match e {
                    Event::WorkFinished(s) => {
                        prop_assert!(s.lifecycle.state().is_terminal());
                        prop_assert_eq!(s.lifecycle.state(), s.result.terminal_state());
                        prop_assert!(!finished.contains(&s.id), "finished twice");
                        prop_assert!(finished.last().is_none_or(|last| *last < s.id), "out of issue order");
                        if s.lifecycle.state() == WorkState::Completed {
                            prop_assert!(launched.contains(&s.id), "completed without launch");
                        }
                        finished.push(s.id);
                        outcomes.push((s.id, s.lifecycle.state(), s.lifecycle.started_at().is_some()));
                    }
                    Event::GroupFailed(_) | Event::GroupAborted { .. } => closed = true,
                    _ => {}
                }
            }
            prop_assert_eq!(g.in_flight(), submitted.len() - finished.len());
        }
        // Whatever is left ends once the group is aborted.
        g.handle_abort(now, "end of test".into());
        while let Some(e) = g.poll_event() {
            if let Event::WorkFinished(s) = e {
                prop_assert!(!finished.contains(&s.id));
                finished.push(s.id);
                outcomes.push((s.id, s.lifecycle.state(), s.lifecycle.started_at().is_some()));
            }
        }
        prop_assert_eq!(finished, submitted.clone());
        prop_assert_eq!(g.in_flight(), 0);

        // The recorder saw exactly the works the events reported, each in its final state,
        // and, failed at once, every collective refused because the group had failed.
        let dump = g.dump();
        let is_refused = |e: &&cohort_core::recorder::DumpEntry| {
            e.cohort_error.as_deref().is_some_and(|m| m.contains("refused: the group had failed"))
        };
        let (refusals, entries): (Vec<_>, Vec<_>) = dump.entries.iter().partition(is_refused);
        prop_assert_eq!(refusals.len(), refused);
        prop_assert!(refusals.iter().all(|e| e.cohort_state == Some(WorkState::Failed) && e.cohort_blame.is_some()));
        prop_assert_eq!(entries.len(), submitted.len());
        for (entry, (id, state, started)) in entries.into_iter().zip(&outcomes) {
            let want = id.0;
            prop_assert_eq!(entry.op_id, want);
            prop_assert_eq!(entry.cohort_state, Some(*state));
            prop_assert!(entry.retired);
            let torch_state = match (state, started) {
                (WorkState::Completed, _) => EntryState::Completed,
                (_, true) => EntryState::Started,
                (_, false) => EntryState::Scheduled,
            };
            prop_assert_eq!(entry.state, torch_state);
        }
    }
}
