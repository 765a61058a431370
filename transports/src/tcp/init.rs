//! `init_process_group`: a group from the environment torchrun (or `cohort launch`) sets.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::{InitError, ProcessGroup, TcpOptions};
use crate::env::{self, Env, EnvError};
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
    /// The job's secret (`COHORT_AUTH_TOKEN` or `COHORT_AUTH_TOKEN_FILE`): the store rank 0
    /// hosts requires it, and this rank's store client proves it.
    pub auth: Option<cohort_core::protocol::AuthSecret>,
}

impl InitConfig {
    /// Read `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (0 when unset) and
    /// `COHORT_STORE_HOSTED` (or `TORCHELASTIC_USE_AGENT_STORE`); every missing or malformed
    /// variable is named.
    pub fn from_env() -> Result<InitConfig, InitError> {
        Self::from_vars(&Env::process())
    }

    /// [`InitConfig::from_env`] over any source of variables.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<InitConfig, InitError> {
        Self::from_vars(&Env::new(lookup))
    }

    fn from_vars<F: Fn(&str) -> Option<String>>(v: &Env<F>) -> Result<InitConfig, InitError> {
        let read = || -> Result<InitConfig, EnvError> {
            let master_port = v.u32(env::MASTER_PORT)?.ok_or(EnvError::Missing { name: env::MASTER_PORT.name() })?;
            Ok(InitConfig {
                master_addr: v.required_string(env::MASTER_ADDR)?,
                master_port: u16::try_from(master_port).map_err(|_| {
                    EnvError::invalid(env::MASTER_PORT.name(), master_port.to_string(), "expected a port, 0 to 65535")
                })?,
                rank: v.rank(env::RANK)?,
                world_size: v.rank(env::WORLD_SIZE)?,
                local_rank: v.u32(env::LOCAL_RANK)?.unwrap_or(0),
                host_store: !v.flag(env::STORE_HOSTED)?.unwrap_or(false),
                auth: v.auth_secret()?,
            })
        };
        let cfg = read()?;
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
    let opts = TcpOptions::from_env()?;
    init_process_group_with(cfg, opts)
}

/// [`init_process_group`] with explicit configuration.
pub fn init_process_group_with(cfg: InitConfig, opts: TcpOptions) -> Result<ProcessGroup, InitError> {
    let runtime = Arc::new(runtime(&opts).map_err(InitError::Runtime)?);
    let pg = runtime.block_on(async {
        let (store, server) = rendezvous_store(&cfg, opts.init_timeout).await?;
        let pg = ProcessGroup::connect(TokioNet, store, cfg.rank, cfg.world_size, opts).await?;
        Ok::<_, InitError>(pg.with_owned(server, None))
    })?;
    Ok(pg.with_owned(None, Some(runtime)))
}

/// The tokio runtime for a group made with `opts`, as [`init_process_group`] builds it:
/// `opts.io_threads` worker threads named `cohort-tcp`, each kept to core `opts.io_core` when
/// that is set (see [`TcpOptions::io_core`]).
pub fn runtime(opts: &TcpOptions) -> std::io::Result<tokio::runtime::Runtime> {
    let io_core = opts.io_core;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.io_threads.max(1))
        .thread_name("cohort-tcp")
        .on_thread_start(move || {
            if let Some(slot) = io_core {
                crate::work::keep_to_core(slot);
            }
        })
        .enable_all()
        .build()
}

/// The job's store, as torchrun's env:// sets it up: rank 0 hosts it on `MASTER_PORT` (unless
/// a launcher does, [`InitConfig::host_store`]) and every rank connects to
/// `MASTER_ADDR:MASTER_PORT`, waiting up to `init_timeout`. Returns the client and, on the
/// rank that hosts it, the server, which must live as long as the job. Any backend's group
/// (TCP's, NCCL's) can be built on the client.
pub async fn rendezvous_store(
    cfg: &InitConfig,
    init_timeout: Duration,
) -> Result<(Arc<dyn Store>, Option<TcpStoreServer>), InitError> {
    let server = if cfg.rank == 0 && cfg.host_store {
        let bind = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), cfg.master_port);
        let server = TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind).with_auth(cfg.auth.clone()))
            .await
            .map_err(|source| InitError::HostStore { port: cfg.master_port, source })?;
        Some(server)
    } else {
        None
    };
    let client = TcpStore::connect(
        TcpStoreConfig::new(cfg.master_addr.clone(), cfg.master_port)
            .with_connect_timeout(init_timeout)
            .with_timeout(init_timeout.max(Duration::from_secs(1)))
            .with_auth(cfg.auth.clone()),
    )
    .await?;
    Ok((Arc::new(client), server))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|&(n, v)| (n.to_owned(), v.to_owned())).collect();
        move |name: &str| pairs.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }

    const TORCHRUN: [(&str, &str); 4] =
        [("MASTER_ADDR", "h"), ("MASTER_PORT", "29500"), ("RANK", "1"), ("WORLD_SIZE", "2")];

    fn with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        // The first match wins, so extras go first.
        extra.iter().copied().chain(TORCHRUN).collect()
    }

    #[test]
    fn torchruns_variables_make_a_config() {
        let cfg = InitConfig::from_lookup(table(&with(&[("LOCAL_RANK", "1")]))).unwrap();
        let want = InitConfig {
            master_addr: "h".into(),
            master_port: 29500,
            rank: 1,
            world_size: 2,
            local_rank: 1,
            host_store: true,
            auth: None,
        };
        assert_eq!(cfg, want);
        let with_secret = InitConfig::from_lookup(table(&with(&[("COHORT_AUTH_TOKEN", "s3cret")]))).unwrap();
        assert_eq!(with_secret.auth, cohort_core::protocol::AuthSecret::new("s3cret"));
        assert_eq!(InitConfig::from_lookup(table(&TORCHRUN)).unwrap().local_rank, 0);
        let hosted = InitConfig::from_lookup(table(&with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]))).unwrap();
        assert!(!hosted.host_store);
        let hosted = InitConfig::from_lookup(table(&with(&[("COHORT_STORE_HOSTED", "1")]))).unwrap();
        assert!(!hosted.host_store);
    }

    #[test]
    fn a_malformed_local_rank_is_an_error_not_rank_0() {
        let e = InitConfig::from_lookup(table(&with(&[("LOCAL_RANK", "abc")]))).unwrap_err();
        assert_eq!(e.to_string(), "environment variable LOCAL_RANK=\"abc\" is invalid: invalid digit found in string");
    }

    #[test]
    fn missing_and_malformed_variables_are_named() {
        let e = InitConfig::from_lookup(table(&TORCHRUN[1..])).unwrap_err();
        assert_eq!(e.to_string(), "environment variable MASTER_ADDR is not set");
        let e = InitConfig::from_lookup(table(&with(&[("RANK", "one")]))).unwrap_err();
        assert!(e.to_string().starts_with("environment variable RANK=\"one\" is invalid"), "{e}");
        let e = InitConfig::from_lookup(table(&with(&[("MASTER_PORT", "70000")]))).unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT=\"70000\" is invalid: expected a port"), "{e}");
        let e = InitConfig::from_lookup(table(&with(&[("COHORT_STORE_HOSTED", "maybe")]))).unwrap_err();
        assert!(e.to_string().contains("COHORT_STORE_HOSTED=\"maybe\""), "{e}");
        let e = InitConfig::from_lookup(table(&with(&[("RANK", "2")]))).unwrap_err();
        assert!(matches!(e, InitError::BadRank { rank: 2, world_size: 2 }), "{e}");
    }
}
