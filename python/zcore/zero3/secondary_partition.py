"""ZeRO++ hpZ (``zero_hpz_partition_size`` h): a secondary partition of
stage 3's gathered groups within a block of ranks (a node), so that a
group's gathers after its first one stay within the block.

Ranks form blocks of h consecutive ranks (zcore.comm.topology.Topology.blocks).
The primary partition is unchanged: each rank keeps its 1/W shard of every
group, and the masters, optimizer states, gradients and checkpoints follow
it. When a group's all-gather over the world completes, each rank also
keeps a copy of its 1/h slice of the full buffer (slice k at index k of its
block), the group's secondary. The group's later all-gathers (backward,
activation checkpointing's recomputation, the next micro-step's forward)
gather the secondaries within the block: on a cluster, over the node's
links, never across nodes. With qwZ they are int8 on the wire too, as
DeepSpeed's are, quantized in the blocks of the primary shards they hold,
which gives back the codes the first gather decoded: a weight is not
quantized twice over.

A secondary holds the values the shards had when it was taken, so it is
dropped when they change (zcore.zero3.param_fetcher says when): a trained group's
after every optimizer step (the first forward after a step gathers over the
world again), a group written through GatheredParameters(modifier_rank=...),
every group after a checkpoint load. Frozen groups keep theirs across
steps. No gather is in flight when shards change (between steps, or a
group already gathered), so a secondary never comes from values older than
the last drop. It is taken when the gather completes, not at release as
DeepSpeed does, so what code changes in gathered parameters without
modifier_rank (discarded at release) never reaches it. Persistent groups
stay gathered and are refreshed in place from the shards after each step:
they keep none.

Memory: a secondary is padded_numel / h elements of the compute dtype, on
the compute device, while held (DeepSpeed keeps it on offload_param's
device instead).

Every rank gets the same plans (zcore.zero3.plan_execution), so every rank takes
and drops the same secondaries at the same points, and every rank gathers
a group over the same kind of group: the world, or its block.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Protocol, Union

import torch
import torch.distributed as dist

from zcore.comm.hierarchical_gather import hierarchical_gather
from zcore.config.policies import CommPolicy
from zcore.comm.quantized_collectives import weight_gather
from zcore.comm.topology import RankGroup, Topology

Gather = Callable[[torch.Tensor, torch.Tensor], Any]  # gather(buffer, slice) -> what wait() completes


class WeightGathers(Protocol):
    """How stage 3 gathers a group's weights into its buffer."""

    secondary_gathers: int  # gathers served from secondaries (hpZ), since start-up

    def start(self, group: int, buffer: torch.Tensor, shard: torch.Tensor) -> Any:
        """Starts ``group``'s all-gather into ``buffer`` (from this rank's
        ``shard``, or from its secondary); returns what ``wait()`` completes."""

    def done(self, group: int, buffer: torch.Tensor) -> None:
        """``group``'s all-gather was waited for: ``buffer`` holds its values."""

    def drop(self, groups: Iterable[int]) -> None:
        """These groups' shards changed."""

    def held(self) -> list[torch.Tensor]:
        """What is kept between gathers (the memory report counts it)."""


class WorldGathers:
    """Every gather over the world, from the shards (no hpZ)."""

    secondary_gathers = 0

    def __init__(self, gather: Gather) -> None:
        self._gather = gather

    def start(self, group: int, buffer: torch.Tensor, shard: torch.Tensor) -> Any:
        return self._gather(buffer, shard)

    def done(self, group: int, buffer: torch.Tensor) -> None:
        return None

    def drop(self, groups: Iterable[int]) -> None:
        return None

    def held(self) -> list[torch.Tensor]:
        return []


class SecondaryPartition:
    """hpZ: a group without a secondary gathers over the world and takes
    one; a group with one gathers within the block (module docstring)."""

    def __init__(self, world: Gather, within_block: Gather, block: dist.ProcessGroup, persistent: list[bool]) -> None:
        self._world = world
        self._within_block = within_block
        self.block = block
        self._size, self._rank = dist.get_world_size(block), dist.get_rank(block)
        self._persistent = persistent
        self._secondaries: dict[int, torch.Tensor] = {}  # group -> this rank's slice of its full buffer
        self.secondary_gathers = 0

    def start(self, group: int, buffer: torch.Tensor, shard: torch.Tensor) -> Any:
        secondary = self._secondaries.get(group)
        if secondary is None:
            return self._world(buffer, shard)
        self.secondary_gathers += 1
        return self._within_block(buffer, secondary)

    def done(self, group: int, buffer: torch.Tensor) -> None:
        if group in self._secondaries or self._persistent[group]:
            return
        n = buffer.numel() // self._size  # padded to a multiple of the world, so of the block too
        self._secondaries[group] = buffer[self._rank * n : (self._rank + 1) * n].clone()

    def drop(self, groups: Iterable[int]) -> None:
        for g in groups:
            self._secondaries.pop(g, None)

    def held(self) -> list[torch.Tensor]:
        return list(self._secondaries.values())


def weight_gathers(
    policy: CommPolicy, shard: RankGroup, persistent: list[bool], topology: Optional[Topology]
) -> Union[WorldGathers, SecondaryPartition]:
    """Stage 3's gathers as ``policy`` says, over the ranks that hold a
    group's shards (``shard``: the world, or a MiCS shard group);
    ``persistent``: per group. With hpZ or a hierarchical gather,
    collective: every rank creates the groups it needs from ``topology``."""

    def over(group: RankGroup, segments: int = 1) -> Gather:
        return weight_gather(policy.quantized_weights, group.size, group.group, segments)

    primary = over(shard)
    if policy.hierarchical_gather:
        assert topology is not None
        primary = hierarchical_gather(
            policy.quantized_weights, topology.node_local(), topology.across_nodes_within(shard.size)
        )
    if policy.hpz_size == 1:
        return WorldGathers(primary)
    assert topology is not None
    block = topology.blocks(policy.hpz_size)
    # A secondary holds shard.size // block.size primary shards, each
    # quantized on its own by the primary gather (QuantizedAllGather).
    return SecondaryPartition(primary, over(block, shard.size // block.size), block.group, persistent)
