"""Bytes per rank, per category and per tier: measured from the tensors and
swap files zcore holds, beside the figures the stage's layout and the offload
policy predict for this model.

Tiers are where zcore put the bytes, by policy, not ``tensor.device``: on a
CPU-only machine the compute device is the host, and its bytes still count
as "device" unless offload moved them to "host". Working memory (the
gather arena, staging for offloaded shards, swap I/O buffers, sub-groups
passing through host memory during a step) is not counted; the host copy
asynchronous checkpoint saves write from is reported apart (``checkpoint_copy``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

import zcore._C as _C
from zcore.comm.compressed_allreduce import padded_numel
from zcore.step.gradient_shards import SwappedGradients
from zcore.parallel.dtensor import local_tensor
from zcore.optim import CompressedAdam, ZeroOneAdam
from zcore.step.units import Unit
from zcore.config.policies import Policies, Tier
from zcore.step.precision import MixedPrecision
from zcore.step.sharded_optimizer import ShardedOptimizer

if TYPE_CHECKING:
    from zcore.zero3.param_fetcher import ParamFetcher

DEVICE, HOST, NVME = "device", "host", "nvme"
TIERS = (DEVICE, HOST, NVME)
CATEGORIES = ("parameters", "gradients", "optimizer_states", "buffers")
TIER_NAMES = {Tier.DEVICE: DEVICE, Tier.HOST: HOST, Tier.NVME: NVME}
_SHARD_TIER_NAMES = {_C.ShardTier.DEVICE: DEVICE, _C.ShardTier.HOST: HOST, _C.ShardTier.NVME: NVME}
_MIB = 2**20


@dataclass(frozen=True)
class MemoryFigures:
    parameters: int
    gradients: int
    optimizer_states: int
    buffers: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.buffers


@dataclass(frozen=True)
class MemoryReport:
    stage: int
    world_size: int
    trainable_parameters: int  # elements
    parameter_tier: str  # where parameter shards rest between uses (offload_param)
    optimizer_tier: str  # where the optimizer's states live (offload_optimizer)
    measured_tiers: dict[str, MemoryFigures]  # keyed by TIERS
    theoretical_tiers: dict[str, MemoryFigures]
    # Host bytes held for the copy asynchronous checkpoint saves write from
    # (zcore.checkpoint.snapshot): working memory, apart from the model states.
    checkpoint_copy: int = 0

    @property
    def measured(self) -> MemoryFigures:
        """Bytes per category, all tiers together."""
        return _sum(self.measured_tiers.values())

    @property
    def theoretical(self) -> MemoryFigures:
        return _sum(self.theoretical_tiers.values())

    def __str__(self) -> str:
        columns = [*TIERS, "total"]
        measured = {**self.measured_tiers, "total": self.measured}
        theoretical = {**self.theoretical_tiers, "total": self.theoretical}
        rows = [
            f"zcore memory per rank, MiB (stage {self.stage}, world size {self.world_size}; "
            f"parameters on {self.parameter_tier}, optimizer states on {self.optimizer_tier})",
            (f"{'':18}" + "".join(f"{c:^20}" for c in columns)).rstrip(),
            f"{'':18}" + f"{'measured':>11}{'theory':>9}" * len(columns),
        ]
        for name in (*CATEGORIES, "total"):
            cells = "".join(
                f"{getattr(measured[c], name) / _MIB:>11.2f}{getattr(theoretical[c], name) / _MIB:>9.2f}"
                for c in columns
            )
            rows.append(f"{name:18}{cells}")
        if self.checkpoint_copy:
            rows.append(f"host memory held for asynchronous checkpoint saves: {self.checkpoint_copy / _MIB:.2f} MiB")
        return "\n".join(rows)


def _sum(figures: Iterable[MemoryFigures]) -> MemoryFigures:
    figures = list(figures)
    return MemoryFigures(**{c: sum(getattr(f, c) for f in figures) for c in CATEGORIES})


class _Table:
    """Bytes by (category, tier), filled by adding."""

    def __init__(self) -> None:
        self._bytes: defaultdict[tuple[str, str], int] = defaultdict(int)

    def add(self, category: str, tier: str, nbytes: int) -> None:
        self._bytes[(category, tier)] += nbytes

    def figures(self) -> dict[str, MemoryFigures]:
        return {t: MemoryFigures(**{c: self._bytes[(c, t)] for c in CATEGORIES}) for t in TIERS}


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)  # a DTensor's bytes on this rank (zcore.parallel.mesh)
    return t.numel() * t.element_size()


def _tensor_bytes(tensors: Iterable[Any]) -> int:
    """Each tensor object once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += _nbytes(t)
    return total


def measure_memory(
    module: torch.nn.Module,
    optimizer: Optional[ShardedOptimizer],
    policies: Policies,
    residency: Any,
    device: torch.device,
    checkpoint_copy: int = 0,
) -> MemoryReport:
    """``residency``: the engine's (zcore.engine.residency.ParamResidency); in stage 3
    a zcore.zero3.param_fetcher.ParamFetcher. ``device``: the compute device.
    ``optimizer`` None: an inference engine, without gradients or states.
    ``checkpoint_copy``: host bytes held for asynchronous checkpoint saves."""
    stage, offload = policies.stage, policies.offload
    units = optimizer.units if optimizer is not None else []
    measured, theoretical = _Table(), _Table()
    if stage.shards_parameters:
        _measure_sharded_parameters(residency, measured)
        _theory_sharded_parameters(residency, policies, optimizer is not None, theoretical)
    else:
        # Whole on every rank: the units, and the parameters outside them (frozen).
        in_units = {id(p) for u in units for p in u.params}
        others = _tensor_bytes(p for p in module.parameters() if id(p) not in in_units)
        measured.add("parameters", DEVICE, _tensor_bytes(residency.stored_tensors()) + others)
        theoretical.add("parameters", DEVICE, sum(u.numel * u.dtype.itemsize for u in units) + others)
    if optimizer is not None:
        _measure_gradients(optimizer, measured)
        _measure_optimizer_states(optimizer, offload.optimizer, measured)
        _theory_states(policies, units, device, optimizer.precision, theoretical)
        if isinstance(optimizer.inner, CompressedAdam):
            _theory_compressed(optimizer.inner, theoretical)
    buffers = _tensor_bytes(module.buffers())
    measured.add("buffers", DEVICE, buffers)
    theoretical.add("buffers", DEVICE, buffers)

    return MemoryReport(
        stage=stage.stage,
        world_size=stage.world_size,
        trainable_parameters=sum(u.numel for u in units),
        parameter_tier=TIER_NAMES[offload.parameters],
        optimizer_tier=TIER_NAMES[offload.optimizer],
        measured_tiers=measured.figures(),
        theoretical_tiers=theoretical.figures(),
        checkpoint_copy=checkpoint_copy,
    )


# Measured.
def _measure_sharded_parameters(fetcher: ParamFetcher, table: _Table) -> None:
    """Stage 3: each group's shard on its tier (NVMe: its extent in the swap
    file), the gathered buffers of persistent groups and the hpZ
    secondaries held (zcore.zero3.secondary_partition) on the device."""
    for g in fetcher.groups:
        if g.in_memory:
            table.add("parameters", _SHARD_TIER_NAMES[fetcher.shard_tier(g.index)], _nbytes(g.local_shard))
        if fetcher.persistent(g.index) and fetcher.buffers.holds(g.index):
            table.add("parameters", DEVICE, _nbytes(fetcher.buffers.current(g.index)))
    table.add("parameters", DEVICE, _tensor_bytes(fetcher.gathers.held()))
    table.add("parameters", NVME, fetcher.parameter_swap_bytes())


def _measure_gradients(optimizer: ShardedOptimizer, table: _Table) -> None:
    """The reducer's fp32 gradients are on the device; an optimizer offloaded
    to the host from a GPU keeps copies of the shards beside it, in the
    master's dtype."""
    reducer = optimizer.reducer
    table.add("gradients", DEVICE, _tensor_bytes(reducer.held_tensors()))
    grads = getattr(reducer, "grads", None)
    if isinstance(grads, SwappedGradients):
        table.add("gradients", NVME, grads.nvme_bytes())
    table.add("gradients", HOST, _tensor_bytes(optimizer.update.host_grads or []))


def _measure_optimizer_states(optimizer: ShardedOptimizer, tier: Tier, table: _Table) -> None:
    """In memory on the optimizer's tier (NVMe states pass through the host);
    on NVMe, the sub-groups' extents in the swap file. 1-bit Adam and 0/1
    Adam keep more beside their states (on the device: they refuse offload)."""
    table.add("optimizer_states", HOST if tier is Tier.NVME else TIER_NAMES[tier], optimizer.state_bytes())
    if tier is Tier.NVME:
        table.add("optimizer_states", NVME, optimizer.master.swap.stats().used)
    if isinstance(optimizer.inner, CompressedAdam):
        table.add("optimizer_states", DEVICE, _tensor_bytes(optimizer.inner.held_tensors()))


# Theoretical (the ZeRO paper's figures for this model; padding is not counted).
# With Psi trained elements, N ranks sharding (the world, or MiCS's shard
# group) and p bytes per compute-dtype element:
# - parameters: stages 0-2 p*Psi on the device (and frozen parameters whole);
#   stage 3 p*numel/N per group on offload_param's tier, except that a
#   persistent group (below stage3_param_persistence_threshold) keeps its
#   shard and its gathered p*numel on the device; with hpZ (blocks of h
#   ranks), a non-persistent group's secondary adds p*numel/h on the device
#   from its first gather after an optimizer step until the next step, for
#   good where no step changes it (frozen groups, an engine without
#   optimizer): between steps, where reports are taken, only those;
# - gradients, fp32 on the device: a full-size accumulator 4*Psi in stages 0
#   and 1, plus the reduced shard 4*Psi/N in stage 1; in stages 2 and 3 the
#   shard 4*Psi/N only from an accumulation window's first gradient to the
#   step, which frees it (none between steps), or on NVMe with the optimizer
#   states there. An optimizer on the host, with a GPU computing, adds
#   host copies of the shards in the master's dtype, m*Psi/N (m*Psi in stage 0);
# - optimizer states: Adam's master (m bytes: 4, or 2 with bf16 master
#   weights), exp_avg and exp_avg_sq (s bytes each: 4, or 2 with bf16
#   optimizer states), (m + 2s)*Psi/N ((m + 2s)*Psi in stage 0; 12*Psi/N
#   in fp32) on offload_optimizer's tier; on NVMe none stays in
#   memory between steps; 1-bit Adam and 0/1 Adam (stage 0, on the device)
#   add fp32 error feedback once they have compressed (``_theory_compressed``,
#   whose padding is counted: it is the algorithm's, as DeepSpeed pads);
# - buffers: the module's, whole on the device on every rank.
def _theory_sharded_parameters(fetcher: ParamFetcher, policies: Policies, steps: bool, table: _Table) -> None:
    """``steps``: an optimizer changes the trained groups between steps."""
    offload, world, hpz = policies.offload, policies.stage.shard_size, policies.comm.hpz_size
    kept, spilled = 0, False  # offload_param.max_in_cpu: NVMe shards kept in host memory, in order
    for g in fetcher.groups:
        full = g.numel * g.dtype.itemsize
        if fetcher.persistent(g.index):
            table.add("parameters", DEVICE, full // world + full)
            continue
        if hpz > 1 and not (steps and g.trainable):
            table.add("parameters", DEVICE, full // hpz)
        tier = TIER_NAMES[offload.parameters]
        if offload.parameters is Tier.NVME:
            spilled = spilled or kept + g.shard_numel > offload.nvme_host_elements
            if not spilled:
                kept += g.shard_numel
                tier = HOST
        table.add("parameters", tier, full // world)


def _theory_states(
    policies: Policies, units: list[Unit], device: torch.device, precision: MixedPrecision, table: _Table
) -> None:
    stage, offload = policies.stage, policies.offload
    m, s = precision.master_dtype.itemsize, precision.state_dtype.itemsize
    psi = sum(u.numel for u in units)
    shards = stage.shard_size if stage.shards_optimizer_states else 1
    shard = psi // shards
    reduced = 4 * shard if stage.shards_optimizer_states else 0
    if not stage.reduce_scatters_every_micro_step:
        table.add("gradients", DEVICE, 4 * psi + reduced)  # the full-size accumulator and stage 1's shard
    elif offload.optimizer is Tier.NVME:
        table.add("gradients", NVME, reduced)
    # Otherwise (stages 2-3 in memory) the step frees the shards (zcore.step.gradient_shards).
    if offload.optimizer is Tier.HOST and device.type != "cpu":
        table.add("gradients", HOST, m * shard)
    table.add("optimizer_states", TIER_NAMES[offload.optimizer], (m + 2 * s) * shard)


def _theory_compressed(inner: CompressedAdam, table: _Table) -> None:
    """1-bit Adam and 0/1 Adam on N ranks (zcore.comm.compressed_allreduce),
    beside their states. From the first compressed exchange (none before
    it, nor after a checkpoint load until the next), each compressed
    parameter's error feedback in fp32: a worker error of its elements
    padded as DeepSpeed pads them (``padded_numel``: a multiple of N x
    lcm(N, 8), per parameter) and a server error of 1/N of that. 0/1 Adam,
    from its first local step, also each parameter's fp32 values at the last
    synchronisation."""
    world = inner.world_size
    if inner.errors:
        compressed = [p for g in inner.param_groups if inner.compresses(g) for p in g["params"]]
        padded = [padded_numel(p.numel(), world) for p in compressed]
        table.add("optimizer_states", DEVICE, sum(4 * (n + n // world) for n in padded))
    if isinstance(inner, ZeroOneAdam) and inner.synchronised:
        table.add("optimizer_states", DEVICE, sum(4 * p.numel() for g in inner.param_groups for p in g["params"]))
