#!/usr/bin/env python3
"""Writes N flight-recorder dumps of one hung job, for measuring `cohort fr analyze` at scale.

    scripts/fr_dumps.py --ranks 4096 --entries 100 --hung 17 OUT_DIR
    /usr/bin/time -v target/release/cohort fr analyze OUT_DIR

Every rank but `--hung` completed `--entries` allreduces and waits in the next one; the hung rank
completed them and never started the next. The dumps follow cohort's schema (PyTorch's
flight-recorder JSON with cohort's extras), rank lists included, so each dump is as large as a
real one of that job.
"""
import argparse
import json
import os


def entry(seq: int, state: str, world: int) -> dict:
    t0 = 1_767_225_600_000_000_000 + seq * 1_000_000
    done = state == "completed"
    return {
        "record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": "tcp:all_reduce",
        "time_created_ns": t0, "input_sizes": [[4096]], "input_dtypes": ["Float"],
        "output_sizes": [[4096]], "output_dtypes": ["Float"], "state": state,
        "time_discovered_started_ns": t0 if state != "scheduled" else None,
        "time_discovered_completed_ns": t0 + 500_000 if done else None,
        "retired": done, "timeout_ms": 600_000, "is_p2p": False, "cohort_state": state,
        "cohort_time_finished_ns": t0 + 500_000 if done else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--entries", type=int, default=100)
    ap.add_argument("--hung", type=int, default=17)
    ap.add_argument("out")
    a = ap.parse_args()
    if not 0 <= a.hung < a.ranks:
        ap.error(f"--hung {a.hung} is not a rank of {a.ranks}")
    os.makedirs(a.out, exist_ok=True)
    ranks = "[" + ", ".join(map(str, range(a.ranks))) + "]"
    done = [entry(s, "completed", a.ranks) for s in range(1, a.entries + 1)]
    last = a.entries + 1
    for r in range(a.ranks):
        entries = done if r == a.hung else done + [entry(last, "started", a.ranks)]
        dump = {
            "version": "2.10", "comm_lib_version": "",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
            "pg_status": {"0": {
                "last_enqueued_collective": str(a.entries if r == a.hung else last),
                "last_started_collective": str(a.entries if r == a.hung else last),
                "last_completed_collective": str(a.entries),
            }},
            "entries": entries, "rank": r, "world_size": a.ranks, "reset_epoch": 0,
        }
        with open(os.path.join(a.out, f"rank_{r}.json"), "w") as f:
            json.dump(dump, f)


if __name__ == "__main__":
    main()
