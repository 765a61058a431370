//! The NCCL backend: [`NcclProcessGroup`], the same lifecycle as the TCP backend (core's
//! `GroupState`, `Work`, the watchdog, the flight recorder) over NCCL.
//!
//! The process group is written against a narrow seam ([`device`]): a [`Device`] (streams,
//! events, buffers, copies) and a [`Communicator`] (enqueue, group, async error, abort, split,
//! shrink, finalize). Two implementations sit under it:
//! - [`emu`]: a host emulation that follows CUDA's and NCCL's documented behaviour, computes
//!   real collectives across ranks (in one process, or across processes through a store) and
//!   injects faults. It is always built; the tests and the simulator run on it.
//! - `cuda` (feature `nccl`): cudarc's `sys` layer, loaded at run time. Without a GPU, or
//!   without `libnccl.so`, creating it is a clear error instead of a panic.

pub mod device;
pub mod emu;
mod group;

#[cfg(feature = "nccl")]
pub mod cuda;

#[cfg(test)]
pub(crate) mod conformance;

pub use device::{
    BufRef, CommConfig, CommOp, Communicator, Device, HostBuffer, NcclDataType, NcclError, NcclRedOp, NcclResult,
    nccl_dtype, nccl_op,
};
pub use group::{BACKEND_NAME, DeviceTensor, MonitorAction, NcclOptions, NcclProcessGroup, P2pOp};
