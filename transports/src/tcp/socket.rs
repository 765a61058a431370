//! The fast path of a real TCP connection (tokio's `TcpStream`; the simulator's streams take
//! the generic path in `link`).
//!
//! Small collectives are bound by thread hops, not bytes: a frame went user thread → writer
//! task → socket → the peer's reader task → its waiting user thread, and each hop is a wake-up
//! (on two cores, often a context switch). Here the hops can be skipped:
//!
//! - a sender writes a small frame itself when nothing is queued ahead of it
//!   ([`super::link::LaneTx`], on the socket the writer task also writes to);
//! - a thread waiting for a work of up to [`super::BUSY_POLL_MAX_BYTES`] reads the socket
//!   itself for a while ([`FastReader::drain`] with `inline`, called from
//!   [`crate::work::Work::wait`]), so that the frame that finishes its work wakes nobody;
//! - the runtime is not told of arriving bytes while threads read them ([`FastSocket`],
//!   [`run_reader`]).
//!
//! The reader task reads whatever no waiting thread does. Both decode through the same
//! [`Assembler`] under one lock, so frames keep their order.
//!
//! # Over shared memory
//!
//! When the pair agreed on a shared-memory segment (see [`super::shm`]), a connection's frames
//! go through the segment's rings instead ([`ShmPath`]): senders and the writer task write
//! into the outgoing ring ([`ShmWire`], [`ShmWrite`]), waiting threads and the reader task read
//! the incoming one through the same assembler. The socket stays open and carries only
//! doorbells (one byte: "look at the ring") and the end of the stream: a peer that dies
//! closes it, so it is named as fast as on TCP. The one-shot epoll set keeps its meaning:
//! while it is armed the reader asks the peer for a doorbell (the ring's `want_data`), while
//! threads poll it does not, and nobody is woken by bytes a polling thread reads anyway.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream as StdStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use cohort_core::work::Rank;
use spin::mutex::SpinMutex;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncWrite, Interest};
use tokio::net::TcpStream;

use cohort_core::protocol::{FrameHeader, FrameKind, HEADER_LEN};
#[cfg(doc)]
use cohort_core::shm::Segment;
use cohort_core::shm::{Consumer, Producer, Warmer};

use super::link::{Assembler, CloseTally, Inbound, Wire};
use super::shm::ShmLink;
use super::state::deliver;
use super::tunables::{REARM_BACKOFF_MAX, REARM_GRACE};
use super::{Deferred, Inner};

/// What a reader task with an unarmed epoll set does next ([`Inner::rearm_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rearm {
    /// Arm it: nobody polls, and the grace after the last one has passed (or a thread sleeps).
    Now,
    /// Look again after this long, what is left of the grace after the last poller finished.
    After(Duration),
    /// A thread polls now: look again later (see [`REARM_BACKOFF_MAX`]).
    WhilePolling,
}

/// A real TCP connection taken out of tokio's hands: tokio would wake a runtime thread for
/// every segment that arrives (its registration asks for reads and writes alike), even one a
/// waiting thread has already read; on two cores that wake-up pre-empts the very thread that
/// spins for the frame. Here the runtime is asked about writes only, and reads are announced
/// by an epoll set of our own that fires once, then stays silent until it is re-armed.
pub(crate) struct FastSocket {
    std: Arc<StdStream>,
    write: AsyncFd<Arc<StdStream>>,
    events: AsyncFd<OwnedFd>,
}

/// `tcp` as a [`FastSocket`]; on failure, the stream back (if it still exists) and why.
pub(crate) fn take(tcp: TcpStream) -> Result<FastSocket, (io::Error, Option<TcpStream>)> {
    let events = match one_shot_set(tcp.as_raw_fd()) {
        Ok(fd) => fd,
        Err(e) => return Err((e, Some(tcp))),
    };
    // The descriptor stays the same: `events` watches it still. tokio leaves it non-blocking.
    let std = match tcp.into_std() {
        Ok(std) => Arc::new(std),
        Err(e) => return Err((e, None)),
    };
    let back = |e: io::Error, std: Arc<StdStream>| {
        let tcp = Arc::try_unwrap(std).ok().and_then(|s| TcpStream::from_std(s).ok());
        Err((e, tcp))
    };
    // SAFETY: the `Arc` keeps the socket's descriptor open, the same one, for as long as the
    // registration lives (it owns one of the references).
    let write = match unsafe { AsyncFd::register_with_interest(std.clone(), Interest::WRITABLE) } {
        Ok(w) => w,
        Err(e) => return back(e.into_parts().1, std),
    };
    // SAFETY: the registration owns the epoll set's descriptor.
    match unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) } {
        Ok(events) => Ok(FastSocket { std, write, events }),
        Err(e) => {
            drop(write);
            back(e.into_parts().1, std)
        }
    }
}

/// An epoll set watching `fd` for reads, armed once.
fn one_shot_set(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: a plain system call; a non-negative result is a new descriptor that we own.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ep` was just created and nothing else owns it.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    epoll_ctl(&ep, libc::EPOLL_CTL_ADD, fd)?;
    Ok(ep)
}

fn epoll_ctl(ep: &OwnedFd, op: libc::c_int, fd: RawFd) -> io::Result<()> {
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT) as u32, u64: 0 };
    // SAFETY: `ep` is an open epoll descriptor, `ev` a live event struct for the call.
    if unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd, &mut ev) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl FastSocket {
    /// The socket itself, for direct writes (see [`super::link::Gate::open`]).
    pub(crate) fn std(&self) -> Arc<StdStream> {
        self.std.clone()
    }
}

/// The writer task's view of a socket that senders may also write to directly.
pub(crate) struct SharedWrite(pub(crate) Arc<FastSocket>);

impl SharedWrite {
    fn poll_io(&self, cx: &mut Context<'_>, f: impl Fn(&StdStream) -> io::Result<usize>) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.write.poll_write_ready(cx))?;
            if let Ok(r) = guard.try_io(|fd| f(fd.get_ref())) {
                return Poll::Ready(r);
            }
        }
    }
}

impl AsyncWrite for SharedWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_io(cx, |mut s| s.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_io(cx, |mut s| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.0.std.shutdown(Shutdown::Write) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// The reading side of one connection, shared by its reader task and waiting threads.
///
/// Who reads: the reader task, woken by the connection's one-shot epoll set; or, while threads
/// poll for the works they wait for (see [`super::Polling`]), those threads. Once the set has
/// fired during such a wait, it is left unarmed, so that later segments wake nobody, and
/// re-armed when no thread polls any more: at once if the last one went to sleep (it relies on
/// the task now), else by the task after [`REARM_GRACE`], which it notices at its next look
/// (see [`run_reader`] and [`REARM_BACKOFF_MAX`]).
pub(crate) struct FastReader {
    socket: Arc<FastSocket>,
    read: Mutex<Reading>,
    tally: Arc<CloseTally>,
    ended: AtomicBool,
    /// Whether the epoll set is armed (or has fired and its event is not yet taken).
    armed: AtomicBool,
    /// The connection carries small frames both ways (a peer's first connection).
    shared: bool,
    /// The reader task is draining the socket (or waits for the lock to): what it reads, a
    /// polling thread no longer finds on the socket (see [`FastReader::task_draining`]).
    task_draining: AtomicBool,
    /// The connection's frames come through shared memory (see the [module docs](self)).
    shm: Option<Arc<ShmPath>>,
    /// The peer it comes from.
    peer: Rank,
    /// The connection carries nothing but its end: another connection of the same peer has
    /// the pair's shared memory, which carries all its frames (see [`readable`]).
    quiet: AtomicBool,
    /// Over shared memory: a `poll(2)` saw the socket readable (doorbells or its end), so a
    /// polling thread's next drain reads it too; otherwise polling threads read only the ring,
    /// with no system call (see [`readable`]).
    socket_ready: AtomicBool,
    /// Wakes the reader task without its epoll set: the connection ended in a polling
    /// thread's hands (the set may be unarmed, and is never armed again), or, over shared
    /// memory, [`FastReader::arm`] found bytes waiting in the ring.
    kick: tokio::sync::Notify,
}

/// What a connection is read with, by one thread at a time (a drain, or a thread that holds it
/// to wait for one frame): the assembler, and over shared memory the incoming ring. One lock
/// for both: a reader always wants the two together (a thread that waits for one frame took
/// two locks and released two at every small collective), and the ring alone is only asked
/// whether bytes wait, which a reader that holds it is finding out anyway.
struct Reading {
    asm: Assembler,
    /// Over shared memory, the incoming ring: `Some` exactly when the reader's `shm` is.
    ring: Option<Consumer>,
}

impl FastReader {
    pub(crate) fn new(
        socket: Arc<FastSocket>,
        asm: Assembler,
        tally: Arc<CloseTally>,
        shared: bool,
        shm: Option<Arc<ShmPath>>,
    ) -> Self {
        let (ended, armed) = (AtomicBool::new(false), AtomicBool::new(true));
        let task_draining = AtomicBool::new(false);
        let kick = tokio::sync::Notify::new();
        let socket_ready = AtomicBool::new(false);
        let peer = asm.from();
        let ring = shm.as_ref().map(|path| {
            let mut ring = path.link.segment.consumer(path.link.incoming());
            if super::shm::in_barriers() {
                ring.set_sleep_barrier(super::shm::sleep_barrier);
            }
            ring
        });
        let reader = FastReader {
            socket,
            peer,
            quiet: AtomicBool::new(false),
            read: Mutex::new(Reading { asm, ring }),
            tally,
            ended,
            armed,
            shared,
            task_draining,
            shm,
            socket_ready,
            kick,
        };
        // Armed from the start: over shared memory, ask for a doorbell (or look at once).
        reader.request_data();
        reader
    }

    /// Over shared memory: ask the peer for a doorbell, or, if bytes wait already, wake the
    /// reader task instead.
    fn request_data(&self) {
        if self.shm.is_some() {
            self.request_data_on(self.reading().ring.as_ref());
        }
    }

    /// [`FastReader::request_data`] by a thread that holds the reading side (`ring` is its
    /// ring).
    fn request_data_on(&self, ring: Option<&Consumer>) {
        // A corrupt ring asks for a look, whose drain reports it.
        if ring.is_some_and(|ring| ring.request_data().unwrap_or(true)) {
            self.kick.notify_one();
        }
    }

    fn reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        self.read.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hold this connection's reading side for a thread that waits for one frame in its
    /// shared-memory ring: `None` unless its frames come through shared memory, it has not
    /// ended, no other thread reads it now and its assembler stands between frames with
    /// nothing buffered (frames read before would come first).
    pub(crate) fn hold(&self) -> Option<Held<'_>> {
        let path = self.shm.as_deref()?;
        if self.ended() {
            return None;
        }
        let read = self.read.try_lock().ok()?;
        if read.ring.is_none() || !read.asm.can_peek() {
            return None;
        }
        Some(Held { read, path })
    }

    /// Deliver the last word a held ring gave ([`Waited::End`]) as a drain does: the connection
    /// ends here. Call with no lock of the group's state held.
    pub(crate) fn finish_held(&self, inner: &Arc<Inner>, last: Inbound, acc: &mut Deferred) {
        self.end(inner, last, acc);
    }

    /// Over shared memory: tell the peer that this rank's waiting thread runs on `core`
    /// (`None`: it goes to sleep), and say where the peer's said it runs (see
    /// [`Segment::poller_core`]).
    pub(crate) fn cores(&self, core: Option<u32>) -> Option<u32> {
        self.shm.as_ref()?.cores(core)
    }

    /// The peer, if this connection's frames come through shared memory.
    pub(crate) fn shared_memory_peer(&self) -> Option<Rank> {
        self.shm.as_ref()?;
        Some(self.peer)
    }

    /// Add `new` to a group's `readers`. A peer whose frames come through shared memory sends
    /// nothing on its other connections but their ends: those are marked quiet, so that polling
    /// threads ask the kernel about them only now and then, as about the shared-memory socket
    /// (see [`readable`]), rather than with a system call at every look.
    pub(crate) fn join(readers: &mut Vec<Arc<FastReader>>, new: Arc<FastReader>) {
        let peers = readers.iter().filter(|r| r.peer == new.peer);
        if new.shm.is_some() {
            peers.filter(|r| r.shm.is_none()).for_each(|r| r.quiet.store(true, Ordering::Relaxed));
        } else if peers.clone().any(|r| r.shm.is_some()) {
            new.quiet.store(true, Ordering::Relaxed);
        }
        readers.push(new);
    }

    /// Whether polling threads look at this connection's socket only now and then: it carries
    /// shared memory's doorbells and end, or only its end ([`FastReader::join`]).
    fn looked_at_seldom(&self) -> bool {
        self.shm.is_some() || self.quiet.load(Ordering::Relaxed)
    }

    /// Whether the incoming ring holds bytes (or is corrupt, which a drain reports); false on
    /// a plain connection.
    fn ring_waiting(&self) -> bool {
        if self.shm.is_none() {
            return false;
        }
        match self.read.try_lock() {
            Ok(read) => read.ring.as_ref().is_some_and(|ring| ring.available() != Ok(0)),
            // Someone reads it now.
            Err(_) => false,
        }
    }

    /// Whether the connection carries small frames both ways (a peer's first connection: see
    /// [`Inner::progress`]).
    pub(crate) fn shared(&self) -> bool {
        self.shared
    }

    /// The socket's descriptor.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.socket.std.as_raw_fd()
    }

    /// Whether the reader task is draining the socket now. A thread polling for a work then
    /// finds the socket empty while the bytes it waits for are in the task's hands, and the
    /// task, woken on that thread's core, may wait a whole time slice for it to stop spinning,
    /// so the polling thread yields instead.
    pub(crate) fn task_draining(&self) -> bool {
        self.task_draining.load(Ordering::Acquire)
    }

    /// Whether the connection has delivered its last word.
    pub(crate) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Arm the epoll set unless it is armed already: the reader task hears of the next bytes
    /// (at once, if some are waiting).
    pub(crate) fn arm(&self) {
        if self.ended() {
            return;
        }
        if self.armed.swap(true, Ordering::AcqRel) {
            // Armed already; but a doorbell may have been taken by a polling thread since.
            self.request_data();
            return;
        }
        if let Err(e) = epoll_ctl(self.socket.events.get_ref(), libc::EPOLL_CTL_MOD, self.raw_fd()) {
            // Only a closed descriptor fails here; the reader task meets the closing anyway.
            tracing::debug!("could not re-arm a connection's read events: {e}");
        }
        self.request_data();
    }

    /// Read and deliver whatever has arrived, until a read would block; true if anything was
    /// delivered. `inline` (a waiting user thread): give up at once if another thread is
    /// reading. The effects of what was delivered are gathered in `acc`, to be applied with no
    /// lock held.
    pub(crate) fn drain(&self, inner: &Arc<Inner>, inline: bool, acc: &mut Deferred) -> bool {
        if self.ended() {
            return false;
        }
        let mut read = if inline {
            match self.read.try_lock() {
                Ok(g) => g,
                Err(TryLockError::WouldBlock) => return false,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
            }
        } else {
            self.reading()
        };
        let Reading { asm, ring } = &mut *read;
        let mut delivered = false;
        // A read that fills less than its buffer found the socket empty: stop there rather than
        // pay a system call for the `WouldBlock` (what comes later, `poll` and the re-armed
        // epoll set both see: they report the socket's level, not its edges).
        let mut emptied = false;
        loop {
            while let Some(next) = asm.poll_frame() {
                delivered = true;
                match next {
                    Ok(frame) => self.feed(inner, frame, acc),
                    Err(last) => return self.end(inner, last, acc),
                }
            }
            if self.ended() || emptied {
                return delivered;
            }
            if let (Some(path), Some(ring)) = (&self.shm, ring.as_mut()) {
                let from = asm.from();
                let fed = |header: &FrameHeader, payload: &[u8]| {
                    inner.input_into(acc, |st, fx| st.handle_frame_in_place(super::now(), from, header, payload, fx))
                };
                match path.in_place(asm, ring, fed) {
                    InPlace::Fed => {
                        delivered = true;
                        continue;
                    }
                    InPlace::Copied => continue,
                    InPlace::End(last) => return self.end(inner, last, acc),
                    InPlace::No => {}
                }
                let socket = !inline || self.socket_ready.swap(false, Ordering::AcqRel);
                match path.step(asm, ring, socket.then_some(&*self.socket.std)) {
                    ShmStep::Read => continue,
                    ShmStep::Bells => {
                        // The peer rang because the task asked; if it still relies on
                        // doorbells, ask again (this thread may stop reading any moment).
                        if self.armed.load(Ordering::Acquire) {
                            self.request_data_on(Some(ring));
                        }
                        continue;
                    }
                    ShmStep::Empty => return delivered,
                    ShmStep::End(last) => return self.end(inner, last, acc),
                }
            }
            let buf = asm.read_buf();
            let room = buf.len();
            match (&*self.socket.std).read(buf) {
                Ok(0) => {
                    let eof = asm.eof();
                    return self.end(inner, eof, acc);
                }
                Ok(n) => {
                    emptied = n < room;
                    asm.advance(n);
                }
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
        // The reader task may wait on an unarmed set: let it see the end and leave.
        self.kick.notify_one();
        self.feed(inner, last, acc);
        true
    }

    /// Wait until the epoll set fires or the reader is kicked (see `kick`), and take its
    /// event (which leaves it unarmed).
    async fn fired(&self) -> io::Result<()> {
        let fired = tokio::select! {
            biased;
            () = self.kick.notified() => Ok(()),
            fired = self.epoll_fired() => fired,
        };
        // Awake: what the peer writes now is read without a doorbell. The request is withdrawn
        // before `armed` is cleared, so that an `arm` in between leaves it standing.
        if self.shm.is_some()
            && let Some(ring) = &self.reading().ring
        {
            ring.cancel_data_request();
        }
        self.armed.store(false, Ordering::Release);
        fired
    }

    async fn epoll_fired(&self) -> io::Result<()> {
        loop {
            let mut guard = self.socket.events.readable().await?;
            let mut ev = libc::epoll_event { events: 0, u64: 0 };
            // SAFETY: the set's descriptor is open (we hold it); `ev` has room for one event.
            let n = unsafe { libc::epoll_wait(self.socket.events.as_raw_fd(), &mut ev, 1, 0) };
            match n {
                1 => return Ok(()),
                0 => guard.clear_ready(),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// Which of `readers` have bytes (or an end) waiting, asked of the kernel in one `poll(2)`
/// that takes no socket lock: a waiting thread spinning on `recv` itself would contend with
/// the peer's packets for the lock of the very socket it waits on. A shared-memory reader's
/// ring is looked at directly; its socket, which only carries doorbells and its end, and the
/// pair's other connections, which only carry their ends, only when `sockets` (a polling thread
/// asks every few looks), so that a thread spinning on rings alone makes no system call.
pub(crate) fn readable(readers: &[Arc<FastReader>], sockets: bool) -> impl Iterator<Item = bool> {
    // Between socket looks a group whose peers all share memory asks nothing of the kernel,
    // and builds nothing to ask it with.
    let ask = sockets || readers.iter().any(|r| !r.looked_at_seldom());
    let mut fds: Vec<libc::pollfd> = if ask {
        let fd = |r: &Arc<FastReader>| if r.looked_at_seldom() && !sockets { -1 } else { r.raw_fd() };
        readers.iter().map(|r| libc::pollfd { fd: fd(r), events: libc::POLLIN, revents: 0 }).collect()
    } else {
        Vec::new()
    };
    let n = if fds.iter().all(|p| p.fd < 0) {
        0
    } else {
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structs, and every descriptor in
        // it is held open by its reader, which `readers` borrows for the whole call (poll skips
        // the negative ones).
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) }
    };
    readers.iter().enumerate().map(move |(i, r)| {
        let socket = n > 0 && fds.get(i).is_some_and(|p| p.revents != 0);
        if socket && r.shm.is_some() {
            r.socket_ready.store(true, Ordering::Release);
        }
        socket || r.ring_waiting()
    })
}

/// A connection's shared-memory rings and what serves them (see the [module docs](self)).
pub(crate) struct ShmPath {
    /// The segment, to say where this rank's waiting thread runs and to read where the
    /// peer's does ([`Segment::poller_core`]).
    link: ShmLink,
    wire: Arc<ShmWire>,
    /// The writer task, waiting for room in the outgoing ring.
    space: Mutex<Option<std::task::Waker>>,
    /// The socket has ended; the ring is read to its end before that is delivered.
    eof: AtomicBool,
}

/// The connection's last word when its shared-memory ring is corrupt (`e`), naming the peer.
fn ring_failed(asm: &Assembler, e: &cohort_core::shm::ShmError) -> Inbound {
    let from = asm.from();
    Inbound::Closed { from, reason: format!("{e} (from rank {from}'s shared memory)"), clean: false }
}

/// What a thread waiting for one frame found at a shared-memory ring's read position
/// ([`Held::wait_for`]).
pub(crate) enum Waited {
    /// The frame was taken where it lay and its room released.
    Took,
    /// Something else lies there (another frame, a frame that wraps around the ring's end):
    /// the usual readers take it from here.
    Other,
    /// Nothing came in time.
    Late,
    /// The connection's last word (a malformed frame, a corrupt ring), to be delivered as a
    /// drain delivers it ([`FastReader::finish_held`]).
    End(Inbound),
}

/// How long [`Held::wait_for`] spins before it asks whether the peer's waiting thread may share
/// its core. A peer in step on a core of its own sends within a microsecond or two of this
/// rank; one on the same core cannot send at all while this thread spins.
pub(crate) const SHARED_CORE_CHECK: Duration = Duration::from_micros(4);

/// A shared-memory connection's reading side, held by one thread that waits for one frame
/// ([`FastReader::hold`]): nobody else reads the ring meanwhile.
pub(crate) struct Held<'a> {
    /// With its ring: [`FastReader::hold`] holds only a shared-memory connection.
    read: std::sync::MutexGuard<'a, Reading>,
    path: &'a ShmPath,
}

impl Held<'_> {
    /// Spin for about `wait` (counted from the first reading of the clock, a few looks in) for
    /// a whole data frame at the ring's read position, and offer it
    /// to `take` where it lies (its header, then its payload, which `take` reads as a peer's
    /// bytes). The frame is released if `take` says it used it; anything else is left where
    /// it is for the usual readers. The header passes the decoder's checks first, exactly as a
    /// drained frame's does.
    ///
    /// A spinning wait still empty after [`SHARED_CORE_CHECK`] calls `slow` once (which
    /// tells the peer where this thread runs, moves it if the peer's runs there too, and says
    /// whether the peer's may share its core); if it may, each look from then on yields the
    /// core, as where `yields`: a peer that shares this core, or waits for it, cannot send
    /// while this thread spins.
    pub(crate) fn wait_for(
        &mut self,
        wait: std::time::Duration,
        mut yields: bool,
        mut take: impl FnMut(&FrameHeader, &[u8]) -> bool,
        slow: impl FnOnce() -> bool,
    ) -> Waited {
        let Held { read, path } = self;
        let Reading { asm, ring: Some(ring) } = &mut **read else { return Waited::Other };
        // The peer sends its part when this rank sends its own, give or take: most waits find
        // it at the first look, whose line is asked for now.
        ring.prefetch_next();
        let mut looks = 0u32;
        // The wall clock, not the runtime's (a paused runtime clock may stand anywhere), read
        // first after a few looks: a peer in step has sent by then, and then it is not read.
        let mut deadline = None;
        let mut slow = Some(slow);
        let mut check_at = None;
        loop {
            // A look at an empty ring is two loads: the frame is seen within a few nanoseconds
            // of its arrival, not after a whole look through the reader's checks.
            let found = if ring.looks_empty() {
                Ok(None)
            } else {
                ring.read_in_place(|bytes| match asm.peek_frame(bytes) {
                    // Bytes, but no whole frame at a frame boundary without wrapping.
                    None if !bytes.is_empty() => (0, Some(Waited::Other)),
                    None => (0, None),
                    Some(Err(last)) => (0, Some(Waited::End(last))),
                    Some(Ok((header, len))) => {
                        let frame = &bytes[..HEADER_LEN + len];
                        if header.kind == FrameKind::Data && take(&header, &frame[HEADER_LEN..]) {
                            (frame.len(), Some(Waited::Took))
                        } else {
                            (0, Some(Waited::Other))
                        }
                    }
                })
            };
            match found {
                Ok(Some(Waited::Took)) => {
                    // Both sides of an exchange send before they look: the peer, whose frame
                    // is here, has read this rank's frame by now or is reading it. The slot
                    // this rank's next frame to the peer goes into is asked for now, so that
                    // the next send does not wait for the peer's cache to give it up (earlier,
                    // the peer's read takes it back: "Warming the next slot" in
                    // `cohort_core::shm`).
                    path.wire.warmer.warm();
                    if ring.take_space_request() {
                        path.wire.doorbell();
                    }
                    return Waited::Took;
                }
                Ok(Some(other)) => return other,
                Ok(None) => {}
                Err(e) => return Waited::End(ring_failed(asm, &e)),
            }
            // The clock costs more than a look at the ring: read it every few looks (every
            // look where each yields, which costs more than the clock).
            looks = looks.wrapping_add(1);
            if yields || looks.is_multiple_of(64) {
                let now = std::time::Instant::now();
                if now >= *deadline.get_or_insert(now + wait) {
                    return Waited::Late;
                }
                if !yields
                    && now >= *check_at.get_or_insert(now + SHARED_CORE_CHECK)
                    && let Some(slow) = slow.take()
                {
                    yields = slow();
                }
            }
            if yields {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// What [`ShmPath::in_place`] did with the frame at the ring's read position.
pub(crate) enum InPlace {
    /// A data frame went to its collective where it lay.
    Fed,
    /// A whole frame that could not be used in place went to the assembler: poll it.
    Copied,
    /// No whole frame waits at a frame boundary without wrapping: read the usual way.
    No,
    /// The connection's last word (a malformed frame, a corrupt ring).
    End(Inbound),
}

/// What one look at a shared-memory connection found.
pub(crate) enum ShmStep {
    /// Bytes went to the assembler, or the socket ended: look again.
    Read,
    /// Doorbells were taken from the socket: look again.
    Bells,
    /// The ring is empty and the socket has nothing.
    Empty,
    /// The connection's last word.
    End(Inbound),
}

impl ShmPath {
    pub(crate) fn new(link: &ShmLink, socket: Arc<StdStream>) -> Arc<ShmPath> {
        let mut producer = link.segment.producer(link.outgoing());
        producer.set_in_barriers(super::shm::in_barriers());
        let wire = Arc::new(ShmWire { warmer: producer.warmer(), out: SpinMutex::new(producer), socket });
        Arc::new(ShmPath { link: link.clone(), wire, space: Mutex::new(None), eof: AtomicBool::new(false) })
    }

    /// Tell the peer that this rank's waiting thread runs on `core` (`None`: it sleeps), and
    /// read where the peer's said it runs.
    fn cores(&self, core: Option<u32>) -> Option<u32> {
        self.link.segment.set_poller_core(self.link.incoming(), core);
        self.link.segment.poller_core(self.link.outgoing())
    }

    /// Where senders write.
    pub(crate) fn wire(&self) -> Arc<ShmWire> {
        self.wire.clone()
    }

    /// Take the frame at the ring's read position, if it lies whole there (not wrapping) and
    /// the assembler stands between frames: a data frame `feed` takes (it says whether its
    /// collective runs) is used where it lies, and released after; any other whole frame is
    /// copied into the assembler alone, so that the frames after it can still be used in
    /// place. `feed` runs with the ring locked.
    pub(crate) fn in_place(
        &self,
        asm: &mut Assembler,
        ring: &mut Consumer,
        feed: impl FnOnce(&FrameHeader, &[u8]) -> bool,
    ) -> InPlace {
        let taken = ring.read_in_place(|bytes| match asm.peek_frame(bytes) {
            None => (0, InPlace::No),
            Some(Err(last)) => (0, InPlace::End(last)),
            Some(Ok((header, len))) => {
                let frame = &bytes[..HEADER_LEN + len];
                if header.kind == FrameKind::Data && feed(&header, &frame[HEADER_LEN..]) {
                    (frame.len(), InPlace::Fed)
                } else {
                    asm.handle_bytes(frame);
                    (frame.len(), InPlace::Copied)
                }
            }
        });
        match taken {
            Ok(InPlace::No) => InPlace::No,
            Ok(done) => {
                if matches!(done, InPlace::Fed | InPlace::Copied) && ring.take_space_request() {
                    self.wire.doorbell();
                }
                done
            }
            Err(e) => InPlace::End(ring_failed(asm, &e)),
        }
    }

    /// Move what the ring holds into the assembler; when it is empty, take the socket's
    /// doorbells (which may also be for the writer: room in the outgoing ring) and its end.
    /// `socket`: look at the socket too (a polling thread does only when `poll(2)` said it
    /// has something).
    pub(crate) fn step(&self, asm: &mut Assembler, ring: &mut Consumer, socket: Option<&StdStream>) -> ShmStep {
        match ring.read(asm.read_buf()) {
            Ok(0) => {}
            Ok(n) => {
                asm.advance(n);
                if ring.take_space_request() {
                    self.wire.doorbell();
                }
                return ShmStep::Read;
            }
            Err(e) => return ShmStep::End(ring_failed(asm, &e)),
        }
        if self.eof.load(Ordering::Acquire) {
            return ShmStep::End(asm.eof());
        }
        let Some(socket) = socket else { return ShmStep::Empty };
        let mut bells = [0u8; 64];
        match (&*socket).read(&mut bells) {
            Ok(0) => {
                // Whatever the peer wrote before it closed is in the ring: read that first.
                self.eof.store(true, Ordering::Release);
                ShmStep::Read
            }
            Ok(_) => {
                if let Some(w) = self.space.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    w.wake();
                }
                ShmStep::Bells
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => ShmStep::Empty,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => ShmStep::Read,
            Err(e) => ShmStep::End(asm.read_error(&e)),
        }
    }
}

/// The outgoing ring of a shared-memory connection, as senders and the writer task write it.
#[derive(Debug)]
pub(crate) struct ShmWire {
    /// A lock whose release is a plain store: a locked instruction after a send waits for the
    /// send's line to come over from the peer's cache ("Doorbells" in [`cohort_core::shm`]).
    /// Held for one write; a thread that finds it held yields.
    out: SpinMutex<Producer, spin::relax::Yield>,
    /// Warms the outgoing ring's next box slot ([`Held::wait_for`]).
    warmer: Warmer,
    /// The pair's socket, for doorbells.
    socket: Arc<StdStream>,
}

impl ShmWire {
    /// Tell the peer to look at the rings. A full socket already holds doorbells it will read.
    fn doorbell(&self) {
        let _ = (&*self.socket).write(&[1]);
    }

    fn producer(&self) -> spin::mutex::SpinMutexGuard<'_, Producer> {
        self.out.lock()
    }
}

impl Wire for ShmWire {
    /// A ring the peer corrupted writes nothing here: the usual write meets the error and
    /// reports it.
    fn try_write_whole(&self, frame: &[u8]) -> bool {
        let mut out = self.producer();
        if !matches!(out.write_whole(frame), Ok(true)) {
            return false;
        }
        let ring = out.take_data_request();
        drop(out);
        if ring {
            self.doorbell();
        }
        true
    }

    fn try_write(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let mut out = self.producer();
        let n = out
            .write(bufs.iter().map(|b| &**b))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let ring = n > 0 && out.take_data_request();
        drop(out);
        if ring {
            self.doorbell();
        }
        Ok(n)
    }
}

/// The writer task's view of a shared-memory connection: the outgoing ring, waiting for room
/// through a doorbell when it is full; shutting down closes the socket's writing side.
pub(crate) struct ShmWrite(pub(crate) Arc<ShmPath>);

impl ShmWrite {
    fn poll_io(&self, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let path = &self.0;
        loop {
            let n = path.wire.try_write(bufs)?;
            if n > 0 || bufs.iter().all(|b| b.is_empty()) {
                return Poll::Ready(Ok(n));
            }
            *path.space.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            match path.wire.producer().request_space(bufs.iter().map(|b| b.len()).sum()) {
                Ok(true) => continue,
                Ok(false) => return Poll::Pending,
                Err(e) => return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()))),
            }
        }
    }
}

impl AsyncWrite for ShmWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_io(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_io(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.0.wire.socket.shutdown(Shutdown::Write) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// The reader task of a fast connection: wait until the epoll set fires, drain the socket,
/// repeat until the connection's last word. While the set is unarmed (waiting threads read),
/// it looks now and then whether it should be armed again ([`Inner::rearm_in`]); anyone who
/// arms it meanwhile wakes it through the set.
pub(crate) async fn run_reader(reader: Arc<FastReader>, weak: Weak<Inner>, peer: Rank) {
    let mut backoff = REARM_GRACE;
    loop {
        let fired = loop {
            let recheck = if reader.armed.load(Ordering::Acquire) {
                None
            } else {
                let Some(inner) = weak.upgrade() else { return };
                let wait = next_look(inner.rearm_in(), &mut backoff);
                if wait.is_none() {
                    reader.arm();
                }
                wait
            };
            match recheck {
                None => break reader.fired().await,
                Some(wait) => tokio::select! {
                    biased;
                    fired = reader.fired() => break fired,
                    () = tokio::time::sleep(wait) => {}
                },
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        let mut acc = Deferred::default();
        // Until the works it ends are told, what this task reads is in its hands only.
        reader.task_draining.store(true, Ordering::Release);
        match fired {
            Ok(()) => {
                reader.drain(&inner, false, &mut acc);
            }
            Err(e) => {
                let closed = Inbound::Closed { from: peer, reason: format!("read failed: {e}"), clean: false };
                reader.end(&inner, closed, &mut acc);
            }
        }
        inner.finish_inputs(&mut acc);
        reader.task_draining.store(false, Ordering::Release);
        if reader.ended() {
            inner.forget_reader(&reader);
            return;
        }
    }
}

/// How long a reader task whose epoll set is unarmed waits before its next look, given what
/// [`Inner::rearm_in`] said (`None`: arm the set now). Each look wakes the runtime's thread for
/// some 25 µs, and on a host with as many busy threads as cores that thread takes the core of
/// a rank's spinning thread: its peer then waits for a frame that cannot come, gives up on the
/// two-rank path and skips it for a while. So the wait doubles after each look that finds the
/// set still not to be armed, from [`REARM_GRACE`] up to [`REARM_BACKOFF_MAX`], whether a thread
/// polls now or one finished a work within the grace (as every work on the two-rank path does,
/// which would otherwise bring a look every tick for as long as the run lasts); arming starts
/// over.
fn next_look(rearm: Rearm, backoff: &mut Duration) -> Option<Duration> {
    let wait = match rearm {
        Rearm::Now => {
            *backoff = REARM_GRACE;
            return None;
        }
        Rearm::After(left) => left.max(*backoff),
        Rearm::WhilePolling => *backoff,
    };
    *backoff = (*backoff * 2).min(REARM_BACKOFF_MAX);
    Some(wait)
}

/// Raise this process's soft limit on open files to at least `needed`, as far as its hard limit
/// allows (as Go's runtime does at start): a full mesh holds two descriptors a connection (the
/// socket and the fast path's epoll set), and the usual soft limit of 1,024 would stop a rank
/// at about 250 peers. `Some` says why the limit stays short of `needed`.
pub(crate) fn raise_open_files(needed: u64) -> Option<String> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a plain system call filling the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Some(format!("cannot read the limit on open files: {}", io::Error::last_os_error()));
    }
    if lim.rlim_cur >= needed {
        return None;
    }
    let want = needed.min(lim.rlim_max);
    let raised = libc::rlimit { rlim_cur: want, rlim_max: lim.rlim_max };
    // SAFETY: as above; only the soft limit changes, within the hard one.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Some(format!(
            "cannot raise the limit on open files from {} to {want}: {}",
            lim.rlim_cur,
            io::Error::last_os_error()
        ));
    }
    (want < needed).then(|| {
        format!(
            "this rank may need {needed} open files but the hard limit is {} (ulimit -Hn): raise it, or connect lazily (COHORT_LAZY_INIT=1)",
            lim.rlim_max
        )
    })
}

#[cfg(test)]
mod limit_tests {
    use super::raise_open_files;

    fn limits() -> (u64, u64) {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a plain system call filling the struct we own.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        (lim.rlim_cur, lim.rlim_max)
    }

    #[test]
    fn the_open_files_limit_is_raised_within_the_hard_limit_and_a_short_one_is_named() {
        let (soft, hard) = limits();
        assert_eq!(raise_open_files(soft.min(64)), None, "enough already: nothing to do");
        assert_eq!(limits().0, soft);
        if hard != libc::RLIM_INFINITY {
            let short = raise_open_files(hard + 1).expect("the hard limit is short");
            assert!(short.contains(&format!("the hard limit is {hard}")), "{short}");
            assert_eq!(limits().0, hard, "raised as far as it goes");
        }
    }
}

#[cfg(test)]
mod rearm_tests {
    use std::time::Duration;

    use super::{Rearm, next_look};
    use crate::tcp::tunables::{REARM_BACKOFF_MAX, REARM_GRACE};

    #[test]
    fn looks_grow_rarer_while_the_set_stays_unarmed_and_start_over_once_it_is_armed() {
        let mut backoff = REARM_GRACE;
        // A run of works ended on the two-rank path: each look finds the last one just ended.
        let left = REARM_GRACE - Duration::from_micros(3);
        let waits: Vec<_> = (0..6).map(|_| next_look(Rearm::After(left), &mut backoff)).collect();
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(waits, [ms(1), ms(2), ms(4), ms(8), ms(8), ms(8)], "doubling up to the cap");
        assert_eq!(REARM_BACKOFF_MAX, Duration::from_millis(8), "the cap this test expects");
        assert_eq!(next_look(Rearm::WhilePolling, &mut backoff), ms(8), "polling threads keep it");
        assert_eq!(next_look(Rearm::Now, &mut backoff), None, "nobody polls: arm now");
        assert_eq!(backoff, REARM_GRACE, "and start over");
        // A single work that ended: wait out what is left of the grace, at least one tick.
        assert_eq!(next_look(Rearm::After(left), &mut backoff), Some(REARM_GRACE));
        let mut long = REARM_GRACE;
        let later = Duration::from_millis(3);
        assert_eq!(next_look(Rearm::After(later), &mut long), Some(later), "never shorter than the grace left");
        assert_eq!(next_look(Rearm::WhilePolling, &mut long), ms(2));
    }
}
