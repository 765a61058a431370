//! Collective schedules: every collective as a per-rank [`Plan`], and the [`Executor`] that runs
//! one rank's plan.
//!
//! # Plans
//!
//! A [`Plan`] is a pure function of the [`ScheduleOp`] (which collective, element counts, root),
//! the rank, the world size, the element size and the [`PlanOptions`] (algorithm, pipeline chunk
//! size). It is a list of [`Action`]s in *program order* over two byte buffers ([`BufId::Data`],
//! [`BufId::Output`]); actions refer to byte ranges, never to pointers:
//!
//! - [`Action::Send`] and [`Action::Recv`] move one chunk to or from a peer. Each carries a step
//!   number (`u32`) that the driver puts in the frame header: a receiver identifies a chunk by
//!   `(step, from)`, and a plan expects at most one chunk per `(step, from)`.
//! - [`Action::Copy`], [`Action::Premultiply`] and [`Action::Finalize`] are local and run inside
//!   the executor (own input into its slot of an output, the three phases of a [`Reduction`]).
//!
//! Each action lists the earlier actions it depends on ([`Plan::deps`]). The dependencies are the
//! byte-range hazards between actions in program order — read after write, write after read,
//! write after write (a reducing receive both reads and writes) — plus the explicit round order
//! of the dissemination barrier, whose messages carry no bytes. Two actions without a dependency
//! touch disjoint bytes or only read the same bytes, so they may run in any order and the result
//! is the same: every reduction into a range happens in program order, whatever the arrival
//! order. This is what makes allreduce **bit-identical on every rank**: each element is reduced
//! by exactly one rank, in a fixed order, finalized there, and then only copied.
//!
//! # Pipelining
//!
//! Ring and tree algorithms split every segment into chunks of at most
//! [`PlanOptions::chunk_bytes`] (at most [`MAX_PIPELINE_CHUNKS`] per segment; ring reductions
//! into at least [`MIN_REDUCE_PIPELINE_CHUNKS`] where chunks stay large); each chunk is its
//! own step number, `round * chunks + chunk`. The dependency rule is per byte range, so chunk
//! `k` of round `t + 1` may be sent as soon as chunk `k` of round `t` has been received (and
//! reduced), while chunk `k + 1` of round `t` is still on the wire.
//!
//! # Algorithms
//!
//! | op | algorithm |
//! |---|---|
//! | allreduce | ring (reduce-scatter then allgather) or recursive halving-doubling; see [`AllreduceAlgorithm`] |
//! | broadcast, reduce | binomial tree rooted at any root |
//! | allgather, reduce_scatter | ring, equal or uneven counts per rank |
//! | alltoall | pairwise exchange (`k = 1..n`: send to `rank + k`, receive from `rank - k`), uneven splits |
//! | gather, scatter | direct to or from the root |
//! | barrier | dissemination: `ceil(log2 n)` rounds of zero-byte messages |
//!
//! The [`harness`] runs N executors in memory, in a seeded random delivery order; the property
//! tests in `core/tests/prop_schedule.rs` check every algorithm against a naive reference with it.

mod algorithms;
mod cache;
mod executor;
pub mod harness;
mod plan;

use std::fmt;
use std::ops::Range;

use crate::reduce::Reduction;
use crate::tensor::DType;
use crate::work::Rank;

pub use cache::PlanCache;
pub use executor::{Executor, Outgoing};
pub use plan::{Action, Plan, RecvMode};

/// Allreduce messages of at most this many bytes use recursive doubling under
/// [`AllreduceAlgorithm::Auto`]: half the rounds of halving-doubling, each moving the whole
/// (small) buffer.
pub const RECURSIVE_DOUBLING_MAX_BYTES: usize = 16 * 1024;

/// Allreduce messages of at most this many bytes (and above
/// [`RECURSIVE_DOUBLING_MAX_BYTES`]) use recursive halving-doubling under
/// [`AllreduceAlgorithm::Auto`]; larger ones use the ring.
///
/// Halving-doubling needs `2 log2 p` rounds (plus two whole-buffer transfers when the world size
/// is not a power of two), the ring `2 (n - 1)`: for small messages latency dominates and the
/// fewer rounds win; for large ones the ring's neighbour-only, pipelined transfers win, and the
/// fold-in's whole-buffer transfers would cost more than they save.
pub const HALVING_DOUBLING_MAX_BYTES: usize = 256 * 1024;

/// [`HALVING_DOUBLING_MAX_BYTES`] for a world of a power of two of at least four ranks, where
/// halving-doubling's `2 log2 p` rounds are fewer than the ring's `2 (p - 1)` and it needs no
/// fold-in: up to this size the rounds, not the bytes, set the time (each waits for the ranks
/// that are slowest to get there, which on a crowded host are off their cores). With two
/// ranks both take two rounds and the ring's pipelined chunks win; above this size the ring's
/// overlap wins. The measurements are in `docs/performance.md` (eleventh stop).
pub const HALVING_DOUBLING_MAX_BYTES_POW2: usize = 1024 * 1024;

/// The largest allreduce, in bytes, that [`AllreduceAlgorithm::Auto`] gives halving-doubling
/// in a world of `world_size` ranks.
pub fn halving_doubling_max_bytes(world_size: usize) -> usize {
    if world_size >= 4 && world_size.is_power_of_two() {
        HALVING_DOUBLING_MAX_BYTES_POW2
    } else {
        HALVING_DOUBLING_MAX_BYTES
    }
}

/// Default target size of one pipeline chunk ([`PlanOptions::chunk_bytes`]).
pub const DEFAULT_CHUNK_BYTES: usize = 512 * 1024;

/// Most pipeline chunks one segment is split into.
pub const MAX_PIPELINE_CHUNKS: usize = 64;

/// Fewest pipeline chunks a ring reduction (allreduce, reduce_scatter) splits a segment into,
/// as long as each keeps at least [`MIN_REDUCE_CHUNK_BYTES`]: with one chunk per segment a rank
/// reduces only after the whole segment has arrived, and sends its result only after that, so
/// nothing overlaps. With 2 ranks on 2 cores a 1 MiB float allreduce (segments of 512 KiB) took
/// 0.70–0.93 of the one-chunk time with 3 chunks (four alternated runs), 0.82–0.93 with 4,
/// 0.85–0.90 with 2 and 1.09–1.12 with 6; a 2 MiB one 0.91–0.96 with 3. From 4 MiB up
/// [`DEFAULT_CHUNK_BYTES`] gives 4 or more chunks anyway, and smaller ones cost more than they
/// overlap (4 MiB with 256 KiB chunks: 1.04–1.07; 16 MiB with 128 KiB: 1.27–1.29).
pub const MIN_REDUCE_PIPELINE_CHUNKS: usize = 3;

/// Smallest chunk [`MIN_REDUCE_PIPELINE_CHUNKS`] splits a segment into.
pub const MIN_REDUCE_CHUNK_BYTES: usize = 128 * 1024;

/// Largest world size a plan accepts (step numbers must fit in `u32`).
pub const MAX_WORLD_SIZE: u32 = 1 << 20;

/// One of the two byte buffers a plan works on. The executor owns both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufId {
    /// The rank's input; for allreduce, broadcast and reduce also the output (in place).
    Data,
    /// The separate output of allgather, alltoall, gather, reduce_scatter and scatter (empty
    /// for the in-place ops and on ranks that receive nothing).
    Output,
}

impl fmt::Display for BufId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BufId::Data => "data",
            BufId::Output => "output",
        })
    }
}

/// Which allreduce algorithm a plan uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AllreduceAlgorithm {
    /// Recursive doubling up to [`RECURSIVE_DOUBLING_MAX_BYTES`], halving-doubling up to
    /// [`halving_doubling_max_bytes`] (which depends on the world size), the ring above.
    #[default]
    Auto,
    /// Recursive doubling: `log2 p` rounds, each exchanging the whole buffer (small messages).
    RecursiveDoubling,
    /// Recursive halving (reduce-scatter) then recursive doubling (allgather); for world sizes
    /// that are not powers of two, the first `2 * (n - 2^floor(log2 n))` ranks fold in pairs:
    /// each even rank sends its buffer to the next odd rank, sits the exchange out, and gets
    /// the result back at the end.
    HalvingDoubling,
    /// Chunked ring: reduce-scatter over `n` segments, then allgather.
    Ring,
}

/// The algorithm a [`Plan`] ended up with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Binomial tree (broadcast, reduce).
    BinomialTree,
    /// Straight to or from the root (gather, scatter).
    Direct,
    /// Dissemination (barrier).
    Dissemination,
    /// Recursive halving-doubling (allreduce).
    HalvingDoubling,
    /// Recursive doubling (allreduce, small messages).
    RecursiveDoubling,
    /// Pairwise exchange (alltoall).
    Pairwise,
    /// Ring (allreduce, allgather, reduce_scatter).
    Ring,
}

impl Algorithm {
    /// Short name, e.g. for benchmark tables: `ring`, `halving_doubling`, `binomial_tree`…
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::BinomialTree => "binomial_tree",
            Algorithm::Direct => "direct",
            Algorithm::Dissemination => "dissemination",
            Algorithm::HalvingDoubling => "halving_doubling",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Ring => "ring",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Options that do not change a collective's result, only how it moves. Every rank of a
/// collective must use the same options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanOptions {
    /// The allreduce algorithm.
    pub allreduce: AllreduceAlgorithm,
    /// Target size of one pipeline chunk in bytes (ring and tree algorithms); 0 means
    /// [`DEFAULT_CHUNK_BYTES`].
    pub chunk_bytes: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { allreduce: AllreduceAlgorithm::Auto, chunk_bytes: DEFAULT_CHUNK_BYTES }
    }
}

/// A collective, as far as its schedule is concerned. Counts are in elements; every rank of the
/// collective must describe it identically (except for its own rank).
///
/// Buffer sizes ([`Plan::data_len`], [`Plan::output_len`]), in elements, where `r` is the rank:
///
/// | op | data | output |
/// |---|---|---|
/// | `Allgather` | `counts[r]` | `sum(counts)` |
/// | `Allreduce`, `Broadcast`, `Reduce` | `count` | 0 |
/// | `Alltoall` | `sum(send_counts)` | `sum(recv_counts)` |
/// | `Barrier` | 0 | 0 |
/// | `Gather` | `counts[r]` | root: `sum(counts)`, others 0 |
/// | `ReduceScatter` | `sum(counts)` (overwritten) | `counts[r]` |
/// | `Scatter` | root: `sum(counts)`, others 0 | `counts[r]` |
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ScheduleOp {
    /// Every rank's data, concatenated in rank order, to every rank; `counts[i]` elements from
    /// rank `i` (equal or not).
    Allgather {
        /// Elements each rank contributes.
        counts: Vec<usize>,
    },
    /// Elementwise reduction of every rank's data, to every rank (in place).
    Allreduce {
        /// Elements per rank.
        count: usize,
    },
    /// Rank `i` sends `send_counts[j]` elements to rank `j` (consecutive slices of its data, in
    /// rank order) and receives `recv_counts[j]` from rank `j` (consecutive slices of its
    /// output), as c10d's `alltoall_base` with splits. `recv_counts` on rank `i` must equal
    /// every peer's `send_counts[i]`; a mismatch shows up as a wrong chunk length.
    Alltoall {
        /// Elements this rank sends to each rank.
        send_counts: Vec<usize>,
        /// Elements this rank receives from each rank.
        recv_counts: Vec<usize>,
    },
    /// Wait until every rank has arrived.
    Barrier,
    /// The root's data to every rank (in place).
    Broadcast {
        /// Elements.
        count: usize,
        /// The rank whose data is sent.
        root: Rank,
    },
    /// Every rank's data, concatenated in rank order, to the root's output.
    Gather {
        /// Elements each rank contributes.
        counts: Vec<usize>,
        /// The rank that receives.
        root: Rank,
    },
    /// Elementwise reduction of every rank's data into the root's data. Other ranks' data ends
    /// up holding partial results (as in Gloo): only the root's is meaningful.
    Reduce {
        /// Elements per rank.
        count: usize,
        /// The rank that gets the result.
        root: Rank,
    },
    /// Elementwise reduction of every rank's data; rank `i` gets slice `i` (of `counts[i]`
    /// elements) of the result in its output. The data buffer is used as scratch.
    ReduceScatter {
        /// Elements of the result each rank gets.
        counts: Vec<usize>,
    },
    /// Slice `i` (of `counts[i]` elements) of the root's data to rank `i`'s output.
    Scatter {
        /// Elements each rank receives.
        counts: Vec<usize>,
        /// The rank that sends.
        root: Rank,
    },
}

impl ScheduleOp {
    /// The op's name as torch spells it (`all_reduce`, `reduce_scatter`…), for error messages.
    pub const fn name(&self) -> &'static str {
        match self {
            ScheduleOp::Allgather { .. } => "all_gather",
            ScheduleOp::Allreduce { .. } => "all_reduce",
            ScheduleOp::Alltoall { .. } => "all_to_all",
            ScheduleOp::Barrier => "barrier",
            ScheduleOp::Broadcast { .. } => "broadcast",
            ScheduleOp::Gather { .. } => "gather",
            ScheduleOp::Reduce { .. } => "reduce",
            ScheduleOp::ReduceScatter { .. } => "reduce_scatter",
            ScheduleOp::Scatter { .. } => "scatter",
        }
    }

    /// Whether the op reduces (and so its executor needs a [`Reduction`]).
    pub const fn is_reduction(&self) -> bool {
        matches!(self, ScheduleOp::Allreduce { .. } | ScheduleOp::Reduce { .. } | ScheduleOp::ReduceScatter { .. })
    }

    /// `alltoall_base` from torch's arguments: `input_numel` and `output_numel` elements, and
    /// split sizes per rank that must sum to them — or be empty, meaning an even split (which
    /// then must divide evenly).
    pub fn alltoall_base(
        world_size: u32,
        input_numel: usize,
        output_numel: usize,
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> Result<ScheduleOp, ScheduleError> {
        let send_counts = splits("input_splits", world_size, input_numel, input_splits)?;
        let recv_counts = splits("output_splits", world_size, output_numel, output_splits)?;
        Ok(ScheduleOp::Alltoall { send_counts, recv_counts })
    }

    /// Equal counts for every rank (`allgather_into_tensor`, `reduce_scatter_tensor`, even
    /// gather and scatter): `total` elements split into `world_size` equal parts.
    pub fn equal_counts(world_size: u32, total: usize) -> Result<Vec<usize>, ScheduleError> {
        splits("counts", world_size, total, &[])
    }
}

fn splits(what: &'static str, world_size: u32, total: usize, given: &[usize]) -> Result<Vec<usize>, ScheduleError> {
    if world_size == 0 {
        return Err(ScheduleError::EmptyWorld);
    }
    let n = world_size as usize;
    if given.is_empty() {
        if !total.is_multiple_of(n) {
            return Err(ScheduleError::UnevenSplit { what, total, world_size });
        }
        return Ok(vec![total / n; n]);
    }
    if given.len() != n {
        return Err(ScheduleError::CountsLength { what, len: given.len(), world_size });
    }
    let sum = given.iter().try_fold(0usize, |acc, &c| acc.checked_add(c));
    if sum != Some(total) {
        return Err(ScheduleError::SplitSum { what, sum: sum.unwrap_or(usize::MAX), total });
    }
    Ok(given.to_vec())
}

/// Errors from building a plan, starting an executor, or feeding it a chunk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The plan's buffer and the buffer handed in differ in length.
    #[error("{op}: the {buf} buffer holds {actual} bytes, the plan needs {expected}")]
    BufferLength {
        /// The op.
        op: &'static str,
        /// Which buffer.
        buf: BufId,
        /// Bytes the plan needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// A chunk whose length is not what the plan expects for its step.
    #[error("chunk for step {step} from rank {from} has {actual} bytes, expected {expected}")]
    ChunkLength {
        /// The step.
        step: u32,
        /// The sender.
        from: Rank,
        /// Bytes the plan expects.
        expected: usize,
        /// Bytes received.
        actual: usize,
    },
    /// A per-rank count list with the wrong number of entries.
    #[error("{what} has {len} entries but the world size is {world_size}")]
    CountsLength {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The world size.
        world_size: u32,
    },
    /// The same `(step, from)` chunk arrived twice.
    #[error("duplicate chunk for step {step} from rank {from}")]
    DuplicateChunk {
        /// The step.
        step: u32,
        /// The sender.
        from: Rank,
    },
    /// An element size of 0.
    #[error("element size must be at least 1 byte")]
    ElemSizeZero,
    /// A world size of 0.
    #[error("world size must be at least 1")]
    EmptyWorld,
    /// The op reduces but no reduction was given.
    #[error("{op} needs a reduction")]
    MissingReduction {
        /// The op.
        op: &'static str,
    },
    /// [`Executor::finish_in_place`] on a chunk that was not claimed for an in-place write.
    #[error("chunk for step {step} from rank {from} was not claimed for an in-place write")]
    NotClaimed {
        /// The step.
        step: u32,
        /// The sender.
        from: Rank,
    },
    /// Sizes whose byte count does not fit in memory.
    #[error("{what} of {count} elements of {elem_size} bytes overflows")]
    Overflow {
        /// What overflowed.
        what: &'static str,
        /// Elements.
        count: usize,
        /// Element size in bytes.
        elem_size: usize,
    },
    /// A rank outside the world.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The rank.
        rank: Rank,
        /// The world size.
        world_size: u32,
    },
    /// The reduction's dtype does not have the plan's element size.
    #[error("reduction over {dtype} ({} bytes per element) does not fit a plan of {elem_size}-byte elements", dtype.size())]
    ReductionElemSize {
        /// The reduction's dtype.
        dtype: DType,
        /// The plan's element size.
        elem_size: usize,
    },
    /// A root outside the world.
    #[error("root {root} is out of range for world size {world_size}")]
    RootOutOfRange {
        /// The root.
        root: Rank,
        /// The world size.
        world_size: u32,
    },
    /// An alltoall in which a rank sends itself a different count than it receives from itself.
    #[error("rank {rank} sends {send} elements to itself but expects to receive {recv}")]
    SelfCount {
        /// The rank.
        rank: Rank,
        /// `send_counts[rank]`.
        send: usize,
        /// `recv_counts[rank]`.
        recv: usize,
    },
    /// Split sizes that do not add up to the buffer.
    #[error("{what} sum to {sum} elements but the buffer holds {total}")]
    SplitSum {
        /// Which splits.
        what: &'static str,
        /// Their sum.
        sum: usize,
        /// Elements in the buffer.
        total: usize,
    },
    /// A reduction given for an op that does not reduce.
    #[error("{op} does not reduce, but a reduction was given")]
    UnexpectedReduction {
        /// The op.
        op: &'static str,
    },
    /// A chunk whose `(step, from)` the plan does not expect.
    #[error("no chunk from rank {from} is expected at step {step} (expected from: {})", rank_list(expected))]
    UnexpectedChunk {
        /// The step.
        step: u32,
        /// The sender.
        from: Rank,
        /// The ranks the plan expects a chunk from at this step (empty if none).
        expected: Vec<Rank>,
    },
    /// Empty splits asking for an even split of a buffer that does not divide evenly.
    #[error("{what}: {total} elements do not split evenly over world size {world_size}")]
    UnevenSplit {
        /// Which splits.
        what: &'static str,
        /// Elements in the buffer.
        total: usize,
        /// The world size.
        world_size: u32,
    },
    /// A world size above [`MAX_WORLD_SIZE`].
    #[error("world size {world_size} is above the maximum of {max}")]
    WorldTooLarge {
        /// The world size.
        world_size: u32,
        /// [`MAX_WORLD_SIZE`].
        max: u32,
    },
}

fn rank_list(ranks: &[Rank]) -> String {
    if ranks.is_empty() {
        return "none".to_owned();
    }
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

/// Byte range of `elems` elements of `elem_size` bytes. Callers have checked that the whole
/// buffer's byte length fits in `usize`, so no sub-range can overflow.
fn bytes(elems: Range<usize>, elem_size: usize) -> Range<usize> {
    elems.start * elem_size..elems.end * elem_size
}

/// Check a reduction against a plan: present iff the op reduces, with the plan's element size.
fn check_reduction(plan: &Plan, reduction: Option<&Reduction>) -> Result<(), ScheduleError> {
    let op = plan.op_name();
    match (plan.is_reduction(), reduction) {
        (true, None) => Err(ScheduleError::MissingReduction { op }),
        (false, Some(_)) => Err(ScheduleError::UnexpectedReduction { op }),
        (true, Some(r)) if r.dtype().size() != plan.elem_size() => {
            Err(ScheduleError::ReductionElemSize { dtype: r.dtype(), elem_size: plan.elem_size() })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_splits_mean_an_even_split() {
        let op = ScheduleOp::alltoall_base(4, 8, 12, &[], &[]).unwrap();
        assert_eq!(op, ScheduleOp::Alltoall { send_counts: vec![2; 4], recv_counts: vec![3; 4] });
    }

    #[test]
    fn splits_that_do_not_sum_to_the_buffer_are_refused() {
        let err = ScheduleOp::alltoall_base(2, 8, 8, &[3, 4], &[]).unwrap_err();
        assert_eq!(err.to_string(), "input_splits sum to 7 elements but the buffer holds 8");
        let err = ScheduleOp::alltoall_base(3, 8, 9, &[], &[]).unwrap_err();
        assert_eq!(err.to_string(), "input_splits: 8 elements do not split evenly over world size 3");
        let err = ScheduleOp::alltoall_base(3, 8, 9, &[8], &[]).unwrap_err();
        assert_eq!(err.to_string(), "input_splits has 1 entries but the world size is 3");
    }

    #[test]
    fn unexpected_chunk_names_the_expected_ranks() {
        let err = ScheduleError::UnexpectedChunk { step: 3, from: Rank(2), expected: vec![Rank(1)] };
        assert_eq!(err.to_string(), "no chunk from rank 2 is expected at step 3 (expected from: 1)");
        let err = ScheduleError::UnexpectedChunk { step: 9, from: Rank(2), expected: vec![] };
        assert_eq!(err.to_string(), "no chunk from rank 2 is expected at step 9 (expected from: none)");
    }
}
