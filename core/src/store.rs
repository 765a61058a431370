//! The store: PyTorch's TCPStore protocol and the server's key-value logic, sans IO.
//!
//! Two halves, both pure:
//!
//! - [`wire`]: the byte-level protocol of `torch.distributed.TCPStore`, wire-compatible with
//!   PyTorch's client (`TCPStore.cpp`) and both of its servers (`TCPStoreBackend.cpp`,
//!   `TCPStoreLibUvBackend.cpp`): request and reply encoders, and total, streaming, bounded
//!   decoders.
//! - [`state`]: [`StoreState`], the server's logic: the key-value map, counters, queues, and the
//!   clients waiting for keys, with every command's semantics as PyTorch's libuv server
//!   implements them.
//!
//! The async `Store` trait, the in-memory store, the prefix store and the TCP client and server
//! live in `cohort-transports`; they drive these types.

pub mod state;
pub mod wire;

pub use state::{ClientId, CloseReason, ServerOutput, StateError, StoreState, WaitStatus};
pub use wire::{
    CheckResponse, DecodeError, DecodeLimits, QueryType, Reply, ReplyDecoder, ReplyKind, Request, RequestDecoder,
    VALIDATION_MAGIC, WaitResponse, decode_reply, decode_request,
};
