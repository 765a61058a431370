//! [`NcclProcessGroup`]: ProcessGroupNCCL's lifecycle on core's `GroupState`, over any
//! [`Device`] (CUDA, or the host emulation).
//!
//! # How it runs
//!
//! A collective is submitted to the group's `GroupState` from the caller's thread (so the
//! returned [`Work`] knows its sequence number and the flight recorder has its entry), then
//! enqueued on the group's NCCL stream between a start and an end event, after the NCCL stream
//! was made to wait for the compute stream (c10d's `syncStream`). Enqueues are serialized in
//! issue order; the group's state lock is not held while NCCL is called, so an enqueue that
//! blocks never stops the watchdog.
//!
//! The watchdog, a task on the group's tokio runtime (so that the simulator drives it), polls
//! the events in issue order (start → `handle_started`, end → the device-measured time and
//! `handle_completion`), the communicator's asynchronous error (→ `handle_comm_error`), and
//! fires the core's deadlines. Every few hundred milliseconds it also talks to the store:
//! it publishes this rank's progress (last enqueued, started and completed collective) and
//! reads whether another rank published a failure. Once a collective has run half its timeout
//! it reads every rank's progress (c10d's desync debug) and tells the core which ranks hold it
//! back, so that the timeout names them. A CUDA error from an event query is a communicator
//! error, never a timeout.
//!
//! When the group fails (or is aborted), the communicator is aborted (except under
//! `SkipCleanUp`), the flight recorder is dumped when a dump prefix is set, and a local
//! failure is published through the store (first writer wins) for ranks that would otherwise
//! only see their collective hang — NCCL tells nobody about a peer's failure.
//!
//! A monitor thread watches the watchdog's heartbeat (c10d's `HeartbeatMonitor`,
//! `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`): a watchdog stuck for that long is reported, the
//! recorder dumped, and by default the process aborted.
//!
//! `Work::wait` blocks the host until the work ends; c10d's default, a wait that only makes the
//! caller's stream wait on the device, is [`NcclProcessGroup::wait_stream`]. In blocking-wait
//! mode ([`NcclOptions::blocking_wait`], `TORCH_NCCL_BLOCKING_WAIT=1`) the waiting thread does
//! the watchdog's device pass itself, so its wait ends, and its timeout is caught, even when
//! the watchdog cannot run.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use cohort_core::group::{
    Collective, Completion, ErrorHandling, Event, GroupConfig, GroupFailure, GroupState, TensorSpec, WorkSummary,
};
use cohort_core::protocol::{FailureRecord, ProgressRecord};
use cohort_core::recorder::RecorderConfig;
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Tensor};
use cohort_core::work::{GroupId, OpType, Rank, SeqNo, WorkId};
use tokio::sync::Notify;

use super::device::{
    BufRef, CommConfig, CommOp, Communicator, Device, HostBuffer, NcclError, NcclResult, nccl_dtype, nccl_op,
};
use crate::env::{self, Env, EnvError};
use crate::store::Store;
use crate::work::{CompletionHook, Work, WorkCompleter};

/// The backend name in flight-recorder profiling names (`nccl:all_reduce`), as c10d's.
pub const BACKEND_NAME: &str = "nccl";

/// The current time as the core wants it: tokio's clock (turmoil drives it in the simulator).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// What the monitor does when the watchdog stops beating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MonitorAction {
    /// Dump the flight recorder and abort the process, as c10d does.
    AbortProcess,
    /// Dump the flight recorder and log it; the process goes on.
    Report,
}

/// Options of an NCCL process group (what `ProcessGroupNCCL::Options` and the `TORCH_NCCL_*`
/// variables set). Every `COHORT_*` variable below also reads its `TORCH_NCCL_*` twin.
#[derive(Debug, Clone, PartialEq)]
pub struct NcclOptions {
    /// Default timeout of every collective (c10d's NCCL default, 10 minutes).
    /// `COHORT_TIMEOUT_MS` (collectives only, as under TCP: it does not change `init_timeout`).
    pub timeout: Duration,
    /// How long communicator init may take. `COHORT_INIT_TIMEOUT_MS`, default 10 minutes.
    pub init_timeout: Duration,
    /// What to do after a failure. `COHORT_ASYNC_ERROR_HANDLING` /
    /// `TORCH_NCCL_ASYNC_ERROR_HANDLING` (0-3), default 2 (clean up only: abort the
    /// communicator, keep the process).
    pub error_handling: ErrorHandling,
    /// A blocking communicator (NCCL's `config.blocking`). `COHORT_NCCL_BLOCKING`, default off:
    /// a non-blocking communicator can be aborted while its init or a call is in progress.
    pub blocking_comm: bool,
    /// Create the communicator at the first collective rather than in `new` (c10d's lazy init,
    /// without `device_id`). The unique id is exchanged in `new` either way.
    /// `COHORT_NCCL_LAZY_INIT`, default off (eager, as with `device_id`).
    pub lazy_init: bool,
    /// Desync debug: every rank publishes its progress through the store and a timeout names
    /// the ranks that hold the collective back. `COHORT_DESYNC_DEBUG` /
    /// `TORCH_NCCL_DESYNC_DEBUG`, default on (c10d's default is off; here it costs one store
    /// write per status interval).
    pub desync_debug: bool,
    /// Time every collective with its start and end events (`duration_ms` in the flight
    /// recorder, `Work::duration`). `COHORT_ENABLE_TIMING` / `TORCH_NCCL_ENABLE_TIMING`,
    /// default off.
    pub enable_timing: bool,
    /// How often the watchdog polls the events and the async error while works run (c10d
    /// polls every 100 ms; cohort finishes works from here, so it polls more often).
    pub poll_interval: Duration,
    /// c10d's blocking-wait mode: a thread in `Work::wait` polls the device, the async error
    /// and the deadlines itself (every 200 µs) instead of sleeping until the watchdog ends the
    /// work, so a wait ends, and a timeout is caught, even when the watchdog cannot run.
    /// `COHORT_BLOCKING_WAIT` / `TORCH_NCCL_BLOCKING_WAIT`, default off.
    pub blocking_wait: bool,
    /// How often the watchdog talks to the store (progress, peers' failures).
    /// `COHORT_STATUS_INTERVAL_MS`, default 200.
    pub status_interval: Duration,
    /// A watchdog silent this long is reported by the monitor; `None` turns the monitor off.
    /// `COHORT_HEARTBEAT_TIMEOUT_SEC` / `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC` (0 turns it off),
    /// default 480 s.
    pub heartbeat_timeout: Option<Duration>,
    /// What the monitor does then. `COHORT_MONITOR_ABORT` (1 abort, 0 report), default abort.
    pub monitor_action: MonitorAction,
    /// Flight-recorder entries kept. `COHORT_TRACE_BUFFER_SIZE` /
    /// `TORCH_NCCL_TRACE_BUFFER_SIZE`, default 2000.
    pub trace_buffer_size: usize,
    /// Where to dump the flight recorder when the group fails: `<prefix><rank>.json`.
    /// `COHORT_DUMP_ON_FAILURE` / `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`; off by default.
    pub dump_prefix: Option<PathBuf>,
    /// The Unix time (ns) the recorder counts from; read from the system clock when `None`.
    /// The simulator sets it so that dumps replay byte for byte.
    pub wall_clock_anchor_ns: Option<u64>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(600),
            init_timeout: Duration::from_secs(600),
            error_handling: ErrorHandling::CleanUpOnly,
            blocking_comm: false,
            lazy_init: false,
            desync_debug: true,
            enable_timing: false,
            poll_interval: Duration::from_millis(1),
            blocking_wait: false,
            status_interval: Duration::from_millis(200),
            heartbeat_timeout: Some(Duration::from_secs(480)),
            monitor_action: MonitorAction::AbortProcess,
            trace_buffer_size: 2000,
            dump_prefix: None,
            wall_clock_anchor_ns: None,
        }
    }
}

impl NcclOptions {
    /// Defaults, overridden by whatever `COHORT_*` (or `TORCH_NCCL_*`) variables are set; a
    /// malformed value is an error naming the variable. `COHORT_TIMEOUT_MS` sets the collective
    /// timeout only (as under TCP); the init timeout is `COHORT_INIT_TIMEOUT_MS`.
    pub fn from_env() -> Result<NcclOptions, EnvError> {
        Self::from_vars(&Env::process())
    }

    /// [`NcclOptions::from_env`] over any source of variables.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<NcclOptions, EnvError> {
        Self::from_vars(&Env::new(lookup))
    }

    fn from_vars<F: Fn(&str) -> Option<String>>(v: &Env<F>) -> Result<NcclOptions, EnvError> {
        let mut o = NcclOptions::default();
        if let Some(t) = v.millis(env::TIMEOUT_MS)? {
            o.timeout = t;
        }
        if let Some(t) = v.millis(env::INIT_TIMEOUT_MS)? {
            o.init_timeout = t;
        }
        if let Some(level) = v.error_handling()? {
            o.error_handling = level;
        }
        if let Some(b) = v.flag(env::NCCL_BLOCKING)? {
            o.blocking_comm = b;
        }
        if let Some(b) = v.flag(env::BLOCKING_WAIT)? {
            o.blocking_wait = b;
        }
        if let Some(b) = v.flag(env::NCCL_LAZY_INIT)? {
            o.lazy_init = b;
        }
        if let Some(b) = v.flag(env::DESYNC_DEBUG)? {
            o.desync_debug = b;
        }
        if let Some(b) = v.flag(env::ENABLE_TIMING)? {
            o.enable_timing = b;
        }
        if let Some(t) = v.millis(env::STATUS_INTERVAL_MS)? {
            if t.is_zero() {
                return Err(EnvError::invalid(env::STATUS_INTERVAL_MS.name(), "0", "expected at least 1"));
            }
            o.status_interval = t;
        }
        if let Some(t) = v.secs(env::HEARTBEAT_TIMEOUT_SEC)? {
            o.heartbeat_timeout = (!t.is_zero()).then_some(t);
        }
        if let Some(b) = v.flag(env::MONITOR_ABORT)? {
            o.monitor_action = if b { MonitorAction::AbortProcess } else { MonitorAction::Report };
        }
        if let Some(n) = v.u64(env::TRACE_BUFFER_SIZE)? {
            o.trace_buffer_size = usize::try_from(n).unwrap_or(usize::MAX);
        }
        o.dump_prefix = v.path(env::DUMP_ON_FAILURE);
        Ok(o)
    }
}

/// A tensor in device memory: a buffer of `numel × dtype size` bytes and a shape.
#[derive(Debug)]
pub struct DeviceTensor<D: Device> {
    buf: D::Buffer,
    dtype: DType,
    shape: Vec<usize>,
}

impl<D: Device> Clone for DeviceTensor<D> {
    /// Another handle to the same device memory.
    fn clone(&self) -> Self {
        DeviceTensor { buf: self.buf.clone(), dtype: self.dtype, shape: self.shape.clone() }
    }
}

impl<D: Device> DeviceTensor<D> {
    /// A tensor of `dtype` and `shape` over `buf` (memory of `device`), from its start; refused
    /// when the buffer holds fewer bytes than the tensor needs.
    pub fn from_parts(device: &D, buf: D::Buffer, dtype: DType, shape: &[usize]) -> Result<Self, NcclError> {
        let need = shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        let have = device.buffer_len(&buf);
        match need {
            Some(need) if need <= have => Ok(DeviceTensor { buf, dtype, shape: shape.to_vec() }),
            _ => Err(NcclError::Invalid(format!(
                "a {} tensor of shape {shape:?} does not fit in a device buffer of {have} bytes",
                dtype.name()
            ))),
        }
    }

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

    /// Bytes of data.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// The device buffer.
    pub fn buffer(&self) -> &D::Buffer {
        &self.buf
    }

    fn spec(&self) -> TensorSpec {
        TensorSpec::new(self.dtype, &self.shape)
    }

    fn at(&self, offset: usize) -> BufRef<D::Buffer> {
        BufRef::at(self.buf.clone(), offset)
    }
}

/// One op of [`NcclProcessGroup::batch_isend_irecv`].
#[derive(Debug)]
pub enum P2pOp<D: Device> {
    /// Send the tensor to the rank.
    Send(DeviceTensor<D>, u32),
    /// Receive into the tensor from the rank.
    Recv(DeviceTensor<D>, u32),
}

/// A work's start and end events.
type Events<D> = (<D as Device>::Event, <D as Device>::Event);

/// A work the device runs: its events, and the buffers kept alive until it is done.
struct Running<D: Device> {
    id: WorkId,
    seq: SeqNo,
    is_p2p: bool,
    start: D::Event,
    end: D::Event,
    started: bool,
    /// When it was enqueued (tokio's clock): desync debug looks once it ran half its timeout.
    since: Instant,
    /// The device may still use these: they live until the end event completes or the
    /// communicator is aborted (c10d's stashed tensors).
    _keep: Vec<D::Buffer>,
}

struct State<D: Device> {
    group: GroupState,
    /// Works on the device, in issue order (the order of their events on the one stream).
    running: VecDeque<Running<D>>,
    /// Works that ended before their kernels did (timed out, failed): their buffers stay
    /// alive until the end event completes or the communicator is aborted.
    zombies: Vec<Running<D>>,
    completers: BTreeMap<WorkId, WorkCompleter>,
    /// This rank's progress, and what was last published of it.
    progress: ProgressRecord,
    published: Option<ProgressRecord>,
    comm_aborted: bool,
}

/// What an input asks of the driver once the state lock is released.
struct Effects<D: Device> {
    finished: Vec<(WorkCompleter, WorkSummary)>,
    /// A failure that started here (to publish), or any failure or abort (to clean up).
    failed: Option<GroupFailure>,
    clean_up: bool,
    /// Buffers of works that ended before their kernels: freed once the abort returned.
    keep_until_aborted: Vec<Running<D>>,
    tear_down: Option<String>,
}

struct Inner<D: Device> {
    rank: Rank,
    world_size: u32,
    group_id: GroupId,
    name: String,
    device: Arc<D>,
    uid: [u8; 128],
    comm: OnceLock<Arc<D::Comm>>,
    nccl_stream: D::Stream,
    compute_stream: D::Stream,
    opts: NcclOptions,
    store: Arc<dyn Store>,
    runtime: tokio::runtime::Handle,
    /// Serializes enqueues: NCCL needs every rank to enqueue in the same order, which is issue
    /// order. Never held together with `state` while NCCL is called.
    enqueue: Mutex<()>,
    state: Mutex<State<D>>,
    wake: Arc<Notify>,
    hook: RwLock<Option<CompletionHook>>,
    /// The watchdog's heartbeat, read by the monitor.
    heartbeat: Arc<AtomicU64>,
    /// Tests stall the watchdog with this to see the monitor act.
    stalled: Arc<AtomicBool>,
    /// Set when the monitor saw the watchdog stall (with [`MonitorAction::Report`]).
    monitor_fired: Arc<AtomicBool>,
    /// Splits and shrinks made from this group so far (they name the children).
    split_count: AtomicU64,
    /// Whether `ncclCommAbort` was called, and whether it returned.
    abort_gate: Arc<AbortGate>,
}

/// The one `ncclCommAbort` of a group, run on a thread of its own.
///
/// `ncclCommAbort` raises NCCL's abort flag at once, which ends NCCL's own kernels and any call
/// blocked in NCCL, and then synchronizes NCCL's internal streams. Those streams wait on every
/// stream the communicator enqueued on, so while something other than an NCCL kernel holds such
/// a stream (a host-side wait, a hung compute kernel) the call does not return. Seen on an H200
/// with NCCL 2.28.9: a collective queued behind a `cuStreamWaitValue32` kept `ncclCommAbort`
/// waiting until the stream was released. So the watchdog never waits for it: it raises the
/// flag inline (`Communicator::raise_abort`), finishes the works, dumps the recorder and
/// publishes the failure while `ncclCommAbort` runs on a thread of its own, and the buffers
/// the device may still use are let go only once that call returned.
#[derive(Default)]
struct AbortGate {
    started: AtomicBool,
    done: Mutex<bool>,
    finished: std::sync::Condvar,
}

impl AbortGate {
    fn is_done(&self) -> bool {
        *self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn finish(&self) {
        *self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.finished.notify_all();
    }

    fn wait(&self) {
        let mut done = self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while !*done {
            done = self.finished.wait(done).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// A process group on NCCL (or its emulation), with c10d's lifecycle: asynchronous works, a
/// watchdog, the flight recorder, failure propagation through the store. Cheap to clone;
/// every clone is the same group.
pub struct NcclProcessGroup<D: Device> {
    inner: Arc<Inner<D>>,
}

impl<D: Device> Clone for NcclProcessGroup<D> {
    fn clone(&self) -> Self {
        NcclProcessGroup { inner: self.inner.clone() }
    }
}

impl<D: Device> std::fmt::Debug for NcclProcessGroup<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .field("group", &self.inner.group_id)
            .finish()
    }
}

fn uid_key(name: &str) -> String {
    format!("cohort/nccl/{name}/uid")
}

fn error_key(name: &str) -> String {
    format!("cohort/nccl/{name}/error")
}

fn progress_key(name: &str, rank: u32) -> String {
    format!("cohort/nccl/{name}/progress/{rank}")
}

fn wall_clock_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

impl<D: Device> NcclProcessGroup<D> {
    /// Creates the group `name` (its store keys live under `cohort/nccl/<name>/`): rank 0 makes
    /// the NCCL unique id and publishes it through `store`, the others read it; then (unless
    /// [`NcclOptions::lazy_init`]) the communicator is created and, when non-blocking, polled
    /// until it is ready or [`NcclOptions::init_timeout`] passes (then it is aborted). The
    /// watchdog runs on `runtime`.
    pub async fn new(
        device: Arc<D>,
        store: Arc<dyn Store>,
        name: &str,
        rank: u32,
        world_size: u32,
        opts: NcclOptions,
        runtime: tokio::runtime::Handle,
    ) -> Result<NcclProcessGroup<D>, NcclError> {
        if world_size == 0 || rank >= world_size {
            return Err(NcclError::Invalid(format!("rank {rank} is not in a group of {world_size}")));
        }
        let key = uid_key(name);
        let uid: [u8; 128] = if rank == 0 {
            let id = device.unique_id()?;
            store.set(&key, &id).await?;
            id
        } else {
            // Polled with CHECK rather than a blocking GET: a TcpStore client runs one call at a
            // time, and a GET parked on it would hold up every other user of the client (rank 0's
            // SET among them, where ranks share one).
            let deadline = tokio::time::Instant::now() + opts.init_timeout;
            let mut delay = Duration::from_millis(1);
            while !store.check(&[key.as_str()]).await? {
                if tokio::time::Instant::now() >= deadline {
                    return Err(NcclError::Timeout(format!(
                        "rank 0 did not publish the NCCL unique id ({key}) within {} ms",
                        opts.init_timeout.as_millis()
                    )));
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(20));
            }
            let v = store.get(&key).await?;
            v.as_slice().try_into().map_err(|_| {
                NcclError::Invalid(format!("store key {key} holds {} bytes, an NCCL unique id has 128", v.len()))
            })?
        };
        let comm = if opts.lazy_init { None } else { Some(init_comm(&*device, &uid, world_size, rank, &opts).await?) };
        Self::assemble(device, store, name, GroupId(0), rank, world_size, opts, runtime, uid, comm)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        device: Arc<D>,
        store: Arc<dyn Store>,
        name: &str,
        group_id: GroupId,
        rank: u32,
        world_size: u32,
        opts: NcclOptions,
        runtime: tokio::runtime::Handle,
        uid: [u8; 128],
        comm: Option<D::Comm>,
    ) -> Result<NcclProcessGroup<D>, NcclError> {
        let mut cfg = GroupConfig::new(world_size);
        cfg.group_id = group_id;
        cfg.name = name.to_owned();
        cfg.desc = if group_id.0 == 0 { "default_pg".into() } else { "undefined".into() };
        cfg.timeout = opts.timeout;
        cfg.error_handling = opts.error_handling;
        // NCCL has no control channel: peers' liveness is the store's and the deadlines' job.
        cfg.heartbeat = None;
        // No control messages between ranks here (only the store): no census to hold works for.
        cfg.desync_census = false;
        // NCCL enqueues at call time; the device's stream orders the works.
        cfg.max_in_flight = usize::MAX;
        cfg.recorder = RecorderConfig { capacity: opts.trace_buffer_size, timing: opts.enable_timing };
        cfg.backend = BACKEND_NAME.into();
        cfg.wall_epoch_ns = opts.wall_clock_anchor_ns.unwrap_or_else(wall_clock_ns);
        let group = GroupState::new(cfg, Rank(rank), now());
        let nccl_stream = device.new_stream()?;
        let compute_stream = device.new_stream()?;
        let cell = OnceLock::new();
        if let Some(c) = comm {
            let _ = cell.set(Arc::new(c));
        }
        let inner = Arc::new(Inner {
            rank: Rank(rank),
            world_size,
            group_id,
            name: name.to_owned(),
            device,
            uid,
            comm: cell,
            nccl_stream,
            compute_stream,
            store,
            runtime: runtime.clone(),
            enqueue: Mutex::new(()),
            state: Mutex::new(State {
                group,
                running: VecDeque::new(),
                zombies: Vec::new(),
                completers: BTreeMap::new(),
                progress: ProgressRecord::NONE,
                published: None,
                comm_aborted: false,
            }),
            wake: Arc::new(Notify::new()),
            hook: RwLock::new(None),
            heartbeat: Arc::new(AtomicU64::new(0)),
            stalled: Arc::new(AtomicBool::new(false)),
            monitor_fired: Arc::new(AtomicBool::new(false)),
            split_count: AtomicU64::new(0),
            abort_gate: Arc::default(),
            opts,
        });
        crate::tcp::sigterm::register(Arc::downgrade(&inner) as Weak<dyn crate::tcp::sigterm::Report>);
        runtime.spawn(watchdog(Arc::downgrade(&inner), inner.wake.clone(), inner.stalled.clone()));
        runtime.spawn(store_task(Arc::downgrade(&inner), inner.opts.status_interval));
        if let Some(limit) = inner.opts.heartbeat_timeout {
            spawn_monitor(Arc::downgrade(&inner), limit)?;
        }
        Ok(NcclProcessGroup { inner })
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    /// The group's name (its store keys live under `cohort/nccl/<name>/`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device.
    pub fn device(&self) -> &Arc<D> {
        &self.inner.device
    }

    /// The stream that stands for the caller's current stream: copies run on it, every
    /// collective waits for what was enqueued on it before, and [`NcclProcessGroup::wait_stream`]
    /// makes it wait for a work.
    pub fn compute_stream(&self) -> &D::Stream {
        &self.inner.compute_stream
    }

    /// The options.
    pub fn options(&self) -> &NcclOptions {
        &self.inner.opts
    }

    /// The last collective sequence number handed out.
    pub fn seq(&self) -> SeqNo {
        self.inner.lock().group.seq()
    }

    /// The group's first failure, if it failed.
    pub fn failure(&self) -> Option<GroupFailure> {
        self.inner.lock().group.failure().cloned()
    }

    /// The communicator, once created (at init, or at the first collective under lazy init).
    pub fn comm_handle(&self) -> Option<Arc<D::Comm>> {
        self.inner.comm.get().cloned()
    }

    /// Whether the communicator's abort has begun: it refuses every call from then on, though
    /// `ncclCommAbort` itself may still wait for a stream held by something else (see
    /// [`NcclProcessGroup::is_comm_abort_finished`]).
    pub fn is_comm_aborted(&self) -> bool {
        self.inner.abort_gate.started.load(Ordering::SeqCst) || self.inner.comm.get().is_some_and(|c| c.is_aborted())
    }

    /// Whether `ncclCommAbort` returned. It synchronizes NCCL's internal streams, which wait on
    /// every stream the communicator enqueued on, so a stream held by something other than an
    /// NCCL kernel (a host wait, a hung compute kernel) keeps it waiting; the group's works,
    /// dumps and failure reports do not wait for it.
    pub fn is_comm_abort_finished(&self) -> bool {
        self.inner.abort_gate.is_done()
    }

    /// Whether the monitor saw the watchdog stall (with [`MonitorAction::Report`]).
    pub fn monitor_fired(&self) -> bool {
        self.inner.monitor_fired.load(Ordering::SeqCst)
    }

    /// Call `hook` with every finished work (c10d's `register_on_completion_hook`).
    pub fn set_completion_hook(&self, hook: impl Fn(&crate::work::WorkInfo) + Send + Sync + 'static) {
        *self.inner.hook.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(hook));
    }

    /// The flight recorder as JSON (PyTorch's schema).
    pub fn flight_recorder_json(&self) -> String {
        self.inner.lock().group.dump().to_json()
    }

    /// Copies a host tensor to a new device tensor, on the compute stream.
    pub fn to_device(&self, t: &Tensor) -> Result<DeviceTensor<D>, NcclError> {
        let dev = &self.inner.device;
        let buf = dev.alloc(t.bytes().len())?;
        dev.copy_to_device(&self.inner.compute_stream, t.bytes(), &buf, 0)?;
        Ok(DeviceTensor { buf, dtype: t.dtype(), shape: t.shape().to_vec() })
    }

    /// A zeroed device tensor.
    pub fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<DeviceTensor<D>, NcclError> {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        Ok(DeviceTensor { buf: self.inner.device.alloc(n)?, dtype, shape: shape.to_vec() })
    }

    /// Copies a device tensor to the host, on the compute stream, and blocks the calling thread
    /// until it is there (polling, up to the group's timeout); a device error is returned as
    /// such. The copy sees what every finished work wrote (a work whose `wait` returned, or
    /// whose future resolved, has completed on the device) and whatever the compute stream was
    /// made to wait for ([`NcclProcessGroup::wait_stream`]); it does not wait for works still
    /// running, so a hung collective does not hang the copy of an earlier result.
    pub fn to_host(&self, t: &DeviceTensor<D>) -> Result<Tensor, NcclError> {
        let (host, done) = self.start_to_host(t)?;
        let deadline = std::time::Instant::now() + self.inner.opts.timeout;
        while !self.inner.device.query(&done)? {
            if std::time::Instant::now() > deadline {
                return Err(self.copy_stuck(t));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Tensor::from_bytes(t.dtype, &t.shape, &host.to_vec()).map_err(|e| NcclError::Invalid(e.to_string()))
    }

    /// [`NcclProcessGroup::to_host`] for async callers: polls with tokio's clock (the
    /// simulator's), up to the group's timeout.
    pub async fn to_host_async(&self, t: &DeviceTensor<D>) -> Result<Tensor, NcclError> {
        let (host, done) = self.start_to_host(t)?;
        let deadline = tokio::time::Instant::now() + self.inner.opts.timeout;
        while !self.inner.device.query(&done)? {
            if tokio::time::Instant::now() > deadline {
                return Err(self.copy_stuck(t));
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        Tensor::from_bytes(t.dtype, &t.shape, &host.to_vec()).map_err(|e| NcclError::Invalid(e.to_string()))
    }

    fn copy_stuck(&self, t: &DeviceTensor<D>) -> NcclError {
        NcclError::Timeout(format!(
            "rank {}: copying {} bytes to the host did not finish within {} ms: this rank's compute stream is stuck",
            self.inner.rank,
            t.nbytes(),
            self.inner.opts.timeout.as_millis()
        ))
    }

    fn start_to_host(&self, t: &DeviceTensor<D>) -> Result<(HostBuffer, D::Event), NcclError> {
        let inner = &self.inner;
        let dev = &inner.device;
        let host = HostBuffer::new(t.nbytes());
        dev.copy_to_host(&inner.compute_stream, &t.buf, 0, &host)?;
        let done = dev.new_event(false)?;
        dev.record(&done, &inner.compute_stream)?;
        Ok((host, done))
    }

    /// Makes `stream` wait, on the device, until `work`'s kernels are done: c10d's default
    /// (non-blocking) `work.wait()`. The host does not wait.
    pub fn wait_stream(&self, work: &Work, stream: &D::Stream) -> Result<(), NcclError> {
        let st = self.inner.lock();
        if let Some(r) = st.running.iter().find(|r| r.id == work.id()) {
            self.inner.device.stream_wait(stream, &r.end)?;
        }
        Ok(())
    }

    /// Aborts the group: first the communicator's abort begins, on a thread of its own (its
    /// flag ends an enqueue that blocks), then every unfinished work ends Aborted and later
    /// calls are refused. It does not wait for `ncclCommAbort` to return
    /// ([`NcclProcessGroup::is_comm_abort_finished`]).
    pub fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    /// Finalizes and leaves the group: waits for the works in flight (up to the timeout),
    /// then `ncclCommFinalize`.
    pub fn shutdown(&self) -> Result<(), NcclError> {
        let deadline = std::time::Instant::now() + self.inner.opts.timeout;
        while self.inner.lock().group.in_flight() > 0 && std::time::Instant::now() < deadline {
            self.inner.poll_device();
            std::thread::sleep(Duration::from_micros(200));
        }
        match self.inner.comm.get() {
            Some(c) if !c.is_aborted() => c.finalize(),
            _ => Ok(()),
        }
    }

    // ---- collectives ----

    /// In-place allreduce.
    pub fn allreduce(&self, t: &DeviceTensor<D>, op: ReduceOp) -> Result<Work, NcclError> {
        let red = nccl_op(op, t.dtype)?;
        let c = Collective::new(OpType::Allreduce).inputs(vec![t.spec()]);
        let ops = vec![CommOp::AllReduce {
            send: t.at(0),
            recv: t.at(0),
            count: t.numel(),
            dtype: nccl_dtype(t.dtype),
            op: red,
        }];
        self.inner.launch(c, vec![t.buf.clone()], ops)
    }

    /// Allreduce of several tensors as one work (`ncclGroupStart`/`End` around one allreduce
    /// each, c10d's coalescing).
    pub fn allreduce_coalesced(&self, ts: &[DeviceTensor<D>], op: ReduceOp) -> Result<Work, NcclError> {
        let mut ops = Vec::with_capacity(ts.len());
        for t in ts {
            ops.push(CommOp::AllReduce {
                send: t.at(0),
                recv: t.at(0),
                count: t.numel(),
                dtype: nccl_dtype(t.dtype),
                op: nccl_op(op, t.dtype)?,
            });
        }
        let c = Collective::new(OpType::AllreduceCoalesced).inputs(ts.iter().map(DeviceTensor::spec).collect());
        self.inner.launch(c, ts.iter().map(|t| t.buf.clone()).collect(), ops)
    }

    /// In-place broadcast from `root`.
    pub fn broadcast(&self, t: &DeviceTensor<D>, root: u32) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Broadcast).inputs(vec![t.spec()]).root(Rank(root));
        let ops = vec![CommOp::Broadcast {
            send: t.at(0),
            recv: t.at(0),
            count: t.numel(),
            dtype: nccl_dtype(t.dtype),
            root,
        }];
        self.inner.launch(c, vec![t.buf.clone()], ops)
    }

    /// In-place reduce onto `root` (other ranks' tensors are left as they were).
    pub fn reduce(&self, t: &DeviceTensor<D>, root: u32, op: ReduceOp) -> Result<Work, NcclError> {
        let red = nccl_op(op, t.dtype)?;
        let c = Collective::new(OpType::Reduce).inputs(vec![t.spec()]).root(Rank(root));
        let ops = vec![CommOp::Reduce {
            send: t.at(0),
            recv: t.at(0),
            count: t.numel(),
            dtype: nccl_dtype(t.dtype),
            op: red,
            root,
        }];
        self.inner.launch(c, vec![t.buf.clone()], ops)
    }

    /// Allgather into a list: `outputs[r]` gets rank `r`'s `input` (one broadcast per rank in
    /// one NCCL group, as c10d does for lists).
    pub fn allgather(&self, outputs: &[DeviceTensor<D>], input: &DeviceTensor<D>) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Allgather)
            .inputs(vec![input.spec()])
            .outputs(outputs.iter().map(DeviceTensor::spec).collect());
        let me = self.inner.rank.0;
        let ops = outputs
            .iter()
            .enumerate()
            .map(|(r, out)| CommOp::Broadcast {
                send: if r as u32 == me { input.at(0) } else { out.at(0) },
                recv: out.at(0),
                count: input.numel(),
                dtype: nccl_dtype(input.dtype),
                root: r as u32,
            })
            .collect();
        let mut keep: Vec<D::Buffer> = outputs.iter().map(|t| t.buf.clone()).collect();
        keep.push(input.buf.clone());
        self.inner.launch(c, keep, ops)
    }

    /// Allgather into one tensor of `world × input` elements, in rank order (`ncclAllGather`).
    pub fn allgather_into_tensor(&self, output: &DeviceTensor<D>, input: &DeviceTensor<D>) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::AllgatherIntoTensor).inputs(vec![input.spec()]).outputs(vec![output.spec()]);
        let ops = vec![CommOp::AllGather {
            send: input.at(0),
            recv: output.at(0),
            count: input.numel(),
            dtype: nccl_dtype(input.dtype),
        }];
        self.inner.launch(c, vec![input.buf.clone(), output.buf.clone()], ops)
    }

    /// Several allgathers into tensors as one work (`all_gather_into_tensor_coalesced`).
    pub fn allgather_coalesced(&self, pairs: &[(DeviceTensor<D>, DeviceTensor<D>)]) -> Result<Work, NcclError> {
        let world = self.inner.world_size as usize;
        for (i, (out, input)) in pairs.iter().enumerate() {
            if out.numel() != input.numel() * world || out.dtype != input.dtype {
                return Err(NcclError::Invalid(format!(
                    "allgather_coalesced: output {i} must hold world size {world} × input {} elements of {}",
                    input.numel(),
                    input.dtype
                )));
            }
        }
        let c = Collective::new(OpType::AllgatherCoalesced).inputs(pairs.iter().map(|(_, i)| i.spec()).collect());
        let ops = pairs
            .iter()
            .map(|(out, input)| CommOp::AllGather {
                send: input.at(0),
                recv: out.at(0),
                count: input.numel(),
                dtype: nccl_dtype(input.dtype),
            })
            .collect();
        let keep = pairs.iter().flat_map(|(o, i)| [o.buf.clone(), i.buf.clone()]).collect();
        self.inner.launch(c, keep, ops)
    }

    /// Reduce-scatter of a list: `output` gets the reduction of every rank's `inputs[rank]`
    /// (one reduce per rank in one NCCL group).
    pub fn reduce_scatter(
        &self,
        output: &DeviceTensor<D>,
        inputs: &[DeviceTensor<D>],
        op: ReduceOp,
    ) -> Result<Work, NcclError> {
        let red = nccl_op(op, output.dtype)?;
        let c = Collective::new(OpType::ReduceScatter)
            .inputs(inputs.iter().map(DeviceTensor::spec).collect())
            .outputs(vec![output.spec()]);
        let me = self.inner.rank.0;
        let ops = inputs
            .iter()
            .enumerate()
            .map(|(r, input)| CommOp::Reduce {
                send: input.at(0),
                // Only the root's receive buffer is written (ncclReduce).
                recv: if r as u32 == me { output.at(0) } else { input.at(0) },
                count: output.numel(),
                dtype: nccl_dtype(output.dtype),
                op: red,
                root: r as u32,
            })
            .collect();
        let mut keep: Vec<D::Buffer> = inputs.iter().map(|t| t.buf.clone()).collect();
        keep.push(output.buf.clone());
        self.inner.launch(c, keep, ops)
    }

    /// Reduce-scatter of one tensor of `world × output` elements (`ncclReduceScatter`).
    pub fn reduce_scatter_tensor(
        &self,
        output: &DeviceTensor<D>,
        input: &DeviceTensor<D>,
        op: ReduceOp,
    ) -> Result<Work, NcclError> {
        let red = nccl_op(op, input.dtype)?;
        let c = Collective::new(OpType::ReduceScatterTensor).inputs(vec![input.spec()]).outputs(vec![output.spec()]);
        let ops = vec![CommOp::ReduceScatter {
            send: input.at(0),
            recv: output.at(0),
            count: output.numel(),
            dtype: nccl_dtype(input.dtype),
            op: red,
        }];
        self.inner.launch(c, vec![input.buf.clone(), output.buf.clone()], ops)
    }

    /// All-to-all of one tensor each way, evenly or by `splits` (elements per rank: input,
    /// output), through grouped send/recv as c10d does.
    pub fn alltoall_base(
        &self,
        output: &DeviceTensor<D>,
        input: &DeviceTensor<D>,
        splits: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<Work, NcclError> {
        let world = self.inner.world_size as usize;
        let mut c = Collective::new(OpType::AlltoallBase).inputs(vec![input.spec()]).outputs(vec![output.spec()]);
        c.splits = splits.clone();
        // Checked here too (the core checks again): the offsets below need it.
        c.validate(self.inner.rank, self.inner.world_size)?;
        let (ins, outs) =
            splits.unwrap_or_else(|| (vec![input.numel() / world; world], vec![output.numel() / world; world]));
        let size = input.dtype.size();
        let dtype = nccl_dtype(input.dtype);
        let mut ops = Vec::with_capacity(2 * world);
        let (mut send_at, mut recv_at) = (0, 0);
        for peer in 0..world {
            ops.push(CommOp::Send { buf: input.at(send_at * size), count: ins[peer], dtype, peer: peer as u32 });
            ops.push(CommOp::Recv { buf: output.at(recv_at * size), count: outs[peer], dtype, peer: peer as u32 });
            send_at += ins[peer];
            recv_at += outs[peer];
        }
        self.inner.launch(c, vec![input.buf.clone(), output.buf.clone()], ops)
    }

    /// All-to-all of lists: `inputs[r]` goes to rank `r`, `outputs[r]` comes from it.
    pub fn alltoall(&self, outputs: &[DeviceTensor<D>], inputs: &[DeviceTensor<D>]) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Alltoall)
            .inputs(inputs.iter().map(DeviceTensor::spec).collect())
            .outputs(outputs.iter().map(DeviceTensor::spec).collect());
        c.validate(self.inner.rank, self.inner.world_size)?;
        let mut ops = Vec::with_capacity(2 * inputs.len());
        for (peer, (i, o)) in inputs.iter().zip(outputs).enumerate() {
            ops.push(CommOp::Send { buf: i.at(0), count: i.numel(), dtype: nccl_dtype(i.dtype), peer: peer as u32 });
            ops.push(CommOp::Recv { buf: o.at(0), count: o.numel(), dtype: nccl_dtype(o.dtype), peer: peer as u32 });
        }
        let keep = inputs.iter().chain(outputs).map(|t| t.buf.clone()).collect();
        self.inner.launch(c, keep, ops)
    }

    /// Gather onto `root` through grouped send/recv: on the root `outputs[r]` gets rank `r`'s
    /// input; other ranks pass no outputs.
    pub fn gather(&self, outputs: &[DeviceTensor<D>], input: &DeviceTensor<D>, root: u32) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Gather)
            .inputs(vec![input.spec()])
            .outputs(outputs.iter().map(DeviceTensor::spec).collect())
            .root(Rank(root));
        c.validate(self.inner.rank, self.inner.world_size)?;
        let dtype = nccl_dtype(input.dtype);
        let count = input.numel();
        let ops = if self.inner.rank.0 == root {
            let mut ops = vec![CommOp::Send { buf: input.at(0), count, dtype, peer: root }];
            ops.extend(outputs.iter().enumerate().map(|(r, o)| CommOp::Recv {
                buf: o.at(0),
                count,
                dtype,
                peer: r as u32,
            }));
            ops
        } else {
            vec![CommOp::Send { buf: input.at(0), count, dtype, peer: root }]
        };
        let mut keep: Vec<D::Buffer> = outputs.iter().map(|t| t.buf.clone()).collect();
        keep.push(input.buf.clone());
        self.inner.launch(c, keep, ops)
    }

    /// Scatter from `root` through grouped send/recv: rank `r` gets the root's `inputs[r]`;
    /// other ranks pass no inputs.
    pub fn scatter(&self, output: &DeviceTensor<D>, inputs: &[DeviceTensor<D>], root: u32) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Scatter)
            .inputs(inputs.iter().map(DeviceTensor::spec).collect())
            .outputs(vec![output.spec()])
            .root(Rank(root));
        c.validate(self.inner.rank, self.inner.world_size)?;
        let dtype = nccl_dtype(output.dtype);
        let count = output.numel();
        let mut ops = Vec::new();
        if self.inner.rank.0 == root {
            ops.extend(inputs.iter().enumerate().map(|(r, i)| CommOp::Send {
                buf: i.at(0),
                count,
                dtype,
                peer: r as u32,
            }));
        }
        ops.push(CommOp::Recv { buf: output.at(0), count, dtype, peer: root });
        let mut keep: Vec<D::Buffer> = inputs.iter().map(|t| t.buf.clone()).collect();
        keep.push(output.buf.clone());
        self.inner.launch(c, keep, ops)
    }

    /// A barrier: an allreduce of one element, as c10d's NCCL barrier.
    pub fn barrier(&self) -> Result<Work, NcclError> {
        let buf = self.inner.device.alloc(4)?;
        let c = Collective::new(OpType::Barrier);
        let ops = vec![CommOp::AllReduce {
            send: BufRef::new(buf.clone()),
            recv: BufRef::new(buf.clone()),
            count: 1,
            dtype: nccl_dtype(DType::F32),
            op: super::device::NcclRedOp::Sum,
        }];
        self.inner.launch(c, vec![buf], ops)
    }

    /// Sends `t` to `dst` (`ncclSend`).
    pub fn send(&self, t: &DeviceTensor<D>, dst: u32) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Send).inputs(vec![t.spec()]).peer(Rank(dst), 0);
        let ops = vec![CommOp::Send { buf: t.at(0), count: t.numel(), dtype: nccl_dtype(t.dtype), peer: dst }];
        self.inner.launch(c, vec![t.buf.clone()], ops)
    }

    /// Receives into `t` from `src` (`ncclRecv`).
    pub fn recv(&self, t: &DeviceTensor<D>, src: u32) -> Result<Work, NcclError> {
        let c = Collective::new(OpType::Recv).inputs(vec![t.spec()]).peer(Rank(src), 0);
        let ops = vec![CommOp::Recv { buf: t.at(0), count: t.numel(), dtype: nccl_dtype(t.dtype), peer: src }];
        self.inner.launch(c, vec![t.buf.clone()], ops)
    }

    /// Receiving from any rank: NCCL has no such call (c10d's NCCL backend refuses it too).
    pub fn recv_anysource(&self, _t: &DeviceTensor<D>) -> Result<Work, NcclError> {
        Err(NcclError::Unsupported("recv from any source: NCCL matches receives by rank only".into()))
    }

    /// Sends and receives as one batch (`batch_isend_irecv`): every op in one NCCL group, one
    /// work per op, all ending together.
    pub fn batch_isend_irecv(&self, ops: &[P2pOp<D>]) -> Result<Vec<Work>, NcclError> {
        self.inner.launch_batch(ops)
    }

    /// Splits the group (`ncclCommSplit`): every rank calls it; ranks with `Some(color)` get a
    /// new group of that color, ordered by (`key`, rank); `None` takes part and gets nothing.
    /// The new group is named `<name>/split<n>:<color>`.
    pub async fn split(&self, color: Option<u32>, key: u32, opts: NcclOptions) -> Result<Option<Self>, NcclError> {
        let comm = self.inner.comm()?;
        let n = self.inner.split_count.fetch_add(1, Ordering::SeqCst);
        let child = comm.split(color, key)?;
        let (Some(child), Some(color)) = (child, color) else { return Ok(None) };
        self.child(child, format!("{}/split{n}:{color}", self.inner.name), opts).await.map(Some)
    }

    /// Shrinks the group after a rank loss (`ncclCommShrink`, NCCL ≥ 2.27; refused with a
    /// clear error below): the ranks not in `exclude` form a new group, renumbered in order.
    /// Every remaining rank calls it.
    pub async fn shrink(&self, exclude: &[u32], opts: NcclOptions) -> Result<Self, NcclError> {
        let comm = self.inner.comm.get().cloned().ok_or_else(|| {
            NcclError::Invalid("shrink: the communicator was never created (lazy init before any collective)".into())
        })?;
        let n = self.inner.split_count.fetch_add(1, Ordering::SeqCst);
        let child = comm.shrink(exclude)?;
        self.child(child, format!("{}/shrink{n}", self.inner.name), opts).await
    }

    async fn child(&self, comm: D::Comm, name: String, opts: NcclOptions) -> Result<Self, NcclError> {
        wait_ready(&comm, &opts).await?;
        let (rank, world) = (comm.rank(), comm.world_size());
        let gid = GroupId(self.inner.group_id.0 + 1 + self.inner.split_count.load(Ordering::SeqCst) as u32);
        Self::assemble(
            self.inner.device.clone(),
            self.inner.store.clone(),
            &name,
            gid,
            rank,
            world,
            opts,
            self.inner.runtime.clone(),
            self.inner.uid,
            Some(comm),
        )
    }

    #[cfg(test)]
    pub(crate) fn stall_watchdog(&self, stalled: bool) {
        self.inner.stalled.store(stalled, Ordering::SeqCst);
    }
}

/// Creates the communicator and, when it is non-blocking, waits (on tokio's clock) until it is
/// ready; past the init timeout it is aborted.
async fn init_comm<D: Device>(
    device: &D,
    uid: &[u8; 128],
    world_size: u32,
    rank: u32,
    opts: &NcclOptions,
) -> Result<D::Comm, NcclError> {
    let comm = device.init_comm(uid, world_size, rank, CommConfig { blocking: opts.blocking_comm })?;
    wait_ready(&comm, opts).await?;
    Ok(comm)
}

/// Polls a communicator's async error until it leaves `ncclInProgress` (NCCL's non-blocking
/// init and split), for at most the init timeout; then it is aborted.
async fn wait_ready<C: Communicator>(comm: &C, opts: &NcclOptions) -> Result<(), NcclError> {
    let deadline = tokio::time::Instant::now() + opts.init_timeout;
    loop {
        match comm.async_error()? {
            NcclResult::Success => return Ok(()),
            NcclResult::InProgress => {
                if tokio::time::Instant::now() >= deadline {
                    comm.abort();
                    return Err(NcclError::Timeout(format!(
                        "rank {}: NCCL communicator init still in progress after {} ms; aborted it",
                        comm.rank(),
                        opts.init_timeout.as_millis()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            result => return Err(NcclError::Nccl { call: "ncclCommInitRankConfig", result }),
        }
    }
}

impl<D: Device> Inner<D> {
    fn lock(&self) -> MutexGuard<'_, State<D>> {
        // Every update of the state is complete before anything that can panic runs.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The communicator, created now under lazy init (blocking the caller until it is ready).
    fn comm(&self) -> Result<Arc<D::Comm>, NcclError> {
        if let Some(c) = self.comm.get() {
            return Ok(c.clone());
        }
        let comm = self.device.init_comm(
            &self.uid,
            self.world_size,
            self.rank.0,
            CommConfig { blocking: self.opts.blocking_comm },
        )?;
        let deadline = std::time::Instant::now() + self.opts.init_timeout;
        loop {
            match comm.async_error()? {
                NcclResult::Success => break,
                NcclResult::InProgress if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                NcclResult::InProgress => {
                    comm.abort();
                    return Err(NcclError::Timeout(format!(
                        "rank {}: lazy NCCL communicator init still in progress after {} ms; aborted it",
                        self.rank,
                        self.opts.init_timeout.as_millis()
                    )));
                }
                result => return Err(NcclError::Nccl { call: "ncclCommInitRankConfig", result }),
            }
        }
        Ok(self.comm.get_or_init(|| Arc::new(comm)).clone())
    }

    /// Submit `c` to the core, then enqueue `ops` (one NCCL group when there are several)
    /// between the work's start and end events.
    fn launch(
        self: &Arc<Self>,
        c: Collective,
        keep: Vec<D::Buffer>,
        ops: Vec<CommOp<D::Buffer>>,
    ) -> Result<Work, NcclError> {
        let _order = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        let comm = self.comm()?;
        let is_p2p = c.op.is_p2p();
        let (work, id, seq) = self.submit(c)?;
        let enqueued = self.enqueue_ops(&comm, &ops, 1).map(|mut e| e.remove(0));
        self.enqueued(id, seq, is_p2p, keep, enqueued);
        Ok(work)
    }

    fn launch_batch(self: &Arc<Self>, p2p: &[P2pOp<D>]) -> Result<Vec<Work>, NcclError> {
        let _order = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        let comm = self.comm()?;
        let mut batch = Vec::with_capacity(p2p.len());
        for op in p2p {
            let (c, op, t) = match op {
                P2pOp::Send(t, peer) => (
                    Collective::new(OpType::Send).inputs(vec![t.spec()]).peer(Rank(*peer), 0),
                    CommOp::Send { buf: t.at(0), count: t.numel(), dtype: nccl_dtype(t.dtype), peer: *peer },
                    t,
                ),
                P2pOp::Recv(t, peer) => (
                    Collective::new(OpType::Recv).inputs(vec![t.spec()]).peer(Rank(*peer), 0),
                    CommOp::Recv { buf: t.at(0), count: t.numel(), dtype: nccl_dtype(t.dtype), peer: *peer },
                    t,
                ),
            };
            // Every op is checked before any is submitted: a batch runs whole or not at all.
            c.validate(self.rank, self.world_size)?;
            batch.push((c, op, t.buf.clone()));
        }
        let mut works = Vec::with_capacity(batch.len());
        let mut ops = Vec::with_capacity(batch.len());
        for (c, op, buf) in batch {
            let (work, id, seq) = self.submit(c)?;
            works.push((work, id, seq, buf));
            ops.push(op);
        }
        // One NCCL group; each work gets its own events around all of it.
        match self.enqueue_ops(&comm, &ops, works.len()) {
            Ok(events) => {
                for ((_, id, seq, buf), ev) in works.iter().zip(events) {
                    self.enqueued(*id, *seq, true, vec![buf.clone()], Ok(ev));
                }
            }
            Err(e) => {
                for (_, id, seq, _) in &works {
                    self.enqueued(*id, *seq, true, Vec::new(), Err(e.clone()));
                }
            }
        }
        Ok(works.into_iter().map(|(w, ..)| w).collect())
    }

    /// Submit to the core: the work, its id and sequence number.
    fn submit(self: &Arc<Self>, c: Collective) -> Result<(Work, WorkId, SeqNo), NcclError> {
        let is_p2p = c.op.is_p2p();
        let op = c.op;
        let mut st = self.lock();
        let id = st.group.submit(now(), c)?;
        while st.group.poll_launch().is_some() {}
        let seq = if is_p2p { st.group.p2p_seq() } else { st.group.seq() };
        let hook = self.hook.read().unwrap_or_else(|p| p.into_inner()).clone();
        let (work, completer) = Work::pending(id, seq, op, hook);
        completer.in_group(self.group_id, self.rank);
        if self.opts.blocking_wait {
            work.set_progress(Arc::new(WaitPoller(Arc::downgrade(self))), true);
        }
        let weak = Arc::downgrade(self);
        work.set_abort(Box::new(move |reason| {
            if let Some(inner) = weak.upgrade() {
                inner.abort(reason);
            }
        }));
        st.completers.insert(id, completer);
        if !is_p2p {
            st.progress.enqueued = seq;
        }
        Ok((work, id, seq))
    }

    /// Record `works` start events, enqueue, record as many end events; the events of each
    /// work, or why it failed.
    fn enqueue_ops(
        &self,
        comm: &D::Comm,
        ops: &[CommOp<D::Buffer>],
        works: usize,
    ) -> Result<Vec<Events<D>>, NcclError> {
        let dev = &*self.device;
        // c10d's syncStream: the collective waits for what the caller enqueued before it.
        let ready = dev.new_event(false)?;
        dev.record(&ready, &self.compute_stream)?;
        dev.stream_wait(&self.nccl_stream, &ready)?;
        let mut starts = Vec::with_capacity(works);
        for _ in 0..works {
            let start = dev.new_event(self.opts.enable_timing)?;
            dev.record(&start, &self.nccl_stream)?;
            starts.push(start);
        }
        if let [op] = ops {
            comm.enqueue(op.clone(), &self.nccl_stream)?;
        } else {
            comm.group_start()?;
            let mut res = Ok(());
            for op in ops {
                res = comm.enqueue(op.clone(), &self.nccl_stream);
                if res.is_err() {
                    break;
                }
            }
            // The group is closed even after a failed call, as NCCL requires.
            let end_res = comm.group_end();
            res?;
            end_res?;
        }
        let mut events = Vec::with_capacity(works);
        for start in starts {
            let end = dev.new_event(self.opts.enable_timing)?;
            dev.record(&end, &self.nccl_stream)?;
            events.push((start, end));
        }
        Ok(events)
    }

    /// The enqueue of work `id` ended: it runs on the device, or it failed.
    fn enqueued(
        self: &Arc<Self>,
        id: WorkId,
        seq: SeqNo,
        is_p2p: bool,
        keep: Vec<D::Buffer>,
        enqueued: Result<Events<D>, NcclError>,
    ) {
        self.input(|st, t| match enqueued {
            Ok((start, end)) => {
                let r = Running { id, seq, is_p2p, start, end, started: false, since: t, _keep: keep };
                if st.group.work_state(id).is_some() {
                    st.running.push_back(r);
                } else {
                    // It ended while it was being enqueued (a timeout, an abort): its kernels
                    // may still run.
                    st.zombies.push(r);
                }
            }
            // Refused because this group's abort began: that abort ends every unfinished work
            // (as Aborted, or with the group's failure), so this is not a failure of its own.
            Err(NcclError::Aborted) if self.abort_gate.started.load(Ordering::SeqCst) => {}
            Err(e) => st.group.handle_completion(t, id, Completion::Failed { rank: None, message: e.to_string() }),
        });
        self.wake.notify_one();
    }

    /// Feed one input to the core under the lock, collect what the driver must do, and do it
    /// after the lock is released.
    fn input(self: &Arc<Self>, f: impl FnOnce(&mut State<D>, Instant)) {
        let fx = {
            let mut st = self.lock();
            f(&mut st, now());
            self.drain(&mut st)
        };
        self.apply(fx);
    }

    fn drain(&self, st: &mut State<D>) -> Effects<D> {
        let mut fx = Effects {
            finished: Vec::new(),
            failed: None,
            clean_up: false,
            keep_until_aborted: Vec::new(),
            tear_down: None,
        };
        while let Some(ev) = st.group.poll_event() {
            match ev {
                Event::WorkFinished(summary) => {
                    if let Some(pos) = st.running.iter().position(|r| r.id == summary.id) {
                        let r = st.running.remove(pos).expect("the position was just found");
                        if !summary.result.is_success() {
                            st.zombies.push(r);
                        }
                    }
                    if let Some(c) = st.completers.remove(&summary.id) {
                        fx.finished.push((c, summary));
                    }
                }
                Event::GroupFailed(f) => {
                    fx.clean_up = true;
                    fx.failed = Some(f);
                }
                Event::GroupAborted { .. } => fx.clean_up = true,
                Event::TearDown { cause } => fx.tear_down = Some(cause),
                _ => {}
            }
        }
        // Nothing travels to peers over NCCL: failures go through the store instead.
        while st.group.poll_transmit().is_some() {}
        if fx.clean_up && self.opts.error_handling != ErrorHandling::SkipCleanUp {
            st.comm_aborted = true;
            fx.keep_until_aborted = std::mem::take(&mut st.zombies);
        }
        fx
    }

    /// Acts on what the core decided. The abort comes first, as c10d's does, but only its part
    /// that never waits happens here (see [`AbortGate`]): the works, the dump and the store
    /// hear of the failure without waiting for the device.
    fn apply(self: &Arc<Self>, fx: Effects<D>) {
        if fx.clean_up && self.opts.error_handling != ErrorHandling::SkipCleanUp {
            self.abort_comm(fx.keep_until_aborted);
        }
        if let Some(f) = &fx.failed {
            self.dump_recorder("failure");
            if f.origin == self.rank {
                let store = self.store.clone();
                let key = error_key(&self.name);
                let value =
                    FailureRecord { origin: f.origin, blame: f.blame.clone(), message: f.message.clone() }.encode();
                self.runtime.spawn(async move {
                    if let Err(e) = store.compare_set(&key, b"", &value).await {
                        tracing::warn!("could not publish the failure through the store: {e}");
                    }
                });
            }
        }
        for (completer, summary) in fx.finished {
            completer.finish_with(summary, Vec::new());
        }
        if let Some(cause) = fx.tear_down {
            self.dump_recorder("tear down");
            tracing::error!("tearing the process down (error handling mode): {cause}");
            eprintln!("cohort: rank {}: tearing the process down: {cause}", self.rank);
            std::process::abort();
        }
    }

    fn dump_recorder(&self, why: &str) {
        let Some(prefix) = &self.opts.dump_prefix else { return };
        let json = self.lock().group.dump().to_json();
        let path = format!("{}{}.json", prefix.display(), self.rank);
        match std::fs::write(&path, json) {
            Ok(()) => tracing::warn!(%path, "flight recorder dumped on {why}"),
            Err(e) => tracing::error!(%path, "could not dump the flight recorder: {e}"),
        }
    }

    fn abort(self: &Arc<Self>, reason: &str) {
        // First the communicator, without any lock: its abort flag is what unblocks a stuck
        // enqueue, which holds the state lock.
        self.abort_comm(Vec::new());
        self.input(|st, t| {
            st.comm_aborted = true;
            st.group.handle_abort(t, reason.to_owned());
        });
    }

    /// `ncclCommAbort` on a thread of its own (once per group), then lets `keep` go: the
    /// device may use those buffers until the abort returned. A later call only hands its
    /// buffers to a thread that waits for that return.
    fn abort_comm(self: &Arc<Self>, keep: Vec<Running<D>>) {
        let Some(comm) = self.comm.get().cloned() else { return };
        let gate = self.abort_gate.clone();
        let first = !gate.started.swap(true, Ordering::SeqCst);
        if first {
            // What never waits happens here, in order with the rest of the driver (under the
            // simulator, in the watchdog's task): calls are refused, waiting kernels end.
            comm.raise_abort();
        }
        if !first && keep.is_empty() {
            return;
        }
        if !first && gate.is_done() {
            drop(keep);
            return;
        }
        let rank = self.rank;
        let job = move || {
            if first {
                let started = std::time::Instant::now();
                comm.abort();
                let took = started.elapsed();
                if took > Duration::from_secs(1) {
                    tracing::warn!(
                        "rank {rank}: ncclCommAbort took {took:?}: a stream the communicator enqueued on was held by \
                         something other than NCCL (a host wait, another kernel)"
                    );
                }
                gate.finish();
            } else {
                gate.wait();
            }
            drop(keep);
        };
        // The abort flag must go up even if no thread can be had: then it runs here.
        let spare = std::sync::Arc::new(Mutex::new(Some(job)));
        let run = spare.clone();
        let spawned = std::thread::Builder::new().name("cohort-nccl-abort".into()).spawn(move || {
            if let Some(job) = run.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
                job();
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("rank {rank}: no thread for ncclCommAbort ({e}): aborting on the watchdog");
            if let Some(job) = spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
                job();
            }
        }
    }

    /// The watchdog's look at the device: events in issue order, the async error, deadlines.
    fn poll_device(self: &Arc<Self>) {
        let dev = self.device.clone();
        let comm = self.comm.get().cloned();
        self.input(|st, t| {
            let timing = self.opts.enable_timing;
            let mut error: Option<String> = None;
            let mut done = Vec::new();
            for r in st.running.iter_mut() {
                if !r.started {
                    match dev.query(&r.start) {
                        Ok(true) => {
                            r.started = true;
                            st.group.handle_started(t, r.id);
                            if !r.is_p2p {
                                st.progress.started = st.progress.started.max(r.seq);
                            }
                        }
                        Ok(false) => break,
                        Err(e) => {
                            error = Some(format!("CUDA error while waiting for {} (seq {}): {e}", "its start", r.seq));
                            break;
                        }
                    }
                }
                match dev.query(&r.end) {
                    Ok(true) => {
                        if timing && let Ok(d) = dev.elapsed(&r.start, &r.end) {
                            st.group.handle_device_time(t, r.id, d);
                        }
                        done.push(r.id);
                        if !r.is_p2p {
                            st.progress.completed = st.progress.completed.max(r.seq);
                        }
                    }
                    Ok(false) => break,
                    Err(e) => {
                        error = Some(format!("CUDA error while waiting for seq {} to end: {e}", r.seq));
                        break;
                    }
                }
            }
            for id in done {
                st.group.handle_completion(t, id, Completion::Success);
            }
            // Kernels of works that ended early: let their buffers go once they are done.
            st.zombies.retain(|z| !matches!(dev.query(&z.end), Ok(true)));
            if error.is_none()
                && let Some(comm) = &comm
                && !st.comm_aborted
            {
                match comm.async_error() {
                    Ok(NcclResult::Success | NcclResult::InProgress) | Err(NcclError::Aborted) => {}
                    Ok(result) => {
                        error = Some(format!("NCCL communicator error: {result} (ncclCommGetAsyncError)"));
                    }
                    Err(e) => error = Some(format!("NCCL communicator error: {e}")),
                }
            }
            if let Some(message) = error {
                // The rank whose own communicator or device broke first is the one to look
                // at: a peer's failure reaches the others as its error first.
                let me = st.group.rank();
                st.group.handle_comm_error(t, cohort_core::Blame::rank(me), message);
            }
            if st.group.poll_timeout().is_some_and(|d| d <= t) {
                st.group.handle_timeout(t);
            }
        });
    }

    /// The watchdog's talk with the store: publish this rank's progress, learn of a failure
    /// another rank published, and (desync debug) find who holds an old collective back.
    async fn store_round(self: &Arc<Self>) {
        let (progress, oldest) = {
            let st = self.lock();
            let healthy = st.group.failure().is_none() && !st.group.is_aborted();
            if !healthy {
                return;
            }
            let progress = (st.published != Some(st.progress)).then_some(st.progress);
            // The oldest collective, once it has run half its timeout.
            let half = self.opts.timeout / 2;
            let t = now();
            let oldest = st
                .running
                .iter()
                .find(|r| !r.is_p2p)
                .filter(|r| t.saturating_duration_since(r.since) >= half)
                .map(|r| (r.id, r.seq));
            (progress, oldest)
        };
        if let Some(p) = progress {
            match self.store.set(&progress_key(&self.name, self.rank.0), &p.encode()).await {
                Ok(()) => self.lock().published = Some(p),
                Err(e) => tracing::debug!("could not publish this rank's progress: {e}"),
            }
        }
        let key = error_key(&self.name);
        if matches!(self.store.check(&[key.as_str()]).await, Ok(true))
            && let Ok(value) = self.store.get(&key).await
            && let Ok(rec) = FailureRecord::decode(&value, self.world_size)
            && rec.origin != self.rank
        {
            let message = format!("(learned through the store) {}", rec.message);
            self.input(|st, t| st.group.handle_remote_error(t, rec.origin, rec.blame, message));
            return;
        }
        if self.opts.desync_debug
            && let Some((id, seq)) = oldest
        {
            let mut records = Vec::with_capacity(self.world_size as usize);
            for r in 0..self.world_size {
                let k = progress_key(&self.name, r);
                let rec = if r == self.rank.0 {
                    Some(self.lock().progress)
                } else if matches!(self.store.check(&[k.as_str()]).await, Ok(true)) {
                    self.store.get(&k).await.ok().and_then(|v| ProgressRecord::decode(&v).ok())
                } else {
                    None
                };
                records.push(rec);
            }
            let behind = cohort_core::watchdog::ranks_behind(seq, self.rank, &records);
            if !behind.is_empty() {
                tracing::warn!(rank = %self.rank, %seq, ?behind, "desync debug: these ranks hold the collective back");
                self.input(|st, t| st.group.handle_waiting_on(t, id, &behind));
            }
        }
    }
}

/// The watchdog task: polls the device while works run, and otherwise sleeps until the next
/// deadline or submit (or a status interval, at most). It holds the group only weakly: dropping
/// the last handle ends it. The store is talked to by another task ([`store_task`]): a slow or
/// dead store must never stop the watchdog.
async fn watchdog<D: Device>(weak: Weak<Inner<D>>, wake: Arc<Notify>, stalled: Arc<AtomicBool>) {
    let (poll, idle) = match weak.upgrade() {
        Some(inner) => (inner.opts.poll_interval, inner.opts.status_interval),
        None => return,
    };
    loop {
        if stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(poll).await;
            continue;
        }
        let Some(inner) = weak.upgrade() else { return };
        inner.heartbeat.fetch_add(1, Ordering::SeqCst);
        inner.poll_device();
        let (busy, deadline) = {
            let st = inner.lock();
            (!st.running.is_empty(), st.group.poll_timeout())
        };
        drop(inner);
        let mut until = tokio::time::Instant::now() + if busy { poll } else { idle };
        if let Some(d) = deadline {
            until = until.min(tokio::time::Instant::from_std(d));
        }
        tokio::select! {
            biased;
            _ = wake.notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// How long a thread in blocking-wait mode sleeps between two looks at the device.
const BLOCKING_WAIT_POLL: Duration = Duration::from_micros(200);

/// The SIGTERM report (see `crate::tcp::sigterm`): the oldest unfinished work, without whom it
/// waits for (NCCL does not say), and a dump when a dump prefix is set.
impl<D: Device> crate::tcp::sigterm::Report for Inner<D> {
    fn sigterm_line(&self, now: Instant) -> String {
        use crate::tcp::sigterm;
        let Some(st) = sigterm::lock_within(&self.state, sigterm::LOCK_WAIT) else {
            return sigterm::busy(self.rank, self.group_id);
        };
        let line = sigterm::describe(&st.group, now);
        let json = self.opts.dump_prefix.as_ref().map(|prefix| (prefix, st.group.dump().to_json()));
        drop(st);
        let dumped = json.map(|(prefix, json)| sigterm::dump_file(prefix, self.rank, &json, "SIGTERM"));
        sigterm::with_dump(line, dumped)
    }
}

/// Blocking-wait mode ([`NcclOptions::blocking_wait`]): a thread in `Work::wait` does the
/// watchdog's device pass itself until its work ends.
struct WaitPoller<D: Device>(Weak<Inner<D>>);

impl<D: Device> crate::work::Progress for WaitPoller<D> {
    fn begin(&self) -> Duration {
        // Until the work ends: its deadline ends it at the latest.
        Duration::MAX
    }

    fn poll(&self, _first: bool) -> Option<bool> {
        let inner = self.0.upgrade()?;
        inner.poll_device();
        drop(inner);
        std::thread::sleep(BLOCKING_WAIT_POLL);
        Some(false)
    }

    fn stop(&self, _finished: bool) {}

    fn sleep(&self) {}

    fn woke(&self, _time: Duration, _polled: crate::work::Polled) {}

    fn flush(&self) {}
}

/// The store task: every status interval, [`Inner::store_round`]. It holds the group only
/// weakly between rounds.
async fn store_task<D: Device>(weak: Weak<Inner<D>>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(inner) = weak.upgrade() else { return };
        inner.store_round().await;
    }
}

/// The monitor thread: a watchdog whose heartbeat has not moved for `limit` is reported (c10d's
/// heartbeat monitor). It holds the group only weakly.
fn spawn_monitor<D: Device>(weak: Weak<Inner<D>>, limit: Duration) -> Result<(), NcclError> {
    let check = (limit / 4).clamp(Duration::from_millis(1), Duration::from_secs(10));
    std::thread::Builder::new()
        .name("cohort-nccl-monitor".into())
        .spawn(move || {
            let mut last = (u64::MAX, std::time::Instant::now());
            loop {
                std::thread::sleep(check);
                let Some(inner) = weak.upgrade() else { return };
                let beat = inner.heartbeat.load(Ordering::SeqCst);
                if beat != last.0 {
                    last = (beat, std::time::Instant::now());
                    continue;
                }
                if last.1.elapsed() < limit {
                    continue;
                }
                let msg = format!(
                    "rank {}: the NCCL watchdog has not moved for {} ms (heartbeat timeout {} ms)",
                    inner.rank,
                    last.1.elapsed().as_millis(),
                    limit.as_millis()
                );
                tracing::error!("{msg}");
                eprintln!("cohort: {msg}");
                // The watchdog may hold the state lock forever: dump only if it is free.
                if let Some(prefix) = &inner.opts.dump_prefix
                    && let Ok(st) = inner.state.try_lock()
                {
                    let _ =
                        std::fs::write(format!("{}{}.json", prefix.display(), inner.rank), st.group.dump().to_json());
                }
                match inner.opts.monitor_action {
                    MonitorAction::AbortProcess => std::process::abort(),
                    MonitorAction::Report => {
                        inner.monitor_fired.store(true, Ordering::SeqCst);
                        return;
                    }
                }
            }
        })
        .map(drop)
        .map_err(|e| NcclError::Invalid(format!("cannot start the NCCL monitor thread: {e}")))
}

#[cfg(test)]
#[path = "group_tests.rs"]
mod tests;
