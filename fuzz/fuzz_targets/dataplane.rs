//! The core `DataPlane` fed arbitrary histories of submits, launches, arriving frames, queued
//! and written frames, finished data and closed connections, each checked against the
//! reference model (`cohort_core::dataplane::model`): no panic, works complete once and only
//! with their data done and every frame written, the send window holds, every frame is fed,
//! held or given back exactly once, and a goodbye waits for the frames queued to its peer.
#![no_main]

use cohort_core::dataplane::model::{Op, check};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&window, ops)) = data.split_first() else { return };
    let ops = Op::decode(ops);
    if let Err(violation) = check(&ops, usize::from(window % 8) + 1) {
        panic!("{violation}");
    }
});
