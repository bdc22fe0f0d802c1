"""``OneBitAdam``: DeepSpeed's 1-bit Adam (``"type": "OneBitAdam"``).

Two phases (arXiv:2102.02888; deepspeed/runtime/fp16/onebit/adam.py):
- Warm-up, the first ``freeze_step`` steps: Adam on gradients the engine
  averaged over the ranks (no bias correction: zcore.optim.compressed_adam).
- Compression, every later step: the variance ``exp_avg_sq`` stays as the
  warm-up left it; each rank folds its own gradient into its momentum,
  and the momenta are averaged by the 1-bit all-reduce with error
  feedback (zcore.comm.compressed_allreduce), which leaves every rank the same
  momentum, hence the same update.

A parameter group with ``"non_freeze": True`` stays exact in the second
phase: its gradients are averaged uncompressed (by the optimizer, since
the engine's all-reduce is off then) and both moments keep updating, as in
DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from zcore.errors import InvalidArgumentError
from zcore.optim.compressed_adam import CompressedAdam


class OneBitAdam(CompressedAdam):
    """1-bit Adam. ``freeze_step``: exact Adam steps before compression
    (DeepSpeed's default, 100000); the other arguments are Adam's."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100_000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise InvalidArgumentError(
                f"freeze_step={freeze_step!r} must be an integer >= 1: the variance that compression "
                "freezes comes from the warm-up's exact steps"
            )
        super().__init__(params, lr, betas, eps, weight_decay)
        self.freeze_step = freeze_step

    @property
    def compressing(self) -> bool:
        """Whether the coming step is past the warm-up (DeepSpeed switches
        once ``step >= freeze_step`` after a step)."""
        return self.steps_taken >= self.freeze_step

    def takes_averaged_gradients(self) -> bool:
        return not self.compressing

    def compresses(self, group: dict) -> bool:
        return not group.get("non_freeze", False)  # a non_freeze group stays exact (module docstring)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = self._call(closure)
        compressing = self.compressing
        entries = self._entries()
        if compressing:
            self._average_exactly([p.grad for g, p, _ in entries if not self.compresses(g)])
        frozen = []  # (group, parameter, momentum) to average compressed
        for group, p, state in entries:
            beta1, beta2 = group["betas"]
            grad = p.grad
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            if compressing and self.compresses(group):
                frozen.append((group, p, state["exp_avg"]))
            else:
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if compressing:
            self._average_compressed(frozen)
        for group, p, state in entries:
            self._update(group, p, state)
        self.steps_taken += 1
        return loss
