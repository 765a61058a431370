//! Works: ids, op types, the lifecycle and results.
//!
//! Every collective or point-to-point op is a *work* that goes through
//! `Enqueued → Started → {Completed | Failed | TimedOut | Aborted}`. [`Lifecycle`] holds a
//! work's state and times and only offers the legal transitions; an illegal one (finishing a
//! finished work, starting a started one) is refused with [`IllegalTransition`], which core
//! code treats as a broken invariant.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A rank inside one process group (0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as an index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A work's id, unique within one [`GroupState`](crate::group::GroupState).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkId(pub u64);

impl fmt::Display for WorkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "work#{}", self.0)
    }
}

/// A sequence number: per group, collectives count 1, 2, 3… (as c10d's `collective_seq_id`),
/// and point-to-point ops count separately (`p2p_seq_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SeqNo(pub u64);

impl fmt::Display for SeqNo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A process group's id: 0 is the default (world) group; splits get fresh ids agreed by all
/// members.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GroupId(pub u32);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Every operation a process group runs, named after torch.distributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpType {
    /// `all_gather` (list of outputs).
    Allgather,
    /// `all_gather_coalesced`.
    AllgatherCoalesced,
    /// `all_gather_into_tensor` (c10d's `_allgather_base`).
    AllgatherIntoTensor,
    /// `all_reduce`.
    Allreduce,
    /// `all_reduce_coalesced`.
    AllreduceCoalesced,
    /// Sparse allreduce (indices and values through allgather, as Gloo does).
    AllreduceSparse,
    /// `all_to_all` (lists).
    Alltoall,
    /// `all_to_all_single` (c10d's `alltoall_base`), with optional uneven splits.
    AlltoallBase,
    /// `barrier`.
    Barrier,
    /// `broadcast`.
    Broadcast,
    /// `gather`.
    Gather,
    /// `monitored_barrier`.
    MonitoredBarrier,
    /// `recv` from a given rank.
    Recv,
    /// `recv` from any rank.
    RecvAnySource,
    /// `reduce`.
    Reduce,
    /// `reduce_scatter` (list of inputs).
    ReduceScatter,
    /// `reduce_scatter_tensor` (c10d's `_reduce_scatter_base`).
    ReduceScatterTensor,
    /// `scatter`.
    Scatter,
    /// `send`.
    Send,
}

impl OpType {
    /// Every op type.
    pub const ALL: [OpType; 19] = [
        OpType::Allgather,
        OpType::AllgatherCoalesced,
        OpType::AllgatherIntoTensor,
        OpType::Allreduce,
        OpType::AllreduceCoalesced,
        OpType::AllreduceSparse,
        OpType::Alltoall,
        OpType::AlltoallBase,
        OpType::Barrier,
        OpType::Broadcast,
        OpType::Gather,
        OpType::MonitoredBarrier,
        OpType::Recv,
        OpType::RecvAnySource,
        OpType::Reduce,
        OpType::ReduceScatter,
        OpType::ReduceScatterTensor,
        OpType::Scatter,
        OpType::Send,
    ];

    /// The name c10d's flight recorder uses after the backend prefix (`gloo:all_reduce`).
    pub const fn name(self) -> &'static str {
        match self {
            OpType::Allgather => "all_gather",
            OpType::AllgatherCoalesced => "all_gather_coalesced",
            OpType::AllgatherIntoTensor => "_allgather_base",
            OpType::Allreduce => "all_reduce",
            OpType::AllreduceCoalesced => "allreduce_coalesced",
            OpType::AllreduceSparse => "all_reduce_sparse",
            OpType::Alltoall => "all_to_all",
            OpType::AlltoallBase => "all_to_all_single",
            OpType::Barrier => "barrier",
            OpType::Broadcast => "broadcast",
            OpType::Gather => "gather",
            OpType::MonitoredBarrier => "monitored_barrier",
            OpType::Recv => "recv",
            OpType::RecvAnySource => "recv_any_source",
            OpType::Reduce => "reduce",
            OpType::ReduceScatter => "reduce_scatter",
            OpType::ReduceScatterTensor => "_reduce_scatter_base",
            OpType::Scatter => "scatter",
            OpType::Send => "send",
        }
    }

    /// Inverse of [`OpType::name`]; also accepts the public torch names (`all_gather_into_tensor`,
    /// `reduce_scatter_tensor`, `alltoall_base`, `allreduce`, `allgather`…).
    pub fn parse(s: &str) -> Option<OpType> {
        if let Some(op) = OpType::ALL.into_iter().find(|op| op.name() == s) {
            return Some(op);
        }
        Some(match s {
            "allreduce" => OpType::Allreduce,
            "allgather" => OpType::Allgather,
            "all_gather_into_tensor" | "allgather_into_tensor" => OpType::AllgatherIntoTensor,
            "reduce_scatter_tensor" => OpType::ReduceScatterTensor,
            "alltoall" => OpType::Alltoall,
            "alltoall_base" | "all_to_allv" => OpType::AlltoallBase,
            "recvAnySource" => OpType::RecvAnySource,
            _ => return None,
        })
    }

    /// Whether this is a point-to-point op (its own sequence, as c10d's `p2p_seq_id`).
    pub const fn is_p2p(self) -> bool {
        matches!(self, OpType::Send | OpType::Recv | OpType::RecvAnySource)
    }
}

impl fmt::Display for OpType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a work is in its lifecycle, in lifecycle order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkState {
    /// Submitted, not yet running (the flight recorder's `scheduled`).
    Enqueued,
    /// Running on the data plane.
    Started,
    /// Finished successfully.
    Completed,
    /// Finished with a communication or remote error.
    Failed,
    /// Ended by the watchdog at its deadline.
    TimedOut,
    /// Ended by an abort (local, or the group's).
    Aborted,
}

impl WorkState {
    /// Whether the work has ended.
    pub const fn is_terminal(self) -> bool {
        !matches!(self, WorkState::Enqueued | WorkState::Started)
    }
}

/// Whom a failure blames. Every failed work carries one, and its message says the same
/// (see [`WorkResult`]'s `Display`, which ends with it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Blame {
    /// Decided: these ranks (one; or both ranks of a two-rank group that disagree, where no
    /// majority can say which deviated).
    Ranks {
        /// The ranks, sorted.
        ranks: Vec<Rank>,
    },
    /// The network is cut between two sets of ranks: every link between them is silent.
    /// `near` is the side of the rank that reports it.
    Cut {
        /// The reporting rank's side, sorted.
        near: Vec<Rank>,
        /// The other side, sorted.
        far: Vec<Rank>,
    },
    /// Not decided; these ranks are suspected (maybe none).
    Undecided {
        /// The suspects, sorted.
        suspects: Vec<Rank>,
    },
}

impl Blame {
    /// One rank, decided.
    pub fn rank(rank: Rank) -> Blame {
        Blame::Ranks { ranks: vec![rank] }
    }

    /// These ranks, decided (sorted and deduplicated here).
    pub fn ranks(ranks: impl IntoIterator<Item = Rank>) -> Blame {
        Blame::Ranks { ranks: sorted(ranks) }
    }

    /// A cut between `near` (the reporter's side) and `far`.
    pub fn cut(near: impl IntoIterator<Item = Rank>, far: impl IntoIterator<Item = Rank>) -> Blame {
        Blame::Cut { near: sorted(near), far: sorted(far) }
    }

    /// Undecided, with these suspects.
    pub fn undecided(suspects: impl IntoIterator<Item = Rank>) -> Blame {
        Blame::Undecided { suspects: sorted(suspects) }
    }

    /// Undecided, nobody suspected.
    pub fn nobody() -> Blame {
        Blame::Undecided { suspects: Vec::new() }
    }

    /// `Some(rank)` decided, `None` undecided.
    pub fn from_option(rank: Option<Rank>) -> Blame {
        rank.map_or_else(Blame::nobody, Blame::rank)
    }

    /// The one rank held responsible, when there is exactly one: a single decided rank, or
    /// the far side of a cut that is a single rank (cut off from this side).
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            Blame::Ranks { ranks } | Blame::Cut { far: ranks, .. } if ranks.len() == 1 => Some(ranks[0]),
            _ => None,
        }
    }

    /// Whether it is decided (ranks or a cut).
    pub fn is_decided(&self) -> bool {
        !matches!(self, Blame::Undecided { .. })
    }

    /// Every rank it names: the decided ranks, the far side of a cut, or the suspects.
    pub fn named(&self) -> &[Rank] {
        match self {
            Blame::Ranks { ranks } => ranks,
            Blame::Cut { far, .. } => far,
            Blame::Undecided { suspects } => suspects,
        }
    }

    /// Compact text, for the store and the wire: `3`, `0,1` (ranks), `0,1|2,3` (a cut,
    /// near side first), `?1,3` (undecided with suspects) or `?` (nobody).
    pub fn encode(&self) -> String {
        let list = |r: &[Rank]| r.iter().map(|r| r.0.to_string()).collect::<Vec<_>>().join(",");
        match self {
            Blame::Ranks { ranks } => list(ranks),
            Blame::Cut { near, far } => format!("{}|{}", list(near), list(far)),
            Blame::Undecided { suspects } => format!("?{}", list(suspects)),
        }
    }

    /// The blame in [`Blame::encode`]'s text (`-` also reads as nobody). At most `max_ranks`
    /// ranks in all, each below `world_size`: a peer's bytes can name no more.
    pub fn parse(text: &str, world_size: u32) -> Result<Blame, BlameError> {
        let bad = |why: String| BlameError { text: text.to_owned(), why };
        let list = |t: &str| -> Result<Vec<Rank>, BlameError> {
            if t.is_empty() {
                return Ok(Vec::new());
            }
            let ranks = t
                .split(',')
                .map(|r| match r.parse::<u32>() {
                    Ok(r) if r < world_size => Ok(Rank(r)),
                    _ => Err(bad(format!("{r:?} is not a rank of a group of {world_size}"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if ranks.len() > world_size as usize {
                return Err(bad("it names more ranks than the group has".into()));
            }
            Ok(ranks)
        };
        if text == "-" || text == "?" {
            return Ok(Blame::nobody());
        }
        if let Some(rest) = text.strip_prefix('?') {
            return Ok(Blame::undecided(list(rest)?));
        }
        if let Some((near, far)) = text.split_once('|') {
            let (near, far) = (list(near)?, list(far)?);
            if near.is_empty() || far.is_empty() {
                return Err(bad("a cut needs ranks on both sides".into()));
            }
            return Ok(Blame::cut(near, far));
        }
        let ranks = list(text)?;
        if ranks.is_empty() {
            return Err(bad("it is empty (write ? for nobody)".into()));
        }
        Ok(Blame::ranks(ranks))
    }
}

fn sorted(ranks: impl IntoIterator<Item = Rank>) -> Vec<Rank> {
    let mut v: Vec<Rank> = ranks.into_iter().collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// `[0, 1, 2, 5]` as `[0-2, 5]`.
pub fn rank_ranges(ranks: &[Rank]) -> String {
    let mut out = String::from("[");
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i].0;
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1].0 == end + 1 {
            i += 1;
            end += 1;
        }
        if out.len() > 1 {
            out.push_str(", ");
        }
        if end > start {
            let _ = fmt::Write::write_fmt(&mut out, format_args!("{start}-{end}"));
        } else {
            let _ = fmt::Write::write_fmt(&mut out, format_args!("{start}"));
        }
        i += 1;
    }
    out.push(']');
    out
}

impl fmt::Display for Blame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Blame::Ranks { ranks } if ranks.len() == 1 => write!(f, "rank {}", ranks[0]),
            Blame::Ranks { ranks } => write!(f, "ranks {}", rank_ranges(ranks)),
            Blame::Cut { near, far } => {
                write!(f, "a network cut between ranks {} and ranks {}", rank_ranges(near), rank_ranges(far))
            }
            Blame::Undecided { suspects } if suspects.is_empty() => f.write_str("undecided, no suspects"),
            Blame::Undecided { suspects } => write!(f, "undecided, suspects {}", rank_ranges(suspects)),
        }
    }
}

/// How a work ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
#[non_exhaustive]
pub enum WorkResult {
    /// It completed.
    Success,
    /// The watchdog ended it at its deadline; the message says what it waited for.
    Timeout {
        /// c10d-style message naming op, seq, sizes, timeout, elapsed time and missing ranks.
        message: String,
        /// Whom it blames: the one rank it waited for, or where the waiting chain ended;
        /// undecided, with the ranks it waited for as suspects, otherwise.
        blame: Blame,
    },
    /// This rank's communication failed (a peer's connection dropped, a desync, a protocol
    /// error…).
    CommError {
        /// Whom it blames.
        blame: Blame,
        /// What happened.
        message: String,
    },
    /// Another rank failed first and told this one.
    RemoteError {
        /// The rank that failed first (not a rank that only relayed it).
        rank: Rank,
        /// Whom that rank blamed.
        blame: Blame,
        /// Its cause.
        message: String,
    },
    /// It was aborted.
    Aborted {
        /// Why.
        reason: String,
    },
}

impl WorkResult {
    /// The terminal state this result puts a work in.
    pub fn terminal_state(&self) -> WorkState {
        match self {
            WorkResult::Success => WorkState::Completed,
            WorkResult::Timeout { .. } => WorkState::TimedOut,
            WorkResult::CommError { .. } | WorkResult::RemoteError { .. } => WorkState::Failed,
            WorkResult::Aborted { .. } => WorkState::Aborted,
        }
    }

    /// Whether this is [`WorkResult::Success`].
    pub fn is_success(&self) -> bool {
        matches!(self, WorkResult::Success)
    }

    /// Whom it blames: `None` for a success or an abort (nobody failed), the failure's blame
    /// otherwise.
    pub fn blame(&self) -> Option<&Blame> {
        match self {
            WorkResult::Timeout { blame, .. }
            | WorkResult::CommError { blame, .. }
            | WorkResult::RemoteError { blame, .. } => Some(blame),
            WorkResult::Success | WorkResult::Aborted { .. } => None,
        }
    }

    /// The one rank it blames, if exactly one (see [`Blame::culprit`]).
    pub fn culprit(&self) -> Option<Rank> {
        self.blame().and_then(Blame::culprit)
    }
}

impl fmt::Display for WorkResult {
    /// The message, then whom it blames: `…; blame: rank 2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkResult::Success => f.write_str("success"),
            WorkResult::Timeout { message, blame } | WorkResult::CommError { message, blame } => {
                write!(f, "{message}; blame: {blame}")
            }
            WorkResult::RemoteError { rank, message, blame } => {
                write!(f, "rank {rank} failed first: {message}; blame: {blame}")
            }
            WorkResult::Aborted { reason } => write!(f, "aborted: {reason}"),
        }
    }
}

/// A transition the lifecycle does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal work transition {from:?} -> {to:?}")]
pub struct IllegalTransition {
    /// State before.
    pub from: WorkState,
    /// State asked for.
    pub to: WorkState,
}

/// A work's state and the times of its transitions, as `Duration`s since the group's epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    state: WorkState,
    enqueued_at: Duration,
    started_at: Option<Duration>,
    finished_at: Option<Duration>,
    /// The time the device measured between the work's start and end events (NCCL), which
    /// [`Lifecycle::duration`] reports instead of the host's view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device_time: Option<Duration>,
}

impl Lifecycle {
    /// A work enqueued at `now`.
    pub fn new(now: Duration) -> Self {
        Lifecycle {
            state: WorkState::Enqueued,
            enqueued_at: now,
            started_at: None,
            finished_at: None,
            device_time: None,
        }
    }

    /// The device measured the work's run as `time` (its start and end events, as c10d's
    /// `getDuration` on NCCL): [`Lifecycle::duration`] reports it from now on.
    pub fn set_device_time(&mut self, time: Duration) {
        self.device_time = Some(time);
    }

    /// The device-measured run time, if a device measured it.
    pub fn device_time(&self) -> Option<Duration> {
        self.device_time
    }

    /// `Enqueued → Started`.
    pub fn start(&mut self, now: Duration) -> Result<(), IllegalTransition> {
        if self.state != WorkState::Enqueued {
            return Err(IllegalTransition { from: self.state, to: WorkState::Started });
        }
        self.state = WorkState::Started;
        self.started_at = Some(now);
        Ok(())
    }

    /// `Enqueued | Started → terminal`. A work may end without starting (aborted or timed out
    /// while queued, or failed because a peer it needs is already gone).
    pub fn finish(&mut self, now: Duration, to: WorkState) -> Result<(), IllegalTransition> {
        if self.state.is_terminal() || !to.is_terminal() {
            return Err(IllegalTransition { from: self.state, to });
        }
        self.state = to;
        self.finished_at = Some(now);
        Ok(())
    }

    /// The current state.
    pub fn state(&self) -> WorkState {
        self.state
    }

    /// When it was enqueued.
    pub fn enqueued_at(&self) -> Duration {
        self.enqueued_at
    }

    /// When it started.
    pub fn started_at(&self) -> Option<Duration> {
        self.started_at
    }

    /// When it ended.
    pub fn finished_at(&self) -> Option<Duration> {
        self.finished_at
    }

    /// From start (or enqueue, if it never started) to end; `None` while running. The
    /// device-measured time instead, when a device measured it.
    pub fn duration(&self) -> Option<Duration> {
        let end = self.finished_at?;
        Some(self.device_time.unwrap_or_else(|| end.saturating_sub(self.started_at.unwrap_or(self.enqueued_at))))
    }
}

/// A blame text [`Blame::parse`] cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("blame {text:?}: {why}")]
pub struct BlameError {
    /// The text.
    pub text: String,
    /// What is wrong with it.
    pub why: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn lifecycle_runs_in_order() {
        let mut l = Lifecycle::new(T(1));
        assert_eq!(l.state(), WorkState::Enqueued);
        l.start(T(2)).unwrap();
        l.finish(T(5), WorkState::Completed).unwrap();
        assert_eq!(l.state(), WorkState::Completed);
        assert_eq!(l.duration(), Some(T(3)));
    }

    #[test]
    fn illegal_transitions_are_refused() {
        let mut l = Lifecycle::new(T(0));
        assert!(l.finish(T(1), WorkState::Started).is_err());
        l.finish(T(1), WorkState::Aborted).unwrap();
        assert_eq!(l.start(T(2)), Err(IllegalTransition { from: WorkState::Aborted, to: WorkState::Started }));
        assert!(l.finish(T(2), WorkState::Completed).is_err());
        assert_eq!(l.finished_at(), Some(T(1)));
        assert_eq!(l.duration(), Some(T(1)));
    }

    #[test]
    fn a_device_measured_time_is_the_duration() {
        let mut l = Lifecycle::new(T(1));
        l.start(T(2)).unwrap();
        l.set_device_time(T(40));
        assert_eq!(l.duration(), None, "still running");
        l.finish(T(3), WorkState::Completed).unwrap();
        assert_eq!(l.duration(), Some(T(40)));
        assert_eq!(l.device_time(), Some(T(40)));
    }

    #[test]
    fn results_map_to_terminal_states() {
        assert_eq!(WorkResult::Success.terminal_state(), WorkState::Completed);
        let remote =
            WorkResult::RemoteError { rank: Rank(3), blame: Blame::rank(Rank(1)), message: "connection reset".into() };
        assert_eq!(remote.terminal_state(), WorkState::Failed);
        assert_eq!(remote.culprit(), Some(Rank(1)));
        assert_eq!(remote.to_string(), "rank 3 failed first: connection reset; blame: rank 1");
        let undecided =
            WorkResult::Timeout { message: "timed out".into(), blame: Blame::undecided([Rank(2), Rank(1)]) };
        assert_eq!(undecided.culprit(), None);
        assert_eq!(undecided.to_string(), "timed out; blame: undecided, suspects [1-2]");
        assert_eq!(WorkResult::Aborted { reason: "bye".into() }.blame(), None);
    }

    #[test]
    fn blames_print_what_they_hold_and_round_trip_through_their_text() {
        let cases = [
            (Blame::rank(Rank(2)), "2", "rank 2"),
            (Blame::ranks([Rank(1), Rank(0)]), "0,1", "ranks [0-1]"),
            (
                Blame::cut([Rank(0), Rank(1), Rank(4)], [Rank(2), Rank(3)]),
                "0,1,4|2,3",
                "a network cut between ranks [0-1, 4] and ranks [2-3]",
            ),
            (Blame::undecided([Rank(3)]), "?3", "undecided, suspects [3]"),
            (Blame::nobody(), "?", "undecided, no suspects"),
        ];
        for (blame, text, shown) in cases {
            assert_eq!(blame.encode(), text);
            assert_eq!(blame.to_string(), shown);
            assert_eq!(Blame::parse(text, 8), Ok(blame));
        }
        assert_eq!(Blame::parse("-", 8), Ok(Blame::nobody()));
        assert_eq!(Blame::cut([Rank(0), Rank(1)], [Rank(5)]).culprit(), Some(Rank(5)), "one rank cut off");
        assert_eq!(Blame::ranks([Rank(0), Rank(1)]).culprit(), None);
        for bad in ["", "8", "x", "1,,2", "|1", "1|", "?9", "-1", "1|2|3"] {
            assert!(Blame::parse(bad, 8).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn op_names_round_trip() {
        for op in OpType::ALL {
            assert_eq!(OpType::parse(op.name()), Some(op));
        }
        assert_eq!(OpType::parse("allreduce"), Some(OpType::Allreduce));
        assert!(OpType::Send.is_p2p() && !OpType::Barrier.is_p2p());
    }
}
