//! Reduction operators and their elementwise kernels.
//!
//! A collective reduces in three phases, so that every schedule (ring, tree,
//! halving-doubling) gives the same answer:
//!
//! 1. [`Reduction::premultiply`] on each rank's own input (only `PremulSum` does anything);
//! 2. [`Reduction::combine`] `acc = acc ⊕ src`, as often as the schedule needs (Avg and
//!    PremulSum combine as Sum);
//! 3. [`Reduction::finalize`] once on the reduced result (only `Avg` does anything: it divides
//!    by the number of ranks).
//!
//! The kernels work on byte slices of any alignment. Aligned inputs (the common case: tensor
//! storage is 8-byte aligned) go through plain typed loops that LLVM vectorizes; unaligned ones
//! are staged through an aligned stack buffer. float16 and bfloat16 are computed in float32 and
//! rounded back, as torch does on the CPU. Floating-point Min and Max propagate NaN, as torch's
//! do. Integers wrap on overflow.

use std::fmt;

use bytemuck::Pod;
use half::{bf16, f16, slice::HalfFloatSliceExt};
use serde::{Deserialize, Serialize};

use crate::tensor::DType;

/// c10d's `ReduceOp`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Sum divided by the number of ranks (integers: truncating division).
    Avg,
    /// Bitwise and (integers and bool only).
    BAnd,
    /// Bitwise or (integers and bool only).
    BOr,
    /// Bitwise xor (integers and bool only).
    BXor,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Each rank's input multiplied by the factor, then summed (floating point only), as
    /// torch's `_make_nccl_premul_sum`.
    PremulSum(f64),
    /// Elementwise product.
    Product,
    /// Elementwise sum.
    Sum,
}

impl ReduceOp {
    /// torch's name (`sum`, `avg`, `premul_sum`…), also the name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::PremulSum(_) => "premul_sum",
            ReduceOp::Product => "prod",
            ReduceOp::Sum => "sum",
        }
    }

    /// Parse a name as [`ReduceOp::name`] writes it (`premul_sum` takes factor 1; also accepts
    /// `product` and `mean`).
    pub fn parse(s: &str) -> Option<ReduceOp> {
        Some(match s.to_ascii_lowercase().as_str() {
            "avg" | "mean" => ReduceOp::Avg,
            "band" => ReduceOp::BAnd,
            "bor" => ReduceOp::BOr,
            "bxor" => ReduceOp::BXor,
            "max" => ReduceOp::Max,
            "min" => ReduceOp::Min,
            "premul_sum" => ReduceOp::PremulSum(1.0),
            "prod" | "product" => ReduceOp::Product,
            "sum" => ReduceOp::Sum,
            _ => return None,
        })
    }

    /// One-byte code used on the wire (the PremulSum factor travels separately).
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Avg => 0,
            ReduceOp::BAnd => 1,
            ReduceOp::BOr => 2,
            ReduceOp::BXor => 3,
            ReduceOp::Max => 4,
            ReduceOp::Min => 5,
            ReduceOp::PremulSum(_) => 6,
            ReduceOp::Product => 7,
            ReduceOp::Sum => 8,
        }
    }

    /// Whether `dtype` supports this op; the error says why not.
    pub fn check(self, dtype: DType) -> Result<(), ReduceError> {
        let refused = match self {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => dtype.is_floating_point(),
            ReduceOp::Avg => dtype == DType::Bool,
            ReduceOp::PremulSum(_) => !dtype.is_floating_point(),
            ReduceOp::Max | ReduceOp::Min | ReduceOp::Product | ReduceOp::Sum => false,
        };
        if refused { Err(ReduceError::Unsupported { op: self, dtype }) } else { Ok(()) }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PremulSum(factor) => write!(f, "premul_sum({factor})"),
            op => f.write_str(op.name()),
        }
    }
}

/// Errors from reductions.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ReduceError {
    /// The op is not defined for the dtype (as torch refuses it).
    #[error("reduce op {op} is not supported for dtype {dtype}")]
    Unsupported {
        /// The op.
        op: ReduceOp,
        /// The dtype.
        dtype: DType,
    },
    /// The two operands differ in length.
    #[error("cannot reduce {src} bytes into {acc} bytes")]
    LengthMismatch {
        /// Accumulator length in bytes.
        acc: usize,
        /// Source length in bytes.
        src: usize,
    },
    /// A length that is not a whole number of elements.
    #[error("{len} bytes is not a whole number of {dtype} elements")]
    RaggedBytes {
        /// Length in bytes.
        len: usize,
        /// The dtype.
        dtype: DType,
    },
}

/// A [`ReduceOp`] checked against a [`DType`]: the kernels for one collective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reduction {
    op: ReduceOp,
    dtype: DType,
}

/// The elementwise operation a combine step performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    And,
    Max,
    Min,
    Or,
    Prod,
    Sum,
    Xor,
}

impl Reduction {
    /// Check `op` against `dtype`.
    pub fn new(op: ReduceOp, dtype: DType) -> Result<Reduction, ReduceError> {
        op.check(dtype)?;
        Ok(Reduction { op, dtype })
    }

    /// The op.
    pub fn op(&self) -> ReduceOp {
        self.op
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Phase 1, on a rank's own input: PremulSum multiplies by its factor; every other op
    /// leaves the input alone.
    pub fn premultiply(&self, buf: &mut [u8]) -> Result<(), ReduceError> {
        self.check_len(buf.len())?;
        if let ReduceOp::PremulSum(factor) = self.op {
            scale(self.dtype, buf, factor);
        }
        Ok(())
    }

    /// Phase 2: `acc = acc ⊕ src`, elementwise.
    pub fn combine(&self, acc: &mut [u8], src: &[u8]) -> Result<(), ReduceError> {
        if acc.len() != src.len() {
            return Err(ReduceError::LengthMismatch { acc: acc.len(), src: src.len() });
        }
        self.check_len(acc.len())?;
        let kernel = match self.op {
            ReduceOp::Avg | ReduceOp::PremulSum(_) | ReduceOp::Sum => Kernel::Sum,
            ReduceOp::BAnd => Kernel::And,
            ReduceOp::BOr => Kernel::Or,
            ReduceOp::BXor => Kernel::Xor,
            ReduceOp::Max => Kernel::Max,
            ReduceOp::Min => Kernel::Min,
            ReduceOp::Product => Kernel::Prod,
        };
        combine_bytes(self.dtype, kernel, acc, src);
        Ok(())
    }

    /// Phase 3, once on the reduced result: Avg divides by `world_size`; every other op leaves
    /// it alone. Inlined: for every other op it is a check of the length.
    #[inline]
    pub fn finalize(&self, buf: &mut [u8], world_size: usize) -> Result<(), ReduceError> {
        self.check_len(buf.len())?;
        if self.op == ReduceOp::Avg && world_size > 1 {
            divide(self.dtype, buf, world_size);
        }
        Ok(())
    }

    fn check_len(&self, len: usize) -> Result<(), ReduceError> {
        if len.is_multiple_of(self.dtype.size()) {
            Ok(())
        } else {
            Err(ReduceError::RaggedBytes { len, dtype: self.dtype })
        }
    }
}

/// Bytes handled per staging round for unaligned or half-precision data.
const STAGE: usize = 1024;

/// Run `f` over typed views of `acc` and `src`, staging through aligned buffers when either
/// is not aligned for `T`.
fn with_typed<T: Pod + Default>(acc: &mut [u8], src: &[u8], mut f: impl FnMut(&mut [T], &[T])) {
    // One element (a scalar's allreduce, the most frequent small one): read out and written
    // back whatever its alignment, without the casts' checks or a loop of unknown length.
    if acc.len() == std::mem::size_of::<T>() && src.len() == acc.len() {
        let mut a = [bytemuck::pod_read_unaligned::<T>(acc)];
        f(&mut a, &[bytemuck::pod_read_unaligned::<T>(src)]);
        acc.copy_from_slice(bytemuck::bytes_of(&a[0]));
        return;
    }
    if let (Ok(a), Ok(s)) = (bytemuck::try_cast_slice_mut::<u8, T>(acc), bytemuck::try_cast_slice::<u8, T>(src)) {
        f(a, s);
        return;
    }
    // A small message (a latency-bound one) gets small staging buffers: filling two of
    // `STAGE` elements first would cost more than its reduction.
    if acc.len() <= SMALL_STAGE * std::mem::size_of::<T>() {
        staged::<T, SMALL_STAGE>(acc, src, f);
    } else {
        staged::<T, STAGE>(acc, src, f);
    }
}

/// Elements staged per round for messages of at most this many elements.
const SMALL_STAGE: usize = 64;

fn staged<T: Pod + Default, const N: usize>(acc: &mut [u8], src: &[u8], mut f: impl FnMut(&mut [T], &[T])) {
    let es = std::mem::size_of::<T>();
    let mut abuf = [T::default(); N];
    let mut sbuf = [T::default(); N];
    for (ac, sc) in acc.chunks_mut(N * es).zip(src.chunks(N * es)) {
        let n = ac.len() / es;
        bytemuck::cast_slice_mut::<T, u8>(&mut abuf[..n]).copy_from_slice(ac);
        bytemuck::cast_slice_mut::<T, u8>(&mut sbuf[..n]).copy_from_slice(sc);
        f(&mut abuf[..n], &sbuf[..n]);
        ac.copy_from_slice(bytemuck::cast_slice(&abuf[..n]));
    }
}

/// Run `f` over a typed, mutable view of `buf`, staging when unaligned.
fn with_typed_mut<T: Pod + Default>(buf: &mut [u8], mut f: impl FnMut(&mut [T])) {
    if let Ok(b) = bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        f(b);
        return;
    }
    if buf.len() <= SMALL_STAGE * std::mem::size_of::<T>() {
        staged_mut::<T, SMALL_STAGE>(buf, f);
    } else {
        staged_mut::<T, STAGE>(buf, f);
    }
}

fn staged_mut<T: Pod + Default, const N: usize>(buf: &mut [u8], mut f: impl FnMut(&mut [T])) {
    let es = std::mem::size_of::<T>();
    let mut stage = [T::default(); N];
    for c in buf.chunks_mut(N * es) {
        let n = c.len() / es;
        bytemuck::cast_slice_mut::<T, u8>(&mut stage[..n]).copy_from_slice(c);
        f(&mut stage[..n]);
        c.copy_from_slice(bytemuck::cast_slice(&stage[..n]));
    }
}

macro_rules! float_loop {
    ($kernel:expr, $a:expr, $s:expr) => {
        match $kernel {
            Kernel::Sum => $a.iter_mut().zip($s).for_each(|(a, s)| *a += *s),
            Kernel::Prod => $a.iter_mut().zip($s).for_each(|(a, s)| *a *= *s),
            Kernel::Max => $a.iter_mut().zip($s).for_each(|(a, s)| *a = if *s > *a || s.is_nan() { *s } else { *a }),
            Kernel::Min => $a.iter_mut().zip($s).for_each(|(a, s)| *a = if *s < *a || s.is_nan() { *s } else { *a }),
            // Refused by ReduceOp::check before any kernel runs.
            Kernel::And | Kernel::Or | Kernel::Xor => unreachable!("bitwise kernel on floats"),
        }
    };
}

macro_rules! int_loop {
    ($kernel:expr, $a:expr, $s:expr) => {
        match $kernel {
            Kernel::Sum => $a.iter_mut().zip($s).for_each(|(a, s)| *a = a.wrapping_add(*s)),
            Kernel::Prod => $a.iter_mut().zip($s).for_each(|(a, s)| *a = a.wrapping_mul(*s)),
            Kernel::Max => $a.iter_mut().zip($s).for_each(|(a, s)| *a = (*a).max(*s)),
            Kernel::Min => $a.iter_mut().zip($s).for_each(|(a, s)| *a = (*a).min(*s)),
            Kernel::And => $a.iter_mut().zip($s).for_each(|(a, s)| *a &= *s),
            Kernel::Or => $a.iter_mut().zip($s).for_each(|(a, s)| *a |= *s),
            Kernel::Xor => $a.iter_mut().zip($s).for_each(|(a, s)| *a ^= *s),
        }
    };
}

fn combine_bytes(dtype: DType, kernel: Kernel, acc: &mut [u8], src: &[u8]) {
    match dtype {
        DType::F32 => with_typed::<f32>(acc, src, |a, s| float_loop!(kernel, a, s)),
        DType::F64 => with_typed::<f64>(acc, src, |a, s| float_loop!(kernel, a, s)),
        DType::I8 => with_typed::<i8>(acc, src, |a, s| int_loop!(kernel, a, s)),
        DType::U8 => int_loop!(kernel, acc, src),
        DType::I32 => with_typed::<i32>(acc, src, |a, s| int_loop!(kernel, a, s)),
        DType::I64 => with_typed::<i64>(acc, src, |a, s| int_loop!(kernel, a, s)),
        DType::Bool => {
            // Bools are 0/1 bytes: Sum and Max are "or", Product and Min are "and".
            let kernel = match kernel {
                Kernel::Sum | Kernel::Max => Kernel::Or,
                Kernel::Prod | Kernel::Min => Kernel::And,
                k => k,
            };
            int_loop!(kernel, acc, src)
        }
        DType::F16 => with_typed::<f16>(acc, src, |a, s| half_combine(kernel, a, s)),
        DType::Bf16 => with_typed::<bf16>(acc, src, |a, s| half_combine(kernel, a, s)),
    }
}

/// float16/bfloat16: widen a block to f32, combine, round back.
fn half_combine<H>(kernel: Kernel, acc: &mut [H], src: &[H])
where
    [H]: HalfFloatSliceExt,
{
    let mut fa = [0f32; STAGE];
    let mut fs = [0f32; STAGE];
    for (ac, sc) in acc.chunks_mut(STAGE).zip(src.chunks(STAGE)) {
        let n = ac.len();
        ac.convert_to_f32_slice(&mut fa[..n]);
        sc.convert_to_f32_slice(&mut fs[..n]);
        let (a, s) = (&mut fa[..n], &fs[..n]);
        float_loop!(kernel, a, s);
        ac.convert_from_f32_slice(&fa[..n]);
    }
}

fn half_map<H>(buf: &mut [H], f: impl Fn(f32) -> f32)
where
    [H]: HalfFloatSliceExt,
{
    let mut fb = [0f32; STAGE];
    for c in buf.chunks_mut(STAGE) {
        let n = c.len();
        c.convert_to_f32_slice(&mut fb[..n]);
        fb[..n].iter_mut().for_each(|x| *x = f(*x));
        c.convert_from_f32_slice(&fb[..n]);
    }
}

fn scale(dtype: DType, buf: &mut [u8], factor: f64) {
    match dtype {
        DType::F32 => with_typed_mut::<f32>(buf, |b| b.iter_mut().for_each(|x| *x *= factor as f32)),
        DType::F64 => with_typed_mut::<f64>(buf, |b| b.iter_mut().for_each(|x| *x *= factor)),
        DType::F16 => with_typed_mut::<f16>(buf, |b| half_map(b, |x| x * factor as f32)),
        DType::Bf16 => with_typed_mut::<bf16>(buf, |b| half_map(b, |x| x * factor as f32)),
        // PremulSum on integers is refused by ReduceOp::check.
        DType::Bool | DType::I8 | DType::U8 | DType::I32 | DType::I64 => {
            unreachable!("premul_sum on {dtype}")
        }
    }
}

fn divide(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => with_typed_mut::<f32>(buf, |b| b.iter_mut().for_each(|x| *x /= n as f32)),
        DType::F64 => with_typed_mut::<f64>(buf, |b| b.iter_mut().for_each(|x| *x /= n as f64)),
        DType::F16 => with_typed_mut::<f16>(buf, |b| half_map(b, |x| x / n as f32)),
        DType::Bf16 => with_typed_mut::<bf16>(buf, |b| half_map(b, |x| x / n as f32)),
        // World sizes fit in every integer type that can hold them; a world larger than the
        // type's range leaves the quotient 0, as the true average is below 1 in magnitude.
        DType::I8 => with_typed_mut::<i8>(buf, |b| {
            let d = i8::try_from(n).unwrap_or(i8::MAX);
            b.iter_mut().for_each(|x| *x /= d)
        }),
        DType::U8 => {
            let d = u8::try_from(n).unwrap_or(u8::MAX);
            buf.iter_mut().for_each(|x| *x /= d)
        }
        DType::I32 => with_typed_mut::<i32>(buf, |b| {
            let d = i32::try_from(n).unwrap_or(i32::MAX);
            b.iter_mut().for_each(|x| *x /= d)
        }),
        DType::I64 => with_typed_mut::<i64>(buf, |b| {
            let d = i64::try_from(n).unwrap_or(i64::MAX);
            b.iter_mut().for_each(|x| *x /= d)
        }),
        // Avg on bool is refused by ReduceOp::check.
        DType::Bool => unreachable!("avg on bool"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Element, Tensor};

    fn reduce_all<T: Element>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
        let r = Reduction::new(op, T::DTYPE).unwrap();
        let mut ts: Vec<Tensor> = inputs.iter().map(|v| Tensor::from_slice(v)).collect();
        for t in &mut ts {
            r.premultiply(t.bytes_mut()).unwrap();
        }
        let mut acc = ts[0].clone();
        for t in &ts[1..] {
            r.combine(acc.bytes_mut(), t.bytes()).unwrap();
        }
        r.finalize(acc.bytes_mut(), inputs.len()).unwrap();
        acc.to_vec().unwrap()
    }

    #[test]
    fn float_ops() {
        let xs = vec![vec![1.0f32, -2.0, 3.0], vec![4.0, 5.0, -6.0]];
        assert_eq!(reduce_all(ReduceOp::Sum, &xs), vec![5.0, 3.0, -3.0]);
        assert_eq!(reduce_all(ReduceOp::Avg, &xs), vec![2.5, 1.5, -1.5]);
        assert_eq!(reduce_all(ReduceOp::Product, &xs), vec![4.0, -10.0, -18.0]);
        assert_eq!(reduce_all(ReduceOp::Min, &xs), vec![1.0, -2.0, -6.0]);
        assert_eq!(reduce_all(ReduceOp::Max, &xs), vec![4.0, 5.0, 3.0]);
        assert_eq!(reduce_all(ReduceOp::PremulSum(0.5), &xs), vec![2.5, 1.5, -1.5]);
    }

    #[test]
    fn float_min_max_propagate_nan() {
        let xs = vec![vec![f64::NAN, 1.0], vec![0.0, f64::NAN]];
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let r = reduce_all(op, &xs);
            assert!(r[0].is_nan() && r[1].is_nan(), "{op}: {r:?}");
        }
    }

    #[test]
    fn integer_ops_wrap_and_truncate() {
        let xs = vec![vec![i8::MAX, 7, 0b1100], vec![1, -2, 0b1010]];
        assert_eq!(reduce_all(ReduceOp::Sum, &xs), vec![i8::MIN, 5, 22]);
        assert_eq!(reduce_all(ReduceOp::BAnd, &xs), vec![1, 7 & -2, 0b1000]);
        assert_eq!(reduce_all(ReduceOp::BOr, &xs), vec![i8::MAX, 7 | -2, 0b1110]);
        assert_eq!(reduce_all(ReduceOp::BXor, &xs), vec![i8::MAX ^ 1, 7 ^ -2, 0b0110]);
        let ys = vec![vec![7i64, -7], vec![0, 0]];
        assert_eq!(reduce_all(ReduceOp::Avg, &ys), vec![3, -3]);
        let us = vec![vec![200u8, 3], vec![100, 2]];
        assert_eq!(reduce_all(ReduceOp::Sum, &us), vec![44, 5]);
        assert_eq!(reduce_all(ReduceOp::Avg, &us), vec![22, 2]);
    }

    #[test]
    fn bool_ops_are_logical() {
        let r = Reduction::new(ReduceOp::Sum, DType::Bool).unwrap();
        let mut a = Tensor::from_bools(&[true, false, false]);
        r.combine(a.bytes_mut(), Tensor::from_bools(&[false, false, true]).bytes()).unwrap();
        assert_eq!(a.to_bools().unwrap(), vec![true, false, true]);
        let r = Reduction::new(ReduceOp::Min, DType::Bool).unwrap();
        r.combine(a.bytes_mut(), Tensor::from_bools(&[true, true, false]).bytes()).unwrap();
        assert_eq!(a.to_bools().unwrap(), vec![true, false, false]);
    }

    #[test]
    fn half_types_compute_in_f32() {
        let xs = vec![vec![f16::from_f32(1.5), f16::from_f32(-2.0)], vec![f16::from_f32(2.5), f16::from_f32(8.0)]];
        assert_eq!(reduce_all(ReduceOp::Avg, &xs), vec![f16::from_f32(2.0), f16::from_f32(3.0)]);
        let ys = vec![vec![bf16::from_f32(3.0)], vec![bf16::from_f32(-4.0)]];
        assert_eq!(reduce_all(ReduceOp::Product, &ys), vec![bf16::from_f32(-12.0)]);
        assert_eq!(reduce_all(ReduceOp::PremulSum(2.0), &ys), vec![bf16::from_f32(-2.0)]);
    }

    #[test]
    fn refuses_what_torch_refuses() {
        for d in [DType::F16, DType::Bf16, DType::F32, DType::F64] {
            for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
                assert_eq!(Reduction::new(op, d), Err(ReduceError::Unsupported { op, dtype: d }));
            }
        }
        let err = Reduction::new(ReduceOp::Avg, DType::Bool).unwrap_err();
        assert_eq!(err.to_string(), "reduce op avg is not supported for dtype bool");
        assert!(Reduction::new(ReduceOp::PremulSum(2.0), DType::I32).is_err());
    }

    #[test]
    fn length_errors_are_reported_not_panicked() {
        let r = Reduction::new(ReduceOp::Sum, DType::F32).unwrap();
        assert_eq!(r.combine(&mut [0u8; 8], &[0u8; 4]), Err(ReduceError::LengthMismatch { acc: 8, src: 4 }));
        assert_eq!(r.combine(&mut [0u8; 6], &[0u8; 6]), Err(ReduceError::RaggedBytes { len: 6, dtype: DType::F32 }));
    }

    #[test]
    fn unaligned_operands_give_the_same_answer() {
        // Small messages stage through small buffers, larger ones through several rounds.
        for n in [0usize, 1, 63, 64, 65, 1500, 3000] {
            let a: Vec<f64> = (0..n).map(|i| i as f64 * 0.25).collect();
            let b: Vec<f64> = (0..n).map(|i| 1.0 - i as f64).collect();
            let expect: Vec<f64> = a.iter().zip(&b).map(|(x, y)| 2.0 * (x + y)).collect();
            let mut abuf = vec![0u8; n * 8 + 1];
            let mut bbuf = vec![0u8; n * 8 + 3];
            abuf[1..].copy_from_slice(bytemuck::cast_slice(&a));
            bbuf[3..].copy_from_slice(bytemuck::cast_slice(&b));
            let r = Reduction::new(ReduceOp::Sum, DType::F64).unwrap();
            r.combine(&mut abuf[1..], &bbuf[3..]).unwrap();
            Reduction::new(ReduceOp::PremulSum(2.0), DType::F64).unwrap().premultiply(&mut abuf[1..]).unwrap();
            let got: Vec<f64> = abuf[1..].chunks(8).map(|c| f64::from_ne_bytes(c.try_into().unwrap())).collect();
            assert_eq!(got, expect, "{n} elements");
        }
    }

    /// A one-element combine (its own short path) gives what the same element gives inside a
    /// longer buffer (the general one), for every dtype, every op it takes, and operands at
    /// every alignment.
    #[test]
    fn one_element_combines_as_it_does_among_others() {
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Product,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::BAnd,
            ReduceOp::BOr,
            ReduceOp::BXor,
            ReduceOp::PremulSum(0.5),
        ];
        for dtype in DType::ALL {
            let size = dtype.size();
            // Bytes that read as ordinary values of every dtype (no NaN: it would not equal
            // itself).
            let value = |seed: u8| -> Vec<u8> {
                let x = f64::from(seed) * 0.75 - 3.0;
                match dtype {
                    DType::F32 => (x as f32).to_ne_bytes().to_vec(),
                    DType::F64 => x.to_ne_bytes().to_vec(),
                    DType::F16 => f16::from_f64(x).to_ne_bytes().to_vec(),
                    DType::Bf16 => bf16::from_f64(x).to_ne_bytes().to_vec(),
                    DType::Bool => vec![seed % 2],
                    _ => (0..size).map(|i| seed.wrapping_mul(37).wrapping_add(i as u8 * 11)).collect(),
                }
            };
            for op in ops {
                let Ok(r) = Reduction::new(op, dtype) else { continue };
                for (seed_a, seed_b) in [(1u8, 2u8), (7, 3), (4, 4), (0, 9)] {
                    let (a, b) = (value(seed_a), value(seed_b));
                    // The general path: the element between two others.
                    let mut long_a = [value(5), a.clone(), value(6)].concat();
                    let long_b = [value(8), b.clone(), value(2)].concat();
                    r.combine(&mut long_a, &long_b).unwrap();
                    let expect = &long_a[size..2 * size];
                    for (off_a, off_b) in [(0, 0), (1, 3), (3, 1)] {
                        let mut one_a = vec![0u8; off_a + size];
                        let mut one_b = vec![0u8; off_b + size];
                        one_a[off_a..].copy_from_slice(&a);
                        one_b[off_b..].copy_from_slice(&b);
                        r.combine(&mut one_a[off_a..], &one_b[off_b..]).unwrap();
                        assert_eq!(&one_a[off_a..], expect, "{dtype} {op}, offsets {off_a} and {off_b}");
                    }
                }
            }
        }
    }

    #[test]
    fn op_names_round_trip() {
        for op in [
            ReduceOp::Avg,
            ReduceOp::BAnd,
            ReduceOp::BOr,
            ReduceOp::BXor,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::PremulSum(1.0),
            ReduceOp::Product,
            ReduceOp::Sum,
        ] {
            assert_eq!(ReduceOp::parse(op.name()), Some(op));
        }
    }
}
