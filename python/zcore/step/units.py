"""The flat layout of trainable parameters: units, shards and pieces.

Trainable parameters are packed, whole and in order, into *units* of at most
``reduce_bucket_size`` elements (a larger parameter gets a unit of its own).
Each unit is one flat buffer in the compute dtype, padded to a multiple of
the number of shards, and the parameters become views into it. Shard ``r`` of
a unit is the ``r``-th equal slice: one reduce-scatter per unit hands every
rank exactly its shard of the gradients, and one all-gather per unit
rebuilds the parameters from the shards. A *piece* is the part of one
parameter that falls inside this rank's shard; the optimizer updates pieces,
so a parameter without a gradient is skipped exactly as torch.optim skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from zcore.parallel.dtensor import local_tensor, point_at


@dataclass(frozen=True)
class Piece:
    param_index: int  # position of the parameter in its unit
    shard_start: int  # first element within this rank's shard
    param_start: int  # first element within the flattened parameter
    numel: int


class Unit(Protocol):
    """What the reducer and the optimizer need of a group of parameters laid
    out flat and padded to a multiple of the shard count: stages 0-2 keep the
    whole buffer (FlatUnit), stage 3 only this rank's shard (ShardedGroup)."""

    params: list[torch.nn.Parameter]
    shapes: list[torch.Size]  # the parameters' full shapes (a DTensor's: its local slice's)
    pieces: list[Piece]
    numel: int
    padded_numel: int
    shard_numel: int

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, where the optimizer writes."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def param_slice(self, flat: torch.Tensor, param_index: int) -> torch.Tensor: ...


def pieces_of(offsets: list[int], numels: list[int], lo: int, hi: int) -> list[Piece]:
    """The parts of parameters at ``offsets`` that fall in the shard [lo, hi)."""
    pieces = []
    for i, (offset, numel) in enumerate(zip(offsets, numels)):
        start, end = max(lo, offset), min(hi, offset + numel)
        if start < end:
            pieces.append(Piece(i, start - lo, start - offset, end - start))
    return pieces


class FlatUnit:
    """A group of whole parameters stored in one flat buffer."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        num_shards: int,
        shard_index: int,
        device: torch.device,
    ) -> None:
        self.params = params
        local = [local_tensor(p) for p in params]  # a DTensor's slice on this rank (zcore.parallel.mesh)
        self.shapes = [t.shape for t in local]
        self.num_shards = num_shards
        self.shard_index = shard_index
        self.offsets = []
        total = 0
        for t in local:
            self.offsets.append(total)
            total += t.numel()
        self.numel = total
        self.padded_numel = -(-total // num_shards) * num_shards
        self.shard_numel = self.padded_numel // num_shards
        self.shard_start = shard_index * self.shard_numel
        dtype = local[0].dtype
        self.flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for t, offset in zip(local, self.offsets):
                self.flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
        self._point_params_at(self.flat)
        self.pieces = pieces_of(
            self.offsets, [t.numel() for t in local], self.shard_start, self.shard_start + self.shard_numel
        )

    def _point_params_at(self, flat: torch.Tensor) -> None:
        for p, offset, shape in zip(self.params, self.offsets, self.shapes):
            point_at(p, flat[offset : offset + shape.numel()].view(shape))

    def cast_(self, dtype: torch.dtype) -> None:
        """Re-store the flat buffer (and the parameter views) in ``dtype``."""
        if dtype != self.flat.dtype:
            self.flat = self.flat.to(dtype)
            self._point_params_at(self.flat)

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a unit-sized flat tensor."""
        return flat[self.shard_start : self.shard_start + self.shard_numel]

    @property
    def local_shard(self) -> torch.Tensor:
        return self.shard(self.flat)

    @property
    def device(self) -> torch.device:
        return self.flat.device

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def param_slice(self, flat: torch.Tensor, param_index: int) -> torch.Tensor:
        offset = self.offsets[param_index]
        return flat[offset : offset + self.shapes[param_index].numel()]


# Reductions overlap with backward one unit at a time, so units stay small
# enough to pipeline even when reduce_bucket_size is DeepSpeed's default 5e8.
MAX_UNIT_NUMEL = 1 << 22


def pack_units(
    params: list[torch.nn.Parameter],
    bucket_numel: int,
    num_shards: int,
    shard_index: int,
    device: torch.device,
    alone: frozenset[int] = frozenset(),
) -> list[FlatUnit]:
    """Whole parameters, in order, into units of at most ``bucket_numel``
    (and MAX_UNIT_NUMEL) elements; a parameter whose id is in ``alone`` in
    a unit of its own (a weight tied across pipeline stages: zcore.parallel.pipelining)."""
    bucket_numel = min(bucket_numel, MAX_UNIT_NUMEL)
    units: list[FlatUnit] = []
    current: list[torch.nn.Parameter] = []
    current_numel = 0
    for p in params:
        numel = local_tensor(p).numel()
        if current and (current_numel + numel > bucket_numel or id(p) in alone or id(current[-1]) in alone):
            units.append(FlatUnit(current, num_shards, shard_index, device))
            current, current_numel = [], 0
        current.append(p)
        current_numel += numel
    if current:
        units.append(FlatUnit(current, num_shards, shard_index, device))
    return units
