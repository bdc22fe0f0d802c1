"""What each optimizer step cost: the figures the monitors write and
``wall_clock_breakdown`` prints.

Measured on every rank, on the training thread, when the config asks for
them (a monitor or ``wall_clock_breakdown``); otherwise the engine holds no
``StepMetrics`` and measures nothing.

- Time: a step runs from the end of the previous optimizer step to the end
  of its own. Its parts are exclusive and add up to the total: forward,
  backward and optimizer step (each without the waits inside it), time
  blocked on collectives, on NVMe and on host<->device copies
  (zcore.tracing), and the rest ("other": data loading, the user's code).
  Waiting for the optimizer step that runs behind the forward counts as
  optimizer step.
- Throughput: samples per second from the batch size; tokens from the
  training forwards' token ids (``input_ids``, or the first integer tensor
  argument) times the data-parallel size, since every data-parallel rank
  takes a batch of the same shape (tensor-parallel ranks take the same one,
  and a pipeline's later stages take activations: no tokens there);
  FLOPs counted by torch's FlopCounterMode over the first optimizer step
  (which runs slower for it), then scaled by tokens (or forward calls).
- Memory: zcore's bytes per tier and category (zcore.observe.memory_report), the
  process's resident set, and the activations: the most bytes one forward
  of the step saved for backward (zcore.observe.saved_activations), on the device.
- Loss: the mean over the step's micro-batches of the loss given to
  ``engine.backward``, on this rank.
"""

from __future__ import annotations

import enum
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch

from zcore import tracing
from zcore.observe.flops_profiler import flop_counter
from zcore.observe.memory_report import CATEGORIES, DEVICE, HOST, TIERS, MemoryReport
from zcore.observe.saved_activations import SavedActivations
from zcore.tracing import Wait


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


# The parts of a step's time, in the order they are printed and plotted.
TIME_PARTS = ("forward", "backward", "step", "comm_wait", "nvme_wait", "copy_wait", "other")
_WAIT_PART = {Wait.COMM: "comm_wait", Wait.NVME: "nvme_wait", Wait.COPY: "copy_wait", Wait.STEP: "step"}
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step's figures; ``events`` names them with DeepSpeed's keys."""

    global_step: int  # steps taken, this one included
    global_samples: int
    loss: Optional[float]
    lr: Optional[float]
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool
    skipped_steps: int
    samples_per_second: float
    tokens_per_second: Optional[float]
    tflops: Optional[float]
    time_ms: dict[str, float]  # "total" and TIME_PARTS
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> category -> bytes

    def events(self) -> list[tuple[str, float, int]]:
        """(key, value, samples) as DeepSpeed's monitors take them."""
        values: dict[str, Optional[float]] = {
            "Train/Samples/train_loss": self.loss,
            "Train/Samples/lr": self.lr,
            "Train/Samples/loss_scale": self.loss_scale,
            "Train/Samples/grad_norm": self.grad_norm,
            "Train/Samples/skipped_steps": self.skipped_steps,
            "Train/Samples/samples_per_second": self.samples_per_second,
            "Train/Samples/tokens_per_second": self.tokens_per_second,
            "Train/Samples/tflops": self.tflops,
        }
        for part, ms in self.time_ms.items():
            values[f"Train/Samples/elapsed_time_ms_{part}"] = ms
        for tier, categories in self.memory.items():
            for category, nbytes in categories.items():
                values[f"Memory/{tier}/{category}"] = nbytes
        return [(key, float(v), self.global_samples) for key, v in values.items() if v is not None]

    def breakdown(self) -> str:
        """The step-time split as ``wall_clock_breakdown`` prints it."""
        t = self.time_ms
        line = (
            f"time (ms) | total: {t['total']:.1f} | forward: {t['forward']:.1f} | backward: {t['backward']:.1f} "
            f"| step: {t['step']:.1f} | waiting on collectives: {t['comm_wait']:.1f}, NVMe: {t['nvme_wait']:.1f}, "
            f"copies: {t['copy_wait']:.1f} | other: {t['other']:.1f}"
        )
        rates = [f"{self.samples_per_second:.2f} samples/s"]
        if self.tokens_per_second is not None:
            rates.append(f"{self.tokens_per_second:.0f} tokens/s")
        if self.tflops is not None:
            rates.append(f"{self.tflops:.3g} TFLOPS")
        return f"{line} | {', '.join(rates)}"


class StepMetrics:
    """Measures the steps of one engine (module docstring)."""

    def __init__(self, module: torch.nn.Module, world_size: int, data_parallel_size: int) -> None:
        """FLOPs are counted on each rank of ``world_size``, tokens on each of
        ``data_parallel_size`` (the world, or a mesh's "dp" dimension)."""
        self._world_size = world_size
        self._data_parallel_size = data_parallel_size
        self._activations = SavedActivations(module)
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._waited = 0.0
        self._started: Optional[float] = None  # the step's start: the previous step's end
        self._losses: list[torch.Tensor] = []
        self._tokens = 0  # this rank's, this step
        self._forwards = 0
        self._counted: Optional[float] = None  # FLOPs counted so far in the first step
        self._flops_per_token: Optional[float] = None
        self._flops_per_forward: Optional[float] = None
        self.last: Optional[StepRecord] = None

    # What zcore.tracing calls on this thread during a phase.
    def add_wait(self, kind: Wait, seconds: float) -> None:
        self._seconds[_WAIT_PART[kind]] += seconds
        self._waited += seconds

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Times ``phase`` without the waits inside it (they count as waits)."""
        start, waited = time.perf_counter(), self._waited
        if self._started is None:
            self._started = start
        saving = self._activations.counting() if phase is Phase.FORWARD else nullcontext()
        try:
            with tracing.measuring(self), self._counting(phase), saving:
                yield
        finally:
            self._seconds[phase.value] += time.perf_counter() - start - (self._waited - waited)

    def forward_inputs(self, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation between steps: its tokens are not the step's throughput
        self._forwards += 1
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex():
            self._tokens += ids.numel()

    def loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def drop_losses(self) -> None:
        """The losses of an accumulation window whose gradients were dropped
        (its micro-batches run again); its time and tokens still count."""
        self._losses.clear()

    def end_step(
        self,
        *,
        global_step: int,
        global_samples: int,
        batch_size: int,
        lr: Optional[float],
        grad_norm: Optional[float],
        loss_scale: float,
        skipped: bool,
        skipped_steps: int,
        memory: MemoryReport,
    ) -> StepRecord:
        """After an optimizer step: the record of the step it ended."""
        end = time.perf_counter()
        total = end - (self._started if self._started is not None else end)
        times = {part: self._seconds.get(part, 0.0) for part in TIME_PARTS if part != "other"}
        times["other"] = max(0.0, total - sum(times.values()))
        self._learn_flops()
        tokens = self._tokens * self._data_parallel_size
        flops = self._step_flops()
        record = StepRecord(
            global_step=global_step,
            global_samples=global_samples,
            loss=torch.stack(self._losses).float().mean().item() if self._losses else None,
            lr=lr,
            grad_norm=grad_norm,
            loss_scale=loss_scale,
            skipped=skipped,
            skipped_steps=skipped_steps,
            samples_per_second=batch_size / total if total > 0 else 0.0,
            tokens_per_second=tokens / total if tokens and total > 0 else None,
            tflops=flops / total / 1e12 if flops is not None and total > 0 else None,
            time_ms={"total": total * 1e3, **{part: times[part] * 1e3 for part in TIME_PARTS}},
            memory=self._memory(memory),
        )
        self.last = record
        self._seconds.clear()
        self._losses.clear()
        self._tokens = self._forwards = 0
        self._started = end
        self._activations.reset()
        return record

    # FLOPs: counted while the first step runs, per token (or per forward) after.
    @contextmanager
    def _counting(self, phase: Phase) -> Iterator[None]:
        if phase is Phase.STEP or self._flops_per_forward is not None:
            yield
            return
        counter = flop_counter()  # entering one again would clear its counts
        try:
            with counter:
                yield
        finally:
            self._counted = (self._counted or 0.0) + counter.get_total_flops()

    def _learn_flops(self) -> None:
        if self._counted is None or self._flops_per_forward is not None:
            return
        counted = self._counted * self._world_size
        self._counted = None
        self._flops_per_forward = counted / max(self._forwards, 1)
        self._flops_per_token = counted / (self._tokens * self._data_parallel_size) if self._tokens else None

    def _step_flops(self) -> Optional[float]:
        if self._flops_per_token is not None and self._tokens:
            return self._flops_per_token * self._tokens * self._data_parallel_size
        if self._flops_per_forward is not None and self._flops_per_forward > 0:
            return self._flops_per_forward * self._forwards
        return None

    def _memory(self, report: MemoryReport) -> dict[str, dict[str, int]]:
        memory = {
            tier: {c: getattr(report.measured_tiers[tier], c) for c in CATEGORIES} for tier in TIERS
        }
        memory[DEVICE]["activations"] = self._activations.peak
        with open("/proc/self/statm", "rb") as statm:
            memory[HOST]["process_rss"] = int(statm.read().split()[1]) * _PAGE
        return memory
