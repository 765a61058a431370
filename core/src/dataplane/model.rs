//! A reference model of the [`DataPlane`]'s rules, for property tests and the `dataplane`
//! fuzz target: [`check`] plays a sequence of [`Op`]s against a data plane and against a plain
//! model of what it must answer, and reports the first answer that differs.
//!
//! Public so that the fuzz target (its own crate) can use it; not part of the runtime API.
//!
//! ```
//! use cohort_core::dataplane::model::{Op, check};
//!
//! let ops = [
//!     Op::Submit { collective: true, fingerprint: 0 },
//!     Op::Arrive { seq: 1, from: 1, fingerprint: 0 }, // early: held
//!     Op::Launch,                                     // takes the held frame
//!     Op::Send { work: 0, to: 1 },
//!     Op::DataDone { work: 0 },                       // not complete: a frame is unwritten
//!     Op::Write { to: 1, n: 1, fail: false },         // now it is
//!     Op::Finish,
//! ];
//! check(&ops, 2).unwrap();
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use super::{AfterWrite, DataFrame, DataPlane, PeerClosed, Route};
use crate::group::Completion;
use crate::protocol::Fingerprint;
use crate::work::{OpType, Rank, SeqNo, WorkId};

/// Peers the model talks to: ranks 0..PEERS.
const PEERS: u32 = 4;
/// Collective sequence numbers frames name: 1..=SEQS.
const SEQS: u64 = 12;

/// One step of a data plane's life, as a driver would feed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Submit a work: a collective (with one of a few fingerprints) or a p2p op.
    Submit {
        /// A collective, rather than a p2p op.
        collective: bool,
        /// Which fingerprint (taken modulo a few).
        fingerprint: u8,
    },
    /// Launch the next collective submitted and not launched yet.
    Launch,
    /// A data frame arrives for collective `seq` (modulo a dozen) from `from`.
    Arrive {
        /// Its collective's sequence number.
        seq: u8,
        /// Its sender (modulo a few).
        from: u8,
        /// Its fingerprint (modulo a few).
        fingerprint: u8,
    },
    /// Work `work` (an index into the tracked works) wants to queue a frame for `to`.
    Send {
        /// Which tracked work.
        work: u8,
        /// To whom.
        to: u8,
    },
    /// Up to `n` of the oldest frames queued for `to` are written, or fail.
    Write {
        /// To whom.
        to: u8,
        /// How many.
        n: u8,
        /// They could not be written.
        fail: bool,
    },
    /// The data side of work `work` is done.
    DataDone {
        /// Which tracked work.
        work: u8,
    },
    /// The connection to `peer` ends, with a goodbye or broken.
    Close {
        /// Whose.
        peer: u8,
        /// With a goodbye.
        clean: bool,
    },
    /// The oldest tracked work ends.
    Finish,
}

impl Op {
    /// Decode operations from fuzzer bytes: three bytes each, the last one cut short ignored.
    pub fn decode(bytes: &[u8]) -> Vec<Op> {
        bytes
            .chunks_exact(3)
            .map(|c| match c[0] % 8 {
                0 => Op::Submit { collective: c[1] % 4 != 0, fingerprint: c[2] },
                1 => Op::Launch,
                2 => Op::Arrive { seq: c[1], from: c[2] & 0x0F, fingerprint: c[2] >> 4 },
                3 => Op::Send { work: c[1], to: c[2] },
                4 => Op::Write { to: c[1], n: c[2] & 0x7F, fail: c[2] & 0x80 != 0 },
                5 => Op::DataDone { work: c[1] },
                6 => Op::Close { peer: c[1], clean: c[2] % 2 == 0 },
                _ => Op::Finish,
            })
            .collect()
    }
}

/// An answer of the data plane that breaks its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The index of the operation that got it.
    pub step: usize,
    /// What was wrong.
    pub what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: {}", self.step, self.what)
    }
}

impl std::error::Error for Violation {}

fn fingerprint(variant: u8) -> Fingerprint {
    let op = [OpType::Allreduce, OpType::Broadcast, OpType::Allgather][usize::from(variant % 3)];
    Fingerprint { op, dtype: None, root: None }
}

#[derive(Debug)]
struct ModelWork {
    id: WorkId,
    /// A collective's fingerprint, and its seq once launched.
    collective: Option<(Fingerprint, Option<SeqNo>)>,
    unwritten: usize,
    data_done: bool,
    throttled: bool,
    completed: bool,
}

/// Play `ops` against a [`DataPlane`] with send window `window` and against the model; the
/// first answer that differs, or a payload lost or returned twice, is a [`Violation`].
pub fn check(ops: &[Op], window: usize) -> Result<(), Violation> {
    let window = window.max(1);
    let mut plane: DataPlane<(), u64> = DataPlane::new(window);
    let mut works: Vec<ModelWork> = Vec::new();
    let mut next_id = 0u64;
    let mut next_seq = 0u64;
    let mut last_finished = 0u64;
    let mut held: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut queues: BTreeMap<u32, VecDeque<WorkId>> = BTreeMap::new();
    let mut closed: BTreeMap<u32, bool> = BTreeMap::new();
    let mut deferred: Vec<u32> = Vec::new();
    let mut tokens = 0u64;
    let mut returned: Vec<bool> = Vec::new();

    for (step, &op) in ops.iter().enumerate() {
        let fail = |what: String| Err(Violation { step, what });
        let give_back = |token: u64, returned: &mut Vec<bool>| -> Result<(), Violation> {
            match returned.get_mut(token as usize) {
                Some(r) if !*r => {
                    *r = true;
                    Ok(())
                }
                _ => Err(Violation { step, what: format!("payload {token} returned twice or never routed") }),
            }
        };
        match op {
            Op::Submit { collective, fingerprint: f } => {
                next_id += 1;
                let id = WorkId(next_id);
                let fp = collective.then(|| fingerprint(f));
                plane.track(id, fp, ());
                works.push(ModelWork {
                    id,
                    collective: fp.map(|f| (f, None)),
                    unwritten: 0,
                    data_done: false,
                    throttled: false,
                    completed: false,
                });
            }
            Op::Launch => {
                let Some(w) = works.iter_mut().find(|w| matches!(w.collective, Some((_, None)))) else { continue };
                next_seq += 1;
                let seq = SeqNo(next_seq);
                if let Some((_, s)) = &mut w.collective {
                    *s = Some(seq);
                }
                let frames = plane.launch(seq, w.id);
                plane.launched();
                let want = held.remove(&next_seq).unwrap_or_default();
                let got: Vec<u64> = frames.iter().map(|f| f.payload).collect();
                if got != want {
                    return fail(format!("launch of seq {next_seq} handed over {got:?}, held were {want:?}"));
                }
                for t in got {
                    give_back(t, &mut returned)?;
                }
            }
            Op::Arrive { seq, from, fingerprint: f } => {
                let seq = u64::from(seq) % SEQS + 1;
                let from = Rank(u32::from(from) % PEERS);
                let token = tokens;
                tokens += 1;
                returned.push(false);
                let tag = fingerprint(f).to_tag();
                let running = works.iter().find(|w| matches!(w.collective, Some((_, Some(s)))if s.0 == seq));
                match (plane.route(SeqNo(seq), DataFrame { from, step: 0, tag, payload: token }), running) {
                    (Route::Feed(id, frame), Some(w)) if id == w.id && frame.payload == token => {
                        give_back(token, &mut returned)?;
                        let (mine, _) = w.collective.expect("a running work is a collective");
                        let checked = plane.check(id, SeqNo(seq), from, tag);
                        match (checked, mine == fingerprint(f)) {
                            (Ok(()), true) => {}
                            (Err(Completion::Mismatch { rank, .. }), false) if rank == from => {}
                            (c, _) => return fail(format!("fingerprint check of a frame from {from}: {c:?}")),
                        }
                    }
                    (Route::Held, None) if seq > last_finished => held.entry(seq).or_default().push(token),
                    (Route::Stale(t), None) if seq <= last_finished && t == token => give_back(t, &mut returned)?,
                    (route, _) => return fail(format!("frame for seq {seq} routed {route:?}")),
                }
            }
            Op::Send { work, to } => {
                let Some(w) = nth(&mut works, work) else { continue };
                let to = u32::from(to) % PEERS;
                let open = plane.window_open(w.id);
                if open != (w.unwritten < window) {
                    return fail(format!("window of {} with {} unwritten said open: {open}", w.id, w.unwritten));
                }
                w.throttled = !open;
                if open {
                    plane.queued(w.id, Rank(to));
                    w.unwritten += 1;
                    queues.entry(to).or_default().push_back(w.id);
                }
            }
            Op::Write { to, n, fail: failed } => {
                let to = u32::from(to) % PEERS;
                let queue = queues.entry(to).or_default();
                let ids: Vec<WorkId> = (0..n).map_while(|_| queue.pop_front()).collect();
                let due = plane.frames_written(Rank(to), ids.len());
                let want_due = queue.is_empty() && deferred.contains(&to);
                if due != want_due {
                    return fail(format!("departure of {to} due: {due}, expected {want_due}"));
                }
                if due {
                    deferred.retain(|&d| d != to);
                }
                for id in ids {
                    let after = plane.work_written(id, Rank(to), failed.then_some("write failed"));
                    let Some(w) = works.iter_mut().find(|w| w.id == id) else {
                        if after != AfterWrite::Nothing {
                            return fail(format!("a frame of finished {id} gave {after:?}"));
                        }
                        continue;
                    };
                    w.unwritten -= 1;
                    let want = if failed {
                        AfterWrite::Fail(Completion::Failed { rank: Some(Rank(to)), message: "write failed".into() })
                    } else if w.throttled {
                        w.throttled = false;
                        AfterWrite::Resume
                    } else if w.data_done && w.unwritten == 0 && !w.completed {
                        w.completed = true;
                        AfterWrite::Complete
                    } else {
                        AfterWrite::Nothing
                    };
                    if after != want {
                        return fail(format!("a frame of {id} written: {after:?}, expected {want:?}"));
                    }
                }
            }
            Op::DataDone { work } => {
                let Some(w) = nth(&mut works, work) else { continue };
                let complete = plane.data_done(w.id);
                w.data_done = true;
                let want = w.unwritten == 0 && !w.completed;
                w.completed |= want;
                if complete != want {
                    return fail(format!("data of {} done: complete {complete}, expected {want}", w.id));
                }
            }
            Op::Close { peer, clean } => {
                let peer = u32::from(peer) % PEERS;
                let got = plane.peer_closed(Rank(peer), "gone", clean);
                let want = if closed.contains_key(&peer) {
                    PeerClosed::Again
                } else if !clean {
                    PeerClosed::Lost
                } else if queues.get(&peer).is_some_and(|q| !q.is_empty()) {
                    deferred.push(peer);
                    PeerClosed::Deferred
                } else {
                    PeerClosed::Departed
                };
                closed.entry(peer).or_insert(clean);
                if got != want {
                    return fail(format!("close of {peer}: {got:?}, expected {want:?}"));
                }
                if plane.stranded(&[Rank(peer)]).is_none() {
                    return fail(format!("a collective waiting on closed {peer} is not stranded"));
                }
            }
            Op::Finish => {
                if works.is_empty() {
                    continue;
                }
                let w = works.remove(0);
                let seq = w.collective.and_then(|(_, s)| s);
                let done = plane.finish(w.id, seq);
                if done.work.is_none() {
                    return fail(format!("{} was not tracked", w.id));
                }
                let mut want = Vec::new();
                if let Some(seq) = seq {
                    last_finished = last_finished.max(seq.0);
                    let live = held.split_off(&(last_finished + 1));
                    want = std::mem::replace(&mut held, live).into_values().flatten().collect();
                }
                if done.stale != want {
                    return fail(format!("finishing {} gave back {:?}, expected {want:?}", w.id, done.stale));
                }
                for t in done.stale {
                    give_back(t, &mut returned)?;
                }
            }
        }
        let in_model: usize = held.values().map(Vec::len).sum();
        if plane.held() != in_model {
            return fail(format!("{} frames held, the model holds {in_model}", plane.held()));
        }
        let unwritten: usize = queues.values().map(VecDeque::len).sum();
        if plane.unwritten() != unwritten {
            return fail(format!("{} frames unwritten, the model has {unwritten}", plane.unwritten()));
        }
        if plane.len() != works.len() {
            return fail(format!("{} works tracked, the model has {}", plane.len(), works.len()));
        }
    }
    let lost = returned.iter().filter(|r| !**r).count();
    let still_held: usize = held.values().map(Vec::len).sum();
    if lost != still_held {
        return Err(Violation { step: ops.len(), what: format!("{lost} payloads not returned, {still_held} held") });
    }
    Ok(())
}

fn nth(works: &mut [ModelWork], i: u8) -> Option<&mut ModelWork> {
    let n = works.len();
    (n > 0).then(|| &mut works[usize::from(i) % n])
}
