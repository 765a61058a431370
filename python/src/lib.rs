//! # cohort-torch
//!
//! The native half of the Python package `cohort_torch`, which registers cohort's TCP backend
//! as the `torch.distributed` backend `"cohort"` for CPU tensors. This crate is the extension
//! module `cohort_torch._cohort`; the Python half (`python/cohort_torch/__init__.py`) is the
//! `torch.distributed.Backend` subclass that torch calls, and maps torch's arguments onto it.
//!
//! Build it with maturin (`pip install ./python`), which turns on PyO3's extension-module
//! linking; a plain `cargo build` links against libpython, and the crate has no Rust tests
//! (its tests are pytest, in `python/tests/`).
//!
//! ## What lives here, and what does not
//!
//! - `Group`: one cohort [`ProcessGroup`](cohort_transports::ProcessGroup) with its own
//!   tokio runtime. Every collective of the Rust API is a method taking tensors as
//!   `(data_ptr, nbytes, dtype, shape)` descriptors; inputs are copied when the call is made
//!   (with the GIL released), outputs are written by the runtime when the work ends.
//! - `PendingWork`: `wait()` (GIL released), `is_completed()`, `exception()`,
//!   `source_rank()`, and `on_done(callback)`, which the Python layer uses to complete torch's
//!   future from a runtime thread.
//! - The store: the creator torch calls receives a Python store object (a `PrefixStore` over
//!   the job's `TCPStore`, or whatever store the user passed). `PyStore` (`src/store.rs`) implements
//!   cohort's [`Store`](cohort_transports::Store) by calling that object's methods from tokio's
//!   blocking pool, so every store torch supports works (TCPStore, FileStore, HashStore) and
//!   keys land under the prefix torch chose for the group. This was chosen over dialling the
//!   TCPStore's address with cohort's own client, which would only cover the TCPStore case and
//!   would have to guess the prefix. Store traffic after init is small: rendezvous, the
//!   failure record, and one `check` per heartbeat interval while the group is healthy.
//!
//! Collectives, their lifecycle, timeouts and errors stay in Rust. Errors are raised as
//! [`CohortError`] (a `RuntimeError`) with cohort's text: this rank, the op, its seq and the
//! rank to blame.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod group;
mod store;

use pyo3::prelude::*;

pyo3::create_exception!(
    _cohort,
    CohortError,
    pyo3::exceptions::PyRuntimeError,
    "A cohort collective, or the group, failed; the message names this rank, the op, its seq and the culprit rank."
);

/// The extension module `cohort_torch._cohort`.
#[pymodule]
fn _cohort(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<group::Group>()?;
    m.add_class::<group::PendingWork>()?;
    m.add("CohortError", m.py().get_type::<CohortError>())?;
    // The tests' build (scripts/python-tests.sh) is cargo's dev profile: benchmarks refuse it.
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    Ok(())
}
