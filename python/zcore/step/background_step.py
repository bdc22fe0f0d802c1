"""The part of an optimizer step that runs behind the next forward.

With the optimizer states on NVMe at stage 3, a step is mostly disk
traffic: every sub-group is read, updated and written back. When every
unit's shard is updated in place in host memory, nothing but the next use
of a unit's parameters depends on its update, so the step streams the
sub-groups on a worker thread and returns; the next forward waits for each
unit just before gathering it (``wait_unit``) and raises the worker's
failure once done, and anything that needs the whole step (backward, the
next step, checkpoints) waits for all of it (``finish``). The worker only
reads and writes the optimizer's own swap files and host memory that
nothing else touches until then; collectives and the parameter
coordinator stay on the caller's thread.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Optional

from zcore import tracing
from zcore.errors import InvalidStateError
from zcore.tracing import Wait


class StepState(enum.Enum):
    IDLE = "idle"  # no step in flight
    RUNNING = "running"  # the worker streams the sub-groups
    FAILED = "failed"  # the worker raised: the states are partly updated


class BackgroundStep:
    def __init__(self) -> None:
        self.state = StepState.IDLE
        self.failure: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._done: set[int] = set()  # units whose update is complete
        self._ended = False  # the worker returned or raised
        self._thread: Optional[threading.Thread] = None

    def start(self, work: Callable[[Callable[[int], None]], None]) -> None:
        """IDLE -> RUNNING: ``work(report)`` runs on a worker thread and calls
        ``report(unit)`` as each unit's update is complete."""
        if self.state is not StepState.IDLE:
            raise InvalidStateError(f"an optimizer step cannot start while the last one is {self.state.value}")
        self._done.clear()
        self._ended = False
        self.state = StepState.RUNNING
        self._thread = threading.Thread(target=self._run, args=(work,), name="zcore-optimizer-step", daemon=True)
        self._thread.start()

    def wait_unit(self, unit: int) -> None:
        """Until ``unit``'s update is complete, or the worker has failed
        (at once when no step runs). It raises nothing, so that a forward's
        plan is never cut short: the forward checks ``failed`` once done."""
        if self.state is StepState.RUNNING:
            with self._cond, tracing.waiting(Wait.STEP):
                self._cond.wait_for(lambda: unit in self._done or self._ended)

    @property
    def failed(self) -> bool:
        """The worker raised (``finish`` raises it again)."""
        return self.failure is not None

    def finish(self) -> None:
        """RUNNING -> IDLE once the worker is done, or -> FAILED, raising
        what the worker raised. A FAILED step raises it again."""
        if self.state is StepState.RUNNING:
            assert self._thread is not None
            with tracing.waiting(Wait.STEP):
                self._thread.join()
            self._thread = None
            self.state = StepState.FAILED if self.failure is not None else StepState.IDLE
            if self.failure is not None:
                raise self.failure
        self._raise_failure()

    def reset(self) -> None:
        """FAILED -> IDLE: every state was replaced (a checkpoint load)."""
        self.finish_quietly()
        self.state, self.failure = StepState.IDLE, None

    def finish_quietly(self) -> None:
        """Waits for the worker, leaving a failure recorded but not raised."""
        try:
            self.finish()
        except BaseException:  # noqa: BLE001 - recorded in self.failure
            pass

    def _raise_failure(self) -> None:
        if self.state is StepState.FAILED:
            raise InvalidStateError(
                f"the last optimizer step failed part-way ({type(self.failure).__name__}: {self.failure}), "
                "so the parameters and optimizer states are partly updated; remove the cause, then load the "
                "last checkpoint"
            ) from self.failure

    def _run(self, work: Callable[[Callable[[int], None]], None]) -> None:
        try:
            work(self._report)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread by finish()
            self.failure = exc
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _report(self, unit: int) -> None:
        with self._cond:
            self._done.add(unit)
            self._cond.notify_all()
