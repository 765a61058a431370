//! TCP collectives with ranks as tasks of one process on loopback.

mod common;

use std::time::Duration;

use cohort_core::{ReduceOp, Tensor};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_sums_across_ranks() {
    for world in [2u32, 3] {
        let pgs = common::group(world, common::opts(5)).await;
        let works: Vec<_> = pgs
            .iter()
            .map(|pg| pg.allreduce(vec![Tensor::from_slice(&[pg.rank().0 as f32 + 1.0; 5])], ReduceOp::Sum).unwrap())
            .collect();
        let want: f32 = (1..=world).map(|r| r as f32).sum();
        for w in works {
            let out = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap();
            assert_eq!(out, vec![Tensor::from_slice(&[want; 5])]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allgather_coalesced_returns_every_ranks_tensors_rank_major() {
    let world = 3u32;
    let pgs = common::group(world, common::opts(5)).await;
    let inputs = |r: u32| {
        let r = r as i32;
        vec![Tensor::from_slice(&[r, r * 10]), Tensor::from_slice_shaped(&[r; 6], &[2, 3]).unwrap()]
    };
    let works: Vec<_> = pgs.iter().map(|pg| pg.allgather_coalesced(inputs(pg.rank().0)).unwrap()).collect();
    let want: Vec<Tensor> = (0..world).flat_map(inputs).collect();
    for w in works {
        let out = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap();
        assert_eq!(out, want);
    }
    // Arguments are checked before anything is sent.
    let err = pgs[0].allgather_coalesced(Vec::new()).unwrap_err().to_string();
    assert!(err.contains("all_gather_coalesced") && err.contains("at least one tensor"), "{err}");
    let err = pgs[0]
        .allgather_coalesced(vec![Tensor::from_slice(&[1i32]), Tensor::from_slice(&[1.0f32])])
        .unwrap_err()
        .to_string();
    assert!(err.contains("all_gather_coalesced") && err.contains("dtype"), "{err}");
    // The group is still usable after refused calls.
    let works: Vec<_> =
        pgs.iter().map(|pg| pg.allgather_coalesced(vec![Tensor::from_slice(&[7u8])]).unwrap()).collect();
    for w in works {
        assert_eq!(w.await.unwrap(), vec![Tensor::from_slice(&[7u8]); 3]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_sparse_sums_duplicate_indices_across_ranks() {
    use cohort_transports::tcp::SparseTensor;
    let pgs = common::group(3, common::opts(5)).await;
    // Shape [4, 2], one sparse dim. Rank 0 holds rows 1 and 3, rank 1 row 1, rank 2 nothing.
    let part = |r: u32| match r {
        0 => SparseTensor::new(
            Tensor::from_slice_shaped(&[3i64, 1], &[2, 1]).unwrap(),
            Tensor::from_slice_shaped(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap(),
            vec![4, 2],
        ),
        1 => SparseTensor::new(
            Tensor::from_slice_shaped(&[1i64], &[1, 1]).unwrap(),
            Tensor::from_slice_shaped(&[10.0f32, 20.0], &[1, 2]).unwrap(),
            vec![4, 2],
        ),
        _ => SparseTensor::new(
            Tensor::zeros(cohort_core::DType::I64, &[0, 1]).unwrap(),
            Tensor::zeros(cohort_core::DType::F32, &[0, 2]).unwrap(),
            vec![4, 2],
        ),
    };
    let joins: Vec<_> = pgs
        .iter()
        .map(|pg| {
            let (pg, t) = (pg.clone(), part(pg.rank().0).unwrap());
            tokio::spawn(async move { pg.allreduce_sparse_async(t, ReduceOp::Sum).await })
        })
        .collect();
    for j in joins {
        let out = tokio::time::timeout(Duration::from_secs(5), j).await.expect("in time").unwrap().unwrap();
        assert_eq!(out.indices, Tensor::from_slice_shaped(&[1i64, 3], &[2, 1]).unwrap());
        assert_eq!(out.values, Tensor::from_slice_shaped(&[13.0f32, 24.0, 1.0, 2.0], &[2, 2]).unwrap());
        assert_eq!(out.shape, vec![4, 2]);
    }
    // Bad parts are refused naming the op and the argument.
    let err = SparseTensor::new(
        Tensor::from_slice_shaped(&[4i64], &[1, 1]).unwrap(),
        Tensor::from_slice_shaped(&[1.0f32, 2.0], &[1, 2]).unwrap(),
        vec![4, 2],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("all_reduce_sparse") && err.contains("indices") && err.contains("out of bounds"), "{err}");
    let err = SparseTensor::new(
        Tensor::from_slice_shaped(&[1i64], &[1, 1]).unwrap(),
        Tensor::from_slice_shaped(&[1.0f32], &[1, 1]).unwrap(),
        vec![4, 2],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("values") && err.contains("expected [1, 2]"), "{err}");
    let err = pgs[0].allreduce_sparse_async(part(0).unwrap(), ReduceOp::Max).await.unwrap_err();
    assert!(matches!(err, cohort_transports::tcp::SparseError::Submit(_)), "{err:?}");
    assert!(err.to_string().contains("only sum"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_larger_than_the_send_window_finish_exact() {
    // 24 MiB: each rank's sends to its peer are many more chunks than may be queued at once, so
    // the schedules pause and resume as their frames are written.
    let n = 6 << 20;
    let pgs = common::group(2, common::opts(60)).await;
    let input = |r: u32| Tensor::from_slice(&(0..n).map(|i| ((i % 1000) as u32 * (r + 1)) as f32).collect::<Vec<_>>());
    let works: Vec<_> = pgs.iter().map(|pg| pg.allreduce(vec![input(pg.rank().0)], ReduceOp::Sum).unwrap()).collect();
    let want = Tensor::from_slice(&(0..n).map(|i| ((i % 1000) * 3) as f32).collect::<Vec<_>>());
    for w in works {
        let out = tokio::time::timeout(Duration::from_secs(60), w).await.expect("in time").unwrap();
        assert!(out == vec![want.clone()], "allreduce result differs");
    }
    let works: Vec<_> = pgs.iter().map(|pg| pg.broadcast(vec![input(pg.rank().0)], 1).unwrap()).collect();
    for w in works {
        let out = tokio::time::timeout(Duration::from_secs(60), w).await.expect("in time").unwrap();
        assert!(out == vec![input(1)], "broadcast result differs");
    }
}
