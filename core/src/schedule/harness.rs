//! An in-memory N-rank harness for executors: no IO, no threads, a seeded delivery order.
//!
//! A test utility (public so that integration tests, benchmarks and fuzz targets can use it):
//! it runs one [`Executor`] per rank, turns every send into a message in flight, and delivers
//! the messages one at a time in an order drawn from a seeded [`SplitMix64`], optionally
//! dropping, duplicating or resizing them ([`Tamper`]). The same seed gives the same run.
//!
//! ```
//! use cohort_core::schedule::harness::{Harness, RunOutcome};
//! use cohort_core::schedule::{PlanOptions, ScheduleOp};
//! use cohort_core::tensor::HostBuffer;
//! use cohort_core::{DType, ReduceOp, Reduction};
//!
//! let sum = Reduction::new(ReduceOp::Sum, DType::I32).unwrap();
//! let inputs: Vec<HostBuffer> =
//!     (0..3).map(|r: i32| HostBuffer::from_bytes(bytemuck::cast_slice(&[r, 10 * r]))).collect();
//! let op = ScheduleOp::Allreduce { count: 2 };
//! let mut h = Harness::for_op(&op, 4, PlanOptions::default(), Some(sum), inputs, 7).unwrap();
//! assert_eq!(h.run(), RunOutcome::Completed);
//! for (data, _output) in h.into_buffers() {
//!     assert_eq!(bytemuck::cast_slice::<u8, i32>(data.as_bytes()), &[3, 30]);
//! }
//! ```

use super::{Executor, Plan, PlanOptions, ScheduleError, ScheduleOp};
use crate::reduce::Reduction;
use crate::tensor::HostBuffer;
use crate::work::Rank;

/// SplitMix64: a tiny, seeded, deterministic generator (Steele, Lea and Flood, 2014).
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0), nearly uniform.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// A message in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The sender.
    pub from: Rank,
    /// The receiver.
    pub to: Rank,
    /// The step it was sent at.
    pub step: u32,
    /// The bytes.
    pub payload: Vec<u8>,
}

/// What the harness does with a message it picked for delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tamper {
    /// Deliver it as sent.
    Deliver,
    /// Lose it.
    Drop,
    /// Deliver it, and keep a copy in flight to be delivered again later.
    Duplicate,
    /// Deliver it with its payload truncated or zero-padded to this many bytes.
    Resize(usize),
}

/// How a harness run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// Every executor finished.
    Completed,
    /// An executor refused a message.
    Failed {
        /// The rank that refused it.
        rank: Rank,
        /// Why.
        error: ScheduleError,
    },
    /// Nothing left in flight but some executors are not done: each with the peers it is
    /// waiting on.
    Stuck {
        /// `(rank, waiting_on)` of every unfinished executor, by rank.
        waiting: Vec<(Rank, Vec<Rank>)>,
    },
}

/// N executors wired together in memory. See the [module docs](self).
#[derive(Debug)]
pub struct Harness {
    executors: Vec<Executor>,
    in_flight: Vec<Envelope>,
    rng: SplitMix64,
    delivered: usize,
    /// Payload buffers of delivered messages, reused for new ones.
    spare: Vec<Vec<u8>>,
    /// Receive in place where the executor allows it ([`Harness::receive_in_place`]).
    in_place: bool,
    /// Chunks claimed for an in-place write and written up to `.1` bytes, the rest to come.
    claimed: Vec<(Envelope, usize)>,
}

impl Harness {
    /// A harness over `executors`, where `executors[i]` runs rank `i`'s plan; `seed` picks the
    /// delivery order.
    pub fn new(executors: Vec<Executor>, seed: u64) -> Harness {
        Harness {
            executors,
            in_flight: Vec::new(),
            rng: SplitMix64::new(seed),
            delivered: 0,
            spare: Vec::new(),
            in_place: false,
            claimed: Vec::new(),
        }
    }

    /// Receive chunks in place where the executor allows it
    /// ([`Executor::claim_in_place`]), as a socket reader does: a claimed chunk's bytes are
    /// written in two parts, with other deliveries in between (the second part is picked like
    /// a message in flight).
    pub fn receive_in_place(&mut self, on: bool) {
        self.in_place = on;
    }

    /// Plans and executors for `op` on `inputs.len()` ranks, `inputs[i]` being rank `i`'s data
    /// buffer; elements of the reduction's dtype size, or of `elem_size` when there is none.
    pub fn for_op(
        op: &ScheduleOp,
        elem_size: usize,
        options: PlanOptions,
        reduction: Option<Reduction>,
        inputs: Vec<HostBuffer>,
        seed: u64,
    ) -> Result<Harness, ScheduleError> {
        let world_size = u32::try_from(inputs.len()).unwrap_or(u32::MAX);
        let elem_size = reduction.map_or(elem_size, |r| r.dtype().size());
        let mut executors = Vec::with_capacity(inputs.len());
        for (rank, data) in inputs.into_iter().enumerate() {
            let plan = Plan::new(op, Rank(rank as u32), world_size, elem_size, options)?;
            executors.push(Executor::new(plan, reduction, data)?);
        }
        Ok(Harness::new(executors, seed))
    }

    /// Run to the end, delivering every message as sent, in random order.
    pub fn run(&mut self) -> RunOutcome {
        self.run_with(|_, _| Tamper::Deliver)
    }

    /// Run to the end, asking `tamper` what to do with each message picked for delivery. Ends
    /// at the first refused message, or when nothing is left in flight.
    pub fn run_with(&mut self, mut tamper: impl FnMut(&Envelope, &mut SplitMix64) -> Tamper) -> RunOutcome {
        for rank in 0..self.executors.len() {
            self.drain(rank);
        }
        while !self.in_flight.is_empty() || !self.claimed.is_empty() {
            let pick = self.rng.below(self.in_flight.len() + self.claimed.len());
            if let Some(k) = pick.checked_sub(self.in_flight.len()) {
                let (env, at) = self.claimed.swap_remove(k);
                if let Err(error) = self.finish_claimed(&env, at) {
                    return RunOutcome::Failed { rank: env.to, error };
                }
                let to = env.to.index();
                self.spare.push(env.payload);
                self.drain(to);
                continue;
            }
            let mut env = self.in_flight.swap_remove(pick);
            match tamper(&env, &mut self.rng) {
                Tamper::Deliver => {}
                Tamper::Drop => continue,
                Tamper::Duplicate => self.in_flight.push(env.clone()),
                Tamper::Resize(len) => env.payload.resize(len, 0),
            }
            let to = env.to.index();
            self.delivered += 1;
            if self.in_place {
                match self.executors[to].claim_in_place(env.from, env.step, env.payload.len()) {
                    Err(error) => return RunOutcome::Failed { rank: env.to, error },
                    Ok(true) => {
                        // The first part now; the rest later, like a socket's next read.
                        let at = self.rng.below(env.payload.len() + 1);
                        if let Some(dst) = self.executors[to].claimed_buffer_mut(env.from, env.step) {
                            dst[..at].copy_from_slice(&env.payload[..at]);
                        }
                        self.claimed.push((env, at));
                        continue;
                    }
                    Ok(false) => {}
                }
            }
            if let Err(error) = self.executors[to].handle_recv(env.from, env.step, &env.payload) {
                return RunOutcome::Failed { rank: env.to, error };
            }
            self.spare.push(env.payload);
            self.drain(to);
        }
        let waiting: Vec<_> = self
            .executors
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.is_done())
            .map(|(r, e)| (Rank(r as u32), e.waiting_on()))
            .collect();
        if waiting.is_empty() { RunOutcome::Completed } else { RunOutcome::Stuck { waiting } }
    }

    /// Messages delivered so far.
    pub fn delivered(&self) -> usize {
        self.delivered
    }

    /// The executors, by rank.
    pub fn executors(&self) -> &[Executor] {
        &self.executors
    }

    /// Every rank's `(data, output)` buffers, by rank.
    pub fn into_buffers(self) -> Vec<(HostBuffer, HostBuffer)> {
        self.executors.into_iter().map(Executor::into_buffers).collect()
    }

    /// Write the rest of a claimed chunk from byte `at` and finish it.
    fn finish_claimed(&mut self, env: &Envelope, at: usize) -> Result<(), ScheduleError> {
        let exec = &mut self.executors[env.to.index()];
        if let Some(dst) = exec.claimed_buffer_mut(env.from, env.step) {
            dst[at..].copy_from_slice(&env.payload[at..]);
        }
        exec.finish_in_place(env.from, env.step)
    }

    fn drain(&mut self, rank: usize) {
        let exec = &mut self.executors[rank];
        while let Some(send) = exec.poll_send() {
            let mut payload = self.spare.pop().unwrap_or_default();
            payload.clear();
            payload.extend_from_slice(exec.payload(&send));
            self.in_flight.push(Envelope { from: Rank(rank as u32), to: send.to, step: send.step, payload });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::ReduceOp;
    use crate::tensor::DType;

    fn sum_inputs(n: usize, count: usize) -> Vec<HostBuffer> {
        (0..n)
            .map(|r| {
                let v: Vec<i64> = (0..count).map(|i| (r * 1000 + i) as i64).collect();
                HostBuffer::from_bytes(bytemuck::cast_slice(&v))
            })
            .collect()
    }

    fn allreduce(n: usize, count: usize, seed: u64) -> Harness {
        let sum = Reduction::new(ReduceOp::Sum, DType::I64).unwrap();
        let op = ScheduleOp::Allreduce { count };
        Harness::for_op(&op, 8, PlanOptions::default(), Some(sum), sum_inputs(n, count), seed).unwrap()
    }

    #[test]
    fn splitmix_is_deterministic_and_in_range() {
        let (mut a, mut b) = (SplitMix64::new(42), SplitMix64::new(42));
        for _ in 0..100 {
            let x = a.below(7);
            assert_eq!(x, b.below(7));
            assert!(x < 7);
        }
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }

    #[test]
    fn same_seed_same_run() {
        let mut a = allreduce(5, 13, 9);
        let mut b = allreduce(5, 13, 9);
        let mut order_a = Vec::new();
        let mut order_b = Vec::new();
        assert_eq!(
            a.run_with(|e, _| {
                order_a.push((e.from, e.to, e.step));
                Tamper::Deliver
            }),
            RunOutcome::Completed
        );
        b.run_with(|e, _| {
            order_b.push((e.from, e.to, e.step));
            Tamper::Deliver
        });
        assert_eq!(order_a, order_b);
        assert!(a.delivered() > 0);
    }

    #[test]
    fn a_dropped_message_leaves_ranks_stuck_naming_the_sender() {
        let mut h = allreduce(4, 4, 3);
        let mut first = true;
        let outcome = h.run_with(|e, _| {
            if first && e.from == Rank(2) {
                first = false;
                return Tamper::Drop;
            }
            Tamper::Deliver
        });
        let RunOutcome::Stuck { waiting } = outcome else { panic!("expected stuck, got {outcome:?}") };
        assert!(waiting.iter().any(|(_, peers)| peers.contains(&Rank(2))), "{waiting:?}");
    }

    #[test]
    fn a_duplicated_message_is_refused() {
        let mut h = allreduce(3, 5, 11);
        let outcome = h.run_with(|_, _| Tamper::Duplicate);
        assert!(
            matches!(outcome, RunOutcome::Failed { error: ScheduleError::DuplicateChunk { .. }, .. }),
            "{outcome:?}"
        );
    }
}
