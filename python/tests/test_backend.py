"""cohort_torch against gloo, with real processes rendezvousing through env:// (as torchrun).

Each test launches WORLD_SIZE copies of workers.py and compares what they saved.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cohort_torch

WORKERS = Path(__file__).with_name("workers.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case: str, world: int, backend: str, out_dir: Path, timeout: float = 240,
           env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), BACKEND=backend,
                   OMP_NUM_THREADS="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(WORKERS), case, str(out_dir)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = []
    for rank, p in enumerate(procs):
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            stdout, _ = p.communicate()
            pytest.fail(f"{case} ({backend}, {world} ranks): rank {rank} did not finish:\n{stdout}")
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return done


# torch's own gloo now and then aborts a rank as the process ends ("terminate called without an
# active exception": its worker threads outliving the group; pytorch/pytorch#190489 and #179291).
# It is the reference the cohort runs are compared with, not what these tests test, so such a
# gloo run is run again, once; cohort's runs never are.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_ok(case: str, world: int, backend: str, out_dir: Path) -> list[dict]:
    procs = launch(case, world, backend, out_dir)
    if backend == "gloo" and any(p.returncode == -signal.SIGABRT and GLOO_TEARDOWN_ABORT in p.stdout for p in procs):
        procs = launch(case, world, backend, out_dir)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"{case} ({backend}) rank {rank} exited {p.returncode}:\n{p.stdout}"
    return [torch.load(out_dir / f"{case}_{backend}_{r}.pt") for r in range(world)]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, gloo {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, gloo {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}:\n cohort {got}\n gloo   {want}"


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_gives_gloos_results(tmp_path: Path, world: int) -> None:
    ours = run_ok("collectives", world, "cohort", tmp_path)
    gloo = run_ok("collectives", world, "gloo", tmp_path)
    for rank in range(world):
        compared = 0
        for key, want in gloo[rank].items():
            assert key in ours[rank], f"rank {rank}: cohort did not produce {key}"
            assert_same(ours[rank][key], want, f"rank {rank} {key}")
            compared += 1
        assert compared > 100 if rank == 0 else compared > 50
        for key, got in ours[rank].items():
            if key.endswith("/expect"):
                assert_same(ours[rank][key.removesuffix("/expect")], got, f"rank {rank} {key}")


@pytest.mark.parametrize("world", [2, 3])
def test_what_gloo_lacks_gives_the_expected_results(tmp_path: Path, world: int) -> None:
    ours = run_ok("cohort_only", world, "cohort", tmp_path)
    for rank in range(world):
        out = ours[rank]
        for key, want in out.items():
            if key.endswith("/expect"):
                got = out[key.removesuffix("/expect")]
                assert got.dtype == want.dtype
                assert torch.allclose(got.double(), want.double()), f"rank {rank} {key}: {got} vs {want}"
        bools = [torch.tensor([(i + r) % 2 == 0 for i in range(6)]) for r in range(world)]
        assert torch.equal(out["bool/BAND"], torch.stack(bools).all(0))
        assert torch.equal(out["bool/BOR"], torch.stack(bools).any(0))
        assert torch.equal(out["bool/BXOR"], torch.stack(bools).sum(0) % 2 == 1)
        expect_sum = sum((torch.arange(4) * 3 + r * 5) % 7 + 1 for r in range(world)).float()
        assert torch.equal(out["funcol/all_reduce"], expect_sum)
        assert bool(out["is_completed"])
    assert ours[0]["anysource"].tolist() == [[r, r * 10] for r in range(1, world)]
    assert ours[0]["anysource/subgroup"].tolist() == [world - 1, (world - 1) * 100]


@pytest.mark.parametrize("world", [2, 3])
def test_contiguous_tensors_are_used_in_place_and_the_rest_through_copies(tmp_path: Path, world: int) -> None:
    ours = run_ok("in_place", world, "cohort", tmp_path)
    n_bytes = (1 << 15) * 4
    for rank in range(world):
        out = ours[rank]
        for key, want in out.items():
            if key.endswith("/expect"):
                assert_same(out[key.removesuffix("/expect")], want, f"rank {rank} {key}")
        assert int(out["allreduce/copied"]) == 0
        assert int(out["broadcast/copied"]) == 0
        assert int(out["misaligned/copied"]) == 2 * n_bytes, "copied in and out"
        assert int(out["twice/copied"]) == 4 * n_bytes, "both copies, in and out"
        for op in ["allgather", "reduce_scatter", "all_to_all"]:
            assert int(out[f"{op}/copied"]) == 0, op


def test_ddp_trains_to_the_same_parameters_as_gloo(tmp_path: Path) -> None:
    ours = run_ok("ddp", 2, "cohort", tmp_path)
    gloo = run_ok("ddp", 2, "gloo", tmp_path)
    for rank in range(2):
        for key, want in gloo[rank].items():
            got = ours[rank][key]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"rank {rank} {key}: {got} vs {want}"
    # And the ranks agree on the parameters (buffers differ: DDP broadcasts them before each
    # forward, and each rank's last forward updated its own BatchNorm statistics).
    for key, p in ours[0].items():
        if "running_" in key or "num_batches" in key:
            continue
        assert torch.allclose(p, ours[1][key], rtol=1e-5, atol=1e-6), key


def _survivor_errors(case: str, world: int, tmp_path: Path, env: dict[str, str] | None = None) -> list[str]:
    procs = launch(case, world, "cohort", tmp_path, timeout=120, env=env)
    dead = world - 1
    lines = []
    for rank in range(dead):
        p = procs[rank]
        assert p.returncode == 3, f"rank {rank} exited {p.returncode} (want 3: caught an error):\n{p.stdout}"
        caught = [line for line in p.stdout.splitlines() if line.startswith("CAUGHT")]
        assert caught, p.stdout
        assert f"rank {dead}" in caught[0], f"rank {rank}'s error does not name rank {dead}: {caught[0]}"
        lines.append(caught[0])
    return lines


def test_a_rank_killed_during_ddp_is_named_by_every_survivor_without_a_crash(tmp_path: Path) -> None:
    _survivor_errors("killed", 3, tmp_path)


def test_a_lost_rank_is_named_in_the_next_collectives_error_and_the_recorder_is_dumped(tmp_path: Path) -> None:
    prefix = tmp_path / "fr_"
    lines = _survivor_errors("lost", 2, tmp_path, env={"COHORT_DUMP_ON_FAILURE": str(prefix)})
    assert "CohortError" in lines[0] and "all_reduce (seq " in lines[0], lines[0]
    dump = json.loads((tmp_path / "fr_0.json").read_text())
    assert dump, "the survivor's flight recorder dump is empty"


def test_a_collective_times_out_after_init_process_groups_timeout(tmp_path: Path) -> None:
    procs = launch("hang", 2, "cohort", tmp_path, timeout=120)
    p = procs[0]
    assert p.returncode == 3, f"rank 0 exited {p.returncode}:\n{p.stdout}"
    caught = next(line for line in p.stdout.splitlines() if line.startswith("CAUGHT"))
    assert "timeout" in caught and "rank 1" in caught and "all_reduce (seq 1" in caught, caught
    seconds = float(caught.split(" after ")[1].split(" s:")[0])
    assert 2.5 <= seconds <= 11, caught


def test_an_explicit_store_and_a_single_rank_group_work(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend="cohort", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.arange(4.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        path = tmp_path / "fr.json"
        text = cohort_torch.dump_flight_recorder(str(path))
        assert path.read_text() == text and "all_reduce" in text.lower().replace("allreduce", "all_reduce")
    finally:
        dist.destroy_process_group()


def test_unsupported_dtypes_are_refused_by_name(tmp_path: Path) -> None:
    store = dist.HashStore()
    dist.init_process_group(backend="cohort", store=store, rank=0, world_size=1)
    try:
        with pytest.raises((TypeError, RuntimeError), match="int16"):
            dist.all_reduce(torch.zeros(2, dtype=torch.int16))
    finally:
        dist.destroy_process_group()
