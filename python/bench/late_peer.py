"""What a rank spends while it waits for a late peer: rank 1 arrives 5 s late at an allreduce,
rank 0 reports the CPU time it used in that allreduce.

    BACKEND=cohort python -m torch.distributed.run --nproc-per-node 2 python/bench/late_peer.py
    BACKEND=gloo   python -m torch.distributed.run --nproc-per-node 2 python/bench/late_peer.py
"""

from __future__ import annotations

import os
import resource
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers the backend "cohort")
from cohort_torch import _cohort

if os.environ.get("BACKEND", "cohort") == "cohort" and _cohort.DEBUG_BUILD:
    raise SystemExit("cohort_torch is a debug build here (scripts/python-tests.sh installs one): "
                     "run `pip install --no-build-isolation ./python` for the release build first")

LATE_S = 5.0


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    backend = os.environ.get("BACKEND", "cohort")
    dist.init_process_group(backend=backend)
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)  # connected and warm
    if rank == 1:
        time.sleep(LATE_S)
    cpu0, wall0 = cpu_seconds(), time.monotonic()
    dist.all_reduce(t)
    cpu, wall = cpu_seconds() - cpu0, time.monotonic() - wall0
    if rank == 0:
        print(f"{backend}: rank 0 waited {wall:.2f} s and used {cpu:.3f} s of CPU: "
              f"{100 * cpu / wall:.2f}% of one core")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
