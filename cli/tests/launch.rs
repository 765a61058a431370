//! `cohort launch` end to end, as a user runs it.

use std::process::{Command, Output};

fn cohort(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort")).args(args).output().expect("run cohort")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn launch_sets_torchrun_environment_and_prefixes_lines() {
    let out = cohort(&[
        "launch",
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lws=$LOCAL_WORLD_SIZE addr=$MASTER_ADDR port=$MASTER_PORT",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for r in 0..3 {
        let line = stdout.lines().find(|l| l.starts_with(&format!("[rank {r}] "))).expect(&stdout);
        assert!(line.contains(&format!("rank={r} local={r} world=3 lws=3 addr=127.0.0.1 port=")), "{line}");
        let port: u16 = line.rsplit("port=").next().unwrap().parse().expect(line);
        assert!(port > 0);
    }
    assert!(text(&out.stderr).contains("code 0"));
}

#[test]
fn a_failing_rank_stops_the_others_and_the_table_says_how_each_ended() {
    let out = cohort(&[
        "launch",
        "-n",
        "3",
        "--grace",
        "0.5",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then exit 7; fi; exec sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(7));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("rank 1 exited with code 7; stopping the other ranks"), "{stderr}");
    assert!(stderr.contains("signal 15 (SIGTERM)"), "{stderr}");
}

#[test]
fn multi_node_flags_set_global_ranks() {
    let out = cohort(&[
        "launch",
        "-n",
        "2",
        "--nnodes",
        "3",
        "--node-rank",
        "2",
        "--master-port",
        "29999",
        "--no-prefix",
        "--",
        "sh",
        "-c",
        "echo $RANK/$WORLD_SIZE/$GROUP_RANK",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut lines: Vec<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    lines.sort();
    assert_eq!(lines, vec!["4/6/2", "5/6/2"]);
}

#[test]
fn bad_flags_get_a_one_line_error_naming_the_flag() {
    let out = cohort(&["launch", "-n", "0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("'--nproc-per-node <N>'"), "{}", text(&out.stderr));
    let out = cohort(&["launch", "-n", "2", "--nnodes", "2", "--", "true"]);
    assert_eq!(text(&out.stderr).trim(), "cohort: error: --master-port is required with --nnodes > 1");
    let out = cohort(&["launch", "-n", "1", "--", "/nonexistent/program"]);
    assert!(text(&out.stderr).contains("cannot start \"/nonexistent/program\" for rank 0"), "{}", text(&out.stderr));
}

#[test]
fn launch_hosts_the_store_for_cohort_ranks() {
    // `cohort bench` under launch runs as the launched ranks, which find the launcher's store.
    let out =
        cohort(&["launch", "-n", "2", "--", env!("CARGO_BIN_EXE_cohort"), "bench", "-b", "1K", "-e", "1K", "-n", "2"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[rank 0] # Out of bounds values : 0 OK"), "{stdout}");
    // The port is the launcher's: a second launch on it is refused with the flag named.
    let holder = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = holder.local_addr().unwrap().port().to_string();
    let out = cohort(&["launch", "-n", "1", "--master-port", &port, "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&format!("--master-port {port}: cannot host the store")), "{stderr}");
}

/// torch's ranks under `cohort launch` use the launcher's store (TORCHELASTIC_USE_AGENT_STORE),
/// when a python with torch is at hand (COHORT_TORCH_PYTHON, else python3).
#[test]
fn launch_hosts_the_store_for_torch_ranks() {
    let python = std::env::var("COHORT_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_torch = std::process::Command::new(&python)
        .args(["-c", "import torch.distributed"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        eprintln!("skipped: no torch in {python} (set COHORT_TORCH_PYTHON to a python with torch)");
        return;
    }
    let script = "import torch, torch.distributed as dist\n\
        dist.init_process_group('gloo')\n\
        t = torch.ones(4) * (dist.get_rank() + 1)\n\
        dist.all_reduce(t)\n\
        print('sum', int(t[0].item()))\n\
        dist.destroy_process_group()\n";
    let out = cohort(&["launch", "-n", "2", "--", &python, "-c", script]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[rank 0] sum 3") && stdout.contains("[rank 1] sum 3"), "{stdout}");
}
