"""Muon as a whole-matrix optimizer (zcore.optim.matrix_optimizer), with
``torch.optim.Muon``'s math: momentum and its Nesterov blend element-wise,
the quintic Newton-Schulz iteration in bfloat16 on the whole matrix, then
decoupled weight decay and a step scaled for the matrix's shape. The same
operations in the same order and dtypes, so that results are torch's to the
bit where the inputs are.

``ns_method="gram"`` runs DeepSpeed's Gram Newton-Schulz instead (its
``ns_method: "gram"``, https://tridao.me/blog/2026/gram-newton-schulz/),
with DeepSpeed 0.19.8's numerics: normalised in fp32, iterated in fp16 on
the Gram matrix X·Xᵀ, the shape's scale applied in fp16 (test_muon_gram
holds it against DeepSpeed's own outputs).
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
NS_METHODS = ("standard", "gram")
# The Gram iteration recomputes X and X·Xᵀ from its polynomial Q at this
# step, which keeps fp16's rounding from piling up in Q (DeepSpeed's choice).
GRAM_RESTART = 2


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


def gram_newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:
    """The orthogonalised ``matrix`` (2-D, or a batch of matrices over its
    leading dimensions), in float16: DeepSpeed's Gram Newton-Schulz, the
    same polynomial as ``newton_schulz`` written as Q·X with Q iterated on
    the small square X·Xᵀ of the wide orientation; a square matrix takes
    the plain iteration (no FLOPs to save). Each line is DeepSpeed's
    operation, so that each rounds where DeepSpeed's does."""
    a, b, c = coefficients
    # Normalised before the cast to fp16, whose range ends at 65504.
    x = matrix.float() if matrix.dtype == torch.float16 else matrix
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + eps)).half()
    if x.size(-2) == x.size(-1):
        for _ in range(steps):
            gram = x @ x.mT
            polynomial = b * gram + c * gram @ gram
            x = a * x + polynomial @ x
        return x.mT if tall else x
    gram = x @ x.mT
    q: Optional[torch.Tensor] = None
    for i in range(steps):
        if i == GRAM_RESTART:
            x = q @ x
            gram = x @ x.mT
            q = None
        z = b * gram + c * gram @ gram
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != GRAM_RESTART:
            gram_z = a * gram + z @ gram
            gram = a * gram_z + z @ gram_z
    return x.mT @ q.mT if tall else q @ x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """The step size for a matrix of ``shape`` (torch.optim.Muon's rule)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(MatrixOptimizer):
    """torch.optim.Muon's update (same arguments and defaults), for
    parameters of two or more dimensions (more: as the first dimension by
    the rest), on whole parameters or under ZeRO. ``ns_method``: "standard"
    (torch's iteration) or "gram" (DeepSpeed's, module docstring)."""

    # The iteration's first step casts to it, and it returns it. Gram: fp32,
    # as DeepSpeed normalises the matrix in fp32 before its cast to fp16 (a
    # bf16 matrix would lose bits fp16 keeps), and the fp16 direction comes
    # back exact.
    exchange_dtype = torch.bfloat16
    state_keys = ("momentum_buffer",)

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
        ns_method: str = "standard",
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
        if ns_method not in NS_METHODS:
            raise InvalidArgumentError(f"ns_method={ns_method!r} is not one of {NS_METHODS}", ns_method=ns_method)
        if not 0 < ns_steps < 100:
            raise InvalidArgumentError(f"ns_steps={ns_steps} must lie in [1, 99]", ns_steps=ns_steps)
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        # One method for every group: it fixes the dtype ZeRO exchanges in.
        self.ns_method = ns_method
        if ns_method == "gram":
            self.exchange_dtype = torch.float32
            for group in self.param_groups:
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    raise InvalidArgumentError(
                        "ns_method='gram' scales each step as DeepSpeed does (adjust_lr_fn 'original'), but a "
                        "group has adjust_lr_fn='match_rms_adamw': set it to None or 'original', or use "
                        "ns_method='standard'", adjust_lr_fn=group["adjust_lr_fn"],
                    )

    @classmethod
    def from_torch(cls, optimizer: torch.optim.Optimizer) -> "Muon":
        """This Muon over ``optimizer``'s (a torch.optim.Muon's) parameter
        groups and state, the same objects: a scheduler built on either
        drives both."""
        ours = cls([{**g} for g in optimizer.param_groups], **optimizer.defaults)
        ours.param_groups = optimizer.param_groups
        ours.state = optimizer.state
        return ours

    def cost(self, rows: int, cols: int) -> float:
        """The multiply-adds of one iteration on a rows x cols matrix, with
        m <= n its sides: "standard", ns_steps x (X·Xᵀ, its square, the
        product with X): s(2m²n + m³); "gram" (m < n), X·Xᵀ, its restart and
        the last Q·X (4m²n) and about four m x m products a step (4sm³)."""
        m, n = min(rows, cols), max(rows, cols)
        steps = self.defaults["ns_steps"]
        if self.ns_method == "gram" and m < n:
            return 4 * m * m * n + 4 * steps * m**3
        return steps * (2 * m * m * n + m**3)

    def matrix_view(self, t: torch.Tensor) -> torch.Tensor:
        """The first dimension by the others; "gram" takes a 3-D parameter
        as a batch of matrices, as DeepSpeed's Muon does. (DeepSpeed 0.19.8
        fails on a 4-D one: its update's last torch.where broadcasts the 2-D
        direction against the 4-D gradient.)"""
        return t if self.ns_method == "gram" and t.dim() == 3 else super().matrix_view(t)

    def premix(self, grad: torch.Tensor, state: dict[str, Any], group: dict) -> torch.Tensor:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(grad)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def direction(self, matrix: torch.Tensor, state: dict[str, Any], group: dict) -> torch.Tensor:
        if self.ns_method == "standard":
            return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
        # DeepSpeed scales the fp16 direction for each matrix's shape, not the step size.
        orthogonal = gram_newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
        return orthogonal.mul_(adjusted_lr(1.0, "original", matrix.shape[-2:])).float()

    def apply_(self, param: torch.Tensor, direction: torch.Tensor, group: dict, shape: torch.Size) -> None:
        lr = float(group["lr"])
        param.mul_(1 - lr * group["weight_decay"])
        step_size = lr if self.ns_method == "gram" else adjusted_lr(lr, group["adjust_lr_fn"], shape)
        param.add_(direction, alpha=-step_size)
