//! Cross-crate scenarios for cohort live in `tests/tests/`; this library holds what they share,
//! and `src/bin/rank.rs` is the rank process the multi-process tests start.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod collectives;
