//! [`EmuComm`]: the emulated NCCL communicator, its kernels and its faults.
//!
//! A launch (a top-level [`Communicator::enqueue`], or everything between
//! [`Communicator::group_start`] and [`Communicator::group_end`]) becomes one stream operation:
//! the "kernel". When the stream reaches it, it reads its send buffers, posts them to the
//! fabric, waits for its peers and writes its receive buffers. Collectives meet under
//! `c/<communicator>/<n>`, where `n` counts this communicator's collectives (NCCL requires every
//! rank to issue them in the same order); sends and receives use the channel
//! `p/<communicator>/<from>/<to>`, first in first out (NCCL matches point-to-point calls to one
//! peer in issue order).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use cohort_core::reduce::Reduction;
use tokio::sync::{oneshot, watch};

use super::{EmuBuffer, EmuDevice, EmuStream, StreamHandle};
use crate::nccl::device::{
    CommConfig, CommOp, Communicator, NcclDataType, NcclError, NcclRedOp, NcclResult, require_version,
};

/// A fault armed on one rank's communicator with [`EmuComm::inject`]. Faults queue: the first
/// armed applies to the next launch (a top-level enqueue, or a whole group at its
/// `group_end`), the second to the launch after, and so on.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum EmuFault {
    /// When the launch's kernel runs, [`Communicator::async_error`] starts returning this
    /// result (say `RemoteError` or `SystemError`) and the kernel hangs until the communicator
    /// is aborted (NCCL: a failed communicator's kernels stay stuck until `ncclCommAbort`).
    AsyncError(NcclResult),
    /// The rank dies: from this launch on it never contributes again and every later kernel of
    /// this communicator (and every later split or shrink) hangs. Its peers see a dead peer:
    /// their collectives hang, as NCCL's survivors do until their watchdogs act.
    Dies,
    /// The `enqueue` (or `group_end`) call blocks the calling thread until the communicator is
    /// aborted from another thread, then returns [`NcclError::Aborted`] (NCCL: a launch that
    /// blocks on a full work queue or a stuck proxy; `ncclCommAbort` frees it).
    EnqueueBlocks,
    /// A compute kernel that never ends, ahead of the launch: the device hangs for good at its
    /// next stream operation once this fault is next in line (at `inject` if nothing else is
    /// queued, else right after the previous launch was enqueued), and at the latest right
    /// before the launch's own kernel. So events recorded before that point complete, while the
    /// launch's start event (recorded after it, directly or behind a stream wait) never does and
    /// this rank never contributes. The hang lands on whichever stream that next operation uses
    /// (in the process group, the compute stream the NCCL stream waits on). An abort does not
    /// free the stream (the hang is not NCCL's kernel), so it does not return while a launch of
    /// this communicator is queued behind the hang (see [`Communicator::abort`] on
    /// [`EmuComm`]); it disarms a hang not placed yet. [`EmuDevice::hang_stream`] hangs one
    /// given stream instead.
    KernelHang,
    /// The kernel takes this much longer (on tokio's clock), then completes correctly.
    SlowKernel(Duration),
}

/// An emulated NCCL communicator over an [`EmuDevice`]. Cheap to clone; clones are the same
/// communicator.
#[derive(Clone)]
pub struct EmuComm {
    inner: Arc<CommInner>,
}

impl fmt::Debug for EmuComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (rank, world) = self.inner.shape();
        f.debug_struct("EmuComm")
            .field("id", &self.inner.id)
            .field("rank", &rank)
            .field("world_size", &world)
            .field("aborted", &self.inner.is_aborted())
            .finish()
    }
}

impl EmuComm {
    /// Arms `fault` for a later launch of this rank (see [`EmuFault`]).
    pub fn inject(&self, fault: EmuFault) {
        let mut s = self.inner.lock();
        s.faults.push_back(fault);
        self.inner.arm_head(&mut s);
    }

    /// The communicator's id: the same on every rank, derived from the unique id (or, for a
    /// split or shrink, from the parent's id).
    pub fn id(&self) -> &str {
        &self.inner.id
    }
}

struct CommInner {
    device: EmuDevice,
    id: String,
    blocking: bool,
    /// Known at init; for a split, once its rendezvous finished (the parent's until then).
    rank: AtomicU32,
    world: AtomicU32,
    state: Mutex<CommState>,
    /// Wakes host threads blocked on the state: on abort and when the last kernel ends.
    changed: Condvar,
    aborted: AtomicBool,
    /// Tells pending kernels and setup tasks that the communicator was aborted.
    abort_signal: watch::Sender<bool>,
    desync_warned: AtomicBool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Readiness {
    InProgress,
    Ready,
    Failed(NcclResult),
}

struct CommState {
    readiness: Readiness,
    group_depth: u32,
    grouped: Vec<(Prepared, StreamHandle)>,
    faults: VecDeque<EmuFault>,
    /// The device hang armed for a [`EmuFault::KernelHang`] at the head of `faults`.
    armed_hang: Option<Arc<AtomicBool>>,
    async_error: Option<NcclResult>,
    dead: bool,
    finalized: bool,
    /// Kernels launched and not ended.
    outstanding: u64,
    /// Stream operations of launches that their streams have not reached yet.
    queued: u64,
    collectives: u64,
    splits: u64,
    shrinks: u64,
}

impl CommInner {
    fn new(device: EmuDevice, id: String, blocking: bool, rank: u32, world: u32) -> Arc<CommInner> {
        Arc::new(CommInner {
            device,
            id,
            blocking,
            rank: AtomicU32::new(rank),
            world: AtomicU32::new(world),
            state: Mutex::new(CommState {
                readiness: Readiness::InProgress,
                group_depth: 0,
                grouped: Vec::new(),
                faults: VecDeque::new(),
                armed_hang: None,
                async_error: None,
                dead: false,
                finalized: false,
                outstanding: 0,
                queued: 0,
                collectives: 0,
                splits: 0,
                shrinks: 0,
            }),
            changed: Condvar::new(),
            aborted: AtomicBool::new(false),
            abort_signal: watch::channel(false).0,
            desync_warned: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, CommState> {
        // Every update is a few assignments with nothing that can panic in between.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shape(&self) -> (u32, u32) {
        (self.rank.load(Ordering::SeqCst), self.world.load(Ordering::SeqCst))
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Everything an abort does but wait: later calls are refused, waiting kernels end.
    fn raise_abort(&self) {
        let mut s = self.lock();
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        s.grouped.clear();
        s.group_depth = 0;
        s.faults.clear();
        if let Some(armed) = s.armed_hang.take() {
            armed.store(false, Ordering::SeqCst);
        }
        drop(s);
        self.changed.notify_all();
        self.abort_signal.send_replace(true);
    }

    fn abort(&self) {
        self.raise_abort();
        // ncclCommAbort then synchronizes NCCL's own streams, which wait on every stream a
        // launch was enqueued on: it returns once each launch was reached (and, aborted, ended
        // at once). A stream held by something else keeps it waiting.
        let mut s = self.lock();
        while s.queued > 0 {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Whether `call` may use the communicator now. NCCL's `ncclCommEnsureReady`: a
    /// communicator still in progress refuses with `ncclInvalidArgument`, one with an
    /// asynchronous error returns that error.
    fn usable(&self, s: &CommState, call: &'static str, allow_async_error: bool) -> Result<(), NcclError> {
        if self.is_aborted() {
            return Err(NcclError::Aborted);
        }
        if self.device.sticky().is_some() {
            return Err(NcclError::Nccl { call, result: NcclResult::UnhandledCudaError });
        }
        match s.readiness {
            Readiness::Ready => {}
            Readiness::InProgress => {
                tracing::warn!(call, comm = %self.id, "attempt to use the communicator before its init finished");
                return Err(NcclError::Nccl { call, result: NcclResult::InvalidArgument });
            }
            Readiness::Failed(result) => return Err(NcclError::Nccl { call, result }),
        }
        if let Some(result) = s.async_error
            && !allow_async_error
        {
            return Err(NcclError::Nccl { call, result });
        }
        if s.finalized {
            tracing::warn!(call, comm = %self.id, "the communicator was finalized");
            return Err(NcclError::Nccl { call, result: NcclResult::InvalidUsage });
        }
        Ok(())
    }

    /// Arms the device hang of a [`EmuFault::KernelHang`] that became next in line.
    fn arm_head(&self, s: &mut CommState) {
        if s.armed_hang.is_none() && s.faults.front() == Some(&EmuFault::KernelHang) {
            s.armed_hang = Some(self.device.arm_hang());
        }
    }

    /// A kernel broke: the communicator reports `result` from now on (the first error stays).
    fn set_async_error(&self, result: NcclResult) {
        self.lock().async_error.get_or_insert(result);
    }

    /// Launches `items` as one kernel (one launch: a top-level enqueue or a whole group).
    fn launch(self: &Arc<Self>, items: Vec<(Prepared, StreamHandle)>, call: &'static str) -> Result<(), NcclError> {
        let mut s = self.lock();
        let fault = s.faults.pop_front();
        if fault == Some(EmuFault::KernelHang) {
            // Its hang is armed: if no stream operation took it yet, this launch's will.
            s.armed_hang = None;
        }
        if fault == Some(EmuFault::EnqueueBlocks) {
            // Blocks the calling thread (the one documented exception) until an abort.
            while !self.is_aborted() {
                s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
            }
            return Err(NcclError::Aborted);
        }
        if fault == Some(EmuFault::Dies) {
            s.dead = true;
        }
        let dead = s.dead;
        let mut streams: Vec<StreamHandle> = Vec::new();
        let mut ops = Vec::with_capacity(items.len());
        for (op, stream) in items {
            let seq = match op {
                Prepared::Collective(_) => {
                    s.collectives += 1;
                    s.collectives
                }
                Prepared::Send { .. } | Prepared::Recv { .. } => 0,
            };
            if !streams.iter().any(|h| h.id == stream.id) {
                streams.push(stream);
            }
            ops.push((op, seq));
        }
        s.outstanding += 1;
        s.queued += streams.len() as u64;
        drop(s);
        let guard = Counted::outstanding(self);
        let mut queued: Vec<Counted> = streams.iter().map(|_| Counted::queued(self)).collect();
        let (primary, others) = streams.split_first().expect("a launch has at least one op");
        // NCCL joins every stream of a group: the kernel starts once all of them got there and
        // each of them goes on once it is done. The kernel runs on the first stream.
        let mut arrivals = Vec::new();
        let mut dones = Vec::new();
        for other in others {
            let (arrive, arrived) = oneshot::channel::<()>();
            let (done_tx, done_rx) = oneshot::channel::<()>();
            let mut aborted = self.abort_signal.subscribe();
            let reached = queued.pop().expect("one per stream");
            self.device.push_on(
                other,
                call,
                Box::pin(async move {
                    drop(reached);
                    drop(arrive);
                    tokio::select! {
                        biased;
                        _ = aborted.wait_for(|a| *a) => {}
                        _ = done_rx => {}
                    }
                }),
            )?;
            arrivals.push(arrived);
            dones.push(done_tx);
        }
        let kernel = Kernel { comm: self.clone(), ops, fault, dead };
        let mut aborted = self.abort_signal.subscribe();
        let reached = queued.pop().expect("one per stream");
        self.device.push_on(
            primary,
            call,
            Box::pin(async move {
                drop(reached);
                let _guard = guard;
                let work = async move {
                    for a in arrivals {
                        let _ = a.await;
                    }
                    kernel.run().await;
                };
                // ncclCommAbort ends this rank's pending kernels: the stream goes on without
                // the data.
                tokio::select! {
                    biased;
                    _ = aborted.wait_for(|a| *a) => {}
                    () = work => {}
                }
                drop(dones);
            }),
        )?;
        // A KernelHang next in line hangs the device after this launch, ahead of the next.
        self.arm_head(&mut self.lock());
        Ok(())
    }

    fn ready(&self, rank: u32, world: u32) {
        self.rank.store(rank, Ordering::SeqCst);
        self.world.store(world, Ordering::SeqCst);
        self.lock().readiness = Readiness::Ready;
    }

    fn failed(&self, result: NcclResult) {
        self.lock().readiness = Readiness::Failed(result);
    }

    /// Finishes setting up a communicator with `work` (a rendezvous giving its rank and world
    /// size): on the calling thread if it is blocking, in a task otherwise. An abort of the
    /// communicator, or of `parent`, ends the setup.
    fn setup(
        self: &Arc<Self>,
        parent: Option<watch::Receiver<bool>>,
        work: impl Future<Output = Result<(u32, u32), NcclResult>> + Send + 'static,
        call: &'static str,
    ) -> Result<(), NcclError> {
        let comm = self.clone();
        let mut own = self.abort_signal.subscribe();
        let task = async move {
            let parent_aborted = async move {
                match parent {
                    Some(mut p) => {
                        let _ = p.wait_for(|a| *a).await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = own.wait_for(|a| *a) => {}
                () = parent_aborted => comm.abort(),
                outcome = work => match outcome {
                    Ok((rank, world)) => comm.ready(rank, world),
                    Err(result) => comm.failed(result),
                },
            }
        };
        if !self.blocking {
            // NCCL's non-blocking config: the call returns, async_error says ncclInProgress.
            self.device.config().runtime.spawn(task);
            return Ok(());
        }
        self.device.block_on_host(task).ok_or_else(runtime_gone)?;
        if self.is_aborted() {
            return Err(NcclError::Aborted);
        }
        match self.lock().readiness {
            Readiness::Failed(result) => Err(NcclError::Nccl { call, result }),
            _ => Ok(()),
        }
    }

    /// A collective whose ranks disagree: NCCL does not check, the kernels wait for data that
    /// never comes. Says so once per communicator, then hangs.
    async fn desync(&self, seq: u64, detail: String) {
        if !self.desync_warned.swap(true, Ordering::SeqCst) {
            tracing::warn!(comm = %self.id, seq, "{detail}: the collective hangs, as mismatched NCCL collectives do");
        }
        std::future::pending::<()>().await;
    }

    /// A kernel cannot go on: the communicator reports `result` and the kernel hangs until an
    /// abort, as a failed NCCL kernel does.
    async fn broken(&self, result: NcclResult, why: &str) {
        tracing::warn!(comm = %self.id, %result, "{why}");
        self.set_async_error(result);
        std::future::pending::<()>().await;
    }
}

fn runtime_gone() -> NcclError {
    NcclError::Unavailable("the tokio runtime that runs the emulation has shut down".into())
}

/// The NCCL result a fabric failure shows up as.
fn fabric_result(e: &NcclError) -> NcclResult {
    match e {
        NcclError::Invalid(_) => NcclResult::InvalidUsage,
        NcclError::Store(_) => NcclResult::SystemError,
        _ => NcclResult::InternalError,
    }
}

/// One count of the communicator's state, taken back when dropped; threads waiting on the
/// state are woken when it reaches zero. `Counted::outstanding`: a kernel until it ends or is
/// dropped (finalize waits for these). `Counted::queued`: one stream operation of a launch
/// until its stream reaches it or drops it (abort waits for these). The caller has counted it.
struct Counted {
    comm: Arc<CommInner>,
    count: fn(&mut CommState) -> &mut u64,
}

impl Counted {
    fn outstanding(comm: &Arc<CommInner>) -> Counted {
        Counted { comm: comm.clone(), count: |s| &mut s.outstanding }
    }

    fn queued(comm: &Arc<CommInner>) -> Counted {
        Counted { comm: comm.clone(), count: |s| &mut s.queued }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut s = self.comm.lock();
        let n = (self.count)(&mut s);
        *n -= 1;
        let zero = *n == 0;
        drop(s);
        if zero {
            self.comm.changed.notify_all();
        }
    }
}

/// `ncclCommInitRankConfig` on `dev`.
pub(super) fn init(
    dev: &EmuDevice,
    id: &[u8; 128],
    world: u32,
    rank: u32,
    config: CommConfig,
) -> Result<EmuComm, NcclError> {
    const CALL: &str = "ncclCommInitRankConfig";
    if world == 0 || rank >= world {
        tracing::warn!(rank, world, "{CALL}: invalid rank {rank} for world size {world}");
        return Err(NcclError::Nccl { call: CALL, result: NcclResult::InvalidArgument });
    }
    if dev.sticky().is_some() {
        return Err(NcclError::Nccl { call: CALL, result: NcclResult::UnhandledCudaError });
    }
    let comm_id = hash_id(&[b"init", id]);
    let inner = CommInner::new(dev.clone(), comm_id.clone(), config.blocking, rank, world);
    let hang = dev.take_init_hang();
    let fabric = dev.config().fabric.clone();
    let work = async move {
        if hang {
            std::future::pending::<()>().await;
        }
        let all =
            fabric.exchange(format!("i/{comm_id}"), rank, world, world.to_le_bytes().to_vec()).await.map_err(|e| {
                tracing::warn!(comm = %comm_id, "{CALL}: rendezvous failed: {e}");
                fabric_result(&e)
            })?;
        if all.iter().any(|w| w[..] != world.to_le_bytes()) {
            tracing::warn!(comm = %comm_id, "{CALL}: the ranks disagree on the world size");
            return Err(NcclResult::InvalidUsage);
        }
        Ok((rank, world))
    };
    inner.setup(None, work, CALL)?;
    Ok(EmuComm { inner })
}

impl Communicator for EmuComm {
    type Device = EmuDevice;

    /// For a non-blocking split still in progress: the parent's rank until it finished.
    fn rank(&self) -> u32 {
        self.inner.shape().0
    }

    /// For a non-blocking split still in progress: the parent's size until it finished.
    fn world_size(&self) -> u32 {
        self.inner.shape().1
    }

    fn enqueue(&self, op: CommOp<EmuBuffer>, stream: &EmuStream) -> Result<(), NcclError> {
        let call = op.call_name();
        let mut s = self.inner.lock();
        self.inner.usable(&s, call, false)?;
        let (rank, world) = self.inner.shape();
        let prepared = prepare(op, call, rank, world)?;
        if s.group_depth > 0 {
            s.grouped.push((prepared, stream.handle()));
            return Ok(());
        }
        drop(s);
        self.inner.launch(vec![(prepared, stream.handle())], call)
    }

    /// Nesting counts, as NCCL's does; the group is per communicator here (NCCL's is per
    /// thread, across communicators).
    fn group_start(&self) -> Result<(), NcclError> {
        let mut s = self.inner.lock();
        if self.inner.is_aborted() {
            return Err(NcclError::Aborted);
        }
        s.group_depth += 1;
        Ok(())
    }

    fn group_end(&self) -> Result<(), NcclError> {
        const CALL: &str = "ncclGroupEnd";
        let mut s = self.inner.lock();
        if self.inner.is_aborted() {
            return Err(NcclError::Aborted);
        }
        if s.group_depth == 0 {
            tracing::warn!(comm = %self.inner.id, "{CALL} without ncclGroupStart");
            return Err(NcclError::Nccl { call: CALL, result: NcclResult::InvalidUsage });
        }
        s.group_depth -= 1;
        if s.group_depth > 0 || s.grouped.is_empty() {
            return Ok(());
        }
        let items = std::mem::take(&mut s.grouped);
        drop(s);
        self.inner.launch(items, CALL)
    }

    fn async_error(&self) -> Result<NcclResult, NcclError> {
        if self.inner.is_aborted() {
            return Err(NcclError::Aborted);
        }
        if self.inner.device.sticky().is_some() {
            // NCCL reports a CUDA failure it saw as ncclUnhandledCudaError.
            return Ok(NcclResult::UnhandledCudaError);
        }
        let s = self.inner.lock();
        Ok(match s.readiness {
            Readiness::InProgress => NcclResult::InProgress,
            Readiness::Failed(result) => result,
            Readiness::Ready => match s.async_error {
                Some(result) => result,
                // A non-blocking ncclCommFinalize is in progress until its work drained.
                None if s.finalized && s.outstanding > 0 => NcclResult::InProgress,
                None => NcclResult::Success,
            },
        })
    }

    /// From any thread: pending kernels of this rank end without their data (the stream goes
    /// on), a blocked `enqueue` returns `Aborted`, setup rendezvous stop, and every later call
    /// is refused at once. Then it waits until every stream this communicator launched on has
    /// reached its launch, as `ncclCommAbort` does (it synchronizes NCCL's internal streams):
    /// a launch queued behind a held stream ([`EmuDevice::block_stream`], a
    /// [`EmuFault::KernelHang`]) keeps it from returning until the stream goes on, so call it
    /// from a thread that may block. Peers are not told: their kernels keep waiting, as they do
    /// for a real aborted rank.
    fn abort(&self) {
        self.inner.abort();
    }

    /// Refuses later calls and ends this rank's waiting kernels, without waiting for the
    /// streams: deterministic under the simulator, where it runs on the watchdog's task.
    fn raise_abort(&self) {
        self.inner.raise_abort();
    }

    fn is_aborted(&self) -> bool {
        self.inner.is_aborted()
    }

    /// A rendezvous of every parent rank (exchanging colors and keys); blocking for a blocking
    /// communicator, else returning at once with a child in progress (NCCL's non-blocking
    /// split). `None` takes part and returns `None`.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>, NcclError> {
        const CALL: &str = "ncclCommSplit";
        let (n, dead) = {
            let mut s = self.inner.lock();
            self.inner.usable(&s, CALL, false)?;
            s.splits += 1;
            (s.splits, s.dead)
        };
        let (rank, world) = self.inner.shape();
        let fabric = self.inner.device.config().fabric.clone();
        let xkey = format!("s/{}/{n}", self.inner.id);
        let mut data = vec![u8::from(color.is_some())];
        data.extend(color.unwrap_or(0).to_le_bytes());
        data.extend(key.to_le_bytes());
        let exchange = async move {
            if dead {
                std::future::pending::<()>().await;
            }
            let all = fabric.exchange(xkey, rank, world, data).await.map_err(|e| fabric_result(&e))?;
            let mut members = Vec::new();
            for (parent_rank, d) in all.iter().enumerate() {
                let entry = parse_split_entry(d).ok_or(NcclResult::InternalError)?;
                if color.is_some() && entry.0 == color {
                    members.push((entry.1, parent_rank as u32));
                }
            }
            // ncclCommSplit: ranks of one color, ordered by key, then by parent rank.
            members.sort_unstable();
            let new_rank = members.iter().position(|m| m.1 == rank).unwrap_or(0) as u32;
            Ok((new_rank, members.len() as u32))
        };
        let Some(c) = color else {
            // NCCL_SPLIT_NOCOLOR: takes part in the rendezvous, gets no communicator.
            let mut aborted = self.inner.abort_signal.subscribe();
            let task = async move {
                tokio::select! {
                    biased;
                    _ = aborted.wait_for(|a| *a) => {}
                    _ = exchange => {}
                }
            };
            if self.inner.blocking {
                self.inner.device.block_on_host(task).ok_or_else(runtime_gone)?;
                if self.inner.is_aborted() {
                    return Err(NcclError::Aborted);
                }
            } else {
                self.inner.device.config().runtime.spawn(task);
            }
            return Ok(None);
        };
        let child_id = hash_id(&[b"split", self.inner.id.as_bytes(), &n.to_le_bytes(), &c.to_le_bytes()]);
        let child = CommInner::new(self.inner.device.clone(), child_id, self.inner.blocking, rank, world);
        child.setup(Some(self.inner.abort_signal.subscribe()), exchange, CALL)?;
        Ok(Some(EmuComm { inner: child }))
    }

    /// Only the remaining ranks meet (the excluded may be dead); ranks that pass different
    /// lists never meet and hang. Blocking or not as the parent is. Allowed on a communicator
    /// with an asynchronous error: recovering from one is what shrink is for.
    fn shrink(&self, exclude: &[u32]) -> Result<Self, NcclError> {
        const CALL: &str = "ncclCommShrink";
        require_version(CALL, self.inner.device.config().nccl_version, 2, 27)?;
        let (rank, world) = self.inner.shape();
        let mut excluded = exclude.to_vec();
        excluded.sort_unstable();
        excluded.dedup();
        if excluded.iter().any(|r| *r >= world) || excluded.contains(&rank) {
            tracing::warn!(rank, world, ?excluded, "{CALL}: ranks to exclude must be other ranks of the communicator");
            return Err(NcclError::Nccl { call: CALL, result: NcclResult::InvalidArgument });
        }
        let (n, dead) = {
            let mut s = self.inner.lock();
            self.inner.usable(&s, CALL, true)?;
            s.shrinks += 1;
            (s.shrinks, s.dead)
        };
        let survivors: Vec<u32> = (0..world).filter(|r| !excluded.contains(r)).collect();
        let new_rank = survivors.iter().position(|r| *r == rank).expect("the caller is not excluded") as u32;
        let new_world = survivors.len() as u32;
        let list: Vec<u8> = excluded.iter().flat_map(|r| r.to_le_bytes()).collect();
        let child_id = hash_id(&[b"shrink", self.inner.id.as_bytes(), &n.to_le_bytes(), &list]);
        let fabric = self.inner.device.config().fabric.clone();
        let key = format!("k/{child_id}");
        let work = async move {
            if dead {
                std::future::pending::<()>().await;
            }
            fabric.exchange(key, new_rank, new_world, Vec::new()).await.map_err(|e| fabric_result(&e))?;
            Ok((new_rank, new_world))
        };
        let child = CommInner::new(self.inner.device.clone(), child_id, self.inner.blocking, new_rank, new_world);
        child.setup(Some(self.inner.abort_signal.subscribe()), work, CALL)?;
        Ok(EmuComm { inner: child })
    }

    /// Later launches are refused (`ncclInvalidUsage`). A blocking communicator waits here,
    /// blocking the calling thread, until its launched kernels ended (or it is aborted); a
    /// non-blocking one returns at once and reports `ncclInProgress` from `async_error` until
    /// then (NCCL's `ncclCommFinalize` in either config).
    fn finalize(&self) -> Result<(), NcclError> {
        let mut s = self.inner.lock();
        if self.inner.is_aborted() {
            return Err(NcclError::Aborted);
        }
        s.finalized = true;
        if !self.inner.blocking {
            return Ok(());
        }
        while s.outstanding > 0 && !self.inner.is_aborted() {
            s = self.inner.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        if self.inner.is_aborted() { Err(NcclError::Aborted) } else { Ok(()) }
    }
}

fn parse_split_entry(d: &[u8]) -> Option<(Option<u32>, u32)> {
    let d: &[u8; 9] = d.try_into().ok()?;
    let color = u32::from_le_bytes(d[1..5].try_into().ok()?);
    let key = u32::from_le_bytes(d[5..9].try_into().ok()?);
    Some((if d[0] == 1 { Some(color) } else { None }, key))
}

/// A communicator id: 32 hex digits of two FNV-1a hashes over `parts` (each prefixed by its
/// length). Deterministic, the same on every rank.
fn hash_id(parts: &[&[u8]]) -> String {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let (mut a, mut b) = (0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64);
    for part in parts {
        for &byte in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            a = (a ^ u64::from(byte)).wrapping_mul(PRIME);
            b = (b ^ u64::from(byte)).wrapping_mul(PRIME).rotate_left(17);
        }
    }
    format!("{a:016x}{b:016x}")
}

// ---- ops -------------------------------------------------------------------------------------

/// A part of a device buffer, checked at enqueue.
#[derive(Clone)]
struct Region {
    buf: EmuBuffer,
    offset: usize,
    len: usize,
}

impl Region {
    fn read(&self) -> Vec<u8> {
        self.buf.read(self.offset, self.len).expect("checked at enqueue and buffers never shrink")
    }

    fn write(&self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.len);
        let written = self.buf.write(self.offset, bytes);
        debug_assert!(written, "checked at enqueue and buffers never shrink");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllReduce = 0,
    Broadcast = 1,
    Reduce = 2,
    AllGather = 3,
    ReduceScatter = 4,
}

/// A validated collective.
struct Collective {
    kind: Kind,
    /// What this rank contributes (none for a broadcast's non-root ranks).
    send: Option<Region>,
    /// Where its result goes (none for a reduce's non-root ranks).
    recv: Option<Region>,
    count: usize,
    dtype: NcclDataType,
    op: Option<NcclRedOp>,
    root: u32,
    reduction: Option<Reduction>,
}

const HEADER_LEN: usize = 21;

impl Collective {
    /// What every rank must agree on: kind, count, dtype code, reduce-op code, root.
    fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = self.kind as u8;
        h[1..9].copy_from_slice(&(self.count as u64).to_le_bytes());
        h[9..13].copy_from_slice(&self.dtype.code().to_le_bytes());
        h[13..17].copy_from_slice(&self.op.map_or(-1, NcclRedOp::code).to_le_bytes());
        h[17..21].copy_from_slice(&self.root.to_le_bytes());
        h
    }
}

/// A validated op, ready to launch.
enum Prepared {
    Collective(Collective),
    Send { src: Region, peer: u32 },
    Recv { dst: Region, peer: u32 },
}

/// Checks `op` against the buffers and the communicator (NCCL's argument checks, which return
/// `ncclInvalidArgument`).
fn prepare(op: CommOp<EmuBuffer>, call: &'static str, rank: u32, world: u32) -> Result<Prepared, NcclError> {
    let invalid = |why: String| {
        tracing::warn!(call, "{call}: {why}");
        NcclError::Nccl { call, result: NcclResult::InvalidArgument }
    };
    let region = |r: crate::nccl::device::BufRef<EmuBuffer>, count: usize, dtype: NcclDataType, what: &str| {
        let len = count.checked_mul(dtype.size()).ok_or_else(|| invalid(format!("{count} elements overflow")))?;
        let have = r.buf.len();
        match r.offset.checked_add(len) {
            Some(end) if end <= have => Ok(Region { buf: r.buf, offset: r.offset, len }),
            _ => Err(invalid(format!("the {what} buffer holds {have} bytes, {len} needed at offset {}", r.offset))),
        }
    };
    let reduction = |op: NcclRedOp, dtype: NcclDataType| {
        let dt = dtype.to_dtype().ok_or_else(|| invalid(format!("no reduction for NCCL data type {dtype:?}")))?;
        Reduction::new(op.to_reduce_op(), dt).map_err(|e| invalid(e.to_string()))
    };
    let check_rank = |r: u32, what: &str| {
        if r < world { Ok(()) } else { Err(invalid(format!("{what} {r} is not a rank of a world of {world}"))) }
    };
    let w = world as usize;
    Ok(match op {
        CommOp::AllReduce { send, recv, count, dtype, op } => Prepared::Collective(Collective {
            kind: Kind::AllReduce,
            send: Some(region(send, count, dtype, "send")?),
            recv: Some(region(recv, count, dtype, "receive")?),
            count,
            dtype,
            op: Some(op),
            root: 0,
            reduction: Some(reduction(op, dtype)?),
        }),
        CommOp::Broadcast { send, recv, count, dtype, root } => {
            check_rank(root, "root")?;
            Prepared::Collective(Collective {
                kind: Kind::Broadcast,
                send: if rank == root { Some(region(send, count, dtype, "send")?) } else { None },
                recv: Some(region(recv, count, dtype, "receive")?),
                count,
                dtype,
                op: None,
                root,
                reduction: None,
            })
        }
        CommOp::Reduce { send, recv, count, dtype, op, root } => {
            check_rank(root, "root")?;
            Prepared::Collective(Collective {
                kind: Kind::Reduce,
                send: Some(region(send, count, dtype, "send")?),
                recv: if rank == root { Some(region(recv, count, dtype, "receive")?) } else { None },
                count,
                dtype,
                op: Some(op),
                root,
                reduction: Some(reduction(op, dtype)?),
            })
        }
        CommOp::AllGather { send, recv, count, dtype } => {
            let total = count.checked_mul(w).ok_or_else(|| invalid(format!("{count} elements overflow")))?;
            Prepared::Collective(Collective {
                kind: Kind::AllGather,
                send: Some(region(send, count, dtype, "send")?),
                recv: Some(region(recv, total, dtype, "receive")?),
                count,
                dtype,
                op: None,
                root: 0,
                reduction: None,
            })
        }
        CommOp::ReduceScatter { send, recv, count, dtype, op } => {
            let total = count.checked_mul(w).ok_or_else(|| invalid(format!("{count} elements overflow")))?;
            Prepared::Collective(Collective {
                kind: Kind::ReduceScatter,
                send: Some(region(send, total, dtype, "send")?),
                recv: Some(region(recv, count, dtype, "receive")?),
                count,
                dtype,
                op: Some(op),
                root: 0,
                reduction: Some(reduction(op, dtype)?),
            })
        }
        CommOp::Send { buf, count, dtype, peer } => {
            check_rank(peer, "peer")?;
            Prepared::Send { src: region(buf, count, dtype, "send")?, peer }
        }
        CommOp::Recv { buf, count, dtype, peer } => {
            check_rank(peer, "peer")?;
            Prepared::Recv { dst: region(buf, count, dtype, "receive")?, peer }
        }
    })
}

// ---- kernels ---------------------------------------------------------------------------------

type OpFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// One launch, as the stream runs it.
struct Kernel {
    comm: Arc<CommInner>,
    ops: Vec<(Prepared, u64)>,
    fault: Option<EmuFault>,
    dead: bool,
}

impl Kernel {
    async fn run(self) {
        if self.dead {
            std::future::pending::<()>().await;
        }
        match self.fault {
            Some(EmuFault::SlowKernel(d)) => tokio::time::sleep(d).await,
            Some(EmuFault::AsyncError(result)) => {
                self.comm.set_async_error(result);
                std::future::pending::<()>().await;
            }
            _ => {}
        }
        let (rank, world) = self.comm.shape();
        // Every op posts its request now, in launch order (that order is what matches sends
        // to receives), then all of them wait together: NCCL runs a group's operations as one
        // kernel, so grouped sends and receives that need each other cannot deadlock.
        let ops: Vec<OpFuture> =
            self.ops.into_iter().map(|(op, seq)| start_op(self.comm.clone(), op, seq, rank, world)).collect();
        JoinAll(ops.into_iter().map(Some).collect()).await;
    }
}

/// Reads the op's input and posts it to the fabric; the returned future finishes the op.
fn start_op(comm: Arc<CommInner>, op: Prepared, seq: u64, rank: u32, world: u32) -> OpFuture {
    let fabric = comm.device.config().fabric.clone();
    match op {
        Prepared::Collective(c) => {
            let mut data = c.header().to_vec();
            if let Some(send) = &c.send {
                data.extend(send.read());
            }
            let posted = fabric.exchange(format!("c/{}/{seq}", comm.id), rank, world, data);
            Box::pin(async move {
                match posted.await {
                    Ok(all) => finish_collective(&comm, c, seq, rank, all).await,
                    Err(e) => {
                        comm.broken(fabric_result(&e), &format!("collective {seq}: the fabric failed: {e}")).await
                    }
                }
            })
        }
        Prepared::Send { src, peer } => {
            let posted = fabric.send(format!("p/{}/{rank}/{peer}", comm.id), src.read());
            Box::pin(async move {
                if let Err(e) = posted.await {
                    comm.broken(fabric_result(&e), &format!("send to {peer}: the fabric failed: {e}")).await;
                }
            })
        }
        Prepared::Recv { dst, peer } => {
            let posted = fabric.recv(format!("p/{}/{peer}/{rank}", comm.id));
            Box::pin(async move {
                match posted.await {
                    Ok(data) if data.len() == dst.len => dst.write(&data),
                    // A receive matched with a send of another size: NCCL does not truncate;
                    // the emulation calls it invalid usage and the kernel stops there.
                    Ok(data) => {
                        let why = format!("receive from {peer}: {} bytes sent, {} bytes expected", data.len(), dst.len);
                        comm.broken(NcclResult::InvalidUsage, &why).await;
                    }
                    Err(e) => {
                        comm.broken(fabric_result(&e), &format!("receive from {peer}: the fabric failed: {e}")).await
                    }
                }
            })
        }
    }
}

/// Computes this rank's output of a collective from every rank's contribution (NCCL's
/// definitions of each collective).
async fn finish_collective(comm: &CommInner, c: Collective, seq: u64, rank: u32, all: Vec<Vec<u8>>) {
    let header = c.header();
    let bytes = c.len_per_rank();
    let world = all.len();
    let mut inputs: Vec<&[u8]> = Vec::with_capacity(world);
    for (r, d) in all.iter().enumerate() {
        if d.len() < HEADER_LEN || d[..HEADER_LEN] != header {
            let detail = format!("rank {rank} called {:?} {:?}, rank {r} called something else", c.kind, c.dtype);
            return comm.desync(seq, detail).await;
        }
        inputs.push(&d[HEADER_LEN..]);
    }
    let reduce = |parts: &mut dyn Iterator<Item = &[u8]>| -> Option<Vec<u8>> {
        let red = c.reduction.as_ref()?;
        let mut acc = parts.next()?.to_vec();
        for p in parts {
            red.combine(&mut acc, p).ok()?;
        }
        red.finalize(&mut acc, world).ok()?;
        Some(acc)
    };
    let expect_len = |want: usize, sources: &[&[u8]]| sources.iter().all(|s| s.len() == want);
    let out: Option<Vec<u8>> = match c.kind {
        Kind::AllReduce | Kind::Reduce => {
            if !expect_len(bytes, &inputs) {
                None
            } else if c.kind == Kind::Reduce && rank != c.root {
                // ncclReduce: only the root's receive buffer is written.
                return;
            } else {
                reduce(&mut inputs.iter().copied())
            }
        }
        Kind::Broadcast => inputs.get(c.root as usize).filter(|s| s.len() == bytes).map(|s| s.to_vec()),
        Kind::AllGather => expect_len(bytes, &inputs).then(|| inputs.concat()),
        Kind::ReduceScatter => {
            let start = rank as usize * bytes;
            if expect_len(bytes * world, &inputs) {
                reduce(&mut inputs.iter().map(|s| &s[start..start + bytes]))
            } else {
                None
            }
        }
    };
    match (out, &c.recv) {
        (Some(out), Some(recv)) => recv.write(&out),
        (Some(_), None) => {}
        (None, _) => comm.desync(seq, format!("{:?} contributions of unexpected sizes", c.kind)).await,
    }
}

impl Collective {
    /// The bytes each rank contributes (a reduce-scatter's: one block of `world`).
    fn len_per_rank(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// Polls every op until all are done (a hand-written `join_all`: in order, deterministic).
struct JoinAll(Vec<Option<OpFuture>>);

impl Future for JoinAll {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut pending = false;
        for slot in self.0.iter_mut() {
            if let Some(f) = slot {
                if f.as_mut().poll(cx).is_ready() {
                    *slot = None;
                } else {
                    pending = true;
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    }
}
