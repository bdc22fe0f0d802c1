"""The whole-matrix part of the ZeRO step (Muon, Shampoo: zcore.optim.matrix_optimizer):
owner compute.

After the gradient reduce-scatter, the elements of one matrix lie on
several ranks, each rank holding one consecutive range (its shard's part of
the unit). Every matrix has one owner rank, chosen at start-up so that the
optimizer's cost (``MatrixOptimizer.cost``: m·n·min(m, n) for Newton-Schulz)
is balanced over the ranks. Each step, over the matrices some rank got a
gradient for:

1. every rank premixes its ranges element-wise (Muon's momentum: these
   states stay sharded, as Adam's moments are) and casts them to the
   optimizer's exchange dtype;
2. one all-to-all sends each range to its matrix's owner, exactly those
   elements;
3. each owner joins its matrices (ranges in rank order) and computes each
   one's direction, keeping any whole-matrix state itself;
4. one all-to-all sends each rank its ranges of the directions;
5. each rank applies them to its fp32 master pieces, element-wise.

Note "matrix bytes": with b bytes per element of the exchange dtype (Muon:
2, bfloat16), n_r(M) the elements of matrix M on rank r and |M| its size,
rank r sends per step

    b · ( Σ_{M not owned by r} n_r(M)  +  Σ_{M owned by r} (|M| − n_r(M)) )

(each term counts the elements that leave the rank: its ranges to other
owners, then the directions of its matrices to the other holders). Summed
over the ranks that is 2 · b · Σ_M (|M| − n_owner(M)), about
2 · b · (W−1)/W · Σ|M| on W ranks. tests/python/test_muon.py checks it
with the counting process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from zcore.comm import collectives as comm
from zcore.comm.topology import RankGroup
from zcore.errors import CheckpointError, ConfigError, InvalidStateError
from zcore.optim.matrix_optimizer import MatrixAndElementwise, MatrixOptimizer
from zcore.step.sharded_optimizer import FusedCpuUpdate, MasterShards, TorchUpdate, UnitShards
from zcore.step.units import Unit


@dataclass(frozen=True)
class Matrix:
    """One parameter of the whole-matrix optimizer, as the ranks hold it."""

    index: int  # position in the plan (the same on every rank)
    unit: int
    param_index: int  # in its unit
    group: int  # its parameter group in MatrixAndElementwise.param_groups
    shape: torch.Size
    ranges: tuple[tuple[int, int], ...]  # per rank of the shard group: [start, stop) of the flattened parameter
    owner: int  # the rank (in the shard group) that computes its direction
    piece: Optional[int]  # index of this rank's piece in its unit's pieces; None: it holds none

    def held(self, rank: int) -> int:
        start, stop = self.ranges[rank]
        return stop - start


def assign_owners(costs: list[float], ranks: int) -> list[int]:
    """An owner per cost: the costliest first, each to the rank with the
    least cost so far (the lowest such rank), as every rank computes alike."""
    load = [0.0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def matrix_cost(rule: MatrixOptimizer, shape: torch.Size) -> float:
    """The cost of one ``direction`` on a parameter of ``shape`` as the
    optimizer sees it (``matrix_view``): a batch of matrices costs each."""
    view = rule.matrix_view(torch.empty(shape, device="meta")).shape
    return float(math.prod(view[:-2]) * rule.cost(view[-2], view[-1]))


def plan_matrices(
    units: list[Unit], group_of: dict[int, int], rule: MatrixOptimizer, shards: int, shard_rank: int
) -> list[Matrix]:
    """The matrices among the units' parameters (``group_of``: id of each
    matrix parameter -> its group; ``rule``: the optimizer, whose costs
    balance the owners), with the ranges each of ``shards`` ranks holds and
    their owners. ``shards`` 1: every rank holds and computes every matrix
    (stage 0, or a world of one)."""
    found = []
    for u, unit in enumerate(units):
        for i, p in enumerate(unit.params):
            if id(p) in group_of:
                found.append((u, i, group_of[id(p)], unit.shapes[i]))
    owners = assign_owners([matrix_cost(rule, shape) for *_, shape in found], shards)
    matrices = []
    for index, ((u, i, group, shape), owner) in enumerate(zip(found, owners)):
        unit = units[u]
        offset, numel = unit.offsets[i], shape.numel()
        ranges = []
        for r in range(shards):
            lo = r * unit.shard_numel
            start, stop = max(lo, offset) - offset, min(lo + unit.shard_numel, offset + numel) - offset
            ranges.append((start, stop) if start < stop else (0, 0))
        piece = next((k for k, meta in enumerate(unit.pieces) if meta.param_index == i), None)
        matrices.append(Matrix(index, u, i, group, shape, tuple(ranges), owner, piece))
    return matrices


class MatrixStep:
    """Owner compute over the shard group (module docstring)."""

    def __init__(
        self, optimizer: MatrixAndElementwise, master: Any, matrices: list[Matrix], shard: RankGroup,
        exchanges: bool, comm_device: torch.device, home: torch.device,
    ) -> None:
        """``master``: MasterShards, whose pieces ``step`` updates (NVMe
        states: zcore.step.swapped_matrix premixes and applies itself);
        ``exchanges``: the units are sharded over ``shard`` (False: every
        rank holds every matrix whole and computes it); ``comm_device``:
        where the collectives' buffers live (NCCL takes no host memory);
        ``home``: where the master values are."""
        self.optimizer = optimizer
        self.master = master
        self.matrices = matrices
        self.shard = shard
        self.exchanges = exchanges and shard.size > 1
        self.rank = shard.rank if self.exchanges else 0
        self.ranks = shard.size if self.exchanges else 1
        self.comm_device = comm_device
        self.home = home
        # The whole-matrix states of the matrices this rank owns, by index.
        self.whole_states: dict[int, dict[str, Any]] = {}

    def stepping(self, used: list[list[int]]) -> list[Matrix]:
        """The matrices some rank got a gradient for (``used``: per unit, per parameter)."""
        return [m for m in self.matrices if used[m.unit][m.param_index]]

    def step(self, used: list[list[int]]) -> None:
        """Updates the master pieces of every matrix that got a gradient on
        some rank; their gradients are final (unscaled and clipped)."""
        stepping = self.stepping(used)
        if not stepping:
            return
        rule, groups = self.optimizer.matrix, self.optimizer.param_groups
        mine: dict[int, torch.Tensor] = {}
        for m in stepping:
            if m.piece is not None:
                piece = self.master.pieces[m.unit][m.piece]
                mixed = rule.premix(piece.grad, self.optimizer.state[piece], groups[m.group])
                mine[m.index] = mixed.to(rule.exchange_dtype)
        back = self.directions(stepping, mine)
        for m in stepping:
            if m.piece is not None:
                piece = self.master.pieces[m.unit][m.piece]
                rule.apply_(piece, back[m.index], groups[m.group], m.shape)

    def directions(self, stepping: list[Matrix], mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Steps 2-4 of the module docstring: ``mine`` (index -> this rank's
        premixed range of each stepping matrix it holds, in the exchange
        dtype) to the owners, their directions, and this rank's range of
        each back, by index."""
        rule, groups = self.optimizer.matrix, self.optimizer.param_groups
        exchange = rule.exchange_dtype
        owned = [m for m in stepping if m.owner == self.rank]
        whole = self._to_owners(stepping, owned, mine, exchange)
        directions = {}
        for m in owned:
            matrix = rule.matrix_view(whole[m.index].view(m.shape))
            direction = rule.direction(matrix, self.whole_states.setdefault(m.index, {}), groups[m.group])
            if direction.dtype != exchange or direction.shape != matrix.shape:
                raise InvalidStateError(
                    f"{type(rule).__name__}.direction returned a {direction.dtype} tensor of shape "
                    f"{tuple(direction.shape)} for a {tuple(matrix.shape)} matrix; it must return its matrix's "
                    f"shape in the exchange dtype {exchange}"
                )
            directions[m.index] = direction.reshape(-1)
        return self._from_owners(stepping, owned, directions, exchange)

    def _to_owners(
        self, stepping: list[Matrix], owned: list[Matrix], mine: dict[int, torch.Tensor], dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        """Each owned matrix whole (flat), from every rank's ranges."""
        device = self.home
        if not self.exchanges:
            return mine
        sends = [[mine[m.index] for m in stepping if m.owner == q and m.piece is not None] for q in range(self.ranks)]
        received = self._all_to_all(
            sends, [sum(m.held(r) for m in owned) for r in range(self.ranks)], dtype
        )
        whole = {m.index: torch.empty(m.shape.numel(), dtype=dtype, device=device) for m in owned}
        for r, part in enumerate(received):
            pos = 0
            for m in owned:
                start, stop = m.ranges[r]
                whole[m.index][start:stop].copy_(part[pos : pos + stop - start])
                pos += stop - start
        return whole

    def _from_owners(
        self, stepping: list[Matrix], owned: list[Matrix], directions: dict[int, torch.Tensor], dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        """This rank's range of every stepping matrix's direction."""
        if not self.exchanges:
            return directions
        sends = [[directions[m.index][slice(*m.ranges[q])] for m in owned if m.held(q)] for q in range(self.ranks)]
        received = self._all_to_all(
            sends, [sum(m.held(self.rank) for m in stepping if m.owner == r) for r in range(self.ranks)], dtype
        )
        device = self.home
        back = {}
        for r, part in enumerate(received):
            pos = 0
            for m in stepping:
                if m.owner == r and m.piece is not None:
                    n = m.held(self.rank)
                    back[m.index] = part[pos : pos + n].to(device)
                    pos += n
        return back

    def _all_to_all(self, sends: list[list[torch.Tensor]], receives: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """``sends[q]`` (joined) to rank q; returns what each rank sent here."""
        splits = [sum(t.numel() for t in parts) for parts in sends]
        flat = [t.to(self.comm_device) for parts in sends for t in parts]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=self.comm_device)
        out = torch.empty(sum(receives), dtype=dtype, device=self.comm_device)
        comm.all_to_all_uneven(out, send, receives, splits, group=self.shard.group)
        return list(out.split(receives))

    def state_bytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for s in self.whole_states.values() for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def computes(self, m: Matrix) -> bool:
        """Whether this rank computes ``m``'s direction and keeps its whole-matrix state."""
        return m.owner == self.rank

    def check_saveable(self) -> None:
        """Checkpoints hold whole-matrix states as tensors: raises
        CheckpointError on every rank where some rank keeps another value."""
        bad = next(
            (f"{k!r} of matrix {i}" for i, state in self.whole_states.items() for k, v in state.items()
             if not isinstance(v, torch.Tensor)),
            None,
        )
        flag = torch.tensor([0 if bad is None else 1], dtype=torch.int32, device=self.comm_device)
        comm.all_reduce_max(flag)  # every rank saves, so every rank raises
        if flag.item():
            raise CheckpointError(
                f"{type(self.optimizer.matrix).__name__} keeps a whole-matrix state that is not a tensor "
                f"({bad or 'on another rank'}); checkpoints hold whole-matrix states as tensors: keep them as "
                "tensors (a count as a 0-d tensor)"
            )

    def load_whole_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """The whole-matrix states a checkpoint load read for the matrices
        this rank computes, by index; the others start afresh."""
        self.whole_states = {i: {k: v.to(self.home) for k, v in s.items()} for i, s in states.items()}


class MatrixUpdate:
    """The ZeRO update with a whole-matrix optimizer: gradients scaled once,
    the matrices stepped (MatrixStep), then the element-wise optimizer's
    update (``elementwise``: over its pieces, writing every unit's shard)."""

    def __init__(
        self, elementwise: Union[TorchUpdate, FusedCpuUpdate], matrix: MatrixStep, steps_elementwise: bool
    ) -> None:
        """``steps_elementwise``: False when no parameter is the element-wise
        optimizer's; ``elementwise`` then only writes the shards."""
        self.elementwise = elementwise
        self.matrix = matrix
        self.steps_elementwise = steps_elementwise
        self._used: list[list[int]] = []

    @property
    def shards(self) -> UnitShards:
        return self.elementwise.shards

    @property
    def master(self) -> MasterShards:
        return self.elementwise.master

    @property
    def host_grads(self) -> Optional[list[torch.Tensor]]:
        return self.elementwise.host_grads

    def attach_grads(self, used: list[torch.Tensor]) -> None:
        self._used = [flags.tolist() for flags in used]
        self.elementwise.attach_grads(used)

    def detach_grads(self) -> None:
        self.elementwise.detach_grads()

    def apply(self, coefficient: float) -> None:
        e = self.elementwise
        e.scale_grads(coefficient)
        with torch.no_grad():
            self.matrix.step(self._used)
        if isinstance(e, FusedCpuUpdate) and e.fused_copy:
            # The fused kernel writes the compute-dtype copies of its own pieces only.
            for matrix in self.matrix.matrices:
                if matrix.piece is not None:
                    piece = e.master.pieces[matrix.unit][matrix.piece]
                    e.outs[piece].copy_(piece.detach())
        if self.steps_elementwise:
            e.apply(1.0)
        else:
            for unit, shard in zip(e.master.units, e.master.shards):
                e.shards.write(unit, shard)

    def state_bytes(self) -> int:
        return self.elementwise.state_bytes() + self.matrix.state_bytes()

    def check_saveable(self) -> None:
        self.matrix.check_saveable()

    def close(self) -> None:
        self.elementwise.close()


def matrix_step(
    inner: MatrixAndElementwise, master: Any, group_params: list[list[Any]], shard: RankGroup, model_parallel: Any,
    comm_device: torch.device, home: torch.device,
) -> MatrixStep:
    """Owner compute for ``inner``'s matrices over ``master``'s units
    (``group_params``: the model parameters of each of inner's groups;
    ``shard``: the ranks the units are sharded over; ``home``: where the
    master values are)."""
    if model_parallel is not None:
        raise ConfigError(
            f"{type(inner.matrix).__name__} updates whole matrices, and zcore assigns each to one data-parallel "
            "rank; with a device_mesh of \"tp\" or \"pp\" dimensions a matrix is split over ranks zcore does not "
            "gather it from (tensor parallelism), which is not supported yet: train it without the mesh's model "
            "parallelism, or use AdamW"
        )
    units = master.units
    group_of = {id(p): g for g, params in enumerate(group_params[: inner.matrix_groups]) for p in params}
    sharded = any(u.shard_numel < u.padded_numel for u in units)
    shards = shard.size if sharded else 1
    matrices = plan_matrices(units, group_of, inner.matrix, shards, shard.rank if sharded else 0)
    return MatrixStep(inner, master, matrices, shard, sharded, comm_device, home)


def matrix_update(
    inner: MatrixAndElementwise, elementwise: Union[TorchUpdate, FusedCpuUpdate], group_params: list[list[Any]],
    shard: RankGroup, model_parallel: Any, comm_device: torch.device,
) -> MatrixUpdate:
    """The update of ``inner`` over ``elementwise``'s master shards in memory."""
    master = elementwise.master
    home = master.shards[0].device if master.shards else comm_device
    step = matrix_step(inner, master, group_params, shard, model_parallel, comm_device, home)
    return MatrixUpdate(elementwise, step, steps_elementwise=inner.elementwise is not None)
