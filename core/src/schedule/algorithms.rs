//! The algorithms: each writes one rank's actions into a [`Builder`], in program order.
//!
//! Element ranges here; the builder turns them into byte ranges. Ranks are plain `usize` in
//! `0..n` until they become a [`Rank`](crate::work::Rank) through [`Ctx::peer`].

use std::ops::Range;

use super::BufId::{Data, Output};
use super::RecvMode::{Copy, Reduce};
use super::plan::{Builder, Ctx};

/// Ring allreduce: reduce-scatter over `n` near-equal segments, after which rank `r` holds
/// segment `r` fully reduced and finalizes it; then allgather.
///
/// Reduce-scatter round `t` (`0..n-1`): send segment `r - t - 1` to `r + 1`, receive segment
/// `r - t - 2` from `r - 1` and combine. Allgather round `u` (`0..n-1`, step round `n - 1 + u`):
/// send segment `r - u`, receive segment `r - u - 1` and copy. All modulo `n`.
pub(super) fn ring_allreduce(ctx: &Ctx, count: usize) -> Builder {
    let counts = even_counts(count, ctx.n);
    let mut b = Builder::new(ctx, count, 0);
    b.premultiply(Data, 0..count);
    let segs = Segments::new(&counts);
    let chunks = ctx.reduce_chunks_for(counts[0]);
    ring_reduce_scatter_rounds(ctx, &mut b, &segs, chunks);
    let own = segs.get(ctx.rank);
    for k in 0..chunks {
        b.finalize(Data, chunk(&own, chunks, k));
    }
    ring_allgather_rounds(ctx, &mut b, Data, &segs, chunks, ctx.n - 1);
    b
}

/// Ring reduce-scatter with `counts[i]` elements for rank `i`: the rounds of
/// [`ring_allreduce`] over the data buffer, then rank `r` copies segment `r` to its output and
/// finalizes it there.
pub(super) fn ring_reduce_scatter(ctx: &Ctx, counts: &[usize]) -> Builder {
    let segs = Segments::new(counts);
    let mut b = Builder::new(ctx, segs.total(), counts[ctx.rank]);
    b.premultiply(Data, 0..segs.total());
    let chunks = ctx.reduce_chunks_for(counts.iter().copied().max().unwrap_or(0));
    ring_reduce_scatter_rounds(ctx, &mut b, &segs, chunks);
    b.copy(Data, segs.get(ctx.rank), Output, 0..counts[ctx.rank]);
    b.finalize(Output, 0..counts[ctx.rank]);
    b
}

/// Ring allgather with `counts[i]` elements from rank `i`: copy the own data into its slot of
/// the output, then round `u` (`0..n-1`) sends slot `r - u` to `r + 1` and receives slot
/// `r - u - 1` from `r - 1`.
pub(super) fn ring_allgather(ctx: &Ctx, counts: &[usize]) -> Builder {
    let segs = Segments::new(counts);
    let mut b = Builder::new(ctx, counts[ctx.rank], segs.total());
    b.copy(Data, 0..counts[ctx.rank], Output, segs.get(ctx.rank));
    let chunks = ctx.chunks_for(counts.iter().copied().max().unwrap_or(0));
    ring_allgather_rounds(ctx, &mut b, Output, &segs, chunks, 0);
    b
}

fn ring_reduce_scatter_rounds(ctx: &Ctx, b: &mut Builder, segs: &Segments, chunks: usize) {
    let (n, r) = (ctx.n, ctx.rank);
    let (left, right) = (ctx.peer((r + n - 1) % n), ctx.peer((r + 1) % n));
    for t in 0..n - 1 {
        let send = segs.get((r + 2 * n - t - 1) % n);
        let recv = segs.get((r + 2 * n - t - 2) % n);
        for k in 0..chunks {
            let step = step(t, chunks, k);
            b.send(step, right, Data, chunk(&send, chunks, k));
            b.recv(step, left, Data, chunk(&recv, chunks, k), Reduce);
        }
    }
}

fn ring_allgather_rounds(
    ctx: &Ctx,
    b: &mut Builder,
    buf: super::BufId,
    segs: &Segments,
    chunks: usize,
    first_round: usize,
) {
    let (n, r) = (ctx.n, ctx.rank);
    let (left, right) = (ctx.peer((r + n - 1) % n), ctx.peer((r + 1) % n));
    for u in 0..n - 1 {
        let send = segs.get((r + n - u) % n);
        let recv = segs.get((r + 2 * n - u - 1) % n);
        for k in 0..chunks {
            let step = step(first_round + u, chunks, k);
            b.send(step, right, buf, chunk(&send, chunks, k));
            b.recv(step, left, buf, chunk(&recv, chunks, k), Copy);
        }
    }
}

/// Recursive halving-doubling allreduce (Rabenseifner), with the fold-in of the extra ranks.
///
/// With `p` the largest power of two `<= n` and `rem = n - p`: step 0, each even rank
/// `r < 2 rem` sends its whole buffer to `r + 1`, which combines it; the `p` remaining ranks
/// take new ranks `0..p`. Steps `1..=L` (`L = log2 p`), halving: at level `i` a rank exchanges
/// with the new rank that differs in bit `p >> (i + 1)`, keeps the lower half of its current
/// range (if that bit is clear) or the upper half, sends the other half and combines what it
/// receives into the half it keeps. It then finalizes the range it owns. Steps `L+1..=2L`,
/// doubling: the levels in reverse, sending the owned range and copying the partner's. Step
/// `2L + 1`: each odd rank `r < 2 rem` sends the result to `r - 1`.
pub(super) fn halving_doubling_allreduce(ctx: &Ctx, count: usize) -> Builder {
    let core = Core::new(ctx);
    let levels = core.levels;
    let last_step = (1 + 2 * levels) as u32;
    let all = 0..count;
    let mut b = Builder::new(ctx, count, 0);
    let Some(new_rank) = core.fold_in(ctx, &mut b, count, last_step) else { return b };
    let mut range = all.clone();
    let mut exchanged = Vec::with_capacity(levels);
    for i in 0..levels {
        let mask = core.p >> (i + 1);
        let partner = core.peer(ctx, new_rank ^ mask);
        let mid = range.start + range.len() / 2;
        let (keep, give) =
            if new_rank & mask == 0 { (range.start..mid, mid..range.end) } else { (mid..range.end, range.start..mid) };
        let step = (1 + i) as u32;
        b.send(step, partner, Data, give.clone());
        b.recv(step, partner, Data, keep.clone(), Reduce);
        exchanged.push((partner, keep.clone(), give));
        range = keep;
    }
    b.finalize(Data, range);
    for (j, (partner, keep, give)) in exchanged.into_iter().rev().enumerate() {
        let step = (1 + levels + j) as u32;
        b.send(step, partner, Data, keep);
        b.recv(step, partner, Data, give, Copy);
    }
    core.fold_out(ctx, &mut b, count, last_step);
    b
}

/// Recursive doubling for small messages: `log2 p` rounds (halving-doubling needs twice as
/// many), each exchanging the whole buffer with the partner and combining. Every rank of the
/// power-of-two core combines the same values at each level (`x ⊕ y` on one side, `y ⊕ x` on
/// the other), so all end bit-identical. Non-powers of two fold in as in
/// [`halving_doubling_allreduce`]: step 0 folds each even rank `r < 2 rem` into `r + 1`, step
/// `L + 1` hands it the result.
pub(super) fn recursive_doubling_allreduce(ctx: &Ctx, count: usize) -> Builder {
    let core = Core::new(ctx);
    let last_step = (1 + core.levels) as u32;
    let all = 0..count;
    let mut b = Builder::new(ctx, count, 0);
    let Some(new_rank) = core.fold_in(ctx, &mut b, count, last_step) else { return b };
    for i in 0..core.levels {
        let partner = core.peer(ctx, new_rank ^ (1 << i));
        let step = (1 + i) as u32;
        b.send(step, partner, Data, all.clone());
        b.recv(step, partner, Data, all.clone(), Reduce);
    }
    b.finalize(Data, all);
    core.fold_out(ctx, &mut b, count, last_step);
    b
}

/// The power-of-two core of `n` ranks that halving-doubling and recursive doubling work in:
/// the largest `p = 2^levels <= n`; the first `2 rem` ranks (`rem = n - p`) pair up, each even
/// one folding its buffer into the next odd one, which stands for both in the core.
struct Core {
    p: usize,
    rem: usize,
    levels: usize,
}

impl Core {
    fn new(ctx: &Ctx) -> Core {
        let p = 1usize << (usize::BITS - 1 - ctx.n.leading_zeros());
        Core { p, rem: ctx.n - p, levels: p.trailing_zeros() as usize }
    }

    /// Premultiply, then step 0: an even rank `r < 2 rem` sends its buffer to `r + 1` and waits
    /// for the result at `last_step` (`None`: it sits the core out); an odd one combines its
    /// partner's buffer. Returns this rank's number in the core.
    fn fold_in(&self, ctx: &Ctx, b: &mut Builder, count: usize, last_step: u32) -> Option<usize> {
        let r = ctx.rank;
        b.premultiply(Data, 0..count);
        if r < 2 * self.rem {
            if r.is_multiple_of(2) {
                b.send(0, ctx.peer(r + 1), Data, 0..count);
                b.recv(last_step, ctx.peer(r + 1), Data, 0..count, Copy);
                return None;
            }
            b.recv(0, ctx.peer(r - 1), Data, 0..count, Reduce);
            return Some(r / 2);
        }
        Some(r - self.rem)
    }

    /// The real rank of core rank `v`.
    fn peer(&self, ctx: &Ctx, v: usize) -> crate::work::Rank {
        ctx.peer(if v < self.rem { 2 * v + 1 } else { v + self.rem })
    }

    /// Step `last_step`: each odd rank `r < 2 rem` hands the result to `r - 1`.
    fn fold_out(&self, ctx: &Ctx, b: &mut Builder, count: usize, last_step: u32) {
        if ctx.rank < 2 * self.rem {
            b.send(last_step, ctx.peer(ctx.rank - 1), Data, 0..count);
        }
    }
}

/// Binomial-tree broadcast. With virtual ranks `v = (r - root) mod n`: a rank `v != 0`
/// receives from `v` with its lowest set bit cleared, at step `k = trailing_zeros(v)`; it sends
/// to `v + 2^j` for every `j < k` (the root: every `2^j < n`) at step `j`, farthest child first.
/// Chunked: step `j * chunks + c`, and chunk `c` is forwarded as soon as it has arrived.
pub(super) fn tree_broadcast(ctx: &Ctx, count: usize, root: usize) -> Builder {
    let tree = Tree::new(ctx, root);
    let chunks = ctx.chunks_for(count);
    let all = 0..count;
    let mut b = Builder::new(ctx, count, 0);
    if let Some((parent, k)) = tree.parent {
        for c in 0..chunks {
            b.recv(step(k, chunks, c), parent, Data, chunk(&all, chunks, c), Copy);
        }
    }
    for c in 0..chunks {
        for &(child, j) in tree.children.iter().rev() {
            b.send(step(j, chunks, c), child, Data, chunk(&all, chunks, c));
        }
    }
    b
}

/// Binomial-tree reduce: the broadcast tree upside down. A rank combines its children's
/// chunks into its own data, nearest child first, then sends each chunk to its parent; the
/// root finalizes.
pub(super) fn tree_reduce(ctx: &Ctx, count: usize, root: usize) -> Builder {
    let tree = Tree::new(ctx, root);
    let chunks = ctx.chunks_for(count);
    let all = 0..count;
    let mut b = Builder::new(ctx, count, 0);
    b.premultiply(Data, all.clone());
    for &(child, j) in &tree.children {
        for c in 0..chunks {
            b.recv(step(j, chunks, c), child, Data, chunk(&all, chunks, c), Reduce);
        }
    }
    match tree.parent {
        Some((parent, k)) => {
            for c in 0..chunks {
                b.send(step(k, chunks, c), parent, Data, chunk(&all, chunks, c));
            }
        }
        None => b.finalize(Data, all),
    }
    b
}

/// Gather straight to the root, all at step 0.
pub(super) fn direct_gather(ctx: &Ctx, counts: &[usize], root: usize) -> Builder {
    let segs = Segments::new(counts);
    let own = 0..counts[ctx.rank];
    if ctx.rank != root {
        let mut b = Builder::new(ctx, counts[ctx.rank], 0);
        b.send(0, ctx.peer(root), Data, own);
        return b;
    }
    let mut b = Builder::new(ctx, counts[ctx.rank], segs.total());
    b.copy(Data, own, Output, segs.get(root));
    for p in (0..ctx.n).filter(|&p| p != root) {
        b.recv(0, ctx.peer(p), Output, segs.get(p), Copy);
    }
    b
}

/// Scatter straight from the root, all at step 0.
pub(super) fn direct_scatter(ctx: &Ctx, counts: &[usize], root: usize) -> Builder {
    let segs = Segments::new(counts);
    let own = 0..counts[ctx.rank];
    if ctx.rank != root {
        let mut b = Builder::new(ctx, 0, counts[ctx.rank]);
        b.recv(0, ctx.peer(root), Output, own, Copy);
        return b;
    }
    let mut b = Builder::new(ctx, segs.total(), counts[ctx.rank]);
    for p in (0..ctx.n).filter(|&p| p != root) {
        b.send(0, ctx.peer(p), Data, segs.get(p));
    }
    b.copy(Data, segs.get(root), Output, own);
    b
}

/// Pairwise alltoall: copy the own slice, then at step `k` (`1..n`) send to `r + k` and
/// receive from `r - k`.
pub(super) fn pairwise_alltoall(ctx: &Ctx, send_counts: &[usize], recv_counts: &[usize]) -> Builder {
    let (n, r) = (ctx.n, ctx.rank);
    let (send, recv) = (Segments::new(send_counts), Segments::new(recv_counts));
    let mut b = Builder::new(ctx, send.total(), recv.total());
    b.copy(Data, send.get(r), Output, recv.get(r));
    for k in 1..n {
        let (to, from) = ((r + k) % n, (r + n - k) % n);
        b.send(k as u32, ctx.peer(to), Data, send.get(to));
        b.recv(k as u32, ctx.peer(from), Output, recv.get(from), Copy);
    }
    b
}

/// Dissemination barrier: round `k` (`0..ceil(log2 n)`) sends an empty message to `r + 2^k`
/// and receives one from `r - 2^k`. Round `k + 1` (its send, and taking its message) waits
/// until round `k`'s message has been taken: a rank's round-`k` message must vouch for every
/// rank it heard from in rounds `< k`, so an early message for a later round waits its turn.
pub(super) fn dissemination_barrier(ctx: &Ctx) -> Builder {
    let (n, r) = (ctx.n, ctx.rank);
    let mut b = Builder::new(ctx, 0, 0);
    let mut prev = None;
    for k in 0..ceil_log2(n) {
        let d = 1usize << k;
        b.send_empty_after(k as u32, ctx.peer((r + d) % n), prev);
        prev = Some(b.recv_empty_after(k as u32, ctx.peer((r + n - d) % n), prev));
    }
    b
}

/// A rank's place in the binomial tree rooted at `root`.
struct Tree {
    /// The parent and the step (tree level) of the edge to it; `None` at the root.
    parent: Option<(crate::work::Rank, usize)>,
    /// Children and the levels of their edges, nearest (lowest level) first.
    children: Vec<(crate::work::Rank, usize)>,
}

impl Tree {
    fn new(ctx: &Ctx, root: usize) -> Tree {
        let n = ctx.n;
        let v = (ctx.rank + n - root) % n;
        let real = |v: usize| ctx.peer((v + root) % n);
        let (parent, limit) = if v == 0 {
            (None, ceil_log2(n))
        } else {
            let k = v.trailing_zeros() as usize;
            (Some((real(v & (v - 1)), k)), k)
        };
        let children = (0..limit).filter(|&j| v + (1 << j) < n).map(|j| (real(v + (1 << j)), j)).collect();
        Tree { parent, children }
    }
}

/// Prefix offsets of per-rank counts.
struct Segments {
    offsets: Vec<usize>,
}

impl Segments {
    fn new(counts: &[usize]) -> Segments {
        let mut offsets = Vec::with_capacity(counts.len() + 1);
        offsets.push(0);
        let mut acc = 0;
        for &c in counts {
            // Plan::new checked that the total fits (in bytes, so also in elements).
            acc += c;
            offsets.push(acc);
        }
        Segments { offsets }
    }

    fn get(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    fn total(&self) -> usize {
        *self.offsets.last().expect("offsets start with 0")
    }
}

/// `count` split into `n` parts, the first `count % n` one element larger.
fn even_counts(count: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| count / n + usize::from(i < count % n)).collect()
}

/// Chunk `k` of `chunks` near-equal chunks of `range` (the first ones one element larger).
fn chunk(range: &Range<usize>, chunks: usize, k: usize) -> Range<usize> {
    let (base, extra) = (range.len() / chunks, range.len() % chunks);
    let start = range.start + k * base + k.min(extra);
    start..start + base + usize::from(k < extra)
}

/// Step number of chunk `k` of round `round`.
fn step(round: usize, chunks: usize, k: usize) -> u32 {
    // Rounds are below 2 * MAX_WORLD_SIZE and chunks at most MAX_PIPELINE_CHUNKS: < 2^27.
    (round * chunks + k) as u32
}

fn ceil_log2(n: usize) -> usize {
    (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Action, Algorithm, AllreduceAlgorithm, BufId, Plan, PlanOptions, RecvMode, ScheduleOp};
    use crate::work::Rank;

    fn plan(op: ScheduleOp, rank: usize, n: usize, options: PlanOptions) -> Plan {
        Plan::new(&op, Rank(rank as u32), n as u32, 1, options).unwrap()
    }

    /// (step, peer, byte range, is_send) of every message, in program order.
    fn messages(p: &Plan) -> Vec<(u32, u32, Range<usize>, bool)> {
        p.actions()
            .iter()
            .filter_map(|a| match a {
                Action::Send { step, to, range, .. } => Some((*step, to.0, range.clone(), true)),
                Action::Recv { step, from, range, .. } => Some((*step, from.0, range.clone(), false)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn chunks_cover_the_range_in_order() {
        let r = 3..13;
        let parts: Vec<_> = (0..4).map(|k| chunk(&r, 4, k)).collect();
        assert_eq!(parts, vec![3..6, 6..9, 9..11, 11..13]);
        assert_eq!(even_counts(7, 3), vec![3, 2, 2]);
        assert_eq!((1..=9).map(ceil_log2).collect::<Vec<_>>(), vec![0, 1, 2, 2, 3, 3, 3, 3, 4]);
    }

    #[test]
    fn three_rank_ring_allreduce_by_hand() {
        // 6 elements: segments 0..2, 2..4, 4..6. Rank 1: left 0, right 2.
        let ring = PlanOptions { allreduce: AllreduceAlgorithm::Ring, chunk_bytes: 1 << 20 };
        let p = plan(ScheduleOp::Allreduce { count: 6 }, 1, 3, ring);
        assert_eq!(p.algorithm(), crate::schedule::Algorithm::Ring);
        assert_eq!(
            messages(&p),
            vec![
                (0, 2, 0..2, true),  // RS round 0: own segment r-1 = 0
                (0, 0, 4..6, false), // ... receive segment r-2 = 2
                (1, 2, 4..6, true),  // RS round 1: forward segment 2
                (1, 0, 2..4, false), // ... receive own segment 1: fully reduced
                (2, 2, 2..4, true),  // AG round 0: send own segment
                (2, 0, 0..2, false), // ... receive segment 0
                (3, 2, 0..2, true),  // AG round 1: forward it
                (3, 0, 4..6, false), // ... receive segment 2
            ]
        );
        let modes: Vec<_> = p
            .actions()
            .iter()
            .filter_map(|a| if let Action::Recv { mode, .. } = a { Some(*mode) } else { None })
            .collect();
        assert_eq!(modes, vec![RecvMode::Reduce, RecvMode::Reduce, RecvMode::Copy, RecvMode::Copy]);
        assert!(matches!(p.actions()[0], Action::Premultiply { .. }));
        assert!(p.actions().iter().any(|a| matches!(a, Action::Finalize { range, .. } if *range == (2..4))));
    }

    #[test]
    fn five_rank_ring_allreduce_pipelines_chunks() {
        // 10 elements of 1 byte, chunk_bytes 1: segments of 2, two chunks each.
        let ring = PlanOptions { allreduce: AllreduceAlgorithm::Ring, chunk_bytes: 1 };
        let p = plan(ScheduleOp::Allreduce { count: 10 }, 0, 5, ring);
        let m = messages(&p);
        assert_eq!(m.len(), 2 * 4 * 2 * 2, "8 rounds x 2 chunks x (send + recv)");
        // Round 1 chunk 0 (step 2) sends what round 0 chunk 0 (step 0) received: segment 3.
        assert_eq!(m[0], (0, 1, 8..9, true));
        assert_eq!(m[1], (0, 4, 6..7, false));
        assert_eq!(m[4], (2, 1, 6..7, true));
        // Its only dependency is that receive, not chunk 1 of round 0.
        let send_idx = p.actions().iter().position(|a| matches!(a, Action::Send { step: 2, .. })).unwrap();
        let recv_idx = p.recv_index(0, Rank(4)).unwrap() as u32;
        assert_eq!(p.deps(send_idx), &[recv_idx]);
    }

    #[test]
    fn ring_reductions_split_a_segment_into_at_least_three_chunks_of_at_least_128_kib() {
        use crate::schedule::{DEFAULT_CHUNK_BYTES, MIN_REDUCE_CHUNK_BYTES};
        let ring = PlanOptions { allreduce: AllreduceAlgorithm::Ring, chunk_bytes: DEFAULT_CHUNK_BYTES };
        let sends = |op: ScheduleOp, n: usize| messages(&plan(op, 0, n, ring)).iter().filter(|m| m.3).count();
        // 2 ranks, 1 byte per element: one round each way, so sends = chunks (+ chunks).
        let allreduce = |bytes: usize, n: usize| sends(ScheduleOp::Allreduce { count: bytes }, n) / (2 * (n - 1));
        assert_eq!(allreduce(1 << 20, 2), 3, "1 MiB: 512 KiB segments, 3 chunks rather than 1");
        assert_eq!(allreduce(2 << 20, 2), 3, "2 MiB: 1 MiB segments, 3 chunks rather than 2");
        assert_eq!(allreduce(4 << 20, 2), 4, "4 MiB: the default chunk size already gives 4");
        assert_eq!(allreduce(64 << 20, 2), 64, "64 MiB: 64 chunks of 512 KiB");
        assert_eq!(allreduce(2 * MIN_REDUCE_CHUNK_BYTES, 2), 1, "a 128 KiB segment stays whole");
        assert_eq!(allreduce(4 * MIN_REDUCE_CHUNK_BYTES, 2), 2, "256 KiB: 2 chunks of 128 KiB");
        assert_eq!(allreduce(3 << 20, 3), 3, "3 ranks, 1 MiB segments");
        let rs = sends(ScheduleOp::ReduceScatter { counts: vec![512 * 1024; 2] }, 2);
        assert_eq!(rs, 3, "reduce_scatter pipelines the same way");
        // Copies only: allgather keeps the plain chunk size.
        assert_eq!(sends(ScheduleOp::Allgather { counts: vec![512 * 1024; 2] }, 2), 1);
    }

    #[test]
    fn ring_with_fewer_elements_than_ranks_sends_empty_segments() {
        let ring = PlanOptions { allreduce: AllreduceAlgorithm::Ring, chunk_bytes: 1 };
        let p = plan(ScheduleOp::Allreduce { count: 2 }, 3, 5, ring);
        assert_eq!(messages(&p).len(), 16);
        assert!(messages(&p).iter().filter(|m| m.2.is_empty()).count() > 0);
    }

    #[test]
    fn binomial_tree_rooted_at_two_of_seven() {
        // Virtual ranks v = (r - 2) mod 7. v=0 (rank 2) → children v=1,2,4 (ranks 3,4,6).
        // v=1 (rank 3): leaf; v=2 (rank 4) → v=3 (rank 5); v=4 (rank 6) → v=5,6 (ranks 0,1).
        let o = PlanOptions::default();
        let op = ScheduleOp::Broadcast { count: 4, root: Rank(2) };
        let sends = |r: usize| -> Vec<(u32, u32)> {
            messages(&plan(op.clone(), r, 7, o)).into_iter().filter(|m| m.3).map(|m| (m.0, m.1)).collect()
        };
        let recvs = |r: usize| -> Vec<(u32, u32)> {
            messages(&plan(op.clone(), r, 7, o)).into_iter().filter(|m| !m.3).map(|m| (m.0, m.1)).collect()
        };
        assert_eq!(sends(2), vec![(2, 6), (1, 4), (0, 3)], "root: farthest child first");
        assert_eq!(recvs(2), vec![]);
        assert_eq!(recvs(3), vec![(0, 2)]);
        assert_eq!(sends(3), vec![]);
        assert_eq!(recvs(4), vec![(1, 2)]);
        assert_eq!(sends(4), vec![(0, 5)]);
        assert_eq!(recvs(5), vec![(0, 4)]);
        assert_eq!(recvs(6), vec![(2, 2)]);
        assert_eq!(sends(6), vec![(1, 1), (0, 0)]);
        assert_eq!(recvs(0), vec![(0, 6)]);
        assert_eq!(recvs(1), vec![(1, 6)]);
        // Reduce is the same tree upside down, nearest child first.
        let red = ScheduleOp::Reduce { count: 4, root: Rank(2) };
        let m = messages(&plan(red, 6, 7, o));
        assert_eq!(
            m.iter().map(|m| (m.0, m.1, m.3)).collect::<Vec<_>>(),
            vec![(0, 0, false), (1, 1, false), (2, 2, true)]
        );
    }

    #[test]
    fn recursive_doubling_exchanges_whole_buffers_in_half_the_rounds() {
        // n = 6: ranks 0 and 2 fold into 1 and 3; new ranks 1→0, 3→1, 4→2, 5→3.
        let rd = PlanOptions { allreduce: AllreduceAlgorithm::RecursiveDoubling, chunk_bytes: 0 };
        let op = ScheduleOp::Allreduce { count: 8 };
        assert_eq!(messages(&plan(op.clone(), 0, 6, rd)), vec![(0, 1, 0..8, true), (3, 1, 0..8, false)]);
        assert_eq!(
            messages(&plan(op.clone(), 1, 6, rd)),
            vec![
                (0, 0, 0..8, false), // fold-in
                (1, 3, 0..8, true),  // level 0: new rank 0 ↔ 1 (rank 3), whole buffer
                (1, 3, 0..8, false),
                (2, 4, 0..8, true), // level 1: new rank 0 ↔ 2 (rank 4)
                (2, 4, 0..8, false),
                (3, 0, 0..8, true), // the result back to rank 0
            ]
        );
        // Auto picks it for small buffers only.
        let auto = PlanOptions::default();
        let small = Plan::new(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 4, auto).unwrap();
        assert_eq!(small.algorithm(), Algorithm::RecursiveDoubling);
        let medium = Plan::new(&ScheduleOp::Allreduce { count: 16 * 1024 }, Rank(0), 2, 4, auto).unwrap();
        assert_eq!(medium.algorithm(), Algorithm::HalvingDoubling);
    }

    #[test]
    fn auto_gives_halving_doubling_up_to_1_mib_only_in_worlds_of_a_power_of_two_of_four_or_more() {
        use crate::schedule::{HALVING_DOUBLING_MAX_BYTES, HALVING_DOUBLING_MAX_BYTES_POW2};
        let auto = PlanOptions::default();
        // f32 elements: the largest count each world gives halving-doubling, and one more.
        let algorithm = |n: u32, bytes: usize| {
            Plan::new(&ScheduleOp::Allreduce { count: bytes / 4 }, Rank(0), n, 4, auto).unwrap().algorithm()
        };
        for n in [4, 8, 16] {
            assert_eq!(algorithm(n, HALVING_DOUBLING_MAX_BYTES_POW2), Algorithm::HalvingDoubling, "{n} ranks");
            assert_eq!(algorithm(n, HALVING_DOUBLING_MAX_BYTES_POW2 + 4), Algorithm::Ring, "{n} ranks");
        }
        // Two ranks (as many rounds either way: the ring pipelines), or a fold-in to pay.
        for n in [2, 3, 5, 6] {
            assert_eq!(algorithm(n, HALVING_DOUBLING_MAX_BYTES), Algorithm::HalvingDoubling, "{n} ranks");
            assert_eq!(algorithm(n, HALVING_DOUBLING_MAX_BYTES + 4), Algorithm::Ring, "{n} ranks");
        }
    }

    #[test]
    fn halving_doubling_folds_in_the_extra_ranks() {
        // n = 6: p = 4, rem = 2. Ranks 0 and 2 fold into 1 and 3; new ranks: 1→0, 3→1, 4→2, 5→3.
        let hd = PlanOptions { allreduce: AllreduceAlgorithm::HalvingDoubling, chunk_bytes: 0 };
        let op = ScheduleOp::Allreduce { count: 8 };
        let m0 = messages(&plan(op.clone(), 0, 6, hd));
        assert_eq!(m0, vec![(0, 1, 0..8, true), (5, 1, 0..8, false)]);
        let m1 = messages(&plan(op.clone(), 1, 6, hd));
        assert_eq!(
            m1,
            vec![
                (0, 0, 0..8, false), // fold-in
                (1, 4, 4..8, true),  // level 0: new rank 0 ↔ 2 (rank 4): keep the lower half
                (1, 4, 0..4, false),
                (2, 3, 2..4, true), // level 1: new rank 0 ↔ 1 (rank 3): keep 0..2
                (2, 3, 0..2, false),
                (3, 3, 0..2, true), // doubling, in reverse
                (3, 3, 2..4, false),
                (4, 4, 0..4, true),
                (4, 4, 4..8, false),
                (5, 0, 0..8, true), // the result back to rank 0
            ]
        );
        let m5 = messages(&plan(op, 5, 6, hd));
        assert_eq!(m5[0], (1, 3, 0..4, true), "new rank 3 ↔ 1 (rank 3) keeps the upper half");
    }

    #[test]
    fn dissemination_barrier_orders_its_rounds() {
        let p = plan(ScheduleOp::Barrier, 0, 5, PlanOptions::default());
        let m = messages(&p);
        assert_eq!(
            m.iter().map(|m| (m.0, m.1, m.3)).collect::<Vec<_>>(),
            vec![(0, 1, true), (0, 4, false), (1, 2, true), (1, 3, false), (2, 4, true), (2, 1, false)]
        );
        assert!(m.iter().all(|m| m.2.is_empty()));
        // Round 1's send and receive wait for round 0's receive.
        assert_eq!(p.deps(2), &[1]);
        assert_eq!(p.deps(3), &[1]);
        assert_eq!(p.deps(0), &[] as &[u32]);
    }

    #[test]
    fn alltoall_is_pairwise_with_uneven_splits() {
        let op = ScheduleOp::Alltoall { send_counts: vec![1, 2, 3], recv_counts: vec![4, 2, 0] };
        let p = plan(op, 1, 3, PlanOptions::default());
        assert_eq!(p.data_len(), 6);
        assert_eq!(p.output_len(), 6);
        assert_eq!(p.actions()[0], Action::Copy { src_buf: BufId::Data, src: 1..3, dst_buf: BufId::Output, dst: 4..6 });
        assert_eq!(
            messages(&p),
            vec![(1, 2, 3..6, true), (1, 0, 0..4, false), (2, 0, 0..1, true), (2, 2, 6..6, false)]
        );
    }

    #[test]
    fn gather_and_scatter_go_straight_to_the_root() {
        let o = PlanOptions::default();
        let g = ScheduleOp::Gather { counts: vec![1, 2, 3], root: Rank(1) };
        assert_eq!(messages(&plan(g.clone(), 2, 3, o)), vec![(0, 1, 0..3, true)]);
        assert_eq!(messages(&plan(g, 1, 3, o)), vec![(0, 0, 0..1, false), (0, 2, 3..6, false)]);
        let s = ScheduleOp::Scatter { counts: vec![1, 2, 3], root: Rank(0) };
        assert_eq!(messages(&plan(s.clone(), 0, 3, o)), vec![(0, 1, 1..3, true), (0, 2, 3..6, true)]);
        assert_eq!(messages(&plan(s, 2, 3, o)), vec![(0, 0, 0..3, false)]);
    }
}
