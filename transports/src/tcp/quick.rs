//! A small allreduce over shared memory that ends inside its submit call.
//!
//! # Why
//!
//! A 4-byte allreduce between ranks of one host is an exchange of one small frame each way
//! with each of a few peers. On the usual path the submit builds an executor for the plan and
//! returns; the waiting thread then polls the group's readers, the reader's drain finds the
//! peer's frame in the ring, and the data plane feeds it to the executor, which reduces, sends
//! on, finishes and ends the work. Each layer is cheap, but together they are most of a small
//! work's cost (`docs/performance.md`, "A small work's cost in instructions"), and on a host
//! with more ranks than cores every microsecond of it delays the rank that shares the core.
//!
//! # What it does
//!
//! When the group's world is a power of two, the tensor is small, nothing else is in flight or
//! held, the plan is a chain of exchanges of the whole buffer, one peer at a time
//! ([`Plan::exchanges`](cohort_core::schedule::Plan::exchanges): recursive doubling; one
//! exchange with two ranks, two with four), and every peer of the chain sends through shared
//! memory, the submitting thread:
//!
//! 1. holds the group's state, then, if no other thread reads the first peer's ring now, that
//!    peer's reading side (a drain takes them the other way round, so this thread only tries
//!    for it; a collective that cannot take this path is submitted the usual way under the
//!    same hold of the state);
//! 2. submits the work to the core as an inline work
//!    ([`GroupState::submit_inline`](cohort_core::group::GroupState::submit_inline)): its
//!    checks, sequence number, flight-recorder entry and desync signature are any work's (the
//!    checks made once for a description the path keeps from work to work), but it
//!    stays out of the core's table (no deadline timers, launch queue or finished event) and out
//!    of the data plane's, since it ends before the group's next input. Its first frame goes
//!    as the executor would send it, as soon as the work has passed its checks and has its
//!    sequence number (the recorder's entry is written while the frame is on its way). The
//!    collective's description is the last work's when that had the same dtype and shape, and
//!    the caller's vector carries the reduced tensor back as the `Work`'s outputs: a loop of
//!    small allreduces allocates neither;
//! 3. waits on the peer's ring for up to [`QUICK_WAIT`] for its frame, checks that it is this
//!    exchange's (group, sequence number, step, fingerprint tag, length) and combines it into
//!    the tensor where it lies; then sends the combined tensor to the next peer of the chain
//!    and waits for that peer's frame the same way, and so on. After the last exchange it
//!    finalizes (the executor's order: see the core's property test) and ends the work: its
//!    flight-recorder entry completes and its `Work` is made finished, as the usual path would
//!    have left it; once the lock is released, the completion hook runs.
//!
//! The wait spins where the rank has a core of its own. On a host with more ranks than cores
//! ([`TcpOptions::oversubscribed`](super::TcpOptions::oversubscribed)) each look that finds
//! nothing yields the core, as MPI does there: the peer the thread waits for may be the thread
//! that needs it. A spinning wait that has found nothing for
//! [`SHARED_CORE_CHECK`](super::socket::SHARED_CORE_CHECK) tells the peers which core it runs
//! on and reads where theirs run (moving off a lower rank's core, see
//! [`CoreMoves`](crate::work::Neighbours)), and yields at each look from then on if a peer's
//! thread may share its core: two ranks' threads the kernel put on one core (after a sleep,
//! say) would otherwise take turns there, each wait running out.
//!
//! Anything else goes to the one state machine: a frame that does not come in time, any other
//! frame at the read position, or a next peer's ring read by another thread hands the work off
//! as a running collective whose frames so far have gone
//! ([`DriverState::quick_hand_off`](super::state::DriverState::quick_hand_off)), with the
//! entries a submitted work has and its deadline counted from its submission. After the
//! chain's first exchange, the hand-off runs the executor again on this rank's input and the
//! peers' parts taken so far (kept for the purpose, at most a few KiB), which brings it to
//! where the chain stands. The usual readers then read what is there and the data plane judges
//! it as it judges every frame (a desync, a stale frame, the connection's end). Timeouts, stuck
//! notes, heartbeats and failure detection are the usual path's: a work ended here ended
//! within microseconds.
//!
//! A late peer makes the next collectives skip this path, for longer with each hand-off in a
//! row ([`Gate`]): one that is often busy, or that shares this rank's core on a crowded host
//! (where spinning only delays it), gains nothing from the wait. The first late peer of a
//! fresh group, before the ranks have met on the path, does not: that is the launch's skew.
//! `COHORT_SHM_QUICK=0` turns the path off.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cohort_core::group::{SinceEpoch, SubmitError};
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::Tensor;
use cohort_core::work::Rank;

use super::collective::Request;
use super::socket::{FastReader, Waited};
use super::state::{MAX_CHAIN, Payload, QuickEnd, QuickStart};
use super::{Deferred, Inner};
use crate::work::{Neighbours, Work};

/// How long the submitting thread waits for a peer's frame before handing the work to the
/// usual path. Two ranks in step send within a microsecond or two of each other; a peer
/// later than this is computing, descheduled, or gone, and the usual path's polling (which
/// yields its core, and sleeps in the end) serves that better.
pub(crate) const QUICK_WAIT: Duration = Duration::from_micros(20);

/// How long it waits where each empty look yields the core (on a host with more ranks than
/// cores): a peer in step may be a few context switches away, and a wait that yields costs
/// the host little.
pub(crate) const QUICK_WAIT_YIELDING: Duration = Duration::from_micros(100);

/// The largest tensor this path takes, in bytes: a small collective's, whose cost is the
/// bookkeeping around it (larger ones are dominated by the copy and the reduction).
pub(crate) const QUICK_MAX_BYTES: usize = 4096;

/// Collectives skipped after the first hand-off in a row; each further one in a row doubles
/// it, up to [`MAX_SKIP_SHIFT`] doublings.
const SKIP_AFTER_HAND_OFF: u32 = 16;
const MAX_SKIP_SHIFT: u32 = 8;

/// When a group tries this path, and what came of it.
pub(crate) struct Gate {
    /// How long to wait for a peer's frame, in nanoseconds: [`QUICK_WAIT`] or
    /// [`QUICK_WAIT_YIELDING`], or longer in tests that need the ranks to meet on a crowded
    /// machine.
    wait_ns: AtomicU64,
    /// Whether each empty look yields the core ([`TcpOptions::oversubscribed`](super::TcpOptions::oversubscribed)).
    yields: bool,
    /// Collectives still to skip.
    skip: AtomicU32,
    /// Hand-offs in a row.
    late: AtomicU32,
    /// Works ended in their submit call.
    pub(crate) ended: AtomicU64,
    /// Works handed to the usual path after their frame went.
    pub(crate) handed_off: AtomicU64,
    /// Of those, the ones handed off after their chain's first exchange.
    pub(crate) handed_off_later: AtomicU64,
    /// Each peer's reading side, by rank, once its shared-memory connection is attached
    /// ([`Gate::attach`]): a submit finds it here without the group's `readers` lock and its
    /// reference count (a connection that ended is never held: [`FastReader::hold`]).
    readers: Box<[OnceLock<Arc<FastReader>>]>,
    /// Whether any is: a group whose frames all go over sockets never tries the path.
    any_reader: AtomicBool,
    /// The peers in `readers`, in the order they were attached (the first `attached` places
    /// are taken, and set right after): [`Gate::neighbours`] goes through these, not through
    /// every rank.
    order: Box<[OnceLock<Rank>]>,
    attached: AtomicUsize,
    /// When the last work that ended in its submit call started, in nanoseconds after `epoch`,
    /// plus one (0: none yet). What a polling thread's `Polling::last_finished` is, kept apart
    /// so that the path stores a word where it would take the polling state's lock.
    last_ended: AtomicU64,
    /// The group's epoch ([`GroupState::epoch`](cohort_core::group::GroupState::epoch)), which
    /// a work's submission time counts from.
    epoch: Instant,
}

impl Gate {
    /// The gate of a group of `world_size` ranks whose core's epoch is `epoch`; `yields`: each
    /// empty look yields the core.
    pub(super) fn new(world_size: u32, yields: bool, epoch: Instant) -> Self {
        let wait = if yields { QUICK_WAIT_YIELDING } else { QUICK_WAIT };
        Gate {
            wait_ns: AtomicU64::new(wait.as_nanos() as u64),
            yields,
            skip: AtomicU32::new(0),
            late: AtomicU32::new(0),
            ended: AtomicU64::new(0),
            handed_off: AtomicU64::new(0),
            handed_off_later: AtomicU64::new(0),
            readers: (0..world_size).map(|_| OnceLock::new()).collect(),
            any_reader: AtomicBool::new(false),
            order: (0..world_size).map(|_| OnceLock::new()).collect(),
            attached: AtomicUsize::new(0),
            last_ended: AtomicU64::new(0),
            epoch,
        }
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("skip", &self.skip)
            .field("late", &self.late)
            .field("ended", &self.ended)
            .field("handed_off", &self.handed_off)
            .field("attached", &self.readers.iter().filter(|r| r.get().is_some()).count())
            .finish_non_exhaustive()
    }
}

impl Gate {
    fn wait(&self) -> Duration {
        Duration::from_nanos(self.wait_ns.load(Ordering::Relaxed))
    }

    /// Whether to skip this collective (counting it).
    fn skip(&self) -> bool {
        let left = self.skip.load(Ordering::Relaxed);
        if left == 0 {
            return false;
        }
        self.skip.store(left - 1, Ordering::Relaxed);
        true
    }

    /// A work submitted `at` after the epoch ([`Exchange::submitted`](super::state::Exchange::submitted))
    /// ended in its submit call. Only a thread that holds the group's state counts: a load
    /// and a store, not a locked add.
    fn took(&self, at: Duration) {
        self.late.store(0, Ordering::Relaxed);
        self.ended.store(self.ended.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        self.last_ended.store((at.as_nanos() as u64).saturating_add(1), Ordering::Relaxed);
    }

    /// When the last work that ended in its submit call started, if any has.
    pub(super) fn last_ended(&self) -> Option<Instant> {
        let ns = self.last_ended.load(Ordering::Relaxed).checked_sub(1)?;
        Some(self.epoch + Duration::from_nanos(ns))
    }

    /// A shared-memory connection to `peer` was attached: the first is the path's.
    pub(super) fn attach(&self, peer: Rank, reader: &Arc<FastReader>) {
        if let Some(slot) = self.readers.get(peer.0 as usize)
            && slot.set(reader.clone()).is_ok()
        {
            self.any_reader.store(true, Ordering::Release);
            // Peers attach from several tasks at once: each takes a place of its own (one a
            // reader finds not yet set is skipped).
            let at = self.attached.fetch_add(1, Ordering::AcqRel);
            if let Some(place) = self.order.get(at) {
                let _ = place.set(peer);
            }
        }
    }

    /// This rank (`me`)'s polling thread runs on `core` (`None`: it goes to sleep): tell each
    /// peer on shared memory, and say where theirs run (see
    /// [`CoreMoves`](crate::work::Neighbours)).
    pub(super) fn neighbours(&self, me: Rank, core: Option<u32>) -> Neighbours {
        let mut near = Neighbours::default();
        let attached = self.attached.load(Ordering::Acquire);
        for peer in self.order.iter().take(attached).filter_map(OnceLock::get) {
            let Some(theirs) = self.reader(*peer).and_then(|r| r.cores(core)) else { continue };
            near.known = true;
            if Some(theirs) == core {
                if peer.0 < me.0 {
                    near.lower_here = true;
                } else {
                    near.higher_here = true;
                }
            }
            if theirs < 64 {
                near.cores |= 1 << theirs;
                near.counts[theirs as usize] = near.counts[theirs as usize].saturating_add(1);
            }
        }
        near
    }

    /// Whether any peer's frames come through shared memory.
    pub(super) fn any_reader(&self) -> bool {
        self.any_reader.load(Ordering::Relaxed)
    }

    /// `peer`'s reading side, if its frames come through shared memory.
    fn reader(&self, peer: Rank) -> Option<&FastReader> {
        self.readers.get(peer.0 as usize)?.get().map(|r| &**r)
    }

    /// A work was handed off: because the peer was `late` (which makes the next collectives
    /// skip the path, where the wait spins), or because something else lay in the ring (a
    /// heartbeat, once a second; a frame that wraps), which says nothing about the next one.
    /// `at`: the exchange of its chain it waited for (0: the first).
    ///
    /// A wait that yields at each look does not close the path: it cost the host little, and
    /// on a crowded host a peer is late now and then only because it did not have a core (the
    /// usual path would have waited for it too). Closing the path there made the 4 B
    /// allreduce of 4 ranks on 2 cores slower (`docs/performance.md`).
    ///
    /// Nor does the first late peer of a group whose path has not ended a work yet: the ranks
    /// have not met on it, and the first collective of a fresh group waits for the launch's
    /// skew (the ranks reach it up to milliseconds apart), which says nothing about the next
    /// one. Closing it there sent a fresh group's next 16 collectives the usual way, several
    /// times slower, which made them most of the slowest of its first 500. A second late one
    /// in a row closes it as any does.
    fn handed_off(&self, late: bool, at: usize) {
        if at > 0 {
            self.handed_off_later.fetch_add(1, Ordering::Relaxed);
        }
        if late && !self.yields {
            let before = self.late.load(Ordering::Relaxed);
            self.late.store(before.saturating_add(1), Ordering::Relaxed);
            let met = self.ended.load(Ordering::Relaxed) > 0;
            if met || before > 0 {
                let shift = if met { before } else { before - 1 };
                self.skip.store(SKIP_AFTER_HAND_OFF << shift.min(MAX_SKIP_SHIFT), Ordering::Relaxed);
            }
        }
        self.handed_off.fetch_add(1, Ordering::Relaxed);
    }
}

/// The time-stamp counter, calibrated against the wall clock once per process
/// ([`calibrate_ticks`]), for [`QuickClock`]. Set only where the kernel's own clock is the
/// counter: it then ticks at one rate on every core, as the wall clock does.
static TICKS: OnceLock<quanta::Clock> = OnceLock::new();

/// How long a [`QuickClock`] counts from one reading of the wall clock before it reads it
/// again. The counter and the wall clock may drift apart by at most the kernel's slew of the
/// wall clock (0.05 %), half a microsecond over this; a longer count (a counter that jumped,
/// a thread moved to a core whose counter disagrees) reads the wall clock instead.
const ANCHOR_FOR: Duration = Duration::from_millis(1);

/// The longest a reading of the wall clock may take between the counter's readings around it
/// for it to anchor the count (it takes tens of nanoseconds).
const ANCHOR_READ: Duration = Duration::from_micros(5);

/// Calibrate [`TICKS`] once per process (quanta spins for about half a millisecond where the
/// host is quiet, up to 200 ms on a crowded one), if the kernel keeps time with the counter.
/// Blocks; a group being made runs it beside its connecting ([`calibrating`]), except on a host
/// with more ranks than cores, whose works read the wall clock.
pub(super) fn calibrate_ticks() {
    if kernel_keeps_time_with_the_counter() {
        TICKS.get_or_init(quanta::Clock::new);
    }
}

/// [`calibrate_ticks`] on the runtime's blocking threads, unless it is done: a group being made
/// awaits it before its first collective, so that the calibration's spinning never takes a
/// core from a rank that runs one (two ranks of a pair sharing two cores with it made their
/// waits run out, and the path closed for thousands of works).
pub(super) fn calibrating() -> Option<tokio::task::JoinHandle<()>> {
    (TICKS.get().is_none() && kernel_keeps_time_with_the_counter())
        .then(|| tokio::task::spawn_blocking(calibrate_ticks))
}

/// Whether the kernel's clock source is the time-stamp counter, which it uses only where it
/// found the counter constant-rate and in step across cores.
fn kernel_keeps_time_with_the_counter() -> bool {
    cfg!(target_arch = "x86_64")
        && std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .is_ok_and(|source| source.trim() == "tsc")
}

/// The time as [`super::now`] gives it, counted from the group's epoch, for the works that
/// run to their end here (their start and their end): the wall clock (tokio's clock is paused
/// only in the simulator, which has no shared memory) read at most every [`ANCHOR_FOR`], and in
/// between that reading plus the time-stamp counter's count since ([`TICKS`]).
///
/// Why: a reading of the wall clock waits for every instruction before it to finish (the
/// kernel's clock reads the counter in order with them), which here costs as much as a tenth
/// of a small allreduce's time, twice a work; a plain read of the counter does not wait. And
/// the core counts a work's times from the epoch: counted so here, they are not made
/// `Instant`s only to be counted again. Never earlier than its last answer.
#[derive(Debug)]
pub(crate) struct QuickClock {
    epoch: Instant,
    /// The last reading of the wall clock, in nanoseconds from the epoch, and the counter then.
    anchor: Option<(u64, u64)>,
    /// The last answer, in nanoseconds from the epoch.
    last: u64,
}

impl QuickClock {
    /// A clock for a group whose epoch is `epoch`.
    pub(crate) fn new(epoch: Instant) -> QuickClock {
        QuickClock { epoch, anchor: None, last: 0 }
    }

    #[inline]
    pub(crate) fn now(&mut self) -> SinceEpoch {
        let ns = match (TICKS.get(), self.anchor) {
            (Some(clock), Some((at, then))) => {
                let since = clock.delta_as_nanos(then, clock.raw());
                if since < ANCHOR_FOR.as_nanos() as u64 { at + since } else { self.anchor_now(clock) }
            }
            (Some(clock), None) => self.anchor_now(clock),
            (None, _) => self.wall(),
        };
        let ns = ns.max(self.last);
        self.last = ns;
        SinceEpoch(Duration::from_nanos(ns))
    }

    /// The wall clock, in nanoseconds from the epoch.
    fn wall(&self) -> u64 {
        u64::try_from(Instant::now().saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Read the wall clock, and the counter around it: a reading the thread was descheduled in
    /// the middle of (the counter moved on by more than [`ANCHOR_READ`]) anchors nothing, since
    /// counting from it would be off by as long as the thread was away.
    #[cold]
    fn anchor_now(&mut self, clock: &quanta::Clock) -> u64 {
        let before = clock.raw();
        let now = self.wall();
        let after = clock.raw();
        self.anchor = (clock.delta(before, after) < ANCHOR_READ).then(|| (now, before + (after - before) / 2));
        now
    }
}

/// Whether `tensors`' allreduce may try this path (see the module docs): a world of a power of
/// two ranks, one small tensor, the path on and not skipping.
pub(super) fn open(inner: &Inner, tensors: &[Tensor]) -> bool {
    let small = matches!(tensors, [t] if t.nbytes() <= QUICK_MAX_BYTES);
    let world = inner.world_size;
    let chain = world >= 2 && world.is_power_of_two() && world.trailing_zeros() as usize <= MAX_CHAIN;
    let gate = &inner.quick;
    small
        && chain
        && inner.opts.shm_quick
        && !inner.opts.busy_poll.is_zero()
        && gate.any_reader.load(Ordering::Relaxed)
        && !gate.skip()
}

/// Submit `tensors`' allreduce, which [`open`] let onto this path: run it in this call if it
/// may (see the module docs), else the usual way under the same hold of the group's state.
pub(super) fn allreduce(inner: &Arc<Inner>, tensors: Vec<Tensor>, op: ReduceOp) -> Result<Work, SubmitError> {
    let hook = || inner.completion_hook();
    let gate = &inner.quick;
    // Where a rank shares its core, a look that finds nothing yields it (the peer may be the
    // thread that needs it); elsewhere the thread spins.
    let yields = gate.yields;
    // Dropped below only if it holds something: most calls gather nothing, and the drop of
    // an empty one would still look at every field.
    let mut acc = ManuallyDrop::new(Deferred::default());
    let mut took = false;
    // The group's state first, then the peer's reading side if nobody else reads it: a
    // drain takes them the other way round, so this thread only tries for the reading side
    // and never waits for it while it holds the state. An error comes back boxed, so that
    // what every small collective passes up from under the lock fits in registers.
    let (end, last) = inner.input_into(&mut acc, |st, fx| {
        let usual = |st: &mut super::state::DriverState, fx: &mut _, collective, tensors: Vec<Tensor>| {
            let payload = Payload::Collective { request: Box::new(Request::allreduce(tensors, op)), run: None };
            (st.submit(super::now(), collective, payload, hook(), fx).map(QuickEnd::Work).map_err(Box::new), None)
        };
        // Every peer of the chain on shared memory (some pairs of a group may not share a
        // host), and the first one's ring not read by another thread now.
        let ready = st
            .quick_plan(&tensors, op)
            .filter(|plan| plan.peers().all(|peer| gate.reader(peer).is_some()))
            .and_then(|plan| Some((gate.reader(plan.first_peer())?.hold()?, plan)));
        let Some((mut held, plan)) = ready else {
            return usual(st, fx, super::allreduce_collective(&tensors), tensors);
        };
        st.quick_collective(&tensors[0]);
        let started = st.quick_clock.now();
        let mut exchange = match st.quick_start(started, tensors, op, plan, hook) {
            Err(e) => return (Err(Box::new(e)), None),
            Ok(QuickStart::Busy(tensors)) => {
                let collective = st.take_quick_collective(&tensors);
                return usual(st, fx, collective, tensors);
            }
            Ok(QuickStart::Unsent(exchange, gone)) => {
                let work = st.quick_unsent(super::now(), exchange, gone, fx);
                return (Ok(QuickEnd::Work(work)), None);
            }
            Ok(QuickStart::Sent(exchange)) => exchange,
        };
        loop {
            let waited = held.wait_for(
                gate.wait(),
                yields,
                |header, payload| st.quick_take(&mut exchange, header, payload),
                || crate::work::check_core(&*inner.progress),
            );
            match waited {
                Waited::Took if st.quick_more(&exchange) => {
                    drop(held);
                    exchange = match st.quick_next(exchange) {
                        Ok(exchange) => exchange,
                        Err((exchange, gone)) => {
                            return (Ok(QuickEnd::Work(st.quick_unsent(super::now(), exchange, gone, fx))), None);
                        }
                    };
                    match gate.reader(exchange.peer()).and_then(FastReader::hold) {
                        Some(next) => held = next,
                        // Another thread reads that peer's ring now: the usual path takes it.
                        None => {
                            gate.handed_off(false, exchange.place());
                            let work = st.quick_hand_off(super::now(), exchange, false, fx);
                            return (Ok(QuickEnd::Work(work)), None);
                        }
                    }
                }
                Waited::Took => {
                    let submitted = exchange.submitted();
                    let now = st.quick_clock.now();
                    let end = st.quick_finish(now, exchange, fx);
                    // This thread read the ring for its work as a polling thread does: the
                    // reader tasks may leave their wake-ups off for a while, as after a polled
                    // work (`Inner::rearm_in`). Otherwise one that re-armed finds the peer's
                    // next frame waiting, wakes, and waits for this thread's hold on the ring,
                    // at every work.
                    gate.took(submitted);
                    took = true;
                    return (Ok(end), None);
                }
                waited @ (Waited::Other | Waited::Late) => {
                    gate.handed_off(matches!(waited, Waited::Late), exchange.place());
                    let work = st.quick_hand_off(super::now(), exchange, false, fx);
                    return (Ok(QuickEnd::Work(work)), None);
                }
                Waited::End(last) => {
                    let peer = exchange.peer();
                    gate.handed_off(false, exchange.place());
                    let work = st.quick_hand_off(super::now(), exchange, false, fx);
                    return (Ok(QuickEnd::Work(work)), Some((peer, last)));
                }
            }
        }
    });
    if let Some((peer, last)) = last
        && let Some(reader) = gate.reader(peer)
    {
        reader.finish_held(inner, last, &mut acc);
    }
    inner.finish_inputs(&mut acc);
    if !acc.is_vacant() {
        drop(ManuallyDrop::into_inner(acc));
    }
    let end = end.map_err(|e| *e);
    end.map(|end| match end {
        // Finished already: a wait has nothing to poll for or flush.
        QuickEnd::Ended(work, hook) => {
            hook.run();
            work
        }
        QuickEnd::Work(work) if took => work,
        // As the usual submit sets it for a work this small on a group with fast readers.
        QuickEnd::Work(work) => {
            work.set_progress(inner.progress.clone(), true);
            work
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use cohort_core::{DType, ReduceOp, Tensor};

    use crate::{MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
    }

    fn opts(quick: bool) -> TcpOptions {
        TcpOptions { timeout: Duration::from_secs(20), shm_quick: quick, ..TcpOptions::default() }
    }

    /// Two ranks of this process, rank `r` with `per_rank[r]`; they share memory.
    fn pair(rt: &tokio::runtime::Runtime, per_rank: [TcpOptions; 2]) -> Vec<ProcessGroup> {
        group(rt, per_rank.into())
    }

    /// Ranks of this process, rank `r` with `per_rank[r]`; every two share memory.
    fn group(rt: &tokio::runtime::Runtime, per_rank: Vec<TcpOptions>) -> Vec<ProcessGroup> {
        let world = per_rank.len();
        group_sharing(rt, per_rank, vec![world - 1; world])
    }

    /// Ranks of this process, rank `r` with `per_rank[r]`, sharing memory with `sharing[r]`
    /// peers.
    fn group_sharing(
        rt: &tokio::runtime::Runtime,
        per_rank: Vec<TcpOptions>,
        sharing: impl AsRef<[usize]>,
    ) -> Vec<ProcessGroup> {
        let world = per_rank.len() as u32;
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let pgs: Vec<ProcessGroup> = rt.block_on(async {
            let joins: Vec<_> = per_rank
                .into_iter()
                .enumerate()
                .map(|(r, o)| {
                    let store = store.clone();
                    tokio::spawn(async move { ProcessGroup::connect(TokioNet, store, r as u32, world, o).await })
                })
                .collect();
            let mut out = Vec::new();
            for j in joins {
                out.push(j.await.unwrap().expect("connect"));
            }
            out
        });
        for (pg, &want) in pgs.iter().zip(sharing.as_ref()) {
            assert_eq!(pg.shared_memory_peers().len(), want, "rank {}'s peers over shared memory", pg.rank().0);
        }
        pgs
    }

    /// Run `f(rank's group)` on a thread per rank; their outputs, by rank.
    fn on_each<T: Send + 'static>(
        pgs: Vec<ProcessGroup>,
        f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let threads: Vec<_> = pgs
            .into_iter()
            .map(|pg| {
                let f = f.clone();
                std::thread::spawn(move || f(pg))
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a rank thread")).collect()
    }

    /// Sleep 10 µs; false, to try again.
    fn sleep_a_little() -> bool {
        std::thread::sleep(Duration::from_micros(10));
        false
    }

    /// Rank `me`'s input of iteration `i`: `n` elements of `dtype`.
    fn input(me: u32, i: usize, n: usize, dtype: DType) -> Tensor {
        let v: Vec<f64> = (0..n).map(|j| ((i * 7 + j * 3 + me as usize * 5) % 11) as f64 - 3.0).collect();
        Tensor::from_f64s(dtype, &v)
    }

    /// What a two-rank allreduce with `op` gives for iteration `i`.
    fn expected(op: ReduceOp, i: usize, n: usize, dtype: DType) -> Vec<f64> {
        expected_of(op, i, n, dtype, 2)
    }

    /// What an allreduce of `world` ranks with `op` gives for iteration `i` (the inputs are
    /// small integers: every order of combining gives the same).
    fn expected_of(op: ReduceOp, i: usize, n: usize, dtype: DType, world: u32) -> Vec<f64> {
        let inputs: Vec<Vec<f64>> = (0..world).map(|r| input(r, i, n, dtype).to_f64s()).collect();
        let all = |j: usize| inputs.iter().map(move |v| v[j]);
        (0..n)
            .map(|j| match op {
                ReduceOp::Sum => all(j).sum(),
                ReduceOp::Avg if dtype.is_floating_point() => all(j).sum::<f64>() / world as f64,
                ReduceOp::Avg => (all(j).sum::<f64>() as i64 / world as i64) as f64,
                ReduceOp::Max => all(j).fold(f64::MIN, f64::max),
                ReduceOp::Min => all(j).fold(f64::MAX, f64::min),
                ReduceOp::Product => all(j).product(),
                _ => unreachable!("not used here"),
            })
            .collect()
    }

    const CASES: [(ReduceOp, DType, usize); 6] = [
        (ReduceOp::Sum, DType::F32, 1),
        (ReduceOp::Avg, DType::F32, 7),
        (ReduceOp::Max, DType::I32, 64),
        (ReduceOp::Min, DType::F64, 3),
        (ReduceOp::Product, DType::I64, 5),
        (ReduceOp::Avg, DType::I32, 1024),
    ];

    /// Allreduces of every case, `iters` rounds, each result checked; before each, `pause(rank,
    /// round)` (a late rank). The group's gate is reset before each collective, so that every
    /// one may try the path.
    fn rounds(pgs: Vec<ProcessGroup>, iters: usize, pause: fn(u32, usize) -> Duration) -> Vec<(u64, u64, u64)> {
        on_each(pgs, move |pg| {
            let me = pg.rank().0;
            for i in 0..iters {
                for (k, &(op, dtype, n)) in CASES.iter().enumerate() {
                    std::thread::sleep(pause(me, i * CASES.len() + k));
                    pg.inner.quick.skip.store(0, Ordering::Relaxed);
                    let out = pg.allreduce(vec![input(me, i, n, dtype)], op).unwrap().result().unwrap();
                    assert_eq!(out[0].dtype(), dtype);
                    let want = expected_of(op, i, n, dtype, pg.world_size());
                    assert_eq!(out[0].to_f64s(), want, "rank {me}, round {i}, {op:?} {dtype}");
                }
            }
            let gate = &pg.inner.quick;
            let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let counts = (load(&gate.ended), load(&gate.handed_off), load(&gate.handed_off_later));
            pg.shutdown();
            counts
        })
    }

    #[test]
    fn each_rank_learns_where_the_peers_polling_threads_run_and_who_of_two_on_a_core_moves() {
        let rt = runtime();
        let pgs = group(&rt, vec![opts(true); 4]);
        let near = |r: usize, core: Option<u32>| pgs[r].inner.quick.neighbours(pgs[r].rank(), core);
        assert!(!near(0, Some(1)).known, "nobody has said yet");
        // Ranks 1 and 3 on core 1, rank 2 on core 70 (beyond the mask), rank 0 asleep.
        near(1, Some(1));
        near(2, Some(70));
        near(3, Some(1));
        let n0 = near(0, None);
        assert_eq!((n0.known, n0.lower_here, n0.higher_here, n0.cores), (true, false, false, 0b10));
        assert_eq!(
            (n0.counts[0], n0.counts[1], n0.counts.iter().map(|&c| u32::from(c)).sum::<u32>()),
            (0, 2, 2),
            "two threads on core 1; core 70 is beyond the counts"
        );
        let n1 = near(1, Some(1));
        assert_eq!((n1.lower_here, n1.higher_here, n1.cores), (false, true, 0b10), "rank 3 is the one that moves");
        let n3 = near(3, Some(1));
        assert_eq!((n3.lower_here, n3.higher_here), (true, false), "rank 1 is lower: rank 3 moves");
        let n2 = near(2, Some(70));
        assert_eq!((n2.lower_here, n2.higher_here, n2.cores), (false, false, 0b10));
        // Rank 3 moved to core 0.
        near(3, Some(0));
        let n1 = near(1, Some(1));
        assert_eq!((n1.lower_here, n1.higher_here, n1.cores), (false, false, 0b01), "only the peers' cores");
        assert_eq!((n1.counts[0], n1.counts[1]), (1, 0), "only the peers' threads");
        for pg in pgs {
            pg.shutdown();
        }
    }

    #[test]
    fn the_quick_clock_keeps_to_the_wall_clock_and_never_goes_back() {
        super::calibrate_ticks();
        let counted = super::kernel_keeps_time_with_the_counter();
        assert_eq!(
            super::TICKS.get().is_some(),
            counted,
            "calibrated exactly where the kernel keeps time with the counter"
        );
        // Where the counter counts, its answers stray from the wall clock's by at most half a
        // reading's time around its anchor and a little drift; a count scaled wrongly, or not
        // added, is off by up to a millisecond.
        let slack = if counted { super::ANCHOR_READ } else { Duration::ZERO };
        let epoch = Instant::now();
        let mut clock = super::QuickClock::new(epoch);
        let (mut last, mut anchors) = (None, std::collections::BTreeSet::new());
        for i in 0..20_000 {
            if i % 2_000 == 1_999 {
                // Past the anchor's time: the next answer reads the wall clock again.
                std::thread::sleep(super::ANCHOR_FOR + Duration::from_micros(200));
            }
            let before = epoch.elapsed();
            let now = clock.now().0;
            let after = epoch.elapsed();
            assert!(
                now + slack >= before && now <= after + slack,
                "answer {i}: {now:?} not between {before:?} and {after:?}"
            );
            assert!(last.is_none_or(|last| now >= last), "answer {i} went back");
            last = Some(now);
            anchors.extend(clock.anchor.map(|(at, _)| at));
        }
        if counted {
            assert!(anchors.len() >= 10, "read the wall clock again after each pause: {} anchors", anchors.len());
        } else {
            assert!(anchors.is_empty(), "without a calibrated counter every answer is the wall clock's");
        }
    }

    #[test]
    fn a_late_peer_closes_a_spinning_path_for_longer_each_time_in_a_row_and_nothing_else_does() {
        let epoch = Instant::now();
        let gate = super::Gate::new(2, false, epoch);
        let skipped = |gate: &super::Gate| (0..10_000).take_while(|_| gate.skip()).count();
        assert_eq!(skipped(&gate), 0, "open from the start");
        assert_eq!(gate.last_ended(), None);
        gate.handed_off(false, 0);
        assert_eq!(skipped(&gate), 0, "a heartbeat in the way closes nothing");
        gate.handed_off(true, 0);
        assert_eq!(skipped(&gate), 0, "before the ranks first met on the path, one late peer closes nothing");
        for want in [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 4096] {
            gate.handed_off(true, 0);
            assert_eq!(skipped(&gate), want);
        }
        let at = Duration::from_micros(1234);
        gate.took(at);
        assert_eq!(gate.last_ended(), Some(epoch + at), "what the reader tasks' grace counts from");
        gate.handed_off(true, 0);
        assert_eq!(skipped(&gate), 16, "a work that ended in its call starts the count again, and closes it at once");
        assert_eq!(gate.ended.load(Ordering::Relaxed), 1);
        assert_eq!(gate.handed_off.load(Ordering::Relaxed), 13);
        assert_eq!(gate.handed_off_later.load(Ordering::Relaxed), 0);
        gate.handed_off(false, 1);
        assert_eq!(gate.handed_off_later.load(Ordering::Relaxed), 1, "one after its chain's first exchange");

        // Where the wait yields the core, lateness closes nothing, and it waits longer.
        let yielding = super::Gate::new(2, true, epoch);
        for _ in 0..3 {
            yielding.handed_off(true, 0);
            assert_eq!(skipped(&yielding), 0);
        }
        assert_eq!(yielding.wait(), super::QUICK_WAIT_YIELDING);
        assert_eq!(gate.wait(), super::QUICK_WAIT);
    }

    /// Two ranks with the path on that wait long for each other's frame: on a machine busy with
    /// other tests the two rank threads may seldom run at once, so each waits long enough for
    /// the other to be scheduled.
    fn patient_pair(rt: &tokio::runtime::Runtime) -> Vec<ProcessGroup> {
        let pgs = pair(rt, [opts(true), opts(true)]);
        for pg in &pgs {
            pg.inner.quick.wait_ns.store(50_000_000, Ordering::Relaxed);
        }
        pgs
    }

    #[test]
    fn small_allreduces_between_two_ranks_end_in_their_submit_call_with_the_usual_result() {
        let rt = runtime();
        let pgs = patient_pair(&rt);
        let counts = rounds(pgs, 300, |_, _| Duration::ZERO);
        for (rank, (ended, handed_off, _)) in counts.into_iter().enumerate() {
            // Some find the ring read by another thread, or the peer's frame read already.
            assert!(ended + handed_off <= 1800);
            eprintln!("rank {rank}: {ended} ended in their submit call, {handed_off} handed off");
            // Two threads in step meet within the wait almost every time.
            assert!(ended > 0, "rank {rank}: none of 1,800 allreduces ended in its submit call");
        }
    }

    #[test]
    fn a_work_ended_in_its_submit_call_runs_the_completion_hook_once_before_it_returns() {
        use cohort_core::work::{OpType, WorkState};
        let rt = runtime();
        let seen = on_each(patient_pair(&rt), |pg| {
            let me = pg.rank().0;
            let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
            let c = calls.clone();
            // A hook may call back into the group: it runs with the group's state unlocked.
            let inner = Arc::downgrade(&pg.inner);
            pg.set_completion_hook(move |info| {
                // Another thread (a runtime task) may hold it for a moment: try for a while.
                let unlocked =
                    inner.upgrade().is_some_and(|i| (0..1000).any(|_| i.state.try_lock().is_ok() || sleep_a_little()));
                assert!(unlocked, "work {}: the hook ran under the group's lock", info.seq.0);
                c.lock().unwrap().push((info.seq.0, info.op, info.state));
            });
            for i in 0..200 {
                let work = pg.allreduce(vec![input(me, i, 1, DType::F32)], ReduceOp::Sum).unwrap();
                if pg.inner.quick.ended.load(Ordering::Relaxed) as usize == i + 1 {
                    // It ended in the call: its hook has run, once, and it is finished.
                    assert!(work.is_completed(), "rank {me}, work {i}");
                    assert_eq!(calls.lock().unwrap().len(), i + 1, "rank {me}, work {i}: one call by its return");
                }
                assert_eq!(work.result().unwrap()[0].to_f64s(), expected(ReduceOp::Sum, i, 1, DType::F32));
            }
            pg.shutdown();
            let ended = pg.inner.quick.ended.load(Ordering::Relaxed);
            (ended, calls.lock().unwrap().clone())
        });
        for (rank, (ended, calls)) in seen.into_iter().enumerate() {
            assert!(ended > 0, "rank {rank}: none of 200 allreduces ended in its submit call");
            let want: Vec<_> = (1..=200).map(|s| (s, OpType::Allreduce, WorkState::Completed)).collect();
            assert_eq!(calls, want, "rank {rank}: one call a work, in order, each completed");
        }
    }

    #[test]
    fn each_work_is_recorded_with_its_own_shape_and_dtype_when_they_change_from_work_to_work() {
        use cohort_core::recorder::Dump;
        // The path keeps the last work's description for the next of the same dtype and shape:
        // shapes and dtypes that change at every work, and some that repeat, must each be
        // recorded as they are.
        let shapes: [(DType, &[usize]); 7] = [
            (DType::F32, &[1]),
            (DType::F32, &[1]),
            (DType::F32, &[2, 3]),
            (DType::F32, &[6]),
            (DType::I64, &[6]),
            (DType::I64, &[6]),
            (DType::F32, &[1]),
        ];
        let rt = runtime();
        let dumps = on_each(patient_pair(&rt), move |pg| {
            let me = pg.rank().0;
            for i in 0..20 {
                for &(dtype, shape) in &shapes {
                    let n = shape.iter().product();
                    let t = input(me, i, n, dtype).reshape(shape).unwrap();
                    let out = pg.allreduce(vec![t], ReduceOp::Sum).unwrap().result().unwrap();
                    assert_eq!(out[0].shape(), shape);
                    assert_eq!(out[0].to_f64s(), expected(ReduceOp::Sum, i, n, dtype));
                }
            }
            let ended = pg.inner.quick.ended.load(Ordering::Relaxed);
            let dump = Dump::from_json(&pg.flight_recorder_json()).unwrap();
            pg.shutdown();
            (ended, dump)
        });
        for (rank, (ended, dump)) in dumps.into_iter().enumerate() {
            assert!(ended > 0, "rank {rank}: none of 140 allreduces ended in its submit call");
            assert_eq!(dump.entries.len(), 140);
            for (k, e) in dump.entries.iter().enumerate() {
                let (dtype, shape) = shapes[k % shapes.len()];
                let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
                assert_eq!(e.input_sizes, vec![want.clone()], "rank {rank}, entry {k}");
                assert_eq!(e.output_sizes, vec![want], "rank {rank}, entry {k}");
                let name = if dtype == DType::F32 { "Float" } else { "Long" };
                assert_eq!(e.input_dtypes, vec![name.to_string()], "rank {rank}, entry {k}");
            }
        }
    }

    #[test]
    fn a_late_peer_gets_the_work_handed_to_the_usual_path_with_the_same_result() {
        let rt = runtime();
        // Rank 1 is 50 ms late for every other collective: rank 0, spinning 20 µs, hands those
        // off (all 6, unless this thread was itself held up that long).
        let late =
            |me: u32, k: usize| if me == 1 && k.is_multiple_of(2) { Duration::from_millis(50) } else { Duration::ZERO };
        let counts = rounds(pair(&rt, [opts(true), opts(true)]), 2, late);
        assert!(counts[0].1 >= 1, "rank 0 handed off none of the 6 works its peer was late for");
    }

    #[test]
    fn a_rank_with_the_path_turned_off_meets_one_with_it_on() {
        let rt = runtime();
        let pause =
            |me: u32, k: usize| Duration::from_micros(if (k + me as usize).is_multiple_of(5) { 300 } else { 0 });
        let counts = rounds(pair(&rt, [opts(true), opts(false)]), 40, pause);
        assert_eq!(counts[1], (0, 0, 0), "rank 1 has it off");
    }

    /// `world` ranks with the path on (or `quick` off) that wait long for each other's frames
    /// (see `patient_pair`); with `yields`, as on a host with more ranks than cores.
    fn patient_group(rt: &tokio::runtime::Runtime, world: usize, quick: bool, yields: bool) -> Vec<ProcessGroup> {
        let pgs = group(rt, vec![TcpOptions { oversubscribed: yields, ..opts(quick) }; world]);
        for pg in &pgs {
            pg.inner.quick.wait_ns.store(50_000_000, Ordering::Relaxed);
        }
        pgs
    }

    #[test]
    fn small_allreduces_of_four_and_eight_ranks_end_in_their_submit_call_with_the_usual_result() {
        // Four threads that spin for each other's frames; eight (on two cores) that yield.
        for (world, yields, iters) in [(4, false, 60), (8, true, 20)] {
            let rt = runtime();
            let counts = rounds(patient_group(&rt, world, true, yields), iters, |_, _| Duration::ZERO);
            for (rank, (ended, handed_off, later)) in counts.into_iter().enumerate() {
                eprintln!(
                    "{world} ranks, rank {rank}: {ended} ended in their call, {handed_off} handed off ({later} later)"
                );
                assert!(ended > 0, "{world} ranks, rank {rank}: none of {} ended in its submit call", iters * 6);
            }
        }
    }

    #[test]
    fn a_rank_that_shares_memory_with_no_peer_meets_three_that_do() {
        // Rank 3 reaches every peer over sockets: ranks 1 and 2, whose chains include it, take
        // the usual path; rank 0's chain (ranks 1, then 2) is all shared memory.
        let rt = runtime();
        let mut per_rank = vec![opts(true); 4];
        per_rank[3].shared_memory = false;
        let pgs = group_sharing(&rt, per_rank, [2, 2, 2, 0]);
        for pg in &pgs {
            pg.inner.quick.wait_ns.store(50_000_000, Ordering::Relaxed);
        }
        let counts = rounds(pgs, 20, |_, _| Duration::ZERO);
        assert!(counts[0].0 > 0, "rank 0 ended none of its 120 works in its submit call: {counts:?}");
        for (rank, counts) in counts.iter().enumerate().skip(1) {
            assert_eq!(*counts, (0, 0, 0), "rank {rank} has a peer over sockets in its chain");
        }
    }

    #[test]
    fn a_peer_late_for_a_later_exchange_gets_the_work_handed_off_with_the_same_result() {
        // Four ranks: 0 with 1 and 2 with 3 first, then 0 with 2 and 1 with 3. Ranks 2 and 3 are
        // 50 ms late for every other collective: ranks 0 and 1 meet, then hand the work off at
        // their second exchange, whose executor runs their first again.
        let rt = runtime();
        let pgs = group(&rt, vec![opts(true); 4]);
        for pg in &pgs {
            pg.inner.quick.wait_ns.store(5_000_000, Ordering::Relaxed);
        }
        let late = |me: u32, k: usize| {
            if me >= 2 && k.is_multiple_of(2) { Duration::from_millis(50) } else { Duration::ZERO }
        };
        let counts = rounds(pgs, 2, late);
        let later = counts[0].2 + counts[1].2;
        assert!(later >= 1, "ranks 0 and 1 handed off none of the 6 works after their first exchange: {counts:?}");
    }

    #[test]
    fn eight_ranks_with_a_different_one_late_each_time_get_the_usual_results() {
        // Every third collective one rank (a different one each time) comes 2 ms late: its
        // peers hand off at whichever exchange of their chain waits for it (or for a peer that
        // waits for it), some after their first. The waits yield, as on a crowded host.
        let rt = runtime();
        let pgs = group(&rt, vec![TcpOptions { oversubscribed: true, ..opts(true) }; 8]);
        let late = |me: u32, k: usize| {
            let late = k.is_multiple_of(3) && me as usize == (k / 3) % 8;
            if late { Duration::from_millis(2) } else { Duration::ZERO }
        };
        let counts = rounds(pgs, 8, late);
        let later: u64 = counts.iter().map(|c| c.2).sum();
        assert!(later >= 1, "no rank handed a work off after its chain's first exchange: {counts:?}");
    }

    #[test]
    fn a_desync_of_four_ranks_blames_the_deviating_rank_as_without_the_path() {
        // Which rank fails first varies from run to run with or without the path, and so does
        // the message; the verdict does not.
        for quick in [true, false] {
            for (rank, e) in failures(4, quick, false).iter().enumerate() {
                assert!(e.contains("so rank 3 deviated; blame: rank 3"), "path {quick}, rank {rank}: {e}");
            }
        }
    }

    #[test]
    fn a_departed_peer_of_four_ranks_is_named_as_without_the_path() {
        // Rank 0, whose first exchange is with rank 1, fails first; the others learn it from
        // rank 0 or find rank 1 gone themselves: each names rank 1 either way.
        for quick in [true, false] {
            let errors = failures(4, quick, true);
            for rank in [0, 2, 3] {
                assert!(errors[rank].contains("rank 1"), "path {quick}, rank {rank}: {}", errors[rank]);
            }
        }
    }

    /// The error each rank's work ends with when the last rank passes more elements than the
    /// others, or when rank 1 has left: what the usual path says, with or without this one.
    fn failures(world: usize, quick: bool, leave: bool) -> Vec<String> {
        let rt = runtime();
        let pgs = patient_group(&rt, world, quick, false);
        on_each(pgs, move |pg| {
            let me = pg.rank().0;
            if leave && me == 1 {
                pg.shutdown();
                return String::new();
            }
            if leave {
                std::thread::sleep(Duration::from_millis(200));
            }
            let last = me as usize + 1 == world && !leave;
            let t = input(me, 0, if last { 8 } else { 4 }, DType::F32);
            // A rank that learned of the group's failure before it submits is refused at once.
            let e = match pg.allreduce(vec![t], ReduceOp::Sum) {
                Ok(work) => work.result().unwrap_err().to_string(),
                Err(e) => e.to_string(),
            };
            pg.shutdown();
            e
        })
    }

    #[test]
    fn a_desync_is_judged_as_without_the_path() {
        assert_eq!(failures(2, true, false), failures(2, false, false));
    }

    #[test]
    fn a_departed_peer_is_named_as_without_the_path() {
        let with = failures(2, true, true);
        assert!(with[0].contains("rank 1"), "{}", with[0]);
        assert_eq!(with, failures(2, false, true));
    }
}
