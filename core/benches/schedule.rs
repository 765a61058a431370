//! Allreduce of 1 MiB of f32 through the in-memory harness: plan, executor and reduction
//! kernels with no network, so the figure is the schedule's own overhead plus the combines.
//!
//! Run: `cargo bench -p cohort-core --bench schedule`

use std::hint::black_box;

use cohort_core::schedule::harness::{Harness, RunOutcome};
use cohort_core::schedule::{AllreduceAlgorithm, PlanOptions, ScheduleOp};
use cohort_core::tensor::HostBuffer;
use cohort_core::{DType, ReduceOp, Reduction};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const BYTES: usize = 1 << 20;

fn inputs(world: usize) -> Vec<HostBuffer> {
    (0..world)
        .map(|r| {
            let v: Vec<f32> = (0..BYTES / 4).map(|i| ((i + r) % 97) as f32 * 0.5).collect();
            HostBuffer::from_bytes(bytemuck::cast_slice(&v))
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("allreduce_1MiB_f32");
    g.throughput(Throughput::Bytes(BYTES as u64));
    let sum = Reduction::new(ReduceOp::Sum, DType::F32).expect("supported");
    let op = ScheduleOp::Allreduce { count: BYTES / 4 };
    for world in [2usize, 4] {
        for (name, allreduce) in
            [("ring", AllreduceAlgorithm::Ring), ("halving_doubling", AllreduceAlgorithm::HalvingDoubling)]
        {
            let options = PlanOptions { allreduce, ..PlanOptions::default() };
            let data = inputs(world);
            g.bench_function(format!("{name}/{world}_ranks"), |b| {
                b.iter_batched(
                    || data.clone(),
                    |data| {
                        let mut h = Harness::for_op(&op, 4, options, Some(sum), data, 1).expect("valid plan");
                        assert_eq!(h.run(), RunOutcome::Completed);
                        // Returned, so that freeing the buffers is not timed.
                        black_box(h.into_buffers())
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
