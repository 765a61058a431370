#!/usr/bin/env python3
"""The simulator at scale: wall time, peak memory and cost per rank-collective, by world size.

Runs `cohort sim` once per world size (and fault), each under `/usr/bin/time`, and prints a
Markdown table. It is a benchmark, not a test: it asserts only that each run names the faulty
rank (its diagnosis line `culprit rank(s): [R]`), and prints the figures for the reader to
compare, as ratios against a run of the same command at another size on the same machine.

    scripts/sim_scale.py --cohort target/release/cohort --ranks 64,256,1024 \\
        --faults hang:17@seq3,crash:17@seq3,desync-size:17@seq3

Every run: `--seed 1 --lazy-connect --ranks-per-host P` (P from --per-host, default 32) and the
default script, or --script. A rank-collective is one rank running one collective of the script,
so the cost per rank-collective is the wall time over ranks × collectives; the per-rank memory
is the peak RSS over ranks.
"""

import argparse
import re
import subprocess
import sys
import tempfile

DEFAULT_SCRIPT = "allreduce:4096,allreduce:4096,allgather:256,broadcast:1024,barrier"


def run(cohort: str, ranks: int, fault: str, per_host: int, script: str) -> dict:
    with tempfile.NamedTemporaryFile("r") as timing:
        cmd = ["/usr/bin/time", "-o", timing.name, "-f", "%e %M", cohort, "sim", "--ranks", str(ranks),
               "--seed", "1", "--lazy-connect", "--ranks-per-host", str(per_host), "--script", script]
        if fault:
            cmd += ["--fault", fault]
        out = subprocess.run(cmd, capture_output=True, text=True)
        wall, rss_kb = timing.read().split()[-2:]
    named = re.findall(r"culprit rank\(s\): \[([0-9, -]+)\]", out.stdout)
    return {"wall_s": float(wall), "rss_mb": int(rss_kb) / 1024, "culprits": named, "rc": out.returncode,
            "stdout": out.stdout, "stderr": out.stderr}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cohort", default="target/release/cohort")
    ap.add_argument("--ranks", default="64,128,256,512,1024")
    ap.add_argument("--faults", default="hang:17@seq3", help="comma-separated; each runs at every size")
    ap.add_argument("--per-host", type=int, default=32)
    ap.add_argument("--script", default=DEFAULT_SCRIPT)
    args = ap.parse_args()
    collectives = len(args.script.split(","))
    rows = []
    ok = True
    for fault in args.faults.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            r = run(args.cohort, ranks, fault, args.per_host, args.script)
            faulty = re.search(r":(\d+)@", fault)
            want = faulty.group(1) if faulty else None
            named = want is None or any(c.strip() == want for c in r["culprits"])
            if not named:
                ok = False
                print(f"{ranks} ranks, {fault}: the diagnosis does not name rank {want}:\n{r['stdout'][-2000:]}"
                      f"{r['stderr'][-2000:]}", file=sys.stderr)
            per = r["wall_s"] / (ranks * collectives) * 1e3
            rows.append((ranks, fault, r["wall_s"], r["rss_mb"], r["rss_mb"] / ranks, per, named))
            print(f"# {ranks} ranks, {fault}: {r['wall_s']:.2f} s, {r['rss_mb']:.0f} MB", file=sys.stderr)
    print(f"script `{args.script}`, --seed 1 --lazy-connect --ranks-per-host {args.per_host}\n")
    print("| ranks | fault | wall | peak RSS | RSS per rank | wall per rank-collective | names the rank |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for ranks, fault, wall, rss, rss_rank, per, named in rows:
        print(f"| {ranks} | {fault} | {wall:.2f} s | {rss:.0f} MB | {rss_rank:.2f} MB | {per:.2f} ms | "
              f"{'yes' if named else 'NO'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
