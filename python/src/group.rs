//! [`Group`]: one cohort TCP process group seen from Python, and [`PendingWork`], the handle
//! each of its collectives returns.
//!
//! Python passes tensors as descriptors, `(data_ptr, nbytes, dtype, shape, tensor)`: the Python
//! layer checks that they are contiguous CPU tensors. Each is used in place where it can be
//! ([`borrowable`]): a core [`HostBuffer::borrowed`] over the tensor's memory, holding a reference
//! to the tensor, so an allreduce reduces straight into it. Outputs the runtime returns in other
//! buffers are copied into their tensors once the collective has ended, before the work counts
//! as done for Python.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use cohort_core::group::SubmitError;
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, HostBuffer, Tensor};
use cohort_transports::{ProcessGroup, TcpOptions, TokioNet, Work, WorkError};
use pyo3::prelude::*;

use crate::CohortError;
use crate::store::PyStore;

/// A tensor as Python describes it: `(data_ptr, nbytes, dtype name, shape, the tensor)`.
type Buf = (usize, usize, String, Vec<usize>, Py<PyAny>);

/// Where an output's bytes go: `(data_ptr, nbytes)`.
type Out = (usize, usize);

/// A cohort TCP process group driven from Python.
#[pyclass(frozen, module = "cohort_torch._cohort")]
pub(crate) struct Group {
    pg: ProcessGroup,
    runtime: Background,
    /// The first failure of any of this group's works: every later call raises it.
    error: Arc<Mutex<Option<String>>>,
    store_closed: Arc<AtomicBool>,
    /// Host buffers of finished works, reused for the inputs of later ones.
    pool: Arc<BufferPool>,
    /// Bytes copied between Python's tensors and cohort's buffers (in and out).
    copied: Arc<AtomicU64>,
}

#[pymethods]
impl Group {
    /// Connect rank `rank` of `size` through the Python store `store`, with collectives timing
    /// out after `timeout_s` seconds (torch's `init_process_group(timeout=…)`). Other options
    /// come from the `COHORT_*` environment variables, as for the Rust API.
    #[new]
    fn new(py: Python<'_>, store: &Bound<'_, PyAny>, rank: u32, size: u32, timeout_s: f64) -> PyResult<Group> {
        let store = PyStore::new(store)?;
        let store_closed = store.closer();
        let mut opts = TcpOptions::from_env().map_err(|e| CohortError::new_err(e.to_string()))?;
        if timeout_s > 0.0 {
            opts.timeout = Duration::try_from_secs_f64(timeout_s).map_err(|e| CohortError::new_err(e.to_string()))?;
        }
        let runtime = cohort_transports::tcp::runtime(&opts)
            .map_err(|e| CohortError::new_err(format!("cannot start the runtime: {e}")))?;
        let rt = runtime.handle().clone();
        // From here on a failure drops the runtime without waiting (see `Background`).
        let runtime = Background(Some(runtime));
        let pg = py
            .detach(move || {
                rt.block_on(ProcessGroup::connect(TokioNet, Arc::new(store), rank, size, opts))
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| CohortError::new_err(format!("cohort rank {rank}: init failed: {e}")))?;
        Ok(Group {
            pg,
            runtime,
            error: Arc::new(Mutex::new(None)),
            store_closed,
            pool: Arc::new(BufferPool::default()),
            copied: Arc::new(AtomicU64::new(0)),
        })
    }

    /// This rank.
    fn rank(&self) -> u32 {
        self.pg.rank().0
    }

    /// The number of ranks.
    fn size(&self) -> u32 {
        self.pg.world_size()
    }

    /// The last collective sequence number handed out.
    fn seq(&self) -> u64 {
        self.pg.seq().0
    }

    /// The first failure of this group, as raised by later calls; `None` while it is healthy.
    fn error(&self) -> Option<String> {
        lock(&self.error).clone()
    }

    /// Bytes copied so far between Python's tensors and cohort's buffers, in and out: zero for
    /// collectives that ran in place.
    fn bytes_copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }

    /// The flight recorder as JSON (PyTorch's flight-recorder schema).
    fn flight_recorder_json(&self) -> String {
        self.pg.flight_recorder_json()
    }

    /// Abort the group: unfinished works end aborted, later calls raise, peers are told.
    fn abort(&self, reason: &str) {
        let reason = reason.to_owned();
        let mut e = lock(&self.error);
        if e.is_none() {
            *e = Some(format!("cohort rank {}: the group was aborted: {reason}", self.pg.rank()));
        }
        drop(e);
        self.pg.abort(&reason);
    }

    /// Close the group cleanly (waits up to 2 s for queued frames), then stop using the Python
    /// store.
    fn shutdown(&self, py: Python<'_>) {
        let pg = self.pg.clone();
        py.detach(move || pg.shutdown());
        self.store_closed.store(true, Ordering::Release);
    }

    fn allreduce(&self, py: Python<'_>, tensors: Vec<Buf>, op: &str, factor: f64) -> PyResult<PendingWork> {
        let op = reduce_op(op, factor)?;
        let outs = outs_of(&tensors);
        self.launch(py, outs, move |pg, t| pg.allreduce(t, op), tensors)
    }

    fn allreduce_coalesced(&self, py: Python<'_>, tensors: Vec<Buf>, op: &str, factor: f64) -> PyResult<PendingWork> {
        let op = reduce_op(op, factor)?;
        let outs = outs_of(&tensors);
        self.launch(py, outs, move |pg, t| pg.allreduce_coalesced(t, op), tensors)
    }

    fn broadcast(&self, py: Python<'_>, tensors: Vec<Buf>, root: u32) -> PyResult<PendingWork> {
        let outs = outs_of(&tensors);
        self.launch(py, outs, move |pg, t| pg.broadcast(t, root), tensors)
    }

    /// Only the root's tensors are written: elsewhere they are left as they were.
    fn reduce(&self, py: Python<'_>, tensors: Vec<Buf>, root: u32, op: &str, factor: f64) -> PyResult<PendingWork> {
        let op = reduce_op(op, factor)?;
        // Elsewhere the reduction runs in a copy: torch leaves non-root tensors as they were.
        let (outs, in_place) = if root == self.pg.rank().0 { (outs_of(&tensors), true) } else { (Vec::new(), false) };
        self.launch_with(py, outs, move |pg, t| pg.reduce(t, root, op), tensors, in_place)
    }

    /// `outputs`: one per rank.
    fn allgather(&self, py: Python<'_>, input: Buf, outputs: Vec<Out>) -> PyResult<PendingWork> {
        self.launch(py, outputs, move |pg, mut t| pg.allgather(t.remove(0)), vec![input])
    }

    /// `outputs`: rank-major, `world_size × inputs.len()`.
    fn allgather_coalesced(&self, py: Python<'_>, inputs: Vec<Buf>, outputs: Vec<Out>) -> PyResult<PendingWork> {
        self.launch(py, outputs, move |pg, t| pg.allgather_coalesced(t), inputs)
    }

    /// Gathers into `output` itself (in place where it can).
    fn allgather_into_tensor(&self, py: Python<'_>, input: Buf, output: Buf) -> PyResult<PendingWork> {
        self.launch_into(py, output, input, |pg, output, input| pg.allgather_base(output, input))
    }

    /// `outputs`: one per rank on the root, empty elsewhere.
    fn gather(&self, py: Python<'_>, input: Buf, root: u32, outputs: Vec<Out>) -> PyResult<PendingWork> {
        self.launch(py, outputs, move |pg, mut t| pg.gather(t.remove(0), root), vec![input])
    }

    /// `inputs`: one per rank on the root, empty elsewhere.
    fn scatter(&self, py: Python<'_>, output: Buf, inputs: Vec<Buf>, root: u32) -> PyResult<PendingWork> {
        let outs = outs_of(std::slice::from_ref(&output));
        let mut all = vec![output];
        all.extend(inputs);
        self.launch(
            py,
            outs,
            move |pg, mut t| {
                let output = t.remove(0);
                pg.scatter(output, t, root)
            },
            all,
        )
    }

    /// `inputs`: one per rank.
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        inputs: Vec<Buf>,
        output: Out,
        op: &str,
        factor: f64,
    ) -> PyResult<PendingWork> {
        let op = reduce_op(op, factor)?;
        self.launch(py, vec![output], move |pg, t| pg.reduce_scatter(t, op), inputs)
    }

    /// Reduces into `output` itself (in place where it can).
    fn reduce_scatter_tensor(
        &self,
        py: Python<'_>,
        input: Buf,
        output: Buf,
        op: &str,
        factor: f64,
    ) -> PyResult<PendingWork> {
        let op = reduce_op(op, factor)?;
        self.launch_into(py, output, input, move |pg, output, input| pg.reduce_scatter_base(output, input, op))
    }

    /// `outputs` and `inputs`: one per rank.
    fn alltoall(&self, py: Python<'_>, outputs: Vec<Buf>, inputs: Vec<Buf>) -> PyResult<PendingWork> {
        let outs = outs_of(&outputs);
        let n = outputs.len();
        let mut all = outputs;
        all.extend(inputs);
        self.launch(
            py,
            outs,
            move |pg, mut t| {
                let inputs = t.split_off(n);
                pg.alltoall(t, inputs)
            },
            all,
        )
    }

    /// Splits count elements, one per rank; `None` splits evenly.
    #[pyo3(signature = (output, input, output_splits=None, input_splits=None))]
    fn alltoall_base(
        &self,
        py: Python<'_>,
        output: Buf,
        input: Buf,
        output_splits: Option<Vec<usize>>,
        input_splits: Option<Vec<usize>>,
    ) -> PyResult<PendingWork> {
        self.launch_into(py, output, input, move |pg, output, input| {
            pg.alltoall_base(output, input, output_splits, input_splits)
        })
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<PendingWork> {
        self.launch(py, Vec::new(), move |pg, _| pg.barrier(), Vec::new())
    }

    fn send(&self, py: Python<'_>, tensor: Buf, dst: u32, tag: u32) -> PyResult<PendingWork> {
        self.launch(py, Vec::new(), move |pg, mut t| pg.send(t.remove(0), dst, tag), vec![tensor])
    }

    fn recv(&self, py: Python<'_>, tensor: Buf, src: u32, tag: u32) -> PyResult<PendingWork> {
        let outs = outs_of(std::slice::from_ref(&tensor));
        self.launch(py, outs, move |pg, mut t| pg.recv(t.remove(0), src, tag), vec![tensor])
    }

    fn recv_anysource(&self, py: Python<'_>, tensor: Buf, tag: u32) -> PyResult<PendingWork> {
        let outs = outs_of(std::slice::from_ref(&tensor));
        self.launch(py, outs, move |pg, mut t| pg.recv_anysource(t.remove(0), tag), vec![tensor])
    }

    /// torch's `monitored_barrier`: blocks; rank 0's error names the ranks that did not come.
    fn monitored_barrier(&self, py: Python<'_>, timeout_s: f64, wait_all_ranks: bool) -> PyResult<()> {
        self.check()?;
        let timeout = if timeout_s > 0.0 {
            Duration::try_from_secs_f64(timeout_s).map_err(|e| CohortError::new_err(e.to_string()))?
        } else {
            self.pg.options().timeout
        };
        let pg = self.pg.clone();
        let rank = pg.rank();
        py.detach(move || pg.monitored_barrier(timeout, wait_all_ranks))
            .map_err(|e| CohortError::new_err(format!("cohort rank {rank}: {e}")))
    }
}

impl Group {
    /// Raise the group's first failure, if it has one.
    fn check(&self) -> PyResult<()> {
        match lock(&self.error).as_ref() {
            Some(e) => Err(CohortError::new_err(format!("{e} (an earlier collective failed; the group is aborted)"))),
            None => Ok(()),
        }
    }

    /// Read `bufs` into tensors (without the GIL), submit with `f`, and return the work whose
    /// results the runtime writes to `outs` when it ends.
    fn launch<F>(&self, py: Python<'_>, outs: Vec<Out>, f: F, bufs: Vec<Buf>) -> PyResult<PendingWork>
    where
        F: FnOnce(&ProcessGroup, Vec<Tensor>) -> Result<Work, SubmitError> + Send,
    {
        self.launch_with(py, outs, f, bufs, true)
    }

    /// [`Group::launch`] of an op that fills `output` from `input` (`f(pg, output, input)`),
    /// the output in place where it can.
    fn launch_into<F>(&self, py: Python<'_>, output: Buf, input: Buf, f: F) -> PyResult<PendingWork>
    where
        F: FnOnce(&ProcessGroup, Tensor, Tensor) -> Result<Work, SubmitError> + Send,
    {
        let outs = outs_of(std::slice::from_ref(&output));
        let run = move |pg: &ProcessGroup, mut t: Vec<Tensor>| {
            let input = t.remove(1);
            f(pg, t.remove(0), input)
        };
        self.launch(py, outs, run, vec![output, input])
    }

    /// [`Group::launch`]; `in_place: false` gives the collective copies of every tensor.
    fn launch_with<F>(
        &self,
        py: Python<'_>,
        outs: Vec<Out>,
        f: F,
        bufs: Vec<Buf>,
        in_place: bool,
    ) -> PyResult<PendingWork>
    where
        F: FnOnce(&ProcessGroup, Vec<Tensor>) -> Result<Work, SubmitError> + Send,
    {
        self.check()?;
        let pg = self.pg.clone();
        let rank = pg.rank();
        let pool = self.pool.clone();
        let copied = self.copied.clone();
        let borrow = if in_place { borrowable(&bufs, &outs) } else { vec![false; bufs.len()] };
        let submitted = py.detach(move || -> Result<Work, String> {
            let tensors = bufs
                .into_iter()
                .zip(borrow)
                .map(|(b, borrow)| read(&pool, &copied, b, borrow))
                .collect::<Result<Vec<_>, _>>()?;
            f(&pg, tensors).map_err(|e| e.to_string())
        });
        let work = submitted.map_err(|e| CohortError::new_err(format!("cohort rank {rank}: {e}")))?;
        let done = Arc::new(Done::default());
        let task = Completion {
            work: work.clone(),
            outs,
            done: done.clone(),
            group_error: self.error.clone(),
            pg: self.pg.clone(),
            pool: self.pool.clone(),
            copied: self.copied.clone(),
        };
        if let Some(rt) = &self.runtime.0 {
            rt.spawn(task.run());
        }
        Ok(PendingWork { work, done, rank: rank.0 })
    }
}

/// The group's runtime, shut down without waiting when the group is dropped: the drop may run
/// with the GIL held (Python's garbage collector), while a blocking-pool thread waits for the
/// GIL to call Python, and a plain drop would wait for that thread forever.
struct Background(Option<tokio::runtime::Runtime>);

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// A collective in flight: Python's handle on it.
#[pyclass(frozen, module = "cohort_torch._cohort")]
pub(crate) struct PendingWork {
    work: Work,
    done: Arc<Done>,
    rank: u32,
}

#[pymethods]
impl PendingWork {
    /// Block (without the GIL) until the work has ended and its outputs are written; raise
    /// `CohortError` if it failed. `timeout_s` > 0 bounds the wait (`False` when it ran out).
    #[pyo3(signature = (timeout_s=0.0))]
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let work = self.work.clone();
        let done = self.done.clone();
        let timeout = if timeout_s > 0.0 { Duration::try_from_secs_f64(timeout_s).ok() } else { None };
        let outcome = py.detach(move || {
            // The work's own wait reads the sockets itself for small works (busy polling);
            // then the outputs are written by the completion task.
            let _ = match timeout {
                Some(t) => work.wait_timeout(t),
                None => work.wait(),
            };
            done.wait(timeout)
        });
        match outcome {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(CohortError::new_err(e)),
        }
    }

    /// Whether the work has ended and its outputs are written.
    fn is_completed(&self) -> bool {
        self.done.state().outcome.is_some()
    }

    /// Whether the work ended successfully.
    fn is_success(&self) -> bool {
        matches!(self.done.state().outcome, Some(Ok(())))
    }

    /// The error the work failed with, if it did.
    fn exception(&self) -> Option<String> {
        self.done.state().outcome.clone().and_then(Result::err)
    }

    /// The rank a `recv_anysource` received from (-1 before it is known).
    fn source_rank(&self) -> i64 {
        self.work.source_rank().map_or(-1, |r| i64::from(r.0))
    }

    /// The work's sequence number.
    fn seq(&self) -> u64 {
        self.work.seq().0
    }

    /// Call `callback()` once the work has ended and its outputs are written (any number of
    /// callbacks, in the order given): at once, on this
    /// thread, if it already has; otherwise from a thread of the runtime's blocking pool, with
    /// the GIL. Never called with an error: ask `exception()`.
    fn on_done(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let mut st = self.done.state();
        if st.outcome.is_some() {
            drop(st);
            callback.call0(py)?;
            return Ok(());
        }
        st.callbacks.push(callback);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("PendingWork(rank={}, op={}, seq={})", self.rank, self.work.op(), self.work.seq().0)
    }
}

/// What Python waits for: the work ended and its outputs were written.
#[derive(Default)]
struct Done {
    state: Mutex<DoneState>,
    cond: Condvar,
}

#[derive(Default)]
struct DoneState {
    outcome: Option<Result<(), String>>,
    callbacks: Vec<Py<PyAny>>,
}

impl Done {
    fn state(&self) -> MutexGuard<'_, DoneState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The outcome, or `None` if `timeout` ran out first.
    fn wait(&self, timeout: Option<Duration>) -> Option<Result<(), String>> {
        let st = self.state();
        let st = match timeout {
            None => self.cond.wait_while(st, |s| s.outcome.is_none()).unwrap_or_else(|p| p.into_inner()),
            Some(t) => {
                self.cond.wait_timeout_while(st, t, |s| s.outcome.is_none()).unwrap_or_else(|p| p.into_inner()).0
            }
        };
        st.outcome.clone()
    }
}

/// The task that waits for a work, writes its outputs and tells Python.
struct Completion {
    work: Work,
    outs: Vec<Out>,
    done: Arc<Done>,
    group_error: Arc<Mutex<Option<String>>>,
    pg: ProcessGroup,
    pool: Arc<BufferPool>,
    copied: Arc<AtomicU64>,
}

impl Completion {
    async fn run(self) {
        let Completion { work, outs, done, group_error, pg, pool, copied } = self;
        let rank = pg.rank();
        let outcome = match work.clone().await {
            Ok(tensors) => {
                let written = write_outputs(&tensors, &outs, &copied)
                    .map_err(|e| format!("cohort rank {rank}: {} (seq {}): {e}", work.op(), work.seq().0));
                for t in tensors {
                    pool.put(t.into_host_buffer());
                }
                written
            }
            Err(e) => Err(failure_message(rank.0, &e)),
        };
        if let Err(message) = &outcome {
            let mut first = lock(&group_error);
            if first.is_none() {
                *first = Some(message.clone());
                drop(first);
                tracing::error!("{message}");
                // A failure the group itself did not record (a local error): abort it, so that
                // peers learn of it and later calls are refused.
                if pg.failure().is_none() {
                    pg.abort(message);
                }
            }
        }
        let callbacks = {
            let mut st = done.state();
            st.outcome = Some(outcome);
            std::mem::take(&mut st.callbacks)
        };
        done.cond.notify_all();
        if !callbacks.is_empty() {
            tokio::task::spawn_blocking(move || {
                let called = Python::try_attach(|py| {
                    for callback in &callbacks {
                        if let Err(e) = callback.call0(py) {
                            e.print(py);
                        }
                    }
                });
                if called.is_none() {
                    // The interpreter is going away: nothing may touch Python any more.
                    std::mem::forget(callbacks);
                }
            });
        }
    }
}

/// The text Python sees for a failed work: this rank, the op, its seq and whom it blames.
fn failure_message(rank: u32, e: &WorkError) -> String {
    let text = e.to_string();
    // cohort's result text usually says "rank R: op (seq S) failed: …" itself, after the
    // work's own "op (seq S) failed: ": keep that part only.
    let me = format!("rank {rank}: ");
    let message = match text.find(&me) {
        Some(at) if at > 0 => format!("cohort {}", &text[at..]),
        _ => format!("cohort rank {rank}: {text}"),
    };
    match e.culprit() {
        Some(culprit) if !message.contains(&format!("rank {culprit}")) => {
            format!("{message} (culprit: rank {culprit})")
        }
        _ => message,
    }
}

/// Copy each result tensor into its output; their sizes must agree.
fn write_outputs(tensors: &[Tensor], outs: &[Out], copied: &AtomicU64) -> Result<(), String> {
    if tensors.len() < outs.len() {
        return Err(format!("returned {} tensors for {} outputs", tensors.len(), outs.len()));
    }
    for (i, (t, &(ptr, nbytes))) in tensors.iter().zip(outs).enumerate() {
        let bytes = t.bytes();
        if bytes.len() != nbytes {
            return Err(format!("output {i} holds {nbytes} bytes but the result has {}", bytes.len()));
        }
        // A result that is the output's own memory (the collective ran in place) is there.
        if nbytes > 0 && bytes.as_ptr() as usize != ptr {
            // SAFETY: Python handed `(ptr, nbytes)` as the storage of a contiguous CPU tensor
            // it keeps alive until this work is done (the callback holds it), and nothing
            // else writes it meanwhile.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr as *mut u8, nbytes) };
            copied.fetch_add(nbytes as u64, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// A tensor over the bytes Python described: the tensor's memory itself when `borrow` (and it
/// is 8-byte aligned), else a copy, in a buffer from `pool` when it has one of that size.
fn read(
    pool: &BufferPool,
    copied: &AtomicU64,
    (ptr, nbytes, dtype, shape, tensor): Buf,
    borrow: bool,
) -> Result<Tensor, String> {
    let dtype = DType::parse(&dtype).ok_or_else(|| format!("cohort does not support dtype {dtype}"))?;
    if borrow && nbytes > 0 {
        // SAFETY: Python handed `(ptr, nbytes)` as the storage of the contiguous CPU tensor
        // `tensor`, which the buffer holds a reference to, so the memory lives as long as the
        // buffer. `borrowable` checked that no other tensor or output of this call overlaps it,
        // and the Python layer's contract (documented there, as for every torch backend) is
        // that the caller leaves a tensor alone while a collective on it is in flight.
        if let Some(buffer) = unsafe { HostBuffer::borrowed(ptr as *mut u8, nbytes, Box::new(tensor)) } {
            return Tensor::from_host_buffer(dtype, &shape, buffer).map_err(|e| e.to_string());
        }
    }
    let bytes: &[u8] = if nbytes == 0 {
        &[]
    } else {
        // SAFETY: Python handed `(ptr, nbytes)` as the storage of a live, contiguous CPU tensor
        // and holds the GIL-free call until this copy returns.
        unsafe { std::slice::from_raw_parts(ptr as *const u8, nbytes) }
    };
    copied.fetch_add(nbytes as u64, Ordering::Relaxed);
    match pool.take(nbytes) {
        Some(mut buffer) => {
            buffer.as_bytes_mut().copy_from_slice(bytes);
            Tensor::from_host_buffer(dtype, &shape, buffer).map_err(|e| e.to_string())
        }
        None => Tensor::from_bytes(dtype, &shape, bytes).map_err(|e| e.to_string()),
    }
}

/// Which of a call's tensors may be used in place: those that overlap no other tensor of the
/// call and no output other than themselves. An output with exactly a tensor's memory is that
/// tensor: an in-place collective's result is the buffer itself (not copied again), and an
/// input of another collective is consumed when the collective starts, before any output is
/// written. Overlapping ones are copied, so two buffers never alias.
fn borrowable(bufs: &[Buf], outs: &[Out]) -> Vec<bool> {
    let mut ok = vec![true; bufs.len()];
    // (start, end, Some(buf index) or None for an output), by start.
    let mut spans: Vec<(usize, usize, Option<usize>)> = bufs
        .iter()
        .enumerate()
        .filter(|(_, b)| b.1 > 0)
        .map(|(i, b)| (b.0, b.0.saturating_add(b.1), Some(i)))
        .collect();
    let own: std::collections::HashSet<Out> = bufs.iter().map(|b| (b.0, b.1)).collect();
    spans.extend(outs.iter().filter(|o| o.1 > 0 && !own.contains(o)).map(|o| (o.0, o.0.saturating_add(o.1), None)));
    spans.sort_unstable();
    // Each span against the furthest end seen before it, and the span that reached it: a span
    // overlapping any earlier one overlaps that one too (or is overlapped by it at the same
    // start), so every member of an overlapping pair is marked.
    let mut reach: Option<(usize, Option<usize>)> = None;
    for &(start, end, who) in &spans {
        if let Some((far, far_who)) = reach
            && start < far
        {
            for w in [who, far_who].into_iter().flatten() {
                ok[w] = false;
            }
        }
        if reach.is_none_or(|(far, _)| end > far) {
            reach = Some((end, who));
        }
    }
    ok
}

/// Host buffers of finished works, by length, for the inputs of later works of that size: a
/// DDP job allreduces the same bucket sizes every step, and a buffer whose pages are already
/// mapped copies in several times faster than a new one (a 48 MiB bucket: about 12,000 page
/// faults saved per call). Only buffers of at least [`BufferPool::MIN_BYTES`] are kept, at most
/// [`BufferPool::PER_SIZE`] per length and [`BufferPool::MAX_BYTES`] in all.
#[derive(Default)]
struct BufferPool {
    free: Mutex<(usize, std::collections::BTreeMap<usize, Vec<HostBuffer>>)>,
}

impl BufferPool {
    const MIN_BYTES: usize = 64 << 10;
    const PER_SIZE: usize = 4;
    const MAX_BYTES: usize = 256 << 20;

    fn take(&self, len: usize) -> Option<HostBuffer> {
        if len < Self::MIN_BYTES {
            return None;
        }
        let mut free = lock(&self.free);
        let buffer = free.1.get_mut(&len)?.pop()?;
        free.0 -= len;
        Some(buffer)
    }

    fn put(&self, buffer: HostBuffer) {
        let len = buffer.len();
        // A borrowed buffer is a Python tensor's memory: never reuse it.
        if len < Self::MIN_BYTES || buffer.is_borrowed() {
            return;
        }
        let mut free = lock(&self.free);
        if free.0 + len > Self::MAX_BYTES {
            return;
        }
        let same = free.1.entry(len).or_default();
        if same.len() < Self::PER_SIZE {
            same.push(buffer);
            free.0 += len;
        }
    }
}

fn outs_of(bufs: &[Buf]) -> Vec<Out> {
    bufs.iter().map(|b| (b.0, b.1)).collect()
}

/// torch's `ReduceOp` by name (`SUM`, `AVG`, `PREMUL_SUM`…); `factor` is PREMUL_SUM's.
fn reduce_op(name: &str, factor: f64) -> PyResult<ReduceOp> {
    Ok(match name.to_ascii_uppercase().as_str() {
        "SUM" => ReduceOp::Sum,
        "AVG" => ReduceOp::Avg,
        "PRODUCT" => ReduceOp::Product,
        "MIN" => ReduceOp::Min,
        "MAX" => ReduceOp::Max,
        "BAND" => ReduceOp::BAnd,
        "BOR" => ReduceOp::BOr,
        "BXOR" => ReduceOp::BXor,
        "PREMUL_SUM" => ReduceOp::PremulSum(factor),
        other => return Err(CohortError::new_err(format!("cohort does not support ReduceOp {other}"))),
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
