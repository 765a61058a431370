//! Properties of the collective schedules: every op, every algorithm, world sizes 1..=16 and
//! random delivery orders give what a naive reference computes; allreduce is bit-identical on
//! every rank; a duplicated, resized or lost chunk ends in a clear error or a stuck rank that
//! names its peer — never a panic, never a wrong answer. Chunks are received staged or, in half
//! the cases, in place where the executor allows it; in half the cases the output buffer starts
//! full of garbage.

use cohort_core::schedule::harness::{Harness, RunOutcome, SplitMix64, Tamper};
use cohort_core::schedule::{AllreduceAlgorithm, Executor, Plan, PlanOptions, ScheduleError, ScheduleOp};
use cohort_core::tensor::HostBuffer;
use cohort_core::{DType, Rank, ReduceOp, Reduction};
use half::{bf16, f16};
use proptest::prelude::*;

/// One collective on every rank: the op as each rank describes it, the dtype, the reduction and
/// the seed for both the inputs and the delivery order.
#[derive(Debug, Clone)]
struct Case {
    ops: Vec<ScheduleOp>,
    dtype: DType,
    reduce: Option<ReduceOp>,
    options: PlanOptions,
    seed: u64,
}

impl Case {
    fn n(&self) -> usize {
        self.ops.len()
    }

    fn plans(&self) -> Vec<Plan> {
        let n = self.n() as u32;
        (0..n)
            .map(|r| Plan::new(&self.ops[r as usize], Rank(r), n, self.dtype.size(), self.options).expect("valid case"))
            .collect()
    }

    fn inputs(&self) -> Vec<Vec<u8>> {
        let mut rng = SplitMix64::new(self.seed ^ 0x5eed);
        self.plans().iter().map(|p| gen_bytes(self.dtype, self.reduce, p.data_len(), &mut rng)).collect()
    }

    fn harness(&self, inputs: &[Vec<u8>]) -> Harness {
        let reduction = self.reduce.map(|op| Reduction::new(op, self.dtype).expect("supported pair"));
        let executors = self
            .plans()
            .into_iter()
            .zip(inputs)
            .map(|(p, d)| {
                let data = HostBuffer::from_bytes(d);
                // Half the cases write into an output that holds garbage (a caller's tensor, as
                // the torch backend passes): every plan must write every output byte.
                if self.seed & 2 == 2 {
                    let garbage = HostBuffer::from_bytes(&vec![0xA5; p.output_len()]);
                    Executor::with_output(p, reduction, data, garbage).expect("valid executor")
                } else {
                    Executor::new(p, reduction, data).expect("valid executor")
                }
            })
            .collect();
        // Half the cases receive in place where the executors allow it, as the TCP reader does
        // for large chunks.
        let mut h = Harness::new(executors, self.seed);
        h.receive_in_place(self.seed & 1 == 1);
        h
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs and the reference.

/// `len` bytes of random values of `dtype`, tame enough that float reductions stay finite.
fn gen_bytes(dtype: DType, op: Option<ReduceOp>, len: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let n = len / dtype.size();
    let product = op == Some(ReduceOp::Product);
    let mut float = || {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        if product {
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            sign * (0.8 + 0.45 * u)
        } else {
            16.0 * u - 8.0
        }
    };
    let mut out = Vec::with_capacity(len);
    match dtype {
        DType::F64 => (0..n).for_each(|_| out.extend(float().to_ne_bytes())),
        DType::F32 => (0..n).for_each(|_| out.extend((float() as f32).to_ne_bytes())),
        DType::F16 => (0..n).for_each(|_| out.extend(f16::from_f64(float()).to_ne_bytes())),
        DType::Bf16 => (0..n).for_each(|_| out.extend(bf16::from_f64(float()).to_ne_bytes())),
        DType::Bool => (0..n).for_each(|_| out.push((rng.next_u64() & 1) as u8)),
        DType::I8 | DType::U8 | DType::I32 | DType::I64 => {
            while out.len() < len {
                out.extend(rng.next_u64().to_ne_bytes());
            }
            out.truncate(len);
        }
    }
    out
}

fn floats(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let es = dtype.size();
    bytes
        .chunks_exact(es)
        .map(|c| match dtype {
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            DType::F32 => f64::from(f32::from_ne_bytes(c.try_into().unwrap())),
            DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            DType::Bf16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            _ => unreachable!("not a float dtype"),
        })
        .collect()
}

fn ints(dtype: DType, bytes: &[u8]) -> Vec<i128> {
    let es = dtype.size();
    bytes
        .chunks_exact(es)
        .map(|c| match dtype {
            DType::Bool | DType::U8 => i128::from(c[0]),
            DType::I8 => i128::from(c[0] as i8),
            DType::I32 => i128::from(i32::from_ne_bytes(c.try_into().unwrap())),
            DType::I64 => i128::from(i64::from_ne_bytes(c.try_into().unwrap())),
            _ => unreachable!("not an integer dtype"),
        })
        .collect()
}

/// Two's-complement wrap into the dtype's range.
fn wrap(dtype: DType, v: i128) -> i128 {
    match dtype {
        DType::I8 => i128::from(v as i8),
        DType::U8 => i128::from(v as u8),
        DType::I32 => i128::from(v as i32),
        DType::I64 => i128::from(v as i64),
        _ => v,
    }
}

fn epsilon(dtype: DType) -> (f64, f64) {
    // (unit roundoff, absolute floor for results near zero)
    match dtype {
        DType::F64 => (f64::EPSILON, 1e-300),
        DType::F32 => (f64::from(f32::EPSILON), 1e-30),
        DType::F16 => (f16::EPSILON.to_f64(), 1e-4),
        DType::Bf16 => (bf16::EPSILON.to_f64(), 1e-30),
        _ => unreachable!("not a float dtype"),
    }
}

/// What a reduction should give, element by element.
#[derive(Debug, Clone)]
enum Expect {
    /// Exactly these values.
    Ints(Vec<i128>),
    /// These values within these tolerances (0: exactly).
    Floats(Vec<(f64, f64)>),
}

impl Expect {
    fn slice(&self, elems: std::ops::Range<usize>) -> Expect {
        match self {
            Expect::Ints(v) => Expect::Ints(v[elems].to_vec()),
            Expect::Floats(v) => Expect::Floats(v[elems].to_vec()),
        }
    }

    fn check(&self, dtype: DType, got: &[u8], what: &str) -> Result<(), TestCaseError> {
        match self {
            Expect::Ints(want) => {
                let got = ints(dtype, got);
                prop_assert_eq!(got.len(), want.len(), "{}: length", what);
                if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                    prop_assert!(false, "{}: element {} is {}, expected {}", what, i, got[i], want[i]);
                }
            }
            Expect::Floats(want) => {
                let got = floats(dtype, got);
                prop_assert_eq!(got.len(), want.len(), "{}: length", what);
                for (i, (&g, &(w, tol))) in got.iter().zip(want).enumerate() {
                    prop_assert!((g - w).abs() <= tol, "{}: element {} is {}, expected {} ± {}", what, i, g, w, tol);
                }
            }
        }
        Ok(())
    }
}

/// The naive reduction of `inputs` (one byte buffer per rank), element by element: integers
/// with the kernels' wrapping and truncation, floats in f64 with a tolerance of a few units of
/// roundoff per combine, scaled by the magnitude of the terms.
fn reference(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Expect {
    let n = inputs.len();
    if !dtype.is_floating_point() {
        let vals: Vec<Vec<i128>> = inputs.iter().map(|b| ints(dtype, b)).collect();
        let len = vals[0].len();
        let out = (0..len)
            .map(|j| {
                let col = vals.iter().map(|v| v[j]);
                if dtype == DType::Bool {
                    return match op {
                        ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => col.max().unwrap(),
                        ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => col.min().unwrap(),
                        ReduceOp::BXor => col.fold(0, |a, x| a ^ x),
                        _ => unreachable!("{op} on bool"),
                    };
                }
                match op {
                    ReduceOp::Sum => wrap(dtype, col.sum()),
                    ReduceOp::Avg => wrap(dtype, col.sum()) / n as i128,
                    ReduceOp::Product => col.fold(1, |a, x| wrap(dtype, a * x)),
                    ReduceOp::Min => col.min().unwrap(),
                    ReduceOp::Max => col.max().unwrap(),
                    ReduceOp::BAnd => col.fold(-1, |a, x| a & x),
                    ReduceOp::BOr => col.fold(0, |a, x| a | x),
                    ReduceOp::BXor => col.fold(0, |a, x| a ^ x),
                    ReduceOp::PremulSum(_) => unreachable!("premul_sum on integers"),
                }
            })
            .collect();
        return Expect::Ints(out);
    }
    let vals: Vec<Vec<f64>> = inputs.iter().map(|b| floats(dtype, b)).collect();
    let len = vals[0].len();
    let (eps, floor) = epsilon(dtype);
    let slack = 2.0 * (n as f64 + 3.0) * eps;
    let out = (0..len)
        .map(|j| {
            let col = vals.iter().map(|v| v[j]);
            match op {
                ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                    let f = if let ReduceOp::PremulSum(f) = op { f } else { 1.0 };
                    let (sum, mag) = col.fold((0.0, 0.0), |(s, m), x| (s + x * f, m + (x * f).abs()));
                    let d = if op == ReduceOp::Avg { n as f64 } else { 1.0 };
                    (sum / d, slack * mag / d + floor)
                }
                ReduceOp::Product => {
                    let p: f64 = col.product();
                    (p, slack * p.abs() + floor)
                }
                ReduceOp::Min => (col.fold(f64::INFINITY, f64::min), 0.0),
                ReduceOp::Max => (col.fold(f64::NEG_INFINITY, f64::max), 0.0),
                _ => unreachable!("{op} on floats"),
            }
        })
        .collect();
    Expect::Floats(out)
}

fn offsets(counts: &[usize], elem_size: usize) -> Vec<usize> {
    let mut off = vec![0];
    for c in counts {
        off.push(off.last().unwrap() + c * elem_size);
    }
    off
}

// ---------------------------------------------------------------------------------------------
// Running and checking a case.

fn run_and_check(case: &Case) -> Result<(), TestCaseError> {
    let inputs = case.inputs();
    let mut h = case.harness(&inputs);
    let outcome = h.run();
    prop_assert_eq!(&outcome, &RunOutcome::Completed);
    let out = h.into_buffers();
    let n = case.n();
    let es = case.dtype.size();
    let all: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let reduced = || reference(case.dtype, case.reduce.expect("reducing op"), &all);
    match &case.ops[0] {
        ScheduleOp::Allreduce { .. } => {
            let want = reduced();
            for (r, (data, _)) in out.iter().enumerate() {
                want.check(case.dtype, data.as_bytes(), &format!("rank {r}"))?;
                prop_assert!(data == &out[0].0, "rank {} differs from rank 0 in some bit", r);
            }
        }
        ScheduleOp::Reduce { root, .. } => {
            reduced().check(case.dtype, out[root.index()].0.as_bytes(), "root")?;
        }
        ScheduleOp::ReduceScatter { counts } => {
            let want = reduced();
            let mut start = 0;
            for (r, (_, output)) in out.iter().enumerate() {
                want.slice(start..start + counts[r]).check(case.dtype, output.as_bytes(), &format!("rank {r}"))?;
                start += counts[r];
            }
        }
        ScheduleOp::Broadcast { root, .. } => {
            for (r, (data, _)) in out.iter().enumerate() {
                prop_assert!(
                    data.as_bytes() == inputs[root.index()].as_slice(),
                    "rank {} did not get the root's data",
                    r
                );
            }
        }
        ScheduleOp::Allgather { .. } => {
            let want = inputs.concat();
            for (r, (_, output)) in out.iter().enumerate() {
                prop_assert!(output.as_bytes() == want.as_slice(), "rank {} gathered something else", r);
            }
        }
        ScheduleOp::Gather { root, .. } => {
            prop_assert!(out[root.index()].1.as_bytes() == inputs.concat().as_slice(), "root gathered something else");
        }
        ScheduleOp::Scatter { counts, root } => {
            let off = offsets(counts, es);
            for (r, (_, output)) in out.iter().enumerate() {
                let want = &inputs[root.index()][off[r]..off[r + 1]];
                prop_assert!(output.as_bytes() == want, "rank {} got the wrong slice", r);
            }
        }
        ScheduleOp::Alltoall { .. } => {
            for (r, (_, output)) in out.iter().enumerate() {
                let mut want = Vec::new();
                for (j, op) in case.ops.iter().enumerate() {
                    let ScheduleOp::Alltoall { send_counts, .. } = op else { unreachable!() };
                    let off = offsets(send_counts, es);
                    want.extend_from_slice(&inputs[j][off[r]..off[r + 1]]);
                }
                prop_assert!(output.as_bytes() == want.as_slice(), "rank {} received something else", r);
            }
        }
        ScheduleOp::Barrier => {}
        op => prop_assert!(false, "unchecked op {:?}", op),
    }
    prop_assert_eq!(n, out.len());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Strategies.

const REDUCE_OPS: [ReduceOp; 10] = [
    ReduceOp::Avg,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::PremulSum(0.5),
    ReduceOp::PremulSum(-1.25),
    ReduceOp::Product,
    ReduceOp::Sum,
];

/// Every (dtype, op) pair `ReduceOp::check` allows.
fn reduction_pair() -> impl Strategy<Value = (DType, ReduceOp)> {
    let pairs: Vec<(DType, ReduceOp)> = DType::ALL
        .into_iter()
        .flat_map(|d| REDUCE_OPS.into_iter().filter(move |op| op.check(d).is_ok()).map(move |op| (d, op)))
        .collect();
    proptest::sample::select(pairs)
}

/// Element counts: mostly small, sometimes medium, occasionally up to 100 000.
fn count() -> impl Strategy<Value = usize> {
    prop_oneof![12 => 0usize..40, 4 => 40usize..3000, 2 => 3000usize..=100_000]
}

/// Per-rank counts, equal or uneven, mostly small.
fn counts(n: usize) -> impl Strategy<Value = Vec<usize>> {
    let small = prop_oneof![10 => 0usize..20, 1 => 20usize..2000];
    prop_oneof![small.clone().prop_map(move |c| vec![c; n]), proptest::collection::vec(small, n),]
}

fn options() -> impl Strategy<Value = PlanOptions> {
    let algorithm = prop_oneof![
        Just(AllreduceAlgorithm::Auto),
        Just(AllreduceAlgorithm::Ring),
        Just(AllreduceAlgorithm::HalvingDoubling),
        Just(AllreduceAlgorithm::RecursiveDoubling)
    ];
    let chunk_bytes = prop_oneof![Just(0usize), Just(1), Just(3), 1usize..5000];
    (algorithm, chunk_bytes).prop_map(|(allreduce, chunk_bytes)| PlanOptions { allreduce, chunk_bytes })
}

fn data_dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn same(op: ScheduleOp, n: usize) -> Vec<ScheduleOp> {
    vec![op; n]
}

fn allreduce_case() -> impl Strategy<Value = Case> {
    (1usize..=16, reduction_pair(), count(), options(), any::<u64>()).prop_map(
        |(n, (dtype, op), count, options, seed)| Case {
            ops: same(ScheduleOp::Allreduce { count }, n),
            dtype,
            reduce: Some(op),
            options,
            seed,
        },
    )
}

fn reduce_case() -> impl Strategy<Value = Case> {
    (1usize..=16, reduction_pair(), count(), options(), any::<u64>(), any::<u32>()).prop_map(
        |(n, (dtype, op), count, options, seed, root)| {
            let root = Rank(root % n as u32);
            Case { ops: same(ScheduleOp::Reduce { count, root }, n), dtype, reduce: Some(op), options, seed }
        },
    )
}

fn reduce_scatter_case() -> impl Strategy<Value = Case> {
    (1usize..=16).prop_flat_map(|n| (counts(n), reduction_pair(), options(), any::<u64>())).prop_map(
        |(counts, (dtype, op), options, seed)| {
            let n = counts.len();
            Case { ops: same(ScheduleOp::ReduceScatter { counts }, n), dtype, reduce: Some(op), options, seed }
        },
    )
}

/// Broadcast, allgather, gather, scatter or alltoall, over any dtype (bytes only move).
fn data_case() -> impl Strategy<Value = Case> {
    (1usize..=16)
        .prop_flat_map(|n| {
            let matrix = proptest::collection::vec(counts(n), n);
            (Just(n), 0usize..5, count(), counts(n), matrix, 0..n as u32, data_dtype(), options(), any::<u64>())
        })
        .prop_map(|(n, kind, count, counts, matrix, root, dtype, options, seed)| {
            let root = Rank(root);
            let ops = match kind {
                0 => same(ScheduleOp::Broadcast { count, root }, n),
                1 => same(ScheduleOp::Allgather { counts }, n),
                2 => same(ScheduleOp::Gather { counts, root }, n),
                3 => same(ScheduleOp::Scatter { counts, root }, n),
                _ => (0..n)
                    .map(|i| ScheduleOp::Alltoall {
                        send_counts: matrix[i].clone(),
                        recv_counts: (0..n).map(|j| matrix[j][i]).collect(),
                    })
                    .collect(),
            };
            Case { ops, dtype, reduce: None, options, seed }
        })
}

fn any_case() -> impl Strategy<Value = Case> {
    let barrier = (1usize..=16, any::<u64>()).prop_map(|(n, seed)| Case {
        ops: same(ScheduleOp::Barrier, n),
        dtype: DType::U8,
        reduce: None,
        options: PlanOptions::default(),
        seed,
    });
    prop_oneof![allreduce_case(), reduce_case(), reduce_scatter_case(), data_case(), barrier]
}

// ---------------------------------------------------------------------------------------------
// Properties.

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn allreduce_matches_the_reference_bit_identically_on_every_rank(case in allreduce_case()) {
        run_and_check(&case)?;
    }

    #[test]
    fn faults_end_in_a_clear_error_or_a_named_wait_never_a_wrong_answer(
        case in any_case().prop_filter("needs a message", |c| c.n() >= 2),
        fault in 0u8..3,
        pick in any::<u64>(),
    ) {
        let inputs = case.inputs();
        let mut clean = case.harness(&inputs);
        prop_assert_eq!(clean.run(), RunOutcome::Completed);
        let total = clean.delivered();
        prop_assume!(total > 0);
        let target = (pick % total as u64) as usize;
        let mut h = case.harness(&inputs);
        let mut seen = 0;
        let mut victim = None;
        let outcome = h.run_with(|env, _| {
            seen += 1;
            if seen - 1 != target {
                return Tamper::Deliver;
            }
            victim = Some((env.from, env.to, env.step, env.payload.len()));
            match fault {
                0 => Tamper::Duplicate,
                1 if env.payload.is_empty() || pick & (1 << 63) != 0 => Tamper::Resize(env.payload.len() + 1 + (pick % 7) as usize),
                1 => Tamper::Resize(env.payload.len() - 1 - (pick % 7) as usize % env.payload.len()),
                _ => Tamper::Drop,
            }
        });
        let (from, to, step, len) = victim.expect("the tampered delivery happens: same seed, same order");
        match (fault, outcome) {
            (0, RunOutcome::Failed { rank, error }) => {
                prop_assert_eq!(rank, to);
                prop_assert_eq!(error, ScheduleError::DuplicateChunk { step, from });
            }
            (1, RunOutcome::Failed { rank, error: ScheduleError::ChunkLength { step: s, from: f, expected, actual } }) => {
                prop_assert_eq!((rank, s, f, expected), (to, step, from, len));
                prop_assert_ne!(actual, len);
            }
            (2, RunOutcome::Stuck { waiting }) => {
                let (_, peers) = waiting.iter().find(|(r, _)| *r == to).expect("the receiver cannot finish");
                prop_assert!(!peers.is_empty());
            }
            (fault, outcome) => prop_assert!(false, "fault {} ended in {:?}", fault, outcome),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn reduce_matches_the_reference_at_any_root(case in reduce_case()) {
        run_and_check(&case)?;
    }

    #[test]
    fn reduce_scatter_matches_the_reference_for_equal_and_uneven_counts(case in reduce_scatter_case()) {
        run_and_check(&case)?;
    }

    #[test]
    fn broadcast_allgather_gather_scatter_and_alltoall_move_the_right_bytes(case in data_case()) {
        run_and_check(&case)?;
    }

    #[test]
    fn barrier_completes_and_waits_for_a_silent_rank(n in 1usize..=16, seed in any::<u64>(), silent in any::<u32>()) {
        let case = Case {
            ops: same(ScheduleOp::Barrier, n),
            dtype: DType::U8,
            reduce: None,
            options: PlanOptions::default(),
            seed,
        };
        run_and_check(&case)?;
        if n >= 2 {
            let silent = Rank(silent % n as u32);
            let mut h = case.harness(&vec![Vec::new(); n]);
            let outcome = h.run_with(|env, _| if env.from == silent { Tamper::Drop } else { Tamper::Deliver });
            prop_assert!(matches!(outcome, RunOutcome::Stuck { .. }), "{:?}", outcome);
            for (r, e) in h.executors().iter().enumerate() {
                prop_assert!(r == silent.index() || !e.is_done(), "rank {} passed the barrier without rank {}", r, silent);
            }
        }
    }
}
