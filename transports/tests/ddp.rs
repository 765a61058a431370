//! DDP communication with ranks as tasks of one process on loopback: bucketed reduction equals
//! per-tensor allreduce, compression hooks stay within tolerance, PowerSGD converges, errors
//! name the parameter or the rank.

mod common;

use std::time::Duration;

use cohort_core::{DType, ReduceOp, Tensor};
use cohort_transports::ProcessGroup;
use cohort_transports::ddp::{
    AllreduceHook, BucketCaps, CommHook, CompressHook, DdpError, PowerSgdConfig, PowerSgdHook, Reducer,
    broadcast_coalesced,
};

/// A model's parameter shapes: matrices, vectors, a scalar-ish bias, an odd size.
fn shapes() -> Vec<Vec<usize>> {
    vec![vec![64, 32], vec![32], vec![300, 17], vec![1], vec![17, 5], vec![5], vec![1000]]
}

/// Rank r's gradient of parameter p: small integers, so sums are exact in any order.
fn grad(r: u32, p: usize, shape: &[usize], step: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 7 + p * 3 + step as usize + r as usize * 5) % 13) as f32).collect();
    Tensor::from_slice_shaped(&v, shape).unwrap()
}

async fn run_reducer(pgs: &[ProcessGroup], make_hook: impl Fn() -> Box<dyn CommHook>, steps: u32) -> Vec<Vec<Tensor>> {
    let caps = BucketCaps { first: 4096, rest: 16_000 };
    let mut tasks = Vec::new();
    for pg in pgs {
        let mut reducer = Reducer::with_caps(pg.clone(), shapes(), DType::F32, make_hook(), caps).unwrap();
        assert!(reducer.buckets().len() >= 3, "{:?}", reducer.buckets());
        let r = pg.rank().0;
        tasks.push(tokio::spawn(async move {
            let mut last = Vec::new();
            for step in 0..steps {
                // Every rank marks its gradients in its own order (reverse, with a twist).
                let mut order: Vec<usize> = (0..shapes().len()).rev().collect();
                order.rotate_left(r as usize % 3);
                for p in order {
                    reducer.mark_ready(p, &grad(r, p, &shapes()[p], step)).unwrap();
                }
                last = reducer.finish_async().await.expect("the step");
            }
            last
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(tokio::time::timeout(Duration::from_secs(60), t).await.expect("in time").unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_average_hook_equals_a_per_tensor_allreduce_exactly() {
    let pgs = common::group(3, common::opts(10)).await;
    let got = run_reducer(&pgs, || Box::new(AllreduceHook), 2).await;
    for (p, shape) in shapes().iter().enumerate() {
        // The per-tensor reference, through the same group.
        let works: Vec<_> =
            pgs.iter().map(|pg| pg.allreduce(vec![grad(pg.rank().0, p, shape, 1)], ReduceOp::Avg).unwrap()).collect();
        for (r, w) in works.into_iter().enumerate() {
            let want = w.await.unwrap().pop().unwrap();
            assert_eq!(got[r][p], want, "rank {r} param {p}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_hooks_stay_within_tolerance() {
    let pgs = common::group(2, common::opts(10)).await;
    for (name, hook, tol) in [("fp16", CompressHook::fp16(), 1e-3f32), ("bf16", CompressHook::bf16(), 1e-2)] {
        let got = run_reducer(&pgs, || Box::new(hook), 1).await;
        for (p, shape) in shapes().iter().enumerate() {
            let a = grad(0, p, shape, 0).to_vec::<f32>().unwrap();
            let b = grad(1, p, shape, 0).to_vec::<f32>().unwrap();
            for (r, out) in got.iter().enumerate() {
                let v = out[p].to_vec::<f32>().unwrap();
                assert_eq!(out[p].shape(), shape.as_slice());
                for i in 0..v.len() {
                    let want = (a[i] + b[i]) / 2.0;
                    assert!(
                        (v[i] - want).abs() <= tol * want.abs().max(1.0),
                        "{name} rank {r} p{p}[{i}]: {} vs {want}",
                        v[i]
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn powersgd_converges_to_the_exact_average_on_a_low_rank_gradient() {
    let pgs = common::group(2, common::opts(10)).await;
    let (n, m) = (48usize, 40usize);
    // Rank r's gradient: u₁ a_rᵀ + u₂ b_rᵀ, rank 2 with the same column space on every rank;
    // the average is rank 2 too, which a rank-2 approximation can reach exactly.
    let u1: Vec<f32> = (0..n).map(|i| ((i % 5) as f32 - 2.0) * 0.5 + 0.1).collect();
    let u2: Vec<f32> = (0..n).map(|i| ((i * 3 % 7) as f32) * 0.25 - 0.6).collect();
    let mat = |r: u32| -> Vec<f32> {
        (0..n * m)
            .map(|k| {
                let (i, j) = (k / m, k % m);
                let a = (j % 7) as f32 * 0.3 + r as f32 * ((j % 3) as f32 - 1.0);
                let b = (j % 4) as f32 * 0.2 - r as f32 * 0.1;
                u1[i] * a + u2[i] * b
            })
            .collect()
    };
    let bias = |r: u32| -> Vec<f32> { (0..m).map(|i| i as f32 + r as f32).collect() };
    let exact: Vec<f32> = mat(0).iter().zip(mat(1)).map(|(a, b)| (a + b) / 2.0).collect();
    let config = PowerSgdConfig { rank: 2, start_iter: 2, ..PowerSgdConfig::default() };
    let mut tasks = Vec::new();
    for pg in &pgs {
        let hook = PowerSgdHook::new(config.clone()).unwrap();
        let mut reducer = Reducer::new(pg.clone(), vec![vec![n, m], vec![m]], DType::F32, Box::new(hook)).unwrap();
        let r = pg.rank().0;
        let (g, b) = (Tensor::from_slice_shaped(&mat(r), &[n, m]).unwrap(), Tensor::from_slice(&bias(r)));
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            for _ in 0..8 {
                reducer.mark_ready(1, &b).unwrap();
                reducer.mark_ready(0, &g).unwrap();
                let out = reducer.finish_async().await.unwrap();
                errors.push(out);
            }
            errors
        }));
    }
    for t in tasks {
        let steps = t.await.unwrap();
        let rel = |out: &Vec<Tensor>| {
            let v = out[0].to_vec::<f32>().unwrap();
            let num: f32 = v.iter().zip(&exact).map(|(a, b)| (a - b) * (a - b)).sum();
            (num / exact.iter().map(|x| x * x).sum::<f32>()).sqrt()
        };
        // Vanilla allreduce for the first two steps: exact.
        assert!(rel(&steps[0]) < 1e-6 && rel(&steps[1]) < 1e-6);
        // Then compressed: the power iteration finds the average's column space, and the
        // approximation is the exact average (to f32 rounding) from then on.
        for (k, out) in steps.iter().enumerate().skip(2) {
            let e = rel(out);
            assert!(e < 1e-4, "relative error at step {k}: {e}");
        }
        // The bias (1-d) is never compressed: exact every step.
        let want: Vec<f32> = (0..m).map(|i| i as f32 + 0.5).collect();
        assert_eq!(steps.last().unwrap()[1].to_vec::<f32>().unwrap(), want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_coalesced_equals_broadcasting_each_tensor() {
    let pgs = common::group(3, common::opts(10)).await;
    let tensors = |r: u32| {
        vec![
            Tensor::from_slice(&[r as f32; 100]),
            Tensor::from_slice(&[i64::from(r) * 7; 3]),
            Tensor::from_slice_shaped(&[r as f32 + 0.5; 600], &[20, 30]).unwrap(),
            Tensor::from_f64s(DType::F16, &[f64::from(r); 9]),
            Tensor::from_slice(&[r as f32; 1]),
        ]
    };
    let mut joins = Vec::new();
    for pg in &pgs {
        let pg = pg.clone();
        // 1 KiB buckets: several per dtype, and the 2400-byte tensor alone.
        joins.push(tokio::task::spawn_blocking(move || broadcast_coalesced(&pg, tensors(pg.rank().0), 1024, 1)));
    }
    for j in joins {
        assert_eq!(j.await.unwrap().unwrap(), tensors(1));
    }
    let err = broadcast_coalesced(&pgs[0], tensors(0), 1024, 3).unwrap_err();
    assert!(err.to_string().contains("root rank 3"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_names_the_parameter() {
    let pgs = common::group(1, common::opts(10)).await;
    let mut reducer = Reducer::new(pgs[0].clone(), shapes(), DType::F32, Box::new(AllreduceHook))
        .unwrap()
        .with_names((0..shapes().len()).map(|p| format!("layer{p}.weight")).collect());
    reducer.mark_ready(2, &grad(0, 2, &shapes()[2], 0)).unwrap();
    let twice = reducer.mark_ready(2, &grad(0, 2, &shapes()[2], 0)).unwrap_err();
    assert!(twice.to_string().contains("parameter 2 (layer2.weight) was marked ready twice"), "{twice}");
    let wrong = reducer.mark_ready(1, &Tensor::from_slice(&[1.0f32; 3])).unwrap_err();
    assert!(wrong.to_string().contains("gradient of parameter 1 (layer1.weight)"), "{wrong}");
    assert!(matches!(reducer.mark_ready(99, &Tensor::from_slice(&[1.0f32])), Err(DdpError::NoSuchParam { .. })));
    for p in [0, 3, 4, 5, 6] {
        reducer.mark_ready(p, &grad(0, p, &shapes()[p], 0)).unwrap();
    }
    let missing = reducer.finish_async().await.unwrap_err();
    assert!(missing.to_string().contains("parameter(s) 1 (layer1.weight) never got a gradient"), "{missing}");
    // The next step starts clean.
    for p in 0..shapes().len() {
        reducer.mark_ready(p, &grad(0, p, &shapes()[p], 0)).unwrap();
    }
    assert_eq!(reducer.finish_async().await.unwrap().len(), shapes().len());
}
