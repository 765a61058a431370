//! Flight-recorder dumps (ours and PyTorch's JSON): loading arbitrary text never panics, a
//! loaded dump dumps again and loads back equal, and the diagnosis of any set of loaded dumps
//! never panics and its JSON loads back equal.
#![no_main]

use cohort_core::Rank;
use cohort_core::analyze::diagnose;
use cohort_core::recorder::Dump;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, &str)| {
    let (world, text) = input;
    let mut dumps = Vec::new();
    for (i, part) in text.split('\u{1e}').enumerate().take(8) {
        if let Ok(d) = Dump::from_json(part) {
            let again = Dump::from_json(&d.to_json()).expect("our own dump loads");
            assert_eq!(again, d);
            dumps.push((Rank(i as u32), d));
        }
    }
    let world = u32::from(world % 9);
    let diagnosis = diagnose(&dumps, (world > 0).then_some(world));
    let back: cohort_core::analyze::Diagnosis = serde_json::from_str(&diagnosis.to_json()).expect("our JSON loads");
    assert_eq!(back, diagnosis);
    let _ = diagnosis.to_string();
});
