//! The TCP backend's driver state: the core's [`GroupState`] plus the data plane (running
//! schedules, point-to-point matching, early frames) and the links to peers.
//!
//! Every input — a user submit, a frame, a closed connection, a timer — locks the state, feeds
//! the core exactly one input, and drains every output ([`DriverState::drain`]). Works that end
//! are finished *after* the lock is released ([`Finished::complete`]), so that waiters and
//! completion hooks never run under it.

use std::collections::BTreeMap;
use std::time::Instant;

use bytes::Bytes;
use cohort_core::group::{Collective, Completion, ControlMsg, Event, GroupState, Launch, SubmitError, WorkSummary};
use cohort_core::p2p::Matcher;
use cohort_core::protocol::{Fingerprint, FrameHeader, FrameKind, decode_control, encode_control};
use cohort_core::schedule::PlanCache;
use cohort_core::seqmap::SeqMap;
use cohort_core::tensor::Tensor;
use cohort_core::work::{Blame, GroupId, Rank, SeqNo, WorkId};

use super::collective::CollectiveRun;
use super::link::{Corks, Inbound, LaneRx, LaneTx, Lanes, Outbound, SendMode, Sent};
use super::tunables::SEND_WINDOW;
use crate::work::{Work, WorkCompleter};

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

/// A data frame that arrived before its collective started: sender, step, tag, payload.
type EarlyFrame = (Rank, u32, u32, Vec<u8>);

#[derive(Debug)]
struct Pending {
    completer: WorkCompleter,
    payload: Payload,
    outputs: Vec<Tensor>,
    /// Frames of this work queued but not yet on the socket.
    unwritten: usize,
    /// The data side is done (a collective's schedule finished, a send was queued); the work
    /// completes once `unwritten` is 0 too, so that a rank that exits right after a work
    /// completes never takes unsent bytes with it.
    data_done: bool,
    /// A collective's op, dtype and root, sent in every data frame's tag and checked against
    /// what peers send (see [`Fingerprint`]).
    fingerprint: Option<Fingerprint>,
    /// A collective stopped taking frames to send at [`SEND_WINDOW`]; it goes on as its frames
    /// are written.
    throttled: bool,
}

pub(crate) use super::link::OnWritten;

/// Works that ended under the lock, to be finished after it is released.
#[derive(Debug, Default)]
#[must_use = "finished works must be completed after the lock is released"]
pub(crate) struct Finished(Vec<(WorkCompleter, WorkSummary, Vec<Tensor>)>);

impl Finished {
    /// Wake every waiter and run the hooks. Call with no lock held.
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

/// The driver state of one rank in one TCP process group.
#[derive(Debug)]
pub(crate) struct DriverState {
    pub(crate) group: GroupState,
    me: Rank,
    gid: GroupId,
    writers: Vec<Option<Lanes>>,
    pending: SeqMap<WorkId, Pending>,
    /// Running collectives by sequence number.
    running: SeqMap<SeqNo, WorkId>,
    /// Plans of the collectives run so far, reused by later runs of the same ones.
    plans: PlanCache,
    /// Data frames for collectives this rank has not launched yet.
    early: BTreeMap<SeqNo, Vec<EarlyFrame>>,
    /// A collective is being started and fed its early frames (see `launch`).
    starting: bool,
    /// p2p matching: posted receives, and payloads nobody has asked for yet.
    p2p: Matcher<WorkId>,
    /// Highest collective seq finished here; frames for older ones are stale.
    last_finished_seq: SeqNo,
    /// Peers whose connection is gone.
    closed: BTreeMap<Rank, String>,
    /// The ranks a running collective waits for, as last asked (the allocation is reused).
    waiting_scratch: Vec<Rank>,
    /// Frames queued for each peer and not yet written.
    unwritten_to: BTreeMap<Rank, usize>,
    /// Their sum, readable without the lock (see [`DriverState::writing_count`]).
    unwritten_total: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Peers that said goodbye while frames to them were still being written: their
    /// departure is handled once those writes finish, so a send that reached them succeeds.
    deferred_departures: std::collections::BTreeSet<Rank>,
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
        writers: Vec<Option<Lanes>>,
        lazy: Option<u16>,
        on_written: OnWritten,
        pool: super::link::BufferPool,
    ) -> Self {
        DriverState {
            me: group.rank(),
            gid: group.config().group_id,
            group,
            writers,
            pending: SeqMap::new(),
            running: SeqMap::new(),
            plans: PlanCache::default(),
            early: BTreeMap::new(),
            starting: false,
            p2p: Matcher::new(),
            last_finished_seq: SeqNo(0),
            closed: BTreeMap::new(),
            waiting_scratch: Vec::new(),
            unwritten_to: BTreeMap::new(),
            unwritten_total: Default::default(),
            deferred_departures: std::collections::BTreeSet::new(),
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
        let missing = self.writers.get(to.index()).is_some_and(Option::is_none);
        if missing
            && let Some(k) = self.lazy
            && to != self.me
            && !self.closed.contains_key(&to)
            && !self.group.is_aborted()
            && self.group.failure().is_none()
        {
            let (txs, rxs): (Vec<_>, Vec<_>) = (0..k).map(|_| super::link::lane()).unzip();
            self.writers[to.index()] = Some(Lanes::new(txs));
            self.dial_requests.push((to, rxs));
        }
        self.writers.get(to.index()).and_then(Option::as_ref)
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

    /// Peers to dial now (lazy connection), each with its connections' queues.
    pub(crate) fn take_dial_requests(&mut self) -> Vec<(Rank, Vec<LaneRx>)> {
        std::mem::take(&mut self.dial_requests)
    }

    /// A full set of connections from `peer` was accepted (lazy connection). If this rank has no
    /// lanes to `peer` yet, they become its lanes (the queues are returned); otherwise this
    /// rank already writes over connections it dialed and only reads from these (`None`).
    /// Either way `peer` now counts as connected.
    pub(crate) fn accept_lanes(&mut self, now: Instant, peer: Rank, n: usize) -> Option<Vec<LaneRx>> {
        if self.closed.contains_key(&peer) || peer == self.me {
            return None;
        }
        self.group.handle_peer_connected(now, peer);
        let slot = self.writers.get_mut(peer.index())?;
        if slot.is_some() {
            return None;
        }
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| super::link::lane()).unzip();
        *slot = Some(Lanes::new(txs));
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
        self.pending.insert(
            id,
            Pending {
                completer,
                payload,
                outputs: Vec::new(),
                unwritten: 0,
                data_done: false,
                fingerprint,
                throttled: false,
            },
        );
        self.corking = self.corks.in_burst();
        self.drain(now, effects);
        self.corking = false;
        effects.rearm_timer = true;
        Ok(work)
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
            kind => match decode_control(kind, header.seq, &payload, self.writers.len() as u32) {
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
        if self.closed.contains_key(&from) {
            return;
        }
        self.closed.insert(from, reason.clone());
        if let Some(w) = self.writers.get_mut(from.index()) {
            *w = None;
        }
        if clean {
            if self.unwritten_to.get(&from).copied().unwrap_or(0) > 0 {
                self.deferred_departures.insert(from);
            } else {
                self.departed(now, from);
            }
        } else {
            self.group.handle_peer_lost(now, from, reason);
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
        let left = self.unwritten_to.entry(to).or_default();
        let done = ids.len().min(*left);
        *left -= done;
        let left = *left;
        self.unwritten_total.fetch_sub(done, std::sync::atomic::Ordering::Relaxed);
        for &id in ids {
            let Some(p) = self.pending.get_mut(&id) else { continue };
            p.unwritten = p.unwritten.saturating_sub(1);
            let resume = p.throttled && outcome.is_ok();
            match &outcome {
                Ok(()) if resume => self.after_step(now, id, Ok(())),
                Ok(()) => self.maybe_complete(now, id),
                Err(message) => {
                    let message = message.clone();
                    self.group.handle_completion(now, id, Completion::Failed { rank: Some(to), message })
                }
            }
        }
        if left == 0 && self.deferred_departures.remove(&to) {
            self.departed(now, to);
        }
        self.drain(now, effects);
    }

    /// `peer` said goodbye and everything it sent has arrived: works that still wait for it
    /// can never finish, so they fail naming it; nothing else does.
    fn departed(&mut self, now: Instant, peer: Rank) {
        self.group.handle_peer_departed(now, peer);
        for id in self.p2p.waiting_for(peer) {
            let message = format!("rank {peer} shut its process group down without sending what this recv waits for");
            self.group.handle_completion(now, id, Completion::Failed { rank: Some(peer), message });
        }
        let running: Vec<WorkId> = self.running.iter().map(|(_, &id)| id).collect();
        for id in running {
            self.fail_if_stranded(now, id);
        }
    }

    /// Fail a running collective that waits for a peer whose connection is closed.
    fn fail_if_stranded(&mut self, now: Instant, id: WorkId) {
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = self.pending.get(&id) else {
            return;
        };
        let mut ranks = Vec::new();
        run.waiting_on(&mut ranks);
        self.fail_if_waiting_on_closed(now, id, &ranks);
    }

    /// Fail work `id` if one of `ranks`, whose parts it waits for, has its connection closed.
    fn fail_if_waiting_on_closed(&mut self, now: Instant, id: WorkId, ranks: &[Rank]) {
        if let Some((&p, why)) = ranks.iter().find_map(|r| self.closed.get_key_value(r)) {
            let message = format!("rank {p} is gone before sending its part ({why})");
            self.group.handle_completion(now, id, Completion::Failed { rank: Some(p), message });
        }
    }

    /// Complete `id` once its data side is done and every frame of it is written.
    fn maybe_complete(&mut self, now: Instant, id: WorkId) {
        if self.pending.get(&id).is_some_and(|p| p.data_done && p.unwritten == 0) {
            self.group.handle_completion(now, id, Completion::Success);
        }
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
        SendMode { direct: self.pending.len() <= 1, cork: self.corking.then(|| self.corks.clone()) }
    }

    /// Count a frame of work `id` to `to` that was queued (it must be written before the work
    /// completes); false if the link is gone.
    fn count_sent(&mut self, id: WorkId, to: Rank, sent: Sent) -> bool {
        match sent {
            Sent::Gone => return false,
            Sent::Written => {}
            Sent::Queued => {
                if let Some(p) = self.pending.get_mut(&id) {
                    p.unwritten += 1;
                }
                *self.unwritten_to.entry(to).or_default() += 1;
                self.unwritten_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        self.pending
            .get(&id)
            .is_some_and(|p| matches!(p.payload, Payload::Recv { tensor: None, .. }) && !p.outputs.is_empty())
    }

    /// The flight recorder as JSON.
    pub(crate) fn dump_json(&self) -> String {
        self.group.dump().to_json()
    }

    /// Close every writer: the writer tasks say goodbye and end.
    pub(crate) fn close_links(&mut self) {
        for w in &mut self.writers {
            *w = None;
        }
        self.idle.clear();
    }

    fn handle_data(&mut self, now: Instant, from: Rank, seq: SeqNo, step: u32, tag: u32, payload: Vec<u8>) {
        if let Some(&id) = self.running.get(&seq) {
            self.feed(now, id, from, step, tag, payload);
        } else if seq > self.last_finished_seq {
            self.early.entry(seq).or_default().push((from, step, tag, payload));
        } else {
            tracing::debug!(%from, %seq, step, "dropping a data frame for a finished collective");
            self.pool.give(payload);
        }
    }

    fn handle_p2p(&mut self, now: Instant, from: Rank, tag: u32, payload: Vec<u8>) {
        if let Some((id, payload)) = self.p2p.arrive(from, tag, payload) {
            self.complete_recv(now, id, from, payload);
        }
    }

    fn complete_recv(&mut self, now: Instant, id: WorkId, from: Rank, bytes: Vec<u8>) {
        let Some(p) = self.pending.get_mut(&id) else { return };
        let Payload::Recv { tensor, .. } = &mut p.payload else { return };
        let Some(mut t) = tensor.take() else { return };
        if bytes.len() != t.nbytes() {
            let message = format!(
                "recv from rank {from}: {} bytes arrived for a tensor of {} bytes ({} × {})",
                bytes.len(),
                t.nbytes(),
                t.numel(),
                t.dtype()
            );
            self.pool.give(bytes);
            self.group.handle_completion(now, id, Completion::Failed { rank: Some(from), message });
            return;
        }
        t.bytes_mut().copy_from_slice(&bytes);
        p.outputs = vec![t];
        p.completer.set_source_rank(from);
        self.pool.give(bytes);
        self.group.handle_completion(now, id, Completion::Success);
    }

    /// Feed one data frame to a running collective and push what it wants to send.
    fn feed(&mut self, now: Instant, id: WorkId, from: Rank, step: u32, tag: u32, payload: Vec<u8>) {
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, fingerprint, .. }) =
            self.pending.get_mut(&id)
        else {
            self.pool.give(payload);
            return;
        };
        if let (Some(mine), Some(theirs)) = (*fingerprint, Fingerprint::from_tag(tag))
            && mine != theirs
        {
            let message =
                format!("desync at seq {}: rank {from} is running {theirs} while this rank runs {mine}", run.seq());
            self.pool.give(payload);
            self.group.handle_completion(now, id, Completion::Mismatch { rank: from, message });
            return;
        }
        let result = run.handle_recv(from, step, &payload);
        self.pool.give(payload);
        match result {
            // A part that does not fit the plan (another size, step or chunk): the core asks
            // every rank what it runs before blaming anyone.
            Err(e) => {
                let message = format!("rank {from}'s part does not fit this rank's collective: {e}");
                self.group.handle_completion(now, id, Completion::Mismatch { rank: from, message });
            }
            Ok(()) => self.after_step(now, id, Ok(())),
        }
    }

    /// After an input to a running collective: send what it wants sent, then see where it is.
    fn after_step(&mut self, now: Instant, id: WorkId, result: Result<(), String>) {
        match result {
            Err(message) => {
                self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
            }
            Ok(()) => {
                self.send_outgoing(now, id);
                let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, throttled: false, .. }) =
                    self.pending.get(&id)
                else {
                    return; // gone, or more to send once frames are written
                };
                if !run.is_done() {
                    let mut ranks = std::mem::take(&mut self.waiting_scratch);
                    run.waiting_on(&mut ranks);
                    self.group.handle_waiting_on(now, id, &ranks);
                    if !self.starting {
                        self.fail_if_waiting_on_closed(now, id, &ranks);
                    }
                    self.waiting_scratch = ranks;
                    return;
                }
                let Some(p) = self.pending.get_mut(&id) else { return };
                let Payload::Collective { run, .. } = &mut p.payload else { return };
                let Some(run) = run.take() else { return };
                match run.finish() {
                    Ok(outputs) => {
                        p.outputs = outputs;
                        p.data_done = true;
                        self.maybe_complete(now, id);
                    }
                    Err(message) => {
                        self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
                    }
                }
            }
        }
    }

    fn send_outgoing(&mut self, now: Instant, id: WorkId) {
        let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, fingerprint, .. }) =
            self.pending.get_mut(&id)
        else {
            return;
        };
        let fingerprint = *fingerprint;
        let seq = run.seq();
        loop {
            let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, unwritten, throttled, .. }) =
                self.pending.get_mut(&id)
            else {
                return;
            };
            if *unwritten >= SEND_WINDOW {
                *throttled = true;
                return;
            }
            *throttled = false;
            let Some(out) = run.poll_send() else { return };
            let to = out.to;
            // Straight from the collective's buffer when this thread writes it; whatever the
            // socket does not take now is copied and queued.
            let mode = self.mode();
            let sent = match self.lanes_for(to).is_some() {
                false => Sent::Gone,
                true => {
                    let DriverState { writers, pending, pool, on_written, .. } = &*self;
                    let Some(Pending { payload: Payload::Collective { run: Some(run), .. }, .. }) = pending.get(&id)
                    else {
                        return;
                    };
                    let bytes = run.payload(&out);
                    let mut header = FrameHeader::data(self.gid, seq, out.step, self.me, bytes.len() as u64);
                    header.tag = fingerprint.map_or(0, Fingerprint::to_tag);
                    let written = super::link::Written { id, hook: on_written.0.clone() };
                    let lane =
                        writers.get(to.index()).and_then(Option::as_ref).and_then(|l| l.lane_for(&header, bytes.len()));
                    lane.map_or(Sent::Gone, |l| l.send_slice(header, bytes, Some(written), mode, |b| pool.bytes(b)))
                }
            };
            if !self.count_sent(id, to, sent) {
                let message = format!("connection to rank {to} is closed");
                self.group.handle_completion(now, id, Completion::Failed { rank: Some(to), message });
                return;
            }
        }
    }

    /// Drain every output of the core until nothing is left.
    fn drain(&mut self, now: Instant, effects: &mut Effects) {
        loop {
            let mut progressed = false;
            while let Some(t) = self.group.poll_transmit() {
                progressed = true;
                let (header, payload) = match t.msg {
                    ControlMsg::Heartbeat => (FrameHeader::heartbeat(self.me), Bytes::new()),
                    msg => {
                        let f = encode_control(&msg);
                        let mut h = FrameHeader::data(self.gid, f.seq, 0, self.me, f.payload.len() as u64);
                        h.kind = f.kind;
                        (h, Bytes::from(f.payload))
                    }
                };
                send(&self.writers, t.to, Outbound::new(header, payload, None));
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
        let Some(p) = self.pending.get_mut(&id) else { return };
        match &mut p.payload {
            Payload::Send { peer, tag, tensor } => {
                let bytes = Bytes::copy_from_slice(tensor.bytes());
                let header = FrameHeader::p2p(self.gid, launch.seq, self.me, *tag, bytes.len() as u64);
                let peer = *peer;
                p.data_done = true;
                if self.send_frame(id, peer, header, bytes) {
                    self.maybe_complete(now, id); // the frame may be on the socket already
                } else {
                    let message = format!("connection to rank {peer} is closed");
                    self.group.handle_completion(now, id, Completion::Failed { rank: Some(peer), message });
                }
            }
            Payload::Recv { peer, tag, .. } => {
                let (peer, tag) = (*peer, *tag);
                match self.p2p.take_held(peer, tag) {
                    Some((from, bytes)) => self.complete_recv(now, id, from, bytes),
                    None => match peer.and_then(|p| self.closed.get(&p).map(|why| (p, why.clone()))) {
                        // Everything the peer sent arrived before its connection closed.
                        Some((p, why)) => {
                            let message = format!("nothing from rank {p} with tag {tag} arrived before: {why}");
                            self.group.handle_completion(now, id, Completion::Failed { rank: Some(p), message });
                        }
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
                    Ok(r) => {
                        // Buffers for what it receives (and for the next collective of its
                        // size, whose chunks may arrive before that one starts here).
                        let plan = r.plan();
                        if self.pool.needs_reserve(plan.recv_bytes(), plan.largest_recv()) {
                            effects.reserve.push((self.pool.clone(), plan.recv_bytes(), plan.largest_recv()));
                        }
                        *run = Some(Box::new(r));
                    }
                    Err(message) => {
                        self.group.handle_completion(now, id, Completion::Failed { rank: None, message });
                        return;
                    }
                }
                self.running.insert(launch.seq, id);
                // Frames that arrived before this rank started the collective are fed before
                // asking whether it waits on a closed peer: a peer that sent its part and then
                // shut down cleanly left everything needed here.
                self.starting = true;
                self.after_step(now, id, Ok(()));
                for (from, step, tag, bytes) in self.early.remove(&launch.seq).unwrap_or_default() {
                    if self.running.contains_key(&launch.seq) {
                        self.feed(now, id, from, step, tag, bytes);
                    } else {
                        self.pool.give(bytes);
                    }
                }
                self.starting = false;
                if self.running.contains_key(&launch.seq) {
                    self.fail_if_stranded(now, id);
                }
            }
        }
    }

    fn handle_event(&mut self, event: Event, effects: &mut Effects) {
        match event {
            Event::WorkFinished(summary) => {
                if !summary.is_p2p {
                    self.running.remove(&summary.seq);
                    self.last_finished_seq = self.last_finished_seq.max(summary.seq);
                    // Frames for collectives up to the last finished are stale: their
                    // buffers go back to the pool.
                    let live = self.early.split_off(&SeqNo(self.last_finished_seq.0.saturating_add(1)));
                    for (_, _, _, payload) in std::mem::replace(&mut self.early, live).into_values().flatten() {
                        self.pool.give(payload);
                    }
                }
                self.p2p.forget(summary.id);
                if let Some(p) = self.pending.remove(&summary.id) {
                    effects.finished.0.push((p.completer, summary, p.outputs));
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

/// Queue a frame for `to`; false if the link is gone.
fn send(writers: &[Option<Lanes>], to: Rank, out: Outbound) -> bool {
    writers.get(to.index()).and_then(Option::as_ref).is_some_and(|lanes| lanes.send(out, SendMode::QUEUE) != Sent::Gone)
}

/// Hand what a connection delivered to the driver state: a frame, or the connection's end.
pub(crate) fn deliver(st: &mut DriverState, fx: &mut Effects, inbound: Inbound) {
    match inbound {
        Inbound::Frame { from, header, payload } => st.handle_frame(super::now(), from, header, payload, fx),
        Inbound::Closed { from, reason, clean } => st.handle_closed(super::now(), from, reason, clean, fx),
    }
}
