//! `monitored_barrier`: torch's debugging barrier over Gloo. Every non-zero rank sends a token
//! to rank 0 and waits for its ack; rank 0 receives from each rank in turn within one timeout
//! and names the ranks that did not arrive, acking everyone only when all did.

use std::time::Duration;

use cohort_core::group::SubmitError;
use cohort_core::tensor::Tensor;
use cohort_core::work::Rank;

use super::ProcessGroup;
use super::tunables::MONITORED_BARRIER_POLL;
use crate::work::{Work, WorkError};

/// The point-to-point tag `monitored_barrier` uses; user sends and receives should avoid it.
pub const MONITORED_BARRIER_TAG: u32 = u32::MAX;

/// Why a [`ProcessGroup::monitored_barrier`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MonitoredBarrierError {
    /// On rank 0: these ranks did not reach the barrier within the timeout (the first one
    /// only, unless `wait_all_ranks`), each with what rank 0 saw.
    #[error("{} failed to pass monitoredBarrier in {} ms ({})", ranks_word(.failed), .timeout.as_millis(), causes(.failed))]
    RanksFailed {
        /// The ranks that did not pass, in rank order, with why.
        failed: Vec<(Rank, String)>,
        /// The barrier's timeout.
        timeout: Duration,
    },
    /// On a non-zero rank: rank 0 did not acknowledge within the timeout (it found another
    /// rank missing, or it never arrived itself).
    #[error(
        "rank {rank} reached monitoredBarrier but rank 0 did not acknowledge it within {} ms ({cause}); \
         check rank 0's error for the faulty ranks",
        .timeout.as_millis()
    )]
    NoAck {
        /// This rank.
        rank: Rank,
        /// The barrier's timeout.
        timeout: Duration,
        /// What the wait ended with.
        cause: String,
    },
    /// The barrier could not be started (the group failed or was aborted, bad argument).
    #[error("monitored_barrier: {0}")]
    Submit(#[from] SubmitError),
    /// The arguments are invalid.
    #[error("monitored_barrier: {0}")]
    InvalidArgument(String),
    /// Called from async code: use [`ProcessGroup::monitored_barrier_async`].
    #[error("monitored_barrier blocks: call monitored_barrier_async from async code")]
    InAsyncContext,
}

impl MonitoredBarrierError {
    /// The ranks this error blames: the missing ranks on rank 0, rank 0 elsewhere.
    pub fn culprits(&self) -> Vec<Rank> {
        match self {
            MonitoredBarrierError::RanksFailed { failed, .. } => failed.iter().map(|(r, _)| *r).collect(),
            MonitoredBarrierError::NoAck { .. } => vec![Rank(0)],
            _ => Vec::new(),
        }
    }
}

fn ranks_word(failed: &[(Rank, String)]) -> String {
    let list = failed.iter().map(|(r, _)| r.0.to_string()).collect::<Vec<_>>().join(", ");
    if failed.len() == 1 { format!("Rank {list}") } else { format!("Ranks {list}") }
}

fn causes(failed: &[(Rank, String)]) -> String {
    failed.iter().map(|(r, why)| format!("rank {}: {why}", r.0)).collect::<Vec<_>>().join("; ")
}

fn token() -> Tensor {
    Tensor::from_slice(&[0u8])
}

fn describe(e: &WorkError, timeout: Duration) -> String {
    match e {
        WorkError::WaitTimedOut { .. } => format!("no message within {} ms", timeout.as_millis()),
        other => other.to_string(),
    }
}

/// How long is left until `deadline` (zero once past).
fn left(deadline: tokio::time::Instant) -> Duration {
    deadline.saturating_duration_since(tokio::time::Instant::now())
}

async fn wait_within(work: &Work, within: Duration) -> Result<(), WorkError> {
    match tokio::time::timeout(within, work.clone()).await {
        Ok(r) => r.map(|_| ()),
        Err(_) => Err(WorkError::WaitTimedOut { op: work.op(), seq: work.seq(), waited: within }),
    }
}

impl ProcessGroup {
    /// torch's `monitored_barrier`: like [`ProcessGroup::barrier`], but rank 0 checks every
    /// rank in turn within `timeout` and the error names the ranks that did not arrive
    /// ("Ranks 1, 3 failed to pass monitoredBarrier in 5000 ms"). With `wait_all_ranks`
    /// rank 0 reports every missing rank rather than the first. Other ranks fail naming rank 0
    /// when it does not acknowledge them. Uses point-to-point messages with
    /// [`MONITORED_BARRIER_TAG`]. Blocks; from async code use
    /// [`ProcessGroup::monitored_barrier_async`].
    pub fn monitored_barrier(&self, timeout: Duration, wait_all_ranks: bool) -> Result<(), MonitoredBarrierError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(MonitoredBarrierError::InAsyncContext);
        }
        self.inner.runtime.block_on(self.monitored_barrier_async(timeout, wait_all_ranks))
    }

    /// [`ProcessGroup::monitored_barrier`] for async code.
    pub async fn monitored_barrier_async(
        &self,
        timeout: Duration,
        wait_all_ranks: bool,
    ) -> Result<(), MonitoredBarrierError> {
        if timeout.is_zero() {
            return Err(MonitoredBarrierError::InvalidArgument("timeout must be positive, got 0 ms".into()));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let (me, world) = (self.rank(), self.world_size());
        if me.0 != 0 {
            let send = self.send(token(), 0, MONITORED_BARRIER_TAG)?;
            let ack = self.recv(token(), 0, MONITORED_BARRIER_TAG)?;
            let no_ack =
                |e: WorkError| MonitoredBarrierError::NoAck { rank: me, timeout, cause: describe(&e, timeout) };
            wait_within(&send, left(deadline)).await.map_err(no_ack)?;
            return wait_within(&ack, left(deadline)).await.map_err(no_ack);
        }
        // Post every receive first, so that arrivals are absorbed in any order. Works finish in
        // submission order, so a missing rank holds back the completion of later receives:
        // rank 0 watches whether each receive's token has arrived instead.
        let recvs = (1..world)
            .map(|r| self.recv(token(), r, MONITORED_BARRIER_TAG).map(|w| (Rank(r), w)))
            .collect::<Result<Vec<_>, _>>()?;
        loop {
            let expired = left(deadline).is_zero();
            let mut failed = Vec::new();
            let mut pending = false;
            for (r, work) in &recvs {
                let why = if work.is_completed() {
                    match work.exception() {
                        None => continue,
                        Some(e) => e.to_string(),
                    }
                } else if self.inner.lock().recv_arrived(work.id()) {
                    continue;
                } else if expired {
                    format!("no message within {} ms", timeout.as_millis())
                } else {
                    pending = true;
                    if wait_all_ranks {
                        continue;
                    }
                    // Torch checks ranks in order: a later rank's failure waits for this one.
                    break;
                };
                failed.push((*r, why));
                if !wait_all_ranks {
                    break;
                }
            }
            if !failed.is_empty() && (!pending || !wait_all_ranks) {
                return Err(MonitoredBarrierError::RanksFailed { failed, timeout });
            }
            if !pending {
                break;
            }
            tokio::time::sleep(MONITORED_BARRIER_POLL.min(left(deadline)).max(Duration::from_micros(100))).await;
        }
        let acks = (1..world).map(|r| self.send(token(), r, MONITORED_BARRIER_TAG)).collect::<Result<Vec<_>, _>>()?;
        for (i, ack) in acks.iter().enumerate() {
            if let Err(e) = wait_within(ack, left(deadline).max(Duration::from_millis(1))).await {
                let r = Rank(i as u32 + 1);
                return Err(MonitoredBarrierError::RanksFailed { failed: vec![(r, describe(&e, timeout))], timeout });
            }
        }
        Ok(())
    }
}
