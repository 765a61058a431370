//! [`Net`]: listening and connecting, abstracted so the same drivers run on real sockets
//! ([`TokioNet`]) and inside the turmoil simulator (an implementation over `turmoil::net`).
//!
//! What an implementation must provide: `bind` a listener on a socket address, `accept`
//! connections on it, and `connect` to a host name and port; streams are plain byte pipes
//! (`AsyncRead + AsyncWrite`). Drivers using it read time only through `tokio::time` and write
//! `biased;` first in every `select!`, so under turmoil they are deterministic.
//!
//! A turmoil implementation is a few lines: `bind` is `turmoil::net::TcpListener::bind(addr)`,
//! `accept` is its `accept`, `connect` is `turmoil::net::TcpStream::connect((host, port))`
//! (turmoil resolves simulated host names itself).

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

/// A network: how to listen and how to connect.
pub trait Net: Clone + Send + Sync + 'static {
    /// A connected byte stream.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// A bound listener yielding [`Self::Stream`]s.
    type Listener: Listener<Stream = Self::Stream>;

    /// Binds a listener on `addr` (port 0: any free port; see [`Listener::local_addr`]).
    fn bind(&self, addr: SocketAddr) -> impl Future<Output = io::Result<Self::Listener>> + Send;

    /// Opens one connection to `host:port`; `host` is a name or an address literal.
    fn connect(&self, host: &str, port: u16) -> impl Future<Output = io::Result<Self::Stream>> + Send;

    /// The stream as a real TCP socket, if it is one: the TCP backend then serves it on its
    /// fast path (a sending thread writes its own frames, a waiting thread reads its own; see
    /// `docs/tcp.md`), which needs the socket's descriptor. Otherwise (the default: a simulated
    /// stream) the stream comes back and is served by the writer and reader tasks alone.
    fn into_tcp(stream: Self::Stream) -> Result<TcpStream, Self::Stream> {
        Err(stream)
    }

    /// Whether two ranks of one host may exchange frames through shared memory on this
    /// network (real sockets only: the simulator's hosts share no memory that its faults
    /// could cut).
    const SHARES_MEMORY: bool = false;
}

/// A bound listener.
pub trait Listener: Send + Sync + 'static {
    /// The stream type accepted connections come as.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// The next incoming connection and its peer's address.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, SocketAddr)>> + Send;

    /// The address actually bound (the chosen port when bound to port 0).
    fn local_addr(&self) -> io::Result<SocketAddr>;

    /// An accepted stream as a real TCP socket, if it is one (see [`Net::into_tcp`]).
    fn into_tcp(stream: Self::Stream) -> Result<TcpStream, Self::Stream> {
        Err(stream)
    }
}

/// A fresh authentication challenge from the operating system's generator (see
/// [`cohort_core::protocol::auth`]).
pub(crate) fn fresh_nonce() -> io::Result<cohort_core::protocol::AuthNonce> {
    let mut nonce = [0u8; cohort_core::protocol::NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(io::Error::other)?;
    Ok(cohort_core::protocol::AuthNonce(nonce))
}

/// Real sockets through tokio. Every stream, accepted or connected, has `TCP_NODELAY` set: the
/// store's requests are small and latency-bound, as PyTorch's TCPStore sets it too.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioNet;

/// A [`TokioNet`] listener.
#[derive(Debug)]
pub struct TokioListener {
    inner: TcpListener,
}

impl Net for TokioNet {
    const SHARES_MEMORY: bool = true;

    type Stream = TcpStream;
    type Listener = TokioListener;

    async fn bind(&self, addr: SocketAddr) -> io::Result<TokioListener> {
        Ok(TokioListener { inner: TcpListener::bind(addr).await? })
    }

    async fn connect(&self, host: &str, port: u16) -> io::Result<TcpStream> {
        let stream = TcpStream::connect((host, port)).await?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    fn into_tcp(stream: TcpStream) -> Result<TcpStream, TcpStream> {
        Ok(stream)
    }
}

impl Listener for TokioListener {
    type Stream = TcpStream;

    async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        let (stream, peer) = self.inner.accept().await?;
        stream.set_nodelay(true)?;
        Ok((stream, peer))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn into_tcp(stream: TcpStream) -> Result<TcpStream, TcpStream> {
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn tokio_net_connects_to_its_own_listener_with_nodelay() {
        let net = TokioNet;
        let listener = net.bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_ne!(port, 0);
        let (client, server) = tokio::join!(net.connect("127.0.0.1", port), listener.accept());
        let mut client = client.unwrap();
        let (mut server, peer) = server.unwrap();
        assert!(client.nodelay().unwrap());
        assert!(server.nodelay().unwrap());
        assert_eq!(peer, client.local_addr().unwrap());
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0; 4];
        server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
    }
}
