"""DTensor parameters as zcore holds them: a DTensor's values live in its
local tensor (this rank's slice), so zcore's flat buffers hold local tensors
and a parameter is re-pointed by replacing that local tensor (torch has no
public setter; ``.data`` on a DTensor would drop its sharding)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch


def dtensor_module() -> Optional[ModuleType]:
    """torch's DTensor module where it is loaded, else None. A model holding
    DTensors has loaded it; importing it here would cost every ``import
    zcore`` 0.7 s. torch 2.4 keeps it private."""
    return sys.modules.get("torch.distributed.tensor") or sys.modules.get("torch.distributed._tensor")


def is_dtensor(t: object) -> bool:
    module = dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def dtensor(local: torch.Tensor, spec: object, requires_grad: bool) -> torch.Tensor:
    """A DTensor of ``local`` placed as ``spec`` (a DTensor's ``_spec``)."""
    module = dtensor_module()
    assert module is not None, "a DTensor's spec exists only where its module is loaded"
    return module.DTensor(local, spec, requires_grad=requires_grad)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t``: a DTensor's local slice, or ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def point_at(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """``param`` computes with ``values`` (shaped as its local tensor) from now on."""
    if is_dtensor(param):
        param._local_tensor = values
    else:
        param.data = values


def local_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``'s gradient, laid out as ``param``'s
    local tensor (a DTensor gradient placed otherwise is redistributed
    first: a collective over the parameter's mesh, in the same order on
    every rank as autograd's hooks run)."""
    if not is_dtensor(grad):
        return grad
    if grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param``'s slices differ across tensor-parallel ranks."""
    return is_dtensor(param) and any(isinstance(p, dtensor_module().Shard) for p in param.placements)


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a parameter sharded over tp is cut: along ``dim`` into ``count``
    parts as torch.chunk cuts (DTensor's Shard), this rank holding ``index``."""

    dim: int
    index: int
    count: int

    def part_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Each part's shape, for the whole tensor's ``shape``."""
        size = shape[self.dim]
        chunk = -(-size // self.count)
        return [
            (*shape[: self.dim], max(0, min(chunk, size - k * chunk)), *shape[self.dim + 1 :])
            for k in range(self.count)
        ]


def tp_split(param: torch.Tensor) -> Optional[TensorParallelSplit]:
    """How ``param`` is cut over tp; None when every tp rank holds it whole."""
    if not tp_sharded(param):
        return None
    (placement,) = param.placements  # one mesh dimension: check_parameters holds it
    mesh = param.device_mesh
    return TensorParallelSplit(placement.dim, mesh.get_local_rank(), mesh.size())
