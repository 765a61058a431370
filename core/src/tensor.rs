//! Tensors: a dtype, a shape and contiguous storage.
//!
//! Storage is host memory today (8-byte aligned, so every typed view is sound); the NCCL
//! backend adds a device variant. Tensors are always contiguous and row-major: collectives
//! move flat bytes, and the shape only travels with the result.

use std::fmt;
use std::str::FromStr;

use bytemuck::Pod;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// Element type of a tensor. Names follow torch (`float32`, `bfloat16`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// bool, stored as one byte holding 0 or 1.
    Bool,
    /// float16.
    F16,
    /// float32.
    F32,
    /// float64.
    F64,
    /// int8.
    I8,
    /// int32.
    I32,
    /// int64.
    I64,
    /// uint8.
    U8,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 9] =
        [DType::Bf16, DType::Bool, DType::F16, DType::F32, DType::F64, DType::I8, DType::I32, DType::I64, DType::U8];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_floating_point(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16 | DType::F32 | DType::F64)
    }

    /// torch's name: `float32`, `bfloat16`, `int64`, `bool`…
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bfloat16",
            DType::Bool => "bool",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }

    /// c10's `ScalarType` name, as PyTorch's flight recorder writes it (`Float`, `BFloat16`…).
    pub const fn scalar_type_name(self) -> &'static str {
        match self {
            DType::Bf16 => "BFloat16",
            DType::Bool => "Bool",
            DType::F16 => "Half",
            DType::F32 => "Float",
            DType::F64 => "Double",
            DType::I8 => "Char",
            DType::I32 => "Int",
            DType::I64 => "Long",
            DType::U8 => "Byte",
        }
    }

    /// Parse either torch's name (`float32`, also `float`, `half`, `long`…) or c10's
    /// `ScalarType` name (`Float`, `BFloat16`…).
    pub fn parse(s: &str) -> Option<DType> {
        let d = match s {
            "bfloat16" | "bf16" | "BFloat16" => DType::Bf16,
            "bool" | "Bool" => DType::Bool,
            "float16" | "half" | "f16" | "Half" => DType::F16,
            "float32" | "float" | "f32" | "Float" => DType::F32,
            "float64" | "double" | "f64" | "Double" => DType::F64,
            "int8" | "i8" | "Char" => DType::I8,
            "int32" | "int" | "i32" | "Int" => DType::I32,
            "int64" | "long" | "i64" | "Long" => DType::I64,
            "uint8" | "u8" | "Byte" => DType::U8,
            _ => return None,
        };
        Some(d)
    }

    /// One-byte code used on the wire.
    pub const fn code(self) -> u8 {
        match self {
            DType::Bf16 => 0,
            DType::Bool => 1,
            DType::F16 => 2,
            DType::F32 => 3,
            DType::F64 => 4,
            DType::I8 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::U8 => 8,
        }
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = TensorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::parse(s).ok_or_else(|| TensorError::UnknownDType(s.to_owned()))
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A Rust type that is the element of some [`DType`], so a tensor can be viewed as `&[T]`.
pub trait Element: Pod + Send + Sync + fmt::Debug {
    /// The dtype whose elements are `Self`.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f32 => F32, f64 => F64, f16 => F16, bf16 => Bf16, i8 => I8, u8 => U8, i32 => I32, i64 => I64);

/// Errors from building, viewing or reshaping tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// A typed view asked for the wrong element type.
    #[error("tensor has dtype {actual}, not {requested}")]
    DTypeMismatch {
        /// The tensor's dtype.
        actual: DType,
        /// The dtype asked for.
        requested: DType,
    },
    /// The bytes or elements given do not fill the shape.
    #[error("shape {shape:?} holds {expected} elements but {actual} were given")]
    ShapeMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// A byte length that is not a whole number of elements.
    #[error("{len} bytes is not a whole number of {dtype} elements")]
    RaggedBytes {
        /// Length in bytes.
        len: usize,
        /// The dtype.
        dtype: DType,
    },
    /// A shape whose element count overflows.
    #[error("shape {0:?} has more elements than fit in memory")]
    TooLarge(Vec<usize>),
    /// Coalescing tensors of different dtypes.
    #[error("cannot flatten tensors of different dtypes: tensor {index} is {found}, tensor 0 is {expected}")]
    MixedDTypes {
        /// Index of the first tensor that differs.
        index: usize,
        /// dtype of tensor 0.
        expected: DType,
        /// dtype found.
        found: DType,
    },
    /// A bool tensor holding a byte other than 0 or 1.
    #[error("bool tensor holds byte {byte} at element {index}; only 0 and 1 are bools")]
    NotABool {
        /// Element index.
        index: usize,
        /// The byte found.
        byte: u8,
    },
    /// A dtype name nobody knows.
    #[error("unknown dtype {0:?}")]
    UnknownDType(String),
}

/// Host bytes, 8-byte aligned so every [`Element`] view is sound: bytes cohort owns, or memory
/// it borrows from its caller ([`HostBuffer::borrowed`]) so a collective runs in place in, say,
/// a PyTorch tensor. A clone always owns its bytes: two buffers never share memory.
#[derive(Default)]
pub struct HostBuffer {
    repr: Repr,
}

enum Repr {
    Owned { words: Vec<u64>, len: usize },
    Borrowed(Borrowed),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Owned { words: Vec::new(), len: 0 }
    }
}

/// Someone else's memory, kept alive by `_owner` (dropped with the buffer).
struct Borrowed {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: `HostBuffer::borrowed`'s caller promised that the bytes stay valid while `_owner`
// lives and that nothing but this buffer touches them meanwhile, so the buffer may move to and
// be shared with other threads as an owned one can (`&self` only reads).
unsafe impl Send for Borrowed {}
// SAFETY: as above.
unsafe impl Sync for Borrowed {}

impl HostBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        HostBuffer { repr: Repr::Owned { words: vec![0; len.div_ceil(8)], len } }
    }

    /// A copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut b = HostBuffer::zeroed(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }

    /// The `len` bytes at `ptr`, used in place: reads and writes of the buffer are reads and
    /// writes of that memory. `owner` is dropped with the buffer (it is what keeps the memory
    /// alive, for example a reference to the tensor that holds it). `None` when `ptr` is not
    /// 8-byte aligned (typed views need it): copy the bytes instead. Empty memory gives an
    /// owned empty buffer.
    ///
    /// # Safety
    ///
    /// While `owner` lives, `ptr` must be valid for reads and writes of `len` bytes, and while
    /// the buffer lives nothing else may read or write them (no other buffer over the same
    /// bytes either).
    pub unsafe fn borrowed(ptr: *mut u8, len: usize, owner: Box<dyn Send + Sync>) -> Option<Self> {
        if len == 0 {
            return Some(HostBuffer::default());
        }
        if !(ptr as usize).is_multiple_of(8) {
            return None;
        }
        let ptr = std::ptr::NonNull::new(ptr)?;
        Some(HostBuffer { repr: Repr::Borrowed(Borrowed { ptr, len, _owner: owner }) })
    }

    /// Whether the buffer is borrowed memory ([`HostBuffer::borrowed`]), which must not be
    /// reused for anything else.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.repr, Repr::Borrowed(_))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Owned { len, .. } => *len,
            Repr::Borrowed(b) => b.len,
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.repr {
            Repr::Owned { words, len } => &bytemuck::cast_slice(words)[..*len],
            // SAFETY: valid for `len` bytes and touched by nobody else while the buffer lives
            // (`borrowed`'s contract); the slice borrows `self`.
            Repr::Borrowed(b) => unsafe { std::slice::from_raw_parts(b.ptr.as_ptr(), b.len) },
        }
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.repr {
            Repr::Owned { words, len } => &mut bytemuck::cast_slice_mut(words)[..*len],
            // SAFETY: as in `as_bytes`, and the slice borrows `self` mutably, so it is the only
            // reference to those bytes.
            Repr::Borrowed(b) => unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr(), b.len) },
        }
    }
}

impl Clone for HostBuffer {
    /// An owned copy, also of a borrowed buffer.
    fn clone(&self) -> Self {
        match &self.repr {
            Repr::Owned { words, len } => HostBuffer { repr: Repr::Owned { words: words.clone(), len: *len } },
            Repr::Borrowed(_) => HostBuffer::from_bytes(self.as_bytes()),
        }
    }
}

impl PartialEq for HostBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for HostBuffer {}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_borrowed() { ", borrowed" } else { "" };
        write!(f, "HostBuffer({} bytes{kind})", self.len())
    }
}

/// A tensor's storage.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Storage {
    /// Host memory.
    Host(HostBuffer),
}

/// A contiguous, row-major tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
}

/// Where one tensor sits inside a flat, coalesced buffer (see [`Tensor::flatten`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatSlot {
    /// Offset in elements.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
    /// The tensor's shape.
    pub shape: Vec<usize>,
}

/// Number of elements a shape holds, or `None` on overflow.
pub fn numel_of(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor, TensorError> {
        let n = numel_of(shape).ok_or_else(|| TensorError::TooLarge(shape.to_vec()))?;
        let bytes = n.checked_mul(dtype.size()).ok_or_else(|| TensorError::TooLarge(shape.to_vec()))?;
        Ok(Tensor { dtype, shape: shape.to_vec(), storage: Storage::Host(HostBuffer::zeroed(bytes)) })
    }

    /// A one-dimensional tensor holding `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Tensor {
        Tensor::from_bytes_unchecked(T::DTYPE, vec![values.len()], bytemuck::cast_slice(values))
    }

    /// A tensor of `shape` holding `values`.
    pub fn from_slice_shaped<T: Element>(values: &[T], shape: &[usize]) -> Result<Tensor, TensorError> {
        Tensor::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(values))
    }

    /// A one-dimensional bool tensor.
    pub fn from_bools(values: &[bool]) -> Tensor {
        let bytes: Vec<u8> = values.iter().map(|&b| u8::from(b)).collect();
        Tensor::from_bytes_unchecked(DType::Bool, vec![values.len()], &bytes)
    }

    /// A tensor of `shape` holding a copy of `bytes` (native endianness).
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor, TensorError> {
        let expected = numel_of(shape).ok_or_else(|| TensorError::TooLarge(shape.to_vec()))?;
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(TensorError::RaggedBytes { len: bytes.len(), dtype });
        }
        let actual = bytes.len() / dtype.size();
        if actual != expected {
            return Err(TensorError::ShapeMismatch { shape: shape.to_vec(), expected, actual });
        }
        if dtype == DType::Bool {
            check_bools(bytes)?;
        }
        Ok(Tensor::from_bytes_unchecked(dtype, shape.to_vec(), bytes))
    }

    /// A tensor of `shape` over `buffer`, without copying it; checked as [`Tensor::from_bytes`].
    pub fn from_host_buffer(dtype: DType, shape: &[usize], buffer: HostBuffer) -> Result<Tensor, TensorError> {
        Tensor::from_parts(dtype, shape.to_vec(), buffer)
    }

    /// [`Tensor::from_host_buffer`] taking the shape by value, checked the same way: with
    /// [`Tensor::into_parts`], a tensor taken apart and put back together allocates nothing.
    pub fn from_parts(dtype: DType, shape: Vec<usize>, buffer: HostBuffer) -> Result<Tensor, TensorError> {
        let Some(expected) = numel_of(&shape) else { return Err(TensorError::TooLarge(shape)) };
        let len = buffer.len();
        if !len.is_multiple_of(dtype.size()) {
            return Err(TensorError::RaggedBytes { len, dtype });
        }
        if len / dtype.size() != expected {
            return Err(TensorError::ShapeMismatch { shape, expected, actual: len / dtype.size() });
        }
        if dtype == DType::Bool {
            check_bools(buffer.as_bytes())?;
        }
        Ok(Tensor { dtype, shape, storage: Storage::Host(buffer) })
    }

    /// The tensor's dtype, shape and host buffer, without copying any of them.
    pub fn into_parts(self) -> (DType, Vec<usize>, HostBuffer) {
        let Tensor { dtype, shape, storage } = self;
        match storage {
            Storage::Host(b) => (dtype, shape, b),
        }
    }

    /// The tensor's host buffer, without copying it (the shape and dtype are dropped).
    pub fn into_host_buffer(self) -> HostBuffer {
        self.into_parts().2
    }

    fn from_bytes_unchecked(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Tensor {
        Tensor { dtype, shape, storage: Storage::Host(HostBuffer::from_bytes(bytes)) }
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Where the tensor lives.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Host(_) => Device::Cpu,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.nbytes() / self.dtype.size()
    }

    /// Size of one element in bytes.
    pub fn element_size(&self) -> usize {
        self.dtype.size()
    }

    /// Size of the data in bytes.
    pub fn nbytes(&self) -> usize {
        match &self.storage {
            Storage::Host(b) => b.len(),
        }
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The raw bytes (native endianness).
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Host(b) => b.as_bytes(),
        }
    }

    /// The raw bytes, mutably. Writing anything but 0 or 1 into a bool tensor is the caller's
    /// error; [`Tensor::to_bools`] reports it.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Host(b) => b.as_bytes_mut(),
        }
    }

    /// A typed view.
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        self.check_dtype(T::DTYPE)?;
        Ok(bytemuck::cast_slice(self.bytes()))
    }

    /// A typed view, mutably.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], TensorError> {
        self.check_dtype(T::DTYPE)?;
        Ok(bytemuck::cast_slice_mut(self.bytes_mut()))
    }

    /// A copy of the elements as `Vec<T>`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        self.as_slice::<T>().map(<[T]>::to_vec)
    }

    /// The elements of a bool tensor.
    pub fn to_bools(&self) -> Result<Vec<bool>, TensorError> {
        self.check_dtype(DType::Bool)?;
        check_bools(self.bytes())?;
        Ok(self.bytes().iter().map(|&b| b == 1).collect())
    }

    /// The same data under another shape with the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor, TensorError> {
        let expected = numel_of(shape).ok_or_else(|| TensorError::TooLarge(shape.to_vec()))?;
        if expected != self.numel() {
            return Err(TensorError::ShapeMismatch { shape: shape.to_vec(), expected, actual: self.numel() });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// Copy tensors of one dtype into one flat 1-d tensor (what c10d's coalesced ops and DDP's
    /// buckets do), and say where each one went.
    pub fn flatten(tensors: &[Tensor]) -> Result<(Tensor, Vec<FlatSlot>), TensorError> {
        let Some(first) = tensors.first() else {
            return Ok((Tensor::from_slice::<f32>(&[]), Vec::new()));
        };
        let dtype = first.dtype;
        let mut slots = Vec::with_capacity(tensors.len());
        let mut total = 0usize;
        for (index, t) in tensors.iter().enumerate() {
            if t.dtype != dtype {
                return Err(TensorError::MixedDTypes { index, expected: dtype, found: t.dtype });
            }
            slots.push(FlatSlot { offset: total, numel: t.numel(), shape: t.shape.clone() });
            total += t.numel();
        }
        let mut flat = Tensor::zeros(dtype, &[total])?;
        let es = dtype.size();
        for (t, slot) in tensors.iter().zip(&slots) {
            flat.bytes_mut()[slot.offset * es..(slot.offset + slot.numel) * es].copy_from_slice(t.bytes());
        }
        Ok((flat, slots))
    }

    /// Split a flat tensor back into the tensors [`Tensor::flatten`] described.
    pub fn unflatten(&self, slots: &[FlatSlot]) -> Result<Vec<Tensor>, TensorError> {
        let es = self.dtype.size();
        slots
            .iter()
            .map(|slot| {
                let end = slot.offset.checked_add(slot.numel).filter(|&e| e <= self.numel());
                let Some(end) = end else {
                    return Err(TensorError::ShapeMismatch {
                        shape: self.shape.clone(),
                        expected: slot.offset.saturating_add(slot.numel),
                        actual: self.numel(),
                    });
                };
                Tensor::from_bytes(self.dtype, &slot.shape, &self.bytes()[slot.offset * es..end * es])
            })
            .collect()
    }

    /// A 1-d tensor of `dtype` holding `values`, each converted as `as` would (floats round,
    /// integers truncate and saturate, bools are `v != 0`). For tests, benchmarks and checks
    /// that compute references in f64.
    pub fn from_f64s(dtype: DType, values: &[f64]) -> Tensor {
        match dtype {
            DType::F32 => Tensor::from_slice(&values.iter().map(|&v| v as f32).collect::<Vec<_>>()),
            DType::F64 => Tensor::from_slice(values),
            DType::F16 => Tensor::from_slice(&values.iter().map(|&v| f16::from_f64(v)).collect::<Vec<_>>()),
            DType::Bf16 => Tensor::from_slice(&values.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<_>>()),
            DType::I8 => Tensor::from_slice(&values.iter().map(|&v| v as i8).collect::<Vec<_>>()),
            DType::U8 => Tensor::from_slice(&values.iter().map(|&v| v as u8).collect::<Vec<_>>()),
            DType::I32 => Tensor::from_slice(&values.iter().map(|&v| v as i32).collect::<Vec<_>>()),
            DType::I64 => Tensor::from_slice(&values.iter().map(|&v| v as i64).collect::<Vec<_>>()),
            DType::Bool => Tensor::from_bools(&values.iter().map(|&v| v != 0.0).collect::<Vec<_>>()),
        }
    }

    /// The elements as f64 (exact for every dtype but i64 beyond 2^53); bools are 0 or 1.
    pub fn to_f64s(&self) -> Vec<f64> {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f64::from(f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))).collect(),
            DType::F64 => b.chunks_exact(8).map(|c| f64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect(),
            DType::F16 => b.chunks_exact(2).map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
            DType::Bf16 => b.chunks_exact(2).map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
            DType::I8 => b.iter().map(|&v| f64::from(v as i8)).collect(),
            DType::U8 => b.iter().map(|&v| f64::from(v)).collect(),
            DType::I32 => b.chunks_exact(4).map(|c| f64::from(i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))).collect(),
            DType::I64 => {
                b.chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes")) as f64).collect()
            }
            DType::Bool => b.iter().map(|&v| f64::from(u8::from(v != 0))).collect(),
        }
    }

    fn check_dtype(&self, requested: DType) -> Result<(), TensorError> {
        if self.dtype == requested { Ok(()) } else { Err(TensorError::DTypeMismatch { actual: self.dtype, requested }) }
    }
}

fn check_bools(bytes: &[u8]) -> Result<(), TensorError> {
    match bytes.iter().position(|&b| b > 1) {
        Some(index) => Err(TensorError::NotABool { index, byte: bytes[index] }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn host_buffers_move_in_and_out_of_tensors_checked() {
        let t = Tensor::from_slice_shaped(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let buf = t.clone().into_host_buffer();
        assert_eq!(buf.len(), 16);
        let back = Tensor::from_host_buffer(DType::F32, &[2, 2], buf.clone()).unwrap();
        assert_eq!(back, t);
        let err = Tensor::from_host_buffer(DType::F32, &[3], buf.clone()).unwrap_err();
        assert!(matches!(err, TensorError::ShapeMismatch { expected: 3, actual: 4, .. }), "{err}");
        let twelve = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).into_host_buffer();
        assert!(matches!(Tensor::from_host_buffer(DType::F64, &[1], twelve), Err(TensorError::RaggedBytes { .. })));
        let bad_bools = Tensor::from_slice(&[0u8, 2]).into_host_buffer();
        assert!(matches!(Tensor::from_host_buffer(DType::Bool, &[2], bad_bools), Err(TensorError::NotABool { .. })));
    }

    #[test]
    fn a_tensor_taken_apart_goes_back_together_checked() {
        let t = Tensor::from_slice_shaped(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).unwrap();
        let (dtype, shape, buf) = t.clone().into_parts();
        assert_eq!((dtype, shape.as_slice(), buf.len()), (DType::F32, &[3, 2][..], 24));
        assert_eq!(Tensor::from_parts(dtype, shape, buf.clone()).unwrap(), t);
        let err = Tensor::from_parts(DType::F32, vec![5], buf.clone()).unwrap_err();
        assert!(matches!(err, TensorError::ShapeMismatch { expected: 5, actual: 6, .. }), "{err}");
        let err = Tensor::from_parts(DType::F32, vec![usize::MAX, 2], buf).unwrap_err();
        assert!(matches!(err, TensorError::TooLarge(_)), "{err}");
        let bad_bools = Tensor::from_slice(&[1u8, 7]).into_host_buffer();
        assert!(matches!(Tensor::from_parts(DType::Bool, vec![2], bad_bools), Err(TensorError::NotABool { .. })));
    }

    #[test]
    fn a_borrowed_buffer_works_in_place_and_its_clone_owns_its_bytes() {
        // u64s, so the memory is 8-byte aligned as a torch tensor's storage is.
        let mut memory: Vec<u64> = bytemuck::cast_slice(&[1.0f32, 2.0, 3.0, 4.0]).to_vec();
        let ptr = memory.as_mut_ptr().cast::<u8>();
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Owner(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        // SAFETY: `memory` outlives the buffer and is not touched while the buffer lives.
        let buf = unsafe { HostBuffer::borrowed(ptr, 16, Box::new(Owner(dropped.clone()))) }.unwrap();
        assert!(buf.is_borrowed());
        let mut t = Tensor::from_host_buffer(DType::F32, &[4], buf).unwrap();
        t.as_mut_slice::<f32>().unwrap()[2] = 30.0;
        let copy = t.clone();
        t.as_mut_slice::<f32>().unwrap()[0] = 10.0;
        assert_eq!(copy.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 30.0, 4.0], "a clone is a copy");
        assert!(!copy.clone().into_host_buffer().is_borrowed());
        assert_eq!(
            t.storage(),
            &Storage::Host(HostBuffer::from_bytes(bytemuck::cast_slice(&[10.0f32, 2.0, 30.0, 4.0])))
        );
        assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
        drop(t);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "the owner goes with the buffer");
        assert_eq!(bytemuck::cast_slice::<u64, f32>(&memory), &[10.0, 2.0, 30.0, 4.0], "writes landed in the memory");
        // Misaligned memory is refused (typed views need 8 bytes), empty memory is owned.
        // SAFETY: refused before any use.
        assert!(unsafe { HostBuffer::borrowed(ptr.wrapping_add(4), 8, Box::new(())) }.is_none());
        // SAFETY: no bytes.
        let empty = unsafe { HostBuffer::borrowed(std::ptr::null_mut(), 0, Box::new(())) }.unwrap();
        assert!(empty.is_empty() && !empty.is_borrowed());
    }

    #[test]
    fn f64_round_trip_in_every_dtype() {
        let v = [0.0, 1.0, 2.0, 7.0, 100.0];
        for d in [DType::F32, DType::F64, DType::F16, DType::Bf16, DType::I8, DType::U8, DType::I32, DType::I64] {
            let t = Tensor::from_f64s(d, &v);
            assert_eq!(t.dtype(), d);
            assert_eq!(t.to_f64s(), v, "{d}");
        }
        assert_eq!(Tensor::from_f64s(DType::Bool, &[0.0, 3.0]).to_f64s(), vec![0.0, 1.0]);
        assert_eq!(Tensor::from_f64s(DType::I8, &[-3.0]).to_f64s(), vec![-3.0]);
    }

    use super::*;

    #[test]
    fn dtype_codes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(DType::parse(d.scalar_type_name()), Some(d));
        }
        assert_eq!(DType::from_code(9), None);
        assert!(matches!("complex64".parse::<DType>(), Err(TensorError::UnknownDType(_))));
    }

    #[test]
    fn typed_views_check_the_dtype() {
        let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        assert_eq!(t.numel(), 3);
        assert_eq!(t.nbytes(), 12);
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0]);
        t.as_mut_slice::<f32>().unwrap()[1] = 5.0;
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 5.0, 3.0]);
        assert_eq!(t.as_slice::<i32>(), Err(TensorError::DTypeMismatch { actual: DType::F32, requested: DType::I32 }));
    }

    #[test]
    fn f64_and_i64_views_are_aligned_after_any_construction() {
        let t = Tensor::from_bytes(DType::F64, &[2], &[0u8; 16]).unwrap();
        assert_eq!(t.as_slice::<f64>().unwrap(), &[0.0, 0.0]);
        let t = Tensor::zeros(DType::I64, &[3, 5]).unwrap();
        assert_eq!(t.as_slice::<i64>().unwrap().len(), 15);
    }

    #[test]
    fn from_bytes_refuses_wrong_lengths_and_bad_bools() {
        assert!(matches!(
            Tensor::from_bytes(DType::F32, &[2], &[0u8; 7]),
            Err(TensorError::RaggedBytes { len: 7, .. })
        ));
        assert!(matches!(
            Tensor::from_bytes(DType::F32, &[3], &[0u8; 8]),
            Err(TensorError::ShapeMismatch { expected: 3, actual: 2, .. })
        ));
        assert_eq!(Tensor::from_bytes(DType::Bool, &[2], &[1, 7]), Err(TensorError::NotABool { index: 1, byte: 7 }));
        assert!(matches!(Tensor::zeros(DType::F32, &[usize::MAX, 2]), Err(TensorError::TooLarge(_))));
    }

    #[test]
    fn bools_round_trip() {
        let t = Tensor::from_bools(&[true, false, true]);
        assert_eq!(t.dtype(), DType::Bool);
        assert_eq!(t.to_bools().unwrap(), vec![true, false, true]);
    }

    #[test]
    fn flatten_then_unflatten_is_identity() {
        let a = Tensor::from_slice_shaped(&[1i32, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
        let b = Tensor::from_slice(&[7i32]);
        let c = Tensor::zeros(DType::I32, &[0]).unwrap();
        let (flat, slots) = Tensor::flatten(&[a.clone(), b.clone(), c.clone()]).unwrap();
        assert_eq!(flat.to_vec::<i32>().unwrap(), vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(flat.unflatten(&slots).unwrap(), vec![a, b, c]);
    }

    #[test]
    fn flatten_refuses_mixed_dtypes() {
        let err = Tensor::flatten(&[Tensor::from_slice(&[1.0f32]), Tensor::from_slice(&[1.0f64])]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot flatten tensors of different dtypes: tensor 1 is float64, tensor 0 is float32"
        );
    }

    #[test]
    fn reshape_keeps_the_element_count() {
        let t = Tensor::from_slice(&[1u8, 2, 3, 4]).reshape(&[2, 2]).unwrap();
        assert_eq!(t.shape(), &[2, 2]);
        assert!(t.reshape(&[3]).is_err());
    }
}
