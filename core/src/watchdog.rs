//! The watchdog's pure parts: one timer table keyed by [`TimerKind`], the c10d-style timeout
//! message, and the monitor that notices when a driver stops ticking.
//!
//! [`GroupState`](crate::group::GroupState) owns a [`TimerTable`]; a driver asks for the
//! earliest deadline with `poll_timeout()` and calls `handle_timeout(now)` when it passes.
//! Deadlines are exact, so a hung collective is reported at its timeout, not at the next
//! multiple of a polling interval.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::work::{OpType, Rank, SeqNo, WorkId};

/// The most hops of a chain of stuck notes a timeout's message shows (the rest are counted).
const CHAIN_SHOWN: usize = 8;

/// Why the group asked to be woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TimerKind {
    /// Send the next heartbeat to every peer.
    Heartbeat,
    /// A peer has been silent too long.
    PeerSilence(Rank),
    /// A work's deadline (enqueue time + its timeout).
    WorkDeadline(WorkId),
    /// Halfway to a collective's deadline: if it is still waiting, tell the peers whom it
    /// waits for, so that a later timeout anywhere can follow the chain to the rank that is
    /// not in the collective at all.
    WorkStuck(WorkId),
    /// The desync census of a collective (by sequence number) has waited long enough for
    /// votes: decide with those it has.
    Census(SeqNo),
}

/// Deadlines keyed by kind; at most one deadline per kind.
///
/// A map from kind to deadline, plus a min-heap of `(deadline, kind)` from which moved and
/// cancelled timers leave lazily: a heap entry that no longer matches the map is stale and is
/// dropped when it reaches the top (the top is never stale between calls). Setting and
/// cancelling a work's deadline, once per work, are then a hash-map insert and removal and a
/// heap push that usually moves nothing (deadlines mostly grow); B-trees cost several times
/// that. The keys are this process's own, so the map uses a fast, non-keyed hash. Ties between
/// equal deadlines pop in [`TimerKind`] order, so runs replay.
#[derive(Debug, Clone, Default)]
pub struct TimerTable {
    by_kind: FxHashMap<TimerKind, Duration>,
    by_time: BinaryHeap<Reverse<(Duration, TimerKind)>>,
}

impl TimerTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Set (or move) the deadline of `kind`.
    pub fn set(&mut self, kind: TimerKind, at: Duration) {
        self.by_kind.insert(kind, at);
        self.by_time.push(Reverse((at, kind)));
        self.settle();
    }

    /// Remove the deadline of `kind`, if any.
    pub fn cancel(&mut self, kind: TimerKind) {
        if self.by_kind.remove(&kind).is_some() {
            self.settle();
        }
    }

    /// The deadline of `kind`.
    pub fn get(&self, kind: TimerKind) -> Option<Duration> {
        self.by_kind.get(&kind).copied()
    }

    /// The earliest deadline and its kind.
    pub fn earliest(&self) -> Option<(Duration, TimerKind)> {
        self.by_time.peek().map(|r| r.0)
    }

    /// Remove and return the earliest timer if it is due at `now`. Call until `None`.
    pub fn pop_expired(&mut self, now: Duration) -> Option<(Duration, TimerKind)> {
        let (at, kind) = self.earliest()?;
        if at > now {
            return None;
        }
        self.by_time.pop();
        self.by_kind.remove(&kind);
        self.settle();
        Some((at, kind))
    }

    /// Number of timers set.
    pub fn len(&self) -> usize {
        self.by_kind.len()
    }

    /// Whether no timer is set.
    pub fn is_empty(&self) -> bool {
        self.by_kind.is_empty()
    }

    /// Drop stale entries from the top of the heap, and rebuild it when stale entries behind
    /// the top outnumber the live ones (a timer moved again and again, or many cancelled
    /// behind a long one).
    fn settle(&mut self) {
        while let Some(&Reverse((at, kind))) = self.by_time.peek() {
            if self.by_kind.get(&kind) == Some(&at) {
                break;
            }
            self.by_time.pop();
        }
        if self.by_time.len() > 2 * self.by_kind.len() + 64 {
            self.by_time = self.by_kind.iter().map(|(&kind, &at)| Reverse((at, kind))).collect();
        }
    }
}

/// What a timed-out work was, for [`timeout_message`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimeoutContext {
    /// The op.
    pub op: OpType,
    /// Its sequence number.
    pub seq: SeqNo,
    /// Elements in.
    pub numel_in: usize,
    /// Elements out.
    pub numel_out: usize,
    /// Its timeout.
    pub timeout: Duration,
    /// How long it ran before the watchdog ended it.
    pub elapsed: Duration,
    /// Whether it ever started on the data plane.
    pub started: bool,
    /// The ranks whose part had not arrived, when the data plane told us.
    pub waiting_on: Option<Vec<Rank>>,
    /// Where the waiting led, from peers' stuck notes: `[b, c]` when the rank this one waits
    /// for (`a`) said it was itself stuck (in this collective or an earlier one) waiting for
    /// `b`, and `b` for `c`. The last rank of the chain sent no such note.
    pub chain: Vec<Rank>,
}

/// The message of a watchdog timeout. It carries what c10d's does ("Watchdog caught collective
/// operation timeout: WorkNCCL(SeqNum=…, OpType=…, NumelIn=…, NumelOut=…, Timeout(ms)=…) ran
/// for … milliseconds before timing out") and, beyond it, the ranks that never sent their part.
pub fn timeout_message(this_rank: Rank, cx: &TimeoutContext) -> String {
    let mut msg = format!(
        "rank {this_rank}: watchdog caught collective operation timeout: {op} (seq {seq}, numel in {ni}, numel out {no}, timeout {t} ms) ran for {e} ms before timing out",
        op = cx.op,
        seq = cx.seq,
        ni = cx.numel_in,
        no = cx.numel_out,
        t = cx.timeout.as_millis(),
        e = cx.elapsed.as_millis(),
    );
    if !cx.started {
        msg.push_str("; it never started (an earlier work on this group was still running)");
    }
    match &cx.waiting_on {
        Some(ranks) if !ranks.is_empty() => {
            let list: Vec<String> = ranks.iter().map(Rank::to_string).collect();
            msg.push_str(&format!("; still waiting for rank(s) [{}]", list.join(", ")));
            if let ([waited], Some(last)) = (ranks.as_slice(), cx.chain.last()) {
                let mut hops = vec![format!("rank {waited}")];
                hops.extend(cx.chain.iter().map(|r| format!("rank {r}")));
                // A long chain (a ring of a thousand ranks) keeps its ends: the rank waited
                // for and the likely culprit are what a reader needs.
                if hops.len() > CHAIN_SHOWN {
                    let hidden = hops.len() - CHAIN_SHOWN / 2 * 2;
                    let tail = hops.split_off(hops.len() - CHAIN_SHOWN / 2);
                    hops.truncate(CHAIN_SHOWN / 2);
                    hops.push(format!("… ({hidden} more)"));
                    hops.extend(tail);
                }
                msg.push_str(&format!(
                    "; {}: each said it was stuck waiting for the next (in this collective or an earlier one) and rank {last} never did: rank {last} is the likely culprit",
                    hops.join(" → "),
                ));
            }
        }
        _ => {}
    }
    msg
}

/// Which ranks hold collective `seq` back, from every rank's published progress (c10d's desync
/// debug, `TORCH_NCCL_DESYNC_DEBUG`): a backend that cannot see whom a collective waits for
/// (NCCL) asks every rank how far it got instead. `progress[r]` is rank `r`'s record, `None`
/// where it published none.
///
/// The ranks that have not enqueued `seq` (or published nothing) are behind. If every rank
/// enqueued it, those whose kernel for it has not started are: their device is stuck in
/// something earlier. `me` is never named (this rank knows its own state). Empty when no rank
/// is behind: the ranks all entered it and the collective itself is stuck.
pub fn ranks_behind(seq: SeqNo, me: Rank, progress: &[Option<crate::protocol::ProgressRecord>]) -> Vec<Rank> {
    let others = || progress.iter().enumerate().map(|(r, p)| (Rank(r as u32), p)).filter(|(r, _)| *r != me);
    let not_enqueued: Vec<Rank> =
        others().filter(|(_, p)| p.is_none_or(|p| p.enqueued < seq)).map(|(r, _)| r).collect();
    if !not_enqueued.is_empty() {
        return not_enqueued;
    }
    others().filter(|(_, p)| p.is_some_and(|p| p.started < seq)).map(|(r, _)| r).collect()
}

/// Notices a driver that stopped ticking (c10d's heartbeat monitor for its watchdog thread,
/// `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`): the driver calls [`DriverMonitor::handle_tick`] from its
/// loop; another thread asks [`DriverMonitor::check`].
#[derive(Debug, Clone)]
pub struct DriverMonitor {
    last_tick: Duration,
    stall_after: Duration,
    raised: bool,
}

impl DriverMonitor {
    /// A monitor that raises once the driver has not ticked for `stall_after`.
    pub fn new(now: Duration, stall_after: Duration) -> Self {
        DriverMonitor { last_tick: now, stall_after, raised: false }
    }

    /// The driver is alive at `now`.
    pub fn handle_tick(&mut self, now: Duration) {
        self.last_tick = self.last_tick.max(now);
        self.raised = false;
    }

    /// How long the driver has been silent, once it exceeds the limit; raised once per stall.
    pub fn check(&mut self, now: Duration) -> Option<Duration> {
        let silent = now.saturating_sub(self.last_tick);
        if silent >= self.stall_after && !self.raised {
            self.raised = true;
            Some(silent)
        } else {
            None
        }
    }

    /// When [`DriverMonitor::check`] could next raise.
    pub fn poll_timeout(&self) -> Option<Duration> {
        (!self.raised).then(|| self.last_tick + self.stall_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn timer_table_pops_in_deadline_order_and_moves_timers() {
        let mut t = TimerTable::new();
        t.set(TimerKind::WorkDeadline(WorkId(1)), MS(30));
        t.set(TimerKind::Heartbeat, MS(10));
        t.set(TimerKind::PeerSilence(Rank(2)), MS(20));
        t.set(TimerKind::Heartbeat, MS(40));
        assert_eq!(t.earliest(), Some((MS(20), TimerKind::PeerSilence(Rank(2)))));
        assert_eq!(t.pop_expired(MS(19)), None);
        assert_eq!(t.pop_expired(MS(35)), Some((MS(20), TimerKind::PeerSilence(Rank(2)))));
        assert_eq!(t.pop_expired(MS(35)), Some((MS(30), TimerKind::WorkDeadline(WorkId(1)))));
        assert_eq!(t.pop_expired(MS(35)), None);
        t.cancel(TimerKind::Heartbeat);
        assert!(t.is_empty());
    }

    proptest::proptest! {
        /// Any sequence of sets, moves, cancels and pops behaves as a table that keeps every
        /// timer in one ordered set, ties popping in kind order.
        #[test]
        fn timer_table_matches_an_ordered_model(
            ops in proptest::collection::vec((0u8..4, 0u64..6, 0u64..50), 0..300),
        ) {
            let mut t = TimerTable::new();
            let mut model: std::collections::BTreeMap<TimerKind, Duration> = Default::default();
            let kinds = |k: u64| match k {
                0 => TimerKind::Heartbeat,
                1 | 2 => TimerKind::PeerSilence(Rank(k as u32)),
                3 | 4 => TimerKind::WorkDeadline(WorkId(k)),
                _ => TimerKind::WorkStuck(WorkId(k)),
            };
            for (op, k, at) in ops {
                let kind = kinds(k);
                match op {
                    0 | 1 => {
                        t.set(kind, MS(at));
                        model.insert(kind, MS(at));
                    }
                    2 => {
                        t.cancel(kind);
                        model.remove(&kind);
                    }
                    _ => {
                        let want = model.iter().map(|(&k, &a)| (a, k)).min().filter(|&(a, _)| a <= MS(at));
                        if let Some((_, k)) = want {
                            model.remove(&k);
                        }
                        proptest::prop_assert_eq!(t.pop_expired(MS(at)), want);
                    }
                }
                proptest::prop_assert_eq!(t.earliest(), model.iter().map(|(&k, &a)| (a, k)).min());
                proptest::prop_assert_eq!(t.len(), model.len());
                proptest::prop_assert_eq!(t.get(kind), model.get(&kind).copied());
                proptest::prop_assert!(t.by_time.len() <= 2 * t.by_kind.len() + 65);
            }
        }
    }

    #[test]
    fn the_ranks_behind_are_those_that_did_not_enqueue_then_those_that_did_not_start() {
        use crate::protocol::ProgressRecord;
        let p = |e, s, c| Some(ProgressRecord { enqueued: SeqNo(e), started: SeqNo(s), completed: SeqNo(c) });
        // Rank 2 never called seq 3; rank 3 published nothing.
        assert_eq!(
            ranks_behind(SeqNo(3), Rank(0), &[p(3, 3, 2), p(3, 3, 2), p(2, 2, 2), None]),
            vec![Rank(2), Rank(3)]
        );
        // Everyone enqueued it; rank 1's kernel never started (its stream is stuck earlier).
        assert_eq!(ranks_behind(SeqNo(3), Rank(0), &[p(3, 2, 2), p(3, 2, 2), p(3, 3, 2)]), vec![Rank(1)]);
        // This rank is never named, and a collective stuck on every rank names nobody.
        assert_eq!(ranks_behind(SeqNo(3), Rank(1), &[p(3, 3, 2), p(3, 2, 2), p(3, 3, 2)]), Vec::<Rank>::new());
        assert_eq!(ranks_behind(SeqNo(3), Rank(0), &[p(1, 0, 0), p(5, 5, 5)]), Vec::<Rank>::new());
    }

    #[test]
    fn timeout_message_names_the_missing_ranks() {
        let cx = TimeoutContext {
            op: OpType::Allreduce,
            seq: SeqNo(7),
            numel_in: 1024,
            numel_out: 1024,
            timeout: MS(500),
            elapsed: MS(503),
            started: true,
            waiting_on: Some(vec![Rank(2), Rank(3)]),
            chain: Vec::new(),
        };
        assert_eq!(
            timeout_message(Rank(0), &cx),
            "rank 0: watchdog caught collective operation timeout: all_reduce (seq 7, numel in 1024, numel out 1024, timeout 500 ms) ran for 503 ms before timing out; still waiting for rank(s) [2, 3]"
        );
        let cx = TimeoutContext { waiting_on: Some(vec![Rank(1)]), chain: vec![Rank(2), Rank(3)], ..cx };
        assert_eq!(
            timeout_message(Rank(0), &cx),
            "rank 0: watchdog caught collective operation timeout: all_reduce (seq 7, numel in 1024, numel out 1024, timeout 500 ms) ran for 503 ms before timing out; still waiting for rank(s) [1]; rank 1 → rank 2 → rank 3: each said it was stuck waiting for the next (in this collective or an earlier one) and rank 3 never did: rank 3 is the likely culprit"
        );
        // A ring of a thousand: the ends of the chain, and how many hops between.
        let cx =
            TimeoutContext { waiting_on: Some(vec![Rank(1023)]), chain: (17..1023).rev().map(Rank).collect(), ..cx };
        let text = timeout_message(Rank(0), &cx);
        assert!(
            text.ends_with("; rank 1023 → rank 1022 → rank 1021 → rank 1020 → … (999 more) → rank 20 → rank 19 → rank 18 → rank 17: each said it was stuck waiting for the next (in this collective or an earlier one) and rank 17 never did: rank 17 is the likely culprit"),
            "{text}"
        );
    }

    #[test]
    fn driver_monitor_raises_once_per_stall() {
        let mut m = DriverMonitor::new(MS(0), MS(100));
        assert_eq!(m.check(MS(99)), None);
        assert_eq!(m.poll_timeout(), Some(MS(100)));
        assert_eq!(m.check(MS(150)), Some(MS(150)));
        assert_eq!(m.check(MS(200)), None);
        m.handle_tick(MS(210));
        assert_eq!(m.check(MS(250)), None);
        assert_eq!(m.check(MS(310)), Some(MS(100)));
    }
}
