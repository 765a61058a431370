//! `monitored_barrier` on the TCP backend, ranks as tasks of one process on loopback.

mod common;

use std::time::Duration;

use cohort_core::Rank;
use cohort_transports::tcp::MonitoredBarrierError;
use cohort_transports::{ProcessGroup, TcpOptions};

fn opts() -> TcpOptions {
    TcpOptions { init_timeout: Duration::from_secs(5), timeout: Duration::from_secs(20), ..TcpOptions::default() }
}

/// Run the barrier on `ranks` concurrently; the result of each, by rank.
async fn barrier_on(
    pgs: &[ProcessGroup],
    ranks: &[u32],
    timeout: Duration,
    wait_all: bool,
) -> Vec<(u32, Result<(), MonitoredBarrierError>)> {
    common::concurrently(ranks.iter().map(|&r| {
        let pg = pgs[r as usize].clone();
        async move { (r, pg.monitored_barrier_async(timeout, wait_all).await) }
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rank_passes_when_all_arrive_and_again_after() {
    let pgs = common::group(3, opts()).await;
    for _ in 0..2 {
        for (r, res) in barrier_on(&pgs, &[0, 1, 2], Duration::from_secs(10), false).await {
            assert!(res.is_ok(), "rank {r}: {res:?}");
        }
    }
    // A rank that is merely late (within the timeout) still passes.
    let late = pgs[2].clone();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        late.monitored_barrier_async(Duration::from_secs(10), true).await
    });
    for (r, res) in barrier_on(&pgs, &[0, 1], Duration::from_secs(10), true).await {
        assert!(res.is_ok(), "rank {r}: {res:?}");
    }
    late.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_0_names_every_missing_rank_with_wait_all_ranks_and_others_name_rank_0() {
    let pgs = common::group(4, opts()).await;
    let results = barrier_on(&pgs, &[0, 2], Duration::from_millis(500), true).await;
    let err0 = results[0].1.clone().unwrap_err();
    assert_eq!(err0.culprits(), vec![Rank(1), Rank(3)], "{err0}");
    assert!(err0.to_string().starts_with("Ranks 1, 3 failed to pass monitoredBarrier in 500 ms"), "{err0}");
    let err2 = results[1].1.clone().unwrap_err();
    assert_eq!(err2.culprits(), vec![Rank(0)], "{err2}");
    assert!(err2.to_string().contains("rank 0 did not acknowledge it within 500 ms"), "{err2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_wait_all_ranks_rank_0_names_the_first_missing_rank_only() {
    let pgs = common::group(4, opts()).await;
    let results = barrier_on(&pgs, &[0, 2], Duration::from_millis(300), false).await;
    let err0 = results[0].1.clone().unwrap_err();
    assert_eq!(err0.culprits(), vec![Rank(1)], "{err0}");
    assert!(err0.to_string().starts_with("Rank 1 failed to pass monitoredBarrier in 300 ms"), "{err0}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_blocking_from_async_code_are_refused() {
    let pgs = common::group(2, opts()).await;
    let err = pgs[0].monitored_barrier_async(Duration::ZERO, false).await.unwrap_err();
    assert!(err.to_string().contains("monitored_barrier: timeout must be positive"), "{err}");
    let err = pgs[1].monitored_barrier(Duration::from_secs(1), false).unwrap_err();
    assert_eq!(err, MonitoredBarrierError::InAsyncContext);
}
