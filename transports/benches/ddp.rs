//! DDP gradient reduction, 2 ranks in one process over loopback: a ResNet-50-shaped gradient
//! set (161 tensors, 25.6 M parameters, 102 MB of f32) reduced with one allreduce per tensor,
//! then bucketed through the Reducer with each comm hook.
//!
//! Run: `cargo bench -p cohort-transports --bench ddp`

use std::sync::Arc;
use std::time::Duration;

use cohort_core::{DType, ReduceOp, Tensor};
use cohort_transports::ddp::{AllreduceHook, CommHook, CompressHook, PowerSgdConfig, PowerSgdHook, Reducer};
use cohort_transports::{MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

/// ResNet-50's parameter shapes, in registration order.
fn resnet50() -> Vec<Vec<usize>> {
    let mut s = vec![vec![64, 3, 7, 7], vec![64], vec![64]];
    let mut inp = 64;
    for (blocks, w) in [(3, 64), (4, 128), (6, 256), (3, 512)] {
        for b in 0..blocks {
            s.extend([vec![w, inp, 1, 1], vec![w], vec![w], vec![w, w, 3, 3], vec![w], vec![w]]);
            s.extend([vec![4 * w, w, 1, 1], vec![4 * w], vec![4 * w]]);
            if b == 0 {
                s.extend([vec![4 * w, inp, 1, 1], vec![4 * w], vec![4 * w]]);
            }
            inp = 4 * w;
        }
    }
    s.extend([vec![1000, 2048], vec![1000]]);
    s
}

fn grads(rank: u32, shapes: &[Vec<usize>]) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(p, shape)| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| ((i + p + rank as usize) % 17) as f32 * 0.01).collect();
            Tensor::from_slice_shaped(&v, shape).expect("shape")
        })
        .collect()
}

async fn group() -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let opts = TcpOptions { timeout: Duration::from_secs(120), ..TcpOptions::default() };
    let joins: Vec<_> = (0..2)
        .map(|r| {
            let (store, opts) = (store.clone(), opts.clone());
            tokio::spawn(async move { ProcessGroup::connect(TokioNet, store, r, 2, opts).await })
        })
        .collect();
    let mut pgs = Vec::new();
    for j in joins {
        pgs.push(j.await.expect("joined").expect("connect"));
    }
    pgs
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let pgs = rt.block_on(group());
    // `cargo bench` passes --bench; `cargo test --benches` runs each bench once, in a debug
    // build: a slice of the model keeps that quick.
    let full = std::env::args().any(|a| a == "--bench");
    let shapes = if full { resnet50() } else { resnet50().into_iter().take(20).collect() };
    let numel: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let data: Vec<Arc<Vec<Tensor>>> = (0..2).map(|r| Arc::new(grads(r, &shapes))).collect();

    let mut g = c.benchmark_group(format!("ddp_resnet50_{:.1}M_params_2_ranks", numel as f64 / 1e6));
    g.sample_size(10).measurement_time(Duration::from_secs(20)).throughput(Throughput::Bytes(numel as u64 * 4));

    g.bench_function("per_tensor_allreduce", |b| {
        b.iter(|| {
            rt.block_on(async {
                let tasks: Vec<_> = pgs
                    .iter()
                    .zip(&data)
                    .map(|(pg, d)| {
                        let (pg, d) = (pg.clone(), d.clone());
                        tokio::spawn(async move {
                            let works: Vec<_> = d
                                .iter()
                                .rev()
                                .map(|t| pg.allreduce(vec![t.clone()], ReduceOp::Avg).expect("ok"))
                                .collect();
                            for w in works {
                                w.await.expect("allreduce");
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("rank");
                }
            })
        })
    });

    type MakeHook = fn() -> Box<dyn CommHook>;
    let hooks: [(&str, MakeHook); 4] = [
        ("bucketed_allreduce_hook", || Box::new(AllreduceHook)),
        ("bucketed_fp16_compress", || Box::new(CompressHook::fp16())),
        ("bucketed_bf16_compress", || Box::new(CompressHook::bf16())),
        ("bucketed_powersgd_rank4", || {
            let cfg = PowerSgdConfig { rank: 4, start_iter: 2, ..PowerSgdConfig::default() };
            Box::new(PowerSgdHook::new(cfg).expect("valid"))
        }),
    ];
    for (name, make) in hooks {
        let reducers: Vec<_> = pgs
            .iter()
            .map(|pg| {
                Arc::new(tokio::sync::Mutex::new(
                    Reducer::new(pg.clone(), shapes.clone(), DType::F32, make()).expect("reducer"),
                ))
            })
            .collect();
        let step = || {
            rt.block_on(async {
                let tasks: Vec<_> = reducers
                    .iter()
                    .zip(&data)
                    .map(|(red, d)| {
                        let (red, d) = (red.clone(), d.clone());
                        tokio::spawn(async move {
                            let mut red = red.lock().await;
                            for (p, t) in d.iter().enumerate().rev() {
                                red.mark_ready(p, t).expect("ready");
                            }
                            red.finish_async().await.expect("step")
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("rank");
                }
            })
        };
        // PowerSGD's first steps are plain allreduce; time the compressed ones.
        step();
        step();
        g.bench_function(name, |b| b.iter(step));
    }
    g.finish();
    for pg in &pgs {
        pg.shutdown();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
