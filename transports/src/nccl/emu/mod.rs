//! The host emulation of CUDA and NCCL behind the device seam ([`super::device`]).
//!
//! [`EmuDevice`] is a [`Device`]: streams are tokio tasks that run their operations one at a
//! time in enqueue order, events point at markers on streams stamped with tokio's clock, device
//! memory is host memory. [`EmuComm`] is a [`Communicator`](super::Communicator) whose
//! collectives are really computed across ranks (with NCCL's meaning of every code) through a
//! [`Fabric`]: [`MemFabric`] in one process, [`StoreFabric`] across processes or inside the
//! simulator. Faults are injected per rank ([`EmuComm::inject`], [`EmuDevice::inject_init_hang`],
//! [`EmuDevice::inject_device_error`], [`EmuDevice::hang_stream`]).
//!
//! # Determinism
//!
//! The emulation runs inside the turmoil simulator too, so, except in the calls documented as
//! blocking the calling thread ([`Device::synchronize`], a blocking `init_comm`, `split` or
//! `shrink`, `finalize` on a blocking communicator, and `enqueue` under
//! [`EmuFault::EnqueueBlocks`]), it never starts a thread, never blocks one, reads time only as
//! `tokio::time::Instant::now()`, sleeps only with `tokio::time::sleep`, spawns only on the
//! configured runtime handle, starts every `select!` with `biased;` and lets no hash order
//! decide anything. Every other [`Device`] and communicator method returns at once, so they may
//! be called from inside a current-thread runtime.

mod comm;
mod fabric;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::{Notify, mpsc, watch};

pub use comm::{EmuComm, EmuFault};
pub use fabric::{Fabric, FabricFuture, MemFabric, StoreFabric};

use super::device::{CommConfig, Device, HostBuffer, NcclError, nccl_version_code};

/// `cudaErrorInvalidResourceHandle`: an event without timing, or never recorded, given to
/// `cudaEventElapsedTime`.
const CUDA_ERROR_INVALID_RESOURCE_HANDLE: i32 = 400;
/// `cudaErrorNotReady`: `cudaEventElapsedTime` on an event that has not completed.
const CUDA_ERROR_NOT_READY: i32 = 600;
/// `cudaErrorCudartUnloading`: what a call gets once the runtime that ran the streams is gone.
const CUDA_ERROR_CUDART_UNLOADING: i32 = 4;

/// How an [`EmuDevice`] is made. Build with [`EmuConfig::new`], then adjust the fields.
#[derive(Debug, Clone)]
pub struct EmuConfig {
    /// Where stream work, non-blocking inits and fabric requests run (as tokio tasks).
    pub runtime: Handle,
    /// How this device's communicators meet their peers.
    pub fabric: Arc<dyn Fabric>,
    /// The device ordinal [`Device::ordinal`] reports; it also goes into unique ids.
    pub ordinal: usize,
    /// The NCCL version to claim ([`Device::nccl_version`]); calls newer than it are refused.
    /// Default 2.28.3.
    pub nccl_version: u32,
    /// Seeds [`Device::unique_id`]: ids are this seed, the ordinal and a counter, so a run is
    /// reproducible. Devices that make ids for different jobs on one fabric need different
    /// seeds or ordinals (NCCL forbids reusing a unique id). Default 0.
    pub seed: u64,
}

impl EmuConfig {
    /// The defaults above, running on `runtime` over `fabric`.
    pub fn new(runtime: Handle, fabric: Arc<dyn Fabric>) -> EmuConfig {
        EmuConfig { runtime, fabric, ordinal: 0, nccl_version: nccl_version_code(2, 28, 3), seed: 0 }
    }
}

/// The emulated device: a [`Device`] whose streams are tokio tasks and whose memory is host
/// memory. Cheap to clone; every clone is the same device.
#[derive(Clone)]
pub struct EmuDevice {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    config: EmuConfig,
    next_unique_id: AtomicU64,
    next_stream: AtomicU64,
    /// The sticky error, once one was injected: (code, name).
    sticky: Mutex<Option<(i32, String)>>,
    /// Inits still to hang ([`EmuDevice::inject_init_hang`]).
    init_hangs: AtomicU32,
    /// Hangs armed by [`EmuFault::KernelHang`] for the next stream operation; a flag that
    /// was cleared (the communicator was aborted first) no longer counts.
    armed_hangs: Mutex<VecDeque<Arc<AtomicBool>>>,
}

impl fmt::Debug for EmuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.inner.config;
        f.debug_struct("EmuDevice")
            .field("ordinal", &c.ordinal)
            .field("nccl_version", &c.nccl_version)
            .field("seed", &c.seed)
            .field("fabric", &c.fabric)
            .finish()
    }
}

/// One operation of a stream: the stream's task runs it to completion before the next.
type StreamOp = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// An emulated stream: a tokio task that runs its operations in enqueue order. Dropping it
/// lets the work already enqueued finish (`cudaStreamDestroy` returns at once and frees the
/// stream once its work is done).
pub struct EmuStream {
    id: u64,
    tx: mpsc::UnboundedSender<StreamOp>,
}

impl fmt::Debug for EmuStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmuStream").field("id", &self.id).finish()
    }
}

/// What a communicator keeps of a stream to launch kernels on it.
#[derive(Clone)]
struct StreamHandle {
    id: u64,
    tx: mpsc::UnboundedSender<StreamOp>,
}

impl StreamHandle {
    fn push(&self, call: &'static str, op: StreamOp) -> Result<(), NcclError> {
        self.tx.send(op).map_err(|_| NcclError::Cuda {
            call,
            code: CUDA_ERROR_CUDART_UNLOADING,
            message: "the tokio runtime that ran the emulated streams has shut down".into(),
        })
    }
}

impl EmuStream {
    fn handle(&self) -> StreamHandle {
        StreamHandle { id: self.id, tx: self.tx.clone() }
    }
}

/// An emulated event: the marker its latest record put on a stream (none if never recorded).
pub struct EmuEvent {
    inner: Arc<EventInner>,
}

impl fmt::Debug for EmuEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmuEvent")
            .field("timing", &self.inner.timing)
            .field("recorded", &self.inner.latest().is_some())
            .field("complete", &self.inner.is_complete())
            .finish()
    }
}

#[derive(Default)]
struct EventInner {
    timing: bool,
    /// The latest record's marker.
    latest: Mutex<Option<Arc<Marker>>>,
}

impl EventInner {
    fn latest(&self) -> Option<Arc<Marker>> {
        self.latest.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn is_complete(&self) -> bool {
        self.latest().is_none_or(|m| m.stamp().is_some())
    }
}

/// One point of one stream: done once the stream got there. Each record makes its own, so a
/// wait on one record is not released by a later record of the same event elsewhere.
#[derive(Default)]
struct Marker {
    /// When the stream got here, on tokio's clock.
    reached: Mutex<Option<tokio::time::Instant>>,
    /// Wakes streams waiting on it ([`Device::stream_wait`]).
    changed: Notify,
    /// Wakes host threads waiting on it ([`Device::synchronize`]).
    done: Condvar,
}

impl Marker {
    fn lock(&self) -> MutexGuard<'_, Option<tokio::time::Instant>> {
        // Updates are one assignment: a poisoned marker is still whole.
        self.reached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stamp(&self) -> Option<tokio::time::Instant> {
        *self.lock()
    }

    /// The stream got here.
    fn reach(&self) {
        *self.lock() = Some(tokio::time::Instant::now());
        self.changed.notify_waiters();
        self.done.notify_all();
    }

    /// Waits, on the device, until the stream got here.
    async fn reached(&self) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.stamp().is_some() {
                return;
            }
            notified.await;
        }
    }
}

/// Emulated device memory. Cloning hands out another reference to the same memory.
#[derive(Clone)]
pub struct EmuBuffer {
    /// Host memory standing for device memory: the same shared, bounds-checked bytes as a
    /// [`HostBuffer`].
    mem: HostBuffer,
}

impl fmt::Debug for EmuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmuBuffer").field("len", &self.len()).finish()
    }
}

impl EmuBuffer {
    fn len(&self) -> usize {
        self.mem.len()
    }

    /// A copy of its bytes now, bypassing every stream: an emulation-only peek for tests (on
    /// CUDA, read through [`Device::copy_to_host`]).
    pub fn to_vec(&self) -> Vec<u8> {
        self.mem.to_vec()
    }

    /// `len` bytes from `offset`, if they are inside the buffer.
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        self.mem.read(offset, len)
    }

    /// Writes `bytes` at `offset`; false (and nothing written) if they do not fit.
    fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        self.mem.write(offset, bytes)
    }
}

/// Holds a stream that [`EmuDevice::block_stream`] blocked. [`StreamGate::release`] lets it
/// go on; dropping the gate does too.
#[derive(Debug)]
pub struct StreamGate {
    open: watch::Sender<bool>,
}

impl StreamGate {
    /// Lets the blocked stream go on.
    pub fn release(&self) {
        self.open.send_replace(true);
    }
}

impl EmuDevice {
    /// A device as `config` describes.
    pub fn new(config: EmuConfig) -> EmuDevice {
        EmuDevice {
            inner: Arc::new(DeviceInner {
                config,
                next_unique_id: AtomicU64::new(0),
                next_stream: AtomicU64::new(0),
                sticky: Mutex::new(None),
                init_hangs: AtomicU32::new(0),
                armed_hangs: Mutex::new(VecDeque::new()),
            }),
        }
    }

    /// Breaks the device for good: every later CUDA call (`record`, `query`, `elapsed`,
    /// `synchronize`, `stream_wait`, copies, allocation, new streams and events) fails with
    /// `NcclError::Cuda { code, message }`, and communicators report
    /// `ncclUnhandledCudaError`. CUDA: errors such as `cudaErrorIllegalAddress` (700) are
    /// sticky, they corrupt the context and every later call returns them. The first error
    /// injected stays.
    pub fn inject_device_error(&self, code: i32, message: impl Into<String>) {
        let mut sticky = self.inner.sticky.lock().unwrap_or_else(PoisonError::into_inner);
        if sticky.is_none() {
            *sticky = Some((code, message.into()));
        }
    }

    /// Makes the next [`Device::init_comm`] on this device never finish: this rank never joins
    /// the rendezvous (so its peers wait too). A non-blocking init stays `ncclInProgress` until
    /// it is aborted; a blocking one blocks its caller for good (as NCCL's blocking init does
    /// when a peer never shows up: use non-blocking init to be able to abort).
    pub fn inject_init_hang(&self) {
        self.inner.init_hangs.fetch_add(1, Ordering::SeqCst);
    }

    /// Hangs `stream` for good from this point: models a compute kernel that never ends,
    /// enqueued now, ahead of whatever is enqueued next (so an event recorded after this call,
    /// such as a collective's start event, never completes). Nothing releases it, not even an
    /// abort: it is not NCCL's kernel.
    pub fn hang_stream(&self, stream: &EmuStream) -> Result<(), NcclError> {
        self.check("cudaLaunchKernel")?;
        self.push(stream, "cudaLaunchKernel", Box::pin(std::future::pending()))
    }

    /// Blocks `stream` from this point until the returned gate is released (or dropped):
    /// CUDA's `cuStreamWaitValue32` on a host flag.
    pub fn block_stream(&self, stream: &EmuStream) -> Result<StreamGate, NcclError> {
        self.check("cuStreamWaitValue32")?;
        let (open, mut opened) = watch::channel(false);
        self.push(
            stream,
            "cuStreamWaitValue32",
            Box::pin(async move {
                // An Err means the gate was dropped: that releases the stream too.
                let _ = opened.wait_for(|open| *open).await;
            }),
        )?;
        Ok(StreamGate { open })
    }

    fn config(&self) -> &EmuConfig {
        &self.inner.config
    }

    fn sticky(&self) -> Option<(i32, String)> {
        self.inner.sticky.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The sticky error, as CUDA's `call` reports it.
    fn check(&self, call: &'static str) -> Result<(), NcclError> {
        match self.sticky() {
            Some((code, message)) => Err(NcclError::Cuda { call, code, message }),
            None => Ok(()),
        }
    }

    /// Enqueues `op` on `stream`, behind a hang if a [`EmuFault::KernelHang`] is armed: every
    /// stream operation of the device goes through here.
    fn push(&self, stream: &EmuStream, call: &'static str, op: StreamOp) -> Result<(), NcclError> {
        self.push_on(&stream.handle(), call, op)
    }

    fn push_on(&self, stream: &StreamHandle, call: &'static str, op: StreamOp) -> Result<(), NcclError> {
        let hang = {
            let mut armed = self.inner.armed_hangs.lock().unwrap_or_else(PoisonError::into_inner);
            let mut found = false;
            while let Some(flag) = armed.pop_front() {
                if flag.swap(false, Ordering::SeqCst) {
                    found = true;
                    break;
                }
            }
            found
        };
        if hang {
            stream.push(call, Box::pin(std::future::pending()))?;
        }
        stream.push(call, op)
    }

    /// Arms a hang for the next stream operation; clearing the returned flag disarms it.
    fn arm_hang(&self) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(true));
        self.inner.armed_hangs.lock().unwrap_or_else(PoisonError::into_inner).push_back(flag.clone());
        flag
    }

    /// Takes one armed init hang, if any.
    fn take_init_hang(&self) -> bool {
        self.inner.init_hangs.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }

    /// Runs `fut` on the runtime and blocks the calling thread until it ends; `None` if the
    /// runtime shut down first. Only for the calls documented as blocking: on a runtime worker
    /// of a current-thread runtime it would deadlock.
    fn block_on_host<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.config().runtime.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().ok()
    }
}

fn check_range(call: &str, what: &str, offset: usize, len: usize, buffer_len: usize) -> Result<(), NcclError> {
    match offset.checked_add(len) {
        Some(end) if end <= buffer_len => Ok(()),
        _ => Err(NcclError::Invalid(format!(
            "{call}: {len} bytes at offset {offset} do not fit in the {what} of {buffer_len} bytes"
        ))),
    }
}

impl Device for EmuDevice {
    type Stream = EmuStream;
    type Event = EmuEvent;
    type Buffer = EmuBuffer;
    type Comm = EmuComm;

    fn ordinal(&self) -> usize {
        self.config().ordinal
    }

    fn nccl_version(&self) -> Result<u32, NcclError> {
        Ok(self.config().nccl_version)
    }

    fn new_stream(&self) -> Result<EmuStream, NcclError> {
        self.check("cudaStreamCreate")?;
        let (tx, mut rx) = mpsc::unbounded_channel::<StreamOp>();
        // CUDA: a stream runs its work asynchronously to the host, one operation after the
        // other in issue order.
        self.config().runtime.spawn(async move {
            while let Some(op) = rx.recv().await {
                op.await;
            }
        });
        Ok(EmuStream { id: self.inner.next_stream.fetch_add(1, Ordering::SeqCst), tx })
    }

    fn new_event(&self, timing: bool) -> Result<EmuEvent, NcclError> {
        self.check("cudaEventCreate")?;
        Ok(EmuEvent { inner: Arc::new(EventInner { timing, ..EventInner::default() }) })
    }

    fn record(&self, event: &EmuEvent, stream: &EmuStream) -> Result<(), NcclError> {
        self.check("cudaEventRecord")?;
        // cudaEventRecord: the event now stands for this point of the stream; it is pending
        // until the stream gets here, whatever earlier records did.
        let marker = Arc::new(Marker::default());
        *event.inner.latest.lock().unwrap_or_else(PoisonError::into_inner) = Some(marker.clone());
        self.push(stream, "cudaEventRecord", Box::pin(async move { marker.reach() }))
    }

    fn query(&self, event: &EmuEvent) -> Result<bool, NcclError> {
        self.check("cudaEventQuery")?;
        // cudaEventQuery: cudaSuccess for an event never recorded or whose latest record was
        // reached, cudaErrorNotReady otherwise; a device error is returned as itself.
        Ok(event.inner.is_complete())
    }

    fn elapsed(&self, start: &EmuEvent, end: &EmuEvent) -> Result<Duration, NcclError> {
        const CALL: &str = "cudaEventElapsedTime";
        self.check(CALL)?;
        let err = |code: i32, message: &str| NcclError::Cuda { call: CALL, code, message: message.into() };
        // cudaEventElapsedTime: cudaErrorInvalidResourceHandle for an event made without
        // timing or never recorded, cudaErrorNotReady while either has not completed.
        if !start.inner.timing || !end.inner.timing {
            return Err(err(CUDA_ERROR_INVALID_RESOURCE_HANDLE, "cudaErrorInvalidResourceHandle"));
        }
        let stamp = |e: &EmuEvent| match e.inner.latest() {
            None => Err(err(CUDA_ERROR_INVALID_RESOURCE_HANDLE, "cudaErrorInvalidResourceHandle")),
            Some(m) => m.stamp().ok_or_else(|| err(CUDA_ERROR_NOT_READY, "cudaErrorNotReady")),
        };
        let (a, b) = (stamp(start)?, stamp(end)?);
        Ok(b.saturating_duration_since(a))
    }

    fn stream_wait(&self, stream: &EmuStream, event: &EmuEvent) -> Result<(), NcclError> {
        self.check("cudaStreamWaitEvent")?;
        // cudaStreamWaitEvent: waits for the record that is the event's latest at the time of
        // this call; later records do not matter; a never-recorded event is no wait at all.
        let Some(marker) = event.inner.latest() else { return Ok(()) };
        self.push(stream, "cudaStreamWaitEvent", Box::pin(async move { marker.reached().await }))
    }

    /// Blocks the calling thread (never call it on a runtime worker of a current-thread
    /// runtime). A device error injected while it waits ends the wait with that error, as
    /// `cudaStreamSynchronize` returns it.
    fn synchronize(&self, stream: &EmuStream) -> Result<(), NcclError> {
        const CALL: &str = "cudaStreamSynchronize";
        self.check(CALL)?;
        let marker = Arc::new(Marker::default());
        let m = marker.clone();
        self.push(stream, CALL, Box::pin(async move { m.reach() }))?;
        let mut reached = marker.lock();
        while reached.is_none() {
            // The only blocking wait of the device: its timeout only re-checks the sticky error.
            reached =
                marker.done.wait_timeout(reached, Duration::from_millis(5)).unwrap_or_else(PoisonError::into_inner).0;
            if reached.is_none() {
                self.check(CALL)?;
            }
        }
        drop(reached);
        self.check(CALL)
    }

    fn alloc(&self, bytes: usize) -> Result<EmuBuffer, NcclError> {
        self.check("cudaMalloc")?;
        Ok(EmuBuffer { mem: HostBuffer::new(bytes) })
    }

    fn buffer_len(&self, buf: &EmuBuffer) -> usize {
        buf.len()
    }

    fn copy_to_device(&self, stream: &EmuStream, src: &[u8], dst: &EmuBuffer, offset: usize) -> Result<(), NcclError> {
        const CALL: &str = "cudaMemcpyAsync";
        self.check(CALL)?;
        check_range(CALL, "device buffer", offset, src.len(), dst.len())?;
        // cudaMemcpyAsync from pageable host memory stages the bytes before returning, so the
        // caller may reuse `src` at once; the device copy happens in stream order.
        let bytes = src.to_vec();
        let dst = dst.clone();
        self.push(
            stream,
            CALL,
            Box::pin(async move {
                let written = dst.write(offset, &bytes);
                debug_assert!(written, "bounds checked at enqueue and buffers never shrink");
            }),
        )
    }

    fn copy_to_host(
        &self,
        stream: &EmuStream,
        src: &EmuBuffer,
        offset: usize,
        dst: &HostBuffer,
    ) -> Result<(), NcclError> {
        const CALL: &str = "cudaMemcpyAsync";
        self.check(CALL)?;
        check_range(CALL, "device buffer", offset, dst.len(), src.len())?;
        let (src, dst) = (src.clone(), dst.clone());
        self.push(
            stream,
            CALL,
            Box::pin(async move {
                // Filled when the stream gets here, so by the time a later event completes.
                if let Some(bytes) = src.read(offset, dst.len()) {
                    let written = dst.write(0, &bytes);
                    debug_assert!(written, "read exactly dst.len() bytes");
                }
            }),
        )
    }

    fn unique_id(&self) -> Result<[u8; 128], NcclError> {
        // ncclGetUniqueId: opaque bytes the ranks share. Here: a tag, the seed, the ordinal and
        // a counter, so runs are reproducible.
        let mut id = [0u8; 128];
        id[..16].copy_from_slice(b"cohort-emu-uid\0\0");
        id[16..24].copy_from_slice(&self.config().seed.to_le_bytes());
        id[24..32].copy_from_slice(&(self.config().ordinal as u64).to_le_bytes());
        id[32..40].copy_from_slice(&self.inner.next_unique_id.fetch_add(1, Ordering::SeqCst).to_le_bytes());
        Ok(id)
    }

    /// A non-blocking `config` returns at once ([`Communicator::async_error`] reports
    /// `ncclInProgress` until every rank joined); a blocking one blocks the calling thread
    /// until then (call it from a plain thread or `spawn_blocking`).
    ///
    /// [`Communicator::async_error`]: super::Communicator::async_error
    fn init_comm(&self, id: &[u8; 128], world_size: u32, rank: u32, config: CommConfig) -> Result<EmuComm, NcclError> {
        comm::init(self, id, world_size, rank, config)
    }
}
