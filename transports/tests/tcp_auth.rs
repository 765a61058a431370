//! A shared secret (`COHORT_AUTH_TOKEN`): ranks that share it connect and run as without one,
//! eagerly and lazily; a rank with another secret, or with none, is refused on both sides with
//! an error naming it (the proofs themselves, replays and reflections: `core::protocol::auth`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_core::protocol::AuthSecret;
use cohort_core::{ReduceOp, Tensor};
use cohort_transports::{InitError, MemoryStore, TcpOptions};

fn with(secret: Option<&str>, lazy: bool) -> TcpOptions {
    TcpOptions {
        auth: secret.map(|s| AuthSecret::new(s.as_bytes()).unwrap()),
        lazy_connect: lazy,
        init_timeout: Duration::from_secs(4),
        ..common::opts(10)
    }
}

async fn allreduce_works(pgs: &[cohort_transports::ProcessGroup]) {
    let works: Vec<_> = pgs
        .iter()
        .map(|pg| pg.allreduce(vec![Tensor::from_slice(&[pg.rank().0 as f32 + 1.0; 4])], ReduceOp::Sum).unwrap())
        .collect();
    let n = pgs.len() as f32;
    for w in works {
        let out = tokio::time::timeout(Duration::from_secs(10), w).await.expect("in time").unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![n * (n + 1.0) / 2.0; 4]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_share_the_secret_connect_eagerly_and_lazily() {
    for lazy in [false, true] {
        let pgs = common::group(3, with(Some("s3cret"), lazy)).await;
        allreduce_works(&pgs).await;
        for pg in &pgs {
            pg.shutdown_async().await;
        }
    }
}

fn init_errors(results: Vec<Result<cohort_transports::ProcessGroup, InitError>>) -> Vec<String> {
    results.into_iter().map(|r| r.map(|_| ()).expect_err("a refused rank must not connect").to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_another_secret_is_refused_on_both_sides_naming_it() {
    let started = Instant::now();
    let errors = init_errors(common::connect_each(vec![with(Some("s3cret"), false), with(Some("guess"), false)]).await);
    // Rank 1 dials rank 0: it fails at once; rank 0 says why rank 1 never connected.
    assert!(
        errors[1].contains("handshake with rank 0 failed") && errors[1].contains("different secrets"),
        "{errors:?}"
    );
    assert!(errors[0].contains("handshake with rank 1 failed") && errors[0].contains("peer rank 1"), "{errors:?}");
    assert!(errors[0].contains("different secrets"), "{errors:?}");
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_without_a_secret_is_refused_where_one_is_required_and_the_other_way() {
    let errors = init_errors(common::connect_each(vec![with(Some("s3cret"), false), with(None, false)]).await);
    assert!(errors[0].contains("peer rank 1 does not authenticate, and this rank requires it"), "{errors:?}");
    assert!(errors[1].contains("authenticates, and this rank has no secret"), "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_rank_with_another_secret_fails_its_first_collective_naming_the_peer() {
    let store = Arc::new(MemoryStore::new());
    let pgs: Vec<_> = common::connect_each_on(store, vec![with(Some("s3cret"), true), with(Some("guess"), true)]).await;
    let pgs: Vec<_> = pgs.into_iter().map(|r| r.expect("lazy init connects nobody yet")).collect();
    let works: Vec<_> = pgs.iter().map(|pg| pg.allreduce(vec![Tensor::from_slice(&[1.0f32])], ReduceOp::Sum)).collect();
    let mut errors = Vec::new();
    for w in works {
        let e = tokio::time::timeout(Duration::from_secs(20), w.unwrap()).await.expect("fails in time").unwrap_err();
        errors.push(e.to_string());
    }
    assert!(errors.iter().any(|e| e.contains("different secrets")), "{errors:?}");
    for pg in &pgs {
        pg.shutdown_async().await;
    }
}

mod store {
    use std::time::Duration;

    use cohort_core::protocol::AuthSecret;
    use cohort_transports::store::{Store, StoreError, TcpStore, TcpStoreConfig, TcpStoreServer};
    use cohort_transports::{TcpStoreServerConfig, TokioNet};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn secret(s: &str) -> Option<AuthSecret> {
        AuthSecret::new(s.as_bytes())
    }

    async fn server(auth: Option<AuthSecret>) -> TcpStoreServer {
        let config = TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap()).with_auth(auth);
        TcpStoreServer::bind(TokioNet, config).await.unwrap()
    }

    async fn client(port: u16, auth: Option<AuthSecret>) -> Result<TcpStore, StoreError> {
        let config = TcpStoreConfig::new("127.0.0.1", port)
            .with_connect_timeout(Duration::from_secs(20))
            .with_timeout(Duration::from_secs(5))
            .with_auth(auth);
        TcpStore::connect(config).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_with_the_secret_is_served_and_others_are_refused_at_once() {
        let server = server(secret("s3cret")).await;
        let good = client(server.port(), secret("s3cret")).await.expect("the same secret connects");
        good.set("k", b"v").await.unwrap();
        assert_eq!(good.get("k").await.unwrap(), b"v");
        // Refusals fail at once, not after the 20 s connect timeout: retrying cannot help.
        let started = std::time::Instant::now();
        let e = client(server.port(), secret("guess")).await.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("the store's proof of the shared secret is wrong"), "{e}");
        let e = client(server.port(), None).await.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("it requires authentication (set COHORT_AUTH_TOKEN"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        let plain = self::server(None).await;
        let e = client(plain.port(), secret("s3cret")).await.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("it has no secret"), "{e}");
        assert_eq!(server.num_keys(), 1);
        server.shutdown().await;
        plain.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_speaks_only_pytorchs_protocol_is_disconnected_and_stores_nothing() {
        let server = server(secret("s3cret")).await;
        let mut raw = tokio::net::TcpStream::connect(("127.0.0.1", server.port())).await.unwrap();
        // VALIDATE, then SET "/k" "v", as PyTorch's client writes them.
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
        bytes.push(1);
        for part in [b"/k".as_slice(), b"v"] {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part);
        }
        raw.write_all(&bytes).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut buf)).await.expect("closed in time");
        assert!(matches!(n, Ok(0) | Err(_)), "the server closes the connection: {n:?}");
        assert_eq!(server.num_keys(), 0);
        server.shutdown().await;
    }
}
