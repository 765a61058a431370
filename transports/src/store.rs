//! The store: a small key-value service every rank shares, wire-compatible with PyTorch's
//! `torch.distributed.TCPStore`.
//!
//! - [`Store`]: the async interface (set, get, add, compare_set, wait, check, delete_key,
//!   num_keys, append, multi_get, multi_set), object-safe so groups can hold an
//!   `Arc<dyn Store>`.
//! - [`MemoryStore`]: in-process, for tests and single-process groups.
//! - [`PrefixStore`]: namespaces another store's keys as `prefix/key`, like PyTorch's.
//! - [`TcpStore`]: the client, and [`TcpStoreServer`]: the server (embedded in rank 0 by just
//!   binding it, or standalone from the CLI). Either side interoperates with PyTorch's.
//!
//! The protocol and the server's logic are pure and live in `cohort_core::store`; this module
//! moves their bytes over a [`Net`](crate::net::Net).

mod client;
mod memory;
mod prefix;
mod server;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::time::Duration;

use cohort_core::store::{DecodeError, StateError};

pub use client::{TcpStore, TcpStoreConfig};
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use server::{StoreServerError, TcpStoreServer, TcpStoreServerConfig};

/// A store connection's read buffer (client or server side). It starts at 4 KiB, since most
/// store messages are a few bytes and a server holds one connection per rank (64 KiB each was
/// 268 MB for a 4,096-rank job), and doubles, up to 64 KiB, whenever a read fills it.
struct ReadBuf(Box<[u8]>);

impl ReadBuf {
    const MIN: usize = 4 << 10;
    const MAX: usize = 64 << 10;

    fn new() -> Self {
        ReadBuf(vec![0; Self::MIN].into())
    }

    /// Where the next read goes.
    fn space(&mut self) -> &mut [u8] {
        &mut self.0
    }

    /// The `n` bytes the last read gave.
    fn filled(&self, n: usize) -> &[u8] {
        &self.0[..n]
    }

    /// The last read's `n` bytes were used: grow if they filled the buffer.
    fn used(&mut self, n: usize) {
        if n == self.0.len() && n < Self::MAX {
            self.0 = vec![0; n * 2].into();
        }
    }
}

/// PyTorch's default store timeout (`Store::kDefaultTimeout`): 300 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The future every [`Store`] method returns.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A key-value store shared by the ranks of a job, with PyTorch's `c10d::Store` semantics.
///
/// Keys are strings, values bytes. `get` and `multi_get` first wait (up to [`Store::timeout`])
/// for their keys to exist, as PyTorch's stores do.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Stores `value` under `key`, replacing any value.
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()>;

    /// The value under `key`, waiting up to [`Store::timeout`] for it to be set.
    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<u8>>;

    /// Adds `delta` to the integer under `key` (0 when missing) and returns the result; the
    /// value is stored as a decimal string.
    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64>;

    /// Stores `desired` if the value under `key` equals `expected` (an empty `expected` matches
    /// a missing key) and returns the value now stored; for a missing key and a non-empty
    /// `expected` it stores nothing and returns `expected`, as PyTorch does.
    fn compare_set<'a>(&'a self, key: &'a str, expected: &'a [u8], desired: &'a [u8]) -> StoreFuture<'a, Vec<u8>>;

    /// Waits until every key exists, or fails with [`StoreError::Timeout`] after `timeout`.
    fn wait<'a>(&'a self, keys: &'a [&'a str], timeout: Duration) -> StoreFuture<'a, ()>;

    /// Whether every key exists now.
    fn check<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, bool>;

    /// Deletes `key`; returns whether it existed.
    fn delete_key<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool>;

    /// How many keys the whole store holds (a prefix store counts its inner store's keys, as
    /// PyTorch's does).
    fn num_keys(&self) -> StoreFuture<'_, u64>;

    /// Appends `value` to the bytes under `key`, creating it when missing.
    fn append<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()>;

    /// The values of `keys`, in order, waiting up to [`Store::timeout`] for all of them.
    fn multi_get<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, Vec<Vec<u8>>>;

    /// Stores each `(key, value)` pair, in order.
    fn multi_set<'a>(&'a self, items: &'a [(&'a str, &'a [u8])]) -> StoreFuture<'a, ()>;

    /// The timeout `get` and `multi_get` wait for, and the default for `wait` callers.
    fn timeout(&self) -> Duration;
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// An earlier failure left the connection in an unknown state; the store must be
    /// reconnected.
    #[error("the store connection is unusable after an earlier failure: {0}")]
    Broken(String),
    /// The server closed the connection (PyTorch's server does so after a refused command,
    /// such as ADD on a value that is not an integer).
    #[error("the store server at {addr} closed the connection during {op}")]
    Closed {
        /// The call.
        op: &'static str,
        /// `host:port`.
        addr: String,
    },
    /// Authentication with the server failed: the two have different secrets, or only one
    /// has one. Not retried.
    #[error("store at {addr}: {reason}")]
    Auth {
        /// `host:port`.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The client could not connect and validate before its connect timeout.
    #[error("could not connect to the store at {addr} within {timeout:?} ({attempts} attempts): {last_error}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// The connect timeout.
        timeout: Duration,
        /// How many connections were tried.
        attempts: u32,
        /// What went wrong on the last try.
        last_error: String,
    },
    /// Reading from or writing to the server failed.
    #[error("store {op} failed: {source}")]
    Io {
        /// The call.
        op: &'static str,
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// The server's reply could not be decoded.
    #[error("the store server sent an invalid reply to {op}: {source}")]
    Protocol {
        /// The call.
        op: &'static str,
        /// Why it could not be decoded.
        #[source]
        source: DecodeError,
    },
    /// The store refused the command (an in-process store; a remote server closes the
    /// connection instead).
    #[error(transparent)]
    Refused(#[from] StateError),
    /// A call did not finish in time: a wait for keys, or a reply that did not come.
    #[error("store {op} timed out after {timeout:?} waiting for keys {keys:?}")]
    Timeout {
        /// The call (`"wait"`, `"get"`, …).
        op: &'static str,
        /// The keys it concerned, as the caller named them.
        keys: Vec<String>,
        /// The timeout that ran out.
        timeout: Duration,
    },
    /// The server's reply decoded, but is not what the call allows.
    #[error("the store server answered {op} with {got}, expected {expected}")]
    UnexpectedReply {
        /// The call.
        op: &'static str,
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: String,
    },
}

impl StoreError {
    /// Whether this is a [`StoreError::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, StoreError::Timeout { .. })
    }
}

impl From<StoreError> for io::Error {
    fn from(e: StoreError) -> Self {
        let kind = match &e {
            StoreError::Timeout { .. } => io::ErrorKind::TimedOut,
            StoreError::Connect { .. } => io::ErrorKind::ConnectionRefused,
            StoreError::Closed { .. } => io::ErrorKind::ConnectionAborted,
            StoreError::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

fn owned_keys(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}
