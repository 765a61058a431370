//! The device seam: everything the NCCL process group asks of CUDA and NCCL, as two traits.
//!
//! [`Device`] is the CUDA side: streams, events, device buffers and host↔device copies.
//! [`Communicator`] is the NCCL side: enqueue a collective or point-to-point op with NCCL's own
//! dtype and op codes, group start/end, the asynchronous error, abort, split, shrink, finalize.
//!
//! Nothing here depends on cudarc. Two implementations exist: the host emulation
//! ([`super::emu`], always built, what the tests run) and CUDA itself (`super::cuda`, feature
//! `nccl`). The process group ([`super::NcclProcessGroup`]) is written against these traits
//! only, so every line of its lifecycle runs in `cargo test` on a machine without a GPU.
//!
//! # Rules every implementation follows (CUDA's and NCCL's documented behaviour)
//!
//! - A stream runs its operations asynchronously to the host and in the order they were
//!   enqueued.
//! - [`Device::query`] on an event that was never recorded reports it complete
//!   (`cudaEventQuery` returns `cudaSuccess`). Recording again makes it pending until the
//!   stream reaches the new record. A device error is an `Err`, never "not ready".
//! - [`Device::stream_wait`] waits for the event's latest record at the time of the call;
//!   records made later do not matter; waiting on a never-recorded event does nothing
//!   (`cudaStreamWaitEvent`).
//! - [`Device::elapsed`] needs two completed events made with timing; otherwise it is an error
//!   (`cudaEventElapsedTime`).
//! - Copies are ordered on a stream. [`Device::copy_to_device`] takes the host bytes before it
//!   returns; [`Device::copy_to_host`] fills the host buffer by the time an event recorded after
//!   it completes (an implementation may finish it before returning).
//! - [`Communicator::abort`] may be called from any thread, also while another thread is
//!   blocked in a call on the same communicator (`ncclCommAbort`). Afterwards the
//!   communicator refuses every call.
//! - A non-blocking communicator's [`Communicator::async_error`] reports
//!   [`NcclResult::InProgress`] until its init (or a call) has finished.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::DType;

use crate::store::StoreError;

/// NCCL's `ncclDataType_t`, with NCCL's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum NcclDataType {
    /// `ncclInt8`.
    Int8 = 0,
    /// `ncclUint8`.
    Uint8 = 1,
    /// `ncclInt32`.
    Int32 = 2,
    /// `ncclUint32`.
    Uint32 = 3,
    /// `ncclInt64`.
    Int64 = 4,
    /// `ncclUint64`.
    Uint64 = 5,
    /// `ncclFloat16`.
    Float16 = 6,
    /// `ncclFloat32`.
    Float32 = 7,
    /// `ncclFloat64`.
    Float64 = 8,
    /// `ncclBfloat16`.
    Bfloat16 = 9,
}

impl NcclDataType {
    /// NCCL's code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The type with NCCL's code `code`, if NCCL has one.
    pub fn from_code(code: i32) -> Option<NcclDataType> {
        use NcclDataType::*;
        [Int8, Uint8, Int32, Uint32, Int64, Uint64, Float16, Float32, Float64, Bfloat16]
            .into_iter()
            .find(|t| t.code() == code)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            NcclDataType::Int8 | NcclDataType::Uint8 => 1,
            NcclDataType::Float16 | NcclDataType::Bfloat16 => 2,
            NcclDataType::Int32 | NcclDataType::Uint32 | NcclDataType::Float32 => 4,
            NcclDataType::Int64 | NcclDataType::Uint64 | NcclDataType::Float64 => 8,
        }
    }

    /// The cohort dtype with the same bits, when cohort has one (not for the unsigned 32 and 64
    /// bit types).
    pub fn to_dtype(self) -> Option<DType> {
        Some(match self {
            NcclDataType::Int8 => DType::I8,
            NcclDataType::Uint8 => DType::U8,
            NcclDataType::Int32 => DType::I32,
            NcclDataType::Int64 => DType::I64,
            NcclDataType::Float16 => DType::F16,
            NcclDataType::Float32 => DType::F32,
            NcclDataType::Float64 => DType::F64,
            NcclDataType::Bfloat16 => DType::Bf16,
            NcclDataType::Uint32 | NcclDataType::Uint64 => return None,
        })
    }
}

/// NCCL's built-in `ncclRedOp_t`, with NCCL's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum NcclRedOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclProd`.
    Prod = 1,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
    /// `ncclAvg` (NCCL ≥ 2.10).
    Avg = 4,
}

impl NcclRedOp {
    /// NCCL's code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The op with NCCL's code `code`, if it is a built-in one.
    pub fn from_code(code: i32) -> Option<NcclRedOp> {
        use NcclRedOp::*;
        [Sum, Prod, Max, Min, Avg].into_iter().find(|o| o.code() == code)
    }

    /// The cohort reduce op that computes the same thing.
    pub fn to_reduce_op(self) -> ReduceOp {
        match self {
            NcclRedOp::Sum => ReduceOp::Sum,
            NcclRedOp::Prod => ReduceOp::Product,
            NcclRedOp::Max => ReduceOp::Max,
            NcclRedOp::Min => ReduceOp::Min,
            NcclRedOp::Avg => ReduceOp::Avg,
        }
    }
}

/// NCCL's `ncclResult_t`, with NCCL's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NcclResult {
    /// `ncclSuccess`.
    Success,
    /// `ncclUnhandledCudaError`.
    UnhandledCudaError,
    /// `ncclSystemError`: a system call or the network failed.
    SystemError,
    /// `ncclInternalError`.
    InternalError,
    /// `ncclInvalidArgument`.
    InvalidArgument,
    /// `ncclInvalidUsage`.
    InvalidUsage,
    /// `ncclRemoteError`: a remote process exited or the network failed.
    RemoteError,
    /// `ncclInProgress`: a non-blocking call has not finished yet.
    InProgress,
    /// A code this build does not know.
    Other(i32),
}

impl NcclResult {
    /// The result with NCCL's code `code`.
    pub fn from_code(code: i32) -> NcclResult {
        match code {
            0 => NcclResult::Success,
            1 => NcclResult::UnhandledCudaError,
            2 => NcclResult::SystemError,
            3 => NcclResult::InternalError,
            4 => NcclResult::InvalidArgument,
            5 => NcclResult::InvalidUsage,
            6 => NcclResult::RemoteError,
            7 => NcclResult::InProgress,
            other => NcclResult::Other(other),
        }
    }

    /// NCCL's code.
    pub fn code(self) -> i32 {
        match self {
            NcclResult::Success => 0,
            NcclResult::UnhandledCudaError => 1,
            NcclResult::SystemError => 2,
            NcclResult::InternalError => 3,
            NcclResult::InvalidArgument => 4,
            NcclResult::InvalidUsage => 5,
            NcclResult::RemoteError => 6,
            NcclResult::InProgress => 7,
            NcclResult::Other(c) => c,
        }
    }

    /// Whether this is an error (neither success nor in progress).
    pub fn is_error(self) -> bool {
        !matches!(self, NcclResult::Success | NcclResult::InProgress)
    }

    /// NCCL's text for the code (`ncclGetErrorString`).
    pub fn describe(self) -> &'static str {
        match self {
            NcclResult::Success => "no error",
            NcclResult::UnhandledCudaError => "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
            NcclResult::SystemError => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            NcclResult::InternalError => "internal error - please report this issue to the NCCL developers",
            NcclResult::InvalidArgument => "invalid argument (run with NCCL_DEBUG=WARN for details)",
            NcclResult::InvalidUsage => "invalid usage (run with NCCL_DEBUG=WARN for details)",
            NcclResult::RemoteError => "remote process exited or there was a network error",
            NcclResult::InProgress => "NCCL operation in progress",
            NcclResult::Other(_) => "unknown result code",
        }
    }
}

impl fmt::Display for NcclResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.describe(), self.code())
    }
}

/// Why a device, communicator or NCCL process-group call failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// The CUDA driver or NCCL cannot be loaded on this machine.
    #[error("NCCL backend unavailable: {0}")]
    Unavailable(String),
    /// An NCCL call returned an error.
    #[error("{call} failed: {result}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// Its result.
        result: NcclResult,
    },
    /// A CUDA call failed.
    #[error("{call} failed: CUDA error {code} ({message})")]
    Cuda {
        /// The CUDA function.
        call: &'static str,
        /// CUDA's error code.
        code: i32,
        /// CUDA's name for it.
        message: String,
    },
    /// The call needs a newer NCCL than the one loaded.
    #[error("{call} needs NCCL >= {needs}, the loaded library is {found}")]
    NeedsVersion {
        /// The NCCL function.
        call: &'static str,
        /// The version it needs, as `major.minor`.
        needs: String,
        /// The version loaded, as `major.minor.patch`.
        found: String,
    },
    /// The store failed during setup (unique-id exchange, status, failures).
    #[error("store error in the NCCL backend: {0}")]
    Store(String),
    /// The op, dtype or reduce op is not supported on this backend.
    #[error("unsupported on the NCCL backend: {0}")]
    Unsupported(String),
    /// An argument was wrong (shape, dtype, rank, buffer size…).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Communicator init or a call ran past its timeout.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The communicator was aborted: it refuses every call.
    #[error("the NCCL communicator was aborted")]
    Aborted,
    /// The process group refused the call (bad argument, failed or aborted group).
    #[error(transparent)]
    Refused(#[from] cohort_core::group::SubmitError),
}

impl From<StoreError> for NcclError {
    fn from(e: StoreError) -> Self {
        NcclError::Store(e.to_string())
    }
}

/// The NCCL dtype a cohort dtype travels as. Bool travels as uint8, as in PyTorch.
pub fn nccl_dtype(dtype: DType) -> NcclDataType {
    match dtype {
        DType::Bf16 => NcclDataType::Bfloat16,
        DType::Bool | DType::U8 => NcclDataType::Uint8,
        DType::F16 => NcclDataType::Float16,
        DType::F32 => NcclDataType::Float32,
        DType::F64 => NcclDataType::Float64,
        DType::I8 => NcclDataType::Int8,
        DType::I32 => NcclDataType::Int32,
        DType::I64 => NcclDataType::Int64,
    }
}

/// The NCCL reduction for `op` on `dtype`, as PyTorch's `getNcclReduceOp` picks it; ops NCCL
/// has no built-in for are refused by name.
///
/// Bool travels as uint8, so a sum would count the trues (2 ranks holding true give 2, 256 give
/// 0): PyTorch maps sum on bool to `ncclMax` (logical or) and product to `ncclMin` (logical
/// and), and so does cohort.
pub fn nccl_op(op: ReduceOp, dtype: DType) -> Result<NcclRedOp, NcclError> {
    let unsupported = |why: &str| NcclError::Unsupported(format!("reduce op {} on {}: {why}", op.name(), dtype.name()));
    if dtype == DType::Bool {
        return match op {
            ReduceOp::Sum | ReduceOp::Max => Ok(NcclRedOp::Max),
            ReduceOp::Product | ReduceOp::Min => Ok(NcclRedOp::Min),
            ReduceOp::Avg => Err(unsupported("cannot average booleans")),
            _ => Err(unsupported("NCCL has no bitwise reductions")),
        };
    }
    Ok(match op {
        ReduceOp::Sum => NcclRedOp::Sum,
        ReduceOp::Product => NcclRedOp::Prod,
        ReduceOp::Max => NcclRedOp::Max,
        ReduceOp::Min => NcclRedOp::Min,
        ReduceOp::Avg if dtype.is_floating_point() => NcclRedOp::Avg,
        ReduceOp::Avg => return Err(unsupported("NCCL averages floating-point dtypes only")),
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => return Err(unsupported("NCCL has no bitwise reductions")),
        ReduceOp::PremulSum(_) => {
            // ncclRedOpCreatePreMulSum makes a per-communicator op id, which the seam does not
            // carry yet.
            return Err(unsupported("premul_sum is not available on the NCCL backend yet"));
        }
    })
}

/// A host buffer a device-to-host copy writes into (see [`Device::copy_to_host`]). Cheap to
/// clone; every clone is the same memory.
#[derive(Debug, Clone, Default)]
pub struct HostBuffer(Arc<Mutex<Vec<u8>>>);

impl HostBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> HostBuffer {
        HostBuffer(Arc::new(Mutex::new(vec![0; len])))
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of its bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.lock().clone()
    }

    /// `len` bytes from `offset`, if they are inside the buffer.
    pub fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let end = offset.checked_add(len)?;
        self.lock().get(offset..end).map(<[u8]>::to_vec)
    }

    /// Writes `bytes` at `offset`; false (and nothing written) if they do not fit.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        let mut b = self.lock();
        match offset.checked_add(bytes.len()) {
            Some(end) if end <= b.len() => {
                b[offset..end].copy_from_slice(bytes);
                true
            }
            _ => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // Every write is a single copy: a poisoned buffer still holds whole values.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How a communicator is created. The default is non-blocking: PyTorch creates non-blocking
/// communicators when it may need to abort one mid-init.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommConfig {
    /// Blocking (`true`) or non-blocking init and calls (NCCL's `config.blocking`). A
    /// non-blocking communicator reports [`NcclResult::InProgress`] from
    /// [`Communicator::async_error`] until its init has finished.
    pub blocking: bool,
}

/// A place in a device buffer: the buffer and a byte offset into it.
#[derive(Debug, Clone)]
pub struct BufRef<B> {
    /// The buffer.
    pub buf: B,
    /// Where the data starts, in bytes.
    pub offset: usize,
}

impl<B> BufRef<B> {
    /// The start of `buf`.
    pub fn new(buf: B) -> Self {
        BufRef { buf, offset: 0 }
    }

    /// `bytes` further into the same buffer.
    pub fn at(buf: B, offset: usize) -> Self {
        BufRef { buf, offset }
    }
}

/// One NCCL operation, with NCCL's argument meanings: `count` is in elements; for allgather it
/// is what each rank sends, for reduce-scatter what each rank receives.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum CommOp<B> {
    /// `ncclAllReduce`.
    AllReduce {
        /// Input.
        send: BufRef<B>,
        /// Output (may be the input).
        recv: BufRef<B>,
        /// Elements.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
        /// Reduction.
        op: NcclRedOp,
    },
    /// `ncclBroadcast`.
    Broadcast {
        /// Input (read on the root only).
        send: BufRef<B>,
        /// Output.
        recv: BufRef<B>,
        /// Elements.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
        /// The root.
        root: u32,
    },
    /// `ncclReduce`.
    Reduce {
        /// Input.
        send: BufRef<B>,
        /// Output (written on the root only).
        recv: BufRef<B>,
        /// Elements.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
        /// Reduction.
        op: NcclRedOp,
        /// The root.
        root: u32,
    },
    /// `ncclAllGather`: `count` elements in, `count × world` out, in rank order.
    AllGather {
        /// Input.
        send: BufRef<B>,
        /// Output.
        recv: BufRef<B>,
        /// Elements each rank sends.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
    },
    /// `ncclReduceScatter`: `count × world` elements in, block `rank` of the reduction out.
    ReduceScatter {
        /// Input.
        send: BufRef<B>,
        /// Output.
        recv: BufRef<B>,
        /// Elements each rank receives.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
        /// Reduction.
        op: NcclRedOp,
    },
    /// `ncclSend`.
    Send {
        /// What to send.
        buf: BufRef<B>,
        /// Elements.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
        /// The receiver.
        peer: u32,
    },
    /// `ncclRecv`.
    Recv {
        /// Where to receive.
        buf: BufRef<B>,
        /// Elements.
        count: usize,
        /// Element type.
        dtype: NcclDataType,
        /// The sender.
        peer: u32,
    },
}

impl<B> CommOp<B> {
    /// NCCL's name for the call.
    pub fn call_name(&self) -> &'static str {
        match self {
            CommOp::AllReduce { .. } => "ncclAllReduce",
            CommOp::Broadcast { .. } => "ncclBroadcast",
            CommOp::Reduce { .. } => "ncclReduce",
            CommOp::AllGather { .. } => "ncclAllGather",
            CommOp::ReduceScatter { .. } => "ncclReduceScatter",
            CommOp::Send { .. } => "ncclSend",
            CommOp::Recv { .. } => "ncclRecv",
        }
    }

    /// Whether it is a point-to-point op.
    pub fn is_p2p(&self) -> bool {
        matches!(self, CommOp::Send { .. } | CommOp::Recv { .. })
    }
}

/// The CUDA side of the seam: one device, its streams, events and memory.
pub trait Device: Send + Sync + fmt::Debug + 'static {
    /// A stream (`CUstream`).
    type Stream: Send + Sync + fmt::Debug + 'static;
    /// An event (`CUevent`).
    type Event: Send + Sync + fmt::Debug + 'static;
    /// Device memory; cloning hands out another reference to the same memory.
    type Buffer: Clone + Send + Sync + fmt::Debug + 'static;
    /// The NCCL communicator over this device.
    type Comm: Communicator<Device = Self>;

    /// The device's ordinal.
    fn ordinal(&self) -> usize;
    /// The NCCL version loaded, as NCCL encodes it (`major*10000 + minor*100 + patch`).
    fn nccl_version(&self) -> Result<u32, NcclError>;

    /// A new stream.
    fn new_stream(&self) -> Result<Self::Stream, NcclError>;
    /// A new event; `timing` makes it usable with [`Device::elapsed`].
    fn new_event(&self, timing: bool) -> Result<Self::Event, NcclError>;
    /// Records `event` on `stream`: it completes when the stream reaches this point.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<(), NcclError>;
    /// Whether `event` has completed; never blocks. A device error is an `Err`.
    fn query(&self, event: &Self::Event) -> Result<bool, NcclError>;
    /// Device time between two completed timing events.
    fn elapsed(&self, start: &Self::Event, end: &Self::Event) -> Result<Duration, NcclError>;
    /// Makes `stream` wait, on the device, for `event`'s latest record.
    fn stream_wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<(), NcclError>;
    /// Blocks the calling thread until `stream` has finished everything enqueued on it.
    fn synchronize(&self, stream: &Self::Stream) -> Result<(), NcclError>;

    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer, NcclError>;
    /// A buffer's length in bytes.
    fn buffer_len(&self, buf: &Self::Buffer) -> usize;
    /// Copies `src` into `dst` at `offset`, ordered on `stream`.
    fn copy_to_device(
        &self,
        stream: &Self::Stream,
        src: &[u8],
        dst: &Self::Buffer,
        offset: usize,
    ) -> Result<(), NcclError>;
    /// Copies `dst.len()` bytes of `src` from `offset` into `dst`, ordered on `stream`.
    fn copy_to_host(
        &self,
        stream: &Self::Stream,
        src: &Self::Buffer,
        offset: usize,
        dst: &HostBuffer,
    ) -> Result<(), NcclError>;

    /// A new NCCL unique id (rank 0 makes it and shares it through the store).
    fn unique_id(&self) -> Result<[u8; 128], NcclError>;
    /// Joins communicator `id` as `rank` of `world_size` (`ncclCommInitRankConfig`). A
    /// non-blocking one may return before it is ready: poll [`Communicator::async_error`].
    fn init_comm(
        &self,
        id: &[u8; 128],
        world_size: u32,
        rank: u32,
        config: CommConfig,
    ) -> Result<Self::Comm, NcclError>;
}

/// The NCCL side of the seam: one communicator.
pub trait Communicator: Send + Sync + fmt::Debug + 'static {
    /// The device it runs on.
    type Device: Device;

    /// This rank in the communicator.
    fn rank(&self) -> u32;
    /// Ranks in the communicator.
    fn world_size(&self) -> u32;
    /// Enqueues `op` on `stream`. Between [`Communicator::group_start`] and
    /// [`Communicator::group_end`] ops are collected and launched together at the end.
    fn enqueue(
        &self,
        op: CommOp<<Self::Device as Device>::Buffer>,
        stream: &<Self::Device as Device>::Stream,
    ) -> Result<(), NcclError>;
    /// `ncclGroupStart`.
    fn group_start(&self) -> Result<(), NcclError>;
    /// `ncclGroupEnd`: launches what was enqueued since the start, as one.
    fn group_end(&self) -> Result<(), NcclError>;
    /// `ncclCommGetAsyncError`: success, in progress, or the error that broke it.
    fn async_error(&self) -> Result<NcclResult, NcclError>;
    /// `ncclCommAbort`: callable from any thread, also while a call blocks. This rank's NCCL
    /// kernels that wait for peers end; the communicator refuses every later call. It returns
    /// once the streams it launched on reached its launches, so a stream held by something
    /// else (a host wait, a hung compute kernel) keeps it waiting: call it where waiting is
    /// fine. Aborting twice does nothing more.
    fn abort(&self);
    /// The part of [`Communicator::abort`] that never waits: from now on every call is
    /// refused and [`Communicator::is_aborted`] is true; an implementation may also end its
    /// waiting kernels here. [`Communicator::abort`] must still follow, to free the
    /// communicator. Idempotent.
    fn raise_abort(&self);
    /// Whether [`Communicator::raise_abort`] or [`Communicator::abort`] ran.
    fn is_aborted(&self) -> bool;
    /// `ncclCommSplit`: ranks with `Some(color)` join that color's communicator ordered by
    /// `key`; `None` takes part without joining one. Every rank must call it.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>, NcclError>
    where
        Self: Sized;
    /// `ncclCommShrink` (NCCL ≥ 2.27): a communicator of the ranks not in `exclude`, renumbered
    /// in order. Every remaining rank calls it.
    fn shrink(&self, exclude: &[u32]) -> Result<Self, NcclError>
    where
        Self: Sized;
    /// `ncclCommFinalize`: flushes outstanding work; then the communicator may be dropped.
    fn finalize(&self) -> Result<(), NcclError>;
}

/// NCCL's version encoding for `major.minor.patch` (`NCCL_VERSION` for 2.9 and later).
pub const fn nccl_version_code(major: u32, minor: u32, patch: u32) -> u32 {
    major * 10_000 + minor * 100 + patch
}

/// `major.minor.patch` of an encoded NCCL version.
pub fn version_text(code: u32) -> String {
    format!("{}.{}.{}", code / 10_000, (code / 100) % 100, code % 100)
}

/// Refuses `call` unless `loaded` is at least `major.minor` (a symbol that is missing from an
/// older library would otherwise make cudarc panic).
pub fn require_version(call: &'static str, loaded: u32, major: u32, minor: u32) -> Result<(), NcclError> {
    if loaded >= nccl_version_code(major, minor, 0) {
        Ok(())
    } else {
        Err(NcclError::NeedsVersion { call, needs: format!("{major}.{minor}"), found: version_text(loaded) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bool_sum_and_product_are_logical_as_in_pytorch() {
        assert_eq!(nccl_op(ReduceOp::Sum, DType::Bool).unwrap(), NcclRedOp::Max);
        assert_eq!(nccl_op(ReduceOp::Product, DType::Bool).unwrap(), NcclRedOp::Min);
        assert_eq!(nccl_op(ReduceOp::Sum, DType::U8).unwrap(), NcclRedOp::Sum);
        let e = nccl_op(ReduceOp::Avg, DType::Bool).unwrap_err().to_string();
        assert!(e.contains("avg on bool"), "{e}");
    }

    #[test]
    fn reduce_ops_map_to_nccl_or_are_refused_by_name() {
        assert_eq!(nccl_op(ReduceOp::Sum, DType::F32).unwrap(), NcclRedOp::Sum);
        assert_eq!(nccl_op(ReduceOp::Avg, DType::Bf16).unwrap(), NcclRedOp::Avg);
        assert_eq!(nccl_op(ReduceOp::Max, DType::I64).unwrap(), NcclRedOp::Max);
        let e = nccl_op(ReduceOp::Avg, DType::I32).unwrap_err().to_string();
        assert!(e.contains("avg on int32"), "{e}");
        let e = nccl_op(ReduceOp::BXor, DType::U8).unwrap_err().to_string();
        assert!(e.contains("bitwise"), "{e}");
        let e = nccl_op(ReduceOp::PremulSum(0.5), DType::F32).unwrap_err().to_string();
        assert!(e.contains("premul_sum"), "{e}");
        assert_eq!(nccl_dtype(DType::Bool), NcclDataType::Uint8);
        assert_eq!(nccl_dtype(DType::Bf16), NcclDataType::Bfloat16);
    }

    #[test]
    fn codes_round_trip_and_match_nccl() {
        for code in 0..10 {
            assert_eq!(NcclDataType::from_code(code).unwrap().code(), code);
        }
        assert_eq!(NcclDataType::from_code(10), None);
        assert_eq!(NcclDataType::Bfloat16.code(), 9);
        assert_eq!(NcclRedOp::Avg.code(), 4);
        for code in 0..9 {
            assert_eq!(NcclResult::from_code(code).code(), code);
        }
        assert_eq!(NcclResult::from_code(6), NcclResult::RemoteError);
        assert!(!NcclResult::InProgress.is_error());
    }

    #[test]
    fn newer_calls_are_refused_with_the_version_they_need() {
        assert!(require_version("ncclCommShrink", nccl_version_code(2, 27, 3), 2, 27).is_ok());
        let e = require_version("ncclCommShrink", nccl_version_code(2, 26, 5), 2, 27).unwrap_err().to_string();
        assert_eq!(e, "ncclCommShrink needs NCCL >= 2.27, the loaded library is 2.26.5");
    }
}
