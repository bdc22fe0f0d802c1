"""What the engine measures and reports about its steps: step metrics and
the monitors they feed (only when a monitor or wall_clock_breakdown asks for
them), DeepSpeed's flops profiler at its one step, and the periodic step
log. The engine calls it at each point of a step; it decides what, if
anything, to record there."""

from __future__ import annotations

import logging
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from zcore.observe.flops_profiler import FlopsProfiler, FlopsReport, ProfilerState
from zcore.observe.memory_report import MemoryReport
from zcore.observe.monitors import close_all
from zcore.observe.step_metrics import Phase, StepMetrics, StepRecord

# Per-step lines (the progress line every steps_per_print steps, and
# wall_clock_breakdown's time split): their own logger, so that a user's
# logging can route or silence them apart from zcore's other messages.
step_log = logging.getLogger("zcore.steps")


class _StderrUnlessHandled(logging.Handler):
    """Prints the step lines to stderr (as ``[zcore] ...``) where nothing
    else would handle them: once the user's logging has a handler on the
    way (``zcore.steps``, ``zcore`` or the root logger), the line is theirs
    alone, also when they configure logging after zcore.initialize."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("[zcore] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _other_handler(self):
            return
        try:
            # sys.stderr now, not at construction: it may have been replaced since.
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's contract: a handler reports its own failure, never raises
            self.handleError(record)


def _other_handler(own: logging.Handler) -> bool:
    logger: Optional[logging.Logger] = step_log
    while logger is not None:
        if any(handler is not own for handler in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def _print_step_lines() -> None:
    """Step lines print by default (see _StderrUnlessHandled), at INFO
    unless the user set the logger's level."""
    if not any(isinstance(h, _StderrUnlessHandled) for h in step_log.handlers):
        step_log.addHandler(_StderrUnlessHandled())
    if step_log.level == logging.NOTSET:
        step_log.setLevel(logging.INFO)


@dataclass(frozen=True)
class StepLog:
    """Which steps are logged (``steps_per_print``), by which rank, and
    whether each logs its time breakdown (``wall_clock_breakdown``)."""

    rank: int
    steps_per_print: int
    wall_clock_breakdown: bool

    def due(self, global_step: int) -> bool:
        return self.rank == 0 and global_step % self.steps_per_print == 0


@dataclass(frozen=True)
class StepFigures:
    """What the engine knows of an optimizer step when it ends."""

    global_step: int
    global_samples: int
    batch_size: int
    lr: Optional[float]
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool
    skipped_steps: int


class StepObservation:
    def __init__(
        self,
        metrics: Optional[StepMetrics],
        monitors: list,
        flops_profiler: Optional[FlopsProfiler],
        step_log_policy: StepLog,
    ) -> None:
        self.metrics = metrics
        self.monitors = monitors
        self.flops_profiler = flops_profiler
        self.flops_report: Optional[FlopsReport] = None
        self.log = step_log_policy
        if step_log_policy.rank == 0:
            _print_step_lines()

    @property
    def records_steps(self) -> bool:
        return self.metrics is not None

    @property
    def last(self) -> Optional[StepRecord]:
        return None if self.metrics is None else self.metrics.last

    def before_forward(self, global_step: int, args: tuple, kwargs: dict) -> None:
        """The profiler starts with the forward of its step."""
        profiler = self.flops_profiler
        if profiler is not None and profiler.state is ProfilerState.WAITING and profiler.profiles(global_step):
            profiler.start()
        if self.metrics is not None:
            self.metrics.forward_inputs(args, kwargs)

    def phase(self, phase: Phase) -> Any:
        return self.metrics.phase(phase) if self.metrics is not None else nullcontext()

    def loss(self, loss: torch.Tensor) -> None:
        if self.metrics is not None:
            self.metrics.loss(loss)

    def drop_window(self) -> None:
        """The accumulation window's micro-batches were dropped: so are their losses."""
        if self.metrics is not None:
            self.metrics.drop_losses()

    @property
    def profiling(self) -> bool:
        """Whether the step now running is the profiled one."""
        return self.flops_profiler is not None and self.flops_profiler.state is ProfilerState.PROFILING

    def end_step(
        self,
        figures: StepFigures,
        seconds: float,
        profiled: bool,
        memory: Callable[[], MemoryReport],
    ) -> None:
        """An optimizer step ended after ``seconds``; ``memory()`` measures
        what is held now (called only where it is recorded)."""
        if self.metrics is not None:
            record = self.metrics.end_step(
                global_step=figures.global_step,
                global_samples=figures.global_samples,
                batch_size=figures.batch_size,
                lr=figures.lr,
                grad_norm=figures.grad_norm,
                loss_scale=figures.loss_scale,
                skipped=figures.skipped,
                skipped_steps=figures.skipped_steps,
                memory=memory(),
            )
            events = record.events()
            for monitor in self.monitors:
                monitor.write(events)
            if self.log.wall_clock_breakdown and self.log.due(figures.global_step):
                step_log.info("step %d: %s", figures.global_step, record.breakdown())
        if profiled:
            assert self.flops_profiler is not None
            self.flops_report = self.flops_profiler.stop(step_seconds=seconds)

    def report_progress(
        self, global_step: int, skipped_steps: int, lr: Callable[[], list], mom: Callable[[], list]
    ) -> None:
        """DeepSpeed's progress line (its engine's _report_progress), on
        rank 0 every steps_per_print steps, skipped steps counted: called
        once a step is counted and the learning-rate schedule has moved, so
        ``lr()`` is the next step's, as DeepSpeed prints it. ``lr()`` and
        ``mom()`` (the engine's get_lr and get_mom) are called only then."""
        if self.log.due(global_step):
            step_log.info("step=%d, skipped=%d, lr=%s, mom=%s", global_step, skipped_steps, lr(), mom())

    def close(self) -> None:
        if self.flops_profiler is not None:
            self.flops_profiler.close()
        close_all(self.monitors)
        self.monitors = []
