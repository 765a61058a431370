//! `cohort bench`, `cohort store` and `cohort fr` end to end, as a user runs them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn cohort(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort")).args(args).output().expect("run cohort")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn bench_prints_the_nccl_tests_table_with_checked_results() {
    let out = cohort(&["bench", "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1", "--ranks", "3"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("#       size         count      type   redop    root       time    algbw    busbw  #wrong")
    );
    let rows: Vec<Vec<&str>> =
        stdout.lines().filter(|l| !l.starts_with('#')).map(|l| l.split_whitespace().collect()).collect();
    // 8, 256, 8192 bytes, rounded down to whole elements.
    assert_eq!(rows.iter().map(|r| r[0]).collect::<Vec<_>>(), ["8", "256", "8192"], "{stdout}");
    for r in &rows {
        assert_eq!(&r[2..5], ["float", "sum", "-1"]);
        assert_eq!(r[8], "0", "no wrong elements: {stdout}");
    }
    assert!(stdout.contains("# Out of bounds values : 0 OK"));
    assert!(stdout.contains("# Avg bus bandwidth    : "));
}

#[test]
fn bench_checks_every_op_and_emits_json() {
    for op in ["allgather", "broadcast", "reduce", "reduce_scatter", "alltoall", "sendrecv", "barrier"] {
        let out = cohort(&["bench", "-o", op, "-d", "int32", "-r", "max", "-b", "1K", "-e", "1K", "-n", "2", "--json"]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{op}: {stdout}\n{}", text(&out.stderr));
        let row: serde_json::Value = serde_json::from_str(stdout.lines().next().expect("one row")).expect(&stdout);
        assert_eq!(row["op"], op);
        assert_eq!(row["times_us"].as_array().map(Vec::len), Some(2));
        if op != "barrier" {
            assert_eq!(row["wrong"], 0, "{op}: {stdout}");
            assert_eq!(row["type"], "int32");
        }
    }
}

#[test]
fn bench_times_the_whole_loop_when_asked_with_the_same_figures_otherwise() {
    let out = cohort(&["bench", "-b", "4", "-e", "64", "-f", "16", "-n", "50", "--json", "--whole-loop"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).expect(l)).collect();
    assert_eq!(rows.iter().map(|r| r["size"].as_u64()).collect::<Vec<_>>(), [Some(4), Some(64)], "{stdout}");
    for row in &rows {
        // No clock read per iteration: no iteration's time, no median; the mean and the check
        // are there.
        assert_eq!(row["times_us"].as_array().map(Vec::len), Some(0), "{row}");
        assert!(row["median_us"].is_null(), "{row}");
        assert!(row["time_us"].as_f64().is_some_and(|t| t > 0.0), "{row}");
        assert_eq!(row["wrong"], 0, "{row}");
    }
}

#[test]
fn bench_keeps_several_works_in_flight_and_checks_each() {
    for op in ["allreduce", "sendrecv", "allgather", "barrier"] {
        let out =
            cohort(&["bench", "-o", op, "-b", "0", "-e", "4K", "-f", "64", "-n", "3", "--inflight", "5", "--json"]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{op}: {stdout}\n{}", text(&out.stderr));
        for line in stdout.lines() {
            let row: serde_json::Value = serde_json::from_str(line).expect(line);
            assert_eq!(row["inflight"], 5, "{line}");
            if op != "barrier" {
                assert_eq!(row["wrong"], 0, "{op}: {line}");
            }
        }
    }
    let out = cohort(&["bench", "--inflight", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--inflight"));
}

#[test]
fn bench_flags_are_checked_with_one_line_errors() {
    for (args, needle) in [
        (vec!["bench", "-b", "12Q"], "--minbytes"),
        (vec!["bench", "-o", "allsmash"], "--op"),
        (vec!["bench", "-d", "float33"], "--datatype"),
        (vec!["bench", "-r", "bxor"], "--redop"),
        (vec!["bench", "--bogus"], "--bogus"),
        (vec!["bench", "-b", "1M", "-e", "1K"], "-b"),
        (vec!["bench", "--transport", "nccl"], "NCCL backend unavailable"),
    ] {
        let out = cohort(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: one line, got {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// A minimal TCPStore client speaking PyTorch's wire format by hand: VALIDATE, then SET and
/// GET (what torch's client sends first).
fn torch_wire_set_get(port: u16) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut msg = vec![0u8]; // VALIDATE
    msg.extend_from_slice(&0x3C85F7CEu32.to_le_bytes());
    msg.push(1); // SET
    for part in [&b"k"[..], &b"hello"[..]] {
        msg.extend_from_slice(&(part.len() as u64).to_le_bytes());
        msg.extend_from_slice(part);
    }
    msg.push(3); // GET
    msg.extend_from_slice(&1u64.to_le_bytes());
    msg.extend_from_slice(b"k");
    s.write_all(&msg).unwrap();
    let mut len = [0u8; 8];
    s.read_exact(&mut len).unwrap();
    let mut value = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut value).unwrap();
    value
}

#[test]
fn store_serves_the_tcpstore_protocol_until_interrupted() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["store", "--port", "0", "--host", "127.0.0.1"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the store");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("a line").unwrap();
    let port: u16 =
        first.split("127.0.0.1:").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().parse().unwrap();
    assert_eq!(torch_wire_set_get(port), b"hello");
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(lines.next().expect("a goodbye line").unwrap().contains("stopping (1 keys held)"));

    let out = cohort(&["store", "--port", "notaport"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--port"));
}

#[test]
fn fr_analyzes_shows_and_draws_torch_shaped_dumps() {
    let dir = std::env::temp_dir().join(format!("cohort-fr-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Two ranks' dumps in torch's JSON shape (no `rank` field: the rank comes from the file
    // name): rank 1 never called the second allreduce.
    for (rank, seqs) in [(0u32, 2u64), (1, 1)] {
        let entries: Vec<String> = (1..=seqs)
            .map(|seq| {
                let done = seq == 1;
                format!(
                    r#"{{"record_id":{r},"pg_id":0,"process_group":["0","default_pg"],"collective_seq_id":{seq},"p2p_seq_id":0,"op_id":{seq},"profiling_name":"gloo:all_reduce","time_created_ns":{t},"duration_ms":null,"input_sizes":[[4]],"input_dtypes":["Float"],"output_sizes":[[4]],"output_dtypes":["Float"],"state":"{state}","time_discovered_started_ns":{t},"time_discovered_completed_ns":{c},"retired":{done},"timeout_ms":1000,"is_p2p":false,"frames":[]}}"#,
                    r = seq - 1,
                    t = 1_000_000 * seq,
                    state = if done { "completed" } else { "started" },
                    c = if done { (1_000_000 * seq + 500).to_string() } else { "null".into() },
                )
            })
            .collect();
        let dump =
            format!(r#"{{"version":"2.10","pg_config":{{}},"pg_status":{{}},"entries":[{}]}}"#, entries.join(","));
        std::fs::write(dir.join(format!("trace_rank_{rank}")), dump).unwrap();
    }
    std::fs::write(dir.join("notes.json"), "{\"unrelated\": true}").unwrap();
    let d = dir.to_str().unwrap();

    let out = cohort(&["fr", "analyze", d]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("collective seq 2 (all_reduce): rank(s) [1] never joined it"), "{stdout}");

    let out = cohort(&["fr", "analyze", d, "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["findings"][0]["kind"]["kind"], "never_joined");

    let out = cohort(&["fr", "show", dir.join("trace_rank_0").to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("2 entries") && stdout.contains("gloo:all_reduce") && stdout.contains("started"),
        "{stdout}"
    );

    let trace = dir.join("out.trace");
    let out = cohort(&["fr", "timeline", d, "-o", trace.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let slices: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(slices.len(), 3);
    assert!(slices.iter().any(|e| e["pid"] == 0 && e["name"] == "gloo:all_reduce (unfinished)"));
    assert!(events.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "rank 1"));

    let out = cohort(&["fr", "analyze", "/no/such/folder"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("/no/such/folder"));
    std::fs::write(dir.join("broken.json"), "{\"version\": \"2.10\", \"entries\": [{]}").unwrap();
    let out = cohort(&["fr", "analyze", d]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("broken.json"), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sim_replays_a_seed_to_the_same_output_and_names_the_hung_rank() {
    let dir = std::env::temp_dir().join(format!("cohort-sim-test-{}", std::process::id()));
    let dumps = dir.to_str().unwrap();
    let args = [
        "sim",
        "--ranks",
        "3",
        "--seed",
        "5",
        "--fault",
        "hang:1@seq2",
        "--script",
        "allreduce:64,allreduce:64,barrier",
    ];
    let first = cohort(&args);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    let out = text(&first.stdout);
    assert!(out.contains("rank 1: hung before collective 1"), "{out}");
    assert!(out.contains("rank(s) [1] never joined it"), "{out}");
    assert!(out.contains("culprit rank(s): [1]"), "{out}");
    assert_eq!(text(&cohort(&args).stdout), out, "same seed, same output");

    let with_dumps = [&args[..], &["--dumps", dumps]].concat();
    assert_eq!(cohort(&with_dumps).status.code(), Some(0));
    let analyzed = cohort(&["fr", "analyze", dumps]);
    assert!(text(&analyzed.stdout).contains("culprit rank(s): [1]"), "{}", text(&analyzed.stdout));
    std::fs::remove_dir_all(&dir).ok();

    let bad = cohort(&["sim", "--fault", "crash:x@seq1"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("--fault: fault \"crash:x@seq1\": rank \"x\" is not a number"));
    let bad = cohort(&["sim", "--ranks", "2", "--fault", "crash:5@seq1"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("rank 5 is not a rank of a 2-rank world"), "{}", text(&bad.stderr));
    let bad = cohort(&["sim", "--script", "allreduse"]);
    assert!(text(&bad.stderr).contains("--script: unknown collective"), "{}", text(&bad.stderr));
}
