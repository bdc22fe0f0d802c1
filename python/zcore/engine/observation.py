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

log = logging.getLogger("zcore")
# The per-step breakdown (wall_clock_breakdown): its own logger, so that a
# user's logging can route or silence it apart from zcore's other messages.
step_log = logging.getLogger("zcore.steps")


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
        if metrics is not None and step_log_policy.wall_clock_breakdown and not step_log.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[zcore] %(message)s"))
            step_log.addHandler(handler)
            step_log.setLevel(logging.INFO)

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
        lrs: Callable[[], list[float]],
    ) -> None:
        """An optimizer step ended after ``seconds``; ``memory()`` measures
        what is held now, ``lrs()`` gives each group's learning rate now
        (each called only where it is reported)."""
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
        if self.log.due(figures.global_step):
            log.info(
                "step %d: lr %s, loss scale %g, skipped %d",
                figures.global_step, lrs(), figures.loss_scale, figures.skipped_steps,
            )

    def close(self) -> None:
        if self.flops_profiler is not None:
            self.flops_profiler.close()
        close_all(self.monitors)
        self.monitors = []
