//! The data plane's decisions, sans-IO: when a work's data is done *and* on the wire, which
//! collective a data frame belongs to (or whether it is early or stale), how many frames a
//! collective may have queued, and what a peer's goodbye or lost connection means for the
//! works that still need it.
//!
//! [`GroupState`](crate::group::GroupState) decides a work's lifecycle; a driver moves bytes.
//! In between sits this table: the driver tells it what happened on its queues and sockets
//! (a frame queued, frames written, a frame arrived, a connection ended), and it answers with
//! what follows — feed this collective, resume that one, complete, fail with this
//! [`Completion`] — which the driver hands to the group. The rules:
//!
//! - **Completion.** A work completes once its data side is done (a collective's schedule
//!   finished, a send queued) *and* every frame it queued has been written, so that a rank that
//!   exits right after a work completes never takes unsent bytes with it. It is reported
//!   complete once.
//! - **Send window.** A collective stops taking frames to send while it has
//!   [`DataPlane::new`]'s window of them queued and unwritten; it resumes as they are written.
//! - **Early and stale frames.** A data frame for a collective this rank has not launched yet
//!   is held, and handed over, in arrival order, when it launches. A frame for a collective
//!   that finished here is stale: its payload is given back.
//! - **Goodbyes.** A peer that said goodbye while frames to it were still queued *departs*
//!   only once they are written, so that a send that reached it succeeds. A departed peer
//!   fails only the works that still wait for its data ([`DataPlane::stranded`]); a lost one
//!   is the group's to judge.
//! - **Desyncs.** A data frame carries its collective's [`Fingerprint`]; one that differs from
//!   this rank's is a mismatch for the group's census, never a blame by itself.
//!
//! Every error text a peer's behaviour can cause on the data plane is made here, so that every
//! driver (TCP, the simulator, which runs the TCP driver) words it the same way.
//!
//! [`model`] runs random operation sequences against it and checks these rules; the property
//! tests and a fuzz target drive it.

use std::collections::{BTreeMap, BTreeSet};

use crate::group::Completion;
use crate::protocol::Fingerprint;
use crate::seqmap::SeqMap;
use crate::tensor::Tensor;
use crate::work::{Rank, SeqNo, WorkId};

pub mod model;

/// A data frame as the data plane keeps it: its sender, schedule step, tag and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataFrame<P> {
    /// The rank that sent it.
    pub from: Rank,
    /// The schedule step it belongs to.
    pub step: u32,
    /// Its tag (the sender's [`Fingerprint`]).
    pub tag: u32,
    /// The bytes.
    pub payload: P,
}

/// Where an arriving data frame goes ([`DataPlane::route`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Route<P> {
    /// To the running collective `id`.
    Feed(WorkId, DataFrame<P>),
    /// Held until its collective launches here.
    Held,
    /// Its collective finished here: the payload is given back.
    Stale(P),
}

/// What a written (or failed) frame means for its work ([`DataPlane::work_written`]).
#[derive(Debug, PartialEq, Eq)]
pub enum AfterWrite {
    /// Nothing yet.
    Nothing,
    /// The work is complete: its data was done and this was its last unwritten frame.
    Complete,
    /// The collective was held at the send window and may send again.
    Resume,
    /// The frame could not be written: the work fails.
    Fail(Completion),
}

/// What an ended connection means ([`DataPlane::peer_closed`]).
#[derive(Debug, PartialEq, Eq)]
pub enum PeerClosed {
    /// The peer's connection had ended already; nothing changes.
    Again,
    /// The peer said goodbye and everything to it is written: it departs now.
    Departed,
    /// The peer said goodbye with frames to it still queued: it departs once they are written
    /// ([`DataPlane::frames_written`] says when).
    Deferred,
    /// The connection broke: the peer is lost.
    Lost,
}

/// What ended with a work ([`DataPlane::finish`]).
#[derive(Debug)]
pub struct Finished<W, P> {
    /// The driver's data of the work, if it was tracked.
    pub work: Option<W>,
    /// Payloads of frames that became stale (a collective finished): give them back.
    pub stale: Vec<P>,
}

#[derive(Debug)]
struct Tracked<W> {
    data: W,
    fingerprint: Option<Fingerprint>,
    unwritten: usize,
    data_done: bool,
    throttled: bool,
    completed: bool,
}

impl<W> Tracked<W> {
    /// Complete (once) if the data is done and nothing is left to write.
    fn ready(&mut self) -> bool {
        let ready = self.data_done && self.unwritten == 0 && !self.completed;
        self.completed |= ready;
        ready
    }
}

/// The data plane of one rank in one group: the works in flight with the driver's data `W`
/// for each, and data frames with payloads `P` (see the [module docs](self)).
#[derive(Debug)]
pub struct DataPlane<W, P> {
    works: SeqMap<WorkId, Tracked<W>>,
    /// Running collectives by sequence number.
    running: SeqMap<SeqNo, WorkId>,
    /// Data frames for collectives not launched here yet, per sequence number.
    early: BTreeMap<SeqNo, Vec<DataFrame<P>>>,
    /// Highest collective seq finished here; frames for older ones are stale.
    last_finished: SeqNo,
    /// A collective is being launched and fed its early frames.
    starting: bool,
    unwritten_to: BTreeMap<Rank, usize>,
    unwritten_total: usize,
    /// Peers whose connection ended, with why.
    closed: BTreeMap<Rank, String>,
    /// Peers that said goodbye with frames to them still queued.
    deferred: BTreeSet<Rank>,
    window: usize,
}

impl<W, P> DataPlane<W, P> {
    /// No works; a collective may have up to `send_window` frames queued and unwritten (at
    /// least 1).
    pub fn new(send_window: usize) -> Self {
        DataPlane {
            works: SeqMap::new(),
            running: SeqMap::new(),
            early: BTreeMap::new(),
            last_finished: SeqNo(0),
            starting: false,
            unwritten_to: BTreeMap::new(),
            unwritten_total: 0,
            closed: BTreeMap::new(),
            deferred: BTreeSet::new(),
            window: send_window.max(1),
        }
    }

    // ---- Works -------------------------------------------------------------------------

    /// Track a submitted work: ids come in increasing order. `fingerprint` is a collective's
    /// (checked against what peers send, see [`DataPlane::check`]).
    pub fn track(&mut self, id: WorkId, fingerprint: Option<Fingerprint>, data: W) {
        self.works.insert(
            id,
            Tracked { data, fingerprint, unwritten: 0, data_done: false, throttled: false, completed: false },
        );
    }

    /// The driver's data of work `id`.
    pub fn work(&self, id: WorkId) -> Option<&W> {
        self.works.get(&id).map(|t| &t.data)
    }

    /// The driver's data of work `id`, to change.
    pub fn work_mut(&mut self, id: WorkId) -> Option<&mut W> {
        self.works.get_mut(&id).map(|t| &mut t.data)
    }

    /// How many works are tracked.
    pub fn len(&self) -> usize {
        self.works.len()
    }

    /// Whether no work is tracked.
    pub fn is_empty(&self) -> bool {
        self.works.is_empty()
    }

    /// The data side of work `id` is done; true if it is complete now (nothing of it is left
    /// to write). Reported once.
    pub fn data_done(&mut self, id: WorkId) -> bool {
        self.works.get_mut(&id).is_some_and(|t| {
            t.data_done = true;
            t.ready()
        })
    }

    /// Work `id` ended (the group said so): stop tracking it. For a collective (`seq` given),
    /// frames for it and every older collective are stale from now on.
    pub fn finish(&mut self, id: WorkId, collective: Option<SeqNo>) -> Finished<W, P> {
        let mut stale = Vec::new();
        if let Some(seq) = collective {
            self.running.remove(&seq);
            self.collective_ended(seq, &mut stale);
        }
        Finished { work: self.works.remove(&id).map(|t| t.data), stale }
    }

    /// Collective `seq` ended: frames for it and every older collective are stale from now on;
    /// the payloads of those held are added to `stale`. [`DataPlane::finish`] calls it for a
    /// collective this plane tracked; a driver calls it alone for one the plane never tracked
    /// nor ran (run to its end inside its submit call).
    pub fn collective_ended(&mut self, seq: SeqNo, stale: &mut Vec<P>) {
        self.last_finished = self.last_finished.max(seq);
        if !self.early.is_empty() {
            let live = self.early.split_off(&SeqNo(self.last_finished.0.saturating_add(1)));
            stale.extend(std::mem::replace(&mut self.early, live).into_values().flatten().map(|f| f.payload));
        }
    }

    // ---- Collectives and their frames ---------------------------------------------------

    /// Collective `id` launched as `seq`: it takes frames from now on. Returns the frames that
    /// arrived for it before, in arrival order; until [`DataPlane::launched`], it is not judged
    /// stranded ([`DataPlane::stranded`]), since those frames may be all it needs from a peer
    /// that has gone since.
    pub fn launch(&mut self, seq: SeqNo, id: WorkId) -> Vec<DataFrame<P>> {
        self.running.insert(seq, id);
        self.starting = true;
        self.early.remove(&seq).unwrap_or_default()
    }

    /// The collective launched last has been fed its early frames.
    pub fn launched(&mut self) {
        self.starting = false;
    }

    /// Whether collective `seq` is running here.
    pub fn is_running(&self, seq: SeqNo) -> bool {
        self.running.contains_key(&seq)
    }

    /// The running collectives, oldest first.
    pub fn running(&self) -> Vec<WorkId> {
        self.running.iter().map(|(_, &id)| id).collect()
    }

    /// The running collective `seq` is, if it runs: a frame for it would be fed to it
    /// ([`Route::Feed`]) by [`DataPlane::route`].
    pub fn running_id(&self, seq: SeqNo) -> Option<WorkId> {
        self.running.get(&seq).copied()
    }

    /// Where a data frame for collective `seq` goes.
    pub fn route(&mut self, seq: SeqNo, frame: DataFrame<P>) -> Route<P> {
        if let Some(&id) = self.running.get(&seq) {
            Route::Feed(id, frame)
        } else if seq > self.last_finished {
            self.early.entry(seq).or_default().push(frame);
            Route::Held
        } else {
            Route::Stale(frame.payload)
        }
    }

    /// How many frames are held for collectives not launched yet.
    pub fn held(&self) -> usize {
        self.early.values().map(Vec::len).sum()
    }

    /// Check a frame from `from` with `tag` against collective `id` (running as `seq`): a
    /// different fingerprint is a [`Completion::Mismatch`].
    pub fn check(&self, id: WorkId, seq: SeqNo, from: Rank, tag: u32) -> Result<(), Completion> {
        let mine = self.works.get(&id).and_then(|t| t.fingerprint);
        match (mine, Fingerprint::from_tag(tag)) {
            (Some(mine), Some(theirs)) if mine != theirs => Err(Completion::Mismatch {
                rank: from,
                message: format!("desync at seq {seq}: rank {from} is running {theirs} while this rank runs {mine}"),
            }),
            _ => Ok(()),
        }
    }

    // ---- Sending -----------------------------------------------------------------------

    /// The tag of work `id`'s data frames: its [`Fingerprint`], 0 for none.
    pub fn tag(&self, id: WorkId) -> u32 {
        self.works.get(&id).and_then(|t| t.fingerprint).map_or(0, Fingerprint::to_tag)
    }

    /// Whether collective `id` may queue another frame now. At the send window it may not,
    /// and it is resumed ([`AfterWrite::Resume`]) when one of its frames is written.
    pub fn window_open(&mut self, id: WorkId) -> bool {
        let window = self.window;
        self.works.get_mut(&id).is_none_or(|t| {
            t.throttled = t.unwritten >= window;
            !t.throttled
        })
    }

    /// A frame of work `id` to `to` was queued: the work waits for it to be written.
    pub fn queued(&mut self, id: WorkId, to: Rank) {
        if let Some(t) = self.works.get_mut(&id) {
            t.unwritten += 1;
        }
        *self.unwritten_to.entry(to).or_default() += 1;
        self.unwritten_total += 1;
    }

    /// Frames queued and not yet written, to every peer.
    pub fn unwritten(&self) -> usize {
        self.unwritten_total
    }

    /// `n` frames to `to` were written, or cannot be. True if `to`'s departure is due now: it
    /// said goodbye while they were queued ([`PeerClosed::Deferred`]). Call
    /// [`DataPlane::work_written`] for each frame's work before handling the departure.
    pub fn frames_written(&mut self, to: Rank, n: usize) -> bool {
        let left = self.unwritten_to.entry(to).or_default();
        let done = n.min(*left);
        *left -= done;
        self.unwritten_total -= done;
        *left == 0 && self.deferred.remove(&to)
    }

    /// A frame of work `id` to `to` was written, or could not be (`error`): what follows.
    pub fn work_written(&mut self, id: WorkId, to: Rank, error: Option<&str>) -> AfterWrite {
        let Some(t) = self.works.get_mut(&id) else { return AfterWrite::Nothing };
        t.unwritten = t.unwritten.saturating_sub(1);
        match error {
            Some(e) => AfterWrite::Fail(Completion::Failed { rank: Some(to), message: e.to_string() }),
            None if t.throttled => {
                t.throttled = false;
                AfterWrite::Resume
            }
            None if t.ready() => AfterWrite::Complete,
            None => AfterWrite::Nothing,
        }
    }

    // ---- Peers -------------------------------------------------------------------------

    /// The connection to `peer` ended: with its goodbye (`clean`) or broken, for `reason`.
    pub fn peer_closed(&mut self, peer: Rank, reason: &str, clean: bool) -> PeerClosed {
        if self.closed.contains_key(&peer) {
            return PeerClosed::Again;
        }
        self.closed.insert(peer, reason.to_string());
        match clean {
            false => PeerClosed::Lost,
            true if self.unwritten_to.get(&peer).copied().unwrap_or(0) > 0 => {
                self.deferred.insert(peer);
                PeerClosed::Deferred
            }
            true => PeerClosed::Departed,
        }
    }

    /// Whether the connection to `peer` has ended.
    pub fn is_closed(&self, peer: Rank) -> bool {
        self.closed.contains_key(&peer)
    }

    /// The failure of a collective that waits for parts from `waiting_on`, if one of them has
    /// its connection closed (none while a collective is being fed its early frames).
    pub fn stranded(&self, waiting_on: &[Rank]) -> Option<Completion> {
        if self.starting {
            return None;
        }
        let (&p, why) = waiting_on.iter().find_map(|r| self.closed.get_key_value(r))?;
        Some(Completion::Failed { rank: Some(p), message: format!("rank {p} is gone before sending its part ({why})") })
    }

    /// The failure of a receive posted for `peer` with `tag` when nothing it accepts is held,
    /// if `peer`'s connection has ended: everything it sent arrived before.
    pub fn recv_after_close(&self, peer: Option<Rank>, tag: u32) -> Option<Completion> {
        let (p, why) = peer.and_then(|p| self.closed.get_key_value(&p))?;
        Some(Completion::Failed {
            rank: Some(*p),
            message: format!("nothing from rank {p} with tag {tag} arrived before: {why}"),
        })
    }
}

/// The failure of a receive from `peer` that departed without sending what it waits for.
pub fn departed_before_send(peer: Rank) -> Completion {
    Completion::Failed {
        rank: Some(peer),
        message: format!("rank {peer} shut its process group down without sending what this recv waits for"),
    }
}

/// The failure of a work whose frame to `to` could not be queued: the link is gone.
pub fn link_gone(to: Rank) -> Completion {
    Completion::Failed { rank: Some(to), message: format!("connection to rank {to} is closed") }
}

/// Check that a message of `arrived` bytes from `from` fits the receive's tensor `into`.
pub fn check_recv(from: Rank, arrived: usize, into: &Tensor) -> Result<(), Completion> {
    if arrived == into.nbytes() {
        return Ok(());
    }
    Err(Completion::Failed {
        rank: Some(from),
        message: format!(
            "recv from rank {from}: {arrived} bytes arrived for a tensor of {} bytes ({} × {})",
            into.nbytes(),
            into.numel(),
            into.dtype()
        ),
    })
}

/// The mismatch when `from`'s part does not fit this rank's collective (another size, step or
/// chunk): the group asks every rank what it runs before blaming anyone.
pub fn part_mismatch(from: Rank, error: impl std::fmt::Display) -> Completion {
    Completion::Mismatch {
        rank: from,
        message: format!("rank {from}'s part does not fit this rank's collective: {error}"),
    }
}

#[cfg(test)]
mod tests;
