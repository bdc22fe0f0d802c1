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
every module that has it lists its group among the groups it needs. Trained
and frozen parameters (and parameters of different dtypes) go to separate
groups, so a trained group is exactly a unit of the reducer and optimizer,
and frozen ones take no gradient or optimizer memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zcore.errors import InvalidStateError
from zcore.partition import Piece, pieces_of


class ShardedGroup:
    """Satisfies zcore.partition.Unit for the reducer and the optimizer."""

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        num_shards: int,
        shard_index: int,
        device: torch.device,
    ) -> None:
        self.index = index  # the coordinator's group id
        self.params = params
        self.trainable = params[0].requires_grad
        self.shapes = [p.shape for p in params]
        self._strides = [torch.empty(shape, device="meta").stride() for shape in self.shapes]  # contiguous
        self.numels = [p.numel() for p in params]
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.padded_numel = -(-total // num_shards) * num_shards
        self.shard_numel = self.padded_numel // num_shards
        self.shard_start = shard_index * self.shard_numel
        self.pieces: list[Piece] = pieces_of(
            self.offsets, self.numels, self.shard_start, self.shard_start + self.shard_numel
        )
        dtype = params[0].dtype
        self._device = device
        # This rank's shard; on the compute device unless zcore.shard_store
        # moved it to host memory or NVMe (parameter offload).
        self._shard: Optional[torch.Tensor] = torch.zeros(self.shard_numel, dtype=dtype, device=device)
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
                "through the engine's shard store (zcore.shard_store.ShardStore)"
            )
        return self._shard

    @local_shard.setter
    def local_shard(self, shard: Optional[torch.Tensor]) -> None:
        """None: the shard now rests on NVMe (zcore.shard_store)."""
        self._shard = shard

    @property
    def in_memory(self) -> bool:
        return self._shard is not None

    def take_shard_of(self, param_index: int, full: torch.Tensor) -> None:
        """Copies this rank's part of parameter ``param_index`` from ``full``
        (the parameter's whole value) into the local shard."""
        flat = full.detach().reshape(-1)
        for piece in self.pieces:
            if piece.param_index == param_index:
                self.local_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(
                    flat[piece.param_start : piece.param_start + piece.numel]
                )

    def point_params_at(self, full: torch.Tensor) -> None:
        """Parameters become views into ``full`` (padded_numel elements)."""
        base = full.storage_offset()
        for p, offset, shape, stride in zip(self.params, self.offsets, self.shapes, self._strides):
            p.data = full.as_strided(shape, stride, base + offset)  # one op; a slice and a view are two

    def release_params(self) -> None:
        for p in self.params:
            p.data = self._placeholder

    def cast_(self, dtype: torch.dtype) -> None:
        if dtype != self.dtype:
            self.local_shard = self.local_shard.to(dtype)
            self._dtype = dtype
            self._placeholder = self._placeholder.to(dtype)
            self.release_params()

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a group-sized flat tensor."""
        return full[self.shard_start : self.shard_start + self.shard_numel]

    def param_slice(self, flat: torch.Tensor, param_index: int) -> torch.Tensor:
        offset = self.offsets[param_index]
        return flat[offset : offset + self.numels[param_index]]


@dataclass(frozen=True)
class GroupPlan:
    """Who owns what, before any group is built."""

    owned: list[tuple[str, torch.nn.Module, list[list[torch.nn.Parameter]]]]  # per module: its groups' params
    uses: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]  # per module: every direct param


def plan_groups(model: torch.nn.Module) -> GroupPlan:
    owner: set[int] = set()
    owned, uses = [], []
    for name, module in model.named_modules():
        direct = list(module.parameters(recurse=False))
        if not direct:
            continue
        kinds: dict[tuple[bool, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in direct:
            if id(p) not in owner:
                owner.add(id(p))
                kinds.setdefault((p.requires_grad, p.dtype), []).append(p)
        owned.append((name, module, list(kinds.values())))
        uses.append((module, direct))
    return GroupPlan(owned=owned, uses=uses)


def build_groups(
    plan: GroupPlan,
    num_shards: int,
    shard_index: int,
    device: torch.device,
    synchronise: bool,
    materialise: Optional[Callable[[str, torch.nn.Module, list[torch.nn.Parameter]], None]] = None,
) -> tuple[list[ShardedGroup], list[tuple[torch.nn.Module, list[int]]]]:
    """The groups, each keeping this rank's shard of its parameters' current
    values (rank 0's when ``synchronise``), and per module with parameters
    the ids of the groups it needs. Full values are dropped group by group;
    ``materialise(name, module, owned)`` first gives a meta module's owned
    parameters their values (zcore.meta_init)."""
    groups: list[ShardedGroup] = []
    group_of: dict[int, int] = {}
    for name, module, kinds in plan.owned:
        if materialise is not None:
            materialise(name, module, [p for params in kinds for p in params])
        for params in kinds:
            group = ShardedGroup(len(groups), params, num_shards, shard_index, device)
            with torch.no_grad():
                for i, p in enumerate(params):
                    full = p.detach().to(device)
                    if synchronise:
                        # Every rank starts from rank 0's weights, as DDP and DeepSpeed do.
                        torch.distributed.broadcast(full, src=0)
                    group.take_shard_of(i, full)
            group.release_params()
            groups.append(group)
            group_of.update((id(p), group.index) for p in params)
    modules = [
        (module, list(dict.fromkeys(group_of[id(p)] for p in direct))) for module, direct in plan.uses
    ]
    return groups, modules
