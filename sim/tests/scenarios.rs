//! The fault scenarios of the simulator, each pinned by a snapshot of its report (outcomes,
//! simulated times, diagnosis) and replayed once more to check the report's bytes are the same.

use std::time::Duration;

use cohort_sim::{Fate, FaultPlan, Outcome, Report, Script, SetupError, Simulation};

fn run(world: u32, seed: u64, script: &str, faults: &str) -> Report {
    let sim = || {
        Simulation::new(world)
            .seed(seed)
            .script(script.parse::<Script>().unwrap())
            .faults(faults.parse::<FaultPlan>().unwrap())
    };
    let report = sim().run().unwrap();
    let again = sim().run().unwrap();
    assert_eq!(report.to_json(), again.to_json(), "seed {seed} replays to the same bytes");
    report
}

fn survivors(report: &Report) -> impl Iterator<Item = &cohort_sim::RankReport> {
    report.ranks.iter().filter(|r| !matches!(r.fate, Fate::Crashed { .. }))
}

#[test]
fn crash_mid_allreduce() {
    // Rank 2 dies as it starts the second allreduce; its peers are waiting in it.
    let report = run(4, 11, "allreduce:4096,allreduce:4096,allreduce:4096", "crash 2 @collective 1");
    insta::assert_snapshot!(report.summary());
    assert_eq!(report.ranks[2].fate, Fate::Crashed { at_ms: report.applied[0].1 });
    for r in survivors(&report) {
        let failed = r.works.iter().find(|w| w.outcome != Outcome::Completed).expect("a failed work");
        assert_eq!(failed.culprit, Some(2), "rank {}: {:?}", r.rank, failed.error);
    }
    assert_eq!(report.blamed(), vec![2]);
}

#[test]
fn hang_before_a_collective() {
    let report = run(4, 12, "allreduce:1024,broadcast:256:f32:root=3,allreduce:1024", "hang 1 @collective 1");
    insta::assert_snapshot!(report.summary());
    assert!(matches!(report.ranks[1].fate, Fate::Hung { collective: 1, .. }));
    // Every other rank fails (by its own timeout, or by an earlier one relayed to it), and
    // every one names rank 1: those waiting on a rank that waits on rank 1 follow the stuck
    // notes to it.
    for r in report.ranks.iter().filter(|r| r.rank != 1) {
        let named =
            r.works.iter().any(|w| matches!(w.outcome, Outcome::TimedOut | Outcome::Failed) && w.culprit == Some(1));
        assert!(named, "rank {} fails naming rank 1: {:?}", r.rank, r.works);
    }
    assert_eq!(report.blamed(), vec![1]);
}

#[test]
fn partition_during_allgather() {
    // Collective 1 is a large allgather (23..25 ms at this seed); the 0-3 link drops everything
    // from 24 ms on.
    let report = run(4, 13, "allreduce:64,allgather:65536,allreduce:64", "partition 0-3 @24ms");
    insta::assert_snapshot!(report.summary());
    for r in &report.ranks {
        assert!(matches!(r.fate, Fate::Failed { .. }), "rank {} fails: {:?}", r.rank, r.fate);
    }
    // The ranks at the ends of the cut link blame each other by name.
    let blame = |rank: usize| report.ranks[rank].works.iter().find_map(|w| w.culprit);
    assert_eq!(blame(0), Some(3));
    assert_eq!(blame(3), Some(0));
}

#[test]
fn desync_of_op_type() {
    let report = run(4, 14, "allreduce:256,allreduce:256,barrier", "desync 3 @collective 1 op=allgather");
    insta::assert_snapshot!(report.summary());
    assert_eq!(report.blamed(), vec![3]);
}

#[test]
fn desync_of_size() {
    let report = run(4, 15, "allreduce:256,allreduce:256,barrier", "desync 0 @collective 1 numel=100");
    insta::assert_snapshot!(report.summary());
    assert_eq!(report.blamed(), vec![0]);
    for r in &report.ranks {
        assert!(matches!(r.fate, Fate::Failed { .. }), "rank {}: the mismatch fails everyone, not a hang", r.rank);
    }
}

#[test]
fn desync_of_dtype() {
    let report = run(4, 16, "allreduce:256,allgather:64,barrier", "desync 2 @collective 1 dtype=f64");
    insta::assert_snapshot!(report.summary());
    assert_eq!(report.blamed(), vec![2]);
}

#[test]
fn a_slow_rank_still_completes_without_a_false_alarm() {
    // 400 ms late before every collective, against a 5 s timeout and 2 s heartbeats.
    let report = run(4, 17, "allreduce:1024,allgather:128,reduce_scatter:64,alltoall:32,barrier", "slow 2 400ms");
    insta::assert_snapshot!(report.summary());
    for r in &report.ranks {
        assert_eq!(r.fate, Fate::Finished, "rank {}", r.rank);
        assert!(r.works.iter().all(|w| w.outcome == Outcome::Completed));
    }
    assert!(report.diagnosis.is_healthy());
    assert!(report.end_ms >= 5 * 400, "the slow rank set the pace");
}

#[test]
fn the_store_crashing_after_init_does_not_stop_the_job() {
    let script = "allreduce:1024,allreduce:1024,allreduce:1024,allreduce:1024,allreduce:1024";
    let report = run(4, 18, script, "store-crash @100ms; slow 1 100ms");
    insta::assert_snapshot!(report.summary());
    assert_eq!(report.applied.len(), 1, "the store crashed");
    for r in &report.ranks {
        assert_eq!(r.fate, Fate::Finished, "rank {}", r.rank);
        assert!(r.joined_ms.unwrap() < 100, "rank {} joined before the crash", r.rank);
    }
}

#[test]
fn a_held_link_that_is_released_in_time_loses_nothing() {
    let report = run(3, 19, "allreduce:4096,allreduce:4096,allreduce:4096", "hold 0-1 @15ms until 900ms");
    assert_eq!(report.applied.len(), 2, "held, then released");
    for r in &report.ranks {
        assert_eq!(r.fate, Fate::Finished, "rank {}", r.rank);
    }
    assert!(report.end_ms >= 900);
}

#[test]
fn code_workloads_get_a_process_group_and_their_works_are_reported() {
    let report = Simulation::new(3)
        .seed(20)
        .workload("send/recv ring", |pg| async move {
            use cohort_core::tensor::{DType, Tensor};
            let me = pg.rank().0;
            let n = pg.world_size();
            let send =
                pg.send(Tensor::from_f64s(DType::F32, &[me as f64; 8]), (me + 1) % n, 7).map_err(|e| e.to_string())?;
            let recv =
                pg.recv(Tensor::from_f64s(DType::F32, &[0.0; 8]), (me + n - 1) % n, 7).map_err(|e| e.to_string())?;
            let got = recv.await.map_err(|e| e.to_string())?;
            send.await.map_err(|e| e.to_string())?;
            let want = ((me + n - 1) % n) as f64;
            if got[0].to_f64s() != vec![want; 8] {
                return Err(format!("rank {me} received {:?}", got[0].to_f64s()).into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok(())
        })
        .run()
        .unwrap();
    for r in &report.ranks {
        assert_eq!(r.fate, Fate::Finished, "rank {}", r.rank);
        assert_eq!(r.events.len(), 2, "rank {}: a send and a recv finished: {:?}", r.rank, r.events);
    }
    assert!(report.summary().contains("send/recv ring"));
}

#[test]
fn bad_setups_are_refused_with_the_reason() {
    let e = Simulation::new(0).seed(1).run().unwrap_err();
    assert_eq!(e, SetupError::NoRanks);
    let e = Simulation::new(2).seed(1).faults("crash 5 @10ms".parse().unwrap()).run().unwrap_err();
    assert!(e.to_string().contains("rank 5 is not a rank of a 2-rank world"), "{e}");
    let e = Simulation::new(2).seed(1).script("broadcast:4:f32:root=2".parse().unwrap()).run().unwrap_err();
    assert!(matches!(e, SetupError::Script(_)) && e.to_string().contains("root 2"), "{e}");
}

#[test]
fn a_receive_whose_send_never_comes_names_the_sender() {
    let report = Simulation::new(3)
        .seed(21)
        .workload("rank 1 forgets a send", |pg| async move {
            use cohort_core::tensor::{DType, Tensor};
            let me = pg.rank().0;
            if me == 0 {
                let work = pg.recv(Tensor::from_f64s(DType::F32, &[0.0; 4]), 1, 3).map_err(|e| e.to_string())?;
                work.await.map_err(|e| e.to_string())?;
            }
            // Ranks 1 and 2 stay up a while, then leave; rank 1 never sends.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(())
        })
        .run()
        .unwrap();
    let Fate::Failed { error } = &report.ranks[0].fate else { panic!("{:?}", report.ranks[0].fate) };
    assert!(error.contains("rank 1"), "{error}");
    assert_eq!(report.blamed(), vec![1], "{}", report.diagnosis);
    assert!(report.diagnosis.to_string().contains("rank 1 never sent what receive #1 on rank 0 waits for"));
}

#[test]
fn a_large_report_shows_one_rank_for_the_majority_and_every_rank_that_differs() {
    let report = run(24, 12, "allreduce:1024,allreduce:1024,allreduce:1024", "hang 17 @collective 1");
    let text = report.summary();
    let rank_lines: Vec<&str> = text.lines().filter(|l| l.starts_with("rank")).collect();
    // Rank 17 hangs; the others fail alike, naming it. The hung rank is shown on its own, the
    // rest fold into one entry that lists them as ranges.
    assert!(matches!(report.ranks[17].fate, Fate::Hung { collective: 1, .. }));
    assert!(rank_lines.iter().any(|l| l.starts_with("rank 17: hung before collective 1")), "{text}");
    let folded = rank_lines.iter().find(|l| l.starts_with("ranks ")).unwrap_or_else(|| panic!("{text}"));
    assert!(folded.contains("alike; rank 0 shown"), "{folded}");
    let listed: usize = rank_lines.len() - 1;
    let alike: usize = folded.split(" (").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    assert_eq!(alike + listed, 24, "every rank is in the folded entry or shown on its own: {text}");
    assert!(listed < 24 / 2, "most ranks fold: {text}");
    assert_eq!(report.blamed(), vec![17]);
}
