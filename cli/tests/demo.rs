//! `cohort demo` end to end, as a newcomer runs it.

use std::process::Command;

#[test]
fn the_demo_catches_the_hung_rank_and_names_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort")).arg("demo").output().expect("cohort runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("step  8/8"), "{stdout}");
    assert!(stdout.contains("rank(s) [2] never joined it"), "{stdout}");
    assert!(stdout.contains("watchdog caught collective operation timeout"), "{stdout}");
    assert!(stdout.contains("demo OK"), "{stdout}");
    // The files it points at exist and parse.
    let timeline = stdout.lines().find_map(|l| l.trim().strip_prefix("timeline:")).expect("timeline line");
    let path = timeline.split_whitespace().next().expect("a path");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("trace written")).unwrap();
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    assert!(events.iter().any(|e| e["name"].as_str().is_some_and(|n| n.contains("all_reduce"))));
    let dir = std::path::Path::new(path).parent().unwrap();
    for rank in 0..4 {
        assert!(dir.join(format!("rank_{rank}.json")).exists(), "rank {rank}'s dump");
    }
    std::fs::remove_dir_all(dir).ok();
}
