//! A thin NCCL communicator over cudarc's `sys` layer: init through `ncclCommInitRankConfig`
//! (blocking or non-blocking), abort, async-error polling, split, finalize and destroy.
//!
//! A [`Communicator`] is neither `Send` nor `Sync`: it lives on the thread that created it.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::DType;
use cudarc::nccl::sys;

use super::NcclError;

/// NCCL's `NCCL_SPLIT_NOCOLOR`.
const SPLIT_NOCOLOR: c_int = -1;
/// NCCL's `NCCL_CONFIG_UNDEF_INT`.
const CONFIG_UNDEF_INT: c_int = i32::MIN;

/// Turns an NCCL result into a `Result`, naming the call; `ncclInProgress` counts as success
/// (non-blocking communicators return it, completion is then polled).
pub(crate) fn check(call: &'static str, r: sys::ncclResult_t) -> Result<(), NcclError> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(NcclError::Call { call, code: other, message: error_string(other) }),
    }
}

fn error_string(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for every result code.
    unsafe {
        let p = sys::ncclGetErrorString(r);
        if p.is_null() { format!("{r:?}") } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() }
    }
}

/// The NCCL datatype for a cohort dtype (bool travels as uint8, as in PyTorch).
pub fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        DType::Bool | DType::U8 => sys::ncclDataType_t::ncclUint8,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::I8 => sys::ncclDataType_t::ncclInt8,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

/// The built-in NCCL reduction for `op`; ops NCCL has no built-in for are refused by name.
pub fn nccl_op(op: ReduceOp, dtype: DType) -> Result<sys::ncclRedOp_t, NcclError> {
    let unsupported = |why: &str| NcclError::Unsupported(format!("reduce op {} on {}: {why}", op.name(), dtype.name()));
    Ok(match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Avg if dtype.is_floating_point() => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Avg => return Err(unsupported("NCCL averages floating-point dtypes only")),
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
            return Err(unsupported("NCCL has no bitwise reductions"));
        }
        ReduceOp::PremulSum(_) => {
            // ncclRedOpCreatePreMulSum hands back an op id outside cudarc's ncclRedOp_t enum,
            // which Rust cannot hold without undefined behaviour: refused until cohort loads
            // that symbol with an integer signature itself.
            return Err(unsupported("premul_sum is not available on the NCCL backend yet"));
        }
    })
}

/// How a communicator is created.
#[derive(Debug, Clone, Copy)]
pub struct CommConfig {
    /// Blocking (`true`) or non-blocking init and calls.
    pub blocking: bool,
    /// How long a non-blocking init may stay `ncclInProgress` before it is aborted.
    pub init_timeout: Duration,
}

fn default_config(blocking: bool) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 30, 0): the layout of cudarc's ncclConfig_t (nccl-02030 bindings).
        version: 2 * 10_000 + 30 * 100,
        blocking: c_int::from(blocking),
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
        graphUsageMode: CONFIG_UNDEF_INT,
        numRmaCtx: CONFIG_UNDEF_INT,
        maxP2pPeers: CONFIG_UNDEF_INT,
    }
}

/// A new unique id (rank 0 makes it and shares it through the store).
pub fn unique_id() -> Result<[u8; 128], NcclError> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer.
    check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
    Ok(id.internal.map(|c| c as u8))
}

/// One NCCL communicator, owned by the thread that made it.
#[derive(Debug)]
pub struct Communicator {
    comm: sys::ncclComm_t,
    config: CommConfig,
    /// Set once `ncclCommAbort` ran: the handle is freed and must not be used or destroyed.
    aborted: Cell<bool>,
    _not_send: PhantomData<*const ()>,
}

impl Communicator {
    /// Joins the communicator `id` as `rank` of `world`; the current thread must have the
    /// target device's CUDA context bound.
    pub fn init(id: &[u8; 128], world: u32, rank: u32, config: CommConfig) -> Result<Communicator, NcclError> {
        let nranks = c_int::try_from(world).map_err(|_| NcclError::Invalid(format!("world size {world} too large")))?;
        let rank_c = c_int::try_from(rank).map_err(|_| NcclError::Invalid(format!("rank {rank} too large")))?;
        let uid = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut cfg = default_config(config.blocking);
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: out-pointer and config are valid for the call; NCCL copies the config.
        let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, nranks, uid, rank_c, &mut cfg) };
        check("ncclCommInitRankConfig", r)?;
        if comm.is_null() {
            return Err(NcclError::Invalid("ncclCommInitRankConfig returned no communicator".into()));
        }
        let c = Communicator { comm, config, aborted: Cell::new(false), _not_send: PhantomData };
        c.wait_ready("ncclCommInitRankConfig")?;
        Ok(c)
    }

    fn wait_ready(&self, call: &'static str) -> Result<(), NcclError> {
        self.wait_ready_for(call, self.config.init_timeout)
    }

    /// Polls `ncclCommGetAsyncError` until the communicator leaves `ncclInProgress` (a
    /// non-blocking communicator's calls return before they are enqueued); past `timeout` it is
    /// aborted.
    pub fn wait_ready_for(&self, call: &'static str, timeout: Duration) -> Result<(), NcclError> {
        let start = Instant::now();
        loop {
            match self.async_error_raw()? {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {
                    if start.elapsed() > timeout {
                        self.abort();
                        return Err(NcclError::Timeout(format!(
                            "{call} still in progress after {:?}",
                            start.elapsed()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                other => return check(call, other),
            }
        }
    }

    fn live(&self) -> Result<(), NcclError> {
        if self.aborted.get() { Err(NcclError::Closed) } else { Ok(()) }
    }

    fn async_error_raw(&self) -> Result<sys::ncclResult_t, NcclError> {
        self.live()?;
        let mut e = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.comm` is a live communicator and `e` a valid out-pointer.
        check("ncclCommGetAsyncError", unsafe { sys::ncclCommGetAsyncError(self.comm, &mut e) })?;
        Ok(e)
    }

    /// The communicator's asynchronous error, if any (`ncclInProgress` is not an error).
    pub fn async_error(&self) -> Result<(), NcclError> {
        let e = self.async_error_raw()?;
        check("ncclCommGetAsyncError", e)
    }

    /// Aborts the communicator: in-flight NCCL kernels are torn down. Later calls fail.
    pub fn abort(&self) {
        if self.aborted.replace(true) {
            return;
        }
        // SAFETY: `self.comm` is live; ncclCommAbort is legal at any time, even mid-collective,
        // and frees the communicator (Drop then skips ncclCommDestroy).
        let _ = unsafe { sys::ncclCommAbort(self.comm) };
    }

    /// Splits the communicator: ranks with `Some(color)` join the group of that color ordered by
    /// `key`; ranks with `None` take part with `NCCL_SPLIT_NOCOLOR` and get no communicator.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>, NcclError> {
        let color_c = match color {
            Some(c) => c_int::try_from(c).map_err(|_| NcclError::Invalid(format!("split color {c} too large")))?,
            None => SPLIT_NOCOLOR,
        };
        let key_c = c_int::try_from(key).map_err(|_| NcclError::Invalid(format!("split key {key} too large")))?;
        self.live()?;
        let mut cfg = default_config(self.config.blocking);
        let mut out: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: live parent communicator, valid out-pointer and config.
        check("ncclCommSplit", unsafe { sys::ncclCommSplit(self.comm, color_c, key_c, &mut out, &mut cfg) })?;
        if out.is_null() {
            return Ok(None);
        }
        let c = Communicator { comm: out, config: self.config, aborted: Cell::new(false), _not_send: PhantomData };
        c.wait_ready("ncclCommSplit")?;
        Ok(Some(c))
    }

    /// Finalizes (flushes outstanding operations) then destroys the communicator.
    pub fn finalize(self) -> Result<(), NcclError> {
        self.live()?;
        // SAFETY: `self.comm` is live.
        check("ncclCommFinalize", unsafe { sys::ncclCommFinalize(self.comm) })?;
        self.wait_ready("ncclCommFinalize")?;
        Ok(()) // Drop destroys it.
    }

    /// Opens a group of calls (`ncclGroupStart`): coalescing and grouped send/recv.
    pub fn group_start() -> Result<(), NcclError> {
        // SAFETY: no arguments.
        check("ncclGroupStart", unsafe { sys::ncclGroupStart() })
    }

    /// Closes a group of calls (`ncclGroupEnd`).
    pub fn group_end() -> Result<(), NcclError> {
        // SAFETY: no arguments.
        check("ncclGroupEnd", unsafe { sys::ncclGroupEnd() })
    }

    /// `ncclAllReduce` of `count` elements.
    ///
    /// # Safety
    /// `send`/`recv` must be device buffers of `count` elements of `dtype` valid on `stream`.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: sys::ncclRedOp_t,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclAllReduce(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_dtype(dtype),
                op,
                self.comm,
                stream.cast(),
            )
        };
        check("ncclAllReduce", r)
    }

    /// `ncclBroadcast` of `count` elements from `root`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`].
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: u32,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclBroadcast(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_dtype(dtype),
                root as c_int,
                self.comm,
                stream.cast(),
            )
        };
        check("ncclBroadcast", r)
    }

    /// `ncclReduce` of `count` elements onto `root`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: sys::ncclRedOp_t,
        root: u32,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclReduce(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_dtype(dtype),
                op,
                root as c_int,
                self.comm,
                stream.cast(),
            )
        };
        check("ncclReduce", r)
    }

    /// `ncclAllGather`: `count` elements in, `count × world` out.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`], with `recv` holding `count × world` elements.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclAllGather(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_dtype(dtype),
                self.comm,
                stream.cast(),
            )
        };
        check("ncclAllGather", r)
    }

    /// `ncclReduceScatter`: `count × world` elements in, `count` out.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`], with `send` holding `count × world` elements.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: sys::ncclRedOp_t,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclReduceScatter(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_dtype(dtype),
                op,
                self.comm,
                stream.cast(),
            )
        };
        check("ncclReduceScatter", r)
    }

    /// `ncclSend` of `count` elements to `peer`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`].
    pub unsafe fn send(
        &self,
        buf: u64,
        count: usize,
        dtype: DType,
        peer: u32,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclSend(buf as *const c_void, count, nccl_dtype(dtype), peer as c_int, self.comm, stream.cast())
        };
        check("ncclSend", r)
    }

    /// `ncclRecv` of `count` elements from `peer`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`].
    pub unsafe fn recv(
        &self,
        buf: u64,
        count: usize,
        dtype: DType,
        peer: u32,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        self.live()?;
        let r = unsafe {
            sys::ncclRecv(buf as *mut c_void, count, nccl_dtype(dtype), peer as c_int, self.comm, stream.cast())
        };
        check("ncclRecv", r)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.aborted.get() {
            return;
        }
        // SAFETY: `self.comm` is live (not aborted) and dropped exactly once.
        let _ = unsafe { sys::ncclCommDestroy(self.comm) };
    }
}
