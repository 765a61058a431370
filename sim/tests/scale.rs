//! 64 simulated ranks: a mesh of 4032 connections (2016 pairs, one per direction), an
//! allreduce, one crash. The wall time is printed (the note quotes it from a release run); the
//! assertions are about behaviour.

use cohort_sim::{Fate, FaultPlan, Outcome, Script, Simulation};

#[test]
fn sixty_four_ranks_allreduce_and_survive_a_crash_naming_it() {
    let started = std::time::Instant::now();
    let report = Simulation::new(64)
        .seed(64)
        .script(Script::allreduces(3, 4096))
        .faults("crash 17 @collective 1".parse::<FaultPlan>().unwrap())
        .run()
        .unwrap();
    eprintln!("64 ranks: {} ms simulated in {:.2} s of wall time", report.end_ms, started.elapsed().as_secs_f64());
    let crash_ms = report.applied[0].1;
    assert_eq!(report.ranks[17].fate, Fate::Crashed { at_ms: crash_ms });
    // Rank 17 finished the first allreduce (it crashed starting the second); the others may
    // still have been in it, waiting for chunks that pass through rank 17.
    assert_eq!(report.ranks[17].works[0].outcome, Outcome::Completed);
    for r in report.ranks.iter().filter(|r| r.rank != 17) {
        let failed = r.works.iter().find(|w| w.outcome != Outcome::Completed).expect("a failed work");
        assert_eq!(failed.culprit, Some(17), "rank {}: {:?}", r.rank, failed.error);
        assert!(failed.ended_ms.unwrap() <= crash_ms + 500, "rank {} learned within 500 ms", r.rank);
    }
    assert_eq!(report.blamed(), vec![17]);
}
