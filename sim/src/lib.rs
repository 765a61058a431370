//! # cohort-sim
//!
//! The deterministic fault-injection simulator: N rank hosts and a store host in one turmoil
//! world, every rank running the **production** TCP backend (`cohort-transports`) over
//! turmoil's simulated network ([`TurmoilNet`]), under a [`FaultPlan`]: crashes, hangs,
//! partitions, held links, latency, slow ranks, desyncs, a store crash. A run gives a
//! [`Report`]: per rank, every collective's outcome with simulated times, its flight-recorder
//! dump, and the cross-rank [diagnosis](cohort_core::analyze) naming the culprit. The same
//! seed gives the same report, byte for byte.
//!
//! ```
//! use cohort_sim::{FaultPlan, Script, Simulation};
//!
//! let report = Simulation::new(4)
//!     .seed(42)
//!     .script("allreduce:256,allgather:16,barrier".parse::<Script>().unwrap())
//!     .faults("hang 1 @collective 1".parse::<FaultPlan>().unwrap())
//!     .run()
//!     .unwrap();
//! assert_eq!(report.blamed(), vec![1]);
//! println!("{report}");
//! ```
//!
//! | module | what it owns |
//! |---|---|
//! | [`net`] | [`TurmoilNet`]: the transports' `Net` over turmoil |
//! | [`plan`] | [`FaultPlan`], [`Fault`], their text syntax, random plans from a seed |
//! | [`workload`] | [`Script`]s of collectives with checked results |
//! | [`run`] | [`Simulation`] (the builder), the controller, the [`Report`] |

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod net;
pub mod plan;
pub mod run;
pub mod workload;

pub use net::TurmoilNet;
pub use plan::{Change, DeviceFault, Fault, FaultPlan, PlanError, SLOW_KERNEL_MS, Trigger};
pub use run::{
    Backend, Fate, Outcome, RankError, RankFn, RankReport, Report, SetupError, Simulation, WorkEvent, WorkOutcome,
    Workload,
};
pub use workload::{Script, ScriptError, ScriptOp, Step};
