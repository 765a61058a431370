//! Interop with PyTorch's own TCPStore, in both directions:
//!
//! - PyTorch's client (`torch.distributed.TCPStore(host, port, is_master=False)`) against our
//!   `TcpStoreServer`;
//! - our `TcpStore` client against PyTorch's server (`is_master=True`, the default libuv
//!   backend, and the legacy backend with `use_libuv=False`).
//!
//! The Python interpreter is `$COHORT_TORCH_PYTHON`, else `python3`. When that variable is
//! set (`scripts/test.sh`, and so CI, sets it to the venv it installs torch into), a Python
//! that cannot import torch fails the tests. When it is not set and `python3` has no torch (a
//! bare `cargo test`), each test prints "skipped: torch not importable (set
//! COHORT_TORCH_PYTHON)" and passes.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cohort_transports::store::{Store, StoreError, TcpStore, TcpStoreConfig, TcpStoreServer};
use cohort_transports::{TcpStoreServerConfig, TokioNet};

/// A Python that can import torch, or `None` (after printing the skip line).
fn torch_python() -> Option<String> {
    let python = std::env::var("COHORT_TORCH_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let ok = Command::new(&python)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if ok {
        Some(python)
    } else if std::env::var_os("COHORT_TORCH_PYTHON").is_some() {
        panic!("COHORT_TORCH_PYTHON={python} cannot import torch.distributed");
    } else {
        println!("skipped: torch not importable (set COHORT_TORCH_PYTHON)");
        None
    }
}

/// Kills the child if the test fails before it exits.
struct Reap(Option<Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// PyTorch's client exercising every command against our server. Rust sets `from_rust` before
/// and `rust_late` once the script says it is waiting for it.
const TORCH_CLIENT: &str = r#"
import sys, datetime, warnings
warnings.filterwarnings("ignore")
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
s = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=20))
def check(cond, what):
    if not cond:
        print("FAIL", what, flush=True)
        sys.exit(1)
check(s.get("from_rust") == b"hello", "get of a key set by the rust client")
s.set("k", "v"); check(s.get("k") == b"v", "set/get")
check(s.add("cnt", 5) == 5, "add on a missing key")
check(s.add("cnt", 2) == 7, "add")
check(s.get("cnt") == b"7", "add stores the decimal string")
check(s.compare_set("cs", "", "a") == b"a", "compare_set creates")
check(s.compare_set("cs", "x", "b") == b"a", "compare_set mismatch")
check(s.compare_set("cs", "a", "b") == b"b", "compare_set swaps")
check(s.compare_set("nokey", "exp", "d") == b"exp", "compare_set on a missing key")
check(s.check(["k", "cnt"]) is True, "check ready")
check(s.check(["k", "zzz"]) is False, "check not ready")
s.wait(["k", "cs"])
try:
    s.wait(["never"], datetime.timedelta(milliseconds=200))
    check(False, "wait must time out")
except Exception as e:
    check("timeout" in str(e).lower(), "wait timeout message: " + str(e))
s.set("after", "1")
check(s.delete_key("after") is True, "delete existing")
check(s.delete_key("after") is False, "delete missing")
s.append("ap", "x"); s.append("ap", "y")
check(s.get("ap") == b"xy", "append")
s.multi_set(["m1", "m2"], ["1", "2"])
check(s.multi_get(["m2", "m1"]) == [b"2", b"1"], "multi_get")
check(s.num_keys() == 7, "num_keys " + str(s.num_keys()))
s.queue_push("q", "a"); s.queue_push("q", "b")
check(s.queue_len("q") == 2, "queue_len")
check(s.queue_pop("q") == b"a", "queue_pop")
check(s.queue_pop("q", False) == b"b", "queue_pop no block")
keys = set(s.list_keys())
check({"from_rust", "k", "cnt", "cs", "ap", "m1", "m2"} <= keys, "list_keys " + str(keys))
s.barrier("bar", 1, datetime.timedelta(seconds=5))
s.set("py_waiting", "1")
s.wait(["rust_late"])
check(s.get("rust_late") == b"late", "wait woken by the rust client")
print("OK", flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torch_client_against_our_server() {
    let Some(python) = torch_python() else { return };
    let server =
        TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap())).await.unwrap();
    let port = server.port();
    let ours =
        TcpStore::connect(TcpStoreConfig::new("127.0.0.1", port).with_timeout(Duration::from_secs(20))).await.unwrap();
    ours.set("from_rust", b"hello").await.unwrap();

    let child = Command::new(&python)
        .args(["-c", TORCH_CLIENT, "127.0.0.1", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reap = Reap(Some(child));

    // Wake the Python client's wait from our side (unless it already exited with a failure).
    for _ in 0..1000 {
        if ours.check(&["py_waiting"]).await.unwrap() {
            ours.set("rust_late", b"late").await.unwrap();
            break;
        }
        if reap.0.as_mut().unwrap().try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let child = reap.0.take().unwrap();
    let output = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success() && stdout.contains("OK"), "python failed:\n{stdout}\n{stderr}");

    // What PyTorch's client wrote is what ours reads.
    assert_eq!(ours.get("k").await.unwrap(), b"v");
    assert_eq!(ours.get("cnt").await.unwrap(), b"7");
    assert_eq!(ours.get("cs").await.unwrap(), b"b");
    assert_eq!(ours.multi_get(&["m1", "ap"]).await.unwrap(), [b"1".to_vec(), b"xy".to_vec()]);
    assert!(!ours.check(&["nokey", "after"]).await.unwrap());
    server.shutdown().await;
}

/// PyTorch's server; prints its port, waits for `rust_done`, then checks what Rust wrote.
const TORCH_SERVER: &str = r#"
import sys, datetime, warnings
warnings.filterwarnings("ignore")
from torch.distributed import TCPStore
use_libuv = sys.argv[1] == "libuv"
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=20), use_libuv=use_libuv)
s.set("from_torch", "hi")
s.set("counter", "10")
print(s.port, flush=True)
def check(cond, what):
    if not cond:
        print("FAIL", what, flush=True)
        sys.exit(1)
s.wait(["rust_waiting"])
s.set("torch_late", "late")
s.wait(["rust_done"])
check(s.get("rust_set") == b"value", "set by rust")
check(s.get("counter") == b"13", "add by rust")
check(s.get("rust_app") == b"ab", "append by rust")
check(s.multi_get(["rm1", "rm2"]) == [b"1", b""], "multi_set by rust")
check(s.get("rust_cs") == b"won", "compare_set by rust")
check(not s.check(["rust_deleted"]), "delete_key by rust")
print("OK", flush=True)
"#;

async fn our_client_against_torch_server(backend: &str) {
    let Some(python) = torch_python() else { return };
    let mut child = Command::new(&python)
        .args(["-c", TORCH_SERVER, backend])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut reap = Reap(Some(child));
    let (port_line, mut lines) = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stdout);
        let mut first = String::new();
        lines.read_line(&mut first).map(|_| (first, lines))
    })
    .await
    .unwrap()
    .unwrap();
    let port: u16 = port_line.trim().parse().unwrap_or_else(|_| panic!("no port from python: {port_line:?}"));

    let store =
        TcpStore::connect(TcpStoreConfig::new("127.0.0.1", port).with_timeout(Duration::from_secs(20))).await.unwrap();
    assert_eq!(store.get("from_torch").await.unwrap(), b"hi");
    store.set("rust_set", b"value").await.unwrap();
    assert_eq!(store.add("counter", 3).await.unwrap(), 13);
    assert_eq!(store.add("fresh_counter", 4).await.unwrap(), 4);
    assert_eq!(store.compare_set("rust_cs", b"", b"first").await.unwrap(), b"first");
    assert_eq!(store.compare_set("rust_cs", b"nope", b"x").await.unwrap(), b"first");
    assert_eq!(store.compare_set("rust_cs", b"first", b"won").await.unwrap(), b"won");
    assert_eq!(store.compare_set("rust_missing", b"exp", b"x").await.unwrap(), b"exp");
    assert!(store.check(&["from_torch", "counter"]).await.unwrap());
    assert!(!store.check(&["from_torch", "absent"]).await.unwrap());
    let err = store.wait(&["absent"], Duration::from_millis(200)).await.unwrap_err();
    assert!(matches!(&err, StoreError::Timeout { keys, .. } if keys == &["absent"]), "{err}");
    store.set("rust_deleted", b"x").await.unwrap();
    assert!(store.delete_key("rust_deleted").await.unwrap());
    assert!(!store.delete_key("rust_deleted").await.unwrap());
    store.append("rust_app", b"a").await.unwrap();
    store.append("rust_app", b"b").await.unwrap();
    store.multi_set(&[("rm1", b"1"), ("rm2", b"")]).await.unwrap();
    assert_eq!(store.multi_get(&["rm2", "rm1"]).await.unwrap(), [b"".to_vec(), b"1".to_vec()]);
    // from_torch, counter, rust_set, fresh_counter, rust_cs, rust_app, rm1, rm2.
    assert_eq!(store.num_keys().await.unwrap(), 8);
    if backend == "libuv" {
        // Queues, list_keys and barrier are libuv-only in PyTorch.
        store.queue_push("rq", b"item").await.unwrap();
        assert_eq!(store.queue_len("rq").await.unwrap(), 1);
        assert_eq!(store.queue_pop("rq", true).await.unwrap().as_deref(), Some(&b"item"[..]));
        assert_eq!(store.queue_pop("rq", false).await.unwrap(), None);
        let keys = store.list_keys().await.unwrap();
        assert!(keys.iter().any(|k| k == "from_torch") && keys.iter().any(|k| k == "rm2"), "{keys:?}");
        store.barrier("rbar", 1, Duration::from_secs(5)).await.unwrap();
    }
    // A wait woken by PyTorch's own client.
    store.set("rust_waiting", b"1").await.unwrap();
    assert_eq!(store.get("torch_late").await.unwrap(), b"late");
    store.set("rust_done", b"1").await.unwrap();

    let mut child = reap.0.take().unwrap();
    let (rest, status, stderr) = tokio::task::spawn_blocking(move || {
        let mut rest = String::new();
        let _ = lines.read_to_string(&mut rest);
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        (rest, child.wait(), stderr)
    })
    .await
    .unwrap();
    assert!(status.unwrap().success() && rest.contains("OK"), "python server ({backend}) failed:\n{rest}\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_against_torch_libuv_server() {
    our_client_against_torch_server("libuv").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_against_torch_legacy_server() {
    our_client_against_torch_server("legacy").await;
}

/// PyTorch's client against a store that requires a secret: it cannot authenticate, so the
/// store disconnects it (logging why) and it fails; nothing it sent is stored.
const TORCH_CLIENT_REFUSED: &str = r#"
import sys, datetime, warnings
warnings.filterwarnings("ignore")
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3))
    s.set("k", "v")
    s.get("k")
    print("SERVED", flush=True)
except Exception as e:
    print("REFUSED", type(e).__name__, flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torch_client_is_refused_by_a_store_with_a_secret() {
    let Some(python) = torch_python() else { return };
    let secret = cohort_core::protocol::AuthSecret::new(b"s3cret".as_slice());
    let config = TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap()).with_auth(secret);
    let server = TcpStoreServer::bind(TokioNet, config).await.unwrap();
    let port = server.port().to_string();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(&python).args(["-c", TORCH_CLIENT_REFUSED, "127.0.0.1", &port]).output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("REFUSED"),
        "torch's client must fail:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(server.num_keys(), 0);
    server.shutdown().await;
}
