//! Reduction kernels against a plain copy of the same bytes: the kernels must run at memory
//! speed (issue target: f32 Sum over 1 MiB within 2x the time of the copy).
//!
//! Run: `cargo bench -p cohort-core --bench reduce`

use std::hint::black_box;

use cohort_core::{DType, ReduceOp, Reduction};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BYTES: usize = 1 << 20;

fn buffers(dtype: DType) -> (Vec<u64>, Vec<u64>) {
    // u64 words keep the byte views 8-byte aligned, as tensor storage is.
    let words = BYTES / 8;
    let mut a = vec![0u64; words];
    let mut b = vec![0u64; words];
    // Small finite values for every dtype: byte patterns 0x01..0x3f.
    for (i, (x, y)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
        let v = 0x0101_0101_0101_0101u64 * ((i % 63) as u64 + 1);
        *x = if dtype.is_floating_point() { v & 0x3f3f_3f3f_3f3f_3f3f } else { v };
        *y = *x ^ 0x0001_0001_0001_0001;
    }
    (a, b)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_1MiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    {
        let (mut a, b) = buffers(DType::F32);
        g.bench_function("copy", |bench| {
            bench.iter(|| {
                a.copy_from_slice(black_box(&b));
                black_box(&a);
            })
        });
    }
    for (name, op, dtype) in [
        ("f32_sum", ReduceOp::Sum, DType::F32),
        ("f32_max", ReduceOp::Max, DType::F32),
        ("f64_sum", ReduceOp::Sum, DType::F64),
        ("i32_sum", ReduceOp::Sum, DType::I32),
        ("u8_bxor", ReduceOp::BXor, DType::U8),
        ("bf16_sum", ReduceOp::Sum, DType::Bf16),
        ("f16_sum", ReduceOp::Sum, DType::F16),
    ] {
        let r = Reduction::new(op, dtype).expect("supported");
        let (mut a, b) = buffers(dtype);
        g.bench_function(name, |bench| {
            bench.iter(|| {
                let acc: &mut [u8] = bytemuck::cast_slice_mut(&mut a);
                r.combine(acc, black_box(bytemuck::cast_slice(&b))).expect("same length");
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
