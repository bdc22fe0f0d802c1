"""ZeRO-3's parameter groups: one module's own parameters, stored sharded.

A group is laid out as a FlatUnit is (whole parameters in order, padded to a
multiple of the world size, rank r owning slice r), but a rank stores only
its shard, in the compute dtype. The full buffer exists only while the
coordinator has the group gathered; the parameters are then views into it,
and otherwise point at an empty placeholder. Their shapes live here, never
on the Parameter objects.

Which parameters form which group (``plan_groups``): the direct parameters
of each module, in ``named_modules()`` order; a Parameter shared by several
modules (a tied embedding and LM head) belongs to the first that has it, and
every module that has it lists its group among the groups it needs. A leaf
module (zcore.zero3.leaf_modules) needs the groups of its whole subtree and
the modules inside it need none: they are not hooked. The groups are the
same with or without leaves, so the shards and checkpoints are too. Trained
and frozen parameters (and parameters of different dtypes) go to separate
groups, so a trained group is exactly a unit of the reducer and optimizer,
and frozen ones take no gradient or optimizer memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zcore.comm import collectives as comm
from zcore.errors import InvalidStateError
from zcore.parallel.dtensor import local_tensor, point_at
from zcore.step.units import Piece, pieces_of
from zcore.zero3.leaf_modules import z3_leaf_module
from zcore.comm.topology import RankGroup


class ShardedGroup:
    """Satisfies zcore.step.units.Unit for the reducer and the optimizer."""

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        num_shards: int,
        shard_index: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """``dtype``: the shard's (the compute dtype for floating-point
        parameters). The shard has no values until ``local_shard`` is set
        (zcore.zero3.sharded_group.fill_groups)."""
        self.index = index  # the coordinator's group id
        self.params = params
        self.trainable = params[0].requires_grad
        # A DTensor's: its local slice on this rank (zcore.parallel.mesh).
        self.shapes = [local_tensor(p).shape for p in params]
        self._strides = [torch.empty(shape, device="meta").stride() for shape in self.shapes]  # contiguous
        self.numels = [shape.numel() for shape in self.shapes]
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        # At least one element per shard: a module whose parameters are all
        # empty still forms a group, and the coordinator and collectives take
        # no empty one (the padding is never read).
        self.padded_numel = max(-(-total // num_shards), 1) * num_shards
        self.shard_numel = self.padded_numel // num_shards
        self.shard_start = shard_index * self.shard_numel
        self.pieces: list[Piece] = pieces_of(
            self.offsets, self.numels, self.shard_start, self.shard_start + self.shard_numel
        )
        self._device = device
        # This rank's shard; on the compute device unless zcore.zero3.shard_store
        # moved it to host memory or NVMe (parameter offload).
        self._shard: Optional[torch.Tensor] = None
        self._dtype = dtype
        self._placeholder = torch.empty(0, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        """The compute device, where the gathered parameters live."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's shard in memory (device or host), updated in place."""
        if self._shard is None:
            raise InvalidStateError(
                f"group {self.index}'s shard rests on NVMe, not in memory: read and write it "
                "through the engine's shard store (zcore.zero3.shard_store.ShardStore)"
            )
        return self._shard

    @local_shard.setter
    def local_shard(self, shard: Optional[torch.Tensor]) -> None:
        """None: the shard now rests on NVMe (zcore.zero3.shard_store)."""
        if shard is not None and (shard.dtype != self._dtype or shard.shape != (self.shard_numel,)):
            raise InvalidStateError(
                f"group {self.index}'s shard is {self.shard_numel} elements of {self._dtype}, "
                f"not {tuple(shard.shape)} of {shard.dtype}"
            )
        self._shard = shard

    @property
    def in_memory(self) -> bool:
        return self._shard is not None

    def copy_shard_of(self, param_index: int, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Copies this rank's part of parameter ``param_index`` from ``full``
        (the parameter's whole value) into ``shard`` (shard_numel elements)."""
        flat = full.detach().reshape(-1)
        for piece in self.pieces:
            if piece.param_index == param_index:
                shard[piece.shard_start : piece.shard_start + piece.numel].copy_(
                    flat[piece.param_start : piece.param_start + piece.numel]
                )

    def point_params_at(self, full: torch.Tensor) -> None:
        """Parameters become views into ``full`` (padded_numel elements)."""
        base = full.storage_offset()
        for p, offset, shape, stride in zip(self.params, self.offsets, self.shapes, self._strides):
            point_at(p, full.as_strided(shape, stride, base + offset))  # one op; a slice and a view are two

    def release_params(self) -> None:
        for p in self.params:
            point_at(p, self._placeholder)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a group-sized flat tensor."""
        return full[self.shard_start : self.shard_start + self.shard_numel]

    def param_slice(self, flat: torch.Tensor, param_index: int) -> torch.Tensor:
        offset = self.offsets[param_index]
        return flat[offset : offset + self.numels[param_index]]


@dataclass(frozen=True)
class GroupPlan:
    """Who owns what, before any group is built."""

    model: torch.nn.Module
    # Per module that owns parameters or meta buffers (zcore.zero3.meta_init
    # materialises those), in named_modules() order: its groups' params.
    owned: list[tuple[str, torch.nn.Module, list[list[torch.nn.Parameter]]]]
    # Per module to hook: every param it needs (direct ones; a leaf's: its subtree's).
    uses: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]


def plan_groups(model: torch.nn.Module, alone: frozenset[int] = frozenset()) -> GroupPlan:
    """``alone``: ids of parameters that get a group of their own (a weight
    tied across pipeline stages, whose gradient is summed with its copies')."""
    owner: set[int] = set()
    owned, uses = [], []
    inside_leaf: set[int] = set()  # ids of the modules within a leaf's subtree, the leaf excluded
    for name, module in model.named_modules():
        direct = list(module.parameters(recurse=False))
        kinds: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in direct:
            if id(p) not in owner:
                owner.add(id(p))
                kind = (p.requires_grad, p.dtype, id(p) if id(p) in alone else None)
                kinds.setdefault(kind, []).append(p)
        if kinds or any(b.is_meta for b in module.buffers(recurse=False)):
            owned.append((name, module, list(kinds.values())))
        if id(module) in inside_leaf:
            continue
        if z3_leaf_module(module):
            inside_leaf.update(id(m) for m in module.modules() if m is not module)
            direct = list(module.parameters())
        if direct:
            uses.append((module, direct))
    return GroupPlan(model=model, owned=owned, uses=uses)


def build_groups(
    plan: GroupPlan, num_shards: int, shard_index: int, device: torch.device, compute_dtype: torch.dtype
) -> tuple[list[ShardedGroup], list[tuple[torch.nn.Module, list[int]]]]:
    """The groups, without values yet (``fill_groups`` gives them), their
    floating-point shards in ``compute_dtype``; and per module with
    parameters the ids of the groups it needs."""
    groups: list[ShardedGroup] = []
    group_of: dict[int, int] = {}
    for _, _, kinds in plan.owned:
        for params in kinds:
            dtype = compute_dtype if params[0].is_floating_point() else params[0].dtype
            groups.append(ShardedGroup(len(groups), params, num_shards, shard_index, device, dtype))
            group_of.update((id(p), len(groups) - 1) for p in params)
    modules = [
        (module, list(dict.fromkeys(group_of[id(p)] for p in direct))) for module, direct in plan.uses
    ]
    return groups, modules


def fill_groups(
    plan: GroupPlan,
    groups: list[ShardedGroup],
    synchronise: Optional[RankGroup],
    place: Callable[[ShardedGroup, torch.Tensor], None],
    materialise: Optional[Callable[[str, torch.nn.Module, list[torch.nn.Parameter]], None]] = None,
) -> None:
    """Module by module: ``materialise(name, module, owned)`` first gives a
    meta module's owned parameters and buffers their values (zcore.zero3.meta_init),
    then each of its groups takes this rank's shard of them (the values of
    the first rank of ``synchronise``, when given) and ``place(group, values)``
    gets that shard, in
    the parameters' own dtype, to keep. Full values are dropped group by
    group, so memory holds one module's parameters at a time beyond the
    shards."""
    built = iter(groups)
    for name, module, kinds in plan.owned:
        if materialise is not None:
            materialise(name, module, [p for params in kinds for p in params])
        for params in kinds:
            group = next(built)
            shard = torch.zeros(group.shard_numel, dtype=params[0].dtype, device=group.device)
            with torch.no_grad():
                for i, p in enumerate(params):
                    full = local_tensor(p).detach().to(group.device)
                    if synchronise is not None:
                        # Every rank starts from the first rank's weights, as DDP and DeepSpeed do.
                        comm.broadcast_from_rank0([full], synchronise.group)
                    group.copy_shard_of(i, full, shard)
            group.release_params()
            place(group, shard)
