//! The TCP backend across real OS processes on loopback: every rank is a `cohort-rank` process
//! started with torchrun's environment; rank 0 hosts the store.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(u32, String)>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start(world: u32, scenario: &str, extra_env: &[(&str, &str)]) -> Job {
    start_with(free_port(), world, scenario, extra_env, |_| Vec::new())
}

/// [`start`] on `port`, with variables for each rank on top (`per_rank(r)`).
fn start_with(
    port: u16,
    world: u32,
    scenario: &str,
    extra_env: &[(&str, &str)],
    per_rank: impl Fn(u32) -> Vec<(&'static str, String)>,
) -> Job {
    let port = port.to_string();
    let (tx, lines) = mpsc::channel();
    let children = (0..world)
        .map(|r| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_cohort-rank"));
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("COHORT_TEST_SCENARIO", scenario)
                .env("COHORT_INIT_TIMEOUT_MS", "20000")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            for (k, v) in extra_env {
                cmd.env(k, v);
            }
            for (k, v) in per_rank(r) {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("start cohort-rank");
            let out = child.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send((r, line));
                }
            });
            child
        })
        .collect();
    Job { children, lines }
}

impl Job {
    /// Wait for every rank to exit; returns each one's lines.
    fn finish(mut self, limit: Duration) -> Vec<(u32, String)> {
        let deadline = Instant::now() + limit;
        for c in &mut self.children {
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    panic!("a rank did not finish within {limit:?}: {:?}", self.lines.try_iter().collect::<Vec<_>>());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        self.lines.try_iter().collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn p2p_ring_across_three_processes() {
    let lines = start(3, "p2p-ring", &[]).finish(Duration::from_secs(60));
    for r in 0..3 {
        assert!(lines.contains(&(r, "ok p2p-ring".to_string())), "{lines:?}");
    }
}

#[test]
fn every_survivor_names_a_sigkilled_rank_within_50_ms() {
    for world in [2u32, 4] {
        let mut job = start(world, "wait-for-last", &[]);
        let mut ready = 0;
        let deadline = Instant::now() + Duration::from_secs(60);
        while ready < world {
            let (_, line) = job.lines.recv_timeout(deadline - Instant::now()).expect("ranks get ready");
            if line == "ready" {
                ready += 1;
            }
        }
        // Let the survivors' allreduce reach the wire.
        std::thread::sleep(Duration::from_millis(200));
        let killed_ns = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
        let last = job.children.last_mut().unwrap();
        last.kill().unwrap();
        let lines = job.finish(Duration::from_secs(30));
        let mut delays = Vec::new();
        for r in 0..world - 1 {
            let line = lines
                .iter()
                .find(|(rank, l)| *rank == r && l.starts_with("noticed_ns"))
                .unwrap_or_else(|| panic!("{lines:?}"));
            let noticed: u128 = line.1.split_whitespace().nth(1).unwrap().parse().unwrap();
            let delay_ms = (noticed.saturating_sub(killed_ns)) as f64 / 1e6;
            assert!(line.1.contains(&format!("culprit Some({})", world - 1)), "{line:?}");
            assert!(line.1.contains(&format!("rank {}", world - 1)), "{line:?}");
            delays.push(delay_ms);
        }
        eprintln!("world {world}: survivors noticed the SIGKILL after {delays:?} ms");
        // The kernel closes the dead process's sockets; EOF reaches the survivors at once.
        assert!(delays.iter().all(|&d| d < 50.0), "world {world}: {delays:?} ms");
    }
}

#[test]
fn every_collective_and_dtype_matches_the_reference_on_2_3_and_4_processes() {
    for world in [2u32, 3, 4] {
        let lines = start(world, "collectives", &[]).finish(Duration::from_secs(120));
        for r in 0..world {
            assert!(lines.contains(&(r, "ok collectives".to_string())), "world {world}: {lines:?}");
        }
    }
}

fn line_of(lines: &[(u32, String)], rank: u32, prefix: &str) -> String {
    lines
        .iter()
        .find(|(r, l)| *r == rank && l.starts_with(prefix))
        .map(|(_, l)| l.clone())
        .unwrap_or_else(|| panic!("rank {rank} printed no {prefix:?} line: {lines:?}"))
}

/// The survivors of a job where the last rank never calls the allreduce; asserts every
/// survivor names it.
fn skipped_rank_is_named(world: u32) {
    let skip = (world - 1).to_string();
    let env = [("COHORT_TEST_SKIP", skip.as_str()), ("COHORT_TIMEOUT_MS", "500")];
    let lines = start(world, "skip-collective", &env).finish(Duration::from_secs(60));
    for r in 0..world - 1 {
        let line = line_of(&lines, r, "failed");
        eprintln!("world {world} rank {r}: {line}");
        assert!(line.contains("timed out") || line.contains("timeout"), "world {world}: {line}");
        let skipper = world - 1;
        let named = line.contains(&format!("rank(s) [{skipper}]"))
            || line.contains(&format!("rank {skipper} is the likely culprit"));
        assert!(named, "world {world}: rank {r} does not name rank {}: {line}", world - 1);
    }
}

#[test]
fn a_rank_that_never_calls_the_collective_is_named_by_the_timeout() {
    skipped_rank_is_named(2);
}

/// In a ring of 3 a survivor may wait on the other survivor, which waits on the rank that never
/// came: halfway to the timeout each stuck rank tells its peers whom it waits for, and the
/// timeout follows that chain to the rank that never said it was stuck.
#[test]
fn a_rank_that_never_calls_the_collective_is_named_by_every_survivor_of_three() {
    skipped_rank_is_named(3);
}

#[test]
fn monitored_barrier_across_processes_names_the_ranks_that_never_came() {
    let lines = start(4, "monitored-barrier", &[("COHORT_TEST_SKIP", "1,3")]).finish(Duration::from_secs(60));
    let l0 = line_of(&lines, 0, "barrier");
    assert!(l0.contains("culprits [1, 3] :: Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms"), "{l0}");
    let l2 = line_of(&lines, 2, "barrier");
    assert!(l2.contains("culprits [0] :: rank 2 reached monitoredBarrier but rank 0 did not acknowledge"), "{l2}");
    eprintln!("{l0}\n{l2}");

    let lines = start(3, "monitored-barrier", &[]).finish(Duration::from_secs(60));
    for r in 0..3 {
        assert!(lines.contains(&(r, "passed".to_string())), "{lines:?}");
    }
}

#[test]
fn a_wrong_world_size_fails_init_clearly_on_both_sides() {
    let env = [("COHORT_INIT_TIMEOUT_MS", "3000")];
    let job = start_with(free_port(), 2, "p2p-ring", &env, |r| {
        if r == 1 { vec![("WORLD_SIZE", "3".into())] } else { Vec::new() }
    });
    let lines = job.finish(Duration::from_secs(30));
    for r in 0..2 {
        let line = line_of(&lines, r, "error init");
        eprintln!("rank {r}: {line}");
        assert!(line.to_lowercase().contains("world size"), "rank {r}: {line}");
    }
}

#[test]
fn a_master_port_held_by_something_else_fails_init_without_hanging() {
    let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let env = [("COHORT_INIT_TIMEOUT_MS", "3000")];
    let started = Instant::now();
    let lines = start_with(port, 2, "p2p-ring", &env, |_| Vec::new()).finish(Duration::from_secs(30));
    for r in 0..2 {
        let line = line_of(&lines, r, "error init");
        eprintln!("rank {r} after {:?}: {line}", started.elapsed());
    }
    assert!(line_of(&lines, 0, "error init").contains(&format!("cannot host the store on port {port}")), "{lines:?}");
    assert!(line_of(&lines, 1, "error init").contains("store"), "{lines:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
    drop(squatter);
}

#[test]
fn a_sigstopped_rank_is_named_once_heartbeats_declare_it_dead() {
    let env = [("COHORT_HEARTBEAT_MS", "100"), ("COHORT_PEER_DEAD_AFTER_MS", "1000")];
    let world = 3;
    let mut job = start(world, "wait-for-last", &env);
    let mut ready = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ready < world {
        let (_, line) = job.lines.recv_timeout(deadline - Instant::now()).expect("ranks get ready");
        if line == "ready" {
            ready += 1;
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let pid = job.children.last().unwrap().id().to_string();
    let stopped_ns = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    // The survivors finish; then the stopped rank is resumed and killed.
    let survivors_deadline = Instant::now() + Duration::from_secs(30);
    let mut noticed = Vec::new();
    while noticed.len() < (world - 1) as usize {
        let (r, line) = job.lines.recv_timeout(survivors_deadline - Instant::now()).expect("survivors notice");
        if line.starts_with("noticed_ns") {
            noticed.push((r, line));
        }
    }
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let _ = job.children.last_mut().unwrap().kill();
    let mut delays = Vec::new();
    for (r, line) in &noticed {
        let at: u128 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let delay_ms = at.saturating_sub(stopped_ns) as f64 / 1e6;
        assert!(line.contains(&format!("rank {}", world - 1)), "rank {r}: {line}");
        delays.push(delay_ms);
        eprintln!("rank {r} after {delay_ms:.0} ms: {line}");
    }
    // Declared dead after 1000 ms of silence: not before, and not much after.
    assert!(delays.iter().all(|&d| (850.0..5000.0).contains(&d)), "{delays:?}");
}

#[test]
fn a_rank_lost_during_a_ddp_step_fails_the_step_naming_it() {
    let world = 3u32;
    let mut job = start(world, "ddp-lose-last", &[]);
    let (mut ready, mut first_steps) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while ready < world {
        let (_, line) = job.lines.recv_timeout(deadline - Instant::now()).expect("ranks get ready");
        ready += usize::from(line == "ready") as u32;
        first_steps += usize::from(line == "step ok");
    }
    assert_eq!(first_steps, world as usize, "every rank's first step averaged right");
    job.children.last_mut().unwrap().kill().unwrap();
    let lines = job.finish(Duration::from_secs(30));
    for r in 0..world - 1 {
        let line = lines
            .iter()
            .find(|(rank, l)| *rank == r && l.starts_with("step failed"))
            .unwrap_or_else(|| panic!("rank {r}: {lines:?}"));
        assert!(line.1.contains("culprit Some(2)") && line.1.contains("rank 2"), "{line:?}");
    }
}

#[test]
fn collectives_go_on_after_the_store_is_killed_and_a_later_loss_is_still_named() {
    let port = free_port();
    let world = 3u32;
    // The store runs in its own process, as a launcher's would.
    let mut store = Command::new(env!("CARGO_BIN_EXE_cohort-rank"))
        .env("COHORT_TEST_SCENARIO", "store-server")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the store");
    let mut first = String::new();
    BufReader::new(store.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert_eq!(first.trim(), "listening");
    let go = std::env::temp_dir().join(format!("cohort-go-{}-{port}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let go_text = go.display().to_string();
    let env = [("COHORT_STORE_HOSTED", "1"), ("COHORT_TEST_GO", go_text.as_str())];
    let mut job = start_with(port, world, "store-gone", &env, |_| Vec::new());
    // Wait until every rank printed each of `what`.
    let wait_for = |job: &mut Job, what: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = vec![0u32; what.len()];
        while seen.iter().any(|&n| n < world) {
            let (_, line) = job.lines.recv_timeout(deadline - Instant::now()).unwrap_or_else(|_| panic!("{what:?}"));
            assert!(!line.starts_with("error"), "{line}");
            if let Some(i) = what.iter().position(|w| *w == line) {
                seen[i] += 1;
            }
        }
    };
    wait_for(&mut job, &["ready"]);
    store.kill().unwrap();
    store.wait().unwrap();
    std::fs::write(&go, b"go").unwrap();
    wait_for(&mut job, &["collectives ok without the store", "ready"]);
    std::thread::sleep(Duration::from_millis(200));
    job.children.last_mut().unwrap().kill().unwrap();
    let lines = job.finish(Duration::from_secs(30));
    let _ = std::fs::remove_file(&go);
    for r in 0..world - 1 {
        let line = line_of(&lines, r, "noticed_ns");
        eprintln!("rank {r}: {line}");
        assert!(line.contains("culprit Some(2)") && line.contains("rank 2"), "{line}");
    }
}

/// Every collective, then a SIGKILL, with `env` on every rank.
fn collectives_and_a_sigkill_with(env: &[(&str, &str)]) {
    let lines = start(3, "collectives", env).finish(Duration::from_secs(120));
    for r in 0..3 {
        assert!(lines.contains(&(r, "ok collectives".to_string())), "{env:?}: {lines:?}");
    }
    let mut job = start(3, "wait-for-last", env);
    let mut ready = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ready < 3 {
        let (_, line) = job.lines.recv_timeout(deadline - Instant::now()).expect("ranks get ready");
        ready += u32::from(line == "ready");
    }
    std::thread::sleep(Duration::from_millis(200));
    job.children.last_mut().unwrap().kill().unwrap();
    let lines = job.finish(Duration::from_secs(30));
    for r in 0..2 {
        let line = line_of(&lines, r, "noticed_ns");
        eprintln!("{env:?} rank {r}: {line}");
        assert!(line.contains("culprit Some(2)") && line.contains("rank 2"), "{env:?}: {line}");
    }
}

#[test]
fn every_collective_is_right_and_a_sigkill_is_named_over_two_connections_per_peer() {
    collectives_and_a_sigkill_with(&[("COHORT_CONNECTIONS_PER_PEER", "2")]);
}

#[test]
fn every_collective_is_right_and_a_sigkill_is_named_with_lazy_connection() {
    collectives_and_a_sigkill_with(&[("COHORT_LAZY_INIT", "1")]);
    collectives_and_a_sigkill_with(&[("TORCH_GLOO_LAZY_INIT", "1"), ("COHORT_CONNECTIONS_PER_PEER", "2")]);
}

#[test]
fn every_collective_is_right_and_a_sigkill_is_named_with_busy_poll_off_and_long() {
    // The default (50 µs) runs in every other test here; 0 leaves all reading to the reader
    // tasks, 2 ms makes waiting threads read almost everything themselves.
    collectives_and_a_sigkill_with(&[("COHORT_BUSY_POLL_US", "0")]);
    collectives_and_a_sigkill_with(&[("COHORT_BUSY_POLL_US", "2000")]);
}

/// The NCCL process group on the emulated device across three real processes, its fabric over
/// the TCPStore: the allreduce computes, then the last rank stops calling (it sleeps, or exits
/// like a crashed process) and both survivors' timeouts name it through desync debug.
#[test]
fn the_emulated_nccl_group_runs_across_processes_and_names_the_rank_that_stopped() {
    for exit in ["0", "1"] {
        let env = [
            ("COHORT_TEST_SKIP", "2"),
            ("COHORT_TEST_EXIT", exit),
            ("COHORT_TIMEOUT_MS", "1500"),
            ("COHORT_STATUS_INTERVAL_MS", "50"),
            ("COHORT_HEARTBEAT_TIMEOUT_SEC", "0"),
        ];
        let lines = start(3, "nccl-emu", &env).finish(Duration::from_secs(60));
        for r in 0..3 {
            assert_eq!(line_of(&lines, r, "sum"), "sum [3.0, 3.0]", "{lines:?}");
        }
        for r in 0..2 {
            let line = line_of(&lines, r, "failed");
            assert!(line.starts_with("failed culprit Some(2) ::"), "exit {exit}: {line}");
            assert!(line.contains("timed out"), "exit {exit}: {line}");
        }
    }
}
