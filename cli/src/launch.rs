//! `cohort launch`: a torchrun-style launcher for local rank processes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
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
    /// Seconds to let the other ranks exit after one fails, before killing them.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
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
    pumps: Vec<JoinHandle<()>>,
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
        let mut pumps = Vec::new();
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(out, prefix.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(err, prefix, true));
        }
        procs.push(RankProc { rank, child, status: None, pumps });
    }

    let grace = Duration::from_secs_f64(args.grace);
    let mut first_failure: Option<(u32, ExitStatus)> = None;
    while procs.iter().any(|p| p.status.is_none()) {
        reap(&mut procs);
        if first_failure.is_none()
            && let Some(p) = procs.iter().find(|p| p.status.is_some_and(|s| !s.success()))
        {
            let status = p.status.expect("just matched");
            first_failure = Some((p.rank, status));
            eprintln!(
                "cohort launch: rank {} {}; stopping the other ranks (grace {:.1} s)",
                p.rank,
                describe(status),
                grace.as_secs_f64()
            );
            // Ask politely, wait out the grace period, then kill what is left.
            for other in procs.iter().filter(|p| p.status.is_none()) {
                terminate(&other.child);
            }
            let until = Instant::now() + grace;
            while Instant::now() < until && procs.iter().any(|p| p.status.is_none()) {
                thread::sleep(Duration::from_millis(10));
                reap(&mut procs);
            }
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
    drop(store);
    Ok(match first_failure {
        None => 0,
        Some((_, status)) => status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(1)),
    })
}

fn pump<R: Read + Send + 'static>(stream: R, prefix: String, is_err: bool) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let mut out: Box<dyn Write> =
                        if is_err { Box::new(std::io::stderr().lock()) } else { Box::new(std::io::stdout().lock()) };
                    let _ = out.write_all(prefix.as_bytes());
                    let _ = out.write_all(&line);
                    if !line.ends_with(b"\n") {
                        let _ = out.write_all(b"\n");
                    }
                    let _ = out.flush();
                }
            }
        }
    })
}

fn terminate(child: &Child) {
    let Ok(pid) = i32::try_from(child.id()) else { return };
    // SAFETY: kill(2) on a pid we spawned and have not yet reaped; the worst case is ESRCH.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}

fn reap(procs: &mut [RankProc]) {
    for p in procs.iter_mut().filter(|p| p.status.is_none()) {
        if let Ok(Some(status)) = p.child.try_wait() {
            p.status = Some(status);
        }
    }
}

fn kill_all(procs: &mut [RankProc]) {
    for p in procs.iter_mut().filter(|p| p.status.is_none()) {
        let _ = p.child.kill();
        p.status = p.child.wait().ok();
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
        let exit = match p.status {
            Some(s) => match (s.code(), s.signal()) {
                (Some(c), _) => format!("code {c}"),
                (None, Some(sig)) => format!("signal {sig} ({})", signal_name(sig)),
                (None, None) => "unknown".into(),
            },
            None => "not reaped".into(),
        };
        eprintln!("cohort launch: {:<6} {:<8} {exit}", p.rank, p.child.id());
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
        let server = runtime
            .block_on(TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind)))
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
