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
        /// The rank it blames: the one rank it waited for, or where the waiting chain ended.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        culprit: Option<Rank>,
    },
    /// This rank's communication failed (a peer's connection dropped, a protocol error…).
    CommError {
        /// The rank the failure is about, when there is one.
        rank: Option<Rank>,
        /// What happened.
        message: String,
    },
    /// Another rank failed first and told this one.
    RemoteError {
        /// The rank that failed first and reported it.
        rank: Rank,
        /// The rank it blamed (e.g. the peer it lost), when it named one.
        culprit: Option<Rank>,
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

    /// The rank this result blames, if any.
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            WorkResult::CommError { rank, .. } => *rank,
            WorkResult::Timeout { culprit, .. } => *culprit,
            WorkResult::RemoteError { rank, culprit, .. } => culprit.or(Some(*rank)),
            _ => None,
        }
    }
}

impl fmt::Display for WorkResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkResult::Success => f.write_str("success"),
            WorkResult::Timeout { message, .. } => f.write_str(message),
            WorkResult::CommError { message, .. } => f.write_str(message),
            WorkResult::RemoteError { rank, message, .. } => write!(f, "rank {rank} failed first: {message}"),
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
        let remote = WorkResult::RemoteError { rank: Rank(3), culprit: None, message: "connection reset".into() };
        assert_eq!(remote.terminal_state(), WorkState::Failed);
        assert_eq!(remote.culprit(), Some(Rank(3)));
        assert_eq!(remote.to_string(), "rank 3 failed first: connection reset");
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
