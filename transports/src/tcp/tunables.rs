//! The TCP backend's tuning constants, in one place, each with the reason for its value.
//!
//! These are choices, not protocol facts: changing one changes how fast or how eagerly the
//! backend moves bytes, never what it sends. (Protocol facts, such as the header length or a
//! reserved tag, stay next to the code they describe.) The measurements behind the values are
//! in `docs/performance.md`; the design they serve is in `docs/tcp.md`. Settings a user may
//! change (`TcpOptions`, `COHORT_*` variables) are not here, only their built-in defaults where
//! the code uses a constant.

use std::time::Duration;

// ---- Sending -----------------------------------------------------------------------------

/// Payloads up to this size are copied next to their header and written with one call; larger
/// ones go out as header then payload, without a copy. Small frames are many and a system call
/// each would dominate; for large ones the copy is the cost, and a second call is not.
pub(crate) const COALESCE_LIMIT: usize = 64 * 1024;

/// Frames up to this size may be written by the thread that sends them (see
/// [`LaneTx::send`](super::link::LaneTx::send); a collective's chunk, sent from its buffer with
/// [`LaneTx::send_slice`](super::link::LaneTx::send_slice), may be larger). The same bound as
/// [`COALESCE_LIMIT`]: a larger frame would be written by the writer task without a copy, so a
/// direct write of it spares no copy, and it would hold the sending thread in a long write.
pub(crate) const DIRECT_LIMIT: usize = COALESCE_LIMIT;

/// The most bytes one connection holds back for a submitting thread (see
/// [`Corks`](super::link::Corks)); a frame that would take it past this goes out at once, what
/// was held back ahead of it first. The same bound as [`COALESCE_LIMIT`]: held-back frames go
/// out in one write, which is what the writer task would coalesce too.
pub(crate) const CORK_LIMIT: usize = COALESCE_LIMIT;

/// How long frames may stay held back when nobody waits for a work of the group: the watcher
/// ([`Corks::watch`](super::link::Corks::watch)) writes them after this (tokio's timer rounds
/// it up to its next tick). The shortest wait the timer has: it only matters for works nobody
/// waits for, and a longer one would only delay them more.
pub(crate) const CORK_TIMEOUT: Duration = Duration::from_millis(1);

/// Bytes a writer task's coalescing buffer starts with (it grows on demand up to
/// [`COALESCE_LIMIT`]): a few small frames, small enough to hold for every connection of a
/// large job.
pub(crate) const WRITER_START: usize = 1024;

/// Frames of one collective queued for the writers and not yet written, at most: each is a
/// copy of a chunk (up to half a MiB), so this bounds what a large collective holds in the
/// queues (8 MiB) instead of copying all of its sends at once, while keeping enough queued
/// that the writers never wait for the collective.
pub(crate) const SEND_WINDOW: usize = 16;

// ---- Receiving ---------------------------------------------------------------------------

/// Bytes a connection's reads are staged in; larger payloads are read straight into their own
/// buffer. As large as [`COALESCE_LIMIT`], so that what a writer sends in one write of small
/// frames is read with one call too.
pub(crate) const STAGING: usize = 64 * 1024;

/// Smallest buffer the [`BufferPool`](super::link::BufferPool) keeps. Smaller payloads are
/// read through the staging buffer and allocated as they come: the allocator serves them from
/// memory it keeps, so pooling them saves nothing.
pub(crate) const POOL_MIN_BUFFER: usize = STAGING;

/// Bytes a [`BufferPool`](super::link::BufferPool) holds at most unless told otherwise
/// (`TcpOptions::buffer_pool_bytes`, `COHORT_BUFFER_POOL_MB`): what a collective of a few tens
/// of MiB receives, so that one of that size maps no memory after its first run, at a bounded
/// cost in memory held while the group lives.
pub(crate) const POOL_DEFAULT_LIMIT: usize = 64 << 20;

// ---- Busy polling and read notifications -------------------------------------------------

/// How far [`Polling`](super::Polling) may raise the time a waiting thread polls, over the
/// setting (`TcpOptions::busy_poll`). Enough doublings to outlast a peer's wake-up on a loaded
/// host, so two ranks that take turns sleeping fall out of step, but bounded, so a thread that
/// polls in vain gives its core back in bounded time.
pub(crate) const MAX_POLL_FACTOR: u32 = 16;

/// How long a connection's reader task leaves reading to waiting threads after the last of
/// them finished its work: a thread that waits again soon reads the next frame itself, and
/// the frame wakes nobody. Frames that nobody waits for are read at the latest this much later
/// (rounded up to the runtime's timer, a millisecond). One tick of the timer: the shortest
/// grace it can give.
pub(crate) const REARM_GRACE: Duration = Duration::from_millis(1);

/// A thread polling for its work asks the kernel about the sockets that carry only doorbells
/// or ends (of shared-memory pairs) once in this many looks. Such a `poll(2)` costs a
/// microsecond, some twenty looks at the rings, and a frame that arrives during it waits for it
/// to return; once in 64 looks keeps the system calls to a small share of a spinning thread's
/// time, and a dead peer's end is still seen within microseconds of spinning.
pub(crate) const SOCKET_LOOK_EVERY: u32 = 64;

/// How long, at most, a reader task waits between looks while threads keep polling. Each look
/// wakes the runtime's thread, which on a host with as many busy threads as cores takes the
/// core of a polling thread (this rank's or its peer's), so the task waits twice as long after
/// each look that finds a thread polling or one that finished a work within [`REARM_GRACE`]
/// (as every work ended in its submit call does), from [`REARM_GRACE`] up to this; the first
/// look that re-arms starts over. The price: once polling stops, the set may stay unarmed until
/// the task's next look, so frames that nobody polls for then (a work submitted right after a
/// run of polled ones and not waited for, a heartbeat) are read up to this much plus
/// [`REARM_GRACE`] after the last polling thread finished. A thread that goes to sleep arms the
/// set itself. 8 ms keeps that delay far below any timeout while making the looks rare.
pub(crate) const REARM_BACKOFF_MAX: Duration = Duration::from_millis(8);

/// How often a device work looks whether its inputs have reached the host. Short against a
/// collective's time, long enough that the looks cost little CPU.
pub(crate) const DEVICE_POLL_INTERVAL: Duration = Duration::from_micros(100);

/// How often rank 0 of a monitored barrier looks at the tokens that arrived. The barrier is a
/// debugging aid, not a fast path: a coarse interval keeps it cheap.
pub(crate) const MONITORED_BARRIER_POLL: Duration = Duration::from_millis(2);

// ---- Connections and shutdown ------------------------------------------------------------

/// How long an accepted connection may take to send its handshake. A rank sends it right
/// after connecting, so anything that takes this long is not a rank of this group; the bound
/// keeps such a connection from holding up anybody.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The first pause between attempts to dial a peer that is not listening yet. Ranks start
/// within milliseconds of each other, so the first retries come quickly.
pub(crate) const DIAL_BACKOFF_MIN: Duration = Duration::from_millis(5);

/// The longest pause between attempts to dial a peer (the pause doubles from
/// [`DIAL_BACKOFF_MIN`]): a rank that starts late is found within half a second of listening,
/// without a storm of connection attempts while it is not there.
pub(crate) const DIAL_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// How long a listener pauses after a failed `accept` (out of file descriptors, say) before it
/// tries again, so that a persistent failure does not spin.
pub(crate) const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// How often the store is read for failures published by other ranks when heartbeats are off
/// (with heartbeats on, it is read at their interval).
pub(crate) const STORE_ERROR_POLL: Duration = Duration::from_secs(1);

/// How long a shutdown waits for queued frames to be written: long enough for the frames of
/// works in flight on a healthy connection, short enough that a dead peer does not hold up the
/// process's exit.
pub const SHUTDOWN_FLUSH: Duration = Duration::from_secs(2);

/// How often a blocking [`ProcessGroup::shutdown`](super::ProcessGroup::shutdown) looks whether
/// its writers have finished.
pub(crate) const SHUTDOWN_POLL: Duration = Duration::from_millis(1);
