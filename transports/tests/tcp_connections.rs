//! Several TCP connections between each pair of ranks (`connections_per_peer`, as Gloo's
//! option): large data frames spread over them, control and point-to-point frames keep their
//! order on the first, and a mismatch between ranks fails init on both sides at once.

mod common;

use std::time::{Duration, Instant};

use cohort_core::{DType, ReduceOp, Tensor};
use cohort_transports::TcpOptions;

fn opts(connections_per_peer: u16) -> TcpOptions {
    TcpOptions {
        init_timeout: Duration::from_secs(10),
        timeout: Duration::from_secs(10),
        connections_per_peer,
        ..TcpOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_and_p2p_are_right_over_three_connections_per_peer() {
    let world = 3u32;
    let pgs: Vec<_> = common::connect_each(vec![opts(3); 3]).await.into_iter().map(|r| r.expect("connect")).collect();
    // 4 MiB per rank: ring chunks far above the striping threshold.
    let n = 1 << 20;
    let input = |r: u32| Tensor::from_slice(&(0..n).map(|i| (i % 1000) as f32 + r as f32).collect::<Vec<_>>());
    for _ in 0..3 {
        let works: Vec<_> =
            pgs.iter().map(|pg| pg.allreduce(vec![input(pg.rank().0)], ReduceOp::Sum).unwrap()).collect();
        let want: Vec<f32> = (0..n).map(|i| 3.0 * (i % 1000) as f32 + 3.0).collect();
        for w in works {
            let out = tokio::time::timeout(Duration::from_secs(20), w).await.expect("in time").unwrap();
            assert!(out[0].to_vec::<f32>().unwrap() == want, "a wrong allreduce over striped connections");
        }
    }
    // Alltoall: every pair exchanges a large block.
    let block = 256 * 1024;
    let works: Vec<_> = pgs
        .iter()
        .map(|pg| {
            let r = pg.rank().0 as i32;
            let input = Tensor::from_slice(&(0..world as i32 * block).map(|i| r * 10 + i / block).collect::<Vec<_>>());
            let output = Tensor::zeros(DType::I32, &[(world as i32 * block) as usize]).unwrap();
            pg.alltoall_base(output, input, None, None).unwrap()
        })
        .collect();
    for (r, w) in works.into_iter().enumerate() {
        let out = w.await.unwrap()[0].to_vec::<i32>().unwrap();
        let want: Vec<i32> = (0..world as i32 * block).map(|i| (i / block) * 10 + r as i32).collect();
        assert!(out == want, "rank {r}: a wrong alltoall over striped connections");
    }
    // Point-to-point messages with one tag arrive in the order they were sent, large or small.
    let sizes = [300_000usize, 1, 70_000, 5, 1_000_000];
    let recvs: Vec<_> =
        sizes.iter().map(|&len| pgs[1].recv(Tensor::zeros(DType::U8, &[len]).unwrap(), 0, 7).unwrap()).collect();
    let sends: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(k, &len)| pgs[0].send(Tensor::from_slice(&vec![k as u8 + 1; len]), 1, 7).unwrap())
        .collect();
    for s in sends {
        s.await.unwrap();
    }
    for (k, r) in recvs.into_iter().enumerate() {
        let got = r.await.unwrap()[0].to_vec::<u8>().unwrap();
        assert_eq!(got.len(), sizes[k]);
        assert!(got.iter().all(|&b| b == k as u8 + 1), "message {k} arrived out of order");
    }
    for pg in &pgs {
        pg.shutdown_async().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_leaves_is_named_once_all_its_connections_close() {
    let mut pgs: Vec<_> =
        common::connect_each(vec![opts(2); 3]).await.into_iter().map(|r| r.expect("connect")).collect();
    // The survivors' allreduce is under way when rank 2 leaves cleanly: a goodbye on each of
    // its two connections, one departure.
    let works: Vec<_> = pgs[..2]
        .iter()
        .map(|pg| pg.allreduce(vec![Tensor::zeros(DType::F32, &[1 << 18]).unwrap()], ReduceOp::Sum).unwrap())
        .collect();
    let lost = pgs.pop().unwrap();
    lost.shutdown_async().await;
    for w in works {
        let err = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap_err().to_string();
        assert!(err.contains("rank 2"), "{err}");
    }
    // Later calls are refused with the same cause.
    let err = pgs[0].allreduce(vec![Tensor::zeros(DType::F32, &[4]).unwrap()], ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("rank 2"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_disagree_on_connections_per_peer_fail_init_at_once_naming_it() {
    let started = Instant::now();
    let results = common::connect_each(vec![opts(1), opts(2)]).await;
    for (r, result) in results.into_iter().enumerate() {
        let err = result.expect_err("a mismatch must not connect").to_string();
        assert!(err.contains("connection(s) per peer"), "rank {r}: {err}");
    }
    assert!(started.elapsed() < Duration::from_secs(5), "failed only after {:?}", started.elapsed());
    let err = common::connect_each(vec![opts(0)]).await.pop().unwrap().unwrap_err().to_string();
    assert!(err.contains("connections_per_peer is 0, expected 1 to 16"), "{err}");
}
