//! DDP's bucketed reducer inside the simulator: exact averages over simulated links, and a rank
//! lost in the middle of a step fails the step on every survivor, naming it.

use std::time::Duration;

use cohort_core::tensor::{DType, Tensor};
use cohort_sim::{Fate, Fault, FaultPlan, Simulation, Trigger};
use cohort_transports::ddp::{AllreduceHook, BucketCaps, Reducer};

fn shapes() -> Vec<Vec<usize>> {
    vec![vec![64, 32], vec![32], vec![16, 16, 4], vec![128], vec![7]]
}

/// Rank `r`'s gradient of parameter `p` at `step`: small integers, so averages over 4 ranks
/// are exact.
fn grad(r: u32, p: usize, step: u32, n: usize) -> Vec<f64> {
    (0..n).map(|i| ((i + p + step as usize + 4 * r as usize) % 7) as f64).collect()
}

fn ddp(world: u32, steps: u32, pause: Duration, plan: FaultPlan) -> cohort_sim::Report {
    Simulation::new(world)
        .seed(u64::from(world) * 100 + u64::from(steps))
        .faults(plan)
        .workload("ddp reducer", move |pg| async move {
            let caps = BucketCaps { first: 4096, rest: 12_000 };
            let mut reducer = Reducer::with_caps(pg.clone(), shapes(), DType::F32, Box::new(AllreduceHook), caps)
                .map_err(|e| e.to_string())?;
            let me = pg.rank().0;
            let n = pg.world_size();
            for step in 0..steps {
                for p in (0..shapes().len()).rev() {
                    let numel: usize = shapes()[p].iter().product();
                    let g = Tensor::from_f64s(DType::F32, &grad(me, p, step, numel));
                    reducer.mark_ready(p, &g).map_err(|e| e.to_string())?;
                }
                let out = reducer.finish_async().await.map_err(|e| format!("step {step}: {e}"))?;
                for (p, t) in out.iter().enumerate() {
                    let numel: usize = shapes()[p].iter().product();
                    let want: Vec<f64> = (0..numel)
                        .map(|i| (0..n).map(|q| grad(q, p, step, numel)[i]).sum::<f64>() / f64::from(n))
                        .collect();
                    if t.to_f64s() != want {
                        return Err(format!("step {step}: parameter {p} is not the exact average").into());
                    }
                }
                tokio::time::sleep(pause).await;
            }
            Ok(())
        })
        .run()
        .unwrap()
}

#[test]
fn the_bucketed_average_is_exact_over_simulated_links() {
    let report = ddp(4, 3, Duration::from_millis(5), FaultPlan::none());
    for r in &report.ranks {
        assert_eq!(r.fate, Fate::Finished, "rank {}", r.rank);
        assert_eq!(r.events.len(), 2 * 3, "rank {}: two buckets a step, three steps", r.rank);
    }
    assert!(report.diagnosis.is_healthy());
}

#[test]
fn a_rank_lost_during_a_step_fails_the_step_naming_it() {
    // Steps every 20 ms from about 20 ms; rank 2 dies at 75 ms, inside a step or between two.
    let plan = FaultPlan::none().with(Fault::Crash { rank: 2, at: Trigger::AtMs(75) });
    let report = ddp(4, 20, Duration::from_millis(20), plan);
    assert!(matches!(report.ranks[2].fate, Fate::Crashed { at_ms: 75 }));
    for r in report.ranks.iter().filter(|r| r.rank != 2) {
        let Fate::Failed { error } = &r.fate else { panic!("rank {} did not fail: {:?}", r.rank, r.fate) };
        assert!(error.contains("rank 2"), "rank {}: {error}", r.rank);
        let last = r.events.last().expect("events");
        assert!(last.at_ms <= 75 + 500, "rank {} learned within 500 ms: {last:?}", r.rank);
    }
    assert_eq!(report.blamed(), vec![2]);
}
