//! `init_process_group`: a group from the environment torchrun (or `cohort launch`) sets.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::{InitError, ProcessGroup, TcpOptions};
use crate::net::TokioNet;
use crate::store::{Store, TcpStore, TcpStoreConfig, TcpStoreServer, TcpStoreServerConfig};

/// Where the group's store is and who this rank is, as torchrun's environment says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitConfig {
    /// `MASTER_ADDR`: the host of the store.
    pub master_addr: String,
    /// `MASTER_PORT`: the store's port.
    pub master_port: u16,
    /// `RANK`.
    pub rank: u32,
    /// `WORLD_SIZE`.
    pub world_size: u32,
    /// `LOCAL_RANK` (informational on the TCP backend).
    pub local_rank: u32,
    /// Whether rank 0 hosts the store in-process (the default). `COHORT_STORE_HOSTED=1` (or
    /// torchrun's `TORCHELASTIC_USE_AGENT_STORE=True`) says a launcher hosts it already.
    pub host_store: bool,
}

impl InitConfig {
    /// Read `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`; every missing or
    /// malformed variable is named.
    pub fn from_env() -> Result<InitConfig, InitError> {
        fn get(name: &str) -> Result<String, InitError> {
            std::env::var(name).map_err(|_| InitError::Env(format!("environment variable {name} is not set")))
        }
        fn num<T: std::str::FromStr>(name: &str) -> Result<T, InitError> {
            let v = get(name)?;
            v.trim().parse().map_err(|_| InitError::Env(format!("environment variable {name}={v:?} is not a number")))
        }
        let hosted = std::env::var("COHORT_STORE_HOSTED").is_ok_and(|v| v == "1")
            || std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        let cfg = InitConfig {
            master_addr: get("MASTER_ADDR")?,
            master_port: num("MASTER_PORT")?,
            rank: num("RANK")?,
            world_size: num("WORLD_SIZE")?,
            local_rank: std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            host_store: !hosted,
        };
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            return Err(InitError::BadRank { rank: cfg.rank, world_size: cfg.world_size });
        }
        Ok(cfg)
    }
}

/// A process group from torchrun's environment and `COHORT_*` options, with its own tokio
/// runtime. Rank 0 hosts the store on `MASTER_PORT` unless a launcher does. Call it outside
/// any async context (in one, use [`ProcessGroup::connect`]).
pub fn init_process_group() -> Result<ProcessGroup, InitError> {
    let cfg = InitConfig::from_env()?;
    let opts = TcpOptions::from_env().map_err(|e| InitError::Env(e.to_string()))?;
    init_process_group_with(cfg, opts)
}

/// [`init_process_group`] with explicit configuration.
pub fn init_process_group_with(cfg: InitConfig, opts: TcpOptions) -> Result<ProcessGroup, InitError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.io_threads.max(1))
        .thread_name("cohort-tcp")
        .enable_all()
        .build()
        .map_err(|e| InitError::Env(format!("cannot start the runtime: {e}")))?;
    let runtime = Arc::new(runtime);
    let pg = runtime.block_on(async {
        let server = if cfg.rank == 0 && cfg.host_store {
            let bind = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), cfg.master_port);
            let server = TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind)).await.map_err(|e| {
                InitError::Env(format!("rank 0 cannot host the store on port {}: {e}", cfg.master_port))
            })?;
            Some(server)
        } else {
            None
        };
        let client = TcpStore::connect(
            TcpStoreConfig::new(cfg.master_addr.clone(), cfg.master_port)
                .with_connect_timeout(opts.init_timeout)
                .with_timeout(opts.init_timeout.max(Duration::from_secs(1))),
        )
        .await?;
        let store: Arc<dyn Store> = Arc::new(client);
        let pg = ProcessGroup::connect(TokioNet, store, cfg.rank, cfg.world_size, opts).await?;
        Ok::<_, InitError>(pg.with_owned(server, None))
    })?;
    Ok(pg.with_owned(None, Some(runtime)))
}
