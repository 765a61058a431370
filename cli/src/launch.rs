//! `cohort launch`: a torchrun-style launcher for local rank processes.
//!
//! When a rank fails (a non-zero exit or a signal) the others are not stopped at once: a rank
//! that loses a peer names it a few milliseconds later, and a SIGTERM sent first would kill it
//! before it says so. They get `--grace` seconds to end on their own, with their output still
//! relayed; then SIGTERM, and [`TERM_TIMEOUT`] later SIGKILL. The launcher ends with a summary
//! on stderr: the first failure, each other rank's last error line ([`is_error_line`]) and
//! where the flight-recorder dumps are.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use clap::Args;

/// Arguments of `cohort launch`.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  cohort launch -n 4 -- ./train --epochs 3\n  \
    cohort launch -n 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 -- ./train")]
pub(crate) struct LaunchArgs {
    /// Rank processes to start on this node.
    #[arg(short = 'n', long = "nproc-per-node", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    nproc: u32,
    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    nnodes: u32,
    /// This node's index (0-based).
    #[arg(long, default_value_t = 0)]
    node_rank: u32,
    /// Address of the node that hosts the store (node 0).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store, which node 0 hosts; 0 picks a free one (single node only).
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// After a rank fails, seconds the other ranks get to fail (and say why) on their own, with
    /// their output still relayed, before they get SIGTERM (and SIGKILL 5 s after that); 0
    /// sends SIGTERM at once.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    grace: f64,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    no_prefix: bool,
    /// Do not host the store: the program's rank 0 hosts it (as torch's rank 0 and cohort's
    /// `init_process_group` do when no launcher hosts one).
    #[arg(long)]
    no_store: bool,
    /// The command to run, and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

struct RankProc {
    rank: u32,
    child: Child,
    status: Option<ExitStatus>,
    /// When the launcher reaped it.
    ended_at: Option<Instant>,
    pumps: Vec<JoinHandle<()>>,
    last_error: Arc<Mutex<LastError>>,
}

/// How long the launcher waits, once a rank failed, for others to fail before it names the
/// first failure (at most `--grace`): see [`first_failed`].
const SETTLE: Duration = Duration::from_millis(50);

/// How long a rank that got SIGTERM has before SIGKILL.
const TERM_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest error line the summary quotes (longer ones are cut, with "...").
const MAX_ERROR_LINE: usize = 400;

/// What a rank last wrote to stderr, for the summary.
#[derive(Debug, Default)]
struct LastError {
    /// The last line that [`is_error_line`] accepts.
    error: Option<String>,
    /// The last non-empty line.
    line: Option<String>,
}

/// Run the launcher; returns the process exit code.
pub(crate) fn run(args: LaunchArgs) -> Result<i32, String> {
    if args.node_rank >= args.nnodes {
        return Err(format!("--node-rank {} is outside --nnodes {}", args.node_rank, args.nnodes));
    }
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        return Err(format!("--grace {} is not a number of seconds", args.grace));
    }
    if args.nnodes > 1 && args.master_port == 0 {
        return Err("--master-port is required with --nnodes > 1".into());
    }
    let host_store = args.node_rank == 0 && !args.no_store;
    let (port, store) = if host_store {
        // Node 0 hosts the store on MASTER_PORT (port 0: the one the OS picks, no race).
        let store = HostedStore::start(args.master_port)
            .map_err(|e| format!("--master-port {}: cannot host the store: {e}", args.master_port))?;
        (store.port, Some(store))
    } else {
        match args.master_port {
            0 => (free_port().map_err(|e| format!("cannot find a free port for the store: {e}"))?, None),
            p => (p, None),
        }
    };
    let world_size = args.nnodes * args.nproc;
    let mut procs = Vec::new();
    for local in 0..args.nproc {
        let rank = args.node_rank * args.nproc + local;
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if args.no_store {
            cmd.env_remove("COHORT_STORE_HOSTED").env_remove("TORCHELASTIC_USE_AGENT_STORE");
        } else {
            // The ranks connect to the launcher's store instead of hosting one (torch reads the
            // same variable as torchrun's agent store).
            cmd.env("COHORT_STORE_HOSTED", "1").env("TORCHELASTIC_USE_AGENT_STORE", "True");
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut procs);
                return Err(format!("cannot start {:?} for rank {rank}: {e}", args.command[0]));
            }
        };
        let prefix = if args.no_prefix { String::new() } else { format!("[rank {rank}] ") };
        let last_error = Arc::new(Mutex::new(LastError::default()));
        let mut pumps = Vec::new();
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(out, prefix.clone(), None));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(err, prefix, Some(Arc::clone(&last_error))));
        }
        procs.push(RankProc { rank, child, status: None, ended_at: None, pumps, last_error });
    }

    let grace = Duration::from_secs_f64(args.grace);
    let mut first_failure: Option<(u32, ExitStatus)> = None;
    // When the launcher first saw a rank fail.
    let mut failed_at: Option<Instant> = None;
    // After the first failure: when the ranks still running get SIGTERM, then SIGKILL.
    let mut term_at: Option<Instant> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        reap(&mut procs);
        let now = Instant::now();
        let all_ended = procs.iter().all(|p| p.status.is_some());
        if failed_at.is_none() && procs.iter().any(|p| p.status.is_some_and(|s| !s.success())) {
            failed_at = Some(now);
        }
        if first_failure.is_none()
            && let Some(at) = failed_at
            && (now >= at + grace.min(SETTLE) || all_ended)
            && let Some(p) = first_failed(&procs)
        {
            let status = p.status.expect("first_failed picks a reaped rank");
            first_failure = Some((p.rank, status));
            eprintln!(
                "cohort launch: rank {} {}; stopping the other ranks: they have {:.1} s (--grace) to end on \
                 their own, then SIGTERM",
                p.rank,
                describe(status),
                grace.as_secs_f64()
            );
            term_at = Some(at + grace);
        }
        if all_ended {
            break;
        }
        if term_at.is_some_and(|t| now >= t) {
            term_at = None;
            kill_at = Some(now + TERM_TIMEOUT);
            let running: Vec<u32> = procs.iter().filter(|p| p.status.is_none()).map(|p| p.rank).collect();
            if grace > Duration::ZERO {
                eprintln!("cohort launch: grace over; sending SIGTERM to rank(s) {running:?}");
            }
            for other in procs.iter().filter(|p| p.status.is_none()) {
                terminate(&other.child);
            }
        }
        if kill_at.is_some_and(|t| now >= t) {
            kill_all(&mut procs);
        }
        thread::sleep(Duration::from_millis(5));
    }
    for p in &mut procs {
        for h in p.pumps.drain(..) {
            let _ = h.join();
        }
    }
    print_table(&procs);
    if let Some((rank, status)) = first_failure {
        print_summary(&procs, rank, status);
    }
    drop(store);
    Ok(match first_failure {
        None => 0,
        Some((_, status)) => status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(1)),
    })
}

/// Relays `stream` line by line to the launcher's stdout (`last_error` `None`) or stderr
/// (`Some`: each line also updates it), as the lines come.
fn pump<R: Read + Send + 'static>(
    stream: R,
    prefix: String,
    last_error: Option<Arc<Mutex<LastError>>>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let mut out: Box<dyn Write> = if last_error.is_some() {
                        Box::new(std::io::stderr().lock())
                    } else {
                        Box::new(std::io::stdout().lock())
                    };
                    let _ = out.write_all(prefix.as_bytes());
                    let _ = out.write_all(&line);
                    if !line.ends_with(b"\n") {
                        let _ = out.write_all(b"\n");
                    }
                    let _ = out.flush();
                    drop(out);
                    if let Some(last) = &last_error {
                        note_line(last, &line);
                    }
                }
            }
        }
    })
}

/// Whether the summary quotes `line` as a rank's error: it contains "error", "fail",
/// "timed out", "exception" or "panicked" (any case). A rank's last error line is the last
/// stderr line that passes, else its last non-empty stderr line.
fn is_error_line(line: &str) -> bool {
    let lower = line.to_lowercase();
    ["error", "fail", "timed out", "exception", "panicked"].iter().any(|w| lower.contains(w))
}

fn note_line(last: &Mutex<LastError>, line: &[u8]) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim();
    if text.is_empty() {
        return;
    }
    let mut text = text.to_owned();
    if text.len() > MAX_ERROR_LINE {
        let mut cut = MAX_ERROR_LINE;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("...");
    }
    // A pump that panicked while holding the lock left a whole value behind: keep using it.
    let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
    if is_error_line(&text) {
        last.error = Some(text.clone());
    }
    last.line = Some(text);
}

/// The rank to report as the first failure. The launcher polls, so ranks that end within a
/// few milliseconds of each other may be reaped in either order (a rank SIGKILLed while stopped
/// closes its sockets before it can be reaped, and a peer that sees the EOF may exit first):
/// after the first failure the launcher waits [`SETTLE`] for others, then picks a rank killed by
/// a signal over one that exited with an error (the usual reaction to a lost peer), then the
/// one reaped first, then the lowest rank.
fn first_failed(procs: &[RankProc]) -> Option<&RankProc> {
    let failed = procs.iter().filter(|p| p.status.is_some_and(|s| !s.success()));
    failed.min_by_key(|p| (p.status.and_then(|s| s.signal()).is_none(), p.ended_at, p.rank))
}

fn terminate(child: &Child) {
    let Ok(pid) = i32::try_from(child.id()) else { return };
    // SAFETY: kill(2) on a pid we spawned and have not yet reaped; the worst case is ESRCH.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}

/// Collects the exit status of every rank that has ended.
fn reap(procs: &mut [RankProc]) {
    for p in procs.iter_mut().filter(|p| p.status.is_none()) {
        if let Ok(Some(status)) = p.child.try_wait() {
            p.status = Some(status);
            p.ended_at = Some(Instant::now());
        }
    }
}

fn kill_all(procs: &mut [RankProc]) {
    for p in procs.iter_mut().filter(|p| p.status.is_none()) {
        let _ = p.child.kill();
        p.status = p.child.wait().ok();
        p.ended_at = Some(Instant::now());
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        (None, None) => "ended".into(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

fn print_table(procs: &[RankProc]) {
    eprintln!("cohort launch: {:<6} {:<8} exit", "rank", "pid");
    for p in procs {
        eprintln!("cohort launch: {:<6} {:<8} {}", p.rank, p.child.id(), exit_text(p.status));
    }
}

fn exit_text(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("code {c}"),
            (None, Some(sig)) => format!("signal {sig} ({})", signal_name(sig)),
            (None, None) => "unknown".into(),
        },
        None => "not reaped".into(),
    }
}

/// The summary after a failure: the first failure, every rank's last error line (see
/// [`is_error_line`]) and where the flight-recorder dumps are.
fn print_summary(procs: &[RankProc], first: u32, status: ExitStatus) {
    eprintln!("cohort launch: summary: rank {first} failed first: it {}", describe(status));
    for p in procs {
        let last = p.last_error.lock().unwrap_or_else(|e| e.into_inner());
        let said = match (&last.error, &last.line) {
            (Some(e), _) | (None, Some(e)) => e.as_str(),
            (None, None) => "(nothing on stderr)",
        };
        eprintln!("cohort launch:   rank {} ({}): {said}", p.rank, exit_text(p.status));
    }
    for var in ["COHORT_DUMP_ON_FAILURE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] {
        let Ok(prefix) = std::env::var(var) else { continue };
        let written: Vec<u32> =
            procs.iter().map(|p| p.rank).filter(|r| Path::new(&format!("{prefix}{r}.json")).exists()).collect();
        eprintln!("cohort launch:   dumps ({var}): {prefix}<rank>.json; written by rank(s) {written:?}");
        // The ranks read the first of the two that is set.
        break;
    }
}

/// The store `cohort launch` hosts on node 0 (and `cohort bench` for its local ranks), served
/// from its own thread until dropped.
pub(crate) struct HostedStore {
    pub(crate) port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl HostedStore {
    pub(crate) fn start(port: u16) -> Result<HostedStore, String> {
        use cohort_transports::{TcpStoreServer, TcpStoreServerConfig, TokioNet};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the runtime: {e}"))?;
        let bind = std::net::SocketAddr::from(([0, 0, 0, 0], port));
        // The ranks inherit the environment, so they prove the secret this store requires.
        let secret = cohort_transports::env::Env::process().auth_secret().map_err(|e| e.to_string())?;
        let server = runtime
            .block_on(TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind).with_auth(secret)))
            .map_err(|e| e.to_string())?;
        let port = server.port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = thread::spawn(move || {
            runtime.block_on(async move {
                let _ = stopped.await;
                server.shutdown().await;
            });
        });
        Ok(HostedStore { port, stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for HostedStore {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}
