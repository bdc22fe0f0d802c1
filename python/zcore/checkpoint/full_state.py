"""``engine.full_state_dict()``: the whole model on rank 0, in process.

Gathered one unit (or ZeRO-3 group) at a time, so that the other ranks
never hold more than their shards and rank 0 never holds more than the
result plus one unit; states on NVMe are read a unit at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zcore.checkpoint.layout import engine_layout
from zcore.swapped_optimizer import SwappedMaster


def full_state_dict(engine: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    layout = engine_layout(engine)
    rank = engine.context.rank
    values: dict[str, torch.Tensor] = {}
    for unit, shard in _shards(engine):
        # Offloaded shards (master, parameters) rest on the host; the
        # collective's backend (NCCL on a GPU) needs them on the device.
        full = _gather(shard.to(engine.context.device), unit.padded_numel, rank)
        if rank == 0:
            for i, p in enumerate(unit.params):
                values[layout.names[id(p)]] = unit.param_slice(full, i).view(unit.shapes[i]).cpu().clone()
    if rank != 0:
        return {}
    for slot in layout.slots:  # whole frozen parameters (stages 0-2) and buffers
        if slot.name not in values:
            values[slot.name] = slot.data.view(layout.tensors[slot.name].shape).cpu().clone()
    cast = {n: (v.to(dtype) if v.is_floating_point() else v) for n, v in values.items()}
    return {key: cast[name] for key, name in layout.keys.items()}


def _shards(engine: Any) -> Iterator[tuple[Any, torch.Tensor]]:
    """Each unit's fp32 master shard, then (stage 3) each frozen group's
    shard, one at a time: read from NVMe where they rest there."""
    optimizer = engine.optimizer  # None: an inference engine, its groups in the compute dtype
    if optimizer is not None and isinstance(optimizer.master, SwappedMaster):
        for u, shard in optimizer.master.read_units():
            yield optimizer.units[u], shard
    elif optimizer is not None:
        yield from zip(optimizer.units, optimizer.master.shards)
    if engine.policies.stage.shards_parameters:
        for g in engine.residency.groups:
            if not g.trainable or optimizer is None:
                yield g, engine.residency.read_shard(g.index)


def _gather(shard: torch.Tensor, padded_numel: int, rank: int) -> torch.Tensor:
    if shard.numel() == padded_numel:  # unsharded (stage 0 or a world of one)
        return shard
    parts = [torch.empty_like(shard) for _ in range(padded_numel // shard.numel())] if rank == 0 else None
    dist.gather(shard.contiguous(), parts, dst=0)
    return torch.cat(parts) if rank == 0 else shard
