//! [`Work`]: the handle a collective returns, as c10d's `Work`.
//!
//! A work is finished exactly once by the runtime (its driver calls [`WorkCompleter::finish`]);
//! any number of threads or tasks may wait for it, synchronously ([`Work::wait`],
//! [`Work::wait_timeout`]) or asynchronously (`work.await`). [`Work::from_future`] wraps any
//! future as a work, as c10d's `FutureWrappingWork`.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use cohort_core::group::WorkSummary;
use cohort_core::tensor::Tensor;
use cohort_core::work::{Lifecycle, OpType, Rank, SeqNo, WorkId, WorkResult, WorkState};

/// Why a work did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkError {
    /// The work ended without success; the result says how (timeout, comm error naming the
    /// rank, remote error naming the origin, abort).
    #[error("{op} (seq {seq}) {state}: {result}", state = state_word(result.terminal_state()))]
    Failed {
        /// The op.
        op: OpType,
        /// Its sequence number.
        seq: SeqNo,
        /// How it ended.
        result: WorkResult,
    },
    /// [`Work::wait_timeout`] gave up; the work itself goes on.
    #[error("{op} (seq {seq}) did not finish within {} ms", waited.as_millis())]
    WaitTimedOut {
        /// The op.
        op: OpType,
        /// Its sequence number.
        seq: SeqNo,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The runtime dropped the work without finishing it (it shut down).
    #[error("{op} (seq {seq}) was dropped by the runtime before it finished")]
    Dropped {
        /// The op.
        op: OpType,
        /// Its sequence number.
        seq: SeqNo,
    },
}

fn state_word(state: WorkState) -> &'static str {
    match state {
        WorkState::Completed => "completed",
        WorkState::Failed => "failed",
        WorkState::TimedOut => "timed out",
        WorkState::Aborted => "was aborted",
        WorkState::Enqueued | WorkState::Started => "is unfinished",
    }
}

/// A state as the work span records it.
fn span_state(state: WorkState) -> &'static str {
    match state {
        WorkState::Enqueued => "enqueued",
        WorkState::Started => "started",
        WorkState::Completed => "completed",
        WorkState::Failed => "failed",
        WorkState::TimedOut => "timed_out",
        WorkState::Aborted => "aborted",
    }
}

impl WorkError {
    /// The [`WorkResult`] this error stands for (a wait that gave up or a dropped work become
    /// a `CommError` with this error's text).
    pub fn to_result(&self) -> WorkResult {
        match self {
            WorkError::Failed { result, .. } => result.clone(),
            other => WorkResult::CommError { blame: cohort_core::Blame::nobody(), message: other.to_string() },
        }
    }

    /// Whom this error blames: the failed work's blame (undecided, no suspects, for a wait
    /// that gave up, a dropped work or an abort).
    pub fn blame(&self) -> cohort_core::Blame {
        match self {
            WorkError::Failed { result, .. } => result.blame().cloned().unwrap_or_else(cohort_core::Blame::nobody),
            _ => cohort_core::Blame::nobody(),
        }
    }

    /// The rank this error blames, if exactly one (see [`cohort_core::Blame::culprit`]).
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            WorkError::Failed { result, .. } => result.culprit(),
            _ => None,
        }
    }
}

impl From<WorkError> for std::io::Error {
    fn from(e: WorkError) -> Self {
        let kind = match &e {
            WorkError::WaitTimedOut { .. } => std::io::ErrorKind::TimedOut,
            WorkError::Failed { result, .. } if result.terminal_state() == WorkState::TimedOut => {
                std::io::ErrorKind::TimedOut
            }
            WorkError::Failed { result, .. } if result.terminal_state() == WorkState::Aborted => {
                std::io::ErrorKind::ConnectionAborted
            }
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

/// What a finished work reports to an on-completion hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkInfo {
    /// Its sequence number.
    pub seq: SeqNo,
    /// The op.
    pub op: OpType,
    /// How it ended.
    pub state: WorkState,
    /// From start (or enqueue) to end.
    pub duration: Option<Duration>,
}

impl WorkInfo {
    fn of(summary: &WorkSummary) -> WorkInfo {
        WorkInfo {
            seq: summary.seq,
            op: summary.op,
            state: summary.lifecycle.state(),
            duration: summary.lifecycle.duration(),
        }
    }
}

/// Called with every finished work (c10d's `register_on_completion_hook`).
pub type CompletionHook = Arc<dyn Fn(&WorkInfo) + Send + Sync>;

/// A finished work's call of its completion hook, if it has one, to be made with no lock held
/// ([`Work::finished`]). Boxed: most groups have no hook, and the call travels back up the
/// submit path inside every small collective's result, which stays small enough to pass in
/// registers this way.
#[must_use = "the hook is called only by `run`"]
pub(crate) struct HookCall(Option<Box<(CompletionHook, WorkInfo)>>);

impl HookCall {
    /// Call the hook. Call with no lock held.
    pub(crate) fn run(self) {
        if let Some(call) = self.0 {
            let (hook, info) = &*call;
            hook(info);
        }
    }
}

/// Asks the runtime to abort a work.
pub type AbortFn = Box<dyn Fn(&str) + Send + Sync>;

/// Moves works on from a thread that waits for one (see [`Work::set_progress`]), and learns
/// who waits.
pub(crate) trait Progress: Send + Sync {
    /// A thread starts polling; for how long at most.
    fn begin(&self) -> Duration;
    /// How long a polling thread spins between yields of its core (zero: it yields after
    /// every empty poll).
    fn yield_every(&self) -> Duration {
        YIELD_EVERY
    }
    /// Read what has arrived and feed it; whether anything was delivered, or `None` if the
    /// thread had better stop polling and sleep. `first`: the thread's first poll of this wait
    /// (what it waits for has often arrived already; the transport may read without asking).
    fn poll(&self, first: bool) -> Option<bool>;
    /// The thread stops polling; `finished`: its work ended.
    fn stop(&self, finished: bool);
    /// Someone (a thread, a task) starts waiting for the runtime to finish a work.
    fn sleep(&self);
    /// It stopped waiting after `time`; `polled`: how it polled before (nothing if it did not).
    fn woke(&self, time: Duration, polled: Polled);
    /// Someone waits for a work or asks about it: send what the group holds back now (a work
    /// may need this rank's own frames to end; see the TCP backend's `Corks`).
    fn flush(&self);
    /// The calling thread, which polls, runs on `core`: tell the peers that can see it, and
    /// say where theirs run (see [`CoreMoves`]). Unknown where the transport cannot say.
    fn polls_on(&self, core: u32) -> Neighbours {
        let _ = core;
        Neighbours::default()
    }
    /// The core a polling thread of this rank belongs on, where it has one and no peer says
    /// where its own runs (see [`CoreMoves`]): a wait starts there.
    fn home(&self) -> Option<usize> {
        None
    }
}

/// How a waiting thread's poll went before it slept, for [`Progress::woke`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Polled {
    /// It polled for all the time granted (a look that found another thread polling cuts
    /// the poll short, and the time says nothing then).
    pub(crate) spent: bool,
    /// Some look delivered frames: the work, or another, moved on while it polled.
    pub(crate) moved: bool,
}

/// Where the polling threads of a rank's peers run, as they said last (over shared memory:
/// [`Segment::poller_core`](cohort_core::shm::Segment::poller_core)), against the calling
/// thread's core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Neighbours {
    /// Some peer said where its thread runs (false: none shares memory with this rank, or none
    /// polls now).
    pub(crate) known: bool,
    /// A peer of a lower rank runs on this core: this thread is the one that leaves it.
    pub(crate) lower_here: bool,
    /// A peer of a higher rank runs on this core: that one leaves it.
    pub(crate) higher_here: bool,
    /// The cores (those below 64) the peers run on, one bit each: a thread that leaves its
    /// core goes to another one when it can.
    pub(crate) cores: u64,
    /// How many of the peers' threads run on each core below 64 (see [`spread`]).
    pub(crate) counts: [u8; 64],
    /// Where no peer says where it runs: the calling thread against its rank's own core, if it
    /// has one ([`TcpOptions::home_core`](crate::tcp::TcpOptions::home_core)).
    pub(crate) home: Home,
}

impl Default for Neighbours {
    fn default() -> Self {
        Neighbours { known: false, lower_here: false, higher_here: false, cores: 0, counts: [0; 64], home: Home::None }
    }
}

/// A polling thread against its rank's own core (see [`CoreMoves`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Home {
    /// It has none.
    #[default]
    None,
    /// It runs there.
    Here,
    /// It runs elsewhere; that core.
    Away(usize),
}

impl Home {
    /// A thread on `core` whose rank's own core is `home`.
    pub(crate) fn of(home: Option<usize>, core: u32) -> Home {
        match home {
            Some(home) if usize::try_from(core).is_ok_and(|c| c == home) => Home::Here,
            Some(home) => Home::Away(home),
            None => Home::None,
        }
    }
}

/// How long a polling thread spins between yields, unless its group says otherwise
/// ([`Progress::yield_every`]): a thread that waits for its core (the peer's, or this rank's
/// runtime thread, on a host where another job holds a core) gets it within this; a yield that
/// finds nobody waiting costs a system call, a few percent of this.
pub(crate) const YIELD_EVERY: Duration = Duration::from_micros(20);

/// A periodic yield that returns after longer than this gave the core to a thread that was
/// waiting for it. Where a rank has a core of its own ([`Progress::yield_every`] is not zero),
/// that is, as often as not, the peer's own polling thread: a wake-up prefers the waker's core,
/// so the two can end up on one core, and as neither sleeps again, the scheduler, which does
/// not move a task that ran a moment ago, leaves them taking turns there for tens of
/// milliseconds while another core idles, each wait costing two turns of a yield interval and
/// more. A thread that sees it moves to another core ([`CoreMoves`]). A yield to a
/// short-lived thread (this rank's runtime, a kernel worker) returns well within this.
pub(crate) const SHARED_CORE_YIELD: Duration = Duration::from_micros(10);

/// A yield that returns after this long ran a thread that does not yield (another job's busy
/// thread, which keeps the core for its time slice), not a polling thread like ours.
const NON_YIELDING: Duration = Duration::from_micros(500);

/// Whether a yield that took `late` ran another rank's polling thread: it came back later than
/// [`SHARED_CORE_YIELD`], and sooner than a thread that does not yield would have let it.
fn ran_a_polling_thread(late: Duration) -> bool {
    late > SHARED_CORE_YIELD && late < NON_YIELDING
}

/// The least time between two moves of one thread to another core.
const LEAVE_CORE_EVERY: Duration = Duration::from_millis(1);

/// The same where the peers say which cores their threads run on ([`Neighbours`]): only
/// one thread of two moves, so moves cannot chase each other.
const LEAVE_SHARED_CORE_EVERY: Duration = Duration::from_micros(100);

/// How long a thread that went back to the core it left waits before it tries another.
const AFTER_RETURN: Duration = Duration::from_secs(1);

/// What a polling thread does after a periodic yield.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CoreMove {
    Stay,
    /// To another core: one outside `avoid` (a mask of cores below 64) where there is one.
    Leave {
        avoid: u64,
    },
    /// Back to this core, the one it left.
    Return(usize),
    /// To this core, its rank's own.
    Home(usize),
    /// To this core, which has fewer polling threads ([`spread`]).
    Spread(usize),
}

/// A polling thread's moves between cores (see [`SHARED_CORE_YIELD`]), one per thread.
///
/// - Where the peers say which cores their polling threads run on ([`Neighbours`]: the ranks
///   that share memory), that decides, after each periodic yield and when a wait for a peer's
///   frame over shared memory has been empty for a while
///   ([`SHARED_CORE_CHECK`](crate::tcp::socket::SHARED_CORE_CHECK)): of two threads on one
///   core, the higher rank's leaves it, for a core no peer runs on where there is one; the
///   lower rank's stays. Exactly one of the two moves, at once, and never onto the other's
///   core. A late yield with no peer on the core ran some other thread: it moves nobody.
/// - Where nobody says, but each of the host's ranks has a core of its own ([`Home`]): a yield
///   that ran a polling thread (late by more than [`SHARED_CORE_YIELD`], less than
///   [`NON_YIELDING`]) sends the thread to its own core if it is elsewhere, and leaves it
///   where it is if it is there: of two ranks' threads on one core, exactly the one away from
///   home moves, and not onto another rank's core. A thread that wakes, or whose wait over
///   shared memory has been empty for a while, goes to its own core too: the kernel puts a
///   thread that wakes where it likes, often next to the peer's. So does every wait of a
///   group with no shared-memory peer, at its start ([`Progress::home`]).
/// - Where nothing tells: such a yield moves it to another core, on the toss of a coin
///   ([`coin`]): the thread it shares the core with, the peer's, saw the same and decides the
///   same way, and if both moved they would share the other core.
/// - It moves at most once in [`LEAVE_CORE_EVERY`] on a coin, or in [`LEAVE_SHARED_CORE_EVERY`]
///   where only one of the two threads moves: the kernel may put a thread that wakes back next
///   to its peer.
/// - The first yield after a move tells whether the new core was a better one. If it ran a
///   thread that does not yield (another job holds that core), the thread goes back at once,
///   and tries no other core for [`AFTER_RETURN`]: sharing a core with a thread that keeps it
///   for a time slice costs milliseconds a wait, sharing one with the peer's polling thread
///   tens of microseconds.
/// - A yield that ran a thread that does not yield, with no move before it, changes nothing:
///   another core may be no better.
/// - Where the host runs more ranks than cores, every empty look yields, and a yield says
///   nothing about who ran. There the peers' word alone decides, once in [`SPREAD_EVERY`]: the
///   threads spread over the cores, none holding more than its share ([`spread`]).
#[derive(Debug, Clone, Copy, Default)]
struct CoreMoves {
    /// When it last left a core.
    moved: Option<std::time::Instant>,
    /// After a return: the earliest time it may move again.
    hold: Option<std::time::Instant>,
    /// The core it left at its last move, until the first yield after it.
    left: Option<usize>,
}

impl CoreMoves {
    /// After a periodic yield at `now` that returned `late` after the time it was due, with
    /// the coin showing `heads` or not, the peers' threads being `near`.
    fn after_yield(&mut self, now: std::time::Instant, late: Duration, heads: bool, near: Neighbours) -> CoreMove {
        if let Some(core) = self.left.take()
            && late >= NON_YIELDING
        {
            self.hold = Some(now + AFTER_RETURN);
            return CoreMove::Return(core);
        }
        if near.known {
            return self.leave_if(near.lower_here, now, near);
        }
        match near.home {
            Home::None => self.leave_if(ran_a_polling_thread(late) && heads, now, near),
            // The other thread is the one away from its core.
            Home::Here => CoreMove::Stay,
            Home::Away(core) => self.go_home(ran_a_polling_thread(late), core, now),
        }
    }

    /// When a thread woke at `now`, or its wait found nothing for a while, the peers' threads
    /// being `near` (no yield to judge by).
    fn on_check(&mut self, now: std::time::Instant, near: Neighbours) -> CoreMove {
        match near.home {
            Home::Away(core) if !near.known => self.go_home(true, core, now),
            _ => self.leave_if(near.lower_here, now, near),
        }
    }

    fn leave_if(&mut self, leave: bool, now: std::time::Instant, near: Neighbours) -> CoreMove {
        // Where the peers say where they run, only this thread of the two moves: no need to
        // wait long since its last move (the kernel may have put it back next to its peer when
        // it woke), whichever way that move was decided.
        let every = if near.known { LEAVE_SHARED_CORE_EVERY } else { LEAVE_CORE_EVERY };
        if leave && self.may_move(now, every) {
            self.moved = Some(now);
            return CoreMove::Leave { avoid: near.cores };
        }
        CoreMove::Stay
    }

    fn go_home(&mut self, go: bool, core: usize, now: std::time::Instant) -> CoreMove {
        // Only the thread away from its core moves: as where the peers say.
        if go && self.may_move(now, LEAVE_SHARED_CORE_EVERY) {
            self.moved = Some(now);
            return CoreMove::Home(core);
        }
        CoreMove::Stay
    }

    /// On a host with more polling threads than cores, at `now`: to `to`, where [`spread`]
    /// found one, at most once in [`SPREAD_EVERY`].
    fn spread(&mut self, to: Option<usize>, now: std::time::Instant) -> CoreMove {
        match to {
            Some(core) if self.may_move(now, SPREAD_EVERY) => {
                self.moved = Some(now);
                CoreMove::Spread(core)
            }
            _ => CoreMove::Stay,
        }
    }

    fn may_move(&self, now: std::time::Instant, every: Duration) -> bool {
        self.hold.is_none_or(|until| now >= until) && self.moved.is_none_or(|at| now >= at + every)
    }

    /// It left `core` (`None`: it could not move).
    fn moved(&mut self, core: Option<usize>) {
        self.left = core;
    }
}

/// How long a thread that found another polling thread on its core goes on yielding at every
/// empty poll ([`TakeTurns`]) after the last yield that switched to another thread.
const TAKE_TURNS_FOR: Duration = Duration::from_millis(1);

/// A yield that took longer than this ran another thread (a bare `sched_yield` takes well
/// under it).
const SWITCHED: Duration = Duration::from_micros(2);

/// Whether a polling thread takes turns with another on its core: it yields at every empty
/// poll instead of spinning for its yield interval.
///
/// Two ranks' polling threads on one core (see [`SHARED_CORE_YIELD`]) each hold it for a
/// whole interval while the other, whose frame the first waits for, cannot run: a small
/// allreduce then takes two intervals and more instead of a few microseconds, every other
/// iteration. A thread that saw a yield run a polling thread yields at every empty poll, as an
/// oversubscribed rank does, until [`TAKE_TURNS_FOR`] has passed with no yield that switched to
/// another thread; then it spins again, and its next periodic yield tells whether the core is
/// still shared. [`CoreMoves`] meanwhile moves one of the two to another core.
#[derive(Debug, Clone, Copy, Default)]
struct TakeTurns {
    until: Option<std::time::Instant>,
}

impl TakeTurns {
    /// After a yield at `now` that took `late`.
    fn after_yield(&mut self, now: std::time::Instant, late: Duration) {
        let switched = self.taking(now) && late > SWITCHED && late < NON_YIELDING;
        if ran_a_polling_thread(late) || switched {
            self.until = Some(now + TAKE_TURNS_FOR);
        }
    }

    fn taking(&self, now: std::time::Instant) -> bool {
        self.until.is_some_and(|until| now < until)
    }

    /// How long to spin before the next yield, at `now`, for a thread whose interval is
    /// `every`.
    fn interval(&self, now: std::time::Instant, every: Duration) -> Duration {
        if self.taking(now) { Duration::ZERO } else { every }
    }
}

thread_local! {
    /// The calling thread's [`TakeTurns`].
    static TURNS: std::cell::Cell<TakeTurns> = const { std::cell::Cell::new(TakeTurns { until: None }) };
}

/// The calling thread's spin before its next yield at `now` ([`TakeTurns::interval`]).
fn turns(now: std::time::Instant, every: Duration) -> Duration {
    TURNS.get().interval(now, every)
}

thread_local! {
    /// The calling thread's [`CoreMoves`].
    static MOVES: std::cell::Cell<CoreMoves> = const { std::cell::Cell::new(CoreMoves { moved: None, hold: None, left: None }) };
}

/// The core the calling thread runs on.
fn current_core() -> Option<u32> {
    // SAFETY: a plain query about the calling thread.
    u32::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// Make `decision`, for the calling thread's `moves`; once it has moved, tell the peers.
/// Whether it moved.
fn make_move(moves: &mut CoreMoves, decision: CoreMove, progress: &dyn Progress) -> bool {
    let moved = match decision {
        CoreMove::Stay => return false,
        CoreMove::Leave { avoid } => {
            let left = move_core(None, avoid);
            moves.moved(left);
            left.is_some()
        }
        CoreMove::Home(core) | CoreMove::Spread(core) => {
            let left = move_core(Some(core), 0);
            moves.moved(left);
            left.is_some()
        }
        CoreMove::Return(core) => move_core(Some(core), 0).is_some(),
    };
    if let Some(core) = current_core() {
        progress.polls_on(core);
    }
    moved
}

/// The calling thread's [`CoreMoves`] and [`TakeTurns`], after a periodic yield at `now` that
/// took `late`.
fn after_yield(now: std::time::Instant, late: Duration, progress: &dyn Progress) {
    let mut turns = TURNS.get();
    turns.after_yield(now, late);
    TURNS.set(turns);
    let near = current_core().map_or_else(Neighbours::default, |core| progress.polls_on(core));
    let mut moves = MOVES.get();
    let decision = moves.after_yield(now, late, coin(late), near);
    make_move(&mut moves, decision, progress);
    MOVES.set(moves);
}

/// For a thread that woke up, or whose wait for a peer's frame has found nothing for a
/// while: tell the peers which core it runs on, and if a peer of a lower rank says it runs
/// there too, move to another; where no peer says, go to the rank's own core if it has one
/// and runs elsewhere ([`CoreMoves`]). Whether a peer's polling thread may share its
/// core now: one says it does, or none says where it runs (asleep, or woken and not yet
/// running: spinning would keep it off the core).
pub(crate) fn check_core(progress: &dyn Progress) -> bool {
    let Some(core) = current_core() else { return true };
    let near = progress.polls_on(core);
    if near.lower_here || (!near.known && matches!(near.home, Home::Away(_))) {
        let mut moves = MOVES.get();
        let decision = moves.on_check(std::time::Instant::now(), near);
        let moved = make_move(&mut moves, decision, progress);
        MOVES.set(moves);
        if moved {
            return false;
        }
    }
    !near.known || near.lower_here || near.higher_here
}

/// How often a polling thread on a host with more ranks than cores looks at where the peers'
/// threads run ([`spread_check`]), and the least time between two of its moves.
const SPREAD_EVERY: Duration = Duration::from_millis(1);

/// Where a host runs more ranks than cores, the core the calling thread, on `core`, should move
/// to, if any: the one of the `allowed` cores (a mask of those below 64) with the fewest of the
/// peers' polling threads (`near`), where this core has more than its share (all the threads
/// over the allowed cores, rounded up) and that one has fewer. Of the threads on a crowded
/// core only the highest rank's moves (it sees no higher one there), so one move at a time
/// evens the cores out, and it never moves onto a core that would then be crowded.
///
/// Why: a polling thread that yields at every empty look always ran a moment ago, and the
/// kernel does not move such a thread to balance its cores. Four ranks on two cores were seen
/// split three to one for 60 ms and more, the lone thread keeping a core to itself while the
/// other three took turns, which made a 1 MiB allreduce about a quarter slower
/// (`docs/performance.md`, "four ranks' threads split three to one").
fn spread(core: u32, near: &Neighbours, allowed: u64) -> Option<usize> {
    let core = usize::try_from(core).ok().filter(|&c| c < 64 && allowed >> c & 1 == 1)?;
    let cores = allowed.count_ones() as usize;
    if !near.known || near.higher_here || cores < 2 {
        return None;
    }
    let peers: usize = (0..64).filter(|&c| allowed >> c & 1 == 1).map(|c| usize::from(near.counts[c])).sum();
    let share = (peers + 1).div_ceil(cores);
    if usize::from(near.counts[core]) < share {
        return None;
    }
    let (to, there) = (0..64)
        .filter(|&c| c != core && allowed >> c & 1 == 1)
        .map(|c| (c, usize::from(near.counts[c])))
        .min_by_key(|&(c, n)| (n, c))?;
    (there < share).then_some(to)
}

thread_local! {
    /// When the calling thread last looked for a less crowded core ([`spread_check`]).
    static SPREAD_CHECKED: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// On a host with more ranks than cores, at `now`, at most once in [`SPREAD_EVERY`]: tell the
/// peers where the calling thread runs, and move it to a less crowded core if [`spread`] finds
/// one.
fn spread_check(now: std::time::Instant, progress: &dyn Progress) {
    if SPREAD_CHECKED.get().is_some_and(|at| now < at + SPREAD_EVERY) {
        return;
    }
    SPREAD_CHECKED.set(Some(now));
    let Some(core) = current_core() else { return };
    let near = progress.polls_on(core);
    if !near.known {
        return;
    }
    let allowed = allowed_cores().map_or(0, |cores| cores.iter().filter(|&&c| c < 64).fold(0u64, |m, &c| m | 1 << c));
    let mut moves = MOVES.get();
    let decision = moves.spread(spread(core, &near, allowed), now);
    make_move(&mut moves, decision, progress);
    MOVES.set(moves);
}

/// At the start of a wait: a thread away from its rank's own core `home` goes there
/// ([`CoreMoves`]), before the peer's thread, which may be on the same core, needs it.
fn go_home(home: usize, progress: &dyn Progress) {
    if current_core().is_none_or(|core| core as usize == home) {
        return;
    }
    let mut moves = MOVES.get();
    let decision = moves.go_home(true, home, std::time::Instant::now());
    make_move(&mut moves, decision, progress);
    MOVES.set(moves);
}

/// A coin toss from how late a yield was and this process's id: two ranks' threads toss apart
/// even on a clock that counts in coarse steps. A multiplicative hash's top bit.
fn coin(late: Duration) -> bool {
    let x = (late.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32);
    x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 63 == 1
}

/// Move the calling thread to core `to` (`None`: any other core it may run on), then let it run
/// wherever it could before: the kernel moves it at once, and it is not left pinned. Where `to`
/// is `None`, the cores in `avoid` (a mask of those below 64) are left out too unless no other
/// is allowed. The core it left; `None` where it could not move (no other core allowed, `to`
/// not allowed, a call failed): it stays.
fn move_core(to: Option<usize>, avoid: u64) -> Option<usize> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    let setsize = libc::CPU_SETSIZE as usize;
    // SAFETY: plain system calls on the calling thread's own affinity, with masks this frame
    // owns and their true size; every core index is checked against the masks' size.
    unsafe {
        let here = usize::try_from(libc::sched_getcpu()).ok()?;
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if here >= setsize || to.is_some_and(|c| c >= setsize) || libc::sched_getaffinity(0, size, &mut allowed) != 0 {
            return None;
        }
        let mut target = allowed;
        match to {
            None => {
                libc::CPU_CLR(here, &mut target);
                let mut elsewhere = target;
                for core in (0..64).filter(|c| avoid >> c & 1 == 1) {
                    libc::CPU_CLR(core, &mut elsewhere);
                }
                if libc::CPU_COUNT(&elsewhere) > 0 {
                    target = elsewhere;
                }
            }
            Some(core) => {
                libc::CPU_ZERO(&mut target);
                if libc::CPU_ISSET(core, &allowed) && core != here {
                    libc::CPU_SET(core, &mut target);
                }
            }
        }
        if libc::CPU_COUNT(&target) == 0 || libc::sched_setaffinity(0, size, &target) != 0 {
            return None;
        }
        libc::sched_setaffinity(0, size, &allowed);
        Some(here)
    }
}

/// The cores the calling thread may run on, in order; `None` where the call failed.
fn allowed_cores() -> Option<Vec<usize>> {
    // SAFETY: a plain query into a mask this frame owns, of its true size; every core index
    // is below the mask's size.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
            return None;
        }
        Some((0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &allowed)).collect())
    }
}

/// The `slot`-th core the calling thread may run on, where it may run on every core of the
/// host (two or more) and there are more than `slot` of them: then each of the host's ranks,
/// started alike, gets a core of its own from its `LOCAL_RANK` (see
/// [`TcpOptions::home_core`](crate::tcp::TcpOptions::home_core)). A process kept to some
/// cores by its launcher gets none: its peers' masks may differ from its own.
pub(crate) fn home_core(slot: usize) -> Option<usize> {
    let cores = allowed_cores()?;
    // SAFETY: a plain query.
    let online = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).ok()?;
    (cores.len() >= 2 && cores.len() == online).then(|| cores.get(slot).copied()).flatten()
}

/// Keep the calling thread to the `slot`-th core it may run on, counted round them (see
/// [`TcpOptions::io_core`](crate::tcp::TcpOptions::io_core)); the core, or `None` where it may
/// run on one core only or the call failed (it then runs where it did).
pub(crate) fn keep_to_core(slot: usize) -> Option<usize> {
    let cores = allowed_cores().filter(|c| c.len() > 1)?;
    let core = cores[slot % cores.len()];
    // SAFETY: sets the calling thread's affinity to a mask this frame owns, of its true size,
    // holding one core below its size.
    unsafe {
        let mut target: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut target);
        (libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &target) == 0).then_some(core)
    }
}

/// A group's [`Progress`], shared by its works.
pub(crate) type ProgressFn = Arc<dyn Progress>;

#[derive(Default)]
struct Slot {
    summary: Option<WorkSummary>,
    outputs: Option<Vec<Tensor>>,
    dropped: bool,
    wakers: Vec<Waker>,
    /// A future waits for the work, counted by [`Progress::sleep`].
    relied: bool,
    /// Threads blocked on the condition variable: the completer notifies only when there are
    /// some (a notification is a system call even when nobody waits).
    sleeping: u32,
}

struct Shared {
    op: OpType,
    seq: SeqNo,
    id: WorkId,
    source_rank: Mutex<Option<Rank>>,
    slot: Mutex<Slot>,
    cond: Condvar,
    abort: Mutex<Option<AbortFn>>,
    /// The group's progress function, and whether a waiting thread polls with it.
    progress: std::sync::OnceLock<(ProgressFn, bool)>,
    /// The work's `tracing` span, from submit to finish.
    span: tracing::Span,
}

impl Shared {
    /// A work's shared state, its slot as given.
    fn new(id: WorkId, seq: SeqNo, op: OpType, slot: Slot, span: tracing::Span) -> Shared {
        Shared {
            op,
            seq,
            id,
            source_rank: Mutex::new(None),
            slot: Mutex::new(slot),
            cond: Condvar::new(),
            abort: Mutex::new(None),
            progress: std::sync::OnceLock::new(),
            span,
        }
    }

    /// A work's `tracing` span, from submit to finish.
    fn span(op: OpType, seq: SeqNo) -> tracing::Span {
        tracing::debug_span!(
            "work",
            op = %op,
            seq = seq.0,
            group = tracing::field::Empty,
            rank = tracing::field::Empty,
            state = tracing::field::Empty,
            duration_us = tracing::field::Empty,
        )
    }

    /// The work ended as `summary` says: its span and its event.
    fn note_end(span: &tracing::Span, summary: &WorkSummary) {
        let event = || {
            if summary.result.is_success() {
                tracing::debug!("work finished");
            } else {
                tracing::warn!(result = %summary.result, "work failed");
            }
        };
        // A span no subscriber wants records nothing and is entered for nothing: a small
        // work's end skips the lifecycle's reading and the scope.
        if span.is_disabled() {
            return event();
        }
        span.record("state", span_state(summary.lifecycle.state()));
        if let Some(d) = summary.lifecycle.duration() {
            span.record("duration_us", d.as_micros() as u64);
        }
        span.in_scope(event);
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // A poisoned lock means a waiter panicked while holding it; the slot is still
        // consistent (every write is a single assignment), so keep going.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The work ended (`end` marks it so in the slot): wake whoever waits for it. Threads on
    /// the condition variable are notified only if some sleep there (a notification is a
    /// system call even when nobody waits); the futures that waited (counted once, if any)
    /// stop counting as waiting.
    fn release(&self, end: impl FnOnce(&mut Slot)) {
        let (wakers, relied, sleeping) = {
            let mut slot = self.lock();
            end(&mut slot);
            (std::mem::take(&mut slot.wakers), std::mem::take(&mut slot.relied), slot.sleeping > 0)
        };
        if sleeping {
            self.cond.notify_all();
        }
        wakers.into_iter().for_each(Waker::wake);
        if relied && let Some((p, _)) = self.progress.get() {
            p.woke(Duration::ZERO, Polled::default());
        }
    }
}

/// A running or finished collective. Clone it freely: clones are the same work.
#[derive(Clone)]
pub struct Work(Repr);

#[derive(Clone)]
enum Repr {
    /// A work the runtime finishes through its [`WorkCompleter`].
    Live(Live),
    /// A work that succeeded inside its submit call.
    Done(DoneHandle),
}

/// A handle on a [`Done`]. The last one's drop keeps the allocation for the next work its
/// thread ends in its submit call ([`SPARE`]), emptied of what the work held.
///
/// Why: a loop of small collectives ends one work per call; allocating each and freeing it
/// was a twentieth of a 4 B allreduce's instructions over shared memory, and the last
/// handle's drop a locked instruction (counting down). Whether a handle is the last is one
/// plain load here (`triomphe::Arc::get_mut`), since nobody can clone a work nobody else
/// holds; the `Arc` keeps no weak count, which std's would also look at.
struct DoneHandle(ManuallyDrop<triomphe::Arc<Done>>);

thread_local! {
    /// The storage of a finished work whose last handle this thread dropped.
    static SPARE: Cell<Option<triomphe::Arc<Done>>> = const { Cell::new(None) };
}

impl DoneHandle {
    /// A finished work's handle, in the storage this thread kept if it kept one.
    fn new(done: Done) -> DoneHandle {
        let mut spare = SPARE.try_with(Cell::take).ok().flatten();
        if let Some(kept) = spare.as_mut().and_then(triomphe::Arc::get_mut) {
            // Emptied when kept: what this drops holds nothing.
            *kept = done;
            return DoneHandle(ManuallyDrop::new(spare.expect("kept")));
        }
        DoneHandle(ManuallyDrop::new(triomphe::Arc::new(done)))
    }
}

impl std::ops::Deref for DoneHandle {
    type Target = Done;

    fn deref(&self) -> &Done {
        &self.0
    }
}

impl Clone for DoneHandle {
    fn clone(&self) -> DoneHandle {
        DoneHandle(ManuallyDrop::new(triomphe::Arc::clone(&self.0)))
    }
}

impl Drop for DoneHandle {
    fn drop(&mut self) {
        // SAFETY: the one place the `Arc` is taken out, and `self` is not used after it.
        let mut done = unsafe { ManuallyDrop::take(&mut self.0) };
        if let Some(last) = triomphe::Arc::get_mut(&mut done) {
            // What the work held goes now, as it would with the work: its outputs nobody
            // took, its abort function, its span (whose close a subscriber sees).
            drop(last.outputs.take_mut());
            drop(last.abort.get_mut().unwrap_or_else(|p| p.into_inner()).take());
            drop(std::mem::replace(&mut last.span, tracing::Span::none()));
            // A thread being torn down keeps nothing: the allocation is freed.
            let _ = SPARE.try_with(|spare| spare.set(Some(done)));
        }
    }
}

/// A work with a completer: its state behind a lock, for waiters to sleep on or poll.
#[derive(Clone)]
struct Live {
    shared: Arc<Shared>,
}

/// A work that succeeded before anyone could wait for it ([`Work::finished`]): nobody will
/// ever sleep on it, poll for it or finish it, so it has none of a running work's machinery
/// (a slot behind a lock, a condition variable, wakers, a progress function), only what its
/// readers ask for. A small collective run to its end in its submit call makes one at every
/// call, and these are the bytes it builds, moves and drops there.
struct Done {
    id: WorkId,
    seq: SeqNo,
    op: OpType,
    /// From its start to its end.
    duration: Option<Duration>,
    /// Taken by the first [`Work::result`] or await: one atomic swap, where a lock would be
    /// two locked instructions at every small collective.
    outputs: atomic_take::AtomicTake<Vec<Tensor>>,
    abort: Mutex<Option<AbortFn>>,
    span: tracing::Span,
}

impl Done {
    fn take_outputs(&self) -> Vec<Tensor> {
        self.outputs.take().unwrap_or_default()
    }
}

/// The runtime's side of a [`Work`]: finishes it exactly once. Dropping it unfinished makes
/// waiters see [`WorkError::Dropped`].
pub(crate) struct WorkCompleter {
    shared: Arc<Shared>,
    hook: Option<CompletionHook>,
    done: bool,
}

impl Work {
    /// A new unfinished work and its completer.
    pub(crate) fn pending(id: WorkId, seq: SeqNo, op: OpType, hook: Option<CompletionHook>) -> (Work, WorkCompleter) {
        let shared = Arc::new(Shared::new(id, seq, op, Slot::default(), Shared::span(op, seq)));
        (Work(Repr::Live(Live { shared: shared.clone() })), WorkCompleter { shared, hook, done: false })
    }

    /// A work that ended before anyone could wait for it (a collective run to its end inside
    /// its submit call, on `group`'s `rank`): made finished, answering every question as
    /// [`WorkCompleter::finish_with`] would leave it answering (a success is a [`Done`], with
    /// none of a running work's parts). Its completion hook's call comes back to be made once
    /// no lock is held ([`HookCall::run`]): the work itself may be made under the group's
    /// lock, so that what it is made of is not moved out from under it first.
    pub(crate) fn finished(
        summary: &WorkSummary,
        outputs: Vec<Tensor>,
        hook: Option<CompletionHook>,
        group: cohort_core::work::GroupId,
        rank: Rank,
    ) -> (Work, HookCall) {
        let (id, seq, op) = (summary.id, summary.seq, summary.op);
        let call = HookCall(hook.map(|hook| Box::new((hook, WorkInfo::of(summary)))));
        let span = Shared::span(op, seq);
        span.record("group", group.0).record("rank", rank.0);
        Shared::note_end(&span, summary);
        if !summary.result.is_success() || summary.lifecycle.state() != WorkState::Completed {
            let slot = Slot { summary: Some(summary.clone()), outputs: Some(outputs), ..Slot::default() };
            return (Work(Repr::Live(Live { shared: Arc::new(Shared::new(id, seq, op, slot, span)) })), call);
        }
        let done = Done {
            id,
            seq,
            op,
            duration: summary.lifecycle.duration(),
            outputs: atomic_take::AtomicTake::new(outputs),
            abort: Mutex::new(None),
            span,
        };
        (Work(Repr::Done(DoneHandle::new(done))), call)
    }

    /// Wrap a future as a work (c10d's `FutureWrappingWork`): it succeeds with the future's
    /// tensors or fails with its error, whose message the work's error carries. The future
    /// runs on the current tokio runtime.
    pub fn from_future<F, E>(op: OpType, fut: F) -> Work
    where
        F: Future<Output = Result<Vec<Tensor>, E>> + Send + 'static,
        E: std::fmt::Display,
    {
        Work::from_work_future(&tokio::runtime::Handle::current(), op, async move {
            fut.await.map_err(|e| WorkResult::CommError { blame: cohort_core::Blame::nobody(), message: e.to_string() })
        })
    }

    /// Wrap a future that fails with a [`WorkResult`] (so a failure of the works it awaited,
    /// with the rank they blame, passes through unchanged), running it on `runtime`. For
    /// compound works such as communication hooks.
    pub fn from_work_future<F>(runtime: &tokio::runtime::Handle, op: OpType, fut: F) -> Work
    where
        F: Future<Output = Result<Vec<Tensor>, WorkResult>> + Send + 'static,
    {
        let (work, completer) = Work::pending(WorkId(0), SeqNo(0), op, None);
        let handle = runtime.spawn(async move {
            let now = Duration::ZERO;
            let mut lifecycle = Lifecycle::new(now);
            lifecycle.start(now).expect("a new lifecycle starts");
            match fut.await {
                Ok(outputs) => {
                    lifecycle.finish(now, WorkState::Completed).expect("a started lifecycle finishes");
                    completer.finish(WorkResult::Success, lifecycle, outputs);
                }
                Err(result) => {
                    let state = match result.terminal_state() {
                        WorkState::Completed | WorkState::Enqueued | WorkState::Started => WorkState::Failed,
                        s => s,
                    };
                    let result = if result.is_success() {
                        WorkResult::CommError {
                            blame: cohort_core::Blame::nobody(),
                            message: "the wrapped future failed".into(),
                        }
                    } else {
                        result
                    };
                    lifecycle.finish(now, state).expect("a started lifecycle finishes");
                    completer.finish(result, lifecycle, Vec::new());
                }
            }
        });
        let abort_handle = handle.abort_handle();
        work.set_abort(Box::new(move |_| abort_handle.abort()));
        work
    }

    /// Let [`Work::abort`] reach the runtime.
    pub fn set_abort(&self, f: AbortFn) {
        *self.abort_fn().lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// Where its abort function is kept.
    fn abort_fn(&self) -> &Mutex<Option<AbortFn>> {
        match &self.0 {
            Repr::Live(live) => &live.shared.abort,
            Repr::Done(done) => &done.abort,
        }
    }

    /// Tell `progress` who waits for this work, and, if `poll`, let a thread that waits move
    /// the work on itself for a while before it sleeps: `progress` does what the runtime's
    /// tasks would (reads what has arrived and feeds it). The frame that finishes the work then
    /// wakes nobody.
    ///
    /// A finished work has nothing to poll for.
    pub(crate) fn set_progress(&self, progress: ProgressFn, poll: bool) {
        if let Repr::Live(live) = &self.0 {
            live.set_progress(progress, poll);
        }
    }

    /// Block until the work ends; `Ok` if it succeeded.
    pub fn wait(&self) -> Result<(), WorkError> {
        match &self.0 {
            Repr::Live(live) => live.wait(),
            Repr::Done(_) => Ok(()),
        }
    }

    /// Block at most `timeout`. The work goes on after [`WorkError::WaitTimedOut`] (its own
    /// deadline is the watchdog's business).
    pub fn wait_timeout(&self, timeout: Duration) -> Result<(), WorkError> {
        match &self.0 {
            Repr::Live(live) => live.wait_timeout(timeout),
            Repr::Done(_) => Ok(()),
        }
    }

    /// Whether the work has ended (successfully or not). A thread that polls this instead of
    /// waiting still sends what its submits held back.
    pub fn is_completed(&self) -> bool {
        match &self.0 {
            Repr::Live(live) => live.is_completed(),
            Repr::Done(_) => true,
        }
    }

    /// Whether the work ended successfully.
    pub fn is_success(&self) -> bool {
        match &self.0 {
            Repr::Live(live) => live.is_success(),
            Repr::Done(_) => true,
        }
    }

    /// The error the work ended with, if it failed (c10d's `exception()`).
    pub fn exception(&self) -> Option<WorkError> {
        match &self.0 {
            Repr::Live(live) => live.exception(),
            Repr::Done(_) => None,
        }
    }

    /// Wait, then take the output tensors (the first call gets them; later calls get an empty
    /// list).
    pub fn result(&self) -> Result<Vec<Tensor>, WorkError> {
        match &self.0 {
            Repr::Live(live) => live.result(),
            Repr::Done(done) => Ok(done.take_outputs()),
        }
    }

    /// The rank a `recv_anysource` received from, once known.
    pub fn source_rank(&self) -> Option<Rank> {
        match &self.0 {
            Repr::Live(live) => live.source_rank(),
            Repr::Done(_) => None,
        }
    }

    /// How long the work ran, once it ended.
    pub fn duration(&self) -> Option<Duration> {
        match &self.0 {
            Repr::Live(live) => live.duration(),
            Repr::Done(done) => done.duration,
        }
    }

    /// The work's state.
    pub fn state(&self) -> WorkState {
        match &self.0 {
            Repr::Live(live) => live.state(),
            Repr::Done(_) => WorkState::Completed,
        }
    }

    /// The work's `tracing` span (`work{op, seq, group, rank}`), open from submit until the
    /// work finishes, when it records `state` and `duration_us` and logs the outcome: a
    /// subscriber sees every collective as a span. Enter it to attach your own events.
    pub fn span(&self) -> &tracing::Span {
        match &self.0 {
            Repr::Live(live) => &live.shared.span,
            Repr::Done(done) => &done.span,
        }
    }

    /// Its sequence number in its group.
    pub fn seq(&self) -> SeqNo {
        match &self.0 {
            Repr::Live(live) => live.shared.seq,
            Repr::Done(done) => done.seq,
        }
    }

    /// Its id in its group.
    pub fn id(&self) -> WorkId {
        match &self.0 {
            Repr::Live(live) => live.shared.id,
            Repr::Done(done) => done.id,
        }
    }

    /// The op.
    pub fn op(&self) -> OpType {
        match &self.0 {
            Repr::Live(live) => live.shared.op,
            Repr::Done(done) => done.op,
        }
    }

    /// Ask the runtime to abort this work (and, as c10d does, the group it runs on).
    pub fn abort(&self) {
        if let Some(f) = self.abort_fn().lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            f(&format!("{} (seq {}) aborted by the user", self.op(), self.seq()));
        }
    }
}

impl Live {
    fn set_progress(&self, progress: ProgressFn, poll: bool) {
        let _ = self.shared.progress.set((progress, poll));
    }

    /// Run the work's progress function until the work ends, the time it grants is spent or
    /// it says to stop; true if the time was spent.
    ///
    /// Between empty polls the thread spins, and every [`YIELD_EVERY`] (or as
    /// [`Progress::yield_every`] says) it yields its core:
    /// where a thread of the peer (or of this rank's runtime) waits for that core, as it does
    /// when another job takes a core, a thread that only spun would hold its core until the
    /// scheduler's tick while the frame it waits for could not be sent (whole iterations of a
    /// millisecond and more); on a core nobody else wants the yield returns at once, and
    /// spinning in between keeps the reaction to an arriving frame as quick as it can be.
    fn busy_poll(&self, progress: &ProgressFn) -> Polled {
        if self.ended() {
            // Already over (all but the first of a batch of works, usually): no poller
            // bookkeeping, no clock.
            return Polled::default();
        }
        let budget = progress.begin();
        let yield_every = progress.yield_every();
        if let Some(home) = progress.home() {
            go_home(home, &**progress);
        }
        let start = std::time::Instant::now();
        // A zero budget still looks once: what the thread waits for has often arrived.
        let mut polled = Polled { spent: !budget.is_zero(), moved: false };
        let mut first = true;
        let mut next_yield = start + turns(start, yield_every);
        loop {
            let delivered = progress.poll(std::mem::take(&mut first));
            match delivered {
                None => polled.spent = false,
                Some(true) => polled.moved = true,
                Some(false) => {}
            }
            let now = std::time::Instant::now();
            if self.ended() || now.duration_since(start) >= budget {
                break;
            }
            match delivered {
                Some(true) => continue,
                // Another thread polls this group's sockets: give it the core.
                None => std::thread::yield_now(),
                Some(false) if now < next_yield => std::hint::spin_loop(),
                Some(false) => {
                    std::thread::yield_now();
                    let back = std::time::Instant::now();
                    if !yield_every.is_zero() {
                        // Whether another thread had this core meanwhile (see `CoreMoves` and
                        // `TakeTurns`).
                        after_yield(back, back.duration_since(now), &**progress);
                    } else {
                        // More ranks than cores: whether this core has more than its share.
                        spread_check(back, &**progress);
                    }
                    next_yield = back + turns(back, yield_every);
                }
            }
        }
        progress.stop(self.ended());
        polled
    }

    /// Send what the group holds back (see [`Progress::flush`]).
    fn flush(&self) {
        if let Some((p, _)) = self.shared.progress.get() {
            p.flush();
        }
    }

    fn wait(&self) -> Result<(), WorkError> {
        self.flush();
        let progress = self.shared.progress.get();
        let polled = match progress {
            Some((progress, true)) => self.busy_poll(progress),
            _ => Polled::default(),
        };
        let mut slot = self.shared.lock();
        if slot.summary.is_some() || slot.dropped {
            return self.outcome(&slot);
        }
        let asleep = progress.map(|(p, _)| {
            p.sleep();
            (p, std::time::Instant::now())
        });
        slot.sleeping += 1;
        while slot.summary.is_none() && !slot.dropped {
            slot = self.shared.cond.wait(slot).unwrap_or_else(|p| p.into_inner());
        }
        slot.sleeping -= 1;
        let outcome = self.outcome(&slot);
        drop(slot);
        if let Some((p, since)) = asleep {
            p.woke(since.elapsed(), polled);
            // The kernel put the thread where it chose when it woke: maybe on the core of the
            // peer's polling thread. (Where ranks outnumber cores, moving helps nobody.)
            if !p.yield_every().is_zero() {
                let _ = check_core(&**p);
            }
        }
        outcome
    }

    fn wait_timeout(&self, timeout: Duration) -> Result<(), WorkError> {
        self.flush();
        let asleep = self.shared.progress.get().map(|(p, _)| {
            p.sleep();
            (p, std::time::Instant::now())
        });
        let mut slot = self.shared.lock();
        slot.sleeping += 1;
        let (mut slot, _) = self
            .shared
            .cond
            .wait_timeout_while(slot, timeout, |s| s.summary.is_none() && !s.dropped)
            .unwrap_or_else(|p| p.into_inner());
        slot.sleeping -= 1;
        let outcome = if slot.summary.is_none() && !slot.dropped {
            Err(WorkError::WaitTimedOut { op: self.shared.op, seq: self.shared.seq, waited: timeout })
        } else {
            self.outcome(&slot)
        };
        drop(slot);
        if let Some((p, since)) = asleep {
            p.woke(since.elapsed(), Polled::default());
        }
        outcome
    }

    fn is_completed(&self) -> bool {
        self.flush();
        self.ended()
    }

    fn ended(&self) -> bool {
        let slot = self.shared.lock();
        slot.summary.is_some() || slot.dropped
    }

    fn is_success(&self) -> bool {
        self.shared.lock().summary.as_ref().is_some_and(|s| s.result.is_success())
    }

    fn exception(&self) -> Option<WorkError> {
        let slot = self.shared.lock();
        if slot.summary.is_none() && !slot.dropped {
            return None;
        }
        self.outcome(&slot).err()
    }

    fn result(&self) -> Result<Vec<Tensor>, WorkError> {
        if self.shared.progress.get().is_none() {
            // Nothing to flush or poll with: a work that ended is answered in one look.
            let mut slot = self.shared.lock();
            if slot.summary.is_some() || slot.dropped {
                self.outcome(&slot)?;
                return Ok(slot.outputs.take().unwrap_or_default());
            }
        }
        self.wait()?;
        Ok(self.shared.lock().outputs.take().unwrap_or_default())
    }

    fn source_rank(&self) -> Option<Rank> {
        *self.shared.source_rank.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn duration(&self) -> Option<Duration> {
        self.shared.lock().summary.as_ref().and_then(|s| s.lifecycle.duration())
    }

    fn state(&self) -> WorkState {
        let slot = self.shared.lock();
        match &slot.summary {
            Some(s) => s.lifecycle.state(),
            None if slot.dropped => WorkState::Aborted,
            None => WorkState::Enqueued,
        }
    }

    fn outcome(&self, slot: &Slot) -> Result<(), WorkError> {
        match &slot.summary {
            Some(s) if s.result.is_success() => Ok(()),
            Some(s) => Err(WorkError::Failed { op: self.shared.op, seq: self.shared.seq, result: s.result.clone() }),
            None => Err(WorkError::Dropped { op: self.shared.op, seq: self.shared.seq }),
        }
    }
}

impl Future for Work {
    type Output = Result<Vec<Tensor>, WorkError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &self.0 {
            Repr::Live(live) => live.poll(cx),
            Repr::Done(done) => Poll::Ready(Ok(done.take_outputs())),
        }
    }
}

impl Live {
    fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Vec<Tensor>, WorkError>> {
        self.flush();
        let mut slot = self.shared.lock();
        if slot.summary.is_none() && !slot.dropped {
            if !slot.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                slot.wakers.push(cx.waker().clone());
            }
            // Counted under the slot's lock, so that the completer, which uncounts it, cannot
            // come in between.
            if let Some((p, _)) = self.shared.progress.get()
                && !std::mem::replace(&mut slot.relied, true)
            {
                p.sleep();
            }
            return Poll::Pending;
        }
        let outcome = self.outcome(&slot);
        Poll::Ready(outcome.map(|()| slot.outputs.take().unwrap_or_default()))
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work").field("op", &self.op()).field("seq", &self.seq()).field("state", &self.state()).finish()
    }
}

impl WorkCompleter {
    /// Name the group and rank the work runs on, in its span.
    pub(crate) fn in_group(&self, group: cohort_core::work::GroupId, rank: Rank) {
        self.shared.span.record("group", group.0).record("rank", rank.0);
    }

    /// Record the rank a `recv_anysource` received from.
    pub(crate) fn set_source_rank(&self, rank: Rank) {
        *self.shared.source_rank.lock().unwrap_or_else(|p| p.into_inner()) = Some(rank);
    }

    /// Finish the work: wake every waiter, run the hook.
    pub(crate) fn finish(self, result: WorkResult, lifecycle: Lifecycle, outputs: Vec<Tensor>) {
        let summary = WorkSummary {
            id: self.shared.id,
            seq: self.shared.seq,
            is_p2p: self.shared.op.is_p2p(),
            op: self.shared.op,
            result,
            lifecycle,
        };
        self.finish_with(summary, outputs);
    }

    /// Finish the work from the core's summary.
    pub(crate) fn finish_with(mut self, summary: WorkSummary, outputs: Vec<Tensor>) {
        let info = WorkInfo::of(&summary);
        Shared::note_end(&self.shared.span, &summary);
        self.shared.release(|slot| {
            slot.summary = Some(summary);
            slot.outputs = Some(outputs);
        });
        self.done = true;
        if let Some(hook) = &self.hook {
            hook(&info);
        }
    }
}

impl Drop for WorkCompleter {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.shared.release(|slot| slot.dropped = true);
    }
}

impl fmt::Debug for WorkCompleter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompleter").field("op", &self.shared.op).field("seq", &self.shared.seq).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use cohort_core::work::GroupId;

    fn finished_lifecycle(state: WorkState) -> Lifecycle {
        let mut l = Lifecycle::new(Duration::ZERO);
        l.start(Duration::from_millis(1)).unwrap();
        l.finish(Duration::from_millis(4), state).unwrap();
        l
    }

    /// Records how each poll of a wait was asked, and finishes the work at the third.
    struct Recorder {
        firsts: Mutex<Vec<bool>>,
        completer: Mutex<Option<WorkCompleter>>,
    }

    impl Progress for Recorder {
        fn begin(&self) -> Duration {
            Duration::from_secs(5)
        }
        fn poll(&self, first: bool) -> Option<bool> {
            let mut firsts = self.firsts.lock().unwrap();
            firsts.push(first);
            if firsts.len() == 3
                && let Some(c) = self.completer.lock().unwrap().take()
            {
                c.finish(WorkResult::Success, finished_lifecycle(WorkState::Completed), Vec::new());
                return Some(true);
            }
            Some(false)
        }
        fn stop(&self, _finished: bool) {}
        fn sleep(&self) {}
        fn woke(&self, _time: Duration, _polled: Polled) {}
        fn flush(&self) {}
    }

    /// Says the peers stand as `near` (with the calling thread's core filled in).
    struct Near(std::sync::Mutex<(Neighbours, Vec<u32>)>);

    impl Progress for Near {
        fn begin(&self) -> Duration {
            Duration::ZERO
        }
        fn poll(&self, _first: bool) -> Option<bool> {
            Some(false)
        }
        fn stop(&self, _finished: bool) {}
        fn sleep(&self) {}
        fn woke(&self, _time: Duration, _polled: Polled) {}
        fn flush(&self) {}
        fn polls_on(&self, core: u32) -> Neighbours {
            let mut g = self.0.lock().unwrap();
            g.1.push(core);
            g.0
        }
    }

    #[test]
    fn a_check_says_the_core_is_shared_unless_a_peer_says_it_runs_elsewhere_or_this_thread_moved() {
        std::thread::spawn(|| {
            let apart = Neighbours { known: true, ..UNKNOWN };
            let higher = Neighbours { known: true, higher_here: true, ..UNKNOWN };
            let lower = Neighbours { known: true, lower_here: true, ..UNKNOWN };
            for (near, want) in [(UNKNOWN, true), (apart, false), (higher, true)] {
                let p = Near(std::sync::Mutex::new((near, Vec::new())));
                assert_eq!(check_core(&p), want, "{near:?}");
                assert_eq!(p.0.lock().unwrap().1.len(), 1, "told the peers its core, once");
            }
            // A lower rank's thread here: this one moves where it can, and then does not share.
            let p = Near(std::sync::Mutex::new((lower, Vec::new())));
            let shared = check_core(&p);
            let told = p.0.lock().unwrap().1.len();
            // SAFETY: reads the calling thread's mask into one it owns, then counts it.
            let cores = unsafe { libc::CPU_COUNT(&affinity()) };
            if cores > 1 {
                assert!(!shared, "moved: alone now");
                assert_eq!(told, 2, "and told the peers its new core");
            } else {
                assert!(shared, "no other core to go to");
                assert_eq!(told, 1);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_that_yielded_to_a_poller_takes_turns_until_a_quiet_millisecond() {
        let every = YIELD_EVERY;
        let now = std::time::Instant::now();
        let mut t = TakeTurns::default();
        assert_eq!(t.interval(now, every), every, "spins between yields at first");
        // A yield to a short-lived thread (this rank's runtime) or to one that keeps its core
        // (another job's) is no reason to take turns.
        t.after_yield(now, Duration::from_micros(5));
        t.after_yield(now, Duration::from_millis(3));
        assert_eq!(t.interval(now, every), every);
        // One that ran a polling thread is.
        t.after_yield(now, Duration::from_micros(30));
        assert_eq!(t.interval(now, every), Duration::ZERO);
        // While taking turns, a yield that switched to the other thread keeps it going; a bare
        // yield does not.
        let a = now + Duration::from_micros(900);
        t.after_yield(a, Duration::from_micros(4));
        t.after_yield(a + Duration::from_micros(500), Duration::from_nanos(600));
        assert_eq!(t.interval(a + TAKE_TURNS_FOR - Duration::from_micros(1), every), Duration::ZERO);
        assert_eq!(t.interval(a + TAKE_TURNS_FOR, every), every, "a quiet millisecond ends it");
    }

    #[test]
    fn a_thread_sharing_its_core_with_a_poller_moves_on_heads_and_then_not_for_a_while() {
        let now = std::time::Instant::now();
        let shared = Duration::from_micros(15);
        let mut m = CoreMoves::default();
        assert_eq!(
            m.after_yield(now, Duration::from_micros(3), true, UNKNOWN),
            CoreMove::Stay,
            "on time: the core is its own"
        );
        assert_eq!(m.after_yield(now, shared, false, UNKNOWN), CoreMove::Stay, "tails stays (the peer may be moving)");
        assert_eq!(m.after_yield(now, shared, true, UNKNOWN), CoreMove::Leave { avoid: 0 });
        m.moved(Some(0));
        assert_eq!(m.after_yield(now, Duration::from_micros(2), true, UNKNOWN), CoreMove::Stay, "the new core is free");
        assert_eq!(
            m.after_yield(now + LEAVE_CORE_EVERY / 2, shared, true, UNKNOWN),
            CoreMove::Stay,
            "moved a moment ago"
        );
        assert_eq!(
            m.after_yield(now + LEAVE_CORE_EVERY, shared, true, UNKNOWN),
            CoreMove::Leave { avoid: 0 },
            "after the interval"
        );
        assert_eq!(
            m.after_yield(now, Duration::from_millis(3), true, UNKNOWN),
            CoreMove::Stay,
            "a busy thread, no move before: stays"
        );
    }

    /// No peer says where its thread runs.
    const UNKNOWN: Neighbours =
        Neighbours { known: false, lower_here: false, higher_here: false, cores: 0, counts: [0; 64], home: Home::None };

    /// Peers' threads `on` cores (a list of cores, one entry a thread), this thread on `core`
    /// and the highest rank there unless `higher_here`.
    fn spread_near(on: &[usize], core: usize, higher_here: bool) -> Neighbours {
        let mut near = Neighbours { known: !on.is_empty(), higher_here, ..UNKNOWN };
        for &c in on {
            near.counts[c] += 1;
            near.cores |= 1 << c;
        }
        near.lower_here = on.contains(&core) && !higher_here;
        near
    }

    #[test]
    fn on_a_crowded_host_the_highest_thread_of_a_core_over_its_share_moves_to_the_least_crowded_one() {
        let two = 0b11;
        // Four ranks on two cores, three on core 0 (this thread and two peers), one on core 1.
        assert_eq!(spread(0, &spread_near(&[0, 0, 1], 0, false), two), Some(1), "three to one: the highest moves");
        assert_eq!(spread(0, &spread_near(&[0, 0, 1], 0, true), two), None, "a higher rank there moves instead");
        assert_eq!(spread(1, &spread_near(&[0, 0, 0], 1, false), two), None, "the lone thread stays");
        assert_eq!(spread(0, &spread_near(&[0, 1, 1], 0, false), two), None, "two and two: nobody moves");
        assert_eq!(spread(0, &spread_near(&[0, 0, 0], 0, false), two), Some(1), "four on one core");
        // Three ranks on two cores: two and one is as even as it gets.
        assert_eq!(spread(0, &spread_near(&[0, 1], 0, false), two), None);
        assert_eq!(spread(0, &spread_near(&[0, 0], 0, false), two), Some(1));
        // Three cores: to the emptiest, the lowest of equals.
        assert_eq!(spread(2, &spread_near(&[2, 2, 0, 1, 1], 2, false), 0b111), Some(0));
        assert_eq!(spread(0, &spread_near(&[0, 0, 2], 0, false), 0b111), Some(1));
        // Only the cores this thread may use count, and a core it may not use is no target.
        assert_eq!(spread(0, &spread_near(&[0, 0, 1, 1], 0, false), 0b101), Some(2), "core 1 is not allowed");
        assert_eq!(spread(0, &spread_near(&[0, 0, 1], 0, false), 0b1), None, "one core allowed");
        assert_eq!(spread(3, &spread_near(&[0, 0, 1], 3, false), two), None, "a thread on a core it may not use");
        assert_eq!(spread(70, &spread_near(&[0, 0, 1], 0, false), two), None, "a core beyond the mask");
        assert_eq!(spread(0, &UNKNOWN, two), None, "nobody says where they run");
    }

    #[test]
    fn a_spreading_move_waits_its_interval_after_any_move() {
        let now = std::time::Instant::now();
        let mut moves = CoreMoves::default();
        assert_eq!(moves.spread(None, now), CoreMove::Stay);
        assert_eq!(moves.spread(Some(1), now), CoreMove::Spread(1));
        assert_eq!(moves.spread(Some(0), now + SPREAD_EVERY / 2), CoreMove::Stay, "too soon");
        assert_eq!(moves.spread(Some(0), now + SPREAD_EVERY), CoreMove::Spread(0));
    }

    #[test]
    fn where_the_peers_say_they_run_the_higher_rank_of_two_on_a_core_moves_and_nobody_else() {
        let now = std::time::Instant::now();
        let (on_time, shared) = (Duration::from_micros(1), Duration::from_micros(30));
        // This thread runs on core 1; the peers on cores 1 and 3.
        let lower = Neighbours { known: true, lower_here: true, cores: 0b1010, ..UNKNOWN };
        let higher = Neighbours { known: true, higher_here: true, cores: 0b1010, ..UNKNOWN };
        let apart = Neighbours { known: true, cores: 0b1000, ..UNKNOWN };
        let mut m = CoreMoves::default();
        assert_eq!(
            m.after_yield(now, shared, true, higher),
            CoreMove::Stay,
            "the higher rank's thread moves, not this"
        );
        assert_eq!(m.after_yield(now, shared, true, apart), CoreMove::Stay, "no peer here: another thread ran");
        assert_eq!(
            m.after_yield(now, on_time, false, lower),
            CoreMove::Leave { avoid: 0b1010 },
            "a lower rank's thread here: leave, whatever the yield or the coin says, for a core no peer runs on"
        );
        m.moved(Some(1));
        assert_eq!(m.after_yield(now, on_time, true, apart), CoreMove::Stay, "alone on the new core");
        let soon = now + LEAVE_SHARED_CORE_EVERY / 2;
        assert_eq!(m.after_yield(soon, on_time, false, lower), CoreMove::Stay, "moved a moment ago");
        assert_eq!(m.on_check(soon, lower), CoreMove::Stay, "nor from a check");
        let later = now + LEAVE_SHARED_CORE_EVERY;
        assert_eq!(m.on_check(later, higher), CoreMove::Stay);
        assert_eq!(
            m.on_check(later, lower),
            CoreMove::Leave { avoid: 0b1010 },
            "a check moves too, and sooner than a coin's move may"
        );
        assert!(LEAVE_SHARED_CORE_EVERY < LEAVE_CORE_EVERY);
        // A coin's move holds back the next coin's move, not the next known one.
        let mut m = CoreMoves::default();
        assert_eq!(m.after_yield(now, shared, true, UNKNOWN), CoreMove::Leave { avoid: 0 });
        assert_eq!(m.after_yield(now + LEAVE_SHARED_CORE_EVERY, shared, true, UNKNOWN), CoreMove::Stay);
        assert_eq!(m.on_check(now + LEAVE_SHARED_CORE_EVERY, lower), CoreMove::Leave { avoid: 0b1010 });
        // With nobody saying, the yield and the coin decide as before.
        let mut m = CoreMoves::default();
        assert_eq!(m.after_yield(now, shared, true, UNKNOWN), CoreMove::Leave { avoid: 0 });
        assert_eq!(m.on_check(now + LEAVE_CORE_EVERY, UNKNOWN), CoreMove::Stay, "a check moves only for a known peer");
    }

    #[test]
    fn where_each_rank_has_a_core_the_thread_away_from_its_own_goes_there_and_the_other_stays() {
        let now = std::time::Instant::now();
        let (on_time, shared, busy) = (Duration::from_micros(1), Duration::from_micros(30), Duration::from_millis(2));
        let at = |home| Neighbours { home, ..UNKNOWN };
        assert_eq!(Home::of(Some(1), 1), Home::Here);
        assert_eq!(Home::of(Some(1), 0), Home::Away(1));
        assert_eq!(Home::of(None, 0), Home::None);
        let mut m = CoreMoves::default();
        for heads in [false, true] {
            assert_eq!(m.after_yield(now, shared, heads, at(Home::Here)), CoreMove::Stay, "at home: the other moves");
            assert_eq!(m.after_yield(now, on_time, heads, at(Home::Away(1))), CoreMove::Stay, "the core is its own");
            assert_eq!(m.after_yield(now, busy, heads, at(Home::Away(1))), CoreMove::Stay, "a busy thread ran");
        }
        assert_eq!(
            m.after_yield(now, shared, false, at(Home::Away(1))),
            CoreMove::Home(1),
            "another polling thread on its core, away from home: home, whatever the coin"
        );
        m.moved(Some(0));
        let soon = now + LEAVE_SHARED_CORE_EVERY / 2;
        assert_eq!(m.after_yield(soon, shared, true, at(Home::Away(1))), CoreMove::Stay, "moved a moment ago");
        assert_eq!(m.on_check(soon, at(Home::Away(1))), CoreMove::Stay);
        let later = now + LEAVE_SHARED_CORE_EVERY;
        assert_eq!(m.on_check(later, at(Home::Here)), CoreMove::Stay);
        assert_eq!(m.on_check(later, at(Home::Away(1))), CoreMove::Home(1), "woke elsewhere: home");
        // Home holds another job's busy thread: back to where it came from, for a while.
        m.moved(Some(0));
        assert_eq!(m.after_yield(later, busy, true, at(Home::Here)), CoreMove::Return(0));
        let hold = later + AFTER_RETURN / 2;
        assert_eq!(m.on_check(hold, at(Home::Away(1))), CoreMove::Stay, "not home again so soon");
        assert_eq!(m.after_yield(hold, shared, true, at(Home::Away(1))), CoreMove::Stay);
        assert_eq!(m.on_check(later + AFTER_RETURN, at(Home::Away(1))), CoreMove::Home(1));
        // Where a peer says where its thread runs, that decides and the home does not.
        let lower = Neighbours { known: true, lower_here: true, cores: 0b10, home: Home::Here, ..UNKNOWN };
        let higher = Neighbours { known: true, higher_here: true, cores: 0b1, home: Home::Away(1), ..UNKNOWN };
        let mut m = CoreMoves::default();
        assert_eq!(m.after_yield(now, shared, false, higher), CoreMove::Stay);
        assert_eq!(m.on_check(now, higher), CoreMove::Stay);
        assert_eq!(m.on_check(now, lower), CoreMove::Leave { avoid: 0b10 });
    }

    #[test]
    fn a_rank_has_a_core_of_its_own_only_where_it_may_run_on_every_core() {
        std::thread::spawn(|| {
            let before = affinity();
            // SAFETY: reads a mask this frame owns, and a plain query.
            let (count, online) =
                unsafe { (libc::CPU_COUNT(&before) as usize, libc::sysconf(libc::_SC_NPROCESSORS_ONLN) as usize) };
            let allowed = cores_in(&before);
            if count == online && count > 1 {
                for slot in 0..count {
                    assert_eq!(home_core(slot), Some(allowed[slot]), "slot {slot} of {allowed:?}");
                }
                assert_eq!(home_core(count), None, "more ranks than cores: no core each");
                // Kept to one core by its launcher: its peers' masks are not known.
                assert_eq!(keep_to_core(1), Some(allowed[1]));
                assert_eq!(home_core(0), None, "a process kept to some cores has no home");
            } else {
                assert_eq!(home_core(0), None, "this process may not use every core");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_on_a_crowded_core_moves_to_the_emptier_one_at_most_once_an_interval() {
        std::thread::spawn(|| {
            let all = affinity();
            let allowed = cores_in(&all);
            assert!(allowed.len() >= 2, "this test needs two cores to move between");
            // The thread may run on the first two only, as on a two-core host.
            let allowed = [allowed[0], allowed[1]];
            // SAFETY: sets the calling thread's mask to one this frame owns, of its true size.
            let before = unsafe {
                let mut two: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(allowed[0], &mut two);
                libc::CPU_SET(allowed[1], &mut two);
                assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &two), 0);
                two
            };
            // SAFETY: compares two masks this frame owns.
            let unpinned = || unsafe { libc::CPU_EQUAL(&affinity(), &before) };
            // SAFETY: a plain call about the calling thread.
            let here = || usize::try_from(unsafe { libc::sched_getcpu() }).unwrap();
            // Two peers' threads on this thread's core and one on another: three to one. (The
            // kernel may move the thread between the test's look and the check's: it tries
            // again then.)
            let moved = (0..20).find_map(|_| {
                MOVES.set(CoreMoves::default());
                SPREAD_CHECKED.set(None);
                let from = here();
                let other = *allowed.iter().find(|&&c| c != from)?;
                let mut near = Neighbours { known: true, ..UNKNOWN };
                near.counts[from] = 2;
                near.counts[other] = 1;
                let p = Near(std::sync::Mutex::new((near, Vec::new())));
                let now = std::time::Instant::now();
                spread_check(now, &p);
                let told = p.0.lock().unwrap().1.len();
                let left = MOVES.get().left?;
                // Within the interval it neither looks nor moves again.
                spread_check(now + SPREAD_EVERY / 2, &p);
                let again = p.0.lock().unwrap().1.len();
                Some((left, from, told, again))
            });
            let (left, from, told, again) = moved.expect("a thread on a crowded core moves");
            assert_eq!(left, from, "it left the crowded core");
            assert_eq!(told, 2, "it said where it ran, then where it runs now");
            assert_eq!(again, told, "no second look within the interval");
            assert!(unpinned(), "not kept on the new core");
            // A peer's thread on each of the first two cores: on either, this one makes two and
            // one, as even as three threads get. It looks and stays.
            MOVES.set(CoreMoves::default());
            SPREAD_CHECKED.set(None);
            let mut near = Neighbours { known: true, ..UNKNOWN };
            near.counts[allowed[0]] = 1;
            near.counts[allowed[1]] = 1;
            let p = Near(std::sync::Mutex::new((near, Vec::new())));
            spread_check(std::time::Instant::now(), &p);
            assert_eq!(p.0.lock().unwrap().1.len(), 1, "it looked");
            assert_eq!(MOVES.get().moved, None, "an even split moves nobody");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_wait_away_from_its_ranks_core_starts_there() {
        std::thread::spawn(|| {
            let before = affinity();
            let allowed = cores_in(&before);
            let [first, second, ..] = allowed[..] else { return };
            // SAFETY: compares two masks this frame owns.
            let unpinned = || unsafe { libc::CPU_EQUAL(&affinity(), &before) };
            let restore = || {
                // SAFETY: sets the calling thread's mask to one this frame owns, of its true size.
                assert_eq!(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &before) }, 0);
            };
            // At home (kept there for the test, so that the kernel cannot move it meanwhile):
            // nothing to do, nothing said.
            assert_eq!(keep_to_core(0), Some(first));
            let p = Near(std::sync::Mutex::new((UNKNOWN, Vec::new())));
            go_home(first, &p);
            assert!(p.0.lock().unwrap().1.is_empty(), "at home: no move");
            assert_eq!(MOVES.get().moved, None);
            restore();
            // Elsewhere: it goes there, is not kept there, and says where it runs now. (The
            // kernel may move the thread between the test's look and the wait's: it tries
            // again then.)
            // SAFETY: a plain call about the calling thread.
            let here = || usize::try_from(unsafe { libc::sched_getcpu() }).unwrap();
            let moved = (0..20).find_map(|_| {
                MOVES.set(CoreMoves::default());
                let from = here();
                let home = if from == first { second } else { first };
                let p = Near(std::sync::Mutex::new((UNKNOWN, Vec::new())));
                go_home(home, &p);
                let told = p.0.lock().unwrap().1.len();
                MOVES.get().left.map(|left| (left, home, told))
            });
            let (left, home, told) = moved.expect("a thread away from its core moves there");
            assert_ne!(left, home, "it left another core");
            assert_eq!(told, 1, "and said where it runs, once");
            assert!(unpinned(), "not kept there");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_that_moved_next_to_a_thread_that_does_not_yield_goes_back_and_stays_a_while() {
        let now = std::time::Instant::now();
        let shared = Duration::from_micros(30);
        let mut m = CoreMoves::default();
        assert_eq!(m.after_yield(now, shared, true, UNKNOWN), CoreMove::Leave { avoid: 0 });
        m.moved(Some(1));
        let later = now + Duration::from_micros(50);
        let busy = Duration::from_millis(2);
        assert_eq!(m.after_yield(later, busy, false, UNKNOWN), CoreMove::Return(1), "another job holds that core");
        assert_eq!(m.after_yield(later, busy, true, UNKNOWN), CoreMove::Stay, "back already");
        assert_eq!(
            m.after_yield(later + LEAVE_CORE_EVERY, shared, true, UNKNOWN),
            CoreMove::Stay,
            "no other core for a while"
        );
        assert_eq!(m.after_yield(later + AFTER_RETURN, shared, true, UNKNOWN), CoreMove::Leave { avoid: 0 });
        // A move that did not happen has nothing to go back to.
        m.moved(None);
        assert_eq!(m.after_yield(later + AFTER_RETURN, busy, true, UNKNOWN), CoreMove::Stay);
    }

    #[test]
    fn the_coin_falls_both_ways_even_on_a_coarse_clock() {
        for step in [1, 1_000] {
            let heads = (1..=1_000u64).filter(|i| coin(Duration::from_nanos(10_000 + i * step))).count();
            assert!((350..=650).contains(&heads), "{heads} heads in 1,000 tosses {step} ns apart");
        }
    }

    /// The cores in `mask`, in order.
    fn cores_in(mask: &libc::cpu_set_t) -> Vec<usize> {
        // SAFETY: reads a mask the caller owns; every index is below its size.
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, mask) }).collect()
    }

    fn affinity() -> libc::cpu_set_t {
        // SAFETY: reads the calling thread's mask into one it owns.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
            set
        }
    }

    #[test]
    fn moving_between_cores_moves_the_thread_and_leaves_it_free_to_run_anywhere() {
        std::thread::spawn(|| {
            let before = affinity();
            // SAFETY: reads a mask this frame owns.
            let cores = unsafe { libc::CPU_COUNT(&before) };
            // SAFETY: a plain call about the calling thread.
            let here = || usize::try_from(unsafe { libc::sched_getcpu() }).unwrap();
            // SAFETY: compares two masks this frame owns.
            let unpinned = || unsafe { libc::CPU_EQUAL(&affinity(), &before) };
            let left = move_core(None, 0);
            assert!(unpinned(), "the mask is what it was: the thread is not pinned");
            if cores > 1 {
                let left = left.expect("with another core allowed, it moves");
                assert_ne!(here(), left, "it left core {left}");
                let from = move_core(Some(left), 0);
                assert!(unpinned());
                assert_eq!((here(), from.is_some()), (left, true), "and back to the core it left");
            } else {
                assert_eq!(left, None, "with one core allowed it stays");
            }
            if cores > 1 {
                // Avoiding every other core still leaves this one; avoiding none but this one's
                // neighbour moves elsewhere where there is elsewhere.
                assert!(move_core(None, !0).is_some(), "every other core avoided: it moves anyway");
                assert!(unpinned());
                let first = here();
                if cores > 2 && first < 64 && move_core(None, 0).is_some() {
                    // From a second core, avoiding the first: it goes to a third.
                    assert!(move_core(None, 1 << first).is_some());
                    assert_ne!(here(), first, "it avoided core {first}");
                    assert!(unpinned());
                }
            }
            assert_eq!(move_core(Some(here()), 0), None, "to the core it is on: no move");
            assert_eq!(move_core(Some(libc::CPU_SETSIZE as usize), 0), None, "to a core that does not exist: no move");
            assert!(unpinned());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_kept_to_a_core_runs_only_on_the_slot_th_core_it_was_allowed_counted_round() {
        for slot in [0, 1, 2, 5] {
            std::thread::spawn(move || {
                let before = affinity();
                let allowed = cores_in(&before);
                let core = keep_to_core(slot);
                let after = affinity();
                if allowed.len() > 1 {
                    let want = allowed[slot % allowed.len()];
                    assert_eq!(core, Some(want), "slot {slot} of cores {allowed:?}");
                    // SAFETY: reads a mask this frame owns.
                    assert_eq!(unsafe { libc::CPU_COUNT(&after) }, 1, "slot {slot}: one core");
                    // SAFETY: as above.
                    assert!(unsafe { libc::CPU_ISSET(want, &after) }, "slot {slot}: core {want}");
                    // SAFETY: a plain call about the calling thread.
                    assert_eq!(usize::try_from(unsafe { libc::sched_getcpu() }).unwrap(), want, "it runs there now");
                } else {
                    assert_eq!(core, None, "with one core allowed it stays as it was");
                    // SAFETY: compares two masks this frame owns.
                    assert!(unsafe { libc::CPU_EQUAL(&after, &before) });
                }
            })
            .join()
            .unwrap();
        }
    }

    #[test]
    fn only_the_first_poll_of_each_wait_is_marked_first() {
        let (work, completer) = Work::pending(WorkId(1), SeqNo(1), OpType::Allreduce, None);
        let recorder = Arc::new(Recorder { firsts: Mutex::new(Vec::new()), completer: Mutex::new(Some(completer)) });
        work.set_progress(recorder.clone(), true);
        work.wait().unwrap();
        assert_eq!(*recorder.firsts.lock().unwrap(), vec![true, false, false]);
    }

    /// How a [`Scripted`] answers the `n`th poll of a wait (from 1).
    type Answer = fn(usize) -> Option<bool>;

    /// Answers each poll of a wait as `answer` says (by the poll's number), and keeps what the
    /// waiter said when it woke.
    struct Scripted {
        answer: Answer,
        polls: Mutex<usize>,
        woke: Mutex<Vec<Polled>>,
    }

    impl Progress for Scripted {
        fn begin(&self) -> Duration {
            Duration::from_millis(2)
        }
        fn poll(&self, _first: bool) -> Option<bool> {
            let mut polls = self.polls.lock().unwrap();
            *polls += 1;
            (self.answer)(*polls)
        }
        fn stop(&self, _finished: bool) {}
        fn sleep(&self) {}
        fn woke(&self, _time: Duration, polled: Polled) {
            self.woke.lock().unwrap().push(polled);
        }
        fn flush(&self) {}
    }

    /// A waiter that polled its whole time and then slept says whether a look delivered
    /// frames (the transport keeps its polling time then); one that found another thread
    /// polling says it did not spend its time.
    #[test]
    fn a_waiter_that_slept_says_whether_its_poll_delivered_anything() {
        let cases: [(Answer, Polled); 4] = [
            (|_| Some(false), Polled { spent: true, moved: false }),
            (|n| Some(n == 1), Polled { spent: true, moved: true }),
            (|n| Some(n == 5), Polled { spent: true, moved: true }),
            (|n| if n == 1 { None } else { Some(true) }, Polled { spent: false, moved: true }),
        ];
        for (i, (answer, want)) in cases.into_iter().enumerate() {
            let (work, completer) = Work::pending(WorkId(1), SeqNo(1), OpType::Allreduce, None);
            let progress = Arc::new(Scripted { answer, polls: Mutex::new(0), woke: Mutex::new(Vec::new()) });
            work.set_progress(progress.clone(), true);
            let waiter = work.clone();
            let t = std::thread::spawn(move || waiter.wait());
            until_asleep(&work, 1);
            completer.finish(WorkResult::Success, finished_lifecycle(WorkState::Completed), Vec::new());
            t.join().unwrap().unwrap();
            assert_eq!(*progress.woke.lock().unwrap(), vec![want], "case {i}");
        }
    }

    #[test]
    fn wait_returns_after_finish_from_another_thread() {
        let (work, completer) = Work::pending(WorkId(1), SeqNo(3), OpType::Allreduce, None);
        assert!(!work.is_completed());
        let t = std::thread::spawn(move || {
            completer.finish(
                WorkResult::Success,
                finished_lifecycle(WorkState::Completed),
                vec![Tensor::from_slice(&[1.0f32])],
            )
        });
        work.wait().unwrap();
        t.join().unwrap();
        assert!(work.is_success());
        assert_eq!(work.duration(), Some(Duration::from_millis(3)));
        assert_eq!(work.result().unwrap(), vec![Tensor::from_slice(&[1.0f32])]);
        assert_eq!(work.exception(), None);
    }

    impl Work {
        fn live(&self) -> &Live {
            match &self.0 {
                Repr::Live(live) => live,
                Repr::Done(_) => panic!("a finished work has no waiters"),
            }
        }
    }

    /// Wait until `n` threads sleep on the work's condition variable.
    fn until_asleep(work: &Work, n: u32) {
        let start = std::time::Instant::now();
        while work.live().shared.lock().sleeping < n {
            assert!(start.elapsed() < Duration::from_secs(10), "the waiters never went to sleep");
            std::thread::yield_now();
        }
    }

    #[test]
    fn sleeping_waiters_are_woken_by_finish_and_by_drop() {
        // The completer notifies only when it counts sleepers: every kind of waiter must be
        // counted, or it would sleep forever (wait_timeout's long timeout would fail the test).
        for finish in [true, false] {
            let (work, completer) = Work::pending(WorkId(1), SeqNo(1), OpType::Allreduce, None);
            let waiters: Vec<_> = (0..4)
                .map(|i| {
                    let work = work.clone();
                    std::thread::spawn(move || {
                        if i % 2 == 0 {
                            work.wait().map_err(|e| e.to_string())
                        } else {
                            work.wait_timeout(Duration::from_secs(60)).map_err(|e| e.to_string())
                        }
                    })
                })
                .collect();
            until_asleep(&work, 4);
            if finish {
                completer.finish(WorkResult::Success, finished_lifecycle(WorkState::Completed), vec![]);
            } else {
                drop(completer);
            }
            for w in waiters {
                let outcome = w.join().unwrap();
                assert_eq!(outcome.is_ok(), finish, "{outcome:?}");
                if let Err(e) = outcome {
                    assert!(e.contains("dropped by the runtime"), "a waiter slept through the drop: {e}");
                }
            }
            assert_eq!(work.live().shared.lock().sleeping, 0);
        }
    }

    #[test]
    fn failures_name_op_seq_and_culprit() {
        let (work, completer) = Work::pending(WorkId(1), SeqNo(5), OpType::Broadcast, None);
        completer.finish(
            WorkResult::CommError {
                blame: cohort_core::Blame::rank(Rank(2)),
                message: "connection to rank 2 lost: EOF".into(),
            },
            finished_lifecycle(WorkState::Failed),
            vec![],
        );
        let err = work.wait().unwrap_err();
        assert_eq!(err.to_string(), "broadcast (seq 5) failed: connection to rank 2 lost: EOF; blame: rank 2");
        assert_eq!(err.culprit(), Some(Rank(2)));
        assert_eq!(work.exception(), Some(err));
        assert_eq!(work.state(), WorkState::Failed);
    }

    #[test]
    fn wait_timeout_gives_up_without_ending_the_work() {
        let (work, completer) = Work::pending(WorkId(1), SeqNo(1), OpType::Barrier, None);
        let err = work.wait_timeout(Duration::from_millis(5)).unwrap_err();
        assert!(matches!(err, WorkError::WaitTimedOut { .. }), "{err}");
        assert!(!work.is_completed());
        drop(completer);
        assert!(matches!(work.wait(), Err(WorkError::Dropped { .. })));
    }

    #[test]
    fn hook_sees_every_finished_work() {
        let seen = Arc::new(AtomicUsize::new(0));
        let s = seen.clone();
        let hook: CompletionHook = Arc::new(move |info: &WorkInfo| {
            assert_eq!(info.state, WorkState::TimedOut);
            s.fetch_add(1, Ordering::SeqCst);
        });
        let (_work, completer) = Work::pending(WorkId(1), SeqNo(1), OpType::Allreduce, Some(hook));
        completer.finish(
            WorkResult::Timeout { message: "t".into(), blame: cohort_core::Blame::nobody() },
            finished_lifecycle(WorkState::TimedOut),
            vec![],
        );
        assert_eq!(seen.load(Ordering::SeqCst), 1);
    }

    /// Everything a caller can ask of a work, in a form to compare.
    fn answers(work: &Work) -> String {
        let clone = work.clone();
        let before = format!(
            "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
            work.is_completed(),
            work.is_success(),
            work.exception(),
            work.wait(),
            work.wait_timeout(Duration::from_millis(1)),
            work.state(),
            work.duration(),
            work.source_rank(),
            (work.seq(), work.id(), work.op()),
            work,
            work.span().is_disabled(),
            work.result(),
        );
        // The first `result` took the outputs, for every clone.
        let polled = std::pin::pin!(clone).poll(&mut Context::from_waker(Waker::noop()));
        format!("{before} | {:?} {polled:?}", work.result())
    }

    #[test]
    fn a_work_finished_in_its_submit_call_answers_as_one_finished_by_its_completer() {
        let outputs = vec![Tensor::from_slice(&[3.0f32])];
        let failed = WorkResult::CommError { blame: cohort_core::Blame::rank(Rank(1)), message: "lost".into() };
        for (result, state) in [(WorkResult::Success, WorkState::Completed), (failed, WorkState::Failed)] {
            let summary = WorkSummary {
                id: WorkId(7),
                seq: SeqNo(4),
                is_p2p: false,
                op: OpType::Allreduce,
                result,
                lifecycle: finished_lifecycle(state),
            };
            let seen = Arc::new(Mutex::new(Vec::new()));
            let hook = |seen: &Arc<Mutex<Vec<WorkInfo>>>| -> CompletionHook {
                let seen = seen.clone();
                Arc::new(move |info: &WorkInfo| seen.lock().unwrap().push(info.clone()))
            };
            let (finished, call) = Work::finished(&summary, outputs.clone(), Some(hook(&seen)), GroupId(0), Rank(0));
            assert!(seen.lock().unwrap().is_empty(), "the hook waits for its call");
            call.run();
            let (completed, completer) = Work::pending(summary.id, summary.seq, summary.op, Some(hook(&seen)));
            completer.finish_with(summary.clone(), outputs.clone());
            let infos = seen.lock().unwrap().clone();
            assert_eq!(infos.len(), 2);
            assert_eq!(infos[0], infos[1]);
            assert_eq!(answers(&finished), answers(&completed), "{state:?}");
            // An abort function set on either is called by `abort`.
            for work in [&finished, &completed] {
                let aborted = Arc::new(Mutex::new(None));
                let a = aborted.clone();
                work.set_abort(Box::new(move |why| *a.lock().unwrap() = Some(why.to_string())));
                work.abort();
                assert_eq!(aborted.lock().unwrap().as_deref(), Some("all_reduce (seq 4) aborted by the user"));
            }
        }
    }

    #[test]
    fn a_finished_works_storage_serves_the_next_only_once_no_handle_holds_it_and_holds_nothing_then() {
        let finished = |seq: u64, value: f32| {
            let summary = WorkSummary {
                id: WorkId(seq),
                seq: SeqNo(seq),
                is_p2p: false,
                op: OpType::Allreduce,
                result: WorkResult::Success,
                lifecycle: finished_lifecycle(WorkState::Completed),
            };
            Work::finished(&summary, vec![Tensor::from_slice(&[value])], None, GroupId(0), Rank(0)).0
        };
        let storage = |work: &Work| match &work.0 {
            Repr::Done(done) => &**done as *const Done,
            Repr::Live(_) => panic!("a successful finished work is a `Done`"),
        };
        // The abort function owns `token`: its count says whether the function is still held.
        let token = Arc::new(());
        let first = finished(1, 1.0);
        let held = Arc::clone(&token);
        first.set_abort(Box::new(move |_| drop(Arc::clone(&held))));
        let clone = first.clone();
        let at = storage(&first);
        drop(first);
        // The clone still holds the first work: the second gets storage of its own.
        let second = finished(2, 2.0);
        assert_ne!(storage(&second), at);
        assert_eq!((clone.seq(), clone.result().unwrap()), (SeqNo(1), vec![Tensor::from_slice(&[1.0f32])]));
        assert_eq!((second.seq(), second.result().unwrap()), (SeqNo(2), vec![Tensor::from_slice(&[2.0f32])]));
        assert_eq!(Arc::strong_count(&token), 2, "the clone's abort function is its own until it goes");
        drop(second);
        drop(clone);
        assert_eq!(Arc::strong_count(&token), 1, "the last handle's drop dropped the abort function");
        let kept = SPARE.with(|spare| {
            let kept = spare.take();
            let at = kept.as_ref().map(|done| &**done as *const Done);
            spare.set(kept);
            at
        });
        assert_eq!(kept, Some(at), "the last handle's drop kept the storage");
        // The next work this thread ends goes into the storage the last drop kept, emptied of
        // the old work: its own answers, and no abort function.
        let third = finished(3, 3.0);
        assert_eq!(storage(&third), at);
        assert_eq!((third.id(), third.seq()), (WorkId(3), SeqNo(3)));
        third.abort();
        assert_eq!(Arc::strong_count(&token), 1);
        assert_eq!(third.result().unwrap(), vec![Tensor::from_slice(&[3.0f32])]);
        assert_eq!(third.result().unwrap(), Vec::<Tensor>::new(), "the outputs are taken once");
    }

    #[tokio::test]
    async fn await_and_from_future() {
        let work =
            Work::from_future(OpType::Allreduce, async { Ok::<_, std::io::Error>(vec![Tensor::from_slice(&[2i32])]) });
        assert_eq!(work.clone().await.unwrap(), vec![Tensor::from_slice(&[2i32])]);
        let failing = Work::from_future(OpType::Gather, async { Err(std::io::Error::other("nope")) });
        let err = failing.await.unwrap_err();
        assert_eq!(err.to_string(), "gather (seq 0) failed: nope; blame: undecided, no suspects");
    }
}
