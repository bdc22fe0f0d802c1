"""Muon as a whole-matrix optimizer (zcore.optim.matrix_optimizer), with
``torch.optim.Muon``'s math: momentum and its Nesterov blend element-wise,
the quintic Newton-Schulz iteration in bfloat16 on the whole matrix, then
decoupled weight decay and a step scaled for the matrix's shape. The same
operations in the same order and dtypes, so that results are torch's to the
bit where the inputs are.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from zcore.errors import InvalidArgumentError
from zcore.optim.matrix_optimizer import MatrixOptimizer

# torch.optim.Muon's defaults (Keller Jordan's coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:
    """The orthogonalised ``matrix`` (2-D), in bfloat16: torch.optim.Muon's
    iteration, on the wide orientation, after scaling to norm at most 1."""
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """The step size for a matrix of ``shape`` (torch.optim.Muon's rule)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(MatrixOptimizer):
    """torch.optim.Muon's update (same arguments and defaults), for
    parameters of two or more dimensions (more: as the first dimension by
    the rest), on whole parameters or under ZeRO."""

    exchange_dtype = torch.bfloat16  # the iteration's first step casts to it, and it returns it

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise InvalidArgumentError(
                f"Muon takes lr, momentum and weight_decay >= 0, got lr={lr}, momentum={momentum}, "
                f"weight_decay={weight_decay}", lr=lr, momentum=momentum, weight_decay=weight_decay,
            )
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise InvalidArgumentError(
                f"adjust_lr_fn={adjust_lr_fn!r} is not one of {ADJUST_LR_FNS}", adjust_lr_fn=adjust_lr_fn
            )
        if not 0 < ns_steps < 100:
            raise InvalidArgumentError(f"ns_steps={ns_steps} must lie in [1, 99]", ns_steps=ns_steps)
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)

    @classmethod
    def from_torch(cls, optimizer: torch.optim.Optimizer) -> "Muon":
        """This Muon over ``optimizer``'s (a torch.optim.Muon's) parameter
        groups and state, the same objects: a scheduler built on either
        drives both."""
        ours = cls([{**g} for g in optimizer.param_groups], **optimizer.defaults)
        ours.param_groups = optimizer.param_groups
        ours.state = optimizer.state
        return ours

    def premix(self, grad: torch.Tensor, state: dict[str, Any], group: dict) -> torch.Tensor:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(grad)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def direction(self, matrix: torch.Tensor, state: dict[str, Any], group: dict) -> torch.Tensor:
        return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def apply_(self, param: torch.Tensor, direction: torch.Tensor, group: dict, shape: torch.Size) -> None:
        lr = float(group["lr"])
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(direction, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))
