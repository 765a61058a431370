//! The TCP backend's driver state: the core's [`GroupState`] plus the data plane (running
//! schedules, point-to-point matching, early frames) and the links to peers.
//!
//! Every input — a user submit, a frame, a closed connection, a timer — locks the state, feeds
//! the core exactly one input, and drains every output ([`DriverState::drain`]). Works that end
//! are finished *after* the lock is released ([`Finished::complete`]), so that waiters and
//! completion hooks never run under it.
//!
//! What follows from a frame, a write or a goodbye — feed, hold or drop a frame, resume or
//! complete a work, fail one stranded by a departed peer — is the core's
//! [`DataPlane`](cohort_core::dataplane) to decide; this file keeps the sockets' queues, the
//! tensors and the collectives' runs, and does what it answers.

use std::time::{Duration, Instant};

use bytes::Bytes;
use cohort_core::dataplane::{self, AfterWrite, DataFrame, DataPlane, PeerClosed, Route};
use cohort_core::group::{
    Checked, Collective, Completion, ControlMsg, Event, GroupState, Inline, InlineWork, Launch, SinceEpoch,
    SubmitError, WorkSummary,
};
use cohort_core::p2p::Matcher;
use cohort_core::protocol::{Fingerprint, FrameHeader, FrameKind, HEADER_LEN, decode_control, encode_control};
use cohort_core::schedule::PlanCache;
use cohort_core::tensor::Tensor;
use cohort_core::work::{Blame, GroupId, Rank, SeqNo, WorkId};

use cohort_core::reduce::{ReduceOp, Reduction};
use cohort_core::schedule::{PlanOptions, ScheduleOp};
use cohort_core::work::OpType;

use super::collective::{CollectiveRun, Request};
use super::link::{BufferPool, Corks, Inbound, LaneRx, LaneTx, Lanes, Outbound, SendMode, Sent};
use super::tunables::SEND_WINDOW;
use crate::work::{HookCall, Work, WorkCompleter};

/// What the user handed in with a work, and what it becomes.
#[derive(Debug)]
pub(crate) enum Payload {
    /// A collective: its run on the data plane, built at launch.
    Collective { request: Box<super::collective::Request>, run: Option<Box<CollectiveRun>> },
    /// A send: the bytes.
    Send { peer: Rank, tag: u32, tensor: Tensor },
    /// A recv into `tensor`, from `peer` or any rank.
    Recv { peer: Option<Rank>, tag: u32, tensor: Option<Tensor> },
}

/// A work's driver side: whom to tell when it ends, what the user handed in, what it gives.
#[derive(Debug)]
struct Pending {
    completer: WorkCompleter,
    payload: Payload,
    outputs: Vec<Tensor>,
}

pub(crate) use super::link::OnWritten;

/// Works that ended under the lock, to be finished after it is released.
#[derive(Debug, Default)]
#[must_use = "finished works must be completed after the lock is released"]
pub(crate) struct Finished(Vec<Done>);

/// A finished work: its completer, summary and outputs.
type Done = (WorkCompleter, WorkSummary, Vec<Tensor>);

impl Finished {
    /// A work finished (after those pushed before it).
    pub(crate) fn push(&mut self, done: Done) {
        self.0.push(done);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Empty, with nothing allocated.
    fn is_vacant(&self) -> bool {
        self.0.capacity() == 0
    }

    /// Wake every waiter and run the hooks, in the order the works finished. Call with no lock
    /// held.
    pub(crate) fn complete(self) {
        for (completer, summary, outputs) in self.0 {
            completer.finish_with(summary, outputs);
        }
    }
}

/// Side effects the driver must perform outside the lock.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    /// Works to finish.
    pub(crate) finished: Finished,
    /// The group failed (origin, culprit, message): publish it, dump the recorder.
    pub(crate) failed: Option<(Rank, Blame, String)>,
    /// Tear the process down after dumping (error-handling modes 1 and 3).
    pub(crate) tear_down: Option<String>,
    /// The timer may need an earlier wake-up.
    pub(crate) rearm_timer: bool,
    /// Buffers to reserve in a pool, `(pool, bytes, chunk)` (see [`BufferPool::reserve`]): made
    /// with no lock held, since the first collective of a size makes many of them.
    ///
    /// [`BufferPool::reserve`]: super::link::BufferPool::reserve
    pub(crate) reserve: Vec<(super::link::BufferPool, usize, usize)>,
}

impl Effects {
    /// Whether there is nothing to perform.
    pub(crate) fn is_empty(&self) -> bool {
        self.finished.is_empty()
            && self.failed.is_none()
            && self.tear_down.is_none()
            && !self.rearm_timer
            && self.reserve.is_empty()
    }

    /// Empty, with nothing allocated: dropping it would only look at its empty fields. (Every
    /// field is named here, so that one added later is not left out of the question.)
    pub(crate) fn is_vacant(&self) -> bool {
        let Effects { finished, failed, tear_down, rearm_timer: _, reserve } = self;
        finished.is_vacant() && failed.is_none() && tear_down.is_none() && reserve.capacity() == 0
    }
}

/// The lanes this rank writes on, by peer: only peers it is connected to have an entry.
pub(crate) type Writers = std::collections::BTreeMap<Rank, Lanes>;

/// The driver state of one rank in one TCP process group.
#[derive(Debug)]
pub(crate) struct DriverState {
    pub(crate) group: GroupState,
    me: Rank,
    gid: GroupId,
    /// The lanes this rank writes to each peer on, for the peers it is connected to: nothing
    /// for a peer it never talks to (most peers of a large job under lazy connection).
    writers: Writers,
    /// The works in flight and the data plane's bookkeeping of them.
    plane: DataPlane<Pending, Vec<u8>>,
    /// Plans of the collectives run so far, reused by later runs of the same ones.
    plans: PlanCache,
    /// The last allreduce [`DriverState::quick_plan`] looked at, by element count and
    /// size, and its plan's exchanges: a loop of one small allreduce asks for the same plan at
    /// every work.
    last_exchange: Option<(usize, usize, Option<Chain>)>,
    /// What a chain of exchanges keeps to hand its work off after its first exchange (this
    /// rank's input and the peers' parts so far; see [`DriverState::quick_take`]), between works.
    quick_replay: Vec<u8>,
    /// The exchanges of the allreduce running in its submit call now, if one is.
    quick_chain: Chain,
    /// The clock of the works that run to their end in their submit call.
    pub(crate) quick_clock: super::quick::QuickClock,
    /// The description of the last collective the submit-call path ended, for the next allreduce
    /// of the same dtype and shape ([`DriverState::quick_collective`]): a loop of one small
    /// allreduce describes the same collective at every work, and describing it takes two
    /// allocations. It was checked when it was made, and is not checked again.
    quick_collective: Option<Checked>,
    /// p2p matching: posted receives, and payloads nobody has asked for yet.
    p2p: Matcher<WorkId>,
    /// The ranks a running collective waits for, as last asked (one allocation for every ask).
    waiting_scratch: Vec<Rank>,
    /// Frames queued and not yet written, readable without the lock (see
    /// [`DriverState::writing_count`]): the data plane's count, mirrored.
    unwritten_total: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    on_written: WrittenHook,
    /// Lazy connection: connections per peer, when peers are dialed on first use.
    lazy: Option<u16>,
    /// Large frame buffers for reuse, shared with this group's readers.
    pub(crate) pool: super::link::BufferPool,
    /// Peers to dial (lazy connection), with the queues their new connections will write.
    dial_requests: Vec<(Rank, Vec<LaneRx>)>,
    /// Writers of connections this rank only reads from (a peer's lanes to it, when it writes
    /// to that peer over connections it dialed itself): closed with the links, so that they
    /// say goodbye too.
    idle: Vec<LaneTx>,
    /// The deadline the timer task sleeps until (`None`: none), so that an input wakes it only
    /// when it moves the next deadline earlier.
    timer_armed: Option<Instant>,
    /// Small frames held back for one write (see [`Corks`]).
    corks: std::sync::Arc<Corks>,
    /// A user's submit in a burst is being handled: the small frames it sends are held back
    /// ([`Corks::in_burst`]).
    corking: bool,
}

struct WrittenHook(OnWritten);

impl std::fmt::Debug for WrittenHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WrittenHook")
    }
}

impl DriverState {
    pub(crate) fn new(
        group: GroupState,
        writers: Writers,
        lazy: Option<u16>,
        on_written: OnWritten,
        pool: super::link::BufferPool,
    ) -> Self {
        let quick_clock = super::quick::QuickClock::new(group.epoch());
        DriverState {
            me: group.rank(),
            gid: group.config().group_id,
            group,
            writers,
            plane: DataPlane::new(SEND_WINDOW),
            plans: PlanCache::default(),
            last_exchange: None,
            quick_replay: Vec::new(),
            quick_chain: Chain::default(),
            quick_clock,
            quick_collective: None,
            p2p: Matcher::new(),
            waiting_scratch: Vec::new(),
            unwritten_total: Default::default(),
            on_written: WrittenHook(on_written),
            lazy,
            pool,
            dial_requests: Vec::new(),
            idle: Vec::new(),
            timer_armed: None,
            corks: Default::default(),
            corking: false,
        }
    }

    /// The lanes to `to`; with lazy connection, a first use makes them (frames queue at once)
    /// and asks for `to` to be dialed. `None` for a closed peer, or a missing one without lazy
    /// connection.
    fn lanes_for(&mut self, to: Rank) -> Option<&Lanes> {
        if self.linked(to) { self.writers.get(&to) } else { None }
    }

    /// Whether there are lanes to `to`, made as [`DriverState::lanes_for`] makes them. A peer
    /// connected already, as in a loop of small works from its second on, costs one lookup.
    ///
    /// Inlined, the lookup alone: making the lanes is [`DriverState::link`]'s, out of line.
    #[inline]
    fn linked(&mut self, to: Rank) -> bool {
        self.writers.contains_key(&to) || self.link(to)
    }

    /// Make lanes to `to` if it may have them (see [`DriverState::linked`]).
    #[cold]
    fn link(&mut self, to: Rank) -> bool {
        if to.0 < self.group.config().world_size
            && let Some(k) = self.lazy
            && to != self.me
            && !self.plane.is_closed(to)
            && !self.group.is_aborted()
            && self.group.failure().is_none()
        {
            let (txs, rxs): (Vec<_>, Vec<_>) = (0..k).map(|_| super::link::lane()).unzip();
            self.writers.insert(to, Lanes::new(txs));
            self.dial_requests.push((to, rxs));
            return true;
        }
        false
    }

    /// The timer task is about to sleep until `deadline`.
    pub(crate) fn timer_armed(&mut self, deadline: Option<Instant>) {
        self.timer_armed = deadline;
    }

    /// Whether the core's next deadline is earlier than the one the timer task sleeps until
    /// (then it counts as armed for it: the caller wakes the timer).
    pub(crate) fn timer_needs_wake(&mut self) -> bool {
        let next = self.group.poll_timeout();
        let needed = match (next, self.timer_armed) {
            (Some(n), Some(armed)) => n < armed,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if needed {
            self.timer_armed = next;
        }
        needed
    }

    /// Whether there are peers to dial (a look costs less than taking the empty list).
    pub(crate) fn has_dial_requests(&self) -> bool {
        !self.dial_requests.is_empty()
    }

    /// Peers to dial now (lazy connection), each with its connections' queues.
    pub(crate) fn take_dial_requests(&mut self) -> Vec<(Rank, Vec<LaneRx>)> {
        std::mem::take(&mut self.dial_requests)
    }

    /// A full set of connections from `peer` was accepted (lazy connection). If this rank has no
    /// lanes to `peer` yet, they become its lanes (the queues are returned); otherwise this
    /// rank already writes over connections it dialed and only reads from these (`None`).
    /// Either way `peer` now counts as connected.
    pub(crate) fn accept_lanes(&mut self, now: Instant, peer: Rank, n: usize) -> Option<Vec<LaneRx>> {
        if self.plane.is_closed(peer) || peer == self.me {
            return None;
        }
        self.group.handle_peer_connected(now, peer);
        if peer.0 >= self.group.config().world_size || self.writers.contains_key(&peer) {
            return None;
        }
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| super::link::lane()).unzip();
        self.writers.insert(peer, Lanes::new(txs));
        Some(rxs)
    }

    /// The queue of a writer with nothing to write but its goodbye.
    pub(crate) fn idle_writer(&mut self) -> LaneRx {
        let (tx, rx) = super::link::lane();
        if !self.group.is_aborted() && self.group.failure().is_none() {
            self.idle.push(tx);
        }
        rx
    }

    /// `peer` was dialed and is connected (lazy connection).
    pub(crate) fn peer_connected(&mut self, now: Instant, peer: Rank, effects: &mut Effects) {
        self.group.handle_peer_connected(now, peer);
        effects.rearm_timer = true;
    }

    /// A user submit.
    pub(crate) fn submit(
        &mut self,
        now: Instant,
        collective: Collective,
        payload: Payload,
        hook: Option<crate::work::CompletionHook>,
        effects: &mut Effects,
    ) -> Result<Work, SubmitError> {
        let op = collective.op;
        let fingerprint = (!op.is_p2p()).then(|| Fingerprint {
            op,
            // The inputs' dtype, or the outputs' on ranks that pass no input (scatter's
            // non-root ranks): the same on every rank of a well-formed call.
            dtype: collective.inputs.first().or(collective.outputs.first()).map(|t| t.dtype),
            root: collective.root,
        });
        let id = self.group.submit(now, collective)?;
        let seq = if op.is_p2p() { self.group.p2p_seq() } else { self.group.seq() };
        let (work, completer) = Work::pending(id, seq, op, hook);
        completer.in_group(self.group.config().group_id, self.group.rank());
        self.plane.track(id, fingerprint, Pending { completer, payload, outputs: Vec::new() });
        self.corking = self.corks.in_burst();
        self.drain(now, effects);
        self.corking = false;
        effects.rearm_timer = true;
        Ok(work)
    }

    /// Whether a user's allreduce of `tensors` with `op` may run in its submit call (see
    /// `quick.rs`): nothing else is in flight or held here, and its plan is a chain of
    /// exchanges of the whole buffer, one peer at a time (PremulSum is left out: its
    /// premultiplied input would be premultiplied again if the work were handed off).
    pub(crate) fn quick_plan(&mut self, tensors: &[Tensor], op: ReduceOp) -> Option<QuickPlan> {
        let idle = self.plane.is_empty() && self.plane.held() == 0 && self.plane.unwritten() == 0;
        let [tensor] = tensors else { return None };
        if !idle || matches!(op, ReduceOp::PremulSum(_)) {
            return None;
        }
        let reduction = Reduction::new(op, tensor.dtype()).ok()?;
        let count = tensor.numel();
        let elem = tensor.dtype().size();
        let shape = match self.last_exchange {
            Some((c, e, shape)) if (c, e) == (count, elem) => shape,
            _ => {
                let world = self.group.config().world_size;
                let op = ScheduleOp::Allreduce { count };
                let plan = self.plans.plan(&op, self.me, world, elem, PlanOptions::default()).ok()?;
                let chain = plan.exchanges().filter(|_| plan.data_len() == tensor.nbytes()).and_then(Chain::new);
                self.last_exchange = Some((count, elem, chain));
                chain
            }
        };
        Some(QuickPlan { reduction, chain: shape? })
    }

    /// Make the kept description the one of an allreduce of `tensor` alone: the last one this
    /// path used stays if it was of the same dtype and shape. It stays in place for
    /// [`DriverState::quick_start`] (a work ended in its call never moves it); a work that goes
    /// the usual way takes it ([`DriverState::take_quick_collective`]). One that fails its
    /// checks is not kept: the usual submit then refuses it, saying why.
    pub(crate) fn quick_collective(&mut self, tensor: &Tensor) {
        let same = |c: &Checked| matches!(&c.collective().inputs[..], [spec] if spec.dtype == tensor.dtype() && spec.shape == tensor.shape());
        if !self.quick_collective.as_ref().is_some_and(same) {
            let collective = super::allreduce_collective(std::slice::from_ref(tensor));
            self.quick_collective = Checked::new(collective, self.me, self.group.config().world_size).ok();
        }
    }

    /// The kept description, for a work of `tensors` that leaves this path: it goes with the
    /// work (made anew if none is kept).
    pub(crate) fn take_quick_collective(&mut self, tensors: &[Tensor]) -> Collective {
        self.quick_collective.take().map_or_else(|| super::allreduce_collective(tensors), Checked::into_inner)
    }

    /// A user's allreduce that [`DriverState::quick_plan`] accepted, to be run in its submit
    /// call: submitted to the core as an inline work ([`GroupState::submit_inline`]: numbered,
    /// recorded and started like any work, but kept out of the core's table and of this data
    /// plane's), and its one frame sent to the peer; the caller then waits for the peer's frame
    /// itself ([`Exchange::take`]) and ends it with [`DriverState::quick_finish`] or, if the
    /// frame does not come, [`DriverState::quick_hand_off`], which gives it the usual entries.
    ///
    /// The work's description is the kept one ([`DriverState::quick_collective`]), which the
    /// work takes only if it is handed off.
    pub(crate) fn quick_start(
        &mut self,
        now: SinceEpoch,
        tensors: Vec<Tensor>,
        op: ReduceOp,
        plan: QuickPlan,
        hook: impl FnOnce() -> Option<crate::work::CompletionHook>,
    ) -> Result<QuickStart, SubmitError> {
        let QuickPlan { reduction, chain } = plan;
        let (peer, step) = chain.at(0);
        self.quick_chain = chain;
        let mode = self.mode();
        let linked = self.linked(peer);
        let (gid, me) = (self.gid, self.me);
        // The frame goes out as soon as the work is numbered, before its flight-recorder entry
        // and before its `Work` is made: those overlap the frame's way to the peer.
        let DriverState { group, writers, pool, on_written, quick_collective, quick_replay, .. } = &mut *self;
        let Some(checked) = quick_collective.as_ref() else {
            // Its description failed its checks: the usual submit says why.
            return Ok(QuickStart::Busy(tensors));
        };
        let collective = checked.collective();
        let fingerprint =
            Some(Fingerprint { op: collective.op, dtype: Some(tensors[0].dtype()), root: collective.root });
        let tag = fingerprint.map_or(0, Fingerprint::to_tag);
        let tensor = &tensors[0];
        let send = |id: WorkId, seq: SeqNo| {
            if !linked {
                return Sent::Gone;
            }
            let frame = ExchangeFrame { gid, from: me, to: peer, step, id, seq, tag };
            frame.send(tensor, writers, pool, on_written, mode)
        };
        let (inline, sent) = match group.submit_inline(now, checked, send)? {
            Inline::Running(inline, sent) => (inline, sent),
            // The core had something in flight after all: the usual path takes it.
            Inline::Busy => return Ok(QuickStart::Busy(tensors)),
        };
        if chain.len() > 1 {
            // This rank's input, for a hand-off after the first exchange.
            quick_replay.clear();
            quick_replay.extend_from_slice(tensors[0].bytes());
        }
        let hook = hook();
        let exchange =
            Exchange { inline, hook, fingerprint, peer, step, at: 0, tag, gid: self.gid, tensors, reduction, op };
        Ok(match sent {
            Sent::Written => QuickStart::Sent(exchange),
            Sent::Queued => QuickStart::Unsent(exchange, false),
            Sent::Gone => QuickStart::Unsent(exchange, true),
        })
    }

    /// Offer the frame at the exchange's peer's ring's read position: if it is the peer's part
    /// of this exchange (the same group, sequence number, step and fingerprint tag, and as many
    /// bytes as this rank's), it is combined into the tensor and `true` comes back. Anything
    /// else is left for the usual path, which judges it as it judges every frame.
    pub(crate) fn quick_take(&mut self, exchange: &mut Exchange, header: &FrameHeader, payload: &[u8]) -> bool {
        let taken = exchange.matches(header, payload)
            && exchange.reduction.combine(exchange.tensors[0].bytes_mut(), payload).is_ok();
        if taken && exchange.at as usize + 1 < self.quick_chain.len() {
            // The part, for a hand-off at a later exchange.
            self.quick_replay.extend_from_slice(payload);
        }
        taken
    }

    /// Whether the exchange's chain has another exchange after the one that was just taken.
    pub(crate) fn quick_more(&self, exchange: &Exchange) -> bool {
        exchange.at as usize + 1 < self.quick_chain.len()
    }

    /// The exchange's peer's part was taken ([`DriverState::quick_take`]) and another exchange
    /// follows ([`DriverState::quick_more`]): send the combined buffer to the next peer, as
    /// the executor would. `Err` if the frame did not go out at once (its link gone, if
    /// `true`): end the exchange with [`DriverState::quick_unsent`].
    #[allow(clippy::result_large_err)] // moved once an exchange, as `QuickStart` is: no box
    pub(crate) fn quick_next(&mut self, mut exchange: Exchange) -> Result<Exchange, (Exchange, bool)> {
        exchange.at += 1;
        let (peer, step) = self.quick_chain.at(exchange.at as usize);
        exchange.peer = peer;
        exchange.step = step;
        let sent = match self.linked(peer) {
            false => Sent::Gone,
            true => {
                let mode = self.mode();
                let (id, seq, tag) = (exchange.inline.id(), exchange.inline.seq(), exchange.tag);
                let frame = ExchangeFrame { gid: self.gid, from: self.me, to: peer, step, id, seq, tag };
                frame.send(&exchange.tensors[0], &self.writers, &self.pool, &self.on_written, mode)
            }
        };
        match sent {
            Sent::Written => Ok(exchange),
            Sent::Queued => Err((exchange, false)),
            Sent::Gone => Err((exchange, true)),
        }
    }

    /// The exchange's frame did not go out at once ([`QuickStart::Unsent`]): it waits for the
    /// writer task, and the work goes to the usual path, which waits for it too; or its link
    /// is `gone`, and the work fails as any work on that link does.
    pub(crate) fn quick_unsent(&mut self, now: Instant, exchange: Exchange, gone: bool, effects: &mut Effects) -> Work {
        if !gone {
            return self.quick_hand_off(now, exchange, true, effects);
        }
        let peer = exchange.peer;
        let (id, _, work) = self.adopt(exchange, effects);
        self.group.handle_completion(now, id, dataplane::link_gone(peer));
        self.drain(now, effects);
        work
    }

    /// The peer's frame was combined into the exchange's tensor ([`Exchange::take`]): finish
    /// the reduction and end the work as the usual path ends it (frames for it are stale from
    /// now on). Its finished `Work` is made here; its completion hook is called once the lock
    /// is released ([`QuickEnd::Ended`]).
    pub(crate) fn quick_finish(&mut self, at: SinceEpoch, mut exchange: Exchange, effects: &mut Effects) -> QuickEnd {
        let heard = self.quick_chain.len();
        let world = self.group.config().world_size as usize;
        let end = match exchange.reduction.finalize(exchange.tensors[0].bytes_mut(), world) {
            Ok(()) => {
                let Exchange { inline, hook, tensors, .. } = exchange;
                // The inline work ends before the group hears of anything else: nothing may
                // find it missing from the table. The chain's peers were heard from.
                let chain = self.quick_chain;
                let summary = self.group.finish_inline(at, inline, (0..heard).map(|i| chain.at(i).0));
                // The plane never tracked it: only the frames it makes stale are its business.
                let mut stale = Vec::new();
                self.plane.collective_ended(summary.seq, &mut stale);
                for payload in stale {
                    self.pool.give(payload);
                }
                let (work, hook) = Work::finished(&summary, tensors, hook, self.gid, self.me);
                // `Success` holds nothing to free, and its drop would still call the result's.
                match summary.result {
                    cohort_core::work::WorkResult::Success => std::mem::forget(summary.result),
                    failed => drop(failed),
                }
                QuickEnd::Ended(work, hook)
            }
            Err(e) => {
                let now = self.group.epoch() + at.0;
                let (id, _, work) = self.adopt(exchange, effects);
                self.heard_from_chain(now, heard);
                self.group.handle_completion(now, id, Completion::Failed { rank: None, message: e.to_string() });
                QuickEnd::Work(work)
            }
        };
        // As `drain`, with the time made an `Instant` only where there is something to drain.
        if self.group.has_output() {
            self.drain_outputs(self.group.epoch() + at.0, effects);
        }
        end
    }

    /// The peers of the chain's first `count` exchanges were heard from.
    fn heard_from_chain(&mut self, now: Instant, count: usize) {
        for i in 0..count {
            self.group.handle_peer_activity(now, self.quick_chain.at(i).0);
        }
    }

    /// The peer's frame did not come in time, something else came first, or this rank's frame
    /// waits for the writer task (`queued`): the work goes on as any running collective whose
    /// frames so far have gone (timeouts, stuck notes, desync checks and failures then apply as
    /// to every other). After the chain's first exchange, the executor is brought to where
    /// the chain stands by running it again on this rank's input and the peers' parts taken so
    /// far (kept by [`DriverState::quick_start`] and [`DriverState::quick_take`]): it sends
    /// what went already, which is dropped, and computes what the chain computed.
    pub(crate) fn quick_hand_off(
        &mut self,
        now: Instant,
        exchange: Exchange,
        queued: bool,
        effects: &mut Effects,
    ) -> Work {
        let (id, Adopted { seq, peer, at, mut tensors, op }, work) = self.adopt(exchange, effects);
        self.heard_from_chain(now, at);
        if queued {
            self.count_sent(id, peer, Sent::Queued);
        }
        let n = tensors[0].nbytes();
        // This rank's input, then one part for each exchange before this one.
        let kept = if at == 0 { Some(&[][..]) } else { self.quick_replay.get(..(at + 1) * n) };
        let Some(kept) = kept else {
            let message = format!("kept {} bytes to replay {at} exchanges of {n} bytes", self.quick_replay.len());
            self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
            self.drain(now, effects);
            return work;
        };
        if let Some(input) = kept.get(..n) {
            tensors[0].bytes_mut().copy_from_slice(input);
        }
        let world = self.group.config().world_size;
        let mut request = Request::allreduce(tensors, op);
        let chain = self.quick_chain;
        let started = CollectiveRun::start(&mut request, self.me, world, seq, &mut self.plans).and_then(|mut run| {
            for j in 0..=at {
                // The executor's send is the frame that went already.
                let (to, step) = chain.at(j);
                match run.poll_send() {
                    Some(out) if out.to == to && out.step == step => {}
                    other => {
                        return Err(format!("the run's send {j} is {other:?}, not the frame to rank {to} that went"));
                    }
                }
                if let Some(part) = kept.get((j + 1) * n..(j + 2) * n) {
                    run.handle_recv(to, step, part)?;
                }
            }
            Ok(run)
        });
        match started {
            Ok(run) => {
                if let Some(p) = self.plane.work_mut(id) {
                    p.payload = Payload::Collective { request: Box::new(Request::Taken), run: Some(Box::new(run)) };
                }
                self.begin_run(now, id, seq, effects);
            }
            Err(message) => self.group.handle_completion(now, id, Completion::Failed { rank: None, message }),
        }
        self.drain(now, effects);
        work
    }

    /// Give the exchange's inline work the usual entries, the core's table and this data
    /// plane's tracking (its data still with the exchange, which is given back), its
    /// description (the kept one) and its `Work`.
    fn adopt(&mut self, exchange: Exchange, effects: &mut Effects) -> (WorkId, Adopted, Work) {
        let Exchange { inline, hook, fingerprint, peer, at, tensors, op, .. } = exchange;
        let collective = self.take_quick_collective(&tensors);
        let (id, seq) = (inline.id(), inline.seq());
        let (work, completer) = Work::pending(id, seq, OpType::Allreduce, hook);
        completer.in_group(self.gid, self.me);
        self.group.adopt_inline(inline, collective);
        let payload = Payload::Collective { request: Box::new(Request::Taken), run: None };
        self.plane.track(id, fingerprint, Pending { completer, payload, outputs: Vec::new() });
        effects.rearm_timer = true;
        (id, Adopted { seq, peer, at: at as usize, tensors, op }, work)
    }

    /// A frame from `from`.
    pub(crate) fn handle_frame(
        &mut self,
        now: Instant,
        from: Rank,
        header: FrameHeader,
        payload: Vec<u8>,
        effects: &mut Effects,
    ) {
        self.group.handle_peer_activity(now, from);
        match header.kind {
            FrameKind::Data => self.handle_data(now, from, header.seq, header.step, header.tag, payload),
            FrameKind::P2p => self.handle_p2p(now, from, header.tag, payload),
            FrameKind::Goodbye => {}
            kind => match decode_control(kind, header.seq, &payload, self.group.config().world_size) {
                Ok(Some(msg)) => self.group.handle_message(now, from, msg),
                Ok(None) => {}
                // A peer's malformed control frame is reported, not obeyed: the connection
                // stays up and its heartbeats still count.
                Err(e) => tracing::warn!(%from, "ignoring a control frame: {e}"),
            },
        }
        self.drain(now, effects);
    }

    /// The connection to `from` ended.
    pub(crate) fn handle_closed(
        &mut self,
        now: Instant,
        from: Rank,
        reason: String,
        clean: bool,
        effects: &mut Effects,
    ) {
        let closed = self.plane.peer_closed(from, &reason, clean);
        if closed == PeerClosed::Again {
            return;
        }
        self.writers.remove(&from);
        match closed {
            PeerClosed::Departed => self.departed(now, from),
            PeerClosed::Lost => self.group.handle_peer_lost(now, from, reason),
            PeerClosed::Deferred | PeerClosed::Again => {}
        }
        self.drain(now, effects);
    }

    /// The timer fired.
    pub(crate) fn handle_timeout(&mut self, now: Instant, effects: &mut Effects) {
        self.group.handle_timeout(now);
        self.drain(now, effects);
        effects.rearm_timer = true;
    }

    /// A user or remote abort.
    pub(crate) fn handle_abort(&mut self, now: Instant, reason: String, effects: &mut Effects) {
        self.group.handle_abort(now, reason);
        self.drain(now, effects);
    }

    /// A frame of work `id` for `to` reached the socket, or cannot.
    pub(crate) fn handle_written(
        &mut self,
        now: Instant,
        to: Rank,
        ids: &[WorkId],
        outcome: Result<(), String>,
        effects: &mut Effects,
    ) {
        let departure_due = self.plane.frames_written(to, ids.len());
        self.mirror_unwritten();
        for &id in ids {
            match self.plane.work_written(id, to, outcome.as_ref().err().map(String::as_str)) {
                AfterWrite::Nothing => {}
                AfterWrite::Resume => self.after_step(now, id, Ok(())),
                AfterWrite::Complete => self.group.handle_completion(now, id, Completion::Success),
                AfterWrite::Fail(completion) => self.group.handle_completion(now, id, completion),
            }
        }
        if departure_due {
            self.departed(now, to);
        }
        self.drain(now, effects);
    }

    /// `peer` said goodbye and everything it sent has arrived: works that still wait for it
    /// can never finish, so they fail naming it; nothing else does.
    fn departed(&mut self, now: Instant, peer: Rank) {
        self.group.handle_peer_departed(now, peer);
        for id in self.p2p.waiting_for(peer) {
            self.group.handle_completion(now, id, dataplane::departed_before_send(peer));
        }
        for id in self.plane.running() {
            self.fail_if_stranded(now, id);
        }
    }

    /// Fail a running collective that waits for a peer whose connection is closed.
    fn fail_if_stranded(&mut self, now: Instant, id: WorkId) {
        self.check_waiting(now, id, false);
    }

    /// Ask a running collective whom it waits for: tell the group if `tell` (for stuck notes
    /// and timeouts), and fail it if one of them has closed its connection. The rank list is
    /// the driver's own, reused: this runs at every step of every collective.
    fn check_waiting(&mut self, now: Instant, id: WorkId, tell: bool) {
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.plane.work(id) else {
            return;
        };
        let mut ranks = std::mem::take(&mut self.waiting_scratch);
        run.waiting_on(&mut ranks);
        if tell {
            self.group.handle_waiting_on(now, id, &ranks);
        }
        if let Some(failure) = self.plane.stranded(&ranks) {
            self.group.handle_completion(now, id, failure);
        }
        self.waiting_scratch = ranks;
    }

    /// The data side of `id` is done: complete it if every frame of it is written.
    fn data_done(&mut self, now: Instant, id: WorkId) {
        if self.plane.data_done(id) {
            self.group.handle_completion(now, id, Completion::Success);
        }
    }

    /// Copy the data plane's count of unwritten frames where lock-free readers see it.
    fn mirror_unwritten(&self) {
        self.unwritten_total.store(self.plane.unwritten(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Queue a frame of work `id` for `to`; false if the link is gone.
    fn send_frame(&mut self, id: WorkId, to: Rank, header: FrameHeader, payload: Bytes) -> bool {
        let written = super::link::Written { id, hook: self.on_written.0.clone() };
        let mode = self.mode();
        let Some(lanes) = self.lanes_for(to) else { return false };
        let sent = lanes.send(Outbound::new(header, payload, Some(written)), mode);
        self.count_sent(id, to, sent)
    }

    /// The count of frames of this rank waiting for the writer tasks, for a reader that does
    /// not take the state's lock (a polling thread checks it between polls).
    pub(crate) fn writing_count(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        self.unwritten_total.clone()
    }

    /// The group's held-back frames, for the threads that wait and for the watcher task.
    pub(crate) fn corks(&self) -> std::sync::Arc<Corks> {
        self.corks.clone()
    }

    /// How a frame may go out now. A user's submit in a burst holds its small frames back (they
    /// go out when a thread waits, see [`Corks`]). Otherwise a sender may write its frames
    /// itself when one work is in flight (a round trip waits on it); with several, the writer
    /// task coalesces their frames into fewer writes.
    fn mode(&self) -> SendMode {
        SendMode { direct: self.plane.len() <= 1, cork: self.corking.then(|| self.corks.clone()) }
    }

    /// Count a frame of work `id` to `to` that was queued (it must be written before the work
    /// completes); false if the link is gone.
    fn count_sent(&mut self, id: WorkId, to: Rank, sent: Sent) -> bool {
        match sent {
            Sent::Gone => return false,
            Sent::Written => {}
            Sent::Queued => {
                self.plane.queued(id, to);
                self.mirror_unwritten();
            }
        }
        true
    }

    /// A failure another rank published (through the store).
    pub(crate) fn handle_remote_error(
        &mut self,
        now: Instant,
        origin: Rank,
        blame: Blame,
        message: String,
        effects: &mut Effects,
    ) {
        self.group.handle_remote_error(now, origin, blame, message);
        self.drain(now, effects);
    }

    /// Whether the receive `id` got its message (it may still wait to finish behind earlier
    /// works, which finish in submission order).
    pub(crate) fn recv_arrived(&self, id: WorkId) -> bool {
        self.plane
            .work(id)
            .is_some_and(|p| matches!(p.payload, Payload::Recv { tensor: None, .. }) && !p.outputs.is_empty())
    }

    /// The flight recorder as JSON.
    pub(crate) fn dump_json(&self) -> String {
        self.group.dump().to_json()
    }

    /// Close every writer: the writer tasks say goodbye and end.
    pub(crate) fn close_links(&mut self) {
        self.writers.clear();
        self.idle.clear();
    }

    fn handle_data(&mut self, now: Instant, from: Rank, seq: SeqNo, step: u32, tag: u32, payload: Vec<u8>) {
        match self.plane.route(seq, DataFrame { from, step, tag, payload }) {
            Route::Feed(id, frame) => self.feed(now, id, seq, frame),
            Route::Held => {}
            Route::Stale(payload) => {
                tracing::debug!(%from, %seq, step, "dropping a data frame for a finished collective");
                self.pool.give(payload);
            }
        }
    }

    fn handle_p2p(&mut self, now: Instant, from: Rank, tag: u32, payload: Vec<u8>) {
        if let Some((id, payload)) = self.p2p.arrive(from, tag, payload) {
            self.complete_recv(now, id, from, payload);
        }
    }

    fn complete_recv(&mut self, now: Instant, id: WorkId, from: Rank, bytes: Vec<u8>) {
        let Some(p) = self.plane.work_mut(id) else { return };
        let Payload::Recv { tensor, .. } = &mut p.payload else { return };
        let Some(mut t) = tensor.take() else { return };
        if let Err(failure) = dataplane::check_recv(from, bytes.len(), &t) {
            self.pool.give(bytes);
            self.group.handle_completion(now, id, failure);
            return;
        }
        t.bytes_mut().copy_from_slice(&bytes);
        p.outputs = vec![t];
        p.completer.set_source_rank(from);
        self.pool.give(bytes);
        self.group.handle_completion(now, id, Completion::Success);
    }

    /// A data frame read in place, out of a shared-memory ring: if its collective runs, its
    /// payload is fed to it from where it lies (reduced or copied straight out of the ring)
    /// and `true` comes back; otherwise nothing happens and `false` comes back, and the
    /// caller hands the frame over the usual way ([`DriverState::handle_frame`]).
    pub(crate) fn handle_frame_in_place(
        &mut self,
        now: Instant,
        from: Rank,
        header: &FrameHeader,
        payload: &[u8],
        effects: &mut Effects,
    ) -> bool {
        if header.kind != FrameKind::Data {
            return false;
        }
        let Some(id) = self.plane.running_id(header.seq) else { return false };
        self.group.handle_peer_activity(now, from);
        let part = self.take_part(id, header.seq, from, header.step, header.tag, payload);
        self.after_part(now, id, part);
        self.drain(now, effects);
        true
    }

    /// Feed one data frame to running collective `id` (`seq`) and push what it wants to send.
    fn feed(&mut self, now: Instant, id: WorkId, seq: SeqNo, frame: DataFrame<Vec<u8>>) {
        let DataFrame { from, step, tag, payload } = frame;
        let part = self.take_part(id, seq, from, step, tag, &payload);
        self.pool.give(payload);
        self.after_part(now, id, part);
    }

    /// Collective `id` (`seq`) takes one part from `from`, after the fingerprint check.
    fn take_part(&mut self, id: WorkId, seq: SeqNo, from: Rank, step: u32, tag: u32, payload: &[u8]) -> Part {
        if let Err(mismatch) = self.plane.check(id, seq, from, tag) {
            return Part::Failed(mismatch);
        }
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.plane.work_mut(id) else {
            return Part::Gone;
        };
        match run.handle_recv(from, step, payload) {
            Err(e) => Part::Failed(dataplane::part_mismatch(from, e)),
            Ok(()) => Part::Taken,
        }
    }

    /// After [`DriverState::take_part`]: end the work, or push what it wants to send.
    fn after_part(&mut self, now: Instant, id: WorkId, part: Part) {
        match part {
            Part::Failed(completion) => self.group.handle_completion(now, id, completion),
            Part::Gone => {}
            Part::Taken => self.after_step(now, id, Ok(())),
        }
    }

    /// After an input to a running collective: send what it wants sent, then see where it is.
    fn after_step(&mut self, now: Instant, id: WorkId, result: Result<(), String>) {
        match result {
            Err(message) => {
                self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
            }
            Ok(()) => {
                if !self.send_outgoing(now, id) {
                    return; // more to send once frames are written
                }
                let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.plane.work(id)
                else {
                    return;
                };
                if !run.is_done() {
                    self.check_waiting(now, id, true);
                    return;
                }
                let Some(p) = self.plane.work_mut(id) else { return };
                let Payload::Collective { run, .. } = &mut p.payload else { return };
                let Some(run) = run.take() else { return };
                match run.finish() {
                    Ok(outputs) => {
                        p.outputs = outputs;
                        self.data_done(now, id);
                    }
                    Err(message) => {
                        self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
                    }
                }
            }
        }
    }

    /// Queue what collective `id` wants to send, up to the send window; false if it stopped
    /// at the window (it resumes as its frames are written) or failed.
    fn send_outgoing(&mut self, now: Instant, id: WorkId) -> bool {
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.plane.work(id) else {
            return true;
        };
        let seq = run.seq();
        let tag = self.plane.tag(id);
        loop {
            if !self.plane.window_open(id) {
                return false;
            }
            let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.plane.work_mut(id)
            else {
                return true;
            };
            let Some(out) = run.poll_send() else { return true };
            let to = out.to;
            // Straight from the collective's buffer when this thread writes it; whatever the
            // socket does not take now is copied and queued.
            let mode = self.mode();
            let sent = match self.linked(to) {
                false => Sent::Gone,
                true => {
                    let DriverState { writers, plane, pool, on_written, .. } = &*self;
                    let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = plane.work(id)
                    else {
                        return true;
                    };
                    let bytes = run.payload(&out);
                    let mut header = FrameHeader::data(self.gid, seq, out.step, self.me, bytes.len() as u64);
                    header.tag = tag;
                    let written = || Some(super::link::Written { id, hook: on_written.0.clone() });
                    let lane = writers.get(&to).and_then(|l| l.lane_for(&header, bytes.len()));
                    lane.map_or(Sent::Gone, |l| l.send_slice(header, bytes, written, mode, |b| pool.bytes(b)))
                }
            };
            if !self.count_sent(id, to, sent) {
                self.group.handle_completion(now, id, dataplane::link_gone(to));
                return false;
            }
        }
    }

    /// Drain every output of the core until nothing is left. Inlined for its first look: most
    /// inputs (a work ended in its submit call among them) leave nothing.
    #[inline]
    fn drain(&mut self, now: Instant, effects: &mut Effects) {
        if self.group.has_output() {
            self.drain_outputs(now, effects);
        }
    }

    fn drain_outputs(&mut self, now: Instant, effects: &mut Effects) {
        loop {
            let mut progressed = false;
            while let Some(t) = self.group.poll_transmit() {
                progressed = true;
                // A stuck note may go to a rank not connected yet (lazy connection: the rank it
                // waits for): it connects. Everything else goes to connected peers only.
                let dial = matches!(t.msg, ControlMsg::Stuck { .. });
                let (header, payload) = match t.msg {
                    ControlMsg::Heartbeat => (FrameHeader::heartbeat(self.me), Bytes::new()),
                    msg => {
                        let f = encode_control(&msg);
                        let mut h = FrameHeader::data(self.gid, f.seq, 0, self.me, f.payload.len() as u64);
                        h.kind = f.kind;
                        (h, Bytes::from(f.payload))
                    }
                };
                let out = Outbound::new(header, payload, None);
                if dial {
                    if let Some(lanes) = self.lanes_for(t.to) {
                        lanes.send(out, SendMode::QUEUE);
                    }
                } else {
                    send(&self.writers, t.to, out);
                }
            }
            while let Some(launch) = self.group.poll_launch() {
                progressed = true;
                self.launch(now, launch, effects);
            }
            while let Some(event) = self.group.poll_event() {
                progressed = true;
                self.handle_event(event, effects);
            }
            if !progressed {
                break;
            }
        }
    }

    fn launch(&mut self, now: Instant, launch: Launch, effects: &mut Effects) {
        let id = launch.id;
        self.group.handle_started(now, id);
        let Some(p) = self.plane.work_mut(id) else { return };
        match &mut p.payload {
            Payload::Send { peer, tag, tensor } => {
                let bytes = Bytes::copy_from_slice(tensor.bytes());
                let header = FrameHeader::p2p(self.gid, launch.seq, self.me, *tag, bytes.len() as u64);
                let peer = *peer;
                if self.send_frame(id, peer, header, bytes) {
                    self.data_done(now, id); // the frame may be on the socket already
                } else {
                    self.group.handle_completion(now, id, dataplane::link_gone(peer));
                }
            }
            Payload::Recv { peer, tag, .. } => {
                let (peer, tag) = (*peer, *tag);
                match self.p2p.take_held(peer, tag) {
                    Some((from, bytes)) => self.complete_recv(now, id, from, bytes),
                    None => match self.plane.recv_after_close(peer, tag) {
                        Some(failure) => self.group.handle_completion(now, id, failure),
                        None => self.p2p.wait(id, peer, tag),
                    },
                }
            }
            Payload::Collective { request, run } => {
                match CollectiveRun::start(
                    request,
                    self.me,
                    self.group.config().world_size,
                    launch.seq,
                    &mut self.plans,
                ) {
                    Ok(r) => *run = Some(Box::new(r)),
                    Err(message) => {
                        self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
                        return;
                    }
                }
                self.begin_run(now, id, launch.seq, effects);
            }
        }
    }

    /// Collective `id` (`seq`) has its run: reserve buffers for what it receives, feed it the
    /// frames that came before it started, send what it may, and see whether it waits on a
    /// closed peer.
    fn begin_run(&mut self, now: Instant, id: WorkId, seq: SeqNo, effects: &mut Effects) {
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.plane.work(id) else {
            return;
        };
        // Buffers for what it receives (and for the next collective of its size, whose chunks
        // may arrive before that one starts here).
        let plan = run.plan();
        if self.pool.needs_reserve(plan.recv_bytes(), plan.largest_recv()) {
            effects.reserve.push((self.pool.clone(), plan.recv_bytes(), plan.largest_recv()));
        }
        // Frames that arrived before this rank started the collective are fed before asking
        // whether it waits on a closed peer: a peer that sent its part and then shut down
        // cleanly left everything needed here.
        let early = self.plane.launch(seq, id);
        self.after_step(now, id, Ok(()));
        for frame in early {
            self.feed(now, id, seq, frame);
        }
        self.plane.launched();
        self.fail_if_stranded(now, id);
    }

    fn handle_event(&mut self, event: Event, effects: &mut Effects) {
        match event {
            Event::WorkFinished(summary) => {
                let finished = self.plane.finish(summary.id, (!summary.is_p2p).then_some(summary.seq));
                for payload in finished.stale {
                    self.pool.give(payload);
                }
                self.p2p.forget(summary.id);
                if let Some(p) = finished.work {
                    effects.finished.push((p.completer, summary, p.outputs));
                }
            }
            Event::PeerLost { rank, reason } => {
                tracing::warn!(%rank, %reason, "peer lost");
            }
            Event::GroupFailed(failure) => {
                tracing::error!(origin = %failure.origin, blame = %failure.blame, "process group failed: {}", failure.message);
                effects.failed = Some((failure.origin, failure.blame, failure.message));
            }
            Event::GroupAborted { reason } => {
                tracing::warn!(%reason, "process group aborted");
                effects.failed.get_or_insert((self.me, Blame::nobody(), reason));
            }
            Event::TearDown { cause } => effects.tear_down = Some(cause),
            _ => {}
        }
    }
}

/// One exchange's data frame of a work run in its submit call, as the executor would send it.
struct ExchangeFrame {
    gid: GroupId,
    from: Rank,
    to: Rank,
    step: u32,
    id: WorkId,
    seq: SeqNo,
    tag: u32,
}

impl ExchangeFrame {
    /// Send `tensor` in this frame on the lane to `to`, written at once if it can be. Inlined:
    /// the first exchange's send is on the submit-call path, where a call of its own adds to
    /// every small allreduce.
    #[inline(always)]
    fn send(
        self,
        tensor: &Tensor,
        writers: &Writers,
        pool: &BufferPool,
        on_written: &WrittenHook,
        mode: SendMode,
    ) -> Sent {
        let mut header = FrameHeader::data(self.gid, self.seq, self.step, self.from, tensor.nbytes() as u64);
        header.tag = self.tag;
        let id = self.id;
        let Some(lane) = writers.get(&self.to).and_then(|l| l.lane_for(&header, tensor.nbytes())) else {
            return Sent::Gone;
        };
        let payload = tensor.bytes();
        // A frame that fits a shared-memory box slot is built whole here and written in one
        // piece where nothing is ahead of it.
        let mut frame = [0u8; HEADER_LEN + SMALL_FRAME_PAYLOAD];
        if let Some((head, rest)) = frame.split_first_chunk_mut::<HEADER_LEN>()
            && let Some(body) = rest.get_mut(..payload.len())
        {
            header.encode_into(head);
            body.copy_from_slice(payload);
            if lane.try_write_whole(&frame[..HEADER_LEN + payload.len()], &mode) {
                return Sent::Written;
            }
        }
        let written = || Some(super::link::Written { id, hook: on_written.0.clone() });
        lane.send_slice(header, payload, written, mode, |b| pool.bytes(b))
    }
}

/// The largest payload [`ExchangeFrame::send`] builds a whole frame of on the stack: one whose
/// frame fits a shared-memory box slot ([`cohort_core::shm::BOX_BYTES`]).
const SMALL_FRAME_PAYLOAD: usize = cohort_core::shm::BOX_BYTES - HEADER_LEN;

/// The most exchanges a chain may have ([`Chain`]): a world of 64 ranks.
pub(crate) const MAX_CHAIN: usize = 6;

/// An allreduce's exchanges, one peer at a time, as `(peer, step)` in order
/// ([`Plan::exchanges`](cohort_core::schedule::Plan::exchanges)), kept without an allocation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chain {
    steps: [(Rank, u32); MAX_CHAIN],
    len: u8,
}

impl Default for Chain {
    fn default() -> Self {
        Chain { steps: [(Rank(0), 0); MAX_CHAIN], len: 0 }
    }
}

impl Chain {
    /// `None` if there are none, or more than [`MAX_CHAIN`].
    fn new(exchanges: Vec<(Rank, u32)>) -> Option<Chain> {
        if exchanges.is_empty() || exchanges.len() > MAX_CHAIN {
            return None;
        }
        let mut chain = Chain { len: exchanges.len() as u8, ..Chain::default() };
        chain.steps[..exchanges.len()].copy_from_slice(&exchanges);
        Some(chain)
    }

    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    /// The `i`th exchange's peer and step.
    pub(crate) fn at(&self, i: usize) -> (Rank, u32) {
        self.steps[i]
    }
}

/// What [`DriverState::quick_plan`] found: the exchanges' reduction, peers and steps.
pub(crate) struct QuickPlan {
    reduction: Reduction,
    chain: Chain,
}

impl QuickPlan {
    /// The peer of the first exchange, whose frame the submitting thread waits for first.
    pub(crate) fn first_peer(&self) -> Rank {
        self.chain.at(0).0
    }

    /// The exchanges' peers, in order.
    pub(crate) fn peers(&self) -> impl Iterator<Item = Rank> + '_ {
        self.chain.steps[..self.chain.len()].iter().map(|&(peer, _)| peer)
    }
}

/// How [`DriverState::quick_start`] went.
#[allow(clippy::large_enum_variant)] // moved once a call: a box would cost the allocation this path saves
pub(crate) enum QuickStart {
    /// The core is busy after all: submit the collective the usual way, with these tensors.
    Busy(Vec<Tensor>),
    /// Its frame went: wait for the peer's.
    Sent(Exchange),
    /// Its frame did not go out at once (its link gone, if `true`): end it with
    /// [`DriverState::quick_unsent`].
    Unsent(Exchange, bool),
}

/// How [`DriverState::quick_finish`] ended a collective.
pub(crate) enum QuickEnd {
    /// It succeeded: its finished `Work`, and its hook's call to make once the lock is
    /// released.
    Ended(Work, HookCall),
    /// It failed, on the usual path: here is its `Work`.
    Work(Work),
}

/// An allreduce run in its submit call whose frame to the peer of its current exchange went,
/// waiting for the peer's ([`DriverState::quick_start`], [`DriverState::quick_next`]).
pub(crate) struct Exchange {
    /// The core's side of it, kept out of the core's table until it ends or is handed off.
    inline: InlineWork,
    /// The user's completion hook, for the `Work` made when it ends or is handed off.
    hook: Option<crate::work::CompletionHook>,
    fingerprint: Option<Fingerprint>,
    /// The current exchange's peer and step, and its place in the chain.
    peer: Rank,
    step: u32,
    at: u8,
    tag: u32,
    gid: GroupId,
    /// The caller's vector with its one tensor, reduced in place and handed back as the
    /// outputs (no vector of its own to allocate).
    tensors: Vec<Tensor>,
    reduction: Reduction,
    op: ReduceOp,
}

/// What an exchange handed off still needs ([`DriverState::adopt`]).
struct Adopted {
    seq: SeqNo,
    /// The current exchange's peer and its place in the chain.
    peer: Rank,
    at: usize,
    tensors: Vec<Tensor>,
    op: ReduceOp,
}

impl Exchange {
    /// The peer whose part the exchange waits for now.
    pub(crate) fn peer(&self) -> Rank {
        self.peer
    }

    /// The current exchange's place in the chain (0: the first).
    pub(crate) fn place(&self) -> usize {
        self.at as usize
    }

    /// When its work was submitted, after the group's epoch.
    pub(crate) fn submitted(&self) -> Duration {
        self.inline.submitted()
    }

    /// Whether the frame is the peer's part of the current exchange: the same group, sequence
    /// number, step and fingerprint tag, and as many bytes as this rank's.
    fn matches(&self, header: &FrameHeader, payload: &[u8]) -> bool {
        header.kind == FrameKind::Data
            && header.group == self.gid
            && header.source == self.peer
            && header.seq == self.inline.seq()
            && header.step == self.step
            && header.tag == self.tag
            && payload.len() == self.tensors[0].nbytes()
    }
}

/// What a collective made of one part a peer sent ([`DriverState::take_part`]).
enum Part {
    /// It took it.
    Taken,
    /// The part ends the work: a desync, or a part it cannot take.
    Failed(Completion),
    /// The work is no longer a running collective.
    Gone,
}

/// Queue a frame for `to`; false if the link is gone.
fn send(writers: &Writers, to: Rank, out: Outbound) -> bool {
    writers.get(&to).is_some_and(|lanes| lanes.send(out, SendMode::QUEUE) != Sent::Gone)
}

/// Hand what a connection delivered to the driver state: a frame, or the connection's end.
pub(crate) fn deliver(st: &mut DriverState, fx: &mut Effects, inbound: Inbound) {
    match inbound {
        Inbound::Frame { from, header, payload } => st.handle_frame(super::now(), from, header, payload, fx),
        Inbound::Closed { from, reason, clean } => st.handle_closed(super::now(), from, reason, clean, fx),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use cohort_core::group::WorkSummary;
    use cohort_core::work::{Lifecycle, OpType, SeqNo, WorkId, WorkResult, WorkState};

    use super::{Effects, Finished};
    use crate::work::{CompletionHook, Work};

    /// A vacant gathering is one whose drop may be skipped: anything in it, or anything it
    /// allocated and still holds, makes it not vacant.
    #[test]
    fn effects_are_vacant_only_when_empty_with_nothing_allocated() {
        assert!(Effects::default().is_vacant());
        // A flag holds nothing to free.
        assert!(Effects { rearm_timer: true, ..Effects::default() }.is_vacant());
        let failed = Effects {
            failed: Some((cohort_core::Rank(1), cohort_core::Blame::nobody(), "x".into())),
            ..Effects::default()
        };
        assert!(!failed.is_vacant());
        assert!(!Effects { tear_down: Some(String::new()), ..Effects::default() }.is_vacant());
        // Emptied, but still holding its allocation.
        let mut reserve = Vec::with_capacity(1);
        reserve.clear();
        assert!(!Effects { reserve, ..Effects::default() }.is_vacant());
        let mut finished = Finished::default();
        finished.0.reserve(1);
        assert!(finished.is_empty());
        assert!(!Effects { finished, ..Effects::default() }.is_vacant());
    }

    #[test]
    fn finished_works_complete_in_the_order_they_finished() {
        for n in [0, 1, 2, 5] {
            let order = Arc::new(Mutex::new(Vec::new()));
            let hook: CompletionHook = {
                let order = order.clone();
                Arc::new(move |info| order.lock().unwrap().push(info.seq.0))
            };
            let mut finished = Finished::default();
            let mut works = Vec::new();
            for i in 0..n {
                let (work, completer) = Work::pending(WorkId(i), SeqNo(i), OpType::Allreduce, Some(hook.clone()));
                let mut lifecycle = Lifecycle::new(Duration::ZERO);
                lifecycle.start(Duration::ZERO).unwrap();
                lifecycle.finish(Duration::from_millis(1), WorkState::Completed).unwrap();
                let summary = WorkSummary {
                    id: WorkId(i),
                    seq: SeqNo(i),
                    is_p2p: false,
                    op: OpType::Allreduce,
                    result: WorkResult::Success,
                    lifecycle,
                };
                finished.push((completer, summary, Vec::new()));
                works.push(work);
            }
            assert!(works.iter().all(|w| !w.is_completed()), "nothing completes before `complete`");
            finished.complete();
            assert!(works.iter().all(Work::is_completed));
            assert_eq!(*order.lock().unwrap(), (0..n).collect::<Vec<_>>(), "{n} works");
        }
    }
}
