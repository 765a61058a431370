//! Threads that wait for small works read the sockets themselves (busy-poll) while the reader
//! tasks keep serving them too: results stay exact and in order, whoever reads a frame.

mod common;

use std::time::Duration;

use cohort_core::{ReduceOp, Tensor};
use cohort_transports::TcpOptions;
use cohort_transports::tcp::BUSY_POLL_MAX_BYTES;

fn with_busy_poll(us: u64) -> TcpOptions {
    TcpOptions { busy_poll: Duration::from_micros(us), ..common::opts(20) }
}

#[test]
fn waiting_threads_and_reader_tasks_share_the_sockets_without_losing_or_reordering_frames() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Rank 0 polls long, rank 1 briefly, rank 2 never: every mix of who reads what.
    let pgs =
        runtime.block_on(common::connect_each(vec![with_busy_poll(1_000_000), with_busy_poll(20), with_busy_poll(0)]));
    let pgs: Vec<_> = pgs.into_iter().map(|r| r.expect("connect")).collect();
    let world = pgs.len();
    // Sizes below and above the busy-poll limit, so that polled and unpolled works interleave.
    let sizes = [1usize, 64, BUSY_POLL_MAX_BYTES / 4 + 1, 1000, 3];
    let threads: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            std::thread::spawn(move || {
                let me = pg.rank().0 as usize;
                for i in 0..300usize {
                    let n = sizes[i % sizes.len()];
                    let mine: Vec<f32> = (0..n).map(|k| (me * 1000 + i + k) as f32).collect();
                    let out = pg.allreduce(vec![Tensor::from_slice(&mine)], ReduceOp::Sum).unwrap().result().unwrap();
                    let want: Vec<f32> = (0..n).map(|k| (0..world).map(|r| (r * 1000 + i + k) as f32).sum()).collect();
                    assert_eq!(out, vec![Tensor::from_slice(&want)], "rank {me}, iteration {i}");
                    // A ring of sends: each rank's recv is matched by tag and order.
                    let to = ((me + 1) % world) as u32;
                    let from = ((me + world - 1) % world) as u32;
                    let send = pg.send(Tensor::from_slice(&[(me * 10_000 + i) as i64]), to, 7).unwrap();
                    let got = pg.recv(Tensor::from_slice(&[0i64]), from, 7).unwrap().result().unwrap();
                    assert_eq!(got, vec![Tensor::from_slice(&[(from as usize * 10_000 + i) as i64])]);
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

/// After a run of polled works the connections' epoll sets are left unarmed (the waiting threads
/// read); a work that nobody polls for must still complete: one that nobody waits for at all,
/// one awaited as a future, one too large to poll for, and one waited with a timeout.
#[test]
fn works_nobody_polls_for_complete_after_polled_ones() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let pgs = runtime.block_on(common::connect_each(vec![with_busy_poll(1_000_000), with_busy_poll(1_000_000)]));
    let pgs: Vec<_> = pgs.into_iter().map(|r| r.expect("connect")).collect();
    let handle = runtime.handle().clone();
    let threads: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            let handle = handle.clone();
            std::thread::spawn(move || {
                let me = pg.rank().0 as f32;
                let polled = |i: usize| {
                    for _ in 0..i {
                        let out =
                            pg.allreduce(vec![Tensor::from_slice(&[me])], ReduceOp::Sum).unwrap().result().unwrap();
                        assert_eq!(out, vec![Tensor::from_slice(&[1.0f32])]);
                    }
                };
                polled(100);
                // Nobody waits: only the reader task can finish it.
                let work = pg.allreduce(vec![Tensor::from_slice(&[me])], ReduceOp::Sum).unwrap();
                let start = std::time::Instant::now();
                while !work.is_completed() {
                    assert!(
                        start.elapsed() < Duration::from_secs(10),
                        "rank {me}: a work nobody waited for never ended"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(work.result().unwrap(), vec![Tensor::from_slice(&[1.0f32])]);
                polled(50);
                let work = pg.allreduce(vec![Tensor::from_slice(&[me])], ReduceOp::Sum).unwrap();
                assert_eq!(handle.block_on(work).unwrap(), vec![Tensor::from_slice(&[1.0f32])], "awaited");
                polled(50);
                let n = BUSY_POLL_MAX_BYTES; // floats: four times the limit
                let big = pg.allreduce(vec![Tensor::from_slice(&vec![me; n])], ReduceOp::Sum).unwrap();
                assert_eq!(big.result().unwrap(), vec![Tensor::from_slice(&vec![1.0f32; n])], "large");
                polled(50);
                let work = pg.allreduce(vec![Tensor::from_slice(&[me])], ReduceOp::Sum).unwrap();
                work.wait_timeout(Duration::from_secs(10)).expect("a timed wait");
                pg.shutdown();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a rank thread");
    }
}
