//! The NCCL process group's lifecycle on the host emulation: every collective's numbers, and
//! every failure path (timeouts naming the rank, async errors, CUDA errors, aborts that
//! interrupt a blocked enqueue, init that hangs, the monitor), with no GPU.

use std::sync::Arc;
use std::time::Duration;

use cohort_core::group::ErrorHandling;
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Tensor};
use cohort_core::work::{Rank, WorkResult, WorkState};

use super::*;
use crate::nccl::NcclResult;
use crate::nccl::emu::{EmuConfig, EmuDevice, EmuFault, MemFabric};
use crate::store::{MemoryStore, Store};

type Pg = NcclProcessGroup<EmuDevice>;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
}

fn quick() -> NcclOptions {
    NcclOptions {
        timeout: Duration::from_secs(20),
        init_timeout: Duration::from_secs(10),
        status_interval: Duration::from_millis(20),
        heartbeat_timeout: None,
        ..NcclOptions::default()
    }
}

/// `n` ranks in this process: one emulated device each over one shared fabric, one store.
fn world_with(rt: &tokio::runtime::Runtime, n: u32, opts: NcclOptions, store: Arc<dyn Store>) -> Vec<Pg> {
    let fabric = MemFabric::new();
    let _in = rt.enter();
    let mut set = tokio::task::JoinSet::new();
    for r in 0..n {
        let mut cfg = EmuConfig::new(rt.handle().clone(), fabric.clone());
        cfg.ordinal = r as usize;
        cfg.seed = 7;
        let dev = Arc::new(EmuDevice::new(cfg));
        let (store, opts, handle) = (store.clone(), opts.clone(), rt.handle().clone());
        set.spawn(async move { (r, Pg::new(dev, store, "t", r, n, opts, handle).await) });
    }
    let mut pgs: Vec<(u32, Pg)> = rt.block_on(async {
        let mut out = Vec::new();
        while let Some(j) = set.join_next().await {
            let (r, pg) = j.expect("init task");
            out.push((r, pg.expect("init")));
        }
        out
    });
    pgs.sort_by_key(|(r, _)| *r);
    pgs.into_iter().map(|(_, pg)| pg).collect()
}

fn world(rt: &tokio::runtime::Runtime, n: u32, opts: NcclOptions) -> Vec<Pg> {
    world_with(rt, n, opts, Arc::new(MemoryStore::new()))
}

/// Runs `f` on every rank at once, each on its own thread; the results in rank order.
fn each<T: Send>(pgs: &[Pg], f: impl Fn(&Pg) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = pgs.iter().map(|pg| s.spawn(|| f(pg))).collect();
        hs.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

fn host(pg: &Pg, t: &DeviceTensor<EmuDevice>) -> Vec<f64> {
    pg.to_host(t).expect("to host").to_f64s()
}

fn dev(pg: &Pg, dtype: DType, v: &[f64]) -> DeviceTensor<EmuDevice> {
    pg.to_device(&Tensor::from_f64s(dtype, v)).expect("to device")
}

fn emu_comm(pg: &Pg) -> Arc<crate::nccl::emu::EmuComm> {
    pg.comm_handle().expect("the communicator exists")
}

#[test]
fn every_collective_computes_across_four_ranks() {
    let rt = runtime();
    let pgs = world(&rt, 4, quick());
    let out = each(&pgs, |pg| {
        let me = pg.rank().0 as f64;
        let n = 4usize;
        let mut got = Vec::new();
        // allreduce sum and avg
        let t = dev(pg, DType::F32, &[me, 1.0]);
        pg.allreduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        got.push(host(pg, &t));
        let t = dev(pg, DType::F64, &[me]);
        pg.allreduce(&t, ReduceOp::Avg).unwrap().wait().unwrap();
        got.push(host(pg, &t));
        // coalesced
        let a = dev(pg, DType::I64, &[me]);
        let b = dev(pg, DType::I64, &[1.0, 2.0]);
        pg.allreduce_coalesced(&[a.clone(), b.clone()], ReduceOp::Max).unwrap().wait().unwrap();
        got.push([host(pg, &a), host(pg, &b)].concat());
        // broadcast and reduce
        let t = dev(pg, DType::F32, &[me + 10.0]);
        pg.broadcast(&t, 2).unwrap().wait().unwrap();
        got.push(host(pg, &t));
        let t = dev(pg, DType::F32, &[me]);
        pg.reduce(&t, 1, ReduceOp::Sum).unwrap().wait().unwrap();
        got.push(host(pg, &t));
        // allgather (list, tensor, coalesced)
        let input = dev(pg, DType::F32, &[me, -me]);
        let outs: Vec<_> = (0..n).map(|_| pg.zeros(DType::F32, &[2]).unwrap()).collect();
        pg.allgather(&outs, &input).unwrap().wait().unwrap();
        got.push(outs.iter().flat_map(|o| host(pg, o)).collect());
        let whole = pg.zeros(DType::F32, &[8]).unwrap();
        pg.allgather_into_tensor(&whole, &input).unwrap().wait().unwrap();
        got.push(host(pg, &whole));
        let whole2 = pg.zeros(DType::F32, &[8]).unwrap();
        pg.allgather_coalesced(&[(whole2.clone(), input.clone())]).unwrap().wait().unwrap();
        got.push(host(pg, &whole2));
        // reduce_scatter (list and tensor)
        let ins: Vec<_> = (0..n).map(|r| dev(pg, DType::F32, &[r as f64 + me])).collect();
        let o = pg.zeros(DType::F32, &[1]).unwrap();
        pg.reduce_scatter(&o, &ins, ReduceOp::Sum).unwrap().wait().unwrap();
        got.push(host(pg, &o));
        let input = dev(pg, DType::F32, &[0.0, 1.0, 2.0, 3.0]);
        let o = pg.zeros(DType::F32, &[1]).unwrap();
        pg.reduce_scatter_tensor(&o, &input, ReduceOp::Sum).unwrap().wait().unwrap();
        got.push(host(pg, &o));
        // alltoall: even, uneven, lists
        let input = dev(pg, DType::F32, &[me * 10.0, me * 10.0 + 1.0, me * 10.0 + 2.0, me * 10.0 + 3.0]);
        let o = pg.zeros(DType::F32, &[4]).unwrap();
        pg.alltoall_base(&o, &input, None).unwrap().wait().unwrap();
        got.push(host(pg, &o));
        // Uneven: rank r sends r+1 elements to everyone and so receives q+1 from rank q.
        let k = pg.rank().0 as usize + 1;
        let input = dev(pg, DType::F32, &vec![me; 4 * k]);
        let o = pg.zeros(DType::F32, &[1 + 2 + 3 + 4]).unwrap();
        pg.alltoall_base(&o, &input, Some((vec![k; 4], vec![1, 2, 3, 4]))).unwrap().wait().unwrap();
        got.push(host(pg, &o));
        let ins: Vec<_> = (0..n).map(|r| dev(pg, DType::F32, &[me * 10.0 + r as f64])).collect();
        let outs: Vec<_> = (0..n).map(|_| pg.zeros(DType::F32, &[1]).unwrap()).collect();
        pg.alltoall(&outs, &ins).unwrap().wait().unwrap();
        got.push(outs.iter().flat_map(|o| host(pg, o)).collect());
        // gather and scatter onto / from rank 3
        let input = dev(pg, DType::F32, &[me]);
        let outs: Vec<_> =
            if pg.rank().0 == 3 { (0..n).map(|_| pg.zeros(DType::F32, &[1]).unwrap()).collect() } else { Vec::new() };
        pg.gather(&outs, &input, 3).unwrap().wait().unwrap();
        got.push(outs.iter().flat_map(|o| host(pg, o)).collect());
        let ins: Vec<_> = if pg.rank().0 == 3 {
            (0..n).map(|r| dev(pg, DType::F32, &[100.0 + r as f64])).collect()
        } else {
            Vec::new()
        };
        let o = pg.zeros(DType::F32, &[1]).unwrap();
        pg.scatter(&o, &ins, 3).unwrap().wait().unwrap();
        got.push(host(pg, &o));
        // barrier, then a ring of send/recv in one batch
        pg.barrier().unwrap().wait().unwrap();
        let me_u = pg.rank().0;
        let s = dev(pg, DType::I32, &[me]);
        let r = pg.zeros(DType::I32, &[1]).unwrap();
        let works =
            pg.batch_isend_irecv(&[P2pOp::Send(s, (me_u + 1) % 4), P2pOp::Recv(r.clone(), (me_u + 3) % 4)]).unwrap();
        works.iter().for_each(|w| w.wait().unwrap());
        got.push(host(pg, &r));
        // plain send and recv: 0 -> 1
        if me_u == 0 {
            pg.send(&dev(pg, DType::F32, &[42.0]), 1).unwrap().wait().unwrap();
        } else if me_u == 1 {
            let t = pg.zeros(DType::F32, &[1]).unwrap();
            pg.recv(&t, 0).unwrap().wait().unwrap();
            got.push(host(pg, &t));
        }
        got
    });
    for (r, got) in out.iter().enumerate() {
        let me = r as f64;
        assert_eq!(got[0], vec![6.0, 4.0], "allreduce sum on rank {r}");
        assert_eq!(got[1], vec![1.5], "allreduce avg");
        assert_eq!(got[2], vec![3.0, 1.0, 2.0], "coalesced max");
        assert_eq!(got[3], vec![12.0], "broadcast from 2");
        assert_eq!(got[4], if r == 1 { vec![6.0] } else { vec![me] }, "reduce onto 1 leaves the others");
        let gathered = vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0];
        assert_eq!(got[5], gathered, "allgather list");
        assert_eq!(got[6], gathered, "allgather into tensor");
        assert_eq!(got[7], gathered, "allgather coalesced");
        assert_eq!(got[8], vec![4.0 * me + 6.0], "reduce_scatter list");
        assert_eq!(got[9], vec![4.0 * me], "reduce_scatter tensor");
        assert_eq!(got[10], (0..4).map(|q| q as f64 * 10.0 + me).collect::<Vec<_>>(), "alltoall even");
        let uneven: Vec<f64> = (0..4).flat_map(|q| vec![q as f64; q + 1]).collect();
        assert_eq!(got[11], uneven, "alltoall uneven");
        assert_eq!(got[12], (0..4).map(|q| q as f64 * 10.0 + me).collect::<Vec<_>>(), "alltoall lists");
        assert_eq!(got[13], if r == 3 { vec![0.0, 1.0, 2.0, 3.0] } else { vec![] }, "gather");
        assert_eq!(got[14], vec![100.0 + me], "scatter");
        assert_eq!(got[15], vec![((r + 3) % 4) as f64], "ring");
        if r == 1 {
            assert_eq!(got[16], vec![42.0], "send/recv");
        }
    }
    // Every work is in the recorder as a completed nccl collective.
    let dump = cohort_core::recorder::Dump::from_json(&pgs[0].flight_recorder_json()).unwrap();
    assert!(dump.entries.iter().all(|e| e.state == cohort_core::recorder::EntryState::Completed), "{:?}", dump.entries);
    assert!(dump.entries.iter().any(|e| e.profiling_name == "nccl:all_reduce"));
    assert!(dump.entries.iter().any(|e| e.profiling_name == "nccl:send 0->1"));
}

#[test]
fn bool_sum_is_a_logical_or_not_a_count() {
    let rt = runtime();
    let pgs = world(&rt, 3, quick());
    let out = each(&pgs, |pg| {
        let t = pg.to_device(&Tensor::from_bools(&[true, false])).unwrap();
        pg.allreduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        pg.to_host(&t).unwrap().bytes().to_vec()
    });
    assert!(out.iter().all(|b| b == &vec![1u8, 0]), "{out:?}");
}

/// Waits until every work ended or `limit` passed; the results.
fn outcomes(works: &[Work], limit: Duration) -> Vec<Result<(), crate::work::WorkError>> {
    works.iter().map(|w| w.wait_timeout(limit)).collect()
}

#[test]
fn a_hung_kernel_times_out_everywhere_and_the_others_name_its_rank() {
    let rt = runtime();
    let opts = NcclOptions { timeout: Duration::from_millis(600), ..quick() };
    let pgs = world(&rt, 4, opts);
    let results = each(&pgs, |pg| {
        let mut works = Vec::new();
        for seq in 1..=4 {
            if seq == 3 && pg.rank().0 == 2 {
                emu_comm(pg).inject(EmuFault::KernelHang);
            }
            let t = pg.zeros(DType::F32, &[8]).unwrap();
            works.push(pg.allreduce(&t, ReduceOp::Sum).unwrap());
        }
        let res = outcomes(&works, Duration::from_secs(10));
        (res, works[2].state())
    });
    for (r, (res, state)) in results.iter().enumerate() {
        // Rank 2's abort waits for the stream its hung kernel holds, for good (as
        // ncclCommAbort does): the work ends by the watchdog all the same.
        assert_eq!(*state, WorkState::TimedOut, "rank {r}: {res:?}");
        assert!(res[0].is_ok() && res[1].is_ok(), "rank {r}: {res:?}");
        let e = res[2].as_ref().expect_err("seq 3 cannot finish");
        if r != 2 {
            assert_eq!(e.culprit(), Some(Rank(2)), "rank {r}: {e}");
            assert!(e.to_string().contains("timed out"), "rank {r}: {e}");
            assert!(e.to_string().contains("rank(s) [2]"), "rank {r}: {e}");
        }
        assert!(res[3].is_err(), "rank {r}: seq 4 after the failure: {:?}", res[3]);
    }
    assert!(pgs.iter().all(|pg| pg.is_comm_aborted()), "every rank cleans up: aborts its communicator");
}

#[test]
fn an_async_nccl_error_fails_that_rank_and_the_others_learn_its_rank_through_the_store() {
    let rt = runtime();
    let pgs = world(&rt, 3, quick());
    let results = each(&pgs, |pg| {
        if pg.rank().0 == 1 {
            emu_comm(pg).inject(EmuFault::AsyncError(NcclResult::RemoteError));
        }
        let t = pg.zeros(DType::F32, &[4]).unwrap();
        let w = pg.allreduce(&t, ReduceOp::Sum).unwrap();
        (w.wait_timeout(Duration::from_secs(10)), w.state())
    });
    let (e1, s1) = &results[1];
    let e1 = e1.as_ref().unwrap_err();
    assert_eq!(*s1, WorkState::Failed);
    assert!(e1.to_string().contains("ncclCommGetAsyncError"), "{e1}");
    assert!(e1.to_string().contains("remote process exited"), "{e1}");
    for r in [0, 2] {
        let (e, state) = &results[r];
        let e = e.as_ref().unwrap_err();
        assert_eq!(*state, WorkState::Failed, "rank {r}: {e}");
        assert!(matches!(e.to_result(), WorkResult::RemoteError { rank: Rank(1), .. }), "rank {r}: {e}");
        assert_eq!(e.culprit(), Some(Rank(1)), "rank {r}: {e}");
        assert!(e.to_string().contains("learned through the store"), "rank {r}: {e}");
    }
}

#[test]
fn abort_interrupts_an_enqueue_that_blocks() {
    let rt = runtime();
    let pgs = world(&rt, 2, quick());
    let pg = &pgs[0];
    emu_comm(pg).inject(EmuFault::EnqueueBlocks);
    let t = pg.zeros(DType::F32, &[4]).unwrap();
    std::thread::scope(|s| {
        let call = s.spawn(|| pg.allreduce(&t, ReduceOp::Sum));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!call.is_finished(), "the enqueue blocks");
        let started = std::time::Instant::now();
        pg.abort("test abort");
        let work = call.join().unwrap().expect("the work was submitted before the enqueue blocked");
        assert!(started.elapsed() < Duration::from_secs(2));
        let e = work.wait_timeout(Duration::from_secs(5)).unwrap_err();
        assert_eq!(work.state(), WorkState::Aborted, "{e}");
    });
    assert!(pg.is_comm_aborted());
    let e = pg.allreduce(&t, ReduceOp::Sum).unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
}

#[test]
fn a_cuda_error_is_a_communicator_error_not_a_timeout() {
    let rt = runtime();
    let opts = NcclOptions { timeout: Duration::from_secs(30), ..quick() };
    let pgs = world(&rt, 2, opts);
    // Rank 1 never calls: rank 0's allreduce waits, then its device breaks.
    let t = pgs[0].zeros(DType::F32, &[4]).unwrap();
    let w = pgs[0].allreduce(&t, ReduceOp::Sum).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    pgs[0].device().inject_device_error(700, "cudaErrorIllegalAddress");
    let started = std::time::Instant::now();
    let e = w.wait_timeout(Duration::from_secs(10)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "found well before the 30 s timeout");
    assert_eq!(w.state(), WorkState::Failed, "{e}");
    assert!(e.to_string().contains("CUDA error"), "{e}");
    assert!(e.to_string().contains("700"), "{e}");
}

#[test]
fn a_slow_kernel_completes_and_its_device_time_is_recorded() {
    let rt = runtime();
    let opts = NcclOptions { enable_timing: true, ..quick() };
    let pgs = world(&rt, 2, opts);
    let durations = each(&pgs, |pg| {
        emu_comm(pg).inject(EmuFault::SlowKernel(Duration::from_millis(150)));
        let t = dev(pg, DType::F32, &[1.0]);
        let w = pg.allreduce(&t, ReduceOp::Sum).unwrap();
        w.wait().unwrap();
        assert_eq!(host(pg, &t), vec![2.0]);
        w.duration().unwrap()
    });
    assert!(durations.iter().all(|d| *d >= Duration::from_millis(150)), "{durations:?}");
    let dump = cohort_core::recorder::Dump::from_json(&pgs[0].flight_recorder_json()).unwrap();
    assert!(dump.entries[0].duration_ms.is_some_and(|ms| ms >= 150.0), "{:?}", dump.entries[0]);
}

#[test]
fn a_timeout_dumps_the_recorder_and_no_handling_keeps_the_communicator() {
    let rt = runtime();
    let dir = std::env::temp_dir().join(format!("cohort-nccl-dump-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("rank");
    let opts = NcclOptions { timeout: Duration::from_millis(300), dump_prefix: Some(prefix.clone()), ..quick() };
    let pgs = world(&rt, 2, opts);
    // Only rank 0 calls.
    let w = pgs[0].allreduce(&pgs[0].zeros(DType::F32, &[2]).unwrap(), ReduceOp::Sum).unwrap();
    let e = w.wait_timeout(Duration::from_secs(10)).unwrap_err();
    assert_eq!(w.state(), WorkState::TimedOut, "{e}");
    assert_eq!(e.culprit(), Some(Rank(1)), "{e}");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let path = format!("{}0.json", prefix.display());
    while !std::path::Path::new(&path).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let dump = cohort_core::recorder::Dump::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(dump.entries.len(), 1);
    assert!(pgs[0].is_comm_aborted());
    std::fs::remove_dir_all(&dir).ok();

    let opts =
        NcclOptions { timeout: Duration::from_millis(300), error_handling: ErrorHandling::NoHandling, ..quick() };
    let pgs = world(&rt, 2, opts);
    let w = pgs[0].allreduce(&pgs[0].zeros(DType::F32, &[2]).unwrap(), ReduceOp::Sum).unwrap();
    let _ = w.wait_timeout(Duration::from_secs(10));
    assert_eq!(w.state(), WorkState::TimedOut);
    assert!(!pgs[0].is_comm_aborted(), "no handling: the communicator stays");
    assert!(pgs[0].failure().is_none());
}

#[test]
fn an_init_that_never_finishes_is_aborted_at_the_init_timeout() {
    let rt = runtime();
    let fabric = MemFabric::new();
    let dev = Arc::new(EmuDevice::new(EmuConfig::new(rt.handle().clone(), fabric)));
    dev.inject_init_hang();
    let opts = NcclOptions { init_timeout: Duration::from_millis(200), ..quick() };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let e = rt.block_on(Pg::new(dev, store, "hang", 0, 1, opts, rt.handle().clone())).unwrap_err();
    assert!(matches!(e, NcclError::Timeout(_)), "{e}");
    assert!(e.to_string().contains("still in progress after 200 ms"), "{e}");
}

#[test]
fn lazy_init_creates_the_communicator_at_the_first_collective() {
    let rt = runtime();
    let pgs = world(&rt, 2, NcclOptions { lazy_init: true, ..quick() });
    assert!(pgs.iter().all(|pg| pg.comm_handle().is_none()));
    let got = each(&pgs, |pg| {
        let t = dev(pg, DType::F32, &[1.0]);
        pg.allreduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        host(pg, &t)
    });
    assert_eq!(got, vec![vec![2.0], vec![2.0]]);
}

#[test]
fn split_makes_groups_that_compute_apart() {
    let rt = runtime();
    let pgs = world(&rt, 4, quick());
    let got = each(&pgs, |pg| {
        let me = pg.rank().0;
        let child = rt.block_on(pg.split(Some(me % 2), me, quick())).unwrap().expect("every rank has a color");
        assert_eq!(child.world_size(), 2);
        let t = dev(&child, DType::F32, &[me as f64]);
        child.allreduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        host(&child, &t)
    });
    assert_eq!(got, vec![vec![2.0], vec![4.0], vec![2.0], vec![4.0]]);
}

#[test]
fn survivors_shrink_the_group_after_a_rank_dies() {
    let rt = runtime();
    let opts =
        NcclOptions { timeout: Duration::from_millis(400), error_handling: ErrorHandling::NoHandling, ..quick() };
    let pgs = world(&rt, 4, opts);
    emu_comm(&pgs[3]).inject(EmuFault::Dies);
    let got = each(&pgs, |pg| {
        let t = dev(pg, DType::F32, &[1.0]);
        let w = pg.allreduce(&t, ReduceOp::Sum).unwrap();
        let _ = w.wait_timeout(Duration::from_secs(10));
        if pg.rank().0 == 3 {
            return None;
        }
        assert_eq!(w.state(), WorkState::TimedOut);
        let small = rt.block_on(pg.shrink(&[3], quick())).unwrap();
        let t = dev(&small, DType::F32, &[1.0]);
        small.allreduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        Some((small.rank().0, small.world_size(), host(&small, &t)))
    });
    assert_eq!(got, vec![Some((0, 3, vec![3.0])), Some((1, 3, vec![3.0])), Some((2, 3, vec![3.0])), None]);
}

#[test]
fn shrink_is_refused_below_nccl_2_27() {
    let rt = runtime();
    let fabric = MemFabric::new();
    let mut cfg = EmuConfig::new(rt.handle().clone(), fabric);
    cfg.nccl_version = crate::nccl::device::nccl_version_code(2, 26, 5);
    let dev = Arc::new(EmuDevice::new(cfg));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pg = rt.block_on(Pg::new(dev, store, "old", 0, 1, quick(), rt.handle().clone())).unwrap();
    let e = rt.block_on(pg.shrink(&[], quick())).unwrap_err();
    assert_eq!(e.to_string(), "ncclCommShrink needs NCCL >= 2.27, the loaded library is 2.26.5");
}

#[test]
fn the_monitor_reports_a_watchdog_that_stopped() {
    let rt = runtime();
    let opts = NcclOptions {
        // Long enough that a busy CI machine does not starve a beating watchdog for as long.
        heartbeat_timeout: Some(Duration::from_secs(1)),
        monitor_action: MonitorAction::Report,
        ..quick()
    };
    let pgs = world(&rt, 1, opts);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!pgs[0].monitor_fired(), "a beating watchdog is left alone");
    pgs[0].stall_watchdog(true);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !pgs[0].monitor_fired() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(pgs[0].monitor_fired());
}

#[test]
fn in_blocking_wait_mode_the_waiting_thread_ends_works_and_catches_timeouts_itself() {
    let rt = runtime();
    let opts = NcclOptions { blocking_wait: true, timeout: Duration::from_millis(400), ..quick() };
    let pgs = world(&rt, 2, opts);
    pgs.iter().for_each(|pg| pg.stall_watchdog(true));
    // `Work::wait` on a thread of its own, given 10 s to end.
    let wait_within = |w: &Work| {
        let (tx, rx) = std::sync::mpsc::channel();
        let w2 = w.clone();
        std::thread::spawn(move || tx.send(w2.wait()));
        rx.recv_timeout(Duration::from_secs(10)).expect("the waiting thread did not end the work")
    };
    let got = each(&pgs, |pg| {
        let t = dev(pg, DType::F32, &[1.0]);
        wait_within(&pg.allreduce(&t, ReduceOp::Sum).unwrap()).unwrap();
        host(pg, &t)
    });
    assert_eq!(got, vec![vec![2.0], vec![2.0]], "finished by the waiting threads alone");
    // Rank 1 never calls: rank 0's own wait sees the deadline pass.
    let w = pgs[0].allreduce(&pgs[0].zeros(DType::F32, &[1]).unwrap(), ReduceOp::Sum).unwrap();
    let e = wait_within(&w).unwrap_err();
    assert_eq!(w.state(), WorkState::TimedOut, "{e}");

    // Without it, a stalled watchdog leaves the work unfinished.
    let pgs = world(&rt, 2, NcclOptions { timeout: Duration::from_millis(400), ..quick() });
    pgs.iter().for_each(|pg| pg.stall_watchdog(true));
    let w = pgs[0].allreduce(&pgs[0].zeros(DType::F32, &[1]).unwrap(), ReduceOp::Sum).unwrap();
    assert!(matches!(w.wait_timeout(Duration::from_millis(800)), Err(crate::work::WorkError::WaitTimedOut { .. })));
}

#[test]
fn options_read_the_torch_names_and_refuse_bad_values_by_name() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    };
    let o = NcclOptions::from_lookup(env(&[
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),
        ("TORCH_NCCL_ENABLE_TIMING", "1"),
        ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "0"),
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "17"),
        ("TORCH_NCCL_BLOCKING_WAIT", "1"),
        ("COHORT_TIMEOUT_MS", "1500"),
    ]))
    .unwrap();
    assert_eq!(o.error_handling, ErrorHandling::NoHandling);
    assert!(o.enable_timing);
    assert_eq!(o.heartbeat_timeout, None);
    assert_eq!(o.trace_buffer_size, 17);
    assert!(o.blocking_wait);
    // COHORT_TIMEOUT_MS is the collectives' timeout only, as under TCP; init keeps its own.
    assert_eq!((o.timeout, o.init_timeout), (Duration::from_millis(1500), NcclOptions::default().init_timeout));
    let o = NcclOptions::from_lookup(env(&[("COHORT_INIT_TIMEOUT_MS", "700")])).unwrap();
    assert_eq!((o.timeout, o.init_timeout), (NcclOptions::default().timeout, Duration::from_millis(700)));
    // COHORT_* wins over TORCH_NCCL_*.
    let o = NcclOptions::from_lookup(env(&[("COHORT_DESYNC_DEBUG", "0"), ("TORCH_NCCL_DESYNC_DEBUG", "1")])).unwrap();
    assert!(!o.desync_debug);
    let e = NcclOptions::from_lookup(env(&[("TORCH_NCCL_ENABLE_TIMING", "maybe")])).unwrap_err();
    assert!(e.to_string().contains("TORCH_NCCL_ENABLE_TIMING"), "{e}");
    let e = NcclOptions::from_lookup(env(&[("COHORT_ASYNC_ERROR_HANDLING", "7")])).unwrap_err();
    assert!(e.to_string().contains("expected 0 (no handling)"), "{e}");
}

#[test]
fn the_fabric_over_a_tcp_store_runs_a_group() {
    let rt = runtime();
    let server = rt
        .block_on(crate::store::TcpStoreServer::bind(
            crate::net::TokioNet,
            crate::store::TcpStoreServerConfig::new("127.0.0.1:0".parse().unwrap()),
        ))
        .unwrap();
    let port = server.local_addr().port();
    let store: Arc<dyn Store> = Arc::new(
        rt.block_on(crate::store::TcpStore::connect(crate::store::TcpStoreConfig::new("127.0.0.1", port))).unwrap(),
    );
    // The fabric gets its own connection: its polls must not queue behind the group's calls.
    let fabric_store: Arc<dyn Store> = Arc::new(
        rt.block_on(crate::store::TcpStore::connect(crate::store::TcpStoreConfig::new("127.0.0.1", port))).unwrap(),
    );
    let fabric = crate::nccl::emu::StoreFabric::new(fabric_store);
    let _in = rt.enter();
    let mut set = tokio::task::JoinSet::new();
    for r in 0..3u32 {
        let mut cfg = EmuConfig::new(rt.handle().clone(), fabric.clone());
        cfg.ordinal = r as usize;
        let dev = Arc::new(EmuDevice::new(cfg));
        let (store, handle) = (store.clone(), rt.handle().clone());
        set.spawn(async move { (r, Pg::new(dev, store, "tcp", r, 3, quick(), handle).await.unwrap()) });
    }
    let mut pgs: Vec<(u32, Pg)> = rt.block_on(async {
        let mut v = Vec::new();
        while let Some(j) = set.join_next().await {
            v.push(j.unwrap());
        }
        v
    });
    pgs.sort_by_key(|(r, _)| *r);
    let pgs: Vec<Pg> = pgs.into_iter().map(|(_, p)| p).collect();
    let got = each(&pgs, |pg| {
        let t = dev(pg, DType::F32, &[pg.rank().0 as f64, 1.0]);
        pg.allreduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        host(pg, &t)
    });
    assert!(got.iter().all(|g| g == &vec![3.0, 3.0]), "{got:?}");
    drop(server);
}
