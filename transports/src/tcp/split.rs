//! New groups from existing ones: [`ProcessGroup::split_group`] (a sub-group of some ranks,
//! torch's `split_group` / `new_group`; after a failure, the survivors' shrink) and
//! [`ProcessGroup::merge_remote_group`] (independent groups joined into one, torch's
//! `merge_remote_group`).
//!
//! Every new group gets a fresh group id, agreed through the store rather than counted locally,
//! so that ranks which made different numbers of groups before can never end up in each other's
//! rendezvous: the id comes from the store counter `cohort/next_group_id`, allocated by one
//! rank and published under a key every member computes the same way.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use cohort_core::tensor::Tensor;
use cohort_core::work::GroupId;

use super::ProcessGroup;
use super::options::TcpOptions;
use super::rendezvous::InitError;
use crate::net::Net;
use crate::store::{Store, StoreError};

/// The store counter new group ids come from (group 0 is the default group).
pub const NEXT_GROUP_ID_KEY: &str = "cohort/next_group_id";

/// Connects one rank of a new group over the parent's network: the parent's `Net`, erased.
pub(crate) type Connector = Arc<
    dyn Fn(
            Arc<dyn Store>,
            GroupId,
            u32,
            u32,
            TcpOptions,
        ) -> Pin<Box<dyn Future<Output = Result<ProcessGroup, InitError>> + Send>>
        + Send
        + Sync,
>;

pub(crate) fn connector<N: Net>(net: N) -> Connector {
    Arc::new(move |store, gid, rank, world_size, opts| {
        let net = net.clone();
        Box::pin(async move { ProcessGroup::connect_group(net, store, gid, rank, world_size, opts).await })
    })
}

/// How a group was made from another, and what that rank was called there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    /// The group this one was split from (for a merge: the group this rank came from).
    pub parent: GroupId,
    /// For each rank of this group, its rank in the parent (a split), or `None` (a merge,
    /// where ranks come from different parents).
    pub parent_ranks: Option<Vec<u32>>,
}

/// Why a split or merge failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SplitError {
    /// The rank list is empty.
    #[error("split_group: the list of ranks is empty")]
    Empty,
    /// A listed rank is not in the parent group.
    #[error("split_group: rank {rank} is not in the parent group (world size {world_size})")]
    RankOutOfRange {
        /// The rank.
        rank: u32,
        /// The parent's world size.
        world_size: u32,
    },
    /// A rank is listed twice.
    #[error("split_group: rank {0} is listed twice")]
    Duplicate(u32),
    /// The caller is not in the list.
    #[error("split_group: this rank ({rank}) is not in {ranks:?}; only the ranks of the new group call split_group")]
    NotAMember {
        /// This rank.
        rank: u32,
        /// The list.
        ranks: Vec<u32>,
    },
    /// The rank that allocates the new group's id never did.
    #[error(
        "{what}: rank {leader} did not create the group within {} ms; did every rank of {ranks:?} call it with the same ranks, in the same order of calls?",
        timeout.as_millis()
    )]
    LeaderMissing {
        /// "split_group" or "merge_remote_group".
        what: &'static str,
        /// The rank expected to allocate the id.
        leader: u32,
        /// The ranks.
        ranks: Vec<u32>,
        /// How long it waited.
        timeout: Duration,
    },
    /// A merge's size is zero, or more ranks joined than it says.
    #[error("merge_remote_group {name:?}: {joined} ranks joined a group of size {size}")]
    MergeOverfull {
        /// The merged group's name.
        name: String,
        /// Ranks that joined so far, this group's included.
        joined: u64,
        /// The size every group passed.
        size: u32,
    },
    /// The group failed while its rank 0 shared the merge's rank block.
    #[error("merge_remote_group {name:?}: this group could not share its rank block: {why}")]
    Parent {
        /// The merged group's name.
        name: String,
        /// Why.
        why: String,
    },
    /// This group's rank 0 could not join the merge (its own error says why).
    #[error("merge_remote_group {name:?}: rank 0 of this group could not join the merge; its error says why")]
    LeaderFailed {
        /// The merged group's name.
        name: String,
    },
    /// The store held something unreadable under a group key.
    #[error("{what}: the store holds {value:?} under {key}, which is not a group id")]
    BadValue {
        /// "split_group" or "merge_remote_group".
        what: &'static str,
        /// The key.
        key: String,
        /// What it held.
        value: String,
    },
    /// The store failed.
    #[error("store error while creating a group: {0}")]
    Store(#[from] StoreError),
    /// Connecting the new group failed.
    #[error("connecting the new group {gid}: {source}")]
    Init {
        /// The new group's id.
        gid: GroupId,
        /// Why.
        source: InitError,
    },
}

/// Per parent group: how many splits over each rank set this rank has made.
#[derive(Default)]
pub(crate) struct SplitCounts(std::sync::Mutex<HashMap<Vec<u32>, u64>>);

impl SplitCounts {
    fn next(&self, ranks: &[u32]) -> u64 {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ranks.to_vec()).or_insert(0);
        let this = *n;
        *n += 1;
        this
    }
}

/// Checks a split's rank list against the parent and returns it sorted.
pub(crate) fn check_ranks(ranks: &[u32], me: u32, world_size: u32) -> Result<Vec<u32>, SplitError> {
    if ranks.is_empty() {
        return Err(SplitError::Empty);
    }
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    for w in sorted.windows(2) {
        if w[0] == w[1] {
            return Err(SplitError::Duplicate(w[0]));
        }
    }
    if let Some(&rank) = sorted.iter().find(|&&r| r >= world_size) {
        return Err(SplitError::RankOutOfRange { rank, world_size });
    }
    if !sorted.contains(&me) {
        return Err(SplitError::NotAMember { rank: me, ranks: sorted });
    }
    Ok(sorted)
}

fn parse_gid(what: &'static str, key: &str, value: &[u8]) -> Result<GroupId, SplitError> {
    let text = String::from_utf8_lossy(value);
    text.trim().parse::<u32>().map(GroupId).map_err(|_| SplitError::BadValue {
        what,
        key: key.to_owned(),
        value: text.into_owned(),
    })
}

async fn allocate_gid(store: &dyn Store) -> Result<GroupId, SplitError> {
    let id = store.add(NEXT_GROUP_ID_KEY, 1).await?;
    // The default group is 0, so the first allocated id is 1; an id beyond u32 means a store
    // whose counter someone else wrote.
    let id = u32::try_from(id).ok().filter(|&id| id > 0).ok_or_else(|| SplitError::BadValue {
        what: "group id",
        key: NEXT_GROUP_ID_KEY.into(),
        value: id.to_string(),
    })?;
    Ok(GroupId(id))
}

/// A merging group's rank 0: reserve `mine` ranks of the merged group and agree on its id.
async fn reserve_block(store: &dyn Store, name: &str, mine: u32, size: u32) -> Result<(i64, GroupId), SplitError> {
    let prefix = format!("cohort/merge/{name}/");
    let end = store.add(&format!("{prefix}ranks"), i64::from(mine)).await?;
    if size == 0 || end > i64::from(size) {
        // Give the block back, so that the count other groups see stays true.
        let _ = store.add(&format!("{prefix}ranks"), -i64::from(mine)).await;
        return Err(SplitError::MergeOverfull { name: name.to_owned(), joined: end.max(0) as u64, size });
    }
    // Every group's rank 0 proposes an id; the first proposal stored wins.
    let candidate = allocate_gid(store).await?;
    let key = format!("{prefix}gid");
    let agreed = store.compare_set(&key, b"", candidate.0.to_string().as_bytes()).await?;
    Ok((end - i64::from(mine), parse_gid("merge_remote_group", &key, &agreed)?))
}

impl ProcessGroup {
    /// A new group of some of this group's ranks (torch's `split_group`). Every rank in `ranks`
    /// calls it with the same list (in any order); ranks not in it do not call it. In the new
    /// group, ranks are numbered by their order in the parent: the lowest listed rank is rank 0.
    ///
    /// It needs only the store, not the parent's connections, so it also works after the parent
    /// failed: the survivors of a lost rank split themselves into a smaller group and go on
    /// (NCCL's shrink). Options are the parent's.
    pub async fn split_group(&self, ranks: &[u32]) -> Result<ProcessGroup, SplitError> {
        let me = self.rank().0;
        let sorted = check_ranks(ranks, me, self.world_size())?;
        let n = self.inner.split_counts.next(&sorted);
        let list = sorted.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let key = format!("{}split/{list}/{n}", super::rendezvous::group_prefix(self.group_id()));
        let store = self.store();
        let leader = sorted[0];
        let gid = if me == leader {
            let gid = allocate_gid(store.as_ref()).await?;
            store.set(&key, gid.0.to_string().as_bytes()).await?;
            gid
        } else {
            let timeout = self.inner.opts.init_timeout;
            match store.wait(&[key.as_str()], timeout).await {
                Ok(()) => {}
                Err(StoreError::Timeout { .. }) => {
                    return Err(SplitError::LeaderMissing { what: "split_group", leader, ranks: sorted, timeout });
                }
                Err(e) => return Err(e.into()),
            }
            parse_gid("split_group", &key, &store.get(&key).await?)?
        };
        let new_rank = sorted.iter().position(|&r| r == me).unwrap_or_default() as u32;
        let world = sorted.len() as u32;
        let pg = (self.inner.connector)(store, gid, new_rank, world, self.inner.opts.clone())
            .await
            .map_err(|source| SplitError::Init { gid, source })?;
        pg.set_lineage(Lineage { parent: self.group_id(), parent_ranks: Some(sorted) });
        Ok(pg)
    }

    /// Join independent groups into one group of `size` ranks through a store every one of
    /// them reaches (torch's `merge_remote_group`). Every rank of every group calls it with the
    /// same `store`, `size` and `name`. Each group keeps its ranks together and in order: a
    /// group's rank 0 reserves a block of ranks in the merged group (groups get blocks in the
    /// order they arrive) and shares it with its own ranks over the group itself. To merge
    /// single processes, merge their one-rank groups.
    pub async fn merge_remote_group(
        &self,
        store: Arc<dyn Store>,
        size: u32,
        name: &str,
    ) -> Result<ProcessGroup, SplitError> {
        let mine = self.world_size();
        let mut failure = None;
        let (mut base, mut gid) = (-1i64, GroupId(0));
        if self.rank().0 == 0 {
            match reserve_block(store.as_ref(), name, mine, size).await {
                Ok(block) => (base, gid) = block,
                Err(e) => failure = Some(e),
            }
        }
        if mine > 1 {
            // Rank 0 shares the block, or -1 when it could not join, so that its group fails at
            // once rather than at the parent's timeout.
            let parent = |why: String| SplitError::Parent { name: name.to_owned(), why };
            let block = Tensor::from_slice(&[base, i64::from(gid.0)]);
            let work = self.broadcast(vec![block], 0).map_err(|e| parent(e.to_string()))?;
            let out = work.await.map_err(|e| parent(e.to_string()))?;
            match out.first().and_then(|t| t.to_vec::<i64>().ok()).as_deref() {
                Some(&[b, g]) => (base, gid) = (b, GroupId(u32::try_from(g).unwrap_or_default())),
                _ => return Err(parent("the broadcast returned no block".into())),
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if base < 0 {
            return Err(SplitError::LeaderFailed { name: name.to_owned() });
        }
        let new_rank = base as u32 + self.rank().0;
        let pg = (self.inner.connector)(store, gid, new_rank, size, self.inner.opts.clone())
            .await
            .map_err(|source| SplitError::Init { gid, source })?;
        pg.set_lineage(Lineage { parent: self.group_id(), parent_ranks: None });
        Ok(pg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_are_checked_and_sorted() {
        assert_eq!(check_ranks(&[3, 1, 2], 1, 4).unwrap(), vec![1, 2, 3]);
        assert!(matches!(check_ranks(&[], 0, 4), Err(SplitError::Empty)));
        let e = check_ranks(&[0, 4], 0, 4).unwrap_err();
        assert_eq!(e.to_string(), "split_group: rank 4 is not in the parent group (world size 4)");
        assert!(matches!(check_ranks(&[2, 0, 2], 0, 4), Err(SplitError::Duplicate(2))));
        let e = check_ranks(&[1, 2], 0, 4).unwrap_err().to_string();
        assert!(e.contains("this rank (0) is not in [1, 2]"), "{e}");
    }

    #[test]
    fn split_counts_number_each_rank_set_separately() {
        let c = SplitCounts::default();
        assert_eq!(c.next(&[0, 1]), 0);
        assert_eq!(c.next(&[0, 1]), 1);
        assert_eq!(c.next(&[0, 2]), 0);
        assert_eq!(c.next(&[0, 1]), 2);
    }

    #[test]
    fn group_ids_in_the_store_must_parse() {
        assert_eq!(parse_gid("split_group", "k", b"7").unwrap(), GroupId(7));
        let e = parse_gid("split_group", "k", b"seven").unwrap_err().to_string();
        assert_eq!(e, "split_group: the store holds \"seven\" under k, which is not a group id");
    }
}
