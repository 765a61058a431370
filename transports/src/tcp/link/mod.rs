//! One connection to one peer: a reader task that decodes frames and a writer task that sends
//! them. Both report to the group's driver through channels; neither makes a decision.
//!
//! The pieces, one concern per file:
//! - [`pool`]: the buffer pool, large frame buffers reused by readers and senders;
//! - [`outbound`]: a frame to send, and the hook told once it is written;
//! - [`lane`](mod@lane): a connection's send queue, the gate that lets senders write to the socket
//!   themselves, and the choice of connection for a frame;
//! - [`cork`]: frames held back so that a burst of small works goes out in one write;
//! - [`writer`]: the writer task;
//! - [`inbound`]: what a connection hands the driver, and the close of a peer's connections;
//! - [`reader`]: the frame assembler and the reader task.
//!
//! The tuning constants they use are in [`super::tunables`].

mod cork;
mod inbound;
mod lane;
mod outbound;
mod pool;
mod reader;
#[cfg(test)]
mod test_util;
mod writer;

pub(crate) use cork::Corks;
pub(crate) use inbound::{CloseTally, Inbound, Tallies};
pub(crate) use lane::{Gate, LaneRx, LaneTx, Lanes, SendMode, Sent, Wire, lane};
pub(crate) use outbound::{OnWritten, Outbound, Written};
pub(crate) use pool::BufferPool;
pub(crate) use reader::{Assembler, run_reader};
pub(crate) use writer::run_writer;
