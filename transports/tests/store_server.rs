//! Our TcpStore client against our TcpStoreServer on loopback: every command, concurrency,
//! waits, races, garbage clients, and start-up errors.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cohort_core::store::{Request, VALIDATION_MAGIC};
use cohort_transports::store::{Store, StoreError, StoreServerError, TcpStore, TcpStoreConfig, TcpStoreServer};
use cohort_transports::{TcpStoreServerConfig, TokioNet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn server() -> TcpStoreServer {
    TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap())).await.unwrap()
}

fn config(server: &TcpStoreServer) -> TcpStoreConfig {
    TcpStoreConfig::new("127.0.0.1", server.port()).with_timeout(Duration::from_secs(10))
}

async fn client(server: &TcpStoreServer) -> TcpStore {
    TcpStore::connect(config(server)).await.unwrap()
}

#[tokio::test]
async fn every_command_works_against_our_server() {
    let server = server().await;
    let store = client(&server).await;

    store.set("a", b"1").await.unwrap();
    assert_eq!(store.get("a").await.unwrap(), b"1");
    assert_eq!(store.add("n", 5).await.unwrap(), 5);
    assert_eq!(store.add("n", -2).await.unwrap(), 3);
    assert_eq!(store.get("n").await.unwrap(), b"3");
    assert_eq!(store.compare_set("c", b"", b"first").await.unwrap(), b"first");
    assert_eq!(store.compare_set("c", b"wrong", b"second").await.unwrap(), b"first");
    assert_eq!(store.compare_set("c", b"first", b"second").await.unwrap(), b"second");
    assert_eq!(store.compare_set("missing", b"x", b"y").await.unwrap(), b"x");
    assert!(store.check(&["a", "n", "c"]).await.unwrap());
    assert!(!store.check(&["a", "missing"]).await.unwrap());
    store.wait(&["a", "c"], Duration::from_secs(1)).await.unwrap();
    store.append("c", b"!").await.unwrap();
    store.append("fresh", b"new").await.unwrap();
    assert_eq!(store.get("c").await.unwrap(), b"second!");
    assert_eq!(store.get("fresh").await.unwrap(), b"new");
    store.multi_set(&[("m1", b"x"), ("m2", b"")]).await.unwrap();
    assert_eq!(store.multi_get(&["m2", "m1", "a"]).await.unwrap(), [b"".to_vec(), b"x".to_vec(), b"1".to_vec()]);
    assert_eq!(store.num_keys().await.unwrap(), 6);
    assert!(store.delete_key("fresh").await.unwrap());
    assert!(!store.delete_key("fresh").await.unwrap());
    assert_eq!(store.num_keys().await.unwrap(), 5);
    assert_eq!(server.num_keys(), 5);
    let mut keys = store.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, ["a", "c", "m1", "m2", "n"]);

    store.queue_push("q", b"one").await.unwrap();
    store.queue_push("q", b"two").await.unwrap();
    assert_eq!(store.queue_len("q").await.unwrap(), 2);
    assert_eq!(store.queue_pop("q", true).await.unwrap().as_deref(), Some(&b"one"[..]));
    assert_eq!(store.queue_pop("q", false).await.unwrap().as_deref(), Some(&b"two"[..]));
    assert_eq!(store.queue_pop("q", false).await.unwrap(), None);
    store.barrier("solo", 1, Duration::from_secs(1)).await.unwrap();

    let big = vec![0xA5u8; 1 << 20];
    store.set("big", &big).await.unwrap();
    assert_eq!(store.get("big").await.unwrap(), big);
    server.shutdown().await;
}

#[tokio::test]
async fn keys_carry_pytorchs_slash_prefix_on_the_wire() {
    let server = server().await;
    let store = client(&server).await;
    store.set("k", b"v").await.unwrap();
    let mut raw = TcpStoreConfig::new("127.0.0.1", server.port());
    raw.key_prefix = String::new();
    let raw = TcpStore::connect(raw).await.unwrap();
    assert_eq!(raw.get("/k").await.unwrap(), b"v");
}

#[tokio::test]
async fn concurrent_clients_add_without_losing_increments() {
    let server = server().await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = client(&server).await;
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..20 {
                seen.push(store.add("counter", 1).await.unwrap());
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    all.sort();
    assert_eq!(all, (1..=160).collect::<Vec<i64>>());
    let store = client(&server).await;
    assert_eq!(store.get("counter").await.unwrap(), b"160");
}

#[tokio::test]
async fn wait_and_get_are_woken_by_another_clients_set() {
    let server = server().await;
    let waiter = client(&server).await;
    let getter = client(&server).await;
    let setter = client(&server).await;
    let wait = tokio::spawn(async move { waiter.wait(&["k1", "k2"], Duration::from_secs(10)).await });
    let get = tokio::spawn(async move { getter.get("k2").await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!wait.is_finished() && !get.is_finished());
    setter.set("k1", b"1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!wait.is_finished(), "wait needs both keys");
    setter.set("k2", b"2").await.unwrap();
    wait.await.unwrap().unwrap();
    assert_eq!(get.await.unwrap().unwrap(), b"2");
}

#[tokio::test]
async fn many_waiters_are_all_woken_by_one_set() {
    let server = server().await;
    let mut waits = Vec::new();
    for _ in 0..10 {
        let store = client(&server).await;
        waits.push(tokio::spawn(async move { store.wait(&["go"], Duration::from_secs(10)).await }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    client(&server).await.set("go", b"").await.unwrap();
    for wait in waits {
        wait.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn wait_timeout_names_keys_and_timeout_and_keeps_the_connection() {
    let server = server().await;
    let store = client(&server).await;
    let timeout = Duration::from_millis(200);
    let err = store.wait(&["never", "nope"], timeout).await.unwrap_err();
    match &err {
        StoreError::Timeout { op: "wait", keys, timeout: t } => {
            assert_eq!(keys, &["never", "nope"]);
            assert_eq!(*t, timeout);
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("never") && text.contains("nope") && text.contains("200ms"), "{text}");
    // The cancelled wait is forgotten by the server: a later set does not leave a stray reply.
    store.set("never", b"x").await.unwrap();
    assert_eq!(store.get("never").await.unwrap(), b"x");
    assert_eq!(store.add("n", 1).await.unwrap(), 1);
}

#[tokio::test]
async fn get_of_a_missing_key_times_out_like_pytorch() {
    let server = server().await;
    let store = TcpStore::connect(config(&server).with_timeout(Duration::from_millis(150))).await.unwrap();
    let err = store.get("absent").await.unwrap_err();
    assert!(matches!(&err, StoreError::Timeout { op: "get", keys, .. } if keys == &["absent"]), "{err}");
    store.set("absent", b"now").await.unwrap();
    assert_eq!(store.get("absent").await.unwrap(), b"now");
}

#[tokio::test]
async fn compare_set_race_has_exactly_one_winner() {
    let server = server().await;
    let mut tasks = Vec::new();
    for rank in 0..8 {
        let store = client(&server).await;
        tasks.push(tokio::spawn(async move {
            let mine = format!("rank{rank}");
            let now = store.compare_set("leader", b"", mine.as_bytes()).await.unwrap();
            (mine, now)
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let winners: Vec<_> = results.iter().filter(|(mine, now)| mine.as_bytes() == now.as_slice()).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    let leader = &winners[0].1;
    assert!(results.iter().all(|(_, now)| now == leader), "{results:?}");
}

#[tokio::test]
async fn barrier_releases_all_clients_together() {
    let server = server().await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let store = client(&server).await;
        tasks.push(tokio::spawn(async move { store.barrier("b", 4, Duration::from_secs(10)).await }));
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
}

/// Captures `tracing` events (level, message and fields) from the current thread.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<String>>);

impl Captured {
    fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }
}

struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl tracing::Subscriber for Captured {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut line = format!("{}", event.metadata().level());
        event.record(&mut Fields(&mut line));
        line.push('\n');
        self.0.lock().unwrap().push_str(&line);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Sends `bytes` (then half-closes if `eof`) and expects the server to close the connection.
async fn expect_disconnect(port: u16, bytes: &[u8], eof: bool) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    if eof {
        stream.shutdown().await.unwrap();
    }
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await.expect("server closes");
    assert!(matches!(read, Ok(0) | Err(_)), "expected a closed connection, got {read:?}");
}

fn validate() -> Vec<u8> {
    Request::Validate { magic: VALIDATION_MAGIC }.to_bytes()
}

// Single-threaded runtime: the server's tasks run on this thread, so the thread-local
// subscriber sees their warnings.
#[tokio::test(flavor = "current_thread")]
async fn garbage_clients_are_disconnected_while_a_good_client_keeps_working() {
    let captured = Captured::default();
    let _guard = tracing::subscriber::set_default(captured.clone());
    let server = server().await;
    let port = server.port();
    let good = client(&server).await;
    good.set("kept", b"safe").await.unwrap();

    let mut set_huge_key = validate();
    set_huge_key.push(1); // SET
    set_huge_key.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let mut truncated = validate();
    truncated.extend_from_slice(&Request::Set { key: b"/half".to_vec(), value: vec![1; 100] }.to_bytes()[..40]);
    let mut unknown = validate();
    unknown.push(200);
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        ("wrong magic", vec![0, 0xEF, 0xBE, 0xAD, 0xDE], false, "0xdeadbeef"),
        (
            "no VALIDATE",
            Request::Set { key: b"/sneaky".to_vec(), value: b"x".to_vec() }.to_bytes(),
            false,
            "first request was SET",
        ),
        ("unknown query type", unknown, false, "unknown query type 200"),
        ("length 2^60", set_huge_key, false, "1152921504606846976"),
        ("truncated then EOF", truncated, true, "middle of a request"),
    ];
    for (i, (name, bytes, eof, logged)) in cases.into_iter().enumerate() {
        expect_disconnect(port, &bytes, eof).await;
        assert!(captured.text().contains(logged), "{name}: log lacks {logged:?}:\n{}", captured.text());
        // The good client is unaffected.
        assert_eq!(good.add("progress", 1).await.unwrap(), i as i64 + 1, "{name}");
        assert_eq!(good.get("kept").await.unwrap(), b"safe", "{name}");
    }
    // ADD on a non-integer: PyTorch's server closes that client; ours too, with a warning.
    let victim = client(&server).await;
    victim.set("text", b"hello").await.unwrap();
    assert!(matches!(victim.add("text", 1).await, Err(StoreError::Closed { op: "add", .. })));
    assert!(matches!(victim.get("text").await, Err(StoreError::Broken(_))));
    assert!(captured.text().contains("is not an integer"), "{}", captured.text());

    assert!(!good.check(&["sneaky", "half"]).await.unwrap(), "garbage must not store keys");
    assert_eq!(good.get("text").await.unwrap(), b"hello");
    assert_eq!(good.num_keys().await.unwrap(), 3);
    for _ in 0..100 {
        if server.num_clients() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.num_clients(), 1, "only the good client is left");
    assert!(captured.text().lines().filter(|l| l.starts_with("WARN")).count() >= 6, "{}", captured.text());
}

#[tokio::test]
async fn binding_a_port_in_use_fails_naming_the_address() {
    let first = server().await;
    let addr = first.local_addr();
    let err = TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(addr)).await.unwrap_err();
    assert!(matches!(&err, StoreServerError::Bind { addr: a, source } if *a == addr
        && source.kind() == std::io::ErrorKind::AddrInUse));
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

async fn free_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn connecting_to_nothing_fails_naming_address_and_timeout() {
    let port = free_port().await;
    let cfg = TcpStoreConfig::new("127.0.0.1", port).with_connect_timeout(Duration::from_millis(300));
    let err = TcpStore::connect(cfg).await.unwrap_err();
    match &err {
        StoreError::Connect { addr, timeout, attempts, .. } => {
            assert_eq!(addr, &format!("127.0.0.1:{port}"));
            assert_eq!(*timeout, Duration::from_millis(300));
            assert!(*attempts > 1, "retried: {attempts}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")) && err.to_string().contains("300ms"), "{err}");
}

#[tokio::test]
async fn the_client_retries_until_the_server_appears() {
    let port = free_port().await;
    let connect = tokio::spawn(TcpStore::connect(
        TcpStoreConfig::new("127.0.0.1", port).with_connect_timeout(Duration::from_secs(10)),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let server =
        TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(format!("127.0.0.1:{port}").parse().unwrap()))
            .await
            .unwrap();
    let store = connect.await.unwrap().unwrap();
    store.set("up", b"1").await.unwrap();
    // SET has no reply; a GET orders after it.
    assert_eq!(store.get("up").await.unwrap(), b"1");
    assert_eq!(server.num_keys(), 1);
}

#[tokio::test]
async fn shutdown_closes_client_connections() {
    let server = server().await;
    let store = client(&server).await;
    store.set("k", b"v").await.unwrap();
    server.shutdown().await;
    let err = store.add("n", 1).await.unwrap_err();
    assert!(matches!(err, StoreError::Closed { .. } | StoreError::Io { .. }), "{err}");
}

#[tokio::test]
async fn a_prefix_store_over_tcp_shares_keys_with_the_plain_client() {
    use cohort_transports::PrefixStore;
    let server = server().await;
    let plain: Arc<dyn Store> = Arc::new(client(&server).await);
    let prefixed = PrefixStore::new("group1", plain.clone());
    prefixed.set("rank0", b"addr").await.unwrap();
    assert_eq!(plain.get("group1/rank0").await.unwrap(), b"addr");
}
