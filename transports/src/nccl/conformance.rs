//! The device conformance suite: one set of cases that every [`Device`] implementation must
//! pass, written against the seam only. `cargo test` runs it on the host emulation
//! (`emu::tests`); the CUDA implementation runs it on a GPU (`cuda::tests`).
//!
//! Communicator cases use a world of one rank, the only world one GPU allows. Cases run on
//! plain threads (never inside a tokio runtime): they block in `synchronize` and poll with
//! bounded waits (up to 10 s, 1 ms apart). None panics: a failed case is an `Err` saying what
//! was seen, and a panic inside one is caught and reported the same way.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::DType;

use super::device::{
    BufRef, CommConfig, CommOp, Communicator, Device, HostBuffer, NcclDataType, NcclError, NcclRedOp, NcclResult,
    nccl_dtype, nccl_op, nccl_version_code, version_text,
};

/// Holds streams still on the device, so that a case can see what is pending.
pub(crate) trait StreamBlocker<D: Device> {
    /// Makes `stream` wait, on the device, until `release` is called (CUDA: cuStreamWaitValue32 on a host flag).
    fn block(&self, dev: &D, stream: &D::Stream) -> Result<(), NcclError>;
    /// Lets every stream blocked by `block` go on.
    fn release(&self);
}

/// A conformance case: `Ok` or what went wrong.
type Case<D> = fn(&D, &dyn StreamBlocker<D>) -> Result<(), String>;

/// Every case, by name, with its outcome; none panics (a failure is an Err with what was seen).
pub(crate) fn run_all<D: Device>(dev: &D, blocker: &dyn StreamBlocker<D>) -> Vec<(&'static str, Result<(), String>)> {
    let cases: [(&'static str, Case<D>); 14] = [
        ("event_never_recorded_is_complete", event_never_recorded_is_complete::<D>),
        ("recorded_event_is_pending_while_blocked_then_completes", recorded_event_is_pending_while_blocked::<D>),
        ("stream_runs_in_order", stream_runs_in_order::<D>),
        ("stream_wait_waits_for_the_record_at_call_time", stream_wait_waits_for_the_record_at_call_time::<D>),
        ("elapsed_needs_timing_and_completion", elapsed_needs_timing_and_completion::<D>),
        ("copies_round_trip_with_offsets_and_check_bounds", copies_round_trip_with_offsets_and_check_bounds::<D>),
        ("nonblocking_init_reaches_success", nonblocking_init_reaches_success::<D>),
        ("allreduce_sum_f32_at_world_one", allreduce_sum_f32_at_world_one::<D>),
        ("broadcast_reduce_allgather_reduce_scatter_at_world_one", rooted_and_gathering_collectives::<D>),
        ("send_and_recv_to_self_in_a_group", send_and_recv_to_self_in_a_group::<D>),
        ("bool_sum_travels_as_uint8_max", bool_sum_travels_as_uint8_max::<D>),
        (
            "abort_refuses_calls_at_once_and_returns_once_a_held_stream_goes_on",
            abort_refuses_calls_at_once_and_returns_once_a_held_stream_goes_on::<D>,
        ),
        ("split_gives_a_working_communicator", split_gives_a_working_communicator::<D>),
        ("shrink_works_or_is_refused_by_version", shrink_works_or_is_refused_by_version::<D>),
    ];
    cases
        .into_iter()
        .map(|(name, case)| {
            let outcome = catch_unwind(AssertUnwindSafe(|| case(dev, blocker))).unwrap_or_else(|panic| {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string panic".to_owned());
                Err(format!("panicked: {why}"))
            });
            // Never leave a stream blocked behind a failed case.
            blocker.release();
            (name, outcome)
        })
        .collect()
}

// ---- cases -----------------------------------------------------------------------------------

/// cudaEventQuery: an event never recorded is complete.
fn event_never_recorded_is_complete<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    for timing in [false, true] {
        let ev = dev.new_event(timing).map_err(ctx("new_event"))?;
        ensure(dev.query(&ev).map_err(ctx("query"))?, || format!("a fresh event (timing {timing}) is not complete"))?;
    }
    Ok(())
}

fn recorded_event_is_pending_while_blocked<D: Device>(dev: &D, blocker: &dyn StreamBlocker<D>) -> Result<(), String> {
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let ev = dev.new_event(false).map_err(ctx("new_event"))?;
    let held = Held::block(blocker, dev, &s)?;
    dev.record(&ev, &s).map_err(ctx("record"))?;
    stays_pending(dev, &ev, "an event recorded behind a blocked stream")?;
    held.release();
    wait_event(dev, &ev, "the event after release")
}

fn stream_runs_in_order<D: Device>(dev: &D, blocker: &dyn StreamBlocker<D>) -> Result<(), String> {
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let buf = dev.alloc(8).map_err(ctx("alloc"))?;
    let ev = dev.new_event(false).map_err(ctx("new_event"))?;
    let held = Held::block(blocker, dev, &s)?;
    dev.copy_to_device(&s, &[1; 8], &buf, 0).map_err(ctx("first copy"))?;
    dev.copy_to_device(&s, &[2; 4], &buf, 2).map_err(ctx("second copy"))?;
    dev.record(&ev, &s).map_err(ctx("record"))?;
    stays_pending(dev, &ev, "copies behind a blocked stream")?;
    held.release();
    let got = download(dev, &s, &buf, 0, 8)?;
    ensure(got == [1, 1, 2, 2, 2, 2, 1, 1], || format!("two ordered copies gave {got:?}"))
}

/// cudaStreamWaitEvent waits for the record that was the latest when it was called; a later
/// record (here on a free stream) does not release the waiter; a never-recorded event is no
/// wait.
fn stream_wait_waits_for_the_record_at_call_time<D: Device>(
    dev: &D,
    blocker: &dyn StreamBlocker<D>,
) -> Result<(), String> {
    let (a, b, c) = (
        dev.new_stream().map_err(ctx("new_stream"))?,
        dev.new_stream().map_err(ctx("new_stream"))?,
        dev.new_stream().map_err(ctx("new_stream"))?,
    );
    let e = dev.new_event(false).map_err(ctx("new_event"))?;
    let after = dev.new_event(false).map_err(ctx("new_event"))?;
    let held = Held::block(blocker, dev, &a)?;
    dev.record(&e, &a).map_err(ctx("record on a"))?;
    dev.stream_wait(&b, &e).map_err(ctx("stream_wait"))?;
    dev.record(&after, &b).map_err(ctx("record on b"))?;
    stays_pending(dev, &after, "stream b waiting on blocked stream a")?;
    dev.record(&e, &c).map_err(ctx("re-record on c"))?;
    wait_event(dev, &e, "the event re-recorded on a free stream")?;
    stays_pending(dev, &after, "stream b after the event was re-recorded elsewhere")?;
    held.release();
    wait_event(dev, &after, "stream b once a is released")?;
    let never = dev.new_event(false).map_err(ctx("new_event"))?;
    let x = dev.new_event(false).map_err(ctx("new_event"))?;
    dev.stream_wait(&c, &never).map_err(ctx("stream_wait on a never-recorded event"))?;
    dev.record(&x, &c).map_err(ctx("record"))?;
    wait_event(dev, &x, "a stream that waited on a never-recorded event")
}

/// cudaEventElapsedTime: an error (not a number) unless both events were made with timing and
/// have completed.
fn elapsed_needs_timing_and_completion<D: Device>(dev: &D, blocker: &dyn StreamBlocker<D>) -> Result<(), String> {
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let start = dev.new_event(true).map_err(ctx("new_event"))?;
    let end = dev.new_event(true).map_err(ctx("new_event"))?;
    let untimed = dev.new_event(false).map_err(ctx("new_event"))?;
    refused(dev.elapsed(&start, &end), "elapsed between events never recorded")?;
    let held = Held::block(blocker, dev, &s)?;
    dev.record(&start, &s).map_err(ctx("record start"))?;
    dev.record(&end, &s).map_err(ctx("record end"))?;
    refused(dev.elapsed(&start, &end), "elapsed between pending events")?;
    held.release();
    wait_event(dev, &start, "start")?;
    wait_event(dev, &end, "end")?;
    let d = dev.elapsed(&start, &end).map_err(ctx("elapsed between completed timing events"))?;
    ensure(d < Duration::from_secs(10), || format!("elapsed {d:?} between two adjacent events"))?;
    dev.record(&untimed, &s).map_err(ctx("record"))?;
    wait_event(dev, &untimed, "the untimed event")?;
    refused(dev.elapsed(&start, &untimed), "elapsed to an event made without timing")?;
    refused(dev.elapsed(&untimed, &end), "elapsed from an event made without timing")
}

fn copies_round_trip_with_offsets_and_check_bounds<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let buf = dev.alloc(16).map_err(ctx("alloc"))?;
    ensure(dev.buffer_len(&buf) == 16, || format!("buffer_len {} for 16 bytes", dev.buffer_len(&buf)))?;
    ensure(download(dev, &s, &buf, 0, 16)? == [0; 16], || "alloc is not zeroed".to_owned())?;
    dev.copy_to_device(&s, &[1, 2, 3, 4, 5, 6, 7, 8], &buf, 4).map_err(ctx("copy_to_device"))?;
    let got = download(dev, &s, &buf, 2, 10)?;
    ensure(got == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8], || format!("round trip at offsets gave {got:?}"))?;
    refused(dev.copy_to_device(&s, &[9; 8], &buf, 12), "8 bytes at offset 12 of 16")?;
    refused(dev.copy_to_device(&s, &[9; 1], &buf, usize::MAX), "a copy at offset usize::MAX")?;
    refused(dev.copy_to_host(&s, &buf, 10, &HostBuffer::new(8)), "reading 8 bytes at offset 10 of 16")?;
    let got = download(dev, &s, &buf, 0, 16)?;
    ensure(got == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], || format!("refused copies wrote: {got:?}"))
}

fn nonblocking_init_reaches_success<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let comm = world_one(dev)?;
    ensure(comm.rank() == 0 && comm.world_size() == 1, || {
        format!("rank {} of {} for a world of one", comm.rank(), comm.world_size())
    })
}

fn allreduce_sum_f32_at_world_one<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let comm = world_one(dev)?;
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let values = [1.5f32, -2.0, 3.25];
    let x = upload(dev, &s, &f32_bytes(&values))?;
    let out = dev.alloc(12).map_err(ctx("alloc"))?;
    let op = CommOp::AllReduce {
        send: BufRef::new(x.clone()),
        recv: BufRef::new(out.clone()),
        count: 3,
        dtype: NcclDataType::Float32,
        op: NcclRedOp::Sum,
    };
    comm.enqueue(op, &s).map_err(ctx("allreduce"))?;
    // In place, with another op.
    let op = CommOp::AllReduce {
        send: BufRef::new(x.clone()),
        recv: BufRef::new(x.clone()),
        count: 3,
        dtype: NcclDataType::Float32,
        op: NcclRedOp::Max,
    };
    comm.enqueue(op, &s).map_err(ctx("in-place allreduce"))?;
    let got = download(dev, &s, &out, 0, 12)?;
    ensure(got == f32_bytes(&values), || format!("allreduce sum gave {:?}", f32s(&got)))?;
    let got = download(dev, &s, &x, 0, 12)?;
    ensure(got == f32_bytes(&values), || format!("in-place allreduce max gave {:?}", f32s(&got)))
}

fn rooted_and_gathering_collectives<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let comm = world_one(dev)?;
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let data = f32_bytes(&[4.0, -1.0, 0.5]);
    let x = upload(dev, &s, &data)?;
    let (f32t, n) = (NcclDataType::Float32, 3);
    let send = || BufRef::new(x.clone());
    let sum = NcclRedOp::Sum;
    type MakeOp<'a, B> = Box<dyn Fn(BufRef<B>) -> CommOp<B> + 'a>;
    let outputs: [(&str, MakeOp<'_, D::Buffer>); 4] = [
        ("broadcast", Box::new(|recv| CommOp::Broadcast { send: send(), recv, count: n, dtype: f32t, root: 0 })),
        ("reduce", Box::new(|recv| CommOp::Reduce { send: send(), recv, count: n, dtype: f32t, op: sum, root: 0 })),
        ("allgather", Box::new(|recv| CommOp::AllGather { send: send(), recv, count: n, dtype: f32t })),
        (
            "reduce_scatter",
            Box::new(|recv| CommOp::ReduceScatter { send: send(), recv, count: n, dtype: f32t, op: sum }),
        ),
    ];
    for (name, op) in outputs {
        // Every output lands at offset 4 of a 16-byte buffer.
        let out = dev.alloc(16).map_err(ctx("alloc"))?;
        comm.enqueue(op(BufRef::at(out.clone(), 4)), &s).map_err(ctx(name))?;
        let got = download(dev, &s, &out, 0, 16)?;
        ensure(got[..4] == [0; 4] && got[4..] == data[..], || {
            format!("{name} gave {got:?}, expected 4 zeros then {data:?}")
        })?;
    }
    Ok(())
}

/// NCCL's group semantics: a send to self and the matching receive, in one group, complete.
fn send_and_recv_to_self_in_a_group<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let comm = world_one(dev)?;
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let data = f32_bytes(&[7.0, 8.0, 9.0]);
    let x = upload(dev, &s, &data)?;
    let y = dev.alloc(12).map_err(ctx("alloc"))?;
    comm.group_start().map_err(ctx("group_start"))?;
    let f32t = NcclDataType::Float32;
    comm.enqueue(CommOp::Send { buf: BufRef::new(x), count: 3, dtype: f32t, peer: 0 }, &s).map_err(ctx("send"))?;
    comm.enqueue(CommOp::Recv { buf: BufRef::new(y.clone()), count: 3, dtype: f32t, peer: 0 }, &s)
        .map_err(ctx("recv"))?;
    comm.group_end().map_err(ctx("group_end"))?;
    let got = download(dev, &s, &y, 0, 12)?;
    ensure(got == data, || format!("send/recv to self gave {:?}", f32s(&got)))
}

/// PyTorch sends bool as uint8 and sums it with ncclMax (so two trues give 1, not 2).
fn bool_sum_travels_as_uint8_max<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let op = nccl_op(ReduceOp::Sum, DType::Bool).map_err(ctx("nccl_op"))?;
    let dtype = nccl_dtype(DType::Bool);
    ensure(op == NcclRedOp::Max && dtype == NcclDataType::Uint8, || format!("bool sum maps to {op:?} on {dtype:?}"))?;
    let comm = world_one(dev)?;
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let x = upload(dev, &s, &[1, 0, 1])?;
    let op = CommOp::AllReduce { send: BufRef::new(x.clone()), recv: BufRef::new(x.clone()), count: 3, dtype, op };
    comm.enqueue(op, &s).map_err(ctx("allreduce"))?;
    let got = download(dev, &s, &x, 0, 3)?;
    ensure(got == [1, 0, 1], || format!("bool allreduce gave {got:?}"))
}

/// ncclCommAbort from another thread with a collective queued behind a held stream: every
/// call is refused at once, but the abort itself returns only once the stream goes on, because
/// it synchronizes NCCL's internal streams, which wait on this one (NCCL 2.28.9 on an H200
/// waited like this). Then the stream moves on.
fn abort_refuses_calls_at_once_and_returns_once_a_held_stream_goes_on<D: Device>(
    dev: &D,
    blocker: &dyn StreamBlocker<D>,
) -> Result<(), String> {
    let comm = Arc::new(world_one(dev)?);
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let x = upload(dev, &s, &f32_bytes(&[1.0, 2.0]))?;
    let after = dev.new_event(false).map_err(ctx("new_event"))?;
    let held = Held::block(blocker, dev, &s)?;
    let op = CommOp::AllReduce {
        send: BufRef::new(x.clone()),
        recv: BufRef::new(x.clone()),
        count: 2,
        dtype: NcclDataType::Float32,
        op: NcclRedOp::Sum,
    };
    comm.enqueue(op.clone(), &s).map_err(ctx("allreduce behind the held stream"))?;
    dev.record(&after, &s).map_err(ctx("record"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    let aborter = comm.clone();
    std::thread::spawn(move || {
        aborter.abort();
        let _ = tx.send(());
    });
    let deadline = Instant::now() + Duration::from_secs(2);
    while !comm.is_aborted() {
        ensure(Instant::now() < deadline, || "is_aborted is still false 2 s after abort was called".to_owned())?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let refused_at = Instant::now();
    match comm.enqueue(op, &s) {
        Err(NcclError::Aborted) => {}
        other => return Err(format!("enqueue during the abort gave {other:?}, expected Err(Aborted)")),
    }
    ensure(matches!(comm.async_error(), Err(NcclError::Aborted)), || {
        "async_error during the abort is not Err(Aborted)".to_owned()
    })?;
    ensure(refused_at.elapsed() < Duration::from_millis(500), || {
        format!("calls during the abort took {:?} to be refused", refused_at.elapsed())
    })?;
    match rx.recv_timeout(Duration::from_millis(300)) {
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        _ => return Err("abort returned while the stream it waits on was still held".to_owned()),
    }
    held.release();
    rx.recv_timeout(WAIT_LIMIT)
        .map_err(|_| format!("abort did not return within {WAIT_LIMIT:?} of the stream's release"))?;
    wait_event(dev, &after, "the stream after the aborted collective")
}

fn split_gives_a_working_communicator<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let comm = world_one(dev)?;
    let child = comm.split(Some(0), 0).map_err(ctx("split"))?.ok_or("split with a color gave no communicator")?;
    wait_ready(&child, "the split communicator")?;
    ensure(child.rank() == 0 && child.world_size() == 1, || {
        format!("the split gave rank {} of {}", child.rank(), child.world_size())
    })?;
    check_allreduce(dev, &child, "allreduce on the split communicator")?;
    match comm.split(None, 0) {
        Ok(None) => Ok(()),
        Ok(Some(_)) => Err("split without a color gave a communicator".to_owned()),
        Err(e) => Err(format!("split without a color: {e}")),
    }
}

/// ncclCommShrink exists from NCCL 2.27: it works there and is refused by version below.
fn shrink_works_or_is_refused_by_version<D: Device>(dev: &D, _: &dyn StreamBlocker<D>) -> Result<(), String> {
    let version = dev.nccl_version().map_err(ctx("nccl_version"))?;
    ensure(version / 10_000 == 2, || format!("NCCL version {} is not 2.x", version_text(version)))?;
    let comm = world_one(dev)?;
    let shrunk = comm.shrink(&[]);
    if version >= nccl_version_code(2, 27, 0) {
        let small = shrunk.map_err(ctx("shrink on NCCL >= 2.27"))?;
        wait_ready(&small, "the shrunk communicator")?;
        ensure(small.world_size() == 1, || format!("shrink kept {} ranks of 1", small.world_size()))?;
        check_allreduce(dev, &small, "allreduce on the shrunk communicator")
    } else {
        match shrunk {
            Err(NcclError::NeedsVersion { .. }) => Ok(()),
            other => Err(format!("shrink on NCCL {} gave {other:?}, expected NeedsVersion", version_text(version))),
        }
    }
}

// ---- helpers ---------------------------------------------------------------------------------

const WAIT_LIMIT: Duration = Duration::from_secs(10);

/// Releases a blocked stream when the case is done with it, also on an early return.
struct Held<'a, D: Device> {
    blocker: &'a dyn StreamBlocker<D>,
}

impl<'a, D: Device> Held<'a, D> {
    fn block(blocker: &'a dyn StreamBlocker<D>, dev: &D, stream: &D::Stream) -> Result<Self, String> {
        blocker.block(dev, stream).map_err(ctx("block the stream"))?;
        Ok(Held { blocker })
    }

    fn release(self) {}
}

impl<D: Device> Drop for Held<'_, D> {
    fn drop(&mut self) {
        self.blocker.release();
    }
}

fn ctx(what: &str) -> impl FnOnce(NcclError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn ensure(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(why()) }
}

/// The call must be refused: an error, not a value.
fn refused<T: std::fmt::Debug>(r: Result<T, NcclError>, what: &str) -> Result<(), String> {
    match r {
        Err(_) => Ok(()),
        Ok(v) => Err(format!("{what} gave {v:?} instead of an error")),
    }
}

/// Waits (up to 10 s) for `ev` to complete; a query error fails at once.
fn wait_event<D: Device>(dev: &D, ev: &D::Event, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + WAIT_LIMIT;
    loop {
        match dev.query(ev) {
            Ok(true) => return Ok(()),
            Ok(false) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(false) => return Err(format!("{what}: not complete after {WAIT_LIMIT:?}")),
            Err(e) => return Err(format!("{what}: query failed: {e}")),
        }
    }
}

/// `ev` must stay pending (checked for 50 ms).
fn stays_pending<D: Device>(dev: &D, ev: &D::Event, what: &str) -> Result<(), String> {
    let until = Instant::now() + Duration::from_millis(50);
    while Instant::now() < until {
        if dev.query(ev).map_err(ctx(what))? {
            return Err(format!("{what}: completed, but the stream is blocked"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// A non-blocking world of one, ready.
fn world_one<D: Device>(dev: &D) -> Result<D::Comm, String> {
    let id = dev.unique_id().map_err(ctx("unique_id"))?;
    let comm = dev.init_comm(&id, 1, 0, CommConfig { blocking: false }).map_err(ctx("init_comm"))?;
    wait_ready(&comm, "non-blocking init")?;
    Ok(comm)
}

/// Polls `async_error` (up to 10 s) until it leaves `InProgress`; it must become `Success`.
fn wait_ready<C: Communicator>(comm: &C, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + WAIT_LIMIT;
    loop {
        match comm.async_error().map_err(ctx(what))? {
            NcclResult::Success => return Ok(()),
            NcclResult::InProgress if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            NcclResult::InProgress => return Err(format!("{what}: still in progress after {WAIT_LIMIT:?}")),
            other => return Err(format!("{what}: async error {other}")),
        }
    }
}

/// An allreduce on `comm` (a world of one) gives back its input.
fn check_allreduce<D: Device>(dev: &D, comm: &D::Comm, what: &str) -> Result<(), String> {
    let s = dev.new_stream().map_err(ctx("new_stream"))?;
    let data = f32_bytes(&[3.0, 5.0]);
    let x = upload(dev, &s, &data)?;
    let op = CommOp::AllReduce {
        send: BufRef::new(x.clone()),
        recv: BufRef::new(x.clone()),
        count: 2,
        dtype: NcclDataType::Float32,
        op: NcclRedOp::Sum,
    };
    comm.enqueue(op, &s).map_err(ctx(what))?;
    let got = download(dev, &s, &x, 0, 8)?;
    ensure(got == data, || format!("{what} gave {:?}", f32s(&got)))
}

fn upload<D: Device>(dev: &D, s: &D::Stream, bytes: &[u8]) -> Result<D::Buffer, String> {
    let buf = dev.alloc(bytes.len()).map_err(ctx("alloc"))?;
    dev.copy_to_device(s, bytes, &buf, 0).map_err(ctx("copy_to_device"))?;
    Ok(buf)
}

/// `len` bytes of `buf` from `offset`, read in stream order after everything enqueued so far.
fn download<D: Device>(dev: &D, s: &D::Stream, buf: &D::Buffer, offset: usize, len: usize) -> Result<Vec<u8>, String> {
    let host = HostBuffer::new(len);
    dev.copy_to_host(s, buf, offset, &host).map_err(ctx("copy_to_host"))?;
    dev.synchronize(s).map_err(ctx("synchronize"))?;
    Ok(host.to_vec())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
