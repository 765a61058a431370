//! # cohort-transports
//!
//! The runtime that drives `cohort-core` over real sockets and devices: the `ProcessGroup` and
//! `Work` API, the TCPStore-compatible store, the TCP backend and (feature `nccl`) the NCCL
//! backend. The README is the manual; `docs/` holds the design.
//!
//! | module | what it owns |
//! |---|---|
//! | [`ddp`] | DDP communication: `broadcast_coalesced`, `GradBucket`, comm hooks, the bucketed `Reducer` |
//! | [`env`] | [`Env`]: the one reader of environment variables, and [`EnvError`] |
//! | [`net`] | [`Net`]: listen and connect, over tokio ([`TokioNet`]) or a simulator |
//! | [`tcp`] | [`ProcessGroup`] over a full mesh of TCP connections (the Gloo of cohort) |
//! | [`work`] | [`Work`]: the handle every collective returns (wait, wait_timeout, await, abort, hooks) |
//! | [`store`] | [`Store`], [`MemoryStore`], [`PrefixStore`], the [`TcpStore`] client and the [`TcpStoreServer`] |

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod ddp;
pub mod env;
pub mod nccl;
pub mod net;
pub mod store;
pub mod tcp;
pub mod work;

pub use env::{Env, EnvError};
pub use net::{Listener, Net, TokioListener, TokioNet};
pub use store::{
    MemoryStore, PrefixStore, Store, StoreError, StoreFuture, StoreServerError, TcpStore, TcpStoreConfig,
    TcpStoreServer, TcpStoreServerConfig,
};
pub use tcp::{InitError, ProcessGroup, TcpOptions};
pub use work::{Work, WorkError, WorkInfo};
