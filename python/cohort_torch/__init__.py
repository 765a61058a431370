"""cohort as a ``torch.distributed`` backend for CPU tensors.

Importing this module registers the backend ``"cohort"``::

    import cohort_torch  # noqa: F401  (registers "cohort")
    import torch.distributed as dist
    dist.init_process_group(backend="cohort")  # env:// (torchrun, cohort launch) or store=...

How it fits into torch
----------------------
:class:`CohortBackend` subclasses ``torch._C._distributed_c10d.Backend`` (torch's ``PyBackend``
trampoline), so the group torch builds around it is a real C++ ``ProcessGroup``: group names,
``new_group``, functional collectives and DDP work as with gloo. Every collective goes to the
native extension ``cohort_torch._cohort``, which runs cohort's TCP backend (Rust) on its own
threads; the GIL is released while a call copies its inputs and while ``wait()`` blocks.

Tensors are used through ``data_ptr()``, in place: an allreduce, broadcast, reduce (on its root),
recv, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single or scatter works directly
in the tensors' memory, with no copy in or out, and every input is read from it (the extension
holds a reference to each tensor while it uses it). Outputs given as lists are copied once, when
the work ends. A non-contiguous tensor, one whose memory is not 8-byte aligned, or tensors that
overlap within one call go through a copy, written back when the work ends. As with every
backend, a tensor must not be read or written while a collective on it is in flight: wait first.

``dist.recv(tensor, src=None)``
------------------------------
torch 2.15 wraps the work a Python backend returns in a C++ holder that forwards only
``wait()`` and ``get_future()``, so torch's ``recv(src=None)`` cannot ask it for the sender.
Importing this module replaces ``torch.distributed.recv`` with :func:`_recv`, which answers that
one case on cohort groups and hands every other call to torch's own ``recv``.

Errors
------
A failed collective raises :class:`CohortError` (a ``RuntimeError``) from ``work.wait()`` and
from blocking calls; the message is cohort's: this rank, the op, its seq and the rank to blame
(``cohort rank 0: allreduce (seq 7) failed: ... rank 1 ...``).

The future of a work (``work.get_future()``) is **never failed**: under DDP a failed future
crashes torch's reducer (SIGSEGV). It completes with the work's tensors even when the work
failed (their contents are then unspecified), and it is complete once ``work.wait()``
returns. Instead, as torchft does, the failure aborts the group, is logged on the
``cohort_torch`` logger, and every later call on the group raises it.
So a DDP job whose peer died fails at its next step with the culprit's rank, not with a crash.

Timeouts come from ``init_process_group(timeout=...)``; other options from the ``COHORT_*``
environment variables, as for the Rust API (``COHORT_DUMP_ON_FAILURE=<prefix>`` dumps the
flight recorder to ``<prefix><rank>.json`` when the group fails; ``cohort fr analyze`` reads
the dumps).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import threading
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

from . import _cohort
from ._cohort import CohortError

__all__ = ["CohortBackend", "CohortError", "BACKEND_NAME", "dump_flight_recorder"]

BACKEND_NAME = "cohort"

_log = logging.getLogger("cohort_torch")

#: torch dtypes cohort carries, by cohort's (and torch's) name.
_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}

#: Live backends, for ``dump_flight_recorder`` and the shutdown at exit.
_live: list[weakref.ref[CohortBackend]] = []
_live_lock = threading.Lock()


def _check(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cohort: expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"cohort: only CPU tensors are supported, got one on {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"cohort: only dense tensors are supported, got layout {t.layout}")
    if t.dtype not in _DTYPES:
        supported = ", ".join(sorted(_DTYPES.values()))
        raise TypeError(f"cohort: dtype {t.dtype} is not supported (supported: {supported})")


def _buf(t: torch.Tensor) -> tuple[int, int, str, list[int], torch.Tensor]:
    """The descriptor the extension reads: a contiguous CPU tensor's memory, and the tensor,
    which the extension holds while it uses that memory in place."""
    return (t.data_ptr(), t.numel() * t.element_size(), _DTYPES[t.dtype], list(t.shape), t)


def _out(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


class _Tensors:
    """Contiguous stand-ins for the tensors of one call, and what to write back at the end."""

    def __init__(self) -> None:
        self.writeback: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.keep: list[torch.Tensor] = []

    def input(self, t: torch.Tensor) -> torch.Tensor:
        _check(t)
        c = t.contiguous()
        self.keep.append(c)
        return c

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor the extension may write: ``t`` itself, or a copy written back later."""
        _check(t)
        if t.is_contiguous():
            self.keep.append(t)
            return t
        c = t.contiguous()
        self.writeback.append((t, c))
        self.keep.append(c)
        return c


def _reduce_op(opts: Any) -> tuple[str, float]:
    """(name, PREMUL_SUM factor) from options, a ``ReduceOp`` or a bare ``RedOpType``."""
    op = getattr(opts, "reduceOp", opts)
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    factor = 1.0
    if name == "PREMUL_SUM":
        f = getattr(op, "factor", None)
        if isinstance(f, torch.Tensor):
            f = f.item()
        if f is None:
            raise ValueError("cohort: PREMUL_SUM needs a factor (torch.distributed._make_nccl_premul_sum)")
        factor = float(f)
    return name, factor


def _seconds(timeout: Any) -> float:
    """A timeout in seconds; 0 for "the group's default" (torch passes -1 ms for that)."""
    if timeout is None:
        return 0.0
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return s if s > 0 else 0.0


def _row(t: torch.Tensor) -> int:
    """Elements per index of dimension 0 (all_to_all_single splits count rows)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return 1
    return t.numel() // t.shape[0]


class _Work(_C10dWork):
    """The ``Work`` torch gets back: waits on cohort's works, completes a torch future.

    ``wait()`` raises :class:`CohortError` if a work failed. The future always completes with
    ``value`` and never fails (see the module docs).
    """

    def __init__(self, pendings: Sequence[Any], value: list[torch.Tensor], tensors: _Tensors,
                 after: Callable[[], None] | None = None, parts: Sequence[_Work] = ()) -> None:
        super().__init__()
        self._parts = list(parts)
        self._pendings = list(pendings)
        self._value = value
        self._tensors: _Tensors | None = tensors
        self._after = after
        self._fut: torch.futures.Future = torch.futures.Future()
        self._lock = threading.Lock()
        self._left = len(self._pendings)
        self._finished = False
        # Set once the future is complete; the thread that completes it, while it does.
        self._completed = threading.Event()
        self._finisher: int | None = None
        if not self._pendings:
            self._finish()
        for p in self._pendings:
            p.on_done(self._one_done)

    def _one_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left <= 0
        if last:
            self._finish()

    def _finish(self) -> None:
        """Write back, log a failure, complete the future: once, whoever comes first. A caller
        that comes second (``wait()`` while cohort's completion runs the first, on its own
        thread) returns only once the future is complete, so that ``wait()`` leaves it done;
        one that comes back in from the first's own work (a callback of the future) does not
        wait for itself."""
        with self._lock:
            first = not self._finished
            if first:
                self._finished = True
                self._finisher = threading.get_ident()
                tensors, self._tensors = self._tensors, None
            elif self._finisher == threading.get_ident():
                return
        if not first:
            self._completed.wait()
            return
        try:
            error = self._error()
            if error is None and tensors is not None:
                for original, copy in tensors.writeback:
                    original.copy_(copy)
                if self._after is not None:
                    self._after()
            if error is not None:
                _log.error("%s", error)
            self._fut.set_result(self._value)
        finally:
            # Whatever happened above, nobody waits for this call in vain.
            with self._lock:
                self._finisher = None
            self._completed.set()

    def _error(self) -> str | None:
        for p in self._pendings:
            e = p.exception()
            if e is not None:
                return e
        return None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        secs = _seconds(timeout)
        for p in self._pendings:
            if not p.wait(secs):
                raise CohortError(f"cohort: work {p!r} did not finish within {secs} s")
        for w in self._parts:
            w._finish()
        self._finish()
        return True

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self._pendings)

    def is_success(self) -> bool:
        return all(p.is_success() for p in self._pendings)

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def source_rank(self) -> int:
        return self._pendings[0].source_rank() if self._pendings else -1

    _source_rank = source_rank


class CohortBackend(_C10dBackend):
    """torch's backend ``"cohort"``: a cohort TCP process group for CPU tensors."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._timeout = timeout
        self._coalesced: list[_Work] | None = None
        self._group = _cohort.Group(store, rank, size, _seconds(timeout))
        with _live_lock:
            _live.append(weakref.ref(self))

    # ---- identity ----

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def _get_sequence_number_for_group(self) -> int:
        return self._group.seq()

    def bytes_copied(self) -> int:
        """Bytes copied so far between this group's tensors and cohort's buffers, in and out:
        collectives that ran in the tensors' own memory add nothing."""
        return self._group.bytes_copied()

    def flight_recorder_json(self) -> str:
        """The flight recorder as JSON (PyTorch's flight-recorder schema)."""
        return self._group.flight_recorder_json()

    def error(self) -> str | None:
        """The group's first failure, or ``None`` while it is healthy."""
        return self._group.error()

    # ---- coalescing (the old style: each collective runs, end_coalescing waits for all) ----

    def start_coalescing(self) -> None:
        self._coalesced = []

    def end_coalescing(self) -> _Work:
        works, self._coalesced = self._coalesced or [], None
        pendings = [p for w in works for p in w._pendings]
        value = [t for w in works for t in w._value]
        return _Work(pendings, value, _Tensors(), after=None, parts=works)

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    def _track(self, work: _Work) -> _Work:
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    # ---- lifecycle ----

    def shutdown(self) -> None:
        self._group.shutdown()

    def abort(self) -> None:
        self._group.abort("abort() was called")

    # ---- collectives ----

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        ts = _Tensors()
        bufs = [_buf(ts.output(t)) for t in tensors]
        name, factor = _reduce_op(opts if opts is not None else dist.ReduceOp.SUM)
        return self._track(_Work([self._group.allreduce(bufs, name, factor)], list(tensors), ts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        ts = _Tensors()
        bufs = [_buf(ts.output(t)) for t in tensors]
        name, factor = _reduce_op(opts if opts is not None else dist.ReduceOp.SUM)
        return self._track(_Work([self._group.allreduce_coalesced(bufs, name, factor)], list(tensors), ts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        ts = _Tensors()
        bufs = [_buf(ts.output(t)) for t in tensors]
        return self._track(_Work([self._group.broadcast(bufs, opts.rootRank)], list(tensors), ts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        ts = _Tensors()
        bufs = [_buf(ts.output(t)) for t in tensors]
        name, factor = _reduce_op(opts)
        return self._track(_Work([self._group.reduce(bufs, opts.rootRank, name, factor)], list(tensors), ts))

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        if len(inputs) != 1 or len(output_lists) != 1:
            raise ValueError("cohort: allgather takes one input tensor per rank")
        ts = _Tensors()
        outs = [_out(ts.output(o)) for o in output_lists[0]]
        p = self._group.allgather(_buf(ts.input(inputs[0])), outs)
        return self._track(_Work([p], list(output_lists[0]), ts))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> _Work:
        ts = _Tensors()
        flat = [o for lst in output_lists for o in lst]
        outs = [_out(ts.output(o)) for o in flat]
        p = self._group.allgather_coalesced([_buf(ts.input(t)) for t in inputs], outs)
        return self._track(_Work([p], flat, ts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        ts = _Tensors()
        o = ts.output(output)
        p = self._group.allgather_into_tensor(_buf(ts.input(input)), _buf(o))
        return self._track(_Work([p], [output], ts))

    _allgather_base = all_gather_single
    allgather_into_tensor = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> _Work:
        ts = _Tensors()
        ps = [self._group.allgather_into_tensor(_buf(ts.input(i)), _buf(ts.output(o)))
              for o, i in zip(outputs, inputs, strict=True)]
        return self._track(_Work(ps, list(outputs), ts))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> _Work:
        ts = _Tensors()
        root = opts.rootRank
        outputs = list(output_lists[0]) if output_lists and self._group.rank() == root else []
        p = self._group.gather(_buf(ts.input(inputs[0])), root, [_out(ts.output(o)) for o in outputs])
        return self._track(_Work([p], outputs, ts))

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> _Work:
        ts = _Tensors()
        root = opts.rootRank
        inputs = list(input_lists[0]) if input_lists and self._group.rank() == root else []
        out = ts.output(outputs[0])
        p = self._group.scatter(_buf(out), [_buf(ts.input(t)) for t in inputs], root)
        return self._track(_Work([p], [outputs[0]], ts))

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> _Work:
        ts = _Tensors()
        name, factor = _reduce_op(opts)
        out = ts.output(outputs[0])
        p = self._group.reduce_scatter([_buf(ts.input(t)) for t in input_lists[0]], _out(out), name, factor)
        return self._track(_Work([p], [outputs[0]], ts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Work:
        ts = _Tensors()
        name, factor = _reduce_op(opts)
        out = ts.output(output)
        p = self._group.reduce_scatter_tensor(_buf(ts.input(input)), _buf(out), name, factor)
        return self._track(_Work([p], [output], ts))

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> _Work:
        ts = _Tensors()
        name, factor = _reduce_op(opts)
        ps = [self._group.reduce_scatter_tensor(_buf(ts.input(i)), _buf(ts.output(o)), name, factor)
              for o, i in zip(outputs, inputs, strict=True)]
        return self._track(_Work(ps, list(outputs), ts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        ts = _Tensors()
        outs = [_buf(ts.output(o)) for o in outputs]
        p = self._group.alltoall(outs, [_buf(ts.input(t)) for t in inputs])
        return self._track(_Work([p], list(outputs), ts))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], opts: Any = None) -> _Work:
        ts = _Tensors()
        out = ts.output(output)
        osplits = [s * _row(output) for s in output_splits] if output_splits else None
        isplits = [s * _row(input) for s in input_splits] if input_splits else None
        p = self._group.alltoall_base(_buf(out), _buf(ts.input(input)), osplits, isplits)
        return self._track(_Work([p], [output], ts))

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> _Work:
        return self._track(_Work([self._group.barrier()], [], _Tensors()))

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        secs = _seconds(getattr(opts, "timeout", None)) or _seconds(self._timeout)
        self._group.monitored_barrier(secs, wait_all_ranks)

    # ---- point to point ----

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        ts = _Tensors()
        p = self._group.send(_buf(ts.input(tensors[0])), dst, tag)
        return self._track(_Work([p], list(tensors), ts))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        ts = _Tensors()
        p = self._group.recv(_buf(ts.output(tensors[0])), src, tag)
        return self._track(_Work([p], list(tensors), ts))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        ts = _Tensors()
        p = self._group.recv_anysource(_buf(ts.output(tensors[0])), tag)
        return self._track(_Work([p], list(tensors), ts))


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> CohortBackend:
    return CohortBackend(store, rank, size, timeout)


def _backends() -> list[CohortBackend]:
    with _live_lock:
        alive = [b for b in (r() for r in _live) if b is not None]
        _live[:] = [weakref.ref(b) for b in alive]
    return alive


def dump_flight_recorder(path: str, backend: CohortBackend | None = None) -> str:
    """Write the flight recorder of ``backend`` (default: the first cohort group made, the
    world group under ``init_process_group``) to ``path`` as JSON; return the JSON.

    ``cohort fr analyze DIR`` reads a directory of such dumps, one per rank.
    """
    if backend is None:
        live = _backends()
        if not live:
            raise RuntimeError("cohort: no cohort process group exists")
        backend = live[0]
    text = backend.flight_recorder_json()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


@atexit.register
def _shutdown_all() -> None:
    """Close every group before the interpreter goes: peers see a goodbye, not a crash, and
    no runtime thread calls into Python while it finalizes."""
    for b in _backends():
        try:
            b.shutdown()
        except Exception as e:  # noqa: BLE001 (best effort at exit)
            _log.debug("shutdown at exit failed: %s", e)


def _cohort_backend_of(group: Any) -> CohortBackend | None:
    """The cohort backend behind ``group`` (``None``: the default group), if it has one."""
    try:
        pg = _c10d._group_or_default_group(group)
        backend = pg._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, CohortBackend) else None


_torch_recv = _c10d.recv


@functools.wraps(_torch_recv)
def _recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> int:
    """``dist.recv``, with ``src=None`` on a cohort group answered by cohort.

    torch 2.15's ``recv(src=None)`` asks the handle ``recv_anysource`` returned for its source
    rank, and the C++ handle torch wraps around a Python work forwards only ``wait()`` and
    ``get_future()``, so the question fails there for every Python backend. On a cohort group
    this receives through the backend itself and asks cohort's work; everything else (a given
    source, other backends, tensor subclasses) goes to torch's own ``recv`` unchanged.
    """
    if src is None and group_src is None and not torch.overrides.has_torch_function((tensor,)):
        backend = _cohort_backend_of(group)
        if backend is not None and not _c10d._rank_not_in_group(group):
            _c10d._check_single_tensor(tensor, "tensor")
            if tensor.is_complex():
                tensor = torch.view_as_real(tensor)
            work = backend.recv_anysource([tensor], tag)
            work.wait()
            return _c10d.get_global_rank(_c10d._group_or_default_group(group), work.source_rank())
    return _torch_recv(tensor, src=src, group=group, tag=tag, group_src=group_src)


# `torch.distributed.recv` is the same function object as `distributed_c10d.recv`: both names
# are replaced, so either spelling reaches `_recv`.
_c10d.recv = _recv
dist.recv = _recv

if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
