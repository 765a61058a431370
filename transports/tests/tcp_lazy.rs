//! Lazy connection (`lazy_connect`, Gloo's lazy init): init connects nobody, a peer is dialed
//! on first use, and whichever side (or both) connects first, what each rank sends arrives in
//! order.

mod common;

use std::sync::Arc;
use std::time::Duration;

use cohort_core::{DType, Rank, ReduceOp, Tensor};
use cohort_transports::{MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};

fn lazy(connections_per_peer: u16) -> TcpOptions {
    TcpOptions {
        init_timeout: Duration::from_secs(2),
        timeout: Duration::from_secs(10),
        connections_per_peer,
        lazy_connect: true,
        ..TcpOptions::default()
    }
}

fn ranks(v: &[u32]) -> Vec<Rank> {
    v.iter().copied().map(Rank).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_connect_on_first_use_only() {
    for k in [1u16, 2] {
        let pgs: Vec<_> = common::connect_each(vec![lazy(k); 4]).await.into_iter().map(|r| r.expect("init")).collect();
        assert!(pgs.iter().all(|pg| pg.connected_peers().is_empty()), "init connects nobody");
        // A ring of sends: each rank talks to its two neighbours only.
        let recvs: Vec<_> = pgs
            .iter()
            .map(|pg| pg.recv(Tensor::zeros(DType::I64, &[3]).unwrap(), (pg.rank().0 + 3) % 4, 1).unwrap())
            .collect();
        let sends: Vec<_> = pgs
            .iter()
            .map(|pg| pg.send(Tensor::from_slice(&[i64::from(pg.rank().0); 3]), (pg.rank().0 + 1) % 4, 1).unwrap())
            .collect();
        for s in sends {
            tokio::time::timeout(Duration::from_secs(5), s).await.expect("in time").unwrap();
        }
        for (r, w) in recvs.into_iter().enumerate() {
            let got = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap();
            assert_eq!(got, vec![Tensor::from_slice(&[(r as i64 + 3) % 4; 3])]);
        }
        // Wait for the receivers' side to count the connections they accepted.
        for _ in 0..200 {
            if pgs.iter().all(|pg| pg.connected_peers().len() == 2) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pgs[0].connected_peers(), ranks(&[1, 3]), "rank 0 never talked to rank 2");
        assert_eq!(pgs[2].connected_peers(), ranks(&[1, 3]));
        // An alltoall needs everyone: the rest connect now, and every result is right.
        let works: Vec<_> = pgs
            .iter()
            .map(|pg| {
                let r = pg.rank().0 as i32;
                let input = Tensor::from_slice(&(0..4).map(|to| r * 10 + to).collect::<Vec<_>>());
                pg.alltoall_base(Tensor::zeros(DType::I32, &[4]).unwrap(), input, None, None).unwrap()
            })
            .collect();
        for (r, w) in works.into_iter().enumerate() {
            let got = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap();
            assert_eq!(got, vec![Tensor::from_slice(&(0..4).map(|from| from * 10 + r as i32).collect::<Vec<_>>())]);
        }
        assert!(pgs.iter().all(|pg| pg.connected_peers().len() == 3));
        for pg in &pgs {
            pg.shutdown_async().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_connecting_at_once_keep_every_message_in_order() {
    for round in 0..5 {
        let pgs: Vec<_> =
            common::connect_each(vec![lazy(1 + round % 2); 2]).await.into_iter().map(|r| r.expect("init")).collect();
        // Both ranks send first, at once: each dials the other.
        let mut works = Vec::new();
        for pg in &pgs {
            let peer = 1 - pg.rank().0;
            for m in 0..20u8 {
                let len = if m % 3 == 0 { 200_000 } else { 3 };
                works.push((pg.rank().0, m, len, pg.recv(Tensor::zeros(DType::U8, &[len]).unwrap(), peer, 0).unwrap()));
            }
            for m in 0..20u8 {
                let len = if m % 3 == 0 { 200_000 } else { 3 };
                pg.send(Tensor::from_slice(&vec![m + 10 * pg.rank().0 as u8; len]), peer, 0).unwrap();
            }
        }
        for (r, m, len, w) in works {
            let got = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap();
            let want = m + 10 * (1 - r) as u8;
            let v = got[0].to_vec::<u8>().unwrap();
            assert!(v.len() == len && v.iter().all(|&b| b == want), "round {round}: rank {r} message {m} out of order");
        }
        // And collectives over the same connections.
        let works: Vec<_> = pgs
            .iter()
            .map(|pg| pg.allreduce(vec![Tensor::from_slice(&[1.0f32; 1000])], ReduceOp::Sum).unwrap())
            .collect();
        for w in works {
            assert_eq!(w.await.unwrap(), vec![Tensor::from_slice(&[2.0f32; 1000])]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_init_still_names_the_missing_rank_and_a_dead_peer_is_named_at_first_use() {
    // Only ranks 0 and 1 of 3 come.
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (a, b) = tokio::join!(
        ProcessGroup::connect(TokioNet, store.clone(), 0, 3, lazy(1)),
        ProcessGroup::connect(TokioNet, store.clone(), 1, 3, lazy(1)),
    );
    for r in [a, b] {
        let err = r.unwrap_err().to_string();
        assert!(err.contains("2/3 ranks joined; missing: [2]"), "{err}");
    }
    // Rank 2 leaves before anyone talked to it; rank 0's first send to it fails naming it.
    let mut pgs: Vec<_> = common::connect_each(vec![lazy(1); 3]).await.into_iter().map(|r| r.expect("init")).collect();
    let gone = pgs.pop().unwrap();
    gone.shutdown_async().await;
    drop(gone);
    let send = pgs[0].send(Tensor::from_slice(&[1u8]), 2, 0).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), send).await.expect("bounded").unwrap_err().to_string();
    assert!(err.contains("rank 2"), "{err}");
    // Rank 1 never talked to either; it learns the failure and its culprit through the store.
    let mut learned = None;
    for _ in 0..400 {
        learned = pgs[1].failure();
        if learned.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let failure = learned.expect("rank 1 learns of the failure");
    assert_eq!(failure.culprit(), Some(Rank(2)), "{failure:?}");
}
