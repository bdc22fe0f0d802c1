"""Optimizer states on NVMe (``offload_optimizer.device = "nvme"``).

The master shards and Adam's two moments of every unit on this rank
form one flat range of elements, cut into sub-groups of at most
``sub_group_size`` elements (a sub-group may hold the ends of several units,
and a large unit spans several sub-groups). Each sub-group is one swap key
whose bytes are ``[master | exp_avg | exp_avg_sq]`` in one dtype: fp32, or
bf16 with bf16 master weights and optimizer states. A step streams
the sub-groups through host memory: the next one is read while this one is
stepped by zcore's fused CPU Adam, and the previous one is written back
meanwhile, so host memory holds about three sub-groups whatever the model's
size. The compute-dtype shard of each unit is written out in the same pass
(zcore.step.sharded_optimizer.UnitShards: in place, or to the parameter tier).

The torch optimizer the user sees (``engine.optimizer.inner``, a CPUAdam)
keeps the parameter groups (hyper-parameters, which a scheduler changes) and
each piece's step count; its pieces are placeholders on the meta device, as
the values they stand for are on disk.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch

from zcore import tracing
from zcore.step.background_step import BackgroundStep
from zcore.errors import ConfigError, InvalidStateError
from zcore.step.grad_reduction import GradientReducer
from zcore.memory.host_memory import PAGE_ALIGNMENT
from zcore.optim import CPUAdam
from zcore.optim.adam import group_config
from zcore.optim.functional import adam_step
from zcore.optim.matrix_optimizer import MatrixAndElementwise, MatrixOptimizer
from zcore.step.units import Unit
from zcore.step.sharded_optimizer import TorchUpdate, UnitShards, pieces_by_param
from zcore.memory.swap import SwapManager

FP32_BYTES = 4
STATES = 3  # master, exp_avg, exp_avg_sq
# The rows of a sub-group where Adam's moments rest; a whole-matrix
# optimizer's per-element states take rows 1, 2 in its state_keys' order.
ADAM_ROWS = {"exp_avg": 1, "exp_avg_sq": 2}


@dataclass(frozen=True)
class Run:
    """Elements of one piece inside one sub-group."""

    unit: int
    piece: int  # index into the unit's pieces
    unit_start: int  # first element in the unit's shard
    offset: int  # first element in the sub-group
    numel: int


@dataclass
class SubGroup:
    key: int
    numel: int
    runs: list[Run] = field(default_factory=list)
    finishes: list[int] = field(default_factory=list)  # units whose last elements are here
    element_size: int = FP32_BYTES  # of the master and the moments

    @property
    def nbytes(self) -> int:
        return STATES * self.numel * self.element_size


def plan_sub_groups(units: list[Unit], size: int, element_size: int = FP32_BYTES) -> list[SubGroup]:
    """The units' pieces laid end to end and cut every ``size`` elements.
    Elements no piece covers (a unit's padding) are not stored."""
    groups: list[SubGroup] = []
    current = SubGroup(0, 0, element_size=element_size)
    for u, unit in enumerate(units):
        for k, meta in enumerate(unit.pieces):
            start, left = meta.shard_start, meta.numel
            while left > 0:
                if current.numel == size:
                    groups.append(current)
                    current = SubGroup(len(groups), 0, element_size=element_size)
                take = min(left, size - current.numel)
                current.runs.append(Run(u, k, start, current.numel, take))
                current.numel += take
                start += take
                left -= take
        if unit.pieces:
            current.finishes.append(u)
    if current.numel > 0 or current.finishes:
        groups.append(current)
    return groups


class SwappedMaster:
    """What MasterShards is for the in-memory optimizer, with the values on
    NVMe: the units, and one placeholder piece per piece of a unit."""

    def __init__(
        self, units: list[Unit], sub_groups: list[SubGroup], open_swap: Callable[[], SwapManager],
        read_ahead: bool = True, dtype: torch.dtype = torch.float32,
    ) -> None:
        """``open_swap()``: a new, empty swap file for the sub-groups.
        ``read_ahead``: whether reading the states may hold two sub-groups
        (offload_optimizer.pipeline_read, which the host buffers are sized for).
        ``dtype``: of the master and the moments."""
        self.units = units
        self.dtype = dtype
        self.read_ahead = read_ahead
        self._open_swap = open_swap
        self.swap = open_swap()
        self.sub_groups = sub_groups
        self.pieces = [
            [torch.nn.Parameter(torch.empty(p.numel, dtype=dtype, device="meta")) for p in unit.pieces]
            for unit in units
        ]
        self._filling = 0  # the first sub-group not yet written by take()
        self._buffer: Optional[torch.Tensor] = None

    def piece_of(self) -> dict[int, list[torch.nn.Parameter]]:
        return pieces_by_param(self.units, self.pieces)

    def numel(self) -> int:
        return sum(s.numel for s in self.sub_groups)

    def read_pieces(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(unit, piece, states)`` for every piece in order, ``states`` its
        [master, exp_avg, exp_avg_sq] as a [3, numel] tensor of ``dtype``, valid
        until the next item. Host memory: the sub-groups being read, and a
        piece that spans several of them."""
        subs = {s.key: s for s in self.sub_groups if s.numel > 0}
        partial: dict[tuple[int, int], torch.Tensor] = {}
        for key, states in self.swap.stream(subs, write_back=False, read_ahead=self.read_ahead):
            sub = subs[key]
            for run in sub.runs:
                meta = self.units[run.unit].pieces[run.piece]
                part = states.view(STATES, sub.numel)[:, run.offset : run.offset + run.numel]
                if run.numel == meta.numel:
                    # A copy: the stream's host buffers are counted for its
                    # reads alone, and the consumer may hold this one while
                    # the next sub-group is read.
                    yield run.unit, run.piece, part.clone()
                    continue
                whole = partial.setdefault((run.unit, run.piece), torch.empty(STATES, meta.numel, dtype=self.dtype))
                start = run.unit_start - meta.shard_start
                whole[:, start : start + run.numel].copy_(part)
                if start + run.numel == meta.numel:
                    yield run.unit, run.piece, partial.pop((run.unit, run.piece))
            del states, part  # before the stream reads the next sub-group

    def read_units(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(unit, master)`` for every unit in order (as collectives need
        them on every rank): its master shard, zero where no piece is.
        Host memory: one unit's shard more than ``read_pieces``."""
        pieces = self.read_pieces()
        pending = next(pieces, None)
        for u, unit in enumerate(self.units):
            shard = torch.zeros(unit.shard_numel, dtype=self.dtype)
            while pending is not None and pending[0] == u:
                meta = unit.pieces[pending[1]]
                shard[meta.shard_start : meta.shard_start + meta.numel].copy_(pending[2][0])
                pending = next(pieces, None)
            yield u, shard

    def stage(
        self,
        values: Callable[[int, int, int, int], torch.Tensor],
        unit_shard: Callable[[int, torch.Tensor], None],
        keep_moments: bool = False,
    ) -> SwapManager:
        """A new swap file holding every sub-group as ``values(unit, piece,
        lo, hi)`` gives it: [3, hi - lo] of ``dtype``, the master, exp_avg and
        exp_avg_sq of elements [lo, hi) of the piece. Each unit's
        compute-dtype shard goes to ``unit_shard(unit, shard)`` once
        complete; with ``keep_moments`` only the master comes from
        ``values``, the moments from the states in use. Those are untouched
        until ``adopt``; on an error the new file is removed."""
        swap = self._open_swap()
        try:
            outs: dict[int, torch.Tensor] = {}
            writing: Optional[int] = None  # the sub-group written behind the one being filled
            held: Optional[torch.Tensor] = None
            for sub in self.sub_groups:
                if sub.numel == 0:
                    continue
                states = torch.empty(STATES, sub.numel, dtype=self.dtype)
                if keep_moments:
                    current = self.swap.swap_in(sub.key)
                    self.swap.wait(sub.key)
                    states.copy_(current.view(STATES, sub.numel))
                    del current
                rows = slice(0, 1) if keep_moments else slice(0, STATES)
                for run in sub.runs:
                    unit = self.units[run.unit]
                    lo = run.unit_start - unit.pieces[run.piece].shard_start
                    block = states[:, run.offset : run.offset + run.numel]
                    block[rows].copy_(values(run.unit, run.piece, lo, lo + run.numel)[rows])
                    out = outs.setdefault(run.unit, torch.zeros(unit.shard_numel, dtype=unit.dtype))
                    out[run.unit_start : run.unit_start + run.numel].copy_(block[0])
                swap.swap_out(sub.key, states)
                if writing is not None:
                    swap.wait(writing)
                writing, held = sub.key, states
                for u in sub.finishes:
                    unit_shard(u, outs.pop(u))
            if writing is not None:
                swap.wait(writing)
            del held
        except BaseException:
            swap.close()
            raise
        return swap

    def adopt(self, swap: SwapManager) -> None:
        """``swap`` (from ``stage``) holds the states from now on; the old
        swap file is removed."""
        old, self.swap = self.swap, swap
        old.close()

    def write_unit(self, unit: int, values: torch.Tensor) -> None:
        """``values`` (the unit's shard) become its master values on disk."""
        for sub, runs, states in self._sub_groups_of(lambda r: r.unit == unit):
            for r in runs:
                states[0, r.offset : r.offset + r.numel].copy_(values[r.unit_start : r.unit_start + r.numel])
            self.swap.swap_out(sub.key, states)
            self.swap.wait(sub.key)

    def read_piece(self, unit: int, piece: int) -> torch.Tensor:
        """One piece's [master, exp_avg, exp_avg_sq] ([STATES, numel] of
        ``dtype``), read from the sub-groups that hold it only."""
        meta = self.units[unit].pieces[piece]
        out = torch.empty(STATES, meta.numel, dtype=self.dtype)
        for _, runs, states in self._sub_groups_of(lambda r: r.unit == unit and r.piece == piece):
            for r in runs:
                start = r.unit_start - meta.shard_start
                out[:, start : start + r.numel].copy_(states[:, r.offset : r.offset + r.numel])
        return out

    def write_piece(self, unit: int, piece: int, row: int, values: torch.Tensor) -> None:
        """``values`` (the piece's elements) into row ``row`` of its states on disk."""
        meta = self.units[unit].pieces[piece]
        for sub, runs, states in self._sub_groups_of(lambda r: r.unit == unit and r.piece == piece):
            for r in runs:
                start = r.unit_start - meta.shard_start
                states[row, r.offset : r.offset + r.numel].copy_(values[start : start + r.numel])
            self.swap.swap_out(sub.key, states)
            self.swap.wait(sub.key)

    def _sub_groups_of(self, selected: Callable[[Run], bool]) -> Iterator[tuple[SubGroup, list[Run], torch.Tensor]]:
        """Each sub-group with runs ``selected``, those runs, and its states
        read in ([STATES, numel]), one sub-group at a time."""
        for sub in self.sub_groups:
            runs = [r for r in sub.runs if selected(r)]
            if not runs:
                continue
            states = self.swap.swap_in(sub.key)
            self.swap.wait(sub.key)
            yield sub, runs, states.view(STATES, sub.numel)
            del states

    def take(self, unit: int, values: torch.Tensor) -> None:
        """At start-up, unit by unit in order: ``values`` (the unit's shard,
        before any cast) become its master; moments start at zero. Each
        sub-group is written once its last unit is taken, so host memory
        holds one sub-group."""
        while self._filling < len(self.sub_groups):
            sub = self.sub_groups[self._filling]
            if sub.numel == 0:
                self._filling += 1
                continue
            if self._buffer is None:
                self._buffer = torch.zeros(STATES, sub.numel, dtype=self.dtype)
            for run in sub.runs:
                if run.unit == unit:
                    self._buffer[0, run.offset : run.offset + run.numel].copy_(
                        values[run.unit_start : run.unit_start + run.numel]
                    )
            if sub.runs[-1].unit > unit:
                return  # later units fill the rest
            self.swap.swap_out(sub.key, self._buffer)
            self.swap.wait(sub.key)
            self._buffer = None
            self._filling += 1

    def finish(self) -> None:
        """After the last ``take``: every sub-group is on disk."""
        if self._buffer is not None or any(s.numel > 0 for s in self.sub_groups[self._filling :]):
            raise InvalidStateError("the optimizer's sub-groups were not all given their values at start-up")


def matrix_rows(rule: MatrixOptimizer) -> dict[str, int]:
    """The rows where a whole-matrix optimizer's per-element states rest."""
    return {key: row for row, key in enumerate(rule.state_keys, start=1)}


def state_rows(inner: torch.optim.Optimizer) -> Callable[[torch.Tensor], dict[str, int]]:
    """For a piece of ``inner``'s, the rows of its sub-groups where its
    ranged optimizer states rest on NVMe, by state key."""
    if not isinstance(inner, MatrixAndElementwise):
        return lambda piece: ADAM_ROWS
    rows = matrix_rows(inner.matrix)
    matrix_pieces = {id(p) for g in inner.matrix.param_groups for p in g["params"]}
    return lambda piece: rows if id(piece) in matrix_pieces else ADAM_ROWS


def resting_keys(state: dict, rows: dict[str, int]) -> list[str]:
    """The ranged keys of a piece's optimizer state on NVMe: Adam's
    moments, which its step implies; a whole-matrix optimizer's, which a
    meta marker in the state stands for (``resting_state``)."""
    return [key for key in rows if key in state or "step" in state]


def resting_state(state: dict, rows: dict[str, int], like: torch.Tensor) -> dict:
    """What the optimizer keeps in memory of a piece's state whose ranged
    values rest on NVMe: its scalars (Adam's step), and for a state without
    a step (Muon's) a marker per ranged key (``mark_resting``)."""
    kept = {key: value for key, value in state.items() if key not in rows}
    if "step" not in state:
        mark_resting(kept, [key for key in rows if key in state], like)
    return kept


def mark_resting(state: dict, keys: list[str], like: torch.Tensor) -> None:
    """Puts a meta tensor like ``like`` in ``state`` for each of ``keys``
    it lacks: those ranged states rest on NVMe."""
    for key in keys:
        state.setdefault(key, torch.empty_like(like, device="meta"))


class SwappedAdamUpdate(TorchUpdate):
    """One Adam/AdamW step streamed over the sub-groups (module docstring).
    Pieces of a whole-matrix optimizer's (zcore.step.swapped_matrix) are not
    its to step: it writes their compute-dtype values out only."""

    def __init__(
        self, inner: torch.optim.Optimizer, master: SwappedMaster, reducer: GradientReducer, shards: UnitShards,
        read_ahead: bool = True, write_behind: bool = True, background: Optional[BackgroundStep] = None,
    ) -> None:
        """``background``: stream the sub-groups behind the next forward
        (zcore.step.background_step); only where every unit's shard is updated
        in place in host memory."""
        self.inner = inner
        self.master = master
        self.reducer = reducer
        self.shards = shards
        self.host_grads = None
        self.background = background
        # Stage 3 units are parameter groups: the fetcher waits by group.
        self._unit_of_group = {getattr(unit, "index", u): u for u, unit in enumerate(master.units)}
        self._read_ahead = read_ahead
        self._write_behind = write_behind
        self._used: list[list[bool]] = [[] for _ in master.units]
        self._grads: dict[int, torch.Tensor] = {}  # unit -> its gradient shard on the host, during a step
        self._group_of = {id(p): i for i, g in enumerate(inner.param_groups) for p in g["params"]}
        # The first groups are a whole-matrix optimizer's, the others zcore's CPU Adam's.
        self._matrix_groups = inner.matrix_groups if isinstance(inner, MatrixAndElementwise) else 0
        adam = inner.elementwise if isinstance(inner, MatrixAndElementwise) else inner
        self._threads = adam.num_threads if isinstance(adam, CPUAdam) else None

    def steps_adam(self, piece: torch.nn.Parameter) -> bool:
        """Whether Adam steps ``piece`` (not a whole-matrix optimizer)."""
        return self._group_of[id(piece)] >= self._matrix_groups

    def grad_source(self, unit: int) -> torch.Tensor:
        return self.reducer.grad_shard(unit)

    def attach_grads(self, used: list[torch.Tensor]) -> None:
        self._used = [flags.tolist() for flags in used]

    def detach_grads(self) -> None:
        self._used = [[] for _ in self.master.units]

    def state_bytes(self) -> int:
        return 0  # on NVMe; sub-groups pass through host memory during the step only

    def close(self) -> None:
        if self.background is not None:
            self.background.finish_quietly()  # its files are about to go
        try:
            self.master.swap.close()
        finally:
            self.reducer.close()

    def apply(self, coefficient: float) -> None:
        """Steps every sub-group; with ``background``, on a worker thread
        that is still running when this returns."""
        units, pieces = self.master.units, self.master.pieces
        steps = {}  # (unit, piece) -> the step this update takes, for pieces with a gradient
        for u, unit in enumerate(units):
            for k, meta in enumerate(unit.pieces):
                if self._used[u][meta.param_index] and self.steps_adam(pieces[u][k]):
                    state = self._state(pieces[u][k])
                    steps[(u, k)] = int(state["step"].item()) + 1
        # Taken now: a scheduler changes the learning rate once this returns.
        configs = [group_config(g) if i >= self._matrix_groups else None for i, g in enumerate(self.inner.param_groups)]
        if self.background is None:
            self._stream(steps, configs, coefficient, lambda u: None)
        else:
            self.background.start(functools.partial(self._stream, steps, configs, coefficient))

    def wait_group(self, group: int) -> None:
        """Stage 3, with ``background``: until the update of the unit that
        is parameter group ``group`` is complete (frozen groups: at once)."""
        u = self._unit_of_group.get(group)
        if u is not None and self.background is not None:
            self.background.wait_unit(u)

    def _stream(self, steps: dict, configs: list, coefficient: float, report: Callable[[int], None]) -> None:
        units, pieces = self.master.units, self.master.pieces
        for u, unit in enumerate(units):
            if not unit.pieces:
                report(u)
        outs: dict[int, torch.Tensor] = {}
        self._grads.clear()
        subs = {s.key: s for s in self.master.sub_groups if s.numel > 0}
        stream = self.master.swap.stream(subs, read_ahead=self._read_ahead, write_behind=self._write_behind)
        # Driven to its end (never zip()ped), so that the last sub-group is written back.
        for key, states in stream:
            sub = subs[key]
            with tracing.span("optimizer_sub_group"):
                self._step_sub_group(sub, states.view(STATES, sub.numel), steps, configs, coefficient, outs)
            for u in sub.finishes:
                self._grads.pop(u, None)
                out = outs.pop(u)
                if out is not self.shards.resident(units[u]):
                    self.shards.write(units[u], out)
                report(u)
            # The stream reads the next sub-group into host buffers this one
            # would still hold (buffer_count counts those in flight only).
            del states
        for (u, k) in steps:
            self.inner.state[pieces[u][k]]["step"] += 1

    def _step_sub_group(
        self, sub: SubGroup, states: torch.Tensor, steps: dict, configs: list, coefficient: float, outs: dict
    ) -> None:
        self._step_matrices(sub, states)
        master, exp_avg, exp_avg_sq = states[0], states[1], states[2]
        batches: dict[tuple[int, int], list[Run]] = defaultdict(list)
        for run in sub.runs:
            step = steps.get((run.unit, run.piece))
            if step is not None:
                group = self._group_of[id(self.master.pieces[run.unit][run.piece])]
                batches[(group, step)].append(run)
            if run.unit not in outs:
                outs[run.unit] = self._out_buffer(run.unit)
        for (group, step), runs in batches.items():
            views = [slice(r.offset, r.offset + r.numel) for r in runs]
            grads = [self._grad(r) for r in runs]
            unit_dtype = self.master.units[runs[0].unit].dtype
            fused_out = unit_dtype in (torch.bfloat16, torch.float16)
            adam_step(
                configs[group], step,
                [master[v] for v in views], grads, [exp_avg[v] for v in views], [exp_avg_sq[v] for v in views],
                params_out=[self._out_view(outs, r) for r in runs] if fused_out else None,
                grad_scale=coefficient,
                num_threads=self._threads,
            )
        for run in sub.runs:
            out = self._out_view(outs, run)
            if out.dtype == torch.float32 or (run.unit, run.piece) not in steps:
                # fp32 compute, or a piece without a gradient: the master is the value.
                out.copy_(master[run.offset : run.offset + run.numel])

    def _step_matrices(self, sub: SubGroup, states: torch.Tensor) -> None:
        """The whole-matrix optimizer's element-wise step on its runs in
        ``sub`` ([STATES, numel]): none here (zcore.step.swapped_matrix)."""
        return None

    def _grad(self, run: Run) -> torch.Tensor:
        """Read once per unit (from NVMe, or copied from the device) and
        kept until the unit's last sub-group is stepped."""
        shard = self._grads.get(run.unit)
        if shard is None:
            shard = self.reducer.grad_shard(run.unit)
            shard = self._grads[run.unit] = shard if shard.device.type == "cpu" else shard.to("cpu")
        return shard[run.unit_start : run.unit_start + run.numel]

    def _out_buffer(self, unit: int) -> torch.Tensor:
        resident = self.shards.resident(self.master.units[unit])
        if resident is not None and resident.device.type == "cpu":
            return resident
        u = self.master.units[unit]
        return torch.zeros(u.shard_numel, dtype=u.dtype)  # padding included: it is written out

    @staticmethod
    def _out_view(outs: dict, run: Run) -> torch.Tensor:
        return outs[run.unit][run.unit_start : run.unit_start + run.numel]

    def _state(self, piece: torch.nn.Parameter) -> dict:
        state = self.inner.state[piece]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        return state


def swap_capacity(sub_groups: list[SubGroup]) -> int:
    return sum(-(-s.nbytes // PAGE_ALIGNMENT) * PAGE_ALIGNMENT for s in sub_groups)


# Host memory the NVMe optimizer's buffers take when sub_group_size is not
# set: enough for sub-groups of hundreds of MB (disk bandwidth saturates well
# below that), and never more than a quarter of what the host has available.
DEFAULT_HOST_BYTES = 4 << 30
# By default a rank's states are cut into at least this many sub-groups, so
# that a step reads, updates and writes them at once instead of in turn
# (one sub-group of a 92M-parameter GPT's states: 8.63 s per training step
# on 2 ranks, against 7.91 s with eight);
# but none under MIN_SUB_GROUP elements (12 MiB of states), to keep the
# reads and writes large.
MIN_SUB_GROUPS = 8
MIN_SUB_GROUP = 1 << 20


def sub_group_elements(
    total: int, buffers: int, size: int, size_set: bool, available: int, element_size: int = FP32_BYTES
) -> int:
    """Elements per sub-group for ``total`` optimizer elements on this rank:
    ``size`` (zero_optimization.sub_group_size) when set, if ``buffers``
    sub-groups fit in ``available`` host bytes (else a ConfigError naming the
    size that fits); by default, an eighth of the states (MIN_SUB_GROUPS),
    within the default host budget. ``element_size``: of the master and the
    moments."""
    per_element = buffers * STATES * element_size
    if size_set:
        if buffers * min(size, total) * STATES * element_size > available:
            raise ConfigError(
                f"zero_optimization.sub_group_size = {size} with offload_optimizer.buffer_count = "
                f"{buffers} needs {buffers} host buffers of {STATES * element_size} bytes per element "
                f"({per_element * min(size, total)} bytes), more than the {available} bytes this "
                f"host has available: set sub_group_size to at most {available // per_element}"
            )
        return max(1, min(size, total))
    budget = min(DEFAULT_HOST_BYTES, available // 4)
    pipelined = max(-(-total // MIN_SUB_GROUPS), MIN_SUB_GROUP)
    return max(1, min(size, total, pipelined, budget // per_element))


def host_bytes_available() -> int:
    """MemAvailable from /proc/meminfo (Linux), in bytes."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")
