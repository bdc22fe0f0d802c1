"""Optimizer states on NVMe (``offload_optimizer.device = "nvme"``).

The fp32 master shards and Adam's two moments of every unit on this rank
form one flat range of elements, cut into sub-groups of at most
``sub_group_size`` elements (a sub-group may hold the ends of several units,
and a large unit spans several sub-groups). Each sub-group is one swap key
whose bytes are ``[master | exp_avg | exp_avg_sq]`` in fp32. A step streams
the sub-groups through host memory: the next one is read while this one is
stepped by zcore's fused CPU Adam, and the previous one is written back
meanwhile, so host memory holds about three sub-groups whatever the model's
size. The compute-dtype shard of each unit is written out in the same pass
(zcore.sharded_optimizer.UnitShards: in place, or to the parameter tier).

The torch optimizer the user sees (``engine.optimizer.inner``, a CPUAdam)
keeps the parameter groups (hyper-parameters, which a scheduler changes) and
each piece's step count; its pieces are placeholders on the meta device, as
the values they stand for are on disk.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from zcore.errors import ConfigError
from zcore.grad_reduction import GradientReducer
from zcore.host_memory import PAGE_ALIGNMENT
from zcore.optim import CPUAdam
from zcore.optim.adam import group_config
from zcore.optim.functional import adam_step
from zcore.partition import Unit
from zcore.sharded_optimizer import TorchUpdate, UnitShards, pieces_by_param
from zcore.swap import SwapManager

FP32_BYTES = 4
STATES = 3  # master, exp_avg, exp_avg_sq


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

    @property
    def nbytes(self) -> int:
        return STATES * self.numel * FP32_BYTES


def plan_sub_groups(units: list[Unit], size: int) -> list[SubGroup]:
    """The units' pieces laid end to end and cut every ``size`` elements.
    Elements no piece covers (a unit's padding) are not stored."""
    groups: list[SubGroup] = []
    current = SubGroup(0, 0)
    for u, unit in enumerate(units):
        for k, meta in enumerate(unit.pieces):
            start, left = meta.shard_start, meta.numel
            while left > 0:
                if current.numel == size:
                    groups.append(current)
                    current = SubGroup(len(groups), 0)
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

    def __init__(self, units: list[Unit], sub_groups: list[SubGroup], swap: SwapManager) -> None:
        self.units = units
        self.swap = swap
        self.sub_groups = sub_groups
        self.pieces = [
            [torch.nn.Parameter(torch.empty(p.numel, device="meta")) for p in unit.pieces] for unit in units
        ]
        self._write_initial_states()

    def piece_of(self) -> dict[int, list[torch.nn.Parameter]]:
        return pieces_by_param(self.units, self.pieces)

    def numel(self) -> int:
        return sum(s.numel for s in self.sub_groups)

    def write_unit(self, unit: int, values: torch.Tensor) -> None:
        """``values`` (the unit's shard) become its master values on disk."""
        for sub in self.sub_groups:
            runs = [r for r in sub.runs if r.unit == unit]
            if not runs:
                continue
            states = self.swap.swap_in(sub.key)
            self.swap.wait(sub.key)
            master = states.view(STATES, sub.numel)[0]
            for r in runs:
                master[r.offset : r.offset + r.numel].copy_(values[r.unit_start : r.unit_start + r.numel])
            self.swap.swap_out(sub.key, states)
            self.swap.wait(sub.key)

    def _write_initial_states(self) -> None:
        """Master values from the units' shards (still fp32, before the model
        is cast), moments zero; one sub-group in host memory at a time."""
        for sub in self.sub_groups:
            if sub.numel == 0:
                continue
            states = torch.zeros(STATES, sub.numel, dtype=torch.float32)
            for run in sub.runs:
                shard = self.units[run.unit].local_shard
                states[0, run.offset : run.offset + run.numel].copy_(
                    shard[run.unit_start : run.unit_start + run.numel]
                )
            self.swap.swap_out(sub.key, states)
            self.swap.wait(sub.key)


class SwappedAdamUpdate(TorchUpdate):
    """One Adam/AdamW step streamed over the sub-groups (module docstring)."""

    def __init__(
        self, inner: CPUAdam, master: SwappedMaster, reducer: GradientReducer, shards: UnitShards,
        read_ahead: bool = True, write_behind: bool = True,
    ) -> None:
        self.inner = inner
        self.master = master
        self.reducer = reducer
        self.shards = shards
        self.host_grads = None
        self._read_ahead = read_ahead
        self._write_behind = write_behind
        self._used: list[list[bool]] = [[] for _ in master.units]
        self._group_of = {id(p): i for i, g in enumerate(inner.param_groups) for p in g["params"]}

    def grad_source(self, unit: int) -> torch.Tensor:
        return self.reducer.grad_shard(unit)

    def attach_grads(self, used: list[torch.Tensor]) -> None:
        self._used = [flags.tolist() for flags in used]

    def detach_grads(self) -> None:
        self._used = [[] for _ in self.master.units]

    def state_bytes(self) -> int:
        return 0  # on NVMe; sub-groups pass through host memory during the step only

    def close(self) -> None:
        self.master.swap.close()

    def apply(self, coefficient: float) -> None:
        units, pieces = self.master.units, self.master.pieces
        steps = {}  # (unit, piece) -> the step this update takes, for pieces with a gradient
        for u, unit in enumerate(units):
            for k, meta in enumerate(unit.pieces):
                if self._used[u][meta.param_index]:
                    state = self._state(pieces[u][k])
                    steps[(u, k)] = int(state["step"].item()) + 1
        outs: dict[int, torch.Tensor] = {}
        subs = {s.key: s for s in self.master.sub_groups if s.numel > 0}
        stream = self.master.swap.stream(subs, read_ahead=self._read_ahead, write_behind=self._write_behind)
        # Driven to its end (never zip()ped), so that the last sub-group is written back.
        for key, states in stream:
            sub = subs[key]
            self._step_sub_group(sub, states.view(STATES, sub.numel), steps, coefficient, outs)
            for u in sub.finishes:
                out = outs.pop(u)
                if out is not self.shards.resident(units[u]):
                    self.shards.write(units[u], out)
        for (u, k) in steps:
            self.inner.state[pieces[u][k]]["step"] += 1

    def _step_sub_group(
        self, sub: SubGroup, states: torch.Tensor, steps: dict, coefficient: float, outs: dict
    ) -> None:
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
                group_config(self.inner.param_groups[group]), step,
                [master[v] for v in views], grads, [exp_avg[v] for v in views], [exp_avg_sq[v] for v in views],
                params_out=[self._out_view(outs, r) for r in runs] if fused_out else None,
                grad_scale=coefficient,
                num_threads=self.inner.num_threads,
            )
        for run in sub.runs:
            out = self._out_view(outs, run)
            if out.dtype == torch.float32 or (run.unit, run.piece) not in steps:
                # fp32 compute, or a piece without a gradient: the master is the value.
                out.copy_(master[run.offset : run.offset + run.numel])

    def _grad(self, run: Run) -> torch.Tensor:
        shard = self.reducer.grad_shard(run.unit)[run.unit_start : run.unit_start + run.numel]
        return shard if shard.device.type == "cpu" else shard.to("cpu")

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


def sub_group_elements(total: int, buffers: int, size: int, size_set: bool, available: int) -> int:
    """Elements per sub-group for ``total`` optimizer elements on this rank:
    ``size`` (zero_optimization.sub_group_size) when set, if ``buffers``
    sub-groups fit in ``available`` host bytes (else a ConfigError naming the
    size that fits); by default, what fits in the default host budget."""
    per_element = buffers * STATES * FP32_BYTES
    if size_set:
        if buffers * min(size, total) * STATES * FP32_BYTES > available:
            raise ConfigError(
                f"zero_optimization.sub_group_size = {size} with offload_optimizer.buffer_count = "
                f"{buffers} needs {buffers} host buffers of {STATES * FP32_BYTES} bytes per element "
                f"({per_element * min(size, total)} bytes), more than the {available} bytes this "
                f"host has available: set sub_group_size to at most {available // per_element}"
            )
        return max(1, min(size, total))
    budget = min(DEFAULT_HOST_BYTES, available // 4)
    return max(1, min(size, total, budget // per_element))


def host_bytes_available() -> int:
    """MemAvailable from /proc/meminfo (Linux), in bytes."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")
