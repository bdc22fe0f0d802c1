"""MiCS's hierarchical parameter all-gather (``mics_hierarchical_params_gather``).

A shard group of s ranks that spans k nodes of h ranks gathers in two
levels: first across nodes, among the k ranks of the group with this
rank's local index (each receives the k shards at positions l, h + l, ...,
the only traffic over the slow links), then within the node, where each
of the h ranks contributes its k shards. The second level's result is the
shards in (local index, node) order, which a transpose puts in the group's
(node, local index) order. The group's ranks must be numbered node by node
(zcore.comm.topology.Topology.in_rank_order).

With qwZ, each rank quantizes its shard once and both levels move those
int8 bytes (codes and scales) unchanged; every rank decodes the s slices
once at the end (zcore.comm.quantized_collectives.QuantizedAllGather). So the
weights are those a flat qwZ gather over the shard group gives, within
half a scale of the shards. (Quantizing at each level would decode the k
shards after the first and quantize them again in blocks that run across
shard boundaries: two errors, the second scaled by a neighbour's largest.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from zcore.comm.quantized_collectives import QuantizedAllGather, weight_gather
from zcore.comm.topology import RankGroup

Gather = Callable[[torch.Tensor, torch.Tensor], Any]  # gather(output, shard) -> what wait() completes


class HierarchicalAllGather:
    """``output`` (s x shard elements) receives every shard-group rank's
    ``shard``: ``across(out, shard)`` gathers over the nodes, then
    ``within(out, shards)`` over the node; ``wait()`` runs the second level."""

    def __init__(
        self, output: torch.Tensor, shard: torch.Tensor, across: Gather, within: Gather, nodes: int, local: int
    ) -> None:
        self._output, self._within = output, within
        self._nodes, self._local = nodes, local
        self._across = torch.empty(nodes * shard.numel(), dtype=shard.dtype, device=shard.device)
        self._first: Optional[Any] = across(self._across, shard)

    def wait(self) -> None:
        """Like torch's Work.wait(): a second call returns at once."""
        if self._first is None:
            return
        self._first.wait()
        self._first = None
        gathered = torch.empty(self._local * self._across.numel(), dtype=self._across.dtype, device=self._across.device)
        self._within(gathered, self._across).wait()
        n = self._across.numel() // self._nodes
        self._output.view(self._nodes, self._local, n).copy_(
            gathered.view(self._local, self._nodes, n).transpose(0, 1)
        )
        self._across = None


def hierarchical_gather(quantized: bool, intra: RankGroup, inter: RankGroup) -> Gather:
    """Two-level gathers over ``inter`` (one rank per node) then ``intra``
    (the node); ``quantized`` (qwZ): of the int8 slices, decoded once."""
    across, within = weight_gather(False, inter.size, inter.group), weight_gather(False, intra.size, intra.group)

    def start(output: torch.Tensor, shard: torch.Tensor) -> HierarchicalAllGather:
        return HierarchicalAllGather(output, shard, across, within, inter.size, intra.size)

    if not quantized:
        return start
    return functools.partial(QuantizedAllGather, world_size=inter.size * intra.size, gather=start)
