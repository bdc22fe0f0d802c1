"""Waiting for collectives in slices, so that a rank left waiting can find
out why (note "ranks out of step" in zcore.engine.rank_calls).

A collective whose peers never join blocks until the process group's
timeout (minutes). Where an engine watches its calls, the thread that
waits on gloo work waits in slices of ``SLICE`` seconds instead, and
between two slices asks the watcher whether to go on: the watcher may
raise (the ranks are out of step), which ends the wait. gloo's own timed
wait cannot serve: on point-to-point work (zcore's all-gather on gloo) a
timed-out wait closes every connection of the process group. So a thread
of ``_WaitThreads`` makes the untimed wait and the caller waits for that
thread, in slices. A wait that completes within its first slice, as every
wait of ranks in step does, asks nothing of the watcher.

NCCL work is never waited for in slices, so engines on NCCL set no
watcher: its ``wait()`` only orders the caller's CUDA stream after the
collective (it does not block), and must run on the caller's thread,
whose current stream it orders.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Protocol, Sequence

SLICE = 1.0  # seconds between two questions to the watcher of a wait that goes on


class Watcher(Protocol):
    """What a wait asks (zcore.engine.rank_calls.EngineCalls)."""

    def before_wait(self) -> None:
        """Raises instead of waiting where the ranks are known to be out of step."""

    def still_waiting(self, seq: int, kind: str, seconds: float) -> None:
        """Called every ``SLICE`` seconds of a wait for collective ``seq``
        (zcore.comm.collectives.issued) of ``kind``: raises to stop waiting."""

    def wait_ended(self, seq: int) -> None:
        """The wait for ``seq`` returned after ``still_waiting`` was called."""


# The watcher of the engine whose call runs now, held weakly (an engine
# dropped without destroy() is collected); None: plain waits.
_watcher: Optional[weakref.ref] = None


def watch(watcher: Optional[Watcher]) -> None:
    """Waits on gloo work from now on ask ``watcher`` (None: they do not)."""
    global _watcher
    _watcher = None if watcher is None else weakref.ref(watcher)


def watching() -> Optional[Watcher]:
    return None if _watcher is None else _watcher()


def wait_all(works: Sequence[Any], seq: int, kind: str) -> None:
    """Waits for every work of collective ``seq`` (``kind``: its name, for
    messages); in slices when a watcher watches (see the module docstring)."""
    watcher = watching()
    if watcher is None or not works:
        for work in works:
            work.wait()
        return
    watcher.before_wait()
    job = _THREADS.start(works)
    waited = 0.0
    while not job.done.wait(SLICE):
        waited += SLICE
        watcher.still_waiting(seq, kind, waited)  # raising leaves the thread waiting: it rejoins the pool once done
    if waited:
        watcher.wait_ended(seq)
    job.raise_failure()


class _Job:
    def __init__(self, works: Sequence[Any]) -> None:
        self.works = works
        self.done = threading.Event()
        self.failure: Optional[BaseException] = None

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


class _WaitThread:
    """A daemon thread that waits for the jobs it is given, one at a time,
    and returns itself to the idle threads after each."""

    def __init__(self, pool: _WaitThreads) -> None:
        self._pool = pool
        self._job: Optional[_Job] = None
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="zcore-comm-wait", daemon=True).start()

    def give(self, job: _Job) -> None:
        with self._ready:
            self._job = job
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._job is not None)
                job, self._job = self._job, None
            try:
                for work in job.works:
                    work.wait()
            except BaseException as exc:  # noqa: BLE001 - raised on the waiting thread
                job.failure = exc
            job.works = ()
            self._pool.rejoin(self)
            job.done.set()


class _WaitThreads:
    """Idle wait threads; a new one when none is idle (one whose wait never
    ends, after the ranks fell out of step, never comes back)."""

    def __init__(self) -> None:
        self._idle: list[_WaitThread] = []
        self._lock = threading.Lock()

    def start(self, works: Sequence[Any]) -> _Job:
        job = _Job(works)
        with self._lock:
            thread = self._idle.pop() if self._idle else None
        (thread or _WaitThread(self)).give(job)
        return job

    def rejoin(self, thread: _WaitThread) -> None:
        with self._lock:
            self._idle.append(thread)


_THREADS = _WaitThreads()
