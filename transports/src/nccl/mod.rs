//! The NCCL backend (feature `nccl`): a thin communicator over cudarc's `sys` layer
//! ([`comm::Communicator`]), device tensors ([`DeviceTensor`]) and [`NcclProcessGroup`], whose
//! communicator lives on its own thread.
//!
//! Creating a group first probes for `libcuda.so` and `libnccl.so`; on a machine without them
//! it returns [`NcclError::Unavailable`] — cudarc's first call would otherwise panic.
//!
//! Not done yet: the asynchronous `Work` lifecycle through core's `GroupState` (every call
//! here blocks until the NCCL stream has finished, like `TORCH_NCCL_BLOCKING_WAIT=1`), the
//! watchdog, flight-recorder entries and event timing.

pub mod comm;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Tensor};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::store::{Store, StoreError};
use comm::{CommConfig, Communicator};

/// Why an NCCL call or group failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// The CUDA driver or NCCL library cannot be loaded on this machine.
    #[error("NCCL backend unavailable: {0}")]
    Unavailable(String),
    /// An NCCL call returned an error.
    #[error("{call} failed: {code:?} ({message})")]
    Call {
        /// The NCCL function.
        call: &'static str,
        /// Its result code.
        code: cudarc::nccl::sys::ncclResult_t,
        /// NCCL's text for the code.
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// The store failed during the unique-id exchange.
    #[error("store error during NCCL setup: {0}")]
    Store(#[from] StoreError),
    /// The operation or reduce op is not supported on this backend.
    #[error("unsupported on the NCCL backend: {0}")]
    Unsupported(String),
    /// An argument was wrong (shape, dtype, rank, buffer size…).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Communicator init or a collective ran past its timeout; the communicator was aborted.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The group's communicator thread is gone (aborted or shut down).
    #[error("NCCL process group is shut down")]
    Closed,
}

impl From<cudarc::driver::DriverError> for NcclError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        NcclError::Driver(format!("{e:?}"))
    }
}

/// Checks that the CUDA driver and NCCL can be loaded, without calling into either (cudarc
/// panics on its first call when a library is missing).
pub fn probe() -> Result<(), NcclError> {
    // SAFETY: these only try to dlopen the libraries' candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NcclError::Unavailable("libcuda.so could not be loaded".into()));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(NcclError::Unavailable(
            "libnccl.so could not be loaded (put a folder with a libnccl.so link on LD_LIBRARY_PATH)".into(),
        ));
    }
    Ok(())
}

fn env_flag(name: &'static str) -> Result<Option<bool>, crate::tcp::EnvError> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim() {
            "1" | "true" | "TRUE" | "True" => Ok(Some(true)),
            "0" | "false" | "FALSE" | "False" | "" => Ok(Some(false)),
            _ => Err(crate::tcp::EnvError { name, value: v.clone(), reason: "expected 0 or 1".into() }),
        },
    }
}

/// Settings of an NCCL group (the `TORCH_NCCL_*` knobs as `COHORT_*` variables).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NcclOptions {
    /// Collective timeout (`COHORT_TIMEOUT_MS`).
    pub timeout: Duration,
    /// Communicator-init timeout for non-blocking init.
    pub init_timeout: Duration,
    /// Blocking NCCL communicator (`COHORT_NCCL_BLOCKING`, default 1); 0 makes init and calls
    /// non-blocking, completion is then polled with `ncclCommGetAsyncError`.
    pub blocking_comm: bool,
    /// CUDA device ordinal (`COHORT_CUDA_DEVICE`, default: `rank % device count`).
    pub device: Option<usize>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(600),
            init_timeout: Duration::from_secs(600),
            blocking_comm: true,
            device: None,
        }
    }
}

impl NcclOptions {
    /// Reads `COHORT_TIMEOUT_MS`, `COHORT_INIT_TIMEOUT_MS`, `COHORT_NCCL_BLOCKING` and `COHORT_CUDA_DEVICE`; a malformed
    /// value is an error naming the variable.
    pub fn from_env() -> Result<NcclOptions, crate::tcp::EnvError> {
        let mut o = NcclOptions::default();
        let num = |name: &'static str| -> Result<Option<u64>, crate::tcp::EnvError> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => v.trim().parse::<u64>().map(Some).map_err(|e| crate::tcp::EnvError {
                    name,
                    value: v.clone(),
                    reason: e.to_string(),
                }),
            }
        };
        if let Some(ms) = num("COHORT_TIMEOUT_MS")? {
            o.timeout = Duration::from_millis(ms);
            o.init_timeout = o.timeout;
        }
        if let Some(ms) = num("COHORT_INIT_TIMEOUT_MS")? {
            o.init_timeout = Duration::from_millis(ms);
        }
        if let Some(b) = env_flag("COHORT_NCCL_BLOCKING")? {
            o.blocking_comm = b;
        }
        if let Some(d) = num("COHORT_CUDA_DEVICE")? {
            o.device = Some(d as usize);
        }
        Ok(o)
    }
}

/// A tensor in device memory: a flat buffer of `numel` elements of `dtype` with a shape.
#[derive(Debug)]
pub struct DeviceTensor {
    buf: CudaSlice<u8>,
    dtype: DType,
    shape: Vec<usize>,
}

impl DeviceTensor {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

type Reply<T> = mpsc::Sender<Result<T, NcclError>>;

enum Cmd {
    ToDevice(Tensor, Reply<DeviceTensor>),
    ToHost(DeviceTensor, Reply<(Tensor, DeviceTensor)>),
    AllReduce(DeviceTensor, ReduceOp, Reply<DeviceTensor>),
    Broadcast(DeviceTensor, u32, Reply<DeviceTensor>),
    AllGather(DeviceTensor, Reply<DeviceTensor>),
    ReduceScatter(DeviceTensor, ReduceOp, Reply<DeviceTensor>),
    Reduce(DeviceTensor, u32, ReduceOp, Reply<DeviceTensor>),
    Send(DeviceTensor, u32, Reply<DeviceTensor>),
    Recv(DeviceTensor, u32, Reply<DeviceTensor>),
    AllToAll(DeviceTensor, Reply<DeviceTensor>),
    Barrier(Reply<()>),
    Abort,
}

/// A process group on NCCL: one communicator per process, on its own thread.
///
/// Every collective blocks the calling thread until the NCCL stream has finished.
#[derive(Debug)]
pub struct NcclProcessGroup {
    rank: u32,
    world: u32,
    tx: mpsc::Sender<Cmd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NcclProcessGroup {
    /// Creates the group: probes for CUDA and NCCL, exchanges the unique id through `store`
    /// (rank 0 writes `nccl/<name>/uid`), then initialises the communicator on its thread.
    pub async fn new(
        store: Arc<dyn Store>,
        name: &str,
        rank: u32,
        world: u32,
        options: NcclOptions,
    ) -> Result<NcclProcessGroup, NcclError> {
        probe()?;
        if world == 0 || rank >= world {
            return Err(NcclError::Invalid(format!("rank {rank} is not in a group of {world}")));
        }
        let key = format!("nccl/{name}/uid");
        let id: [u8; 128] = if rank == 0 {
            let id = comm::unique_id()?;
            store.set(&key, &id).await?;
            id
        } else {
            let v = store.get(&key).await?;
            v.as_slice().try_into().map_err(|_| {
                NcclError::Invalid(format!("store key {key} holds {} bytes, an NCCL unique id has 128", v.len()))
            })?
        };
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("cohort-nccl-{rank}"))
            .spawn(move || comm_thread(id, rank, world, options, rx, ready_tx))
            .map_err(|e| NcclError::Driver(format!("cannot spawn the communicator thread: {e}")))?;
        let ready = tokio::task::spawn_blocking(move || ready_rx.recv().unwrap_or(Err(NcclError::Closed)))
            .await
            .map_err(|_| NcclError::Closed)?;
        ready?;
        Ok(NcclProcessGroup { rank, world, tx, thread: Some(thread) })
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.world
    }

    fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, NcclError> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(make(tx)).map_err(|_| NcclError::Closed)?;
        rx.recv().unwrap_or(Err(NcclError::Closed))
    }

    /// Copies a host tensor to the group's device.
    pub fn to_device(&self, t: Tensor) -> Result<DeviceTensor, NcclError> {
        self.call(|r| Cmd::ToDevice(t, r))
    }

    /// Copies a device tensor back to the host; returns both.
    pub fn to_host(&self, t: DeviceTensor) -> Result<(Tensor, DeviceTensor), NcclError> {
        self.call(|r| Cmd::ToHost(t, r))
    }

    /// In-place allreduce.
    pub fn allreduce(&self, t: DeviceTensor, op: ReduceOp) -> Result<DeviceTensor, NcclError> {
        self.call(|r| Cmd::AllReduce(t, op, r))
    }

    /// In-place broadcast from `root`.
    pub fn broadcast(&self, t: DeviceTensor, root: u32) -> Result<DeviceTensor, NcclError> {
        if root >= self.world {
            return Err(NcclError::Invalid(format!("broadcast root {root} is not in a group of {}", self.world)));
        }
        self.call(|r| Cmd::Broadcast(t, root, r))
    }

    /// Allgather into a new tensor of shape `[world, ..input shape]`.
    pub fn allgather_into_tensor(&self, t: DeviceTensor) -> Result<DeviceTensor, NcclError> {
        self.call(|r| Cmd::AllGather(t, r))
    }

    /// Reduce-scatter of an input whose first dimension is the world size; returns one slice.
    pub fn reduce_scatter_tensor(&self, t: DeviceTensor, op: ReduceOp) -> Result<DeviceTensor, NcclError> {
        if t.shape.first() != Some(&(self.world as usize)) {
            return Err(NcclError::Invalid(format!(
                "reduce_scatter_tensor input shape {:?}: first dimension must be the world size {}",
                t.shape, self.world
            )));
        }
        self.call(|r| Cmd::ReduceScatter(t, op, r))
    }

    fn check_peer(&self, what: &str, peer: u32) -> Result<(), NcclError> {
        if peer >= self.world {
            return Err(NcclError::Invalid(format!("{what} rank {peer} is not in a group of {}", self.world)));
        }
        Ok(())
    }

    /// In-place reduce onto `root` (other ranks' buffers are left as NCCL leaves them).
    pub fn reduce(&self, t: DeviceTensor, root: u32, op: ReduceOp) -> Result<DeviceTensor, NcclError> {
        self.check_peer("reduce root", root)?;
        self.call(|r| Cmd::Reduce(t, root, op, r))
    }

    /// Sends `t` to `dst` (returned once sent).
    pub fn send(&self, t: DeviceTensor, dst: u32) -> Result<DeviceTensor, NcclError> {
        self.check_peer("send destination", dst)?;
        self.call(|r| Cmd::Send(t, dst, r))
    }

    /// Receives into `t` from `src`.
    pub fn recv(&self, t: DeviceTensor, src: u32) -> Result<DeviceTensor, NcclError> {
        self.check_peer("recv source", src)?;
        self.call(|r| Cmd::Recv(t, src, r))
    }

    /// All-to-all of an input whose first dimension is the world size: slice `i` goes to rank
    /// `i`, through grouped send/recv; returns the received slices in rank order.
    pub fn alltoall_base(&self, t: DeviceTensor) -> Result<DeviceTensor, NcclError> {
        if t.shape.first() != Some(&(self.world as usize)) {
            return Err(NcclError::Invalid(format!(
                "alltoall_base input shape {:?}: first dimension must be the world size {}",
                t.shape, self.world
            )));
        }
        self.call(|r| Cmd::AllToAll(t, r))
    }

    /// A barrier: a one-element allreduce.
    pub fn barrier(&self) -> Result<(), NcclError> {
        self.call(Cmd::Barrier)
    }

    /// Aborts the communicator (`ncclCommAbort`); later calls fail with [`NcclError::Closed`].
    pub fn abort(&self) {
        let _ = self.tx.send(Cmd::Abort);
    }
}

impl Drop for NcclProcessGroup {
    fn drop(&mut self) {
        let (tx, _) = mpsc::channel();
        self.tx = tx; // closes the command channel: the thread finalizes and exits
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Device {
    stream: Arc<CudaStream>,
    comm: Communicator,
    world: u32,
    timeout: Duration,
}

fn comm_thread(
    id: [u8; 128],
    rank: u32,
    world: u32,
    options: NcclOptions,
    rx: mpsc::Receiver<Cmd>,
    ready: mpsc::Sender<Result<(), NcclError>>,
) {
    let setup = || -> Result<Device, NcclError> {
        let ordinal = match options.device {
            Some(d) => d,
            None => {
                let n = CudaContext::device_count()?.max(1) as u32;
                (rank % n) as usize
            }
        };
        let ctx = CudaContext::new(ordinal)?;
        ctx.bind_to_thread()?;
        let stream = ctx.new_stream()?;
        let comm = Communicator::init(
            &id,
            world,
            rank,
            CommConfig { blocking: options.blocking_comm, init_timeout: options.init_timeout },
        )?;
        Ok(Device { stream, comm, world, timeout: options.timeout })
    };
    let dev = match setup() {
        Ok(d) => {
            let _ = ready.send(Ok(()));
            d
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Cmd::ToDevice(t, r) => drop(r.send(dev.to_device(t))),
            Cmd::ToHost(t, r) => drop(r.send(dev.to_host(t))),
            Cmd::AllReduce(t, op, r) => drop(r.send(dev.all_reduce(t, op))),
            Cmd::Broadcast(t, root, r) => drop(r.send(dev.broadcast(t, root))),
            Cmd::AllGather(t, r) => drop(r.send(dev.all_gather(t))),
            Cmd::ReduceScatter(t, op, r) => drop(r.send(dev.reduce_scatter(t, op))),
            Cmd::Reduce(t, root, op, r) => drop(r.send(dev.reduce(t, root, op))),
            Cmd::Send(t, peer, r) => drop(r.send(dev.p2p(t, peer, true))),
            Cmd::Recv(t, peer, r) => drop(r.send(dev.p2p(t, peer, false))),
            Cmd::AllToAll(t, r) => drop(r.send(dev.all_to_all(t))),
            Cmd::Barrier(r) => {
                let res =
                    dev.to_device(Tensor::from_slice(&[0f32])).and_then(|t| dev.all_reduce(t, ReduceOp::Sum)).map(drop);
                drop(r.send(res));
            }
            Cmd::Abort => {
                dev.comm.abort();
                return; // the communicator is destroyed on drop; later calls see Closed
            }
        }
    }
    let Device { comm, .. } = dev;
    let _ = comm.finalize();
}

impl Device {
    fn to_device(&self, t: Tensor) -> Result<DeviceTensor, NcclError> {
        let buf = self.stream.clone_htod(t.bytes())?;
        Ok(DeviceTensor { buf, dtype: t.dtype(), shape: t.shape().to_vec() })
    }

    fn to_host(&self, t: DeviceTensor) -> Result<(Tensor, DeviceTensor), NcclError> {
        let bytes = self.stream.clone_dtoh(&t.buf)?;
        let host = Tensor::from_bytes(t.dtype, &t.shape, &bytes).map_err(|e| NcclError::Invalid(e.to_string()))?;
        Ok((host, t))
    }

    fn alloc(&self, dtype: DType, shape: Vec<usize>) -> Result<DeviceTensor, NcclError> {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        let buf = self.stream.alloc_zeros::<u8>(n.max(1))?;
        Ok(DeviceTensor { buf, dtype, shape })
    }

    /// Waits for the stream, polling the communicator's async error; past the timeout the
    /// communicator is aborted.
    fn finish(&self, what: &str) -> Result<(), NcclError> {
        let start = std::time::Instant::now();
        // A non-blocking communicator may still be enqueueing: wait for that first.
        self.comm.wait_ready_for("enqueue", self.timeout)?;
        let event = self.stream.record_event(None)?;
        loop {
            if event.is_complete() {
                return Ok(());
            }
            self.comm.async_error()?;
            if start.elapsed() > self.timeout {
                self.comm.abort();
                return Err(NcclError::Timeout(format!(
                    "{what} ran for {} milliseconds before timing out (timeout {} ms)",
                    start.elapsed().as_millis(),
                    self.timeout.as_millis()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn raw_stream(&self) -> *mut std::ffi::c_void {
        self.stream.cu_stream().cast()
    }

    fn all_reduce(&self, mut t: DeviceTensor, op: ReduceOp) -> Result<DeviceTensor, NcclError> {
        let nop = comm::nccl_op(op, t.dtype)?;
        let count = t.numel();
        {
            let (p, _g) = t.buf.device_ptr_mut(&self.stream);
            // SAFETY: in-place allreduce of `count` elements in a buffer of that size on our stream.
            unsafe { self.comm.all_reduce(p, p, count, t.dtype, nop, self.raw_stream())? };
        }
        self.finish("nccl:all_reduce")?;
        Ok(t)
    }

    fn broadcast(&self, mut t: DeviceTensor, root: u32) -> Result<DeviceTensor, NcclError> {
        let count = t.numel();
        {
            let (p, _g) = t.buf.device_ptr_mut(&self.stream);
            // SAFETY: in-place broadcast over our own buffer.
            unsafe { self.comm.broadcast(p, p, count, t.dtype, root, self.raw_stream())? };
        }
        self.finish("nccl:broadcast")?;
        Ok(t)
    }

    fn reduce(&self, mut t: DeviceTensor, root: u32, op: ReduceOp) -> Result<DeviceTensor, NcclError> {
        let nop = comm::nccl_op(op, t.dtype)?;
        let count = t.numel();
        {
            let (p, _g) = t.buf.device_ptr_mut(&self.stream);
            // SAFETY: in-place reduce over our own buffer of `count` elements.
            unsafe { self.comm.reduce(p, p, count, t.dtype, nop, root, self.raw_stream())? };
        }
        self.finish("nccl:reduce")?;
        Ok(t)
    }

    fn p2p(&self, mut t: DeviceTensor, peer: u32, send: bool) -> Result<DeviceTensor, NcclError> {
        let count = t.numel();
        {
            let (p, _g) = t.buf.device_ptr_mut(&self.stream);
            // SAFETY: our own buffer of `count` elements on our stream.
            unsafe {
                if send {
                    self.comm.send(p, count, t.dtype, peer, self.raw_stream())?;
                } else {
                    self.comm.recv(p, count, t.dtype, peer, self.raw_stream())?;
                }
            }
        }
        self.finish(if send { "nccl:send" } else { "nccl:recv" })?;
        Ok(t)
    }

    fn all_to_all(&self, t: DeviceTensor) -> Result<DeviceTensor, NcclError> {
        let world = self.world as usize;
        let count = t.numel() / world;
        let bytes = count * t.dtype.size();
        let mut out = self.alloc(t.dtype, t.shape.clone())?;
        {
            let (s, _g1) = t.buf.device_ptr(&self.stream);
            let (r, _g2) = out.buf.device_ptr_mut(&self.stream);
            Communicator::group_start()?;
            let mut res = Ok(());
            for peer in 0..world {
                let off = (peer * bytes) as u64;
                // SAFETY: slice `peer` of `count` elements lies inside both world × count buffers.
                res = unsafe {
                    self.comm
                        .send(s + off, count, t.dtype, peer as u32, self.raw_stream())
                        .and_then(|()| self.comm.recv(r + off, count, t.dtype, peer as u32, self.raw_stream()))
                };
                if res.is_err() {
                    break;
                }
            }
            // The group is closed even after a failed call, as NCCL requires.
            let end = Communicator::group_end();
            res?;
            end?;
        }
        self.finish("nccl:all_to_all")?;
        Ok(out)
    }

    fn all_gather(&self, t: DeviceTensor) -> Result<DeviceTensor, NcclError> {
        let count = t.numel();
        let mut shape = vec![self.world as usize];
        shape.extend_from_slice(&t.shape);
        let mut out = self.alloc(t.dtype, shape)?;
        {
            let (s, _g1) = t.buf.device_ptr(&self.stream);
            let (r, _g2) = out.buf.device_ptr_mut(&self.stream);
            // SAFETY: `out` holds world × count elements.
            unsafe { self.comm.all_gather(s, r, count, t.dtype, self.raw_stream())? };
        }
        self.finish("nccl:all_gather")?;
        Ok(out)
    }

    fn reduce_scatter(&self, t: DeviceTensor, op: ReduceOp) -> Result<DeviceTensor, NcclError> {
        let nop = comm::nccl_op(op, t.dtype)?;
        let count = t.numel() / self.world as usize;
        let mut out = self.alloc(t.dtype, t.shape[1..].to_vec())?;
        {
            let (s, _g1) = t.buf.device_ptr(&self.stream);
            let (r, _g2) = out.buf.device_ptr_mut(&self.stream);
            // SAFETY: input holds world × count elements (checked by the caller), output count.
            unsafe { self.comm.reduce_scatter(s, r, count, t.dtype, nop, self.raw_stream())? };
        }
        self.finish("nccl:reduce_scatter")?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn store() -> Arc<dyn Store> {
        Arc::new(MemoryStore::new())
    }

    /// `Some(reason)` when the GPU tests cannot run here.
    fn gpu_missing() -> Option<String> {
        probe().err().map(|e| e.to_string())
    }

    #[tokio::test]
    async fn creating_a_group_without_cuda_is_a_clear_error_not_a_panic() {
        match probe() {
            Ok(()) => {
                eprintln!("skipped: CUDA and NCCL are present, the no-GPU error cannot be observed here");
            }
            Err(e) => {
                let err = NcclProcessGroup::new(store(), "g", 0, 1, NcclOptions::default()).await.unwrap_err();
                assert!(matches!(err, NcclError::Unavailable(_)), "{err:?}");
                let msg = err.to_string();
                assert!(msg.starts_with("NCCL backend unavailable: lib"), "{msg}");
                assert!(msg.contains(".so could not be loaded"), "{msg}");
                assert_eq!(msg, e.to_string());
            }
        }
    }

    #[test]
    fn reduce_ops_map_to_nccl_or_are_refused_by_name() {
        use cudarc::nccl::sys::ncclRedOp_t as R;
        assert_eq!(comm::nccl_op(ReduceOp::Sum, DType::F32).unwrap(), R::ncclSum);
        assert_eq!(comm::nccl_op(ReduceOp::Avg, DType::Bf16).unwrap(), R::ncclAvg);
        assert_eq!(comm::nccl_op(ReduceOp::Max, DType::I64).unwrap(), R::ncclMax);
        let e = comm::nccl_op(ReduceOp::Avg, DType::I32).unwrap_err().to_string();
        assert!(e.contains("avg on int32"), "{e}");
        let e = comm::nccl_op(ReduceOp::BXor, DType::U8).unwrap_err().to_string();
        assert!(e.contains("bitwise"), "{e}");
        let e = comm::nccl_op(ReduceOp::PremulSum(0.5), DType::F32).unwrap_err().to_string();
        assert!(e.contains("premul_sum"), "{e}");
        assert_eq!(comm::nccl_dtype(DType::Bool), cudarc::nccl::sys::ncclDataType_t::ncclUint8);
        assert_eq!(comm::nccl_dtype(DType::Bf16), cudarc::nccl::sys::ncclDataType_t::ncclBfloat16);
    }

    /// GPU: a world of one runs every collective and reads the results back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gpu_world_of_one_runs_the_collectives() {
        if let Some(why) = gpu_missing() {
            eprintln!("skipped: {why}");
            return;
        }
        for blocking in [true, false] {
            let opts = NcclOptions { blocking_comm: blocking, ..NcclOptions::default() };
            let name = format!("w1-{blocking}");
            let pg = NcclProcessGroup::new(store(), &name, 0, 1, opts).await.expect("init");
            let t = pg.to_device(Tensor::from_slice(&[1.5f32, -2.0, 3.0])).unwrap();
            let t = pg.allreduce(t, ReduceOp::Sum).unwrap();
            let t = pg.allreduce(t, ReduceOp::Avg).unwrap();
            let t = pg.broadcast(t, 0).unwrap();
            let (h, t) = pg.to_host(t).unwrap();
            assert_eq!(h.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.0]);
            let g = pg.allgather_into_tensor(t).unwrap();
            assert_eq!(g.shape(), &[1, 3]);
            let r = pg.reduce_scatter_tensor(g, ReduceOp::Max).unwrap();
            let (h, _) = pg.to_host(r).unwrap();
            assert_eq!(h.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.0]);
            let i = pg.to_device(Tensor::from_slice(&[7i64, 9])).unwrap();
            let (h, _) = pg.to_host(pg.allreduce(i, ReduceOp::Product).unwrap()).unwrap();
            assert_eq!(h.to_vec::<i64>().unwrap(), vec![7, 9]);
            let a = pg.to_device(Tensor::from_slice_shaped(&[4u8, 5], &[1, 2]).unwrap()).unwrap();
            let (h, _) = pg.to_host(pg.alltoall_base(a).unwrap()).unwrap();
            assert_eq!(h.to_vec::<u8>().unwrap(), vec![4, 5]);
            let d = pg.to_device(Tensor::from_slice(&[2.0f64])).unwrap();
            let (h, _) = pg.to_host(pg.reduce(d, 0, ReduceOp::Min).unwrap()).unwrap();
            assert_eq!(h.to_vec::<f64>().unwrap(), vec![2.0]);
            let x = pg.to_device(Tensor::from_slice(&[1f32])).unwrap();
            assert!(matches!(pg.send(x, 1), Err(NcclError::Invalid(_))));
            pg.barrier().unwrap();
            let bad = pg.to_device(Tensor::from_slice(&[1i32])).unwrap();
            assert!(matches!(pg.allreduce(bad, ReduceOp::Avg), Err(NcclError::Unsupported(_))));
            pg.abort();
            assert!(matches!(pg.barrier(), Err(NcclError::Closed)));
        }
    }
}
