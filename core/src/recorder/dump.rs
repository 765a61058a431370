//! The dump document: PyTorch's flight-recorder JSON schema, version `"2.10"`.
//!
//! [`Dump`] is the whole document, as serde types. It is written the way PyTorch's
//! `FlightRecorder<EventType>::dump_json` writes it (`torch/csrc/distributed/c10d/
//! FlightRecorderDetail.hpp`, keys from `FlightRecorder.hpp`), so that torch's analyzer
//! (`torch/distributed/flight_recorder`, formerly `tools/flight_recorder`) can read ours, and
//! it is read leniently, so that ours can read torch's:
//!
//! - unknown keys are ignored; keys older versions lack are optional;
//! - numbers torch writes as strings in JSON and as ints in its pickle dump (`pg_status`
//!   counters, `pg_id`) are accepted either way; `ranks` in `pg_config` is accepted as torch's
//!   string (`"[0, 1]"`) or as a list;
//! - `time_discovered_*_ns` are `0` in torch's JSON and `None` in its pickle when the event was
//!   not seen: both read as `None`, and `None` is written as `0`, as torch's JSON does.
//!
//! What torch's dump has and ours leaves out: `thread_name` and `thread_id` (core runs no
//! threads; read when present), `frames` (no stack traces; torch's JSON has none either, its
//! pickle does; read when present) and `nccl_comm_state` (read when present).
//!
//! What ours adds, which torch's readers ignore: top-level `rank`, `world_size` (torch's
//! analyzer takes the rank from the file name), `reset_epoch` and `reset_time_ns`; per entry
//! `cohort_state` (the work's own terminal state: `failed`, `timed_out`, `aborted` are not
//! expressible in torch's `state`), `cohort_error`, `cohort_blame` and `cohort_time_finished_ns`. Ours always
//! writes `entries`, even empty (torch leaves the key out when there are none, which its own
//! loader then trips over).
//!
//! Loading is total: any input gives `Ok` or a [`DumpError`], never a panic.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::work::{Rank, WorkState};

/// The schema version this module writes (`version_val` in torch's `FlightRecorder.hpp`).
pub const DUMP_VERSION: &str = "2.10";

/// A flight-recorder dump: one rank's recent collectives and the state of its groups.
///
/// Field order is the order written. Build one with
/// [`FlightRecorder::dump`](super::FlightRecorder::dump) or [`Dump::from_json`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    /// Schema version, `"2.10"` for ours; any `2.x` is read.
    pub version: String,
    /// The communication library's version (`comm_lib_version`, torch ≥ 2.8; the NCCL version
    /// for torch's NCCL backend). Empty when absent.
    #[serde(default)]
    pub comm_lib_version: String,
    /// Process groups by name: `pg_config`.
    #[serde(default)]
    pub pg_config: BTreeMap<String, PgConfig>,
    /// Per-group progress by pg id (as a decimal string): `pg_status`.
    #[serde(default)]
    pub pg_status: BTreeMap<String, PgStatus>,
    /// The recorded entries, oldest first.
    #[serde(default)]
    pub entries: Vec<DumpEntry>,
    /// Backend-specific per-communicator state (`nccl_comm_state`), when the dump has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl_comm_state: Option<BTreeMap<String, BTreeMap<String, String>>>,
    /// cohort extra: the rank that wrote the dump (absent in torch's dumps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<Rank>,
    /// cohort extra: the world size of the rank that wrote the dump.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// cohort extra: the recorder's reset epoch (0 until the first
    /// [`reset`](super::FlightRecorder::reset)); entries of earlier epochs are not dumped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_epoch: Option<u64>,
    /// cohort extra: wall time (Unix ns) of the last reset, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_time_ns: Option<u64>,
}

/// One process group in `pg_config`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgConfig {
    /// The group's name (torch: `_process_group_name`, e.g. `"0"`).
    pub name: String,
    /// The group's description (torch: `group_desc`, e.g. `"default_pg"`, `"undefined"`).
    #[serde(default)]
    pub desc: String,
    /// Global ranks of the members. Written as torch's string (`"[0, 1, 2]"`, which its
    /// analyzer `ast.literal_eval`s); read from that string or from a list. Shared: every dump
    /// of a job repeats its groups' lists, and 4,096 dumps of a 4,096-rank job would otherwise
    /// hold 16 M parsed ranks.
    #[serde(with = "ranks_text")]
    pub ranks: Arc<[u64]>,
}

/// One group's progress in `pg_status`: sequence numbers of the last collective enqueued,
/// started and completed, `-1` before the first (torch's `ProcessGroupStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgStatus {
    /// `last_enqueued_collective`.
    #[serde(with = "i64_text", default = "minus_one")]
    pub last_enqueued_collective: i64,
    /// `last_started_collective`.
    #[serde(with = "i64_text", default = "minus_one")]
    pub last_started_collective: i64,
    /// `last_completed_collective`.
    #[serde(with = "i64_text", default = "minus_one")]
    pub last_completed_collective: i64,
}

impl Default for PgStatus {
    fn default() -> Self {
        PgStatus { last_enqueued_collective: -1, last_started_collective: -1, last_completed_collective: -1 }
    }
}

/// An entry's state as torch writes it: from the times its events were discovered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryState {
    /// Recorded, not seen to start.
    Scheduled,
    /// Seen to start, not seen to complete (also: failed, timed out or aborted after starting).
    Started,
    /// Seen to complete.
    Completed,
}

/// One stack frame (`frames`, in torch's pickle dumps with stack traces).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// Function name.
    pub name: String,
    /// File name.
    pub filename: String,
    /// Line number.
    pub line: i64,
}

/// One recorded collective or point-to-point op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DumpEntry {
    /// Position in the recorder since the last reset (torch's `id_`).
    pub record_id: u64,
    /// The group's uid (an int in torch's JSON; a string is read too).
    #[serde(deserialize_with = "u64_text::deserialize")]
    pub pg_id: u64,
    /// `[name, desc]` of the group.
    pub process_group: (String, String),
    /// Name of the thread that recorded it (torch only; ours leaves it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_name: Option<String>,
    /// Id of the thread that recorded it (torch only; ours leaves it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// Collective sequence number in the group (counts kernel launches: 1 per coalesced group).
    #[serde(deserialize_with = "u64_text::deserialize")]
    pub collective_seq_id: u64,
    /// Point-to-point sequence number in the group.
    #[serde(default, deserialize_with = "u64_text::deserialize")]
    pub p2p_seq_id: u64,
    /// Logical op number (one per op inside a coalesced group).
    #[serde(default, deserialize_with = "u64_text::deserialize")]
    pub op_id: u64,
    /// `backend:op`, e.g. `nccl:all_reduce`, `gloo:broadcast`, `nccl:send 0->1`.
    pub profiling_name: String,
    /// Wall time (Unix ns) it was recorded.
    #[serde(deserialize_with = "u64_text::deserialize")]
    pub time_created_ns: u64,
    /// Start-to-completion time, only when timing is on (torch: `TORCH_NCCL_ENABLE_TIMING`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
    /// Shape of each input tensor.
    #[serde(default)]
    pub input_sizes: Vec<Vec<u64>>,
    /// c10 `ScalarType` name of each input (`Float`, `BFloat16`, …).
    #[serde(default)]
    pub input_dtypes: Vec<String>,
    /// Shape of each output tensor.
    #[serde(default)]
    pub output_sizes: Vec<Vec<u64>>,
    /// c10 `ScalarType` name of each output.
    #[serde(default)]
    pub output_dtypes: Vec<String>,
    /// `scheduled`, `started` or `completed`.
    pub state: EntryState,
    /// Wall time (Unix ns) the start was seen; written as `0` when not seen, as torch's JSON.
    #[serde(default, with = "time_or_zero")]
    pub time_discovered_started_ns: Option<u64>,
    /// Wall time (Unix ns) the completion was seen; written as `0` when not seen.
    #[serde(default, with = "time_or_zero")]
    pub time_discovered_completed_ns: Option<u64>,
    /// Whether the work left the in-flight list: completed, or (if not completed) failed,
    /// timed out or aborted. torch: "a retired but not completed event has timed out".
    #[serde(default)]
    pub retired: bool,
    /// The work's timeout.
    #[serde(default, deserialize_with = "u64_text::deserialize")]
    pub timeout_ms: u64,
    /// Whether it is a point-to-point op.
    #[serde(default)]
    pub is_p2p: bool,
    /// Stack frames, when the dump has them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frames: Vec<Frame>,
    /// cohort extra: the work's own lifecycle state (`enqueued`, `started`, `completed`,
    /// `failed`, `timed_out`, `aborted`). Absent in torch's dumps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cohort_state: Option<WorkState>,
    /// cohort extra: why the work failed, timed out or was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cohort_error: Option<String>,
    /// cohort extra: whom the failure blamed (the same as the end of `cohort_error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cohort_blame: Option<crate::work::Blame>,
    /// cohort extra: wall time (Unix ns) the work reached its terminal state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cohort_time_finished_ns: Option<u64>,
}

/// A dump that could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DumpError {
    /// Not JSON, or JSON that does not follow the flight-recorder schema.
    #[error("malformed flight-recorder dump: {0}")]
    Malformed(#[from] serde_json::Error),
    /// A `version` whose major number is not 2.
    #[error("unsupported flight-recorder dump version {0:?} (expected 2.x)")]
    UnsupportedVersion(String),
}

impl Dump {
    /// The compact JSON text of the dump (as torch's `dump_json`); the caller writes it out.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a dump always serialises: string keys, plain values")
    }

    /// The JSON text of the dump, indented.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("a dump always serialises: string keys, plain values")
    }

    /// Load a dump written by cohort or by PyTorch (JSON, schema 2.x).
    pub fn from_json(text: &str) -> Result<Dump, DumpError> {
        let dump: Dump = serde_json::from_str(text)?;
        let major = dump.version.split('.').next().unwrap_or_default();
        if major.trim() != "2" {
            return Err(DumpError::UnsupportedVersion(dump.version));
        }
        Ok(dump)
    }
}

fn minus_one() -> i64 {
    -1
}

/// An integer written as a JSON number or as a decimal string.
#[derive(Deserialize)]
#[serde(untagged)]
enum IntOrText {
    Unsigned(u64),
    Signed(i64),
    Text(String),
}

/// `u64` read from a number or a decimal string.
mod u64_text {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer};

    use super::IntOrText;

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match IntOrText::deserialize(d)? {
            IntOrText::Unsigned(v) => Ok(v),
            IntOrText::Signed(v) => Err(D::Error::custom(format_args!("expected a non-negative integer, got {v}"))),
            IntOrText::Text(s) => s
                .trim()
                .parse()
                .map_err(|_| D::Error::custom(format_args!("expected a non-negative integer, got {s:?}"))),
        }
    }
}

/// `i64` written as a decimal string (torch's JSON `pg_status`), read from a string or a number.
mod i64_text {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::IntOrText;

    pub(super) fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        match IntOrText::deserialize(d)? {
            IntOrText::Unsigned(v) => {
                i64::try_from(v).map_err(|_| D::Error::custom(format_args!("integer {v} out of range")))
            }
            IntOrText::Signed(v) => Ok(v),
            IntOrText::Text(s) => {
                s.trim().parse().map_err(|_| D::Error::custom(format_args!("expected an integer, got {s:?}")))
            }
        }
    }
}

/// An optional wall time written as `0` when absent (torch's JSON) and read from a number,
/// a decimal string, `0` or `null`.
mod time_or_zero {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::IntOrText;

    pub(super) fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(v.unwrap_or(0))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let v = match Option::<IntOrText>::deserialize(d)? {
            None => return Ok(None),
            Some(IntOrText::Unsigned(v)) => v,
            Some(IntOrText::Signed(v)) => {
                return Err(D::Error::custom(format_args!("expected a non-negative time, got {v}")));
            }
            Some(IntOrText::Text(s)) => {
                s.trim().parse().map_err(|_| D::Error::custom(format_args!("expected a time in ns, got {s:?}")))?
            }
        };
        Ok((v != 0).then_some(v))
    }
}

/// Ranks written as torch's `ranks_str` (`"[0, 1, 2]"`), read from that or from a list.
mod ranks_text {
    use std::cell::RefCell;
    use std::fmt::{self, Write as _};
    use std::sync::Arc;

    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(ranks: &Arc<[u64]>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(ranks))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<[u64]>, D::Error> {
        d.deserialize_any(RanksVisitor)
    }

    thread_local! {
        /// The last list read as text, and its parse: the dumps of one job repeat their
        /// groups' lists, so reading many dumps parses and keeps each list once.
        static LAST: RefCell<Option<(String, Arc<[u64]>)>> = const { RefCell::new(None) };
    }

    struct RanksVisitor;

    impl<'de> Visitor<'de> for RanksVisitor {
        type Value = Arc<[u64]>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("ranks like \"[0, 1]\" or a list of ranks")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Arc<[u64]>, E> {
            if let Some(hit) = LAST.with_borrow(|last| last.as_ref().filter(|(t, _)| t == s).map(|(_, r)| r.clone())) {
                return Ok(hit);
            }
            let ranks: Arc<[u64]> =
                parse(s).ok_or_else(|| E::custom(format_args!("expected ranks like \"[0, 1]\", got {s:?}")))?.into();
            LAST.set(Some((s.to_owned(), ranks.clone())));
            Ok(ranks)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Arc<[u64]>, A::Error> {
            let mut ranks = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(r) = seq.next_element()? {
                ranks.push(r);
            }
            Ok(ranks.into())
        }
    }

    /// `[0, 1, 2]`, as torch's `ranks_str`.
    pub(crate) fn format(ranks: &[u64]) -> String {
        let mut out = String::with_capacity(2 + ranks.len() * 4);
        out.push('[');
        for (i, r) in ranks.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            write!(out, "{r}").expect("writing to a String cannot fail");
        }
        out.push(']');
        out
    }

    /// Inverse of [`format`], tolerant of whitespace.
    pub(crate) fn parse(s: &str) -> Option<Vec<u64>> {
        let inner = s.trim().strip_prefix('[')?.strip_suffix(']')?.trim();
        if inner.is_empty() {
            return Some(Vec::new());
        }
        inner.split(',').map(|r| r.trim().parse().ok()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document shaped exactly as PyTorch 2.10's `FlightRecorder<EventType>::dump_json`
    /// emits it, modelled on pytorch/pytorch `torch/csrc/distributed/c10d/FlightRecorderDetail.hpp`
    /// (`dump_json`, `getPgConfigJson`, `getPgStatusJson`) and the key names in
    /// `torch/csrc/distributed/c10d/FlightRecorder.hpp` (`version_val "2.10"`):
    ///
    /// ```text
    /// result[version_key_str] = version_val_str;
    /// result[comm_lib_version_key_str] = comm_lib_version_;
    /// result[pg_config_key_str] = getPgConfigJson();   // name -> {name, desc, ranks: ranks_str(ranks)}
    /// result[pg_status_key_str] = getPgStatusJson();   // std::to_string(pg_id) -> {last_*_collective: std::to_string(seq)}
    /// j[record_id_key_str] = int64_t(e.id_);
    /// j[pg_id_key_str] = int64_t(e.pg_id_);
    /// j[pg_name_key_str] = e.pg_name_;                 // tuple<string, string> -> [name, desc]
    /// j[thread_name_key_str] = e.thread_name_;
    /// j[thread_id_key_str] = c10::str(e.thread_id_);
    /// ... collective_seq_id, p2p_seq_id, op_id, profiling_name, time_created_ns,
    /// if (e.duration_) j[duration_key_str] = *e.duration_;          // float
    /// ... input_sizes (list of lists), input_dtypes (c10::toString(ScalarType)), output_*,
    /// j[state_key_str] = completed / started / scheduled;
    /// j[time_discovered_started_key_str] = ... ? int64_t(*e.time_discovered_started_) : 0;
    /// j[time_discovered_completed_key_str] = ... : 0;
    /// j[retired_key_str] = e.retired_; j[timeout_key_str] = e.timeout_ms_; j[is_p2p_key_str] = e.isP2P_;
    /// if (!entries.empty()) result[entries_key_str] = entries;
    /// result.dump();   // nlohmann::json: keys sorted
    /// ```
    const TORCH_2_10: &str = r#"{"comm_lib_version":"2.21.5","entries":[{"collective_seq_id":1,"duration_ms":0.4134399890899658,"input_dtypes":["Float"],"input_sizes":[[4,1024]],"is_p2p":false,"op_id":1,"output_dtypes":["Float"],"output_sizes":[[4,1024]],"p2p_seq_id":0,"pg_id":0,"process_group":["0","default_pg"],"profiling_name":"nccl:all_reduce","record_id":0,"retired":true,"state":"completed","thread_id":"140237411284800","thread_name":"pt_main_thread","time_created_ns":1718000000000000000,"time_discovered_completed_ns":1718000000002000000,"time_discovered_started_ns":1718000000001000000,"timeout_ms":600000},{"collective_seq_id":1,"input_dtypes":["BFloat16"],"input_sizes":[[8]],"is_p2p":true,"op_id":2,"output_dtypes":["BFloat16"],"output_sizes":[[8]],"p2p_seq_id":1,"pg_id":0,"process_group":["0","default_pg"],"profiling_name":"nccl:send 0->1","record_id":1,"retired":false,"state":"started","thread_id":"140237411284800","thread_name":"pt_main_thread","time_created_ns":1718000000003000000,"time_discovered_completed_ns":0,"time_discovered_started_ns":1718000000004000000,"timeout_ms":600000},{"collective_seq_id":2,"input_dtypes":["Float","Long"],"input_sizes":[[2,3],[]],"is_p2p":false,"op_id":3,"output_dtypes":[],"output_sizes":[],"p2p_seq_id":1,"pg_id":1,"process_group":["1","undefined"],"profiling_name":"nccl:broadcast","record_id":2,"retired":false,"state":"scheduled","thread_id":"140237411284800","thread_name":"pt_main_thread","time_created_ns":1718000000005000000,"time_discovered_completed_ns":0,"time_discovered_started_ns":0,"timeout_ms":1800000}],"pg_config":{"0":{"desc":"default_pg","name":"0","ranks":"[0, 1]"},"1":{"desc":"undefined","name":"1","ranks":"[0, 1]"}},"pg_status":{"0":{"last_completed_collective":"1","last_enqueued_collective":"1","last_started_collective":"1"},"1":{"last_completed_collective":"-1","last_enqueued_collective":"2","last_started_collective":"-1"}},"version":"2.10"}"#;

    #[test]
    fn torch_2_10_json_dump_loads() {
        let dump = Dump::from_json(TORCH_2_10).unwrap();
        assert_eq!(dump.version, "2.10");
        assert_eq!(dump.comm_lib_version, "2.21.5");
        assert_eq!(dump.rank, None);
        assert_eq!(*dump.pg_config["0"].ranks, [0, 1]);
        assert_eq!(dump.pg_config["1"].desc, "undefined");
        assert_eq!(
            dump.pg_status["1"],
            PgStatus { last_enqueued_collective: 2, last_started_collective: -1, last_completed_collective: -1 }
        );
        assert_eq!(dump.entries.len(), 3);
        let [done, send, queued] = &dump.entries[..] else { unreachable!() };
        assert_eq!(done.state, EntryState::Completed);
        assert_eq!(done.duration_ms, Some(0.4134399890899658));
        assert_eq!(done.input_sizes, vec![vec![4, 1024]]);
        assert_eq!(done.time_discovered_started_ns, Some(1_718_000_000_001_000_000));
        assert_eq!(done.thread_name.as_deref(), Some("pt_main_thread"));
        assert_eq!(done.cohort_state, None);
        assert!(send.is_p2p && send.profiling_name == "nccl:send 0->1");
        assert_eq!(send.time_discovered_completed_ns, None);
        assert_eq!(send.duration_ms, None);
        assert_eq!(queued.process_group, ("1".to_owned(), "undefined".to_owned()));
        assert_eq!(queued.input_sizes, vec![vec![2, 3], vec![]]);
        assert_eq!(queued.input_dtypes, vec!["Float", "Long"]);
        assert_eq!(queued.state, EntryState::Scheduled);
        assert_eq!(queued.timeout_ms, 1_800_000);
    }

    #[test]
    fn torch_pickle_style_values_load() {
        // torch's pickle dump (converted to JSON): ints where the JSON dump has strings,
        // ranks as a string still, None for undiscovered times, frames present, no entries.
        let text = r#"{"version": "2.7", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": [0, 1, 2]}},
            "pg_status": {"0": {"last_enqueued_collective": 3, "last_started_collective": -1, "last_completed_collective": -1}},
            "entries": [{"record_id": 7, "pg_id": "0", "process_group": ["0", "default_pg"], "collective_seq_id": 3,
              "p2p_seq_id": 0, "op_id": 3, "profiling_name": "gloo:all_reduce", "time_created_ns": 5,
              "input_sizes": [[1]], "input_dtypes": ["Float"], "output_sizes": [[1]], "output_dtypes": ["Float"],
              "state": "scheduled", "time_discovered_started_ns": null, "time_discovered_completed_ns": null,
              "retired": false, "timeout_ms": 100, "is_p2p": false,
              "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2696}]}]}"#;
        let dump = Dump::from_json(text).unwrap();
        assert_eq!(dump.comm_lib_version, "");
        assert_eq!(*dump.pg_config["0"].ranks, [0, 1, 2]);
        assert_eq!(dump.pg_status["0"].last_enqueued_collective, 3);
        let e = &dump.entries[0];
        assert_eq!((e.pg_id, e.record_id), (0, 7));
        assert_eq!(e.time_discovered_started_ns, None);
        assert_eq!(e.frames[0].line, 2696);
    }

    #[test]
    fn minimal_document_and_missing_entries_load() {
        let dump = Dump::from_json(r#"{"version":"2.10","pg_config":{},"pg_status":{}}"#).unwrap();
        assert!(dump.entries.is_empty());
    }

    #[test]
    fn bad_documents_are_typed_errors() {
        for text in [
            "",
            "[]",
            "{}",
            r#"{"version": 2}"#,
            r#"{"version":"2.10","pg_config":{"0":{"name":"0","desc":"","ranks":"[0, x]"}}}"#,
            r#"{"version":"2.10","pg_status":{"0":{"last_enqueued_collective":"many"}}}"#,
            r#"{"version":"2.10","entries":[{"record_id":-1}]}"#,
            r#"{"version":"2.10","entries":[{"state":"exploded"}]}"#,
        ] {
            assert!(matches!(Dump::from_json(text), Err(DumpError::Malformed(_))), "{text:?}");
        }
        let err = Dump::from_json(r#"{"version":"3.0"}"#).unwrap_err();
        assert!(matches!(err, DumpError::UnsupportedVersion(ref v) if v == "3.0"));
        assert_eq!(err.to_string(), "unsupported flight-recorder dump version \"3.0\" (expected 2.x)");
    }

    #[test]
    fn deeply_nested_unknown_fields_do_not_overflow_the_stack() {
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let ignored = format!(r#"{{"version":"2.10","extra":{}}}"#, nest(100_000));
        assert!(Dump::from_json(&ignored).is_ok());
        // Untagged number-or-text fields buffer their value: serde_json's depth limit applies.
        let buffered = format!(r#"{{"version":"2.10","entries":[{{"pg_id":{}}}]}}"#, nest(100_000));
        assert!(matches!(Dump::from_json(&buffered), Err(DumpError::Malformed(_))));
    }

    #[test]
    fn dumps_with_the_same_rank_list_share_one_parse_of_it() {
        let doc = |rank: u32, ranks: &str| {
            format!(
                r#"{{"version": "2.10", "pg_config": {{"0": {{"name": "0", "desc": "default_pg", "ranks": "{ranks}"}}}},
                "pg_status": {{}}, "entries": [], "rank": {rank}}}"#
            )
        };
        let a = Dump::from_json(&doc(0, "[0, 1, 2]")).unwrap();
        let b = Dump::from_json(&doc(1, "[0, 1, 2]")).unwrap();
        let c = Dump::from_json(&doc(2, "[0, 2]")).unwrap();
        assert!(Arc::ptr_eq(&a.pg_config["0"].ranks, &b.pg_config["0"].ranks));
        assert_eq!(*c.pg_config["0"].ranks, [0, 2]);
        assert!(Dump::from_json(&doc(3, "[0, x]")).unwrap_err().to_string().contains("[0, x]"));
    }

    #[test]
    fn ranks_text_round_trips() {
        assert_eq!(ranks_text::format(&[]), "[]");
        assert_eq!(ranks_text::format(&[0, 1, 2]), "[0, 1, 2]");
        assert_eq!(ranks_text::parse(" [ 3 ,4 ] "), Some(vec![3, 4]));
        assert_eq!(ranks_text::parse("[]"), Some(vec![]));
        assert_eq!(ranks_text::parse("[1,]"), None);
        assert_eq!(ranks_text::parse("0, 1"), None);
    }

    proptest::proptest! {
        #[test]
        fn loading_any_text_never_panics(text in "\\PC{0,200}") {
            let _ = Dump::from_json(&text);
        }

        #[test]
        fn loading_mutated_torch_dumps_never_panics(cut in 0usize..2000, byte in 0u8..128) {
            let mut bytes = TORCH_2_10.as_bytes().to_vec();
            let at = cut % bytes.len();
            bytes[at] = byte;
            if let Ok(text) = std::str::from_utf8(&bytes) {
                let _ = Dump::from_json(text);
            }
        }
    }
}
