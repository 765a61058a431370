//! [`PlanCache`]: plans built once and shared by later runs of the same collective.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::{Plan, PlanOptions, ScheduleError, ScheduleOp};
use crate::work::Rank;

type Key = (ScheduleOp, Rank, u32, usize, PlanOptions);

/// Plans by what they are a function of (see [`Plan::new`]): a training loop runs the same few
/// collectives over and over, and building a plan (its hazard tracking, its dependency lists)
/// costs more than running a small one. Holds at most `capacity` plans; when a new one would
/// not fit, the cache starts over empty (the loop's working set comes back within one
/// iteration).
#[derive(Debug)]
pub struct PlanCache {
    plans: FxHashMap<Key, Arc<Plan>>,
    capacity: usize,
}

impl Default for PlanCache {
    fn default() -> Self {
        PlanCache::new(PlanCache::DEFAULT_CAPACITY)
    }
}

impl PlanCache {
    /// How many plans [`PlanCache::default`] keeps.
    pub const DEFAULT_CAPACITY: usize = 256;

    /// A cache of at most `capacity` plans (0 caches nothing).
    pub fn new(capacity: usize) -> Self {
        PlanCache { plans: FxHashMap::default(), capacity }
    }

    /// The plan [`Plan::new`] would build for these arguments, built at most once while it
    /// stays cached. Errors are not cached.
    pub fn plan(
        &mut self,
        op: &ScheduleOp,
        rank: Rank,
        world_size: u32,
        elem_size: usize,
        options: PlanOptions,
    ) -> Result<Arc<Plan>, ScheduleError> {
        let key = (op.clone(), rank, world_size, elem_size, options);
        if let Some(plan) = self.plans.get(&key) {
            return Ok(Arc::clone(plan));
        }
        let plan = Arc::new(Plan::new(op, rank, world_size, elem_size, options)?);
        if self.capacity > 0 {
            if self.plans.len() >= self.capacity {
                self.plans.clear();
            }
            self.plans.insert(key, Arc::clone(&plan));
        }
        Ok(plan)
    }

    /// Number of plans held.
    pub fn len(&self) -> usize {
        self.plans.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_arguments_share_one_plan_and_others_get_their_own() {
        let mut cache = PlanCache::new(8);
        let o = PlanOptions::default();
        let a = cache.plan(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 4, o).unwrap();
        let b = cache.plan(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 4, o).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(*a, Plan::new(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 4, o).unwrap());
        // Any argument that changes the plan gives another one.
        let others = [
            cache.plan(&ScheduleOp::Allreduce { count: 5 }, Rank(0), 2, 4, o).unwrap(),
            cache.plan(&ScheduleOp::Allreduce { count: 4 }, Rank(1), 2, 4, o).unwrap(),
            cache.plan(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 3, 4, o).unwrap(),
            cache.plan(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 2, o).unwrap(),
            cache
                .plan(&ScheduleOp::Allreduce { count: 4 }, Rank(0), 2, 4, PlanOptions { chunk_bytes: 8, ..o })
                .unwrap(),
        ];
        for p in &others {
            assert!(!Arc::ptr_eq(&a, p));
        }
        assert_eq!(cache.len(), 6);
    }

    #[test]
    fn errors_are_returned_not_cached_and_a_full_cache_starts_over() {
        let mut cache = PlanCache::new(2);
        let o = PlanOptions::default();
        let bad = ScheduleOp::Broadcast { count: 1, root: Rank(7) };
        assert_eq!(
            cache.plan(&bad, Rank(0), 2, 4, o).unwrap_err(),
            ScheduleError::RootOutOfRange { root: Rank(7), world_size: 2 }
        );
        assert!(cache.is_empty());
        for count in 1..=2 {
            cache.plan(&ScheduleOp::Allreduce { count }, Rank(0), 2, 4, o).unwrap();
        }
        assert_eq!(cache.len(), 2);
        cache.plan(&ScheduleOp::Allreduce { count: 3 }, Rank(0), 2, 4, o).unwrap();
        assert_eq!(cache.len(), 1);
        let mut none = PlanCache::new(0);
        none.plan(&ScheduleOp::Barrier, Rank(0), 2, 1, o).unwrap();
        assert!(none.is_empty());
    }
}
