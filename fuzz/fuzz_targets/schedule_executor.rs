//! Schedule executors of every collective on 1–6 ranks, with arbitrary delivery order and
//! messages dropped, duplicated or resized, received staged or in place: the run ends in the
//! right result, a clear error, or (only when a message was lost) stuck naming whom it waits
//! on — never a panic and never a wrong result.
#![no_main]

use arbitrary::Arbitrary;
use cohort_core::schedule::harness::{Harness, RunOutcome, Tamper};
use cohort_core::schedule::{AllreduceAlgorithm, PlanOptions, ScheduleOp};
use cohort_core::tensor::HostBuffer;
use cohort_core::{DType, Rank, ReduceOp, Reduction};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Case {
    world: u8,
    op: u8,
    count: u16,
    root: u8,
    algorithm: u8,
    chunk_bytes: u16,
    seed: u64,
    /// One byte per delivery: what to do with it (mostly deliver).
    tamper: Vec<u8>,
}

fn value(r: usize, i: usize) -> i32 {
    (r as i32 + 1) * ((i % 11) as i32 + 1)
}

fuzz_target!(|case: Case| {
    let n = usize::from(case.world % 6) + 1;
    let count = usize::from(case.count % 300);
    let root = Rank(u32::from(case.root) % n as u32);
    let counts = vec![count; n];
    let op = match case.op % 8 {
        0 => ScheduleOp::Allreduce { count },
        1 => ScheduleOp::Allgather { counts },
        2 => ScheduleOp::Broadcast { count, root },
        3 => ScheduleOp::Reduce { count, root },
        4 => ScheduleOp::ReduceScatter { counts },
        5 => ScheduleOp::Gather { counts, root },
        6 => ScheduleOp::Scatter { counts, root },
        _ => ScheduleOp::Barrier,
    };
    let options = PlanOptions {
        allreduce: match case.algorithm % 3 {
            0 => AllreduceAlgorithm::Auto,
            1 => AllreduceAlgorithm::Ring,
            _ => AllreduceAlgorithm::HalvingDoubling,
        },
        chunk_bytes: usize::from(case.chunk_bytes),
    };
    let data_len = match &op {
        ScheduleOp::ReduceScatter { .. } | ScheduleOp::Scatter { .. } => count * n,
        ScheduleOp::Barrier => 0,
        _ => count,
    };
    let inputs: Vec<HostBuffer> = (0..n)
        .map(|r| {
            let v: Vec<i32> = (0..data_len).map(|i| value(r, i)).collect();
            HostBuffer::from_bytes(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
        })
        .collect();
    let sum = Reduction::new(ReduceOp::Sum, DType::I32).expect("sum on i32");
    let reduction = op.is_reduction().then_some(sum);
    let Ok(mut h) = Harness::for_op(&op, 4, options, reduction, inputs, case.seed) else { return };
    h.receive_in_place(case.seed & 2 != 0);
    let mut script = case.tamper.into_iter();
    let mut lost = false;
    let outcome = h.run_with(|env, _| match script.next().unwrap_or(0) {
        250 => {
            lost = true;
            Tamper::Drop
        }
        251 => Tamper::Duplicate,
        252 => Tamper::Resize(env.payload.len() + 4),
        253 => Tamper::Resize(env.payload.len().saturating_sub(4)),
        _ => Tamper::Deliver,
    });
    match outcome {
        RunOutcome::Failed { error, .. } => {
            assert!(!error.to_string().is_empty());
            return;
        }
        RunOutcome::Stuck { waiting } => {
            assert!(lost, "stuck without a lost message: {waiting:?}");
            assert!(waiting.iter().all(|(_, on)| !on.is_empty()) || n == 1);
            return;
        }
        RunOutcome::Completed => {}
    }
    // Completed: every rank's result is right.
    let ints = |b: &HostBuffer| -> Vec<i32> {
        b.as_bytes().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    let col = |i: usize| (0..n).map(|r| value(r, i)).sum::<i32>();
    for (r, (data, output)) in h.into_buffers().iter().enumerate() {
        let (data, output) = (ints(data), ints(output));
        match &op {
            ScheduleOp::Allreduce { .. } => assert_eq!(data, (0..count).map(col).collect::<Vec<_>>()),
            ScheduleOp::Broadcast { .. } => {
                assert_eq!(data, (0..count).map(|i| value(root.index(), i)).collect::<Vec<_>>())
            }
            ScheduleOp::Reduce { .. } if r == root.index() => {
                assert_eq!(data, (0..count).map(col).collect::<Vec<_>>())
            }
            ScheduleOp::Allgather { .. } => {
                assert_eq!(
                    output,
                    (0..n * count).map(|i| value(i / count.max(1), i % count.max(1))).collect::<Vec<_>>()
                )
            }
            ScheduleOp::Gather { .. } if r == root.index() => {
                assert_eq!(
                    output,
                    (0..n * count).map(|i| value(i / count.max(1), i % count.max(1))).collect::<Vec<_>>()
                )
            }
            ScheduleOp::ReduceScatter { .. } => {
                assert_eq!(output, (0..count).map(|i| col(r * count + i)).collect::<Vec<_>>())
            }
            ScheduleOp::Scatter { .. } => {
                assert_eq!(output, (0..count).map(|i| value(root.index(), r * count + i)).collect::<Vec<_>>())
            }
            _ => {}
        }
    }
});
