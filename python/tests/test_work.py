"""The torch-facing ``Work`` alone, with stand-ins for cohort's works: no process group."""

from __future__ import annotations

import threading
import time

import torch

from cohort_torch import _Tensors, _Work


class _Pending:
    """A cohort work that is done at once, and whose completion callback runs on a thread of
    its own (as cohort's runtime runs it), right away."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def on_done(self, callback) -> None:
        t = threading.Thread(target=callback)
        self.threads.append(t)
        t.start()

    def wait(self, _secs) -> bool:
        return True

    def exception(self) -> str | None:
        return None

    def is_completed(self) -> bool:
        return True


def test_wait_leaves_the_future_done_while_the_completion_thread_is_still_finishing() -> None:
    pending = _Pending()
    entered = threading.Event()

    def slow_after() -> None:
        # The completion thread is in the middle of finishing the work when `wait()` comes.
        entered.set()
        time.sleep(0.3)

    value = [torch.ones(2)]
    work = _Work([pending], value, _Tensors(), after=slow_after)
    assert entered.wait(5), "the completion thread started finishing"
    assert work.wait()
    assert work.get_future().done(), "wait() returned before the future was complete"
    assert work.get_future().value() is value
    for t in pending.threads:
        t.join()


def test_a_callback_of_the_future_may_wait_on_its_own_work() -> None:
    pending = _Pending()
    seen: list[bool] = []
    work: _Work | None = None
    ready = threading.Event()
    done = threading.Event()

    def after() -> None:
        ready.wait(5)

    work = _Work([pending], [torch.zeros(1)], _Tensors(), after=after)

    def callback(fut: torch.futures.Future) -> None:
        # Runs on the completion thread, inside the work's finishing: no deadlock.
        seen.append(work.wait())
        done.set()

    work.get_future().add_done_callback(callback)
    ready.set()
    assert done.wait(5), "the callback's wait() returned"
    assert seen == [True]
    for t in pending.threads:
        t.join()
