"""``ZeroOneAdam``: DeepSpeed's 0/1 Adam (``"type": "ZeroOneAdam"``).

Two phases (arXiv:2202.06009; deepspeed/runtime/fp16/onebit/zoadam.py),
steps numbered from 1 as the optimizer takes them:

- Variance phase, steps 1 to ``var_freeze_step + 1``. Step s updates the
  variance when s is a multiple of the current interval, on gradients the
  engine averaged; the interval starts at 1 and doubles after every
  ``var_update_scaler`` such updates. The steps between take each rank's
  own gradient, averaged by the 1-bit all-reduce with error feedback, into
  the momentum only.
- Local phase, the steps after (the variance frozen). Each rank steps on
  its own gradient and momentum, and sums the learning rates. Step s
  synchronises when s is a multiple of the local interval: each rank's
  drift since the last synchronisation (the paper's u, the sum of its
  updates) is turned into momentum units (times ``sqrt(exp_avg_sq) +
  eps``) and averaged by the 1-bit all-reduce; every rank goes back to the
  last synchronised parameters and applies the average, and the momentum
  becomes the average divided by minus the learning-rate sum. The local
  interval starts at 1 and doubles, up to ``local_step_clipper``, after
  every ``local_step_scaler`` local steps. Between synchronisations the
  ranks' parameters differ; after one they are equal again.

DeepSpeed sums each rank's updates in a buffer and subtracts it to go
back; zcore keeps the synchronised parameters instead (the same memory)
and takes the drift as their difference: the same values but for
rounding, except that going back is exact, so the ranks' parameters stay
bit-identical from one synchronisation to the next instead of drifting
apart by rounding.

The error buffers start from zero again when the local phase begins (they
held gradients; now they hold updates), as in DeepSpeed. The intervals
are the optimizer's, not each parameter's: one engine decides, for all
parameters at once, whether a step's gradients are averaged.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from zcore.errors import InvalidArgumentError
from zcore.optim.compressed_adam import CompressedAdam, Entry


class Phase(enum.Enum):
    """Which rule the coming step follows."""

    VARIANCE = "variance"  # variance at exponentially spaced steps, 1-bit gradients between
    LOCAL = "local"  # variance frozen: local steps, synchronised at growing intervals


@dataclass
class Intervals:
    """The schedule's counters (DeepSpeed's per-parameter scalars, one set
    here); a checkpoint load starts them afresh, as DeepSpeed's does."""

    var_interval: int = 1  # the variance is updated on steps that are multiples of it
    var_counter: int = 0  # variance updates at the current interval
    local_step_interval: int = 1  # local phase: synchronise on steps that are multiples of it
    local_step_counter: int = 0  # local steps at the current interval


class ZeroOneAdam(CompressedAdam):
    """0/1 Adam, with DeepSpeed's arguments and defaults."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100_000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
    ) -> None:
        for name, value, low in (
            ("var_freeze_step", var_freeze_step, 0),
            ("var_update_scaler", var_update_scaler, 1),
            ("local_step_scaler", local_step_scaler, 1),
            ("local_step_clipper", local_step_clipper, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= {low}", **{name: value})
        super().__init__(params, lr, betas, eps, weight_decay)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.intervals = Intervals()
        # Local phase, per parameter: its values at the last synchronisation
        # (in place of DeepSpeed's momentum_accumulator) and the sum of the
        # learning rates since.
        self.synchronised: dict[torch.Tensor, torch.Tensor] = {}
        self.lr_sums: dict[torch.Tensor, float] = {}

    @property
    def phase(self) -> Phase:
        """The coming step's (DeepSpeed freezes after a step numbered above var_freeze_step)."""
        return Phase.LOCAL if self.steps_taken > self.var_freeze_step else Phase.VARIANCE

    def _updates_variance(self) -> bool:
        """Variance phase: whether the coming step updates the variance."""
        return (self.steps_taken + 1) % self.intervals.var_interval == 0

    def takes_averaged_gradients(self) -> bool:
        return self.phase is Phase.VARIANCE and self._updates_variance()

    def held_tensors(self) -> list[torch.Tensor]:
        """The error feedback, and in the local phase each parameter's
        values at the last synchronisation."""
        return [*super().held_tensors(), *self.synchronised.values()]

    def restart_from_loaded_state(self) -> None:
        super().restart_from_loaded_state()
        self.intervals = Intervals()
        self.synchronised.clear()  # the loaded parameters are the synchronised ones
        self.lr_sums.clear()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = self._call(closure)
        entries = self._entries()
        if self.phase is Phase.VARIANCE:
            self._variance_step(entries)
        else:
            self._local_step(entries)
        self.steps_taken += 1
        if self.steps_taken == self.var_freeze_step + 1:
            for error in self.errors.values():  # from gradients to updates: start afresh
                error.zero_()
        return loss

    def _variance_step(self, entries: list[Entry]) -> None:
        updates_variance = self._updates_variance()
        if not updates_variance:
            self._average_compressed([(group, p, p.grad) for group, p, _ in entries])
        for group, p, state in entries:
            beta1, beta2 = group["betas"]
            grad = p.grad
            if updates_variance:
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            self._update(group, p, state)
        if updates_variance:
            counts = self.intervals
            counts.var_counter += 1
            if counts.var_counter == self.var_update_scaler:
                counts.var_counter = 0
                counts.var_interval *= 2

    def _local_step(self, entries: list[Entry]) -> None:
        synchronises = (self.steps_taken + 1) % self.intervals.local_step_interval == 0
        for group, p, state in entries:
            if p not in self.synchronised:  # the phase's first step, or the first after a load
                self.synchronised[p] = p.detach().clone()
            beta1, _ = group["betas"]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            self.lr_sums[p] = self.lr_sums.get(p, 0.0) + group["lr"]
            self._update(group, p, state)
        if synchronises:
            self._synchronise(entries)
        counts = self.intervals
        counts.local_step_counter += 1
        if counts.local_step_counter == self.local_step_scaler:
            counts.local_step_counter = 0
            counts.local_step_interval = min(self.local_step_clipper, counts.local_step_interval * 2)

    def _synchronise(self, entries: list[Entry]) -> None:
        """Every rank back at the last synchronised parameters, then the
        ranks' drifts, averaged in momentum units, applied."""
        for group, p, state in entries:
            last = self.synchronised[p]
            drift = p - last
            p.copy_(last)
            # The buffer holds the drift in momentum units until the new parameters are known.
            torch.mul(drift, state["exp_avg_sq"].sqrt().add_(group["eps"]), out=last)
        self._average_compressed([(group, p, self.synchronised[p]) for group, p, _ in entries])
        for group, p, state in entries:
            averaged = self.synchronised[p]
            lr_sum = self.lr_sums.pop(p)
            if lr_sum > 0.0:  # a learning rate of 0 throughout moved nothing (DeepSpeed divides by 0)
                torch.div(averaged, -lr_sum, out=state["exp_avg"])
            p.add_(averaged / state["exp_avg_sq"].sqrt().add_(group["eps"]))
            averaged.copy_(p)
