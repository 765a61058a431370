//! `cohort demo`: the main job. Four local rank processes train on synthetic gradients with
//! bucketed allreduce; then one rank hangs, the watchdog catches it, every rank dumps its flight
//! recorder and the diagnosis names the hung rank, the collective and its sequence number.
//!
//! The parent process hosts the store and draws the progress; each rank is this same executable
//! started as the hidden `cohort demo-rank`, which reports to the parent through stdout lines
//! (`step`, `failed`, `hung-saw`, `done`).

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use clap::Args;
use cohort_core::analyze::{self, FindingKind};
use cohort_core::recorder::Dump;
use cohort_core::tensor::DType;
use cohort_core::tensor::Tensor;
use cohort_core::work::Rank;
use cohort_transports::ddp::{AllreduceHook, BucketCaps, Reducer, assign_buckets};
use cohort_transports::{TcpStoreServer, TcpStoreServerConfig, TokioNet};

/// Ranks the demo starts.
const WORLD: u32 = 4;
/// The rank that hangs.
const HUNG: u32 = 2;
/// Training steps before the hang.
const STEPS: u32 = 8;
/// Bucket cap after the first bucket (DDP's `bucket_cap_mb`; 4 MiB here, so that a small model
/// still makes several buckets whose allreduces overlap).
const BUCKET_CAP: usize = 4 << 20;
/// The demo's collective timeout: short, so the watchdog fires within the demo.
const TIMEOUT_MS: u64 = 2_000;
/// How long the parent waits for the ranks before giving up on them.
const RANK_LIMIT: Duration = Duration::from_secs(40);

/// Arguments of `cohort demo` (none: it runs on embedded defaults).
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  cohort demo\n\n\
    Starts 4 local ranks over loopback with an embedded store, trains 8 steps of bucketed\n\
    gradient allreduce, then makes rank 2 hang and shows the watchdog, the flight-recorder\n\
    dumps and the diagnosis. Exits 0 when everything behaved as it should.")]
pub(crate) struct DemoArgs {}

/// Arguments of the hidden `cohort demo-rank` (one rank of the demo; the parent sets them).
#[derive(Debug, Args)]
pub(crate) struct DemoRankArgs {}

/// The gradient set: a small transformer's parameter shapes (about 5.2 M parameters), in
/// registration order.
fn param_shapes() -> Vec<Vec<usize>> {
    let (vocab, d, ff, layers) = (8_000, 256, 1_024, 4);
    let mut shapes = vec![vec![vocab, d]];
    for _ in 0..layers {
        shapes.extend([
            vec![3 * d, d],
            vec![3 * d],
            vec![d, d],
            vec![d],
            vec![d],
            vec![d],
            vec![ff, d],
            vec![ff],
            vec![d, ff],
            vec![d],
            vec![d],
            vec![d],
        ]);
    }
    shapes.push(vec![d]);
    shapes
}

/// Rank `rank`'s gradient of parameter `p` at `step`: small integers, so that the average over
/// ranks is exact in f32 and every rank can check it.
fn grad_value(rank: u32, p: usize, step: u32, i: usize) -> f32 {
    ((i + p + step as usize) % 7) as f32 + rank as f32
}

fn expected_avg(p: usize, step: u32, i: usize) -> f32 {
    ((i + p + step as usize) % 7) as f32 + (WORLD - 1) as f32 / 2.0
}

/// The demo's bucket caps: DDP's 1 MiB first bucket, then 4 MiB (`bucket_cap_mb=4`, so that a
/// small model still makes several buckets whose allreduces overlap the backward pass).
fn caps() -> BucketCaps {
    BucketCaps { first: 1 << 20, rest: BUCKET_CAP }
}

fn plan(shapes: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product::<usize>() * 4).collect();
    assign_buckets(&sizes, caps())
}

// ---------------------------------------------------------------------------------------------
// The parent.

/// One line a rank reported.
enum Report {
    Line(u32, String),
    Eof,
}

pub(crate) fn run(_args: DemoArgs) -> Result<i32, String> {
    let started = Instant::now();
    let dir = demo_dir()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let bind = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    let server = runtime
        .block_on(TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind)))
        .map_err(|e| format!("cannot host the store: {e}"))?;
    let port = server.port();
    // The store serves from the runtime's thread while the parent reads the ranks.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let store_thread = thread::spawn(move || {
        runtime.block_on(async move {
            let _ = stop_rx.await;
            server.shutdown().await;
        })
    });

    let shapes = param_shapes();
    let params: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let nbuckets = plan(&shapes).len();
    println!("cohort demo: {WORLD} ranks over loopback, store on 127.0.0.1:{port}, dumps in {}", dir.display());
    println!(
        "[1/3] training {STEPS} steps: {:.1} M f32 gradients in {} tensors, {nbuckets} buckets (DDP order, caps 1 MiB then 4 MiB), comm hook: allreduce (average)",
        params as f64 / 1e6,
        shapes.len()
    );

    let exe = std::env::current_exe().map_err(|e| format!("cannot find the cohort executable: {e}"))?;
    let (tx, rx) = mpsc::channel();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..WORLD {
        let mut child = Command::new(&exe)
            .arg("demo-rank")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("COHORT_STORE_HOSTED", "1")
            .env("COHORT_TIMEOUT_MS", TIMEOUT_MS.to_string())
            .env("COHORT_HEARTBEAT_MS", "250")
            .env("COHORT_PEER_DEAD_AFTER_MS", "10000")
            .env("COHORT_DUMP_ON_FAILURE", dir.join("rank_"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start rank {rank}: {e}"))?;
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let tx2 = tx.clone();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx2.send(Report::Line(rank, line)).is_err() {
                    return;
                }
            }
            let _ = tx2.send(Report::Eof);
        });
        // Ranks log through tracing on stderr; keep it for the failure report.
        let log = dir.join(format!("rank_{rank}.log"));
        thread::spawn(move || {
            if let Ok(mut f) = std::fs::File::create(&log) {
                let _ = std::io::copy(&mut BufReader::new(stderr), &mut f);
            }
        });
        children.push(child);
    }
    drop(tx);

    let outcome = follow(&rx, started);
    let mut statuses = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = wait_or_kill(&mut child, RANK_LIMIT.saturating_sub(started.elapsed()));
        statuses.push((rank, status));
    }
    let _ = stop_tx.send(());
    let _ = store_thread.join();

    let mut ok = true;
    for (rank, status) in &statuses {
        if status.as_deref() != Some("exit 0") {
            println!("  rank {rank} ended badly: {}", status.as_deref().unwrap_or("killed after the time limit"));
            ok = false;
        }
    }
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => {
            println!("demo FAILED: {e} (rank logs in {})", dir.display());
            return Ok(1);
        }
    };
    ok &= diagnose_and_report(&dir, &outcome)?;
    let secs = started.elapsed().as_secs_f64();
    if ok {
        println!("demo OK in {secs:.1} s: the watchdog caught the hang and the diagnosis named rank {HUNG}");
        Ok(0)
    } else {
        println!("demo FAILED after {secs:.1} s (rank logs in {})", dir.display());
        Ok(1)
    }
}

fn demo_dir() -> Result<PathBuf, String> {
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("cohort-demo-{stamp}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// What the ranks told the parent.
#[derive(Debug, Default)]
struct Outcome {
    /// Per rank: the error its hung step ended with.
    errors: Vec<(u32, String)>,
    /// The collective sequence number the hung rank never called.
    hang_seq: Option<u64>,
}

fn follow(rx: &mpsc::Receiver<Report>, started: Instant) -> Result<Outcome, String> {
    let tty = std::io::stdout().is_terminal();
    let mut out = Outcome::default();
    let mut open = WORLD;
    let mut hang_from: Option<u32> = None;
    let mut hang_announced = false;
    while open > 0 {
        let left = RANK_LIMIT.saturating_sub(started.elapsed());
        let report = match rx.recv_timeout(left) {
            Ok(r) => r,
            Err(_) => return Err(format!("the ranks did not finish within {} s", RANK_LIMIT.as_secs())),
        };
        let (rank, line) = match report {
            Report::Eof => {
                open -= 1;
                continue;
            }
            Report::Line(rank, line) => (rank, line),
        };
        let mut words = line.splitn(2, ' ');
        let (kind, rest) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        match kind {
            "step" if rank == 0 => {
                // step <n> <micros> <bytes>
                let f: Vec<f64> = rest.split(' ').filter_map(|w| w.parse().ok()).collect();
                if let [n, micros, bytes] = f[..] {
                    let secs = micros / 1e6;
                    let busbw = bytes * 2.0 * f64::from(WORLD - 1) / f64::from(WORLD) / secs / 1e9;
                    let bar = progress_bar(n as u32, STEPS);
                    let text = format!(
                        "  step {:>2}/{STEPS} {bar} {:>7.1} ms  algbw {:>5.2} GB/s  busbw {:>5.2} GB/s",
                        n,
                        micros / 1e3,
                        bytes / secs / 1e9,
                        busbw
                    );
                    if tty && (n as u32) < STEPS {
                        print!("{text}\r");
                    } else {
                        println!("{text}");
                    }
                    let _ = std::io::stdout().flush();
                }
            }
            "hang" if out.hang_seq.is_none() => {
                out.hang_seq = rest.trim().parse().ok();
                hang_from = Some(rank);
            }
            "failed" => {
                announce(&mut hang_announced, hang_from, out.hang_seq);
                println!("  rank {rank}: {rest}");
                out.errors.push((rank, rest.to_string()));
            }
            "hung-saw" => {
                announce(&mut hang_announced, hang_from, out.hang_seq);
                println!("  rank {rank} (the hung one) learned: {rest}");
                out.errors.push((rank, rest.to_string()));
            }
            "wrong" | "error" => {
                println!("  rank {rank}: {kind}: {rest}");
                return Err(format!("rank {rank} reported: {rest}"));
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Say that the hung rank hangs, once, after the training steps' lines.
fn announce(done: &mut bool, rank: Option<u32>, seq: Option<u64>) {
    if *done {
        return;
    }
    *done = true;
    let rank = rank.map_or("?".into(), |r| r.to_string());
    let seq = seq.map_or("?".into(), |s| s.to_string());
    println!(
        "[2/3] rank {rank} hangs: alive, but it never calls step {}'s first allreduce (collective seq {seq}); the others wait, timeout {TIMEOUT_MS} ms",
        STEPS + 1
    );
}

fn progress_bar(done: u32, total: u32) -> String {
    let width = 20;
    let filled = (done as usize * width) / total.max(1) as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}

fn wait_or_kill(child: &mut Child, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(describe(status)),
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "unknown".into(),
    }
}

/// Read every rank's dump, diagnose, print; true when the diagnosis named the hung rank at the
/// collective it never called and every other rank failed its step.
fn diagnose_and_report(dir: &Path, outcome: &Outcome) -> Result<bool, String> {
    println!("[3/3] flight recorders dumped by every rank; diagnosis:");
    let mut dumps = Vec::new();
    let mut files = Vec::new();
    for rank in 0..WORLD {
        let path = dir.join(format!("rank_{rank}.json"));
        match std::fs::read_to_string(&path) {
            Ok(text) => match Dump::from_json(&text) {
                Ok(d) => {
                    dumps.push((Rank(rank), d));
                    files.push(path);
                }
                Err(e) => println!("  {}: unreadable dump: {e}", path.display()),
            },
            Err(e) => println!("  rank {rank} wrote no dump ({}: {e})", path.display()),
        }
    }
    let diagnosis = analyze::diagnose(&dumps, Some(WORLD));
    for line in diagnosis.to_string().lines() {
        println!("  {line}");
    }
    let json_path = dir.join("diagnosis.json");
    std::fs::write(&json_path, diagnosis.to_json())
        .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
    let timeline = dir.join("trace.json");
    std::fs::write(&timeline, crate::timeline::chrome_trace(&dumps))
        .map_err(|e| format!("cannot write {}: {e}", timeline.display()))?;
    println!("  dumps:     {}", files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" "));
    println!("  diagnosis: {}", json_path.display());
    println!("  timeline:  {} (open it in https://ui.perfetto.dev)", timeline.display());

    let named = diagnosis.findings.first().is_some_and(|f| {
        matches!(f.kind, FindingKind::NeverJoined { .. })
            && f.culprits() == vec![Rank(HUNG)]
            && Some(f.seq) == outcome.hang_seq
            && f.op.contains("all_reduce")
    });
    let all_failed = (0..WORLD).all(|r| outcome.errors.iter().any(|(e, _)| *e == r));
    if !named {
        println!("  expected the diagnosis to name rank {HUNG} at seq {:?}", outcome.hang_seq);
    }
    if !all_failed {
        println!("  expected every rank to report the failed step");
    }
    Ok(named && all_failed && files.len() == WORLD as usize)
}

// ---------------------------------------------------------------------------------------------
// One rank.

pub(crate) fn run_rank(_args: DemoRankArgs) -> Result<i32, String> {
    let pg = cohort_transports::tcp::init_process_group().map_err(|e| format!("init_process_group: {e}"))?;
    let rank = pg.rank().0;
    let shapes = param_shapes();
    let bytes: usize = shapes.iter().map(|s| s.iter().product::<usize>() * 4).sum();
    let mut reducer = Reducer::with_caps(pg.clone(), shapes.clone(), DType::F32, Box::new(AllreduceHook), caps())
        .map_err(|e| format!("reducer: {e}"))?;
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };

    for step in 1..=STEPS {
        let t = Instant::now();
        let reduced = match backward(&mut reducer, rank, &shapes, step) {
            Ok(r) => r,
            Err(e) => {
                say(format!("error step {step}: {e}"));
                return Ok(1);
            }
        };
        let micros = t.elapsed().as_micros();
        if let Some(wrong) = check(&reduced, step) {
            say(format!("wrong {wrong}"));
            return Ok(1);
        }
        say(format!("step {step} {micros} {bytes}"));
    }

    // The hang: every rank but HUNG runs step STEPS+1's backward; HUNG never does.
    let hang_seq = pg.seq().0 + 1;
    let step = STEPS + 1;
    if rank == HUNG {
        say(format!("hang {hang_seq}"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while pg.failure().is_none() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        match pg.failure() {
            Some(f) => say(format!("hung-saw {}", f.message)),
            None => {
                say("error the hung rank never learned that its group failed".into());
                return Ok(1);
            }
        }
        pg.shutdown();
        return Ok(0);
    }
    match backward(&mut reducer, rank, &shapes, step) {
        Ok(_) => {
            say(format!("error step {step} completed although rank {HUNG} never called it"));
            Ok(1)
        }
        Err(e) => {
            say(format!("failed {e}"));
            pg.shutdown();
            Ok(0)
        }
    }
}

/// One step's backward pass: gradients become ready last layer first, each full bucket is
/// reduced by the comm hook at once; then wait for all and get the averages back.
fn backward(reducer: &mut Reducer, rank: u32, shapes: &[Vec<usize>], step: u32) -> Result<Vec<Tensor>, String> {
    for (p, g) in synthetic_grads(rank, shapes, step).into_iter().enumerate().rev() {
        reducer.mark_ready(p, &g).map_err(|e| e.to_string())?;
    }
    reducer.finish().map_err(|e| e.to_string())
}

fn synthetic_grads(rank: u32, shapes: &[Vec<usize>], step: u32) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(p, shape)| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| grad_value(rank, p, step, i)).collect();
            Tensor::from_slice_shaped(&v, shape).expect("shape matches")
        })
        .collect()
}

fn check(reduced: &[Tensor], step: u32) -> Option<String> {
    for (p, t) in reduced.iter().enumerate() {
        let v = t.as_slice::<f32>().ok()?;
        for (i, x) in v.iter().enumerate().step_by(997) {
            let want = expected_avg(p, step, i);
            if *x != want {
                return Some(format!("step {step}: param {p} element {i} is {x}, expected {want}"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_makes_several_buckets_in_reverse_order() {
        let shapes = param_shapes();
        let plan = plan(&shapes);
        let flat: Vec<usize> = plan.iter().flatten().copied().collect();
        assert_eq!(flat, (0..shapes.len()).rev().collect::<Vec<_>>());
        assert!(plan.len() >= 3, "{plan:?}");
    }

    #[test]
    fn the_expected_average_is_the_mean_of_the_ranks_values() {
        for (p, step, i) in [(0, 1, 0), (3, 2, 11), (40, 9, 123_456)] {
            let mean = (0..WORLD).map(|r| grad_value(r, p, step, i)).sum::<f32>() / WORLD as f32;
            assert_eq!(mean, expected_avg(p, step, i));
        }
    }
}
