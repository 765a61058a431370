//! What the simulator's test files share.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// `f` for every seed of `seeds`, on `threads` threads that each take the next seed not yet
/// taken (a seed is a world of its own, run on one thread from start to end); the results in
/// seed order. A panic in `f` fails the caller.
pub fn per_seed<T: Send>(seeds: Range<u64>, threads: u64, f: impl Fn(u64) -> T + Sync) -> Vec<T> {
    let next = AtomicU64::new(seeds.start);
    let mut done: Vec<(u64, T)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let seed = next.fetch_add(1, Ordering::SeqCst);
                        if seed >= seeds.end {
                            return mine;
                        }
                        mine.push((seed, f(seed)));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("a seed's thread panicked")).collect()
    });
    done.sort_by_key(|d| d.0);
    done.into_iter().map(|d| d.1).collect()
}
