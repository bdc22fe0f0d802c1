"""What a rank holds of the model, named per parameter.

A checkpoint records every stored range as (tensor name, first element,
element count) of the *flattened global tensor*, never as an offset into
zcore's flat buffers, so any rank of any layout (world size, stage, unit
size, offload) finds the elements it needs. A ``Slot`` is one such range
on this rank, with a view of where it lives: a piece of an fp32 master shard
(trained parameters), a piece of a frozen ZeRO-3 group's shard, or a whole
frozen parameter or buffer (stages 0-2, buffers in every stage). Ranges on
NVMe have a meta tensor instead of a view (zcore.checkpoint.slot_values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from zcore.sharded_group import ShardedGroup

TRAINED, FROZEN, BUFFER = "trained", "frozen", "buffer"


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored: fp32 master for trained parameters
    role: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slot:
    name: str
    start: int  # first element of the flattened tensor
    data: torch.Tensor  # 1-D view of where the range lives on this rank
    saves: bool  # this rank writes it (one rank writes a replicated range)
    piece: Optional[torch.nn.Parameter] = None  # trained: the optimizer's parameter
    # Stage 3 frozen: the group whose shard holds the range, from element
    # shard_start. A shard on NVMe has no view: ``data`` is then a meta
    # tensor of the range's size (zcore.checkpoint.slot_values reads it).
    group: Optional[ShardedGroup] = None
    shard_start: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.data.numel()


@dataclass
class EngineLayout:
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # in state_dict order
    keys: dict[str, str] = field(default_factory=dict)  # state_dict key -> tensor name (tied aliases)
    slots: list[Slot] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)  # optimizer groups, by parameter name
    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its first name

    def slots_of(self, role: str) -> list[Slot]:
        return [s for s in self.slots if self.tensors[s.name].role == role]


def engine_layout(engine: Any) -> EngineLayout:
    module, optimizer, rank = engine.module, engine.optimizer, engine.context.rank
    # MiCS: ranks of other shard groups hold the same shards; the first group's write them.
    writes_shards = engine.ranks.writes_shards
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    layout = EngineLayout(names=names)
    infos: dict[str, TensorInfo] = {}

    # An engine without an optimizer (inference) holds trained parameters as
    # frozen ones are held: in the compute dtype, in their groups or modules.
    units = optimizer.units if optimizer is not None else []
    for unit, pieces in zip(units, optimizer.master.pieces if optimizer is not None else []):
        replicated = unit.shard_numel == unit.padded_numel
        for i, p in enumerate(unit.params):
            infos[names[id(p)]] = TensorInfo(tuple(unit.shapes[i]), torch.float32, TRAINED)
        for meta, piece in zip(unit.pieces, pieces):
            name = names[id(unit.params[meta.param_index])]
            saves = writes_shards if not replicated else rank == 0
            layout.slots.append(Slot(name, meta.param_start, piece.detach(), saves, piece))

    in_units = {id(p) for unit in units for p in unit.params}
    if engine.policies.stage.shards_parameters:
        for group in engine.residency.groups:
            if not group.trainable or optimizer is None:
                _add_frozen_group(layout, infos, names, group, writes_shards)
    else:
        for p in module.parameters():
            if id(p) not in in_units:
                name = names[id(p)]
                infos[name] = TensorInfo(tuple(p.shape), p.dtype, FROZEN)
                layout.slots.append(Slot(name, 0, p.data.view(-1), rank == 0))

    buffer_names: dict[int, str] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        name = names.get(id(t))
        if name is None:  # a persistent buffer, maybe registered under several names
            name = buffer_names.setdefault(id(t), key)
            if name == key:
                infos[key] = TensorInfo(tuple(t.shape), t.dtype, BUFFER)
                layout.slots.append(Slot(key, 0, t.data.view(-1), rank == 0))
        layout.keys[key] = name
    layout.tensors = {name: infos[name] for name in dict.fromkeys(layout.keys.values())}
    layout.groups = [[names[id(p)] for p in params] for params in optimizer.group_params] if optimizer else []
    return layout


def _add_frozen_group(
    layout: EngineLayout, infos: dict[str, TensorInfo], names: dict[int, str], group: ShardedGroup, saves: bool
) -> None:
    for i, p in enumerate(group.params):
        infos[names[id(p)]] = TensorInfo(tuple(group.shapes[i]), group.dtype, FROZEN)
    for meta in group.pieces:
        name = names[id(group.params[meta.param_index])]
        if group.in_memory:
            view = group.local_shard[meta.shard_start : meta.shard_start + meta.numel]
        else:
            view = torch.empty(meta.numel, dtype=group.dtype, device="meta")
        layout.slots.append(Slot(name, meta.param_start, view, saves, group=group, shard_start=meta.shard_start))


def describe(tensors: dict[str, TensorInfo]) -> dict[str, dict]:
    return {
        name: {"shape": list(info.shape), "dtype": str(info.dtype).removeprefix("torch."), "role": info.role}
        for name, info in tensors.items()
    }


def tensor_infos(described: dict[str, Any]) -> dict[str, TensorInfo]:
    """From validated records (zcore.checkpoint.schema.TensorRecord)."""
    return {name: TensorInfo(tuple(v.shape), getattr(torch, v.dtype), v.role) for name, v in described.items()}
