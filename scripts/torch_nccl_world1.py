#!/usr/bin/env python3
"""torch's ProcessGroupNCCL at world size 1, timed as `cohort bench --transport nccl` times it.

For each size: 5 warm-up all_reduces, then 5 repetitions of 20 all_reduces enqueued back to back
and one synchronize; prints each repetition's time per all_reduce in µs. Run it on a GPU machine
beside `cohort bench --transport nccl --ranks 1 -b SIZE -e SIZE -n 20 -w 5` (scripts/gpu-tests.sh
builds that binary), alternating the two, and compare medians.

    python3 scripts/torch_nccl_world1.py [SIZE_BYTES ...]     (default: 8 4096 262144 16777216)
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    sizes = [int(s) for s in sys.argv[1:]] or [8, 4096, 262144, 16777216]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        for size in sizes:
            x = torch.ones(max(size // 4, 1), device="cuda")
            for _ in range(5):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            reps = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20):
                    dist.all_reduce(x)
                torch.cuda.synchronize()
                reps.append((time.perf_counter() - t) / 20 * 1e6)
            print(f"torch nccl world 1, {size} B: µs an all_reduce, 5 reps of 20: " + " ".join(f"{r:.2f}" for r in reps))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
