//! The NCCL process group in the simulator, over the emulated device and communicator: device
//! faults, crashes and hangs name the right rank, the same way on every replay, and random
//! plans keep the lifecycle's promises (`COHORT_SIM_NCCL_SEEDS` seeds, default 60).

use std::collections::BTreeMap;

use cohort_sim::{
    Backend, DeviceFault, Fate, Fault, FaultPlan, Outcome, Report, Script, ScriptOp, SetupError, Simulation, Step,
};

const DEFAULT_SCRIPT: &str = "allreduce:4096,allreduce:4096,allgather:256,broadcast:1024,barrier";

fn run(world: u32, seed: u64, script: &Script, plan: &FaultPlan) -> Report {
    Simulation::new(world).seed(seed).script(script.clone()).faults(plan.clone()).backend(Backend::Nccl).run().unwrap()
}

/// Every surviving rank's failed work names `culprit`, structurally.
fn survivors_name(report: &Report, culprit: u32) -> Result<(), String> {
    for r in report.ranks.iter().filter(|r| r.rank != culprit) {
        let failed: Vec<_> = r.works.iter().filter(|w| w.outcome != Outcome::Completed).collect();
        if failed.is_empty() {
            return Err(format!("rank {} finished everything", r.rank));
        }
        for w in failed {
            if w.culprit != Some(culprit) {
                return Err(format!(
                    "rank {} step {}: blames {:?}, not {culprit}: {}",
                    r.rank,
                    w.step,
                    w.culprit,
                    w.error.as_deref().unwrap_or("")
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn device_faults_crashes_and_hangs_name_the_rank_every_time() {
    let script: Script = DEFAULT_SCRIPT.parse().unwrap();
    for fault in ["kernel-hang:2@seq3", "nccl-error:2@seq3", "crash:2@seq3", "hang:2@seq3"] {
        let plan: FaultPlan = fault.parse().unwrap();
        let report = run(4, 11, &script, &plan);
        survivors_name(&report, 2).unwrap_or_else(|e| panic!("{fault}: {e}\n{report}"));
        match fault {
            // The dumps alone name it too: it never started there / never joined.
            "kernel-hang:2@seq3" | "hang:2@seq3" => assert_eq!(report.blamed(), vec![2], "{fault}\n{report}"),
            // A crashed rank leaves no dump: the diagnosis says it is the one to look at.
            "crash:2@seq3" => assert!(report.blamed().contains(&2), "{fault}\n{report}"),
            _ => {}
        }
        // Replay: the same bytes.
        let again = run(4, 11, &script, &plan);
        assert_eq!(report.to_json(), again.to_json(), "{fault}: a replay differs");
    }
}

#[test]
fn a_slow_kernel_is_benign_and_a_fault_free_run_checks_every_result() {
    let script: Script = DEFAULT_SCRIPT.parse().unwrap();
    for plan in [FaultPlan::none(), "slow-kernel:1@seq2".parse().unwrap()] {
        let report = run(3, 5, &script, &plan);
        assert!(report.ranks.iter().all(|r| r.fate == Fate::Finished), "{report}");
        assert!(report.diagnosis.is_healthy(), "{report}");
    }
}

#[test]
fn link_faults_and_device_faults_are_refused_where_they_cannot_apply() {
    let e = Simulation::new(2).faults("partition:0-1@t=5ms".parse().unwrap()).backend(Backend::Nccl).run().unwrap_err();
    assert!(matches!(e, SetupError::LinkFaultUnderNccl(_)), "{e:?}");
    assert!(e.to_string().contains("isolate a rank instead"), "{e}");
    let e = Simulation::new(2).faults("kernel-hang:1@seq1".parse().unwrap()).run().unwrap_err();
    assert!(matches!(e, SetupError::DeviceFaultNeedsNccl(_)), "{e:?}");
    assert!(e.to_string().contains("device faults need the NCCL backend"), "{e}");
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Every work ends exactly once and every failure names a rank.
fn check(report: &Report) -> Result<(), String> {
    let fault = report.plan.faults.first().copied();
    let faulty = fault.map(|f| f.ranks()[0]);
    for r in &report.ranks {
        if r.fate == Fate::StillRunning {
            return Err(format!("rank {} was still running at the time limit", r.rank));
        }
        let mut seen = BTreeMap::new();
        for e in &r.events {
            if !e.state.is_terminal() || seen.insert(e.seq, e.state).is_some() {
                return Err(format!("rank {}: seq {} reported twice or unfinished", r.rank, e.seq));
            }
        }
        for w in &r.works {
            if w.outcome == Outcome::Unfinished {
                return Err(format!("rank {}: step {} never finished ({:?})", r.rank, w.step, r.fate));
            }
            if w.outcome == Outcome::Wrong {
                return Err(format!("rank {}: step {}: {}", r.rank, w.step, w.error.as_deref().unwrap_or("")));
            }
            if w.outcome == Outcome::Completed {
                continue;
            }
            let named = w.culprit.is_some() || w.error.as_deref().is_some_and(|e| e.contains("rank "));
            if !named {
                return Err(format!("rank {}: step {} names no rank: {:?}", r.rank, w.step, w.error));
            }
            // A rank other than the faulty one blames the faulty one.
            if Some(r.rank) != faulty && w.culprit.is_some() && w.culprit != faulty {
                return Err(format!(
                    "rank {}: step {} blames {:?}, the fault was on {faulty:?}: {}",
                    r.rank,
                    w.step,
                    w.culprit,
                    w.error.as_deref().unwrap_or("")
                ));
            }
        }
    }
    if report.plan.is_benign(report.timeout_ms) && report.ranks.iter().any(|r| r.fate != Fate::Finished) {
        return Err("a benign plan did not finish".into());
    }
    Ok(())
}

#[test]
fn random_nccl_plans_keep_every_promise() {
    let n = env("COHORT_SIM_NCCL_SEEDS", 60);
    let mut failures = Vec::new();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for seed in 0..n {
        let world = 2 + (seed % 4) as u32;
        let ops = [
            ScriptOp::Allreduce,
            ScriptOp::Allgather,
            ScriptOp::Broadcast,
            ScriptOp::ReduceScatter,
            ScriptOp::Alltoall,
        ];
        let steps: Vec<Step> = (0..4).map(|i| Step::new(ops[((seed + i) % 5) as usize], 64 + i as usize)).collect();
        let script = Script::new(steps).window(1 + (seed % 2) as usize);
        let plan = FaultPlan::random_nccl(seed, world, script.steps.len());
        let kind = match plan.faults.first() {
            None => "none".to_owned(),
            Some(Fault::Device { kind, .. }) => kind.name().to_owned(),
            Some(f) => f.to_string().split(' ').next().unwrap_or("").to_owned(),
        };
        *kinds.entry(kind).or_default() += 1;
        let report = run(world, seed, &script, &plan);
        if let Err(e) = check(&report) {
            failures.push(format!(
                "seed {seed}: cohort sim --backend nccl --seed {seed} --ranks {world} --script '{script}' --faults '{plan}'\n  {e}"
            ));
        }
    }
    eprintln!("{n} NCCL seeds: {kinds:?}");
    assert!(kinds.len() >= 5, "the seeds should draw every kind of fault: {kinds:?}");
    assert!(failures.is_empty(), "{} of {n} seeds broke a property:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn the_device_fault_names_read_back() {
    let f: Fault = "nccl-error 3 @collective 1".parse().unwrap();
    assert_eq!(f, Fault::Device { rank: 3, collective: 1, kind: DeviceFault::NcclError });
}
