//! Running a simulation: the builder, the controller loop that applies the fault plan, and
//! the [`Report`].

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use cohort_core::analyze::{Diagnosis, diagnose};
use cohort_core::group::{ErrorHandling, HeartbeatConfig};
use cohort_core::recorder::Dump;
use cohort_core::work::{Rank, WorkState, rank_ranges};
use cohort_transports::{
    ProcessGroup, TcpOptions, TcpStore, TcpStoreConfig, TcpStoreServer, TcpStoreServerConfig, Work,
};
use serde::{Deserialize, Serialize};

use crate::net::TurmoilNet;
use crate::plan::{Change, DeviceFault, Fault, FaultPlan, Trigger};
use crate::workload::{Script, ScriptOp, Step, check, submit};
use cohort_core::tensor::{DType, Tensor};

/// The port the simulated store listens on.
pub const STORE_PORT: u16 = 29500;

/// The simulated store's host name.
pub const STORE_HOST: &str = "store";

/// The Unix time the simulation's wall clock starts at (2026-01-01T00:00:00Z): dumps carry
/// it, so it is fixed rather than read from the real clock.
pub const WALL_CLOCK_START_NS: u64 = 1_767_225_600_000_000_000;

/// The host name of a rank that has a host of its own.
pub fn rank_host(rank: u32) -> String {
    format!("rank{rank}")
}

/// The host each rank runs on, with `per_host` ranks to a host (a node, as torchrun's
/// `--nproc-per-node`): consecutive ranks share a host named `node{i}`, and a host of one rank
/// is named [`rank_host`]. A rank that a crash or a link fault names gets a host of its own,
/// since turmoil crashes and partitions hosts, and a host never straddles a cut (a
/// [`Fault::Cut`]), so every fault strikes exactly the ranks it names.
pub fn placement(world_size: u32, per_host: u32, plan: &FaultPlan) -> Vec<String> {
    let mut alone = vec![per_host <= 1; world_size as usize];
    let mut single = |r: u32| {
        if let Some(a) = alone.get_mut(r as usize) {
            *a = true;
        }
    };
    for f in &plan.faults {
        match *f {
            Fault::Crash { rank, .. } | Fault::Isolate { rank, .. } => single(rank),
            Fault::Partition { a, b, .. } | Fault::Hold { a, b, .. } | Fault::Latency { a, b, .. } => {
                single(a);
                single(b);
            }
            _ => {}
        }
    }
    // Which side of every cut a rank is on: ranks share a host only when they agree.
    let side = |r: u32| -> Vec<bool> {
        plan.faults
            .iter()
            .filter_map(|f| match *f {
                Fault::Cut { from, to, .. } => Some((from..to).contains(&r)),
                _ => None,
            })
            .collect()
    };
    let mut hosts = Vec::with_capacity(world_size as usize);
    let mut nodes = 0u32;
    // (the current node, its side, how many ranks it holds)
    let mut open: Option<(u32, Vec<bool>, u32)> = None;
    for r in 0..world_size {
        if alone[r as usize] {
            hosts.push(rank_host(r));
            continue;
        }
        let here = side(r);
        match &mut open {
            Some((node, s, n)) if *s == here && *n < per_host => {
                *n += 1;
                hosts.push(format!("node{node}"));
            }
            _ => {
                hosts.push(format!("node{nodes}"));
                open = Some((nodes, here, 1));
                nodes += 1;
            }
        }
    }
    // A node that ended up with one rank is that rank's own host.
    let mut count = std::collections::HashMap::new();
    for h in &hosts {
        *count.entry(h.clone()).or_insert(0u32) += 1;
    }
    for (r, h) in hosts.iter_mut().enumerate() {
        if count[h.as_str()] == 1 {
            *h = rank_host(r as u32);
        }
    }
    hosts
}

mod nccl;

/// Which process group the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The production TCP backend over turmoil's network.
    #[default]
    Tcp,
    /// The NCCL process group over the emulated device and communicator, whose fabric runs
    /// through the simulated store (so over turmoil's network too).
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Tcp => "tcp",
            Backend::Nccl => "nccl",
        })
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Backend, String> {
        match s {
            "tcp" => Ok(Backend::Tcp),
            "nccl" => Ok(Backend::Nccl),
            other => Err(format!("unknown backend {other:?} (expected tcp or nccl)")),
        }
    }
}

/// A workload written as code: given each rank's connected group, do anything; `Err` is the
/// rank's failure. Its works are reported through the group's completion hook.
pub type RankFn = Rc<dyn Fn(ProcessGroup) -> Pin<Box<dyn Future<Output = Result<(), RankError>>>>>;

/// Why a rank's code workload failed: any error (a `String` converts with `?` or `.into()`).
/// The report keeps its text ([`Fate::Failed`]).
pub type RankError = Box<dyn std::error::Error>;

/// What every rank runs.
#[derive(Clone)]
pub enum Workload {
    /// A script of collectives, with checked results.
    Script(Script),
    /// Code, with a name for the report.
    Custom {
        /// The name the report shows.
        name: String,
        /// The code.
        run: RankFn,
    },
}

impl fmt::Debug for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Workload::Script(s) => f.debug_tuple("Script").field(s).finish(),
            Workload::Custom { name, .. } => f.debug_struct("Custom").field("name", name).finish_non_exhaustive(),
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Workload::Script(s) => write!(f, "{s}"),
            Workload::Custom { name, .. } => write!(f, "{name}"),
        }
    }
}

/// A simulation to run: N rank hosts and a store host in one turmoil world, every rank
/// running the production TCP backend over [`TurmoilNet`], under a [`FaultPlan`].
///
/// ```
/// use cohort_sim::{Simulation, Script, FaultPlan};
/// let report = Simulation::new(3)
///     .seed(7)
///     .script(Script::allreduces(2, 64))
///     .faults("crash 2 @collective 1".parse::<FaultPlan>().unwrap())
///     .run()
///     .unwrap();
/// assert!(report.diagnosis.findings.iter().any(|f| f.culprits().iter().any(|r| r.0 == 2)));
/// ```
#[derive(Debug, Clone)]
pub struct Simulation {
    seed: Option<u64>,
    world_size: u32,
    workload: Workload,
    plan: FaultPlan,
    /// Collective timeout.
    timeout: Duration,
    heartbeat: HeartbeatConfig,
    init_timeout: Duration,
    limit: Duration,
    max_latency: Duration,
    trace_buffer_size: usize,
    backend: Backend,
    lazy_connect: bool,
    ranks_per_host: u32,
}

impl Simulation {
    /// A simulation of `world_size` ranks running one 1024-element allreduce, no faults,
    /// a 5 s collective timeout, heartbeats every 500 ms (a peer silent for 2 s is lost), and
    /// at most 60 s of simulated time.
    pub fn new(world_size: u32) -> Simulation {
        Simulation {
            seed: None,
            world_size,
            workload: Workload::Script(Script::allreduces(1, 1024)),
            plan: FaultPlan::none(),
            timeout: Duration::from_secs(5),
            heartbeat: HeartbeatConfig { interval: Duration::from_millis(500), dead_after: Duration::from_secs(2) },
            init_timeout: Duration::from_secs(10),
            limit: Duration::from_secs(60),
            max_latency: Duration::from_millis(1),
            trace_buffer_size: 2000,
            backend: Backend::Tcp,
            // A full mesh by default: with lazy connections a rank's stuck notes and census
            // votes reach only the peers it talks to, so its own error names the culprit less
            // often (the cross-rank diagnosis of the dumps is unaffected). Large simulations
            // turn it on (`lazy_connect`): a mesh costs the simulated network a link per host
            // pair on every step, so the mesh, not the job, would set their cost.
            lazy_connect: false,
            ranks_per_host: 1,
        }
    }

    /// The backend every rank runs (default TCP).
    pub fn backend(mut self, backend: Backend) -> Simulation {
        self.backend = backend;
        self
    }

    /// The seed: turmoil's randomness (message latencies) and nothing else depends on it.
    /// Without one, a seed is drawn, printed, and kept in the report.
    pub fn seed(mut self, seed: u64) -> Simulation {
        self.seed = Some(seed);
        self
    }

    /// Run a script.
    pub fn script(mut self, script: Script) -> Simulation {
        self.workload = Workload::Script(script);
        self
    }

    /// Run code on every rank (its works are reported through the completion hook).
    pub fn workload<F, Fut>(mut self, name: &str, f: F) -> Simulation
    where
        F: Fn(ProcessGroup) -> Fut + 'static,
        Fut: Future<Output = Result<(), RankError>> + 'static,
    {
        self.workload = Workload::Custom { name: name.to_owned(), run: Rc::new(move |pg| Box::pin(f(pg))) };
        self
    }

    /// The fault plan.
    pub fn faults(mut self, plan: FaultPlan) -> Simulation {
        self.plan = plan;
        self
    }

    /// The collective timeout.
    pub fn timeout(mut self, timeout: Duration) -> Simulation {
        self.timeout = timeout;
        self
    }

    /// Heartbeats.
    pub fn heartbeat(mut self, heartbeat: HeartbeatConfig) -> Simulation {
        self.heartbeat = heartbeat;
        self
    }

    /// The most simulated time the run may take.
    pub fn limit(mut self, limit: Duration) -> Simulation {
        self.limit = limit;
        self
    }

    /// Whether ranks connect to a peer on first use or to every peer when they join (default;
    /// `TcpOptions::lazy_connect`).
    pub fn lazy_connect(mut self, lazy: bool) -> Simulation {
        self.lazy_connect = lazy;
        self
    }

    /// How many ranks share a simulated host (default 1), as torchrun's `--nproc-per-node`:
    /// ranks on one host talk over its loopback, ranks on different hosts over links. Ranks that
    /// a crash or link fault names get a host of their own ([`placement`]). turmoil's cost per
    /// step grows with hosts cubed (it scans every host pair's link for every host), so a job
    /// of hundreds of ranks runs many times faster with tens of ranks per host.
    pub fn ranks_per_host(mut self, n: u32) -> Simulation {
        self.ranks_per_host = n.max(1);
        self
    }

    /// The largest random message latency on every link (default 1 ms).
    pub fn max_latency(mut self, latency: Duration) -> Simulation {
        self.max_latency = latency;
        self
    }

    /// Run it. `Err` names what is wrong with the setup (world size, plan, script); every
    /// failure inside the simulated job is in the report.
    pub fn run(self) -> Result<Report, SetupError> {
        if self.world_size == 0 {
            return Err(SetupError::NoRanks);
        }
        let script = match &self.workload {
            Workload::Script(s) => {
                s.validate(self.world_size)?;
                Some(s)
            }
            Workload::Custom { .. } => None,
        };
        self.plan.validate(self.world_size, script)?;
        self.check_backend()?;
        let seed = self.seed.unwrap_or_else(|| {
            let seed = std::time::SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
            eprintln!("cohort-sim: no seed given; using {seed} (pass it to replay this run)");
            tracing::info!(seed, "cohort-sim: drew a seed");
            seed
        });
        Ok(Controller::new(self, seed).run())
    }
}

/// Why [`Simulation::run`] refused to start: the setup, not the simulated job, is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The world size is 0.
    #[error("the world size must be at least 1")]
    NoRanks,
    /// The script does not fit the world (its message says where).
    #[error(transparent)]
    Script(#[from] crate::workload::ScriptError),
    /// The fault plan does not fit the world or the script (its message says where).
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    /// A device fault under the TCP backend.
    #[error("{0}: device faults need the NCCL backend (--backend nccl)")]
    DeviceFaultNeedsNccl(Fault),
    /// A link fault under the NCCL backend, whose emulated fabric runs through the store host.
    #[error(
        "{0}: the emulated NCCL fabric runs through the store host, so a link between two ranks carries nothing (isolate a rank instead)"
    )]
    LinkFaultUnderNccl(Fault),
    /// A code workload under the NCCL backend.
    #[error("code workloads run on the TCP backend only")]
    CodeWorkloadNeedsTcp,
}

impl Simulation {
    /// Whether the plan and workload suit the backend.
    fn check_backend(&self) -> Result<(), SetupError> {
        for &f in &self.plan.faults {
            match (self.backend, f) {
                (Backend::Tcp, Fault::Device { .. }) => return Err(SetupError::DeviceFaultNeedsNccl(f)),
                (
                    Backend::Nccl,
                    Fault::Partition { .. } | Fault::Cut { .. } | Fault::Hold { .. } | Fault::Latency { .. },
                ) => return Err(SetupError::LinkFaultUnderNccl(f)),
                _ => {}
            }
        }
        if self.backend == Backend::Nccl && matches!(self.workload, Workload::Custom { .. }) {
            return Err(SetupError::CodeWorkloadNeedsTcp);
        }
        Ok(())
    }
}

/// How a rank's run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "fate", rename_all = "snake_case")]
pub enum Fate {
    /// Every collective completed with the right result.
    Finished,
    /// A collective failed (or gave a wrong result); the rank stopped there.
    Failed {
        /// The first error.
        error: String,
    },
    /// The rank could not join the group.
    InitFailed {
        /// Why.
        error: String,
    },
    /// The fault plan crashed the rank's host.
    Crashed {
        /// When (simulated ms).
        at_ms: u64,
    },
    /// The fault plan hung the rank before this collective.
    Hung {
        /// The collective it never called.
        collective: usize,
        /// The group failure it learned of while hung, if any.
        learned: Option<String>,
    },
    /// The simulation's time limit came first.
    StillRunning,
}

/// How one collective ended on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Completed with the right result.
    Completed,
    /// Completed with a wrong result.
    Wrong,
    /// Failed (a peer lost, a remote error, a mismatch).
    Failed,
    /// Timed out.
    TimedOut,
    /// Aborted.
    Aborted,
    /// The group refused to start it (it had already failed).
    Refused,
    /// Still running when the simulation ended.
    Unfinished,
}

impl Outcome {
    fn of(state: WorkState) -> Outcome {
        match state {
            WorkState::Completed => Outcome::Completed,
            WorkState::Failed => Outcome::Failed,
            WorkState::TimedOut => Outcome::TimedOut,
            WorkState::Aborted => Outcome::Aborted,
            WorkState::Enqueued | WorkState::Started => Outcome::Unfinished,
        }
    }
}

/// One collective of a rank's script.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkOutcome {
    /// The script step (0-based).
    pub step: usize,
    /// What was called (the step, as the rank called it: desyncs show here).
    pub call: String,
    /// The group's sequence number, when it was submitted.
    pub seq: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
    /// The error text.
    pub error: Option<String>,
    /// The rank the error blames, when it blames exactly one (see `blame`).
    pub culprit: Option<u32>,
    /// Whom the error blames (ranks, a cut, or undecided with suspects); `None` for a work
    /// that did not fail or whose failure is the simulator's own (a wrong result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blame: Option<cohort_core::Blame>,
    /// When it was submitted (simulated ms).
    pub submitted_ms: u64,
    /// When it ended (simulated ms).
    pub ended_ms: Option<u64>,
}

/// A work the group finished, as its completion hook saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkEvent {
    /// Sequence number.
    pub seq: u64,
    /// The op.
    pub op: String,
    /// Its terminal state.
    pub state: WorkState,
    /// When (simulated ms).
    pub at_ms: u64,
}

/// One rank's part of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    /// The rank.
    pub rank: u32,
    /// How its run ended.
    pub fate: Fate,
    /// When it joined the group (simulated ms).
    pub joined_ms: Option<u64>,
    /// Its script's collectives (empty for code workloads).
    pub works: Vec<WorkOutcome>,
    /// Every work its group finished, in order.
    pub events: Vec<WorkEvent>,
    /// Its flight recorder at the end (none for a crashed host: it died with it).
    pub dump: Option<Dump>,
}

/// Everything a simulation produced. The same seed and setup give the same bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Ranks.
    pub world_size: u32,
    /// The workload.
    pub workload: String,
    /// The fault plan.
    pub plan: FaultPlan,
    /// The collective timeout (ms).
    pub timeout_ms: u64,
    /// When the simulation stopped (simulated ms).
    pub end_ms: u64,
    /// When each fault took effect (simulated ms), as `(fault, ms)`.
    pub applied: Vec<(String, u64)>,
    /// Per rank.
    pub ranks: Vec<RankReport>,
    /// The cross-rank diagnosis of the dumps.
    pub diagnosis: Diagnosis,
    /// The backend, when not TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<Backend>,
}

impl Report {
    /// As pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report is plain data")
    }

    /// The report without dumps and hook events, as text: what a person reads first (and
    /// what the snapshot tests pin).
    pub fn summary(&self) -> String {
        self.to_string()
    }

    /// Ranks the diagnosis blames.
    pub fn blamed(&self) -> Vec<u32> {
        let mut out: Vec<u32> = self.diagnosis.findings.iter().flat_map(|f| f.culprits()).map(|r| r.0).collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "seed {}, {} ranks, workload: {}", self.seed, self.world_size, self.workload)?;
        if let Some(b) = self.backend {
            writeln!(f, "backend: {b} (emulated device and communicator)")?;
        }
        writeln!(f, "faults: {}", self.plan)?;
        for (fault, ms) in &self.applied {
            writeln!(f, "  {fault}: took effect at {ms} ms")?;
        }
        writeln!(f, "collective timeout {} ms; simulation stopped at {} ms", self.timeout_ms, self.end_ms)?;
        if self.ranks.len() <= FOLD_ABOVE {
            for r in &self.ranks {
                write_rank(f, r, &format!("rank {}", r.rank))?;
            }
        } else {
            // At scale most ranks end alike: one of them stands for the rest, and only the
            // ranks that differ from that majority are shown one by one (`--json` has all).
            let mut shapes: BTreeMap<Vec<String>, Vec<Rank>> = BTreeMap::new();
            for r in &self.ranks {
                shapes.entry(shape(r)).or_default().push(Rank(r.rank));
            }
            let majority = shapes.values().max_by_key(|ranks| ranks.len()).cloned().unwrap_or_default();
            if let Some(first) = majority.first().and_then(|r| self.ranks.iter().find(|x| x.rank == r.0)) {
                let label = format!(
                    "ranks {} ({} of {}, alike; rank {} shown)",
                    rank_ranges(&majority),
                    majority.len(),
                    self.ranks.len(),
                    first.rank
                );
                write_rank(f, first, &label)?;
            }
            // Ranks went in in order, so the list is sorted.
            for r in self.ranks.iter().filter(|r| majority.binary_search(&Rank(r.rank)).is_err()) {
                write_rank(f, r, &format!("rank {}", r.rank))?;
            }
        }
        writeln!(f, "diagnosis:")?;
        for line in self.diagnosis.to_string().lines() {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// Reports of up to this many ranks show every rank; larger ones fold the ranks that end
/// alike (see [`shape`]) into one.
const FOLD_ABOVE: usize = 16;

/// What two ranks that "end alike" share: how the run ended and each work's step, call, seq
/// and outcome, without times, error texts or rank numbers (which differ from rank to rank
/// even when they ended the same way).
fn shape(r: &RankReport) -> Vec<String> {
    let fate = match &r.fate {
        Fate::Finished => "finished".to_owned(),
        Fate::Failed { .. } => "failed".to_owned(),
        Fate::InitFailed { .. } => "could not join".to_owned(),
        Fate::Crashed { .. } => "crashed".to_owned(),
        Fate::Hung { collective, .. } => format!("hung at {collective}"),
        Fate::StillRunning => "still running".to_owned(),
    };
    let works = r.works.iter().map(|w| format!("#{} {} {:?} {:?}", w.step, w.call, w.seq, w.outcome));
    let events = r.works.is_empty().then(|| r.events.iter().map(|e| format!("{} {} {:?}", e.seq, e.op, e.state)));
    std::iter::once(fate).chain(works).chain(events.into_iter().flatten()).collect()
}

/// One rank's part of the text report, under `label`.
fn write_rank(f: &mut fmt::Formatter<'_>, r: &RankReport, label: &str) -> fmt::Result {
    let fate = match &r.fate {
        Fate::Finished => "finished".to_owned(),
        Fate::Failed { error } => format!("failed: {error}"),
        Fate::InitFailed { error } => format!("could not join: {error}"),
        Fate::Crashed { at_ms } => format!("crashed at {at_ms} ms"),
        Fate::Hung { collective, learned: None } => format!("hung before collective {collective}"),
        Fate::Hung { collective, learned: Some(e) } => {
            format!("hung before collective {collective}, then learned: {e}")
        }
        Fate::StillRunning => "still running at the time limit".to_owned(),
    };
    writeln!(f, "{label}: {fate}")?;
    for w in &r.works {
        let seq = w.seq.map_or_else(|| "-".to_owned(), |s| s.to_string());
        let end = w.ended_ms.map_or_else(|| "…".to_owned(), |e| e.to_string());
        write!(f, "  #{} {} seq {seq}: {:?} {}..{end} ms", w.step, w.call, w.outcome, w.submitted_ms)?;
        if let Some(e) = &w.error {
            write!(f, ": {e}")?;
        }
        writeln!(f)?;
    }
    if r.works.is_empty() {
        for e in &r.events {
            writeln!(f, "  seq {} {} {:?} at {} ms", e.seq, e.op, e.state, e.at_ms)?;
        }
    }
    Ok(())
}

/// Simulated milliseconds since the start (inside a host).
fn sim_ms() -> u64 {
    turmoil::sim_elapsed().map_or(0, |d| d.as_millis() as u64)
}

/// What a rank shares with the controller.
#[derive(Default)]
struct Slot {
    pg: Option<ProcessGroup>,
    nccl: Option<nccl::Pg>,
    joined_ms: Option<u64>,
    fate: Option<Fate>,
    works: Vec<WorkOutcome>,
    events: Arc<Mutex<Vec<WorkEvent>>>,
    dump: Option<String>,
    crash_requested: bool,
    /// The rank's run returned.
    done: bool,
}

struct Shared {
    slots: Vec<RefCell<Slot>>,
}

/// The per-rank plan, resolved from the fault plan.
#[derive(Debug, Clone, Default)]
struct RankFaults {
    crash_at_collective: Option<usize>,
    hang_at: Option<usize>,
    slow: Option<Duration>,
    desync: Vec<(usize, Change)>,
    device: Vec<(usize, DeviceFault)>,
}

impl RankFaults {
    fn of(plan: &FaultPlan, rank: u32) -> RankFaults {
        let mut out = RankFaults::default();
        for f in &plan.faults {
            match *f {
                Fault::Crash { rank: r, at: Trigger::Collective(k) } if r == rank => {
                    out.crash_at_collective = Some(out.crash_at_collective.map_or(k, |c| c.min(k)));
                }
                Fault::Hang { rank: r, collective } if r == rank => {
                    out.hang_at = Some(out.hang_at.map_or(collective, |c| c.min(collective)));
                }
                Fault::Slow { rank: r, delay_ms } if r == rank => out.slow = Some(Duration::from_millis(delay_ms)),
                Fault::Desync { rank: r, collective, change } if r == rank => out.desync.push((collective, change)),
                Fault::Device { rank: r, collective, kind } if r == rank => out.device.push((collective, kind)),
                _ => {}
            }
        }
        out
    }

    fn apply(&self, k: usize, mut step: Step) -> Step {
        for &(c, change) in &self.desync {
            if c == k {
                match change {
                    Change::Op(op) => step.op = op,
                    Change::Numel(n) => step.numel = n,
                    Change::Dtype(d) => step.dtype = d,
                    Change::OtherOp => {
                        let i = ScriptOp::ALL.iter().position(|o| *o == step.op).unwrap_or(0);
                        step.op = ScriptOp::ALL[(i + 1) % ScriptOp::ALL.len()];
                    }
                    Change::OtherSize => step.numel = step.numel * 2 + 1,
                    Change::OtherDtype => {
                        step.dtype = if step.dtype == DType::F64 { DType::F32 } else { DType::F64 };
                    }
                }
            }
        }
        step
    }
}

/// A network action at a time.
#[derive(Debug, Clone)]
enum Action {
    Crash(u32),
    Partition(Vec<(String, String)>),
    Repair(Vec<(String, String)>),
    Hold(String, String),
    Release(String, String),
    Latency(String, String, Duration),
    StoreCrash,
}

struct Controller {
    cfg: Simulation,
    seed: u64,
    shared: Rc<Shared>,
    /// Each rank's host ([`placement`]).
    hosts: Vec<String>,
}

impl Controller {
    fn new(cfg: Simulation, seed: u64) -> Controller {
        let slots = (0..cfg.world_size).map(|_| RefCell::new(Slot::default())).collect();
        let hosts = placement(cfg.world_size, cfg.ranks_per_host, &cfg.plan);
        Controller { cfg, seed, shared: Rc::new(Shared { slots }), hosts }
    }

    fn timeline(&self) -> Vec<(u64, usize, Action)> {
        let n = self.cfg.world_size;
        let host = |r: u32| self.hosts[r as usize].clone();
        let mut out = Vec::new();
        for (i, f) in self.cfg.plan.faults.iter().enumerate() {
            match *f {
                Fault::Crash { rank, at: Trigger::AtMs(t) } => out.push((t, i, Action::Crash(rank))),
                Fault::Partition { a, b, at_ms, until_ms } => {
                    let link = vec![(host(a), host(b))];
                    out.push((at_ms, i, Action::Partition(link.clone())));
                    if let Some(u) = until_ms {
                        out.push((u, i, Action::Repair(link)));
                    }
                }
                Fault::Isolate { rank, at_ms, until_ms } => {
                    // Every other host, once (several ranks may share one, not always adjacent
                    // in rank order), and the store's.
                    let others: std::collections::BTreeSet<String> = (0..n).filter(|&r| r != rank).map(host).collect();
                    let links: Vec<(String, String)> =
                        others.into_iter().chain([STORE_HOST.to_owned()]).map(|other| (host(rank), other)).collect();
                    out.push((at_ms, i, Action::Partition(links.clone())));
                    if let Some(u) = until_ms {
                        out.push((u, i, Action::Repair(links)));
                    }
                }
                Fault::Cut { from, to, at_ms, until_ms } => {
                    // Every link across, both ways (turmoil's partition is of a pair); the
                    // store stays reachable from both sides.
                    let links: Vec<(String, String)> = (from..to)
                        .flat_map(|a| (0..n).filter(move |b| !(from..to).contains(b)).map(move |b| (a, b)))
                        .map(|(a, b)| (host(a), host(b)))
                        .collect::<std::collections::BTreeSet<_>>()
                        .into_iter()
                        .collect();
                    out.push((at_ms, i, Action::Partition(links.clone())));
                    if let Some(u) = until_ms {
                        out.push((u, i, Action::Repair(links)));
                    }
                }
                Fault::Hold { a, b, at_ms, until_ms } => {
                    out.push((at_ms, i, Action::Hold(host(a), host(b))));
                    if let Some(u) = until_ms {
                        out.push((u, i, Action::Release(host(a), host(b))));
                    }
                }
                Fault::Latency { a, b, latency_ms, at_ms } => {
                    out.push((at_ms, i, Action::Latency(host(a), host(b), Duration::from_millis(latency_ms))))
                }
                Fault::StoreCrash { at_ms } => out.push((at_ms, i, Action::StoreCrash)),
                _ => {}
            }
        }
        out.sort_by_key(|(t, i, _)| (*t, *i));
        out
    }

    fn run(self) -> Report {
        let cfg = &self.cfg;
        let mut sim = turmoil::Builder::new()
            .rng_seed(self.seed)
            .epoch(UNIX_EPOCH + Duration::from_nanos(WALL_CLOCK_START_NS))
            .simulation_duration(cfg.limit + Duration::from_secs(3600))
            .tick_duration(Duration::from_millis(1))
            .min_message_latency(Duration::ZERO)
            .max_message_latency(cfg.max_latency)
            .tcp_capacity(1 << 16)
            .build();
        sim.host(STORE_HOST, || async {
            let bind = SocketAddr::from(([0, 0, 0, 0], STORE_PORT));
            let server = TcpStoreServer::bind(TurmoilNet, TcpStoreServerConfig::new(bind)).await?;
            std::future::pending::<()>().await;
            drop(server);
            Ok(())
        });
        // Each host's ranks, in rank order (hosts in order of their first rank).
        let mut on_host: Vec<(String, Vec<Rc<RankCtx>>)> = Vec::new();
        for rank in 0..cfg.world_size {
            let host = self.hosts[rank as usize].clone();
            let ctx = Rc::new(RankCtx {
                rank,
                host: host.clone(),
                cfg: cfg.clone(),
                faults: RankFaults::of(&cfg.plan, rank),
                shared: self.shared.clone(),
            });
            match on_host.iter_mut().find(|(h, _)| *h == host) {
                Some((_, ctxs)) => ctxs.push(ctx),
                None => on_host.push((host, vec![ctx])),
            }
        }
        for (host, ctxs) in on_host {
            // A host, not a client: only hosts can be crashed. The controller decides when
            // the run is over (no rank's software running), not turmoil.
            sim.host(host, move || {
                let ctxs = ctxs.clone();
                async move {
                    if let [ctx] = &ctxs[..] {
                        ctx.run().await;
                        ctx.slot().done = true;
                        return Ok(());
                    }
                    // Several ranks: each its own task, as processes of one node.
                    let tasks: Vec<_> = ctxs
                        .into_iter()
                        .map(|ctx| {
                            tokio::task::spawn_local(async move {
                                ctx.run().await;
                                ctx.slot().done = true;
                            })
                        })
                        .collect();
                    for t in tasks {
                        let _ = t.await;
                    }
                    Ok(())
                }
            });
        }

        let mut timeline: VecDeque<(u64, usize, Action)> = self.timeline().into();
        let mut applied = Vec::new();
        let limit_ms = cfg.limit.as_millis() as u64;
        let grace_ms = (cfg.heartbeat.interval * 4).as_millis() as u64 + 1000;
        let mut others_done_at: Option<u64> = None;
        let mut store_up = true;
        let end_ms = loop {
            let now = sim.elapsed().as_millis() as u64;
            while timeline.front().is_some_and(|(t, _, _)| *t <= now) {
                let Some((_, i, action)) = timeline.pop_front() else { break };
                if self.apply(&mut sim, &action, &mut store_up, now) {
                    applied.push((cfg.plan.faults[i].to_string(), now));
                }
            }
            for rank in 0..cfg.world_size {
                let requested = std::mem::take(&mut self.shared.slots[rank as usize].borrow_mut().crash_requested);
                if requested {
                    self.crash(&mut sim, rank, now);
                    let i =
                        cfg.plan.faults.iter().position(
                            |f| matches!(f, Fault::Crash { rank: r, at: Trigger::Collective(_) } if *r == rank),
                        );
                    if let Some(i) = i {
                        applied.push((cfg.plan.faults[i].to_string(), now));
                    }
                }
            }
            if now >= limit_ms {
                break now;
            }
            // Done when no rank's software runs. Hung ranks that never learn of the failure
            // would run to the limit: stop a grace period after every other rank is done.
            let mut any_running = false;
            let mut only_hung = true;
            for rank in 0..cfg.world_size {
                if self.is_running(&mut sim, rank) {
                    any_running = true;
                    let hung = matches!(
                        self.shared.slots[rank as usize].borrow().fate,
                        Some(Fate::Hung { learned: None, .. })
                    );
                    only_hung &= hung;
                }
            }
            if !any_running {
                break now;
            }
            if only_hung {
                let since = *others_done_at.get_or_insert(now);
                if now >= since + grace_ms {
                    break now;
                }
            }
            if let Err(e) = sim.step() {
                // A host returned an error: only the store's can (it could not bind).
                tracing::error!("simulation stopped: {e}");
                break sim.elapsed().as_millis() as u64;
            }
        };
        self.report(end_ms, applied)
    }

    /// Apply one timed action; whether it took effect (a fault on a dead host does not).
    fn apply(&self, sim: &mut turmoil::Sim<'_>, action: &Action, store_up: &mut bool, now: u64) -> bool {
        match action {
            Action::Crash(rank) => return self.crash(sim, *rank, now),
            Action::Partition(links) => links.iter().for_each(|(a, b)| sim.partition(a.as_str(), b.as_str())),
            Action::Repair(links) => links.iter().for_each(|(a, b)| sim.repair(a.as_str(), b.as_str())),
            Action::Hold(a, b) => sim.hold(a.as_str(), b.as_str()),
            Action::Release(a, b) => sim.release(a.as_str(), b.as_str()),
            Action::Latency(a, b, d) => sim.set_link_latency(a.as_str(), b.as_str(), *d),
            Action::StoreCrash => {
                if !*store_up {
                    return false;
                }
                *store_up = false;
                sim.crash(STORE_HOST);
            }
        }
        true
    }

    /// Whether the rank's software still runs: its host is up and its run has not returned.
    fn is_running(&self, sim: &mut turmoil::Sim<'_>, rank: u32) -> bool {
        sim.is_host_running(self.hosts[rank as usize].as_str()) && !self.shared.slots[rank as usize].borrow().done
    }

    fn crash(&self, sim: &mut turmoil::Sim<'_>, rank: u32, now: u64) -> bool {
        let mut slot = self.shared.slots[rank as usize].borrow_mut();
        let host = self.hosts[rank as usize].as_str();
        if matches!(slot.fate, Some(Fate::Crashed { .. })) || !sim.is_host_running(host) {
            return false;
        }
        slot.fate = Some(Fate::Crashed { at_ms: now });
        drop(slot);
        // `placement` gave a rank that a crash names a host of its own.
        sim.crash(host);
        true
    }

    fn report(self, end_ms: u64, applied: Vec<(String, u64)>) -> Report {
        let mut ranks = Vec::new();
        let mut dumps = Vec::new();
        for (rank, slot) in self.shared.slots.iter().enumerate() {
            let mut slot = slot.borrow_mut();
            let fate = slot.fate.clone().unwrap_or(Fate::StillRunning);
            let crashed = matches!(fate, Fate::Crashed { .. });
            // A rank that ended wrote its dump; one still running (or hung) is read now; a
            // crashed host's recorder died with it.
            let text = match (&slot.dump, &slot.pg, &slot.nccl) {
                _ if crashed => None,
                (Some(d), _, _) => Some(d.clone()),
                (None, Some(pg), _) => Some(pg.flight_recorder_json()),
                (None, None, Some(pg)) => Some(pg.flight_recorder_json()),
                (None, None, None) => None,
            };
            let dump = text.and_then(|t| match Dump::from_json(&t) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::error!(rank, "unreadable dump: {e}");
                    None
                }
            });
            if let Some(d) = &dump {
                dumps.push((Rank(rank as u32), d.clone()));
            }
            let mut works = std::mem::take(&mut slot.works);
            if crashed {
                // Works in flight on a crashed host never end; they are not outcomes.
                works.retain(|w| w.outcome != Outcome::Unfinished);
            }
            let events = slot.events.lock().unwrap_or_else(|p| p.into_inner()).clone();
            ranks.push(RankReport { rank: rank as u32, fate, joined_ms: slot.joined_ms, works, events, dump });
        }
        let diagnosis = diagnose(&dumps, Some(self.cfg.world_size));
        Report {
            seed: self.seed,
            world_size: self.cfg.world_size,
            workload: self.cfg.workload.to_string(),
            plan: self.cfg.plan.clone(),
            timeout_ms: self.cfg.timeout.as_millis() as u64,
            end_ms,
            applied,
            ranks,
            diagnosis,
            backend: (self.cfg.backend != Backend::Tcp).then_some(self.cfg.backend),
        }
    }
}

struct RankCtx {
    rank: u32,
    host: String,
    cfg: Simulation,
    faults: RankFaults,
    shared: Rc<Shared>,
}

impl RankCtx {
    fn slot(&self) -> std::cell::RefMut<'_, Slot> {
        self.shared.slots[self.rank as usize].borrow_mut()
    }

    fn end(&self, fate: Fate) {
        let mut slot = self.slot();
        if slot.fate.is_none() || matches!(slot.fate, Some(Fate::Hung { .. })) {
            slot.fate = Some(fate);
        }
    }

    async fn run(&self) {
        if self.cfg.backend == Backend::Nccl {
            return self.run_nccl().await;
        }
        let cfg = &self.cfg;
        let store_cfg = TcpStoreConfig::new(STORE_HOST, STORE_PORT)
            .with_timeout(cfg.init_timeout)
            .with_connect_timeout(cfg.init_timeout);
        let store = match TcpStore::connect_with(TurmoilNet, store_cfg).await {
            Ok(s) => s,
            Err(e) => return self.end(Fate::InitFailed { error: format!("cannot reach the store: {e}") }),
        };
        let opts = TcpOptions {
            timeout: cfg.timeout,
            init_timeout: cfg.init_timeout,
            heartbeat: Some(cfg.heartbeat),
            error_handling: ErrorHandling::CleanUpOnly,
            bind_addr: turmoil::lookup(self.host.as_str()),
            trace_buffer_size: cfg.trace_buffer_size,
            dump_prefix: None,
            wall_clock_anchor_ns: Some(WALL_CLOCK_START_NS + sim_ms() * 1_000_000),
            lazy_connect: cfg.lazy_connect,
            ..TcpOptions::default()
        };
        let pg = match ProcessGroup::connect(TurmoilNet, Arc::new(store), self.rank, cfg.world_size, opts).await {
            Ok(pg) => pg,
            Err(e) => return self.end(Fate::InitFailed { error: e.to_string() }),
        };
        self.joined(&pg);
        self.slot().pg = Some(pg.clone());
        let fate = match &cfg.workload {
            Workload::Script(script) => self.run_script(&pg, script).await,
            Workload::Custom { run, .. } => match run(pg.clone()).await {
                Ok(()) => Fate::Finished,
                Err(error) => Fate::Failed { error: error.to_string() },
            },
        };
        if matches!(fate, Fate::Hung { .. }) {
            self.end(fate);
            return;
        }
        self.slot().dump = Some(pg.flight_recorder_json());
        self.end(fate);
        pg.shutdown_async().await;
    }

    /// The rank joined its group: the report records when, and every work the group finishes.
    fn joined<G: SimGroup>(&self, pg: &G) {
        let events = self.slot().events.clone();
        pg.set_completion_hook(move |info| {
            events.lock().unwrap_or_else(|p| p.into_inner()).push(WorkEvent {
                seq: info.seq.0,
                op: info.op.to_string(),
                state: info.state,
                at_ms: sim_ms(),
            });
        });
        self.slot().joined_ms = Some(sim_ms());
    }

    async fn run_script<G: SimGroup>(&self, pg: &G, script: &Script) -> Fate {
        let mut in_flight: VecDeque<InFlight<G::Pending>> = VecDeque::new();
        let mut first_error: Option<String> = None;
        for (k, &step) in script.steps.iter().enumerate() {
            // Wait as a caller with `window` works in flight would, before anything else
            // happens at this step.
            while in_flight.len() >= script.window {
                let Some(w) = in_flight.pop_front() else { break };
                if let Err(e) = self.finish(pg, w).await {
                    first_error.get_or_insert(e);
                }
            }
            if first_error.is_some() {
                break;
            }
            if self.faults.crash_at_collective == Some(k) {
                self.slot().crash_requested = true;
                // The controller crashes this host before its next tick.
                std::future::pending::<()>().await;
            }
            if self.faults.hang_at == Some(k) {
                while let Some(w) = in_flight.pop_front() {
                    // An earlier failure is in the outcomes already; the rank hangs either way.
                    let _ = self.finish(pg, w).await;
                }
                return self.hang(pg, k).await;
            }
            if let Some(d) = self.faults.slow {
                tokio::time::sleep(d).await;
            }
            for &(c, kind) in &self.faults.device {
                if c == k {
                    pg.inject(kind);
                }
            }
            let call = self.faults.apply(k, step);
            let submitted_ms = sim_ms();
            match pg.submit(&call) {
                Ok((work, pending)) => in_flight.push_back((k, call, work, submitted_ms, pending)),
                Err(e) => {
                    self.slot().works.push(WorkOutcome {
                        step: k,
                        call: call.to_string(),
                        seq: None,
                        outcome: Outcome::Refused,
                        error: Some(e.clone()),
                        culprit: pg.failure().and_then(|f| f.culprit()).map(|r| r.0),
                        blame: pg.failure().map(|f| f.blame.clone()),
                        submitted_ms,
                        ended_ms: Some(submitted_ms),
                    });
                    first_error.get_or_insert(e);
                    break;
                }
            }
        }
        while let Some(w) = in_flight.pop_front() {
            if let Err(e) = self.finish(pg, w).await {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            None => Fate::Finished,
            Some(error) => Fate::Failed { error },
        }
    }

    /// Wait for one work and record its outcome (a placeholder first, so that a work still
    /// running when the simulation stops is reported as unfinished).
    async fn finish<G: SimGroup>(
        &self,
        pg: &G,
        (k, call, work, submitted_ms, pending): InFlight<G::Pending>,
    ) -> Result<(), String> {
        let index = {
            let mut slot = self.slot();
            slot.works.push(WorkOutcome {
                step: k,
                call: call.to_string(),
                seq: Some(work.seq().0),
                outcome: Outcome::Unfinished,
                error: None,
                culprit: None,
                blame: None,
                submitted_ms,
                ended_ms: None,
            });
            slot.works.len() - 1
        };
        let result = work.clone().await;
        let (outcome, error, blame) = match result {
            Ok(outputs) => match pg.outputs(pending, outputs).await {
                Ok(outputs) => match check(&call, self.rank, self.cfg.world_size, &outputs) {
                    Ok(()) => (Outcome::Completed, None, None),
                    Err(e) => (Outcome::Wrong, Some(format!("wrong result: {e}")), None),
                },
                Err(e) => (Outcome::Failed, Some(e), None),
            },
            Err(e) => (Outcome::of(work.state()), Some(e.to_string()), Some(e.blame())),
        };
        let culprit = blame.as_ref().and_then(cohort_core::Blame::culprit).map(|r| r.0);
        let ended_ms = sim_ms();
        let mut slot = self.slot();
        let w = &mut slot.works[index];
        w.outcome = outcome;
        w.error = error.clone();
        w.culprit = culprit;
        w.blame = blame;
        w.ended_ms = Some(ended_ms);
        match error {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Stay alive without calling collective `k`: wait until the group learns of a failure
    /// (its peers time out and publish it), as a hung process would be told by its launcher.
    async fn hang<G: SimGroup>(&self, pg: &G, k: usize) -> Fate {
        self.slot().fate = Some(Fate::Hung { collective: k, learned: None });
        loop {
            if let Some(f) = pg.failure() {
                self.slot().dump = Some(pg.flight_recorder_json());
                return Fate::Hung { collective: k, learned: Some(f.message) };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A work in flight in a script: its step, the call as made, the work, when it was submitted,
/// and what the backend needs to read its results.
type InFlight<P> = (usize, Step, Work, u64, P);

/// What a script needs of a rank's process group, on either backend.
trait SimGroup {
    /// What reading a work's results back needs (device tensors on NCCL).
    type Pending;
    /// Submit `step`.
    fn submit(&self, step: &Step) -> Result<(Work, Self::Pending), String>;
    /// The results of a work that succeeded, as host tensors (`from_work`: what the work
    /// itself returned).
    async fn outputs(&self, pending: Self::Pending, from_work: Vec<Tensor>) -> Result<Vec<Tensor>, String>;
    /// The group's first failure.
    fn failure(&self) -> Option<cohort_core::group::GroupFailure>;
    /// The flight recorder.
    fn flight_recorder_json(&self) -> String;
    /// Call `hook` with every work the group finishes.
    fn set_completion_hook(&self, hook: impl Fn(&cohort_transports::WorkInfo) + Send + Sync + 'static);
    /// Arm a device fault for the next collective (only the NCCL backend has a device).
    fn inject(&self, _fault: DeviceFault) {}
}

impl SimGroup for ProcessGroup {
    type Pending = ();

    fn submit(&self, step: &Step) -> Result<(Work, ()), String> {
        submit(self, step).map(|w| (w, ()))
    }

    async fn outputs(&self, (): (), from_work: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        Ok(from_work)
    }

    fn failure(&self) -> Option<cohort_core::group::GroupFailure> {
        ProcessGroup::failure(self)
    }

    fn flight_recorder_json(&self) -> String {
        ProcessGroup::flight_recorder_json(self)
    }

    fn set_completion_hook(&self, hook: impl Fn(&cohort_transports::WorkInfo) + Send + Sync + 'static) {
        ProcessGroup::set_completion_hook(self, hook);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> FaultPlan {
        text.parse().unwrap()
    }

    #[test]
    fn placement_packs_consecutive_ranks_and_gives_faulted_ranks_hosts_of_their_own() {
        // One rank a host by default: every rank's own name.
        assert_eq!(placement(3, 1, &FaultPlan::none()), ["rank0", "rank1", "rank2"]);
        // Four a host; a leftover rank alone on a node is named for itself.
        let hosts = placement(9, 4, &FaultPlan::none());
        assert_eq!(hosts, ["node0", "node0", "node0", "node0", "node1", "node1", "node1", "node1", "rank8"]);
        // A crash, a partition's ends: hosts of their own; a hang or desync strikes no host.
        let hosts = placement(8, 4, &plan("crash:1@seq2; partition:5-6@t=10ms; hang:2@seq1"));
        assert_eq!(hosts, ["node0", "rank1", "node0", "node0", "node0", "rank5", "rank6", "rank7"]);
        // A cut: no host straddles it.
        let hosts = placement(8, 4, &plan("cut:2..5@t=10ms"));
        assert_eq!(hosts, ["node0", "node0", "node1", "node1", "node1", "node2", "node2", "node2"]);
        // Isolate, hold, latency.
        let hosts = placement(4, 4, &plan("isolate:0@t=5ms; hold:1-2@t=5ms"));
        assert_eq!(hosts, ["rank0", "rank1", "rank2", "rank3"]);
    }

    #[test]
    fn ranks_sharing_hosts_run_the_job_and_each_fault_names_its_rank() {
        for (fault, culprit) in [("crash:5@seq2", 5), ("hang:6@seq2", 6), ("desync-size:9@seq2", 9)] {
            let report = Simulation::new(12)
                .seed(4)
                .ranks_per_host(4)
                .script(Script::allreduces(3, 256))
                .faults(plan(fault))
                .run()
                .unwrap();
            assert_eq!(report.blamed(), vec![culprit], "{fault}: {}", report.diagnosis);
            let healthy =
                Simulation::new(12).seed(4).ranks_per_host(4).script(Script::allreduces(3, 256)).run().unwrap();
            assert!(healthy.ranks.iter().all(|r| r.fate == Fate::Finished), "{fault}");
        }
    }
}
