#!/usr/bin/env python3
"""Side-by-side figures for cohort's data plane against its anchors, run alternately.

Each repetition runs, one after another: every row of cohort (`cohort bench`), over shared memory
between the ranks (its default on one host: "cohort shm") and over TCP alone (`COHORT_SHM=0`:
"cohort TCP"), each followed by the
same row of OpenMPI over TCP and over shared memory (the anchor program built from MPI_SRC with
mpicc, run with `--mca pml ob1 --mca btl tcp,self`, then `--mca btl self,vader`) where it has
one, and, with 2 ranks, by a bare TCP exchange of
the row's bytes (scripts/tcp_exchange.c, built with cc: two processes each send and receive the
bytes at once, what a 2-rank allreduce moves, with no reduction: the floor under its time), so
that each group runs seconds apart; then
torch's gloo (TORCH_BENCH under TORCH_PYTHON, all its rows in one run) and iperf3 over loopback
(one stream; then two at once in opposite directions, the ceiling of a 2-rank allreduce's busbw,
which sends and receives at once).
An anchor that is not installed is skipped and named. Medians over the repetitions are printed as
a Markdown table, with the median of the per-repetition time ratios (the machine's speed drifts
between repetitions; a ratio of two runs taken close together drifts less); every raw figure
goes to --raw as JSON. Before and after each repetition's cohort and OpenMPI rows, a fixed Python
loop is timed on each CPU in turn: the last line gives each repetition's slowest CPU against the
fastest seen in the run, beside its shared-memory 4 B ratio, since a repetition run while the
host slows a CPU is not comparable with one run while it does not.

    scripts/side_by_side.py --reps 5 --ranks 2 --cohort target/release/cohort \\
        --mpi-src ../shared/bench/mpi_allreduce.c \\
        --torch-bench ../shared/bench/torch_gloo_bench.py --torch-python /path/venv/bin/python

Rows: float32 SUM allreduce at 4 B (steady, and the first 500 of a fresh group with no warm-up),
1 MiB and 64 MiB (µs; busbw GB/s), barrier, and the work
lifecycle (a zero-element allreduce, synchronous and with 16 in flight). The TCP exchange's busbw
is the one an allreduce taking its time would have.
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
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=600, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


COHORT_ROWS = {
    # At 1-2 µs an iteration, 2,000 iterations last a few milliseconds, and one preemption of
    # a millisecond moves their mean by half a microsecond: the steady row takes 20,000.
    "allreduce 4 B": ["-b", "4", "-e", "4", "-n", "20000", "-w", "1000"],
    # The first 500 of a fresh group, no warm-up: what a job with few small collectives sees.
    "allreduce 4 B, cold": ["-b", "4", "-e", "4", "-n", "500", "-w", "0"],
    "allreduce 1 MiB": ["-b", "1M", "-e", "1M", "-n", "200", "-w", "20"],
    "allreduce 64 MiB": ["-b", "64M", "-e", "64M", "-n", "10", "-w", "3"],
    "barrier": ["-o", "barrier", "-n", "2000", "-w", "200"],
    "0 elements, sync": ["-b", "0", "-e", "0", "-n", "2000", "-w", "200"],
    "0 elements, 16 in flight": ["-b", "0", "-e", "0", "-n", "500", "-w", "20", "--inflight", "16"],
}


COHORT_COLUMNS = {"cohort shm": "1", "cohort TCP": "0"}


def cohort_row(exe, ranks, name, shm="1"):
    """One cohort bench row: (time_us, busbw); `shm` is COHORT_SHM."""
    env = dict(os.environ, COHORT_SHM=shm)
    # The loop is timed as a whole, as the anchors time theirs (a clock read per iteration would
    # add a few percent to the 4 B rows).
    cmd = [exe, "bench", "--ranks", str(ranks), "-c", "0", "--json", "--whole-loop", *COHORT_ROWS[name]]
    for line in run(cmd, env=env).splitlines():
        o = json.loads(line)
        return (o["time_us"], o["busbw"])
    raise RuntimeError(f"cohort bench printed nothing for {name}")


ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")
# Rows the size-based anchors have: name -> (bytes, iterations, warm-up), as cohort's rows. At
# 1 MiB an iteration takes about half a millisecond and a stalled one a millisecond or more (in
# this machine's slow spells OpenMPI's times rise too): with 50 iterations, a few stalls decided
# a repetition's mean, and the per-repetition ratio to OpenMPI ranged from 0.62 to 2.04.
MPI_ROWS = {"allreduce 4 B": (4, 20000, 1000), "allreduce 4 B, cold": (4, 500, 0), "allreduce 1 MiB": (1 << 20, 200, 20),
            "allreduce 64 MiB": (64 << 20, 10, 3)}
# torch_gloo_bench.py's iterations and warm-up for every size of its sweep (the 64 MiB row's, as
# everyone's): at 64 MiB the first iterations on fresh connections run long (even the bare
# exchange's first takes twice its later ones), and 5 timed iterations after 1 left each
# repetition's figure at the mercy of one slow iteration.
TORCH_ITERS = ("10", "3")
SIZES = {size: name for name, (size, _, _) in MPI_ROWS.items() if "cold" not in name}
# OpenMPI's transports: over TCP, and over shared memory between the ranks of one host.
MPI_BTLS = {"OpenMPI TCP": "tcp,self", "OpenMPI vader": "self,vader"}


def mpi_row(exe, ranks, name, btl="tcp,self"):
    """One OpenMPI row over `btl`: (time_us, busbw)."""
    size, iters, warm = MPI_ROWS[name]
    base = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1",
            "--mca", "btl", btl, "-np", str(ranks), exe]
    for line in run(base + [str(size), str(size), str(iters), str(warm)]).splitlines():
        m = ROW.match(line)
        if m and int(m.group(1)) == size:
            return (float(m.group(3)), float(m.group(5)))
    raise RuntimeError(f"the MPI anchor printed no row for {size} bytes")


def exchange_row(exe, name):
    """One bare TCP exchange row: (time_us, the busbw an allreduce of that time would have)."""
    size, iters, warm = MPI_ROWS[name]
    us = float(run([exe, str(size), str(iters), str(warm)]).split()[0])
    return (us, size / us / 1e3)


def torch(python, script, ranks):
    res = {}
    try:
        out = run([python, script, str(ranks), str(free_port()), *TORCH_ITERS], timeout=900)
    except RuntimeError as e:
        # The port `free_port` found can be taken by another connection before the anchor's
        # store listens on it: that is this script's race, not a failure of the anchor.
        if "EADDRINUSE" not in str(e):
            raise
        out = run([python, script, str(ranks), str(free_port()), *TORCH_ITERS], timeout=900)
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


def iperf_client(port, reverse=False):
    """Start an iperf3 client on `port` (3 s; `reverse`: the server sends)."""
    cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "3", "-J"] + (["-R"] if reverse else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def received_gbs(client):
    out, _ = client.communicate(timeout=30)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9


def iperf():
    """Loopback TCP: one stream, then two at once in opposite directions (each with its own
    client and server process), the ceiling of a 2-rank allreduce, which sends and receives
    at once: GB/s per direction, the mean of the two."""
    ports = [free_port(), free_port(), free_port()]
    servers = [subprocess.Popen(["iperf3", "-s", "-p", str(p)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for p in ports]
    try:
        for _ in range(50):
            try:
                one = received_gbs(iperf_client(ports[0]))
                break
            except (KeyError, ValueError):
                # Not listening yet (iperf3 then answers with an error in its JSON).
                time.sleep(0.1)
        else:
            raise RuntimeError("iperf3 server did not answer")
        try:
            both = [iperf_client(ports[1]), iperf_client(ports[2], reverse=True)]
            duplex = sum(received_gbs(c) for c in both) / 2
        except (KeyError, ValueError) as e:
            raise RuntimeError(f"iperf3 in both directions failed: {e}")
        return {"loopback TCP (iperf3, one stream)": (0.0, one),
                "loopback TCP (iperf3, both directions, per direction)": (0.0, duplex)}
    finally:
        for s in servers:
            s.kill()
            s.wait()


def host_speed():
    """Each CPU this script may use, in turn: the best of three timings of a fixed Python loop
    with the script kept to that CPU (ms). A virtual machine's CPU can take 1.4-1.7 times as long
    over the same code for hundreds of milliseconds at a time while the host serves others, and
    a short collective's time moves with it (docs/performance.md, "The host's two speeds")."""
    cpus = sorted(os.sched_getaffinity(0))
    times = {}
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                x = 0
                for i in range(30_000):
                    x += i ^ (x >> 3)
                best = min(best, time.perf_counter() - t0)
            times[str(cpu)] = best * 1e3
    finally:
        os.sched_setaffinity(0, cpus)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cohort", default="target/release/cohort")
    ap.add_argument("--mpi-src", default="../shared/bench/mpi_allreduce.c")
    ap.add_argument("--torch-bench", default="../shared/bench/torch_gloo_bench.py")
    ap.add_argument("--exchange-src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "tcp_exchange.c"))
    ap.add_argument("--torch-python", default=os.environ.get("COHORT_TORCH_PYTHON"))
    ap.add_argument("--raw", default=None, help="write every figure here (JSON)")
    a = ap.parse_args()

    mpi_exe = None
    skipped = []
    if shutil.which("mpicc") and shutil.which("mpirun") and os.path.exists(a.mpi_src):
        mpi_exe = os.path.join(tempfile.mkdtemp(), "mpi_allreduce")
        run(["mpicc", "-O2", "-o", mpi_exe, a.mpi_src, "-lm"])
    else:
        skipped.append("OpenMPI (mpicc/mpirun or the anchor source missing)")
    exchange_exe = None
    if a.ranks != 2:
        skipped.append("TCP exchange (2 ranks only)")
    elif shutil.which("cc") and os.path.exists(a.exchange_src):
        exchange_exe = os.path.join(tempfile.mkdtemp(), "tcp_exchange")
        run(["cc", "-O2", "-o", exchange_exe, a.exchange_src])
    else:
        skipped.append("TCP exchange (cc or its source missing)")
    others = {}
    if a.torch_python and not os.access(a.torch_python, os.X_OK):
        # Checked before any repetition: found at the end, it would lose every figure of the run.
        sys.exit(f"--torch-python / COHORT_TORCH_PYTHON: {a.torch_python} is not an executable file")
    if a.torch_python and os.path.exists(a.torch_bench):
        others["torch gloo"] = lambda: torch(a.torch_python, a.torch_bench, a.ranks)
    else:
        skipped.append("torch gloo (give --torch-python or COHORT_TORCH_PYTHON)")
    if shutil.which("iperf3"):
        others["iperf3"] = iperf
    else:
        skipped.append("iperf3 (not installed)")

    mpis = list(MPI_BTLS) if mpi_exe else []
    names = list(COHORT_COLUMNS) + mpis + (["TCP exchange"] if exchange_exe else []) + list(others)
    raw = {name: [] for name in names}
    raw["host"] = []
    for rep in range(a.reps):
        host = {"before": host_speed()}
        mine, theirs, floor = {c: {} for c in COHORT_COLUMNS}, {m: {} for m in mpis}, {}
        for row in COHORT_ROWS:
            for c, shm in COHORT_COLUMNS.items():
                mine[c][row] = cohort_row(a.cohort, a.ranks, row, shm)
            for m in mpis if row in MPI_ROWS else []:
                try:
                    theirs[m][row] = mpi_row(mpi_exe, a.ranks, row, MPI_BTLS[m])
                except RuntimeError as e:
                    # An anchor that fails once leaves a gap in its column, not a lost run.
                    print(f"rep {rep + 1}/{a.reps}: {m} {row} failed, left out: {e}", file=sys.stderr)
            if exchange_exe and row in ("allreduce 1 MiB", "allreduce 64 MiB"):
                try:
                    floor[row] = exchange_row(exchange_exe, row)
                except RuntimeError as e:
                    print(f"rep {rep + 1}/{a.reps}: TCP exchange {row} failed, left out: {e}", file=sys.stderr)
        for c in COHORT_COLUMNS:
            raw[c].append(mine[c])
        for m in mpis:
            raw[m].append(theirs[m])
        if exchange_exe:
            raw["TCP exchange"].append(floor)
        host["after"] = host_speed()
        raw["host"].append(host)
        print(f"rep {rep + 1}/{a.reps}: cohort and OpenMPI done", file=sys.stderr)
        for name, fn in others.items():
            try:
                raw[name].append(fn())
                print(f"rep {rep + 1}/{a.reps}: {name} done", file=sys.stderr)
            except RuntimeError as e:
                print(f"rep {rep + 1}/{a.reps}: {name} failed, left out: {e}", file=sys.stderr)
                raw[name].append({})
    if a.raw:
        with open(a.raw, "w") as f:
            json.dump(raw, f, indent=1)

    rows = list(COHORT_ROWS)
    cols = [n for n in names if n != "iperf3"]
    # Time ratios of two columns, taken per repetition (same rep, close in time), then the median.
    pairs = [(x, y) for x, y in (("cohort TCP", "OpenMPI TCP"), ("cohort shm", "OpenMPI vader"),
                                 ("torch gloo", "cohort TCP"), ("torch gloo", "cohort shm"),
                                 ("cohort TCP", "TCP exchange"))
             if x in cols and y in cols]

    def ratio(x, y, row):
        rs = [a[row][0] / b[row][0] for a, b in zip(raw[x], raw[y]) if row in a and row in b and b[row][0] > 0]
        return f"{statistics.median(rs):.2f}" if rs else "-"

    print(f"\n{a.ranks} ranks, {a.reps} alternating repetitions, medians: µs per op (busbw GB/s)\n")
    heads = cols + [f"{x} ÷ {y} (time)" for x, y in pairs]
    print("| | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
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
        cells += [ratio(x, y, row) for x, y in pairs]
        print(f"| {row} | " + " | ".join(cells) + " |")
    # A failed iperf3 repetition left an empty entry.
    bws = [r["loopback TCP (iperf3, one stream)"][1] for r in raw.get("iperf3", []) if r]
    duplex = [r["loopback TCP (iperf3, both directions, per direction)"][1] for r in raw.get("iperf3", []) if r]
    if bws:
        print(f"\nloopback TCP, iperf3 one stream, same run: {statistics.median(bws):.2f} GB/s (median); "
              f"two streams at once in opposite directions: {statistics.median(duplex):.2f} GB/s per direction")
    # The host's speed around each repetition's cohort and OpenMPI runs: the slowest CPU's loop
    # time, before and after, against the fastest seen in the whole run.
    slowest = [max(max(h["before"].values()), max(h["after"].values())) for h in raw["host"]]
    if slowest:
        base = min(min(min(h["before"].values()), min(h["after"].values())) for h in raw["host"])
        row = "allreduce 4 B"
        per_rep = []
        for k, slow in enumerate(slowest):
            mine, theirs = raw.get("cohort shm", [{}] * a.reps)[k], raw.get("OpenMPI vader", [{}] * a.reps)[k]
            r = f"{mine[row][0] / theirs[row][0]:.2f}" if row in mine and row in theirs and theirs[row][0] > 0 else "-"
            per_rep.append(f"{slow / base:.2f} ({r})")
        print("\nhost: each repetition's slowest CPU on a fixed loop, against the run's fastest "
              "(and that repetition's cohort shm ÷ OpenMPI vader at 4 B): " + ", ".join(per_rep))
    for s in skipped:
        print(f"skipped: {s}")


if __name__ == "__main__":
    main()
