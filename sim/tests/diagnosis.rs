//! Does every error name the right rank? Over random single-fault plans, per fault kind, this
//! measures whether
//! - *live*: each survivor's first failed work blames the faulty rank, and
//! - *offline*: the diagnosis of the flight-recorder dumps blames it,
//!
//! and prints a table, fault kind × {live, offline} × {exact, tie, wrong, none}, then holds the
//! floors: ≥ 99% exact for crash, hang and each desync (op, size, dtype); ≥ 95% for isolation
//! and a cut between two sets of ranks; a slow rank (benign) must fail nothing and raise no
//! alarm, every time.
//!
//! `COHORT_DIAG_LAZY=1` runs them with lazy connection (the floors are set for the full mesh).
//! `COHORT_DIAG_PLANS` plans (default 200; CI runs the default), from `COHORT_DIAG_FIRST_SEED`
//! (default 0), on `COHORT_DIAG_THREADS` threads (default 2; each runs its simulations one
//! after another: a turmoil simulation lives on the thread that runs it). A floor miss fails
//! with the table and up to 5 `cohort sim` replay lines per failing row.
//!
//! Whom a failure blames is read in two small adapters, [`live_blame`] and [`offline_blame`]:
//! the only places that know how a report spells a blame.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Instant;

use cohort_core::analyze::FindingKind;
use cohort_core::tensor::DType;
use cohort_core::{Blame, Rank};
use cohort_sim::{
    Change, Fate, Fault, FaultPlan, Outcome, Report, Script, ScriptOp, Simulation, Step, Trigger, WorkOutcome,
};

/// The collective timeout the plans run with (the simulator's default).
const TIMEOUT_MS: u64 = 5000;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

// ---------------------------------------------------------------------------------------------
// Whom a failure blames: the two adapters.

/// Whom an error or a diagnosis blames.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Blamed {
    /// Nobody.
    Nobody,
    /// These ranks, decided.
    Ranks(BTreeSet<u32>),
    /// A cut between two sets of ranks (`near` is the reporter's side, when it has one).
    Cut { near: BTreeSet<u32>, far: BTreeSet<u32> },
    /// Undecided, with these suspects (maybe none).
    Undecided(BTreeSet<u32>),
}

/// Whom one failed work blames.
///
/// The structured `blame` when the work has one (ranks, a cut, undecided with suspects); else
/// the structured `culprit` when it is set (one rank); else the error
/// text: its `blame: …` suffix if it has one (`rank 2`, `ranks [0-1]`, `a network cut between
/// ranks [..] and ranks [..]`, `undecided, suspects [..]`); else the rank it calls `the likely
/// culprit`; else every rank the message names (`rank 2`, `rank(s) [0, 3]`) once the labels of
/// the ranks that report or relay it (`rank 3: `, `rank 0 failed first: `) are taken out.
fn live_blame(w: &WorkOutcome) -> Blamed {
    if let Some(b) = &w.blame {
        return structured(b);
    }
    if let Some(r) = w.culprit {
        return Blamed::Ranks(BTreeSet::from([r]));
    }
    let Some(text) = w.error.as_deref() else { return Blamed::Nobody };
    blame_in_text(text)
}

/// Whom an error text blames (see [`live_blame`]).
fn blame_in_text(text: &str) -> Blamed {
    if let Some(i) = text.rfind("blame: ") {
        return parse_blame_text(&text[i + "blame: ".len()..]);
    }
    if let Some(i) = text.find(" is the likely culprit") {
        let named = ranks_named(text[..i].rsplit(": ").next().unwrap_or(""));
        if !named.is_empty() {
            return Blamed::Ranks(named);
        }
    }
    let named = ranks_named(&without_labels(text));
    if named.is_empty() { Blamed::Nobody } else { Blamed::Ranks(named) }
}

/// The text without `rank N: ` and `rank N failed first: ` (who reports or relays it).
fn without_labels(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("rank ") {
        let after = &rest[i + "rank ".len()..];
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let tail = &after[digits..];
        let label = [": ", " failed first: "].into_iter().find(|l| digits > 0 && tail.starts_with(l));
        let word_start = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
        match label {
            Some(l) if word_start => {
                out.push_str(&rest[..i]);
                rest = &tail[l.len()..];
            }
            _ => {
                out.push_str(&rest[..i + "rank ".len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// A structured blame.
fn structured(b: &Blame) -> Blamed {
    let set = |r: &[Rank]| r.iter().map(|r| r.0).collect::<BTreeSet<u32>>();
    match b {
        Blame::Ranks { ranks } if ranks.is_empty() => Blamed::Nobody,
        Blame::Ranks { ranks } => Blamed::Ranks(set(ranks)),
        Blame::Cut { near, far } => Blamed::Cut { near: set(near), far: set(far) },
        Blame::Undecided { suspects } => Blamed::Undecided(set(suspects)),
    }
}

/// Whom the diagnosis of the dumps blames: its decided finding (a structured blame, or the
/// culprits of a disagreement), or the union of the culprits of several; else, when its only
/// findings are undecided (dumps missing), those suspects; else nobody.
fn offline_blame(r: &Report) -> Blamed {
    let mut decided = Vec::new();
    let mut suspects = BTreeSet::new();
    let mut undecided = false;
    for f in &r.diagnosis.findings {
        match &f.kind {
            FindingKind::Undecided { missing_dumps } => {
                undecided = true;
                suspects.extend(missing_dumps.iter().map(|r| r.0));
            }
            FindingKind::Blamed { blame, .. } => decided.push((structured(blame), f.culprits())),
            _ => {
                let culprits = f.culprits();
                decided.push((Blamed::Ranks(culprits.iter().map(|r| r.0).collect()), culprits));
            }
        }
    }
    if decided.len() == 1 {
        decided.swap_remove(0).0
    } else if !decided.is_empty() {
        Blamed::Ranks(decided.iter().flat_map(|(_, c)| c.iter().map(|r| r.0)).collect())
    } else if undecided {
        Blamed::Undecided(suspects)
    } else {
        Blamed::Nobody
    }
}

/// A blame as `Blame`'s `Display` writes it (up to the end of the text or a `;`).
fn parse_blame_text(text: &str) -> Blamed {
    let text = text.split(';').next().unwrap_or("").trim();
    if let Some(rest) = text.strip_prefix("a network cut between ") {
        let (near, far) = rest.split_once(" and ").unwrap_or((rest, ""));
        return Blamed::Cut { near: ranks_named(near), far: ranks_named(far) };
    }
    if text.starts_with("undecided") {
        return Blamed::Undecided(ranks_named(text));
    }
    let named = ranks_named(text);
    if named.is_empty() { Blamed::Nobody } else { Blamed::Ranks(named) }
}

/// Every rank a text names after the word `rank`/`ranks`/`rank(s)`/`suspects`: one number, or
/// a bracketed list of numbers and ranges (`[0-2, 5]`).
fn ranks_named(text: &str) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let word = ["rank(s) ", "ranks ", "rank ", "suspects "].into_iter().find(|w| rest.starts_with(w));
        let at_word_start = i == 0 || !bytes[i - 1].is_ascii_alphanumeric();
        let Some(word) = word.filter(|_| at_word_start) else {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        let after = &rest[word.len()..];
        if let Some(list) = after.strip_prefix('[') {
            let list = list.split(']').next().unwrap_or("");
            for part in list.split(',').map(str::trim) {
                match part.split_once('-') {
                    Some((a, b)) => {
                        if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                            out.extend(a..=b);
                        }
                    }
                    None => out.extend(part.parse::<u32>().ok()),
                }
            }
        } else {
            let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
            out.extend(digits.parse::<u32>().ok());
        }
        i += word.len();
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The plans.

/// A row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Crash,
    Hang,
    DesyncOp,
    DesyncSize,
    DesyncDtype,
    Isolate,
    Cut,
    Slow,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::Crash,
        Kind::Hang,
        Kind::DesyncOp,
        Kind::DesyncSize,
        Kind::DesyncDtype,
        Kind::Isolate,
        Kind::Cut,
        Kind::Slow,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Crash => "crash",
            Kind::Hang => "hang",
            Kind::DesyncOp => "desync (op)",
            Kind::DesyncSize => "desync (size)",
            Kind::DesyncDtype => "desync (dtype)",
            Kind::Isolate => "isolation",
            Kind::Cut => "cut (partition)",
            Kind::Slow => "slow rank (benign)",
        }
    }

    /// The least share of exact answers, in percent.
    fn floor(self) -> f64 {
        match self {
            Kind::Crash | Kind::Hang | Kind::DesyncOp | Kind::DesyncSize | Kind::DesyncDtype => 99.0,
            Kind::Isolate | Kind::Cut => 95.0,
            // Benign: the existing properties already require every run to finish with no alarm.
            Kind::Slow => 100.0,
        }
    }
}

/// xorshift64*, from the seed: this test's own draws, independent of the simulator's.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1A6_0000_0000_0029) | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// One plan: the world, the script, and the fault (time-triggered faults get their time from
/// a fault-free run of the same setup: see [`Plan::of`]).
#[derive(Debug, Clone)]
struct Plan {
    seed: u64,
    kind: Kind,
    world: u32,
    script: Script,
    fault: Fault,
}

/// What a time-triggered fault still needs: its time.
enum Draft {
    Ready(Fault),
    Timed(Box<dyn Fn(u64) -> Fault>),
}

/// The world, script and fault a seed stands for (the fault's time, if it has one, still to
/// be chosen).
fn draw(seed: u64) -> (Kind, u32, Script, Draft, Rng) {
    let mut rng = Rng::new(seed);
    let kind = Kind::ALL[rng.below(Kind::ALL.len() as u64) as usize];
    let desync = matches!(kind, Kind::DesyncOp | Kind::DesyncSize | Kind::DesyncDtype);
    // Some 2-rank worlds for desync, where the right answer is both ranks.
    let world = if desync && rng.below(5) == 0 { 2 } else { rng.range(3, 8) as u32 };
    // The default script of `cohort sim`, the broadcast's root drawn, then up to 3 more
    // collectives.
    let mut steps = vec![
        Step::new(ScriptOp::Allreduce, 4096),
        Step::new(ScriptOp::Allreduce, 4096),
        Step::new(ScriptOp::Allgather, 256),
        Step::new(ScriptOp::Broadcast, 1024).root(rng.below(u64::from(world)) as u32),
        Step::new(ScriptOp::Barrier, 0),
    ];
    for _ in 0..rng.below(4) {
        let op = ScriptOp::ALL[rng.below(ScriptOp::ALL.len() as u64) as usize];
        let numel = if op == ScriptOp::Barrier { 0 } else { rng.range(1, 2048) as usize };
        steps.push(Step::new(op, numel).root(rng.below(u64::from(world)) as u32));
    }
    let window = if rng.below(2) == 0 { 1 } else { 4 };
    let script = Script::new(steps).window(window);
    let n = script.steps.len() as u64;
    let rank = rng.below(u64::from(world)) as u32;
    let collective = rng.below(n) as usize;
    // Size and dtype desyncs at a collective that has data (a barrier has none).
    let with_data: Vec<usize> = (0..script.steps.len()).filter(|&k| script.steps[k].op != ScriptOp::Barrier).collect();
    let data_step = with_data[rng.below(with_data.len() as u64) as usize];
    let explicit = rng.below(2) == 0;
    let draft = match kind {
        Kind::Crash if rng.below(2) == 0 => Draft::Ready(Fault::Crash { rank, at: Trigger::Collective(collective) }),
        Kind::Crash => Draft::Timed(Box::new(move |t| Fault::Crash { rank, at: Trigger::AtMs(t) })),
        Kind::Hang => Draft::Ready(Fault::Hang { rank, collective }),
        Kind::DesyncOp => {
            let change = if explicit {
                let was = script.steps[collective].op;
                let others: Vec<ScriptOp> = ScriptOp::ALL.into_iter().filter(|&o| o != was).collect();
                Change::Op(others[rng.below(others.len() as u64) as usize])
            } else {
                Change::OtherOp
            };
            Draft::Ready(Fault::Desync { rank, collective, change })
        }
        Kind::DesyncSize => {
            let change = if explicit {
                let was = script.steps[data_step].numel as u64;
                let mut numel = rng.range(1, 4096);
                if numel == was {
                    numel += 1;
                }
                Change::Numel(numel as usize)
            } else {
                Change::OtherSize
            };
            Draft::Ready(Fault::Desync { rank, collective: data_step, change })
        }
        Kind::DesyncDtype => {
            // F32 → I32 keeps the width: only the recorded dtype can tell them apart.
            let change = if explicit {
                Change::Dtype([DType::F64, DType::F16, DType::I32, DType::Bf16][rng.below(4) as usize])
            } else {
                Change::OtherDtype
            };
            Draft::Ready(Fault::Desync { rank, collective: data_step, change })
        }
        Kind::Isolate => Draft::Timed(Box::new(move |t| Fault::Isolate { rank, at_ms: t, until_ms: None })),
        Kind::Cut => {
            // Both sides non-empty; with 3 or more ranks one of them has at least 2.
            let size = rng.range(1, u64::from(world) - 1) as u32;
            let from = rng.below(u64::from(world - size + 1)) as u32;
            Draft::Timed(Box::new(move |t| Fault::Cut { from, to: from + size, at_ms: t, until_ms: None }))
        }
        // Benign: all the rank's sleeps together stay below half the timeout. Less is not
        // benign: with a window, or after a broadcast it roots (a root completes once its bytes
        // are sent), a rank runs several collectives ahead of the slow one and waits for several
        // sleeps in one collective (`Fault::is_benign`'s timeout/2 per sleep is not enough: seed
        // 7901's `slow 2 2124ms`, window 1, times out for real).
        Kind::Slow => Draft::Ready(Fault::Slow { rank, delay_ms: rng.range(1, TIMEOUT_MS / 2 / n - 1) }),
    };
    (kind, world, script, draft, rng)
}

impl Plan {
    /// The plan of `seed`. A fault at a time strikes while the job runs, as seen in a
    /// fault-free run of the same world, script and seed: after every rank has joined the
    /// group, and no later than the first submission of the last collective (so that at least
    /// that collective still has data to exchange).
    fn of(seed: u64) -> Plan {
        let (kind, world, script, draft, mut rng) = draw(seed);
        let fault = match draft {
            Draft::Ready(f) => f,
            Draft::Timed(make) => {
                let clean = simulate(seed, world, &script, FaultPlan::none());
                let joined = clean.ranks.iter().filter_map(|r| r.joined_ms).max().unwrap_or(0) + 1;
                let last = script.steps.len() - 1;
                let works = clean.ranks.iter().flat_map(|r| &r.works);
                let last_submit = works.filter(|w| w.step == last).map(|w| w.submitted_ms).min().unwrap_or(joined);
                make(rng.range(joined, last_submit.max(joined)))
            }
        };
        Plan { seed, kind, world, script, fault }
    }

    fn replay(&self) -> String {
        let steps: Vec<String> = self.script.steps.iter().map(Step::to_string).collect();
        let window = if self.script.window > 1 { format!(" --window {}", self.script.window) } else { String::new() };
        format!(
            "cohort sim --seed {} --ranks {} --script '{}'{window} --faults '{}'",
            self.seed,
            self.world,
            steps.join(","),
            self.fault
        )
    }
}

fn simulate(seed: u64, world: u32, script: &Script, plan: FaultPlan) -> Report {
    Simulation::new(world)
        .seed(seed)
        .script(script.clone())
        .faults(plan)
        .lazy_connect(env("COHORT_DIAG_LAZY", 0) == 1)
        .run()
        .unwrap_or_else(|e| panic!("seed {seed}: a bad setup: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Classifying.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    /// Names exactly the right answer.
    Exact,
    /// Names the right rank(s) and others, or is undecided with them among its suspects.
    Tie,
    /// Names something that leaves the faulty rank out.
    Wrong,
    /// Names nobody.
    None,
}

/// The right answer.
#[derive(Debug, Clone)]
enum Expected {
    /// These ranks.
    Ranks(BTreeSet<u32>),
    /// The cut between `a` and `b`; a blame of ranks all on the `far` side is a tie, unless
    /// that side is one rank: cut off from every peer, it is isolated (the store aside), and
    /// naming it is exact, as for an isolation.
    Cut { a: BTreeSet<u32>, b: BTreeSet<u32>, far: BTreeSet<u32> },
}

/// How `blamed` compares with the right answer.
fn classify(blamed: &Blamed, expected: &Expected) -> Class {
    match (blamed, expected) {
        (Blamed::Nobody, _) => Class::None,
        (Blamed::Ranks(s), Expected::Ranks(e)) if s == e => Class::Exact,
        (Blamed::Ranks(s), Expected::Ranks(e)) if s.is_superset(e) => Class::Tie,
        (Blamed::Ranks(s), Expected::Cut { a, b, far }) if s == far && far.len() == 1 && (a == far || b == far) => {
            Class::Exact
        }
        (Blamed::Ranks(s), Expected::Cut { far, .. }) if !s.is_empty() && s.is_subset(far) => Class::Tie,
        (Blamed::Ranks(_), _) => Class::Wrong,
        (Blamed::Cut { near, far }, Expected::Cut { a, b, .. })
            if (near == a && far == b) || (near == b && far == a) =>
        {
            Class::Exact
        }
        // A rank cut off from every other is its isolation.
        (Blamed::Cut { near, far }, Expected::Ranks(e))
            if e.len() == 1 && (far == e || near == e) && near.len() + far.len() > 1 =>
        {
            Class::Exact
        }
        (Blamed::Cut { .. }, _) => Class::Wrong,
        (Blamed::Undecided(s), Expected::Ranks(e) | Expected::Cut { far: e, .. })
            if !e.is_empty() && s.is_superset(e) =>
        {
            Class::Tie
        }
        (Blamed::Undecided(s), _) if s.is_empty() => Class::None,
        (Blamed::Undecided(_), _) => Class::Wrong,
    }
}

/// One plan's results.
#[derive(Debug, Clone)]
struct Judged {
    plan: Plan,
    /// Per counted survivor: the class and the error text (or why there is none).
    live: Vec<(Class, String)>,
    /// Survivors whose every collective completed (nothing to blame; not counted).
    no_error: usize,
    /// Counted live blames read from the error text (no structured culprit).
    from_text: usize,
    offline: (Class, String),
    panicked: bool,
}

fn first_failed(works: &[WorkOutcome]) -> Option<&WorkOutcome> {
    works.iter().find(|w| w.outcome != Outcome::Completed)
}

/// The right answer as rank `me` sees it (`None`: the offline diagnosis, which has no side).
fn expected(fault: Fault, world: u32, me: Option<u32>) -> Expected {
    match fault {
        // With two ranks no majority says which deviated: the answer is both.
        Fault::Desync { .. } if world == 2 => Expected::Ranks(BTreeSet::from([0, 1])),
        Fault::Crash { rank, .. }
        | Fault::Hang { rank, .. }
        | Fault::Isolate { rank, .. }
        | Fault::Desync { rank, .. } => Expected::Ranks(BTreeSet::from([rank])),
        Fault::Cut { from, to, .. } => {
            let a: BTreeSet<u32> = (from..to).collect();
            let b: BTreeSet<u32> = (0..world).filter(|r| !a.contains(r)).collect();
            let far = match me {
                Some(me) if a.contains(&me) => b.clone(),
                Some(_) => a.clone(),
                None => cut_off(&a, &b).clone(),
            };
            Expected::Cut { a, b, far }
        }
        // Benign: nobody.
        Fault::Slow { .. } => Expected::Ranks(BTreeSet::new()),
        f => unreachable!("this test draws no {f}"),
    }
}

/// The side of a cut that is cut off: the smaller one (`a`, `from..to`, when they are equal).
fn cut_off<'a>(a: &'a BTreeSet<u32>, b: &'a BTreeSet<u32>) -> &'a BTreeSet<u32> {
    if a.len() <= b.len() { a } else { b }
}

/// The ranks whose errors count: all but the faulty rank (both ranks of a 2-rank desync, where
/// both are the answer), or the larger side of a cut.
fn survivors(fault: Fault, world: u32) -> Vec<u32> {
    match fault {
        Fault::Desync { .. } if world == 2 => vec![0, 1],
        Fault::Cut { from, to, .. } => {
            let a: BTreeSet<u32> = (from..to).collect();
            let b: BTreeSet<u32> = (0..world).filter(|r| !a.contains(r)).collect();
            let off = cut_off(&a, &b);
            (0..world).filter(|r| !off.contains(r)).collect()
        }
        f => {
            let faulty = f.ranks();
            (0..world).filter(|r| !faulty.contains(r)).collect()
        }
    }
}

fn judge(plan: Plan, report: &Report) -> Judged {
    let survivors = survivors(plan.fault, plan.world);
    let mut live = Vec::new();
    let mut no_error = 0;
    let mut from_text = 0;
    let offline = if plan.kind == Kind::Slow {
        // Benign: every rank finishes and the diagnosis is healthy.
        for &r in &survivors {
            let rank = &report.ranks[r as usize];
            match (&rank.fate, first_failed(&rank.works)) {
                (Fate::Finished, _) => live.push((Class::Exact, "finished".to_owned())),
                (fate, w) => {
                    live.push((Class::Wrong, w.and_then(|w| w.error.clone()).unwrap_or_else(|| format!("{fate:?}"))))
                }
            }
        }
        if report.diagnosis.is_healthy() {
            (Class::Exact, "healthy".to_owned())
        } else {
            (Class::Wrong, report.diagnosis.to_string())
        }
    } else {
        for &r in &survivors {
            let rank = &report.ranks[r as usize];
            match first_failed(&rank.works) {
                Some(w) => {
                    from_text += usize::from(w.blame.is_none() && w.culprit.is_none());
                    let class = classify(&live_blame(w), &expected(plan.fault, plan.world, Some(r)));
                    let text = w.error.clone().unwrap_or_else(|| format!("{:?} with no error text", w.outcome));
                    live.push((class, text));
                }
                None => match &rank.fate {
                    Fate::Finished => no_error += 1,
                    fate => live.push((Class::None, format!("no failed work; {fate:?}"))),
                },
            }
        }
        (classify(&offline_blame(report), &expected(plan.fault, plan.world, None)), report.diagnosis.to_string())
    };
    Judged { plan, live, no_error, from_text, offline, panicked: false }
}

// ---------------------------------------------------------------------------------------------
// The table.

#[derive(Debug, Default, Clone)]
struct Row {
    plans: usize,
    live: BTreeMap<Class, usize>,
    offline: BTreeMap<Class, usize>,
    no_error: usize,
    from_text: usize,
}

fn pct(map: &BTreeMap<Class, usize>, c: Class) -> f64 {
    let total: usize = map.values().sum();
    if total == 0 { 100.0 } else { 100.0 * map.get(&c).copied().unwrap_or(0) as f64 / total as f64 }
}

/// A share in percent with two decimals, never rounded up to a floor it misses.
fn shown(p: f64) -> String {
    format!("{:.2}%", (p * 100.0).floor() / 100.0)
}

struct Table<'a>(&'a BTreeMap<Kind, Row>);

impl fmt::Display for Table<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| fault | plans | live exact | tie | wrong | none | live exact % | offline exact | tie | wrong | none | offline exact % | floor |"
        )?;
        writeln!(f, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        for (kind, row) in self.0 {
            let c = |m: &BTreeMap<Class, usize>, k: Class| m.get(&k).copied().unwrap_or(0);
            let mark = |m: &BTreeMap<Class, usize>| if pct(m, Class::Exact) < kind.floor() { " ✗" } else { "" };
            writeln!(
                f,
                "| {} | {} | {} | {} | {} | {} | {}{} | {} | {} | {} | {} | {}{} | {}% |",
                kind.name(),
                row.plans,
                c(&row.live, Class::Exact),
                c(&row.live, Class::Tie),
                c(&row.live, Class::Wrong),
                c(&row.live, Class::None),
                shown(pct(&row.live, Class::Exact)),
                mark(&row.live),
                c(&row.offline, Class::Exact),
                c(&row.offline, Class::Tie),
                c(&row.offline, Class::Wrong),
                c(&row.offline, Class::None),
                shown(pct(&row.offline, Class::Exact)),
                mark(&row.offline),
                kind.floor(),
            )?;
        }
        Ok(())
    }
}

/// An error text with its numbers blanked, to group alike messages.
fn shape(text: &str) -> String {
    let mut out = String::new();
    let mut in_num = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !in_num {
                out.push('#');
            }
            in_num = true;
        } else {
            in_num = false;
            out.push(c);
        }
    }
    out.chars().take(300).collect()
}

thread_local! {
    static THREAD_PANICS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn run_plan(seed: u64) -> Judged {
    let plan = Plan::of(seed);
    let before = THREAD_PANICS.with(std::cell::Cell::get);
    let report = simulate(seed, plan.world, &plan.script, FaultPlan::none().with(plan.fault));
    let mut out = judge(plan, &report);
    out.panicked = THREAD_PANICS.with(std::cell::Cell::get) != before;
    out
}

#[test]
fn every_error_names_the_faulty_rank() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        THREAD_PANICS.with(|c| c.set(c.get() + 1));
        default_hook(info);
    }));
    let first = env("COHORT_DIAG_FIRST_SEED", 0);
    let n = env("COHORT_DIAG_PLANS", 200);
    let threads = env("COHORT_DIAG_THREADS", 2).max(1);
    let started = Instant::now();
    let outcomes: Vec<Judged> = common::per_seed(first..first + n, threads, run_plan);
    let elapsed = started.elapsed();

    let mut rows: BTreeMap<Kind, Row> = Kind::ALL.iter().map(|&k| (k, Row::default())).collect();
    for o in &outcomes {
        let row = rows.get_mut(&o.plan.kind).expect("every kind has a row");
        row.plans += 1;
        row.no_error += o.no_error;
        row.from_text += o.from_text;
        for (c, _) in &o.live {
            *row.live.entry(*c).or_default() += 1;
        }
        *row.offline.entry(o.offline.0).or_default() += 1;
    }
    let table = Table(&rows).to_string();
    let from_text: Vec<String> =
        rows.iter().filter(|(_, r)| r.from_text > 0).map(|(k, r)| format!("{}: {}", k.name(), r.from_text)).collect();
    let no_error: Vec<String> =
        rows.iter().filter(|(_, r)| r.no_error > 0).map(|(k, r)| format!("{}: {}", k.name(), r.no_error)).collect();
    eprintln!(
        "\n{n} plans (seeds {first}..{}) on {threads} thread(s) in {:.1} s\n\n{table}\nlive: each survivor's first failed work; survivors whose every collective completed are not counted ({}); blames read from the error text for want of a structured blame or culprit: {}\noffline: the diagnosis of the dumps\n",
        first + n,
        elapsed.as_secs_f64(),
        if no_error.is_empty() { "none".to_owned() } else { no_error.join(", ") },
        if from_text.is_empty() { "none".to_owned() } else { from_text.join(", ") },
    );

    // Below a floor: the commonest wrong/none texts, and replays.
    let mut failing = Vec::new();
    for (&kind, row) in &rows {
        for (side, map) in [("live", &row.live), ("offline", &row.offline)] {
            if pct(map, Class::Exact) >= kind.floor() {
                continue;
            }
            let mut texts: BTreeMap<(Class, String), (usize, String, String)> = BTreeMap::new();
            let mut replays = Vec::new();
            for o in outcomes.iter().filter(|o| o.plan.kind == kind) {
                let misses: Vec<&(Class, String)> = if side == "live" {
                    o.live.iter().filter(|(c, _)| *c != Class::Exact).collect()
                } else {
                    std::iter::once(&o.offline).filter(|(c, _)| *c != Class::Exact).collect()
                };
                for (c, text) in &misses {
                    let e = texts.entry((*c, shape(text))).or_insert_with(|| (0, text.clone(), o.plan.replay()));
                    e.0 += 1;
                }
                if let Some((c, text)) = misses.first()
                    && replays.len() < 5
                {
                    replays.push(format!("  {c:?}: {}\n    {}", o.plan.replay(), text.replace('\n', "\n    ")));
                }
            }
            // The three commonest texts of each kind of miss.
            let mut common: Vec<_> = texts.into_iter().collect();
            common.sort_by_key(|((c, _), (count, _, _))| (*c, std::cmp::Reverse(*count)));
            let mut shown_per_class: BTreeMap<Class, usize> = BTreeMap::new();
            let common: Vec<String> = common
                .iter()
                .filter(|((c, _), _)| {
                    let k = shown_per_class.entry(*c).or_default();
                    *k += 1;
                    *k <= 3
                })
                .map(|((c, _), (count, text, replay))| {
                    format!("  {count} × {c:?}: {}\n    {replay}", text.replace('\n', "\n    "))
                })
                .collect();
            eprintln!(
                "{} / {side}: below the {}% floor; commonest misses (3 per kind):\n{}\n",
                kind.name(),
                kind.floor(),
                common.join("\n")
            );
            failing.push(format!("{} / {side}:\n{}", kind.name(), replays.join("\n")));
        }
    }
    let panicked: Vec<String> = outcomes.iter().filter(|o| o.panicked).map(|o| o.plan.replay()).collect();
    assert!(panicked.is_empty(), "a task panicked in {} plan(s):\n{}", panicked.len(), panicked.join("\n"));
    assert!(
        failing.is_empty(),
        "{} row(s) below their floor over {n} plans:\n\n{table}\n{}",
        failing.len(),
        failing.join("\n\n")
    );
}

#[test]
fn the_adapters_read_every_way_a_blame_is_written() {
    let set = |r: &[u32]| r.iter().copied().collect::<BTreeSet<u32>>();
    assert_eq!(ranks_named("still waiting for rank(s) [0, 3]"), set(&[0, 3]));
    assert_eq!(ranks_named("connection to rank 2 lost; blame: ranks [0-2, 5]"), set(&[0, 1, 2, 5]));
    assert_eq!(ranks_named("no rank named; ranking 4"), set(&[]));
    assert_eq!(parse_blame_text("rank 3"), Blamed::Ranks(set(&[3])));
    assert_eq!(
        blame_in_text(
            "all_reduce (seq 1) failed: rank 0 failed first: rank 3: broadcast failed: desync at seq 2: rank 2 is running all_reduce"
        ),
        Blamed::Ranks(set(&[2]))
    );
    assert_eq!(
        blame_in_text(
            "rank 0: timed out; still waiting for rank(s) [3]; rank 3 → rank 1: each said it was stuck waiting for the next and rank 1 never did: rank 1 is the likely culprit"
        ),
        Blamed::Ranks(set(&[1]))
    );
    assert_eq!(blame_in_text("rank 4: connection to rank 2 lost"), Blamed::Ranks(set(&[2])));
    assert_eq!(blame_in_text("rank 4: failed; blame: undecided, suspects [1]"), Blamed::Undecided(set(&[1])));
    assert_eq!(blame_in_text("rank 4: aborted"), Blamed::Nobody);
    assert_eq!(parse_blame_text("undecided, no suspects"), Blamed::Undecided(set(&[])));
    assert_eq!(parse_blame_text("undecided, suspects [1, 4]"), Blamed::Undecided(set(&[1, 4])));
    assert_eq!(
        parse_blame_text("a network cut between ranks [0-1] and ranks [2-3]"),
        Blamed::Cut { near: set(&[0, 1]), far: set(&[2, 3]) }
    );
    let one = |r| Expected::Ranks(set(&[r]));
    assert_eq!(classify(&Blamed::Ranks(set(&[2])), &one(2)), Class::Exact);
    assert_eq!(classify(&Blamed::Ranks(set(&[1, 2])), &one(2)), Class::Tie);
    assert_eq!(classify(&Blamed::Undecided(set(&[2, 3])), &one(2)), Class::Tie);
    assert_eq!(classify(&Blamed::Undecided(set(&[2])), &one(2)), Class::Tie);
    assert_eq!(classify(&Blamed::Ranks(set(&[1])), &one(2)), Class::Wrong);
    assert_eq!(classify(&Blamed::Undecided(set(&[])), &one(2)), Class::None);
    assert_eq!(classify(&Blamed::Nobody, &one(2)), Class::None);
    let cut = Expected::Cut { a: set(&[0, 1]), b: set(&[2, 3, 4]), far: set(&[0, 1]) };
    assert_eq!(classify(&Blamed::Cut { near: set(&[2, 3, 4]), far: set(&[0, 1]) }, &cut), Class::Exact);
    assert_eq!(classify(&Blamed::Ranks(set(&[1])), &cut), Class::Tie);
    let lone = Expected::Cut { a: set(&[0, 1, 2]), b: set(&[3]), far: set(&[3]) };
    assert_eq!(classify(&Blamed::Ranks(set(&[3])), &lone), Class::Exact);
    assert_eq!(classify(&Blamed::Cut { near: set(&[0, 1, 2]), far: set(&[3]) }, &lone), Class::Exact);
    assert_eq!(classify(&Blamed::Ranks(set(&[2])), &lone), Class::Wrong);
    assert_eq!(classify(&Blamed::Ranks(set(&[3])), &cut), Class::Wrong);
    assert_eq!(classify(&Blamed::Cut { near: set(&[0]), far: set(&[1, 2, 3, 4]) }, &cut), Class::Wrong);
    assert_eq!(classify(&Blamed::Cut { near: set(&[0, 1, 3]), far: set(&[2]) }, &one(2)), Class::Exact);
}

#[test]
fn plans_are_a_function_of_the_seed_and_cover_every_kind() {
    let mut kinds = BTreeSet::new();
    for seed in 0..200 {
        let (kind, world, script, draft, _) = draw(seed);
        let (kind2, world2, script2, _, _) = draw(seed);
        assert_eq!((kind, world, &script), (kind2, world2, &script2));
        if let Draft::Ready(f) = draft {
            FaultPlan::none().with(f).validate(world, Some(&script)).unwrap();
            if let Fault::Cut { .. } = f {
                unreachable!("cuts are timed");
            }
        }
        kinds.insert(kind);
    }
    assert_eq!(kinds.len(), Kind::ALL.len());
}
