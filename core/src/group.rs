//! [`GroupState`]: one rank's state in one process group — sequence numbers, works in issue
//! order, deadlines, peer liveness, abort and error handling.
//!
//! # Calling contract
//!
//! A driver owns one `GroupState` per process group and runs the sans-IO loop:
//!
//! 1. wait for one thing: a user submit, a frame from a peer, a data-plane completion, or the
//!    [`GroupState::poll_timeout`] deadline;
//! 2. feed exactly one input ([`submit`](GroupState::submit), [`handle_started`](GroupState::handle_started),
//!    [`handle_waiting_on`](GroupState::handle_waiting_on), [`handle_completion`](GroupState::handle_completion),
//!    [`handle_message`](GroupState::handle_message), [`handle_peer_activity`](GroupState::handle_peer_activity),
//!    [`handle_peer_lost`](GroupState::handle_peer_lost), [`handle_abort`](GroupState::handle_abort),
//!    [`handle_timeout`](GroupState::handle_timeout));
//! 3. drain the outputs in this order, each until `None`: [`poll_transmit`](GroupState::poll_transmit)
//!    (control messages for peers), [`poll_launch`](GroupState::poll_launch) (works the data plane
//!    may start now, in issue order), [`poll_event`](GroupState::poll_event) (what the user sees);
//! 4. re-read [`poll_timeout`](GroupState::poll_timeout) and go back to 1.
//!
//! Every submitted work ends exactly once, in an [`Event::WorkFinished`], and works finish in
//! issue order: a work whose data plane finished early waits for the works before it.
//!
//! One exception, for a driver that can run a small collective to its end inside the user's
//! submit call: [`GroupState::submit_inline`] admits it like any work (checks, sequence number,
//! flight-recorder entry, desync signature) but, on an idle group, hands it back to the caller
//! instead of entering it in the table (a busy group takes nothing this way, and the caller
//! submits as usual). The caller's next input must be
//! [`finish_inline`](GroupState::finish_inline), which returns its summary instead of the
//! event, or [`adopt_inline`](GroupState::adopt_inline), which gives it the usual entry, after
//! which it goes on as any work.
//!
//! Failures are outcomes, not errors. What happens after one depends on [`ErrorHandling`],
//! which mirrors `TORCH_NCCL_ASYNC_ERROR_HANDLING`.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::census::{Signature, Votes};
use crate::recorder::{
    Dump, DumpMeta, FlightRecorder, NameId, ProfilingName, RecordId, RecordNumbers, RecordRequest, RecorderConfig,
};
use crate::seqmap::SeqMap;
use crate::tensor::{DType, numel_of};
use crate::watchdog::{TimeoutContext, TimerKind, TimerTable, timeout_message};
use crate::work::{Blame, GroupId, IllegalTransition, Lifecycle, OpType, Rank, SeqNo, WorkId, WorkResult, WorkState};

/// Gloo's default collective timeout (30 minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Stuck notes kept per peer (one per collective it was stuck in); older ones are dropped.
const STUCK_NOTES_PER_PEER: usize = 64;

/// Collectives whose signatures a rank keeps, to answer a desync census about one it already
/// finished (a broadcast root finishes before its peers notice anything).
const SIGNATURES_KEPT: usize = 256;

/// How often, at most, [`GroupState::finish_inline`] notes the peers an inline work heard from:
/// a silence timer counts in heartbeat intervals, seconds, and reads a peer's time only when it
/// fires.
pub const INLINE_HEARD_EVERY: Duration = Duration::from_micros(100);

/// Desync censuses open at once; older ones are dropped.
const CENSUSES_KEPT: usize = 8;

/// How long a desync census waits for votes before deciding with those it has (every live
/// peer answers at once, so this is a bound for dead or partitioned ones). Capped at a
/// quarter of the work's timeout.
const CENSUS_WINDOW: Duration = Duration::from_millis(500);

/// What the group does after a work fails, mirroring `TORCH_NCCL_ASYNC_ERROR_HANDLING`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ErrorHandling {
    /// 0: only the failed work (and works needing a lost peer) fail; the group goes on.
    NoHandling,
    /// 1: fail the group (every in-flight work fails, later submits are refused), then ask the
    /// driver to tear the process down ([`Event::TearDown`]).
    TearDown,
    /// 2: fail the group and clean up (the driver aborts its connections); the process lives.
    #[default]
    CleanUpOnly,
    /// 3: ask the driver to tear the process down without cleaning up ([`Event::TearDown`]).
    SkipCleanUp,
}

impl ErrorHandling {
    /// From the numeric value of `TORCH_NCCL_ASYNC_ERROR_HANDLING` / `COHORT_ASYNC_ERROR_HANDLING`.
    pub fn from_level(level: u8) -> Option<Self> {
        Some(match level {
            0 => ErrorHandling::NoHandling,
            1 => ErrorHandling::TearDown,
            2 => ErrorHandling::CleanUpOnly,
            3 => ErrorHandling::SkipCleanUp,
            _ => return None,
        })
    }

    fn fails_group(self) -> bool {
        self != ErrorHandling::NoHandling
    }

    fn tears_down(self) -> bool {
        matches!(self, ErrorHandling::TearDown | ErrorHandling::SkipCleanUp)
    }
}

/// Peer heartbeats: catch a peer that went silent (a hung host, a cut link) before the
/// collective timeout. A peer that is alive but never calls the collective keeps sending
/// heartbeats; the work deadline catches that one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatConfig {
    /// How often to send a heartbeat to every peer.
    pub interval: Duration,
    /// A peer silent for this long is declared lost.
    pub dead_after: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        HeartbeatConfig { interval: Duration::from_secs(1), dead_after: Duration::from_secs(10) }
    }
}

/// Configuration of one rank's [`GroupState`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupConfig {
    /// The group's id (0 for the default group).
    pub group_id: GroupId,
    /// The group's name (c10d's pg name).
    pub name: String,
    /// A description (c10d's pg desc, e.g. "default_pg").
    pub desc: String,
    /// Number of ranks in the group.
    pub world_size: u32,
    /// Default timeout of every work (Gloo's 30 minutes unless set).
    pub timeout: Duration,
    /// What to do after a failure.
    pub error_handling: ErrorHandling,
    /// Peer heartbeats; `None` turns them off.
    pub heartbeat: Option<HeartbeatConfig>,
    /// Works the data plane may run at once; later ones wait in issue order.
    pub max_in_flight: usize,
    /// The flight recorder's ring size and timing.
    pub recorder: RecorderConfig,
    /// The backend's name in the recorder's profiling names (`tcp:all_reduce`).
    pub backend: String,
    /// Unix time in nanoseconds at the group's epoch, read by the caller at the same moment as
    /// the `now` given to [`GroupState::new`]: the recorder's wall-clock anchor.
    pub wall_epoch_ns: u64,
    /// Peers connect lazily, on first use: a peer's silence is watched, and heartbeats are
    /// sent to it, only once [`GroupState::handle_peer_connected`] says it is connected. When
    /// false (the default) every peer is connected from the start.
    pub lazy_peers: bool,
    /// Whether a collective that finds a mismatch or times out first asks every rank what it
    /// runs there (the desync census, through [`ControlMsg::Census`]), to blame the deviants
    /// rather than the rank that noticed. Needs control messages between peers; a driver
    /// without them (NCCL's, which talks only through the store) turns it off. Default on.
    pub desync_census: bool,
}

impl GroupConfig {
    /// A default-group configuration for `world_size` ranks.
    pub fn new(world_size: u32) -> Self {
        GroupConfig {
            group_id: GroupId(0),
            name: "0".into(),
            desc: "default_pg".into(),
            world_size,
            timeout: DEFAULT_TIMEOUT,
            error_handling: ErrorHandling::default(),
            heartbeat: Some(HeartbeatConfig::default()),
            max_in_flight: 64,
            recorder: RecorderConfig::default(),
            backend: "cohort".into(),
            wall_epoch_ns: 0,
            lazy_peers: false,
            desync_census: true,
        }
    }
}

/// Shape and dtype of one tensor argument.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// The dtype.
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A spec.
    pub fn new(dtype: DType, shape: &[usize]) -> Self {
        TensorSpec { dtype, shape: shape.to_vec() }
    }

    /// Number of elements (saturating on overflow).
    pub fn numel(&self) -> usize {
        numel_of(&self.shape).unwrap_or(usize::MAX)
    }
}

impl crate::recorder::TensorShape for TensorSpec {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// One work to run: what the user asked for, minus the data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Collective {
    /// The op.
    pub op: OpType,
    /// Input tensors.
    pub inputs: Vec<TensorSpec>,
    /// Output tensors.
    pub outputs: Vec<TensorSpec>,
    /// Root rank (broadcast, reduce, gather, scatter).
    pub root: Option<Rank>,
    /// Peer rank (send, recv).
    pub peer: Option<Rank>,
    /// Tag (send, recv).
    pub tag: u32,
    /// Elements per peer for `alltoall_base` with uneven splits: (input, output).
    pub splits: Option<(Vec<usize>, Vec<usize>)>,
    /// Overrides the group's timeout for this work.
    pub timeout: Option<Duration>,
}

impl Collective {
    /// A work of `op` with no tensors yet.
    pub fn new(op: OpType) -> Self {
        Collective {
            op,
            inputs: Vec::new(),
            outputs: Vec::new(),
            root: None,
            peer: None,
            tag: 0,
            splits: None,
            timeout: None,
        }
    }

    /// Builder: inputs.
    pub fn inputs(mut self, inputs: Vec<TensorSpec>) -> Self {
        self.inputs = inputs;
        self
    }

    /// Builder: outputs.
    pub fn outputs(mut self, outputs: Vec<TensorSpec>) -> Self {
        self.outputs = outputs;
        self
    }

    /// Builder: root.
    pub fn root(mut self, root: Rank) -> Self {
        self.root = Some(root);
        self
    }

    /// Builder: peer and tag.
    pub fn peer(mut self, peer: Rank, tag: u32) -> Self {
        self.peer = Some(peer);
        self.tag = tag;
        self
    }

    /// Builder: timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Total input elements.
    pub fn numel_in(&self) -> usize {
        self.inputs.iter().map(TensorSpec::numel).fold(0, usize::saturating_add)
    }

    /// Total output elements (in-place ops, which have no outputs, count their inputs).
    pub fn numel_out(&self) -> usize {
        if self.outputs.is_empty() {
            return self.numel_in();
        }
        self.outputs.iter().map(TensorSpec::numel).fold(0, usize::saturating_add)
    }

    /// The ranks of a `world_size`-rank group this work cannot complete without (other than
    /// `me`, for a collective), ascending: those [`Collective::needs_peer`] names.
    pub fn peers_needed(&self, me: Rank, world_size: u32) -> Vec<Rank> {
        (0..world_size).map(Rank).filter(|&r| self.needs_peer(me, r)).collect()
    }

    /// Whether this work cannot complete without `rank`.
    pub fn needs_peer(&self, me: Rank, rank: Rank) -> bool {
        match self.op {
            OpType::Send | OpType::Recv => self.peer == Some(rank),
            OpType::RecvAnySource => false,
            _ => rank != me,
        }
    }

    /// Check the arguments as Gloo does, before anything is sent.
    pub fn validate(&self, me: Rank, world_size: u32) -> Result<(), SubmitError> {
        let op = self.op;
        let n = world_size as usize;
        let bad = |arg: &'static str, reason: String| Err(SubmitError::InvalidArgument { op, arg, reason });
        if let Some(root) = self.root
            && root.0 >= world_size
        {
            return Err(SubmitError::InvalidRoot { op, root, world_size });
        }
        let needs_root = matches!(op, OpType::Broadcast | OpType::Reduce | OpType::Gather | OpType::Scatter);
        if needs_root && self.root.is_none() {
            return bad("root", "a root rank is required".into());
        }
        let is_root = self.root == Some(me);
        match op {
            OpType::Send | OpType::Recv => {
                let Some(peer) = self.peer else {
                    return bad("peer", "a peer rank is required".into());
                };
                if peer.0 >= world_size {
                    return Err(SubmitError::InvalidPeer { op, peer, world_size });
                }
                if peer == me {
                    return bad("peer", format!("rank {peer} is this rank; send and recv need another rank"));
                }
            }
            OpType::RecvAnySource => {}
            _ => {}
        }
        let same_dtype = |list: &[TensorSpec], arg: &'static str| -> Result<(), SubmitError> {
            if let Some(first) = list.first()
                && let Some((i, t)) = list.iter().enumerate().find(|(_, t)| t.dtype != first.dtype)
            {
                return bad(arg, format!("tensor {i} has dtype {}, tensor 0 has {}", t.dtype, first.dtype));
            }
            Ok(())
        };
        let same_numel = |list: &[TensorSpec], numel: usize, arg: &'static str| -> Result<(), SubmitError> {
            if let Some((i, t)) = list.iter().enumerate().find(|(_, t)| t.numel() != numel) {
                return bad(arg, format!("tensor {i} has {} elements, expected {numel}", t.numel()));
            }
            Ok(())
        };
        let count = |list: &[TensorSpec], want: usize, arg: &'static str| -> Result<(), SubmitError> {
            if list.len() != want {
                return bad(arg, format!("expected {want} tensors (one per rank), got {}", list.len()));
            }
            Ok(())
        };
        let input_dtype = self.inputs.first().map(|t| t.dtype);
        let outputs_match_input_dtype = |list: &[TensorSpec], arg: &'static str| -> Result<(), SubmitError> {
            if let (Some(d), Some((i, t))) =
                (input_dtype, list.iter().enumerate().find(|(_, t)| Some(t.dtype) != input_dtype))
            {
                return bad(arg, format!("tensor {i} has dtype {}, the input has {d}", t.dtype));
            }
            Ok(())
        };
        match op {
            OpType::Barrier | OpType::MonitoredBarrier => Ok(()),
            OpType::Allreduce
            | OpType::Broadcast
            | OpType::Reduce
            | OpType::Send
            | OpType::Recv
            | OpType::RecvAnySource => {
                if self.inputs.is_empty() {
                    return bad("tensors", "requires at least one tensor".into());
                }
                same_dtype(&self.inputs, "tensors")?;
                same_numel(&self.inputs, self.inputs[0].numel(), "tensors")
            }
            OpType::AllreduceCoalesced | OpType::AllgatherCoalesced => {
                if self.inputs.is_empty() {
                    return bad("tensors", "requires at least one tensor".into());
                }
                same_dtype(&self.inputs, "tensors")
            }
            OpType::AllreduceSparse => {
                if self.inputs.len() != 2 {
                    return bad("tensors", format!("expected indices and values, got {} tensors", self.inputs.len()));
                }
                Ok(())
            }
            OpType::Allgather => {
                if self.inputs.len() != 1 {
                    return bad("input_tensor", format!("requires a single input tensor, got {}", self.inputs.len()));
                }
                count(&self.outputs, n, "output_tensor_list")?;
                outputs_match_input_dtype(&self.outputs, "output_tensor_list")?;
                same_numel(&self.outputs, self.inputs[0].numel(), "output_tensor_list")
            }
            OpType::AllgatherIntoTensor => {
                let (Some(i), Some(o)) = (self.inputs.first(), self.outputs.first()) else {
                    return bad("tensors", "requires one input and one output tensor".into());
                };
                outputs_match_input_dtype(&self.outputs, "output_tensor")?;
                if o.numel() != i.numel().saturating_mul(n) {
                    return bad(
                        "output_tensor",
                        format!(
                            "has {} elements, expected world size {n} × input {} = {}",
                            o.numel(),
                            i.numel(),
                            i.numel().saturating_mul(n)
                        ),
                    );
                }
                Ok(())
            }
            OpType::ReduceScatter => {
                if self.outputs.len() != 1 {
                    return bad("output", format!("requires a single output tensor, got {}", self.outputs.len()));
                }
                count(&self.inputs, n, "input_list")?;
                same_dtype(&self.inputs, "input_list")?;
                same_numel(&self.inputs, self.outputs[0].numel(), "input_list")
            }
            OpType::ReduceScatterTensor => {
                let (Some(i), Some(o)) = (self.inputs.first(), self.outputs.first()) else {
                    return bad("tensors", "requires one input and one output tensor".into());
                };
                outputs_match_input_dtype(&self.outputs, "output")?;
                if i.numel() != o.numel().saturating_mul(n) {
                    return bad(
                        "input",
                        format!(
                            "has {} elements, expected world size {n} × output {} = {}",
                            i.numel(),
                            o.numel(),
                            o.numel().saturating_mul(n)
                        ),
                    );
                }
                Ok(())
            }
            OpType::Gather => {
                if self.inputs.len() != 1 {
                    return bad("tensor", format!("requires a single input tensor, got {}", self.inputs.len()));
                }
                if is_root {
                    count(&self.outputs, n, "gather_list")?;
                    outputs_match_input_dtype(&self.outputs, "gather_list")?;
                    same_numel(&self.outputs, self.inputs[0].numel(), "gather_list")
                } else if !self.outputs.is_empty() {
                    bad("gather_list", "must be empty on non-root ranks".into())
                } else {
                    Ok(())
                }
            }
            OpType::Scatter => {
                if self.outputs.len() != 1 {
                    return bad("tensor", format!("requires a single output tensor, got {}", self.outputs.len()));
                }
                if is_root {
                    count(&self.inputs, n, "scatter_list")?;
                    same_dtype(&self.inputs, "scatter_list")?;
                    same_numel(&self.inputs, self.outputs[0].numel(), "scatter_list")
                } else if !self.inputs.is_empty() {
                    bad("scatter_list", "must be empty on non-root ranks".into())
                } else {
                    Ok(())
                }
            }
            OpType::Alltoall => {
                count(&self.inputs, n, "input_tensor_list")?;
                count(&self.outputs, n, "output_tensor_list")?;
                same_dtype(&self.inputs, "input_tensor_list")?;
                outputs_match_input_dtype(&self.outputs, "output_tensor_list")
            }
            OpType::AlltoallBase => {
                let (Some(i), Some(o)) = (self.inputs.first(), self.outputs.first()) else {
                    return bad("tensors", "requires one input and one output tensor".into());
                };
                outputs_match_input_dtype(&self.outputs, "output")?;
                match &self.splits {
                    None => {
                        if i.numel() % n != 0 || o.numel() % n != 0 {
                            return bad(
                                "input",
                                format!(
                                    "without splits, input ({}) and output ({}) elements must divide by world size {n}",
                                    i.numel(),
                                    o.numel()
                                ),
                            );
                        }
                        Ok(())
                    }
                    Some((ins, outs)) => {
                        count_splits(op, ins, n, i.numel(), "input_split_sizes")?;
                        count_splits(op, outs, n, o.numel(), "output_split_sizes")
                    }
                }
            }
        }
    }
}

/// A collective whose arguments passed [`Collective::validate`] for one rank of one group size.
/// A caller that submits the same description again and again (a loop of one small allreduce,
/// [`GroupState::submit_inline`]) keeps it checked, and the group does not check it again, nor
/// look up what its flight-recorder entry says ([`FlightRecorder::record_again`]).
#[derive(Debug, Clone)]
pub struct Checked {
    collective: Collective,
    rank: Rank,
    world_size: u32,
    /// Which checked description this is: made once per [`Checked::new`] and kept by its
    /// clones, which describe the same collective (nothing changes one once made).
    id: u64,
    /// Its desync signature, made once for all its works.
    signature: Signature,
}

impl PartialEq for Checked {
    fn eq(&self, other: &Self) -> bool {
        (&self.collective, self.rank, self.world_size) == (&other.collective, other.rank, other.world_size)
    }
}

impl Checked {
    /// `collective`, checked for rank `me` of a group of `world_size`.
    pub fn new(collective: Collective, me: Rank, world_size: u32) -> Result<Checked, SubmitError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        collective.validate(me, world_size)?;
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let signature = Signature::of(&collective);
        Ok(Checked { collective, rank: me, world_size, id, signature })
    }

    /// The collective.
    pub fn collective(&self) -> &Collective {
        &self.collective
    }

    /// The collective, to submit the usual way.
    pub fn into_inner(self) -> Collective {
        self.collective
    }
}

fn count_splits(op: OpType, splits: &[usize], n: usize, numel: usize, arg: &'static str) -> Result<(), SubmitError> {
    if splits.len() != n {
        return Err(SubmitError::InvalidArgument {
            op,
            arg,
            reason: format!("expected {n} split sizes (one per rank), got {}", splits.len()),
        });
    }
    let total = splits.iter().fold(0usize, |a, &b| a.saturating_add(b));
    if total != numel {
        return Err(SubmitError::InvalidArgument {
            op,
            arg,
            reason: format!("split sizes sum to {total}, the tensor has {numel} elements"),
        });
    }
    Ok(())
}

/// Why a submit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The group was aborted.
    #[error("process group was aborted: {cause}")]
    Aborted {
        /// Why it was aborted.
        cause: String,
    },
    /// The group failed earlier; this is the original cause.
    #[error("process group failed earlier: {}", .cause.message)]
    GroupFailed {
        /// The first failure.
        cause: GroupFailure,
    },
    /// A peer this work needs is gone.
    #[error("{op}: rank {rank} is gone: {reason}")]
    PeerLost {
        /// The op.
        op: OpType,
        /// The lost rank.
        rank: Rank,
        /// Why it is gone.
        reason: String,
    },
    /// Root outside the group.
    #[error("{op}: invalid root rank {root}: the group has world size {world_size}")]
    InvalidRoot {
        /// The op.
        op: OpType,
        /// The root given.
        root: Rank,
        /// The group's size.
        world_size: u32,
    },
    /// Peer outside the group.
    #[error("{op}: invalid peer rank {peer}: the group has world size {world_size}")]
    InvalidPeer {
        /// The op.
        op: OpType,
        /// The peer given.
        peer: Rank,
        /// The group's size.
        world_size: u32,
    },
    /// Some other argument is wrong.
    #[error("{op}: invalid argument {arg}: {reason}")]
    InvalidArgument {
        /// The op.
        op: OpType,
        /// The argument's name, as torch.distributed calls it.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// The first failure of a group, which every later submit is refused with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupFailure {
    /// The rank that detected or suffered the failure first (this rank, or a remote one).
    pub origin: Rank,
    /// Whom it blames (the lost, silent, missing or deviant rank; a cut; or undecided).
    pub blame: Blame,
    /// The work on which it happened, when there was one.
    pub seq: Option<SeqNo>,
    /// What happened.
    pub message: String,
}

impl GroupFailure {
    /// The one rank it blames, if exactly one (see [`Blame::culprit`]).
    pub fn culprit(&self) -> Option<Rank> {
        self.blame.culprit()
    }
}

/// A work the data plane may start now.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// Its id.
    pub id: WorkId,
    /// Its sequence number (collective or p2p, see [`Launch::is_p2p`]).
    pub seq: SeqNo,
    /// Whether `seq` counts point-to-point ops.
    pub is_p2p: bool,
    /// The op. What to run is what the driver submitted under this id: the core does not copy
    /// the arguments back out.
    pub op: OpType,
}

/// Control messages a rank sends to peers (the TCP backend frames them; see `protocol`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlMsg {
    /// I am alive.
    Heartbeat,
    /// A group failed; this is the cause. Relayed by every rank that hears it, so `origin`
    /// is the rank that failed first, not necessarily the sender.
    Error {
        /// The rank that failed first.
        origin: Rank,
        /// Whom it blames.
        blame: Blame,
        /// The cause.
        message: String,
    },
    /// The desync census: at collective `seq` I run `sig` (`None`: I have not reached it).
    /// A rank that hears one for a collective it has not voted on answers with its own, to
    /// every peer.
    Census {
        /// The collective.
        seq: SeqNo,
        /// What this rank runs there.
        sig: Option<Signature>,
    },
    /// I aborted the group.
    Abort {
        /// Why.
        reason: String,
    },
    /// My collective `seq` has run half its timeout and still waits for these ranks' parts.
    Stuck {
        /// The collective.
        seq: SeqNo,
        /// The ranks it waits for.
        waiting_on: Vec<Rank>,
    },
}

/// A control message for one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The peer.
    pub to: Rank,
    /// The message.
    pub msg: ControlMsg,
}

/// What the data plane says about a work it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The data arrived and the result is in place.
    Success,
    /// It failed; `rank` is the peer responsible when known (undecided otherwise, with the
    /// ranks the work waited for as suspects).
    Failed {
        /// The peer at fault.
        rank: Option<Rank>,
        /// What happened.
        message: String,
    },
    /// Peer `rank`'s part does not fit this rank's collective (another op, dtype, root or
    /// size). The core does not blame `rank` yet: it runs a desync census and blames the
    /// ranks that disagree with the majority.
    Mismatch {
        /// The peer whose part did not fit.
        rank: Rank,
        /// What did not fit.
        message: String,
    },
}

/// A finished work, as the user sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkSummary {
    /// Its id.
    pub id: WorkId,
    /// Its sequence number.
    pub seq: SeqNo,
    /// Whether `seq` counts point-to-point ops.
    pub is_p2p: bool,
    /// The op.
    pub op: OpType,
    /// How it ended.
    pub result: WorkResult,
    /// Its state and times.
    pub lifecycle: Lifecycle,
}

/// What the user (through the driver) sees.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A work ended (exactly once per work, in issue order).
    WorkFinished(WorkSummary),
    /// A peer left cleanly (it said goodbye). Informational: works that still needed it are
    /// failed by the data plane.
    PeerDeparted {
        /// The peer.
        rank: Rank,
    },
    /// A peer is gone (its connection dropped or it went silent).
    PeerLost {
        /// The peer.
        rank: Rank,
        /// Why.
        reason: String,
    },
    /// The group failed; later submits are refused with this cause. The driver cleans up
    /// (aborts connections) and publishes the cause through the store.
    GroupFailed(GroupFailure),
    /// The group was aborted.
    GroupAborted {
        /// Why.
        reason: String,
    },
    /// [`ErrorHandling`] asks the driver to end the process (after dumping the flight recorder).
    TearDown {
        /// Why.
        cause: String,
    },
}

#[derive(Debug)]
struct WorkEntry {
    seq: SeqNo,
    is_p2p: bool,
    collective: Collective,
    lifecycle: Lifecycle,
    timeout: Duration,
    launched: bool,
    waiting_on: Option<Vec<Rank>>,
    /// The ranks its stuck note named, once it was sent (half its timeout).
    stuck_on: Option<Vec<Rank>>,
    /// The result, once known; the work finishes when every earlier work has.
    result: Option<WorkResult>,
    /// Its flight-recorder entry.
    record: Option<RecordId>,
}

/// What [`GroupState::admit`] gave a new work.
struct Admitted {
    id: WorkId,
    seq: SeqNo,
    timeout: Duration,
    record: Option<RecordId>,
}

/// How [`GroupState::submit_inline`] took a collective.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // moved once a call: a box would cost the allocation this path saves
pub enum Inline<T = ()> {
    /// Started, and with the caller: end it with [`GroupState::finish_inline`] or
    /// [`GroupState::adopt_inline`] before the group's next input. With it, what the
    /// submit's `first` gave.
    Running(InlineWork, T),
    /// Not taken: the group is busy or not healthy, or the op is point-to-point. Submit the
    /// collective with [`GroupState::submit`].
    Busy,
}

/// A time given to the core's inline works ([`GroupState::submit_inline`],
/// [`GroupState::finish_inline`]): an [`Instant`], or a time already counted from the group's
/// epoch ([`SinceEpoch`]) by a caller that keeps its own clock, which the core would only
/// count again.
pub trait Moment {
    /// The time, counted from `epoch` (zero for a time before it).
    fn since(self, epoch: Instant) -> Duration;
}

impl Moment for Instant {
    #[inline]
    fn since(self, epoch: Instant) -> Duration {
        self.saturating_duration_since(epoch)
    }
}

/// A time counted from the group's epoch ([`GroupState::epoch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SinceEpoch(pub Duration);

impl Moment for SinceEpoch {
    #[inline]
    fn since(self, _: Instant) -> Duration {
        self.0
    }
}

/// A started collective that the caller runs to its end itself ([`GroupState::submit_inline`]);
/// inside the group, also a new work's parts on their way into the table.
#[derive(Debug)]
#[must_use = "an inline work ends in GroupState::finish_inline or GroupState::adopt_inline"]
pub struct InlineWork {
    id: WorkId,
    seq: SeqNo,
    op: OpType,
    lifecycle: Lifecycle,
    timeout: Duration,
    record: Option<RecordId>,
}

impl InlineWork {
    /// Its id.
    pub fn id(&self) -> WorkId {
        self.id
    }

    /// Its sequence number.
    pub fn seq(&self) -> SeqNo {
        self.seq
    }

    /// When it was submitted, after the group's epoch ([`GroupState::epoch`]).
    pub fn submitted(&self) -> Duration {
        self.lifecycle.enqueued_at()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Healthy,
    Failed(GroupFailure),
    Aborted(String),
}

/// One rank's state machine for one process group. See the [module docs](self) for the
/// calling contract.
#[derive(Debug)]
pub struct GroupState {
    cfg: GroupConfig,
    rank: Rank,
    epoch: Instant,
    next_work: u64,
    seq: SeqNo,
    p2p_seq: SeqNo,
    works: SeqMap<WorkId, WorkEntry>,
    to_launch: VecDeque<WorkId>,
    running: usize,
    timers: TimerTable,
    last_timeout_reason: Option<TimerKind>,
    recorder: FlightRecorder,
    lost: BTreeMap<Rank, String>,
    /// Lost peers that said goodbye: what they sent before leaving may still be received.
    departed: std::collections::BTreeSet<Rank>,
    /// Peers connected so far ([`GroupConfig::lazy_peers`]; every peer otherwise), with when
    /// each was last heard from (frames or heartbeats), since the epoch; read when its silence
    /// timer fires. Only connected peers have an entry, so a rank keeps nothing, and loops over
    /// nothing, for peers it never talks to.
    connected: BTreeMap<Rank, Duration>,
    /// Each peer's stuck notes, by the collective it was stuck in: whom it waited for. Kept per
    /// collective, not just the latest: with several collectives in flight (DDP's buckets) a
    /// peer sends a note for each, and the chain of collective `seq` must read the note for
    /// `seq`, not one for a later bucket. At most [`STUCK_NOTES_PER_PEER`] per peer.
    peer_stuck: BTreeMap<Rank, BTreeMap<SeqNo, Vec<Rank>>>,
    health: Health,
    transmits: VecDeque<Transmit>,
    launches: VecDeque<Launch>,
    events: VecDeque<Event>,
    /// When [`GroupState::finish_inline`] last noted the peers it heard from.
    inline_heard: Option<Duration>,
    /// The last inline work's description ([`Checked`]'s id) and flight-recorder entry: the
    /// next work of that description is recorded like it ([`FlightRecorder::record_again`]).
    inline_record: Option<(u64, RecordId)>,
    /// The last profiling name formatted for the recorder (its allocation is reused).
    name_buf: String,
    /// The recorder's id of each collective's profiling name (`backend:op`), interned on first
    /// use: recording a collective neither formats nor hashes its name.
    collective_names: Vec<(OpType, NameId)>,
    /// The signatures of the last [`SIGNATURES_KEPT`] collectives, for desync censuses.
    signatures: VecDeque<(SeqNo, Signature)>,
    /// Open desync censuses, by collective.
    censuses: BTreeMap<SeqNo, Census>,
}

/// One desync census as this rank sees it.
#[derive(Debug, Default)]
struct Census {
    votes: Votes,
    /// Whether this rank has sent its own vote.
    voted: bool,
    /// The work this rank holds until the verdict, and why.
    held: Option<(WorkId, Held)>,
}

/// Why a work waits for a census's verdict.
#[derive(Debug, Clone)]
enum Held {
    /// Peer `from`'s part did not fit (`detail` says how).
    Mismatch { from: Rank, detail: String },
    /// It timed out; without a desync it ends with this message and blame.
    Timeout { message: String, blame: Blame },
}

impl GroupState {
    /// Rank `rank`'s state for the group `cfg` describes; `now` is the group's epoch.
    ///
    /// Panics if `rank` is outside the group: that is the caller's bug, not a peer's input.
    pub fn new(cfg: GroupConfig, rank: Rank, now: Instant) -> Self {
        assert!(rank.0 < cfg.world_size, "rank {rank} outside world size {}", cfg.world_size);
        let mut recorder = FlightRecorder::new(cfg.recorder, cfg.wall_epoch_ns);
        let ranks: Vec<u64> = (0..u64::from(cfg.world_size)).collect();
        recorder.record_group(u64::from(cfg.group_id.0), &cfg.name, &cfg.desc, &ranks);
        let mut g = GroupState {
            recorder,
            rank,
            epoch: now,
            next_work: 1,
            seq: SeqNo(0),
            p2p_seq: SeqNo(0),
            works: SeqMap::new(),
            to_launch: VecDeque::new(),
            running: 0,
            timers: TimerTable::new(),
            last_timeout_reason: None,
            lost: BTreeMap::new(),
            departed: std::collections::BTreeSet::new(),
            connected: BTreeMap::new(),
            peer_stuck: BTreeMap::new(),
            health: Health::Healthy,
            transmits: VecDeque::new(),
            launches: VecDeque::new(),
            events: VecDeque::new(),
            inline_heard: None,
            inline_record: None,
            name_buf: String::new(),
            collective_names: Vec::new(),
            signatures: VecDeque::new(),
            censuses: BTreeMap::new(),
            cfg,
        };
        if !g.cfg.lazy_peers {
            g.connected = g.peers().into_iter().map(|r| (r, Duration::ZERO)).collect();
        }
        if let Some(hb) = g.cfg.heartbeat
            && g.cfg.world_size > 1
        {
            g.timers.set(TimerKind::Heartbeat, Duration::ZERO);
            for peer in g.connected.keys().copied().collect::<Vec<_>>() {
                g.timers.set(TimerKind::PeerSilence(peer), hb.dead_after);
            }
        }
        g
    }

    /// The configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The group's epoch (the `now` given to [`GroupState::new`]).
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// The last collective sequence number handed out (0 before the first).
    pub fn seq(&self) -> SeqNo {
        self.seq
    }

    /// The last point-to-point sequence number handed out.
    pub fn p2p_seq(&self) -> SeqNo {
        self.p2p_seq
    }

    /// The group's first failure, if it failed.
    pub fn failure(&self) -> Option<&GroupFailure> {
        match &self.health {
            Health::Failed(f) => Some(f),
            _ => None,
        }
    }

    /// Whether the group was aborted.
    pub fn is_aborted(&self) -> bool {
        matches!(self.health, Health::Aborted(_))
    }

    /// The state of a work that has not finished yet (`None` once it has: its summary was in
    /// the [`Event::WorkFinished`]).
    pub fn work_state(&self, id: WorkId) -> Option<WorkState> {
        self.works.get(&id).map(|w| w.lifecycle.state())
    }

    /// Works not yet finished.
    pub fn in_flight(&self) -> usize {
        self.works.len()
    }

    /// The oldest work not yet finished, as a report on a stuck rank names it: its sequence
    /// number (the p2p counter's for a point-to-point op), its op, how long ago (before `now`)
    /// it was submitted, and the ranks it was last reported waiting for
    /// ([`GroupState::handle_waiting_on`]; `None` if the data plane never said). Works finish in
    /// submission order, so every later work waits behind this one. Read-only.
    pub fn oldest_unfinished(&self, now: Instant) -> Option<(SeqNo, OpType, Duration, Option<&[Rank]>)> {
        let (_, w) = self.works.first()?;
        let age = self.since_epoch(now).saturating_sub(w.lifecycle.enqueued_at());
        Some((w.seq, w.collective.op, age, w.waiting_on.as_deref()))
    }

    /// Peers declared lost, with the reason.
    pub fn lost_peers(&self) -> &BTreeMap<Rank, String> {
        &self.lost
    }

    /// Submit a work. Checks the arguments and the group's health, assigns the next sequence
    /// number and a deadline. May queue a [`Launch`].
    pub fn submit(&mut self, now: Instant, collective: Collective) -> Result<WorkId, SubmitError> {
        let now = self.since_epoch(now);
        let Admitted { id, seq, timeout, record } = self.admit(now, &collective)?;
        let lifecycle = Lifecycle::new(now);
        self.enter(now, InlineWork { id, seq, op: collective.op, lifecycle, timeout, record }, collective);
        self.to_launch.push_back(id);
        self.launch_ready();
        Ok(id)
    }

    /// Submit a collective that the caller will run to its end at once, before its next input
    /// to this group, if the group is idle (nothing in flight, nothing to launch) and healthy:
    /// it starts now and stays with the caller ([`Inline::Running`]), outside the group's table
    /// of works, until [`GroupState::finish_inline`] ends it or [`GroupState::adopt_inline`]
    /// gives it the usual entry. Otherwise ([`Inline::Busy`]) nothing happens, and the caller
    /// submits it with [`GroupState::submit`]. The caller keeps the collective: the inline work
    /// needs it back only if it is adopted.
    ///
    /// What every work gets it gets here too: the checks, the sequence number, the
    /// flight-recorder entry and the desync signature. A work that ends within its submit call
    /// has no use for the rest of an entry (deadline and stuck timers, the launch queue, the
    /// table's entry and the finished event), which is most of the core's cost for a small
    /// collective (`docs/performance.md`). No input can reach the group while the caller holds
    /// the work, so nothing can see it missing from the table.
    ///
    /// `first(id, seq)` runs once the work has passed its checks and has its numbers, before its
    /// flight-recorder entry and desync signature are written, and its result comes back with
    /// the work: the caller sends the collective's first frame there, so that this bookkeeping
    /// overlaps the frame's way to the peer. Nobody can see the entry missing meanwhile, since
    /// the caller holds the state throughout. It does not run for a work the group refuses or
    /// does not take.
    pub fn submit_inline<T>(
        &mut self,
        now: impl Moment,
        checked: &Checked,
        first: impl FnOnce(WorkId, SeqNo) -> T,
    ) -> Result<Inline<T>, SubmitError> {
        let collective = &checked.collective;
        let idle = self.works.is_empty() && self.launches.is_empty() && self.running == 0;
        if !idle || collective.op.is_p2p() || !matches!(self.health, Health::Healthy) {
            return Ok(Inline::Busy);
        }
        let now = now.since(self.epoch);
        // Checked for this rank and size already: not again (a description checked for
        // another group is).
        let already = checked.rank == self.rank && checked.world_size == self.cfg.world_size;
        let (id, seq, timeout) = self.admit_checks(now, collective, already)?;
        let sent = first(id, seq);
        // Recorded as started: it starts now. A work of the description the last inline work
        // had is recorded like that one was, without looking up its group, name and tensors.
        let again = match self.inline_record {
            Some((desc, like)) if desc == checked.id => {
                let numbers =
                    RecordNumbers { collective_seq_id: seq.0, p2p_seq_id: self.p2p_seq.0, op_id: self.next_work - 1 };
                self.recorder.record_again(now, like, numbers, timeout)
            }
            _ => None,
        };
        let record = match again {
            Some(record) => {
                self.note_signature(seq, checked.signature);
                Some(record)
            }
            None => self.admit_record(now, collective, seq, timeout, true),
        };
        self.inline_record = record.map(|record| (checked.id, record));
        let mut lifecycle = Lifecycle::new(now);
        lifecycle.start(now).expect("a new work can always start");
        Ok(Inline::Running(InlineWork { id, seq, op: collective.op, lifecycle, timeout, record }, sent))
    }

    /// Inline work `work` succeeded, having heard from the ranks `heard_from` (as
    /// [`GroupState::handle_peer_activity`] for each): it finishes as a work leaving the table
    /// finishes (its flight-recorder entry completes), and its summary is returned rather than
    /// queued as an [`Event::WorkFinished`].
    ///
    /// A peer's last-heard time is read only when its silence timer fires, after a heartbeat
    /// interval: an inline work that ends within [`INLINE_HEARD_EVERY`] of the last one that
    /// noted its peers leaves them as that one did, rather than looking each up at every small
    /// collective.
    pub fn finish_inline(
        &mut self,
        now: impl Moment,
        work: InlineWork,
        heard_from: impl IntoIterator<Item = Rank>,
    ) -> WorkSummary {
        let now = now.since(self.epoch);
        if self.inline_heard.is_none_or(|t| now >= t.saturating_add(INLINE_HEARD_EVERY)) {
            self.inline_heard = Some(now);
            for from in heard_from {
                self.peer_heard(now, from);
            }
        }
        let InlineWork { id, seq, op, mut lifecycle, record, .. } = work;
        let result = WorkResult::Success;
        lifecycle.finish(now, result.terminal_state()).expect("a started work can finish");
        if let Some(rid) = record {
            self.recorder.handle_finished(rid, now, &result);
        }
        WorkSummary { id, seq, is_p2p: false, op, result, lifecycle }
    }

    /// Inline work `work` (of `collective`, the one it was submitted for) does not end at once
    /// after all: it takes the entry a submitted and started work has, its deadline counted
    /// from its submission, and goes on as any other (its completion comes by
    /// [`GroupState::handle_completion`]).
    pub fn adopt_inline(&mut self, work: InlineWork, collective: Collective) {
        let id = work.id;
        self.enter(work.lifecycle.enqueued_at(), work, collective);
        if let Some(w) = self.works.get_mut(&id) {
            w.launched = true;
            self.running += 1;
        }
    }

    /// The checks, sequence number, flight-recorder entry and desync signature of a new work.
    fn admit(&mut self, now: Duration, collective: &Collective) -> Result<Admitted, SubmitError> {
        let (id, seq, timeout) = self.admit_checks(now, collective, false)?;
        let record = self.admit_record(now, collective, seq, timeout, false);
        Ok(Admitted { id, seq, timeout, record })
    }

    /// [`GroupState::admit`]'s first half: the checks, then the work's id, sequence number and
    /// timeout. A collective already `checked` for this rank and group size is not validated
    /// again. Inlined: a small collective's submit calls it at every work.
    #[inline]
    fn admit_checks(
        &mut self,
        now: Duration,
        collective: &Collective,
        checked: bool,
    ) -> Result<(WorkId, SeqNo, Duration), SubmitError> {
        match &self.health {
            Health::Healthy => {}
            Health::Failed(cause) => {
                let cause = cause.clone();
                self.record_refused(now, collective, &cause);
                return Err(SubmitError::GroupFailed { cause });
            }
            Health::Aborted(cause) => return Err(SubmitError::Aborted { cause: cause.clone() }),
        }
        if !checked {
            collective.validate(self.rank, self.cfg.world_size)?;
        }
        if let Some((&rank, _)) = self.lost.iter().find(|(r, _)| collective.needs_peer(self.rank, **r)) {
            return Err(SubmitError::PeerLost { op: collective.op, rank, reason: self.lost[&rank].clone() });
        }
        let seq = if collective.op.is_p2p() {
            self.p2p_seq.0 += 1;
            self.p2p_seq
        } else {
            self.seq.0 += 1;
            self.seq
        };
        let id = WorkId(self.next_work);
        self.next_work += 1;
        Ok((id, seq, collective.timeout.unwrap_or(self.cfg.timeout)))
    }

    /// [`GroupState::admit`]'s second half, for the work numbered last: its flight-recorder
    /// entry (as started at `now` if `started`) and, for a collective, its desync signature.
    fn admit_record(
        &mut self,
        now: Duration,
        collective: &Collective,
        seq: SeqNo,
        timeout: Duration,
        started: bool,
    ) -> Option<RecordId> {
        let record = self.record(now, collective, seq, timeout, started);
        if !collective.op.is_p2p() {
            self.note_signature(seq, Signature::of(collective));
        }
        record
    }

    /// Collective `seq`'s desync signature, kept for censuses.
    fn note_signature(&mut self, seq: SeqNo, signature: Signature) {
        if self.signatures.len() == SIGNATURES_KEPT {
            self.signatures.pop_front();
        }
        self.signatures.push_back((seq, signature));
        // A census about this collective asked before this rank reached it got "not there
        // yet": vote again, now that it is.
        if let Some(c) = self.censuses.get_mut(&seq)
            && c.voted
        {
            c.voted = false;
            self.census_vote(seq);
        }
    }

    /// A work's entry in the table (not launched yet), with its timers counted from
    /// `submitted`.
    fn enter(&mut self, submitted: Duration, work: InlineWork, collective: Collective) {
        let InlineWork { id, seq, lifecycle, timeout, record, .. } = work;
        let is_p2p = collective.op.is_p2p();
        self.timers.set(TimerKind::WorkDeadline(id), submitted.saturating_add(timeout));
        if !is_p2p && self.cfg.world_size > 2 {
            // With two ranks the rank waited for is the only other one: no chain to follow.
            self.timers.set(TimerKind::WorkStuck(id), submitted.saturating_add(timeout / 2));
        }
        self.works.insert(
            id,
            WorkEntry {
                seq,
                is_p2p,
                collective,
                lifecycle,
                timeout,
                launched: false,
                waiting_on: None,
                stuck_on: None,
                result: None,
                record,
            },
        );
    }

    /// The data plane started work `id`. Queues nothing.
    pub fn handle_started(&mut self, now: Instant, id: WorkId) {
        let now = self.since_epoch(now);
        if let Some(w) = self.works.get_mut(&id)
            && w.launched
            && w.lifecycle.state() == WorkState::Enqueued
        {
            w.lifecycle.start(now).expect("an enqueued work can always start");
            if let Some(rid) = w.record {
                self.recorder.handle_started(rid, now);
            }
        }
    }

    /// The data plane says work `id` is waiting for these ranks' parts; a timeout message will
    /// name them. Queues nothing.
    pub fn handle_waiting_on(&mut self, _now: Instant, id: WorkId, ranks: &[Rank]) {
        if let Some(w) = self.works.get_mut(&id) {
            match &mut w.waiting_on {
                Some(was) => {
                    was.clear();
                    was.extend_from_slice(ranks);
                }
                None => w.waiting_on = Some(ranks.to_vec()),
            }
        }
    }

    /// The data plane finished work `id` (ignored unless it was launched and has not ended).
    /// May queue events (the work and any later ones that
    /// were waiting for it), launches, and — when a failure fails the group — transmits.
    pub fn handle_completion(&mut self, now: Instant, id: WorkId, completion: Completion) {
        let now = self.since_epoch(now);
        let Some(w) = self.works.get(&id) else { return };
        // A completion for a finished work, or for one the data plane was never given, is a
        // stale or bogus input: ignore it.
        if w.result.is_some() || !w.launched {
            tracing::debug!(%id, "ignoring a completion for a work that is not running");
            return;
        }
        let (seq, op, is_p2p) = (w.seq, w.collective.op, w.is_p2p);
        match completion {
            Completion::Success => self.set_result(id, WorkResult::Success),
            // A work held by a desync census fails by the census's verdict: whatever else
            // ended it (the peer left, the link broke) came after the mismatch. The verdict
            // comes when the votes are in, or at the census deadline.
            Completion::Failed { .. }
                if self.censuses.get(&seq).is_some_and(|c| c.held.as_ref().is_some_and(|(h, _)| *h == id)) =>
            {
                self.census_decide(now, seq, false);
            }
            Completion::Failed { rank, message } => {
                let blame = match rank {
                    Some(r) => Blame::rank(r),
                    None => Blame::undecided(w.waiting_on.iter().flatten().copied()),
                };
                self.fail_work(now, id, seq, op, blame, &message);
            }
            Completion::Mismatch { rank, message }
                if !is_p2p && self.cfg.desync_census && rank.0 < self.cfg.world_size =>
            {
                self.open_census(now, id, seq, Held::Mismatch { from: rank, detail: message });
            }
            Completion::Mismatch { rank, message } => self.fail_work(now, id, seq, op, Blame::rank(rank), &message),
        }
        self.release(now);
    }

    /// Work `id` failed here: it and the group fail with `blame`.
    fn fail_work(&mut self, now: Duration, id: WorkId, seq: SeqNo, op: OpType, blame: Blame, message: &str) {
        self.set_result(id, WorkResult::CommError { blame: blame.clone(), message: message.to_owned() });
        let message = format!("rank {}: {op} (seq {seq}) failed: {message}", self.rank);
        self.fail_group(now, GroupFailure { origin: self.rank, blame, seq: Some(seq), message }, true);
    }

    /// Collective `seq` (work `id`) got a part that does not fit, or timed out: hold the
    /// work, vote, and ask every peer for its vote. The verdict comes when every rank has
    /// voted, or at the census deadline.
    fn open_census(&mut self, now: Duration, id: WorkId, seq: SeqNo, held: Held) {
        let timeout = self.works.get(&id).map_or(self.cfg.timeout, |w| w.timeout);
        self.census_entry(seq).held = Some((id, held));
        self.census_vote(seq);
        self.timers.set(TimerKind::Census(seq), now.saturating_add(CENSUS_WINDOW.min(timeout / 4)));
        self.census_decide(now, seq, false);
    }

    fn census_entry(&mut self, seq: SeqNo) -> &mut Census {
        if !self.censuses.contains_key(&seq) && self.censuses.len() >= CENSUSES_KEPT {
            // Drop the oldest census that holds no work (a held one always ends in a verdict).
            if let Some(old) = self.censuses.iter().find(|(_, c)| c.held.is_none()).map(|(s, _)| *s) {
                self.censuses.remove(&old);
            }
        }
        self.censuses.entry(seq).or_default()
    }

    /// This rank's signature at collective `seq`: `None` if it has not reached it (or it is
    /// too old to remember, which reads the same: no vote on what it ran).
    fn signature_at(&self, seq: SeqNo) -> Option<Signature> {
        let i = self.signatures.binary_search_by(|(s, _)| s.cmp(&seq)).ok()?;
        Some(self.signatures[i].1)
    }

    /// Vote in census `seq` (once): record this rank's signature and send it to every peer.
    fn census_vote(&mut self, seq: SeqNo) {
        let sig = self.signature_at(seq);
        let me = self.rank;
        let census = self.census_entry(seq);
        if census.voted {
            return;
        }
        census.voted = true;
        census.votes.insert(me, sig);
        for &to in self.connected.keys() {
            if !self.lost.contains_key(&to) {
                self.transmits.push_back(Transmit { to, msg: ControlMsg::Census { seq, sig } });
            }
        }
    }

    /// Decide census `seq` if this rank holds a work on it and every rank it can still hear
    /// has voted (or `force`, at the deadline): the held work and the group fail blaming the
    /// deviants. If the votes agree after all, the rank whose part did not fit is blamed.
    fn census_decide(&mut self, now: Duration, seq: SeqNo, force: bool) {
        let world = self.cfg.world_size;
        let Some(census) = self.censuses.get(&seq) else { return };
        let Some((id, held)) = census.held.clone() else { return };
        let gone = |r: &Rank| self.lost.contains_key(r) || self.departed.contains(r);
        // After a mismatch, a rank that has not reached the collective yet may reach it soon
        // (it answers then): wait for it too, until the deadline. After a timeout, a rank
        // still not there is what the timeout is about: its "not there" is its answer.
        let waiting = match held {
            Held::Mismatch { .. } => (0..world).map(Rank).any(|r| !census.votes.has_signature(r) && !gone(&r)),
            Held::Timeout { .. } => (0..world).map(Rank).any(|r| !census.votes.has(r) && !gone(&r)),
        };
        if waiting && !force {
            return;
        }
        let verdict = census.votes.verdict(world);
        let (from, detail) = match held {
            Held::Mismatch { from, detail } => (from, detail),
            Held::Timeout { message, blame } => {
                self.timers.cancel(TimerKind::Census(seq));
                if let Some(c) = self.censuses.get_mut(&seq) {
                    c.held = None;
                }
                let (message, blame) = match verdict {
                    Some(v) => (format!("{message}; {}", v.message), v.blame),
                    None => (message, blame),
                };
                self.time_out(now, id, seq, message, blame);
                return;
            }
        };
        let from_voted = census.votes.has_signature(from);
        let agree_with_me = (0..world)
            .map(Rank)
            .filter(|&r| {
                r != from && census.votes.has_signature(r) && census.votes.get(r) == census.votes.get(self.rank)
            })
            .count();
        self.timers.cancel(TimerKind::Census(seq));
        if let Some(c) = self.censuses.get_mut(&seq) {
            c.held = None;
        }
        let Some(w) = self.works.get(&id) else { return };
        if w.result.is_some() {
            return;
        }
        let op = w.collective.op;
        let me = self.rank;
        let (blame, message) = match verdict {
            Some(v) => (v.blame, format!("{detail}; {}", v.message)),
            // Everyone agrees on what they run, the peer included: the part itself was bad,
            // and the peer that sent it is to blame.
            None if from_voted => (Blame::rank(from), detail),
            // The peer never voted (it left, or is silent), but its part showed it runs
            // something else. Two ranks: no majority can say which one deviated. More, and
            // another rank runs what this one does: the peer is the odd one out.
            None if world == 2 => {
                (Blame::ranks([me, from]), format!("{detail}; with two ranks no majority says which deviated"))
            }
            None if agree_with_me >= 2 => (Blame::rank(from), detail),
            None => (Blame::undecided([me, from]), format!("{detail}; too few ranks answered the desync census")),
        };
        self.fail_work(now, id, seq, op, blame, &message);
        self.release(now);
    }

    /// The device measured work `id` as `time` (its start and end events, on NCCL): the work's
    /// duration and its flight-recorder entry report it. Feed it before the work's
    /// [`handle_completion`](GroupState::handle_completion). Queues nothing.
    pub fn handle_device_time(&mut self, _now: Instant, id: WorkId, time: Duration) {
        if let Some(w) = self.works.get_mut(&id) {
            w.lifecycle.set_device_time(time);
        }
    }

    /// The communicator itself broke (NCCL's asynchronous error, `ncclCommGetAsyncError`): no
    /// work on it can finish, so every unfinished work fails with `message`, and the group
    /// fails whatever the [`ErrorHandling`] mode (a broken communicator runs nothing more).
    /// `blame` is whom the driver holds responsible. May queue events and transmits. Ignored
    /// once the group has failed or was aborted.
    pub fn handle_comm_error(&mut self, now: Instant, blame: Blame, message: String) {
        let now = self.since_epoch(now);
        if self.health != Health::Healthy {
            return;
        }
        let me = self.rank;
        let open: Vec<(WorkId, SeqNo, OpType)> =
            self.works.iter().filter(|(_, w)| w.result.is_none()).map(|(id, w)| (id, w.seq, w.collective.op)).collect();
        let first = open.first().map(|&(_, seq, op)| (seq, op));
        for (id, seq, op) in open {
            self.set_result(
                id,
                WorkResult::CommError {
                    blame: blame.clone(),
                    message: format!("rank {me}: {op} (seq {seq}) failed: {message}"),
                },
            );
        }
        let message = match first {
            Some((seq, op)) => format!("rank {me}: {op} (seq {seq}) failed: {message}"),
            None => format!("rank {me}: {message}"),
        };
        let failure = GroupFailure { origin: me, blame, seq: first.map(|(s, _)| s), message };
        if self.cfg.error_handling.fails_group() {
            self.fail_group(now, failure, true);
        } else {
            // NoHandling keeps the works' own errors only, but the communicator is broken all
            // the same: the group is failed without tearing anything down.
            self.stop_timers();
            self.health = Health::Failed(failure.clone());
            self.release(now);
            self.events.push_back(Event::GroupFailed(failure));
        }
        self.release(now);
    }

    /// A peer sent a control message. Heartbeats refresh its liveness; an error fails the
    /// group as a remote error naming the origin; an abort aborts the group.
    pub fn handle_message(&mut self, now: Instant, from: Rank, msg: ControlMsg) {
        self.handle_peer_activity(now, from);
        let t = self.since_epoch(now);
        match msg {
            ControlMsg::Heartbeat => {}
            ControlMsg::Error { origin, blame, message } => {
                // A relayed error names the rank that failed first; one naming a rank outside
                // the group is read as the sender's own.
                let origin = if origin.0 < self.cfg.world_size { origin } else { from };
                self.fail_remote(t, GroupFailure { origin, blame, seq: None, message });
            }
            ControlMsg::Census { seq, sig } => {
                if from != self.rank && from.0 < self.cfg.world_size && seq.0 > 0 {
                    self.census_entry(seq).votes.insert(from, sig);
                    if self.health == Health::Healthy {
                        self.census_vote(seq);
                    }
                    self.census_decide(t, seq, false);
                }
            }
            ControlMsg::Abort { reason } => {
                // Relayed to the others, like an error: a peer that hears of it only through
                // this rank's goodbye would otherwise blame this rank.
                self.abort(t, format!("rank {from} aborted the group: {reason}"), Some(from));
            }
            ControlMsg::Stuck { seq, mut waiting_on } => {
                if from != self.rank && from.0 < self.cfg.world_size {
                    waiting_on.retain(|r| r.0 < self.cfg.world_size);
                    waiting_on.truncate(self.cfg.world_size as usize);
                    let notes = self.peer_stuck.entry(from).or_default();
                    notes.insert(seq, waiting_on);
                    // A peer's notes are bounded: the oldest go first.
                    while notes.len() > STUCK_NOTES_PER_PEER {
                        notes.pop_first();
                    }
                }
            }
        }
    }

    /// A remote rank's failure learned some other way (e.g. through the store). Same effect as
    /// an [`ControlMsg::Error`] from `origin`.
    pub fn handle_remote_error(&mut self, now: Instant, origin: Rank, blame: Blame, message: String) {
        let t = self.since_epoch(now);
        self.fail_remote(t, GroupFailure { origin, blame, seq: None, message });
    }

    /// Any bytes from `from` prove it alive. Queues nothing.
    pub fn handle_peer_activity(&mut self, now: Instant, from: Rank) {
        let now = self.since_epoch(now);
        self.peer_heard(now, from);
    }

    fn peer_heard(&mut self, now: Duration, from: Rank) {
        if self.cfg.heartbeat.is_some()
            && from != self.rank
            && from.0 < self.cfg.world_size
            && !self.lost.contains_key(&from)
            // The silence timer is not moved on every frame: it fires at its old deadline and
            // is set again from here (see `handle_timeout`).
            && let Some(t) = self.connected.get_mut(&from)
        {
            *t = now;
        }
    }

    /// A lazily connected peer ([`GroupConfig::lazy_peers`]) is now connected: heartbeats go to
    /// it and its silence is watched from `now`. Repeats and unknown ranks do nothing.
    pub fn handle_peer_connected(&mut self, now: Instant, peer: Rank) {
        let now = self.since_epoch(now);
        if peer == self.rank
            || peer.0 >= self.cfg.world_size
            || self.lost.contains_key(&peer)
            || self.departed.contains(&peer)
            || self.connected.contains_key(&peer)
        {
            return;
        }
        self.connected.insert(peer, now);
        if let Some(hb) = self.cfg.heartbeat {
            self.timers.set(TimerKind::PeerSilence(peer), now.saturating_add(hb.dead_after));
        }
        // A peer that connects while this rank is stuck (often one stuck on it, asking) hears
        // whom it is stuck on.
        if matches!(self.health, Health::Healthy) {
            for (_, w) in self.works.iter().filter(|(_, w)| w.result.is_none()) {
                if let Some(waiting_on) = &w.stuck_on {
                    let msg = ControlMsg::Stuck { seq: w.seq, waiting_on: waiting_on.clone() };
                    self.transmits.push_back(Transmit { to: peer, msg });
                }
            }
        }
    }

    /// Whether `peer` is connected (always, unless [`GroupConfig::lazy_peers`]).
    pub fn is_connected(&self, peer: Rank) -> bool {
        self.connected.contains_key(&peer)
    }

    /// The connection to `rank` is gone (EOF, reset, or the driver gave up on it). Every work
    /// that needs it fails naming it; may fail the group. May queue events and transmits.
    pub fn handle_peer_lost(&mut self, now: Instant, rank: Rank, reason: String) {
        let now = self.since_epoch(now);
        self.peer_lost(now, rank, reason, Blame::rank(rank));
    }

    /// `rank` left cleanly (it said goodbye: its program finished or shut the group down).
    /// Nothing fails here: only the data plane knows whether a running work still needs bytes
    /// from it (everything it sent arrived before its goodbye), and it reports such a work with
    /// [`GroupState::handle_completion`]. Its silence is no longer watched. Queues
    /// [`Event::PeerDeparted`].
    pub fn handle_peer_departed(&mut self, _now: Instant, rank: Rank) {
        if rank == self.rank || rank.0 >= self.cfg.world_size || self.lost.contains_key(&rank) {
            return;
        }
        if self.departed.insert(rank) {
            self.timers.cancel(TimerKind::PeerSilence(rank));
            self.events.push_back(Event::PeerDeparted { rank });
        }
    }

    /// Abort the group: every unfinished work ends Aborted and later submits are refused with
    /// `reason`; peers are told. Queues events and transmits. Aborting twice does nothing.
    pub fn handle_abort(&mut self, now: Instant, reason: String) {
        let now = self.since_epoch(now);
        self.abort(now, reason, None);
    }

    /// Fire every timer due at `now`: work deadlines (the work ends TimedOut), heartbeats
    /// (queues a transmit per peer), peer silence (the peer is lost). Calling it early, late
    /// or repeatedly is harmless: only due timers fire, each once.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.since_epoch(now);
        while let Some((_, kind)) = self.timers.pop_expired(now) {
            if let TimerKind::PeerSilence(rank) = kind {
                // The peer was heard from since the timer was set: watch again from then.
                let dead_after = self.cfg.heartbeat.map(|h| h.dead_after).unwrap_or_default();
                let due = self.connected.get(&rank).map_or(Duration::ZERO, |t| t.saturating_add(dead_after));
                if due > now {
                    self.timers.set(kind, due);
                    continue;
                }
            }
            self.last_timeout_reason = Some(kind);
            match kind {
                TimerKind::Heartbeat => {
                    for &to in self.connected.keys() {
                        if !self.lost.contains_key(&to) {
                            self.transmits.push_back(Transmit { to, msg: ControlMsg::Heartbeat });
                        }
                    }
                    if let (Some(hb), Health::Healthy) = (self.cfg.heartbeat, &self.health) {
                        self.timers.set(TimerKind::Heartbeat, now.saturating_add(hb.interval));
                    }
                }
                TimerKind::PeerSilence(rank) => self.peer_silent(now, rank),
                TimerKind::WorkDeadline(id) => self.work_timed_out(now, id),
                TimerKind::WorkStuck(id) => self.work_stuck(id),
                TimerKind::Census(seq) => self.census_decide(now, seq, true),
            }
        }
        self.release(now);
    }

    /// The flight recorder: every work of this group, as the events reported it.
    pub fn recorder(&self) -> &FlightRecorder {
        &self.recorder
    }

    /// The flight recorder's dump (PyTorch's schema 2.10, plus cohort's extras).
    pub fn dump(&self) -> Dump {
        self.recorder.dump(DumpMeta::new(self.rank, self.cfg.world_size))
    }

    /// The earliest time [`GroupState::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.earliest().map(|(at, _)| self.epoch + at)
    }

    /// Why the last [`GroupState::handle_timeout`] fired (debugging a group that keeps waking).
    pub fn last_timeout_reason(&self) -> Option<TimerKind> {
        self.last_timeout_reason
    }

    /// Next control message for a peer. Drain after every input.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// Next work the data plane may start, in issue order. Drain after every input; call
    /// [`GroupState::handle_started`] when it starts.
    pub fn poll_launch(&mut self) -> Option<Launch> {
        self.launches.pop_front()
    }

    /// Next user-facing event. Drain after every input.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether any of the three polls above has something: a caller with nothing to drain
    /// learns it without the three.
    pub fn has_output(&self) -> bool {
        !(self.transmits.is_empty() && self.launches.is_empty() && self.events.is_empty())
    }

    // ---- helpers ----

    fn since_epoch(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.epoch)
    }

    fn peers(&self) -> Vec<Rank> {
        (0..self.cfg.world_size).map(Rank).filter(|&r| r != self.rank).collect()
    }

    fn record(
        &mut self,
        now: Duration,
        c: &Collective,
        seq: SeqNo,
        timeout: Duration,
        started: bool,
    ) -> Option<RecordId> {
        if !self.recorder.is_enabled() {
            return None;
        }
        // Formatted into a buffer kept for the next submit: the recorder interns the name.
        let mut profiling_name = std::mem::take(&mut self.name_buf);
        profiling_name.clear();
        let name = match (c.op, c.peer) {
            (OpType::Send, Some(p)) => {
                let _ = write!(profiling_name, "{}:send {}->{p}", self.cfg.backend, self.rank);
                ProfilingName::Text(&profiling_name)
            }
            (OpType::Recv, Some(p)) => {
                let _ = write!(profiling_name, "{}:recv {}<-{p}", self.cfg.backend, self.rank);
                ProfilingName::Text(&profiling_name)
            }
            (op, _) => ProfilingName::Interned(match self.collective_names.iter().find(|(o, _)| *o == op) {
                Some(&(_, id)) => id,
                None => {
                    let id = self.recorder.intern_name(&format!("{}:{}", self.cfg.backend, op.name()));
                    self.collective_names.push((op, id));
                    id
                }
            }),
        };
        let is_p2p = c.op.is_p2p();
        let outputs = if c.outputs.is_empty() { &c.inputs } else { &c.outputs };
        let req = RecordRequest {
            pg_id: u64::from(self.cfg.group_id.0),
            pg_name: &self.cfg.name,
            pg_desc: &self.cfg.desc,
            collective_seq_id: if is_p2p { self.seq.0 } else { seq.0 },
            p2p_seq_id: if is_p2p { seq.0 } else { self.p2p_seq.0 },
            op_id: self.next_work - 1,
            profiling_name: name,
            inputs: &c.inputs,
            outputs,
            timeout,
            is_p2p,
        };
        let record = if started { self.recorder.record_started(now, &req) } else { self.recorder.record(now, &req) };
        self.name_buf = profiling_name;
        record
    }

    /// A collective submitted after the group failed is refused, but recorded (failed at
    /// once, with the cause), so that dumps show what each rank tried to run next. It takes
    /// the sequence number it would have had.
    fn record_refused(&mut self, now: Duration, c: &Collective, cause: &GroupFailure) {
        if !self.recorder.is_enabled() || c.validate(self.rank, self.cfg.world_size).is_err() {
            return;
        }
        let seq = if c.op.is_p2p() {
            self.p2p_seq.0 += 1;
            self.p2p_seq
        } else {
            self.seq.0 += 1;
            self.seq
        };
        self.next_work += 1;
        let timeout = c.timeout.unwrap_or(self.cfg.timeout);
        if let Some(rid) = self.record(now, c, seq, timeout, false) {
            let result = WorkResult::RemoteError {
                rank: cause.origin,
                blame: cause.blame.clone(),
                message: format!("refused: the group had failed: {}", cause.message),
            };
            self.recorder.handle_finished(rid, now, &result);
        }
    }

    fn launch_ready(&mut self) {
        while self.running < self.cfg.max_in_flight.max(1) {
            let Some(id) = self.to_launch.pop_front() else { break };
            let Some(w) = self.works.get_mut(&id) else { continue };
            if w.result.is_some() {
                continue;
            }
            w.launched = true;
            self.running += 1;
            self.launches.push_back(Launch { id, seq: w.seq, is_p2p: w.is_p2p, op: w.collective.op });
        }
    }

    /// Record a work's result (once); it finishes in [`GroupState::release`].
    fn set_result(&mut self, id: WorkId, result: WorkResult) {
        let Some(w) = self.works.get_mut(&id) else { return };
        if w.result.is_some() {
            return;
        }
        w.result = Some(result);
        self.timers.cancel(TimerKind::WorkDeadline(id));
        self.timers.cancel(TimerKind::WorkStuck(id));
        if w.launched {
            self.running -= 1;
        }
    }

    /// Finish works in issue order: the oldest unfinished work with a result, repeatedly.
    fn release(&mut self, now: Duration) {
        while let Some((_, first)) = self.works.first_mut() {
            let Some(result) = first.result.take() else { break };
            let Some((id, w)) = self.works.pop_first() else { break };
            let mut lifecycle = w.lifecycle;
            let state = result.terminal_state();
            let finished: Result<(), IllegalTransition> = lifecycle.finish(now, state);
            finished.expect("a work is finished once, when it leaves the table");
            if let Some(rid) = w.record {
                self.recorder.handle_finished(rid, now, &result);
                if let (true, Some(time)) = (result.is_success(), lifecycle.device_time()) {
                    self.recorder.handle_device_time(rid, time);
                }
            }
            self.events.push_back(Event::WorkFinished(WorkSummary {
                id,
                seq: w.seq,
                is_p2p: w.is_p2p,
                op: w.collective.op,
                result,
                lifecycle,
            }));
        }
        self.launch_ready();
    }

    /// A collective ran half its timeout: tell every connected peer whom it still waits for.
    /// Under lazy connection the ranks it waits for are told too, connecting to them if need
    /// be: a rank stuck on this one then learns whom this one is stuck on (it answers with its
    /// own note when the connection comes, [`GroupState::handle_peer_connected`]), so the chain
    /// of notes runs along the waits even where no data ever flowed.
    fn work_stuck(&mut self, id: WorkId) {
        let Some(w) = self.works.get_mut(&id) else { return };
        let Some(waiting_on) = w.waiting_on.clone().filter(|r| !r.is_empty()) else { return };
        if w.result.is_some() || w.is_p2p || !matches!(self.health, Health::Healthy) {
            return;
        }
        w.stuck_on = Some(waiting_on.clone());
        let seq = w.seq;
        // Connected peers, and under lazy connection the ranks it waits for (in rank order).
        let mut told: std::collections::BTreeSet<Rank> = self.connected.keys().copied().collect();
        if self.cfg.lazy_peers {
            told.extend(waiting_on.iter().copied().filter(|&r| r != self.rank && r.0 < self.cfg.world_size));
        }
        for to in told {
            if !self.lost.contains_key(&to) && !self.departed.contains(&to) {
                self.transmits
                    .push_back(Transmit { to, msg: ControlMsg::Stuck { seq, waiting_on: waiting_on.clone() } });
            }
        }
    }

    /// Follow peers' stuck notes from `first` (the one rank collective `seq` waits for): each
    /// rank that said it was stuck in `seq` waiting for one rank leads to that rank. A rank
    /// with no note for `seq` is read by its note for the latest earlier collective it was
    /// stuck in (it cannot finish `seq` before that one ends); notes for later collectives
    /// (later buckets in flight) say nothing about `seq`.
    fn stuck_chain(&self, seq: SeqNo, first: Rank) -> Vec<Rank> {
        let mut chain = Vec::new();
        let mut at = first;
        while let Some((_, on)) = self.peer_stuck.get(&at).and_then(|notes| notes.range(..=seq).next_back()) {
            match on.as_slice() {
                [next] if *next != self.rank && *next != first && !chain.contains(next) => {
                    chain.push(*next);
                    at = *next;
                }
                _ => break,
            }
        }
        chain
    }

    fn work_timed_out(&mut self, now: Duration, id: WorkId) {
        let Some(w) = self.works.get(&id) else { return };
        if w.result.is_some() {
            return;
        }
        let chain = match w.waiting_on.as_deref() {
            Some([one]) if !w.is_p2p => self.stuck_chain(w.seq, *one),
            _ => Vec::new(),
        };
        let cx = TimeoutContext {
            op: w.collective.op,
            seq: w.seq,
            numel_in: w.collective.numel_in(),
            numel_out: w.collective.numel_out(),
            timeout: w.timeout,
            elapsed: now.saturating_sub(w.lifecycle.enqueued_at()),
            started: w.lifecycle.state() == WorkState::Started,
            waiting_on: w.waiting_on.clone(),
            chain,
        };
        let blame = match cx.waiting_on.as_deref() {
            Some([one]) => Blame::rank(cx.chain.last().copied().unwrap_or(*one)),
            Some(many) => Blame::undecided(many.iter().copied()),
            None => Blame::nobody(),
        };
        let message = timeout_message(self.rank, &cx);
        if self.cfg.desync_census && !w.is_p2p && self.cfg.world_size > 2 {
            // Ranks that wait for each other in a chain may be in different collectives: ask
            // what everyone runs here before blaming the end of the chain.
            self.open_census(now, id, cx.seq, Held::Timeout { message, blame });
            return;
        }
        self.time_out(now, id, cx.seq, message, blame);
    }

    fn time_out(&mut self, now: Duration, id: WorkId, seq: SeqNo, message: String, blame: Blame) {
        if self.works.get(&id).is_none_or(|w| w.result.is_some()) {
            return;
        }
        self.set_result(id, WorkResult::Timeout { message: message.clone(), blame: blame.clone() });
        self.fail_group(now, GroupFailure { origin: self.rank, blame, seq: Some(seq), message }, true);
        self.release(now);
    }

    /// Peer `rank`'s silence timer fired. If other peers have gone quiet with it (unheard for
    /// more than half the silence limit), the network is cut between the ranks this rank
    /// still hears and those it does not: they are lost together and the cut is blamed. A
    /// rank that hears nobody is cut off from every peer. One silent rank is blamed alone.
    fn peer_silent(&mut self, now: Duration, rank: Rank) {
        let dead_after = self.cfg.heartbeat.map(|h| h.dead_after).unwrap_or_default();
        let watched: Vec<(Rank, Duration)> = self
            .connected
            .iter()
            .map(|(&r, &t)| (r, t))
            .filter(|(r, _)| !self.lost.contains_key(r) && !self.departed.contains(r))
            .collect();
        let quiet = |&(r, t): &(Rank, Duration)| r == rank || now.saturating_sub(t) > dead_after / 2;
        let (silent, heard): (Vec<_>, Vec<_>) = watched.iter().copied().partition(quiet);
        let (silent, heard): (Vec<Rank>, Vec<Rank>) =
            (silent.into_iter().map(|(r, _)| r).collect(), heard.into_iter().map(|(r, _)| r).collect());
        let reason = format!("no heartbeat or data from rank {rank} for {} ms", dead_after.as_millis());
        if silent.len() < 2 {
            self.peer_lost(now, rank, reason, Blame::rank(rank));
            return;
        }
        let near: Vec<Rank> = heard.iter().copied().chain([self.rank]).collect();
        let blame = Blame::cut(near, silent.iter().copied());
        let reason = if heard.is_empty() {
            format!(
                "this rank is cut off from every peer: no heartbeat or data from ranks {} for over {} ms",
                crate::work::rank_ranges(&silent),
                dead_after.as_millis() / 2
            )
        } else {
            format!("no heartbeat or data for over {} ms across {blame}", dead_after.as_millis() / 2)
        };
        for r in silent {
            self.peer_lost(now, r, reason.clone(), blame.clone());
        }
    }

    fn peer_lost(&mut self, now: Duration, rank: Rank, reason: String, blame: Blame) {
        if rank == self.rank || rank.0 >= self.cfg.world_size || self.lost.contains_key(&rank) {
            return;
        }
        self.lost.insert(rank, reason.clone());
        self.timers.cancel(TimerKind::PeerSilence(rank));
        self.events.push_back(Event::PeerLost { rank, reason: reason.clone() });
        let me = self.rank;
        let dependent: Vec<(WorkId, SeqNo, OpType)> = self
            .works
            .iter()
            .filter(|(_, w)| w.result.is_none() && w.collective.needs_peer(me, rank))
            .map(|(id, w)| (id, w.seq, w.collective.op))
            .collect();
        let first = dependent.first().map(|&(_, seq, op)| (seq, op));
        for (id, seq, op) in dependent {
            self.set_result(
                id,
                WorkResult::CommError {
                    blame: blame.clone(),
                    message: format!("rank {me}: {op} (seq {seq}) failed: connection to rank {rank} lost: {reason}"),
                },
            );
        }
        let message = match first {
            Some((seq, op)) => format!("rank {me}: {op} (seq {seq}) failed: connection to rank {rank} lost: {reason}"),
            None => format!("rank {me}: connection to rank {rank} lost: {reason}"),
        };
        self.fail_group(now, GroupFailure { origin: me, blame, seq: first.map(|(s, _)| s), message }, true);
        // Censuses still waiting for this rank's vote decide without it.
        let waiting: Vec<SeqNo> = self.censuses.iter().filter(|(_, c)| c.held.is_some()).map(|(s, _)| *s).collect();
        for seq in waiting {
            self.census_decide(now, seq, false);
        }
        self.release(now);
    }

    fn fail_remote(&mut self, now: Duration, failure: GroupFailure) {
        if self.health != Health::Healthy {
            return;
        }
        let me = self.rank;
        let origin = failure.origin;
        let dependent: Vec<WorkId> = self
            .works
            .iter()
            .filter(|(_, w)| {
                w.result.is_none() && (self.cfg.error_handling.fails_group() || w.collective.needs_peer(me, origin))
            })
            .map(|(id, _)| id)
            .collect();
        for id in dependent {
            self.set_result(
                id,
                WorkResult::RemoteError {
                    rank: origin,
                    blame: failure.blame.clone(),
                    message: failure.message.clone(),
                },
            );
        }
        self.fail_group(now, failure, false);
        self.release(now);
    }

    /// Apply the error-handling mode to the group's first failure. `local` failures are told
    /// to peers; remote ones are not echoed back.
    fn fail_group(&mut self, now: Duration, failure: GroupFailure, local: bool) {
        if !self.cfg.error_handling.fails_group() || self.health != Health::Healthy {
            return;
        }
        let remaining: Vec<(WorkId, SeqNo, OpType)> =
            self.works.iter().filter(|(_, w)| w.result.is_none()).map(|(id, w)| (id, w.seq, w.collective.op)).collect();
        for (id, seq, op) in remaining {
            let message = format!("{op} (seq {seq}) cannot complete: {}", failure.message);
            let result = if local {
                WorkResult::CommError { blame: failure.blame.clone(), message }
            } else {
                WorkResult::RemoteError { rank: failure.origin, blame: failure.blame.clone(), message }
            };
            self.set_result(id, result);
        }
        // Tell every peer still reachable, also when this rank only learned of the failure:
        // a rank that closes its links after a remote failure would otherwise look, to a peer
        // that has not heard yet, like the rank that failed. The origin and the blame travel
        // along. Only connected peers are told (every peer, unless peers connect lazily):
        // dialing every peer to tell it would open the full mesh that lazy connections avoid,
        // all at once while the job fails. A peer this rank has no link with cannot mistake
        // its closing links for the failure; it hears from a connected peer, which passes the
        // failure on the same way, or from the store, where the failure is published.
        for &to in self.connected.keys() {
            if !self.lost.contains_key(&to) && (local || to != failure.origin) {
                self.transmits.push_back(Transmit {
                    to,
                    msg: ControlMsg::Error {
                        origin: failure.origin,
                        blame: failure.blame.clone(),
                        message: failure.message.clone(),
                    },
                });
            }
        }
        self.stop_timers();
        self.health = Health::Failed(failure.clone());
        // The works' own events come first, then what happened to the group.
        self.release(now);
        self.events.push_back(Event::GroupFailed(failure.clone()));
        if self.cfg.error_handling.tears_down() {
            self.events.push_back(Event::TearDown { cause: failure.message });
        }
    }

    /// Abort every open work and tell every peer but `heard_from` (where the abort came from).
    fn abort(&mut self, now: Duration, reason: String, heard_from: Option<Rank>) {
        if matches!(self.health, Health::Aborted(_)) {
            return;
        }
        let open: Vec<WorkId> = self.works.iter().filter(|(_, w)| w.result.is_none()).map(|(id, _)| id).collect();
        for id in open {
            self.set_result(id, WorkResult::Aborted { reason: reason.clone() });
        }
        // Connected peers only, as for a failure (see `fail_group`): the others hear from them
        // or from the store.
        for &to in self.connected.keys() {
            if !self.lost.contains_key(&to) && Some(to) != heard_from {
                self.transmits.push_back(Transmit { to, msg: ControlMsg::Abort { reason: reason.clone() } });
            }
        }
        self.stop_timers();
        self.health = Health::Aborted(reason.clone());
        self.release(now);
        self.events.push_back(Event::GroupAborted { reason });
    }

    /// After a failure or an abort nothing is left to time: heartbeats and silence checks stop.
    fn stop_timers(&mut self) {
        self.timers.cancel(TimerKind::Heartbeat);
        // Silence is watched only for connected peers (`handle_peer_connected`).
        for &peer in self.connected.keys() {
            self.timers.cancel(TimerKind::PeerSilence(peer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allreduce(n: usize) -> Collective {
        Collective::new(OpType::Allreduce).inputs(vec![TensorSpec::new(DType::F32, &[n])])
    }

    fn group(world: u32, rank: u32, mode: ErrorHandling) -> (GroupState, Instant) {
        let mut cfg = GroupConfig::new(world);
        cfg.error_handling = mode;
        cfg.heartbeat = None;
        cfg.timeout = Duration::from_secs(10);
        #[allow(clippy::disallowed_methods)] // the tests' one epoch
        let t0 = Instant::now();
        (GroupState::new(cfg, Rank(rank), t0), t0)
    }

    fn drain_events(g: &mut GroupState) -> Vec<Event> {
        std::iter::from_fn(|| g.poll_event()).collect()
    }

    fn finished(events: &[Event]) -> Vec<(WorkId, WorkState)> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::WorkFinished(s) => Some((s.id, s.lifecycle.state())),
                _ => None,
            })
            .collect()
    }

    /// Rank 0 of 4, in an allreduce started at t0 that waits for rank 1.
    fn waiting_on_rank_1() -> (GroupState, Instant) {
        let (mut g, t0) = group(4, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(4)).unwrap();
        while g.poll_launch().is_some() {}
        g.handle_started(t0, a);
        g.handle_waiting_on(t0, a, &[Rank(1)]);
        (g, t0)
    }

    #[test]
    fn has_output_says_whether_any_poll_has_something() {
        let (mut g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        assert!(!g.has_output(), "a new group has nothing to say");
        let a = g.submit(t0, allreduce(4)).unwrap();
        assert!(g.has_output(), "a launch");
        while g.poll_launch().is_some() {}
        assert!(!g.has_output());
        g.handle_started(t0, a);
        g.handle_completion(t0, a, Completion::Success);
        assert!(g.has_output(), "an event");
        drain_events(&mut g);
        assert!(!g.has_output());
        // An abort: an event, and a transmit (the abort to the peer).
        g.handle_abort(t0, "user asked".into());
        drain_events(&mut g);
        assert!(g.has_output(), "the abort for rank 1 is still to go");
        assert!(g.poll_transmit().is_some());
        assert!(!g.has_output(), "all drained");
    }

    #[test]
    fn a_timeout_follows_stuck_notes_to_the_rank_that_never_came() {
        let (mut g, t0) = waiting_on_rank_1();
        let s = |ms| t0 + Duration::from_millis(ms);
        // Halfway (5 s of 10): rank 0 tells every peer whom it waits for.
        g.handle_timeout(s(5_000));
        let notes: Vec<Transmit> = std::iter::from_fn(|| g.poll_transmit()).collect();
        assert_eq!(notes.len(), 3);
        assert!(notes.iter().all(|t| t.msg == ControlMsg::Stuck { seq: SeqNo(1), waiting_on: vec![Rank(1)] }));
        // Rank 1 waits for rank 2, rank 2 (still in an earlier collective) for rank 3; rank 3
        // says nothing about this collective or an earlier one.
        g.handle_message(s(5_001), Rank(1), ControlMsg::Stuck { seq: SeqNo(1), waiting_on: vec![Rank(2)] });
        g.handle_message(s(5_002), Rank(2), ControlMsg::Stuck { seq: SeqNo(0), waiting_on: vec![Rank(3)] });
        g.handle_message(s(5_003), Rank(3), ControlMsg::Stuck { seq: SeqNo(9), waiting_on: vec![Rank(0)] });
        g.handle_timeout(s(10_000));
        // Nobody answers the census (these ranks are simulated by hand): its deadline decides.
        g.handle_timeout(s(10_000) + CENSUS_WINDOW);
        let events = drain_events(&mut g);
        let failure = events
            .iter()
            .find_map(|e| match e {
                Event::GroupFailed(f) => Some(f.clone()),
                _ => None,
            })
            .expect("the group fails");
        assert_eq!(failure.culprit(), Some(Rank(3)));
        assert!(failure.message.contains("rank 1 → rank 2 → rank 3: each said"), "{}", failure.message);

        // Without notes, the rank waited for is blamed, as before.
        let (mut g, t0) = waiting_on_rank_1();
        g.handle_message(t0, Rank(1), ControlMsg::Stuck { seq: SeqNo(1), waiting_on: vec![Rank(0)] });
        g.handle_timeout(t0 + Duration::from_secs(10));
        g.handle_timeout(t0 + Duration::from_secs(10) + CENSUS_WINDOW);
        let culprit = drain_events(&mut g).iter().find_map(|e| match e {
            Event::GroupFailed(f) => Some(f.culprit()),
            _ => None,
        });
        assert_eq!(culprit, Some(Some(Rank(1))), "a note pointing back at this rank ends the chain");
    }

    #[test]
    fn under_lazy_connection_a_stuck_rank_tells_the_rank_it_waits_for_and_whoever_connects() {
        let mut cfg = GroupConfig::new(4);
        cfg.lazy_peers = true;
        cfg.heartbeat = None;
        cfg.timeout = Duration::from_secs(10);
        #[allow(clippy::disallowed_methods)] // the test's one epoch
        let t0 = Instant::now();
        let mut g = GroupState::new(cfg, Rank(0), t0);
        g.handle_peer_connected(t0, Rank(2));
        let a = g.submit(t0, allreduce(4)).unwrap();
        while g.poll_launch().is_some() {}
        g.handle_started(t0, a);
        g.handle_waiting_on(t0, a, &[Rank(1)]);
        // Halfway: the connected peer (2) and the rank waited for (1, not connected) hear it;
        // rank 3, neither, does not.
        g.handle_timeout(t0 + Duration::from_secs(5));
        let note = ControlMsg::Stuck { seq: SeqNo(1), waiting_on: vec![Rank(1)] };
        let to: Vec<Rank> = std::iter::from_fn(|| g.poll_transmit()).filter(|t| t.msg == note).map(|t| t.to).collect();
        assert_eq!(to, [Rank(1), Rank(2)]);
        // Rank 3 connects (asking, stuck on this rank): it hears the note at once.
        g.handle_peer_connected(t0 + Duration::from_secs(6), Rank(3));
        let to: Vec<Rank> = std::iter::from_fn(|| g.poll_transmit()).filter(|t| t.msg == note).map(|t| t.to).collect();
        assert_eq!(to, [Rank(3)]);
    }

    /// Deliver every control message `groups[from]` has queued to its addressee.
    fn deliver(groups: &mut [GroupState], from: usize, now: Instant) {
        while let Some(t) = groups[from].poll_transmit() {
            groups[t.to.index()].handle_message(now, Rank(from as u32), t.msg);
        }
    }

    /// DDP's step on 4 ranks: ranks 0, 1 and 3 each issue four bucket allreduces (seq 1..=4);
    /// rank 2 hangs and issues none. The ring makes rank 1 wait for rank 0, rank 0 for rank 3
    /// and rank 3 for rank 2, in every bucket. Returned halfway to the deadline, once every
    /// rank's stuck notes (one per bucket: seq 4's arrives after seq 1's) were delivered.
    fn buckets_in_flight_with_rank_2_hung() -> (Vec<GroupState>, Instant) {
        let (g0, t0) = group(4, 0, ErrorHandling::CleanUpOnly);
        let mut groups: Vec<GroupState> = (0..4).map(|r| GroupState::new(g0.config().clone(), Rank(r), t0)).collect();
        for (r, waits_for) in [(0, 3), (1, 0), (3, 2)] {
            let g = &mut groups[r];
            let ids: Vec<WorkId> = (0..4).map(|_| g.submit(t0, allreduce(1024)).unwrap()).collect();
            while g.poll_launch().is_some() {}
            for id in ids {
                g.handle_started(t0, id);
                g.handle_waiting_on(t0, id, &[Rank(waits_for)]);
            }
        }
        let half = t0 + Duration::from_secs(5);
        for g in &mut groups {
            g.handle_timeout(half);
        }
        for r in 0..4 {
            deliver(&mut groups, r, half);
        }
        (groups, t0)
    }

    #[test]
    fn with_several_buckets_in_flight_every_rank_blames_the_rank_that_never_came() {
        for first in [1, 0, 3] {
            let (mut groups, t0) = buckets_in_flight_with_rank_2_hung();
            let s = |ms| t0 + Duration::from_millis(ms);
            groups[first].handle_timeout(s(10_000));
            groups[first].handle_timeout(s(10_000) + CENSUS_WINDOW);
            let failure = groups[first].failure().expect("the first rank timed out").clone();
            assert_eq!(failure.culprit(), Some(Rank(2)), "rank {first}: {}", failure.message);
            if first != 3 {
                // Rank 3 waits for rank 2 itself; the others followed the chain to it.
                assert!(failure.message.contains("rank 2 is the likely culprit"), "{}", failure.message);
            }
            if first == 1 {
                assert!(
                    failure.message.contains("still waiting for rank(s) [0]; rank 0 → rank 3 → rank 2: each said"),
                    "{}",
                    failure.message
                );
            }
            // Every other rank hears it (rank 2 relays it too) and blames rank 2 as well.
            deliver(&mut groups, first, s(10_001));
            deliver(&mut groups, 2, s(10_002));
            for (r, g) in groups.iter_mut().enumerate() {
                let failure = g.failure().unwrap_or_else(|| panic!("rank {r} did not fail"));
                assert_eq!(failure.culprit(), Some(Rank(2)), "rank {r}: {}", failure.message);
                for e in drain_events(g) {
                    if let Event::WorkFinished(w) = e {
                        assert_eq!(w.result.culprit(), Some(Rank(2)), "rank {r}: {}", w.result);
                    }
                }
            }
        }
    }

    #[test]
    fn a_comm_error_fails_every_open_work_and_the_group_in_every_mode() {
        for mode in [ErrorHandling::NoHandling, ErrorHandling::CleanUpOnly, ErrorHandling::TearDown] {
            let (mut g, t0) = group(4, 2, mode);
            let a = g.submit(t0, allreduce(4)).unwrap();
            let b = g.submit(t0, allreduce(4)).unwrap();
            while g.poll_launch().is_some() {}
            g.handle_comm_error(t0, Blame::nobody(), "ncclCommGetAsyncError: remote process exited".into());
            let events = drain_events(&mut g);
            assert_eq!(finished(&events), vec![(a, WorkState::Failed), (b, WorkState::Failed)], "{mode:?}");
            let Event::WorkFinished(s) = &events[1] else { panic!("{events:?}") };
            assert_eq!(
                s.result,
                WorkResult::CommError {
                    blame: Blame::nobody(),
                    message: "rank 2: all_reduce (seq 2) failed: ncclCommGetAsyncError: remote process exited".into()
                }
            );
            let failure = g.failure().expect("the group failed").clone();
            assert_eq!((failure.origin, failure.seq), (Rank(2), Some(SeqNo(1))), "{mode:?}");
            assert!(events.contains(&Event::GroupFailed(failure)), "{mode:?}");
            assert_eq!(events.iter().any(|e| matches!(e, Event::TearDown { .. })), mode == ErrorHandling::TearDown);
            assert!(matches!(g.submit(t0, allreduce(1)), Err(SubmitError::GroupFailed { .. })));
            // A second error changes nothing.
            g.handle_comm_error(t0, Blame::rank(Rank(1)), "again".into());
            assert!(drain_events(&mut g).is_empty());
        }
    }

    #[test]
    fn a_device_measured_time_becomes_the_duration_and_the_recorded_one() {
        let (g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        let mut cfg = g.config().clone();
        cfg.recorder.timing = true; // TORCH_NCCL_ENABLE_TIMING
        let mut g = GroupState::new(cfg, Rank(0), t0);
        let a = g.submit(t0, allreduce(4)).unwrap();
        while g.poll_launch().is_some() {}
        g.handle_started(t0 + Duration::from_millis(1), a);
        g.handle_device_time(t0, a, Duration::from_micros(250));
        g.handle_completion(t0 + Duration::from_millis(9), a, Completion::Success);
        let events = drain_events(&mut g);
        let Event::WorkFinished(s) = &events[0] else { panic!("{events:?}") };
        assert_eq!(s.lifecycle.duration(), Some(Duration::from_micros(250)));
        let dump = g.dump();
        assert_eq!(dump.entries[0].duration_ms, Some(0.25));
    }

    /// Rank 0 of 2 with epoch `t0`, as [`group`] makes it.
    fn group_at(t0: Instant) -> GroupState {
        let (g, _) = group(2, 0, ErrorHandling::CleanUpOnly);
        GroupState::new(g.config().clone(), Rank(0), t0)
    }

    /// `c`, checked for rank 0 of two (the groups of the inline tests).
    fn checked(c: Collective) -> Checked {
        Checked::new(c, Rank(0), 2).unwrap()
    }

    /// The usual path of one allreduce on `g`: submitted and started at `at`, its result at
    /// `done` (`None`: left running). The finished work's summary, if it finished.
    fn run_usual(g: &mut GroupState, at: Instant, done: Option<Instant>) -> Option<WorkSummary> {
        let id = g.submit(at, allreduce(4)).unwrap();
        assert_eq!(g.poll_launch().map(|l| l.id), Some(id));
        g.handle_started(at, id);
        let done = done?;
        g.handle_completion(done, id, Completion::Success);
        match &drain_events(g)[..] {
            [Event::WorkFinished(s)] => Some(s.clone()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_description_kept_from_work_to_work_is_recorded_as_fresh_ones_are() {
        // A caller that keeps one `Checked` while the description stays has each work recorded
        // like the last (no lookups): it must leave what a fresh description leaves, across a
        // change of description and back, and a ring that wraps (3 entries).
        #[allow(clippy::disallowed_methods)] // the test's one epoch
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let small = |t0| {
            let mut cfg = group_at(t0).config().clone();
            cfg.recorder = RecorderConfig { capacity: 3, timing: true };
            GroupState::new(cfg, Rank(0), t0)
        };
        let (mut kept, mut fresh) = (small(t0), small(t0));
        let (four, eight) = (checked(allreduce(4)), checked(allreduce(8)));
        for (i, n) in [4, 4, 4, 8, 8, 4, 4, 4, 4].into_iter().enumerate() {
            let at = 10 * i as u64;
            let mine = if n == 4 { four.clone() } else { eight.clone() };
            for (g, c) in [(&mut kept, mine), (&mut fresh, checked(allreduce(n)))] {
                let Inline::Running(w, ()) = g.submit_inline(ms(at), &c, |_, _| ()).unwrap() else { panic!() };
                g.finish_inline(ms(at + 3), w, []);
            }
            assert_eq!(kept.dump(), fresh.dump(), "after work {i}");
        }
        // One left running, then handed to the usual path: its entry moves on as any does.
        for g in [&mut kept, &mut fresh] {
            let Inline::Running(w, ()) = g.submit_inline(ms(100), &four, |_, _| ()).unwrap() else { panic!() };
            let id = w.id();
            g.adopt_inline(w, allreduce(4));
            g.handle_completion(ms(107), id, Completion::Failed { rank: Some(Rank(1)), message: "x".into() });
        }
        assert_eq!(kept.dump(), fresh.dump());
    }

    #[test]
    fn an_inline_work_is_numbered_recorded_and_finished_as_a_submitted_one() {
        #[allow(clippy::disallowed_methods)] // the test's one epoch
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // The same times, counted from the epoch by the caller.
        let since = |n| SinceEpoch(Duration::from_millis(n));
        let (mut usual, mut inline, mut counted) = (group_at(t0), group_at(t0), group_at(t0));
        for i in 0..3 {
            let want = run_usual(&mut usual, ms(10 * i), Some(ms(10 * i + 3))).unwrap();
            let first = inline.submit_inline(ms(10 * i), &checked(allreduce(4)), |id, seq| (id, seq)).unwrap();
            let Inline::Running(w, numbers) = first else { panic!("an idle group runs it inline") };
            assert_eq!((w.id(), w.seq()), (want.id, want.seq));
            assert_eq!(numbers, (want.id, want.seq), "`first` ran with the work's numbers");
            assert_eq!(inline.in_flight(), 0, "it stays with the caller");
            assert!(inline.poll_launch().is_none());
            assert_eq!(inline.finish_inline(ms(10 * i + 3), w, []), want);
            assert!(drain_events(&mut inline).is_empty(), "its summary was returned, not queued");
            let Inline::Running(w, ()) =
                counted.submit_inline(since(10 * i), &checked(allreduce(4)), |_, _| ()).unwrap()
            else {
                panic!("an idle group runs it inline")
            };
            assert_eq!(counted.finish_inline(since(10 * i + 3), w, []), want, "times counted from the epoch");
        }
        assert_eq!(inline.dump(), usual.dump(), "the same flight-recorder entries, times and statuses");
        assert_eq!(counted.dump(), usual.dump(), "and with times counted from the epoch");

        // Adopted: it finishes by the usual completion, as the usual work does.
        let want = run_usual(&mut usual, ms(40), Some(ms(45))).unwrap();
        let Inline::Running(w, ()) = inline.submit_inline(ms(40), &checked(allreduce(4)), |_, _| ()).unwrap() else {
            panic!()
        };
        let id = w.id();
        inline.adopt_inline(w, allreduce(4));
        assert_eq!(inline.work_state(id), Some(WorkState::Started));
        assert!(inline.poll_launch().is_none(), "it was launched when it started");
        inline.handle_completion(ms(45), id, Completion::Success);
        assert_eq!(drain_events(&mut inline), vec![Event::WorkFinished(want)]);
        assert_eq!(inline.dump(), usual.dump());

        // Adopted and never answered: it times out at its submission plus the timeout, with
        // what the usual work's timeout says; both groups then refuse the next submit alike.
        run_usual(&mut usual, ms(50), None);
        let Inline::Running(w, ()) = inline.submit_inline(ms(50), &checked(allreduce(4)), |_, _| ()).unwrap() else {
            panic!()
        };
        inline.adopt_inline(w, allreduce(4));
        for g in [&mut usual, &mut inline] {
            g.handle_timeout(ms(50) + Duration::from_secs(10) - Duration::from_millis(1));
            assert!(drain_events(g).is_empty(), "not before its deadline");
        }
        let deadline = ms(50) + Duration::from_secs(10);
        let ends: Vec<Vec<Event>> = [&mut usual, &mut inline]
            .into_iter()
            .map(|g| {
                g.handle_timeout(deadline);
                g.handle_timeout(deadline + CENSUS_WINDOW);
                drain_events(g)
            })
            .collect();
        assert!(ends[0].iter().any(|e| matches!(e, Event::GroupFailed(_))), "{:?}", ends[0]);
        assert_eq!(ends[0], ends[1]);
        assert_eq!(inline.dump(), usual.dump());
        // A failed group takes nothing inline: the caller's usual submit is refused.
        let mut ran = false;
        let busy = inline.submit_inline(ms(60_000), &checked(allreduce(4)), |_, _| ran = true);
        assert!(matches!(busy, Ok(Inline::Busy)) && !ran, "`first` does not run on a failed group");
        let refused = |g: &mut GroupState| g.submit(ms(60_000), allreduce(4)).unwrap_err();
        assert_eq!(refused(&mut inline), refused(&mut usual));
        assert_eq!(inline.dump(), usual.dump(), "the refusal recorded alike");
    }

    #[test]
    fn a_busy_group_takes_nothing_inline() {
        let (mut g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(4)).unwrap();
        let mut ran = false;
        match g.submit_inline(t0, &checked(allreduce(4)), |_, _| ran = true).unwrap() {
            Inline::Busy => {}
            Inline::Running(w, ()) => panic!("{w:?} ran inline beside work {a}"),
        }
        assert!(!ran, "`first` runs only for a work that runs inline");
        assert_eq!(g.seq(), SeqNo(1), "nothing was numbered");
        assert_eq!(std::iter::from_fn(|| g.poll_launch()).map(|l| l.id).collect::<Vec<_>>(), vec![a]);
        // Point-to-point ops never run inline.
        let (mut g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        let send = Collective::new(OpType::Send).inputs(vec![TensorSpec::new(DType::F32, &[4])]).peer(Rank(1), 0);
        assert!(matches!(g.submit_inline(t0, &checked(send), |_, _| panic!("not inline")), Ok(Inline::Busy)));
    }

    #[test]
    fn a_description_checked_for_another_group_is_checked_again() {
        let (mut g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        let bcast =
            |root| Collective::new(OpType::Broadcast).inputs(vec![TensorSpec::new(DType::F32, &[4])]).root(Rank(root));
        // Root 3 is a rank of a group of four, not of this one of two.
        let elsewhere = Checked::new(bcast(3), Rank(0), 4).unwrap();
        let refused = g.submit_inline(t0, &elsewhere, |_, _| panic!("refused before its frame")).unwrap_err();
        assert_eq!(refused, Checked::new(bcast(3), Rank(0), 2).unwrap_err());
        assert!(matches!(refused, SubmitError::InvalidRoot { .. }), "{refused:?}");
        assert_eq!(g.seq(), SeqNo(0), "nothing was numbered");
        let Inline::Running(w, ()) = g.submit_inline(t0, &checked(bcast(1)), |_, _| ()).unwrap() else { panic!() };
        assert_eq!(w.seq(), SeqNo(1));
    }

    #[test]
    fn works_launch_and_finish_in_issue_order() {
        let (mut g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(4)).unwrap();
        let b = g.submit(t0, allreduce(4)).unwrap();
        let launches: Vec<_> = std::iter::from_fn(|| g.poll_launch()).collect();
        assert_eq!(launches.iter().map(|l| (l.id, l.seq)).collect::<Vec<_>>(), vec![(a, SeqNo(1)), (b, SeqNo(2))]);
        g.handle_started(t0, a);
        g.handle_started(t0, b);
        g.handle_completion(t0 + Duration::from_millis(5), b, Completion::Success);
        assert!(drain_events(&mut g).is_empty(), "b must wait for a");
        g.handle_completion(t0 + Duration::from_millis(7), a, Completion::Success);
        assert_eq!(finished(&drain_events(&mut g)), vec![(a, WorkState::Completed), (b, WorkState::Completed)]);
        assert_eq!(g.in_flight(), 0);
    }

    #[test]
    fn max_in_flight_holds_later_launches() {
        let (mut g, t0) = group(2, 1, ErrorHandling::CleanUpOnly);
        g.cfg.max_in_flight = 1;
        let a = g.submit(t0, allreduce(1)).unwrap();
        let b = g.submit(t0, allreduce(1)).unwrap();
        assert_eq!(g.poll_launch().map(|l| l.id), Some(a));
        assert_eq!(g.poll_launch(), None);
        g.handle_completion(t0, a, Completion::Success);
        assert_eq!(g.poll_launch().map(|l| l.id), Some(b));
    }

    #[test]
    fn timeout_names_op_seq_and_missing_ranks_then_refuses_later_submits() {
        let (mut g, t0) = group(4, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(1024)).unwrap();
        g.poll_launch();
        g.handle_started(t0, a);
        g.handle_waiting_on(t0, a, &[Rank(2)]);
        // First the stuck note, halfway; then the deadline.
        assert_eq!(g.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        g.handle_timeout(t0 + Duration::from_secs(9));
        assert_eq!(g.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        let stuck: Vec<_> = std::iter::from_fn(|| g.poll_transmit()).map(|t| t.to).collect();
        assert_eq!(stuck, vec![Rank(1), Rank(2), Rank(3)]);
        assert!(drain_events(&mut g).is_empty());
        g.handle_timeout(t0 + Duration::from_secs(10));
        g.handle_timeout(t0 + Duration::from_secs(10) + CENSUS_WINDOW);
        let events = drain_events(&mut g);
        let Event::WorkFinished(s) = &events[0] else { panic!("{events:?}") };
        assert_eq!(s.lifecycle.state(), WorkState::TimedOut);
        let text = s.result.to_string();
        assert!(text.contains("all_reduce (seq 1, numel in 1024"), "{text}");
        assert!(text.contains("still waiting for rank(s) [2]"), "{text}");
        assert!(matches!(&events[1], Event::GroupFailed(f) if f.culprit() == Some(Rank(2))));
        // Peers are told, and the next submit is refused with the original cause.
        let told: Vec<_> = std::iter::from_fn(|| g.poll_transmit())
            .filter(|t| matches!(t.msg, ControlMsg::Error { .. }))
            .map(|t| t.to)
            .collect();
        assert_eq!(told, vec![Rank(1), Rank(2), Rank(3)]);
        let err = g.submit(t0 + Duration::from_secs(11), allreduce(1)).unwrap_err();
        assert!(err.to_string().contains("still waiting for rank(s) [2]"), "{err}");
        g.handle_timeout(t0 + Duration::from_secs(100));
        assert!(drain_events(&mut g).is_empty(), "a repeated timeout does nothing");
    }

    #[test]
    fn peer_lost_fails_dependent_works_naming_the_rank() {
        let (mut g, t0) = group(3, 0, ErrorHandling::NoHandling);
        let send_to_1 = g
            .submit(t0, Collective::new(OpType::Send).inputs(vec![TensorSpec::new(DType::U8, &[3])]).peer(Rank(1), 7))
            .unwrap();
        let send_to_2 = g
            .submit(t0, Collective::new(OpType::Send).inputs(vec![TensorSpec::new(DType::U8, &[3])]).peer(Rank(2), 7))
            .unwrap();
        g.handle_peer_lost(t0, Rank(2), "EOF".into());
        let events = drain_events(&mut g);
        assert!(matches!(&events[0], Event::PeerLost { rank: Rank(2), .. }));
        // send_to_2 failed, but it finishes only after send_to_1 (issue order).
        assert_eq!(finished(&events), vec![]);
        g.handle_completion(t0, send_to_1, Completion::Success);
        let events = drain_events(&mut g);
        assert_eq!(finished(&events), vec![(send_to_1, WorkState::Completed), (send_to_2, WorkState::Failed)]);
        let Event::WorkFinished(s) = &events[1] else { unreachable!() };
        assert_eq!(s.result.culprit(), Some(Rank(2)));
        assert!(s.result.to_string().contains("connection to rank 2 lost: EOF"));
        // NoHandling: the group goes on, but nothing that needs rank 2 is accepted.
        assert!(g.failure().is_none());
        assert!(matches!(g.submit(t0, allreduce(1)), Err(SubmitError::PeerLost { rank: Rank(2), .. })));
        g.submit(t0, Collective::new(OpType::Recv).inputs(vec![TensorSpec::new(DType::U8, &[1])]).peer(Rank(1), 0))
            .unwrap();
    }

    #[test]
    fn a_clean_departure_fails_nothing_by_itself() {
        let (mut g, t0) = group(3, 0, ErrorHandling::CleanUpOnly);
        let id = g.submit(t0, allreduce(1)).unwrap();
        g.handle_peer_departed(t0, Rank(2));
        assert_eq!(drain_events(&mut g), vec![Event::PeerDeparted { rank: Rank(2) }]);
        assert!(g.failure().is_none());
        // The data plane decides: this work had everything from rank 2 and completes.
        g.poll_launch();
        g.handle_completion(t0, id, Completion::Success);
        assert_eq!(finished(&drain_events(&mut g)), vec![(id, WorkState::Completed)]);
        // A departed peer that later drops is not "lost" again.
        g.handle_peer_departed(t0, Rank(2));
        assert!(drain_events(&mut g).is_empty());
    }

    #[test]
    fn abort_ends_every_work_aborted_and_refuses_later_submits() {
        let (mut g, t0) = group(2, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(1)).unwrap();
        let b = g.submit(t0, allreduce(1)).unwrap();
        g.handle_abort(t0, "user asked".into());
        let events = drain_events(&mut g);
        assert_eq!(finished(&events), vec![(a, WorkState::Aborted), (b, WorkState::Aborted)]);
        assert!(matches!(g.poll_transmit(), Some(Transmit { to: Rank(1), msg: ControlMsg::Abort { .. } })));
        assert_eq!(g.submit(t0, allreduce(1)), Err(SubmitError::Aborted { cause: "user asked".into() }));
        g.handle_abort(t0, "again".into());
        assert!(drain_events(&mut g).is_empty());
    }

    #[test]
    fn a_remote_abort_is_relayed_to_the_others_but_not_echoed() {
        let (mut g, t0) = group(4, 1, ErrorHandling::CleanUpOnly);
        g.handle_message(t0, Rank(2), ControlMsg::Abort { reason: "rank 2 leaves".into() });
        let sent: Vec<(Rank, ControlMsg)> = std::iter::from_fn(|| g.poll_transmit()).map(|t| (t.to, t.msg)).collect();
        let reason = "rank 2 aborted the group: rank 2 leaves".to_owned();
        assert_eq!(
            sent,
            vec![
                (Rank(0), ControlMsg::Abort { reason: reason.clone() }),
                (Rank(3), ControlMsg::Abort { reason: reason.clone() })
            ]
        );
        assert_eq!(g.submit(t0, allreduce(1)), Err(SubmitError::Aborted { cause: reason }));
        // A relay coming back changes nothing.
        g.handle_message(t0, Rank(0), ControlMsg::Abort { reason: "again".into() });
        assert!(g.poll_transmit().is_none());
    }

    #[test]
    fn remote_error_names_the_origin_and_is_relayed_to_the_others_but_not_echoed() {
        let (mut g, t0) = group(4, 1, ErrorHandling::TearDown);
        let a = g.submit(t0, allreduce(1)).unwrap();
        g.handle_message(
            t0,
            Rank(3),
            ControlMsg::Error {
                origin: Rank(3),
                blame: Blame::rank(Rank(2)),
                message: "rank 3: connection to rank 2 lost: EOF".into(),
            },
        );
        let events = drain_events(&mut g);
        let Event::WorkFinished(s) = &events[0] else { panic!() };
        assert_eq!(s.id, a);
        // The origin is rank 3; the rank it blamed is the culprit.
        assert!(matches!(s.result, WorkResult::RemoteError { rank: Rank(3), blame: Blame::Ranks { .. }, .. }));
        assert_eq!(s.result.culprit(), Some(Rank(2)));
        assert!(matches!(&events[1], Event::GroupFailed(f) if f.origin == Rank(3) && f.culprit() == Some(Rank(2))));
        assert!(matches!(&events[2], Event::TearDown { .. }));
        // Relayed with its culprit to every peer but the origin.
        let mut relayed = Vec::new();
        while let Some(t) = g.poll_transmit() {
            assert!(matches!(&t.msg, ControlMsg::Error { origin: Rank(3), blame: Blame::Ranks { .. }, .. }), "{t:?}");
            relayed.push(t.to);
        }
        assert_eq!(relayed, vec![Rank(0), Rank(2)]);
    }

    /// Rank 0 of 3 with heartbeats every 100 ms, a peer lost after 350 ms of silence.
    fn heartbeating(lazy_peers: bool) -> (GroupState, Instant) {
        let mut cfg = GroupConfig::new(3);
        cfg.lazy_peers = lazy_peers;
        cfg.heartbeat =
            Some(HeartbeatConfig { interval: Duration::from_millis(100), dead_after: Duration::from_millis(350) });
        #[allow(clippy::disallowed_methods)] // the test's one epoch
        let t0 = Instant::now();
        (GroupState::new(cfg, Rank(0), t0), t0)
    }

    #[test]
    fn heartbeats_are_sent_and_silence_loses_the_peer() {
        let (mut g, t0) = heartbeating(false);
        let ms = |m| t0 + Duration::from_millis(m);
        g.handle_timeout(ms(0));
        assert_eq!(std::iter::from_fn(|| g.poll_transmit()).count(), 2);
        for t in [100, 200, 300] {
            g.handle_timeout(ms(t));
            g.handle_peer_activity(ms(t), Rank(1));
        }
        assert_eq!(std::iter::from_fn(|| g.poll_transmit()).count(), 6);
        g.handle_timeout(ms(360));
        let events = drain_events(&mut g);
        assert!(
            matches!(&events[0], Event::PeerLost { rank: Rank(2), reason } if reason.contains("350 ms")),
            "{events:?}"
        );
        assert!(matches!(&events[1], Event::GroupFailed(f) if f.culprit() == Some(Rank(2))));
        assert_eq!(g.last_timeout_reason(), Some(TimerKind::PeerSilence(Rank(2))));
    }

    #[test]
    fn an_inline_work_notes_its_peers_as_heard_from_at_most_once_in_inline_heard_every() {
        // Rank 1 is heard from by inline works at 100, 200 and 300 ms; rank 2 only by one that
        // ends `gap` after the last of those. Rank 2's silence timer fires at 350 ms.
        let lost_at_360 = |gap: Duration| {
            let (mut g, t0) = heartbeating(false);
            let ms = |m| t0 + Duration::from_millis(m);
            g.handle_timeout(ms(0));
            let c = Checked::new(allreduce(4), Rank(0), 3).unwrap();
            let mut inline = |at: Instant, from: Rank| {
                let Inline::Running(w, ()) = g.submit_inline(at, &c, |_, _| ()).unwrap() else { panic!() };
                g.finish_inline(at, w, [from]);
            };
            for t in [100, 200, 300] {
                inline(ms(t), Rank(1));
            }
            inline(ms(300) + gap, Rank(2));
            g.handle_timeout(ms(360));
            let lost: Vec<Rank> = drain_events(&mut g)
                .into_iter()
                .filter_map(|e| match e {
                    Event::PeerLost { rank, .. } => Some(rank),
                    _ => None,
                })
                .collect();
            lost
        };
        assert_eq!(lost_at_360(INLINE_HEARD_EVERY), [], "both heard from in time");
        assert_eq!(lost_at_360(INLINE_HEARD_EVERY / 2), [Rank(2)], "rank 2's work came too soon to be noted");
    }

    #[test]
    fn lazy_peers_get_heartbeats_and_silence_watch_only_once_connected() {
        let (mut g, t0) = heartbeating(true);
        let ms = |m| t0 + Duration::from_millis(m);
        g.handle_timeout(ms(0));
        assert_eq!(g.poll_transmit(), None, "nobody is connected yet");
        assert!(!g.is_connected(Rank(1)));
        // Silence from a peer never connected loses nobody.
        g.handle_timeout(ms(1000));
        assert!(drain_events(&mut g).is_empty());
        assert_eq!(g.poll_transmit(), None);
        g.handle_peer_connected(ms(1000), Rank(1));
        assert!(g.is_connected(Rank(1)));
        g.handle_timeout(ms(1100));
        let to: Vec<Rank> = std::iter::from_fn(|| g.poll_transmit()).map(|t| t.to).collect();
        assert_eq!(to, vec![Rank(1)]);
        // Connected at 1000 ms, silent since: lost at 1350 ms, naming it.
        g.handle_timeout(ms(1360));
        let events = drain_events(&mut g);
        assert!(matches!(&events[0], Event::PeerLost { rank: Rank(1), .. }), "{events:?}");
    }

    #[test]
    fn arguments_are_checked_before_anything_is_sent() {
        let (mut g, t0) = group(4, 0, ErrorHandling::CleanUpOnly);
        let bcast = Collective::new(OpType::Broadcast).inputs(vec![TensorSpec::new(DType::F32, &[2])]).root(Rank(4));
        assert_eq!(
            g.submit(t0, bcast).unwrap_err().to_string(),
            "broadcast: invalid root rank 4: the group has world size 4"
        );
        let empty = Collective::new(OpType::Allreduce);
        assert_eq!(
            g.submit(t0, empty).unwrap_err().to_string(),
            "all_reduce: invalid argument tensors: requires at least one tensor"
        );
        let gather = Collective::new(OpType::Allgather)
            .inputs(vec![TensorSpec::new(DType::F32, &[2])])
            .outputs(vec![TensorSpec::new(DType::F32, &[2]); 3]);
        assert_eq!(
            g.submit(t0, gather).unwrap_err().to_string(),
            "all_gather: invalid argument output_tensor_list: expected 4 tensors (one per rank), got 3"
        );
        let mixed = Collective::new(OpType::Allreduce)
            .inputs(vec![TensorSpec::new(DType::F32, &[2]), TensorSpec::new(DType::F64, &[2])]);
        assert!(g.submit(t0, mixed).unwrap_err().to_string().contains("tensor 1 has dtype float64"));
        let to_self = Collective::new(OpType::Send).inputs(vec![TensorSpec::new(DType::F32, &[2])]).peer(Rank(0), 0);
        assert!(g.submit(t0, to_self).is_err());
        let splits = Collective {
            splits: Some((vec![1, 1, 1, 1], vec![1, 1, 1])),
            ..Collective::new(OpType::AlltoallBase)
                .inputs(vec![TensorSpec::new(DType::F32, &[4])])
                .outputs(vec![TensorSpec::new(DType::F32, &[4])])
        };
        assert_eq!(
            g.submit(t0, splits).unwrap_err().to_string(),
            "all_to_all_single: invalid argument output_split_sizes: expected 4 split sizes (one per rank), got 3"
        );
        assert_eq!(g.seq(), SeqNo(0), "refused submits take no sequence number");
    }

    #[test]
    fn a_timeout_asks_every_rank_what_it_runs_and_blames_the_deviant_not_the_chain() {
        // Rank 0 waits for rank 1 in all_reduce (seq 1). Rank 2 runs a broadcast there; rank 3
        // has not reached seq 1 (it answers "not there").
        let (mut g, t0) = waiting_on_rank_1();
        let deadline = t0 + Duration::from_secs(10);
        g.handle_timeout(deadline);
        assert!(g.failure().is_none(), "the work waits for the census");
        let votes: Vec<Transmit> = std::iter::from_fn(|| g.poll_transmit())
            .filter(|t| matches!(t.msg, ControlMsg::Census { seq: SeqNo(1), sig: Some(_) }))
            .collect();
        assert_eq!(votes.len(), 3, "its vote goes to every peer");
        let mine = Signature::of(&allreduce(4));
        let bcast = Signature { op: OpType::Broadcast, root: Some(Rank(0)), ..mine };
        g.handle_message(deadline, Rank(1), ControlMsg::Census { seq: SeqNo(1), sig: Some(mine) });
        g.handle_message(deadline, Rank(3), ControlMsg::Census { seq: SeqNo(1), sig: None });
        assert!(g.failure().is_none(), "rank 2 has not answered");
        g.handle_message(deadline, Rank(2), ControlMsg::Census { seq: SeqNo(1), sig: Some(bcast) });
        let failure = g.failure().expect("every rank answered: the verdict is in").clone();
        assert_eq!(failure.blame, Blame::rank(Rank(2)), "{}", failure.message);
        assert!(failure.message.contains("so rank 2 deviated"), "{}", failure.message);
        let finished = drain_events(&mut g);
        assert!(
            finished.iter().any(|e| matches!(e, Event::WorkFinished(s) if s.lifecycle.state() == WorkState::TimedOut))
        );
    }

    #[test]
    fn a_mismatch_is_held_for_the_census_and_a_rank_behind_is_waited_for_until_the_deadline() {
        let (mut g, t0) = group(3, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(8)).unwrap();
        g.poll_launch();
        g.handle_started(t0, a);
        g.handle_completion(t0, a, Completion::Mismatch { rank: Rank(1), message: "rank 1 sent 3 bytes".into() });
        assert!(g.failure().is_none());
        // Rank 2 has not reached the collective: waited for, until the census deadline.
        g.handle_message(t0, Rank(2), ControlMsg::Census { seq: SeqNo(1), sig: None });
        let odd = Signature { numel: 3, ..Signature::of(&allreduce(8)) };
        g.handle_message(t0, Rank(1), ControlMsg::Census { seq: SeqNo(1), sig: Some(odd) });
        assert!(g.failure().is_none(), "rank 2 may still come");
        g.handle_timeout(t0 + CENSUS_WINDOW);
        let failure = g.failure().expect("decided at the deadline").clone();
        // Rank 0 against rank 1, one each: no majority in a group of three.
        assert_eq!(failure.blame, Blame::undecided([Rank(0), Rank(1)]), "{}", failure.message);
        // The same with rank 2 answering, agreeing with rank 0: rank 1 is the deviant.
        let (mut g, t0) = group(3, 0, ErrorHandling::CleanUpOnly);
        let a = g.submit(t0, allreduce(8)).unwrap();
        g.poll_launch();
        g.handle_started(t0, a);
        g.handle_completion(t0, a, Completion::Mismatch { rank: Rank(1), message: "rank 1 sent 3 bytes".into() });
        g.handle_message(t0, Rank(1), ControlMsg::Census { seq: SeqNo(1), sig: Some(odd) });
        g.handle_message(t0, Rank(2), ControlMsg::Census { seq: SeqNo(1), sig: Some(Signature::of(&allreduce(8))) });
        assert_eq!(g.failure().expect("all voted").blame, Blame::rank(Rank(1)));
    }
}
