//! [`Plan`]: one rank's actions for one collective, with their dependencies.

use std::collections::BTreeMap;
use std::ops::Range;

use super::{Algorithm, AllreduceAlgorithm, BufId, MAX_WORLD_SIZE, PlanOptions, ScheduleError, ScheduleOp, algorithms};
use crate::work::Rank;

/// How a received chunk lands in its buffer range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecvMode {
    /// The payload replaces the range: it may be received straight into the buffer.
    Copy,
    /// The payload is combined into the range (`range = range ⊕ payload`): it needs a staging
    /// area of its own.
    Reduce,
}

/// One thing a rank does in a collective. See the [module docs](super) for the model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// Copy `src` of `src_buf` into `dst` of `dst_buf` (same length).
    Copy {
        /// Source buffer.
        src_buf: BufId,
        /// Source byte range.
        src: Range<usize>,
        /// Destination buffer.
        dst_buf: BufId,
        /// Destination byte range.
        dst: Range<usize>,
    },
    /// [`Reduction::finalize`](crate::reduce::Reduction::finalize) on a range holding a fully
    /// reduced result.
    Finalize {
        /// The buffer.
        buf: BufId,
        /// The byte range.
        range: Range<usize>,
    },
    /// [`Reduction::premultiply`](crate::reduce::Reduction::premultiply) on the rank's own
    /// contribution, before it is sent or combined.
    Premultiply {
        /// The buffer.
        buf: BufId,
        /// The byte range.
        range: Range<usize>,
    },
    /// Receive the chunk `(step, from)` into `range` of `buf`.
    Recv {
        /// The step number in the frame.
        step: u32,
        /// The sender.
        from: Rank,
        /// The buffer.
        buf: BufId,
        /// The byte range; the payload must have exactly its length.
        range: Range<usize>,
        /// Copy or combine.
        mode: RecvMode,
    },
    /// Send `range` of `buf` to `to`, tagged with `step`.
    Send {
        /// The step number in the frame.
        step: u32,
        /// The receiver.
        to: Rank,
        /// The buffer.
        buf: BufId,
        /// The byte range.
        range: Range<usize>,
    },
}

/// One rank's schedule for one collective: actions in program order and, for each, the earlier
/// actions it must wait for. Built by [`Plan::new`]; run by an [`Executor`](super::Executor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    op: ScheduleOp,
    rank: Rank,
    world_size: u32,
    elem_size: usize,
    algorithm: Algorithm,
    data_len: usize,
    output_len: usize,
    actions: Vec<Action>,
    deps: Vec<Vec<u32>>,
    /// Per action: the later actions that depend on it (the inverse of `deps`).
    successors: Vec<Vec<u32>>,
    /// `(step, from)` → index of the receive action.
    recvs: BTreeMap<(u32, Rank), u32>,
    /// Bytes of every receive, summed.
    recv_bytes: usize,
    /// Bytes of the largest receive.
    largest_recv: usize,
}

impl Plan {
    /// The plan of `rank` in a world of `world_size` for `op` over elements of `elem_size`
    /// bytes. Refuses a world size of 0 or above [`MAX_WORLD_SIZE`], a rank or root outside the
    /// world, an element size of 0, count lists without one entry per rank, and sizes whose
    /// bytes overflow `usize`.
    pub fn new(
        op: &ScheduleOp,
        rank: Rank,
        world_size: u32,
        elem_size: usize,
        options: PlanOptions,
    ) -> Result<Plan, ScheduleError> {
        if world_size == 0 {
            return Err(ScheduleError::EmptyWorld);
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(ScheduleError::WorldTooLarge { world_size, max: MAX_WORLD_SIZE });
        }
        if rank.0 >= world_size {
            return Err(ScheduleError::RankOutOfRange { rank, world_size });
        }
        if elem_size == 0 {
            return Err(ScheduleError::ElemSizeZero);
        }
        let ctx = Ctx {
            rank: rank.0 as usize,
            n: world_size as usize,
            elem_size,
            chunk_bytes: if options.chunk_bytes == 0 { super::DEFAULT_CHUNK_BYTES } else { options.chunk_bytes },
        };
        let check_root = |root: Rank| {
            if root.0 >= world_size { Err(ScheduleError::RootOutOfRange { root, world_size }) } else { Ok(()) }
        };
        let check_counts = |what: &'static str, counts: &[usize]| {
            if counts.len() != ctx.n {
                return Err(ScheduleError::CountsLength { what, len: counts.len(), world_size });
            }
            total_bytes(what, counts, elem_size).map(|_| ())
        };
        let (algorithm, b) = match op {
            ScheduleOp::Allgather { counts } => {
                check_counts("counts", counts)?;
                (Algorithm::Ring, algorithms::ring_allgather(&ctx, counts))
            }
            ScheduleOp::Allreduce { count } => {
                let len = total_bytes("count", &[*count], elem_size)?;
                let algorithm = match options.allreduce {
                    AllreduceAlgorithm::Auto if len <= super::RECURSIVE_DOUBLING_MAX_BYTES => {
                        Algorithm::RecursiveDoubling
                    }
                    AllreduceAlgorithm::Auto if len <= super::halving_doubling_max_bytes(ctx.n) => {
                        Algorithm::HalvingDoubling
                    }
                    AllreduceAlgorithm::Auto | AllreduceAlgorithm::Ring => Algorithm::Ring,
                    AllreduceAlgorithm::RecursiveDoubling => Algorithm::RecursiveDoubling,
                    AllreduceAlgorithm::HalvingDoubling => Algorithm::HalvingDoubling,
                };
                let b = match algorithm {
                    Algorithm::RecursiveDoubling => algorithms::recursive_doubling_allreduce(&ctx, *count),
                    Algorithm::HalvingDoubling => algorithms::halving_doubling_allreduce(&ctx, *count),
                    _ => algorithms::ring_allreduce(&ctx, *count),
                };
                (algorithm, b)
            }
            ScheduleOp::Alltoall { send_counts, recv_counts } => {
                check_counts("send_counts", send_counts)?;
                check_counts("recv_counts", recv_counts)?;
                let (send, recv) = (send_counts[ctx.rank], recv_counts[ctx.rank]);
                if send != recv {
                    return Err(ScheduleError::SelfCount { rank, send, recv });
                }
                (Algorithm::Pairwise, algorithms::pairwise_alltoall(&ctx, send_counts, recv_counts))
            }
            ScheduleOp::Barrier => (Algorithm::Dissemination, algorithms::dissemination_barrier(&ctx)),
            ScheduleOp::Broadcast { count, root } => {
                check_root(*root)?;
                total_bytes("count", &[*count], elem_size)?;
                (Algorithm::BinomialTree, algorithms::tree_broadcast(&ctx, *count, root.0 as usize))
            }
            ScheduleOp::Gather { counts, root } => {
                check_root(*root)?;
                check_counts("counts", counts)?;
                (Algorithm::Direct, algorithms::direct_gather(&ctx, counts, root.0 as usize))
            }
            ScheduleOp::Reduce { count, root } => {
                check_root(*root)?;
                total_bytes("count", &[*count], elem_size)?;
                (Algorithm::BinomialTree, algorithms::tree_reduce(&ctx, *count, root.0 as usize))
            }
            ScheduleOp::ReduceScatter { counts } => {
                check_counts("counts", counts)?;
                (Algorithm::Ring, algorithms::ring_reduce_scatter(&ctx, counts))
            }
            ScheduleOp::Scatter { counts, root } => {
                check_root(*root)?;
                check_counts("counts", counts)?;
                (Algorithm::Direct, algorithms::direct_scatter(&ctx, counts, root.0 as usize))
            }
        };
        Ok(b.finish(op.clone(), rank, world_size, elem_size, algorithm))
    }

    /// The collective.
    pub fn op(&self) -> &ScheduleOp {
        &self.op
    }

    /// The collective's torch name (`all_reduce`…).
    pub fn op_name(&self) -> &'static str {
        self.op.name()
    }

    /// Whether the executor needs a [`Reduction`](crate::reduce::Reduction).
    pub fn is_reduction(&self) -> bool {
        self.op.is_reduction()
    }

    /// The rank this plan is for.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The world size.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// Bytes per element.
    pub fn elem_size(&self) -> usize {
        self.elem_size
    }

    /// The algorithm chosen.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Bytes of the [`BufId::Data`] buffer.
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// Bytes of the [`BufId::Output`] buffer.
    pub fn output_len(&self) -> usize {
        self.output_len
    }

    /// Bytes of buffer `buf`.
    pub fn buffer_len(&self, buf: BufId) -> usize {
        match buf {
            BufId::Data => self.data_len,
            BufId::Output => self.output_len,
        }
    }

    /// The actions, in program order.
    pub fn actions(&self) -> &[Action] {
        &self.actions
    }

    /// Indices of the earlier actions that action `index` waits for (sorted; empty for an
    /// index out of range).
    pub fn deps(&self, index: usize) -> &[u32] {
        self.deps.get(index).map_or(&[], Vec::as_slice)
    }

    /// The later actions that depend on action `index` (those whose [`Plan::deps`] name it),
    /// ascending.
    pub fn successors(&self, index: usize) -> &[u32] {
        self.successors.get(index).map_or(&[], Vec::as_slice)
    }

    /// Index of the receive action for chunk `(step, from)`, if the plan expects one.
    pub fn recv_index(&self, step: u32, from: Rank) -> Option<usize> {
        self.recvs.get(&(step, from)).map(|&i| i as usize)
    }

    /// The ranks this plan expects a chunk from at `step`, ascending.
    pub fn senders_at(&self, step: u32) -> Vec<Rank> {
        self.recvs.range((step, Rank(0))..=(step, Rank(u32::MAX))).map(|(&(_, from), _)| from).collect()
    }

    /// Bytes this rank receives from its peers over the whole collective (every receive's
    /// length, summed). A driver can size its receive buffers from it before any arrives.
    pub fn recv_bytes(&self) -> usize {
        self.recv_bytes
    }

    /// Bytes of the largest single chunk this rank receives (0 when it receives nothing).
    pub fn largest_recv(&self) -> usize {
        self.largest_recv
    }

    /// The exchanges of a plan made of nothing but whole-buffer exchanges, one peer at a time,
    /// as `(peer, step)` in order: premultiply, then for each exchange send the buffer to the
    /// peer and combine the peer's buffer into it, then finalize, in that order and nothing
    /// else (an allreduce by recursive doubling in a world of a power of two: one exchange
    /// with two ranks, two with four). A driver may run such a plan without an
    /// [`Executor`](super::Executor): the executor's result is the buffer after `premultiply`,
    /// `combine(buffer, peer's)` for each exchange in turn, and `finalize`. `None` for any
    /// other plan.
    pub fn exchanges(&self) -> Option<Vec<(Rank, u32)>> {
        if !matches!(self.op, ScheduleOp::Allreduce { .. }) || self.output_len != 0 || self.data_len == 0 {
            return None;
        }
        let all = 0..self.data_len;
        let whole = |buf: &BufId, range: &Range<usize>| *buf == BufId::Data && *range == all;
        let mut done = Vec::new();
        // The exchange whose send went and whose receive has not come yet.
        let mut sent = None;
        let mut finalized = false;
        for action in &self.actions {
            match action {
                Action::Premultiply { buf, range } if whole(buf, range) && done.is_empty() && sent.is_none() => {}
                Action::Send { step, to, buf, range } if whole(buf, range) && sent.is_none() && !finalized => {
                    sent = Some((*to, *step));
                }
                Action::Recv { step, from, buf, range, mode: RecvMode::Reduce }
                    if whole(buf, range) && sent == Some((*from, *step)) =>
                {
                    done.extend(sent.take());
                }
                Action::Finalize { buf, range }
                    if whole(buf, range) && sent.is_none() && !done.is_empty() && !finalized =>
                {
                    finalized = true;
                }
                _ => return None,
            }
        }
        finalized.then_some(done)
    }

    /// Receive actions as `((step, from), action index)`, ordered by step then sender.
    pub(super) fn recv_table(&self) -> &BTreeMap<(u32, Rank), u32> {
        &self.recvs
    }
}

/// Sum of `counts` in bytes, refusing overflow.
pub(super) fn total_bytes(what: &'static str, counts: &[usize], elem_size: usize) -> Result<usize, ScheduleError> {
    let count = counts.iter().try_fold(0usize, |acc, &c| acc.checked_add(c));
    let overflow = || ScheduleError::Overflow { what, count: count.unwrap_or(usize::MAX), elem_size };
    count.ok_or_else(overflow)?.checked_mul(elem_size).ok_or_else(overflow)
}

/// What every algorithm needs to know about the rank and the options.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ctx {
    pub(super) rank: usize,
    pub(super) n: usize,
    pub(super) elem_size: usize,
    pub(super) chunk_bytes: usize,
}

impl Ctx {
    /// Pipeline chunks per segment when the largest segment has `max_elems` elements: enough
    /// for chunks of at most `chunk_bytes`, at least 1, at most [`MAX_PIPELINE_CHUNKS`] and at
    /// most one per element.
    ///
    /// [`MAX_PIPELINE_CHUNKS`]: super::MAX_PIPELINE_CHUNKS
    pub(super) fn chunks_for(&self, max_elems: usize) -> usize {
        let bytes = max_elems * self.elem_size;
        bytes.div_ceil(self.chunk_bytes).clamp(1, super::MAX_PIPELINE_CHUNKS).min(max_elems.max(1))
    }

    /// Pipeline chunks per segment of a ring reduction: [`Ctx::chunks_for`], but at least
    /// [`MIN_REDUCE_PIPELINE_CHUNKS`] where each still holds [`MIN_REDUCE_CHUNK_BYTES`].
    ///
    /// [`MIN_REDUCE_PIPELINE_CHUNKS`]: super::MIN_REDUCE_PIPELINE_CHUNKS
    /// [`MIN_REDUCE_CHUNK_BYTES`]: super::MIN_REDUCE_CHUNK_BYTES
    pub(super) fn reduce_chunks_for(&self, max_elems: usize) -> usize {
        let bytes = max_elems * self.elem_size;
        let floor = (bytes / super::MIN_REDUCE_CHUNK_BYTES).min(super::MIN_REDUCE_PIPELINE_CHUNKS);
        self.chunks_for(max_elems).max(floor)
    }

    pub(super) fn peer(&self, rank: usize) -> Rank {
        // World sizes are at most MAX_WORLD_SIZE, so every rank fits in u32.
        Rank(rank as u32)
    }
}

/// Builds a plan's actions and derives their dependencies from byte-range hazards.
#[derive(Debug)]
pub(super) struct Builder {
    elem_size: usize,
    data_len: usize,
    output_len: usize,
    actions: Vec<Action>,
    deps: Vec<Vec<u32>>,
    tracks: [Track; 2],
}

impl Builder {
    /// A builder for buffers of `data_elems` and `output_elems` elements.
    pub(super) fn new(ctx: &Ctx, data_elems: usize, output_elems: usize) -> Builder {
        let (data_len, output_len) = (data_elems * ctx.elem_size, output_elems * ctx.elem_size);
        Builder {
            elem_size: ctx.elem_size,
            data_len,
            output_len,
            actions: Vec::new(),
            deps: Vec::new(),
            tracks: [Track::new(data_len), Track::new(output_len)],
        }
    }

    fn bytes(&self, elems: &Range<usize>) -> Range<usize> {
        super::bytes(elems.clone(), self.elem_size)
    }

    /// Send elements `elems` of `buf` to `to` at `step`; returns the action's index.
    pub(super) fn send(&mut self, step: u32, to: Rank, buf: BufId, elems: Range<usize>) -> u32 {
        let range = self.bytes(&elems);
        self.push(Action::Send { step, to, buf, range }, &[])
    }

    /// Receive `(step, from)` into elements `elems` of `buf`; returns the action's index.
    pub(super) fn recv(&mut self, step: u32, from: Rank, buf: BufId, elems: Range<usize>, mode: RecvMode) -> u32 {
        let range = self.bytes(&elems);
        self.push(Action::Recv { step, from, buf, range, mode }, &[])
    }

    /// An empty message to `to` at `step`, sent once action `after` has run.
    pub(super) fn send_empty_after(&mut self, step: u32, to: Rank, after: Option<u32>) -> u32 {
        let range = 0..0;
        self.push(Action::Send { step, to, buf: BufId::Data, range }, after.as_slice())
    }

    /// An empty message from `from` at `step`, taken once action `after` has run.
    pub(super) fn recv_empty_after(&mut self, step: u32, from: Rank, after: Option<u32>) -> u32 {
        let (range, mode) = (0..0, RecvMode::Copy);
        self.push(Action::Recv { step, from, buf: BufId::Data, range, mode }, after.as_slice())
    }

    /// Copy elements `src` of `src_buf` to elements `dst` of `dst_buf`.
    pub(super) fn copy(&mut self, src_buf: BufId, src: Range<usize>, dst_buf: BufId, dst: Range<usize>) {
        debug_assert_eq!(src.len(), dst.len(), "copy between ranges of different lengths");
        let (src, dst) = (self.bytes(&src), self.bytes(&dst));
        self.push(Action::Copy { src_buf, src, dst_buf, dst }, &[]);
    }

    /// Premultiply elements `elems` of `buf`.
    pub(super) fn premultiply(&mut self, buf: BufId, elems: Range<usize>) {
        let range = self.bytes(&elems);
        self.push(Action::Premultiply { buf, range }, &[]);
    }

    /// Finalize elements `elems` of `buf`.
    pub(super) fn finalize(&mut self, buf: BufId, elems: Range<usize>) {
        let range = self.bytes(&elems);
        self.push(Action::Finalize { buf, range }, &[]);
    }

    fn track(&mut self, buf: BufId) -> &mut Track {
        match buf {
            BufId::Data => &mut self.tracks[0],
            BufId::Output => &mut self.tracks[1],
        }
    }

    fn push(&mut self, action: Action, after: &[u32]) -> u32 {
        let me = u32::try_from(self.actions.len()).expect("plans have far fewer than 2^32 actions");
        let mut deps = after.to_vec();
        match &action {
            Action::Send { buf, range, .. } => self.track(*buf).access(range, false, me, &mut deps),
            Action::Recv { buf, range, .. } | Action::Premultiply { buf, range } | Action::Finalize { buf, range } => {
                self.track(*buf).access(range, true, me, &mut deps)
            }
            Action::Copy { src_buf, src, dst_buf, dst } => {
                self.track(*src_buf).access(src, false, me, &mut deps);
                self.track(*dst_buf).access(dst, true, me, &mut deps);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        deps.retain(|&d| d != me);
        self.actions.push(action);
        self.deps.push(deps);
        me
    }

    fn finish(self, op: ScheduleOp, rank: Rank, world_size: u32, elem_size: usize, algorithm: Algorithm) -> Plan {
        let mut recvs = BTreeMap::new();
        let (mut recv_bytes, mut largest_recv) = (0usize, 0usize);
        for (i, a) in self.actions.iter().enumerate() {
            if let Action::Recv { step, from, range, .. } = a {
                let fresh = recvs.insert((*step, *from), i as u32).is_none();
                debug_assert!(fresh, "plan receives ({step}, {from}) twice");
                // Ranges lie inside buffers whose lengths were checked not to overflow, and a
                // plan receives each byte of them a bounded number of times.
                recv_bytes = recv_bytes.saturating_add(range.len());
                largest_recv = largest_recv.max(range.len());
            }
        }
        let mut successors = vec![Vec::new(); self.actions.len()];
        for (i, deps) in self.deps.iter().enumerate() {
            for &d in deps {
                successors[d as usize].push(i as u32);
            }
        }
        Plan {
            op,
            rank,
            world_size,
            elem_size,
            algorithm,
            data_len: self.data_len,
            output_len: self.output_len,
            actions: self.actions,
            deps: self.deps,
            successors,
            recvs,
            recv_bytes,
            largest_recv,
        }
    }
}

/// Per-buffer hazard tracking: disjoint byte intervals, each with its last writer and the
/// readers since.
#[derive(Debug)]
struct Track {
    /// start → interval.
    segs: BTreeMap<usize, Seg>,
}

#[derive(Debug, Clone)]
struct Seg {
    end: usize,
    writer: Option<u32>,
    readers: Vec<u32>,
}

impl Track {
    fn new(len: usize) -> Track {
        let mut segs = BTreeMap::new();
        if len > 0 {
            segs.insert(0, Seg { end: len, writer: None, readers: Vec::new() });
        }
        Track { segs }
    }

    /// Record an access by action `me`, adding the actions it must wait for to `deps`.
    fn access(&mut self, range: &Range<usize>, write: bool, me: u32, deps: &mut Vec<u32>) {
        if range.is_empty() {
            return;
        }
        self.split_at(range.start);
        self.split_at(range.end);
        for seg in self.segs.range_mut(range.start..range.end).map(|(_, s)| s) {
            deps.extend(seg.writer);
            if write {
                deps.append(&mut seg.readers);
                seg.writer = Some(me);
            } else {
                seg.readers.push(me);
            }
        }
    }

    fn split_at(&mut self, pos: usize) {
        let Some((&start, seg)) = self.segs.range_mut(..=pos).next_back() else { return };
        if start == pos || seg.end <= pos {
            return;
        }
        let upper = seg.clone();
        seg.end = pos;
        self.segs.insert(pos, upper);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::{ReduceOp, Reduction};
    use crate::tensor::DType;

    fn plan(op: ScheduleOp, rank: u32, n: u32) -> Plan {
        Plan::new(&op, Rank(rank), n, 4, PlanOptions::default()).unwrap()
    }

    #[test]
    fn arguments_are_checked_up_front() {
        let o = PlanOptions::default();
        let bcast = ScheduleOp::Broadcast { count: 4, root: Rank(3) };
        assert_eq!(
            Plan::new(&bcast, Rank(0), 3, 4, o).unwrap_err().to_string(),
            "root 3 is out of range for world size 3"
        );
        assert_eq!(
            Plan::new(&bcast, Rank(5), 4, 4, o).unwrap_err().to_string(),
            "rank 5 is out of range for world size 4"
        );
        assert_eq!(Plan::new(&ScheduleOp::Barrier, Rank(0), 0, 4, o).unwrap_err(), ScheduleError::EmptyWorld);
        assert_eq!(Plan::new(&ScheduleOp::Barrier, Rank(0), 1, 0, o).unwrap_err(), ScheduleError::ElemSizeZero);
        let ag = ScheduleOp::Allgather { counts: vec![1, 2] };
        assert_eq!(
            Plan::new(&ag, Rank(0), 3, 4, o).unwrap_err().to_string(),
            "counts has 2 entries but the world size is 3"
        );
        let big = ScheduleOp::Allreduce { count: usize::MAX / 2 };
        assert!(matches!(Plan::new(&big, Rank(0), 2, 4, o), Err(ScheduleError::Overflow { .. })));
        let huge = ScheduleOp::Barrier;
        assert!(matches!(
            Plan::new(&huge, Rank(0), MAX_WORLD_SIZE + 1, 4, o),
            Err(ScheduleError::WorldTooLarge { .. })
        ));
    }

    #[test]
    fn only_whole_buffer_allreduces_of_a_power_of_two_of_ranks_are_exchanges() {
        let small = ScheduleOp::Allreduce { count: 8 };
        let ex = |r: u32, n: u32| plan(small.clone(), r, n).exchanges();
        assert_eq!(ex(0, 2), Some(vec![(Rank(1), 1)]));
        assert_eq!(ex(1, 2), Some(vec![(Rank(0), 1)]));
        // Recursive doubling: the partner differs in one more bit at each level.
        assert_eq!(ex(0, 4), Some(vec![(Rank(1), 1), (Rank(2), 2)]));
        assert_eq!(ex(3, 4), Some(vec![(Rank(2), 1), (Rank(1), 2)]));
        assert_eq!(ex(5, 8), Some(vec![(Rank(4), 1), (Rank(7), 2), (Rank(1), 3)]));
        // A fold-in step (a world of no power of two), split halves (halving-doubling), one
        // rank, no data, or not an allreduce.
        assert_eq!(ex(0, 3), None);
        assert_eq!(ex(1, 6), None);
        assert_eq!(ex(0, 1), None);
        assert_eq!(plan(ScheduleOp::Allreduce { count: 1 << 20 }, 0, 2).exchanges(), None);
        assert_eq!(plan(ScheduleOp::Allreduce { count: 1 << 16 }, 0, 4).exchanges(), None);
        assert_eq!(plan(ScheduleOp::Allreduce { count: 0 }, 0, 2).exchanges(), None);
        assert_eq!(plan(ScheduleOp::Broadcast { count: 8, root: Rank(0) }, 1, 2).exchanges(), None);
        assert_eq!(plan(ScheduleOp::Barrier, 0, 2).exchanges(), None);
    }

    proptest::proptest! {
        /// What a driver computes for a plan of exchanges without an executor (premultiply,
        /// combine each peer's buffer in turn, finalize) is what the executors compute, bit for
        /// bit, at every rank.
        #[test]
        fn exchanges_run_by_hand_match_the_executors(
            count in 1usize..600,
            world in proptest::sample::select(vec![2u32, 4, 8]),
            op in proptest::sample::select(vec![
                ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product,
                ReduceOp::PremulSum(0.37),
            ]),
            seed in 0u64..1000,
        ) {
            use crate::schedule::harness::Harness;
            use crate::tensor::HostBuffer;
            let red = Reduction::new(op, DType::F32).unwrap();
            let inputs: Vec<Vec<f32>> = (0..world as usize)
                .map(|r| (0..count).map(|i| ((i * 7 + r * 13 + seed as usize) % 23) as f32 * 0.3 - 2.0).collect())
                .collect();
            let bufs = inputs.iter().map(|v| HostBuffer::from_bytes(bytemuck::cast_slice(v))).collect();
            let sop = ScheduleOp::Allreduce { count };
            let mut h = Harness::for_op(&sop, 4, PlanOptions::default(), Some(red), bufs, seed).unwrap();
            proptest::prop_assert_eq!(h.run(), crate::schedule::harness::RunOutcome::Completed);
            let results = h.into_buffers();
            let chains: Vec<Vec<(Rank, u32)>> = (0..world)
                .map(|me| Plan::new(&sop, Rank(me), world, 4, PlanOptions::default()).unwrap().exchanges().unwrap())
                .collect();
            // Every rank's buffer after each level, from every rank's buffer before it.
            let mut bufs: Vec<Vec<u8>> = inputs.iter().map(|v| bytemuck::cast_slice(v).to_vec()).collect();
            for b in &mut bufs {
                red.premultiply(b).unwrap();
            }
            for level in 0..chains[0].len() {
                let before = bufs.clone();
                for (me, chain) in chains.iter().enumerate() {
                    let (peer, step) = chain[level];
                    proptest::prop_assert_eq!(chains[peer.0 as usize][level], (Rank(me as u32), step));
                    red.combine(&mut bufs[me], &before[peer.0 as usize]).unwrap();
                }
            }
            for (me, mine) in bufs.iter_mut().enumerate() {
                red.finalize(mine, world as usize).unwrap();
                proptest::prop_assert_eq!(&mine[..], results[me].0.as_bytes());
            }
        }
    }

    #[test]
    fn hazards_order_reads_and_writes_of_overlapping_bytes() {
        let ctx = Ctx { rank: 0, n: 2, elem_size: 1, chunk_bytes: 1 };
        let mut b = Builder::new(&ctx, 10, 0);
        let w0 = b.recv(0, Rank(1), BufId::Data, 0..5, RecvMode::Copy);
        let r1 = b.send(1, Rank(1), BufId::Data, 3..8);
        let r2 = b.send(2, Rank(1), BufId::Data, 4..6);
        let w3 = b.recv(3, Rank(1), BufId::Data, 5..10, RecvMode::Reduce);
        let w4 = b.recv(4, Rank(1), BufId::Data, 8..9, RecvMode::Copy);
        assert_eq!(b.deps[w0 as usize], Vec::<u32>::new());
        assert_eq!(b.deps[r1 as usize], vec![w0], "read after write on 3..5");
        assert_eq!(b.deps[r2 as usize], vec![w0], "reads do not wait for reads");
        assert_eq!(b.deps[w3 as usize], vec![r1, r2], "write after read on 5..8");
        assert_eq!(b.deps[w4 as usize], vec![w3], "write after write on 8..9");
    }

    #[test]
    fn recv_table_names_the_senders_of_a_step() {
        let p = plan(ScheduleOp::Gather { counts: vec![1; 5], root: Rank(2) }, 2, 5);
        assert_eq!(p.senders_at(0), vec![Rank(0), Rank(1), Rank(3), Rank(4)]);
        assert_eq!(p.senders_at(1), vec![]);
        assert!(p.recv_index(0, Rank(3)).is_some());
        assert!(p.recv_index(0, Rank(2)).is_none());
    }

    #[test]
    fn recv_bytes_and_largest_recv_sum_and_bound_the_receives() {
        // A 2-rank ring allreduce of 64 MiB of f32 receives the other half twice (reduce-scatter,
        // then allgather) in chunks of at most the default chunk size.
        let count = 16 << 20;
        let p = plan(ScheduleOp::Allreduce { count }, 0, 2);
        assert_eq!(p.recv_bytes(), count * 4);
        assert_eq!(p.largest_recv(), crate::schedule::DEFAULT_CHUNK_BYTES);
        let by_hand: usize = p
            .actions()
            .iter()
            .filter_map(|a| if let Action::Recv { range, .. } = a { Some(range.len()) } else { None })
            .sum();
        assert_eq!(p.recv_bytes(), by_hand);
        // The root of a gather receives every other rank's part; a sender receives nothing.
        let g = ScheduleOp::Gather { counts: vec![3, 5, 7], root: Rank(0) };
        let root = plan(g.clone(), 0, 3);
        assert_eq!((root.recv_bytes(), root.largest_recv()), ((5 + 7) * 4, 7 * 4));
        let leaf = plan(g, 2, 3);
        assert_eq!((leaf.recv_bytes(), leaf.largest_recv()), (0, 0));
    }
}
