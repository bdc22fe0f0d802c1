"""zcore's work as named ranges in a ``torch.profiler`` trace, and the time
the training thread spends blocked on it, for the step metrics.

Every range is called ``zcore::<name>``: ``all_gather``, ``reduce_scatter``,
``all_reduce``, ``nvme_read``, ``nvme_write``, ``optimizer_step``, inside
it ``optimizer_sub_group`` (one per sub-group streamed from NVMe), and the
waits (``comm_wait``, ``nvme_wait``, ``copy_wait``, ``step_wait``). A range costs one check
when no profiler runs. A wait is timed only on a thread where an engine
measures its step (``measuring``): the optimizer step that runs behind the
forward waits on its own thread, and its waits are not the step's.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Protocol

from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function


class Wait(enum.Enum):
    """What a blocked training thread waits for."""

    COMM = "comm_wait"  # a collective
    NVME = "nvme_wait"  # a read or write of a swap file, or the optimizer step behind the forward
    COPY = "copy_wait"  # a host<->device copy
    STEP = "step_wait"  # the optimizer step running behind the forward (zcore.step.background_step)


class WaitClock(Protocol):
    def add_wait(self, kind: Wait, seconds: float) -> None: ...


_thread = threading.local()  # .clock: the WaitClock measuring on this thread


def span(name: str) -> ContextManager[object]:
    """A ``zcore::<name>`` range while a profiler runs; nothing otherwise."""
    # torch's process-wide flag: torch.autograd._profiler_enabled() is per
    # thread, false on the optimizer step's worker thread and, under
    # profile_all_threads (which records that thread too), on every thread.
    if autograd_profiler._is_profiler_enabled:
        return record_function(f"zcore::{name}")
    return nullcontext()


def waiting(kind: Wait) -> ContextManager[object]:
    """Blocks of the training thread on ``kind``: a range, and its time on
    the clock measuring this thread."""
    clock = getattr(_thread, "clock", None)
    if clock is None:
        return span(kind.value)
    return _TimedWait(kind, clock)


class _TimedWait:
    def __init__(self, kind: Wait, clock: WaitClock) -> None:
        self._kind, self._clock = kind, clock
        self._range = span(kind.value)

    def __enter__(self) -> None:
        self._range.__enter__()
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._clock.add_wait(self._kind, time.perf_counter() - self._start)
        self._range.__exit__(*exc)


@contextmanager
def measuring(clock: WaitClock) -> Iterator[None]:
    """Waits on this thread count on ``clock`` for the duration."""
    previous = getattr(_thread, "clock", None)
    _thread.clock = clock
    try:
        yield
    finally:
        _thread.clock = previous
