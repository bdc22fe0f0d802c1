"""What a rank holds of the model, named per parameter.

A checkpoint records every stored range as (tensor name, first element,
element count) of the *flattened global tensor*, never as an offset into
zcore's flat buffers, so any rank of any layout (world size, stage, unit
size, offload) finds the elements it needs. A ``Slot`` is one such range
on this rank, with a view of where it lives: a piece of an fp32 master shard
(trained parameters), a piece of a frozen ZeRO-3 group's shard, or a whole
frozen parameter or buffer (stages 0-2, buffers in every stage). Ranges on
NVMe have a meta tensor instead of a view (zcore.checkpoint.slot_values).

Under tensor parallelism (zcore.parallel.mesh) a parameter sharded over
"tp" is stored as parts, one tensor per tp rank named ``NAME@tpK`` (its
slice, ranged over the data-parallel ranks as any tensor), and ``NAME``'s
record says which parts join along which dimension; a parameter every tp
rank holds whole is stored once, by the first tp rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from zcore.comm import collectives as comm
from zcore.errors import CheckpointError
from zcore.parallel.dtensor import local_tensor, tp_split
from zcore.zero3.sharded_group import ShardedGroup

TRAINED, FROZEN, BUFFER = "trained", "frozen", "buffer"


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored: fp32 master for trained parameters
    role: str
    # Tensor parallelism: (dimension, part names) the tensor joins from; its
    # values are stored under the parts only.
    parts: Optional[tuple[int, tuple[str, ...]]] = None

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
    module, optimizer = engine.module, engine.optimizer
    # MiCS: ranks of other shard groups hold the same shards; the first group's write them.
    writes_shards = engine.ranks.writes_shards
    mesh = engine.ranks.model_parallel
    first_dp = engine.ranks.data_parallel.rank == 0
    first_tp = mesh is None or mesh.tp_rank == 0
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    layout = EngineLayout(names=names)
    infos: dict[str, TensorInfo] = {}

    def describe_param(p: torch.nn.Parameter, shape: tuple[int, ...], dtype: torch.dtype, role: str) -> str:
        """Records ``p``'s tensor of ``shape`` (its values here; ZeRO-3's
        parameter holds a placeholder), and a DTensor's parts; returns the
        name its values here are stored as."""
        name, split = names[id(p)], tp_split(p)
        if split is None:
            infos[name] = TensorInfo(shape, dtype, role)
            return name
        parts = tuple(f"{name}@tp{k}" for k in range(split.count))
        infos[name] = TensorInfo(tuple(p.shape), dtype, role, (split.dim, parts))
        for part, shape in zip(parts, split.part_shapes(tuple(p.shape))):
            infos[part] = TensorInfo(shape, dtype, role)
        return parts[split.index]

    def distinct_over_tp(p: torch.nn.Parameter) -> bool:
        """Whether this rank's copy is the one its tp ranks write (theirs differ, or it is the first's)."""
        return first_tp or tp_split(p) is not None

    def saves_whole(p: torch.nn.Parameter) -> bool:
        """Whether this rank writes a value every data-parallel rank holds whole."""
        return first_dp and distinct_over_tp(p)

    # An engine without an optimizer (inference) holds trained parameters as
    # frozen ones are held: in the compute dtype, in their groups or modules.
    units = optimizer.units if optimizer is not None else []
    master_dtype = optimizer.precision.master_dtype if optimizer is not None else torch.float32
    for unit, pieces in zip(units, optimizer.master.pieces if optimizer is not None else []):
        replicated = unit.shard_numel == unit.padded_numel
        stored = [describe_param(p, tuple(shape), master_dtype, TRAINED) for p, shape in zip(unit.params, unit.shapes)]
        for meta, piece in zip(unit.pieces, pieces):
            p = unit.params[meta.param_index]
            saves = writes_shards and distinct_over_tp(p) if not replicated else saves_whole(p)
            layout.slots.append(Slot(stored[meta.param_index], meta.param_start, piece.detach(), saves, piece))

    in_units = {id(p) for unit in units for p in unit.params}
    if engine.policies.stage.shards_parameters:
        for group in engine.residency.groups:
            if not group.trainable or optimizer is None:
                stored = [describe_param(p, tuple(shape), group.dtype, FROZEN) for p, shape in zip(group.params, group.shapes)]
                for meta in group.pieces:
                    p = group.params[meta.param_index]
                    if group.in_memory:
                        view = group.local_shard[meta.shard_start : meta.shard_start + meta.numel]
                    else:
                        view = torch.empty(meta.numel, dtype=group.dtype, device="meta")
                    saves = writes_shards and distinct_over_tp(p)
                    layout.slots.append(Slot(stored[meta.param_index], meta.param_start, view, saves,
                                             group=group, shard_start=meta.shard_start))
    else:
        for p in module.parameters():
            if id(p) not in in_units:
                name = describe_param(p, tuple(local_tensor(p).shape), p.dtype, FROZEN)
                layout.slots.append(Slot(name, 0, local_tensor(p).data.view(-1), saves_whole(p)))

    buffer_names: dict[int, str] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        name = names.get(id(t))
        if name is None:  # a persistent buffer, maybe registered under several names
            name = buffer_names.setdefault(id(t), key)
            if name == key:
                infos[key] = TensorInfo(tuple(t.shape), t.dtype, BUFFER)
                layout.slots.append(Slot(key, 0, t.data.view(-1), first_dp and first_tp))
        layout.keys[key] = name
    layout.tensors = {}
    for name in dict.fromkeys(layout.keys.values()):
        layout.tensors[name] = infos[name]
        for part in infos[name].parts[1] if infos[name].parts else ():
            layout.tensors[part] = infos[part]
    layout.groups = [[names[id(p)] for p in params] for params in optimizer.group_params] if optimizer else []
    return layout


def whole_model_layout(engine: Any, layout: EngineLayout) -> EngineLayout:
    """Under pipeline parallelism (zcore.parallel.pipelining), ``layout`` with the
    tensors, state-dict keys and optimizer groups of every stage, which
    meta.json records (collective: every rank calls it); otherwise
    ``layout``. Stages must name their tensors apart, as the whole model
    does."""
    mesh = engine.ranks.model_parallel
    if mesh is None or not mesh.pipelined:
        return layout
    stage = mesh.mesh["pp"].get_local_rank()
    everyone = comm.all_gather_objects((stage, layout.tensors, layout.keys, layout.groups))
    merged = EngineLayout(slots=layout.slots, names=layout.names)
    owner: dict[str, int] = {}
    for theirs, tensors, keys, groups in sorted(everyone, key=lambda e: e[0]):
        for name, info in tensors.items():
            if owner.setdefault(name, theirs) != theirs:
                raise CheckpointError(
                    f"pipeline stages {owner[name]} and {theirs} both hold a tensor named {name!r}: a checkpoint "
                    "names each tensor once for the whole model. Name each stage's parameters and buffers "
                    "as the whole model does (split it with torch.distributed.pipelining, or delete the "
                    "other stages' layers from a copy of the model)"
                )
            merged.tensors[name] = info
        merged.keys.update(keys)
        for i, group in enumerate(groups):
            if i == len(merged.groups):
                merged.groups.append([])
            merged.groups[i].extend(n for n in group if n not in merged.groups[i])
    return merged


def describe(tensors: dict[str, TensorInfo]) -> dict[str, dict]:
    described = {}
    for name, info in tensors.items():
        record: dict[str, Any] = {
            "shape": list(info.shape), "dtype": str(info.dtype).removeprefix("torch."), "role": info.role
        }
        if info.parts is not None:
            record["parts"] = {"dim": info.parts[0], "names": list(info.parts[1])}
        described[name] = record
    return described


def tensor_infos(described: dict[str, Any]) -> dict[str, TensorInfo]:
    """From validated records (zcore.checkpoint.schema.TensorRecord)."""
    return {
        name: TensorInfo(
            tuple(v.shape), getattr(torch, v.dtype), v.role,
            None if v.parts is None else (v.parts.dim, tuple(v.parts.names)),
        )
        for name, v in described.items()
    }


def mismatch(missing: list[str], unexpected: list[str], reshaped: list[str]) -> str:
    """The tensors a checkpoint and a model disagree on, for an error message
    (the first 8 of each kind)."""
    parts = []
    for label, names in (("missing from the checkpoint", missing),
                         ("in the checkpoint but not in the model", unexpected),
                         ("with another shape", reshaped)):
        if names:
            parts.append(f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    return "; ".join(parts)
