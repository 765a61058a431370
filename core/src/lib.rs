//! # cohort-core
//!
//! The sans-IO core of cohort, PyTorch's c10d process-group runtime rebuilt in Rust: every
//! decision the runtime makes, as pure state machines.
//!
//! What it deliberately does **not** do: IO, threads, clock reads or unseeded randomness.
//! Time comes in as an argument (`now`), bytes come in through `handle_*` methods and go out
//! through `poll_*` methods, and the same inputs always give the same outputs. The drivers in
//! `cohort-transports` move bytes and time; the simulator in `cohort-sim` runs the same
//! drivers over a simulated network.
//!
//! | module | what it owns |
//! |---|---|
//! | [`tensor`] | [`DType`], [`Device`], [`Tensor`] |
//! | [`recorder`] | the flight recorder: a bounded ring of collectives, dumped in PyTorch's schema 2.10 |
//! | [`reduce`] | [`ReduceOp`] and its elementwise kernels |
//! | [`work`] | ids, [`OpType`], the work lifecycle and [`WorkResult`] |
//! | [`analyze`] | cross-rank diagnosis from every rank's flight-recorder dump: the first collective the ranks disagree on, and the culprit |
//! | [`group`] | [`GroupState`]: one rank's state in one group — sequence numbers, works in issue order, deadlines, peers, abort, error handling |
//! | [`protocol`] | the data-plane frame and the connection handshake (wire codecs) |
//! | [`schedule`] | every collective as a per-rank plan, the sans-IO executor that runs it, an in-memory harness |
//! | [`shm`] | the shared-memory segment of two ranks on one host: layout, offer, bounds-checked byte rings |
//! | [`store`] | PyTorch's TCPStore wire codec and [`StoreState`](store::StoreState), the store server's logic |
//! | [`watchdog`] | the timer table, the c10d-style timeout message, the driver-stall monitor |
//!
//! ## The drive loop
//!
//! A driver feeds one input, drains every output, and sleeps until the next deadline. Here the
//! "data plane" of a two-rank group is played by hand, and rank 1 never answers:
//!
//! ```
//! use std::time::{Duration, Instant};
//! use cohort_core::group::{Collective, Completion, Event, GroupConfig, GroupState, TensorSpec};
//! use cohort_core::{DType, OpType, Rank, WorkState};
//!
//! let mut cfg = GroupConfig::new(2);
//! cfg.timeout = Duration::from_secs(5);
//! cfg.heartbeat = None;
//! let t0 = Instant::now();
//! let mut g = GroupState::new(cfg, Rank(0), t0);
//!
//! // Input: the user submits two allreduces.
//! let spec = vec![TensorSpec::new(DType::F32, &[1024])];
//! let a = g.submit(t0, Collective::new(OpType::Allreduce).inputs(spec.clone())).unwrap();
//! let b = g.submit(t0, Collective::new(OpType::Allreduce).inputs(spec)).unwrap();
//!
//! // Outputs: the data plane may start both, in issue order.
//! while let Some(launch) = g.poll_launch() {
//!     g.handle_started(t0, launch.id);
//! }
//! // The first one completes; the second waits on rank 1, which never sends its part.
//! g.handle_completion(t0 + Duration::from_millis(3), a, Completion::Success);
//! g.handle_waiting_on(t0 + Duration::from_millis(3), b, &[Rank(1)]);
//!
//! // Sleep until the next deadline, then let the watchdog fire.
//! let deadline = g.poll_timeout().unwrap();
//! assert_eq!(deadline, t0 + Duration::from_secs(5));
//! g.handle_timeout(deadline);
//!
//! let mut ended = Vec::new();
//! while let Some(event) = g.poll_event() {
//!     if let Event::WorkFinished(w) = event {
//!         ended.push((w.id, w.lifecycle.state(), w.result.to_string()));
//!     }
//! }
//! assert_eq!(ended[0].1, WorkState::Completed);
//! assert_eq!(ended[1].1, WorkState::TimedOut);
//! assert!(ended[1].2.contains("still waiting for rank(s) [1]"));
//! ```

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod analyze;
pub mod census;
pub mod dataplane;
pub mod group;
pub mod p2p;
pub(crate) mod prefetch;
pub mod protocol;
pub mod recorder;
pub mod reduce;
pub mod schedule;
pub(crate) mod seqmap;
pub mod shm;
pub mod store;
pub mod tensor;
pub mod watchdog;
pub mod work;

pub use group::{Collective, ErrorHandling, GroupConfig, GroupState, SubmitError, TensorSpec};
pub use protocol::{
    Frame, FrameDecoder, FrameError, FrameHeader, FrameKind, FrameLimits, Handshake, HandshakeError,
    HandshakeExpectation, HandshakeReply, RejectReason,
};
pub use recorder::{
    Dump, DumpEntry, DumpError, DumpMeta, EntryState, FlightRecorder, NameId, PgConfig, PgStatus, ProfilingName,
    RecordId, RecordRequest, RecorderConfig, TensorMeta, TensorShape,
};
pub use reduce::{ReduceError, ReduceOp, Reduction};
pub use schedule::{Executor, Plan, ScheduleError};
pub use tensor::{DType, Device, Element, FlatSlot, Tensor, TensorError};
pub use work::{
    Blame, BlameError, GroupId, IllegalTransition, Lifecycle, OpType, Rank, SeqNo, WorkId, WorkResult, WorkState,
};
