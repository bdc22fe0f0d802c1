"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle, LRRangeTest.

Same formulas and defaults as DeepSpeed, so a config moves over unchanged.
Each schedule sets ``lr`` in every parameter group of the optimizer on
construction and on each ``step()`` (once per optimizer step).
"""

from __future__ import annotations

import logging
import math

from zcore.config.scheduler import (
    LRRangeTestParams,
    OneCycleParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)

log = logging.getLogger("zcore")


class _Schedule:
    """A position (``last_batch_iteration``, the state a checkpoint keeps)
    and the learning rates ``get_lr`` computes from it."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

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


class _WarmupSchedule(_Schedule):
    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int):
        # As DeepSpeed: at least 2, so the log warm-up is defined.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_fraction(self) -> float:
        if self.warmup_type == "log":
            return math.log(self.last_batch_iteration + 1) / math.log(self.warmup_num_steps)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_WarmupSchedule):
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


class WarmupCosineLR(_WarmupSchedule):
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


class OneCycle(_Schedule):
    """One cycle of the learning rate from cycle_min_lr up to cycle_max_lr
    (cycle_first_step_size steps) and back (cycle_second_step_size steps),
    optionally in stairs, then cycle_min_lr decayed every decay_step_size
    steps. With cycle_momentum, Adam's first beta cycles the other way,
    between cycle_max_mom and cycle_min_mom."""

    # DeepSpeed's OneCycle replaces the second beta with this whenever it
    # cycles the first; kept so that a config trains as it does there.
    SECOND_BETA = 0.99

    def __init__(self, optimizer, params: OneCycleParams):
        groups = len(optimizer.param_groups)
        # Floats, as DeepSpeed: the position within the cycle is float arithmetic.
        self.first_step_size = float(params.cycle_first_step_size)
        second = params.cycle_second_step_size
        self.second_step_size = self.first_step_size if second is None else float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = params.cycle_first_stair_count
        second_stairs = params.cycle_second_stair_count
        self.second_stair_count = self.first_stair_count if second_stairs is None else second_stairs
        self.decay_step_size = params.decay_step_size
        self.min_lrs = [params.cycle_min_lr] * groups
        self.max_lrs = [params.cycle_max_lr] * groups
        self.decay_lr_rate = params.decay_lr_rate
        self.min_moms = [params.cycle_min_mom] * groups
        self.max_moms = [params.cycle_max_mom] * groups
        self.decay_mom_rate = params.decay_mom_rate
        self.cycle_momentum = params.cycle_momentum
        if self.cycle_momentum and not all("betas" in group for group in optimizer.param_groups):
            # As DeepSpeed: only an Adam-like optimizer's momentum is cycled
            # (an SGD's momentum stays), and it says so.
            log.warning(
                "zcore: OneCycle's cycle_momentum is off: the optimizer's parameter groups have no betas "
                "(as in DeepSpeed, only an Adam-like optimizer's momentum is cycled)"
            )
            self.cycle_momentum = False
        super().__init__(optimizer, params.last_batch_iteration)
        self._set_momentum_at_rest()

    def _scale_factor(self) -> float:
        """Where the cycle stands, 0 at cycle_min_lr to 1 at cycle_max_lr:
        DeepSpeed's expression, operation for operation, so that the
        learning rates agree to the last bit."""
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            # Stairs counted from the integer step, not from scale_factor,
            # which can land a hair under a stair's edge.
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale_factor = self._scale_factor()
            return [lo + (hi - lo) * scale_factor for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        decay_factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / decay_factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas the schedule sets at its position; None when it does
        not cycle momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale_factor = self._scale_factor()
            moms = [hi - (hi - lo) * scale_factor for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self.decay_step_size == 0 or self.decay_mom_rate == 0:
            moms = list(self.max_moms)
        else:
            decay_factor = 1 + self.decay_mom_rate * self._decay_interval()
            moms = [hi * decay_factor for hi in self.max_moms]
        return [(mom, self.SECOND_BETA) for mom in moms]

    def _set_betas(self, betas: list[tuple[float, float]]) -> None:
        for group, pair in zip(self.optimizer.param_groups, betas):
            group["betas"] = pair

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._set_betas(self.get_mom())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._set_momentum_at_rest()

    def _set_momentum_at_rest(self) -> None:
        # Before the first step DeepSpeed sets cycle_min_mom, though the
        # cycle (and so the first step) starts at cycle_max_mom; elsewhere the
        # momentum of the position, as the last step set it.
        if not self.cycle_momentum:
            return
        if self.last_batch_iteration == -1:
            self._set_betas([(mom, self.SECOND_BETA) for mom in self.min_moms])
        else:
            self._set_betas(self.get_mom())


class LRRangeTest(_Schedule):
    """The learning rate grows linearly from lr_range_test_min_lr, by
    lr_range_test_step_rate times it every lr_range_test_step_size steps
    (continuously or in stairs), to find the largest that still trains."""

    def __init__(self, optimizer, params: LRRangeTestParams):
        self.min_lrs = [params.lr_range_test_min_lr] * len(optimizer.param_groups)
        self.step_size = params.lr_range_test_step_size
        self.step_rate = params.lr_range_test_step_rate
        self.staircase = params.lr_range_test_staircase
        super().__init__(optimizer, params.last_batch_iteration)

    def _interval(self) -> float:
        intervals = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(intervals) if self.staircase else intervals

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lrs]


SCHEDULES = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
