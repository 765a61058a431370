//! Four ranks' `GroupState`s driven in memory on a virtual clock: a few allreduces complete,
//! then rank 2 never calls the next one, and every other rank's watchdog names it.
//!
//! Run: `cargo run -p cohort-core --example hung_rank`

use std::time::{Duration, Instant};

use cohort_core::group::{Collective, Completion, ErrorHandling, Event, GroupConfig, GroupState, TensorSpec};
use cohort_core::{DType, OpType, Rank, SeqNo, WorkId};

const WORLD: u32 = 4;
const HUNG: u32 = 2;

fn main() {
    #[allow(clippy::disallowed_methods)] // the example's one epoch; everything after is virtual
    let t0 = Instant::now();
    let mut now = t0;
    let mut ranks: Vec<GroupState> = (0..WORLD)
        .map(|r| {
            let mut cfg = GroupConfig::new(WORLD);
            cfg.timeout = Duration::from_secs(2);
            cfg.heartbeat = None;
            cfg.error_handling = ErrorHandling::CleanUpOnly;
            GroupState::new(cfg, Rank(r), t0)
        })
        .collect();
    // Which rank has launched which collective: a seq completes once every rank launched it.
    let mut launched: Vec<Vec<(SeqNo, WorkId)>> = vec![Vec::new(); WORLD as usize];
    let spec = vec![TensorSpec::new(DType::F32, &[1 << 20])];

    for step in 1..=5u64 {
        for (r, g) in ranks.iter_mut().enumerate() {
            if step == 5 && r as u32 == HUNG {
                println!("t={:>5} ms  rank {r} hangs before allreduce #{step}", (now - t0).as_millis());
                continue;
            }
            g.submit(now, Collective::new(OpType::Allreduce).inputs(spec.clone())).expect("healthy group");
            while let Some(l) = g.poll_launch() {
                g.handle_started(now, l.id);
                launched[r].push((l.seq, l.id));
            }
        }
        now += Duration::from_millis(7);
        let seq = SeqNo(step);
        let everyone = launched.iter().all(|l| l.iter().any(|&(s, _)| s == seq));
        for (r, g) in ranks.iter_mut().enumerate() {
            let Some(&(_, id)) = launched[r].iter().find(|&&(s, _)| s == seq) else { continue };
            if everyone {
                g.handle_completion(now, id, Completion::Success);
            } else {
                let missing: Vec<Rank> =
                    (0..WORLD).filter(|&o| !launched[o as usize].iter().any(|&(s, _)| s == seq)).map(Rank).collect();
                g.handle_waiting_on(now, id, &missing);
            }
        }
        report(&mut ranks);
    }

    // Nothing else happens: sleep until the earliest deadline and let the watchdogs fire.
    let deadline = ranks.iter().filter_map(GroupState::poll_timeout).min().expect("a work is pending");
    for g in &mut ranks {
        g.handle_timeout(deadline);
    }
    report(&mut ranks);
}

fn report(ranks: &mut [GroupState]) {
    for g in ranks.iter_mut() {
        let r = g.rank();
        while g.poll_transmit().is_some() {}
        while let Some(e) = g.poll_event() {
            match e {
                Event::WorkFinished(w) => {
                    let at = w.lifecycle.finished_at().unwrap_or_default().as_millis();
                    println!("t={at:>5} ms  rank {r}: {} seq {} {:?}: {}", w.op, w.seq, w.lifecycle.state(), w.result);
                }
                Event::GroupFailed(f) => {
                    println!("          rank {r}: group failed, culprit {:?}", f.culprit().map(|c| c.0))
                }
                _ => {}
            }
        }
    }
}
