//! Chrome trace-event JSON from flight-recorder dumps: a track per rank, a slice per recorded
//! collective, unfinished ones drawn to the end of the trace and marked. Perfetto and
//! `chrome://tracing` open it.

use cohort_core::recorder::{Dump, DumpEntry, EntryState};
use cohort_core::work::Rank;
use serde_json::{Value, json};

/// The trace of `dumps` as a JSON document (`{"traceEvents": [...], "displayTimeUnit": "ms"}`).
pub(crate) fn chrome_trace(dumps: &[(Rank, Dump)]) -> String {
    let entries = || dumps.iter().flat_map(|(r, d)| d.entries.iter().map(move |e| (*r, e)));
    let origin = entries().map(|(_, e)| e.time_created_ns).min().unwrap_or(0);
    let end_ns = entries().map(|(_, e)| finished_ns(e).unwrap_or(e.time_created_ns)).max().unwrap_or(origin);
    let us = |ns: u64| ns.saturating_sub(origin) as f64 / 1e3;

    let mut events: Vec<Value> = Vec::new();
    for (rank, _) in dumps {
        events.push(json!({"ph": "M", "name": "process_name", "pid": rank.0, "tid": 0, "args": {"name": format!("rank {rank}")}}));
        events.push(
            json!({"ph": "M", "name": "process_sort_index", "pid": rank.0, "tid": 0, "args": {"sort_index": rank.0}}),
        );
    }
    for (rank, e) in entries() {
        let start = e.time_discovered_started_ns.unwrap_or(e.time_created_ns);
        let (end, unfinished) = match finished_ns(e) {
            Some(t) => (t, false),
            None => (end_ns.max(start), true),
        };
        let state = state_name(e);
        let name = match (unfinished, state.as_str()) {
            (true, _) => format!("{} (unfinished)", e.profiling_name),
            (false, "completed") => e.profiling_name.clone(),
            (false, s) => format!("{} ({s})", e.profiling_name),
        };
        events.push(json!({
            "ph": "X",
            "name": name,
            "cat": if e.is_p2p { "p2p" } else { "collective" },
            "pid": rank.0,
            "tid": e.pg_id,
            "ts": us(start),
            "dur": us(end) - us(start),
            "args": {
                "seq": if e.is_p2p { e.p2p_seq_id } else { e.collective_seq_id },
                "pg": e.pg_id,
                "state": state,
                "input_sizes": e.input_sizes,
                "input_dtypes": e.input_dtypes,
                "error": e.cohort_error,
            },
        }));
    }
    serde_json::to_string(&json!({"traceEvents": events, "displayTimeUnit": "ms"})).expect("plain JSON values")
}

fn finished_ns(e: &DumpEntry) -> Option<u64> {
    if e.state != EntryState::Completed {
        return e.cohort_time_finished_ns;
    }
    e.cohort_time_finished_ns.or(e.time_discovered_completed_ns).or_else(|| {
        let start = e.time_discovered_started_ns.unwrap_or(e.time_created_ns);
        e.duration_ms.map(|ms| start + (ms * 1e6) as u64)
    })
}

fn state_name(e: &DumpEntry) -> String {
    match e.cohort_state {
        Some(s) => format!("{s:?}").to_lowercase(),
        None => format!("{:?}", e.state).to_lowercase(),
    }
}
