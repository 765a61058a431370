#!/usr/bin/env python3
"""Side-by-side figures for cohort's TCP data plane against its anchors, run alternately.

Each repetition runs, one after another: cohort (`cohort bench`), OpenMPI over TCP (the anchor
program built from MPI_SRC with mpicc, run with `--mca pml ob1 --mca btl tcp,self`), torch's gloo
(TORCH_BENCH under TORCH_PYTHON) and iperf3 over loopback. An anchor that is not installed is
skipped and named. Medians over the repetitions are printed as a Markdown table; every raw
figure goes to --raw as JSON.

    scripts/side_by_side.py --reps 5 --ranks 2 --cohort target/release/cohort \\
        --mpi-src ../shared/bench/mpi_allreduce.c \\
        --torch-bench ../shared/bench/torch_gloo_bench.py --torch-python /path/venv/bin/python

Rows: float32 SUM allreduce at 4 B, 1 MiB and 64 MiB (µs; busbw GB/s), barrier, and the work
lifecycle (a zero-element allreduce, synchronous and with 16 in flight).
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=600, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def cohort(exe, ranks):
    """cohort bench rows: name -> (time_us, busbw)."""
    res = {}

    def bench(name, args):
        for line in run([exe, "bench", "--ranks", str(ranks), "-c", "0", "--json", *args]).splitlines():
            o = json.loads(line)
            res[name] = (o["time_us"], o["busbw"])

    bench("allreduce 4 B", ["-b", "4", "-e", "4", "-n", "2000", "-w", "200"])
    bench("allreduce 1 MiB", ["-b", "1M", "-e", "1M", "-n", "50", "-w", "5"])
    bench("allreduce 64 MiB", ["-b", "64M", "-e", "64M", "-n", "5", "-w", "1"])
    bench("barrier", ["-o", "barrier", "-n", "2000", "-w", "200"])
    bench("0 elements, sync", ["-b", "0", "-e", "0", "-n", "2000", "-w", "200"])
    bench("0 elements, 16 in flight", ["-b", "0", "-e", "0", "-n", "500", "-w", "20", "--inflight", "16"])
    return res


ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")
SIZES = {4: "allreduce 4 B", 1 << 20: "allreduce 1 MiB", 64 << 20: "allreduce 64 MiB"}


def mpi(exe, ranks):
    res = {}
    base = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1",
            "--mca", "btl", "tcp,self", "-np", str(ranks), exe]
    for size, iters, warm in ((4, 2000, 200), (1 << 20, 50, 5), (64 << 20, 5, 1)):
        for line in run(base + [str(size), str(size), str(iters), str(warm)]).splitlines():
            m = ROW.match(line)
            if m and int(m.group(1)) == size:
                res[SIZES[size]] = (float(m.group(3)), float(m.group(5)))
    return res


def torch(python, script, ranks):
    res = {}
    out = run([python, script, str(ranks), str(free_port()), "5", "1"], timeout=900)
    for line in out.splitlines():
        m = re.match(r"latency numel=(\d) (\w+)\s*:\s*([\d.]+) us/op", line)
        if m:
            numel, mode, us = int(m.group(1)), m.group(2), float(m.group(3))
            if numel == 1 and mode == "sync":
                res["allreduce 4 B"] = (us, 0.0)
            if numel == 0 and mode == "sync":
                res["0 elements, sync"] = (us, 0.0)
            if numel == 0 and mode == "async_batch":
                res["0 elements, 16 in flight"] = (us, 0.0)
        m = re.match(r"barrier:\s*([\d.]+) us/op", line)
        if m:
            res["barrier"] = (float(m.group(1)), 0.0)
        m = ROW.match(line)
        if m and int(m.group(1)) in SIZES:
            res[SIZES[int(m.group(1))]] = (float(m.group(3)), float(m.group(5)))
    return res


def iperf():
    port = free_port()
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            try:
                out = run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "3", "-J"], timeout=30)
                bps = json.loads(out)["end"]["sum_received"]["bits_per_second"]
                return {"loopback TCP (iperf3, one stream)": (0.0, bps / 8e9)}
            except (RuntimeError, KeyError, ValueError):
                # Not listening yet (iperf3 then answers with an error in its JSON).
                import time
                time.sleep(0.1)
        raise RuntimeError("iperf3 server did not answer")
    finally:
        server.kill()
        server.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cohort", default="target/release/cohort")
    ap.add_argument("--mpi-src", default="../shared/bench/mpi_allreduce.c")
    ap.add_argument("--torch-bench", default="../shared/bench/torch_gloo_bench.py")
    ap.add_argument("--torch-python", default=os.environ.get("COHORT_TORCH_PYTHON"))
    ap.add_argument("--raw", default=None, help="write every figure here (JSON)")
    a = ap.parse_args()

    runners = {"cohort": lambda: cohort(a.cohort, a.ranks)}
    skipped = []
    if shutil.which("mpicc") and shutil.which("mpirun") and os.path.exists(a.mpi_src):
        exe = os.path.join(tempfile.mkdtemp(), "mpi_allreduce")
        run(["mpicc", "-O2", "-o", exe, a.mpi_src, "-lm"])
        runners["OpenMPI TCP"] = lambda: mpi(exe, a.ranks)
    else:
        skipped.append("OpenMPI (mpicc/mpirun or the anchor source missing)")
    if a.torch_python and os.path.exists(a.torch_bench):
        runners["torch gloo"] = lambda: torch(a.torch_python, a.torch_bench, a.ranks)
    else:
        skipped.append("torch gloo (give --torch-python or COHORT_TORCH_PYTHON)")
    if shutil.which("iperf3"):
        runners["iperf3"] = iperf
    else:
        skipped.append("iperf3 (not installed)")

    raw = {name: [] for name in runners}
    for rep in range(a.reps):
        for name, fn in runners.items():
            try:
                raw[name].append(fn())
                print(f"rep {rep + 1}/{a.reps}: {name} done", file=sys.stderr)
            except RuntimeError as e:
                if name == "cohort":
                    raise
                # An anchor that fails once leaves a gap in its column, not a lost run.
                print(f"rep {rep + 1}/{a.reps}: {name} failed, left out: {e}", file=sys.stderr)
    if a.raw:
        with open(a.raw, "w") as f:
            json.dump(raw, f, indent=1)

    rows = ["allreduce 4 B", "allreduce 1 MiB", "allreduce 64 MiB", "barrier", "0 elements, sync",
            "0 elements, 16 in flight"]
    cols = [n for n in runners if n != "iperf3"]
    print(f"\n{a.ranks} ranks, {a.reps} alternating repetitions, medians: µs per op (busbw GB/s)\n")
    print("| | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for row in rows:
        cells = []
        for name in cols:
            vals = [r[row] for r in raw[name] if row in r]
            if not vals:
                cells.append("-")
                continue
            t = statistics.median(v[0] for v in vals)
            bw = statistics.median(v[1] for v in vals)
            cells.append(f"{t:.1f} ({bw:.3f})" if "MiB" in row else f"{t:.1f}")
        print(f"| {row} | " + " | ".join(cells) + " |")
    if raw.get("iperf3"):
        bws = [r["loopback TCP (iperf3, one stream)"][1] for r in raw["iperf3"]]
        print(f"\nloopback TCP, iperf3 one stream, same run: {statistics.median(bws):.2f} GB/s (median)")
    for s in skipped:
        print(f"skipped: {s}")


if __name__ == "__main__":
    main()
