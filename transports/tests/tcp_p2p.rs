//! The TCP backend's mesh and point-to-point path, ranks as tasks of one process on loopback.

mod common;

use std::sync::Arc;
use std::time::Duration;

use cohort_core::group::ErrorHandling;
use cohort_core::{Rank, Tensor, WorkState};
use cohort_transports::{InitError, MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};

fn opts() -> TcpOptions {
    TcpOptions { init_timeout: Duration::from_secs(5), timeout: Duration::from_secs(5), ..TcpOptions::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_and_recv_anysource_carry_tensors_and_tags() {
    let pgs = common::group(3, opts()).await;
    let recv = pgs[1].recv(Tensor::from_slice(&[0f32; 3]), 0, 7).unwrap();
    pgs[0].send(Tensor::from_slice(&[1.0f32, 2.0, 3.0]), 1, 7).unwrap().await.unwrap();
    assert_eq!(recv.await.unwrap(), vec![Tensor::from_slice(&[1.0f32, 2.0, 3.0])]);

    // A message that arrives before its recv is posted waits in the inbox; tags keep order apart.
    pgs[2].send(Tensor::from_slice(&[5i64]), 0, 1).unwrap().await.unwrap();
    pgs[2].send(Tensor::from_slice(&[6i64]), 0, 2).unwrap().await.unwrap();
    let any = pgs[0].recv_anysource(Tensor::from_slice(&[0i64]), 2).unwrap();
    assert_eq!(any.clone().await.unwrap(), vec![Tensor::from_slice(&[6i64])]);
    assert_eq!(any.source_rank(), Some(Rank(2)));
    let tag1 = pgs[0].recv(Tensor::from_slice(&[0i64]), 2, 1).unwrap();
    assert_eq!(tag1.await.unwrap(), vec![Tensor::from_slice(&[5i64])]);

    // A size mismatch is an error naming the sender, not a panic.
    pgs[1].send(Tensor::from_slice(&[1u8, 2]), 2, 0).unwrap().await.unwrap();
    let err = pgs[2].recv(Tensor::from_slice(&[0u8; 3]), 1, 0).unwrap().await.unwrap_err();
    assert!(err.to_string().contains("recv from rank 1: 2 bytes arrived for a tensor of 3 bytes"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_away_fails_pending_works_naming_it() {
    let pgs = common::group(3, opts()).await;
    let pending = pgs[0].recv(Tensor::from_slice(&[0f32]), 2, 0).unwrap();
    pgs[2].shutdown();
    let err = tokio::time::timeout(Duration::from_secs(5), pending).await.expect("noticed in time").unwrap_err();
    assert_eq!(err.culprit(), Some(Rank(2)), "{err}");
    assert!(err.to_string().contains("rank 2"), "{err}");
    // CleanUpOnly: the group failed; later calls are refused with the original cause.
    let later = pgs[0].send(Tensor::from_slice(&[1f32]), 1, 0).unwrap_err();
    assert!(later.to_string().contains("rank 2"), "{later}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recv_nobody_answers_times_out_naming_op_and_seq() {
    let o = TcpOptions { timeout: Duration::from_millis(300), error_handling: ErrorHandling::NoHandling, ..opts() };
    let pgs = common::group(2, o).await;
    let w = pgs[1].recv(Tensor::from_slice(&[0f32]), 0, 0).unwrap();
    let err = w.clone().await.unwrap_err();
    assert_eq!(w.state(), WorkState::TimedOut);
    assert!(err.to_string().contains("recv (seq 1)"), "{err}");
    assert!(err.to_string().contains("timeout 300 ms"), "{err}");
    // The flight recorder saw it.
    let dump = pgs[1].flight_recorder_json();
    assert!(dump.contains("\"tcp:recv 1<-0\""), "{dump}");
    assert!(dump.contains("\"cohort_state\":\"timed_out\""), "{dump}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_rank_is_named_when_init_times_out() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let o = TcpOptions { init_timeout: Duration::from_millis(400), ..opts() };
    let (a, b) = tokio::join!(
        ProcessGroup::connect(TokioNet, store.clone(), 0, 3, o.clone()),
        ProcessGroup::connect(TokioNet, store.clone(), 2, 3, o.clone()),
    );
    for r in [a, b] {
        let err = r.unwrap_err();
        assert!(matches!(err, InitError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("2/3 ranks joined; missing: [1]"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_world_size_is_refused_on_both_sides() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let o = TcpOptions { init_timeout: Duration::from_secs(2), ..opts() };
    let (a, b) = tokio::join!(
        ProcessGroup::connect(TokioNet, store.clone(), 0, 2, o.clone()),
        ProcessGroup::connect(TokioNet, store.clone(), 1, 3, o.clone()),
    );
    let (a, b) = (a.unwrap_err().to_string(), b.unwrap_err().to_string());
    assert!(a.contains("world size"), "{a}");
    assert!(b.contains("world size"), "{b}");
}
