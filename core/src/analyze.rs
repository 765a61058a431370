//! Cross-rank diagnosis from flight-recorder dumps: the first collective the ranks of a group do
//! not agree on, and who is to blame — the question "a job hung: which rank, which collective,
//! why?" answered from the dumps of every rank (ours, or PyTorch's schema 2.x).
//!
//! For each process group, collectives are lined up by `collective_seq_id` across ranks,
//! starting where every rank's ring still holds its entries, and the first one that differs is
//! classified as PyTorch's flight-recorder analyzer does (a mismatch among the ranks that
//! joined is reported before ranks that never joined: the failure a desync causes makes the
//! late ranks' groups refuse the collective, so their absence is a symptom, not the cause):
//!
//! | finding | meaning |
//! |---|---|
//! | [`FindingKind::NeverJoined`] | some ranks never enqueued it: they are hung or elsewhere |
//! | [`FindingKind::OpMismatch`] | ranks called different collectives at the same seq (desync) |
//! | [`FindingKind::SizeMismatch`] | same collective, different input sizes |
//! | [`FindingKind::DtypeMismatch`] | same collective, different dtypes |
//! | [`FindingKind::StateMismatch`] | some ranks completed it, others are stuck in it |
//! | [`FindingKind::NeverStarted`] | every rank enqueued it, none completed it, and on some it never started (their device was stuck before it) |
//! | [`FindingKind::P2pMismatch`] | a send and its receive disagree on size or dtype, or one side never posted |
//! | [`FindingKind::Undecided`] | dumps are missing, so the culprit cannot be named |
//! | [`FindingKind::Blamed`] | what the ranks' own failures blamed (`cohort_blame`), when most dumps agree and the dumps alone cannot decide |
//!
//! The dumps alone cannot see a crashed rank (it leaves no dump) or a network cut (every rank
//! just stops). But our dumps also keep whom each failed work blamed when it failed. When the
//! comparison is undecided, finds nothing, or only finds ranks stuck, and more than half of
//! the dumps that recorded a failure blame the same rank(s) or the same cut, that blame is the
//! finding. A cut with one rank alone on its side is that rank (cut off from the rest).
//!
//! Point-to-point ops are paired per ordered pair of ranks, in record order (the i-th send from
//! a to b with the i-th receive on b from a, as `send a->b` / `recv b<-a` name them); they are
//! checked when a group's collectives agree. A receiver's `recv_any_source` entries, in
//! record order, take the sends to it that no named receive took, oldest send first (the
//! order the receiver's data plane met them), and are then checked like named pairs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::recorder::{Dump, DumpEntry, EntryState};
use crate::schedule::MAX_WORLD_SIZE;
use crate::work::{Blame, OpType, Rank, WorkState};

/// What is wrong with one collective.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum FindingKind {
    /// These ranks never enqueued the collective; the others are waiting in it.
    NeverJoined {
        /// The ranks that never joined (the culprits).
        missing: Vec<Rank>,
        /// The ranks that did.
        waiting: Vec<Rank>,
    },
    /// Ranks called different collectives at this seq.
    OpMismatch {
        /// Op name → ranks that called it.
        by_op: BTreeMap<String, Vec<Rank>>,
    },
    /// Input sizes differ.
    SizeMismatch {
        /// Sizes (as text) → ranks.
        by_size: BTreeMap<String, Vec<Rank>>,
    },
    /// Input dtypes differ.
    DtypeMismatch {
        /// Dtypes (as text) → ranks.
        by_dtype: BTreeMap<String, Vec<Rank>>,
    },
    /// Some ranks completed it, others did not.
    StateMismatch {
        /// Ranks that completed it.
        completed: Vec<Rank>,
        /// Ranks stuck in it.
        stuck: Vec<Rank>,
    },
    /// Every rank enqueued it and none completed it, but on some it never started: their
    /// device was stuck in something before it (a hung kernel), while the others started it
    /// and wait for them. Backends that see a kernel start (NCCL's start events) show this.
    NeverStarted {
        /// Ranks where it never started (the culprits).
        not_started: Vec<Rank>,
        /// Ranks where it started.
        started: Vec<Rank>,
    },
    /// Point-to-point: the i-th send from `sender` to `receiver` and the i-th receive on
    /// `receiver` from `sender` disagree on size or dtype, or one side never posted its half
    /// while the other waits for it.
    P2pMismatch {
        /// The sending rank.
        sender: Rank,
        /// The receiving rank.
        receiver: Rank,
        /// What is wrong.
        problem: String,
        /// Who is to blame: the side that never posted, or both when they disagree.
        blame: Vec<Rank>,
    },
    /// Dumps are missing: the culprit may be among these ranks.
    Undecided {
        /// Ranks without a dump.
        missing_dumps: Vec<Rank>,
    },
    /// What the ranks' own failures blamed, agreed by more than half of the dumps that
    /// recorded a failure in this group.
    Blamed {
        /// The blame.
        blame: Blame,
        /// The ranks whose dumps say so.
        by: Vec<Rank>,
        /// Ranks without a dump.
        missing_dumps: Vec<Rank>,
    },
}

/// The first disagreement in one process group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// The group's id.
    pub pg_id: u64,
    /// The group's description, when a dump had it.
    pub pg_desc: String,
    /// The collective's seq.
    pub seq: u64,
    /// The op (profiling name without the backend prefix), as the majority recorded it.
    pub op: String,
    /// What is wrong.
    pub kind: FindingKind,
}

impl Finding {
    /// The ranks this finding blames.
    pub fn culprits(&self) -> Vec<Rank> {
        match &self.kind {
            FindingKind::NeverJoined { missing, .. } => missing.clone(),
            FindingKind::StateMismatch { stuck, .. } => stuck.clone(),
            FindingKind::NeverStarted { not_started, .. } => not_started.clone(),
            FindingKind::Undecided { missing_dumps } => missing_dumps.clone(),
            FindingKind::Blamed { blame: Blame::Cut { near, far }, .. } => {
                // The smaller side of a cut (both, when even) is where to look first.
                let mut out = match near.len().cmp(&far.len()) {
                    std::cmp::Ordering::Less => near.clone(),
                    std::cmp::Ordering::Greater => far.clone(),
                    std::cmp::Ordering::Equal => near.iter().chain(far).copied().collect(),
                };
                out.sort();
                out
            }
            FindingKind::Blamed { blame, .. } => blame.named().to_vec(),
            FindingKind::P2pMismatch { blame, .. } => blame.clone(),
            FindingKind::OpMismatch { by_op: by }
            | FindingKind::SizeMismatch { by_size: by }
            | FindingKind::DtypeMismatch { by_dtype: by } => minority(by),
        }
    }
}

/// The diagnosis of a whole job: one finding per group that has one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diagnosis {
    /// Ranks whose dumps were read.
    pub ranks: Vec<Rank>,
    /// Findings, by group id.
    pub findings: Vec<Finding>,
}

impl Diagnosis {
    /// Whether every group's ranks agree on every collective in the dumps.
    pub fn is_healthy(&self) -> bool {
        self.findings.is_empty()
    }

    /// As JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a diagnosis is plain data")
    }
}

/// A rank list as ranges (`[0-16, 18-4095]`): readable at thousands of ranks; `--json` keeps
/// every rank.
fn ranks_text(ranks: &[Rank]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    crate::work::rank_ranges(&sorted)
}

fn groups_text(by: &BTreeMap<String, Vec<Rank>>) -> String {
    by.iter().map(|(k, r)| format!("{k} on ranks {}", ranks_text(r))).collect::<Vec<_>>().join("; ")
}

/// The ranks outside the largest group; when the largest size is shared (two ranks that
/// disagree, say), there is no majority and every rank is a suspect.
fn minority(by: &BTreeMap<String, Vec<Rank>>) -> Vec<Rank> {
    let Some(most) = by.values().map(Vec::len).max() else { return Vec::new() };
    let tied = by.values().filter(|r| r.len() == most).count() > 1;
    let mut out: Vec<Rank> = by.values().filter(|r| tied || r.len() != most).flat_map(|r| r.iter().copied()).collect();
    out.sort();
    out
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pg = if self.pg_desc.is_empty() {
            format!("pg {}", self.pg_id)
        } else {
            format!("pg {} ({})", self.pg_id, self.pg_desc)
        };
        if let FindingKind::P2pMismatch { sender, receiver, problem, .. } = &self.kind {
            return write!(f, "{pg}: send/recv {sender}->{receiver} (sender's p2p seq {}): {problem}", self.seq);
        }
        if self.op.is_empty() {
            // Past the last collective any dump holds.
            write!(f, "{pg}: after collective seq {}: ", self.seq.saturating_sub(1))?;
        } else {
            write!(f, "{pg}: collective seq {} ({}): ", self.seq, self.op)?;
        }
        match &self.kind {
            FindingKind::NeverJoined { missing, waiting } => write!(
                f,
                "rank(s) {} never joined it; rank(s) {} are waiting in it",
                ranks_text(missing),
                ranks_text(waiting)
            ),
            FindingKind::OpMismatch { by_op } => {
                write!(f, "ranks called different collectives: {}", groups_text(by_op))
            }
            FindingKind::SizeMismatch { by_size } => write!(f, "input sizes differ: {}", groups_text(by_size)),
            FindingKind::DtypeMismatch { by_dtype } => write!(f, "dtypes differ: {}", groups_text(by_dtype)),
            FindingKind::StateMismatch { completed, stuck } => {
                write!(f, "rank(s) {} completed it but rank(s) {} did not", ranks_text(completed), ranks_text(stuck))
            }
            FindingKind::NeverStarted { not_started, started } => write!(
                f,
                "every rank enqueued it, but it never started on rank(s) {} (their device was stuck before it) while rank(s) {} started it and wait",
                ranks_text(not_started),
                ranks_text(started)
            ),
            FindingKind::P2pMismatch { .. } => Ok(()),
            FindingKind::Undecided { missing_dumps } => write!(
                f,
                "undecided: no dump from rank(s) {}; the culprit may be among them",
                ranks_text(missing_dumps)
            ),
            FindingKind::Blamed { blame, by, missing_dumps } => {
                if !missing_dumps.is_empty() {
                    write!(f, "no dump from rank(s) {}; ", ranks_text(missing_dumps))?;
                }
                write!(f, "the failures recorded by rank(s) {} blame {blame}", ranks_text(by))
            }
        }
    }
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ranks.is_empty() {
            return write!(f, "no dumps: there is nothing to compare (a rank that never joined a group leaves none)");
        }
        if self.findings.is_empty() {
            return write!(f, "no disagreement: the {} dumps agree on every collective they hold", self.ranks.len());
        }
        for (i, finding) in self.findings.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{finding}")?;
            let culprits = finding.culprits();
            if !culprits.is_empty() && !matches!(finding.kind, FindingKind::Undecided { .. }) {
                write!(f, "\n  culprit rank(s): {}", ranks_text(&culprits))?;
            }
        }
        Ok(())
    }
}

/// The op name without the backend prefix (`tcp:all_reduce` → `all_reduce`).
fn op_name(e: &DumpEntry) -> &str {
    e.profiling_name.split_once(':').map_or(e.profiling_name.as_str(), |(_, op)| op)
}

/// Diagnose a job from its ranks' dumps. Each dump names its rank (ours do); for dumps that do
/// not (torch's), pass the rank with it. `world_size` is the job's size (taken from the dumps
/// when `None`; a dump's size above [`MAX_WORLD_SIZE`] is not believed). Missing dumps are
/// named among the first [`MAX_WORLD_SIZE`] ranks.
pub fn diagnose(dumps: &[(Rank, Dump)], world_size: Option<u32>) -> Diagnosis {
    let world = world_size
        .or_else(|| dumps.iter().filter_map(|(_, d)| d.world_size).filter(|&w| w <= MAX_WORLD_SIZE).max())
        .unwrap_or_else(|| dumps.iter().map(|(r, _)| r.0.saturating_add(1)).max().unwrap_or(0));
    let have: BTreeSet<Rank> = dumps.iter().map(|(r, _)| *r).collect();
    // A corrupt or hostile file's size of four billion must not list four billion ranks.
    let missing_dumps: Vec<Rank> = (0..world.min(MAX_WORLD_SIZE)).map(Rank).filter(|r| !have.contains(r)).collect();

    // pg id → rank → seq → entry
    let mut groups: BTreeMap<u64, BTreeMap<Rank, BTreeMap<u64, &DumpEntry>>> = BTreeMap::new();
    let mut descs: BTreeMap<u64, String> = BTreeMap::new();
    for (rank, dump) in dumps {
        for e in dump.entries.iter().filter(|e| !e.is_p2p) {
            groups.entry(e.pg_id).or_default().entry(*rank).or_default().insert(e.collective_seq_id, e);
            descs.entry(e.pg_id).or_insert_with(|| e.process_group.1.clone());
        }
        // A rank with no entry for a group it belongs to still counts as a member.
        for cfg in dump.pg_config.values() {
            if let Ok(id) = cfg.name.parse::<u64>() {
                groups.entry(id).or_default().entry(*rank).or_default();
            }
        }
    }

    // pg id → (sender, receiver) → (the sender's sends to the receiver, the receiver's receives
    // from the sender), each in record order.
    let mut p2p: BTreeMap<u64, P2pPairs<'_>> = BTreeMap::new();
    // pg id → receiver → its receives from any source, in record order.
    let mut any_source: BTreeMap<u64, BTreeMap<Rank, Vec<&DumpEntry>>> = BTreeMap::new();
    for (rank, dump) in dumps {
        for e in dump.entries.iter().filter(|e| e.is_p2p) {
            let pairs = p2p.entry(e.pg_id).or_default();
            match peer_of(op_name(e)) {
                Some((true, peer)) => pairs.entry((*rank, peer)).or_default().0.push(e),
                Some((false, peer)) => pairs.entry((peer, *rank)).or_default().1.push(e),
                None if op_name(e) == OpType::RecvAnySource.name() => {
                    any_source.entry(e.pg_id).or_default().entry(*rank).or_default().push(e);
                }
                None => {}
            }
            descs.entry(e.pg_id).or_insert_with(|| e.process_group.1.clone());
        }
    }
    for (pg_id, receivers) in any_source {
        let pairs = p2p.entry(pg_id).or_default();
        for (receiver, recvs) in receivers {
            pair_any_source(pairs, receiver, recvs);
        }
    }

    let mut findings = Vec::new();
    let pg_ids: BTreeSet<u64> = groups.keys().chain(p2p.keys()).copied().collect();
    for pg_id in pg_ids {
        let pg_desc = descs.get(&pg_id).cloned().unwrap_or_default();
        let collective = groups.get(&pg_id).and_then(|g| first_disagreement(pg_id, &pg_desc, g, &missing_dumps));
        let found = collective.or_else(|| p2p.get(&pg_id).and_then(|p| p2p_disagreement(pg_id, &pg_desc, p, &have)));
        let weak = found
            .as_ref()
            .is_none_or(|f| matches!(f.kind, FindingKind::Undecided { .. } | FindingKind::StateMismatch { .. }));
        let found = match live_consensus(dumps, pg_id) {
            Some((blame, by, seq, op)) if weak || matches!(blame, Blame::Cut { .. }) => {
                let kind = FindingKind::Blamed { blame, by, missing_dumps: missing_dumps.clone() };
                Some(Finding { pg_id, pg_desc, seq, op, kind })
            }
            _ => found,
        };
        findings.extend(found);
    }
    Diagnosis { ranks: have.into_iter().collect(), findings }
}

/// The blame that more than half of the dumps with a failure in group `pg_id` give for their
/// first failed, timed-out or refused entry (refused ones carry the group's failure), read
/// from `cohort_blame`; with the ranks that give it and the seq and op of the earliest such
/// entry. Undecided blames do not count as agreement. A cut is compared as a pair of sets
/// (each rank sees itself on the near side), and a cut with one rank alone on a side is that
/// rank.
fn live_consensus(dumps: &[(Rank, Dump)], pg_id: u64) -> Option<(Blame, Vec<Rank>, u64, String)> {
    let mut votes: Vec<(Blame, Vec<Rank>, u64, String)> = Vec::new();
    let mut voters = 0;
    for (rank, dump) in dumps {
        let first = dump.entries.iter().filter(|e| e.pg_id == pg_id).find(|e| {
            matches!(e.cohort_state, Some(WorkState::Failed | WorkState::TimedOut)) && e.cohort_blame.is_some()
        });
        let Some(e) = first else { continue };
        voters += 1;
        let Some(blame) = e.cohort_blame.as_ref().map(canonical).filter(Blame::is_decided) else { continue };
        let seq = if e.is_p2p { e.p2p_seq_id } else { e.collective_seq_id };
        match votes.iter_mut().find(|(b, ..)| *b == blame) {
            Some((_, by, s, _)) => {
                by.push(*rank);
                *s = (*s).min(seq);
            }
            None => votes.push((blame, vec![*rank], seq, op_name(e).to_owned())),
        }
    }
    let best = votes.into_iter().max_by_key(|(_, by, ..)| by.len())?;
    (best.1.len() * 2 > voters).then_some(best)
}

/// A blame as the dumps compare it: a cut as (smaller set first, or the lower one), and a cut
/// with one rank alone on a side as that rank.
fn canonical(blame: &Blame) -> Blame {
    match blame {
        Blame::Cut { near, far } if far.len() == 1 => Blame::rank(far[0]),
        Blame::Cut { near, .. } if near.len() == 1 => Blame::rank(near[0]),
        Blame::Cut { near, far } if (near.len(), near) <= (far.len(), far) => Blame::cut(near.clone(), far.clone()),
        Blame::Cut { near, far } => Blame::cut(far.clone(), near.clone()),
        other => other.clone(),
    }
}

/// Sends and receives between ordered pairs of ranks: (sender, receiver) → (sends, receives).
type P2pPairs<'a> = BTreeMap<(Rank, Rank), (Vec<&'a DumpEntry>, Vec<&'a DumpEntry>)>;

/// Give `receiver`'s any-source receives (in record order) the sends to it that no named
/// receive took, oldest first: each becomes a receive from that send's sender. Any-source
/// receives left over (nothing was sent for them) are not paired.
fn pair_any_source<'a>(pairs: &mut P2pPairs<'a>, receiver: Rank, recvs: Vec<&'a DumpEntry>) {
    let mut unclaimed: Vec<(u64, Rank)> = Vec::new();
    for (&(sender, to), (sends, named)) in pairs.iter() {
        if to == receiver {
            unclaimed.extend(sends.iter().skip(named.len()).map(|s| (s.time_created_ns, sender)));
        }
    }
    unclaimed.sort();
    for ((_, sender), recv) in unclaimed.into_iter().zip(recvs) {
        pairs.entry((sender, receiver)).or_default().1.push(recv);
    }
}

/// `send 0->1` → (true, 1); `recv 1<-0` → (false, 0); anything else (recv_anysource) → None.
fn peer_of(op: &str) -> Option<(bool, Rank)> {
    if let Some(rest) = op.strip_prefix("send ") {
        return rest.split_once("->").and_then(|(_, p)| p.trim().parse().ok()).map(|p| (true, Rank(p)));
    }
    let rest = op.strip_prefix("recv ")?;
    rest.split_once("<-").and_then(|(_, p)| p.trim().parse().ok()).map(|p| (false, Rank(p)))
}

/// The first send/recv pair that disagrees, between ranks whose dumps are both here.
fn p2p_disagreement(pg_id: u64, pg_desc: &str, pairs: &P2pPairs<'_>, have: &BTreeSet<Rank>) -> Option<Finding> {
    for (&(sender, receiver), (sends, recvs)) in pairs {
        if !have.contains(&sender) || !have.contains(&receiver) {
            continue;
        }
        for i in 0..sends.len().max(recvs.len()) {
            let (problem, blame, seq) = match (sends.get(i), recvs.get(i)) {
                (Some(s), Some(r)) if s.input_sizes != r.input_sizes => (
                    format!("the send has sizes {:?}, the receive {:?}", s.input_sizes, r.input_sizes),
                    vec![sender, receiver],
                    s.p2p_seq_id,
                ),
                (Some(s), Some(r)) if s.input_dtypes != r.input_dtypes => (
                    format!("the send has dtypes {:?}, the receive {:?}", s.input_dtypes, r.input_dtypes),
                    vec![sender, receiver],
                    s.p2p_seq_id,
                ),
                (Some(s), None) if s.state != EntryState::Completed => (
                    format!("rank {receiver} never posted the receive for this send (send #{})", i + 1),
                    vec![receiver],
                    s.p2p_seq_id,
                ),
                (None, Some(r)) if r.state != EntryState::Completed => (
                    format!("rank {sender} never sent what receive #{} on rank {receiver} waits for", i + 1),
                    vec![sender],
                    r.p2p_seq_id,
                ),
                _ => continue,
            };
            let kind = FindingKind::P2pMismatch { sender, receiver, problem, blame };
            return Some(Finding { pg_id, pg_desc: pg_desc.to_owned(), seq, op: "send/recv".into(), kind });
        }
    }
    None
}

fn first_disagreement(
    pg_id: u64,
    pg_desc: &str,
    by_rank: &BTreeMap<Rank, BTreeMap<u64, &DumpEntry>>,
    missing_dumps: &[Rank],
) -> Option<Finding> {
    // Start where every rank that recorded anything still holds its entries.
    let start = by_rank.values().filter_map(|m| m.keys().next().copied()).max()?;
    let end = by_rank.values().filter_map(|m| m.keys().next_back().copied()).max()?;
    let at = |seq: u64| {
        let present: Vec<(Rank, &DumpEntry)> =
            by_rank.iter().filter_map(|(r, m)| m.get(&seq).map(|e| (*r, *e))).collect();
        // Keyed by borrowed names: this runs for every rank at every seq of the dumps.
        let mut by_op: BTreeMap<&str, Vec<Rank>> = BTreeMap::new();
        for (r, e) in &present {
            by_op.entry(op_name(e)).or_default().push(*r);
        }
        let op = by_op.iter().max_by_key(|(_, r)| r.len()).map(|(k, _)| (*k).to_owned()).unwrap_or_default();
        (present, by_op, op)
    };
    let finding = |seq: u64, op: String, kind| Some(Finding { pg_id, pg_desc: pg_desc.to_owned(), seq, op, kind });
    // The numbers some rank recorded, not every number between: they are the dump files', and
    // two of them 2^62 apart must not take 2^62 steps.
    let seqs: BTreeSet<u64> = by_rank.values().flat_map(|m| m.range(start..=end).map(|(seq, _)| *seq)).collect();

    // First pass: a mismatch of op, size or dtype anywhere is a certain desync, and the cause
    // of whatever timing disagreement (ranks stuck, ranks that never joined) came before it in
    // the dumps of an asynchronous job: report the earliest one.
    for &seq in &seqs {
        let (present, by_op, op) = at(seq);
        if by_op.len() > 1 {
            let by_op = by_op.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            return finding(seq, op, FindingKind::OpMismatch { by_op });
        }
        // Texts to group by are made only where the ranks disagree: agreement, the common
        // case, is one comparison per rank.
        let first = present.first().map(|(_, e)| *e);
        let all_same = |same: &dyn Fn(&DumpEntry, &DumpEntry) -> bool| {
            first.is_none_or(|f| present.iter().all(|(_, e)| same(f, e)))
        };
        let group_by = |key: &dyn Fn(&DumpEntry) -> String| {
            let mut by: BTreeMap<String, Vec<Rank>> = BTreeMap::new();
            for (r, e) in &present {
                by.entry(key(e)).or_default().push(*r);
            }
            by
        };
        if !all_same(&|a, b| a.input_sizes == b.input_sizes) {
            let by_size = group_by(&|e| format!("{:?}", e.input_sizes));
            return finding(seq, op, FindingKind::SizeMismatch { by_size });
        }
        if !all_same(&|a, b| a.input_dtypes == b.input_dtypes) {
            let by_dtype = group_by(&|e| format!("{:?}", e.input_dtypes));
            return finding(seq, op, FindingKind::DtypeMismatch { by_dtype });
        }
    }
    // Second pass: the first collective some ranks never joined, or did not all finish.
    for &seq in &seqs {
        let (present, _, op) = at(seq);
        if present.is_empty() {
            continue;
        }
        let absent: Vec<Rank> = by_rank.iter().filter(|(_, m)| !m.contains_key(&seq)).map(|(r, _)| *r).collect();
        if !absent.is_empty() && !missing_dumps.is_empty() {
            // Ranks we can see never joined, but a rank we cannot see may have failed the
            // group first (a group that failed refuses later collectives): it is the suspect.
            return finding(seq, op, FindingKind::Undecided { missing_dumps: missing_dumps.to_vec() });
        }
        if !absent.is_empty() {
            return finding(
                seq,
                op,
                FindingKind::NeverJoined { missing: absent, waiting: present.iter().map(|(r, _)| *r).collect() },
            );
        }
        let completed: Vec<Rank> =
            present.iter().filter(|(_, e)| e.state == EntryState::Completed).map(|(r, _)| *r).collect();
        let stuck: Vec<Rank> =
            present.iter().filter(|(_, e)| e.state != EntryState::Completed).map(|(r, _)| *r).collect();
        if !stuck.is_empty() && !missing_dumps.is_empty() {
            // The ranks we can see are stuck here (some, or all): they may be waiting on the
            // ranks we cannot see, which are the suspects.
            return finding(seq, op, FindingKind::Undecided { missing_dumps: missing_dumps.to_vec() });
        }
        if !completed.is_empty() && !stuck.is_empty() {
            return finding(seq, op, FindingKind::StateMismatch { completed, stuck });
        }
        if completed.is_empty() && !stuck.is_empty() {
            let (not_started, started): (Vec<Rank>, Vec<Rank>) =
                stuck.iter().partition(|r| present.iter().any(|(q, e)| q == *r && e.state == EntryState::Scheduled));
            if !not_started.is_empty() && !started.is_empty() {
                return finding(seq, op, FindingKind::NeverStarted { not_started, started });
            }
        }
    }
    if !missing_dumps.is_empty() {
        // Every dump agrees, but some ranks left none (a crashed process leaves no dump): the
        // job stopped after seq `end`, and only they can say why.
        return finding(
            end.saturating_add(1),
            String::new(),
            FindingKind::Undecided { missing_dumps: missing_dumps.to_vec() },
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::recorder::{DumpMeta, FlightRecorder, RecordRequest, RecorderConfig, TensorMeta};
    use crate::tensor::DType;
    use crate::work::WorkResult;

    /// One rank's recorder after recording `ops` (name, numel, dtype, completed).
    fn dump(rank: u32, world: u32, ops: &[(&str, usize, DType, bool)]) -> (Rank, Dump) {
        let mut fr = FlightRecorder::new(RecorderConfig::default(), 0);
        fr.record_group(0, "0", "default_pg", &(0..u64::from(world)).collect::<Vec<_>>());
        for (i, &(op, numel, dtype, done)) in ops.iter().enumerate() {
            let shape = [numel];
            let t = [TensorMeta { dtype, shape: &shape }];
            let name = format!("tcp:{op}");
            let p2p = op.starts_with("send ") || op.starts_with("recv ") || op == "recv_any_source";
            let id = fr
                .record(
                    Duration::from_millis(i as u64),
                    &RecordRequest {
                        pg_id: 0,
                        pg_name: "0",
                        pg_desc: "default_pg",
                        collective_seq_id: i as u64 + 1,
                        p2p_seq_id: if p2p { i as u64 + 1 } else { 0 },
                        op_id: i as u64 + 1,
                        profiling_name: name.as_str().into(),
                        inputs: &t,
                        outputs: &t,
                        timeout: Duration::from_secs(1),
                        is_p2p: p2p,
                    },
                )
                .unwrap();
            fr.handle_started(id, Duration::from_millis(i as u64));
            if done {
                fr.handle_finished(id, Duration::from_millis(i as u64 + 1), &WorkResult::Success);
            }
        }
        (Rank(rank), fr.dump(DumpMeta::new(Rank(rank), world)))
    }

    const AR: &str = "all_reduce";

    #[test]
    fn names_the_rank_that_never_joined() {
        let ok = |n| vec![(AR, 8, DType::F32, true); n];
        let mut stuck = ok(3);
        stuck.push((AR, 8, DType::F32, false));
        let dumps = vec![dump(0, 4, &stuck), dump(1, 4, &stuck), dump(2, 4, &ok(3)), dump(3, 4, &stuck)];
        let d = diagnose(&dumps, None);
        assert_eq!(d.findings.len(), 1);
        let f = &d.findings[0];
        assert_eq!((f.seq, f.op.as_str()), (4, AR));
        assert_eq!(f.culprits(), vec![Rank(2)]);
        assert_eq!(
            d.to_string(),
            "pg 0 (default_pg): collective seq 4 (all_reduce): rank(s) [2] never joined it; rank(s) [0-1, 3] are waiting in it\n  culprit rank(s): [2]"
        );
    }

    #[test]
    fn desyncs_of_op_size_and_dtype_are_classified() {
        let base = [(AR, 8, DType::F32, true)];
        let op = diagnose(
            &[
                dump(0, 2, &[base[0], (AR, 8, DType::F32, false)]),
                dump(1, 2, &[base[0], ("broadcast", 8, DType::F32, false)]),
            ],
            None,
        );
        assert!(matches!(op.findings[0].kind, FindingKind::OpMismatch { .. }), "{op}");
        let size = diagnose(
            &[
                dump(0, 3, &[(AR, 8, DType::F32, false)]),
                dump(1, 3, &[(AR, 8, DType::F32, false)]),
                dump(2, 3, &[(AR, 9, DType::F32, false)]),
            ],
            None,
        );
        assert_eq!(size.findings[0].culprits(), vec![Rank(2)]);
        assert!(size.to_string().contains("input sizes differ"), "{size}");
        let dtype =
            diagnose(&[dump(0, 2, &[(AR, 8, DType::F32, false)]), dump(1, 2, &[(AR, 8, DType::F64, false)])], None);
        assert!(matches!(dtype.findings[0].kind, FindingKind::DtypeMismatch { .. }), "{dtype}");
    }

    #[test]
    fn sequence_numbers_far_apart_cost_what_the_entries_do() {
        // A dump's numbers are its file's: the diagnosis steps through those recorded, not
        // through every number between (2^62 of them here).
        let far = |rank, done: bool| {
            let (rank, mut d) = dump(rank, 3, &[(AR, 8, DType::F32, true), (AR, 8, DType::F32, done)]);
            d.entries[1].collective_seq_id = 1 << 62;
            (rank, d)
        };
        let dumps = vec![far(0, true), far(1, false)];
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let d = diagnose(&dumps, Some(2));
            let _ = tx.send(d.findings[0].clone());
            // Every dump agrees up to the largest number a u64 holds, and a rank left none.
            let mut last = far(0, true);
            last.1.entries[1].collective_seq_id = u64::MAX;
            let _ = tx.send(diagnose(&[last], Some(2)).findings[0].clone());
        });
        let wait = Duration::from_secs(20);
        let f = rx.recv_timeout(wait).expect("a diagnosis in time");
        assert_eq!(f.seq, 1 << 62);
        assert_eq!(f.kind, FindingKind::StateMismatch { completed: vec![Rank(0)], stuck: vec![Rank(1)] });
        let f = rx.recv_timeout(wait).expect("a diagnosis in time");
        assert_eq!((f.seq, f.kind), (u64::MAX, FindingKind::Undecided { missing_dumps: vec![Rank(1)] }));
    }

    #[test]
    fn a_dumps_world_size_or_rank_past_any_world_lists_no_four_billion_ranks() {
        let stuck = [(AR, 8, DType::F32, false)];
        let (r0, mut d0) = dump(0, 2, &stuck);
        d0.world_size = Some(u32::MAX);
        let (tx, rx) = std::sync::mpsc::channel();
        let dumps = vec![(r0, d0.clone()), dump(1, 2, &stuck)];
        std::thread::spawn(move || {
            // Not believed: the other dump's size stands, and both ranks wait alike.
            let _ = tx.send(diagnose(&dumps, None));
            // A rank past any world: the missing are named among the first ranks a world may
            // have.
            let _ = tx.send(diagnose(&[(Rank(u32::MAX), d0)], None));
        });
        let wait = Duration::from_secs(20);
        let d = rx.recv_timeout(wait).expect("a diagnosis in time");
        assert!(d.is_healthy(), "{d}");
        let d = rx.recv_timeout(wait).expect("a diagnosis in time");
        let FindingKind::Undecided { missing_dumps } = &d.findings[0].kind else { panic!("{d}") };
        assert_eq!(missing_dumps.len(), MAX_WORLD_SIZE as usize);
        assert_eq!((missing_dumps[0], missing_dumps[missing_dumps.len() - 1]), (Rank(0), Rank(MAX_WORLD_SIZE - 1)));
    }

    #[test]
    fn state_mismatch_and_missing_dumps() {
        let done = [(AR, 8, DType::F32, true)];
        let stuck = [(AR, 8, DType::F32, false)];
        let d = diagnose(&[dump(0, 2, &done), dump(1, 2, &stuck)], None);
        assert_eq!(d.findings[0].kind, FindingKind::StateMismatch { completed: vec![Rank(0)], stuck: vec![Rank(1)] });
        let d = diagnose(&[dump(0, 3, &stuck), dump(1, 3, &stuck)], None);
        assert_eq!(d.findings[0].kind, FindingKind::Undecided { missing_dumps: vec![Rank(2)] });
        assert!(d.to_string().contains("undecided: no dump from rank(s) [2]"), "{d}");
    }

    #[test]
    fn a_collective_that_never_started_on_one_rank_blames_that_rank() {
        let ops = [(AR, 8, DType::F32, true), (AR, 8, DType::F32, false)];
        let mut dumps: Vec<(Rank, Dump)> = (0..4).map(|r| dump(r, 4, &ops)).collect();
        // Rank 2's device was stuck before seq 2: it was enqueued there and never started.
        dumps[2].1.entries[1].state = EntryState::Scheduled;
        let d = diagnose(&dumps, None);
        assert_eq!(
            d.findings[0].kind,
            FindingKind::NeverStarted { not_started: vec![Rank(2)], started: vec![Rank(0), Rank(1), Rank(3)] }
        );
        assert_eq!(d.findings[0].culprits(), vec![Rank(2)]);
        assert!(d.to_string().contains("it never started on rank(s) [2]"), "{d}");
        // Stuck everywhere, started everywhere: nobody to blame from the dumps.
        let dumps: Vec<(Rank, Dump)> = (0..4).map(|r| dump(r, 4, &ops)).collect();
        assert!(diagnose(&dumps, None).is_healthy());
    }

    #[test]
    fn agreeing_dumps_are_healthy() {
        let ops = vec![(AR, 8, DType::F32, true), ("broadcast", 3, DType::I64, true)];
        let d = diagnose(&[dump(0, 2, &ops), dump(1, 2, &ops)], None);
        assert!(d.is_healthy(), "{d}");
        assert!(d.to_string().starts_with("no disagreement"));
        let json = d.to_json();
        assert!(json.contains("\"findings\": []"), "{json}");
        // No dumps at all (nobody joined): nothing agreed, and the text says so.
        let none = diagnose(&[], Some(3));
        assert!(none.to_string().starts_with("no dumps: there is nothing to compare"), "{none}");
    }

    #[test]
    fn point_to_point_pairs_are_checked_in_order() {
        // Rank 0 sends 4 floats; rank 1 posts a receive of 8.
        let d = diagnose(
            &[dump(0, 2, &[("send 0->1", 4, DType::F32, true)]), dump(1, 2, &[("recv 1<-0", 8, DType::F32, false)])],
            None,
        );
        let f = &d.findings[0];
        assert!(matches!(&f.kind, FindingKind::P2pMismatch { sender: Rank(0), receiver: Rank(1), .. }), "{f:?}");
        assert_eq!(f.culprits(), vec![Rank(0), Rank(1)]);
        assert!(
            d.to_string().contains("send/recv 0->1 (sender's p2p seq 1): the send has sizes [[4]], the receive [[8]]"),
            "{d}"
        );
        // Rank 1 waits for a second message rank 0 never sent.
        let d = diagnose(
            &[
                dump(0, 2, &[("send 0->1", 4, DType::F32, true)]),
                dump(1, 2, &[("recv 1<-0", 4, DType::F32, true), ("recv 1<-0", 4, DType::F32, false)]),
            ],
            None,
        );
        assert_eq!(d.findings[0].culprits(), vec![Rank(0)]);
        assert!(d.to_string().contains("rank 0 never sent what receive #2 on rank 1 waits for"), "{d}");
        // A send nobody received, still waiting: the receiver never posted it.
        let d = diagnose(&[dump(0, 2, &[("send 0->1", 4, DType::F32, false)]), dump(1, 2, &[])], None);
        assert_eq!(d.findings[0].culprits(), vec![Rank(1)]);
        // Matched pairs are healthy.
        let d = diagnose(
            &[dump(0, 2, &[("send 0->1", 4, DType::F32, true)]), dump(1, 2, &[("recv 1<-0", 4, DType::F32, true)])],
            None,
        );
        assert!(d.is_healthy(), "{d}");
    }

    /// `dump` with its last entry failed, blaming `blame`.
    fn failed_dump(rank: u32, world: u32, n: usize, blame: Blame) -> (Rank, Dump) {
        let ops: Vec<(&str, usize, DType, bool)> = (0..n).map(|i| ("all_reduce", 4, DType::F32, i + 1 < n)).collect();
        let (r, mut d) = dump(rank, world, &ops);
        let last = d.entries.last_mut().expect("an entry");
        last.cohort_state = Some(WorkState::Failed);
        last.cohort_blame = Some(blame);
        (r, d)
    }

    #[test]
    fn what_most_dumps_blamed_decides_what_the_dumps_alone_cannot() {
        // A crash: rank 2 left no dump; the survivors' failures all blame it.
        let dumps: Vec<_> = [0, 1, 3].map(|r| failed_dump(r, 4, 3, Blame::rank(Rank(2)))).into();
        let d = diagnose(&dumps, Some(4));
        assert_eq!(d.findings.len(), 1, "{d}");
        assert_eq!(d.findings[0].culprits(), vec![Rank(2)], "{d}");
        assert!(
            d.to_string().contains("no dump from rank(s) [2]; the failures recorded by rank(s) [0-1, 3] blame rank 2"),
            "{d}"
        );
        // A cut between {0, 1} and {2, 3}: each side sees itself near; the cut is the finding.
        let near = |r: u32| if r < 2 { [Rank(0), Rank(1)] } else { [Rank(2), Rank(3)] };
        let far = |r: u32| if r < 2 { [Rank(2), Rank(3)] } else { [Rank(0), Rank(1)] };
        let dumps: Vec<_> = (0..4).map(|r| failed_dump(r, 4, 2, Blame::cut(near(r), far(r)))).collect();
        let d = diagnose(&dumps, Some(4));
        let FindingKind::Blamed { blame, by, .. } = &d.findings[0].kind else { panic!("{d}") };
        assert_eq!(blame, &Blame::cut([Rank(0), Rank(1)], [Rank(2), Rank(3)]));
        assert_eq!(by.len(), 4);
        // Rank 3 cut off from everyone: it blames a cut with itself alone on one side, the
        // others blame it; all of them mean rank 3.
        let mut dumps: Vec<_> = (0..3).map(|r| failed_dump(r, 4, 2, Blame::rank(Rank(3)))).collect();
        dumps.push(failed_dump(3, 4, 2, Blame::cut([Rank(3)], [Rank(0), Rank(1), Rank(2)])));
        let d = diagnose(&dumps, Some(4));
        assert_eq!(d.findings[0].culprits(), vec![Rank(3)], "{d}");
        // No majority (two say rank 1, two undecided): the dumps' own finding stands.
        let dumps: Vec<_> =
            (0..4).map(|r| failed_dump(r, 4, 2, if r < 2 { Blame::rank(Rank(1)) } else { Blame::nobody() })).collect();
        let d = diagnose(&dumps, Some(4));
        assert!(d.findings.iter().all(|f| !matches!(f.kind, FindingKind::Blamed { .. })), "{d}");
    }

    #[test]
    fn any_source_receives_are_paired_with_the_sends_no_named_receive_took() {
        // Rank 1 receives from any source twice; ranks 0 and 2 each send it one message, and
        // rank 2's is the wrong size.
        let r0 = dump(0, 3, &[("send 0->1", 8, DType::F32, true)]);
        let r1 = dump(1, 3, &[("recv_any_source", 8, DType::F32, true), ("recv_any_source", 8, DType::F32, false)]);
        let r2 = dump(2, 3, &[("send 2->1", 4, DType::F32, false)]);
        let d = diagnose(&[r0, r1, r2], Some(3));
        let [f] = &d.findings[..] else { panic!("one finding: {d}") };
        let FindingKind::P2pMismatch { sender, receiver, blame, .. } = &f.kind else { panic!("{d}") };
        assert_eq!((*sender, *receiver), (Rank(2), Rank(1)), "{d}");
        assert_eq!(blame, &vec![Rank(2), Rank(1)]);
        // Sizes that agree: nothing to report.
        let r0 = dump(0, 2, &[("send 0->1", 8, DType::F32, false)]);
        let r1 = dump(1, 2, &[("recv_any_source", 8, DType::F32, false)]);
        let d = diagnose(&[r0, r1], Some(2));
        assert!(d.findings.iter().all(|f| !matches!(f.kind, FindingKind::P2pMismatch { .. })), "{d}");
    }
}
