//! Sparse allreduce as Gloo does it: allgather every rank's nnz and shape, then its indices
//! and values (padded to the largest nnz), then sum duplicate indices (coalesce).

use std::collections::BTreeMap;

use cohort_core::group::SubmitError;
use cohort_core::reduce::{ReduceError, ReduceOp, Reduction};
use cohort_core::tensor::{DType, Tensor, TensorError};
use cohort_core::work::OpType;

use super::ProcessGroup;
use crate::work::WorkError;

/// A COO sparse tensor: `indices` (I64, `[nnz, sparse_dims]`) says where each of the `nnz`
/// rows of `values` (`[nnz, shape[sparse_dims..]...]`) sits in a tensor of `shape`.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseTensor {
    /// I64 indices, `[nnz, sparse_dims]`.
    pub indices: Tensor,
    /// Values, `[nnz, shape[sparse_dims..]...]`.
    pub values: Tensor,
    /// The dense shape.
    pub shape: Vec<usize>,
}

fn bad(arg: &'static str, reason: String) -> SubmitError {
    SubmitError::InvalidArgument { op: OpType::AllreduceSparse, arg, reason }
}

/// Why [`ProcessGroup::allreduce_sparse`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SparseError {
    /// The blocking call was made from async code.
    #[error("allreduce_sparse blocks: call allreduce_sparse_async from async code")]
    InAsync,
    /// The arguments were refused, or one of the allgathers could not be submitted.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// One of the allgathers failed.
    #[error(transparent)]
    Work(#[from] WorkError),
    /// A tensor could not be built or read.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The values could not be summed.
    #[error(transparent)]
    Reduce(#[from] ReduceError),
    /// A peer sent a negative row count.
    #[error("allreduce_sparse: rank {rank} sent nnz {nnz}")]
    BadNnz {
        /// The peer.
        rank: usize,
        /// What it sent.
        nnz: i64,
    },
    /// A peer sent an index outside the tensor.
    #[error("allreduce_sparse: rank {rank} sent index {index:?} outside shape {shape:?}")]
    IndexOutOfRange {
        /// The peer.
        rank: usize,
        /// The index.
        index: Vec<i64>,
        /// The dense shape.
        shape: Vec<usize>,
    },
}

impl SparseTensor {
    /// Check the parts fit together and every index is in bounds; errors name the argument.
    pub fn new(indices: Tensor, values: Tensor, shape: Vec<usize>) -> Result<SparseTensor, SubmitError> {
        if indices.dtype() != DType::I64 {
            return Err(bad("indices", format!("must be I64, got {}", indices.dtype())));
        }
        let &[nnz, sd] = indices.shape() else {
            return Err(bad("indices", format!("must be 2-D [nnz, sparse_dims], got shape {:?}", indices.shape())));
        };
        if sd == 0 || sd > shape.len() {
            return Err(bad("indices", format!("{sd} sparse dims for a tensor of {} dims", shape.len())));
        }
        let mut want = vec![nnz];
        want.extend_from_slice(&shape[sd..]);
        if values.shape() != want.as_slice() {
            return Err(bad("values", format!("shape {:?}, expected {want:?}", values.shape())));
        }
        let idx = indices.to_vec::<i64>().map_err(|e| bad("indices", e.to_string()))?;
        for (i, row) in idx.chunks(sd).enumerate() {
            for (d, &v) in row.iter().enumerate() {
                if v < 0 || v as u64 >= shape[d] as u64 {
                    return Err(bad(
                        "indices",
                        format!("row {i}: index {v} out of bounds for dim {d} of size {}", shape[d]),
                    ));
                }
            }
        }
        Ok(SparseTensor { indices, values, shape })
    }

    /// The number of stored rows.
    pub fn nnz(&self) -> usize {
        self.indices.shape()[0]
    }

    fn sparse_dims(&self) -> usize {
        self.indices.shape()[1]
    }

    fn row_numel(&self) -> usize {
        self.shape[self.sparse_dims()..].iter().product()
    }
}

impl ProcessGroup {
    /// Sum `tensor` across ranks (Gloo's sparse allreduce: three allgathers, then duplicate
    /// indices are summed). The result is coalesced: indices unique and sorted. Every rank
    /// must pass the same shape, sparse dims and dtype; only [`ReduceOp::Sum`] is supported.
    /// It runs three collectives one after another, so call it where the program would call
    /// any collective (not concurrently with another one on this group).
    pub async fn allreduce_sparse_async(
        &self,
        tensor: SparseTensor,
        op: ReduceOp,
    ) -> Result<SparseTensor, SparseError> {
        if op != ReduceOp::Sum {
            return Err(bad("op", format!("only sum is supported, got {op:?}")).into());
        }
        let dtype = tensor.values.dtype();
        let red = Reduction::new(ReduceOp::Sum, dtype)?;
        let (n, sd, row) = (self.world_size() as usize, tensor.sparse_dims(), tensor.row_numel());
        // 1: nnz, sparse dims, dtype and shape of every rank.
        let mut header = vec![tensor.nnz() as i64, sd as i64, i64::from(dtype.code())];
        header.extend(tensor.shape.iter().map(|&d| d as i64));
        let headers = self.allgather(Tensor::from_slice(&header))?.await?;
        let mut nnzs = Vec::with_capacity(n);
        for (r, h) in headers.iter().enumerate() {
            let h = h.to_vec::<i64>()?;
            if h[1..] != header[1..] {
                return Err(bad(
                    "tensor",
                    format!(
                        "rank {r} has (sparse dims, dtype code, shape) {:?}, this rank {:?}",
                        &h[1..],
                        &header[1..]
                    ),
                )
                .into());
            }
            nnzs.push(usize::try_from(h[0]).map_err(|_| SparseError::BadNnz { rank: r, nnz: h[0] })?);
        }
        let max = nnzs.iter().copied().max().unwrap_or(0);
        // 2 and 3: indices and values, padded to the largest nnz.
        let mut idx = Tensor::zeros(DType::I64, &[max * sd])?;
        idx.bytes_mut()[..tensor.indices.nbytes()].copy_from_slice(tensor.indices.bytes());
        let mut vals = Tensor::zeros(dtype, &[max * row])?;
        vals.bytes_mut()[..tensor.values.nbytes()].copy_from_slice(tensor.values.bytes());
        let all_idx = self.allgather(idx)?.await?;
        let all_vals = self.allgather(vals)?.await?;
        // Coalesce: sum the rows of equal indices, in index order.
        let row_bytes = row * dtype.size();
        let mut sum: BTreeMap<Vec<i64>, Vec<u8>> = BTreeMap::new();
        for (r, &k) in nnzs.iter().enumerate() {
            let ix = all_idx[r].to_vec::<i64>()?;
            let vs = all_vals[r].bytes();
            for i in 0..k {
                let key = ix[i * sd..(i + 1) * sd].to_vec();
                if key.iter().zip(&tensor.shape).any(|(&v, &d)| v < 0 || v as u64 >= d as u64) {
                    return Err(SparseError::IndexOutOfRange { rank: r, index: key, shape: tensor.shape });
                }
                let bytes = &vs[i * row_bytes..(i + 1) * row_bytes];
                match sum.get_mut(&key) {
                    Some(acc) => red.combine(acc, bytes)?,
                    None => {
                        sum.insert(key, bytes.to_vec());
                    }
                }
            }
        }
        let nnz = sum.len();
        let flat_idx: Vec<i64> = sum.keys().flatten().copied().collect();
        let flat_vals: Vec<u8> = sum.into_values().flatten().collect();
        let indices = Tensor::from_slice_shaped(&flat_idx, &[nnz, sd])?;
        let mut vshape = vec![nnz];
        vshape.extend_from_slice(&tensor.shape[sd..]);
        let values = Tensor::from_bytes(dtype, &vshape, &flat_vals)?;
        Ok(SparseTensor { indices, values, shape: tensor.shape })
    }

    /// [`ProcessGroup::allreduce_sparse_async`], blocking; refused inside async code.
    pub fn allreduce_sparse(&self, tensor: SparseTensor, op: ReduceOp) -> Result<SparseTensor, SparseError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(SparseError::InAsync);
        }
        self.inner.runtime.block_on(self.allreduce_sparse_async(tensor, op))
    }
}
