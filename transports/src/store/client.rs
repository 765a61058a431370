//! [`TcpStore`]: the TCPStore client.

use std::fmt;
use std::time::Duration;

use cohort_core::protocol::{AuthSecret, NONCE_LEN, PROOF_LEN, Role, proof, verify};
use cohort_core::store::{DecodeLimits, Reply, ReplyDecoder, ReplyKind, Request, VALIDATION_MAGIC, WaitResponse};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Mutex, MutexGuard};

use super::{DEFAULT_TIMEOUT, Store, StoreError, StoreFuture, owned_keys};
use crate::net::{Net, TokioNet};

/// How a [`TcpStore`] connects and how long it waits. Build with [`TcpStoreConfig::new`] and
/// adjust the public fields or the `with_*` methods.
#[derive(Debug, Clone)]
pub struct TcpStoreConfig {
    /// The server's host name or address.
    pub host: String,
    /// The server's port.
    pub port: u16,
    /// How long one call may take, and how long `get` / `multi_get` wait for their keys.
    /// Default 300 s, PyTorch's `Store::kDefaultTimeout`.
    pub timeout: Duration,
    /// How long to keep trying to connect and validate before giving up. Default 300 s
    /// (PyTorch retries until its `timeout`).
    pub connect_timeout: Duration,
    /// The delay after the first failed connection attempt; it doubles after each failure up
    /// to [`max_backoff`](Self::max_backoff). Default 10 ms. Deterministic: no jitter.
    pub initial_backoff: Duration,
    /// The longest delay between connection attempts. Default 1 s (PyTorch's
    /// `kConnectRetryDelay`).
    pub max_backoff: Duration,
    /// Prepended to every key on the wire. Default `"/"`, PyTorch's `TCPStore::keyPrefix_`, so
    /// that keys are shared with PyTorch clients of the same server.
    pub key_prefix: String,
    /// Bounds on what the server's replies may announce.
    pub limits: DecodeLimits,
    /// The secret to prove to a server that requires one (see
    /// [`TcpStoreServerConfig::auth`](crate::store::TcpStoreServerConfig::auth)); the server
    /// proves it too. None by default.
    pub auth: Option<AuthSecret>,
}

impl TcpStoreConfig {
    /// The defaults above, for the server at `host:port`.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        TcpStoreConfig {
            host: host.into(),
            port,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_TIMEOUT,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(1),
            key_prefix: "/".to_owned(),
            limits: DecodeLimits::default(),
            auth: None,
        }
    }

    /// Sets [`auth`](Self::auth).
    pub fn with_auth(mut self, secret: Option<AuthSecret>) -> Self {
        self.auth = secret;
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
}

/// A client of a TCPStore server (ours or PyTorch's).
///
/// One connection, one call at a time (concurrent calls queue on a lock, as PyTorch's client
/// does). It connects with retries and exponential backoff, then sends VALIDATE and a PING,
/// exactly like PyTorch's client. `get` and `multi_get` first WAIT for their keys, and a WAIT
/// that times out is cancelled with CANCEL_WAIT, as PyTorch's client does.
///
/// A failure in the middle of a call (an IO error, a reply that does not come in time, a reply
/// that does not decode) leaves the connection in an unknown state: every later call fails with
/// [`StoreError::Broken`]. A wait that times out cleanly does not break it.
pub struct TcpStore<N: Net = TokioNet> {
    config: TcpStoreConfig,
    addr: String,
    conn: Mutex<Conn<N::Stream>>,
}

impl<N: Net> fmt::Debug for TcpStore<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).field("timeout", &self.config.timeout).finish()
    }
}

impl TcpStore<TokioNet> {
    /// Connects over real sockets; see [`TcpStore::connect_with`].
    pub async fn connect(config: TcpStoreConfig) -> Result<Self, StoreError> {
        Self::connect_with(TokioNet, config).await
    }
}

impl<N: Net> TcpStore<N> {
    /// Connects to `config.host:config.port` over `net` and validates the connection, retrying
    /// with exponential backoff until `config.connect_timeout`; then fails with
    /// [`StoreError::Connect`], naming the address, the timeout and the last error.
    pub async fn connect_with(net: N, config: TcpStoreConfig) -> Result<Self, StoreError> {
        let addr = format!("{}:{}", config.host, config.port);
        let start = tokio::time::Instant::now();
        let deadline = start.checked_add(config.connect_timeout);
        let mut backoff = config.initial_backoff;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let attempt = async {
                let stream = net
                    .connect(&config.host, config.port)
                    .await
                    .map_err(|source| StoreError::Io { op: "connect", source })?;
                let mut conn = Conn::new(stream, config.limits);
                conn.handshake(&addr, config.auth.as_ref()).await?;
                Ok::<_, StoreError>(conn)
            };
            let result = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, attempt).await.unwrap_or_else(|_| {
                    Err(StoreError::Io { op: "connect", source: std::io::ErrorKind::TimedOut.into() })
                }),
                None => attempt.await,
            };
            let error = match result {
                Ok(conn) => {
                    tracing::debug!(%addr, attempts, "connected to the store");
                    return Ok(TcpStore { config, addr, conn: Mutex::new(conn) });
                }
                // Another secret does not come right by retrying.
                Err(error @ StoreError::Auth { .. }) => return Err(error),
                Err(error) => error,
            };
            let now = tokio::time::Instant::now();
            if deadline.is_some_and(|deadline| now + backoff >= deadline) {
                return Err(StoreError::Connect {
                    addr,
                    timeout: config.connect_timeout,
                    attempts,
                    last_error: error.to_string(),
                });
            }
            tracing::debug!(%addr, attempts, %error, ?backoff, "store connection failed; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(config.max_backoff.max(config.initial_backoff));
        }
    }

    /// `host:port` of the server.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The configuration it was connected with.
    pub fn config(&self) -> &TcpStoreConfig {
        &self.config
    }

    /// QUEUE_PUSH: appends `value` to the queue named `key` (PyTorch's `queue_push`).
    pub async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::QueuePush { key: self.wire_key(key), value: value.to_vec() };
        self.call("queue_push", &[key], request).await.map(drop)
    }

    /// QUEUE_POP: the first item of queue `key`, or `None` when it is empty. With `block`, first
    /// waits up to [`TcpStoreConfig::timeout`] for the queue to be non-empty (PyTorch's
    /// `queue_pop`, which raises on an empty queue instead of returning `None`).
    pub async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError> {
        let mut conn = self.lock().await?;
        if block {
            self.do_wait(&mut conn, "queue_pop", &[key], self.config.timeout).await?;
        }
        let request = Request::QueuePop { key: self.wire_key(key) };
        match self.exchange(&mut conn, "queue_pop", &[key], request).await? {
            Some(Reply::QueuePop { value, .. }) => Ok(value),
            other => Err(unexpected("queue_pop", "a popped item", other)),
        }
    }

    /// QUEUE_LEN: how many items queue `key` holds.
    pub async fn queue_len(&self, key: &str) -> Result<u64, StoreError> {
        let reply = self.call("queue_len", &[key], Request::QueueLen { key: self.wire_key(key) }).await?;
        count("queue_len", reply)
    }

    /// LIST_KEYS: every key carrying this client's prefix, without it (PyTorch's `list_keys`,
    /// which skips keys without the prefix). Keys that are not UTF-8 are converted lossily.
    pub async fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        match self.call("list_keys", &[], Request::ListKeys).await? {
            Some(Reply::Keys(keys)) => Ok(keys
                .iter()
                .filter_map(|key| key.strip_prefix(self.config.key_prefix.as_bytes()))
                .map(|key| String::from_utf8_lossy(key).into_owned())
                .collect()),
            other => Err(unexpected("list_keys", "a key list", other)),
        }
    }

    /// BARRIER: counts this arrival under `key` and waits up to `timeout` until `world_size`
    /// clients have arrived (PyTorch's `barrier`). A timeout cancels the wait but leaves the
    /// arrival counted, as in PyTorch.
    pub async fn barrier(&self, key: &str, world_size: i64, timeout: Duration) -> Result<(), StoreError> {
        let mut conn = self.lock().await?;
        let request = Request::Barrier { key: self.wire_key(key), world_size };
        self.send_then_await_stop(&mut conn, "barrier", &[key], request, timeout).await
    }

    fn wire_key(&self, key: &str) -> Vec<u8> {
        let mut wire = Vec::with_capacity(self.config.key_prefix.len() + key.len());
        wire.extend_from_slice(self.config.key_prefix.as_bytes());
        wire.extend_from_slice(key.as_bytes());
        wire
    }

    async fn lock(&self) -> Result<MutexGuard<'_, Conn<N::Stream>>, StoreError> {
        let conn = self.conn.lock().await;
        match &conn.broken {
            Some(why) => Err(StoreError::Broken(why.clone())),
            None => Ok(conn),
        }
    }

    /// One request and its reply, under the lock.
    async fn call(&self, op: &'static str, keys: &[&str], request: Request) -> Result<Option<Reply>, StoreError> {
        let mut conn = self.lock().await?;
        self.exchange(&mut conn, op, keys, request).await
    }

    /// Sends `request` and reads its reply (if it has one) within the call timeout; any failure
    /// breaks the connection.
    async fn exchange(
        &self,
        conn: &mut Conn<N::Stream>,
        op: &'static str,
        keys: &[&str],
        request: Request,
    ) -> Result<Option<Reply>, StoreError> {
        let timeout = self.config.timeout;
        let result = tokio::time::timeout(timeout, async {
            conn.send(op, &request).await?;
            match request.reply_kind() {
                Some(kind) => conn.recv(op, kind, &self.addr).await.map(Some),
                None => Ok(None),
            }
        })
        .await
        .unwrap_or_else(|_| Err(StoreError::Timeout { op, keys: owned_keys(keys), timeout }));
        conn.break_on_error(result)
    }

    /// PyTorch's `doWait`: WAIT for `keys` (user names; sent prefixed) up to `timeout`.
    async fn do_wait(
        &self,
        conn: &mut Conn<N::Stream>,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let request = Request::Wait { keys: keys.iter().map(|k| self.wire_key(k)).collect() };
        self.send_then_await_stop(conn, op, keys, request, timeout).await
    }

    /// Sends a WAIT or BARRIER and waits up to `timeout` for STOP_WAITING; on timeout sends
    /// CANCEL_WAIT and reads the acknowledgement (skipping a STOP_WAITING that crossed it, as
    /// PyTorch's client does), then fails with [`StoreError::Timeout`].
    async fn send_then_await_stop(
        &self,
        conn: &mut Conn<N::Stream>,
        op: &'static str,
        keys: &[&str],
        request: Request,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let call_timeout = self.config.timeout;
        let sent = tokio::time::timeout(call_timeout, conn.send(op, &request))
            .await
            .unwrap_or_else(|_| Err(StoreError::Timeout { op, keys: owned_keys(keys), timeout: call_timeout }));
        conn.break_on_error(sent)?;
        let waited = match tokio::time::timeout(timeout, conn.recv(op, ReplyKind::Wait, &self.addr)).await {
            Ok(Ok(Reply::Wait(WaitResponse::StopWaiting))) => return Ok(()),
            Ok(Ok(other)) => Err(unexpected(op, "STOP_WAITING", Some(other))),
            Ok(Err(e)) => Err(e),
            Err(_elapsed) => Ok(()),
        };
        conn.break_on_error(waited)?;
        // The wait timed out: cancel it. The server answers promptly; allow one call timeout.
        let cancelled = tokio::time::timeout(call_timeout, async {
            conn.send(op, &Request::CancelWait).await?;
            let mut reply = conn.recv(op, ReplyKind::Wait, &self.addr).await?;
            if reply == Reply::Wait(WaitResponse::StopWaiting) {
                // The keys arrived just before the cancel; the acknowledgement follows.
                reply = conn.recv(op, ReplyKind::Wait, &self.addr).await?;
            }
            match reply {
                Reply::Wait(WaitResponse::WaitCanceled) => Ok(()),
                other => Err(unexpected(op, "WAIT_CANCELED", Some(other))),
            }
        })
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Timeout { op: "cancel_wait", keys: owned_keys(keys), timeout: call_timeout })
        });
        conn.break_on_error(cancelled)?;
        Err(StoreError::Timeout { op, keys: owned_keys(keys), timeout })
    }
}

impl<N: Net> Store for TcpStore<N> {
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let request = Request::Set { key: self.wire_key(key), value: value.to_vec() };
            self.call("set", &[key], request).await.map(drop)
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let mut conn = self.lock().await?;
            self.do_wait(&mut conn, "get", &[key], self.config.timeout).await?;
            match self.exchange(&mut conn, "get", &[key], Request::Get { key: self.wire_key(key) }).await? {
                Some(Reply::Bytes(value)) => Ok(value),
                other => Err(unexpected("get", "bytes", other)),
            }
        })
    }

    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64> {
        Box::pin(async move {
            match self.call("add", &[key], Request::Add { key: self.wire_key(key), delta }).await? {
                Some(Reply::Int(value)) => Ok(value),
                other => Err(unexpected("add", "an integer", other)),
            }
        })
    }

    fn compare_set<'a>(&'a self, key: &'a str, expected: &'a [u8], desired: &'a [u8]) -> StoreFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let request =
                Request::CompareSet { key: self.wire_key(key), expected: expected.to_vec(), desired: desired.to_vec() };
            match self.call("compare_set", &[key], request).await? {
                Some(Reply::Bytes(value)) => Ok(value),
                other => Err(unexpected("compare_set", "bytes", other)),
            }
        })
    }

    fn wait<'a>(&'a self, keys: &'a [&'a str], timeout: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut conn = self.lock().await?;
            self.do_wait(&mut conn, "wait", keys, timeout).await
        })
    }

    fn check<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let request = Request::Check { keys: keys.iter().map(|k| self.wire_key(k)).collect() };
            match self.call("check", keys, request).await? {
                Some(Reply::Check(check)) => Ok(check == cohort_core::store::CheckResponse::Ready),
                other => Err(unexpected("check", "READY or NOT_READY", other)),
            }
        })
    }

    fn delete_key<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            match self.call("delete_key", &[key], Request::DeleteKey { key: self.wire_key(key) }).await? {
                Some(Reply::Int(deleted)) => Ok(deleted == 1),
                other => Err(unexpected("delete_key", "an integer", other)),
            }
        })
    }

    fn num_keys(&self) -> StoreFuture<'_, u64> {
        Box::pin(async move { count("num_keys", self.call("num_keys", &[], Request::GetNumKeys).await?) })
    }

    fn append<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let request = Request::Append { key: self.wire_key(key), value: value.to_vec() };
            self.call("append", &[key], request).await.map(drop)
        })
    }

    fn multi_get<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, Vec<Vec<u8>>> {
        Box::pin(async move {
            let mut conn = self.lock().await?;
            self.do_wait(&mut conn, "multi_get", keys, self.config.timeout).await?;
            let request = Request::MultiGet { keys: keys.iter().map(|k| self.wire_key(k)).collect() };
            match self.exchange(&mut conn, "multi_get", keys, request).await? {
                Some(Reply::MultiBytes(values)) => Ok(values),
                other => Err(unexpected("multi_get", "one value per key", other)),
            }
        })
    }

    fn multi_set<'a>(&'a self, items: &'a [(&'a str, &'a [u8])]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
            let request =
                Request::MultiSet { items: items.iter().map(|(k, v)| (self.wire_key(k), v.to_vec())).collect() };
            self.call("multi_set", &keys, request).await.map(drop)
        })
    }

    fn timeout(&self) -> Duration {
        self.config.timeout
    }
}

/// One connection: the stream, the reply decoder and whether an earlier failure broke it.
struct Conn<S> {
    stream: S,
    decoder: ReplyDecoder,
    read_buf: super::ReadBuf,
    broken: Option<String>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    fn new(stream: S, limits: DecodeLimits) -> Self {
        Conn { stream, decoder: ReplyDecoder::new(limits), read_buf: super::ReadBuf::new(), broken: None }
    }

    /// VALIDATE then PING, as PyTorch's client opens every connection (the nonce is the
    /// process id, as PyTorch's); with a secret, the authentication in between (see
    /// [`cohort_core::protocol::auth`]): this client's challenge, the server's nonce and proof,
    /// checked, then this client's proof.
    async fn handshake(&mut self, addr: &str, auth: Option<&AuthSecret>) -> Result<(), StoreError> {
        let refused = |reason: &str| StoreError::Auth { addr: addr.to_owned(), reason: reason.to_owned() };
        let nonce = std::process::id();
        // Requests go out in as few writes as the exchange allows: VALIDATE with the first of
        // the rest, the proof with the PING.
        let mut bytes = Request::Validate { magic: VALIDATION_MAGIC }.to_bytes();
        if let Some(secret) = auth {
            let mine = crate::net::fresh_nonce().map_err(|source| StoreError::Io { op: "authenticate", source })?;
            Request::Auth { nonce: mine.0.to_vec() }.encode(&mut bytes);
            self.stream.write_all(&bytes).await.map_err(|source| StoreError::Io { op: "authenticate", source })?;
            let challenge = match self.recv("authenticate", ReplyKind::Bytes, addr).await {
                Ok(Reply::Bytes(b)) if b.len() == NONCE_LEN + PROOF_LEN => b,
                Ok(other) => return Err(unexpected("authenticate", "a nonce and a proof", Some(other))),
                Err(StoreError::Closed { .. }) => {
                    return Err(refused(
                        "the store closed the connection when this client authenticated: it has no secret (COHORT_AUTH_TOKEN)",
                    ));
                }
                Err(e) => return Err(e),
            };
            let (theirs, their_proof) = challenge.split_at(NONCE_LEN);
            if !verify(secret, Role::StoreServer, &mine.0, theirs, their_proof) {
                return Err(refused(
                    "the store's proof of the shared secret is wrong: it has another secret (COHORT_AUTH_TOKEN)",
                ));
            }
            bytes = Request::AuthProof { proof: proof(secret, Role::StoreClient, &mine.0, theirs).to_vec() }.to_bytes();
        }
        Request::Ping { nonce }.encode(&mut bytes);
        self.stream.write_all(&bytes).await.map_err(|source| StoreError::Io { op: "validate", source })?;
        if auth.is_some() {
            match self.recv("authenticate", ReplyKind::Int, addr).await {
                Ok(Reply::Int(1)) => {}
                Ok(other) => return Err(unexpected("authenticate", "1", Some(other))),
                Err(StoreError::Closed { .. }) => return Err(refused("the store refused this client's proof")),
                Err(e) => return Err(e),
            }
        }
        match self.recv("ping", ReplyKind::Nonce, addr).await {
            Ok(Reply::Nonce(echoed)) if echoed == nonce => Ok(()),
            Ok(other) => Err(unexpected("ping", "the nonce sent", Some(other))),
            // A store that closes at once on a fresh connection's first command refused it:
            // one that requires authentication does so.
            Err(StoreError::Closed { .. }) if auth.is_none() => Err(refused(
                "the store closed the connection right after VALIDATE: it requires authentication (set COHORT_AUTH_TOKEN to its secret)",
            )),
            Err(e) => Err(e),
        }
    }

    async fn send(&mut self, op: &'static str, request: &Request) -> Result<(), StoreError> {
        self.stream.write_all(&request.to_bytes()).await.map_err(|source| StoreError::Io { op, source })
    }

    /// The next reply, as `kind`. Cancel-safe: bytes already read stay in the decoder.
    async fn recv(&mut self, op: &'static str, kind: ReplyKind, addr: &str) -> Result<Reply, StoreError> {
        loop {
            if let Some(reply) = self.decoder.decode(kind).map_err(|source| StoreError::Protocol { op, source })? {
                return Ok(reply);
            }
            let n = self.stream.read(self.read_buf.space()).await.map_err(|source| StoreError::Io { op, source })?;
            if n == 0 {
                return Err(StoreError::Closed { op, addr: addr.to_owned() });
            }
            self.decoder.extend(self.read_buf.filled(n));
            self.read_buf.used(n);
        }
    }

    fn break_on_error<T>(&mut self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &result {
            self.broken = Some(e.to_string());
        }
        result
    }
}

fn unexpected(op: &'static str, expected: &'static str, got: Option<Reply>) -> StoreError {
    let got = match got {
        Some(reply) => format!("{reply:?}"),
        None => "no reply".to_owned(),
    };
    StoreError::UnexpectedReply { op, expected, got }
}

fn count(op: &'static str, reply: Option<Reply>) -> Result<u64, StoreError> {
    match reply {
        Some(Reply::Int(n)) if n >= 0 => Ok(n as u64),
        other => Err(unexpected(op, "a non-negative integer", other)),
    }
}
