"""Mixed precision: the compute and communication dtypes, and loss scaling.

A policy object per precision (not flags): ``MixedPrecision`` names the dtype
parameters compute in and the dtype gradients are reduced in; its
``scaler`` decides the loss scale and reacts to overflow; and it names the
dtypes of the master weights and of the optimizer's moments: fp32, or bf16
where bf16.bf16_master_weights_and_grads and bf16_optimizer_states ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from zcore.config.schema import Config

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LossScaler(Protocol):
    scale: float
    checks_overflow: bool

    def update(self, overflow: bool) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class NoLossScaler:
    """bf16 and fp32: gradients are not scaled; with ``checks_overflow``
    (bf16.check_grad_overflow) a step whose gradients are not finite is skipped."""

    scale: float = 1.0
    checks_overflow: bool = False

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


@dataclass
class StaticLossScaler:
    """fp16 with a fixed scale: an overflowing step is skipped, the scale stays."""

    scale: float
    checks_overflow: bool = True

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state.get("scale", self.scale)


@dataclass
class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaling.

    On overflow the step is skipped and, once ``hysteresis`` overflows have
    been absorbed, the scale halves (not below ``min_scale``). The scale
    doubles at each ``window``-th step after the first step without
    overflow, as DeepSpeed 0.19.8 does (its 2025 rule; before, the first
    step counted too, so the scale doubled one step earlier).
    """

    scale: float
    window: int
    hysteresis: int
    min_scale: float
    consecutive_hysteresis: bool = False
    checks_overflow: bool = True
    iteration: int = 0
    last_overflow_iteration: int = -1
    hysteresis_left: int = field(init=False)

    def __post_init__(self) -> None:
        self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        """A validated state (zcore.checkpoint.schema.ScalerState): the four
        keys of a dynamic scaler, the scale of a static one, or nothing."""
        self.scale = state.get("scale", self.scale)
        self.iteration = state.get("iteration", self.iteration)
        self.last_overflow_iteration = state.get("last_overflow_iteration", self.last_overflow_iteration)
        self.hysteresis_left = state.get("hysteresis_left", self.hysteresis_left)


@dataclass(frozen=True)
class MixedPrecision:
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    scaler: LossScaler
    cast_buffers: bool = False  # floating-point buffers to compute_dtype too
    master_dtype: torch.dtype = torch.float32  # the master weights and the gradients their optimizer takes
    state_dtype: torch.dtype = torch.float32  # the optimizer's moments


def precision_from_config(config: Config) -> MixedPrecision:
    if config.fp16.enabled:
        fp16 = config.fp16
        scaler: LossScaler
        if fp16.loss_scale > 0:
            scaler = StaticLossScaler(scale=fp16.loss_scale)
        else:
            scaler = DynamicLossScaler(
                scale=2.0**fp16.initial_scale_power,
                window=fp16.loss_scale_window,
                hysteresis=fp16.hysteresis,
                min_scale=fp16.min_loss_scale,
                consecutive_hysteresis=fp16.consecutive_hysteresis,
            )
        compute = torch.float16
        cast_buffers = fp16.cast_buffers
    else:
        scaler = NoLossScaler(checks_overflow=config.bf16.enabled and config.bf16.check_grad_overflow)
        compute = torch.bfloat16 if config.bf16.enabled else torch.float32
        cast_buffers = config.bf16.enabled and config.bf16.cast_buffers
    # Gradients are reduced in fp32 unless the config asks otherwise: summing
    # low-precision gradients over many ranks loses bits or overflows.
    reduce = _DTYPES[config.communication_data_type or "fp32"]
    bf16 = config.bf16
    return MixedPrecision(
        compute_dtype=compute, reduce_dtype=reduce, scaler=scaler, cast_buffers=cast_buffers,
        master_dtype=torch.bfloat16 if bf16.bf16_master_weights_and_grads else torch.float32,
        state_dtype=torch.bfloat16 if bf16.bf16_optimizer_states else torch.float32,
    )
