//! [`TurmoilNet`]: the transports' [`Net`] over turmoil's simulated TCP.

use std::io;
use std::net::SocketAddr;

use cohort_transports::net::{Listener, Net};

/// turmoil's simulated network. Only usable inside a turmoil host or client: host names are
/// the simulation's (`"rank0"`, `"store"`), and an address literal names a simulated host.
#[derive(Debug, Clone, Copy, Default)]
pub struct TurmoilNet;

/// A bound [`TurmoilNet`] listener.
pub struct TurmoilListener {
    inner: turmoil::net::TcpListener,
}

impl std::fmt::Debug for TurmoilListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurmoilListener").field("local_addr", &self.inner.local_addr().ok()).finish()
    }
}

impl Net for TurmoilNet {
    type Stream = turmoil::net::TcpStream;
    type Listener = TurmoilListener;

    /// turmoil binds only unspecified or loopback addresses; a simulated host has a single
    /// interface, so binding its own address is binding the unspecified one on that port.
    async fn bind(&self, addr: SocketAddr) -> io::Result<TurmoilListener> {
        let addr = if addr.ip().is_unspecified() || addr.ip().is_loopback() {
            addr
        } else {
            SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port())
        };
        Ok(TurmoilListener { inner: turmoil::net::TcpListener::bind(addr).await? })
    }

    async fn connect(&self, host: &str, port: u16) -> io::Result<turmoil::net::TcpStream> {
        turmoil::net::TcpStream::connect((host, port)).await
    }
}

impl Listener for TurmoilListener {
    type Stream = turmoil::net::TcpStream;

    async fn accept(&self) -> io::Result<(turmoil::net::TcpStream, SocketAddr)> {
        self.inner.accept().await
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn turmoil_net_carries_bytes_between_simulated_hosts() {
        let mut sim = turmoil::Builder::new().rng_seed(1).build();
        sim.host("server", || async {
            let listener = TurmoilNet.bind("0.0.0.0:7000".parse().unwrap()).await?;
            assert_eq!(listener.local_addr()?.port(), 7000);
            let (mut s, _) = listener.accept().await?;
            let mut buf = [0; 4];
            s.read_exact(&mut buf).await?;
            s.write_all(&buf).await?;
            Ok(())
        });
        sim.client("client", async {
            let mut s = TurmoilNet.connect("server", 7000).await?;
            s.write_all(b"ping").await?;
            let mut buf = [0; 4];
            s.read_exact(&mut buf).await?;
            assert_eq!(&buf, b"ping");
            Ok(())
        });
        sim.run().unwrap();
    }
}
