"""DDP step time of a transformer-sized model on CPU, gloo vs cohort, side by side.

    python python/bench/ddp_step.py [--world 2] [--steps 10] [--layers 4] [--d-model 512]

Launches WORLD ranks per backend on this host (env:// on loopback), trains the same model on
the same data, and prints the median step time and the median time of one allreduce of the
model's gradient size, per backend.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import cohort_torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(args.d_model, nhead=8, dim_feedforward=4 * args.d_model,
                                             batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=args.layers)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(2, 16, args.d_model, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(args.steps + 3):
        start = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.ones(numel)
    ar = []
    for i in range(args.steps + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        if i >= 2:
            ar.append(time.perf_counter() - start)
    if rank == 0:
        print(f"RESULT {args.backend} {numel} {statistics.median(times):.4f} {statistics.median(ar):.4f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend:
        rank_main(args)
        return
    from cohort_torch import _cohort

    if _cohort.DEBUG_BUILD:
        sys.exit("cohort_torch is a debug build here (scripts/python-tests.sh installs one): "
                 "run `pip install --no-build-isolation ./python` for the release build first")
    rows = []
    for backend in ["gloo", "cohort"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(args.world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.world))
            cmd = [sys.executable, __file__, "--backend", backend, "--steps", str(args.steps), "--layers",
                   str(args.layers), "--d-model", str(args.d_model)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"{backend}: a rank failed")
        line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT"))
        _, name, numel, step, ar = line.split()
        rows.append((name, int(numel), float(step), float(ar)))
    print(f"{args.world} ranks, TransformerEncoder {args.layers} layers d_model {args.d_model} "
          f"({rows[0][1] / 1e6:.1f} M parameters, {rows[0][1] * 4 / 2**20:.0f} MiB of gradients)")
    print(f"{'backend':8} {'DDP step (median)':>18} {'allreduce of all grads':>24}")
    for name, _, step, ar in rows:
        print(f"{name:8} {step * 1e3:15.1f} ms {ar * 1e3:21.1f} ms")


if __name__ == "__main__":
    main()
