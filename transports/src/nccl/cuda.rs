//! The CUDA implementation of the device seam (feature `nccl`): [`CudaDevice`] (streams, events,
//! device memory, copies), [`CudaComm`] (one NCCL communicator) and [`CudaBlocker`] (a stream
//! made to wait on a host flag: a real hang, for tests).
//!
//! Everything goes through cudarc's `sys` and `result` layers (and the safe layer's context,
//! stream and event handles, for their lifetimes). cudarc loads `libcuda.so` and `libnccl.so` at
//! run time and **panics** on the first call when a library, or one symbol, is missing. So:
//! - [`CudaDevice::new`] calls [`probe`] first: a machine without the driver or NCCL gets
//!   [`NcclError::Unavailable`] naming the library, never a panic. Every other entry point needs
//!   a `CudaDevice`.
//! - NCCL calls that not every supported NCCL has are gated on `ncclGetVersion` with
//!   [`require_version`] before the call: `ncclCommInitRankConfig` and `ncclCommFinalize` (2.14),
//!   `ncclCommSplit` (2.18), `ncclCommShrink` (2.27). An older library gives
//!   [`NcclError::NeedsVersion`].
//! - Driver calls newer than CUDA 11.x (`cuEventElapsedTime_v2`, `cuStreamWaitValue32_v2`) are
//!   looked up by name before use, with the older entry point as the fallback where one exists.
//!
//! # Threads
//!
//! CUDA handles (streams, events, device pointers, pinned memory) belong to a context, not to a
//! thread: any thread may use them once that context is current. Every method here makes the
//! device's context current first (`bind_to_thread`), which is what makes the handles `Send` and
//! `Sync`. [`CudaComm`] is `Send + Sync` so that [`CudaComm::abort`] can come from a watchdog
//! thread while another thread is blocked in a call on the same communicator, which is what NCCL
//! documents `ncclCommAbort` for (see the soundness note on [`CudaComm`]).
//!
//! # Memory
//!
//! Host↔device copies go through pinned staging memory, so a copy never waits for its stream:
//! [`Device::copy_to_device`] copies the host bytes into a pinned chunk before it returns, and
//! [`Device::copy_to_host`] lands in a pinned chunk that a CUDA host function, ordered on the
//! stream, copies into the [`HostBuffer`]. Dropping the last handle of a [`CudaBuffer`] frees it
//! with `cuMemFree`, which waits for the device's outstanding work: drop buffers once the work
//! that uses them has finished, never while a stream is hung.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::result::DriverError;
use cudarc::driver::{self as cud, CudaContext, result as cu_result, sys as cu};
use cudarc::nccl::sys as nccl;

use super::device::{
    BufRef, CommConfig, CommOp, Communicator, Device, HostBuffer, NcclDataType, NcclError, NcclRedOp, NcclResult,
    nccl_version_code, require_version,
};

/// `NCCL_VERSION(2, 30, 0)`: the NCCL header cudarc's bindings were generated from (cudarc
/// feature `nccl-02030`), so the layout of its `ncclConfig_t`.
pub const BINDING_NCCL_VERSION: u32 = nccl_version_code(2, 30, 0);

/// Checks that the CUDA driver (`libcuda.so`) and NCCL (`libnccl.so`) can be loaded, without
/// calling into either: cudarc panics on its first call when a library is missing.
///
/// cudarc looks for `libnccl.so` (and `libnccl.so.<CUDA major>`), not NCCL's own soname
/// `libnccl.so.2`: with NCCL from a pip wheel (`nvidia-nccl-cu12`/`cu13`), put a folder holding a
/// `libnccl.so` link to the wheel's `libnccl.so.2` on `LD_LIBRARY_PATH` (`scripts/gpu-tests.sh`
/// does this).
pub fn probe() -> Result<(), NcclError> {
    // SAFETY: is_culib_present only tries to dlopen the candidate names; it calls no symbol.
    if !unsafe { cu::is_culib_present() } {
        return Err(NcclError::Unavailable(
            "libcuda.so could not be loaded: no NVIDIA driver on this machine (cudarc looks for libcuda.so and \
             libcuda.so.1)"
                .into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { nccl::is_culib_present() } {
        return Err(NcclError::Unavailable(
            "libnccl.so could not be loaded: cudarc looks for libnccl.so, not NCCL's libnccl.so.2; put a folder \
             holding a libnccl.so link to NCCL's library on LD_LIBRARY_PATH (scripts/gpu-tests.sh does this, see \
             NCCL_LIB there)"
                .into(),
        ));
    }
    Ok(())
}

/// The `version` field cohort writes into `ncclConfig_t` when `loaded` is the NCCL in use: the
/// older of the bindings' header ([`BINDING_NCCL_VERSION`]) and the loaded library.
///
/// NCCL copies `min(config.size, its own sizeof(ncclConfig_t))` bytes and then resets every field
/// newer than `config.version` to its default (`parseCommConfig` in NCCL's `init.cc`). With a
/// newer library, the binding's version makes it ignore the fields our struct does not have.
/// With an older library, our struct is larger than its own: it reads only its prefix, and the
/// loaded version says truthfully which fields we filled for it. All of them hold
/// `NCCL_CONFIG_INITIALIZER`'s "undefined" sentinels anyway, except `blocking`.
pub fn config_version(loaded: u32) -> u32 {
    BINDING_NCCL_VERSION.min(loaded)
}

/// One CUDA device: its primary context, the loaded NCCL's version, and pinned staging memory
/// for copies.
#[derive(Debug)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    nccl_version: u32,
    driver_version: u32,
    /// A private stream for the zeroing of new allocations, so that `alloc` never waits for a
    /// caller's (possibly hung) stream.
    zero_stream: Arc<cud::CudaStream>,
    staging: Arc<Staging>,
}

impl CudaDevice {
    /// The device with CUDA ordinal `ordinal`.
    ///
    /// Without the CUDA driver or NCCL, or without any CUDA device, this is
    /// [`NcclError::Unavailable`] saying which; an ordinal past the last device is
    /// [`NcclError::Invalid`].
    pub fn new(ordinal: usize) -> Result<CudaDevice, NcclError> {
        probe()?;
        let count = visible_devices()?;
        if count == 0 {
            return Err(NcclError::Unavailable("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".into()));
        }
        if ordinal >= count {
            return Err(NcclError::Invalid(format!("CUDA device {ordinal} does not exist: {count} are visible")));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: event tracking only concerns cudarc's CudaSlice, which cohort never creates:
        // buffers are raw allocations ordered by the caller's streams and events. Without it,
        // creating the first stream does not synchronize the whole context (which would wait for
        // a hung stream).
        unsafe { ctx.disable_event_tracking() };
        let nccl_version = loaded_nccl_version()?;
        let mut driver: c_int = 0;
        // SAFETY: cuDriverGetVersion exists in every driver and writes one int.
        unsafe { cu::cuDriverGetVersion(&mut driver) }.result().map_err(cuda_err("cuDriverGetVersion"))?;
        let zero_stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        Ok(CudaDevice {
            ctx,
            ordinal,
            nccl_version,
            driver_version: u32::try_from(driver).unwrap_or(0),
            zero_stream,
            staging: Arc::new(Staging::default()),
        })
    }

    /// The CUDA driver's version, as CUDA encodes it (`major*1000 + minor*10`).
    pub fn driver_version(&self) -> u32 {
        self.driver_version
    }

    /// The device's name.
    pub fn name(&self) -> Result<String, NcclError> {
        self.ctx.name().map_err(cuda_err("cuDeviceGetName"))
    }

    fn bind(&self) -> Result<(), NcclError> {
        self.ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            self.staging.close();
        }
    }
}

/// The number of CUDA devices visible; 0 when the driver reports none. Call [`probe`] first.
pub fn device_count() -> Result<usize, NcclError> {
    probe()?;
    visible_devices()
}

fn visible_devices() -> Result<usize, NcclError> {
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(DriverError(cu::CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(cuda_err("cuDeviceGetCount")(e)),
    }
}

/// A CUDA stream (non-blocking with respect to the legacy default stream).
#[derive(Debug)]
pub struct CudaStream {
    inner: Arc<cud::CudaStream>,
}

impl CudaStream {
    /// The raw `CUstream`, for other CUDA libraries. Do not destroy it.
    pub fn as_raw(&self) -> *mut c_void {
        self.raw().cast()
    }

    fn raw(&self) -> cu::CUstream {
        self.inner.cu_stream()
    }
}

/// A CUDA event, with or without timing (`CU_EVENT_DISABLE_TIMING`).
#[derive(Debug)]
pub struct CudaEvent {
    inner: cud::CudaEvent,
    timing: bool,
}

impl CudaEvent {
    /// Whether it was made with timing, for [`Device::elapsed`].
    pub fn has_timing(&self) -> bool {
        self.timing
    }

    /// The raw `CUevent`, for other CUDA libraries. Do not destroy it.
    pub fn as_raw(&self) -> *mut c_void {
        self.inner.cu_event().cast()
    }
}

/// Device memory from `cuMemAlloc`. Cloning hands out another handle to the same memory; the
/// last handle frees it (`cuMemFree`, which waits for the device's outstanding work).
#[derive(Debug, Clone)]
pub struct CudaBuffer(Arc<DeviceMemory>);

impl CudaBuffer {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The CUDA device it lives on.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// The device address of its first byte (`CUdeviceptr`).
    pub fn device_ptr(&self) -> u64 {
        self.0.ptr
    }

    /// The device address of `bytes` bytes at `offset`, if they lie inside the buffer.
    pub fn device_ptr_at(&self, offset: usize, bytes: usize) -> Result<u64, NcclError> {
        check_range(self.0.len, offset, bytes)?;
        Ok(self.0.ptr + offset as u64)
    }
}

#[derive(Debug)]
struct DeviceMemory {
    ptr: cu::CUdeviceptr,
    /// What the caller asked for; the allocation holds at least one byte more when this is 0.
    len: usize,
    ordinal: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let freed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `ptr` came from cuMemAlloc in CudaDevice::alloc and this is its only owner
            // (every CudaBuffer clone shares this one DeviceMemory); cuMemFree waits for the
            // device's outstanding work before the memory is reused.
            unsafe { cu_result::free_sync(self.ptr) }
        });
        if let Err(e) = freed {
            tracing::warn!(error = %cuda_err("cuMemFree")(e), "freeing a CUDA buffer failed");
        }
    }
}

impl Device for CudaDevice {
    type Stream = CudaStream;
    type Event = CudaEvent;
    type Buffer = CudaBuffer;
    type Comm = CudaComm;

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn nccl_version(&self) -> Result<u32, NcclError> {
        Ok(self.nccl_version)
    }

    fn new_stream(&self) -> Result<CudaStream, NcclError> {
        Ok(CudaStream { inner: self.ctx.new_stream().map_err(cuda_err("cuStreamCreate"))? })
    }

    fn new_event(&self, timing: bool) -> Result<CudaEvent, NcclError> {
        let flags =
            if timing { cu::CUevent_flags::CU_EVENT_DEFAULT } else { cu::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        Ok(CudaEvent { inner: self.ctx.new_event(Some(flags)).map_err(cuda_err("cuEventCreate"))?, timing })
    }

    fn record(&self, event: &CudaEvent, stream: &CudaStream) -> Result<(), NcclError> {
        // The safe layer binds the context and checks that both belong to it.
        event.inner.record(&stream.inner).map_err(cuda_err("cuEventRecord"))
    }

    fn query(&self, event: &CudaEvent) -> Result<bool, NcclError> {
        self.bind()?;
        // try_is_complete, not is_complete: the latter reads every CUDA error as "not ready",
        // which would turn a device error into a timeout.
        event.inner.try_is_complete().map_err(cuda_err("cuEventQuery"))
    }

    fn elapsed(&self, start: &CudaEvent, end: &CudaEvent) -> Result<Duration, NcclError> {
        if !start.timing || !end.timing {
            return Err(NcclError::Invalid("elapsed time needs two events made with timing".into()));
        }
        // Query both first: cudarc's elapsed_ms synchronizes, and this must never block.
        if !self.query(start)? || !self.query(end)? {
            return Err(cuda_err("cuEventElapsedTime")(DriverError(cu::CUresult::CUDA_ERROR_NOT_READY)));
        }
        let ms = elapsed_ms(start.inner.cu_event(), end.inner.cu_event())?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1000.0))
    }

    fn stream_wait(&self, stream: &CudaStream, event: &CudaEvent) -> Result<(), NcclError> {
        stream.inner.wait(&event.inner).map_err(cuda_err("cuStreamWaitEvent"))
    }

    fn synchronize(&self, stream: &CudaStream) -> Result<(), NcclError> {
        stream.inner.synchronize().map_err(cuda_err("cuStreamSynchronize"))
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer, NcclError> {
        self.bind()?;
        // cuMemAlloc refuses 0 bytes; NCCL and the copies never touch memory past `len`.
        let size = bytes.max(1);
        // SAFETY: a plain allocation; nobody sees the memory before it is zeroed below.
        let ptr = unsafe { cu_result::malloc_sync(size) }.map_err(cuda_err("cuMemAlloc"))?;
        let mem = DeviceMemory { ptr, len: bytes, ordinal: self.ordinal, ctx: self.ctx.clone() };
        let zero = self.zero_stream.cu_stream();
        // SAFETY: `ptr` holds `size` bytes. The memset goes on the device's private stream, which
        // is synchronized before the buffer is handed out, so the zeroing is done before any
        // caller's stream (which does not synchronize with the legacy stream) can touch it.
        unsafe { cu_result::memset_d8_async(ptr, 0, size, zero) }.map_err(cuda_err("cuMemsetD8Async"))?;
        self.zero_stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
        Ok(CudaBuffer(Arc::new(mem)))
    }

    fn buffer_len(&self, buf: &CudaBuffer) -> usize {
        buf.len()
    }

    fn copy_to_device(
        &self,
        stream: &CudaStream,
        src: &[u8],
        dst: &CudaBuffer,
        offset: usize,
    ) -> Result<(), NcclError> {
        let target = dst.device_ptr_at(offset, src.len()).map_err(|e| in_call("copy_to_device", e))?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let chunk = self.staging.take(src.len())?;
        // SAFETY: the chunk holds at least src.len() bytes of pinned host memory that only this
        // call uses until it is given back.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), chunk.ptr, src.len()) };
        // SAFETY: `target..target+len` lies inside `dst` (checked above) and the chunk stays out
        // of the pool until the host function below, ordered after the copy, gives it back.
        let copied =
            unsafe { cu::cuMemcpyHtoDAsync_v2(target, chunk.ptr.cast_const().cast(), src.len(), stream.raw()) };
        if let Err(e) = copied.result() {
            self.staging.give_back(chunk);
            return Err(cuda_err("cuMemcpyHtoDAsync")(e));
        }
        self.after_copy(stream, HostCopyDone { staging: self.staging.clone(), chunk: Some(chunk), to_host: None })
    }

    fn copy_to_host(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer,
        offset: usize,
        dst: &HostBuffer,
    ) -> Result<(), NcclError> {
        let len = dst.len();
        let source = src.device_ptr_at(offset, len).map_err(|e| in_call("copy_to_host", e))?;
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        let chunk = self.staging.take(len)?;
        // SAFETY: `source..source+len` lies inside `src` (checked above); the chunk holds at least
        // `len` bytes and stays out of the pool until the host function below has read it.
        let copied = unsafe { cu::cuMemcpyDtoHAsync_v2(chunk.ptr.cast(), source, len, stream.raw()) };
        if let Err(e) = copied.result() {
            self.staging.give_back(chunk);
            return Err(cuda_err("cuMemcpyDtoHAsync")(e));
        }
        let done =
            HostCopyDone { staging: self.staging.clone(), chunk: Some(chunk), to_host: Some((dst.clone(), len)) };
        self.after_copy(stream, done)
    }

    fn unique_id(&self) -> Result<[u8; 128], NcclError> {
        let mut id = nccl::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer for one ncclUniqueId.
        nccl_check("ncclGetUniqueId", unsafe { nccl::ncclGetUniqueId(&mut id) })?;
        Ok(id.internal.map(|c| c as u8))
    }

    fn init_comm(&self, id: &[u8; 128], world_size: u32, rank: u32, config: CommConfig) -> Result<CudaComm, NcclError> {
        require_version("ncclCommInitRankConfig", self.nccl_version, 2, 14)?;
        if rank >= world_size {
            return Err(NcclError::Invalid(format!("rank {rank} is not a rank of a world of {world_size}")));
        }
        let nranks = to_c_int("world size", world_size)?;
        let rank_c = to_c_int("rank", rank)?;
        self.bind()?;
        let uid = nccl::ncclUniqueId { internal: id.map(|b| b as c_char) };
        let mut cfg = comm_config(config.blocking, self.nccl_version);
        let mut raw: nccl::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the out-pointer and the config are valid for the call; NCCL copies the config
        // and the id before it returns, and for init it writes `raw` before returning (only
        // split and shrink write their out-pointer later, from the async job).
        let r = unsafe { nccl::ncclCommInitRankConfig(&mut raw, nranks, uid, rank_c, &mut cfg) };
        if let Err(e) = nccl_check("ncclCommInitRankConfig", r) {
            if !raw.is_null() {
                // A failed init still hands out a communicator, which must be released.
                abort_raw(raw);
            }
            return Err(e);
        }
        if raw.is_null() {
            return Err(NcclError::Invalid("ncclCommInitRankConfig returned no communicator".into()));
        }
        Ok(CudaComm::from_raw(raw, self, rank, world_size, config.blocking))
    }
}

impl CudaDevice {
    /// Enqueues the host function that finishes a staged copy.
    fn after_copy(&self, stream: &CudaStream, done: HostCopyDone) -> Result<(), NcclError> {
        let arg = Box::into_raw(Box::new(done));
        // SAFETY: `host_copy_done` takes back the box exactly once, when the stream reaches it;
        // it makes no CUDA call (forbidden in a host function).
        let launched = unsafe { cu_result::stream::launch_host_function(stream.raw(), host_copy_done, arg.cast()) };
        if let Err(e) = launched {
            // SAFETY: CUDA refused the host function, so `arg` was not handed over: this is its
            // only owner.
            let mut done = unsafe { Box::from_raw(arg) };
            // The copy is still queued and uses the chunk: it must never go back to the pool, so
            // it is leaked (a chunk has no Drop).
            let _leaked = done.chunk.take();
            return Err(cuda_err("cuLaunchHostFunc")(e));
        }
        Ok(())
    }
}

/// One NCCL communicator over a [`CudaDevice`].
///
/// # Non-blocking communicators
///
/// [`CommConfig::blocking`]` = false` makes init, split, shrink, finalize and launches
/// non-blocking in NCCL. `init_comm` returns while the communicator is still `InProgress` (poll
/// [`Communicator::async_error`]). `split`, `shrink` and `finalize` wait for NCCL to finish, and
/// so do `enqueue` and `group_end` when NCCL answers `ncclInProgress`, as PyTorch's
/// `C10D_NCCL_CHECK_TIMEOUT` does: an event recorded after them then follows the op on the
/// stream. Those waits poll `ncclCommGetAsyncError`, so an abort from another thread ends them
/// with [`NcclError::Aborted`].
///
/// # Soundness of `Send + Sync`
///
/// The handle is a pointer to NCCL's communicator, which NCCL lets any thread use (NCCL sets the
/// device itself; cohort also binds the context in every method). Two calls on one communicator
/// from two threads at once are not allowed by NCCL, with documented exceptions:
/// `ncclCommGetAsyncError` may be polled from another thread, and a call that blocks (a blocking
/// init, split, finalize, or an op waiting for a connection) is ended by `ncclCommAbort` from
/// another thread. That is what [`CudaComm::abort`] is for, so it takes no lock that a call which
/// may block holds. The process group makes every other call from one thread at a time.
///
/// After `abort` every call returns [`NcclError::Aborted`] without reaching NCCL, and `Drop` does
/// not destroy the freed communicator. Polls of the asynchronous error (also the ones inside
/// `enqueue`, `finalize`, `split` and `shrink` while they wait) are fenced against abort, and
/// against each other, by a lock that only these non-blocking polls hold, so a poll never runs on
/// a communicator an abort has freed. The one interleaving left is a call that may block which
/// read "not aborted" just before another thread's abort and enters NCCL after it (PyTorch's
/// `NCCLComm` has the same window): the process group avoids it by not issuing new calls once it
/// has decided to abort.
#[derive(Debug)]
pub struct CudaComm {
    raw: nccl::ncclComm_t,
    ctx: Arc<CudaContext>,
    ordinal: usize,
    rank: u32,
    world: u32,
    blocking: bool,
    nccl_version: u32,
    /// Set by `raise_abort` and `abort`: every call is refused from then on.
    aborted: AtomicBool,
    /// Set once `abort` went to call `ncclCommAbort` (which frees the communicator).
    abort_called: AtomicBool,
    /// Held around each `ncclCommGetAsyncError`, and taken by `abort` after it raised the
    /// flag and before `ncclCommAbort`: a poll never runs on a communicator an abort frees, and
    /// two polls never race to join NCCL's finished group job (which `ncclCommGetAsyncError`
    /// does on success). Polls never block, so abort waits at most for one of them to return.
    gate: Mutex<()>,
}

// SAFETY: see the type's doc: NCCL communicators are usable from any thread, calls other than
// abort and async-error polling are serialized by the caller, and abort is the documented
// cross-thread call. The other fields are Send + Sync.
unsafe impl Send for CudaComm {}
// SAFETY: as above.
unsafe impl Sync for CudaComm {}

impl CudaComm {
    fn from_raw(raw: nccl::ncclComm_t, dev: &CudaDevice, rank: u32, world: u32, blocking: bool) -> CudaComm {
        CudaComm {
            raw,
            ctx: dev.ctx.clone(),
            ordinal: dev.ordinal,
            rank,
            world,
            blocking,
            nccl_version: dev.nccl_version,
            aborted: AtomicBool::new(false),
            abort_called: AtomicBool::new(false),
            gate: Mutex::new(()),
        }
    }

    fn child(&self, raw: nccl::ncclComm_t, rank: u32, world: u32) -> CudaComm {
        CudaComm {
            raw,
            ctx: self.ctx.clone(),
            ordinal: self.ordinal,
            rank,
            world,
            blocking: self.blocking,
            nccl_version: self.nccl_version,
            aborted: AtomicBool::new(false),
            abort_called: AtomicBool::new(false),
            gate: Mutex::new(()),
        }
    }

    /// Whether it was created blocking ([`CommConfig::blocking`]).
    pub fn is_blocking(&self) -> bool {
        self.blocking
    }

    /// The loaded NCCL's version.
    pub fn nccl_version(&self) -> u32 {
        self.nccl_version
    }

    fn live(&self) -> Result<(), NcclError> {
        if self.aborted.load(Ordering::SeqCst) { Err(NcclError::Aborted) } else { Ok(()) }
    }

    fn bind(&self) -> Result<(), NcclError> {
        self.ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// The device address `buf` names, after checking that `count` elements of `dtype` fit.
    fn span(
        &self,
        call: &'static str,
        what: &str,
        buf: &BufRef<CudaBuffer>,
        count: usize,
        dtype: NcclDataType,
    ) -> Result<*mut c_void, NcclError> {
        if buf.buf.ordinal() != self.ordinal {
            return Err(NcclError::Invalid(format!(
                "{call}: the {what} buffer is on CUDA device {}, the communicator on {}",
                buf.buf.ordinal(),
                self.ordinal
            )));
        }
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| NcclError::Invalid(format!("{call}: {count} elements of {dtype:?} overflow")))?;
        let ptr = buf.buf.device_ptr_at(buf.offset, bytes).map_err(|e| in_call(call, e))?;
        Ok(ptr as *mut c_void)
    }

    /// The address of a buffer NCCL does not touch on this rank (broadcast's input off the root,
    /// reduce's output off the root): not checked against `count`, kept inside the allocation.
    fn untouched(buf: &BufRef<CudaBuffer>) -> *mut c_void {
        (buf.buf.device_ptr() + buf.offset.min(buf.buf.len()) as u64) as *mut c_void
    }

    fn peer(&self, call: &'static str, what: &str, peer: u32) -> Result<c_int, NcclError> {
        if peer >= self.world {
            return Err(NcclError::Invalid(format!(
                "{call}: {what} {peer} is not a rank of a world of {}",
                self.world
            )));
        }
        to_c_int(what, peer)
    }

    /// `ncclCommGetAsyncError` under the gate: [`NcclError::Aborted`] once `abort` ran, never a
    /// poll of a communicator an abort is freeing.
    fn polled_async_error(&self) -> Result<NcclResult, NcclError> {
        self.live()?;
        let _polling = lock(&self.gate);
        self.live()?;
        Self::async_error_code(self.raw)
    }

    /// The raw result of `ncclCommGetAsyncError`, read as an integer (a code this binding does
    /// not know must not become an invalid Rust enum).
    fn async_error_code(raw: nccl::ncclComm_t) -> Result<NcclResult, NcclError> {
        let mut code: c_uint = 0;
        // SAFETY: `raw` is a live communicator (callers check) and `code` is a valid place for
        // the C enum, which is int-sized; Rust only reads it back as an integer.
        let r = unsafe { nccl::ncclCommGetAsyncError(raw, (&raw mut code).cast::<nccl::ncclResult_t>()) };
        nccl_check("ncclCommGetAsyncError", r)?;
        Ok(NcclResult::from_code(code as i32))
    }

    /// The outcome of a call that puts work on a stream: on `ncclInProgress` (a non-blocking
    /// communicator still launching it) it waits until NCCL is done, so that what the caller
    /// enqueues next follows the op on the stream.
    fn settle(&self, call: &'static str, r: nccl::ncclResult_t) -> Result<(), NcclError> {
        match NcclResult::from_code(r as i32) {
            NcclResult::Success => Ok(()),
            NcclResult::InProgress => self.wait_while_in_progress(call),
            result => Err(NcclError::Nccl { call, result }),
        }
    }

    /// Polls this communicator's asynchronous state until it leaves `InProgress`; an abort from
    /// another thread ends the wait with [`NcclError::Aborted`].
    fn wait_while_in_progress(&self, call: &'static str) -> Result<(), NcclError> {
        loop {
            match self.async_error()? {
                NcclResult::Success => return Ok(()),
                NcclResult::InProgress => std::thread::sleep(Duration::from_millis(1)),
                result => return Err(NcclError::Nccl { call, result }),
            }
        }
    }

    /// Finishes `ncclCommSplit`/`ncclCommShrink`: waits for the child and wraps it.
    ///
    /// NCCL writes a child's handle into `out` from the async job when the child is ready, which
    /// for a non-blocking parent is after the call returned: `out` is on the heap, and is leaked
    /// on every path where the job might still be running.
    fn finish_child(
        &self,
        call: &'static str,
        r: nccl::ncclResult_t,
        out: Box<AtomicPtr<nccl::ncclComm>>,
        rank_world: Option<(u32, u32)>,
    ) -> Result<Option<CudaComm>, NcclError> {
        if let Err(e) = nccl_check(call, r) {
            // A job that ran (a blocking parent) and failed may have handed out its child, which
            // must be released; NCCL writes the slot atomically, as the last thing a job does.
            let child = out.load(Ordering::Acquire);
            Box::leak(out);
            if !child.is_null() {
                abort_raw(child);
            }
            return Err(e);
        }
        // The job belongs to the parent: it reports InProgress until the job is done, and the
        // async-error call that sees Success joins it. A blocking parent is done already.
        loop {
            if self.is_aborted() {
                // The abort joins the job, but on another thread: `out` may still be written.
                Box::leak(out);
                return Err(NcclError::Aborted);
            }
            match self.polled_async_error() {
                Ok(NcclResult::InProgress) => std::thread::sleep(Duration::from_millis(1)),
                Ok(NcclResult::Success) => break,
                Ok(result) => {
                    // The job ended (NCCL publishes the error after the job wrote `out`).
                    let child = out.load(Ordering::Acquire);
                    Box::leak(out);
                    if !child.is_null() {
                        abort_raw(child);
                    }
                    return Err(NcclError::Nccl { call, result });
                }
                Err(e) => {
                    Box::leak(out);
                    return Err(e);
                }
            }
        }
        let child = out.load(Ordering::Acquire);
        if child.is_null() {
            return Ok(None);
        }
        let (rank, world) = match rank_world {
            Some(rw) => rw,
            None => match child_rank_world(child) {
                Ok(rw) => rw,
                Err(e) => {
                    abort_raw(child);
                    return Err(e);
                }
            },
        };
        Ok(Some(self.child(child, rank, world)))
    }
}

impl Communicator for CudaComm {
    type Device = CudaDevice;

    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world
    }

    fn enqueue(&self, op: CommOp<CudaBuffer>, stream: &CudaStream) -> Result<(), NcclError> {
        self.live()?;
        let call = op.call_name();
        let s: nccl::cudaStream_t = stream.raw().cast();
        let world = self.world as usize;
        let times_world = |count: usize| {
            count.checked_mul(world).ok_or_else(|| NcclError::Invalid(format!("{call}: {count} × {world} overflows")))
        };
        let c = self.raw;
        // Every pointer is checked (`span`, `peer`) before the call it goes into.
        let r = match op {
            CommOp::AllReduce { send, recv, count, dtype, op } => {
                let sp = self.span(call, "send", &send, count, dtype)?;
                let rp = self.span(call, "recv", &recv, count, dtype)?;
                self.bind()?;
                // SAFETY (for this and the arms below): the pointers lie inside live device
                // buffers of this device with room for what NCCL reads and writes (checked by
                // `span`), `c` is live (checked by `live`), the stream belongs to the device.
                // The caller keeps the buffers alive until the op completes on the stream.
                unsafe { nccl::ncclAllReduce(sp, rp, count, sys_dtype(dtype), sys_op(op), c, s) }
            }
            CommOp::Broadcast { send, recv, count, dtype, root } => {
                let root_c = self.peer(call, "root", root)?;
                let sp = if self.rank == root {
                    self.span(call, "send", &send, count, dtype)?
                } else {
                    Self::untouched(&send)
                };
                let rp = self.span(call, "recv", &recv, count, dtype)?;
                self.bind()?;
                // SAFETY: as for AllReduce; off the root NCCL does not read `sp`.
                unsafe { nccl::ncclBroadcast(sp, rp, count, sys_dtype(dtype), root_c, c, s) }
            }
            CommOp::Reduce { send, recv, count, dtype, op, root } => {
                let root_c = self.peer(call, "root", root)?;
                let sp = self.span(call, "send", &send, count, dtype)?;
                let rp = if self.rank == root {
                    self.span(call, "recv", &recv, count, dtype)?
                } else {
                    Self::untouched(&recv)
                };
                self.bind()?;
                // SAFETY: as for AllReduce; off the root NCCL does not write `rp`.
                unsafe { nccl::ncclReduce(sp, rp, count, sys_dtype(dtype), sys_op(op), root_c, c, s) }
            }
            CommOp::AllGather { send, recv, count, dtype } => {
                let sp = self.span(call, "send", &send, count, dtype)?;
                let rp = self.span(call, "recv", &recv, times_world(count)?, dtype)?;
                self.bind()?;
                // SAFETY: as for AllReduce, with `recv` holding count × world elements.
                unsafe { nccl::ncclAllGather(sp, rp, count, sys_dtype(dtype), c, s) }
            }
            CommOp::ReduceScatter { send, recv, count, dtype, op } => {
                let sp = self.span(call, "send", &send, times_world(count)?, dtype)?;
                let rp = self.span(call, "recv", &recv, count, dtype)?;
                self.bind()?;
                // SAFETY: as for AllReduce, with `send` holding count × world elements.
                unsafe { nccl::ncclReduceScatter(sp, rp, count, sys_dtype(dtype), sys_op(op), c, s) }
            }
            CommOp::Send { buf, count, dtype, peer } => {
                let peer_c = self.peer(call, "peer", peer)?;
                let p = self.span(call, "send", &buf, count, dtype)?;
                self.bind()?;
                // SAFETY: as for AllReduce.
                unsafe { nccl::ncclSend(p, count, sys_dtype(dtype), peer_c, c, s) }
            }
            CommOp::Recv { buf, count, dtype, peer } => {
                let peer_c = self.peer(call, "peer", peer)?;
                let p = self.span(call, "recv", &buf, count, dtype)?;
                self.bind()?;
                // SAFETY: as for AllReduce.
                unsafe { nccl::ncclRecv(p, count, sys_dtype(dtype), peer_c, c, s) }
            }
        };
        self.settle(call, r)
    }

    fn group_start(&self) -> Result<(), NcclError> {
        self.live()?;
        self.bind()?;
        // SAFETY: no arguments; NCCL keeps the group per thread.
        nccl_check("ncclGroupStart", unsafe { nccl::ncclGroupStart() })
    }

    fn group_end(&self) -> Result<(), NcclError> {
        self.live()?;
        self.bind()?;
        // SAFETY: no arguments.
        let r = unsafe { nccl::ncclGroupEnd() };
        self.settle("ncclGroupEnd", r)
    }

    fn async_error(&self) -> Result<NcclResult, NcclError> {
        self.polled_async_error()
    }

    fn raise_abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        if self.abort_called.swap(true, Ordering::SeqCst) {
            return;
        }
        // Polls that started before the flag was set finish first (they do not block); later
        // ones take the gate after this and see the flag, so none reaches NCCL from here on.
        // The gate is not held across ncclCommAbort, which can block for as long as a stream
        // it waits on is held: a poll must still answer `Aborted` meanwhile. Calls that may
        // block take no lock: abort must reach them.
        drop(lock(&self.gate));
        // Best effort: NCCL sets the communicator's device itself.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `raw` is live (this is the first and only abort; Drop skips an aborted
        // communicator). ncclCommAbort is documented as callable while another thread is blocked
        // in a call on the same communicator: it raises the abort flag that call polls, joins the
        // init/split job if one runs, and frees the communicator.
        let r = unsafe { nccl::ncclCommAbort(self.raw) };
        if let Err(e) = nccl_check("ncclCommAbort", r) {
            tracing::warn!(error = %e, "aborting an NCCL communicator failed");
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<CudaComm>, NcclError> {
        self.live()?;
        require_version("ncclCommSplit", self.nccl_version, 2, 18)?;
        let color_c = match color {
            Some(c) => to_c_int("split color", c)?,
            None => SPLIT_NOCOLOR,
        };
        let key_c = to_c_int("split key", key)?;
        self.bind()?;
        let mut cfg = comm_config(self.blocking, self.nccl_version);
        let out = Box::new(AtomicPtr::new(std::ptr::null_mut()));
        // SAFETY: the parent is live; NCCL reads the config before it returns; `out` is a heap
        // slot that outlives the async job that writes it (see finish_child).
        let r = unsafe { nccl::ncclCommSplit(self.raw, color_c, key_c, out.as_ptr(), &mut cfg) };
        let child = self.finish_child("ncclCommSplit", r, out, None)?;
        match (color, child) {
            (Some(_), None) => Err(NcclError::Invalid("ncclCommSplit returned no communicator".into())),
            (None, Some(unexpected)) => {
                unexpected.abort();
                Ok(None)
            }
            (_, child) => Ok(child),
        }
    }

    fn shrink(&self, exclude: &[u32]) -> Result<CudaComm, NcclError> {
        self.live()?;
        require_version("ncclCommShrink", self.nccl_version, 2, 27)?;
        let (excluded, rank, world) = shrunk(self.rank, self.world, exclude)?;
        if excluded.is_empty() {
            // NCCL refuses an empty exclude list (excludeRanksCount must be > 0). The ranks not
            // excluded are then all of them, in order: what a split with one color and the rank
            // as key makes.
            return self
                .split(Some(0), self.rank)?
                .ok_or_else(|| NcclError::Invalid("ncclCommSplit returned no communicator".into()));
        }
        let mut list = excluded.iter().map(|&r| to_c_int("excluded rank", r)).collect::<Result<Vec<c_int>, _>>()?;
        let count = to_c_int("excluded ranks", list.len() as u32)?;
        self.bind()?;
        let mut cfg = comm_config(self.blocking, self.nccl_version);
        let out = Box::new(AtomicPtr::new(std::ptr::null_mut()));
        // SAFETY: the parent is live; NCCL sorts `list` in place and copies it, and reads the
        // config, before it returns; `out` outlives the job that writes it (see finish_child).
        let r =
            unsafe { nccl::ncclCommShrink(self.raw, list.as_mut_ptr(), count, out.as_ptr(), &mut cfg, SHRINK_DEFAULT) };
        self.finish_child("ncclCommShrink", r, out, Some((rank, world)))?
            .ok_or_else(|| NcclError::Invalid("ncclCommShrink returned no communicator".into()))
    }

    fn finalize(&self) -> Result<(), NcclError> {
        self.live()?;
        require_version("ncclCommFinalize", self.nccl_version, 2, 14)?;
        self.bind()?;
        // SAFETY: the communicator is live.
        nccl_check("ncclCommFinalize", unsafe { nccl::ncclCommFinalize(self.raw) })?;
        self.wait_while_in_progress("ncclCommFinalize")
    }
}

impl Drop for CudaComm {
    fn drop(&mut self) {
        if *self.abort_called.get_mut() {
            return; // ncclCommAbort freed it
        }
        let _ = self.ctx.bind_to_thread();
        if *self.aborted.get_mut() {
            // Raised but never called: ncclCommAbort frees it now.
            abort_raw(self.raw);
            return;
        }
        // A communicator still initializing, or broken, is released with ncclCommAbort (NCCL's
        // advice after an error; ncclCommDestroy refuses one that is still in progress).
        if matches!(Self::async_error_code(self.raw), Ok(NcclResult::Success)) {
            // SAFETY: live, not aborted, and dropped once.
            let r = unsafe { nccl::ncclCommDestroy(self.raw) };
            if let Err(e) = nccl_check("ncclCommDestroy", r) {
                tracing::warn!(error = %e, "destroying an NCCL communicator failed");
            }
        } else {
            abort_raw(self.raw);
        }
    }
}

/// A stream made to wait, on the device, for a flag in pinned host memory
/// (`cuStreamWaitValue32_v2` on `cuMemHostAlloc` memory): [`CudaBlocker::block`] hangs a stream
/// for real, [`CudaBlocker::release`] lets every stream it blocked go on. This is how the GPU
/// tests make a real hang.
#[derive(Debug)]
pub struct CudaBlocker {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    /// 4 bytes of pinned, device-mapped host memory.
    flag: *mut u32,
    flag_device: cu::CUdeviceptr,
    /// The value the latest `block` waits for; `release` writes it.
    issued: AtomicU32,
    wait_value: WaitValue32,
    /// An event recorded after each wait: the flag may be freed once they all completed.
    passed: Mutex<Vec<cud::CudaEvent>>,
}

// SAFETY: the flag is pinned host memory owned by the blocker and only accessed through atomic
// operations (the device reads it, which Rust's model does not see); the CUDA handles are
// usable from any thread once the context is current, which every method makes it.
unsafe impl Send for CudaBlocker {}
// SAFETY: as above.
unsafe impl Sync for CudaBlocker {}

type WaitValue32 = unsafe extern "C" fn(cu::CUstream, cu::CUdeviceptr, u32, c_uint) -> cu::CUresult;

impl CudaBlocker {
    /// A blocker on `dev`, released.
    pub fn new(dev: &CudaDevice) -> Result<CudaBlocker, NcclError> {
        dev.bind()?;
        // SAFETY: the signature is cuStreamWaitValue32_v2's.
        let wait_value = unsafe { driver_fn::<WaitValue32>("cuStreamWaitValue32_v2") }.ok_or_else(|| {
            NcclError::Unavailable(
                "this CUDA driver has no cuStreamWaitValue32_v2 (it needs CUDA 11.7 or later)".into(),
            )
        })?;
        let flags = cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain pinned allocation of 4 bytes, initialized below before any use.
        let host = unsafe { cu_result::malloc_host(std::mem::size_of::<u32>(), flags) }
            .map_err(cuda_err("cuMemHostAlloc"))?
            .cast::<u32>();
        // SAFETY: `host` is 4 fresh, page-aligned bytes owned here.
        unsafe { host.write(0) };
        let mut flag_device: cu::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with CU_MEMHOSTALLOC_DEVICEMAP in this context.
        let mapped = unsafe { cu::cuMemHostGetDevicePointer_v2(&mut flag_device, host.cast(), 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: allocated above by cuMemHostAlloc and never handed out.
            let _ = unsafe { cu_result::free_host(host.cast()) };
            return Err(cuda_err("cuMemHostGetDevicePointer")(e));
        }
        Ok(CudaBlocker {
            ctx: dev.ctx.clone(),
            ordinal: dev.ordinal,
            flag: host,
            flag_device,
            issued: AtomicU32::new(0),
            wait_value,
            passed: Mutex::new(Vec::new()),
        })
    }

    /// Makes `stream` wait, on the device, until the next [`CudaBlocker::release`]: everything
    /// enqueued on it afterwards stays pending.
    pub fn block(&self, stream: &CudaStream) -> Result<(), NcclError> {
        let on = stream.inner.context().ordinal();
        if on != self.ordinal {
            return Err(NcclError::Invalid(format!(
                "the blocker is on CUDA device {}, the stream on {on}",
                self.ordinal
            )));
        }
        self.ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let target = self.issued.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
        let geq = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as c_uint;
        // SAFETY: the function has the declared signature; `flag_device` maps 4 live bytes of
        // pinned memory that stay allocated until every wait has passed (see Drop). GEQ is a
        // cyclic comparison, so the counter may wrap.
        unsafe { (self.wait_value)(stream.raw(), self.flag_device, target, geq) }
            .result()
            .map_err(cuda_err("cuStreamWaitValue32"))?;
        let passed = self.ctx.new_event(None).map_err(cuda_err("cuEventCreate"))?;
        passed.record(&stream.inner).map_err(cuda_err("cuEventRecord"))?;
        let mut waits = lock(&self.passed);
        waits.retain(|e| !matches!(e.try_is_complete(), Ok(true)));
        waits.push(passed);
        Ok(())
    }

    /// Lets every stream blocked so far go on.
    pub fn release(&self) {
        let value = self.issued.load(Ordering::SeqCst);
        self.flag_atomic().store(value, Ordering::SeqCst);
    }

    fn flag_atomic(&self) -> &AtomicU32 {
        // SAFETY: `flag` points to 4 live, page-aligned bytes of pinned memory that the blocker
        // owns until Drop, and the host only ever accesses them atomically.
        unsafe { AtomicU32::from_ptr(self.flag) }
    }
}

impl Drop for CudaBlocker {
    fn drop(&mut self) {
        self.release();
        let deadline = Instant::now() + Duration::from_secs(2);
        let passed = std::mem::take(self.passed.get_mut().unwrap_or_else(|p| p.into_inner()));
        let all_passed = self.ctx.bind_to_thread().is_ok()
            && passed.iter().all(|e| {
                loop {
                    match e.try_is_complete() {
                        Ok(true) => break true,
                        Ok(false) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                        _ => break false,
                    }
                }
            });
        if all_passed {
            // SAFETY: allocated by cuMemHostAlloc in `new`; every wait that read it has passed.
            let _ = unsafe { cu_result::free_host(self.flag.cast()) };
        } else {
            // A stream may still read the flag: leaking 4 bytes beats a device reading freed memory.
            tracing::warn!("a stream blocked by a CudaBlocker did not pass its wait: its flag is leaked");
        }
    }
}

#[cfg(test)]
impl super::conformance::StreamBlocker<CudaDevice> for CudaBlocker {
    fn block(&self, dev: &CudaDevice, stream: &CudaStream) -> Result<(), NcclError> {
        if dev.ordinal != self.ordinal {
            return Err(NcclError::Invalid(format!(
                "the blocker is on CUDA device {}, the stream on {}",
                self.ordinal, dev.ordinal
            )));
        }
        CudaBlocker::block(self, stream)
    }

    fn release(&self) {
        CudaBlocker::release(self)
    }
}

// ---- helpers -------------------------------------------------------------------------------

/// NCCL's `NCCL_SPLIT_NOCOLOR`.
const SPLIT_NOCOLOR: c_int = -1;
/// NCCL's `NCCL_SHRINK_DEFAULT`: no ops in flight on the parent (NCCL_SHRINK_ABORT would abort
/// them first).
const SHRINK_DEFAULT: c_int = 0;
/// NCCL's `NCCL_CONFIG_UNDEF_INT`.
const CONFIG_UNDEF_INT: c_int = i32::MIN;
/// NCCL's `ncclConfig_t` magic.
const CONFIG_MAGIC: c_uint = 0xcafe_beef;

/// `ncclConfig_t` as `NCCL_CONFIG_INITIALIZER` fills it, with `blocking` set and the version
/// from [`config_version`].
fn comm_config(blocking: bool, loaded: u32) -> nccl::ncclConfig_t {
    nccl::ncclConfig_t {
        size: std::mem::size_of::<nccl::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: config_version(loaded),
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

/// cudarc's `ncclDataType_t` for ours.
fn sys_dtype(t: NcclDataType) -> nccl::ncclDataType_t {
    use nccl::ncclDataType_t as T;
    match t {
        NcclDataType::Int8 => T::ncclInt8,
        NcclDataType::Uint8 => T::ncclUint8,
        NcclDataType::Int32 => T::ncclInt32,
        NcclDataType::Uint32 => T::ncclUint32,
        NcclDataType::Int64 => T::ncclInt64,
        NcclDataType::Uint64 => T::ncclUint64,
        NcclDataType::Float16 => T::ncclFloat16,
        NcclDataType::Float32 => T::ncclFloat32,
        NcclDataType::Float64 => T::ncclFloat64,
        NcclDataType::Bfloat16 => T::ncclBfloat16,
    }
}

/// cudarc's `ncclRedOp_t` for ours.
fn sys_op(op: NcclRedOp) -> nccl::ncclRedOp_t {
    use nccl::ncclRedOp_t as O;
    match op {
        NcclRedOp::Sum => O::ncclSum,
        NcclRedOp::Prod => O::ncclProd,
        NcclRedOp::Max => O::ncclMax,
        NcclRedOp::Min => O::ncclMin,
        NcclRedOp::Avg => O::ncclAvg,
    }
}

/// An NCCL result as a `Result`, naming the call; `ncclInProgress` is success (a non-blocking
/// communicator's calls return it, completion is polled with `async_error`).
fn nccl_check(call: &'static str, r: nccl::ncclResult_t) -> Result<(), NcclError> {
    match NcclResult::from_code(r as i32) {
        NcclResult::Success | NcclResult::InProgress => Ok(()),
        result => Err(NcclError::Nccl { call, result }),
    }
}

/// Turns a CUDA driver error into [`NcclError::Cuda`] naming `call`.
fn cuda_err(call: &'static str) -> impl FnOnce(DriverError) -> NcclError {
    move |e| NcclError::Cuda {
        call,
        code: e.0 as i32,
        message: e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0)),
    }
}

/// Prefixes an argument error with the call it was found in.
fn in_call(call: &str, e: NcclError) -> NcclError {
    match e {
        NcclError::Invalid(m) => NcclError::Invalid(format!("{call}: {m}")),
        other => other,
    }
}

fn to_c_int(what: &str, v: u32) -> Result<c_int, NcclError> {
    c_int::try_from(v).map_err(|_| NcclError::Invalid(format!("{what} {v} is too large for NCCL")))
}

/// Whether `bytes` bytes at `offset` fit in `len`.
fn check_range(len: usize, offset: usize, bytes: usize) -> Result<(), NcclError> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(NcclError::Invalid(format!("{bytes} bytes at offset {offset} do not fit in a buffer of {len} bytes"))),
    }
}

/// The sorted, deduplicated excluded ranks, and this rank's rank and the world size after a
/// shrink; an excluded rank must not call shrink.
fn shrunk(rank: u32, world: u32, exclude: &[u32]) -> Result<(Vec<u32>, u32, u32), NcclError> {
    let mut excluded = exclude.to_vec();
    excluded.sort_unstable();
    excluded.dedup();
    if let Some(&bad) = excluded.iter().find(|&&r| r >= world) {
        return Err(NcclError::Invalid(format!("shrink: rank {bad} is not a rank of a world of {world}")));
    }
    if excluded.binary_search(&rank).is_ok() {
        return Err(NcclError::Invalid(format!("shrink: rank {rank} is excluded, so it must not call shrink")));
    }
    let below = excluded.iter().filter(|&&r| r < rank).count() as u32;
    let world_after = world - excluded.len() as u32;
    Ok((excluded, rank - below, world_after))
}

/// NCCL's version as `major*10000 + minor*100 + patch`; NCCL before 2.9 encoded it as
/// `major*1000 + minor*100 + patch`.
fn decode_nccl_version(v: u32) -> u32 {
    if v < 10_000 { nccl_version_code(v / 1000, (v % 1000) / 100, v % 100) } else { v }
}

fn loaded_nccl_version() -> Result<u32, NcclError> {
    let mut v: c_int = 0;
    // SAFETY: ncclGetVersion exists in every NCCL 2.x and writes one int; probe() found NCCL.
    nccl_check("ncclGetVersion", unsafe { nccl::ncclGetVersion(&mut v) })?;
    let v = u32::try_from(v).map_err(|_| NcclError::Invalid(format!("ncclGetVersion returned {v}")))?;
    Ok(decode_nccl_version(v))
}

/// The rank and size of a ready communicator, asked of NCCL.
fn child_rank_world(raw: nccl::ncclComm_t) -> Result<(u32, u32), NcclError> {
    let (mut rank, mut count): (c_int, c_int) = (0, 0);
    // SAFETY: `raw` is a live, ready communicator and the out-pointers are valid.
    nccl_check("ncclCommUserRank", unsafe { nccl::ncclCommUserRank(raw, &mut rank) })?;
    // SAFETY: as above.
    nccl_check("ncclCommCount", unsafe { nccl::ncclCommCount(raw, &mut count) })?;
    let bad = || NcclError::Invalid(format!("NCCL reported rank {rank} of {count}"));
    Ok((u32::try_from(rank).map_err(|_| bad())?, u32::try_from(count).map_err(|_| bad())?))
}

/// `ncclCommAbort` on a handle no [`CudaComm`] owns (a failed init or split's leftover).
fn abort_raw(raw: nccl::ncclComm_t) {
    // SAFETY: `raw` is a communicator NCCL handed out and nobody else holds.
    let r = unsafe { nccl::ncclCommAbort(raw) };
    if let Err(e) = nccl_check("ncclCommAbort", r) {
        tracing::warn!(error = %e, "releasing a failed NCCL communicator failed");
    }
}

/// A driver function by name, or `None` when the loaded driver lacks it (cudarc would panic).
///
/// # Safety
/// `F` must be the function's C signature, and `libcuda` must have been found by [`probe`]
/// (every caller holds a [`CudaDevice`]).
unsafe fn driver_fn<F: Copy>(name: &str) -> Option<F> {
    // SAFETY: the caller vouches for `F` and for the library; it stays loaded for the process
    // (cudarc keeps it in a static), so the function pointer outlives the symbol handle.
    unsafe { cu::culib().get::<F>(name.as_bytes()).ok().map(|s| *s) }
}

type ElapsedTime = unsafe extern "C" fn(*mut f32, cu::CUevent, cu::CUevent) -> cu::CUresult;

/// `cuEventElapsedTime_v2` (CUDA ≥ 12.8), else `cuEventElapsedTime`, on two completed events.
fn elapsed_ms(start: cu::CUevent, end: cu::CUevent) -> Result<f32, NcclError> {
    static ELAPSED: OnceLock<Option<ElapsedTime>> = OnceLock::new();
    // SAFETY: both names have this signature; a CudaDevice exists (the caller's), so libcuda was
    // found.
    let f = ELAPSED.get_or_init(|| unsafe {
        driver_fn::<ElapsedTime>("cuEventElapsedTime_v2").or_else(|| driver_fn::<ElapsedTime>("cuEventElapsedTime"))
    });
    let f = f.ok_or_else(|| NcclError::Unavailable("this CUDA driver has no cuEventElapsedTime".into()))?;
    let mut ms = 0f32;
    // SAFETY: live events of the current context and a valid out-pointer; both events are
    // complete, so the call does not wait.
    unsafe { f(&mut ms, start, end) }.result().map_err(cuda_err("cuEventElapsedTime"))?;
    Ok(ms)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves the data whole: a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Pinned host memory for one staged copy (`cuMemHostAlloc`).
///
/// It has no `Drop`: chunks come back from CUDA host functions, which must not call CUDA, so they
/// are freed only by [`Staging::take`] and [`Staging::close`] on a caller's thread, and a chunk
/// lost on the way (a failed launch, a panic, a closed pool) is leaked, never freed in the wrong
/// place.
#[derive(Debug)]
struct PinnedChunk {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: plain host memory owned by whoever holds the chunk; nothing ties it to a thread.
unsafe impl Send for PinnedChunk {}

/// Idle pinned chunks, reused by later copies.
#[derive(Debug, Default)]
struct Staging {
    state: Mutex<StagingState>,
}

#[derive(Debug, Default)]
struct StagingState {
    idle: Vec<PinnedChunk>,
    /// Set by the device's drop: chunks coming back later are leaked.
    closed: bool,
}

/// Idle chunks kept beyond this are freed by the next `take`.
const MAX_IDLE_CHUNKS: usize = 8;
/// The smallest chunk allocated.
const MIN_CHUNK: usize = 64 * 1024;

impl Staging {
    /// A chunk of at least `len` bytes. The context must be current.
    fn take(&self, len: usize) -> Result<PinnedChunk, NcclError> {
        {
            let mut st = lock(&self.state);
            while st.idle.len() > MAX_IDLE_CHUNKS {
                let smallest = (0..st.idle.len()).min_by_key(|&i| st.idle[i].cap).expect("the pool is not empty");
                free_chunk(st.idle.swap_remove(smallest));
            }
            let best = (0..st.idle.len()).filter(|&i| st.idle[i].cap >= len).min_by_key(|&i| st.idle[i].cap);
            if let Some(i) = best {
                return Ok(st.idle.swap_remove(i));
            }
        }
        let cap = len.max(MIN_CHUNK).checked_next_power_of_two().unwrap_or(len);
        // SAFETY: a plain pinned allocation; the chunk's users write before they read.
        let ptr = unsafe { cu_result::malloc_host(cap, 0) }.map_err(cuda_err("cuMemHostAlloc"))?;
        Ok(PinnedChunk { ptr: ptr.cast(), cap })
    }

    /// Puts a chunk no copy uses any more back in the pool. Called from CUDA host functions:
    /// makes no CUDA call.
    fn give_back(&self, chunk: PinnedChunk) {
        let mut st = lock(&self.state);
        if !st.closed {
            st.idle.push(chunk);
        }
    }

    /// Frees the idle chunks; chunks still in flight are leaked when they come back. The context
    /// must be current.
    fn close(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        for chunk in st.idle.drain(..) {
            free_chunk(chunk);
        }
    }
}

fn free_chunk(chunk: PinnedChunk) {
    // SAFETY: the chunk came from cuMemHostAlloc in Staging::take and no copy uses it (it was
    // idle in the pool).
    if let Err(e) = unsafe { cu_result::free_host(chunk.ptr.cast()) } {
        tracing::warn!(error = %cuda_err("cuMemFreeHost")(e), "freeing pinned staging memory failed");
    }
}

/// What the host function after a staged copy does: copy the chunk into the host buffer (for a
/// device-to-host copy), then give the chunk back.
struct HostCopyDone {
    staging: Arc<Staging>,
    chunk: Option<PinnedChunk>,
    to_host: Option<(HostBuffer, usize)>,
}

impl HostCopyDone {
    fn run(&mut self) {
        let Some(chunk) = self.chunk.take() else { return };
        if let Some((dst, len)) = &self.to_host {
            // SAFETY: the chunk holds at least `len` bytes, which the device-to-host copy before
            // this host function (stream order) has written; nothing else uses the chunk until it
            // is given back below.
            let bytes = unsafe { std::slice::from_raw_parts(chunk.ptr, *len) };
            // The length was checked against the buffer when the copy was enqueued, and a
            // HostBuffer never changes length.
            let _ = dst.write(0, bytes);
        }
        self.staging.give_back(chunk);
    }
}

/// The CUDA host function after a staged copy.
///
/// # Safety
/// `arg` is a `Box<HostCopyDone>` turned into a raw pointer by `CudaDevice::after_copy`, and CUDA
/// calls this once per launch.
unsafe extern "C" fn host_copy_done(arg: *mut c_void) {
    // SAFETY: see the function's contract.
    let mut done = unsafe { Box::from_raw(arg.cast::<HostCopyDone>()) };
    // A panic must not unwind into CUDA; on one, the chunk is leaked with the box's contents.
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| done.run()));
    // Dropping `done` makes no CUDA call: chunks have no Drop, and the pool is freed only by
    // the device's drop, on a caller's thread.
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::super::device::version_text;
    use super::*;

    // ---- without a GPU ------------------------------------------------------------------------

    #[test]
    fn without_the_libraries_the_device_is_unavailable_and_names_them() {
        // SAFETY: only tries to dlopen the candidate names.
        let cuda = unsafe { cu::is_culib_present() };
        // SAFETY: as above.
        let nccl_present = unsafe { nccl::is_culib_present() };
        let unavailable = |e: NcclError| match e {
            NcclError::Unavailable(m) => m,
            other => panic!("expected Unavailable, got {other:?}"),
        };
        match (cuda, nccl_present) {
            (false, _) => {
                let probed = unavailable(probe().unwrap_err());
                assert!(probed.contains("libcuda.so could not be loaded"), "{probed}");
                let made = CudaDevice::new(0).unwrap_err();
                assert!(made.to_string().starts_with("NCCL backend unavailable: libcuda.so"), "{made}");
            }
            (true, false) => {
                let probed = unavailable(probe().unwrap_err());
                assert!(probed.contains("libnccl.so could not be loaded"), "{probed}");
                assert!(probed.contains("LD_LIBRARY_PATH"), "{probed}");
                let made = unavailable(CudaDevice::new(0).unwrap_err());
                assert_eq!(made, probed);
            }
            (true, true) => {
                probe().expect("both libraries load, so probe agrees");
                match CudaDevice::new(0) {
                    Ok(dev) => assert!(dev.nccl_version().unwrap() >= nccl_version_code(2, 0, 0)),
                    Err(NcclError::Unavailable(m)) => {
                        assert_eq!(device_count().unwrap(), 0, "{m}");
                        assert!(m.contains("no CUDA device"), "{m}");
                    }
                    Err(e) => panic!("CUDA and NCCL load but the device fails: {e}"),
                }
            }
        }
    }

    #[test]
    fn dtype_and_op_codes_match_cudarcs_enums() {
        for code in 0..10 {
            let t = NcclDataType::from_code(code).unwrap();
            assert_eq!(sys_dtype(t) as i32, t.code(), "{t:?}");
        }
        assert_eq!(sys_dtype(NcclDataType::Bfloat16), nccl::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl::ncclDataType_t::ncclBfloat16 as i32, 9);
        assert_eq!(sys_dtype(NcclDataType::Float16), nccl::ncclDataType_t::ncclHalf);
        for code in 0..5 {
            let op = NcclRedOp::from_code(code).unwrap();
            assert_eq!(sys_op(op) as i32, op.code(), "{op:?}");
        }
        assert_eq!(sys_op(NcclRedOp::Avg), nccl::ncclRedOp_t::ncclAvg);
        assert_eq!(nccl::ncclRedOp_t::ncclAvg as i32, 4);
    }

    #[test]
    fn nccl_results_map_by_code_and_in_progress_is_not_an_error() {
        use nccl::ncclResult_t as R;
        assert!(nccl_check("ncclAllReduce", R::ncclSuccess).is_ok());
        assert!(nccl_check("ncclAllReduce", R::ncclInProgress).is_ok());
        let e = nccl_check("ncclAllReduce", R::ncclRemoteError).unwrap_err();
        assert!(matches!(e, NcclError::Nccl { call: "ncclAllReduce", result: NcclResult::RemoteError }), "{e:?}");
        assert_eq!(e.to_string(), "ncclAllReduce failed: remote process exited or there was a network error (6)");
        for (raw, ours) in [
            (R::ncclUnhandledCudaError, NcclResult::UnhandledCudaError),
            (R::ncclSystemError, NcclResult::SystemError),
            (R::ncclInternalError, NcclResult::InternalError),
            (R::ncclInvalidArgument, NcclResult::InvalidArgument),
            (R::ncclInvalidUsage, NcclResult::InvalidUsage),
            (R::ncclTimeout, NcclResult::Other(8)),
        ] {
            assert_eq!(NcclResult::from_code(raw as i32), ours);
        }
    }

    #[test]
    fn the_config_is_nccls_initializer_with_the_older_version() {
        // cudarc's nccl-02030 layout: size, magic, version, 4 ints, a pointer, 2 ints, a pointer,
        // 9 ints, padded to 8. A cudarc update that changes the struct must revisit
        // BINDING_NCCL_VERSION and comm_config.
        assert_eq!(std::mem::size_of::<nccl::ncclConfig_t>(), 96);
        let older = comm_config(false, nccl_version_code(2, 21, 5));
        assert_eq!(older.version, 22105);
        assert_eq!(older.size, 96);
        assert_eq!(older.magic, 0xcafe_beef);
        assert_eq!(older.blocking, 0);
        let newer = comm_config(true, nccl_version_code(2, 31, 2));
        assert_eq!(newer.version, BINDING_NCCL_VERSION);
        assert_eq!(newer.blocking, 1);
        for v in [
            newer.cgaClusterSize,
            newer.minCTAs,
            newer.maxCTAs,
            newer.splitShare,
            newer.trafficClass,
            newer.collnetEnable,
            newer.CTAPolicy,
            newer.shrinkShare,
            newer.nvlsCTAs,
            newer.nChannelsPerNetPeer,
            newer.nvlinkCentricSched,
            newer.graphUsageMode,
            newer.numRmaCtx,
            newer.maxP2pPeers,
        ] {
            assert_eq!(v, i32::MIN);
        }
        assert!(newer.netName.is_null() && newer.commName.is_null());
    }

    #[test]
    fn old_and_new_nccl_version_encodings_decode_alike() {
        assert_eq!(decode_nccl_version(2804), nccl_version_code(2, 8, 4));
        assert_eq!(decode_nccl_version(22703), nccl_version_code(2, 27, 3));
        assert_eq!(version_text(decode_nccl_version(2804)), "2.8.4");
    }

    #[test]
    fn buffer_ranges_are_checked() {
        assert!(check_range(16, 0, 16).is_ok());
        assert!(check_range(16, 8, 8).is_ok());
        assert!(check_range(0, 0, 0).is_ok());
        let e = check_range(16, 8, 12).unwrap_err().to_string();
        assert_eq!(e, "invalid argument: 12 bytes at offset 8 do not fit in a buffer of 16 bytes");
        assert!(check_range(16, usize::MAX, 2).is_err());
        let e = in_call("ncclAllReduce", check_range(4, 0, 8).unwrap_err()).to_string();
        assert!(e.starts_with("invalid argument: ncclAllReduce: 8 bytes"), "{e}");
    }

    #[test]
    fn shrink_renumbers_the_remaining_ranks_in_order() {
        assert_eq!(shrunk(3, 5, &[1, 4, 1]).unwrap(), (vec![1, 4], 2, 3));
        assert_eq!(shrunk(0, 2, &[]).unwrap(), (vec![], 0, 2));
        let e = shrunk(1, 4, &[1]).unwrap_err().to_string();
        assert!(e.contains("rank 1 is excluded"), "{e}");
        let e = shrunk(0, 4, &[7]).unwrap_err().to_string();
        assert!(e.contains("rank 7 is not a rank of a world of 4"), "{e}");
    }

    // ---- on a GPU (ignored here: scripts/gpu-tests.sh runs them) ---------------------------------

    fn gpu() -> CudaDevice {
        CudaDevice::new(0).unwrap_or_else(|e| panic!("no usable GPU here ({e}): these tests fail rather than skip"))
    }

    /// Polls `comm` until it leaves InProgress, for at most `limit`.
    fn wait_ready(comm: &CudaComm, limit: Duration) -> Vec<NcclResult> {
        let start = Instant::now();
        let mut seen = Vec::new();
        loop {
            let state = comm.async_error().expect("async error");
            if seen.last() != Some(&state) {
                seen.push(state);
            }
            if state != NcclResult::InProgress {
                return seen;
            }
            assert!(start.elapsed() < limit, "still in progress after {limit:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn world_of_one(dev: &CudaDevice, config: CommConfig) -> CudaComm {
        let id = dev.unique_id().expect("unique id");
        let comm = dev.init_comm(&id, 1, 0, config).expect("init");
        let seen = wait_ready(&comm, Duration::from_secs(60));
        assert_eq!(seen.last(), Some(&NcclResult::Success), "init states {seen:?}");
        comm
    }

    #[test]
    #[ignore = "needs a GPU: run scripts/gpu-tests.sh on a GPU machine"]
    fn gpu_probe_finds_cuda_nccl_and_a_device() {
        let dev = gpu();
        println!(
            "device 0: {} (driver {}, NCCL {}; bindings {})",
            dev.name().unwrap_or_default(),
            dev.driver_version(),
            version_text(dev.nccl_version().unwrap()),
            version_text(BINDING_NCCL_VERSION),
        );
        assert!(dev.nccl_version().unwrap() >= nccl_version_code(2, 14, 0), "cohort needs NCCL 2.14 or later");
    }

    #[test]
    #[ignore = "needs a GPU: run scripts/gpu-tests.sh on a GPU machine"]
    fn gpu_conformance_suite_passes_on_cuda() {
        let dev = gpu();
        let blocker = CudaBlocker::new(&dev).expect("blocker");
        let results = super::super::conformance::run_all(&dev, &blocker);
        assert!(!results.is_empty(), "the conformance suite ran no case");
        let mut failed = Vec::new();
        for (name, result) in &results {
            match result {
                Ok(()) => println!("conformance {name}: ok"),
                Err(why) => {
                    println!("conformance {name}: FAILED: {why}");
                    failed.push(*name);
                }
            }
        }
        assert!(failed.is_empty(), "conformance cases failed on CUDA: {failed:?}");
    }

    /// A hang inside NCCL that its abort exists for: a non-blocking init of a world of two
    /// whose other rank never comes waits in NCCL's bootstrap for good (as it does for a peer
    /// that died before init). `ncclCommAbort` ends it and returns. (A receive from this rank
    /// with no send, which would make a kernel wait, is refused by NCCL 2.28.9 at
    /// `ncclGroupEnd` as invalid usage; and a stream held by something other than NCCL, as in
    /// the conformance suite, keeps the abort waiting instead.)
    #[test]
    #[ignore = "needs a GPU: run scripts/gpu-tests.sh on a GPU machine"]
    fn gpu_abort_ends_a_nonblocking_init_whose_peer_never_comes() {
        let dev = gpu();
        let id = dev.unique_id().unwrap();
        let comm = Arc::new(dev.init_comm(&id, 2, 0, CommConfig::default()).expect("non-blocking init of rank 0 of 2"));
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(1500) {
            assert_eq!(comm.async_error().unwrap(), NcclResult::InProgress, "rank 1 never joins");
            std::thread::sleep(Duration::from_millis(20));
        }
        let (tx, rx) = mpsc::channel();
        let aborter = Arc::clone(&comm);
        std::thread::spawn(move || {
            let start = Instant::now();
            aborter.abort();
            let _ = tx.send(start.elapsed());
        });
        let took = rx.recv_timeout(Duration::from_secs(10)).expect("abort did not end the pending init within 10 s");
        println!("abort ended the pending init after {took:?}");
        assert!(matches!(comm.async_error(), Err(NcclError::Aborted)));
        assert!(matches!(comm.group_start(), Err(NcclError::Aborted)));
    }

    #[test]
    #[ignore = "needs a GPU: run scripts/gpu-tests.sh on a GPU machine"]
    fn gpu_nonblocking_init_reaches_success_and_splits_at_world_one() {
        let dev = gpu();
        let id = dev.unique_id().unwrap();
        let comm = dev.init_comm(&id, 1, 0, CommConfig::default()).expect("non-blocking init");
        assert!(!comm.is_blocking());
        let seen = wait_ready(&comm, Duration::from_secs(60));
        println!("non-blocking init went through {seen:?}");
        assert_eq!(seen.last(), Some(&NcclResult::Success));

        let child = comm.split(Some(0), 0).expect("split").expect("color 0 makes a communicator");
        assert_eq!((child.rank(), child.world_size()), (0, 1));
        assert_eq!(wait_ready(&child, Duration::from_secs(10)).last(), Some(&NcclResult::Success));
        assert!(comm.split(None, 0).expect("split without a color").is_none());

        // A real collective on the child: a world of one's sum is the input.
        let stream = dev.new_stream().unwrap();
        let input: Vec<u8> = [1.5f32, -2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let (send, recv) = (dev.alloc(input.len()).unwrap(), dev.alloc(input.len()).unwrap());
        dev.copy_to_device(&stream, &input, &send, 0).unwrap();
        let op = CommOp::AllReduce {
            send: BufRef::new(send),
            recv: BufRef::new(recv.clone()),
            count: 3,
            dtype: NcclDataType::Float32,
            op: NcclRedOp::Sum,
        };
        child.enqueue(op, &stream).unwrap();
        wait_ready(&child, Duration::from_secs(10));
        let out = HostBuffer::new(input.len());
        dev.copy_to_host(&stream, &recv, 0, &out).unwrap();
        dev.synchronize(&stream).unwrap();
        assert_eq!(out.to_vec(), input);

        let too_many = CommOp::AllReduce {
            send: BufRef::new(recv.clone()),
            recv: BufRef::new(recv),
            count: 4,
            dtype: NcclDataType::Float32,
            op: NcclRedOp::Sum,
        };
        assert!(matches!(child.enqueue(too_many, &stream), Err(NcclError::Invalid(_))));

        child.finalize().expect("finalize the child");
        comm.finalize().expect("finalize");
    }

    #[test]
    #[ignore = "needs a GPU: run scripts/gpu-tests.sh on a GPU machine"]
    fn gpu_config_version_matches_the_loaded_nccl_and_shrink_is_gated() {
        let dev = gpu();
        let loaded = dev.nccl_version().unwrap();
        let cfg = comm_config(false, loaded);
        println!(
            "NCCL loaded {}, bindings {}: ncclConfig_t version {} ({} bytes)",
            version_text(loaded),
            version_text(BINDING_NCCL_VERSION),
            version_text(cfg.version),
            cfg.size
        );
        assert_eq!(cfg.version, loaded.min(BINDING_NCCL_VERSION));
        assert!(cfg.version <= loaded);

        // The gate agrees with the library: the symbols exist exactly from the versions gated on.
        let has = |name: &str| {
            // SAFETY: only looks the symbol up; probe() found NCCL (gpu() succeeded).
            unsafe { nccl::culib().get::<unsafe extern "C" fn()>(name.as_bytes()).is_ok() }
        };
        assert_eq!(has("ncclCommShrink"), loaded >= nccl_version_code(2, 27, 0), "ncclCommShrink");
        assert_eq!(has("ncclCommRevoke"), loaded >= nccl_version_code(2, 28, 0), "ncclCommRevoke");
        assert!(has("ncclCommSplit"));

        let comm = world_of_one(&dev, CommConfig { blocking: true });
        match comm.shrink(&[]) {
            Ok(shrunk) => {
                assert!(loaded >= nccl_version_code(2, 27, 0), "shrink ran on NCCL {}", version_text(loaded));
                assert_eq!((shrunk.rank(), shrunk.world_size()), (0, 1));
                println!("shrink works on NCCL {}", version_text(loaded));
            }
            Err(NcclError::NeedsVersion { call, needs, found }) => {
                assert!(loaded < nccl_version_code(2, 27, 0));
                assert_eq!((call, needs.as_str()), ("ncclCommShrink", "2.27"));
                println!("shrink refused: needs {needs}, found {found}");
            }
            Err(e) => panic!("shrink failed: {e}"),
        }
        let e = comm.shrink(&[0]).unwrap_err();
        assert!(matches!(e, NcclError::Invalid(_) | NcclError::NeedsVersion { .. }), "{e:?}");
    }

    /// The process group's lifecycle on CUDA: a collective runs with a device-measured time;
    /// then a real hang (the compute stream waits on a host flag, so the collective behind it
    /// never starts) is timed out by the watchdog and the flight recorder dumped while
    /// `ncclCommAbort` still waits for the held stream; it returns once the stream is released.
    #[test]
    #[ignore = "needs a GPU: run scripts/gpu-tests.sh on a GPU machine"]
    fn gpu_the_watchdog_times_out_a_real_hang_aborts_and_dumps() {
        use cohort_core::reduce::ReduceOp;
        use cohort_core::tensor::Tensor;
        use cohort_core::work::WorkState;

        use crate::nccl::{NcclOptions, NcclProcessGroup};

        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dev = Arc::new(gpu());
        let dir = std::env::temp_dir().join(format!("cohort-gpu-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prefix = dir.join("rank");
        let opts = NcclOptions {
            timeout: Duration::from_secs(2),
            heartbeat_timeout: None,
            dump_prefix: Some(prefix.clone()),
            enable_timing: true,
            ..NcclOptions::default()
        };
        let store: Arc<dyn crate::store::Store> = Arc::new(crate::store::MemoryStore::new());
        let pg = rt
            .block_on(NcclProcessGroup::new(dev.clone(), store, "gpu", 0, 1, opts, rt.handle().clone()))
            .expect("init");
        let t = pg.to_device(&Tensor::from_slice(&[1.5f32, 2.0])).unwrap();
        let w = pg.allreduce(&t, ReduceOp::Sum).unwrap();
        w.wait().unwrap();
        assert_eq!(pg.to_host(&t).unwrap().to_vec::<f32>().unwrap(), vec![1.5, 2.0]);
        println!("a world-1 allreduce took {:?} on the device", w.duration());
        assert!(w.duration().is_some());

        // Made after the tensor, so dropped before it: the release comes before any free.
        let blocker = CudaBlocker::new(&dev).expect("blocker");
        blocker.block(pg.compute_stream()).unwrap();
        let w = pg.allreduce(&t, ReduceOp::Sum).unwrap();
        let started = Instant::now();
        let e = w.wait_timeout(Duration::from_secs(30)).expect_err("the collective is stuck behind the block");
        println!("after {:?}: {e}", started.elapsed());
        assert_eq!(w.state(), WorkState::TimedOut, "{e}");
        assert!(e.to_string().contains("never started"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10), "the timeout took {:?}", started.elapsed());
        assert!(pg.is_comm_aborted(), "the watchdog aborts the communicator while the stream is blocked");
        let path = format!("{}0.json", prefix.display());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::path::Path::new(&path).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let dump = cohort_core::recorder::Dump::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(dump.entries.len(), 2, "{dump:?}");
        // ncclCommAbort waits for NCCL's streams, which wait behind the held compute stream.
        println!("ncclCommAbort returned while the stream was held: {}", pg.is_comm_abort_finished());
        blocker.release();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pg.is_comm_abort_finished() {
            assert!(Instant::now() < deadline, "ncclCommAbort did not return within 10 s of the release");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
