//! What the one-process TCP tests share: ranks as tasks of one process, over loopback, meeting
//! through an in-memory store.

#![allow(dead_code)] // each test file uses some of it

use std::sync::Arc;
use std::time::Duration;

use cohort_transports::{InitError, MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};

/// Options with both the init and the collective timeout set to `secs` seconds.
pub fn opts(secs: u64) -> TcpOptions {
    TcpOptions { init_timeout: Duration::from_secs(secs), timeout: Duration::from_secs(secs), ..TcpOptions::default() }
}

/// Connect one rank per entry of `per_rank` (rank `r` with `per_rank[r]`) through `store`, all
/// at once; each rank's outcome, by rank.
pub async fn connect_each_on(store: Arc<dyn Store>, per_rank: Vec<TcpOptions>) -> Vec<Result<ProcessGroup, InitError>> {
    let world = per_rank.len() as u32;
    let joins: Vec<_> = per_rank
        .into_iter()
        .enumerate()
        .map(|(r, o)| {
            let store = store.clone();
            tokio::spawn(async move { ProcessGroup::connect(TokioNet, store, r as u32, world, o).await })
        })
        .collect();
    let mut out = Vec::with_capacity(joins.len());
    for j in joins {
        out.push(j.await.expect("the connecting task"));
    }
    out
}

/// [`connect_each_on`] through a fresh in-memory store.
pub async fn connect_each(per_rank: Vec<TcpOptions>) -> Vec<Result<ProcessGroup, InitError>> {
    connect_each_on(Arc::new(MemoryStore::new()), per_rank).await
}

/// A `world`-rank group through `store`, every rank with `opts`; panics if a rank fails.
pub async fn group_on(store: Arc<dyn Store>, world: u32, opts: TcpOptions) -> Vec<ProcessGroup> {
    connect_each_on(store, vec![opts; world as usize]).await.into_iter().map(|r| r.expect("connect")).collect()
}

/// [`group_on`] through a fresh in-memory store.
pub async fn group(world: u32, opts: TcpOptions) -> Vec<ProcessGroup> {
    group_on(Arc::new(MemoryStore::new()), world, opts).await
}

/// Run every future as its own task, all at once (as ranks do); their outputs, in order.
pub async fn concurrently<T, F>(futures: impl IntoIterator<Item = F>) -> Vec<T>
where
    T: Send + 'static,
    F: std::future::Future<Output = T> + Send + 'static,
{
    let joins: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(joins.len());
    for j in joins {
        out.push(j.await.expect("a task of the test"));
    }
    out
}
