//! Shared memory between ranks of one host, end to end over real sockets: who agrees on it,
//! that every size comes through (a ring smaller than the transfer included), lazy connection,
//! mixed groups and a refused ring size. A corrupt ring: `src/tcp/shm_tests.rs`.

mod common;

use cohort_core::{Rank, ReduceOp, Tensor};
use cohort_transports::{ProcessGroup, TcpOptions};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
}

/// Every test here makes segments, and the first looks for this process's in `/dev/shm` once
/// its group is up: the tests take turns, or it would find another test's segments between
/// their creation and their unlinking.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn opts() -> TcpOptions {
    common::opts(30)
}

/// A group of `opts.len()` ranks in this process, rank `r` with `opts[r]`.
fn group(runtime: &tokio::runtime::Runtime, opts: Vec<TcpOptions>) -> Vec<ProcessGroup> {
    runtime.block_on(common::connect_each(opts)).into_iter().map(|r| r.expect("connect")).collect()
}

/// Every rank, each on a thread of its own, runs allreduces of `sizes` (elements) and checks
/// the sums; then a broadcast from the last rank. Each rank's shared-memory peers, as they were
/// after the first allreduce (before the second, which nobody finishes, and so nobody shuts
/// down, until every rank has looked).
fn run_collectives(pgs: Vec<ProcessGroup>, sizes: &[usize]) -> Vec<Vec<Rank>> {
    let n = pgs.len();
    let threads: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            let sizes = sizes.to_vec();
            std::thread::spawn(move || {
                let me = pg.rank().0 as usize;
                let mut shared = None;
                for &len in &sizes {
                    let mine: Vec<f32> = (0..len).map(|i| ((i % 97) * (me + 1)) as f32).collect();
                    let out = pg.allreduce(vec![Tensor::from_slice(&mine)], ReduceOp::Sum).unwrap().result().unwrap();
                    let got: Vec<f32> = out[0].to_vec().unwrap();
                    let factor = (n * (n + 1) / 2) as f32;
                    let wrong = got.iter().enumerate().filter(|&(i, &x)| x != (i % 97) as f32 * factor).count();
                    assert_eq!(wrong, 0, "rank {me}: {wrong} of {len} elements wrong");
                    shared.get_or_insert_with(|| pg.shared_memory_peers());
                }
                let root = (n - 1) as u32;
                let data: Vec<f32> = (0..1000).map(|i| if me as u32 == root { i as f32 } else { -1.0 }).collect();
                let out = pg.broadcast(vec![Tensor::from_slice(&data)], root).unwrap().result().unwrap();
                assert_eq!(out[0].to_vec::<f32>().unwrap(), (0..1000).map(|i| i as f32).collect::<Vec<_>>());
                pg.shutdown();
                shared.unwrap_or_default()
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().expect("a rank thread")).collect()
}

#[test]
fn ranks_of_one_host_share_memory_and_every_size_comes_through() {
    let _turn = turn();
    let rt = runtime();
    let pgs = group(&rt, vec![opts(), opts()]);
    assert_eq!(pgs[0].shared_memory_peers(), vec![Rank(1)]);
    assert_eq!(pgs[1].shared_memory_peers(), vec![Rank(0)]);
    assert!(
        !std::fs::read_dir("/dev/shm").unwrap().any(|e| {
            e.unwrap().file_name().to_string_lossy().starts_with(&format!("cohort-{}-", std::process::id()))
        })
    );
    // 12 MiB: three times the ring, so writers wait for room (and get a doorbell).
    let shared = run_collectives(pgs, &[1, 1000, 70_000, 3 << 20]);
    assert_eq!(shared, vec![vec![Rank(1)], vec![Rank(0)]]);
}

#[test]
fn lazily_connected_ranks_share_memory_from_their_first_collective() {
    let _turn = turn();
    let rt = runtime();
    let lazy = TcpOptions { lazy_connect: true, ..opts() };
    let pgs = group(&rt, vec![lazy.clone(), lazy.clone(), lazy]);
    assert!(pgs.iter().all(|pg| pg.shared_memory_peers().is_empty()), "nobody connected yet");
    let shared = run_collectives(pgs, &[16, 1 << 20]);
    for (me, peers) in shared.iter().enumerate() {
        assert!(!peers.is_empty(), "rank {me} talked to a peer through shared memory: {shared:?}");
    }
}

#[test]
fn a_rank_that_turns_shared_memory_off_stays_on_tcp_and_the_others_share() {
    let _turn = turn();
    let rt = runtime();
    let off = TcpOptions { shared_memory: false, ..opts() };
    let pgs = group(&rt, vec![opts(), opts(), off]);
    assert_eq!(pgs[0].shared_memory_peers(), vec![Rank(1)]);
    assert_eq!(pgs[1].shared_memory_peers(), vec![Rank(0)]);
    assert_eq!(pgs[2].shared_memory_peers(), vec![]);
    let shared = run_collectives(pgs, &[3, 300_000]);
    assert_eq!(shared, vec![vec![Rank(1)], vec![Rank(0)], vec![]]);
}

#[test]
fn a_ring_of_one_page_still_carries_every_size() {
    let _turn = turn();
    // Every frame larger than the ring: writers wait for room over and over, and each wait
    // needs the reader's doorbell.
    let rt = runtime();
    let tiny = TcpOptions { shm_ring_bytes: 4096, ..opts() };
    let pgs = group(&rt, vec![tiny.clone(), tiny.clone(), tiny]);
    let shared = run_collectives(pgs, &[1, 5000, 1 << 20]);
    assert_eq!(shared, vec![vec![Rank(1), Rank(2)], vec![Rank(0), Rank(2)], vec![Rank(0), Rank(1)]]);
}

#[test]
fn a_ring_size_that_is_no_power_of_two_is_refused_naming_the_option() {
    let _turn = turn();
    let rt = runtime();
    let bad = TcpOptions { shm_ring_bytes: 5000, ..opts() };
    let Err(e) = rt.block_on(common::connect_each(vec![bad])).remove(0) else { panic!("connected") };
    assert_eq!(e.to_string(), "shm_ring_bytes is 5000, expected a power of two from 4096 to 1073741824");
}
