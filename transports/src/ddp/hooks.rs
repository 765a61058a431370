//! [`GradBucket`] and communication hooks.

use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Element, Tensor, TensorError};
use cohort_core::work::{OpType, WorkResult};

use crate::tcp::ProcessGroup;
use crate::work::Work;

/// One bucket of gradients, flattened (c10d's `GradBucket`).
#[derive(Debug, Clone)]
pub struct GradBucket {
    /// This bucket's index (0 is the first reduced: the last parameters registered).
    pub index: usize,
    /// How many buckets the model has.
    pub num_buckets: usize,
    /// The flat buffer holding every gradient of the bucket back to back.
    pub buffer: Tensor,
    /// The parameters in this bucket (indices in registration order), in buffer order.
    pub params: Vec<usize>,
    /// Where each gradient starts in `buffer`, in elements.
    pub offsets: Vec<usize>,
    /// Each gradient's element count.
    pub lengths: Vec<usize>,
    /// Each gradient's shape.
    pub shapes: Vec<Vec<usize>>,
    /// For sparse gradients, their indices (unused by the dense reducer).
    pub sparse_indices: Option<Tensor>,
}

impl GradBucket {
    /// Whether this is the last bucket of the step (c10d's `is_last`).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.num_buckets
    }

    /// Gradient `i` of the bucket as a typed view into the buffer.
    pub fn gradient<T: Element>(&self, i: usize) -> Result<&[T], TensorError> {
        let all = self.buffer.as_slice::<T>()?;
        Ok(&all[self.offsets[i]..self.offsets[i] + self.lengths[i]])
    }

    /// Gradient `i` as a mutable typed view into the buffer.
    pub fn gradient_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T], TensorError> {
        let (o, n) = (self.offsets[i], self.lengths[i]);
        let all = self.buffer.as_mut_slice::<T>()?;
        Ok(&mut all[o..o + n])
    }

    /// Every gradient as its own tensor with its shape (copies).
    pub fn gradients(&self) -> Result<Vec<Tensor>, TensorError> {
        let es = self.buffer.element_size();
        (0..self.params.len())
            .map(|i| {
                let bytes = &self.buffer.bytes()[self.offsets[i] * es..(self.offsets[i] + self.lengths[i]) * es];
                Tensor::from_bytes(self.buffer.dtype(), &self.shapes[i], bytes)
            })
            .collect()
    }
}

/// A communication hook: reduces one bucket and returns a [`Work`] whose result is the
/// reduced flat buffer (what c10d's `CppCommHookInterface::runHook` returns as a future). A
/// hook keeps whatever state it needs across buckets and steps.
///
/// Every rank calls `run` for the same buckets in the same order; a hook must issue its
/// collectives in an order that depends only on that sequence (not on timing), or ranks would
/// pair different collectives.
pub trait CommHook: Send {
    /// The hook's name, for messages.
    fn name(&self) -> &str;
    /// Start reducing `bucket`.
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> Work;
}

/// The default: allreduce the bucket and divide by the world size (torch's `allreduce_hook`).
#[derive(Debug, Clone, Copy, Default)]
pub struct AllreduceHook;

impl CommHook for AllreduceHook {
    fn name(&self) -> &str {
        "allreduce"
    }

    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> Work {
        let op = if bucket.buffer.dtype().is_floating_point() { ReduceOp::Avg } else { ReduceOp::Sum };
        match pg.allreduce(vec![bucket.buffer], op) {
            Ok(work) => work,
            Err(e) => refused_work(pg, &e),
        }
    }
}

/// A work that failed because the group refused its collective; a group that failed earlier
/// passes on the rank it blamed.
pub(crate) fn refused_work(pg: &ProcessGroup, e: &cohort_core::group::SubmitError) -> Work {
    let result = refused_result(e);
    pg.spawn_work(OpType::Allreduce, async move { Err(result) })
}

/// The result of a refused collective, blaming the rank the group's failure blamed.
pub(crate) fn refused_result(e: &cohort_core::group::SubmitError) -> WorkResult {
    let blame = match e {
        cohort_core::group::SubmitError::GroupFailed { cause } => cause.blame.clone(),
        _ => cohort_core::Blame::nobody(),
    };
    WorkResult::CommError { blame, message: e.to_string() }
}

/// A work that has already failed with `message`.
pub(crate) fn failed_work(pg: &ProcessGroup, message: String) -> Work {
    pg.spawn_work(OpType::Allreduce, async move {
        Err(WorkResult::CommError { blame: cohort_core::Blame::nobody(), message })
    })
}

/// fp16 or bf16 compression (torch's `fp16_compress_hook` / `bf16_compress_hook`): cast the
/// bucket to half precision, allreduce (sum), cast back, divide by the world size. Halves the
/// bytes on the wire at the cost of precision.
#[derive(Debug, Clone, Copy)]
pub struct CompressHook {
    to: DType,
}

impl CompressHook {
    /// Compress to float16.
    pub fn fp16() -> Self {
        CompressHook { to: DType::F16 }
    }

    /// Compress to bfloat16.
    pub fn bf16() -> Self {
        CompressHook { to: DType::Bf16 }
    }
}

impl CommHook for CompressHook {
    fn name(&self) -> &str {
        if self.to == DType::F16 { "fp16_compress" } else { "bf16_compress" }
    }

    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> Work {
        let from = bucket.buffer.dtype();
        if from != DType::F32 {
            return failed_work(pg, format!("{} hook: gradients must be float32, not {from}", self.name()));
        }
        let values = match bucket.buffer.as_slice::<f32>() {
            Ok(v) => v,
            Err(e) => return failed_work(pg, e.to_string()),
        };
        let wide: Vec<f64> = values.iter().map(|&x| f64::from(x)).collect();
        let compressed = Tensor::from_f64s(self.to, &wide);
        let shape = bucket.buffer.shape().to_vec();
        let work = match pg.allreduce(vec![compressed], ReduceOp::Sum) {
            Ok(w) => w,
            Err(e) => return refused_work(pg, &e),
        };
        let world = pg.world_size() as f32;
        pg.spawn_work(OpType::Allreduce, async move {
            let reduced = work.await.map_err(|e| e.to_result())?;
            let t = reduced.first().ok_or_else(|| WorkResult::CommError {
                blame: cohort_core::Blame::nobody(),
                message: "no output".into(),
            })?;
            let wide: Vec<f32> = t.to_f64s().into_iter().map(|x| x as f32 / world).collect();
            let out = Tensor::from_slice_shaped(&wide, &shape)
                .map_err(|e| WorkResult::CommError { blame: cohort_core::Blame::nobody(), message: e.to_string() })?;
            Ok(vec![out])
        })
    }
}
