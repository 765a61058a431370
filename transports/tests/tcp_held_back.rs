//! A thread that submits several small works in a row has their frames held back, to go out
//! in one write when it waits. They must go out all the same when it never waits, in order
//! with everything sent after them, and with the right results.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use cohort_core::{ReduceOp, Tensor};

/// Rank 0 submits a burst of small works and then neither waits nor asks about them until rank
/// 1, which waits for the same works, has all of them: only the watcher can have sent rank 0's
/// held-back frames (every frame after the first).
#[test]
fn a_burst_nobody_waits_for_still_goes_out_in_order() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // No heartbeats: one would send what is held back ahead of it.
    let opts = cohort_transports::TcpOptions { heartbeat: None, ..common::opts(20) };
    let pgs = runtime.block_on(common::group(2, opts));
    // Element counts, all small enough to be held back.
    let sizes = [1usize, 3, 0, 16, 2, 1000, 5];
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (mut done_tx, mut done_rx) = (Some(done_tx), Some(done_rx));
    let threads: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            // Rank 0 listens, rank 1 tells (a failed rank 1 drops the sender: no hang).
            let done_rx = done_rx.take();
            let done_tx = if done_rx.is_none() { done_tx.take() } else { None };
            std::thread::spawn(move || {
                let me = pg.rank().0 as usize;
                let works: Vec<_> = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| {
                        let mine: Vec<f32> = (0..n).map(|k| (me * 100 + i + k) as f32).collect();
                        pg.allreduce(vec![Tensor::from_slice(&mine)], ReduceOp::Sum).unwrap()
                    })
                    .collect();
                if let Some(done) = done_rx {
                    // Rank 0: no wait, no question, until rank 1 has every result.
                    done.recv_timeout(Duration::from_secs(30))
                        .expect("rank 1 gets every result without rank 0 waiting");
                } else {
                    for w in &works {
                        w.wait_timeout(Duration::from_secs(10)).expect("rank 0's held-back frames go out unasked");
                    }
                    done_tx.expect("rank 1 tells").send(()).unwrap();
                }
                for (i, (w, &n)) in works.iter().zip(&sizes).enumerate() {
                    let want: Vec<f32> = (0..n).map(|k| (i + k) as f32 + (100 + i + k) as f32).collect();
                    assert_eq!(w.result().unwrap(), vec![Tensor::from_slice(&want)], "rank {me}, work {i}");
                }
                pg.shutdown();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a rank thread");
    }
}

/// Bursts of small works (and now and then a large one, which cannot be held back and so sends
/// what is held back ahead of it), waited for in any order and mixed with point-to-point
/// messages, on three ranks: every result exact, whoever writes the held-back frames.
#[test]
fn bursts_mixed_with_sends_keep_every_result_exact() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let pgs = runtime.block_on(common::group(3, common::opts(20)));
    let world = pgs.len();
    let threads: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            std::thread::spawn(move || {
                let me = pg.rank().0 as usize;
                for round in 0..50usize {
                    let burst = 1 + round % 9;
                    let large = (round % 5 == 0).then(|| {
                        pg.allreduce(vec![Tensor::from_slice(&vec![me as f32; 1 << 18])], ReduceOp::Sum).unwrap()
                    });
                    let works: Vec<_> = (0..burst)
                        .map(|i| {
                            let v = (me * 1000 + round * 10 + i) as f32;
                            pg.allreduce(vec![Tensor::from_slice(&[v, -v])], ReduceOp::Sum).unwrap()
                        })
                        .collect();
                    let to = ((me + 1) % world) as u32;
                    let from = ((me + world - 1) % world) as u32;
                    let send = pg.send(Tensor::from_slice(&[(me * 10_000 + round) as i64]), to, 3).unwrap();
                    let recv = pg.recv(Tensor::from_slice(&[0i64]), from, 3).unwrap();
                    // Waited last to first on odd rounds.
                    let order: Vec<usize> =
                        if round % 2 == 1 { (0..burst).rev().collect() } else { (0..burst).collect() };
                    for i in order {
                        let s: f32 = (0..world).map(|r| (r * 1000 + round * 10 + i) as f32).sum();
                        assert_eq!(works[i].result().unwrap(), vec![Tensor::from_slice(&[s, -s])], "rank {me}");
                    }
                    if let Some(large) = large {
                        let s = (0..world).sum::<usize>() as f32;
                        assert_eq!(large.result().unwrap(), vec![Tensor::from_slice(&vec![s; 1 << 18])], "rank {me}");
                    }
                    let got = recv.result().unwrap();
                    assert_eq!(got, vec![Tensor::from_slice(&[(from as usize * 10_000 + round) as i64])]);
                    send.wait().unwrap();
                }
                pg.shutdown();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a rank thread");
    }
}
