"""Where each rank sits: nodes of ranks, as a torch ``DeviceMesh``.

Hierarchical layouts (hpZ's secondary partition, MiCS's shard and
replica groups, a gradient reduction that crosses nodes once) need to know
which ranks share a node. zcore reads it from a 2-D mesh: dimension 0
across nodes ("node"), dimension 1 within a node ("local"). The user can
pass one to ``zcore.initialize(device_mesh=...)`` (a 1-D mesh is one
node); otherwise zcore builds ``(world / LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE)``
in global rank order, as torchrun numbers ranks node by node. On one
machine, a launcher that sets LOCAL_WORLD_SIZE below the world size (or a
mesh) simulates several nodes.

Every process group here is created on every rank in the same order (torch
requires it), so each method is a collective the first time it is called
with given arguments; later calls return the group made then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zcore.errors import ConfigError


NODE, LOCAL = "node", "local"


@dataclass(frozen=True)
class RankGroup:
    """Ranks a collective runs over: ``group`` (None: the world), their
    number, and this rank's index among them."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int

    @staticmethod
    def world() -> RankGroup:
        return RankGroup(None, dist.get_world_size(), dist.get_rank())


class Topology:
    """Nodes x ranks per node, over the ranks of ``mesh`` in its order."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        grid = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]) if mesh.ndim == 2 else mesh.mesh.reshape(1, -1)
        self.nodes, self.local_size = grid.shape
        self.order: list[int] = grid.flatten().tolist()  # ranks node by node
        self._groups: dict[tuple, RankGroup] = {}

    @property
    def world_size(self) -> int:
        return len(self.order)

    def check_two_level_gather(self, shard_size: int) -> None:
        """MiCS's hierarchical gather over shard groups of ``shard_size``
        ranks needs each group to be several whole nodes of consecutive ranks."""
        h = self.local_size
        if shard_size <= h or shard_size % h:
            fix = (
                f"set mics_shard_size to a multiple of {h} above it" if self.world_size > h
                else "the world is one node, so there is no second level"
            )
            raise ConfigError(
                f"zero_optimization.mics_hierarchical_params_gather gathers shard groups that span several whole "
                f"nodes, but mics_shard_size is {shard_size} with {h} ranks per node (LOCAL_WORLD_SIZE or the "
                f"device mesh); {fix}, or remove the key"
            )
        if not self.in_rank_order:
            raise ConfigError(
                "zero_optimization.mics_hierarchical_params_gather needs nodes of consecutive ranks, as torchrun "
                "numbers them; the device mesh given orders them otherwise: pass one in rank order"
            )

    @property
    def in_rank_order(self) -> bool:
        """Nodes hold consecutive global ranks (as torchrun numbers them):
        a group's rank order (torch sorts a group's ranks) is then node by node."""
        return self.order == sorted(self.order)

    def node_local(self) -> RankGroup:
        """This rank's node."""
        return self.blocks(self.local_size)

    def across_nodes(self) -> RankGroup:
        """The ranks with this rank's local index, one on every node."""
        return self.strided(self.local_size)

    def _mesh_group(self, key: tuple) -> Optional[RankGroup]:
        """The mesh's own group where ``key`` names one of its dimensions."""
        if self.mesh.ndim != 2 or self.nodes == 1 or self.local_size == 1 or not self.in_rank_order:
            return None
        dim = {("blocks", self.local_size): 1, ("strided", self.local_size): 0}.get(key)
        if dim is None:
            return None
        group = self.mesh.get_group(dim)
        return RankGroup(group, dist.get_world_size(group), dist.get_rank(group))

    def blocks(self, size: int) -> RankGroup:
        """This rank's block of ``size`` consecutive ranks (in node order):
        a node, part of one, or several whole nodes."""
        return self._group(("blocks", size), self._tile(size))

    def strided(self, size: int) -> RankGroup:
        """The ranks at this rank's position in every block of ``size``:
        those holding the same shard when blocks shard alike (MiCS's replicas)."""
        tiles = self._tile(size)
        return self._group(("strided", size), [list(column) for column in zip(*tiles)])

    def across_nodes_within(self, size: int) -> RankGroup:
        """Within this rank's block of ``size`` (whole nodes), the ranks
        with its local index: one per node of the block."""
        if size % self.local_size:
            raise ValueError(f"a block of {size} ranks is not whole nodes of {self.local_size}")
        if size == self.world_size:
            return self.across_nodes()
        h = self.local_size
        groups = [
            [block[j * h + i] for j in range(size // h)]
            for block in self._tile(size)
            for i in range(h)
        ]
        return self._group(("across_nodes_within", size), groups)

    def _tile(self, size: int) -> list[list[int]]:
        """Blocks of ``size`` in node order, each in torch's order (a
        group's ranks sorted), so that position i is group rank i."""
        if size < 1 or self.world_size % size:
            raise ValueError(f"blocks of {size} ranks do not tile a world of {self.world_size}")
        return [sorted(self.order[i : i + size]) for i in range(0, self.world_size, size)]

    def _group(self, key: tuple, members: list[list[int]]) -> RankGroup:
        known = self._groups.get(key) or self._mesh_group(key)
        if known is not None:
            self._groups[key] = known
            return known
        me = dist.get_rank()
        members = [sorted(ranks) for ranks in members]  # a group's ranks in torch's order
        mine = next(ranks for ranks in members if me in ranks)
        if len(mine) == self.world_size:
            made = RankGroup(None, self.world_size, me)  # the world itself: no new group
        else:
            group, _ = dist.new_subgroups_by_enumeration(members)
            made = RankGroup(group, len(mine), mine.index(me))
        self._groups[key] = made
        return made


def build_topology(device_mesh: Optional[DeviceMesh], device_type: str) -> Topology:
    """The user's mesh, checked; or nodes of LOCAL_WORLD_SIZE ranks.
    Collective (every rank creates the mesh's groups)."""
    world = dist.get_world_size()
    if device_mesh is not None:
        _check_mesh(device_mesh, world)
        return Topology(device_mesh)
    local = _local_world_size(world)
    return Topology(init_device_mesh(device_type, (world // local, local), mesh_dim_names=(NODE, LOCAL)))


def _check_mesh(mesh: DeviceMesh, world: int) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, not {type(mesh).__name__}"
        )
    if mesh.ndim not in (1, 2):
        raise ConfigError(
            f"device_mesh has {mesh.ndim} dimensions; zcore's data-parallel mesh has 2 (across nodes, "
            "within a node) or 1 (one node): pass mesh[\"node\", \"local\"] or a mesh of those dimensions"
        )
    if mesh.size() != world or sorted(mesh.mesh.flatten().tolist()) != list(range(world)):
        raise ConfigError(
            f"device_mesh covers ranks {sorted(mesh.mesh.flatten().tolist())}, but zcore shards over "
            f"every rank of the world ({world}): pass a mesh of all {world} ranks"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is not None and mesh.mesh_dim_names[0] == LOCAL:
        raise ConfigError(
            f"device_mesh's dimensions are {mesh.mesh_dim_names}: zcore reads dimension 0 as across "
            "nodes and dimension 1 as within a node; build it with mesh_dim_names=(\"node\", \"local\")"
        )


def _local_world_size(world: int) -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return world  # no launcher said: one node
    try:
        local = int(raw)
    except ValueError:
        local = 0
    if local < 1 or world % local:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE = {raw!r} must be a positive divisor of the world size ({world}), the "
            "ranks on each node; launch with torchrun (which sets it) or pass zcore.initialize(device_mesh=...)"
        )
    return local
