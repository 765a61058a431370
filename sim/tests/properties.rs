//! Properties of the production TCP backend under random fault plans, one simulation per seed:
//! `COHORT_SIM_SEEDS` seeds (default 200; CI runs the default), starting at
//! `COHORT_SIM_FIRST_SEED` (default 0). A failure prints the seed and the plan; replay it with
//! `cohort sim --seed S --ranks N --script … --faults …` (the message has the command).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use cohort_core::analyze::FindingKind;
use cohort_core::recorder::EntryState;
use cohort_core::work::WorkState;
use cohort_sim::{Fate, Fault, FaultPlan, Outcome, Report, Script, ScriptOp, Simulation, Step, Trigger};

/// How long after a crash every survivor's pending work must have failed (simulated ms):
/// peers read EOF at once, and a survivor not connected to the crashed rank's stream learns
/// through the failure notice; a heartbeat period is ample.
const CRASH_BOUND_MS: u64 = 500;

/// Slack on top of the collective timeout for a hang to be reported: one watchdog pass.
const HANG_SLACK_MS: u64 = 500;

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The world, script and plan a seed stands for.
fn setup(seed: u64) -> (u32, Script, FaultPlan) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xC0FF_EE00;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let world = 2 + next(4) as u32;
    let steps = (0..2 + next(4))
        .map(|_| {
            let op = ScriptOp::ALL[next(ScriptOp::ALL.len() as u64) as usize];
            let numel = if op == ScriptOp::Barrier { 0 } else { 1 + next(2048) as usize };
            Step::new(op, numel).root(next(u64::from(world)) as u32)
        })
        .collect();
    let script = Script::new(steps).window(1 + next(2) as usize);
    let plan = FaultPlan::random(seed, world, script.steps.len(), 8);
    (world, script, plan)
}

fn replay(seed: u64, world: u32, script: &Script, plan: &FaultPlan) -> String {
    format!("seed {seed}: cohort sim --seed {seed} --ranks {world} --script '{script}' --faults '{plan}'")
}

/// Every property; `Err` says which failed.
fn check(report: &Report) -> Result<(), String> {
    let timeout = report.timeout_ms;
    // 1. Every work reaches exactly one terminal state, and the group reports it once.
    for r in &report.ranks {
        if r.fate == Fate::StillRunning {
            return Err(format!("rank {} was still running at the time limit", r.rank));
        }
        let mut seen = BTreeMap::new();
        for e in &r.events {
            if !e.state.is_terminal() {
                return Err(format!("rank {}: seq {} reported in state {:?}", r.rank, e.seq, e.state));
            }
            if seen.insert(e.seq, e.state).is_some() {
                return Err(format!("rank {}: seq {} finished twice", r.rank, e.seq));
            }
        }
        for w in &r.works {
            if w.outcome == Outcome::Unfinished {
                return Err(format!("rank {}: step {} never finished ({:?})", r.rank, w.step, r.fate));
            }
            if let Some(seq) = w.seq {
                let want = match w.outcome {
                    Outcome::Completed | Outcome::Wrong => WorkState::Completed,
                    Outcome::Failed => WorkState::Failed,
                    Outcome::TimedOut => WorkState::TimedOut,
                    Outcome::Aborted => WorkState::Aborted,
                    Outcome::Refused | Outcome::Unfinished => unreachable!("refused works have no seq"),
                };
                if seen.get(&seq) != Some(&want) {
                    return Err(format!(
                        "rank {}: seq {seq} ended {want:?} but the hook saw {:?}",
                        r.rank,
                        seen.get(&seq)
                    ));
                }
            }
        }
        // 5. The dump agrees with the events.
        if let Some(dump) = &r.dump {
            for entry in dump.entries.iter().filter(|e| !e.is_p2p) {
                let Some(state) = seen.get(&entry.collective_seq_id) else {
                    if entry.state == EntryState::Completed {
                        return Err(format!(
                            "rank {}: dump says seq {} completed; no event",
                            r.rank, entry.collective_seq_id
                        ));
                    }
                    continue;
                };
                if (entry.state == EntryState::Completed) != (*state == WorkState::Completed) {
                    return Err(format!(
                        "rank {}: seq {} is {:?} in the dump but ended {state:?}",
                        r.rank, entry.collective_seq_id, entry.state
                    ));
                }
            }
        }
    }
    let fault = report.plan.faults.first().copied();
    // 2. With no fault (or a benign one) every collective completes with the right result.
    if report.plan.is_benign(timeout) || matches!(fault, Some(Fault::StoreCrash { .. })) {
        let store_crash_before_join = match fault {
            Some(Fault::StoreCrash { at_ms }) => report.ranks.iter().any(|r| r.joined_ms.is_none_or(|j| j >= at_ms)),
            _ => false,
        };
        if !store_crash_before_join {
            for r in &report.ranks {
                if r.fate != Fate::Finished {
                    return Err(format!("rank {} did not finish under a benign plan: {:?}", r.rank, r.fate));
                }
            }
            if !report.diagnosis.is_healthy() {
                return Err(format!("a false alarm: {}", report.diagnosis));
            }
        }
    }
    // Nobody computes a wrong result, whatever the fault (a dtype desync of equal width is the
    // one way to get one, and the backend must catch it).
    for r in &report.ranks {
        if let Some(w) = r.works.iter().find(|w| w.outcome == Outcome::Wrong) {
            return Err(format!("rank {}: step {}: {}", r.rank, w.step, w.error.as_deref().unwrap_or("")));
        }
    }
    match fault {
        // 3. After a crash every survivor's pending work fails within the bound, naming it.
        Some(Fault::Crash { rank, .. }) => {
            let Fate::Crashed { at_ms } = report.ranks[rank as usize].fate.clone() else { return Ok(()) };
            for r in report.ranks.iter().filter(|r| r.rank != rank) {
                for w in r.works.iter().filter(|w| w.outcome != Outcome::Completed) {
                    let end = w.ended_ms.unwrap_or(u64::MAX);
                    if end > at_ms + CRASH_BOUND_MS {
                        return Err(format!(
                            "rank {}: step {} failed at {end} ms, crash at {at_ms} ms",
                            r.rank, w.step
                        ));
                    }
                    let text = w.error.as_deref().unwrap_or("");
                    if w.culprit != Some(rank) && !text.contains(&format!("rank {rank}")) {
                        return Err(format!("rank {}: step {} does not name rank {rank}: {text}", r.rank, w.step));
                    }
                }
            }
            // A crash before any survivor joined leaves no group and no dump: then each
            // survivor's own error is the diagnosis, and it must name the rank.
            if report.ranks.iter().all(|r| r.rank == rank || r.joined_ms.is_none()) {
                for r in report.ranks.iter().filter(|r| r.rank != rank) {
                    match &r.fate {
                        Fate::InitFailed { error } if error.contains(&format!("rank {rank}")) => {}
                        other => {
                            return Err(format!(
                                "rank {} could not join, but not naming rank {rank}: {other:?}",
                                r.rank
                            ));
                        }
                    }
                }
            } else if !report.blamed().contains(&rank) {
                return Err(format!("the diagnosis does not name crashed rank {rank}: {}", report.diagnosis));
            }
        }
        // 4. After a hang every other rank fails by the timeout plus a watchdog pass (or
        // finishes, if nothing it ran needed the hung rank: a broadcast root completes once
        // its bytes are sent), and the diagnosis names the hung rank.
        Some(Fault::Hang { rank, .. }) => {
            if !matches!(report.ranks[rank as usize].fate, Fate::Hung { .. }) {
                return Ok(()); // it failed before reaching the collective
            }
            for r in report.ranks.iter().filter(|r| r.rank != rank) {
                if r.fate == Fate::Finished {
                    continue;
                }
                if !matches!(r.fate, Fate::Failed { .. }) {
                    return Err(format!("rank {} did not fail while rank {rank} hung: {:?}", r.rank, r.fate));
                }
                let w = r.works.iter().find(|w| w.outcome != Outcome::Completed).ok_or("no failed work")?;
                let end = w.ended_ms.unwrap_or(u64::MAX);
                if w.outcome != Outcome::Refused && end > w.submitted_ms + timeout + HANG_SLACK_MS {
                    return Err(format!("rank {}: step {} failed only at {end} ms", r.rank, w.step));
                }
            }
            let named = report.diagnosis.findings.iter().any(|f| match &f.kind {
                FindingKind::NeverJoined { missing, .. } => missing.iter().any(|m| m.0 == rank),
                _ => false,
            });
            if !named {
                return Err(format!("the diagnosis does not name hung rank {rank}: {}", report.diagnosis));
            }
        }
        Some(Fault::Desync { rank, .. }) => {
            let failed = report.ranks.iter().any(|r| r.fate != Fate::Finished);
            if failed && !report.blamed().contains(&rank) {
                return Err(format!("the diagnosis does not name desynced rank {rank}: {}", report.diagnosis));
            }
        }
        _ => {}
    }
    Ok(())
}

#[test]
fn random_fault_plans_keep_every_promise() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let first = env("COHORT_SIM_FIRST_SEED", 0);
    let n = env("COHORT_SIM_SEEDS", 200);
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for seed in first..first + n {
        let (world, script, plan) = setup(seed);
        let kind =
            plan.faults.first().map_or("none".to_owned(), |f| f.to_string().split(' ').next().unwrap().to_owned());
        *kinds.entry(kind).or_default() += 1;
        let before = PANICS.load(Ordering::SeqCst);
        let report = Simulation::new(world).seed(seed).script(script.clone()).faults(plan.clone()).run().unwrap();
        let mut result = check(&report);
        if PANICS.load(Ordering::SeqCst) != before {
            result = Err("a task panicked".into());
        }
        if let Err(e) = result {
            failures.push(format!("{}\n  {e}", replay(seed, world, &script, &plan)));
        }
    }
    eprintln!("{n} seeds from {first} in {:.1} s: {kinds:?}", started.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{} of {n} seeds broke a property:\n{}", failures.len(), failures.join("\n"));
}

/// A few seeds at the scale of a real job: 256 ranks, 32 to a simulated host (a full mesh: under
/// lazy connection a rank learns of a crash it is not connected to only by its timeout, which
/// the crash property does not allow). `COHORT_SIM_SCALE_SEEDS` (default 3) seeds from 0.
#[test]
fn random_fault_plans_keep_every_promise_at_256_ranks() {
    let n = env("COHORT_SIM_SCALE_SEEDS", 3);
    let world = 256;
    let started = std::time::Instant::now();
    // The seeds run side by side, one thread a core.
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get() as u64).min(n.max(1));
    let results = common::per_seed(0..n, threads, |seed| {
        let (_, script, _) = setup(seed);
        let plan = FaultPlan::random(seed, world, script.steps.len(), 8);
        let kind = plan.faults.first().map_or("none".to_owned(), ToString::to_string);
        let report = Simulation::new(world)
            .seed(seed)
            .script(script.clone())
            .faults(plan.clone())
            .ranks_per_host(32)
            .run()
            .unwrap_or_else(|e| panic!("seed {seed}: the simulation did not run: {e}"));
        let result = check(&report).map_err(|e| {
            let cmd = replay(seed, world, &script, &plan);
            format!("{cmd} --ranks-per-host 32\n  {e}")
        });
        (kind, result)
    });
    let kinds: Vec<_> = results.iter().map(|r| r.0.clone()).collect();
    let failures: Vec<_> = results.into_iter().filter_map(|r| r.1.err()).collect();
    eprintln!("{n} seeds at {world} ranks on {threads} threads in {:.1} s: {kinds:?}", started.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{} of {n} seeds broke a property:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn a_crash_at_a_time_names_the_rank_in_every_survivor() {
    let report = Simulation::new(5)
        .seed(3)
        .script(Script::allreduces(20, 4096))
        .faults(FaultPlan::none().with(Fault::Crash { rank: 4, at: Trigger::AtMs(40) }))
        .run()
        .unwrap();
    check(&report).unwrap();
    assert!(report.ranks.iter().filter(|r| r.rank != 4).all(|r| matches!(r.fate, Fate::Failed { .. })));
}
