//! New groups from old ones: split_group (sub-groups, and the survivors' shrink after a rank is
//! lost) and merge_remote_group, with ranks as tasks of one process on loopback.

mod common;

use std::sync::Arc;
use std::time::Duration;

use cohort_core::{ReduceOp, Tensor};
use cohort_transports::tcp::SplitError;
use cohort_transports::{MemoryStore, ProcessGroup, Store};

/// Every group in `pgs` allreduces (its parent rank + 1); returns each rank's sum.
async fn sums(pgs: &[ProcessGroup], value: impl Fn(usize) -> f32) -> Vec<f32> {
    let works: Vec<_> = pgs
        .iter()
        .enumerate()
        .map(|(i, pg)| pg.allreduce(vec![Tensor::from_slice(&[value(i)])], ReduceOp::Sum).unwrap())
        .collect();
    let mut out = Vec::new();
    for w in works {
        let t = tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").expect("allreduce");
        out.push(t[0].to_vec::<f32>().unwrap()[0]);
    }
    out
}

async fn split_all(pgs: &[ProcessGroup], lists: &[&[u32]]) -> Vec<Result<ProcessGroup, SplitError>> {
    common::concurrently(pgs.iter().map(|pg| {
        let pg = pg.clone();
        let list = lists.iter().find(|l| l.contains(&pg.rank().0)).expect("every rank is listed").to_vec();
        async move { pg.split_group(&list).await }
    }))
    .await
}

/// Every group in `pgs` calls `merge_remote_group(shared, size, name)` at once.
async fn merge_all(
    pgs: &[ProcessGroup],
    shared: &Arc<dyn Store>,
    size: u32,
    name: &'static str,
) -> Vec<Result<ProcessGroup, SplitError>> {
    common::concurrently(pgs.iter().map(|pg| {
        let (pg, shared) = (pg.clone(), shared.clone());
        async move { pg.merge_remote_group(shared, size, name).await }
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_makes_independent_subgroups_numbered_by_parent_rank() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pgs = common::group_on(store, 4, common::opts(5)).await;
    // Lists in any order; rank 3 and rank 1 make one group, 2 and 0 the other.
    let subs: Vec<_> = split_all(&pgs, &[&[2, 0], &[3, 1]]).await.into_iter().map(|r| r.expect("split")).collect();
    for (parent, sub) in pgs.iter().zip(&subs) {
        assert_eq!(sub.world_size(), 2);
        assert_eq!(sub.rank().0, parent.rank().0 / 2, "ranks keep their parent order");
        let lineage = sub.lineage().expect("a split has a lineage");
        assert_eq!(lineage.parent, parent.group_id());
        assert_eq!(sub.parent_rank(sub.rank().0), Some(parent.rank().0));
        assert_ne!(sub.group_id(), parent.group_id());
    }
    assert_eq!(subs[0].group_id(), subs[2].group_id());
    assert_ne!(subs[0].group_id(), subs[1].group_id());
    // Each sub-group reduces only its own ranks: {0, 2} → 1 + 3, {1, 3} → 2 + 4.
    assert_eq!(sums(&subs, |i| i as f32 + 1.0).await, vec![4.0, 6.0, 4.0, 6.0]);
    // The parent is untouched.
    assert_eq!(sums(&pgs, |i| i as f32 + 1.0).await, vec![10.0; 4]);
    // Splitting the same ranks again makes another group, not the same one twice.
    let again: Vec<_> = split_all(&pgs, &[&[0, 2], &[1, 3]]).await.into_iter().map(|r| r.expect("split")).collect();
    assert_ne!(again[0].group_id(), subs[0].group_id());
    assert_eq!(sums(&again, |_| 1.0).await, vec![2.0; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_shrink_the_group_after_a_rank_is_lost() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut pgs = common::group_on(store, 3, common::opts(5)).await;
    let lost = pgs.pop().expect("rank 2");
    lost.abort("rank 2 leaves");
    drop(lost);
    // The parent fails naming the lost rank (refusing the collective if the abort has already
    // arrived)...
    let works: Vec<_> = pgs.iter().map(|pg| pg.allreduce(vec![Tensor::from_slice(&[1.0f32])], ReduceOp::Sum)).collect();
    for w in works {
        let err = match w {
            Ok(w) => tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").unwrap_err().to_string(),
            Err(refused) => refused.to_string(),
        };
        assert!(err.contains("rank 2"), "{err}");
    }
    // ...and the survivors go on in a group without it.
    let shrunk: Vec<_> = split_all(&pgs, &[&[0, 1]]).await.into_iter().map(|r| r.expect("shrink")).collect();
    assert_eq!(sums(&shrunk, |i| i as f32 + 1.0).await, vec![3.0, 3.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_whose_lowest_rank_never_comes_names_it() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pgs = common::group_on(store, 3, common::opts(5)).await;
    // Rank 1 asks for {0, 1}; rank 0 never does. Rank 1 gives up at the init timeout.
    let err = tokio::time::timeout(Duration::from_secs(10), pgs[1].split_group(&[1, 0]))
        .await
        .expect("bounded by the init timeout")
        .unwrap_err();
    assert!(matches!(err, SplitError::LeaderMissing { leader: 0, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("rank 0 did not create the group") && text.contains("[0, 1]"), "{text}");
    // Argument errors are refused before the store is touched.
    let text = pgs[0].split_group(&[1, 2]).await.unwrap_err().to_string();
    assert!(text.contains("this rank (0) is not in [1, 2]"), "{text}");
    let text = pgs[0].split_group(&[0, 3]).await.unwrap_err().to_string();
    assert!(text.contains("rank 3 is not in the parent group (world size 3)"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_joins_independent_groups_keeping_each_groups_ranks_together() {
    // Two jobs of two ranks each, each with its own store, and one single process.
    let a = common::group_on(Arc::new(MemoryStore::new()), 2, common::opts(5)).await;
    let b = common::group_on(Arc::new(MemoryStore::new()), 2, common::opts(5)).await;
    let c = common::group_on(Arc::new(MemoryStore::new()), 1, common::opts(5)).await;
    let shared: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let all: Vec<ProcessGroup> = a.iter().chain(&b).chain(&c).cloned().collect();
    let merged: Vec<_> = merge_all(&all, &shared, 5, "five").await.into_iter().map(|r| r.expect("merge")).collect();
    let ranks: Vec<u32> = merged.iter().map(|pg| pg.rank().0).collect();
    let mut sorted = ranks.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![0, 1, 2, 3, 4], "every rank of the merged group is taken once");
    assert_eq!(ranks[1], ranks[0] + 1, "job a's ranks stay together, in order");
    assert_eq!(ranks[3], ranks[2] + 1, "job b's ranks stay together, in order");
    assert!(merged.iter().all(|pg| pg.world_size() == 5 && pg.group_id() == merged[0].group_id()));
    // Every process contributes its merged rank; all see 0 + 1 + 2 + 3 + 4.
    let works: Vec<_> = merged
        .iter()
        .map(|pg| pg.allreduce(vec![Tensor::from_slice(&[pg.rank().0 as i64])], ReduceOp::Sum).unwrap())
        .collect();
    for w in works {
        assert_eq!(w.await.unwrap(), vec![Tensor::from_slice(&[10i64])]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_with_more_ranks_than_its_size_fails_the_late_group_whole() {
    let shared: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let first = common::group_on(Arc::new(MemoryStore::new()), 1, common::opts(5)).await;
    let late = common::group_on(Arc::new(MemoryStore::new()), 2, common::opts(5)).await;
    let solo = {
        let (pg, shared) = (first[0].clone(), shared.clone());
        tokio::spawn(async move { pg.merge_remote_group(shared, 2, "two").await })
    };
    while !shared.check(&["cohort/merge/two/gid"]).await.unwrap() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let results = tokio::time::timeout(Duration::from_secs(5), merge_all(&late, &shared, 2, "two")).await;
    let errors: Vec<String> = results.expect("fails at once").into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert!(errors[0].contains("3 ranks joined a group of size 2"), "{}", errors[0]);
    assert!(errors[1].contains("rank 0 of this group could not join"), "{}", errors[1]);
    // The first group reserved its rank and waits for a second rank that never comes.
    let err = solo.await.unwrap().unwrap_err().to_string();
    assert!(err.contains("1/2 ranks joined; missing: [1]"), "{err}");
}
