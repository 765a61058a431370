//! `cohort store`: a standalone TCPStore-compatible server.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Args;
use cohort_transports::{TcpStoreServer, TcpStoreServerConfig, TokioNet};

/// Arguments of `cohort store`.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  cohort store --port 29500\n\n\
    Then, from Python: torch.distributed.TCPStore(\"127.0.0.1\", 29500, is_master=False)\n\
    or MASTER_ADDR/MASTER_PORT with COHORT_STORE_HOSTED=1 for cohort ranks. Ctrl-C (or SIGTERM) stops it.")]
pub(crate) struct StoreArgs {
    /// The port to listen on (PyTorch's default is 29500; 0 picks a free one and prints it).
    #[arg(short = 'p', long, default_value_t = 29500)]
    port: u16,
    /// The address to bind.
    #[arg(long, default_value = "0.0.0.0")]
    host: IpAddr,
    /// Print the number of clients and keys every this many seconds (0: never).
    #[arg(long, default_value_t = 0, value_name = "SECONDS")]
    stats: u64,
}

/// Serve until interrupted; returns the exit code.
pub(crate) fn run(args: StoreArgs) -> Result<i32, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // Register for SIGINT and SIGTERM before announcing the port: a signal that arrives
        // right after the announcement must stop the store cleanly, not kill it.
        let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| format!("cannot listen for SIGINT: {e}"))?;
        let mut terminate = signal(SignalKind::terminate()).map_err(|e| format!("cannot listen for SIGTERM: {e}"))?;
        let bind = SocketAddr::new(args.host, args.port);
        let secret = cohort_transports::env::Env::process().auth_secret().map_err(|e| e.to_string())?;
        let server = TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind).with_auth(secret))
            .await
            .map_err(|e| format!("--port {}: {e}", args.port))?;
        println!("cohort store: serving the TCPStore protocol on {} (Ctrl-C stops it)", server.local_addr());
        let period = Duration::from_secs(args.stats.max(1));
        loop {
            tokio::select! {
                biased;
                _ = interrupt.recv() => break,
                _ = terminate.recv() => break,
                () = tokio::time::sleep(period), if args.stats > 0 => {
                    println!("cohort store: {} clients, {} keys", server.num_clients(), server.num_keys());
                }
            }
        }
        println!("cohort store: stopping ({} keys held)", server.num_keys());
        server.shutdown().await;
        Ok(0)
    })
}
