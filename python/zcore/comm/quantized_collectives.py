"""ZeRO++'s quantized collectives: fewer bytes on the wire for stage 3's
weight all-gathers (qwZ, ``zero_quantized_weights``) and for the gradient
reduce-scatters (qgZ, ``zero_quantized_gradients``).

- qwZ: each rank quantizes its shard to int8 in blocks of
  ``WEIGHT_BLOCK`` elements (zcore.comm.quantization) and all-gathers the codes
  and scales; every rank decodes every rank's slice, its own too, so that
  all ranks compute with the same weights. An fp32 shard crosses the wire
  in about a quarter of its bytes, a bf16 one in about half.
- qgZ: each rank quantizes the slice of its gradient bucket destined for
  each other rank to int4 in blocks of ``GRADIENT_BLOCK`` elements, and one
  all-to-all delivers them; each rank sums the slices it receives (its own
  included, quantized too, so that the sum is the same function of every
  rank's gradient) into fp32, in rank order. An fp32 bucket crosses the
  wire in about a seventh of its bytes (codes and scales).
- qgZ across nodes: the same in two levels, so that each element crosses
  the slow links once (``HierarchicalQuantizedReduceScatter``). Within the
  node, an all-to-all of int8 slices (``NODE_BITS``) brings each rank,
  from every node-peer, the slices of the ranks with its local index on
  every node, summed in fp32; those partial sums are quantized to int4 in
  blocks of ``ACROSS_NODES_BLOCK`` and an all-to-all among the ranks with
  that local index (one per node) delivers each its own slice from every
  node, summed in fp32 in node order. Only (nodes - 1) int4 slices per
  rank cross nodes instead of (nodes - 1) x (ranks per node). A partial
  sum of L ranks spans about L times one rank's range, so its int4 error
  is larger than one rank's; both levels' precision is bought back where
  it is cheap. The node's own links are the fast ones, so they carry int8
  (int4 at both levels left the tied GPT's loss 1.1% behind the
  unquantized run), and the cross-node blocks are halved to 32 elements
  (blocks of 64 left the evaluation loss 1.17% behind on model seed 0;
  blocks of 32 keep every seed of 0-3 within 0.5% in 10-step means and
  0.7% at the evaluation, as the flat path, measured on the tied GPT at
  4 ranks as 2 x 2, 100 steps) for 11% more bytes across nodes.

One rank's slice travels as one byte buffer: its fp32 scales, then its
codes, padded to 4 bytes so that every rank's scales stay aligned. The
error: each element decodes to within half its block's scale (max|x|/127
for int8, max|x|/7 for int4) per quantization, which the tests'
tolerances derive from (an int8 and an int4 one for the hierarchical
path, whose blocks of 32 lie within the first level's of 64). A block holding
NaN or Inf decodes to NaN, so fp16's overflow check still sees an
overflowed gradient; after two levels too, as a NaN decoded in the first
makes its block's scale NaN in the second.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.comm.quantization import code_dtype, dequantize, dequantize_add, quantize, quantized_shapes
from zcore.comm.topology import RankGroup

# int8 weights: a block of 2048 adds 4 bytes of scale to 2048 of codes (0.2%).
WEIGHT_BITS, WEIGHT_BLOCK = 8, 2048
# int4 gradients: an entry under 1/14 of its block's largest rounds to zero,
# which biases training when blocks are long (measured on the tied GPT, 4
# ranks, 100 steps: blocks of 512 left the loss 1.2% behind, blocks of 64
# 0.5%); 4 bytes of scale per 32 of codes (12.5%).
GRADIENT_BITS, GRADIENT_BLOCK = 4, 64
# qgZ's first level across nodes, within the node (the fast links).
NODE_BITS = 8
# Its second level, across nodes: int4 of partial sums in blocks of 32
# (4 bytes of scale per 16 of codes; the module docstring says why).
ACROSS_NODES_BITS, ACROSS_NODES_BLOCK = 4, 32


class _Slice:
    """The byte layout of one rank's quantized slice of ``numel`` elements."""

    def __init__(self, numel: int, bits: int, block: int) -> None:
        self.numel, self.bits, self.block = numel, bits, block
        codes, scales = quantized_shapes(numel, bits, block)
        self.scale_bytes = 4 * scales
        self.code_bytes = codes  # one byte per code element (int8, or two packed int4)
        self.nbytes = -(-(self.scale_bytes + self.code_bytes) // 4) * 4

    def pack(self, values: torch.Tensor, into: torch.Tensor) -> None:
        codes, scales = quantize(values, self.bits, self.block)
        into[: self.scale_bytes].view(torch.float32).copy_(scales)
        into[self.scale_bytes : self.scale_bytes + self.code_bytes].copy_(codes.view(torch.uint8))

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = packed[: self.scale_bytes].view(torch.float32)
        codes = packed[self.scale_bytes : self.scale_bytes + self.code_bytes].view(code_dtype(self.bits))
        return codes, scales


class QuantizedAllGather:
    """``output`` (ranks x shard elements) receives every rank's ``shard``
    over ``group`` (``world_size`` ranks; None: the world), int8-quantized on
    the wire; ``wait()`` decodes it. ``gather(received, packed)``: how the
    packed slices travel, in rank order (default: one all-gather over
    ``group``; zcore.comm.hierarchical_gather passes its two levels, so that a
    shard is quantized once and decoded once whatever the route).
    ``segments``: each shard is quantized as that many equal slices, each
    in blocks from its own start: hpZ's secondary spans several primary
    shards, which were quantized so; blocks aligned to theirs give back the
    same codes, where blocks across them would scale one shard's weights
    by its neighbour's largest."""

    def __init__(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        world_size: int,
        group: Optional[dist.ProcessGroup] = None,
        gather: Optional[Callable[[torch.Tensor, torch.Tensor], Any]] = None,
        segments: int = 1,
    ) -> None:
        self._output = output.view(world_size * segments, -1)
        self._layout = _Slice(shard.numel() // segments, WEIGHT_BITS, WEIGHT_BLOCK)
        n = self._layout.nbytes
        self._send = torch.empty(segments, n, dtype=torch.uint8, device=shard.device)
        for part, into in zip(shard.reshape(segments, -1), self._send):
            self._layout.pack(part, into)
        self._send = self._send.view(-1)
        self._received = torch.empty(world_size * segments * n, dtype=torch.uint8, device=shard.device)
        if gather is None:
            gather = functools.partial(comm.all_gather_into, async_op=True, group=group)
        self._work: Any = gather(self._received, self._send)

    def wait(self) -> None:
        """Like torch's Work.wait(): a second call returns at once."""
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        received = self._received.view(self._output.shape[0], -1)
        for rank, out in enumerate(self._output):
            codes, scales = self._layout.unpack(received[rank])
            dequantize(codes, scales, WEIGHT_BITS, WEIGHT_BLOCK, self._layout.numel, out.dtype, out=out)
        self._received = self._send = None


class QuantizedReduceScatter:
    """Sums ``full`` over the ``world_size`` ranks of ``group`` (None: the
    world) into this rank's ``shard`` (slice ``rank`` of ``full``),
    int4-quantized on the wire; ``wait()`` completes it."""

    def __init__(
        self, shard: torch.Tensor, full: torch.Tensor, world_size: int, group: Optional[dist.ProcessGroup] = None
    ) -> None:
        self._shard = shard
        slices = full.view(world_size, -1)
        self._layout = _Slice(slices.shape[1], GRADIENT_BITS, GRADIENT_BLOCK)
        n = self._layout.nbytes
        send = torch.empty(world_size, n, dtype=torch.uint8, device=full.device)
        for rank in range(world_size):
            self._layout.pack(slices[rank], send[rank])
        self._received = torch.empty(world_size, n, dtype=torch.uint8, device=full.device)
        self._send = send
        self._work: Any = comm.all_to_all(self._received.view(-1), send.view(-1), async_op=True, group=group)

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        _sum_into(self._shard, self._layout, self._received)
        self._received = self._send = None


class HierarchicalQuantizedReduceScatter:
    """Sums ``full`` over ``inter.size`` nodes of ``intra.size`` ranks,
    numbered node by node, into this rank's ``shard`` (slice ``inter.rank *
    intra.size + intra.rank``), int8-quantized within the node and int4 in
    smaller blocks across nodes (the module docstring): the all-to-all
    within the node (``intra``) starts here, ``wait()`` sums it and runs the
    one across nodes (``inter``). Every slice is quantized apart, at both
    levels, so that each cross-node block lies within one block of the
    first level."""

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, intra: RankGroup, inter: RankGroup) -> None:
        self._shard, self._inter = shard, inter
        slices = full.view(inter.size, intra.size, -1)  # [node, local index]: that rank's slice
        self._within = _Slice(slices.shape[2], NODE_BITS, GRADIENT_BLOCK)
        self._layout = _Slice(slices.shape[2], ACROSS_NODES_BITS, ACROSS_NODES_BLOCK)
        # Row m goes to node-peer m: the slices of local index m on every node.
        send = torch.empty(intra.size, inter.size, self._within.nbytes, dtype=torch.uint8, device=full.device)
        for local in range(intra.size):
            for node in range(inter.size):
                self._within.pack(slices[node, local], send[local, node])
        self._received = torch.empty_like(send)  # [node-peer, node]: for this local index
        self._send = send
        self._work: Any = comm.all_to_all(self._received.view(-1), send.view(-1), async_op=True, group=intra.group)

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        nodes, n, device = self._inter.size, self._layout.nbytes, self._received.device
        partial = torch.zeros(nodes, self._layout.numel, dtype=torch.float32, device=device)
        send = torch.empty(nodes, n, dtype=torch.uint8, device=device)
        for node in range(nodes):  # this node's sum of that node's slice for this local index
            pairs = [self._within.unpack(r) for r in self._received[:, node]]
            dequantize_add(partial[node], pairs, NODE_BITS, GRADIENT_BLOCK)
            self._layout.pack(partial[node], send[node])
        self._received = self._send = None
        received = torch.empty_like(send)  # [node]: that node's partial sum of this rank's slice
        # Blocking: it sends what the first level summed, so it cannot start
        # earlier; only the first level overlaps the backward pass.
        comm.all_to_all(received.view(-1), send.view(-1), group=self._inter.group)
        _sum_into(self._shard, self._layout, received)


def _sum_into(shard: torch.Tensor, layout: _Slice, received: torch.Tensor) -> None:
    """``shard`` = the slices ``received`` (one per row, in ``layout``)
    decoded and summed in fp32, in order: the same order on every rank, so
    identical inputs give identical sums."""
    total = shard if shard.dtype == torch.float32 else torch.empty_like(shard, dtype=torch.float32)
    total.zero_()
    dequantize_add(total, [layout.unpack(r) for r in received], layout.bits, layout.block)
    if total is not shard:
        shard.copy_(total)


def weight_gather(
    quantized: bool, world_size: int, group: Optional[dist.ProcessGroup] = None, segments: int = 1
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """How stage 3 starts a group's all-gather over ``group`` (``world_size``
    ranks; None: the world): ``gather(buffer, shard)`` returns what
    ``wait()`` completes. ``segments``: QuantizedAllGather's."""
    if quantized:
        return functools.partial(QuantizedAllGather, world_size=world_size, group=group, segments=segments)
    return functools.partial(comm.all_gather_into, async_op=True, group=group)


def gradient_reduce_scatter(
    quantized: bool, over: RankGroup, nodes: Optional[tuple[RankGroup, RankGroup]] = None
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """How the reducers start a bucket's reduce-scatter over ``over``:
    ``reduce(shard, full)`` returns what ``wait()`` completes. ``nodes``:
    ``(intra, inter)``, this rank's node within ``over`` and the ranks with
    its local index on every node of ``over``, whose positions must run
    node by node; when ``over`` spans several nodes of several ranks, qgZ
    then crosses nodes once (HierarchicalQuantizedReduceScatter)."""
    if nodes is not None:
        _check_node_major(over, *nodes)
    if not quantized:
        return functools.partial(comm.reduce_scatter_sum, group=over.group)
    if nodes is not None and nodes[0].size > 1 and nodes[1].size > 1:
        return functools.partial(HierarchicalQuantizedReduceScatter, intra=nodes[0], inter=nodes[1])
    return functools.partial(QuantizedReduceScatter, world_size=over.size, group=over.group)


def _check_node_major(over: RankGroup, intra: RankGroup, inter: RankGroup) -> None:
    """Position p of ``over`` must be local index p % L on node p // L (L:
    ``intra.size``), as the bucket's slices are laid out that way."""
    local = intra.size
    ranks = _global_ranks(over)
    wanted_intra = ranks[inter.rank * local : (inter.rank + 1) * local]
    wanted_inter = ranks[intra.rank :: local]
    if (
        over.size != local * inter.size
        or over.rank != inter.rank * local + intra.rank
        or _global_ranks(intra) != wanted_intra
        or _global_ranks(inter) != wanted_inter
    ):
        raise ValueError(
            f"the ranks of over ({ranks}, this rank at {over.rank}) are not numbered node by node as "
            f"nodes=(intra {_global_ranks(intra)} at {intra.rank}, inter {_global_ranks(inter)} at "
            f"{inter.rank}) says: position p must be local index p % {local} on node p // {local}; "
            "build both from one zcore.comm.topology.Topology whose mesh lists ranks in over's order, "
            "or pass nodes=None for a flat reduce-scatter"
        )


def _global_ranks(group: RankGroup) -> list[int]:
    """The world ranks of ``group``, by position."""
    if group.group is None:
        return list(range(group.size))
    return dist.get_process_group_ranks(group.group)
