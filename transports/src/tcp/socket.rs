//! The fast path of a real TCP connection (tokio's `TcpStream`; the simulator's streams take
//! the generic path in `link`).
//!
//! Small collectives are bound by thread hops, not bytes: a frame went user thread → writer
//! task → socket → the peer's reader task → its waiting user thread, and each hop is a wake-up
//! (on two cores, often a context switch). Here the hops can be skipped:
//!
//! - a sender writes a small frame itself when nothing is queued ahead of it
//!   ([`super::link::LaneTx`], through a duplicate of the socket's descriptor);
//! - a thread waiting for a small work reads the socket itself for a short while
//!   ([`FastReader::drain`] with `inline`, called from [`crate::work::Work::wait`]), so that
//!   the frame that finishes its work wakes nobody.
//!
//! The reader task still serves every connection; the waiting thread only gets there first.
//! Both decode through the same [`Assembler`] under one lock, so frames keep their order.

use std::io::{self, Read};
use std::net::{Shutdown, TcpStream as StdStream};
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::task::{Context, Poll, ready};

use cohort_core::work::Rank;
use tokio::io::{AsyncWrite, Interest};
use tokio::net::TcpStream;

use super::connect::deliver;
use super::link::{Assembler, CloseTally, Inbound};
use super::{Deferred, Inner};

/// A second descriptor for `tcp`'s socket, for reads and writes from threads outside the
/// runtime that must not depend on tokio's readiness (which only a runtime thread refreshes).
pub(crate) fn duplicate(tcp: &TcpStream) -> io::Result<Arc<StdStream>> {
    let std = StdStream::from(tcp.as_fd().try_clone_to_owned()?);
    // The flag belongs to the socket, shared by both descriptors; tokio has set it already.
    std.set_nonblocking(true)?;
    Ok(Arc::new(std))
}

/// The writer task's view of a socket that senders may also write to directly.
pub(crate) struct SharedWrite {
    pub(crate) tokio: Arc<TcpStream>,
    pub(crate) std: Arc<StdStream>,
}

impl AsyncWrite for SharedWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tokio.poll_write_ready(cx))?;
            match self.tokio.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(r),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tokio.poll_write_ready(cx))?;
            match self.tokio.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(r),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.std.shutdown(Shutdown::Write) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// The reading side of one connection, shared by its reader task and waiting threads.
pub(crate) struct FastReader {
    tokio: Arc<TcpStream>,
    std: Arc<StdStream>,
    asm: Mutex<Assembler>,
    tally: Arc<CloseTally>,
    ended: AtomicBool,
}

impl FastReader {
    pub(crate) fn new(tokio: Arc<TcpStream>, std: Arc<StdStream>, asm: Assembler, tally: Arc<CloseTally>) -> Self {
        FastReader { tokio, std, asm: Mutex::new(asm), tally, ended: AtomicBool::new(false) }
    }

    /// The socket's descriptor (the duplicate this reader holds open).
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.std.as_raw_fd()
    }

    /// Whether the connection has delivered its last word.
    pub(crate) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Read and deliver whatever has arrived, until a read would block; true if anything was
    /// delivered. `inline` (a waiting user thread): give up at once if another thread is
    /// reading, and read the socket directly. The effects of what was delivered are gathered
    /// in `acc`, to be applied with no lock held.
    pub(crate) fn drain(&self, inner: &Arc<Inner>, inline: bool, acc: &mut Deferred) -> bool {
        if self.ended() {
            return false;
        }
        let mut asm = if inline {
            match self.asm.try_lock() {
                Ok(g) => g,
                Err(TryLockError::WouldBlock) => return false,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
            }
        } else {
            self.asm.lock().unwrap_or_else(|p| p.into_inner())
        };
        let mut delivered = false;
        loop {
            while let Some(next) = asm.poll_frame() {
                delivered = true;
                match next {
                    Ok(frame) => self.feed(inner, frame, acc),
                    Err(last) => return self.end(inner, last, acc),
                }
            }
            if self.ended() {
                return delivered;
            }
            let read = {
                let buf = asm.read_buf();
                if inline {
                    (&*self.std).read(buf)
                } else {
                    // Through tokio, so that a read that would block clears its readiness.
                    self.tokio.try_io(Interest::READABLE, || (&*self.std).read(buf))
                }
            };
            match read {
                Ok(0) => {
                    let eof = asm.eof();
                    return self.end(inner, eof, acc);
                }
                Ok(n) => asm.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return delivered,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let closed = asm.read_error(&e);
                    return self.end(inner, closed, acc);
                }
            }
        }
    }

    fn feed(&self, inner: &Arc<Inner>, inbound: Inbound, acc: &mut Deferred) {
        if self.tally.pass(&inbound) {
            inner.input_into(acc, |st, fx| deliver(st, fx, inbound));
        }
    }

    fn end(&self, inner: &Arc<Inner>, last: Inbound, acc: &mut Deferred) -> bool {
        self.ended.store(true, Ordering::Release);
        self.feed(inner, last, acc);
        true
    }
}

/// Which of `readers` have bytes (or an end) waiting, asked of the kernel in one `poll(2)`
/// that takes no socket lock: a waiting thread spinning on `recv` itself would contend with
/// the peer's packets for the lock of the very socket it waits on.
pub(crate) fn readable(readers: &[Arc<FastReader>]) -> impl Iterator<Item = bool> {
    let mut fds: Vec<libc::pollfd> =
        readers.iter().map(|r| libc::pollfd { fd: r.raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `fds` is a live array of `fds.len()` pollfd structs, and every descriptor in it is
    // held open by its reader, which `readers` borrows for the whole call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
    fds.into_iter().map(move |p| n > 0 && p.revents != 0)
}

/// The reader task of a fast connection: wait until the socket is readable, drain it, repeat
/// until its last word.
pub(crate) async fn run_reader(reader: Arc<FastReader>, weak: Weak<Inner>, peer: Rank) {
    loop {
        let ready = reader.tokio.readable().await;
        let Some(inner) = weak.upgrade() else { return };
        let mut acc = Deferred::default();
        match ready {
            Ok(()) => {
                reader.drain(&inner, false, &mut acc);
            }
            Err(e) => {
                let closed = Inbound::Closed { from: peer, reason: format!("read failed: {e}"), clean: false };
                reader.end(&inner, closed, &mut acc);
            }
        }
        inner.finish_inputs(acc);
        if reader.ended() {
            inner.forget_reader(&reader);
            return;
        }
    }
}
