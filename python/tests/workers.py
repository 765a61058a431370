"""Rank programs the tests launch as real processes, as torchrun would (env:// rendezvous).

    python workers.py CASE OUT_DIR

with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and BACKEND ("cohort" or "gloo") set. Each case
writes what it computed to OUT_DIR/<case>_<backend>_<rank>.pt for the test to compare.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers "cohort")

BACKEND = os.environ.get("BACKEND", "cohort")
COHORT = BACKEND == "cohort"

#: dtypes checked, and which reductions each supports in both backends.
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


def values(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integer-valued data (exact in every dtype, whatever the reduction order)."""
    if dtype == torch.bool:
        return (torch.arange(n) + rank + salt) % 2 == 0
    base = (torch.arange(n, dtype=torch.int64) * 3 + rank * 5 + salt) % 7 + 1
    return base.to(dtype)


def collectives(out: dict, rank: int, world: int) -> None:
    ops = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT,
           "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX}
    bit_ops = {"BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
    for dtype in FLOATS + INTS:
        for name, op in ops.items():
            t = values(rank, 5, dtype)
            dist.all_reduce(t, op=op)
            out[f"allreduce/{name}/{dtype}"] = t
    for dtype in INTS:
        for name, op in bit_ops.items():
            t = values(rank, 5, dtype)
            dist.all_reduce(t, op=op)
            out[f"allreduce/{name}/{dtype}"] = t
    # A non-contiguous tensor is reduced through a copy and written back in place (gloo
    # reduces the wrong elements: checked against the expected values instead).
    if COHORT:
        m = torch.stack([values(rank, 4, torch.float32), torch.full((4,), -1.0)], dim=1)
        dist.all_reduce(m[:, 0])
        out["allreduce/noncontiguous"] = m
        want = torch.stack([sum(values(r, 4, torch.float32) for r in range(world)), torch.full((4,), -1.0)], dim=1)
        out["allreduce/noncontiguous/expect"] = want

    for dtype in FLOATS + INTS + [torch.bool]:
        t = values(rank, 6, dtype) if rank == world - 1 else torch.zeros(6, dtype=dtype)
        dist.broadcast(t, src=world - 1)
        out[f"broadcast/{dtype}"] = t

        outs = [torch.zeros(3, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, values(rank, 3, dtype))
        out[f"allgather/{dtype}"] = torch.stack(outs)

        flat = torch.zeros(3 * world, dtype=dtype)
        dist.all_gather_into_tensor(flat, values(rank, 3, dtype, 1))
        out[f"allgather_into_tensor/{dtype}"] = flat

    for dtype in FLOATS + INTS:
        t = values(rank, 4, dtype)
        dist.reduce(t, dst=world - 1, op=dist.ReduceOp.SUM)
        if rank == world - 1:
            out[f"reduce/{dtype}"] = t

        o = torch.zeros(2, dtype=dtype)
        dist.reduce_scatter(o, [values(rank, 2, dtype, r) for r in range(world)], op=dist.ReduceOp.SUM)
        out[f"reduce_scatter/{dtype}"] = o

        o = torch.zeros(3, dtype=dtype)
        dist.reduce_scatter_tensor(o, values(rank, 3 * world, dtype), op=dist.ReduceOp.MAX)
        out[f"reduce_scatter_tensor/{dtype}"] = o

        g = [torch.zeros(2, dtype=dtype) for _ in range(world)] if rank == 0 else None
        dist.gather(values(rank, 2, dtype), gather_list=g, dst=0)
        if rank == 0:
            out[f"gather/{dtype}"] = torch.stack(g)

        s = torch.zeros(2, dtype=dtype)
        dist.scatter(s, [values(0, 2, dtype, r) for r in range(world)] if rank == 0 else None, src=0)
        out[f"scatter/{dtype}"] = s

        # Uneven all_to_all_single: rank r sends r + k + 1 rows to rank k.
        in_splits = [rank + k + 1 for k in range(world)]
        out_splits = [k + rank + 1 for k in range(world)]
        inp = values(rank, sum(in_splits) * 2, dtype).reshape(-1, 2)
        o = torch.zeros(sum(out_splits), 2, dtype=dtype)
        dist.all_to_all_single(o, inp, out_splits, in_splits)
        out[f"all_to_all_single/{dtype}"] = o

        ins = [values(rank, k + 1, dtype, k) for k in range(world)]
        outs = [torch.zeros(rank + 1, dtype=dtype) for _ in range(world)]
        if COHORT:  # gloo has no list all_to_all: check against the expected pieces
            dist.all_to_all(outs, ins)
            out[f"all_to_all/{dtype}"] = torch.cat(outs)
            out[f"all_to_all/{dtype}/expect"] = torch.cat([values(r, rank + 1, dtype, rank) for r in range(world)])

    # Point to point: a ring.
    t = values(rank, 4, torch.float32)
    r = torch.zeros(4)
    if rank % 2 == 0:
        dist.send(t, (rank + 1) % world)
        dist.recv(r, (rank - 1) % world)
    else:
        dist.recv(r, (rank - 1) % world)
        dist.send(t, (rank + 1) % world)
    out["sendrecv"] = r

    dist.barrier()
    out["all_gather_object"] = _objects(rank, world)

    # async_op: a work and its future.
    t = values(rank, 8, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["async/allreduce"] = t
    t2 = values(rank, 8, torch.float64)
    fut = dist.all_reduce(t2, async_op=True).get_future()
    out["async/future"] = fut.wait()[0]

    # A subgroup (every rank calls new_group; members only use it).
    sub = dist.new_group([0, 1])
    if rank < 2:
        t = values(rank, 3, torch.int64)
        dist.all_reduce(t, group=sub)
        out["subgroup/allreduce"] = t


def _objects(rank: int, world: int) -> torch.Tensor:
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "sq": rank * rank})
    return torch.tensor([o["sq"] for o in objs])


def cohort_only(out: dict, rank: int, world: int) -> None:
    """What gloo does not offer: AVG, PREMUL_SUM, bit ops on bool, any-source recv,
    monitored_barrier, functional collectives. The expected values are computed here."""
    for dtype in FLOATS:
        t = values(rank, 5, dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[f"avg/{dtype}"] = t
        expect = sum(values(r, 5, torch.float64) for r in range(world)) / world
        out[f"avg/{dtype}/expect"] = expect.to(dtype)

        t = values(rank, 5, dtype)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        out[f"premul/{dtype}"] = t
        out[f"premul/{dtype}/expect"] = (sum(values(r, 5, torch.float64) for r in range(world)) * 0.5).to(dtype)

    for name, op in {"BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}.items():
        t = values(rank, 6, torch.bool)
        dist.all_reduce(t, op=op)
        out[f"bool/{name}"] = t

    # Any-source receive: rank 0 hears from every other rank, in whatever order, through
    # dist.recv(src=None), which returns the source.
    if rank == 0:
        seen = []
        for _ in range(world - 1):
            r = torch.zeros(1, dtype=torch.int64)
            src = dist.recv(r, src=None)
            seen.append((src, int(r.item())))
        out["anysource"] = torch.tensor(sorted(seen))
    else:
        dist.send(torch.tensor([rank * 10]), 0)
    # In a subgroup of the first and last rank, the source comes back as a global rank.
    pair = dist.new_group([0, world - 1])
    if rank == 0:
        r = torch.zeros(1, dtype=torch.int64)
        out["anysource/subgroup"] = torch.tensor([dist.recv(r, src=None, group=pair), int(r.item())])
    elif rank == world - 1:
        dist.send(torch.tensor([rank * 100]), 0, group=pair)

    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    out["monitored_barrier"] = torch.tensor(1)

    # Coalesced forms, through torch's coalescing manager (allreduce_coalesced,
    # all_gather_single_coalesced, reduce_scatter_single_coalesced) and all_reduce_coalesced.
    a, b = values(rank, 3, torch.float32), values(rank, 6, torch.float32, 1).reshape(2, 3)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    out["coalesced/allreduce/a"] = a
    out["coalesced/allreduce/a/expect"] = sum(values(r, 3, torch.float32) for r in range(world))
    out["coalesced/allreduce/b"] = b
    out["coalesced/allreduce/b/expect"] = sum(values(r, 6, torch.float32, 1) for r in range(world)).reshape(2, 3)
    o1, o2 = torch.zeros(2 * world, dtype=torch.int32), torch.zeros(3 * world, dtype=torch.int32)
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(o1, values(rank, 2, torch.int32))
        dist.all_gather_into_tensor(o2, values(rank, 3, torch.int32, 2))
    out["coalesced/allgather/1"] = o1
    out["coalesced/allgather/1/expect"] = torch.cat([values(r, 2, torch.int32) for r in range(world)])
    out["coalesced/allgather/2"] = o2
    out["coalesced/allgather/2/expect"] = torch.cat([values(r, 3, torch.int32, 2) for r in range(world)])
    r1 = torch.zeros(2, dtype=torch.float64)
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(r1, values(rank, 2 * world, torch.float64))
    out["coalesced/reduce_scatter"] = r1
    out["coalesced/reduce_scatter/expect"] = sum(values(q, 2 * world, torch.float64) for q in range(world))[
        2 * rank:2 * rank + 2]
    c = [values(rank, 4, torch.float64), values(rank, 2, torch.float64, 3)]
    dist.all_reduce_coalesced(c, op=dist.ReduceOp.MAX)
    out["all_reduce_coalesced/0"] = c[0]
    out["all_reduce_coalesced/0/expect"] = torch.stack([values(r, 4, torch.float64) for r in range(world)]).amax(0)
    out["all_reduce_coalesced/1"] = c[1]
    out["all_reduce_coalesced/1/expect"] = torch.stack(
        [values(r, 2, torch.float64, 3) for r in range(world)]).amax(0)

    import torch.distributed._functional_collectives as funcol

    t = funcol.all_reduce(values(rank, 4, torch.float32), "sum", dist.group.WORLD)
    out["funcol/all_reduce"] = funcol.wait_tensor(t) if hasattr(funcol, "wait_tensor") else t

    work = dist.all_reduce(values(rank, 2, torch.float32), async_op=True)
    work.wait()
    # torch 2.15's C++ wrapper of a Python work forwards wait() and get_future() only, so
    # work.is_completed() stays False: the future tells.
    out["is_completed"] = torch.tensor(work.get_future().done())


def in_place(out: dict, rank: int, world: int) -> None:
    """Which tensors are used in place (no copy in or out) and which go through a copy, with
    the results right either way. The expected values are computed here."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    n = 1 << 15
    total = sum(values(r, n, torch.float32) for r in range(world))

    def copied(f: Callable[[], None]) -> torch.Tensor:
        before = backend.bytes_copied()
        f()
        return torch.tensor(backend.bytes_copied() - before)

    # Contiguous, aligned: allreduce, broadcast and recv work in the tensor itself.
    t = values(rank, n, torch.float32)
    out["allreduce/copied"] = copied(lambda: dist.all_reduce(t))
    out["allreduce"], out["allreduce/expect"] = t, total
    b = values(rank, n, torch.float32, 1)
    out["broadcast/copied"] = copied(lambda: dist.broadcast(b, 0))
    out["broadcast"], out["broadcast/expect"] = b, values(0, n, torch.float32, 1)

    # A tensor 4 bytes past an 8-byte boundary is copied in and out.
    base = torch.zeros(n + 1, dtype=torch.float32)
    m = base[1:]
    m.copy_(values(rank, n, torch.float32))
    out["misaligned/copied"] = copied(lambda: dist.all_reduce(m))
    out["misaligned"], out["misaligned/expect"] = m, total

    # The same tensor twice in one call: both are copies, so nothing aliases.
    d = values(rank, n, torch.float32)
    out["twice/copied"] = copied(lambda: backend.allreduce([d, d]).wait())
    out["twice"], out["twice/expect"] = d, 2 * total

    # Single outputs are filled in place too (outputs start as garbage: NaN).
    o = torch.full((world, n), float("nan"))
    out["allgather/copied"] = copied(lambda: dist.all_gather_into_tensor(o, values(rank, n, torch.float32)))
    out["allgather"] = o
    out["allgather/expect"] = torch.stack([values(r, n, torch.float32) for r in range(world)])
    rs = torch.full((n,), float("nan"))
    out["reduce_scatter/copied"] = copied(lambda: dist.reduce_scatter_tensor(rs, values(rank, n * world, torch.float32)))
    out["reduce_scatter"] = rs
    out["reduce_scatter/expect"] = sum(values(q, n * world, torch.float32) for q in range(world))[rank * n:(rank + 1) * n]
    a2a = torch.full((n * world,), float("nan"))
    out["all_to_all/copied"] = copied(lambda: dist.all_to_all_single(a2a, values(rank, n * world, torch.float32)))
    out["all_to_all"] = a2a
    out["all_to_all/expect"] = torch.cat([values(q, n * world, torch.float32)[rank * n:(rank + 1) * n]
                                          for q in range(world)])
    # ... and with the input a slice of the output (as FSDP does), through a copy.
    o2 = torch.zeros(n * world, dtype=torch.float32)
    piece = o2[rank * n:(rank + 1) * n]
    piece.copy_(values(rank, n, torch.float32, 2))
    dist.all_gather_into_tensor(o2, piece)
    out["allgather_slice"] = o2
    out["allgather_slice/expect"] = torch.cat([values(r, n, torch.float32, 2) for r in range(world)])

    # reduce leaves non-root tensors as they were (the reduction runs in a copy there).
    r = values(rank, n, torch.float32)
    dist.reduce(r, 0)
    out["reduce"], out["reduce/expect"] = r, total if rank == 0 else values(rank, n, torch.float32)


def ddp(out: dict, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp_model(x), y)
        loss.backward()
        opt.step()
    for name, p in model.state_dict().items():
        out[f"ddp/{name}"] = p.detach().clone()


def killed(out: dict, rank: int, world: int) -> None:
    """DDP training in which the last rank SIGKILLs itself at step 3; survivors print the
    error they get and exit with status 3."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    try:
        for step in range(200):
            if step == 3 and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = ddp_model(torch.randn(4, 64)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 (the point of the test)
        print(f"CAUGHT {type(e).__name__}: {e}", flush=True)
        sys.stdout.flush()
        os._exit(3)
    print("NO ERROR", flush=True)


def lost(out: dict, rank: int, world: int) -> None:
    """Plain collectives; the last rank exits after the first. Survivors must raise."""
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == world - 1:
        os._exit(0)
    try:
        for _ in range(100):
            dist.all_reduce(t)
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001
        print(f"CAUGHT {type(e).__name__}: {e}", flush=True)
        os._exit(3)
    print("NO ERROR", flush=True)


def hang(out: dict, rank: int, world: int) -> None:
    """The last rank is late by more than the group's timeout (3 s, from init_process_group):
    the others' collective times out, naming it."""
    if rank == world - 1:
        time.sleep(12)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        print(f"CAUGHT {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}", flush=True)
        os._exit(3)
    print("NO ERROR", flush=True)
    os._exit(0 if rank == world - 1 else 4)


CASES = {"collectives": collectives, "cohort_only": cohort_only, "in_place": in_place, "ddp": ddp,
         "killed": killed, "lost": lost, "hang": hang}


def main() -> None:
    case, out_dir = sys.argv[1], sys.argv[2]
    timeout = datetime.timedelta(seconds=3 if case == "hang" else 60)
    dist.init_process_group(backend=BACKEND, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    CASES[case](out, rank, world)
    torch.save(out, os.path.join(out_dir, f"{case}_{BACKEND}_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
