use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::work::OpType;

const EPOCH_NS: u64 = 1_700_000_000_000_000_000;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn recorder(capacity: usize) -> FlightRecorder {
    let mut fr = FlightRecorder::new(RecorderConfig { capacity, timing: true }, EPOCH_NS);
    fr.record_group(0, "0", "default_pg", &[0, 1]);
    fr
}

const SHAPE: &[usize] = &[2, 3];
const METAS: &[TensorMeta<'static>] = &[TensorMeta { dtype: DType::F32, shape: SHAPE }];

fn allreduce(seq: u64) -> RecordRequest<'static> {
    RecordRequest {
        pg_id: 0,
        pg_name: "0",
        pg_desc: "default_pg",
        collective_seq_id: seq,
        p2p_seq_id: 0,
        op_id: seq,
        profiling_name: "gloo:all_reduce".into(),
        inputs: METAS,
        outputs: METAS,
        timeout: ms(60_000),
        is_p2p: false,
    }
}

fn meta() -> DumpMeta {
    DumpMeta::new(Rank(1), 2)
}

fn status(fr: &FlightRecorder, pg: &str) -> PgStatus {
    fr.dump(meta()).pg_status[pg]
}

fn st(enqueued: i64, started: i64, completed: i64) -> PgStatus {
    PgStatus {
        last_enqueued_collective: enqueued,
        last_started_collective: started,
        last_completed_collective: completed,
    }
}

#[test]
fn ring_wraps_keeping_the_newest_entries_oldest_first() {
    let mut fr = recorder(3);
    for seq in 1..=5 {
        fr.record(ms(seq), &allreduce(seq)).unwrap();
    }
    assert_eq!(fr.len(), 3);
    let dump = fr.dump(meta());
    let ids: Vec<_> = dump.entries.iter().map(|e| (e.record_id, e.collective_seq_id)).collect();
    assert_eq!(ids, vec![(2, 3), (3, 4), (4, 5)]);
    assert_eq!(dump.entries[0].time_created_ns, EPOCH_NS + 3_000_000);
}

#[test]
fn transitions_on_an_overwritten_entry_are_ignored() {
    let mut fr = recorder(2);
    let old = fr.record(ms(0), &allreduce(1)).unwrap();
    let a = fr.record(ms(1), &allreduce(2)).unwrap();
    let b = fr.record(ms(2), &allreduce(3)).unwrap(); // overwrites `old`'s slot
    fr.handle_started(old, ms(3));
    fr.handle_completed(old, ms(4));
    fr.handle_finished(old, ms(4), &WorkResult::Aborted { reason: "x".into() });
    let dump = fr.dump(meta());
    assert!(dump.entries.iter().all(|e| e.state == EntryState::Scheduled && !e.retired));
    assert_eq!(dump.pg_status["0"], st(3, -1, -1));
    fr.handle_started(b, ms(5));
    fr.handle_completed(a, ms(6));
    let dump = fr.dump(meta());
    assert_eq!(dump.entries[0].state, EntryState::Completed);
    assert_eq!(dump.entries[1].state, EntryState::Started);
}

#[test]
fn recording_as_started_leaves_what_recording_then_starting_leaves() {
    // Collectives and a point-to-point op, some completed, some failed, some left running,
    // in a ring that wraps.
    let p2p = |seq| RecordRequest {
        is_p2p: true,
        p2p_seq_id: seq,
        profiling_name: "gloo:send 1->0".into(),
        ..allreduce(seq)
    };
    let (mut two_calls, mut one_call) = (recorder(4), recorder(4));
    for seq in 1..=7u64 {
        let req = if seq == 3 { p2p(seq) } else { allreduce(seq) };
        let a = two_calls.record(ms(seq), &req).unwrap();
        two_calls.handle_started(a, ms(seq));
        let b = one_call.record_started(ms(seq), &req).unwrap();
        for (fr, id) in [(&mut two_calls, a), (&mut one_call, b)] {
            match seq % 3 {
                0 => fr.handle_completed(id, ms(seq + 1)),
                1 => fr.handle_finished(
                    id,
                    ms(seq + 2),
                    &WorkResult::Timeout { message: "late".into(), blame: crate::work::Blame::nobody() },
                ),
                _ => {}
            }
        }
        assert_eq!(one_call.dump(meta()), two_calls.dump(meta()), "after collective {seq}");
    }
    assert_eq!(status(&one_call, "0"), st(7, 7, 6));
}

#[test]
fn pg_status_follows_collectives() {
    let mut fr = recorder(8);
    assert_eq!(status(&fr, "0"), st(-1, -1, -1));
    let a = fr.record(ms(0), &allreduce(1)).unwrap();
    let b = fr.record(ms(0), &allreduce(2)).unwrap();
    assert_eq!(status(&fr, "0"), st(2, -1, -1));
    fr.handle_started(b, ms(1));
    fr.handle_started(a, ms(1)); // started is only ever raised
    assert_eq!(status(&fr, "0"), st(2, 2, -1));
    fr.handle_completed(a, ms(2));
    assert_eq!(status(&fr, "0"), st(2, 2, 1));
    fr.handle_completed(b, ms(3));
    assert_eq!(status(&fr, "0"), st(2, 2, 2));
    // A failure does not count as completion.
    let c = fr.record(ms(4), &allreduce(3)).unwrap();
    fr.handle_started(c, ms(4));
    fr.handle_finished(c, ms(5), &WorkResult::Timeout { message: "late".into(), blame: crate::work::Blame::nobody() });
    assert_eq!(status(&fr, "0"), st(3, 3, 2));
    // Point-to-point ops leave it alone.
    let send = fr
        .record(
            ms(6),
            &RecordRequest { is_p2p: true, p2p_seq_id: 1, profiling_name: "gloo:send 1->0".into(), ..allreduce(3) },
        )
        .unwrap();
    fr.handle_started(send, ms(6));
    fr.handle_completed(send, ms(7));
    assert_eq!(status(&fr, "0"), st(3, 3, 2));
}

#[test]
fn every_group_gets_its_own_status_and_config() {
    let mut fr = recorder(8);
    fr.record_group(5, "5", "tp", &[0]);
    let req = RecordRequest { pg_id: 5, pg_name: "5", pg_desc: "tp", ..allreduce(7) };
    let id = fr.record(ms(0), &req).unwrap();
    fr.handle_completed(id, ms(1));
    let dump = fr.dump(meta());
    assert_eq!(dump.pg_status["5"], st(7, 7, 7));
    assert_eq!(dump.pg_status["0"], st(-1, -1, -1));
    assert_eq!(*dump.pg_config["5"].ranks, [0]);
    assert_eq!(dump.entries[0].process_group, ("5".to_owned(), "tp".to_owned()));
    assert_eq!(dump.entries[0].pg_id, 5);
}

#[test]
fn a_groups_ranks_come_back_as_given_whatever_their_runs() {
    let mut fr = recorder(4);
    let lists: [&[u64]; 5] = [&[], &[3], &[0, 1, 2, 3], &[7, 2, 3, 4, 9, 10, 0], &[u64::MAX - 1, u64::MAX, 0, 0]];
    for (i, ranks) in lists.iter().enumerate() {
        fr.record_group(i as u64, &i.to_string(), "g", ranks);
    }
    let dump = fr.dump(meta());
    for (i, ranks) in lists.iter().enumerate() {
        assert_eq!(&*dump.pg_config[&i.to_string()].ranks, *ranks, "group {i}");
    }
}

#[test]
fn interned_names_record_as_their_text_and_unknown_ids_say_so() {
    let mut fr = recorder(4);
    let id = fr.intern_name("gloo:broadcast");
    assert_eq!(fr.intern_name("gloo:broadcast"), id, "the same text keeps its id");
    fr.record(ms(1), &RecordRequest { profiling_name: ProfilingName::Interned(id), ..allreduce(1) }).unwrap();
    fr.record(ms(2), &allreduce(2)).unwrap();
    // An id beyond those this recorder gave (another recorder's) must not panic.
    let mut other = recorder(4);
    for name in ["a", "b", "c", "d", "e"] {
        other.intern_name(name);
    }
    let foreign = other.intern_name("f");
    fr.record(ms(3), &RecordRequest { profiling_name: ProfilingName::Interned(foreign), ..allreduce(3) }).unwrap();
    let names: Vec<String> = fr.dump(meta()).entries.into_iter().map(|e| e.profiling_name).collect();
    assert_eq!(names, ["gloo:broadcast", "gloo:all_reduce", "(unknown profiling name)"]);
}

#[test]
fn the_ring_grows_as_it_fills_and_its_slots_never_move() {
    let mut fr = recorder(2000);
    assert_eq!(fr.slots.reserved(), 0);
    fr.record(ms(0), &allreduce(0));
    let first: *const Slot = fr.slots.get(0).unwrap();
    for seq in 1..5 {
        fr.record(ms(seq), &allreduce(seq));
    }
    // A few records hold one chunk, not the ring's capacity.
    assert_eq!(fr.slots.reserved(), Slots::CHUNK);
    for seq in 5..2500 {
        fr.record(ms(seq), &allreduce(seq));
    }
    assert!(std::ptr::eq(fr.slots.get(0).unwrap(), first), "a slot moved");
    assert_eq!(fr.slots.len(), 2000);
    assert!(fr.slots.reserved() < 2000 + Slots::CHUNK);
    let seqs: Vec<u64> = fr.dump(meta()).entries.iter().map(|e| e.collective_seq_id).collect();
    assert_eq!(seqs.len(), 2000);
    assert_eq!((seqs[0], seqs[1999]), (500, 2499), "the oldest 500 were overwritten, in order");
}

#[test]
fn capacity_zero_records_nothing() {
    let mut fr = FlightRecorder::new(RecorderConfig { capacity: 0, timing: true }, EPOCH_NS);
    assert!(!fr.is_enabled());
    fr.record_group(0, "0", "default_pg", &[0, 1]);
    assert_eq!(fr.record(ms(0), &allreduce(1)), None);
    fr.reset(ms(1));
    let dump = fr.dump(meta());
    assert!(dump.entries.is_empty() && dump.pg_config.is_empty() && dump.pg_status.is_empty());
    assert_eq!(dump.reset_epoch, Some(0));
    assert!(fr.slots.reserved() == 0 && fr.names.is_empty() && fr.groups.is_empty());
}

#[test]
fn reset_begins_a_new_epoch() {
    let mut fr = recorder(4);
    fr.reset(ms(0)); // nothing recorded yet: no new epoch, as torch
    assert_eq!(fr.reset_epoch(), 0);
    let old = fr.record(ms(1), &allreduce(1)).unwrap();
    fr.record(ms(2), &allreduce(2)).unwrap();
    fr.reset(ms(3));
    assert_eq!(fr.reset_epoch(), 1);
    assert!(fr.is_empty());
    let dump = fr.dump(meta());
    assert!(dump.entries.is_empty());
    assert_eq!(dump.pg_status["0"], st(-1, -1, -1));
    assert_eq!(dump.reset_time_ns, Some(EPOCH_NS + 3_000_000));
    // Ids from the old epoch no longer reach an entry.
    fr.handle_started(old, ms(4));
    let new = fr.record(ms(5), &allreduce(1)).unwrap();
    fr.handle_started(new, ms(6));
    let dump = fr.dump(meta());
    assert_eq!(dump.reset_epoch, Some(1));
    assert_eq!(dump.entries.len(), 1);
    assert_eq!(dump.entries[0].record_id, 0);
    assert_eq!(dump.entries[0].state, EntryState::Started);
    assert_eq!(dump.pg_status["0"], st(1, 1, -1));
    // The old epoch's entries are not dumped even while their slots survive.
    for seq in 2..=4 {
        fr.record(ms(7), &allreduce(seq)).unwrap();
    }
    let ids: Vec<_> = fr.dump(meta()).entries.iter().map(|e| e.record_id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3]);
}

#[test]
fn failures_keep_torch_state_and_add_cohort_fields() {
    let mut fr = recorder(8);
    let queued = fr.record(ms(0), &allreduce(1)).unwrap();
    let running = fr.record(ms(0), &allreduce(2)).unwrap();
    fr.handle_started(running, ms(1));
    fr.handle_finished(queued, ms(2), &WorkResult::Aborted { reason: "group aborted".into() });
    let lost = WorkResult::CommError {
        blame: crate::work::Blame::rank(Rank(0)),
        message: "connection to rank 0 reset".into(),
    };
    fr.handle_finished(running, ms(3), &lost);
    fr.handle_completed(running, ms(4)); // too late: it already ended
    let dump = fr.dump(meta());
    let [q, r] = &dump.entries[..] else { panic!("two entries") };
    assert_eq!((q.state, q.cohort_state), (EntryState::Scheduled, Some(WorkState::Aborted)));
    assert_eq!(q.cohort_error.as_deref(), Some("aborted: group aborted"));
    assert_eq!((r.state, r.cohort_state), (EntryState::Started, Some(WorkState::Failed)));
    assert_eq!(r.cohort_error.as_deref(), Some("connection to rank 0 reset; blame: rank 0"));
    assert_eq!(r.cohort_blame, Some(crate::work::Blame::rank(Rank(0))));
    assert_eq!(q.cohort_blame, None, "an abort blames nobody");
    assert_eq!(r.cohort_time_finished_ns, Some(EPOCH_NS + 3_000_000));
    assert!(q.retired && r.retired);
    assert_eq!((r.time_discovered_completed_ns, r.duration_ms), (None, None));
}

#[test]
fn completion_sets_duration_only_with_timing() {
    for timing in [false, true] {
        let mut fr = FlightRecorder::new(RecorderConfig { capacity: 4, timing }, EPOCH_NS);
        let a = fr.record(ms(0), &allreduce(1)).unwrap();
        fr.handle_started(a, ms(10));
        fr.handle_completed(a, ms(35));
        let b = fr.record(ms(40), &allreduce(2)).unwrap();
        fr.handle_finished(b, ms(50), &WorkResult::Success); // never reported started
        let dump = fr.dump(meta());
        assert_eq!(dump.entries[0].duration_ms, timing.then_some(25.0));
        assert_eq!(dump.entries[1].duration_ms, None);
        assert_eq!(dump.entries[1].time_discovered_started_ns, Some(EPOCH_NS + 50_000_000));
        assert_eq!(dump.entries[1].state, EntryState::Completed);
    }
}

#[test]
fn only_active_leaves_out_completed_entries() {
    let mut fr = recorder(8);
    let a = fr.record(ms(0), &allreduce(1)).unwrap();
    fr.record(ms(0), &allreduce(2)).unwrap();
    fr.handle_completed(a, ms(1));
    let dump = fr.dump(DumpMeta { only_active: true, ..meta() });
    assert_eq!(dump.entries.len(), 1);
    assert_eq!(dump.entries[0].collective_seq_id, 2);
}

#[test]
fn tensors_record_their_shapes_and_scalar_type_names() {
    let mut fr = recorder(4);
    let inputs = [Tensor::zeros(DType::Bf16, &[4, 8]).unwrap(), Tensor::from_slice(&[1i64])];
    let output = Tensor::zeros(DType::Bf16, &[8, 8]).unwrap();
    let base = allreduce(1);
    let req = RecordRequest {
        pg_id: base.pg_id,
        pg_name: base.pg_name,
        pg_desc: base.pg_desc,
        collective_seq_id: 1,
        p2p_seq_id: 0,
        op_id: 1,
        profiling_name: base.profiling_name,
        inputs: &inputs,
        outputs: std::slice::from_ref(&output),
        timeout: base.timeout,
        is_p2p: false,
    };
    fr.record(ms(0), &req).unwrap();
    let e = &fr.dump(meta()).entries[0];
    assert_eq!(e.input_sizes, vec![vec![4, 8], vec![1]]);
    assert_eq!(e.input_dtypes, vec!["BFloat16", "Long"]);
    assert_eq!(e.output_sizes, vec![vec![8, 8]]);
    assert_eq!(e.output_dtypes, vec!["BFloat16"]);
}

#[test]
fn shapes_that_change_as_the_ring_turns_are_each_dumped_as_recorded_and_kept_at_most_once_a_slot() {
    let mut fr = recorder(3);
    let dims: Vec<Vec<usize>> = (1..=12).map(|n| vec![n % 4 + 1, n]).collect();
    for (seq, d) in dims.iter().enumerate() {
        let dtype = if seq % 3 == 0 { DType::I64 } else { DType::F32 };
        let metas = [TensorMeta { dtype, shape: d }];
        fr.record(ms(seq as u64), &RecordRequest { inputs: &metas, outputs: &metas, ..allreduce(seq as u64) }).unwrap();
        assert!(fr.shapes.live() <= 3, "record {seq}: {} descriptions for 3 slots", fr.shapes.live());
    }
    let dump = fr.dump(meta());
    for (e, seq) in dump.entries.iter().zip(9..12) {
        assert_eq!(e.input_sizes, vec![dims[seq].iter().map(|&d| d as u64).collect::<Vec<_>>()]);
        assert_eq!(e.output_sizes, e.input_sizes);
        let name = if seq % 3 == 0 { "Long" } else { "Float" };
        assert_eq!(
            (e.input_dtypes.as_slice(), e.output_dtypes.as_slice()),
            ([name.to_string()].as_slice(), [name.to_string()].as_slice())
        );
    }
    // A loop of one shape: one description, however many records.
    for seq in 12..40 {
        fr.record(ms(seq), &allreduce(seq)).unwrap();
    }
    assert_eq!(fr.shapes.live(), 1);
}

/// A small dump with fixed times: two groups, a completed allreduce, a started broadcast that
/// then timed out, a queued send, and a barrier with no tensors.
fn small_dump() -> Dump {
    let mut fr = recorder(16);
    fr.record_group(1, "1", "undefined", &[0, 1]);
    let a = fr.record(ms(1), &allreduce(1)).unwrap();
    fr.handle_started(a, ms(2));
    fr.handle_completed(a, ms(5));
    let bcast_name = format!("gloo:{}", OpType::Broadcast.name());
    let bcast = RecordRequest {
        pg_id: 1,
        pg_name: "1",
        pg_desc: "undefined",
        profiling_name: bcast_name.as_str().into(),
        timeout: ms(1_500),
        ..allreduce(1)
    };
    let b = fr.record(ms(6), &bcast).unwrap();
    fr.handle_started(b, ms(7));
    let timeout = WorkResult::Timeout {
        message: "broadcast seq 1 timed out after 1500 ms waiting for rank 0".into(),
        blame: crate::work::Blame::rank(Rank(0)),
    };
    fr.handle_finished(b, ms(1_507), &timeout);
    let send = RecordRequest {
        p2p_seq_id: 1,
        op_id: 2,
        profiling_name: "gloo:send 1->0".into(),
        is_p2p: true,
        ..allreduce(1)
    };
    fr.record(ms(1_508), &send).unwrap();
    let barrier =
        RecordRequest { profiling_name: "gloo:barrier".into(), op_id: 3, inputs: &[], outputs: &[], ..allreduce(2) };
    fr.record(ms(1_509), &barrier).unwrap();
    fr.dump(DumpMeta { comm_lib_version: "cohort-tcp 0.1.0".into(), ..meta() })
}

#[test]
fn small_dump_snapshot() {
    insta::assert_snapshot!(small_dump().to_json_pretty());
}

#[test]
fn dump_round_trips_through_json() {
    let dump = small_dump();
    let back = Dump::from_json(&dump.to_json()).unwrap();
    assert_eq!(back, dump);
    let back = Dump::from_json(&dump.to_json_pretty()).unwrap();
    assert_eq!(back, dump);
}

#[derive(Debug, Clone)]
enum Op {
    Record,
    Start(usize),
    Complete(usize),
    Fail(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Record),
        2 => any::<usize>().prop_map(Op::Start),
        2 => any::<usize>().prop_map(Op::Complete),
        1 => any::<usize>().prop_map(Op::Fail),
        1 => Just(Op::Reset),
    ]
}

proptest! {
    /// Against a model that keeps every record: the dump holds exactly the last `capacity`
    /// records of the current epoch, oldest first, each in the state its transitions gave it.
    #[test]
    fn dump_matches_a_model_that_keeps_everything(capacity in 1usize..6, ops in prop::collection::vec(op(), 0..60)) {
        let mut fr = recorder(capacity);
        // (id, epoch, seq, torch state, cohort state)
        let mut model: Vec<(RecordId, u64, u64, EntryState, WorkState)> = Vec::new();
        let mut epoch = 0;
        let mut t = 0;
        for op in ops {
            t += 1;
            let now = ms(t);
            let pick = |i: usize| (!model.is_empty()).then(|| i % model.len());
            match op {
                Op::Record => {
                    let seq = model.len() as u64 + 1;
                    let id = fr.record(now, &allreduce(seq)).unwrap();
                    model.push((id, epoch, seq, EntryState::Scheduled, WorkState::Enqueued));
                }
                Op::Start(i) => if let Some(i) = pick(i) {
                    fr.handle_started(model[i].0, now);
                    let live = model[i].1 == epoch && model.len() - i <= capacity;
                    if live && model[i].4 == WorkState::Enqueued {
                        model[i].3 = EntryState::Started;
                        model[i].4 = WorkState::Started;
                    }
                },
                Op::Complete(i) => if let Some(i) = pick(i) {
                    fr.handle_completed(model[i].0, now);
                    let live = model[i].1 == epoch && model.len() - i <= capacity;
                    if live && !model[i].4.is_terminal() {
                        model[i].3 = EntryState::Completed;
                        model[i].4 = WorkState::Completed;
                    }
                },
                Op::Fail(i) => if let Some(i) = pick(i) {
                    fr.handle_finished(model[i].0, now, &WorkResult::Aborted { reason: "x".into() });
                    let live = model[i].1 == epoch && model.len() - i <= capacity;
                    if live && !model[i].4.is_terminal() {
                        model[i].4 = WorkState::Aborted;
                    }
                },
                Op::Reset => {
                    fr.reset(now);
                    if !model.is_empty() {
                        epoch += 1;
                    }
                }
            }
        }
        let first_of_epoch = model.iter().position(|m| m.1 == epoch).unwrap_or(model.len());
        let expected: Vec<_> = model[first_of_epoch..]
            .iter()
            .enumerate()
            .skip(model.len().saturating_sub(capacity).saturating_sub(first_of_epoch))
            .map(|(i, m)| (i as u64, m.2, m.3, Some(m.4)))
            .collect();
        let got: Vec<_> = fr
            .dump(meta())
            .entries
            .iter()
            .map(|e| (e.record_id, e.collective_seq_id, e.state, e.cohort_state))
            .collect();
        prop_assert_eq!(got, expected);
        prop_assert_eq!(fr.len(), model.len().saturating_sub(first_of_epoch).min(capacity));
    }
}

/// What a differential run does next: record a work (of description `desc`, or like the entry of
/// an earlier record, `like`), move one, or reset.
#[derive(Debug, Clone)]
enum Again {
    Record(usize),
    Like(usize),
    Start(usize),
    Complete(usize),
    Fail(usize),
    Reset,
}

fn again_op() -> impl Strategy<Value = Again> {
    prop_oneof![
        3 => (0usize..4).prop_map(Again::Record),
        4 => any::<usize>().prop_map(Again::Like),
        1 => any::<usize>().prop_map(Again::Start),
        2 => any::<usize>().prop_map(Again::Complete),
        1 => any::<usize>().prop_map(Again::Fail),
        1 => Just(Again::Reset),
    ]
}

const WIDE: &[usize] = &[5];
const WIDE_METAS: &[TensorMeta<'static>] = &[TensorMeta { dtype: DType::I64, shape: WIDE }];

/// Description `desc` of four, with these numbers: an allreduce, another group's, one of other
/// tensors, and a point-to-point send (which [`FlightRecorder::record_again`] never copies).
fn described(desc: usize, seq: u64, op_id: u64) -> RecordRequest<'static> {
    let base = allreduce(seq);
    let base = RecordRequest { op_id, ..base };
    match desc {
        0 => base,
        1 => RecordRequest { pg_id: 1, pg_name: "1", pg_desc: "sub", ..base },
        2 => RecordRequest { inputs: WIDE_METAS, outputs: WIDE_METAS, timeout: ms(5), ..base },
        _ => RecordRequest {
            profiling_name: "gloo:send 0->1".into(),
            is_p2p: true,
            collective_seq_id: 0,
            p2p_seq_id: seq,
            ..base
        },
    }
}

proptest! {
    /// `record_again` leaves what `record_started` of the same request leaves: two recorders,
    /// one recording each repeat like an earlier entry where it can, the other in full, dump
    /// alike after every step, through wraps, transitions and resets.
    #[test]
    fn a_record_like_an_earlier_one_leaves_what_a_full_record_leaves(
        capacity in 1usize..5,
        ops in prop::collection::vec(again_op(), 0..60),
    ) {
        let (mut again, mut full) = (recorder(capacity), recorder(capacity));
        for fr in [&mut again, &mut full] {
            fr.record_group(1, "1", "sub", &[0]);
        }
        // Each record's description, and its id in each recorder.
        let mut records: Vec<(usize, RecordId, RecordId)> = Vec::new();
        for (t, op) in ops.into_iter().enumerate() {
            let now = ms(t as u64);
            let seq = records.len() as u64 + 1;
            let pick = |i: usize| (!records.is_empty()).then(|| records[i % records.len()]);
            match op {
                Again::Record(desc) => {
                    let req = described(desc, seq, seq + 100);
                    let a = again.record_started(now, &req).unwrap();
                    let f = full.record_started(now, &req).unwrap();
                    records.push((desc, a, f));
                }
                Again::Like(i) => if let Some((desc, like, _)) = pick(i) {
                    let req = described(desc, seq, seq + 100);
                    let numbers = RecordNumbers {
                        collective_seq_id: req.collective_seq_id,
                        p2p_seq_id: req.p2p_seq_id,
                        op_id: req.op_id,
                    };
                    let a = match again.record_again(now, like, numbers, req.timeout) {
                        Some(a) => a,
                        None => again.record_started(now, &req).unwrap(),
                    };
                    let f = full.record_started(now, &req).unwrap();
                    records.push((desc, a, f));
                },
                Again::Start(i) => if let Some((_, a, f)) = pick(i) {
                    again.handle_started(a, now);
                    full.handle_started(f, now);
                },
                Again::Complete(i) => if let Some((_, a, f)) = pick(i) {
                    again.handle_completed(a, now);
                    full.handle_completed(f, now);
                },
                Again::Fail(i) => if let Some((_, a, f)) = pick(i) {
                    let result = WorkResult::Aborted { reason: "x".into() };
                    again.handle_finished(a, now, &result);
                    full.handle_finished(f, now, &result);
                },
                Again::Reset => {
                    again.reset(now);
                    full.reset(now);
                }
            }
            prop_assert_eq!(again.dump(meta()), full.dump(meta()));
            // And the same descriptions held, each by as many entries.
            prop_assert_eq!(again.shapes.in_use(), full.shapes.in_use());
        }
        prop_assert!(records.iter().all(|(_, a, f)| a == f), "the same record ids");
    }
}
