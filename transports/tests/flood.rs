//! Malformed connections flood the store server and a rank's listener while real clients keep
//! working: nothing is lost, nobody else is disturbed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cohort_core::{ReduceOp, Tensor};
use cohort_transports::{
    MemoryStore, ProcessGroup, Store, TcpOptions, TcpStore, TcpStoreConfig, TcpStoreServer, TcpStoreServerConfig,
    TokioNet,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// What the attackers send: each a different way to be wrong.
fn garbage(i: usize) -> Vec<u8> {
    let mut g = match i % 7 {
        // Wrong magic in a VALIDATE.
        0 => vec![0, 0xde, 0xad, 0xbe, 0xef],
        // A SET announcing a 2^60-byte key.
        1 => {
            let mut v = vec![0, 0xce, 0xf7, 0x85, 0x3c, 1];
            v.extend_from_slice(&(1u64 << 60).to_le_bytes());
            v
        }
        // A truncated request, then EOF.
        2 => vec![0, 0xce, 0xf7, 0x85, 0x3c, 1, 5, 0, 0],
        // An unknown query type.
        3 => vec![0, 0xce, 0xf7, 0x85, 0x3c, 0xee],
        // A first request other than VALIDATE.
        4 => vec![3, 1, 0, 0, 0, 0, 0, 0, 0, b'k'],
        // A frame header of cohort's data plane with a huge length (for the rank's listener).
        5 => {
            let mut v = b"CoHF".to_vec();
            v.extend_from_slice(&[1, 0, 1, 0]);
            v.extend_from_slice(&[0xff; 32]);
            v
        }
        // Random-looking bytes.
        _ => (0..200u32).map(|x| (x.wrapping_mul(2_654_435_761) >> 13) as u8).collect(),
    };
    g.truncate(g.len().max(1));
    g
}

/// Open `n` connections to `addr`: most send garbage and close, some send nothing and hang on.
async fn flood(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut idle = Vec::new();
    for i in 0..n {
        let Ok(mut s) = TcpStream::connect(addr).await else { continue };
        if i % 10 == 9 {
            idle.push(s); // half-open: connects, never speaks
            continue;
        }
        let _ = s.write_all(&garbage(i)).await;
        if i % 3 == 0 {
            let _ = s.shutdown().await;
        }
    }
    idle
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_server_keeps_serving_through_a_flood_of_garbage() {
    let bind: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind)).await.unwrap();
    let addr = server.local_addr();
    let client = TcpStore::connect(TcpStoreConfig::new("127.0.0.1", addr.port()).with_timeout(Duration::from_secs(10)))
        .await
        .unwrap();

    let attackers: Vec<_> = (0..4).map(|k| tokio::spawn(async move { flood(addr, 150 + k).await })).collect();
    for i in 0..300u32 {
        client.set(&format!("key/{i}"), format!("value {i}").as_bytes()).await.expect("set during the flood");
        assert_eq!(client.add("counter", 1).await.expect("add during the flood"), i64::from(i) + 1);
        if i % 50 == 0 {
            tokio::task::yield_now().await;
        }
    }
    let mut idle = Vec::new();
    for a in attackers {
        idle.extend(a.await.unwrap());
    }
    for i in 0..300u32 {
        assert_eq!(client.get(&format!("key/{i}")).await.unwrap(), format!("value {i}").into_bytes(), "key/{i}");
    }
    assert_eq!(client.add("counter", 0).await.unwrap(), 300);
    // A fresh client is served too, while the idle attackers still hold their connections.
    let late = TcpStore::connect(TcpStoreConfig::new("127.0.0.1", addr.port())).await.unwrap();
    assert_eq!(late.get("key/299").await.unwrap(), b"value 299");
    assert_eq!(server.num_keys(), 301);
    assert!(idle.len() >= 50, "the attackers got through to the server: {} idle", idle.len());
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ranks_listener_shrugs_off_garbage_during_rendezvous() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let opts =
        TcpOptions { init_timeout: Duration::from_secs(10), timeout: Duration::from_secs(10), ..TcpOptions::default() };
    let connect = |r: u32| {
        let (store, opts) = (store.clone(), opts.clone());
        tokio::spawn(async move { ProcessGroup::connect(TokioNet, store, r, 2, opts).await })
    };
    // Rank 0 listens and waits for rank 1; the attackers get there first.
    let rank0 = connect(0);
    let published = store.wait_get("cohort/pg0/addr/0").await;
    let addr: SocketAddr = published.parse().unwrap_or_else(|_| panic!("an address: {published}"));
    let idle = flood(addr, 300).await;
    assert_eq!(idle.len(), 30, "the attackers reached the listener");
    let rank1 = connect(1);
    let pgs = [rank0.await.unwrap().expect("rank 0 connects"), rank1.await.unwrap().expect("rank 1 connects")];

    for step in 0..100 {
        let works: Vec<_> = pgs
            .iter()
            .map(|pg| pg.allreduce(vec![Tensor::from_slice(&[pg.rank().0 as f32 + step as f32; 64])], ReduceOp::Sum))
            .collect();
        for w in works {
            let out = tokio::time::timeout(Duration::from_secs(10), w.unwrap()).await.expect("in time").unwrap();
            assert_eq!(out, vec![Tensor::from_slice(&[1.0 + 2.0 * step as f32; 64])], "step {step}");
        }
    }
    assert!(pgs.iter().all(|pg| pg.failure().is_none()), "the group is healthy");
    drop(idle);
}

/// Waiting for a key, for tests.
trait WaitGet {
    async fn wait_get(&self, key: &str) -> String;
}

impl WaitGet for Arc<dyn Store> {
    async fn wait_get(&self, key: &str) -> String {
        for _ in 0..500 {
            if let Ok(v) = self.get(key).await {
                return String::from_utf8(v).expect("utf-8");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{key} never appeared in the store");
    }
}
