//! [`TcpStoreServer`]: the TCPStore server.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cohort_core::protocol::AuthSecret;
use cohort_core::store::{ClientId, CloseReason, DecodeError, DecodeLimits, RequestDecoder, ServerOutput, StoreState};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::net::{Listener, Net};

/// Where and how a [`TcpStoreServer`] listens.
#[derive(Debug, Clone)]
pub struct TcpStoreServerConfig {
    /// The address to bind. Default `0.0.0.0:29500` (PyTorch's `TCPStoreOptions::kDefaultPort`);
    /// port 0 picks a free port, reported by [`TcpStoreServer::local_addr`].
    pub bind_addr: SocketAddr,
    /// Bounds on what a client's requests may announce; a request over them disconnects the
    /// client.
    pub limits: DecodeLimits,
    /// A secret every client must prove it knows right after VALIDATE (cohort's clients with
    /// the same secret do; a PyTorch TCPStore client cannot, and is disconnected with a log line
    /// that says so). None by default.
    pub auth: Option<AuthSecret>,
}

impl TcpStoreServerConfig {
    /// Default limits, bound to `bind_addr`, no secret.
    pub fn new(bind_addr: SocketAddr) -> Self {
        TcpStoreServerConfig { bind_addr, limits: DecodeLimits::default(), auth: None }
    }

    /// The same, requiring clients to prove they know `secret` (none: no requirement).
    pub fn with_auth(mut self, secret: Option<AuthSecret>) -> Self {
        self.auth = secret;
        self
    }
}

impl Default for TcpStoreServerConfig {
    fn default() -> Self {
        Self::new(SocketAddr::from(([0, 0, 0, 0], 29500)))
    }
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreServerError {
    /// Binding failed (the port is in use, the address is not local, …).
    #[error("could not bind the store server to {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: io::Error,
    },
    /// The bound address could not be read back.
    #[error("could not read the store server's bound address: {0}")]
    LocalAddr(#[source] io::Error),
}

/// A running TCPStore server: PyTorch's clients and ours can connect to it.
///
/// One task accepts connections and one task per client reads its requests, feeds them to a
/// shared [`StoreState`] and writes what it answers. A client that sends garbage (a wrong
/// magic, a first request other than VALIDATE, an unknown query type, a length over the
/// limits, half a request then EOF) is disconnected with a `tracing` warning naming the reason;
/// everyone else keeps being served and no key is lost.
///
/// Embedded mode (rank 0 hosts the store) is [`bind`](Self::bind) inside the process; the
/// server runs until [`shutdown`](Self::shutdown) or until this handle is dropped.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
    shared: Arc<Mutex<Shared>>,
}

impl TcpStoreServer {
    /// Binds `config.bind_addr` over `net` and starts serving in spawned tasks (needs a tokio
    /// runtime). Fails with [`StoreServerError::Bind`] naming the address, e.g. when the port is
    /// in use.
    pub async fn bind<N: Net>(net: N, config: TcpStoreServerConfig) -> Result<Self, StoreServerError> {
        let listener = net
            .bind(config.bind_addr)
            .await
            .map_err(|source| StoreServerError::Bind { addr: config.bind_addr, source })?;
        let local_addr = listener.local_addr().map_err(StoreServerError::LocalAddr)?;
        let (shutdown, stop) = watch::channel(false);
        let state = config.auth.clone().map_or_else(StoreState::new, StoreState::with_auth);
        let shared = Arc::new(Mutex::new(Shared { state, ..Shared::default() }));
        let authenticating = config.auth.is_some();
        let task = tokio::spawn(accept_loop(listener, shared.clone(), stop, config.limits, authenticating));
        tracing::info!(%local_addr, "store server listening");
        Ok(TcpStoreServer { local_addr, shutdown, task: Some(task), shared })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The port actually bound.
    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// How many client connections are open.
    pub fn num_clients(&self) -> usize {
        lock(&self.shared).clients.len()
    }

    /// How many keys the store holds.
    pub fn num_keys(&self) -> usize {
        lock(&self.shared).state.num_keys()
    }

    /// Stops accepting, closes every client connection and waits for the server's tasks.
    pub async fn shutdown(mut self) {
        self.shutdown.send_replace(true);
        if let Some(task) = self.task.take() {
            // A panicked server task has nothing left to clean up.
            let _ = task.await;
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// The state every client task shares.
#[derive(Debug, Default)]
struct Shared {
    state: StoreState,
    clients: BTreeMap<ClientId, mpsc::UnboundedSender<Outgoing>>,
    next_id: u64,
}

impl Shared {
    /// Routes the state's outputs to the client tasks.
    fn flush(&mut self) {
        while let Some(output) = self.state.poll_output() {
            let (client, outgoing) = match output {
                ServerOutput::Reply { client, reply } => (client, Outgoing::Bytes(reply.to_bytes())),
                ServerOutput::Close { client, reason } => (client, Outgoing::Close(reason)),
                other => {
                    tracing::error!(?other, "store server ignores an output it does not know");
                    continue;
                }
            };
            if let Some(tx) = self.clients.get(&client) {
                // A closed channel means the client task is ending; it cleans up itself.
                let _ = tx.send(outgoing);
            }
        }
    }
}

#[derive(Debug)]
enum Outgoing {
    Bytes(Vec<u8>),
    Close(CloseReason),
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // Holders only run the state's non-panicking methods.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop<L: Listener>(
    listener: L,
    shared: Arc<Mutex<Shared>>,
    mut stop: watch::Receiver<bool>,
    limits: DecodeLimits,
    authenticating: bool,
) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let (tx, rx) = mpsc::unbounded_channel();
                    let client = {
                        let mut shared = lock(&shared);
                        let client = ClientId(shared.next_id);
                        shared.next_id += 1;
                        match authenticating.then(crate::net::fresh_nonce) {
                            Some(Ok(nonce)) => shared.state.handle_connect_with(client, nonce),
                            Some(Err(e)) => {
                                tracing::error!(%peer, "refusing a store client: no random challenge for it: {e}");
                                continue;
                            }
                            None => shared.state.handle_connect(client),
                        }
                        shared.clients.insert(client, tx);
                        client
                    };
                    tracing::debug!(%peer, %client, "store client connected");
                    tasks.spawn(serve_client(stream, peer, client, shared.clone(), rx, stop.clone(), limits));
                }
                Err(error) => {
                    tracing::warn!(%error, "store server could not accept a connection");
                    // Out of descriptors and the like: do not spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
    tracing::info!("store server stopped");
}

/// Resolves once shutdown is requested (or the server handle is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // An error means the sender is gone: stop as well.
    let _ = stop.wait_for(|stop| *stop).await;
}

/// How a client connection ended.
enum Ending {
    Eof,
    Truncated(usize),
    Garbage(DecodeError),
    Refused(CloseReason),
    Io(io::Error),
    Shutdown,
}

async fn serve_client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    peer: SocketAddr,
    client: ClientId,
    shared: Arc<Mutex<Shared>>,
    mut outgoing: mpsc::UnboundedReceiver<Outgoing>,
    mut stop: watch::Receiver<bool>,
    limits: DecodeLimits,
) {
    let (mut reader, mut writer) = tokio::io::split(stream);
    let mut decoder = RequestDecoder::new(limits);
    let mut buf = super::ReadBuf::new();
    let ending = loop {
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => break Ending::Shutdown,
            out = outgoing.recv() => match out {
                Some(Outgoing::Bytes(bytes)) => {
                    if let Err(e) = writer.write_all(&bytes).await {
                        break Ending::Io(e);
                    }
                }
                Some(Outgoing::Close(reason)) => break Ending::Refused(reason),
                None => break Ending::Shutdown,
            },
            read = reader.read(buf.space()) => match read {
                Ok(0) if decoder.buffered() == 0 => break Ending::Eof,
                Ok(0) => break Ending::Truncated(decoder.buffered()),
                Ok(n) => {
                    decoder.extend(buf.filled(n));
                    buf.used(n);
                    if let Err(e) = serve_requests(&shared, client, &mut decoder) {
                        break Ending::Garbage(e);
                    }
                }
                Err(e) => break Ending::Io(e),
            },
        }
    };
    if matches!(ending, Ending::Garbage(_) | Ending::Truncated(_)) {
        // Answer what was decoded before the bad bytes, as far as the peer still reads.
        while let Ok(Outgoing::Bytes(bytes)) = outgoing.try_recv() {
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
        }
    }
    match ending {
        Ending::Eof => tracing::debug!(%peer, %client, "store client disconnected"),
        Ending::Truncated(n) => tracing::warn!(
            %peer, %client,
            "disconnecting store client: connection closed in the middle of a request ({n} bytes unread)"
        ),
        Ending::Garbage(e) => tracing::warn!(%peer, %client, "disconnecting store client: {e}"),
        Ending::Refused(reason) => tracing::warn!(%peer, %client, "disconnecting store client: {reason}"),
        Ending::Io(e) => tracing::info!(%peer, %client, "store client connection failed: {e}"),
        Ending::Shutdown => {}
    }
    let mut shared = lock(&shared);
    shared.clients.remove(&client);
    shared.state.handle_disconnect(client);
}

/// Feeds every whole request in `decoder` to the state and routes the outputs.
fn serve_requests(shared: &Mutex<Shared>, client: ClientId, decoder: &mut RequestDecoder) -> Result<(), DecodeError> {
    while let Some(request) = decoder.decode()? {
        let mut shared = lock(shared);
        shared.state.handle_request(client, request);
        shared.flush();
    }
    Ok(())
}
