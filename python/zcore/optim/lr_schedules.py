"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR.

Same formulas and defaults as DeepSpeed, so a config moves over unchanged.
Each schedule sets ``lr`` in every parameter group of the optimizer on
construction and on each ``step()`` (once per optimizer step).
"""

from __future__ import annotations

import math

from zcore.config.schema import (
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)


class _Schedule:
    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int):
        self.optimizer = optimizer
        # As DeepSpeed: at least 2, so the log warm-up is defined.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def _warmup_fraction(self) -> float:
        if self.warmup_type == "log":
            return math.log(self.last_batch_iteration + 1) / math.log(self.warmup_num_steps)
        return self.last_batch_iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._apply()


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps, then constant."""

    def __init__(self, optimizer, params: WarmupLRParams):
        groups = len(optimizer.param_groups)
        self.min_lrs = [params.warmup_min_lr] * groups
        max_lr = params.warmup_max_lr
        if max_lr is None:
            max_lr = optimizer.param_groups[0]["lr"]
        self.max_lrs = [max_lr] * groups
        super().__init__(
            optimizer, params.warmup_num_steps, params.warmup_type, params.last_batch_iteration
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, params: WarmupDecayLRParams):
        self.total_num_steps = params.total_num_steps
        super().__init__(optimizer, params)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's initial lr: warm-up from warmup_min_ratio to 1,
    then cosine decay to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer, params: WarmupCosineLRParams):
        self.total_num_steps = params.total_num_steps
        self.warmup_min_ratio = params.warmup_min_ratio
        self.cos_min_ratio = params.cos_min_ratio
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(
            optimizer, params.warmup_num_steps, params.warmup_type, params.last_batch_iteration
        )

    def _ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self._ratio()
        return [lr * ratio for lr in self.base_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
