//! The one reader of environment variables: the TCP backend ([`TcpOptions`]), the NCCL backend
//! ([`NcclOptions`]) and init ([`InitConfig`]) all read through [`Env`], so a variable means
//! the same thing, and a malformed value fails the same way, everywhere.
//!
//! Each variable is a [`Var`]: cohort's name and the torch names that mean the same
//! (`COHORT_ASYNC_ERROR_HANDLING` and `TORCH_NCCL_ASYNC_ERROR_HANDLING`). The first one that is
//! set and not empty is read, cohort's name first. A value that does not parse is an
//! [`EnvError`] naming the variable that was read and its value; it never falls back to the
//! default.
//!
//! Timeouts: `COHORT_TIMEOUT_MS` is the default timeout of collectives only, on every backend;
//! `COHORT_INIT_TIMEOUT_MS` is how long init (connecting the mesh, creating the communicator)
//! may take.
//!
//! [`TcpOptions`]: crate::tcp::TcpOptions
//! [`NcclOptions`]: crate::nccl::NcclOptions
//! [`InitConfig`]: crate::tcp::InitConfig

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use cohort_core::group::ErrorHandling;
use cohort_core::protocol::AuthSecret;

/// An environment variable: cohort's name, then the torch names read when it is not set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Var {
    /// Every name, cohort's first.
    pub names: &'static [&'static str],
}

impl Var {
    /// Cohort's name.
    pub fn name(&self) -> &'static str {
        self.names[0]
    }
}

macro_rules! vars {
    ($($(#[$doc:meta])* $id:ident = [$($name:literal),+ $(,)?];)*) => {
        $($(#[$doc])* pub const $id: Var = Var { names: &[$($name),+] };)*
    };
}

vars! {
    /// torchrun's rank of this process in the job.
    RANK = ["RANK"];
    /// torchrun's number of ranks in the job.
    WORLD_SIZE = ["WORLD_SIZE"];
    /// torchrun's rank of this process on its host.
    LOCAL_RANK = ["LOCAL_RANK"];
    /// torchrun's number of ranks on this host.
    LOCAL_WORLD_SIZE = ["LOCAL_WORLD_SIZE"];
    /// The store's host.
    MASTER_ADDR = ["MASTER_ADDR"];
    /// The store's port.
    MASTER_PORT = ["MASTER_PORT"];
    /// A launcher hosts the store (rank 0 does not).
    STORE_HOSTED = ["COHORT_STORE_HOSTED", "TORCHELASTIC_USE_AGENT_STORE"];
    /// Default timeout of collectives, in milliseconds (not init's).
    TIMEOUT_MS = ["COHORT_TIMEOUT_MS"];
    /// How long init may take, in milliseconds.
    INIT_TIMEOUT_MS = ["COHORT_INIT_TIMEOUT_MS"];
    /// What to do after a failure (0-3).
    ASYNC_ERROR_HANDLING = ["COHORT_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"];
    /// Flight-recorder entries kept.
    TRACE_BUFFER_SIZE = ["COHORT_TRACE_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"];
    /// Prefix of flight-recorder dumps written when the group fails.
    DUMP_ON_FAILURE = ["COHORT_DUMP_ON_FAILURE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"];
    /// TCP: heartbeat interval in milliseconds (0 turns heartbeats off).
    HEARTBEAT_MS = ["COHORT_HEARTBEAT_MS"];
    /// TCP: a peer silent this many milliseconds is dead.
    PEER_DEAD_AFTER_MS = ["COHORT_PEER_DEAD_AFTER_MS"];
    /// TCP: how long a waiter busy-polls, in microseconds.
    BUSY_POLL_US = ["COHORT_BUSY_POLL_US"];
    /// TCP: tokio worker threads.
    IO_THREADS = ["COHORT_IO_THREADS"];
    /// TCP: buffer pool, in MiB.
    BUFFER_POOL_MB = ["COHORT_BUFFER_POOL_MB"];
    /// TCP: connections per peer.
    CONNECTIONS_PER_PEER = ["COHORT_CONNECTIONS_PER_PEER"];
    /// TCP: connect to peers on first use.
    LAZY_INIT = ["COHORT_LAZY_INIT", "TORCH_GLOO_LAZY_INIT"];
    /// TCP: the interface to listen on.
    SOCKET_IFNAME = ["COHORT_SOCKET_IFNAME"];
    /// TCP: shared memory between ranks of one host.
    SHM = ["COHORT_SHM"];
    /// TCP: two-rank allreduces over shared memory run in their submit call.
    SHM_QUICK = ["COHORT_SHM_QUICK"];
    /// TCP: on an oversubscribed host, the runtime's threads keep to this rank's core.
    PIN_IO_THREADS = ["COHORT_PIN_IO_THREADS"];
    /// NCCL: a blocking communicator.
    NCCL_BLOCKING = ["COHORT_NCCL_BLOCKING"];
    /// NCCL: blocking-wait mode.
    BLOCKING_WAIT = ["COHORT_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"];
    /// NCCL: create the communicator at the first collective.
    NCCL_LAZY_INIT = ["COHORT_NCCL_LAZY_INIT"];
    /// NCCL: desync debug.
    DESYNC_DEBUG = ["COHORT_DESYNC_DEBUG", "TORCH_NCCL_DESYNC_DEBUG"];
    /// NCCL: time every collective.
    ENABLE_TIMING = ["COHORT_ENABLE_TIMING", "TORCH_NCCL_ENABLE_TIMING"];
    /// NCCL: how often the watchdog talks to the store, in milliseconds.
    STATUS_INTERVAL_MS = ["COHORT_STATUS_INTERVAL_MS"];
    /// NCCL: the watchdog heartbeat timeout, in seconds (0 turns the monitor off).
    HEARTBEAT_TIMEOUT_SEC = ["COHORT_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"];
    /// NCCL: whether the monitor aborts the process.
    MONITOR_ABORT = ["COHORT_MONITOR_ABORT"];
    /// NCCL: the CUDA device of this rank (default: the local rank).
    CUDA_DEVICE = ["COHORT_CUDA_DEVICE"];
    /// Whether a SIGTERM prints where each group was (default on).
    SIGTERM_REPORT = ["COHORT_SIGTERM_REPORT"];
    /// A secret every rank (and store client) must prove it knows (see [`Env::auth_secret`]).
    AUTH_TOKEN = ["COHORT_AUTH_TOKEN"];
    /// A file holding that secret.
    AUTH_TOKEN_FILE = ["COHORT_AUTH_TOKEN_FILE"];
}

/// An environment variable that is missing or does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// A variable that must be set is not.
    #[error("environment variable {name} is not set")]
    Missing {
        /// The variable.
        name: &'static str,
    },
    /// A variable's value does not parse, or is out of range.
    #[error("environment variable {name}={value:?} is invalid: {reason}")]
    Invalid {
        /// The variable (the name that was read, which may be a torch alias).
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

impl EnvError {
    /// The variable.
    pub fn name(&self) -> &'static str {
        match self {
            EnvError::Missing { name } | EnvError::Invalid { name, .. } => name,
        }
    }

    /// `name=value` is invalid because of `reason`.
    pub fn invalid(name: &'static str, value: impl Into<String>, reason: impl Into<String>) -> EnvError {
        EnvError::Invalid { name, value: value.into(), reason: reason.into() }
    }
}

/// Reads variables through a lookup: the process environment ([`Env::process`]) or a table in
/// tests ([`Env::new`]). Every reader returns `Ok(None)` when no name of the variable is set
/// (or it is empty), and an error naming the variable when its value does not parse.
#[derive(Debug, Clone, Copy)]
pub struct Env<F = fn(&str) -> Option<String>> {
    lookup: F,
}

fn process_lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Env {
    /// The process environment.
    pub fn process() -> Env {
        Env { lookup: process_lookup }
    }
}

impl<F: Fn(&str) -> Option<String>> Env<F> {
    /// Variables from `lookup`.
    pub fn new(lookup: F) -> Env<F> {
        Env { lookup }
    }

    /// The first name of `var` that is set and not empty, with its value.
    pub fn raw(&self, var: Var) -> Option<(&'static str, String)> {
        var.names.iter().find_map(|&n| (self.lookup)(n).filter(|v| !v.is_empty()).map(|v| (n, v)))
    }

    /// Whether any name of `var` is set (and not empty).
    pub fn is_set(&self, var: Var) -> bool {
        self.raw(var).is_some()
    }

    /// The value as it is.
    pub fn string(&self, var: Var) -> Option<String> {
        self.raw(var).map(|(_, v)| v)
    }

    /// The value, which must be set.
    pub fn required_string(&self, var: Var) -> Result<String, EnvError> {
        self.string(var).ok_or(EnvError::Missing { name: var.name() })
    }

    /// The value parsed as `T` (surrounding spaces ignored).
    pub fn parse<T: FromStr>(&self, var: Var) -> Result<Option<T>, EnvError>
    where
        T::Err: std::fmt::Display,
    {
        let Some((name, value)) = self.raw(var) else { return Ok(None) };
        match value.trim().parse::<T>() {
            Ok(v) => Ok(Some(v)),
            Err(e) => Err(EnvError::Invalid { name, value, reason: e.to_string() }),
        }
    }

    /// An unsigned number.
    pub fn u64(&self, var: Var) -> Result<Option<u64>, EnvError> {
        self.parse(var)
    }

    /// An unsigned number of at most 32 bits.
    pub fn u32(&self, var: Var) -> Result<Option<u32>, EnvError> {
        self.parse(var)
    }

    /// A rank or world size, which must be set.
    pub fn rank(&self, var: Var) -> Result<u32, EnvError> {
        self.u32(var)?.ok_or(EnvError::Missing { name: var.name() })
    }

    /// A flag: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off` (any case).
    pub fn flag(&self, var: Var) -> Result<Option<bool>, EnvError> {
        let Some((name, value)) = self.raw(var) else { return Ok(None) };
        match value.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(Some(true)),
            "0" | "false" | "no" | "off" => Ok(Some(false)),
            _ => Err(EnvError::Invalid { name, value, reason: "expected 1 or 0".into() }),
        }
    }

    /// A duration in milliseconds.
    pub fn millis(&self, var: Var) -> Result<Option<Duration>, EnvError> {
        Ok(self.u64(var)?.map(Duration::from_millis))
    }

    /// A duration in microseconds.
    pub fn micros(&self, var: Var) -> Result<Option<Duration>, EnvError> {
        Ok(self.u64(var)?.map(Duration::from_micros))
    }

    /// A duration in seconds.
    pub fn secs(&self, var: Var) -> Result<Option<Duration>, EnvError> {
        Ok(self.u64(var)?.map(Duration::from_secs))
    }

    /// A path (or a path prefix), as it is.
    pub fn path(&self, var: Var) -> Option<PathBuf> {
        self.string(var).map(PathBuf::from)
    }

    /// The job's shared secret: [`AUTH_TOKEN`]'s value, or else the contents of the file
    /// [`AUTH_TOKEN_FILE`] names (a trailing newline dropped); `None` when neither is set. An
    /// error never shows the secret, only the file's name.
    pub fn auth_secret(&self) -> Result<Option<AuthSecret>, EnvError> {
        if let Some(token) = self.string(AUTH_TOKEN) {
            return Ok(AuthSecret::new(token.into_bytes()));
        }
        let Some((name, path)) = self.raw(AUTH_TOKEN_FILE) else { return Ok(None) };
        let mut bytes = std::fs::read(&path).map_err(|e| EnvError::invalid(name, path.clone(), e.to_string()))?;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        AuthSecret::new(bytes).map(Some).ok_or_else(|| EnvError::invalid(name, path, "the file is empty"))
    }

    /// [`ASYNC_ERROR_HANDLING`], a level of 0 to 3.
    pub fn error_handling(&self) -> Result<Option<ErrorHandling>, EnvError> {
        let Some((name, value)) = self.raw(ASYNC_ERROR_HANDLING) else { return Ok(None) };
        let level = self.u64(ASYNC_ERROR_HANDLING)?;
        match level.and_then(|l| u8::try_from(l).ok()).and_then(ErrorHandling::from_level) {
            Some(h) => Ok(Some(h)),
            None => Err(EnvError::invalid(
                name,
                value,
                "expected 0 (no handling), 1 (tear down), 2 (clean up only) or 3 (skip clean up)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, &str)]) -> Env<impl Fn(&str) -> Option<String>> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|&(n, v)| (n.to_owned(), v.to_owned())).collect();
        Env::new(move |name: &str| pairs.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn the_secret_comes_from_the_variable_or_else_its_file_and_an_error_never_shows_it() {
        let dir = std::env::temp_dir().join(format!("cohort-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from the file\n").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(table(&[]).auth_secret(), Ok(None));
        assert_eq!(table(&[("COHORT_AUTH_TOKEN_FILE", path)]).auth_secret(), Ok(AuthSecret::new("from the file")));
        assert_eq!(
            table(&[("COHORT_AUTH_TOKEN", "s3cret"), ("COHORT_AUTH_TOKEN_FILE", path)]).auth_secret(),
            Ok(AuthSecret::new("s3cret")),
            "the variable wins"
        );
        std::fs::write(&file, "\n").unwrap();
        let e = table(&[("COHORT_AUTH_TOKEN_FILE", path)]).auth_secret().unwrap_err().to_string();
        assert!(e.contains("COHORT_AUTH_TOKEN_FILE") && e.contains("the file is empty"), "{e}");
        let missing = dir.join("missing");
        let e = table(&[("COHORT_AUTH_TOKEN_FILE", missing.to_str().unwrap())]).auth_secret().unwrap_err();
        assert!(e.to_string().contains("COHORT_AUTH_TOKEN_FILE"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unset_and_empty_variables_read_as_none() {
        let env = table(&[("COHORT_TIMEOUT_MS", "")]);
        assert_eq!(env.u64(TIMEOUT_MS), Ok(None));
        assert_eq!(env.flag(LAZY_INIT), Ok(None));
        assert_eq!(env.path(DUMP_ON_FAILURE), None);
        assert!(!env.is_set(TIMEOUT_MS));
    }

    #[test]
    fn numbers_parse_with_spaces_and_refuse_anything_else_by_name() {
        let env = table(&[("COHORT_IO_THREADS", " 3 "), ("COHORT_BUFFER_POOL_MB", "-1"), ("RANK", "4294967296")]);
        assert_eq!(env.u64(IO_THREADS), Ok(Some(3)));
        assert_eq!(
            env.u64(BUFFER_POOL_MB).unwrap_err().to_string(),
            "environment variable COHORT_BUFFER_POOL_MB=\"-1\" is invalid: invalid digit found in string"
        );
        assert_eq!(env.u32(IO_THREADS), Ok(Some(3)));
        let e = env.u32(RANK).unwrap_err();
        assert_eq!(e.name(), "RANK");
        assert!(e.to_string().contains("too large"), "{e}");
    }

    #[test]
    fn a_rank_must_be_set_and_a_number() {
        assert_eq!(table(&[("RANK", "2")]).rank(RANK), Ok(2));
        assert_eq!(table(&[]).rank(RANK).unwrap_err().to_string(), "environment variable RANK is not set");
        assert_eq!(
            table(&[("WORLD_SIZE", "two")]).rank(WORLD_SIZE).unwrap_err().to_string(),
            "environment variable WORLD_SIZE=\"two\" is invalid: invalid digit found in string"
        );
    }

    #[test]
    fn flags_take_the_usual_spellings_and_refuse_others_by_name() {
        for (v, want) in [("1", true), ("TRUE", true), ("yes", true), ("On", true), ("0", false), ("false", false)] {
            assert_eq!(table(&[("COHORT_LAZY_INIT", v)]).flag(LAZY_INIT), Ok(Some(want)), "{v}");
        }
        assert_eq!(
            table(&[("TORCH_GLOO_LAZY_INIT", "maybe")]).flag(LAZY_INIT).unwrap_err().to_string(),
            "environment variable TORCH_GLOO_LAZY_INIT=\"maybe\" is invalid: expected 1 or 0"
        );
    }

    #[test]
    fn durations_are_in_the_unit_of_their_name() {
        let env = table(&[
            ("COHORT_TIMEOUT_MS", "1500"),
            ("COHORT_BUSY_POLL_US", "7"),
            ("COHORT_HEARTBEAT_TIMEOUT_SEC", "2"),
            ("COHORT_INIT_TIMEOUT_MS", "1.5"),
        ]);
        assert_eq!(env.millis(TIMEOUT_MS), Ok(Some(Duration::from_millis(1500))));
        assert_eq!(env.micros(BUSY_POLL_US), Ok(Some(Duration::from_micros(7))));
        assert_eq!(env.secs(HEARTBEAT_TIMEOUT_SEC), Ok(Some(Duration::from_secs(2))));
        assert_eq!(env.millis(INIT_TIMEOUT_MS).unwrap_err().name(), "COHORT_INIT_TIMEOUT_MS");
    }

    #[test]
    fn error_handling_is_a_level_from_0_to_3() {
        assert_eq!(
            table(&[("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")]).error_handling(),
            Ok(ErrorHandling::from_level(0))
        );
        assert_eq!(
            table(&[("COHORT_ASYNC_ERROR_HANDLING", "4")]).error_handling().unwrap_err().to_string(),
            "environment variable COHORT_ASYNC_ERROR_HANDLING=\"4\" is invalid: \
             expected 0 (no handling), 1 (tear down), 2 (clean up only) or 3 (skip clean up)"
        );
    }

    #[test]
    fn paths_and_strings_are_read_as_they_are() {
        let env = table(&[("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/fr_"), ("MASTER_ADDR", " host ")]);
        assert_eq!(env.path(DUMP_ON_FAILURE), Some(PathBuf::from("/tmp/fr_")));
        assert_eq!(env.required_string(MASTER_ADDR), Ok(" host ".to_owned()));
        assert_eq!(env.required_string(MASTER_PORT), Err(EnvError::Missing { name: "MASTER_PORT" }));
    }

    #[test]
    fn cohorts_name_wins_over_the_torch_alias_and_the_error_names_what_was_read() {
        let env = table(&[("COHORT_ASYNC_ERROR_HANDLING", "1"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "x")]);
        assert_eq!(env.u64(ASYNC_ERROR_HANDLING), Ok(Some(1)));
        let env = table(&[("TORCH_NCCL_ASYNC_ERROR_HANDLING", "x")]);
        assert_eq!(env.u64(ASYNC_ERROR_HANDLING).unwrap_err().name(), "TORCH_NCCL_ASYNC_ERROR_HANDLING");
    }
}
