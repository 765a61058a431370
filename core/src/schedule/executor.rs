//! [`Executor`]: runs one rank's [`Plan`], sans IO.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use super::plan::{Action, Plan, RecvMode};
use super::{BufId, ScheduleError, check_reduction};
use crate::reduce::Reduction;
use crate::tensor::HostBuffer;
use crate::work::Rank;

/// A chunk the driver must send: bytes `range` of buffer `buf`, to `to`, tagged `step`.
/// Read the bytes with [`Executor::payload`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Outgoing {
    /// The receiver.
    pub to: Rank,
    /// The step number to put in the frame header.
    pub step: u32,
    /// The buffer the bytes are in.
    pub buf: BufId,
    /// The byte range.
    pub range: Range<usize>,
}

/// Runs one rank's [`Plan`] over buffers it owns: the driver feeds it the chunks that arrive
/// and asks it which chunks to send. Pure: no IO, no clock, no randomness.
///
/// # Calling contract
///
/// 1. [`Executor::new`] with the plan, the [`Reduction`] (for allreduce, reduce and
///    reduce_scatter; `None` otherwise) and the rank's input as the data buffer.
/// 2. Drain [`Executor::poll_send`] until `None`. For each [`Outgoing`], take its bytes
///    ([`Executor::payload`]) — write them or copy them — **before the next `&mut self` call**:
///    a returned send counts as done, and a later call may overwrite its bytes.
/// 3. For each chunk that arrives (any order, any time, also for later steps):
///    [`Executor::handle_recv`] with the frame's `(from, step)` and payload, then go to 2.
///    A chunk the plan does not expect at that step, a second chunk for the same
///    `(step, from)`, or a payload of the wrong length is refused with a [`ScheduleError`] and
///    changes nothing; the driver should fail the collective.
/// 4. When [`Executor::is_done`] (checked after draining `poll_send`), take the result with
///    [`Executor::into_buffers`]. While not done, [`Executor::waiting_on`] names the peers whose
///    chunks the earliest unfinished step still needs (for the watchdog's message).
///
/// Optionally, to receive without a copy: [`Executor::claim_in_place`] says whether a chunk
/// may go straight into its buffer range (a copy step whose dependencies are met) and, if so,
/// reserves it: fill [`Executor::claimed_buffer_mut`] (over as many calls as the bytes take to
/// arrive; nothing else reads or writes that range meanwhile), then call
/// [`Executor::finish_in_place`] instead of `handle_recv`.
///
/// # Dependency rule
///
/// An action runs once every action it depends on ([`Plan::deps`]) has run: a send is handed
/// out once the bytes it reads are final (per chunk, so pipelined steps overlap), a received
/// chunk is applied once the bytes it writes are no longer needed by earlier actions, and
/// local copies and reduction phases run as soon as they may. A chunk that arrives earlier is
/// kept (at most one per `(step, from)`, so memory is bounded by the plan) and applied when
/// its turn comes. Combines into the same bytes therefore always happen in program order, and
/// the result does not depend on the arrival order.
#[derive(Debug)]
pub struct Executor {
    plan: Arc<Plan>,
    reduction: Option<Reduction>,
    data: HostBuffer,
    output: HostBuffer,
    /// Per action, in one allocation: what it waits for and how far it got.
    acts: Vec<ActState>,
    /// Receives claimed for an in-place write that has not finished yet, by action.
    claimed: Vec<u32>,
    /// Chunks that arrived before their receive could be applied.
    kept: BTreeMap<u32, Vec<u8>>,
    /// Sends whose dependencies are met, not yet handed out ([`Queue::Sends`]), and local
    /// actions and arrived receives whose dependencies are met, not yet run
    /// ([`Queue::Runnable`]).
    ready: Ready,
    remaining: usize,
}

/// Which of [`Ready`]'s two queues.
#[derive(Debug, Clone, Copy)]
enum Queue {
    Sends = 0,
    Runnable = 1,
}

/// Action indices waiting their turn, in two queues that each give up their lowest index
/// first: bit sets over the plan's actions. Every work builds an executor, and a small
/// collective's plan has a handful of actions: an ordered set's node allocations and
/// rebalancing were a measurable part of such a work. Plans of up to 64 actions keep both
/// sets inline; larger ones put them in one allocation.
#[derive(Debug)]
struct Ready {
    /// Both queues' words when a queue needs one word at most.
    inline: [u64; 2],
    /// The sends' words, then the runnable actions' words, when a queue needs more.
    spilled: Vec<u64>,
    /// Words per queue.
    per: usize,
    /// Per queue, the first word that may have a bit set.
    low: [usize; 2],
}

impl Ready {
    fn new(actions: usize) -> Ready {
        let per = actions.div_ceil(64);
        let spilled = if per > 1 { vec![0; 2 * per] } else { Vec::new() };
        Ready { inline: [0; 2], spilled, per, low: [per; 2] }
    }

    fn queue(&mut self, q: Queue) -> &mut [u64] {
        let words = if self.per > 1 { &mut self.spilled[..] } else { &mut self.inline[..2 * self.per] };
        &mut words[q as usize * self.per..(q as usize + 1) * self.per]
    }

    fn insert(&mut self, q: Queue, i: u32) {
        let w = i as usize / 64;
        self.queue(q)[w] |= 1 << (i % 64);
        self.low[q as usize] = self.low[q as usize].min(w);
    }

    fn pop_first(&mut self, q: Queue) -> Option<u32> {
        let mut low = self.low[q as usize];
        let words = self.queue(q);
        let found = loop {
            let Some(word) = words.get_mut(low) else { break None };
            if *word != 0 {
                let bit = word.trailing_zeros();
                *word &= *word - 1;
                break Some((low * 64) as u32 + bit);
            }
            low += 1;
        };
        self.low[q as usize] = low;
        found
    }
}

/// One action's progress.
#[derive(Debug, Clone, Copy)]
struct ActState {
    /// Dependencies not yet done.
    unmet: u32,
    done: bool,
    /// A receive whose chunk has arrived (applied or kept).
    arrived: bool,
}

impl Executor {
    /// An executor for `plan` over `data` (the rank's input; [`Plan::data_len`] bytes). The
    /// output buffer is allocated here. Refuses a missing or unneeded reduction, a reduction
    /// whose dtype does not have the plan's element size, and a data buffer of the wrong
    /// length. Runs what needs no peer (premultiply, local copies).
    ///
    /// The plan may be shared (an `Arc<Plan>`): a plan is read-only, so runs of the same
    /// collective can reuse one (see [`PlanCache`](super::PlanCache)).
    pub fn new(
        plan: impl Into<Arc<Plan>>,
        reduction: Option<Reduction>,
        data: HostBuffer,
    ) -> Result<Executor, ScheduleError> {
        let plan = plan.into();
        let output = HostBuffer::zeroed(plan.output_len());
        Executor::with_output(plan, reduction, data, output)
    }

    /// [`Executor::new`] writing into `output` ([`Plan::output_len`] bytes, refused otherwise)
    /// instead of a buffer of its own: a caller's output tensor, filled in place. Every plan
    /// writes every byte of its output, so what `output` held before does not matter.
    pub fn with_output(
        plan: impl Into<Arc<Plan>>,
        reduction: Option<Reduction>,
        data: HostBuffer,
        output: HostBuffer,
    ) -> Result<Executor, ScheduleError> {
        let plan = plan.into();
        if output.len() != plan.output_len() {
            return Err(ScheduleError::BufferLength {
                op: plan.op_name(),
                buf: BufId::Output,
                expected: plan.output_len(),
                actual: output.len(),
            });
        }
        check_reduction(&plan, reduction.as_ref())?;
        if data.len() != plan.data_len() {
            return Err(ScheduleError::BufferLength {
                op: plan.op_name(),
                buf: BufId::Data,
                expected: plan.data_len(),
                actual: data.len(),
            });
        }
        let n = plan.actions().len();
        let acts = (0..n).map(|i| ActState { unmet: plan.deps(i).len() as u32, done: false, arrived: false }).collect();
        let mut exec = Executor {
            plan,
            reduction,
            data,
            output,
            acts,
            claimed: Vec::new(),
            kept: BTreeMap::new(),
            ready: Ready::new(n),
            remaining: n,
        };
        for i in 0..n {
            if exec.acts[i].unmet == 0 {
                exec.became_ready(i as u32);
            }
        }
        exec.run_local();
        Ok(exec)
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The next chunk to send, or `None` when nothing can be sent until more chunks arrive.
    /// Call after `new` and after every input, until it returns `None`. The returned send
    /// counts as done: take its bytes ([`Executor::payload`]) before the next `&mut self` call.
    pub fn poll_send(&mut self) -> Option<Outgoing> {
        // Work made possible by the previous send runs now, not then: that send's bytes had to
        // stay untouched until this call.
        self.run_local();
        let i = self.ready.pop_first(Queue::Sends)?;
        let Action::Send { step, to, buf, range } = &self.plan.actions()[i as usize] else {
            unreachable!("only sends are queued as sends")
        };
        let out = Outgoing { to: *to, step: *step, buf: *buf, range: range.clone() };
        self.complete(i);
        Some(out)
    }

    /// The bytes of a send returned by [`Executor::poll_send`] (empty if `send` names a range
    /// outside the buffer).
    pub fn payload(&self, send: &Outgoing) -> &[u8] {
        self.buffer(send.buf).get(send.range.clone()).unwrap_or(&[])
    }

    /// Chunk `(step, from)` arrived with `payload`. Applies it if its turn has come (and then
    /// whatever that makes possible), or keeps a copy until it has; afterwards drain
    /// [`Executor::poll_send`]. Refuses, changing nothing, a chunk the plan does not expect, a
    /// duplicate, or a payload of the wrong length.
    pub fn handle_recv(&mut self, from: Rank, step: u32, payload: &[u8]) -> Result<(), ScheduleError> {
        let i = self.check_recv(from, step, payload.len())?;
        self.acts[i as usize].arrived = true;
        if self.acts[i as usize].unmet == 0 {
            self.apply_recv(i, payload);
            self.complete(i);
            self.run_local();
        } else {
            self.kept.insert(i, payload.to_vec());
        }
        Ok(())
    }

    /// Whether chunk `(step, from)` of `len` bytes may be written straight into its buffer
    /// range, and if so, reserve that range for it: true if claimed (then write it through
    /// [`Executor::claimed_buffer_mut`] and end with [`Executor::finish_in_place`]), false if
    /// it must go through [`Executor::handle_recv`] (a chunk that is combined, or that arrived
    /// before its step may write). Refuses, changing nothing, what `handle_recv` would refuse,
    /// and a chunk already claimed.
    pub fn claim_in_place(&mut self, from: Rank, step: u32, len: usize) -> Result<bool, ScheduleError> {
        let i = self.check_recv(from, step, len)?;
        let Action::Recv { mode, .. } = &self.plan.actions()[i as usize] else {
            unreachable!("recv_index points at receives")
        };
        if *mode == RecvMode::Copy && self.acts[i as usize].unmet == 0 {
            self.claimed.push(i);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// The buffer range that claimed chunk `(step, from)` goes to (`None` if it is not
    /// claimed). Its bytes are the chunk's once [`Executor::finish_in_place`] is called.
    pub fn claimed_buffer_mut(&mut self, from: Rank, step: u32) -> Option<&mut [u8]> {
        let i = self.claimed_index(from, step)?;
        let Action::Recv { buf, range, .. } = self.plan.actions()[self.claimed[i] as usize].clone() else {
            unreachable!("only receives are claimed")
        };
        Some(&mut self.buffer_mut(buf)[range])
    }

    /// Claimed chunk `(step, from)` has been written in full through
    /// [`Executor::claimed_buffer_mut`]. Runs what that makes possible; afterwards drain
    /// [`Executor::poll_send`]. Refuses a chunk that is not claimed.
    pub fn finish_in_place(&mut self, from: Rank, step: u32) -> Result<(), ScheduleError> {
        let Some(k) = self.claimed_index(from, step) else {
            return Err(ScheduleError::NotClaimed { step, from });
        };
        let i = self.claimed.swap_remove(k);
        self.acts[i as usize].arrived = true;
        self.complete(i);
        self.run_local();
        Ok(())
    }

    fn claimed_index(&self, from: Rank, step: u32) -> Option<usize> {
        let i = self.plan.recv_index(step, from)? as u32;
        self.claimed.iter().position(|&c| c == i)
    }

    /// Whether every action has run: the buffers hold the result. Accurate after
    /// [`Executor::poll_send`] has returned `None`.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// The peers whose chunks the earliest step with a missing chunk still needs, ascending
    /// (empty when every expected chunk has arrived). For the watchdog: these are the ranks a
    /// stuck collective is waiting on.
    pub fn waiting_on(&self) -> Vec<Rank> {
        let mut ranks = Vec::new();
        self.waiting_on_into(&mut ranks);
        ranks
    }

    /// [`Executor::waiting_on`] into `ranks` (cleared first), reusing its allocation.
    pub fn waiting_on_into(&self, ranks: &mut Vec<Rank>) {
        ranks.clear();
        let mut missing = self.plan.recv_table().iter().filter(|&(_, &i)| !self.acts[i as usize].arrived);
        let Some((&(first, from), _)) = missing.next() else { return };
        ranks.push(from);
        ranks.extend(missing.take_while(|((step, _), _)| *step == first).map(|(&(_, from), _)| from));
    }

    /// Number of chunks kept because they arrived before their step (for tests and metrics).
    pub fn kept_chunks(&self) -> usize {
        self.kept.len()
    }

    /// The bytes of `buf`.
    pub fn buffer(&self, buf: BufId) -> &[u8] {
        match buf {
            BufId::Data => self.data.as_bytes(),
            BufId::Output => self.output.as_bytes(),
        }
    }

    /// The data and output buffers, whether or not the plan is done.
    pub fn into_buffers(self) -> (HostBuffer, HostBuffer) {
        (self.data, self.output)
    }

    fn buffer_mut(&mut self, buf: BufId) -> &mut [u8] {
        match buf {
            BufId::Data => self.data.as_bytes_mut(),
            BufId::Output => self.output.as_bytes_mut(),
        }
    }

    fn unexpected(&self, from: Rank, step: u32) -> ScheduleError {
        ScheduleError::UnexpectedChunk { step, from, expected: self.plan.senders_at(step) }
    }

    /// The receive action for `(step, from)`, if a chunk of `len` bytes is acceptable now.
    fn check_recv(&self, from: Rank, step: u32, len: usize) -> Result<u32, ScheduleError> {
        let i = self.plan.recv_index(step, from).ok_or_else(|| self.unexpected(from, step))?;
        if self.acts[i].arrived || self.claimed.contains(&(i as u32)) {
            return Err(ScheduleError::DuplicateChunk { step, from });
        }
        let Action::Recv { range, .. } = &self.plan.actions()[i] else { unreachable!("recv_index points at receives") };
        if len != range.len() {
            return Err(ScheduleError::ChunkLength { step, from, expected: range.len(), actual: len });
        }
        Ok(i as u32)
    }

    fn became_ready(&mut self, i: u32) {
        match &self.plan.actions()[i as usize] {
            Action::Send { .. } => {
                self.ready.insert(Queue::Sends, i);
            }
            Action::Recv { .. } => {
                if self.acts[i as usize].arrived {
                    self.ready.insert(Queue::Runnable, i);
                }
            }
            Action::Copy { .. } | Action::Finalize { .. } | Action::Premultiply { .. } => {
                self.ready.insert(Queue::Runnable, i);
            }
        }
    }

    fn complete(&mut self, i: u32) {
        debug_assert!(!self.acts[i as usize].done, "action {i} completed twice");
        self.acts[i as usize].done = true;
        self.remaining -= 1;
        for k in 0..self.plan.successors(i as usize).len() {
            let s = self.plan.successors(i as usize)[k];
            self.acts[s as usize].unmet -= 1;
            if self.acts[s as usize].unmet == 0 {
                self.became_ready(s);
            }
        }
    }

    /// Run every runnable local action and kept chunk, until none is left.
    fn run_local(&mut self) {
        while let Some(i) = self.ready.pop_first(Queue::Runnable) {
            match self.plan.actions()[i as usize].clone() {
                Action::Recv { .. } => {
                    let payload = self.kept.remove(&i).expect("runnable receives have arrived and were kept");
                    self.apply_recv(i, &payload);
                }
                Action::Copy { src_buf, src, dst_buf, dst } => {
                    if src_buf == dst_buf {
                        self.buffer_mut(src_buf).copy_within(src, dst.start);
                    } else {
                        let (data, output) = (self.data.as_bytes_mut(), self.output.as_bytes_mut());
                        let (s, d) = if src_buf == BufId::Data { (&*data, output) } else { (&*output, data) };
                        d[dst].copy_from_slice(&s[src]);
                    }
                }
                Action::Finalize { buf, range } => {
                    let n = self.plan.world_size() as usize;
                    let r = self.reduction.expect("reducing plans have a reduction (checked in new)");
                    r.finalize(&mut self.buffer_mut(buf)[range], n).expect("plan ranges are whole elements");
                }
                Action::Premultiply { buf, range } => {
                    let r = self.reduction.expect("reducing plans have a reduction (checked in new)");
                    r.premultiply(&mut self.buffer_mut(buf)[range]).expect("plan ranges are whole elements");
                }
                Action::Send { .. } => unreachable!("sends are never runnable"),
            }
            self.complete(i);
        }
    }

    fn apply_recv(&mut self, i: u32, payload: &[u8]) {
        let Action::Recv { buf, range, mode, .. } = self.plan.actions()[i as usize].clone() else {
            unreachable!("apply_recv on a receive")
        };
        let reduction = self.reduction;
        let dst = &mut self.buffer_mut(buf)[range];
        match mode {
            RecvMode::Copy => dst.copy_from_slice(payload),
            RecvMode::Reduce => reduction
                .expect("reducing plans have a reduction (checked in new)")
                .combine(dst, payload)
                .expect("payload length checked against the range; ranges are whole elements"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::ReduceOp;
    use crate::schedule::{AllreduceAlgorithm, PlanOptions, ScheduleOp};
    use crate::tensor::DType;

    proptest::proptest! {
        /// Each queue gives up its lowest index first, whatever the order of inserts and pops,
        /// as the ordered sets it replaces did; the two queues do not see each other's indices.
        #[test]
        fn ready_queues_pop_lowest_first(n in 1usize..200, ops in proptest::collection::vec((0u8..4, 0usize..200), 0..300)) {
            let mut ready = Ready::new(n);
            let mut model = [std::collections::BTreeSet::new(), std::collections::BTreeSet::new()];
            for (op, i) in ops {
                let (q, k) = if op % 2 == 0 { (Queue::Sends, 0) } else { (Queue::Runnable, 1) };
                if op < 2 {
                    let i = (i % n) as u32;
                    ready.insert(q, i);
                    model[k].insert(i);
                } else {
                    proptest::prop_assert_eq!(ready.pop_first(q), model[k].pop_first());
                }
            }
            for (q, k) in [(Queue::Sends, 0), (Queue::Runnable, 1)] {
                loop {
                    let want = model[k].pop_first();
                    proptest::prop_assert_eq!(ready.pop_first(q), want);
                    if want.is_none() {
                        break;
                    }
                }
            }
        }
    }

    fn f32s(v: &[f32]) -> HostBuffer {
        HostBuffer::from_bytes(bytemuck::cast_slice(v))
    }

    fn ring_allreduce(rank: u32, n: u32, count: usize) -> Executor {
        let o = PlanOptions { allreduce: AllreduceAlgorithm::Ring, chunk_bytes: 0 };
        let plan = Plan::new(&ScheduleOp::Allreduce { count }, Rank(rank), n, 4, o).unwrap();
        let sum = Reduction::new(ReduceOp::Sum, DType::F32).unwrap();
        let data: Vec<f32> = (0..count).map(|i| (rank as usize * 100 + i) as f32).collect();
        Executor::new(plan, Some(sum), f32s(&data)).unwrap()
    }

    #[test]
    fn new_refuses_bad_reductions_and_buffers() {
        let o = PlanOptions::default();
        let plan = Plan::new(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 4, o).unwrap();
        let err = Executor::new(plan.clone(), None, HostBuffer::zeroed(16)).unwrap_err();
        assert_eq!(err.to_string(), "all_reduce needs a reduction");
        let i64_sum = Reduction::new(ReduceOp::Sum, DType::I64).unwrap();
        let err = Executor::new(plan.clone(), Some(i64_sum), HostBuffer::zeroed(16)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "reduction over int64 (8 bytes per element) does not fit a plan of 4-byte elements"
        );
        let sum = Reduction::new(ReduceOp::Sum, DType::F32).unwrap();
        let err = Executor::new(plan, Some(sum), HostBuffer::zeroed(15)).unwrap_err();
        assert_eq!(err.to_string(), "all_reduce: the data buffer holds 15 bytes, the plan needs 16");
        let bcast = Plan::new(&ScheduleOp::Broadcast { count: 4, root: Rank(0) }, Rank(0), 2, 4, o).unwrap();
        let err = Executor::new(bcast, Some(sum), HostBuffer::zeroed(16)).unwrap_err();
        assert_eq!(err.to_string(), "broadcast does not reduce, but a reduction was given");
    }

    #[test]
    fn two_rank_ring_by_hand_with_an_early_allgather_chunk() {
        let mut a = ring_allreduce(0, 2, 4);
        let mut b = ring_allreduce(1, 2, 4);
        // Each rank can send its reduce-scatter chunk at once; allgather must wait.
        let sa = a.poll_send().unwrap();
        assert_eq!((sa.to, sa.step, sa.range.clone()), (Rank(1), 0, 8..16));
        let pa = a.payload(&sa).to_vec();
        assert_eq!(a.poll_send(), None);
        assert_eq!(a.waiting_on(), vec![Rank(1)]);
        let sb = b.poll_send().unwrap();
        let pb = b.payload(&sb).to_vec();
        assert_eq!(b.poll_send(), None);
        b.handle_recv(Rank(0), 0, &pa).unwrap();
        let sb2 = b.poll_send().unwrap();
        assert_eq!((sb2.step, sb2.range.clone()), (1, 8..16));
        let pb2 = b.payload(&sb2).to_vec();
        // Rank 0 gets the allgather chunk (step 1) before the reduce-scatter one (step 0).
        a.handle_recv(Rank(1), 1, &pb2).unwrap();
        assert_eq!(a.poll_send(), None);
        assert_eq!(a.waiting_on(), vec![Rank(1)]);
        a.handle_recv(Rank(1), 0, &pb).unwrap();
        let sa2 = a.poll_send().unwrap();
        let pa2 = a.payload(&sa2).to_vec();
        assert_eq!(a.poll_send(), None);
        b.handle_recv(Rank(0), 1, &pa2).unwrap();
        assert_eq!(b.poll_send(), None);
        assert!(a.is_done() && b.is_done());
        assert_eq!(a.waiting_on(), vec![]);
        let expect: Vec<f32> = (0..4).map(|i| (i + 100 + i) as f32).collect();
        for e in [a, b] {
            let (data, _) = e.into_buffers();
            assert_eq!(bytemuck::cast_slice::<u8, f32>(data.as_bytes()), expect.as_slice());
        }
    }

    #[test]
    fn bad_chunks_are_refused_and_change_nothing() {
        let mut a = ring_allreduce(0, 3, 6);
        while a.poll_send().is_some() {}
        let err = a.handle_recv(Rank(1), 0, &[0; 8]).unwrap_err();
        assert_eq!(err.to_string(), "no chunk from rank 1 is expected at step 0 (expected from: 2)");
        let err = a.handle_recv(Rank(2), 0, &[0; 4]).unwrap_err();
        assert_eq!(err.to_string(), "chunk for step 0 from rank 2 has 4 bytes, expected 8");
        let err = a.handle_recv(Rank(2), 99, &[0; 8]).unwrap_err();
        assert_eq!(err.to_string(), "no chunk from rank 2 is expected at step 99 (expected from: none)");
        a.handle_recv(Rank(2), 0, &[0; 8]).unwrap();
        let err = a.handle_recv(Rank(2), 0, &[0; 8]).unwrap_err();
        assert_eq!(err, ScheduleError::DuplicateChunk { step: 0, from: Rank(2) });
        // A duplicate of a kept (not yet applied) chunk is refused too.
        a.handle_recv(Rank(2), 3, &[0; 8]).unwrap();
        assert_eq!(a.kept_chunks(), 1);
        assert!(a.handle_recv(Rank(2), 3, &[1; 8]).is_err());
        assert_eq!(a.waiting_on(), vec![Rank(2)]);
    }

    #[test]
    fn in_place_receives_only_for_ready_copy_steps() {
        let mut a = ring_allreduce(0, 2, 4);
        let mut b = ring_allreduce(1, 2, 4);
        // Step 0 combines: staged. Step 1 copies into bytes that rank 0 has yet to send.
        assert_eq!(a.claim_in_place(Rank(1), 0, 8), Ok(false));
        assert_eq!(a.claim_in_place(Rank(1), 1, 8), Ok(false));
        assert_eq!(a.claimed_buffer_mut(Rank(1), 1), None);
        assert_eq!(a.finish_in_place(Rank(1), 1), Err(ScheduleError::NotClaimed { step: 1, from: Rank(1) }));
        let sa = a.poll_send().unwrap();
        let pa = a.payload(&sa).to_vec();
        let sb = b.poll_send().unwrap();
        let pb = b.payload(&sb).to_vec();
        a.handle_recv(Rank(1), 0, &pb).unwrap();
        b.handle_recv(Rank(0), 0, &pa).unwrap();
        let sa = a.poll_send().unwrap();
        let pa = a.payload(&sa).to_vec();
        let sb = b.poll_send().unwrap();
        let pb = b.payload(&sb).to_vec();
        // Bad chunks are refused as handle_recv refuses them; a good one is claimed once.
        assert!(matches!(a.claim_in_place(Rank(1), 1, 7), Err(ScheduleError::ChunkLength { .. })));
        assert!(matches!(a.claim_in_place(Rank(1), 9, 8), Err(ScheduleError::UnexpectedChunk { .. })));
        assert_eq!(a.claim_in_place(Rank(1), 1, 8), Ok(true));
        assert_eq!(a.claim_in_place(Rank(1), 1, 8), Err(ScheduleError::DuplicateChunk { step: 1, from: Rank(1) }));
        assert_eq!(a.handle_recv(Rank(1), 1, &pb), Err(ScheduleError::DuplicateChunk { step: 1, from: Rank(1) }));
        // Still missing until finished: the watchdog names the sender.
        assert_eq!(a.waiting_on(), vec![Rank(1)]);
        // Filled over two writes, as a socket delivers it.
        a.claimed_buffer_mut(Rank(1), 1).unwrap()[..3].copy_from_slice(&pb[..3]);
        a.claimed_buffer_mut(Rank(1), 1).unwrap()[3..].copy_from_slice(&pb[3..]);
        a.finish_in_place(Rank(1), 1).unwrap();
        assert_eq!(a.finish_in_place(Rank(1), 1), Err(ScheduleError::NotClaimed { step: 1, from: Rank(1) }));
        assert_eq!(a.claim_in_place(Rank(1), 1, 8), Err(ScheduleError::DuplicateChunk { step: 1, from: Rank(1) }));
        b.handle_recv(Rank(0), 1, &pa).unwrap();
        assert_eq!((a.poll_send(), b.poll_send()), (None, None));
        assert!(a.is_done() && b.is_done());
        assert_eq!(a.buffer(BufId::Data), b.buffer(BufId::Data));
    }

    #[test]
    fn world_of_one_is_done_at_once_and_finalizes() {
        let plan = Plan::new(&ScheduleOp::Allreduce { count: 2 }, Rank(0), 1, 4, PlanOptions::default()).unwrap();
        let avg = Reduction::new(ReduceOp::PremulSum(2.0), DType::F32).unwrap();
        let mut e = Executor::new(plan, Some(avg), f32s(&[1.5, -3.0])).unwrap();
        assert_eq!(e.poll_send(), None);
        assert!(e.is_done());
        assert_eq!(bytemuck::cast_slice::<u8, f32>(e.buffer(BufId::Data)), &[3.0, -6.0]);
    }
}
