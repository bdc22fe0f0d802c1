"""The interface of optimizers whose update needs each parameter's whole
matrix (Muon, Shampoo, SOAP), and the optimizer pairing one with an
element-wise optimizer for the other parameters.

A ``MatrixOptimizer`` says its update in three parts, so that ZeRO can run
it on shards (zcore.step.matrix_step) as well as on whole parameters:

1. ``premix(grad, state, group)``, element-wise: folds the gradient into
   the per-element states (Muon's momentum) and returns the matrix the
   whole-matrix part needs (Muon: the Nesterov blend). Under ZeRO each rank
   runs it on its own slice, so these states are sharded and checkpointed
   as Adam's moments are.
2. ``direction(matrix, state, group)``, on the whole matrix as
   ``matrix_view`` shows it (by default 2-D: a parameter of more dimensions
   is viewed as its first dimension by the rest): returns the update's
   direction, of its shape; ``state`` holds what only the
   whole matrix has (Shampoo's preconditioners), as tensors: checkpoints
   hold them whole, written by the owner and read by whichever rank owns
   the matrix at load. Under ZeRO one rank, the matrix's owner, runs it.
3. ``apply_(param, direction, group, shape)``, element-wise: the parameter
   takes its step from the direction (``shape``: the whole parameter's).

``step()`` runs the three in turn on whole parameters: a MatrixOptimizer
is a torch optimizer in a single process too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zcore.errors import InvalidArgumentError


class MatrixOptimizer(torch.optim.Optimizer):
    """Base class: subclasses give ``premix``, ``direction`` and ``apply_``
    (module docstring), and ``direction_dtype``."""

    # The dtype ZeRO sends each matrix to its owner in, and its direction
    # back: ``direction`` must cast its matrix to it first and return it
    # (Muon: bfloat16, halving the bytes and changing no result).
    exchange_dtype: torch.dtype = torch.float32
    # The keys of the per-element states ``premix`` keeps (Muon:
    # momentum_buffer), at most two: with the optimizer's states on NVMe they
    # rest where Adam's two moments do (zcore.step.swapped_matrix), which
    # refuses a premix that keeps one not declared here.
    state_keys: tuple[str, ...] = ()

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        # Whole-matrix states in a single process, by parameter (under ZeRO,
        # each matrix's owner keeps its own: zcore.step.matrix_step).
        self.whole_states: dict[torch.Tensor, dict[str, Any]] = {}

    def cost(self, rows: int, cols: int) -> float:
        """The relative cost of one ``direction`` on a rows x cols matrix,
        which ZeRO balances the owners by: Newton-Schulz's m·n·min(m, n) here."""
        return rows * cols * min(rows, cols)

    def matrix_view(self, t: torch.Tensor) -> torch.Tensor:
        """The whole parameter-shaped ``t`` as ``direction`` takes it."""
        return as_matrix(t)

    def premix(self, grad: torch.Tensor, state: dict[str, Any], group: dict) -> torch.Tensor:
        raise NotImplementedError

    def direction(self, matrix: torch.Tensor, state: dict[str, Any], group: dict) -> torch.Tensor:
        raise NotImplementedError

    def apply_(self, param: torch.Tensor, direction: torch.Tensor, group: dict, shape: torch.Size) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_matrix_params(type(self).__name__, self.param_groups)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                mixed = self.premix(p.grad, self.state[p], group)
                direction = self.direction(self.matrix_view(mixed), self.whole_states.setdefault(p, {}), group)
                self.apply_(p, direction.view(p.shape), group, p.shape)
        return loss


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D matrix a whole-matrix update sees: its first
    dimension by the others (a convolution's filters as rows)."""
    return t.reshape(t.shape[0], -1)


def check_matrix_params(optimizer: str, groups: list[dict]) -> None:
    """Whole-matrix updates take parameters of two or more dimensions
    (``optimizer``: its name, for the message)."""
    for group in groups:
        for p in group["params"]:
            if p.dim() < 2:
                raise InvalidArgumentError(
                    f"{optimizer} updates whole matrices, but a parameter of shape {tuple(p.shape)} has fewer "
                    "than 2 dimensions: give it to the element-wise optimizer (AdamW) instead",
                    shape=tuple(p.shape),
                )


class MatrixAndElementwise(torch.optim.Optimizer):
    """A whole-matrix optimizer over some parameters and an element-wise one
    (AdamW) over the rest, as one torch optimizer: its parameter groups are
    the matrix optimizer's, then the element-wise one's (the same dicts: a
    scheduler on either changes both), and one state dict serves both."""

    def __init__(self, matrix: MatrixOptimizer, elementwise: Optional[torch.optim.Optimizer]) -> None:
        self.matrix = matrix
        self.elementwise = elementwise
        groups = list(matrix.param_groups) + (list(elementwise.param_groups) if elementwise is not None else [])
        super().__init__(groups, {})
        # The parts' groups are this optimizer's (re-pointing one re-points both).
        self.param_groups = groups
        matrix.state = self.state
        if elementwise is not None:
            elementwise.state = self.state

    @property
    def matrix_groups(self) -> int:
        """The first groups, which are the matrix optimizer's."""
        return len(self.matrix.param_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.matrix.step()
        if self.elementwise is not None:
            self.elementwise.step()
        return loss
