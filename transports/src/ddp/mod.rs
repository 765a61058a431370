//! What PyTorch's `comm.hpp` and `reducer.cpp` give DistributedDataParallel, for Rust training
//! loops: [`broadcast_coalesced`], [`GradBucket`], communication hooks ([`CommHook`]:
//! [`AllreduceHook`], [`CompressHook`] for fp16/bf16, [`PowerSgdHook`]) and the bucketed
//! gradient [`Reducer`].
//!
//! ```no_run
//! use cohort_core::{DType, Tensor};
//! use cohort_transports::ddp::{AllreduceHook, Reducer};
//! # fn run(pg: cohort_transports::ProcessGroup, grads: Vec<Tensor>) -> Result<(), cohort_transports::ddp::DdpError> {
//! let shapes = vec![vec![1024, 1024], vec![1024], vec![10, 1024]]; // in registration order
//! let mut reducer = Reducer::new(pg, shapes, DType::F32, Box::new(AllreduceHook))?;
//! // Backward: gradients become ready in reverse order; each full bucket is reduced at once.
//! for p in (0..3).rev() {
//!     reducer.mark_ready(p, &grads[p])?;
//! }
//! let averaged: Vec<Tensor> = reducer.finish()?; // one per parameter, registration order
//! # Ok(()) }
//! ```

mod hooks;
mod powersgd;
mod reducer;

pub use hooks::{AllreduceHook, CommHook, CompressHook, GradBucket};
pub use powersgd::{PowerSgdConfig, PowerSgdHook};
pub use reducer::{BucketCaps, Reducer, assign_buckets};

use cohort_core::group::SubmitError;
use cohort_core::tensor::{DType, Tensor, TensorError};

use crate::tcp::ProcessGroup;
use crate::work::WorkError;

/// What went wrong in DDP communication. Errors about a parameter name it by index (and by
/// name when the reducer was given names).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// A gradient was marked ready twice in one step.
    #[error(
        "parameter {param} was marked ready twice in this step (DDP expects each gradient exactly once per backward)"
    )]
    ReadyTwice {
        /// The parameter, as `index` or `index (name)`.
        param: String,
    },
    /// The step finished with parameters whose gradient was never marked ready.
    #[error(
        "the step finished but parameter(s) {params} never got a gradient: they did not take part in producing the loss (DDP's unused-parameter error; mark them ready with zeros)"
    )]
    NeverReady {
        /// The parameters, as `index` or `index (name)`, comma-separated.
        params: String,
    },
    /// A parameter index outside the model.
    #[error("parameter index {index} is out of range: the reducer has {count} parameters")]
    NoSuchParam {
        /// The index given.
        index: usize,
        /// How many parameters there are.
        count: usize,
    },
    /// A gradient whose dtype or element count does not match its parameter.
    #[error("gradient of parameter {param}: {what}")]
    BadGradient {
        /// The parameter.
        param: String,
        /// What was wrong.
        what: String,
    },
    /// Bad configuration (an empty model, a dtype a hook cannot handle...).
    #[error("{0}")]
    Config(String),
    /// A collective was refused before anything was sent.
    #[error("{0}")]
    Submit(#[from] SubmitError),
    /// A collective (or a hook's work) failed.
    #[error("{0}")]
    Work(#[from] WorkError),
    /// Tensor bookkeeping failed.
    #[error("{0}")]
    Tensor(#[from] TensorError),
}

impl DdpError {
    /// The rank a failed collective blames, if any.
    pub fn culprit(&self) -> Option<cohort_core::work::Rank> {
        match self {
            DdpError::Work(e) => e.culprit(),
            _ => None,
        }
    }
}

/// Broadcast `tensors` from `root` in buckets of at most `buffer_size` bytes per dtype (a
/// tensor larger than that goes alone): flatten, broadcast each bucket, unflatten. The result,
/// in the order given, equals broadcasting each tensor. Blocks until done; every rank calls it
/// with tensors of the same shapes and dtypes.
pub fn broadcast_coalesced(
    pg: &ProcessGroup,
    tensors: Vec<Tensor>,
    buffer_size: usize,
    root: u32,
) -> Result<Vec<Tensor>, DdpError> {
    if root >= pg.world_size() {
        return Err(DdpError::Config(format!(
            "broadcast_coalesced: root rank {root} is not a rank of a {}-rank group",
            pg.world_size()
        )));
    }
    // Buckets per dtype, in order of first appearance (as torch's take_tensors does).
    let mut buckets: Vec<(DType, Vec<usize>, usize)> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let open = buckets.iter().rposition(|(d, _, _)| *d == t.dtype());
        match open {
            Some(b) if buckets[b].2 + t.nbytes() <= buffer_size || buckets[b].1.is_empty() => {
                buckets[b].1.push(i);
                buckets[b].2 += t.nbytes();
            }
            _ => buckets.push((t.dtype(), vec![i], t.nbytes())),
        }
    }
    let mut works = Vec::with_capacity(buckets.len());
    for (_, members, _) in &buckets {
        let group: Vec<Tensor> = members.iter().map(|&i| tensors[i].clone()).collect();
        let (flat, slots) = Tensor::flatten(&group)?;
        works.push((members, slots, pg.broadcast(vec![flat], root)?));
    }
    let mut out: Vec<Option<Tensor>> = vec![None; tensors.len()];
    for (members, slots, work) in works {
        let flat = work.result()?.pop().ok_or_else(|| DdpError::Config("broadcast returned no tensor".into()))?;
        for (&i, t) in members.iter().zip(flat.unflatten(&slots)?) {
            out[i] = Some(t);
        }
    }
    Ok(out.into_iter().map(|t| t.expect("every tensor is in one bucket")).collect())
}
