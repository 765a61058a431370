//! The flight recorder: the last N collectives of every process group on this rank, for
//! post-mortem analysis of hangs (PyTorch's c10d `FlightRecorder`).
//!
//! A [`FlightRecorder`] is a bounded ring of entries. Each collective or point-to-point op is
//! [`record`](FlightRecorder::record)ed when it is enqueued, which hands back a [`RecordId`];
//! the owner then reports its transitions with that id. When the ring is full, recording
//! overwrites the oldest entry; a transition on an overwritten entry is a silent no-op, as in
//! torch. [`dump`](FlightRecorder::dump) returns the whole state as a [`Dump`]: PyTorch's
//! flight-recorder JSON schema, version `"2.10"`, readable by torch's analyzer and by ours.
//!
//! # Calling contract
//!
//! 1. [`record_group`](FlightRecorder::record_group) once per process group this rank belongs
//!    to (fills `pg_config`; torch's `record_pg_ranks`).
//! 2. [`record`](FlightRecorder::record) when a work is enqueued: `Some(id)`, or `None` when the
//!    recorder is off (capacity 0). A work enqueued and started at once takes
//!    [`record_started`](FlightRecorder::record_started); one of the same group, profiling
//!    name and tensors as a live entry may take [`record_again`](FlightRecorder::record_again),
//!    which copies those instead of looking them up (a loop of one small collective records
//!    each work so), and leaves the same entry.
//! 3. [`handle_started`](FlightRecorder::handle_started) when the work starts running.
//! 4. Exactly one terminal report: [`handle_completed`](FlightRecorder::handle_completed), or
//!    [`handle_finished`](FlightRecorder::handle_finished) with the work's [`WorkResult`].
//! 5. [`dump`](FlightRecorder::dump) at any time; [`reset`](FlightRecorder::reset) to begin a
//!    new epoch (torch's `reset_all`).
//!
//! Transitions take the record's id first, then `now`. Repeated or out-of-order transitions
//! (start after completion, a second terminal report) change nothing. Nothing here panics on
//! caller input.
//!
//! # Time
//!
//! Core reads no clock: every input takes `now`, the monotonic time since the group epoch, and
//! the constructor takes `wall_epoch_ns`, the Unix time in ns at that epoch. Wall times in the
//! dump are `wall_epoch_ns + now`.
//!
//! # How torch's fields are kept
//!
//! - `state` is torch's: `scheduled` until started, `started` until completed, `completed`.
//!   A work that fails, times out or is aborted keeps the `state` it had (torch cannot say
//!   more); its real outcome and error text are in the extra `cohort_state`, `cohort_error`
//!   and `cohort_time_finished_ns` fields, which torch's readers ignore.
//! - `retired` becomes true when the work reaches any terminal state. torch's watchdog calls
//!   `retire_id` when it sees a work complete, and a work it drops without completion is "a
//!   retired but not completed event" (timed out); cohort's core sees both at the terminal
//!   transition, so retiring is part of it rather than a separate call.
//! - `duration_ms` is set on completion when [`RecorderConfig::timing`] is on and the work was
//!   seen to start (torch: `TORCH_NCCL_ENABLE_TIMING`).
//! - `pg_status` follows collectives only (`is_p2p == false`): `last_enqueued_collective` is
//!   set on record and `last_completed_collective` on completion (assigned, as torch's
//!   `ProcessGroupNCCL` does), `last_started_collective` on start (only ever raised, as torch).
//!   All three start at `-1`.
//! - `record_id` counts every record since the last reset (torch's `id_`), so it keeps
//!   counting when the ring wraps.
//!
//! # Reset epochs
//!
//! torch 2.10 soft-deletes on `reset_all` (used when a communicator is reset): it bumps
//! `reset_epoch_`, restarts `id_` at 0, and dumps only entries of the current epoch; a
//! `retire_id` with an older epoch finds no live entry. [`reset`](FlightRecorder::reset) does
//! the same: ids from before the reset become no-ops, the dump's `record_id`s restart at 0,
//! and earlier entries vanish from dumps (their slots are reused as the ring turns). Like
//! torch, a reset before anything was ever recorded does nothing. Unlike torch, it also puts
//! every group's `pg_status` back to `-1`, since the entries those numbers pointed at are gone;
//! `pg_config` is kept.

mod dump;
mod shapes;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

pub use self::dump::{DUMP_VERSION, Dump, DumpEntry, DumpError, EntryState, Frame, PgConfig, PgStatus};
use crate::tensor::{DType, Tensor};
use crate::work::{Rank, WorkResult, WorkState};

/// torch's default ring size (`TORCH_FR_BUFFER_SIZE`, formerly `TORCH_NCCL_TRACE_BUFFER_SIZE`).
pub const DEFAULT_CAPACITY: usize = 2000;

/// How a [`FlightRecorder`] is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecorderConfig {
    /// Number of entries kept; 0 turns the recorder off (every call is a no-op).
    pub capacity: usize,
    /// Whether completions set `duration_ms` (torch: `TORCH_NCCL_ENABLE_TIMING`, off by default).
    pub timing: bool,
}

impl RecorderConfig {
    /// `capacity` entries (0: off), timing off.
    pub fn new(capacity: usize) -> Self {
        RecorderConfig { capacity, timing: false }
    }
}

impl Default for RecorderConfig {
    fn default() -> Self {
        RecorderConfig { capacity: DEFAULT_CAPACITY, timing: false }
    }
}

/// A handle on a recorded entry, for its later transitions (torch's `TraceIdentifier`).
///
/// It names one record for the life of the recorder: once the entry has been overwritten, or a
/// [`reset`](FlightRecorder::reset) has begun a new epoch, transitions with it do nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId {
    /// Which record (counting every record ever made).
    seq: u64,
    /// Its slot in the ring, `seq % capacity`, kept so that a transition finds it without a
    /// division.
    index: usize,
}

/// A collective's numbers in its entry, torch's `collective_seq_id`, `p2p_seq_id` and `op_id`
/// (as a [`RecordRequest`] has them), for [`FlightRecorder::record_again`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordNumbers {
    /// The group's collective sequence number.
    pub collective_seq_id: u64,
    /// The group's point-to-point sequence number so far.
    pub p2p_seq_id: u64,
    /// The work's id.
    pub op_id: u64,
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "record#{}", self.seq)
    }
}

/// A [`RecordRequest`]'s profiling name: its text, or the id this recorder's
/// [`intern_name`](FlightRecorder::intern_name) gave that text, which records it without
/// hashing it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfilingName<'a> {
    /// The name itself.
    Text(&'a str),
    /// A name interned earlier by the same recorder. An id beyond those it gave records as
    /// `(unknown profiling name)`; another recorder's id names whatever this one interned
    /// under the same number.
    Interned(NameId),
}

impl<'a> From<&'a str> for ProfilingName<'a> {
    fn from(name: &'a str) -> Self {
        ProfilingName::Text(name)
    }
}

/// An interned profiling name (see [`ProfilingName::Interned`]); valid for the life of the
/// recorder that gave it (a [`reset`](FlightRecorder::reset) keeps names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NameId(u32);

/// Anything with a dtype and a shape: what a [`RecordRequest`] lists as inputs and outputs.
/// Implemented for [`Tensor`] and [`TensorMeta`]; argument specs elsewhere can implement it too.
pub trait TensorShape {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Shape.
    fn shape(&self) -> &[usize];
}

impl TensorShape for Tensor {
    fn dtype(&self) -> DType {
        Tensor::dtype(self)
    }

    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
}

/// A tensor's dtype and shape, for a [`RecordRequest`] made without the tensor at hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorMeta<'a> {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: &'a [usize],
}

impl TensorShape for TensorMeta<'_> {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }
}

impl<'a> From<&'a Tensor> for TensorMeta<'a> {
    fn from(t: &'a Tensor) -> Self {
        TensorMeta { dtype: t.dtype(), shape: t.shape() }
    }
}

/// What [`FlightRecorder::record`] records: torch's `record(...)` arguments. Borrowed, so that
/// recording copies numbers only (names are interned, sizes go into reused buffers).
#[derive(Debug)]
pub struct RecordRequest<'a, T = TensorMeta<'a>> {
    /// The group's uid (torch's `pg_id`, `ProcessGroupNCCL::uid_`).
    pub pg_id: u64,
    /// The group's name (the first of torch's `process_group` pair).
    pub pg_name: &'a str,
    /// The group's description (the second of the pair; torch uses `"undefined"` when unset).
    pub pg_desc: &'a str,
    /// Collective sequence number in the group.
    pub collective_seq_id: u64,
    /// Point-to-point sequence number in the group.
    pub p2p_seq_id: u64,
    /// Logical op number (one per op inside a coalesced group).
    pub op_id: u64,
    /// `backend:op`, built from the backend name and [`OpType::name`](crate::work::OpType::name),
    /// e.g. `gloo:all_reduce`; torch's analyzer expects `nccl:send 0->1` / `nccl:recv 1<-0`
    /// (group ranks) for point-to-point ops. The text, or (on a hot path) the id
    /// [`FlightRecorder::intern_name`] gave it.
    pub profiling_name: ProfilingName<'a>,
    /// Input tensors (their dtypes and shapes).
    pub inputs: &'a [T],
    /// Output tensors.
    pub outputs: &'a [T],
    /// The work's timeout.
    pub timeout: Duration,
    /// Whether it is a point-to-point op.
    pub is_p2p: bool,
}

impl<T> Clone for RecordRequest<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for RecordRequest<'_, T> {}

/// Who is dumping, and what to include: the arguments of [`FlightRecorder::dump`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpMeta {
    /// The rank writing the dump (cohort extra `rank`).
    pub rank: Rank,
    /// Its world size (cohort extra `world_size`).
    pub world_size: u32,
    /// The communication library's version (`comm_lib_version`).
    pub comm_lib_version: String,
    /// Leave out completed entries (torch's `onlyActive` / `TORCH_INCLUDE_ONLY_ACTIVE`).
    pub only_active: bool,
}

impl DumpMeta {
    /// A dump of every entry by `rank` of `world_size`, with no library version.
    pub fn new(rank: Rank, world_size: u32) -> Self {
        DumpMeta { rank, world_size, comm_lib_version: String::new(), only_active: false }
    }
}

/// Ranks as runs of consecutive ranks, each its first and last.
type RankRuns = Vec<(u64, u64)>;

/// The flight recorder of one rank: a bounded ring of entries over all its process groups.
/// See the [module docs](self) for the calling contract.
#[derive(Debug)]
pub struct FlightRecorder {
    config: RecorderConfig,
    wall_epoch_ns: u64,
    /// Entry `n` (counting every record ever made) lives at `slots[n % capacity]`.
    slots: Slots,
    /// Number of records ever made.
    recorded: u64,
    /// `recorded % capacity`, the slot the next record writes, kept as it moves: the capacity
    /// is rarely a power of two, and a 64-bit division costs tens of cycles.
    next_index: usize,
    /// Current reset epoch, and the value of `recorded` when it began.
    epoch: u64,
    epoch_start: u64,
    reset_at: Option<Duration>,
    /// Interned `(pg_id, name, desc)` triples that entries point at.
    groups: Vec<GroupKey>,
    /// `pg_status`, by pg id: the index of each group's in `status_slots`.
    statuses: BTreeMap<u64, u32>,
    /// The `pg_status`es, in the order their groups were first seen (an interned group names
    /// its own, so that a transition finds it without a lookup).
    status_slots: Vec<PgStatus>,
    /// `pg_config`: name → (desc, ranks as runs of consecutive ranks, first and last): a group
    /// of consecutive ranks, the world's above all, costs one run however many ranks it has.
    pg_config: BTreeMap<Box<str>, (Box<str>, RankRuns)>,
    /// Interned profiling names. Grows with the number of distinct names (ops × backends, and
    /// peers for point-to-point ops), never with the number of records.
    names: Vec<Box<str>>,
    name_index: HashMap<Box<str>, u32>,
    /// The tensor lists entries describe, each distinct one once: a slot holds its list's id.
    shapes: shapes::Shapes,
}

#[derive(Debug)]
struct GroupKey {
    pg_id: u64,
    name: Box<str>,
    desc: Box<str>,
    /// Its `pg_status` in `status_slots`.
    status: u32,
}

/// The ring's slots, made in chunks of [`Slots::CHUNK`] as the ring fills: a recorder holds
/// memory for the entries it has recorded, not for its capacity (a rank of a large simulated
/// job records a few entries of its 2,000), and a slot never moves once made. A ring that grew
/// as one vector moved every slot at each doubling, which took 0.4-5 ms on a 2-core VM (a fresh
/// region of the allocator's) in the middle of a job's first thousand collectives.
#[derive(Debug, Default)]
struct Slots {
    chunks: Vec<Vec<Slot>>,
    len: usize,
}

impl Slots {
    const CHUNK: usize = 64;

    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, slot: Slot) {
        if self.len.is_multiple_of(Self::CHUNK) {
            self.chunks.push(Vec::with_capacity(Self::CHUNK));
        }
        if let Some(chunk) = self.chunks.last_mut() {
            chunk.push(slot);
            self.len += 1;
        }
    }

    fn get(&self, i: usize) -> Option<&Slot> {
        self.chunks.get(i / Self::CHUNK)?.get(i % Self::CHUNK)
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut Slot> {
        self.chunks.get_mut(i / Self::CHUNK)?.get_mut(i % Self::CHUNK)
    }

    /// Slots allocated, made or not.
    #[cfg(test)]
    fn reserved(&self) -> usize {
        self.chunks.iter().map(Vec::capacity).sum()
    }
}

/// One ring entry. Its tensors' description is an id in the recorder's `shapes`, so recording
/// into a full ring allocates nothing for a description already there.
#[derive(Debug)]
struct Slot {
    /// Which record this is (counting every record ever made).
    seq: u64,
    group: u32,
    name: u32,
    collective_seq_id: u64,
    p2p_seq_id: u64,
    op_id: u64,
    is_p2p: bool,
    timeout: Duration,
    created: Duration,
    started: Option<Duration>,
    completed: Option<Duration>,
    finished: Option<Duration>,
    duration: Option<Duration>,
    state: WorkState,
    error: Option<Box<str>>,
    blame: Option<Box<crate::work::Blame>>,
    /// Its inputs' and outputs' shapes and dtypes: an id in the recorder's `shapes`.
    shapes: u32,
}

/// What a new entry says besides its times and state ([`FlightRecorder::write`]): its
/// interned group, profiling name and description (one reference to it, which the entry takes),
/// its numbers, kind and timeout.
struct Entry {
    group: u32,
    name: u32,
    shapes: u32,
    collective_seq_id: u64,
    p2p_seq_id: u64,
    op_id: u64,
    is_p2p: bool,
    timeout: Duration,
}

impl FlightRecorder {
    /// A recorder keeping `config.capacity` entries (0: off), whose group epoch is
    /// `wall_epoch_ns` nanoseconds after the Unix epoch. The ring's slots are made as it fills,
    /// a chunk at a time.
    pub fn new(config: RecorderConfig, wall_epoch_ns: u64) -> Self {
        FlightRecorder {
            slots: Slots::default(),
            config,
            wall_epoch_ns,
            recorded: 0,
            next_index: 0,
            epoch: 0,
            epoch_start: 0,
            reset_at: None,
            groups: Vec::new(),
            statuses: BTreeMap::new(),
            status_slots: Vec::new(),
            pg_config: BTreeMap::new(),
            names: Vec::new(),
            name_index: HashMap::new(),
            shapes: shapes::Shapes::default(),
        }
    }

    /// Whether the recorder records (capacity > 0).
    pub fn is_enabled(&self) -> bool {
        self.config.capacity > 0
    }

    /// The configuration.
    pub fn config(&self) -> RecorderConfig {
        self.config
    }

    /// Number of entries of the current epoch still in the ring.
    pub fn len(&self) -> usize {
        let live = self.recorded - self.epoch_start;
        usize::try_from(live).map_or(self.slots.len(), |live| live.min(self.slots.len()))
    }

    /// Whether the current epoch has no entries in the ring.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The current reset epoch (0 until the first effective [`reset`](Self::reset)).
    pub fn reset_epoch(&self) -> u64 {
        self.epoch
    }

    /// Declare a process group: its `pg_config` entry (by name: a later call for the same name
    /// replaces it) and, for `pg_id`, a `pg_status` at `-1` if it has none yet. torch's
    /// `record_pg_ranks`. No-op when the recorder is off.
    pub fn record_group(&mut self, pg_id: u64, name: &str, desc: &str, ranks: &[u64]) {
        if !self.is_enabled() {
            return;
        }
        let mut runs = RankRuns::new();
        for &r in ranks {
            match runs.last_mut() {
                Some((_, last)) if last.checked_add(1) == Some(r) => *last = r,
                _ => runs.push((r, r)),
            }
        }
        runs.shrink_to_fit();
        self.pg_config.insert(name.into(), (desc.into(), runs));
        self.status_index(pg_id);
    }

    /// Record a work enqueued at `now`; returns the id for its transitions, or `None` when the
    /// recorder is off. At capacity, overwrites the oldest entry. Moves the group's
    /// `last_enqueued_collective` for a collective.
    pub fn record<T: TensorShape>(&mut self, now: Duration, req: &RecordRequest<'_, T>) -> Option<RecordId> {
        self.record_at(now, req, false)
    }

    /// Record a work enqueued and started at `now`, as [`record`](Self::record) then
    /// [`handle_started`](Self::handle_started) at the same `now` would leave it, in one call
    /// (for a work run to its end in its submit call).
    pub fn record_started<T: TensorShape>(&mut self, now: Duration, req: &RecordRequest<'_, T>) -> Option<RecordId> {
        self.record_at(now, req, true)
    }

    fn record_at<T: TensorShape>(
        &mut self,
        now: Duration,
        req: &RecordRequest<'_, T>,
        started: bool,
    ) -> Option<RecordId> {
        if self.config.capacity == 0 {
            return None;
        }
        let group = self.intern_group(req);
        let name = match req.profiling_name {
            ProfilingName::Text(text) => self.intern_name(text).0,
            ProfilingName::Interned(id) if (id.0 as usize) < self.names.len() => id.0,
            ProfilingName::Interned(_) => self.intern_name("(unknown profiling name)").0,
        };
        let shapes = self.shapes.acquire(req.inputs, req.outputs);
        let entry = Entry {
            group,
            name,
            shapes,
            collective_seq_id: req.collective_seq_id,
            p2p_seq_id: req.p2p_seq_id,
            op_id: req.op_id,
            is_p2p: req.is_p2p,
            timeout: req.timeout,
        };
        Some(self.write(now, entry, started, false))
    }

    /// Record a collective enqueued and started at `now`, of the group, profiling name and
    /// tensors the entry `like` has (a loop of one collective: those need no lookup), with
    /// these `numbers` and `timeout`. It leaves what [`record_started`](Self::record_started)
    /// with the same request would.
    /// `None` if `like`'s entry is gone (overwritten, or from before a reset) or is a
    /// point-to-point op's, or the recorder is off: record it in full then.
    pub fn record_again(
        &mut self,
        now: Duration,
        like: RecordId,
        numbers: RecordNumbers,
        timeout: Duration,
    ) -> Option<RecordId> {
        let slot = self.live_slot(like)?;
        if slot.is_p2p {
            return None;
        }
        let (group, name, shapes) = (slot.group, slot.name, slot.shapes);
        let RecordNumbers { collective_seq_id, p2p_seq_id, op_id } = numbers;
        // A live entry's description is pointed at: one more entry now does, unless the entry
        // this one overwrites points at it too (a full ring of one collective), whose reference
        // then passes to this one.
        let inherits = self.slots.get(self.next_index).is_some_and(|next| next.shapes == shapes);
        if !inherits {
            self.shapes.add_ref(shapes);
        }
        let entry = Entry { group, name, shapes, collective_seq_id, p2p_seq_id, op_id, is_p2p: false, timeout };
        Some(self.write(now, entry, true, inherits))
    }

    /// Write `entry` into the next slot as enqueued at `now` (and started then, if `started`),
    /// and move its group's `pg_status`. The entry's reference to its description is counted
    /// already, or, if `inherits`, is the one the overwritten entry held (the same description).
    fn write(&mut self, now: Duration, entry: Entry, started: bool, inherits: bool) -> RecordId {
        let capacity = self.config.capacity;
        let seq = self.recorded;
        self.recorded += 1;
        if !entry.is_p2p {
            let seq = seq_to_status(entry.collective_seq_id);
            let status = self.status_of(entry.group);
            status.last_enqueued_collective = seq;
            if started {
                status.last_started_collective = status.last_started_collective.max(seq);
            }
        }
        let index = self.next_index;
        self.next_index = if index + 1 == capacity { 0 } else { index + 1 };
        if index == self.slots.len() {
            self.slots.push(Slot::empty());
        }
        let Some(slot) = self.slots.get_mut(index) else {
            // Unreachable: `index` is at most the ring's length, which grew to it.
            self.shapes.release(entry.shapes);
            return RecordId { seq, index };
        };
        slot.seq = seq;
        slot.group = entry.group;
        slot.name = entry.name;
        slot.collective_seq_id = entry.collective_seq_id;
        slot.p2p_seq_id = entry.p2p_seq_id;
        slot.op_id = entry.op_id;
        slot.is_p2p = entry.is_p2p;
        slot.timeout = entry.timeout;
        slot.created = now;
        slot.started = started.then_some(now);
        slot.completed = None;
        slot.finished = None;
        slot.duration = None;
        slot.state = if started { WorkState::Started } else { WorkState::Enqueued };
        slot.error = None;
        slot.blame = None;
        let overwritten = std::mem::replace(&mut slot.shapes, entry.shapes);
        if !inherits {
            self.shapes.release(overwritten);
        }
        // The next records write the next slots, last written `capacity` records ago and out of
        // the cache by now in a full ring: the slot after next is asked for while this
        // collective runs (by address alone: nothing is read).
        let after = if index + 2 < capacity { index + 2 } else { index + 2 - capacity };
        if let Some(next) = self.slots.get(after) {
            next.prefetch_lines();
        }
        RecordId { seq, index }
    }

    /// The work `id` started at `now` (`time_discovered_started_ns`; `state` becomes
    /// `started`). Raises the group's `last_started_collective` for a collective. No-op if the
    /// entry is gone or the work already started or ended.
    pub fn handle_started(&mut self, id: RecordId, now: Duration) {
        let Some(slot) = self.live_slot(id) else { return };
        if slot.state != WorkState::Enqueued {
            return;
        }
        slot.state = WorkState::Started;
        slot.started = Some(now);
        let (is_p2p, seq, group) = (slot.is_p2p, slot.collective_seq_id, slot.group);
        if !is_p2p {
            let status = self.status_of(group);
            status.last_started_collective = status.last_started_collective.max(seq_to_status(seq));
        }
    }

    /// The work `id` completed successfully at `now`: `state` becomes `completed`, the entry is
    /// retired, `duration_ms` is set when timing is on, and the group's
    /// `last_completed_collective` moves for a collective. A work that completes without a
    /// reported start is taken to have started at `now` (a finished collective necessarily
    /// started), with no duration. No-op if the entry is gone or the work already ended.
    pub fn handle_completed(&mut self, id: RecordId, now: Duration) {
        let timing = self.config.timing;
        let Some(slot) = self.live_slot(id) else { return };
        if slot.state.is_terminal() {
            return;
        }
        match slot.started {
            Some(started) if timing => slot.duration = Some(now.saturating_sub(started)),
            Some(_) => {}
            None => slot.started = Some(now),
        }
        slot.completed = Some(now);
        slot.finished = Some(now);
        slot.state = WorkState::Completed;
        let (is_p2p, seq, group) = (slot.is_p2p, slot.collective_seq_id, slot.group);
        if !is_p2p {
            let seq = seq_to_status(seq);
            let status = self.status_of(group);
            status.last_completed_collective = seq;
            status.last_started_collective = status.last_started_collective.max(seq);
        }
    }

    /// The device measured the work `id` as `time` (its start and end events): `duration_ms`
    /// becomes that, when timing is on. No-op if the entry is gone.
    pub fn handle_device_time(&mut self, id: RecordId, time: Duration) {
        let timing = self.config.timing;
        let Some(slot) = self.live_slot(id) else { return };
        if timing {
            slot.duration = Some(time);
        }
    }

    /// The work `id` ended at `now` with `result`. Success is
    /// [`handle_completed`](Self::handle_completed). Any other result retires the entry and
    /// records cohort's terminal state and the result's text in the extra fields, leaving
    /// torch's `state` as it was (`scheduled` or `started`). No-op if the entry is gone or the
    /// work already ended.
    pub fn handle_finished(&mut self, id: RecordId, now: Duration, result: &WorkResult) {
        if result.is_success() {
            self.handle_completed(id, now);
            return;
        }
        let Some(slot) = self.live_slot(id) else { return };
        if slot.state.is_terminal() {
            return;
        }
        slot.state = result.terminal_state();
        slot.finished = Some(now);
        slot.error = Some(result.to_string().into_boxed_str());
        slot.blame = result.blame().cloned().map(Box::new);
    }

    /// Begin a new reset epoch at `now` (torch's `reset_all`): earlier ids become no-ops,
    /// earlier entries leave the dump, `record_id` restarts at 0 and every `pg_status` goes
    /// back to `-1`. No-op if nothing was ever recorded (as torch).
    pub fn reset(&mut self, now: Duration) {
        if self.recorded == 0 {
            return;
        }
        self.epoch += 1;
        self.epoch_start = self.recorded;
        self.reset_at = Some(now);
        for status in &mut self.status_slots {
            *status = PgStatus::default();
        }
    }

    /// The whole recorder as a [`Dump`]: entries of the current epoch, oldest first (only the
    /// unfinished-or-failed ones — those not `completed` — with `meta.only_active`).
    pub fn dump(&self, meta: DumpMeta) -> Dump {
        let pg_config = self
            .pg_config
            .iter()
            .map(|(name, (desc, runs))| {
                let ranks = runs.iter().flat_map(|&(first, last)| first..=last).collect();
                let config = PgConfig { name: name.to_string(), desc: desc.to_string(), ranks };
                (name.to_string(), config)
            })
            .collect();
        let pg_status = self.statuses.iter().map(|(id, &i)| (id.to_string(), self.status_slots[i as usize])).collect();
        let first = self.recorded.saturating_sub(self.slots.len() as u64).max(self.epoch_start);
        let capacity = self.config.capacity.max(1) as u64;
        let entries = (first..self.recorded)
            .filter_map(|seq| self.slots.get((seq % capacity) as usize))
            .filter(|slot| !(meta.only_active && slot.completed.is_some()))
            .map(|slot| self.dump_entry(slot))
            .collect();
        Dump {
            version: DUMP_VERSION.to_owned(),
            comm_lib_version: meta.comm_lib_version,
            pg_config,
            pg_status,
            entries,
            nccl_comm_state: None,
            rank: Some(meta.rank),
            world_size: Some(meta.world_size),
            reset_epoch: Some(self.epoch),
            reset_time_ns: self.reset_at.map(|t| self.wall_ns(t)),
        }
    }

    fn dump_entry(&self, slot: &Slot) -> DumpEntry {
        let group = &self.groups[slot.group as usize];
        let shapes::Described { input_sizes, input_dtypes, output_sizes, output_dtypes } =
            self.shapes.describe(slot.shapes);
        let state = if slot.completed.is_some() {
            EntryState::Completed
        } else if slot.started.is_some() {
            EntryState::Started
        } else {
            EntryState::Scheduled
        };
        DumpEntry {
            record_id: slot.seq - self.epoch_start,
            pg_id: group.pg_id,
            process_group: (group.name.to_string(), group.desc.to_string()),
            thread_name: None,
            thread_id: None,
            collective_seq_id: slot.collective_seq_id,
            p2p_seq_id: slot.p2p_seq_id,
            op_id: slot.op_id,
            profiling_name: self.names[slot.name as usize].to_string(),
            time_created_ns: self.wall_ns(slot.created),
            duration_ms: slot.duration.map(|d| d.as_secs_f64() * 1e3),
            input_sizes,
            input_dtypes,
            output_sizes,
            output_dtypes,
            state,
            time_discovered_started_ns: slot.started.map(|t| self.wall_ns(t)),
            time_discovered_completed_ns: slot.completed.map(|t| self.wall_ns(t)),
            retired: slot.state.is_terminal(),
            timeout_ms: u64::try_from(slot.timeout.as_millis()).unwrap_or(u64::MAX),
            is_p2p: slot.is_p2p,
            frames: Vec::new(),
            cohort_state: Some(slot.state),
            cohort_error: slot.error.as_deref().map(str::to_owned),
            cohort_blame: slot.blame.as_deref().cloned(),
            cohort_time_finished_ns: slot.finished.map(|t| self.wall_ns(t)),
        }
    }

    /// Wall time in Unix ns of `now` (saturating).
    fn wall_ns(&self, now: Duration) -> u64 {
        let since = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        self.wall_epoch_ns.saturating_add(since)
    }

    /// The slot still holding record `id` of the current epoch, if any.
    fn live_slot(&mut self, id: RecordId) -> Option<&mut Slot> {
        let capacity = self.config.capacity as u64;
        if capacity == 0 || id.seq < self.epoch_start {
            return None;
        }
        self.slots.get_mut(id.index).filter(|slot| slot.seq == id.seq)
    }

    /// The `pg_status` of interned group `group`.
    fn status_of(&mut self, group: u32) -> &mut PgStatus {
        &mut self.status_slots[self.groups[group as usize].status as usize]
    }

    /// The index of `pg_id`'s `pg_status` in `status_slots`; a group seen for the first time gets
    /// a new one, every field `-1` (no collective yet).
    fn status_index(&mut self, pg_id: u64) -> u32 {
        let next = u32::try_from(self.status_slots.len()).expect("fewer than 2^32 distinct process groups");
        let index = *self.statuses.entry(pg_id).or_insert(next);
        if index == next {
            self.status_slots.push(PgStatus::default());
        }
        index
    }

    fn intern_group<T>(&mut self, req: &RecordRequest<'_, T>) -> u32 {
        let found =
            self.groups.iter().position(|g| g.pg_id == req.pg_id && *g.name == *req.pg_name && *g.desc == *req.pg_desc);
        let index = found.unwrap_or_else(|| {
            let status = self.status_index(req.pg_id);
            self.groups.push(GroupKey { pg_id: req.pg_id, name: req.pg_name.into(), desc: req.pg_desc.into(), status });
            self.groups.len() - 1
        });
        u32::try_from(index).expect("fewer than 2^32 distinct process groups")
    }

    /// The id of profiling name `name`, to record it as [`ProfilingName::Interned`]; the
    /// same id for the same text for the life of the recorder.
    pub fn intern_name(&mut self, name: &str) -> NameId {
        if let Some(&id) = self.name_index.get(name) {
            return NameId(id);
        }
        let id = u32::try_from(self.names.len()).expect("fewer than 2^32 distinct profiling names");
        self.names.push(name.into());
        self.name_index.insert(name.into(), id);
        NameId(id)
    }
}

impl Slot {
    fn empty() -> Self {
        Slot {
            seq: 0,
            group: 0,
            name: 0,
            collective_seq_id: 0,
            p2p_seq_id: 0,
            op_id: 0,
            is_p2p: false,
            timeout: Duration::ZERO,
            created: Duration::ZERO,
            started: None,
            completed: None,
            finished: None,
            duration: None,
            state: WorkState::Enqueued,
            error: None,
            blame: None,
            shapes: shapes::NONE,
        }
    }

    /// Ask the cache for the slot's own lines, by its address alone: nothing is read. A hint:
    /// it waits for nothing, and does nothing on targets without one.
    fn prefetch_lines(&self) {
        let slot = (self as *const Slot).cast::<u8>();
        for at in (0..size_of::<Slot>()).step_by(64) {
            crate::prefetch::for_read(slot.wrapping_add(at));
        }
    }
}

/// A sequence number as `pg_status` holds it (`int64_t`).
fn seq_to_status(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;
