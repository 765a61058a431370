//! What a rank was doing when it was told to stop: a report on SIGTERM.
//!
//! `cohort launch` (like torchrun) SIGTERMs the ranks still running once `--grace` is over, and
//! so does a cluster scheduler at a job's time limit. A rank stuck in a collective used to die
//! silently then. Now, when the process makes its first process group (TCP, or NCCL and its
//! emulation), it installs a SIGTERM handler, once per process, unless
//! `COHORT_SIGTERM_REPORT=0`. The handler only wakes a thread ([`signal_hook::iterator::Signals`],
//! a self-pipe): no work runs in the signal handler itself. That thread, for every process group
//! still alive (a registry of weak references, filled as groups are made and pruned as they
//! go), in the order they were made:
//! - prints one line to stderr, about the oldest work the group has not finished (the one every
//!   later work waits behind):
//!   `cohort: rank 2: SIGTERM while all_reduce (seq 33) was running for 1840 ms, waiting for
//!   rank(s) [1]; flight recorder dumped to /tmp/x/rank_2.json`,
//!   or `cohort: rank 0: SIGTERM with no collective in flight`. A group other than the default
//!   one is named after the rank (`rank 1 (group 3)`); the ranks waited for are those the data
//!   plane last reported, left out when it never did;
//! - dumps the group's flight recorder to `<prefix><rank>.json` first when a dump prefix
//!   (`COHORT_DUMP_ON_FAILURE`) is set, as a failure would;
//!
//! and then restores SIGTERM's default action and raises it again: the process still dies of
//! SIGTERM (signal 15; status 143 in a shell), which is what the launcher and users expect.
//!
//! It never keeps the process from dying: a group whose state stays locked for
//! [`LOCK_WAIT`] is reported as busy, and [`BACKSTOP`] after the signal the process dies
//! whatever the report is doing.
//!
//! It stays out of the way of a program that handles SIGTERM itself: it is not installed when
//! SIGTERM's action is not the default one as the first group is made. A program that installs
//! its own handler later must set `COHORT_SIGTERM_REPORT=0`, since this one ends the process
//! after its report.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError, Weak};
use std::time::{Duration, Instant};

use cohort_core::group::{GroupConfig, GroupState};
use cohort_core::work::{GroupId, Rank, rank_ranges};
use signal_hook::consts::signal::SIGTERM;
use signal_hook::iterator::Signals;

use crate::env::{self, Env};

/// How long the report waits for a group's state lock before it calls the group busy.
pub(crate) const LOCK_WAIT: Duration = Duration::from_millis(500);

/// How long after SIGTERM the process dies, reported or not.
pub(crate) const BACKSTOP: Duration = Duration::from_secs(3);

/// A process group the report covers.
pub(crate) trait Report: Send + Sync {
    /// This group's line (no newline) at SIGTERM, `now` by the groups' clock; its flight
    /// recorder is dumped first when a dump prefix is set. Must not block for long (see
    /// [`lock_within`]).
    fn sigterm_line(&self, now: Instant) -> String;
}

/// Whether the handler is installed (decided by the first group).
static INSTALLED: OnceLock<bool> = OnceLock::new();

/// The groups alive, in the order they were made.
static GROUPS: Mutex<Vec<Weak<dyn Report>>> = Mutex::new(Vec::new());

fn groups() -> MutexGuard<'static, Vec<Weak<dyn Report>>> {
    GROUPS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Cover `group` in the report, installing the handler if this is the process's first group.
pub(crate) fn register(group: Weak<dyn Report>) {
    if !*INSTALLED.get_or_init(install) {
        return;
    }
    let mut groups = groups();
    groups.retain(|g| g.strong_count() > 0);
    groups.push(group);
}

/// Install the handler and its thread; whether it was.
fn install() -> bool {
    match Env::process().flag(env::SIGTERM_REPORT) {
        Ok(Some(false)) => return false,
        Ok(Some(true) | None) => {}
        // A malformed value must not turn off the one report a killed job leaves.
        Err(e) => tracing::warn!("{e}: the SIGTERM report stays on"),
    }
    if !sigterm_is_default() {
        tracing::debug!("SIGTERM already has a handler (or is ignored): no SIGTERM report");
        return false;
    }
    let mut signals = match Signals::new([SIGTERM]) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("could not install the SIGTERM report: {e}");
            return false;
        }
    };
    let spawned = std::thread::Builder::new().name("cohort-sigterm".into()).spawn(move || {
        if signals.forever().next().is_some() {
            on_sigterm();
        }
    });
    match spawned {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!("could not start the SIGTERM report's thread: {e}");
            false
        }
    }
}

/// Whether SIGTERM has its default action (no handler, not ignored).
fn sigterm_is_default() -> bool {
    // SAFETY: sigaction is plain data; all zeroes is a valid value.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: with a null new action, sigaction only reads the current one into `old`.
    let rc = unsafe { libc::sigaction(SIGTERM, std::ptr::null(), &mut old) };
    rc == 0 && old.sa_sigaction == libc::SIG_DFL
}

/// On the report's thread: report every live group, then die of SIGTERM.
fn on_sigterm() {
    // Whatever happens below, the process dies.
    let _ = std::thread::Builder::new().name("cohort-sigterm-backstop".into()).spawn(|| {
        std::thread::sleep(BACKSTOP);
        die();
    });
    let live: Vec<Arc<dyn Report>> = groups().iter().filter_map(Weak::upgrade).collect();
    let now = super::now();
    for group in &live {
        let mut line = group.sigterm_line(now);
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
    // The process is about to die: dropping a last reference here would only run a group's
    // teardown on the way out.
    std::mem::forget(live);
    die();
}

/// Restore SIGTERM's default action and raise it (aborts if that somehow returns).
fn die() -> ! {
    let _ = signal_hook::low_level::emulate_default_handler(SIGTERM);
    std::process::abort()
}

/// `mutex`'s guard, waiting at most `limit` for it (a poisoned lock is still read).
pub(crate) fn lock_within<T>(mutex: &Mutex<T>, limit: Duration) -> Option<MutexGuard<'_, T>> {
    let deadline = Instant::now() + limit;
    loop {
        match mutex.try_lock() {
            Ok(guard) => return Some(guard),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(TryLockError::WouldBlock) => return None,
        }
    }
}

/// `rank 2`, or `rank 1 (group 3)` outside the default group.
fn who(rank: Rank, gid: GroupId, name: &str, desc: &str) -> String {
    let mut s = format!("rank {rank}");
    if gid.0 != 0 {
        let name = if name.is_empty() { gid.to_string() } else { name.to_owned() };
        let _ = write!(s, " (group {name}");
        if !desc.is_empty() && desc != "undefined" && desc != format!("group {gid}") && desc != "default_pg" {
            let _ = write!(s, ": {desc}");
        }
        s.push(')');
    }
    s
}

/// The line's start for `group`: who, and what it was doing (see the [module docs](self)).
pub(crate) fn describe(group: &GroupState, now: Instant) -> String {
    let cfg: &GroupConfig = group.config();
    let mut s = format!("cohort: {}: SIGTERM", who(group.rank(), cfg.group_id, &cfg.name, &cfg.desc));
    match group.oldest_unfinished(now) {
        None => s.push_str(" with no collective in flight"),
        Some((seq, op, age, waiting)) => {
            let p2p = if op.is_p2p() { "p2p " } else { "" };
            let _ = write!(s, " while {op} ({p2p}seq {seq}) was running for {} ms", age.as_millis());
            if let Some(ranks) = waiting.filter(|r| !r.is_empty()) {
                let _ = write!(s, ", waiting for rank(s) {}", rank_ranges(ranks));
            }
            let behind = group.in_flight().saturating_sub(1);
            if behind > 0 {
                let _ = write!(s, " ({behind} more queued behind it)");
            }
        }
    }
    s
}

/// `describe`'s line with the dump's outcome: `None` without a dump prefix, else the path
/// written or why not.
pub(crate) fn with_dump(mut line: String, dumped: Option<Result<String, String>>) -> String {
    match dumped {
        None => {}
        Some(Ok(path)) => {
            let _ = write!(line, "; flight recorder dumped to {path}");
        }
        Some(Err(e)) => {
            let _ = write!(line, "; {e}");
        }
    }
    line
}

/// Write a flight-recorder dump to `<prefix><rank>.json` (on `why`, for the log): the path
/// written, or why it was not.
pub(crate) fn dump_file(prefix: &Path, rank: Rank, json: &str, why: &str) -> Result<String, String> {
    let path = format!("{}{}.json", prefix.display(), rank);
    match std::fs::write(&path, json) {
        Ok(()) => {
            tracing::warn!(%path, "flight recorder dumped on {why}");
            Ok(path)
        }
        Err(e) => {
            tracing::error!(%path, "could not dump the flight recorder: {e}");
            Err(format!("could not dump the flight recorder to {path}: {e}"))
        }
    }
}

/// The line for a group whose state stayed locked.
pub(crate) fn busy(rank: Rank, gid: GroupId) -> String {
    format!(
        "cohort: {}: SIGTERM, but the group's state stayed locked for {} ms: nothing to report",
        who(rank, gid, "", ""),
        LOCK_WAIT.as_millis()
    )
}

impl Report for super::Inner {
    fn sigterm_line(&self, now: Instant) -> String {
        let Some(st) = lock_within(&self.state, LOCK_WAIT) else {
            return busy(self.rank, self.group_id);
        };
        let line = describe(&st.group, now);
        let json = self.opts.dump_prefix.is_some().then(|| st.dump_json());
        drop(st);
        with_dump(line, json.and_then(|json| self.write_dump(json, "SIGTERM")))
    }
}

#[cfg(test)]
mod tests {
    use cohort_core::group::{Collective, GroupConfig, GroupState, TensorSpec};
    use cohort_core::tensor::DType;
    use cohort_core::work::{OpType, SeqNo};

    use super::*;

    fn allreduce() -> Collective {
        Collective::new(OpType::Allreduce).inputs(vec![TensorSpec::new(DType::F32, &[4])])
    }

    #[test]
    fn the_oldest_unfinished_work_is_named_with_its_age_and_whom_it_waits_for() {
        let t0 = Instant::now();
        let mut g = GroupState::new(GroupConfig::new(3), Rank(0), t0);
        assert_eq!(g.oldest_unfinished(t0), None);
        assert_eq!(describe(&g, t0), "cohort: rank 0: SIGTERM with no collective in flight");

        let first = g.submit(t0, allreduce()).unwrap();
        g.submit(t0 + Duration::from_millis(5), allreduce()).unwrap();
        let later = t0 + Duration::from_millis(1840);
        assert_eq!(g.oldest_unfinished(later), Some((SeqNo(1), OpType::Allreduce, Duration::from_millis(1840), None)));
        assert_eq!(
            describe(&g, later),
            "cohort: rank 0: SIGTERM while all_reduce (seq 1) was running for 1840 ms (1 more queued behind it)"
        );

        g.handle_waiting_on(later, first, &[Rank(1), Rank(2)]);
        let (.., waiting) = g.oldest_unfinished(later).unwrap();
        assert_eq!(waiting, Some(&[Rank(1), Rank(2)][..]));
        let line = with_dump(describe(&g, later), Some(Ok("/tmp/x/rank_0.json".into())));
        assert_eq!(
            line,
            "cohort: rank 0: SIGTERM while all_reduce (seq 1) was running for 1840 ms, waiting for rank(s) [1-2] \
             (1 more queued behind it); flight recorder dumped to /tmp/x/rank_0.json"
        );
    }

    #[test]
    fn a_group_other_than_the_default_names_itself() {
        let mut cfg = GroupConfig::new(2);
        cfg.group_id = GroupId(3);
        cfg.name = "3".into();
        cfg.desc = "group 3".into();
        let g = GroupState::new(cfg, Rank(1), Instant::now());
        assert_eq!(describe(&g, Instant::now()), "cohort: rank 1 (group 3): SIGTERM with no collective in flight");
        assert_eq!(who(Rank(0), GroupId(4), "tp", "tensor parallel"), "rank 0 (group tp: tensor parallel)");
    }

    #[test]
    fn a_lock_held_elsewhere_is_given_up_on() {
        let m = Mutex::new(1);
        let held = m.lock().unwrap();
        assert!(lock_within(&m, Duration::from_millis(10)).is_none());
        drop(held);
        assert_eq!(lock_within(&m, Duration::from_millis(10)).map(|g| *g), Some(1));
    }
}
