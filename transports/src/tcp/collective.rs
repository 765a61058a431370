//! Collectives on the data plane: a user request becomes flat byte buffers and a
//! [`ScheduleOp`], core's [`Executor`] runs the plan, and the final buffers become the user's
//! output tensors.

use cohort_core::reduce::{ReduceOp, Reduction};
use cohort_core::schedule::{Executor, PlanCache, PlanOptions, ScheduleOp};
use cohort_core::tensor::{DType, FlatSlot, HostBuffer, Tensor, numel_of};
use cohort_core::work::{Rank, SeqNo};

/// What the user handed to a collective.
#[derive(Debug)]
pub(crate) enum Request {
    Allreduce {
        tensors: Vec<Tensor>,
        op: ReduceOp,
        coalesced: bool,
    },
    Broadcast {
        tensors: Vec<Tensor>,
        root: Rank,
    },
    Reduce {
        tensors: Vec<Tensor>,
        root: Rank,
        op: ReduceOp,
    },
    Allgather {
        input: Tensor,
        into_tensor: bool,
        /// The caller's output, written in place (`allgather_base`).
        out: Option<Tensor>,
    },
    AllgatherCoalesced {
        inputs: Vec<Tensor>,
    },
    Gather {
        input: Tensor,
        root: Rank,
    },
    Scatter {
        output: Tensor,
        inputs: Vec<Tensor>,
        root: Rank,
    },
    ReduceScatter {
        inputs: Vec<Tensor>,
        op: ReduceOp,
        tensor: bool,
        /// The caller's output, written in place (`reduce_scatter_base`).
        out: Option<Tensor>,
    },
    Alltoall {
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    },
    AlltoallBase {
        output: Tensor,
        input: Tensor,
        input_splits: Vec<usize>,
        output_splits: Vec<usize>,
    },
    Barrier,
    /// Taken by a running collective.
    Taken,
}

impl Request {
    pub(crate) fn allreduce(tensors: Vec<Tensor>, op: ReduceOp) -> Self {
        Request::Allreduce { tensors, op, coalesced: false }
    }
    pub(crate) fn allreduce_coalesced(tensors: Vec<Tensor>, op: ReduceOp) -> Self {
        Request::Allreduce { tensors, op, coalesced: true }
    }
    pub(crate) fn broadcast(tensors: Vec<Tensor>, root: Rank) -> Self {
        Request::Broadcast { tensors, root }
    }
    pub(crate) fn reduce(tensors: Vec<Tensor>, root: Rank, op: ReduceOp) -> Self {
        Request::Reduce { tensors, root, op }
    }
    pub(crate) fn allgather(input: Tensor, into_tensor: bool, out: Option<Tensor>) -> Self {
        Request::Allgather { input, into_tensor, out }
    }
    pub(crate) fn allgather_coalesced(inputs: Vec<Tensor>) -> Self {
        Request::AllgatherCoalesced { inputs }
    }
    pub(crate) fn gather(input: Tensor, root: Rank) -> Self {
        Request::Gather { input, root }
    }
    pub(crate) fn scatter(output: Tensor, inputs: Vec<Tensor>, root: Rank) -> Self {
        Request::Scatter { output, inputs, root }
    }
    pub(crate) fn reduce_scatter(inputs: Vec<Tensor>, op: ReduceOp, tensor: bool, out: Option<Tensor>) -> Self {
        Request::ReduceScatter { inputs, op, tensor, out }
    }
    pub(crate) fn alltoall(outputs: Vec<Tensor>, inputs: Vec<Tensor>) -> Self {
        Request::Alltoall { outputs, inputs }
    }
    pub(crate) fn alltoall_base(
        output: Tensor,
        input: Tensor,
        input_splits: Vec<usize>,
        output_splits: Vec<usize>,
    ) -> Self {
        Request::AlltoallBase { output, input, input_splits, output_splits }
    }
    pub(crate) fn barrier() -> Self {
        Request::Barrier
    }
}

/// How the final buffers become the user's tensors.
#[derive(Debug)]
enum Finish {
    /// The data buffer is the result; give it to every tensor (flattened slots, or copies).
    InPlace { tensors: Vec<Tensor>, slots: Option<Vec<FlatSlot>> },
    /// The data buffer is the result and becomes the one tensor, whose buffer it was (no copy).
    Moved { dtype: DType, shape: Vec<usize> },
    /// The output buffer split into tensors of these shapes.
    Split { dtype: DType, shapes: Vec<Vec<usize>> },
    /// Nothing to hand back.
    Nothing,
}

/// One rank's run of one collective.
#[derive(Debug)]
pub(crate) struct CollectiveRun {
    seq: SeqNo,
    exec: Executor,
    finish: Finish,
}

fn concat(tensors: &[Tensor]) -> Vec<u8> {
    let mut out = Vec::with_capacity(tensors.iter().map(Tensor::nbytes).sum());
    for t in tensors {
        out.extend_from_slice(t.bytes());
    }
    out
}

/// The data buffer of an in-place op (allreduce, broadcast, reduce) and how it finishes. One
/// tensor, the common case, lends its own buffer: no copy in, none out. Several tensors on one
/// rank are combined first with `reduce` (as Gloo does), or, without one, the first is sent and
/// every tensor gets the result.
fn local_input(mut tensors: Vec<Tensor>, reduce: Option<&Reduction>) -> Result<(HostBuffer, Finish), String> {
    if tensors.len() == 1 {
        let t = tensors.pop().ok_or("no tensors")?;
        let (dtype, shape, buffer) = t.into_parts();
        return Ok((buffer, Finish::Moved { dtype, shape }));
    }
    let first = tensors.first().ok_or("no tensors")?;
    let mut acc = HostBuffer::from_bytes(first.bytes());
    if let Some(red) = reduce {
        for t in &tensors[1..] {
            red.combine(acc.as_bytes_mut(), t.bytes()).map_err(|e| e.to_string())?;
        }
    }
    Ok((acc, Finish::InPlace { tensors, slots: None }))
}

fn numels(tensors: &[Tensor]) -> Vec<usize> {
    tensors.iter().map(Tensor::numel).collect()
}

impl CollectiveRun {
    /// Build the executor for this rank's part, on the plan `plans` holds for it (built once).
    pub(crate) fn start(
        request: &mut Request,
        me: Rank,
        world: u32,
        seq: SeqNo,
        plans: &mut PlanCache,
    ) -> Result<Self, String> {
        let n = world as usize;
        let request = std::mem::replace(request, Request::Taken);
        let err = |e: &dyn std::fmt::Display| e.to_string();
        // The caller's output tensor, where the op has one: the executor writes into its buffer,
        // which becomes the result (no copy out), after its dtype and length are checked.
        let mut given: Option<Tensor> = None;
        // (op, reduction, data, output length in bytes, element size, how to finish)
        let (op, reduction, data, out_len, elem, finish) = match request {
            Request::Allreduce { tensors, op, coalesced } => {
                let dtype = tensors.first().map(Tensor::dtype).ok_or("allreduce: no tensors")?;
                let red = Reduction::new(op, dtype).map_err(|e| err(&e))?;
                let (data, finish) = if coalesced {
                    let (flat, slots) = Tensor::flatten(&tensors).map_err(|e| err(&e))?;
                    (flat.into_host_buffer(), Finish::InPlace { tensors, slots: Some(slots) })
                } else {
                    local_input(tensors, Some(&red))?
                };
                let count = data.len() / dtype.size();
                (ScheduleOp::Allreduce { count }, Some(red), data, 0, dtype.size(), finish)
            }
            Request::Broadcast { tensors, root } => {
                let first = tensors.first().ok_or("broadcast: no tensors")?;
                let (count, es) = (first.numel(), first.element_size());
                let (data, finish) = local_input(tensors, None)?;
                (ScheduleOp::Broadcast { count, root }, None, data, 0, es, finish)
            }
            Request::Reduce { tensors, root, op } => {
                let dtype = tensors.first().map(Tensor::dtype).ok_or("reduce: no tensors")?;
                let red = Reduction::new(op, dtype).map_err(|e| err(&e))?;
                let (acc, finish) = local_input(tensors, Some(&red))?;
                let count = acc.len() / dtype.size();
                (ScheduleOp::Reduce { count, root }, Some(red), acc, 0, dtype.size(), finish)
            }
            Request::Allgather { input, into_tensor, out } => {
                let (dtype, numel) = (input.dtype(), input.numel());
                let shapes = match &out {
                    Some(o) => vec![o.shape().to_vec()],
                    None if into_tensor => vec![vec![numel * n]],
                    None => vec![input.shape().to_vec(); n],
                };
                given = out;
                let op = ScheduleOp::Allgather { counts: vec![numel; n] };
                (
                    op,
                    None,
                    HostBuffer::from_bytes(input.bytes()),
                    input.nbytes() * n,
                    dtype.size(),
                    Finish::Split { dtype, shapes },
                )
            }
            Request::AllgatherCoalesced { inputs } => {
                // One allgather of the inputs back to back; every rank's piece splits into its
                // tensors again, rank by rank.
                let dtype = inputs.first().map(Tensor::dtype).ok_or("allgather_coalesced: no tensors")?;
                if let Some((i, t)) = inputs.iter().enumerate().find(|(_, t)| t.dtype() != dtype) {
                    return Err(format!(
                        "allgather_coalesced: tensor {i} has dtype {}, tensor 0 has {dtype}",
                        t.dtype()
                    ));
                }
                let data = concat(&inputs);
                let numel = data.len() / dtype.size();
                let shapes = (0..n).flat_map(|_| inputs.iter().map(|t| t.shape().to_vec())).collect();
                let op = ScheduleOp::Allgather { counts: vec![numel; n] };
                let out_len = data.len() * n;
                (op, None, HostBuffer::from_bytes(&data), out_len, dtype.size(), Finish::Split { dtype, shapes })
            }
            Request::Gather { input, root } => {
                let (dtype, numel) = (input.dtype(), input.numel());
                let (out_len, finish) = if me == root {
                    (input.nbytes() * n, Finish::Split { dtype, shapes: vec![input.shape().to_vec(); n] })
                } else {
                    (0, Finish::Nothing)
                };
                let op = ScheduleOp::Gather { counts: vec![numel; n], root };
                (op, None, HostBuffer::from_bytes(input.bytes()), out_len, dtype.size(), finish)
            }
            Request::Scatter { output, inputs, root } => {
                let dtype = output.dtype();
                let data = if me == root { HostBuffer::from_bytes(&concat(&inputs)) } else { HostBuffer::default() };
                let op = ScheduleOp::Scatter { counts: vec![output.numel(); n], root };
                let finish = Finish::Split { dtype, shapes: vec![output.shape().to_vec()] };
                let out_len = output.nbytes();
                given = Some(output);
                (op, None, data, out_len, dtype.size(), finish)
            }
            Request::ReduceScatter { inputs, op, tensor, out } => {
                let dtype = inputs.first().map(Tensor::dtype).ok_or("reduce_scatter: no tensors")?;
                let red = Reduction::new(op, dtype).map_err(|e| err(&e))?;
                let (counts, shape) = if tensor {
                    let counts = ScheduleOp::equal_counts(world, inputs[0].numel()).map_err(|e| err(&e))?;
                    let k = counts[0];
                    (counts, vec![k])
                } else {
                    (numels(&inputs), inputs[me.index()].shape().to_vec())
                };
                let out_len = counts[me.index()] * dtype.size();
                let shape = out.as_ref().map_or(shape, |o| o.shape().to_vec());
                given = out;
                let finish = Finish::Split { dtype, shapes: vec![shape] };
                (
                    ScheduleOp::ReduceScatter { counts },
                    Some(red),
                    HostBuffer::from_bytes(&concat(&inputs)),
                    out_len,
                    dtype.size(),
                    finish,
                )
            }
            Request::Alltoall { outputs, inputs } => {
                let dtype = inputs.first().map(Tensor::dtype).ok_or("alltoall: no tensors")?;
                let op = ScheduleOp::Alltoall { send_counts: numels(&inputs), recv_counts: numels(&outputs) };
                let out_len = outputs.iter().map(Tensor::nbytes).sum();
                let shapes = outputs.iter().map(|t| t.shape().to_vec()).collect();
                (
                    op,
                    None,
                    HostBuffer::from_bytes(&concat(&inputs)),
                    out_len,
                    dtype.size(),
                    Finish::Split { dtype, shapes },
                )
            }
            Request::AlltoallBase { output, input, input_splits, output_splits } => {
                let dtype = input.dtype();
                let op = ScheduleOp::alltoall_base(world, input.numel(), output.numel(), &input_splits, &output_splits)
                    .map_err(|e| err(&e))?;
                let finish = Finish::Split { dtype, shapes: vec![output.shape().to_vec()] };
                let out_len = output.nbytes();
                given = Some(output);
                (op, None, HostBuffer::from_bytes(input.bytes()), out_len, dtype.size(), finish)
            }
            Request::Barrier => (ScheduleOp::Barrier, None, HostBuffer::default(), 0, 1, Finish::Nothing),
            Request::Taken => return Err("collective started twice".into()),
        };
        let plan = plans.plan(&op, me, world, elem, PlanOptions::default()).map_err(|e| err(&e))?;
        if plan.output_len() != out_len {
            return Err(format!(
                "{}: the outputs hold {out_len} bytes, the plan needs {}",
                plan.op_name(),
                plan.output_len()
            ));
        }
        let exec = match given {
            Some(out) => {
                let name = plan.op_name();
                if out.nbytes() != out_len {
                    return Err(format!("{name}: the output holds {} bytes, the result needs {out_len}", out.nbytes()));
                }
                if let Finish::Split { dtype, .. } = &finish
                    && out.dtype() != *dtype
                {
                    return Err(format!("{name}: the output is {}, the input {dtype}", out.dtype()));
                }
                Executor::with_output(plan, reduction, data, out.into_host_buffer())
            }
            None => Executor::new(plan, reduction, data),
        }
        .map_err(|e| err(&e))?;
        Ok(CollectiveRun { seq, exec, finish })
    }

    pub(crate) fn seq(&self) -> SeqNo {
        self.seq
    }

    /// This rank's plan for the collective.
    pub(crate) fn plan(&self) -> &cohort_core::schedule::Plan {
        self.exec.plan()
    }

    /// A chunk arrived. Drain [`CollectiveRun::poll_send`] next, then ask [`CollectiveRun::step`].
    pub(crate) fn handle_recv(&mut self, from: Rank, step: u32, payload: &[u8]) -> Result<(), String> {
        self.exec.handle_recv(from, step, payload).map_err(|e| e.to_string())
    }

    /// Whether the run is over (call [`CollectiveRun::finish`]); accurate once
    /// [`CollectiveRun::poll_send`] has returned `None`.
    pub(crate) fn is_done(&self) -> bool {
        self.exec.is_done()
    }

    /// The ranks whose parts it waits for now, into `ranks` (cleared first; empty when done).
    pub(crate) fn waiting_on(&self, ranks: &mut Vec<Rank>) {
        self.exec.waiting_on_into(ranks);
    }

    /// The next chunk to send; its bytes are [`CollectiveRun::payload`] until the next call.
    pub(crate) fn poll_send(&mut self) -> Option<cohort_core::schedule::Outgoing> {
        self.exec.poll_send()
    }

    /// The bytes of a chunk from [`CollectiveRun::poll_send`].
    pub(crate) fn payload(&self, out: &cohort_core::schedule::Outgoing) -> &[u8] {
        self.exec.payload(out)
    }

    /// The output tensors.
    pub(crate) fn finish(self) -> Result<Vec<Tensor>, String> {
        let (data, output) = self.exec.into_buffers();
        match self.finish {
            Finish::Moved { dtype, shape } => {
                Ok(vec![Tensor::from_parts(dtype, shape, data).map_err(|e| e.to_string())?])
            }
            Finish::InPlace { mut tensors, slots } => {
                let data = data.as_bytes();
                match slots {
                    Some(slots) => {
                        let dtype = tensors[0].dtype();
                        let flat =
                            Tensor::from_bytes(dtype, &[data.len() / dtype.size()], data).map_err(|e| e.to_string())?;
                        tensors = flat.unflatten(&slots).map_err(|e| e.to_string())?;
                    }
                    None => {
                        for t in &mut tensors {
                            t.bytes_mut().copy_from_slice(data);
                        }
                    }
                }
                Ok(tensors)
            }
            Finish::Split { dtype, mut shapes }
                if shapes.len() == 1 && output.len() == numel_of(&shapes[0]).unwrap_or(0) * dtype.size() =>
            {
                // One output that fills the buffer: it is the tensor, no copy.
                let shape = shapes.pop().unwrap_or_default();
                Ok(vec![Tensor::from_host_buffer(dtype, &shape, output).map_err(|e| e.to_string())?])
            }
            Finish::Split { dtype, shapes } => {
                let mut out = Vec::with_capacity(shapes.len());
                let mut at = 0;
                for shape in shapes {
                    let len = shape.iter().product::<usize>() * dtype.size();
                    let bytes = output.as_bytes().get(at..at + len).ok_or("output buffer shorter than the outputs")?;
                    out.push(Tensor::from_bytes(dtype, &shape, bytes).map_err(|e| e.to_string())?);
                    at += len;
                }
                Ok(out)
            }
            Finish::Nothing => Ok(Vec::new()),
        }
    }
}
