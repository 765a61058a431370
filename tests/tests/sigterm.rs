//! A rank process SIGTERMed while a collective is in flight (what `cohort launch` does to the
//! survivors after `--grace`) says which work it was in and whom it waited for, dumps its flight
//! recorder when a dump prefix is set, and still dies of SIGTERM.
//!
//! Two `cohort-rank` processes run the `wait-for-last` scenario: rank 1 never joins the
//! allreduce that rank 0 waits in.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A line from rank `.0`; `.1` says whether it came from stderr.
type Line = (u32, bool, String);

struct Ranks {
    children: Vec<Child>,
    lines: mpsc::Receiver<Line>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Two ranks of `wait-for-last`, both ready (rank 0 inside its allreduce), stdout and stderr read.
fn start(env: &[(&str, String)]) -> Ranks {
    let port = free_port().to_string();
    let (tx, lines) = mpsc::channel();
    let children = (0..2u32)
        .map(|r| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_cohort-rank"));
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("COHORT_TEST_SCENARIO", "wait-for-last")
                .env("COHORT_INIT_TIMEOUT_MS", "20000")
                .env_remove("COHORT_SIGTERM_REPORT")
                .env_remove("COHORT_DUMP_ON_FAILURE")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("start cohort-rank");
            let out = child.stdout.take().unwrap();
            let err = child.stderr.take().unwrap();
            for (stream, is_err) in [(Box::new(out) as Box<dyn std::io::Read + Send>, false), (Box::new(err), true)] {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        let _ = tx.send((r, is_err, line));
                    }
                });
            }
            child
        })
        .collect();
    let ranks = Ranks { children, lines };
    let mut ready = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ready < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, _, line) = ranks.lines.recv_timeout(left).expect("both ranks get ready");
        assert!(!line.starts_with("error"), "{line}");
        if line == "ready" {
            ready += 1;
        }
    }
    // Let rank 0's allreduce reach the wire and wait for rank 1.
    std::thread::sleep(Duration::from_millis(300));
    ranks
}

impl Ranks {
    /// SIGTERM rank `r`; how it ended and every stderr line it printed.
    fn sigterm(&mut self, r: u32) -> (ExitStatus, Vec<String>) {
        let child = &mut self.children[r as usize];
        let pid = child.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "rank {r} did not die within 20 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        };
        // The readers see the end of the pipes shortly after.
        std::thread::sleep(Duration::from_millis(100));
        let stderr = self.lines.try_iter().filter(|(rank, is_err, _)| *rank == r && *is_err).map(|(.., l)| l).collect();
        (status, stderr)
    }
}

fn scratch_dir() -> std::path::PathBuf {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let dir = std::env::temp_dir().join(format!("cohort-sigterm-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_rank_sigtermed_in_a_collective_names_it_and_whom_it_waited_for_dumps_and_dies_of_sigterm() {
    let dir = scratch_dir();
    let prefix = format!("{}/rank_", dir.display());
    let mut ranks = start(&[("COHORT_DUMP_ON_FAILURE", prefix.clone())]);

    let (status, stderr) = ranks.sigterm(0);
    eprintln!("rank 0: {status:?}, stderr: {stderr:#?}");
    assert_eq!(status.signal(), Some(libc::SIGTERM), "rank 0 must still die of SIGTERM: {status:?}");
    let dump = format!("{prefix}0.json");
    let line = stderr
        .iter()
        .find(|l| l.starts_with("cohort: rank 0: SIGTERM while all_reduce (seq "))
        .unwrap_or_else(|| panic!("no SIGTERM report naming the allreduce: {stderr:?}"));
    assert!(line.contains(" was running for "), "{line}");
    assert!(line.contains(", waiting for rank(s) [1]"), "{line}");
    assert!(line.ends_with(&format!("; flight recorder dumped to {dump}")), "{line}");
    let json = std::fs::read_to_string(&dump).expect("the dump file");
    assert!(json.contains("all_reduce"), "the dump holds the allreduce: {json}");

    // Rank 1 was in no collective (and has lost rank 0 meanwhile).
    let (status, stderr) = ranks.sigterm(1);
    eprintln!("rank 1: {status:?}, stderr: {stderr:#?}");
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(
        stderr
            .iter()
            .any(|l| l.starts_with("cohort: rank 1: SIGTERM with no collective in flight; flight recorder dumped to")),
        "{stderr:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn with_the_report_off_a_sigtermed_rank_dies_silently_as_before() {
    let mut ranks = start(&[("COHORT_SIGTERM_REPORT", "0".into())]);
    let (status, stderr) = ranks.sigterm(0);
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(!stderr.iter().any(|l| l.contains("SIGTERM")), "{stderr:?}");
}
