"""``engine.full_state_dict()``: the whole model on rank 0, in process.

Gathered one unit (or ZeRO-3 group) at a time, so that the other ranks
never hold more than their shards and rank 0 never holds more than the
result plus one unit; states on NVMe are read a unit at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from zcore import arguments
from zcore.checkpoint.layout import EngineLayout, engine_layout
from zcore.errors import InvalidStateError
from zcore.step.swapped_optimizer import SwappedMaster
from zcore.comm.topology import RankGroup


def refuse_model_parallel(engine: Any, what: str) -> None:
    """Whole tensors are gathered over the world as the data-parallel
    ranks; tensor-parallel parts and other pipeline stages would need more."""
    mesh = engine.ranks.model_parallel
    if mesh is not None and (mesh.tp_size > 1 or mesh.pipelined):
        raise InvalidStateError(
            f"{what} does not support a device_mesh of \"dp\" with \"tp\" or \"pp\" yet; save a checkpoint "
            "(engine.save_checkpoint) and turn it into one state dict with `zcore consolidate`"
        )


def full_state_dict(engine: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The whole model's state dict (fp32 master weights in ``dtype``,
    frozen parameters, buffers) on rank 0, gathered one unit at a time; an
    empty dict on the other ranks. Collective: call it on every rank."""
    dtype = arguments.dtype(dtype, "dtype", arguments.FLOATING_DTYPES)
    refuse_model_parallel(engine, "engine.full_state_dict()")
    layout = engine_layout(engine)
    values = dict(full_state_tensors(engine, layout, dtype))
    if engine.context.rank != 0:
        return {}
    return {key: values[name] for key, name in layout.keys.items()}


def full_state_tensors(
    engine: Any, layout: EngineLayout, dtype: torch.dtype, failures: Optional[list[BaseException]] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(tensor name, whole value: floating point in ``dtype``) of every
    tensor in ``layout``, in ``tensor_order``'s order, on rank 0, each a
    copy of its own. Every rank must run it to the end (the gathers); the
    others yield nothing. With ``failures``, a shard this rank cannot read
    (an NVMe error) is recorded there and zeros take its place in the
    gathers, so that no rank is left waiting in one."""
    rank = engine.context.rank
    holders = _holders_of_rank_0s_shards(engine)
    done = set()
    shards = _shards(engine) if failures is None else _shards_or_zeros(engine, failures)
    for unit, shard in shards:
        # Offloaded shards (master, parameters) rest on the host; the
        # collective's backend (NCCL on a GPU) needs them on the device.
        full = _gather(shard.to(engine.context.device), unit.padded_numel, rank, holders)
        if rank == 0:
            for i, p in enumerate(unit.params):
                done.add(layout.names[id(p)])
                yield layout.names[id(p)], _cast(unit.param_slice(full, i).view(unit.shapes[i]), dtype)
        del full  # before the next unit's is gathered
    if rank == 0:
        for name in _whole_slots(layout, done):  # whole frozen parameters (stages 0-2) and buffers
            slot = next(s for s in layout.slots if s.name == name)
            yield name, _cast(slot.data.view(layout.tensors[name].shape), dtype)


def tensor_order(engine: Any, layout: EngineLayout) -> list[str]:
    """The tensor names in the order ``full_state_tensors`` yields them."""
    gathered = [layout.names[id(p)] for unit in _units(engine) for p in unit.params]
    return gathered + _whole_slots(layout, set(gathered))


def _whole_slots(layout: EngineLayout, gathered: set[str]) -> list[str]:
    return list(dict.fromkeys(s.name for s in layout.slots if s.name not in gathered))


def _cast(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value.to("cpu", dtype if value.is_floating_point() else value.dtype, copy=True)


def _shards_or_zeros(engine: Any, failures: list[BaseException]) -> Iterator[tuple[Any, torch.Tensor]]:
    read: Optional[Iterator[tuple[Any, torch.Tensor]]] = _shards(engine)
    trained = {id(u) for u in engine.optimizer.units} if engine.optimizer is not None else set()
    master_dtype = engine.optimizer.precision.master_dtype if engine.optimizer is not None else torch.float32
    for unit in _units(engine):
        shard = None
        if read is not None:
            try:
                _, shard = next(read)
            except Exception as exc:  # noqa: BLE001 - reported by the caller on every rank
                failures.append(exc)
                read = None
        if shard is None:  # what the others gather: masters in theirs, frozen groups in their dtype
            shard = torch.zeros(unit.shard_numel, dtype=master_dtype if id(unit) in trained else unit.dtype)
        yield unit, shard


def _units(engine: Any) -> Iterator[Any]:
    """The units whose shards ``_shards`` yields, in its order."""
    optimizer = engine.optimizer
    if optimizer is not None:
        yield from optimizer.units
    if engine.policies.stage.shards_parameters:
        for g in engine.residency.groups:
            if not g.trainable or optimizer is None:
                yield g


def _shards(engine: Any) -> Iterator[tuple[Any, torch.Tensor]]:
    """Each unit's master shard, then (stage 3) each frozen group's
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


def _holders_of_rank_0s_shards(engine: Any) -> Optional[RankGroup]:
    """The ranks whose shards make up rank 0's units: the world, or with
    MiCS rank 0's shard group (the other groups hold copies of the same
    shards, and take no part: None on their ranks)."""
    if not engine.policies.stage.shards_parameters:
        return RankGroup.world()
    shard = engine.residency.shard
    if shard.group is None or 0 in dist.get_process_group_ranks(shard.group):
        return shard
    return None


def _gather(shard: torch.Tensor, padded_numel: int, rank: int, holders: Optional[RankGroup]) -> torch.Tensor:
    if shard.numel() == padded_numel or holders is None:  # unsharded (stage 0, a world of one), or not a holder
        return shard
    # Straight into one buffer: no concatenated copy beside the parts.
    full = torch.empty(padded_numel, dtype=shard.dtype, device=shard.device) if rank == 0 else None
    parts = list(full.view(-1, shard.numel()).unbind(0)) if rank == 0 else None
    dist.gather(shard.contiguous(), parts, dst=0, group=holders.group)  # dst: the global rank
    return full if rank == 0 else shard
