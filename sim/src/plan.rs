//! Fault plans as data: what goes wrong, where and when. Written by hand (Rust or the text
//! syntax below) or drawn from a seed.
//!
//! # Text syntax
//!
//! Faults separated by `;`. Times are simulated milliseconds since the simulation started;
//! collectives are 0-based indices into the script.
//!
//! | fault | meaning |
//! |---|---|
//! | `crash R @collective K` / `crash R @T ms` | the rank's host dies (peers read EOF) when it starts collective K, or at time T |
//! | `hang R @collective K` | the rank stays alive but never calls collective K |
//! | `partition A-B @T ms [until U ms]` | the link between two ranks drops everything, optionally repaired at U |
//! | `isolate R @T ms [until U ms]` | the rank is partitioned from every other rank and the store |
//! | `cut A..B @T ms [until U ms]` | ranks A to B-1 are partitioned from all the others (every link across drops); the store stays reachable from both sides |
//! | `hold A-B @T ms [until U ms]` | the link holds its messages (silence, nothing lost), released at U |
//! | `latency A-B L ms [@T ms]` | the link's latency becomes L from time T (default 0) |
//! | `slow R D ms` | the rank sleeps D before every collective |
//! | `desync R @collective K op=OP` / `numel=N` / `dtype=D` | the rank calls another op, size or dtype at K |
//! | `store-crash @T ms` | the store's host dies |
//!
//! Spaces around `ms` are optional (`@500ms`). `op=other`, `numel=other` and `dtype=other`
//! change to the next op, twice the size plus one, or f64 (f32 from f64). The compact
//! one-word form `crash:3@seq5`, `hang:2@seq4`, `partition:0-1@t=2s`, `cut:1..3@t=500ms`,
//! `desync-size:1@seq3` (see [`Fault`]'s `FromStr`) reads the same faults; `seqN` is the N-th
//! collective. A cut's `A..B` is half-open, as in Rust: `cut 1..3` puts ranks 1 and 2 on one
//! side.

use std::fmt;
use std::str::FromStr;

use cohort_core::tensor::DType;
use serde::{Deserialize, Serialize};

use crate::workload::{Script, ScriptOp};

/// When a crash happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// At this simulated time (ms since the start).
    AtMs(u64),
    /// When the rank starts this collective (0-based script index), before submitting it.
    Collective(usize),
}

/// What a desynchronised rank does differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    /// Calls this collective instead.
    Op(ScriptOp),
    /// Passes this many elements instead.
    Numel(usize),
    /// Passes this dtype instead.
    Dtype(DType),
    /// Calls the next collective in [`ScriptOp::ALL`] instead.
    OtherOp,
    /// Passes twice the elements plus one.
    OtherSize,
    /// Passes f64 instead (f32 if it was f64).
    OtherDtype,
}

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "fault", rename_all = "snake_case")]
pub enum Fault {
    /// The rank's host dies.
    Crash {
        /// The rank.
        rank: u32,
        /// When.
        at: Trigger,
    },
    /// The rank stays alive but never calls this collective.
    Hang {
        /// The rank.
        rank: u32,
        /// The collective it never calls (0-based script index).
        collective: usize,
    },
    /// The link between two ranks drops everything.
    Partition {
        /// One end.
        a: u32,
        /// The other end.
        b: u32,
        /// From (ms).
        at_ms: u64,
        /// Repaired at (ms), if ever.
        until_ms: Option<u64>,
    },
    /// The rank is cut off from every other rank and the store.
    Isolate {
        /// The rank.
        rank: u32,
        /// From (ms).
        at_ms: u64,
        /// Repaired at (ms), if ever.
        until_ms: Option<u64>,
    },
    /// A partition between two sets of ranks: ranks `from..to` on one side, every other rank
    /// on the other; every link across drops everything, both ways (as a [`Fault::Partition`]
    /// of each pair across). Links within a side keep working, and the store's host stays
    /// reachable from both sides (unlike [`Fault::Isolate`], which cuts the store too).
    Cut {
        /// The first rank of the side `from..to`.
        from: u32,
        /// One past its last rank.
        to: u32,
        /// From (ms).
        at_ms: u64,
        /// Repaired at (ms), if ever.
        until_ms: Option<u64>,
    },
    /// The link holds its messages (they are delayed, not lost).
    Hold {
        /// One end.
        a: u32,
        /// The other end.
        b: u32,
        /// From (ms).
        at_ms: u64,
        /// Released at (ms), if ever.
        until_ms: Option<u64>,
    },
    /// The link's latency changes.
    Latency {
        /// One end.
        a: u32,
        /// The other end.
        b: u32,
        /// The latency (ms).
        latency_ms: u64,
        /// From (ms).
        at_ms: u64,
    },
    /// The rank sleeps before every collective.
    Slow {
        /// The rank.
        rank: u32,
        /// How long (ms).
        delay_ms: u64,
    },
    /// The rank calls another op, size or dtype at one collective.
    Desync {
        /// The rank.
        rank: u32,
        /// The collective (0-based script index).
        collective: usize,
        /// What it does differently.
        change: Change,
    },
    /// The store's host dies.
    StoreCrash {
        /// When (ms).
        at_ms: u64,
    },
    /// A device fault at one collective (NCCL backend only: injected into the emulated device
    /// and communicator).
    Device {
        /// The rank.
        rank: u32,
        /// The collective (0-based script index).
        collective: usize,
        /// What goes wrong.
        kind: DeviceFault,
    },
}

/// What goes wrong on a rank's (emulated) GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceFault {
    /// The stream stalls before the collective's kernel (a hung kernel ahead of it): its
    /// start event never fires.
    KernelHang,
    /// The communicator reports an asynchronous error (`ncclRemoteError`) when the kernel
    /// runs, and the kernel stays stuck until the communicator is aborted.
    NcclError,
    /// The kernel takes [`SLOW_KERNEL_MS`] longer, then completes correctly.
    SlowKernel,
}

/// How much longer a [`DeviceFault::SlowKernel`] kernel takes.
pub const SLOW_KERNEL_MS: u64 = 100;

impl DeviceFault {
    /// The name in plans (`kernel-hang`, `nccl-error`, `slow-kernel`).
    pub const fn name(self) -> &'static str {
        match self {
            DeviceFault::KernelHang => "kernel-hang",
            DeviceFault::NcclError => "nccl-error",
            DeviceFault::SlowKernel => "slow-kernel",
        }
    }

    fn parse(s: &str) -> Option<DeviceFault> {
        [DeviceFault::KernelHang, DeviceFault::NcclError, DeviceFault::SlowKernel].into_iter().find(|d| d.name() == s)
    }
}

impl Fault {
    /// Whether a job under this fault alone must still finish every collective correctly:
    /// a slow rank, added latency, a hold released well within the timeouts, or a store that
    /// dies after every rank has connected (the store is not on the data path).
    pub fn is_benign(&self, timeout_ms: u64) -> bool {
        match *self {
            Fault::Slow { delay_ms, .. } => delay_ms < timeout_ms / 2,
            Fault::Device { kind: DeviceFault::SlowKernel, .. } => SLOW_KERNEL_MS < timeout_ms / 2,
            Fault::Latency { latency_ms, .. } => latency_ms < timeout_ms / 10,
            Fault::Hold { until_ms: Some(until), at_ms, .. } => until.saturating_sub(at_ms) < timeout_ms / 4,
            _ => false,
        }
    }

    /// The ranks this fault is about (the ones a diagnosis should name).
    pub fn ranks(&self) -> Vec<u32> {
        match *self {
            Fault::Crash { rank, .. }
            | Fault::Hang { rank, .. }
            | Fault::Isolate { rank, .. }
            | Fault::Slow { rank, .. }
            | Fault::Desync { rank, .. }
            | Fault::Device { rank, .. } => vec![rank],
            Fault::Partition { a, b, .. } | Fault::Hold { a, b, .. } | Fault::Latency { a, b, .. } => vec![a, b],
            // The side `from..to` (the other side is every other rank).
            Fault::Cut { from, to, .. } => (from..to).collect(),
            Fault::StoreCrash { .. } => Vec::new(),
        }
    }

    fn check(&self, world_size: u32, steps: usize) -> Result<(), String> {
        for r in self.ranks() {
            if r >= world_size {
                return Err(format!("{self}: rank {r} is not a rank of a {world_size}-rank world"));
            }
        }
        if let Fault::Partition { a, b, .. } | Fault::Hold { a, b, .. } | Fault::Latency { a, b, .. } = *self
            && a == b
        {
            return Err(format!("{self}: a link joins two different ranks"));
        }
        if let Fault::Cut { from, to, .. } = *self
            && (from >= to || to > world_size || (from == 0 && to == world_size))
        {
            return Err(format!(
                "{self}: a cut needs ranks on both sides: {from}..{to} must be a non-empty part of the {world_size} ranks 0..{world_size}"
            ));
        }
        let k = match *self {
            Fault::Crash { at: Trigger::Collective(k), .. } | Fault::Hang { collective: k, .. } => Some(k),
            Fault::Desync { collective: k, .. } | Fault::Device { collective: k, .. } => Some(k),
            _ => None,
        };
        if let Some(k) = k
            && k >= steps
        {
            return Err(format!("{self}: collective {k} is past the script's {steps} steps"));
        }
        if let Fault::Partition { at_ms, until_ms: Some(u), .. }
        | Fault::Isolate { at_ms, until_ms: Some(u), .. }
        | Fault::Cut { at_ms, until_ms: Some(u), .. }
        | Fault::Hold { at_ms, until_ms: Some(u), .. } = *self
            && u <= at_ms
        {
            return Err(format!("{self}: it must end after it starts"));
        }
        Ok(())
    }
}

fn until(f: &mut fmt::Formatter<'_>, until_ms: Option<u64>) -> fmt::Result {
    match until_ms {
        Some(u) => write!(f, " until {u}ms"),
        None => Ok(()),
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Fault::Crash { rank, at: Trigger::AtMs(t) } => write!(f, "crash {rank} @{t}ms"),
            Fault::Crash { rank, at: Trigger::Collective(k) } => write!(f, "crash {rank} @collective {k}"),
            Fault::Hang { rank, collective } => write!(f, "hang {rank} @collective {collective}"),
            Fault::Partition { a, b, at_ms, until_ms } => {
                write!(f, "partition {a}-{b} @{at_ms}ms")?;
                until(f, until_ms)
            }
            Fault::Isolate { rank, at_ms, until_ms } => {
                write!(f, "isolate {rank} @{at_ms}ms")?;
                until(f, until_ms)
            }
            Fault::Cut { from, to, at_ms, until_ms } => {
                write!(f, "cut {from}..{to} @{at_ms}ms")?;
                until(f, until_ms)
            }
            Fault::Hold { a, b, at_ms, until_ms } => {
                write!(f, "hold {a}-{b} @{at_ms}ms")?;
                until(f, until_ms)
            }
            Fault::Latency { a, b, latency_ms, at_ms } => write!(f, "latency {a}-{b} {latency_ms}ms @{at_ms}ms"),
            Fault::Slow { rank, delay_ms } => write!(f, "slow {rank} {delay_ms}ms"),
            Fault::Desync { rank, collective, change } => {
                write!(f, "desync {rank} @collective {collective} ")?;
                match change {
                    Change::Op(op) => write!(f, "op={op}"),
                    Change::Numel(n) => write!(f, "numel={n}"),
                    Change::Dtype(d) => write!(f, "dtype={}", crate::workload::dtype_short(d)),
                    Change::OtherOp => write!(f, "op=other"),
                    Change::OtherSize => write!(f, "numel=other"),
                    Change::OtherDtype => write!(f, "dtype=other"),
                }
            }
            Fault::StoreCrash { at_ms } => write!(f, "store-crash @{at_ms}ms"),
            Fault::Device { rank, collective, kind } => write!(f, "{} {rank} @collective {collective}", kind.name()),
        }
    }
}

/// Words of one fault, with `@` and `ms` split off so `@500ms`, `@ 500 ms` and `@500 ms` read
/// the same.
fn words(s: &str) -> Vec<String> {
    let spaced = s.replace('@', " @ ");
    let mut out = Vec::new();
    for w in spaced.split_whitespace() {
        match w.strip_suffix("ms") {
            Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                out.push(n.to_owned());
                out.push("ms".to_owned());
            }
            _ => out.push(w.to_owned()),
        }
    }
    out
}

struct Words<'a> {
    text: &'a str,
    words: std::vec::IntoIter<String>,
}

impl Words<'_> {
    fn err(&self, what: &str) -> String {
        format!("fault {:?}: {what}", self.text.trim())
    }
    fn next(&mut self, what: &str) -> Result<String, String> {
        self.words.next().ok_or_else(|| self.err(&format!("expected {what}")))
    }
    fn expect(&mut self, word: &str) -> Result<(), String> {
        let w = self.next(&format!("{word:?}"))?;
        if w == word { Ok(()) } else { Err(self.err(&format!("expected {word:?}, got {w:?}"))) }
    }
    fn num<T: FromStr>(&mut self, what: &str) -> Result<T, String> {
        let w = self.next(what)?;
        w.parse().map_err(|_| self.err(&format!("{what} {w:?} is not a number")))
    }
    fn ms(&mut self, what: &str) -> Result<u64, String> {
        let n = self.num(what)?;
        self.expect("ms")?;
        Ok(n)
    }
    fn at_ms(&mut self) -> Result<u64, String> {
        self.expect("@")?;
        self.ms("a time")
    }
    fn link(&mut self) -> Result<(u32, u32), String> {
        let w = self.next("a link A-B")?;
        let (a, b) = w.split_once('-').ok_or_else(|| self.err(&format!("expected a link A-B, got {w:?}")))?;
        let parse = |x: &str| x.parse::<u32>().map_err(|_| self.err(&format!("rank {x:?} is not a number")));
        Ok((parse(a)?, parse(b)?))
    }
    fn range(&mut self) -> Result<(u32, u32), String> {
        let w = self.next("a range of ranks A..B")?;
        range(&w).map_err(|e| self.err(&e))
    }
    fn until(&mut self) -> Result<Option<u64>, String> {
        match self.words.next() {
            None => Ok(None),
            Some(w) if w == "until" => self.ms("a time").map(Some),
            Some(w) => Err(self.err(&format!("expected \"until\" or the end, got {w:?}"))),
        }
    }
    fn collective(&mut self) -> Result<usize, String> {
        self.expect("@")?;
        self.expect("collective")?;
        self.num("a collective index")
    }
    fn end(&mut self) -> Result<(), String> {
        match self.words.next() {
            None => Ok(()),
            Some(w) => Err(self.err(&format!("unexpected {w:?}"))),
        }
    }
}

/// A half-open range of ranks `A..B`.
fn range(w: &str) -> Result<(u32, u32), String> {
    let (a, b) = w.split_once("..").ok_or_else(|| format!("expected a range of ranks A..B (A to B-1), got {w:?}"))?;
    let parse = |x: &str| x.parse::<u32>().map_err(|_| format!("rank {x:?} is not a number"));
    Ok((parse(a)?, parse(b)?))
}

/// The compact form, one word: `crash:3@seq5`, `crash:3@t=2s`, `hang:2@seq4`,
/// `partition:0-1@t=2s`, `isolate:1@t=500ms`, `cut:1..3@t=500ms`, `hold:0-1@t=1s`, `slow:2@100ms`,
/// `desync-op:1@seq3`, `desync-size:1@seq3`, `desync-dtype:1@seq3`, `store-crash@t=1s`, and
/// on the NCCL backend `kernel-hang:2@seq3`, `nccl-error:2@seq3`, `slow-kernel:2@seq3`.
/// `seqN` is the N-th collective (1-based, the sequence number a script's collective gets).
fn compact(text: &str) -> Result<Fault, String> {
    let err = |what: &str| format!("fault {text:?}: {what}");
    let (head, when) = text.split_once('@').ok_or_else(|| err("expected KIND:RANK@WHEN"))?;
    let (kind, who) = head.split_once(':').unwrap_or((head, ""));
    let rank = || who.parse::<u32>().map_err(|_| err(&format!("rank {who:?} is not a number")));
    let link = || {
        let (a, b) = who.split_once('-').ok_or_else(|| err(&format!("expected a link A-B, got {who:?}")))?;
        let p = |x: &str| x.parse::<u32>().map_err(|_| err(&format!("rank {x:?} is not a number")));
        Ok::<_, String>((p(a)?, p(b)?))
    };
    let seq = || {
        let n = when.strip_prefix("seq").ok_or_else(|| err(&format!("expected seqN, got {when:?}")))?;
        let n: usize = n.parse().map_err(|_| err(&format!("seq {n:?} is not a number")))?;
        n.checked_sub(1).ok_or_else(|| err("seq numbers start at 1"))
    };
    let ms = |v: &str| -> Result<u64, String> {
        let (n, scale) = if let Some(n) = v.strip_suffix("ms") {
            (n, 1)
        } else if let Some(n) = v.strip_suffix('s') {
            (n, 1000)
        } else {
            return Err(err(&format!("time {v:?} needs a unit (ms or s)")));
        };
        n.parse::<u64>().map(|n| n * scale).map_err(|_| err(&format!("time {v:?} is not a number")))
    };
    let time = || ms(when.strip_prefix("t=").ok_or_else(|| err(&format!("expected t=TIME, got {when:?}")))?);
    let desync = |change| Ok::<_, String>(Fault::Desync { rank: rank()?, collective: seq()?, change });
    match kind {
        "crash" if when.starts_with("seq") => Ok(Fault::Crash { rank: rank()?, at: Trigger::Collective(seq()?) }),
        "crash" => Ok(Fault::Crash { rank: rank()?, at: Trigger::AtMs(time()?) }),
        "hang" => Ok(Fault::Hang { rank: rank()?, collective: seq()? }),
        "partition" => {
            let (a, b) = link()?;
            Ok(Fault::Partition { a, b, at_ms: time()?, until_ms: None })
        }
        "isolate" => Ok(Fault::Isolate { rank: rank()?, at_ms: time()?, until_ms: None }),
        "cut" => {
            let (from, to) = range(who).map_err(|e| err(&e))?;
            Ok(Fault::Cut { from, to, at_ms: time()?, until_ms: None })
        }
        "hold" => {
            let (a, b) = link()?;
            Ok(Fault::Hold { a, b, at_ms: time()?, until_ms: None })
        }
        "slow" => Ok(Fault::Slow { rank: rank()?, delay_ms: ms(when)? }),
        "desync-op" => desync(Change::OtherOp),
        "desync-size" => desync(Change::OtherSize),
        "desync-dtype" => desync(Change::OtherDtype),
        "store-crash" => Ok(Fault::StoreCrash { at_ms: time()? }),
        other => match DeviceFault::parse(other) {
            Some(kind) => Ok(Fault::Device { rank: rank()?, collective: seq()?, kind }),
            None => Err(err(&format!("unknown fault {other:?}"))),
        },
    }
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(text: &str) -> Result<Fault, String> {
        if !text.trim().contains(' ') && text.contains('@') && !text.trim().starts_with('@') {
            return compact(text.trim());
        }
        let mut w = Words { text, words: words(text).into_iter() };
        let kind =
            w.next("a fault (crash, hang, partition, isolate, cut, hold, latency, slow, desync, store-crash)")?;
        let fault = match kind.as_str() {
            "crash" => {
                let rank = w.num("a rank")?;
                w.expect("@")?;
                let what = w.next("\"collective K\" or a time")?;
                let at = if what == "collective" {
                    Trigger::Collective(w.num("a collective index")?)
                } else {
                    let t = what.parse().map_err(|_| w.err(&format!("time {what:?} is not a number")))?;
                    w.expect("ms")?;
                    Trigger::AtMs(t)
                };
                Fault::Crash { rank, at }
            }
            "hang" => {
                let rank = w.num("a rank")?;
                Fault::Hang { rank, collective: w.collective()? }
            }
            "partition" => {
                let (a, b) = w.link()?;
                let at_ms = w.at_ms()?;
                Fault::Partition { a, b, at_ms, until_ms: w.until()? }
            }
            "isolate" => {
                let rank = w.num("a rank")?;
                let at_ms = w.at_ms()?;
                Fault::Isolate { rank, at_ms, until_ms: w.until()? }
            }
            "cut" => {
                let (from, to) = w.range()?;
                let at_ms = w.at_ms()?;
                Fault::Cut { from, to, at_ms, until_ms: w.until()? }
            }
            "hold" => {
                let (a, b) = w.link()?;
                let at_ms = w.at_ms()?;
                Fault::Hold { a, b, at_ms, until_ms: w.until()? }
            }
            "latency" => {
                let (a, b) = w.link()?;
                let latency_ms = w.ms("a latency")?;
                let at_ms = match w.words.as_slice().first() {
                    Some(x) if x == "@" => w.at_ms()?,
                    _ => 0,
                };
                Fault::Latency { a, b, latency_ms, at_ms }
            }
            "slow" => {
                let rank = w.num("a rank")?;
                Fault::Slow { rank, delay_ms: w.ms("a delay")? }
            }
            "desync" => {
                let rank = w.num("a rank")?;
                let collective = w.collective()?;
                let spec = w.next("op=OP, numel=N or dtype=D")?;
                let change = match spec.split_once('=') {
                    Some(("op", "other")) => Change::OtherOp,
                    Some(("numel", "other")) => Change::OtherSize,
                    Some(("dtype", "other")) => Change::OtherDtype,
                    Some(("op", op)) => Change::Op(op.parse().map_err(|e: String| w.err(&e))?),
                    Some(("numel", n)) => {
                        Change::Numel(n.parse().map_err(|_| w.err(&format!("numel {n:?} is not a number")))?)
                    }
                    Some(("dtype", d)) => Change::Dtype(d.parse().map_err(|_| w.err(&format!("unknown dtype {d:?}")))?),
                    _ => return Err(w.err(&format!("expected op=OP, numel=N or dtype=D, got {spec:?}"))),
                };
                Fault::Desync { rank, collective, change }
            }
            "store-crash" => Fault::StoreCrash { at_ms: w.at_ms()? },
            other => match DeviceFault::parse(other) {
                Some(kind) => {
                    let rank = w.num("a rank")?;
                    Fault::Device { rank, collective: w.collective()?, kind }
                }
                None => return Err(w.err(&format!("unknown fault {other:?}"))),
            },
        };
        w.end()?;
        Ok(fault)
    }
}

/// Every fault of one simulation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultPlan {
    /// The faults.
    pub faults: Vec<Fault>,
}

/// A fault plan that does not fit the world or the script ([`FaultPlan::validate`]); the text
/// says which fault and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

impl FaultPlan {
    /// No faults.
    pub fn none() -> FaultPlan {
        FaultPlan::default()
    }

    /// This plan plus `fault`.
    pub fn with(mut self, fault: Fault) -> FaultPlan {
        self.faults.push(fault);
        self
    }

    /// Check every fault against the world and the script.
    pub fn validate(&self, world_size: u32, script: Option<&Script>) -> Result<(), PlanError> {
        let steps = script.map_or(usize::MAX, |s| s.steps.len());
        self.faults.iter().try_for_each(|f| f.check(world_size, steps)).map_err(PlanError)
    }

    /// Whether every fault is benign (see [`Fault::is_benign`]).
    pub fn is_benign(&self, timeout_ms: u64) -> bool {
        self.faults.iter().all(|f| f.is_benign(timeout_ms))
    }

    /// One fault (or none, one time in eight) drawn from `seed` for a `world_size`-rank job
    /// running a `steps`-collective script that starts by about `start_ms`.
    pub fn random(seed: u64, world_size: u32, steps: usize, start_ms: u64) -> FaultPlan {
        Self::random_tcp(seed, world_size, steps, start_ms)
    }

    /// A plan of at most one fault drawn from `seed` among those the NCCL backend meets: a
    /// crash or hang at a collective, or a device fault (kernel hang, NCCL error, slow kernel).
    pub fn random_nccl(seed: u64, world_size: u32, steps: usize) -> FaultPlan {
        let mut rng = SplitMix64(seed ^ 0x5EED_9CC1_0000_0000);
        let rank = rng.below(u64::from(world_size.max(1))) as u32;
        let collective = rng.below(steps.max(1) as u64) as usize;
        let fault = match rng.below(6) {
            0 => return FaultPlan::none(),
            1 => Fault::Crash { rank, at: Trigger::Collective(collective) },
            2 => Fault::Hang { rank, collective },
            3 => Fault::Device { rank, collective, kind: DeviceFault::KernelHang },
            4 => Fault::Device { rank, collective, kind: DeviceFault::NcclError },
            _ => Fault::Device { rank, collective, kind: DeviceFault::SlowKernel },
        };
        FaultPlan::none().with(fault)
    }

    fn random_tcp(seed: u64, world_size: u32, steps: usize, start_ms: u64) -> FaultPlan {
        let mut rng = SplitMix64(seed ^ 0x5EED_F0A1_7000_0000);
        let n = world_size.max(1);
        let steps = steps.max(1);
        let rank = |rng: &mut SplitMix64| rng.below(n as u64) as u32;
        let link = |rng: &mut SplitMix64| {
            let a = rng.below(n as u64) as u32;
            let b = (a + 1 + rng.below(n.saturating_sub(1).max(1) as u64) as u32) % n;
            (a, b)
        };
        let at = |rng: &mut SplitMix64| start_ms + rng.below(400);
        let fault = match rng.below(11) {
            0 => return FaultPlan::none(),
            1 => Fault::Crash { rank: rank(&mut rng), at: Trigger::Collective(rng.below(steps as u64) as usize) },
            2 => Fault::Crash { rank: rank(&mut rng), at: Trigger::AtMs(at(&mut rng)) },
            3 => Fault::Hang { rank: rank(&mut rng), collective: rng.below(steps as u64) as usize },
            // A quarter of the partitions are cuts between two sets of ranks (drawn here so
            // that every other seed keeps its plan).
            4 if n >= 3 && SplitMix64(seed ^ 0xC07).below(4) == 0 => {
                let size = 1 + rng.below(u64::from(n - 1)) as u32;
                let from = rng.below(u64::from(n - size + 1)) as u32;
                Fault::Cut { from, to: from + size, at_ms: at(&mut rng), until_ms: None }
            }
            4 => {
                let (a, b) = link(&mut rng);
                Fault::Partition { a, b, at_ms: at(&mut rng), until_ms: None }
            }
            5 => {
                let at_ms = at(&mut rng);
                Fault::Isolate { rank: rank(&mut rng), at_ms, until_ms: None }
            }
            6 => {
                let (a, b) = link(&mut rng);
                let at_ms = at(&mut rng);
                Fault::Hold { a, b, at_ms, until_ms: Some(at_ms + 50 + rng.below(200)) }
            }
            7 => {
                let (a, b) = link(&mut rng);
                Fault::Latency { a, b, latency_ms: 1 + rng.below(20), at_ms: at(&mut rng) }
            }
            8 => Fault::Slow { rank: rank(&mut rng), delay_ms: 1 + rng.below(100) },
            9 => {
                let change = match rng.below(3) {
                    0 => Change::Op(ScriptOp::ALL[rng.below(ScriptOp::ALL.len() as u64) as usize]),
                    1 => Change::Numel(1 + rng.below(64) as usize),
                    _ => Change::Dtype([DType::F64, DType::F16, DType::I32][rng.below(3) as usize]),
                };
                Fault::Desync { rank: rank(&mut rng), collective: rng.below(steps as u64) as usize, change }
            }
            _ => Fault::StoreCrash { at_ms: at(&mut rng) },
        };
        if world_size < 2 && fault.ranks().len() == 2 {
            return FaultPlan::none();
        }
        FaultPlan::none().with(fault)
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.faults.is_empty() {
            return f.write_str("no faults");
        }
        let parts: Vec<String> = self.faults.iter().map(Fault::to_string).collect();
        f.write_str(&parts.join("; "))
    }
}

impl FromStr for FaultPlan {
    type Err = String;
    fn from_str(s: &str) -> Result<FaultPlan, String> {
        let faults = s.split(';').filter(|p| !p.trim().is_empty()).map(str::parse).collect::<Result<_, _>>()?;
        Ok(FaultPlan { faults })
    }
}

/// SplitMix64: enough randomness to draw plans from a seed, reproducibly.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n ≥ 1).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_prints_in_the_syntax_it_parses_from() {
        let text = "crash 2 @collective 3; crash 1 @500ms; hang 0 @collective 1; partition 0-1 @200ms until 900ms; \
                    isolate 3 @10ms; hold 1-2 @5ms until 50ms; latency 0-3 20ms @100ms; slow 2 30ms; \
                    desync 1 @collective 2 op=broadcast; desync 1 @collective 0 numel=7; \
                    desync 0 @collective 1 dtype=f16; store-crash @300ms; cut 1..3 @500ms; \
                    cut 0..1 @20ms until 400ms";
        let plan: FaultPlan = text.parse().unwrap();
        assert_eq!(plan.faults.len(), 14);
        assert_eq!(plan.faults[12], Fault::Cut { from: 1, to: 3, at_ms: 500, until_ms: None });
        assert_eq!(plan.faults[13], Fault::Cut { from: 0, to: 1, at_ms: 20, until_ms: Some(400) });
        assert_eq!(plan.faults[12].to_string(), "cut 1..3 @500ms");
        assert_eq!(plan.faults[13].to_string(), "cut 0..1 @20ms until 400ms");
        assert_eq!(plan.faults[1], Fault::Crash { rank: 1, at: Trigger::AtMs(500) });
        assert_eq!(plan.faults[10], Fault::Desync { rank: 0, collective: 1, change: Change::Dtype(DType::F16) });
        assert_eq!(plan.to_string().parse::<FaultPlan>().unwrap(), plan);
        assert_eq!("crash 2 @ 500 ms".parse::<Fault>().unwrap(), Fault::Crash { rank: 2, at: Trigger::AtMs(500) });
        assert_eq!("latency 0-1 5ms".parse::<Fault>().unwrap(), Fault::Latency { a: 0, b: 1, latency_ms: 5, at_ms: 0 });
        plan.validate(4, Some(&Script::allreduces(4, 8))).unwrap();
    }

    #[test]
    fn the_compact_form_reads_the_same_faults() {
        let f = |s: &str| s.parse::<Fault>().unwrap();
        assert_eq!(f("crash:3@seq5"), Fault::Crash { rank: 3, at: Trigger::Collective(4) });
        assert_eq!(f("crash:3@t=2s"), Fault::Crash { rank: 3, at: Trigger::AtMs(2000) });
        assert_eq!(f("hang:2@seq4"), Fault::Hang { rank: 2, collective: 3 });
        assert_eq!(f("partition:0-1@t=2s"), Fault::Partition { a: 0, b: 1, at_ms: 2000, until_ms: None });
        assert_eq!(f("isolate:1@t=500ms"), Fault::Isolate { rank: 1, at_ms: 500, until_ms: None });
        assert_eq!(f("cut:1..3@t=500ms"), Fault::Cut { from: 1, to: 3, at_ms: 500, until_ms: None });
        assert_eq!(f("cut:1..3@t=500ms").to_string().parse::<Fault>().unwrap(), f("cut:1..3@t=500ms"));
        assert_eq!(f("slow:2@100ms"), Fault::Slow { rank: 2, delay_ms: 100 });
        assert_eq!(f("desync-size:1@seq3"), Fault::Desync { rank: 1, collective: 2, change: Change::OtherSize });
        assert_eq!(f("store-crash@t=1s"), Fault::StoreCrash { at_ms: 1000 });
        assert_eq!(f("desync-op:0@seq1").to_string().parse::<Fault>().unwrap(), f("desync-op:0@seq1"));
        let device = |rank, collective, kind| Fault::Device { rank, collective, kind };
        assert_eq!(f("kernel-hang:2@seq3"), device(2, 2, DeviceFault::KernelHang));
        assert_eq!(f("nccl-error:1@seq1"), device(1, 0, DeviceFault::NcclError));
        assert_eq!(f("slow-kernel:0@seq2"), device(0, 1, DeviceFault::SlowKernel));
        assert_eq!(f("kernel-hang:2@seq3").to_string(), "kernel-hang 2 @collective 2");
        assert_eq!(f("kernel-hang 2 @collective 2"), f("kernel-hang:2@seq3"));
        let err = |s: &str| s.parse::<Fault>().unwrap_err();
        assert!(err("kernel-hang:2@t=1s").contains("expected seqN"));
        assert!(err("crash:x@seq1").contains("rank \"x\" is not a number"));
        assert!(err("hang:1@seq0").contains("start at 1"));
        assert!(err("partition:0-1@t=2").contains("needs a unit"));
        assert!(err("cut:1-3@t=2s").contains("expected a range of ranks A..B"));
        assert!(err("melt:1@seq1").contains("unknown fault \"melt\""));
    }

    #[test]
    fn bad_faults_name_what_is_wrong() {
        let err = |s: &str| s.parse::<FaultPlan>().unwrap_err();
        assert!(err("explode 1").contains("unknown fault \"explode\""));
        assert!(err("crash x @5ms").contains("rank \"x\" is not a number"));
        assert!(err("crash 1 @5").contains("expected \"ms\""));
        assert!(err("partition 01 @5ms").contains("expected a link A-B"));
        assert!(err("cut 1-3 @5ms").contains("expected a range of ranks A..B"));
        assert!(err("cut 1..x @5ms").contains("rank \"x\" is not a number"));
        assert!(err("hold 0-1 @5ms until").contains("expected a time"));
        assert!(err("desync 1 @collective 2 colour=red").contains("op=OP, numel=N or dtype=D"));
        assert!(err("desync 1 @collective 2 op=allreduse").contains("unknown collective"));
        assert!(err("slow 1 5ms extra").contains("unexpected \"extra\""));
        let plan: FaultPlan = "crash 4 @collective 1; hang 0 @collective 9".parse().unwrap();
        let e = plan.validate(4, Some(&Script::allreduces(3, 8))).unwrap_err();
        assert!(e.0.contains("rank 4 is not a rank of a 4-rank world"), "{e}");
        let plan: FaultPlan = "hang 0 @collective 9".parse().unwrap();
        let e = plan.validate(4, Some(&Script::allreduces(3, 8))).unwrap_err();
        assert!(e.0.contains("collective 9 is past the script's 3 steps"), "{e}");
        let e = "partition 1-1 @5ms".parse::<FaultPlan>().unwrap().validate(4, None).unwrap_err();
        assert!(e.0.contains("two different ranks"), "{e}");
        let e = "hold 0-1 @50ms until 20ms".parse::<FaultPlan>().unwrap().validate(4, None).unwrap_err();
        assert!(e.0.contains("must end after it starts"), "{e}");
        let e = "cut 1..3 @50ms until 20ms".parse::<FaultPlan>().unwrap().validate(4, None).unwrap_err();
        assert!(e.0.contains("must end after it starts"), "{e}");
        for bad in ["cut 0..4 @5ms", "cut 2..2 @5ms", "cut 3..1 @5ms"] {
            let e = bad.parse::<FaultPlan>().unwrap().validate(4, None).unwrap_err();
            assert!(e.0.contains("a cut needs ranks on both sides"), "{bad}: {e}");
        }
        let e = "cut 2..5 @5ms".parse::<FaultPlan>().unwrap().validate(4, None).unwrap_err();
        assert!(e.0.contains("rank 4 is not a rank of a 4-rank world"), "{e}");
        "cut 0..3 @5ms; cut 3..4 @5ms".parse::<FaultPlan>().unwrap().validate(4, None).unwrap();
    }

    #[test]
    fn random_plans_are_a_function_of_the_seed_and_valid() {
        let script = Script::allreduces(5, 16);
        let mut kinds = std::collections::BTreeSet::new();
        for seed in 0..1000 {
            let plan = FaultPlan::random(seed, 4, 5, 100);
            assert_eq!(plan, FaultPlan::random(seed, 4, 5, 100));
            plan.validate(4, Some(&script)).unwrap();
            kinds.insert(
                plan.faults
                    .first()
                    .map_or("none".to_owned(), |f| f.to_string().split_whitespace().next().unwrap().to_owned()),
            );
        }
        assert_eq!(kinds.len(), 11, "every kind is drawn: {kinds:?}");
        assert!(kinds.contains("cut"), "{kinds:?}");
    }
}
