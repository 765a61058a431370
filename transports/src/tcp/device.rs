//! [`DeviceProcessGroup`]: the TCP backend over device tensors, as c10d's `ProcessGroupGloo`
//! runs collectives on CUDA tensors (`AsyncAllreduceCUDAWork` and its siblings): stage the
//! data through host memory around the host collective.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cohort_core::group::{Collective, SubmitError, TensorSpec};
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Tensor};
use cohort_core::work::{OpType, Rank, WorkResult};
use tokio::sync::oneshot;

use super::ProcessGroup;
use super::tunables::DEVICE_POLL_INTERVAL;
use crate::nccl::{Device, DeviceTensor, HostBuffer, NcclError};
use crate::work::Work;

/// Why a [`DeviceProcessGroup`] refused a call. Nothing was submitted to the host group.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceSubmitError {
    /// A device call failed while the copy to the host was enqueued.
    #[error("{op}: enqueueing the copy to the host failed: {source}")]
    Device {
        /// The op.
        op: OpType,
        /// The device's error.
        #[source]
        source: NcclError,
    },
    /// An argument is wrong (named in the error), or the group failed or was aborted.
    #[error(transparent)]
    Refused(#[from] SubmitError),
}

/// The TCP backend for tensors in device memory (c10d's `ProcessGroupGloo` with CUDA tensors),
/// over any [`Device`]: a [`ProcessGroup`], the device, and a side stream of the group's own.
/// Cheap to clone; every clone is the same group and side stream.
///
/// # What one collective does
///
/// 1. At the call, on the caller's thread: an event is recorded on the caller's stream, the
///    group's side stream waits for it, and the inputs are copied to host memory on the side
///    stream, followed by a second event. So the copy sees everything the caller enqueued
///    before the call, and nothing after it.
/// 2. A task on the process group's runtime polls that event (with `tokio::time::sleep`: no
///    thread blocks), then submits the host collective to the [`ProcessGroup`] and awaits it.
/// 3. The host results are copied back into the output device tensors on the side stream,
///    followed by a third event.
/// 4. The caller's stream waits for that event; then the returned [`Work`] ends.
///
/// So once the work has ended (`wait`, `await`, `is_completed`), whatever the caller enqueues
/// on its stream runs after the copy back, without the host waiting for the device. Before
/// that, the caller must not touch the tensors (c10d's `AsyncAllreduceCUDAWork` makes the
/// current stream wait in `wait()`; here the work does it before it ends). The caller's stream is taken as
/// an `Arc` because step 4 happens after the call returns: CUDA's `cudaStreamWaitEvent` waits
/// for an event's latest record at the time of the wait, and the device has no way to wait at
/// the call for a host collective that has not run yet.
///
/// # Ordering and failures
///
/// Host collectives are submitted in call order (a device collective whose inputs are still
/// being copied holds back the ones called after it), and copies back are enqueued in call
/// order; [`DeviceProcessGroup::barrier`] is ordered with them and ends after the device
/// collectives called before it. Collectives called directly on the wrapped
/// [`ProcessGroup`] are not ordered with device collectives still copying their inputs: do not
/// mix the two while device works are unfinished.
///
/// A failed host collective fails the work with the same [`WorkResult`], and nothing is copied
/// back. A device error (an event query, a copy, a wait that fails) fails the work with that
/// error. If the inputs never reach the host (a device error, or the caller's stream not
/// reaching the call's point within [`TcpOptions::timeout`](super::TcpOptions::timeout)),
/// this rank can no longer take part in the collective its peers run, and would pair its next
/// one with theirs: the group is aborted, so that the peers fail at once rather than at their
/// timeout. [`Work::abort`] on a device work aborts the group, as c10d's `Work::abort` does.
///
/// The device works carry sequence number 0; the host collective inside each is an ordinary
/// work of the group (its sequence number, flight-recorder entry and completion hook).
pub struct DeviceProcessGroup<D: Device> {
    inner: Arc<Inner<D>>,
}

struct Inner<D: Device> {
    pg: ProcessGroup,
    device: Arc<D>,
    /// Where the copies to and from the host run.
    side: D::Stream,
    /// The last turns handed out: a new collective waits for them.
    turns: Mutex<Turns>,
}

#[derive(Default)]
struct Turns {
    /// Resolves once the last collective called has submitted its host collective (or gave up).
    submit: Option<oneshot::Receiver<()>>,
    /// Resolves once the last collective called has enqueued its copy back (or gave up).
    copy_back: Option<oneshot::Receiver<()>>,
}

impl<D: Device> Clone for DeviceProcessGroup<D> {
    fn clone(&self) -> Self {
        DeviceProcessGroup { inner: self.inner.clone() }
    }
}

impl<D: Device> fmt::Debug for DeviceProcessGroup<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceProcessGroup")
            .field("pg", &self.inner.pg)
            .field("device", &self.inner.device)
            .field("side_stream", &self.inner.side)
            .finish()
    }
}

impl<D: Device> DeviceProcessGroup<D> {
    /// Runs device collectives over `pg`, staging through host memory on a new stream of
    /// `device`.
    pub fn new(pg: ProcessGroup, device: Arc<D>) -> Result<Self, NcclError> {
        let side = device.new_stream()?;
        Ok(DeviceProcessGroup { inner: Arc::new(Inner { pg, device, side, turns: Mutex::default() }) })
    }

    /// The host process group.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.inner.pg
    }

    /// The device.
    pub fn device(&self) -> &Arc<D> {
        &self.inner.device
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.inner.pg.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.inner.pg.world_size()
    }

    /// Reduce `tensors` across ranks with `op`, in place; several tensors on one rank are
    /// reduced together and every one receives the result (as Gloo does).
    pub fn allreduce(
        &self,
        tensors: &[DeviceTensor<D>],
        op: ReduceOp,
        stream: &Arc<D::Stream>,
    ) -> Result<Work, DeviceSubmitError> {
        let c = Collective::new(OpType::Allreduce).inputs(specs(tensors));
        self.check(&c, Some(op))?;
        self.launch(OpType::Allreduce, stream, tensors, tensors, move |pg, host| pg.allreduce(host, op))
    }

    /// Copy `root`'s `tensors` into every rank's.
    pub fn broadcast(
        &self,
        tensors: &[DeviceTensor<D>],
        root: u32,
        stream: &Arc<D::Stream>,
    ) -> Result<Work, DeviceSubmitError> {
        let c = Collective::new(OpType::Broadcast).inputs(specs(tensors)).root(Rank(root));
        self.check(&c, None)?;
        self.launch(OpType::Broadcast, stream, tensors, tensors, move |pg, host| pg.broadcast(host, root))
    }

    /// Reduce `tensors` to `root` with `op`, in place. Only the root's result is meaningful:
    /// other ranks' tensors receive partial reductions, as with Gloo.
    pub fn reduce(
        &self,
        tensors: &[DeviceTensor<D>],
        root: u32,
        op: ReduceOp,
        stream: &Arc<D::Stream>,
    ) -> Result<Work, DeviceSubmitError> {
        let c = Collective::new(OpType::Reduce).inputs(specs(tensors)).root(Rank(root));
        self.check(&c, Some(op))?;
        self.launch(OpType::Reduce, stream, tensors, tensors, move |pg, host| pg.reduce(host, root, op))
    }

    /// Gather every rank's `input` into `outputs`, one tensor per rank in rank order.
    pub fn allgather(
        &self,
        outputs: &[DeviceTensor<D>],
        input: &DeviceTensor<D>,
        stream: &Arc<D::Stream>,
    ) -> Result<Work, DeviceSubmitError> {
        let c = Collective::new(OpType::Allgather).inputs(vec![spec(input)]).outputs(specs(outputs));
        self.check(&c, None)?;
        self.launch(OpType::Allgather, stream, std::slice::from_ref(input), outputs, |pg, host| pg.allgather(one(host)))
    }

    /// Gather every rank's `input` into `output` of `world_size × input.numel()` elements, in
    /// rank order (`all_gather_into_tensor`).
    pub fn allgather_into_tensor(
        &self,
        output: &DeviceTensor<D>,
        input: &DeviceTensor<D>,
        stream: &Arc<D::Stream>,
    ) -> Result<Work, DeviceSubmitError> {
        let c = Collective::new(OpType::AllgatherIntoTensor).inputs(vec![spec(input)]).outputs(vec![spec(output)]);
        self.check(&c, None)?;
        self.launch(
            OpType::AllgatherIntoTensor,
            stream,
            std::slice::from_ref(input),
            std::slice::from_ref(output),
            |pg, host| pg.allgather_into_tensor(one(host)),
        )
    }

    /// Reduce `input` of `world_size × output.numel()` elements with `op`; rank r receives
    /// block r of the reduction in `output` (`reduce_scatter_tensor`).
    pub fn reduce_scatter_tensor(
        &self,
        output: &DeviceTensor<D>,
        input: &DeviceTensor<D>,
        op: ReduceOp,
        stream: &Arc<D::Stream>,
    ) -> Result<Work, DeviceSubmitError> {
        let c = Collective::new(OpType::ReduceScatterTensor).inputs(vec![spec(input)]).outputs(vec![spec(output)]);
        self.check(&c, Some(op))?;
        self.launch(
            OpType::ReduceScatterTensor,
            stream,
            std::slice::from_ref(input),
            std::slice::from_ref(output),
            move |pg, host| pg.reduce_scatter_tensor(one(host), op),
        )
    }

    /// Block until every rank has called `barrier`. No device data: it is ordered after the
    /// device collectives called before it, and ends after they have (c10d's Gloo barrier
    /// waits for the prior work too).
    pub fn barrier(&self) -> Result<Work, DeviceSubmitError> {
        health(&self.inner.pg)?;
        let (mut submit, mut copy_back) = {
            let mut turns = self.inner.turns();
            (Turn::take(&mut turns.submit), Turn::take(&mut turns.copy_back))
        };
        let pg = self.inner.pg.clone();
        let work = self.inner.pg.spawn_work(OpType::Barrier, async move {
            submit.wait().await;
            let host = pg.barrier().map_err(refused)?;
            drop(submit);
            host.await.map_err(|e| e.to_result())?;
            copy_back.wait().await;
            Ok(Vec::new())
        });
        self.abort_group_on_abort(&work);
        Ok(work)
    }

    /// Refuse the call if an argument is wrong (as the host group would, naming the argument)
    /// or `op` does not apply to the dtype, or the group failed or was aborted.
    fn check(&self, c: &Collective, op: Option<ReduceOp>) -> Result<(), DeviceSubmitError> {
        c.validate(self.rank(), self.world_size())?;
        if let (Some(red), Some(t)) = (op, c.inputs.first()) {
            red.check(t.dtype).map_err(|e| SubmitError::InvalidArgument {
                op: c.op,
                arg: "op",
                reason: e.to_string(),
            })?;
        }
        Ok(health(&self.inner.pg)?)
    }

    /// Step 1 now, then steps 2 to 4 in a task: copy `inputs` to the host, run `submit` on
    /// their host copies, copy its outputs into `outputs`, make `stream` wait.
    fn launch<F>(
        &self,
        op: OpType,
        stream: &Arc<D::Stream>,
        inputs: &[DeviceTensor<D>],
        outputs: &[DeviceTensor<D>],
        submit: F,
    ) -> Result<Work, DeviceSubmitError>
    where
        F: FnOnce(&ProcessGroup, Vec<Tensor>) -> Result<Work, SubmitError> + Send + 'static,
    {
        let inner = &self.inner;
        let dev = &*inner.device;
        let device = |source| DeviceSubmitError::Device { op, source };
        // Under the lock, so that the side stream runs the copies in the order of the turns.
        let mut turns = inner.turns();
        let ready = dev.new_event(false).map_err(device)?;
        let copied = dev.new_event(false).map_err(device)?;
        let back = dev.new_event(false).map_err(device)?;
        dev.record(&ready, stream).map_err(device)?;
        dev.stream_wait(&inner.side, &ready).map_err(device)?;
        let mut staged = Vec::with_capacity(inputs.len());
        for t in inputs {
            let host = HostBuffer::new(t.nbytes());
            dev.copy_to_host(&inner.side, t.buffer(), 0, &host).map_err(device)?;
            staged.push(Staged { dtype: t.dtype(), shape: t.shape().to_vec(), host });
        }
        dev.record(&copied, &inner.side).map_err(device)?;
        let job = Job {
            inner: inner.clone(),
            op,
            caller: stream.clone(),
            staged,
            outputs: outputs.to_vec(),
            copied,
            back,
            submit_turn: Turn::take(&mut turns.submit),
            copy_back_turn: Turn::take(&mut turns.copy_back),
        };
        drop(turns);
        let work = inner.pg.spawn_work(op, job.run(submit));
        self.abort_group_on_abort(&work);
        Ok(work)
    }

    /// [`Work::abort`] aborts the group (as c10d's does); the work's task then ends with it.
    fn abort_group_on_abort(&self, work: &Work) {
        // Weak: a work kept after the group is gone does not keep its connections alive.
        let group = Arc::downgrade(&self.inner.pg.inner);
        work.set_abort(Box::new(move |reason| {
            if let Some(inner) = group.upgrade() {
                ProcessGroup::from_inner(inner).abort(reason);
            }
        }));
    }
}

impl<D: Device> Inner<D> {
    fn turns(&self) -> MutexGuard<'_, Turns> {
        // Each critical section is a few swaps: a poisoned lock still holds whole turns.
        self.turns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Polls `copied` until the inputs are on the host; fails on a device error, when the
    /// group fails or is aborted, or after the group's timeout.
    async fn wait_copied(&self, copied: &D::Event) -> Result<(), WorkResult> {
        let timeout = self.pg.options().timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.device.query(copied) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.device_error(&e)),
            }
            health(&self.pg).map_err(refused)?;
            if tokio::time::Instant::now() >= deadline {
                let me = self.pg.rank();
                return Err(WorkResult::Timeout {
                    message: format!(
                        "rank {me}: copying the inputs to the host did not finish within {} ms: the caller's \
                         stream did not reach the call",
                        timeout.as_millis()
                    ),
                    blame: cohort_core::Blame::rank(me),
                });
            }
            tokio::time::sleep(DEVICE_POLL_INTERVAL).await;
        }
    }

    fn device_error(&self, e: &NcclError) -> WorkResult {
        let me = self.pg.rank();
        WorkResult::CommError { blame: cohort_core::Blame::rank(me), message: format!("rank {me}: device error: {e}") }
    }
}

/// One input's host copy, filled by the side stream.
struct Staged {
    dtype: DType,
    shape: Vec<usize>,
    host: HostBuffer,
}

/// Steps 2 to 4 of one collective.
struct Job<D: Device> {
    inner: Arc<Inner<D>>,
    op: OpType,
    caller: Arc<D::Stream>,
    staged: Vec<Staged>,
    outputs: Vec<DeviceTensor<D>>,
    /// Recorded on the side stream after the copies to the host.
    copied: D::Event,
    /// Recorded on the side stream after the copies back.
    back: D::Event,
    submit_turn: Turn,
    copy_back_turn: Turn,
}

impl<D: Device> Job<D> {
    async fn run<F>(self, submit: F) -> Result<Vec<Tensor>, WorkResult>
    where
        F: FnOnce(&ProcessGroup, Vec<Tensor>) -> Result<Work, SubmitError>,
    {
        let Job { inner, op, caller, staged, outputs, copied, back, mut submit_turn, mut copy_back_turn } = self;
        submit_turn.wait().await;
        // Step 2: the inputs reach the host, the host collective runs.
        let host = match inner.wait_copied(&copied).await.and_then(|()| host_tensors(staged)) {
            Ok(host) => host,
            Err(result) => {
                // The peers run this collective without this rank, and this rank's next one
                // would meet their next but one: end the group for everyone now.
                if health(&inner.pg).is_ok() {
                    inner.pg.abort(&format!("{op} on device tensors never reached the host: {result}"));
                }
                return Err(result);
            }
        };
        let host_work = submit(&inner.pg, host).map_err(refused)?;
        drop(submit_turn);
        let results = host_work.await.map_err(|e| e.to_result())?;
        // Step 3: copy back, in call order.
        copy_back_turn.wait().await;
        let got: Vec<usize> = results.iter().map(Tensor::nbytes).collect();
        let want: Vec<usize> = outputs.iter().map(DeviceTensor::nbytes).collect();
        if got != want {
            return Err(WorkResult::CommError {
                blame: cohort_core::Blame::nobody(),
                message: format!("{op}: the host collective returned {got:?} bytes, the outputs hold {want:?}"),
            });
        }
        let dev = &*inner.device;
        for (r, o) in results.iter().zip(&outputs) {
            dev.copy_to_device(&inner.side, r.bytes(), o.buffer(), 0).map_err(|e| inner.device_error(&e))?;
        }
        dev.record(&back, &inner.side).map_err(|e| inner.device_error(&e))?;
        // Step 4.
        dev.stream_wait(&caller, &back).map_err(|e| inner.device_error(&e))?;
        drop(copy_back_turn);
        Ok(results)
    }
}

/// A place in the call order: waits for the one before, and passes on when dropped.
struct Turn {
    before: Option<oneshot::Receiver<()>>,
    /// Dropped to let the next one go.
    _mine: oneshot::Sender<()>,
}

impl Turn {
    /// The next turn after `last`, which becomes this one.
    fn take(last: &mut Option<oneshot::Receiver<()>>) -> Turn {
        let (tx, rx) = oneshot::channel();
        Turn { before: last.replace(rx), _mine: tx }
    }

    /// Waits until the turn before this one was passed on.
    async fn wait(&mut self) {
        if let Some(before) = self.before.take() {
            // Err: the sender was dropped, which is how a turn is passed on.
            let _ = before.await;
        }
    }
}

/// Why the group refuses work now, if it does.
fn health(pg: &ProcessGroup) -> Result<(), SubmitError> {
    let st = pg.inner.lock();
    if let Some(cause) = st.group.failure() {
        return Err(SubmitError::GroupFailed { cause: cause.clone() });
    }
    if st.group.is_aborted() {
        return Err(SubmitError::Aborted { cause: "the process group was aborted".into() });
    }
    Ok(())
}

/// The result of a work whose host collective the group refused.
fn refused(e: SubmitError) -> WorkResult {
    match e {
        SubmitError::Aborted { cause } => WorkResult::Aborted { reason: cause },
        SubmitError::GroupFailed { cause } => WorkResult::CommError {
            blame: cause.blame,
            message: format!("process group failed earlier: {}", cause.message),
        },
        e => WorkResult::CommError { blame: cohort_core::Blame::nobody(), message: e.to_string() },
    }
}

fn host_tensors(staged: Vec<Staged>) -> Result<Vec<Tensor>, WorkResult> {
    staged
        .into_iter()
        .map(|s| Tensor::from_bytes(s.dtype, &s.shape, &s.host.to_vec()))
        .collect::<Result<_, _>>()
        .map_err(|e| WorkResult::CommError {
            blame: cohort_core::Blame::nobody(),
            message: format!("staging the inputs on the host: {e}"),
        })
}

/// The one host tensor of a collective with one input.
fn one(mut host: Vec<Tensor>) -> Tensor {
    host.pop().expect("launch stages exactly the inputs it is given, and these ops give one")
}

fn spec<D: Device>(t: &DeviceTensor<D>) -> TensorSpec {
    TensorSpec::new(t.dtype(), t.shape())
}

fn specs<D: Device>(ts: &[DeviceTensor<D>]) -> Vec<TensorSpec> {
    ts.iter().map(spec).collect()
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::time::Duration;

    use cohort_core::work::{SeqNo, WorkState};
    use tokio::sync::Notify;

    use super::*;
    use crate::nccl::emu::{EmuConfig, EmuDevice, EmuEvent, EmuStream, MemFabric};
    use crate::store::{MemoryStore, Store};
    use crate::work::WorkError;
    use crate::{TcpOptions, TokioNet};

    type Dpg = DeviceProcessGroup<EmuDevice>;

    /// One rank: its device group (over its own emulated device) and the caller's stream.
    #[derive(Clone)]
    struct Ranked {
        dpg: Dpg,
        stream: Arc<EmuStream>,
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
    }

    fn opts(timeout: Duration) -> TcpOptions {
        TcpOptions { timeout, ..TcpOptions::default() }
    }

    /// `n` TCP ranks on loopback in this process, each with its own emulated device.
    fn world(rt: &tokio::runtime::Runtime, n: u32, opts: TcpOptions) -> Vec<Ranked> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let pgs = rt.block_on(async {
            let joins: Vec<_> = (0..n)
                .map(|r| {
                    let (store, opts) = (store.clone(), opts.clone());
                    tokio::spawn(async move { ProcessGroup::connect(TokioNet, store, r, n, opts).await })
                })
                .collect();
            let mut out = Vec::new();
            for j in joins {
                out.push(j.await.expect("a connect task").expect("connect"));
            }
            out
        });
        pgs.into_iter()
            .enumerate()
            .map(|(r, pg)| {
                let mut cfg = EmuConfig::new(rt.handle().clone(), MemFabric::new());
                cfg.ordinal = r;
                let dev = Arc::new(EmuDevice::new(cfg));
                let stream = Arc::new(dev.new_stream().expect("a stream"));
                Ranked { dpg: Dpg::new(pg, dev).expect("a side stream"), stream }
            })
            .collect()
    }

    /// Runs `f` for every rank at once, as tasks; each must end within 5 s.
    fn on_each<F, Fut>(rt: &tokio::runtime::Runtime, ranks: &[Ranked], f: F)
    where
        F: Fn(Ranked) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        rt.block_on(async {
            let joins: Vec<_> = ranks
                .iter()
                .map(|r| (r.dpg.rank(), tokio::spawn(tokio::time::timeout(Duration::from_secs(5), f(r.clone())))))
                .collect();
            for (rank, j) in joins {
                j.await.expect("a rank panicked").unwrap_or_else(|_| panic!("rank {rank} hung"));
            }
        });
    }

    impl Ranked {
        fn dev(&self) -> &EmuDevice {
            self.dpg.device()
        }

        fn me(&self) -> f64 {
            f64::from(self.dpg.rank().0)
        }

        /// A device tensor holding `values`, written on the caller's stream.
        fn upload(&self, dtype: DType, values: &[f64]) -> DeviceTensor<EmuDevice> {
            let host = Tensor::from_f64s(dtype, values);
            let buf = self.dev().alloc(host.nbytes()).expect("alloc");
            self.dev().copy_to_device(&self.stream, host.bytes(), &buf, 0).expect("copy to device");
            DeviceTensor::from_parts(self.dev(), buf, dtype, &[values.len()]).expect("a tensor")
        }

        fn zeros(&self, dtype: DType, numel: usize) -> DeviceTensor<EmuDevice> {
            let buf = self.dev().alloc(numel * dtype.size()).expect("alloc");
            DeviceTensor::from_parts(self.dev(), buf, dtype, &[numel]).expect("a tensor")
        }

        /// Enqueues a copy of `t` to the host on the caller's stream, and an event after it.
        fn start_read(&self, t: &DeviceTensor<EmuDevice>) -> (HostBuffer, EmuEvent) {
            let host = HostBuffer::new(t.nbytes());
            self.dev().copy_to_host(&self.stream, t.buffer(), 0, &host).expect("copy to host");
            let done = self.dev().new_event(false).expect("an event");
            self.dev().record(&done, &self.stream).expect("record");
            (host, done)
        }

        /// `t` as the caller's stream sees it, polled with tokio's clock.
        async fn read(&self, t: &DeviceTensor<EmuDevice>) -> Vec<f64> {
            let (host, done) = self.start_read(t);
            until_done(self.dev(), &done).await;
            values(t, &host)
        }

        /// `t` as the caller's stream sees it, blocking this thread (not a runtime worker).
        fn read_blocking(&self, t: &DeviceTensor<EmuDevice>) -> Vec<f64> {
            let host = HostBuffer::new(t.nbytes());
            self.dev().copy_to_host(&self.stream, t.buffer(), 0, &host).expect("copy to host");
            self.dev().synchronize(&self.stream).expect("synchronize");
            values(t, &host)
        }
    }

    /// Polls `event` with tokio's clock, for 2 s at most.
    async fn until_done(dev: &EmuDevice, event: &EmuEvent) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while !dev.query(event).expect("query") {
            assert!(tokio::time::Instant::now() < deadline, "the caller's stream is stuck");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn values(t: &DeviceTensor<EmuDevice>, host: &HostBuffer) -> Vec<f64> {
        Tensor::from_bytes(t.dtype(), t.shape(), &host.to_vec()).expect("whole elements").to_f64s()
    }

    /// Every collective from plain threads with the blocking `Work` API; every result is read
    /// back through the caller's stream (and the host copies come back as the work's result).
    #[test]
    fn collectives_compute_across_three_ranks_and_land_on_the_callers_stream() {
        let rt = runtime();
        let ranks = world(&rt, 3, opts(Duration::from_secs(20)));
        std::thread::scope(|s| {
            for r in &ranks {
                s.spawn(move || {
                    let (dpg, stream, me) = (&r.dpg, &r.stream, r.me());
                    // Two tensors on one rank are reduced together; both receive the result.
                    let a = r.upload(DType::F32, &[me, 1.0]);
                    let b = r.upload(DType::F32, &[10.0, me]);
                    let work = dpg.allreduce(&[a.clone(), b.clone()], ReduceOp::Sum, stream).unwrap();
                    work.wait().unwrap();
                    assert!(work.is_completed() && work.is_success());
                    let host: Vec<Vec<f64>> = work.result().unwrap().iter().map(Tensor::to_f64s).collect();
                    assert_eq!(host, vec![vec![33.0, 6.0]; 2], "the host copies are the work's result");
                    assert_eq!(r.read_blocking(&a), [33.0, 6.0]);
                    assert_eq!(r.read_blocking(&b), [33.0, 6.0]);

                    let t = r.upload(DType::I32, &[100.0 * me + 1.0, -me]);
                    dpg.broadcast(std::slice::from_ref(&t), 1, stream)
                        .unwrap()
                        .wait_timeout(Duration::from_secs(2))
                        .unwrap();
                    assert_eq!(r.read_blocking(&t), [101.0, -1.0]);

                    let t = r.upload(DType::F64, &[me, -me]);
                    dpg.reduce(std::slice::from_ref(&t), 2, ReduceOp::Max, stream).unwrap().wait().unwrap();
                    if me == 2.0 {
                        assert_eq!(r.read_blocking(&t), [2.0, 0.0]);
                    }

                    let input = r.upload(DType::F32, &[me, -me]);
                    let outs: Vec<_> = (0..3).map(|_| r.zeros(DType::F32, 2)).collect();
                    dpg.allgather(&outs, &input, stream).unwrap().wait().unwrap();
                    let gathered: Vec<f64> = outs.iter().flat_map(|o| r.read_blocking(o)).collect();
                    assert_eq!(gathered, [0.0, 0.0, 1.0, -1.0, 2.0, -2.0]);
                    let whole = r.zeros(DType::F32, 6);
                    dpg.allgather_into_tensor(&whole, &input, stream).unwrap().wait().unwrap();
                    assert_eq!(r.read_blocking(&whole), [0.0, 0.0, 1.0, -1.0, 2.0, -2.0]);

                    let input = r.upload(DType::I64, &(0..6).map(|i| f64::from(i) + me).collect::<Vec<_>>());
                    let out = r.zeros(DType::I64, 2);
                    dpg.reduce_scatter_tensor(&out, &input, ReduceOp::Sum, stream).unwrap().wait().unwrap();
                    let k = 2.0 * me;
                    assert_eq!(r.read_blocking(&out), [3.0 * k + 3.0, 3.0 * (k + 1.0) + 3.0]);

                    dpg.barrier().unwrap().wait().unwrap();
                    assert_eq!(dpg.process_group().seq(), SeqNo(7), "one host collective per call");
                });
            }
        });
    }

    /// Step 4: the work ends once the copy back is enqueued, and the caller's stream is made
    /// to wait for it. Rank 0 holds its side stream between the copy to the host and the copy
    /// back; a read enqueued on the caller's stream after the work ended must wait for it.
    #[test]
    fn the_callers_stream_waits_for_the_copy_back() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_secs(20)));
        let held = Arc::new(Notify::new());
        on_each(&rt, &ranks, |r| {
            let held = held.clone();
            async move {
                let t = r.upload(DType::F32, &[1.0 + r.me(), 10.0]);
                if r.me() == 0.0 {
                    let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
                    // Behind the copy to the host, ahead of the copy back (which needs rank 1,
                    // who calls only once this is in place).
                    let gate = r.dev().block_stream(&r.dpg.inner.side).unwrap();
                    held.notify_one();
                    work.await.unwrap();
                    let (host, read) = r.start_read(&t);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    assert!(!r.dev().query(&read).unwrap(), "the caller's stream read the tensor before the copy back");
                    gate.release();
                    until_done(r.dev(), &read).await;
                    assert_eq!(values(&t, &host), [3.0, 20.0]);
                } else {
                    held.notified().await;
                    r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap().await.unwrap();
                    assert_eq!(r.read(&t).await, [3.0, 20.0]);
                }
            }
        });
    }

    /// Step 1: the copy to the host waits for the caller's stream. Rank 0's input is written
    /// on its stream behind a gate: neither rank's collective may end before the gate opens,
    /// and the result holds what was written behind it.
    #[test]
    fn the_collective_waits_for_the_callers_stream() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_secs(20)));
        on_each(&rt, &ranks, |r| async move {
            if r.me() == 0.0 {
                let t = r.zeros(DType::F32, 2);
                let gate = r.dev().block_stream(&r.stream).unwrap();
                let input = Tensor::from_f64s(DType::F32, &[5.0, 6.0]);
                r.dev().copy_to_device(&r.stream, input.bytes(), t.buffer(), 0).unwrap();
                let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
                tokio::time::sleep(Duration::from_millis(200)).await;
                assert!(!work.is_completed(), "the collective ran before the caller's stream reached it");
                gate.release();
                work.await.unwrap();
                assert_eq!(r.read(&t).await, [6.0, 7.0]);
            } else {
                let t = r.upload(DType::F32, &[1.0, 1.0]);
                let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert!(!work.is_completed(), "rank 1 finished without rank 0's input");
                work.await.unwrap();
                assert_eq!(r.read(&t).await, [6.0, 7.0]);
            }
        });
    }

    /// A peer that never calls: the host collective times out, blaming it, and the device work
    /// ends with that same result; nothing is copied back.
    #[test]
    fn a_failed_host_collective_fails_the_device_work_with_the_tcp_error() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_millis(300)));
        let r = ranks[0].clone();
        rt.block_on(async move {
            let t = r.upload(DType::F32, &[1.0, 2.0]);
            let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
            let err = tokio::time::timeout(Duration::from_secs(3), work.clone()).await.expect("no hang").unwrap_err();
            assert_eq!(work.state(), WorkState::TimedOut, "{err}");
            let WorkError::Failed { result: WorkResult::Timeout { message, blame }, .. } = &err else {
                panic!("not the host collective's timeout: {err}")
            };
            assert_eq!(*blame, cohort_core::Blame::rank(Rank(1)), "{message}");
            let failure = r.dpg.process_group().failure().expect("the timeout failed the group");
            assert_eq!(message, &failure.message, "the device work carries the host collective's error");
            assert_eq!(r.read(&t).await, [1.0, 2.0], "nothing is copied back after a failure");
            let refused = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap_err();
            assert!(matches!(refused, DeviceSubmitError::Refused(SubmitError::GroupFailed { .. })), "{refused}");
        });
    }

    /// A device error while the inputs are copied fails the work with that error, and aborts
    /// the group: the peer, waiting in the host collective, fails at once instead of at its
    /// (20 s) timeout.
    #[test]
    fn a_device_error_fails_the_work_and_the_peer_does_not_wait_for_its_timeout() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_secs(20)));
        on_each(&rt, &ranks, |r| async move {
            let t = r.upload(DType::F32, &[1.0]);
            if r.me() == 0.0 {
                let _gate = r.dev().block_stream(&r.stream).unwrap();
                let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                r.dev().inject_device_error(700, "cudaErrorIllegalAddress");
                let err = work.clone().await.unwrap_err().to_string();
                assert!(err.contains("device error") && err.contains("cudaEventQuery"), "{err}");
                assert!(err.contains("700") && err.contains("cudaErrorIllegalAddress"), "{err}");
                assert_eq!(work.state(), WorkState::Failed);
                assert!(r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).is_err());
            } else {
                let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
                let err = tokio::time::timeout(Duration::from_secs(2), work)
                    .await
                    .expect("the peer waited for its timeout")
                    .unwrap_err();
                let err = err.to_string();
                assert!(err.contains("rank 0 aborted the group") && err.contains("cudaErrorIllegalAddress"), "{err}");
            }
        });
    }

    /// A caller's stream that never reaches the call: the work times out after the group's
    /// timeout, blaming this rank, and the group is aborted (this rank is out of step).
    #[test]
    fn a_stuck_callers_stream_times_the_work_out_and_aborts_the_group() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_millis(300)));
        let r = ranks[0].clone();
        rt.block_on(async move {
            let t = r.upload(DType::F32, &[1.0]);
            r.dev().hang_stream(&r.stream).unwrap();
            let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
            let err = tokio::time::timeout(Duration::from_secs(2), work.clone()).await.expect("no hang").unwrap_err();
            assert_eq!(work.state(), WorkState::TimedOut, "{err}");
            assert_eq!(err.culprit(), Some(Rank(0)), "{err}");
            assert!(err.to_string().contains("the caller's stream did not reach the call"), "{err}");
            let refused = r.dpg.barrier().unwrap_err();
            assert!(matches!(refused, DeviceSubmitError::Refused(SubmitError::Aborted { .. })), "{refused}");
        });
    }

    /// `Work::abort` aborts the group (as c10d's does): the work ends at once even though its
    /// inputs never reached the host, and later calls are refused.
    #[test]
    fn aborting_a_device_work_aborts_the_group() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_secs(20)));
        let r = ranks[0].clone();
        rt.block_on(async move {
            let t = r.upload(DType::F32, &[1.0]);
            let _gate = r.dev().block_stream(&r.stream).unwrap();
            let work = r.dpg.allreduce(std::slice::from_ref(&t), ReduceOp::Sum, &r.stream).unwrap();
            work.abort();
            let err = tokio::time::timeout(Duration::from_secs(2), work.clone()).await.expect("no hang").unwrap_err();
            assert_eq!(work.state(), WorkState::Aborted, "{err}");
            let refused = r.dpg.barrier().unwrap_err();
            assert!(matches!(refused, DeviceSubmitError::Refused(SubmitError::Aborted { .. })), "{refused}");
        });
    }

    /// Wrong arguments are refused at the call, naming the argument, with nothing submitted
    /// (the next good collective still pairs up across ranks); a device error at the call is
    /// refused as such.
    #[test]
    fn arguments_are_refused_by_name_before_anything_is_enqueued() {
        let rt = runtime();
        let ranks = world(&rt, 2, opts(Duration::from_secs(20)));
        on_each(&rt, &ranks, |r| async move {
            let (dpg, s) = (&r.dpg, &r.stream);
            let f = r.upload(DType::F32, &[1.0, 2.0]);
            let i = r.upload(DType::I32, &[1.0, 2.0]);
            let refusal = |e: DeviceSubmitError| {
                assert!(matches!(e, DeviceSubmitError::Refused(_)), "{e}");
                e.to_string()
            };
            let e = refusal(dpg.allreduce(&[f.clone(), i.clone()], ReduceOp::Sum, s).unwrap_err());
            assert!(e.contains("invalid argument tensors") && e.contains("dtype int32"), "{e}");
            let e = refusal(dpg.allreduce(&[], ReduceOp::Sum, s).unwrap_err());
            assert!(e.contains("invalid argument tensors"), "{e}");
            let e = refusal(dpg.allreduce(std::slice::from_ref(&f), ReduceOp::BXor, s).unwrap_err());
            assert!(e.contains("invalid argument op") && e.contains("bxor"), "{e}");
            let e = refusal(dpg.broadcast(std::slice::from_ref(&f), 2, s).unwrap_err());
            assert!(e.contains("invalid root rank 2"), "{e}");
            let e = refusal(dpg.allgather_into_tensor(&r.zeros(DType::F32, 3), &f, s).unwrap_err());
            assert!(e.contains("invalid argument output_tensor"), "{e}");
            let e = refusal(dpg.allgather_into_tensor(&r.zeros(DType::I32, 4), &f, s).unwrap_err());
            assert!(e.contains("invalid argument output_tensor") && e.contains("dtype int32"), "{e}");
            let e = refusal(dpg.reduce_scatter_tensor(&f, &r.zeros(DType::F32, 3), ReduceOp::Sum, s).unwrap_err());
            assert!(e.contains("invalid argument input"), "{e}");
            let e = refusal(dpg.allgather(std::slice::from_ref(&f), &f, s).unwrap_err());
            assert!(e.contains("invalid argument output_tensor_list"), "{e}");
            let small = r.dev().alloc(4).unwrap();
            let e = DeviceTensor::from_parts(r.dev(), small, DType::F32, &[2]).unwrap_err().to_string();
            assert!(e.contains("does not fit in a device buffer of 4 bytes"), "{e}");

            assert_eq!(dpg.process_group().seq(), SeqNo(0), "a refused call submitted a host collective");
            dpg.allreduce(std::slice::from_ref(&f), ReduceOp::Sum, s).unwrap().await.unwrap();
            assert_eq!(r.read(&f).await, [2.0, 4.0]);

            r.dev().inject_device_error(700, "cudaErrorIllegalAddress");
            let e = dpg.allreduce(std::slice::from_ref(&f), ReduceOp::Sum, s).unwrap_err();
            assert!(matches!(e, DeviceSubmitError::Device { op: OpType::Allreduce, .. }), "{e}");
            assert!(e.to_string().contains("cudaErrorIllegalAddress"), "{e}");
        });
    }
}
