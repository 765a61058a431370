//! The emulation's own tests: the conformance suite on it, and multi-rank behaviour (numbers,
//! grouping, matching, hangs, aborts, every fault, split and shrink) over both fabrics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;

use super::*;
use crate::nccl::conformance::{self, StreamBlocker};
use crate::nccl::device::{BufRef, CommOp, Communicator, NcclDataType, NcclRedOp, NcclResult};
use crate::store::{MemoryStore, Store, TcpStore, TcpStoreConfig, TcpStoreServer, TcpStoreServerConfig};

// ---- the conformance suite -------------------------------------------------------------------

/// Blocks emulated streams with [`EmuDevice::block_stream`].
#[derive(Default)]
struct EmuBlocker {
    gates: Mutex<Vec<StreamGate>>,
}

impl StreamBlocker<EmuDevice> for EmuBlocker {
    fn block(&self, dev: &EmuDevice, stream: &EmuStream) -> Result<(), NcclError> {
        let gate = dev.block_stream(stream)?;
        self.gates.lock().unwrap().push(gate);
        Ok(())
    }

    fn release(&self) {
        for gate in self.gates.lock().unwrap().drain(..) {
            gate.release();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn run_conformance(nccl_version: u32) {
    let rt = runtime();
    let mut cfg = EmuConfig::new(rt.handle().clone(), MemFabric::new());
    cfg.nccl_version = nccl_version;
    let dev = EmuDevice::new(cfg);
    let results = conformance::run_all(&dev, &EmuBlocker::default());
    assert!(results.len() >= 14, "the suite ran {} cases", results.len());
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
    assert!(failed.is_empty(), "conformance cases failed on the emulation: {failed:?}");
}

#[test]
fn conformance_suite_passes_on_the_emulation() {
    run_conformance(nccl_version_code(2, 28, 3));
}

#[test]
fn conformance_suite_passes_on_an_emulated_nccl_without_shrink() {
    run_conformance(nccl_version_code(2, 26, 5));
}

// ---- helpers ---------------------------------------------------------------------------------

/// One emulated rank: its device, communicator and a stream.
struct Rank {
    dev: EmuDevice,
    comm: EmuComm,
    s: EmuStream,
}

fn device(fabric: Arc<dyn Fabric>, ordinal: usize) -> EmuDevice {
    let mut cfg = EmuConfig::new(Handle::current(), fabric);
    cfg.ordinal = ordinal;
    cfg.seed = 11;
    EmuDevice::new(cfg)
}

/// `fabrics.len()` ranks, each with its own device over its fabric, non-blocking and ready.
async fn world_on(fabrics: Vec<Arc<dyn Fabric>>) -> Vec<Rank> {
    let n = fabrics.len() as u32;
    let devs: Vec<EmuDevice> = fabrics.into_iter().enumerate().map(|(r, f)| device(f, r)).collect();
    let id = devs[0].unique_id().unwrap();
    let mut ranks = Vec::new();
    for (r, dev) in devs.into_iter().enumerate() {
        let comm = dev.init_comm(&id, n, r as u32, CommConfig { blocking: false }).unwrap();
        let s = dev.new_stream().unwrap();
        ranks.push(Rank { dev, comm, s });
    }
    for r in &ranks {
        ready(&r.comm).await;
    }
    ranks
}

async fn world(n: u32) -> Vec<Rank> {
    let fabric: Arc<dyn Fabric> = MemFabric::new();
    world_on(vec![fabric; n as usize]).await
}

/// Waits (up to 5 s) for a non-blocking init, split or shrink to finish.
async fn ready(comm: &EmuComm) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match comm.async_error().unwrap() {
            NcclResult::Success => return,
            NcclResult::InProgress if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(1)).await,
            other => panic!("communicator {} is {other}", comm.id()),
        }
    }
}

/// Whether `ev` completes within `limit` (polled every millisecond).
async fn completes(dev: &EmuDevice, ev: &EmuEvent, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if dev.query(ev).unwrap() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// An event recorded now on `r`'s stream.
fn mark(r: &Rank) -> EmuEvent {
    let ev = r.dev.new_event(true).unwrap();
    r.dev.record(&ev, &r.s).unwrap();
    ev
}

fn put(r: &Rank, bytes: &[u8]) -> EmuBuffer {
    let buf = r.dev.alloc(bytes.len()).unwrap();
    r.dev.copy_to_device(&r.s, bytes, &buf, 0).unwrap();
    buf
}

/// `buf`'s bytes once `r`'s stream got past everything enqueued so far.
async fn get(r: &Rank, buf: &EmuBuffer) -> Vec<u8> {
    let host = HostBuffer::new(buf.len());
    r.dev.copy_to_host(&r.s, buf, 0, &host).unwrap();
    let ev = mark(r);
    assert!(completes(&r.dev, &ev, Duration::from_secs(5)).await, "the stream did not get there");
    host.to_vec()
}

fn f32b(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn i64b(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn allreduce(buf: &EmuBuffer, count: usize, dtype: NcclDataType, op: NcclRedOp) -> CommOp<EmuBuffer> {
    CommOp::AllReduce { send: BufRef::new(buf.clone()), recv: BufRef::new(buf.clone()), count, dtype, op }
}

fn f32_sum(buf: &EmuBuffer, count: usize) -> CommOp<EmuBuffer> {
    allreduce(buf, count, NcclDataType::Float32, NcclRedOp::Sum)
}

// ---- collectives -----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_sum_avg_max_on_f32_and_i64_across_four_ranks() {
    let ranks = world(4).await;
    let mut bufs = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let x = r as f32;
        let i = r as i64;
        let mut mine = Vec::new();
        for op in [NcclRedOp::Sum, NcclRedOp::Avg, NcclRedOp::Max] {
            let f = put(rank, &f32b(&[x + 1.0, x * 0.5]));
            rank.comm.enqueue(allreduce(&f, 2, NcclDataType::Float32, op), &rank.s).unwrap();
            let l = put(rank, &i64b(&[i * 10 - 5, (1 << 40) + i]));
            rank.comm.enqueue(allreduce(&l, 2, NcclDataType::Int64, op), &rank.s).unwrap();
            mine.push((f, l));
        }
        bufs.push(mine);
    }
    for (rank, mine) in ranks.iter().zip(&bufs) {
        let mut got = Vec::new();
        for (f, l) in mine {
            got.push((f32s(&get(rank, f).await), i64s(&get(rank, l).await)));
        }
        assert_eq!(
            got,
            vec![
                (vec![10.0, 3.0], vec![40, (4 << 40) + 6]),
                (vec![2.5, 0.75], vec![10, (1 << 40) + 1]),
                (vec![4.0, 1.5], vec![25, (1 << 40) + 3]),
            ]
        );
    }
}

/// Broadcast (root 2), reduce (root 1: the others' output untouched), allgather, reduce-scatter.
async fn every_collective_computes(ranks: &[Rank]) {
    let n = ranks.len();
    let sentinel = f32b(&[-9.0, -9.0]);
    let mut outs = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let x = r as f32;
        let mine = put(rank, &f32b(&[x, 10.0 + x]));
        let bcast = put(rank, &f32b(&[0.0, 0.0]));
        let reduced = put(rank, &sentinel);
        let gathered = rank.dev.alloc(8 * n).unwrap();
        let scatter_in = put(rank, &f32b(&(0..2 * n).map(|i| (i * (r + 1)) as f32).collect::<Vec<_>>()));
        let scattered = rank.dev.alloc(8).unwrap();
        let f = NcclDataType::Float32;
        let ops = [
            CommOp::Broadcast {
                send: BufRef::new(mine.clone()),
                recv: BufRef::new(bcast.clone()),
                count: 2,
                dtype: f,
                root: 2,
            },
            CommOp::Reduce {
                send: BufRef::new(mine.clone()),
                recv: BufRef::new(reduced.clone()),
                count: 2,
                dtype: f,
                op: NcclRedOp::Sum,
                root: 1,
            },
            CommOp::AllGather {
                send: BufRef::new(mine.clone()),
                recv: BufRef::new(gathered.clone()),
                count: 2,
                dtype: f,
            },
            CommOp::ReduceScatter {
                send: BufRef::new(scatter_in),
                recv: BufRef::new(scattered.clone()),
                count: 2,
                dtype: f,
                op: NcclRedOp::Max,
            },
        ];
        for op in ops {
            rank.comm.enqueue(op, &rank.s).unwrap();
        }
        outs.push((bcast, reduced, gathered, scattered));
    }
    let sum: f32 = (0..n).map(|r| r as f32).sum();
    for (r, (rank, (bcast, reduced, gathered, scattered))) in ranks.iter().zip(&outs).enumerate() {
        assert_eq!(f32s(&get(rank, bcast).await), [2.0, 12.0], "rank {r} broadcast");
        let want = if r == 1 { f32b(&[sum, 10.0 * n as f32 + sum]) } else { sentinel.clone() };
        assert_eq!(get(rank, reduced).await, want, "rank {r} reduce");
        let all: Vec<f32> = (0..n).flat_map(|q| [q as f32, 10.0 + q as f32]).collect();
        assert_eq!(f32s(&get(rank, gathered).await), all, "rank {r} allgather");
        // Block r of element i * (q + 1), maxed over q: i * n.
        let block: Vec<f32> = (2 * r..2 * r + 2).map(|i| (i * n) as f32).collect();
        assert_eq!(f32s(&get(rank, scattered).await), block, "rank {r} reduce-scatter");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_computes_over_the_memory_fabric() {
    every_collective_computes(&world(4).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_computes_over_a_store_fabric() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let fabric: Arc<dyn Fabric> = StoreFabric::new(store.clone());
    let ranks = world_on(vec![fabric; 3]).await;
    every_collective_computes(&ranks).await;
    // Init and four collectives: every exchange cleaned up after itself.
    assert_eq!(store.num_keys().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_computes_over_a_tcp_store_one_client_per_rank() {
    let server =
        TcpStoreServer::bind(crate::TokioNet, TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap())).await.unwrap();
    let mut fabrics: Vec<Arc<dyn Fabric>> = Vec::new();
    for _ in 0..3 {
        let cfg = TcpStoreConfig::new("127.0.0.1", server.port()).with_timeout(Duration::from_secs(10));
        fabrics.push(StoreFabric::new(Arc::new(TcpStore::connect(cfg).await.unwrap())));
    }
    let ranks = world_on(fabrics).await;
    every_collective_computes(&ranks).await;
    drop(ranks);
    server.shutdown().await;
}

// ---- point to point --------------------------------------------------------------------------

/// Rank `r` sends `r + p + 1` values to `p` (itself included), all sends listed before all
/// receives: outside a group the first sends would wait for receives never posted.
async fn grouped_all_to_all(ranks: &[Rank]) {
    let n = ranks.len();
    let value = |from: usize, to: usize, i: usize| (from * 100 + to * 10 + i) as f32;
    let mut inboxes = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        rank.comm.group_start().unwrap();
        for p in 0..n {
            let data: Vec<f32> = (0..r + p + 1).map(|i| value(r, p, i)).collect();
            let buf = put(rank, &f32b(&data));
            let op =
                CommOp::Send { buf: BufRef::new(buf), count: data.len(), dtype: NcclDataType::Float32, peer: p as u32 };
            rank.comm.enqueue(op, &rank.s).unwrap();
        }
        let mut inbox = Vec::new();
        for p in 0..n {
            let buf = rank.dev.alloc(4 * (r + p + 1)).unwrap();
            let op = CommOp::Recv {
                buf: BufRef::new(buf.clone()),
                count: r + p + 1,
                dtype: NcclDataType::Float32,
                peer: p as u32,
            };
            rank.comm.enqueue(op, &rank.s).unwrap();
            inbox.push(buf);
        }
        rank.comm.group_end().unwrap();
        inboxes.push(inbox);
    }
    for (r, (rank, inbox)) in ranks.iter().zip(&inboxes).enumerate() {
        for (p, buf) in inbox.iter().enumerate() {
            let want: Vec<f32> = (0..r + p + 1).map(|i| value(p, r, i)).collect();
            assert_eq!(f32s(&get(rank, buf).await), want, "rank {r} from {p}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_all_to_all_with_uneven_sizes_does_not_deadlock() {
    grouped_all_to_all(&world(3).await).await;
    let fabric: Arc<dyn Fabric> = StoreFabric::new(Arc::new(MemoryStore::new()));
    grouped_all_to_all(&world_on(vec![fabric; 3]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_matches_first_in_first_out() {
    for fabric in [MemFabric::new() as Arc<dyn Fabric>, StoreFabric::new(Arc::new(MemoryStore::new()))] {
        let ranks = world_on(vec![fabric; 2]).await;
        let (a, b) = (&ranks[0], &ranks[1]);
        let f = NcclDataType::Float32;
        // Three separate launches each way, then two sends in one group.
        let mut inbox = Vec::new();
        for i in 0..3 {
            let buf = put(a, &f32b(&[i as f32]));
            a.comm.enqueue(CommOp::Send { buf: BufRef::new(buf), count: 1, dtype: f, peer: 1 }, &a.s).unwrap();
        }
        a.comm.group_start().unwrap();
        for i in 3..5 {
            let buf = put(a, &f32b(&[i as f32]));
            a.comm.enqueue(CommOp::Send { buf: BufRef::new(buf), count: 1, dtype: f, peer: 1 }, &a.s).unwrap();
        }
        a.comm.group_end().unwrap();
        for _ in 0..3 {
            let buf = b.dev.alloc(4).unwrap();
            b.comm.enqueue(CommOp::Recv { buf: BufRef::new(buf.clone()), count: 1, dtype: f, peer: 0 }, &b.s).unwrap();
            inbox.push(buf);
        }
        b.comm.group_start().unwrap();
        for _ in 3..5 {
            let buf = b.dev.alloc(4).unwrap();
            b.comm.enqueue(CommOp::Recv { buf: BufRef::new(buf.clone()), count: 1, dtype: f, peer: 0 }, &b.s).unwrap();
            inbox.push(buf);
        }
        b.comm.group_end().unwrap();
        let mut got = Vec::new();
        for buf in &inbox {
            got.extend(f32s(&get(b, buf).await));
        }
        assert_eq!(got, [0.0, 1.0, 2.0, 3.0, 4.0]);
        assert!(completes(&a.dev, &mark(a), Duration::from_secs(5)).await, "every send completed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_of_another_size_is_invalid_usage() {
    let ranks = world(2).await;
    let (a, b) = (&ranks[0], &ranks[1]);
    let f = NcclDataType::Float32;
    a.comm.enqueue(CommOp::Send { buf: BufRef::new(put(a, &[0; 8])), count: 2, dtype: f, peer: 1 }, &a.s).unwrap();
    let small = b.dev.alloc(4).unwrap();
    b.comm.enqueue(CommOp::Recv { buf: BufRef::new(small.clone()), count: 1, dtype: f, peer: 0 }, &b.s).unwrap();
    let done = mark(b);
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.comm.async_error().unwrap() != NcclResult::InvalidUsage && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(b.comm.async_error().unwrap(), NcclResult::InvalidUsage);
    assert!(!completes(&b.dev, &done, Duration::from_millis(50)).await, "the kernel stops there until an abort");
    b.comm.abort();
    assert!(completes(&b.dev, &done, Duration::from_secs(2)).await);
}

// ---- hangs and aborts ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_collectives_hang() {
    let ranks = world(2).await;
    let mut evs = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let buf = put(rank, &[0; 16]);
        let op = if r == 0 { NcclRedOp::Sum } else { NcclRedOp::Max };
        rank.comm.enqueue(allreduce(&buf, 4, NcclDataType::Float32, op), &rank.s).unwrap();
        evs.push(mark(rank));
    }
    for (rank, ev) in ranks.iter().zip(&evs) {
        assert!(!completes(&rank.dev, ev, Duration::from_millis(200)).await, "a desynced collective must hang");
    }
    // Counts that differ hang too (a fresh pair of communicators).
    let ranks = world(2).await;
    let mut evs = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let buf = put(rank, &[0; 16]);
        rank.comm.enqueue(f32_sum(&buf, 3 + r), &rank.s).unwrap();
        evs.push(mark(rank));
    }
    for (rank, ev) in ranks.iter().zip(&evs) {
        assert!(!completes(&rank.dev, ev, Duration::from_millis(100)).await);
    }
    for rank in &ranks {
        rank.comm.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_ends_this_ranks_pending_kernel_while_the_peers_stays_pending() {
    let ranks = world(3).await;
    let mut evs = Vec::new();
    let mut bufs = Vec::new();
    for rank in &ranks[..2] {
        let buf = put(rank, &f32b(&[1.0]));
        rank.comm.enqueue(f32_sum(&buf, 1), &rank.s).unwrap();
        evs.push(mark(rank));
        bufs.push(buf);
    }
    assert!(!completes(&ranks[0].dev, &evs[0], Duration::from_millis(50)).await, "rank 2 has not called");
    let started = std::time::Instant::now();
    ranks[0].comm.abort();
    ranks[0].comm.abort();
    assert!(started.elapsed() < Duration::from_secs(1), "abort returns at once");
    assert!(completes(&ranks[0].dev, &evs[0], Duration::from_secs(2)).await, "the aborted kernel ends");
    assert_eq!(f32s(&get(&ranks[0], &bufs[0]).await), [1.0], "without data");
    assert!(!completes(&ranks[1].dev, &evs[1], Duration::from_millis(200)).await, "the peer is not told");
    // Rank 2 arrives late: rank 0 took its contribution back, so rank 1 still hangs.
    let late = put(&ranks[2], &f32b(&[1.0]));
    ranks[2].comm.enqueue(f32_sum(&late, 1), &ranks[2].s).unwrap();
    assert!(!completes(&ranks[1].dev, &evs[1], Duration::from_millis(200)).await);
    // Everything after the abort is refused.
    let c = &ranks[0].comm;
    assert!(c.is_aborted());
    assert!(matches!(c.enqueue(f32_sum(&bufs[0], 1), &ranks[0].s), Err(NcclError::Aborted)));
    assert!(matches!(c.async_error(), Err(NcclError::Aborted)));
    assert!(matches!(c.group_start(), Err(NcclError::Aborted)));
    assert!(matches!(c.split(Some(0), 0), Err(NcclError::Aborted)));
    assert!(matches!(c.finalize(), Err(NcclError::Aborted)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_hang_stops_the_device_before_the_start_event_and_holds_abort() {
    let ranks = world(2).await;
    let bufs: Vec<_> = ranks.iter().map(|r| put(r, &f32b(&[1.0]))).collect();
    let before: Vec<_> = ranks.iter().map(mark).collect();
    ranks[0].comm.inject(EmuFault::KernelHang);
    let mut marks = Vec::new();
    for (rank, buf) in ranks.iter().zip(&bufs) {
        let start = mark(rank);
        rank.comm.enqueue(f32_sum(buf, 1), &rank.s).unwrap();
        marks.push((start, mark(rank)));
    }
    let (a, b) = (&ranks[0], &ranks[1]);
    assert!(completes(&a.dev, &before[0], Duration::from_secs(2)).await, "an event recorded before the fault");
    assert!(!completes(&a.dev, &marks[0].0, Duration::from_millis(150)).await, "the start event never fires");
    assert!(!completes(&a.dev, &marks[0].1, Duration::from_millis(10)).await);
    assert!(completes(&b.dev, &marks[1].0, Duration::from_secs(2)).await, "the peer started");
    assert!(!completes(&b.dev, &marks[1].1, Duration::from_millis(50)).await, "and waits for rank 0");
    // The abort ends nothing on a stream a compute kernel holds, and waits for it as
    // ncclCommAbort does: the launch is queued behind the hang for good. Calls are refused at once.
    let (tx, rx) = std::sync::mpsc::channel();
    let comm = a.comm.clone();
    std::thread::spawn(move || {
        comm.abort();
        let _ = tx.send(());
    });
    let started = std::time::Instant::now();
    while !a.comm.is_aborted() {
        assert!(started.elapsed() < Duration::from_secs(2), "abort raised its flag");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(matches!(a.comm.enqueue(f32_sum(&bufs[0], 1), &a.s), Err(NcclError::Aborted)));
    assert!(!completes(&a.dev, &marks[0].1, Duration::from_millis(100)).await, "abort does not free a hung kernel");
    assert!(rx.try_recv().is_err(), "abort waits for the stream the hang holds");

    // Queued behind another fault, it hangs the device right after the launch before it.
    let ranks = world(1).await;
    let r = &ranks[0];
    r.comm.inject(EmuFault::SlowKernel(Duration::from_millis(1)));
    r.comm.inject(EmuFault::KernelHang);
    let buf = put(r, &f32b(&[2.0]));
    r.comm.enqueue(f32_sum(&buf, 1), &r.s).unwrap();
    let first = mark(r);
    assert!(!completes(&r.dev, &first, Duration::from_millis(100)).await, "the hang came right after launch 1");
    // An abort disarms a hang not placed yet.
    let ranks = world(1).await;
    let r = &ranks[0];
    r.comm.inject(EmuFault::KernelHang);
    r.comm.abort();
    assert!(completes(&r.dev, &mark(r), Duration::from_secs(2)).await);
    // hang_stream puts the hang on one given stream, where it is called.
    let s = r.dev.new_stream().unwrap();
    r.dev.hang_stream(&s).unwrap();
    let start = r.dev.new_event(false).unwrap();
    r.dev.record(&start, &s).unwrap();
    assert!(!completes(&r.dev, &start, Duration::from_millis(100)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_error_is_reported_and_its_kernel_hangs_until_abort() {
    let ranks = world(2).await;
    let (a, b) = (&ranks[0], &ranks[1]);
    b.comm.inject(EmuFault::AsyncError(NcclResult::RemoteError));
    let mut evs = Vec::new();
    for rank in &ranks {
        let buf = put(rank, &f32b(&[1.0]));
        rank.comm.enqueue(f32_sum(&buf, 1), &rank.s).unwrap();
        evs.push(mark(rank));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.comm.async_error().unwrap() == NcclResult::Success && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(b.comm.async_error().unwrap(), NcclResult::RemoteError);
    assert_eq!(a.comm.async_error().unwrap(), NcclResult::Success, "the peer only hangs");
    // NCCL's ncclCommEnsureReady: a broken communicator refuses new work with its error.
    let again = put(b, &[0; 4]);
    let e = b.comm.enqueue(f32_sum(&again, 1), &b.s).unwrap_err();
    assert!(matches!(e, NcclError::Nccl { result: NcclResult::RemoteError, .. }), "{e}");
    assert!(!completes(&b.dev, &evs[1], Duration::from_millis(100)).await);
    assert!(!completes(&a.dev, &evs[0], Duration::from_millis(10)).await);
    b.comm.abort();
    assert!(completes(&b.dev, &evs[1], Duration::from_secs(2)).await);
    assert!(!completes(&a.dev, &evs[0], Duration::from_millis(50)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_kernel_completes_late_with_the_right_numbers() {
    let ranks = world(2).await;
    ranks[0].comm.inject(EmuFault::SlowKernel(Duration::from_millis(500)));
    let mut out = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let buf = put(rank, &f32b(&[r as f32 + 1.0]));
        let start = mark(rank);
        rank.comm.enqueue(f32_sum(&buf, 1), &rank.s).unwrap();
        out.push((buf, start, mark(rank)));
    }
    assert!(!completes(&ranks[0].dev, &out[0].2, Duration::from_millis(100)).await, "still sleeping");
    for (rank, (buf, _, end)) in ranks.iter().zip(&out) {
        assert!(completes(&rank.dev, end, Duration::from_secs(5)).await);
        assert_eq!(f32s(&get(rank, buf).await), [3.0]);
        // Counted from the slow rank's start mark, which its stream passed before the sleep
        // began: the peer's own start mark may come later than that (its stream runs apart),
        // so its own marks can be less than the sleep apart. The emulation's events carry one
        // host clock, so marks of two ranks compare.
        let took = rank.dev.elapsed(&out[0].1, end).unwrap();
        assert!(took >= Duration::from_millis(500), "{took:?}: the peer waited for the slow rank too");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_that_blocks_returns_aborted_once_another_thread_aborts() {
    for grouped in [false, true] {
        let ranks = world(1).await;
        let r = &ranks[0];
        r.comm.inject(EmuFault::EnqueueBlocks);
        let (comm, buf) = (r.comm.clone(), put(r, &[0; 4]));
        let stream = r.dev.new_stream().unwrap();
        let call = std::thread::spawn(move || {
            if grouped {
                comm.group_start().unwrap();
                comm.enqueue(f32_sum(&buf, 1), &stream).unwrap();
                comm.group_end()
            } else {
                comm.enqueue(f32_sum(&buf, 1), &stream)
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!call.is_finished(), "the call blocks (grouped: {grouped})");
        r.comm.abort();
        let deadline = Instant::now() + Duration::from_secs(2);
        while !call.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(matches!(call.join().unwrap(), Err(NcclError::Aborted)), "grouped: {grouped}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_hangs_its_peers_and_the_survivors_shrink_without_it() {
    let ranks = world(3).await;
    ranks[2].comm.inject(EmuFault::Dies);
    let mut evs = Vec::new();
    for rank in &ranks {
        let buf = put(rank, &f32b(&[1.0]));
        rank.comm.enqueue(f32_sum(&buf, 1), &rank.s).unwrap();
        evs.push(mark(rank));
    }
    for (rank, ev) in ranks.iter().zip(&evs) {
        assert!(!completes(&rank.dev, ev, Duration::from_millis(150)).await, "nobody finishes with a dead peer");
    }
    // Its later kernels hang too.
    let dead = &ranks[2];
    dead.comm.enqueue(f32_sum(&put(dead, &[0; 4]), 1), &dead.s).unwrap();
    // Survivors: shrink away rank 2 (non-blocking), on fresh streams (the old ones hold the
    // hung collective).
    let mut small = Vec::new();
    for rank in &ranks[..2] {
        let comm = rank.comm.shrink(&[2]).unwrap();
        small.push(Rank { dev: rank.dev.clone(), comm, s: rank.dev.new_stream().unwrap() });
    }
    for (r, rank) in small.iter().enumerate() {
        ready(&rank.comm).await;
        assert_eq!((rank.comm.rank(), rank.comm.world_size()), (r as u32, 2));
    }
    let bufs: Vec<_> = small.iter().map(|r| put(r, &f32b(&[r.comm.rank() as f32 + 1.0]))).collect();
    for (rank, buf) in small.iter().zip(&bufs) {
        rank.comm.enqueue(f32_sum(buf, 1), &rank.s).unwrap();
    }
    for (rank, buf) in small.iter().zip(&bufs) {
        assert_eq!(f32s(&get(rank, buf).await), [3.0]);
    }
    // Excluding oneself, or a rank that does not exist, is refused.
    for bad in [&[0u32][..], &[7]] {
        let e = ranks[0].comm.shrink(bad).unwrap_err();
        assert!(matches!(e, NcclError::Nccl { call: "ncclCommShrink", result: NcclResult::InvalidArgument }), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_is_refused_below_nccl_2_27() {
    let mut cfg = EmuConfig::new(Handle::current(), MemFabric::new());
    cfg.nccl_version = nccl_version_code(2, 26, 5);
    let dev = EmuDevice::new(cfg);
    assert_eq!(dev.nccl_version().unwrap(), 22605);
    let comm = dev.init_comm(&dev.unique_id().unwrap(), 1, 0, CommConfig { blocking: false }).unwrap();
    ready(&comm).await;
    let e = comm.shrink(&[]).unwrap_err();
    assert!(matches!(e, NcclError::NeedsVersion { .. }), "{e}");
    assert_eq!(e.to_string(), "ncclCommShrink needs NCCL >= 2.27, the loaded library is 2.26.5");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_hang_keeps_init_in_progress_until_abort() {
    // Non-blocking: in progress for good, until aborted.
    let dev = device(MemFabric::new(), 0);
    dev.inject_init_hang();
    let comm = dev.init_comm(&dev.unique_id().unwrap(), 1, 0, CommConfig { blocking: false }).unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(comm.async_error().unwrap(), NcclResult::InProgress);
    let s = dev.new_stream().unwrap();
    let e = comm.enqueue(f32_sum(&dev.alloc(4).unwrap(), 1), &s).unwrap_err();
    assert!(matches!(e, NcclError::Nccl { result: NcclResult::InvalidArgument, .. }), "used before ready: {e}");
    comm.abort();
    assert!(matches!(comm.async_error(), Err(NcclError::Aborted)));
    // The hang was used up: the next init works.
    let comm = dev.init_comm(&dev.unique_id().unwrap(), 1, 0, CommConfig { blocking: false }).unwrap();
    ready(&comm).await;
    // Blocking: both ranks' calls block (the hung rank never joins), on plain threads.
    let fabric = MemFabric::new();
    let (d0, d1) = (device(fabric.clone(), 0), device(fabric, 1));
    d0.inject_init_hang();
    let id = d0.unique_id().unwrap();
    let calls: Vec<_> = [(d0, 0u32), (d1, 1)]
        .into_iter()
        .map(|(d, r)| std::thread::spawn(move || d.init_comm(&id, 2, r, CommConfig { blocking: true }).map(drop)))
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(calls.iter().all(|c| !c.is_finished()), "blocking inits wait for the hung rank");
    // The threads return (with an error) once this test's runtime shuts down.
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_init_returns_once_every_rank_joined() {
    let fabric = MemFabric::new();
    let devs: Vec<_> = (0..3).map(|r| device(fabric.clone(), r)).collect();
    let id = devs[0].unique_id().unwrap();
    let calls: Vec<_> = devs
        .into_iter()
        .enumerate()
        .map(|(r, d)| std::thread::spawn(move || d.init_comm(&id, 3, r as u32, CommConfig { blocking: true })))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !calls.iter().all(|c| c.is_finished()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for (r, call) in calls.into_iter().enumerate() {
        let comm = call.join().unwrap().unwrap();
        assert_eq!(comm.async_error().unwrap(), NcclResult::Success);
        assert_eq!((comm.rank(), comm.world_size()), (r as u32, 3));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_error_is_sticky_and_never_reads_as_not_ready() {
    let ranks = world(2).await;
    let a = &ranks[0];
    let buf = put(a, &f32b(&[1.0]));
    a.comm.enqueue(f32_sum(&buf, 1), &a.s).unwrap();
    let ev = mark(a);
    assert!(!a.dev.query(&ev).unwrap(), "pending: rank 1 has not called");
    // A thread blocked in synchronize is woken by the error.
    let (dev, s) = (a.dev.clone(), a.dev.new_stream().unwrap());
    let _gate = a.dev.block_stream(&s).unwrap();
    let sync = std::thread::spawn(move || dev.synchronize(&s));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!sync.is_finished());
    a.dev.inject_device_error(700, "cudaErrorIllegalAddress");
    a.dev.inject_device_error(1, "a later error does not replace the first");
    let e = a.dev.query(&ev).unwrap_err();
    assert!(matches!(&e, NcclError::Cuda { call: "cudaEventQuery", code: 700, .. }), "{e}");
    assert!(e.to_string().contains("cudaErrorIllegalAddress"), "{e}");
    assert!(a.dev.record(&ev, &a.s).is_err());
    assert!(a.dev.elapsed(&ev, &ev).is_err());
    assert!(a.dev.synchronize(&a.s).is_err());
    assert!(a.dev.new_stream().is_err());
    assert!(a.dev.alloc(4).is_err());
    assert_eq!(a.comm.async_error().unwrap(), NcclResult::UnhandledCudaError);
    let e = a.comm.enqueue(f32_sum(&buf, 1), &a.s).unwrap_err();
    assert!(matches!(e, NcclError::Nccl { result: NcclResult::UnhandledCudaError, .. }), "{e}");
    let deadline = Instant::now() + Duration::from_secs(2);
    while !sync.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(matches!(sync.join().unwrap(), Err(NcclError::Cuda { code: 700, .. })));
    // The other rank's device is fine.
    assert!(ranks[1].dev.query(&mark(&ranks[1])).is_ok());
}

// ---- split, finalize, arguments ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_into_colors_computes_separately_in_key_order() {
    let ranks = world(4).await;
    // Colors: 0 for ranks 0 and 2 (keys 3 and 1: rank 2 comes first), 1 for rank 1, none for 3.
    let mut children = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let color = if r == 3 { None } else { Some(r as u32 % 2) };
        let child = rank.comm.split(color, 3 - r as u32).unwrap();
        assert_eq!(child.is_some(), color.is_some());
        if let Some(comm) = child {
            children.push((r, Rank { dev: rank.dev.clone(), comm, s: rank.dev.new_stream().unwrap() }));
        }
    }
    let mut gathered = Vec::new();
    for (r, child) in &children {
        ready(&child.comm).await;
        let want = match r {
            0 => (1, 2),
            1 => (0, 1),
            _ => (0, 2),
        };
        assert_eq!((child.comm.rank(), child.comm.world_size()), want, "parent rank {r}");
        let mine = put(child, &f32b(&[*r as f32 + 1.0]));
        let all = child.dev.alloc(4 * child.comm.world_size() as usize).unwrap();
        let op = CommOp::AllGather {
            send: BufRef::new(mine),
            recv: BufRef::new(all.clone()),
            count: 1,
            dtype: NcclDataType::Float32,
        };
        child.comm.enqueue(op, &child.s).unwrap();
        gathered.push(all);
    }
    let mut got = Vec::new();
    for ((_, child), all) in children.iter().zip(&gathered) {
        got.push(f32s(&get(child, all).await));
    }
    // In each child's rank order: color 0 is [parent 2, parent 0].
    assert_eq!(got, vec![vec![3.0, 1.0], vec![2.0], vec![3.0, 1.0]]);
    // The parent still works.
    let bufs: Vec<_> = ranks.iter().map(|r| put(r, &f32b(&[1.0]))).collect();
    for (rank, buf) in ranks.iter().zip(&bufs) {
        rank.comm.enqueue(f32_sum(buf, 1), &rank.s).unwrap();
    }
    for (rank, buf) in ranks.iter().zip(&bufs) {
        assert_eq!(f32s(&get(rank, buf).await), [4.0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_refuses_new_work_and_reports_in_progress_until_drained() {
    let ranks = world(2).await;
    let (a, b) = (&ranks[0], &ranks[1]);
    let buf = put(a, &f32b(&[1.0]));
    a.comm.enqueue(f32_sum(&buf, 1), &a.s).unwrap();
    a.comm.finalize().unwrap();
    assert_eq!(a.comm.async_error().unwrap(), NcclResult::InProgress, "its allreduce waits for rank 1");
    let e = a.comm.enqueue(f32_sum(&buf, 1), &a.s).unwrap_err();
    assert!(matches!(e, NcclError::Nccl { result: NcclResult::InvalidUsage, .. }), "{e}");
    let other = put(b, &f32b(&[2.0]));
    b.comm.enqueue(f32_sum(&other, 1), &b.s).unwrap();
    ready(&a.comm).await;
    assert_eq!(f32s(&get(a, &buf).await), [3.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_refused_at_the_call() {
    let ranks = world(2).await;
    let r = &ranks[0];
    let small = r.dev.alloc(8).unwrap();
    let invalid = |e: NcclError| matches!(e, NcclError::Nccl { result: NcclResult::InvalidArgument, .. });
    // Too many elements for the buffer, at an offset, or overflowing.
    assert!(invalid(r.comm.enqueue(f32_sum(&small, 3), &r.s).unwrap_err()));
    let op = CommOp::AllReduce {
        send: BufRef::at(small.clone(), 4),
        recv: BufRef::new(small.clone()),
        count: 2,
        dtype: NcclDataType::Float32,
        op: NcclRedOp::Sum,
    };
    assert!(invalid(r.comm.enqueue(op, &r.s).unwrap_err()));
    assert!(invalid(r.comm.enqueue(f32_sum(&small, usize::MAX), &r.s).unwrap_err()));
    // An allgather needs count × world in its output.
    let op = CommOp::AllGather {
        send: BufRef::new(small.clone()),
        recv: BufRef::new(small.clone()),
        count: 2,
        dtype: NcclDataType::Float32,
    };
    assert!(invalid(r.comm.enqueue(op, &r.s).unwrap_err()));
    // No reduction on types cohort has no kernels for; moving them is fine.
    let u32s = allreduce(&small, 2, NcclDataType::Uint32, NcclRedOp::Sum);
    assert!(invalid(r.comm.enqueue(u32s, &r.s).unwrap_err()));
    // Roots and peers must be ranks.
    let op = CommOp::Broadcast {
        send: BufRef::new(small.clone()),
        recv: BufRef::new(small.clone()),
        count: 2,
        dtype: NcclDataType::Uint32,
        root: 2,
    };
    assert!(invalid(r.comm.enqueue(op, &r.s).unwrap_err()));
    let op = CommOp::Send { buf: BufRef::new(small.clone()), count: 1, dtype: NcclDataType::Float32, peer: 5 };
    assert!(invalid(r.comm.enqueue(op, &r.s).unwrap_err()));
    // Group end without start; bad init ranks.
    let e = r.comm.group_end().unwrap_err();
    assert!(matches!(e, NcclError::Nccl { call: "ncclGroupEnd", result: NcclResult::InvalidUsage }), "{e}");
    for (world, rank) in [(0, 0), (2, 2)] {
        let e = r.dev.init_comm(&[0; 128], world, rank, CommConfig::default()).unwrap_err();
        assert!(matches!(e, NcclError::Nccl { call: "ncclCommInitRankConfig", result: NcclResult::InvalidArgument }));
    }
    // Uint32 broadcast works across both ranks.
    let mut bufs = Vec::new();
    for (q, rank) in ranks.iter().enumerate() {
        let b = put(rank, &(q as u32 + 7).to_le_bytes());
        let op = CommOp::Broadcast {
            send: BufRef::new(b.clone()),
            recv: BufRef::new(b.clone()),
            count: 1,
            dtype: NcclDataType::Uint32,
            root: 1,
        };
        rank.comm.enqueue(op, &rank.s).unwrap();
        bufs.push(b);
    }
    for (rank, b) in ranks.iter().zip(&bufs) {
        assert_eq!(get(rank, b).await, 8u32.to_le_bytes());
    }
}

#[test]
fn unique_ids_are_reproducible_from_the_seed_and_ordinal() {
    let rt = runtime();
    let make = |seed, ordinal| {
        let mut cfg = EmuConfig::new(rt.handle().clone(), MemFabric::new());
        cfg.seed = seed;
        cfg.ordinal = ordinal;
        EmuDevice::new(cfg)
    };
    let (a, b, c, d) = (make(1, 0), make(1, 0), make(2, 0), make(1, 1));
    let ids = |dev: &EmuDevice| (dev.unique_id().unwrap(), dev.unique_id().unwrap());
    let (a1, a2) = ids(&a);
    assert_eq!((a1, a2), ids(&b));
    assert_ne!(a1, a2);
    assert_ne!(a1, ids(&c).0);
    assert_ne!(a1, ids(&d).0);
}

/// On a current-thread runtime with tokio's clock paused (as inside the simulator), nothing
/// blocks and device time is tokio's time: a 10 s slow kernel takes exactly 10 virtual seconds.
#[tokio::test(start_paused = true)]
async fn runs_on_a_paused_current_thread_runtime_with_tokios_clock() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    for fabric in [MemFabric::new() as Arc<dyn Fabric>, StoreFabric::new(store)] {
        let ranks = world_on(vec![fabric; 2]).await;
        let mut out = Vec::new();
        for (r, rank) in ranks.iter().enumerate() {
            rank.comm.inject(EmuFault::SlowKernel(Duration::from_secs(10)));
            let buf = put(rank, &f32b(&[r as f32]));
            let start = mark(rank);
            rank.comm.enqueue(f32_sum(&buf, 1), &rank.s).unwrap();
            out.push((buf, start, mark(rank)));
        }
        for (rank, (buf, start, end)) in ranks.iter().zip(&out) {
            assert!(completes(&rank.dev, end, Duration::from_secs(60)).await);
            assert_eq!(f32s(&get(rank, buf).await), [1.0]);
            let took = rank.dev.elapsed(start, end).unwrap();
            assert!(took >= Duration::from_secs(10) && took < Duration::from_secs(11), "{took:?}");
        }
    }
}
