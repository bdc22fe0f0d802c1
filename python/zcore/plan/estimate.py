"""Will it fit? Per-rank bytes on the device, the host and NVMe for a model
and a config, before any engine is built (the cheapest configuration that
fits a budget: zcore.plan.recommend).

The figures follow the layouts zcore builds, computed from element counts
alone (a model on the meta device is never materialised):
- model states (parameters, gradients, optimizer states, buffers) as
  ``engine.memory_report()`` measures them, padding and swap-file
  alignment included: stages 0-2 pack trained parameters into units
  (zcore.step.units), stage 3 groups each module's direct parameters
  (zcore.zero3.sharded_group.plan_groups), persistent groups stay gathered;
- working memory memory_report leaves out: the fp32 gradient shards of
  stages 2-3 in memory (held from backward to the step), stage 3's gather arena
  (zcore.zero3.gather_buffers), the gradient buckets reduce-scatters send from
  (zcore.step.grad_reduction), staging for offloaded parameter shards and the
  host pools NVMe swaps read through (zcore.zero3.param_fetcher,
  zcore.step.swapped_optimizer, zcore.initialize); with checkpoint.async_save,
  the host copy of the rank's checkpoint (zcore.checkpoint.snapshot), which
  memory_report shows apart;
- activations: the tensors autograd saves in one forward of a sample
  input, run on the meta device (for a bare count, token ids through a
  GPT-like shape assumed from it: zcore.plan.assumed_gpt), or a figure given.
Figures are for rank 0, whose shards hold the most elements (padding sits
at the end of the last rank's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch

import zcore._C as _C
from zcore.plan.activation_estimate import SampleInput, saved_tensor_bytes
from zcore.plan.assumed_gpt import GPTShape
from zcore.comm.collectives import DistributedContext
from zcore.comm.compressed_allreduce import padded_numel
from zcore.config.schema import Config, load_config
from zcore.errors import InvalidArgumentError
from zcore.zero3.gather_buffers import arena_capacity
from zcore.step.gradient_shards import swap_capacity as gradient_swap_capacity
from zcore.step.grad_reduction import MAX_REDUCES_IN_FLIGHT
from zcore.memory.host_memory import PAGE_ALIGNMENT
from zcore.parallel.dtensor import local_tensor
from zcore.observe.memory_report import TIER_NAMES, CATEGORIES, DEVICE, HOST, NVME, TIERS, MemoryFigures
from zcore.zero3.param_fetcher import coordinator_config, nvme_host_bytes, staging_bytes
from zcore.zero3.param_fetcher import swap_capacity as parameter_swap_capacity
from zcore.step.units import MAX_UNIT_NUMEL, pieces_of
from zcore.config.policies import OffloadPolicy, Policies, Tier, policies_from_config
from zcore.step.precision import MixedPrecision, precision_from_config
from zcore.zero3.sharded_group import plan_groups
from zcore.step.swapped_optimizer import host_bytes_available, plan_sub_groups, sub_group_elements
from zcore.step.swapped_optimizer import swap_capacity as optimizer_swap_capacity

ConfigArg = Union[Config, dict, str, Path]

WORKING = ("gradient_shards", "gather_buffers", "reduce_buckets", "staging_buffers", "checkpoint_copy", "activations")
ESTIMATE_CATEGORIES = (*CATEGORIES, *WORKING)
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq: fp32, one element per trained element of the shard
COMPRESSED_ADAMS = ("OneBitAdam", "ZeroOneAdam")  # optimizer types with error feedback (zcore.optim.compressed_adam)
_GIB, _MIB = 2**30, 2**20


@dataclass(frozen=True)
class EstimateFigures:
    """Bytes per category on one tier."""

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    buffers: int = 0  # the module's buffers
    gradient_shards: int = 0  # stages 2-3: the fp32 gradient shards, from backward to the step
    gather_buffers: int = 0  # stage 3's arena for gathered groups
    reduce_buckets: int = 0  # gradients on their way through reduce-scatter (during backward)
    staging_buffers: int = 0  # offloaded shards staged for all-gathers; host pools of NVMe swaps
    checkpoint_copy: int = 0  # checkpoint.async_save: the host copy saves are written from
    activations: int = 0  # saved for backward, one micro-batch

    @property
    def model_states(self) -> MemoryFigures:
        """The categories engine.memory_report() measures."""
        return MemoryFigures(**{c: getattr(self, c) for c in CATEGORIES})

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in ESTIMATE_CATEGORIES)


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int
    world_size: int
    compute_dtype: torch.dtype
    parameter_tier: str  # as in MemoryReport: device, host or nvme
    optimizer_tier: str
    trainable_parameters: int  # elements
    frozen_parameters: int
    tiers: dict[str, EstimateFigures]  # keyed by zcore.observe.memory_report.TIERS
    activations_known: bool
    assumptions: tuple[str, ...]  # what the figures take for granted, in words

    @property
    def label(self) -> str:
        return choice_label(self.stage, self.optimizer_tier, self.parameter_tier)

    def total(self, tier: str) -> int:
        """Bytes on ``tier`` (activations counted only when known)."""
        return self.tiers[tier].total

    def __str__(self) -> str:
        unit, scale = ("GiB", _GIB) if max(self.total(t) for t in TIERS) >= _GIB else ("MiB", _MIB)
        dtype = str(self.compute_dtype).removeprefix("torch.")
        rows = [
            f"zcore estimate per rank: {self.label} (world size {self.world_size}, {dtype})",
            f"{'':18}" + "".join(f"{f'{tier} {unit}':>14}" for tier in TIERS),
        ]
        for name in (*ESTIMATE_CATEGORIES, "total"):
            cells = []
            for tier in TIERS:
                figures = self.tiers[tier]
                if name == "activations" and not self.activations_known:
                    cells.append(f"{'unknown' if tier == DEVICE else '-':>14}")
                    continue
                value = figures.total if name == "total" else getattr(figures, name)
                cells.append(f"{value / scale:>14.2f}")
            rows.append(f"{name:18}" + "".join(cells))
        rows += [f"- {a}" for a in self.assumptions]
        return "\n".join(rows)


def choice_label(stage: int, optimizer_tier: str, parameter_tier: str) -> str:
    """'stage 3, optimizer states on host', from zcore.observe.memory_report's tier names."""
    offload = [
        f"{what} on {tier}"
        for what, tier in (("optimizer states", optimizer_tier), ("parameters", parameter_tier))
        if tier != DEVICE
    ]
    return ", ".join([f"stage {stage}", *offload])


def estimate_memory(
    model_or_param_count: Union[torch.nn.Module, int],
    config: ConfigArg,
    world_size: int,
    *,
    device: str = "cuda",
    sample_input: Optional[SampleInput] = None,
    activations: Optional[int] = None,
    host_available: Optional[int] = None,
) -> MemoryEstimate:
    """Per-rank bytes for ``config``'s stage and offload choice at ``world_size``.

    ``model_or_param_count``: a module (any device, meta included: only
    shapes and dtypes are read), or a number of parameters, all taken as
    trained, laid out as small parameters would be (stage 3's groups are
    then unknown: the result says what that leaves out). ``device``: the
    compute device type, "cuda" or "cpu". Activations: measured with one
    forward of ``sample_input`` on the meta device (with a count, token ids
    of micro-batch x sequence length, run through a GPT-like shape assumed
    from the count and named in the result), or ``activations`` bytes as
    given; otherwise unknown.
    ``host_available``: the training machine's available host memory,
    which sizes the NVMe optimizer's sub-groups as zcore does (default:
    this machine's).
    """
    planner = Planner(model_or_param_count, config, device=device, sample_input=sample_input,
                      activations=activations, host_available=host_available)
    return planner.estimate(planner.config, world_size)


class Planner:
    """A model's counts (and its activations, measured once) against configs."""

    def __init__(
        self,
        model_or_param_count: Union[torch.nn.Module, int],
        config: ConfigArg,
        *,
        device: str = "cuda",
        sample_input: Optional[SampleInput] = None,
        activations: Optional[int] = None,
        host_available: Optional[int] = None,
    ) -> None:
        if device not in ("cuda", "cpu"):
            raise InvalidArgumentError(f"device must be 'cuda' or 'cpu', got {device!r}", argument="device")
        self.config = load_config(config)
        self.device = torch.device(device)
        self.model = ModelCounts.of(model_or_param_count)
        self.host_available = host_bytes_available() if host_available is None else host_available
        precision = precision_from_config(self.config)
        self.activations, self.activation_note = _activations(self.model, sample_input, activations, precision)
        self.notes = (*self.model.assumptions, self.activation_note)

    def estimate(self, cfg: Config, world_size: int) -> MemoryEstimate:
        _check_world_size(world_size)
        precision = precision_from_config(cfg)
        context = DistributedContext(rank=0, world_size=world_size, local_rank=0, device=self.device, backend="")
        policies = policies_from_config(cfg, context)
        notes = list(self.notes)
        if cfg.optimizer is None:
            notes.append("optimizer: Adam/AdamW states assumed (the config has no 'optimizer' section)")
        table = _Table()
        layout = Layout.of(self.model, policies, cfg, precision)
        _parameters(layout, policies, cfg.zero_optimization.stage3_param_persistence_threshold, table)
        _gradients(layout, policies, self.device, precision, table)
        _optimizer_states(layout, policies.offload, self.host_available, precision, table)
        if cfg.optimizer is not None and cfg.optimizer.type in COMPRESSED_ADAMS:
            _compressed_states(layout, cfg.optimizer.type, world_size, table)
            notes.append(f"optimizer states: {cfg.optimizer.type}'s error feedback included, which it holds from "
                         "its first compressed step on")
        table.add("buffers", DEVICE, self.model.buffer_bytes(precision))
        _working_memory(layout, policies, cfg, precision, self.device, self.host_available, table)
        if cfg.checkpoint.async_save:
            table.add("checkpoint_copy", HOST, _checkpoint_copy(layout, self.model.buffer_bytes(precision), precision))
        if self.activations is not None:
            table.add("activations", DEVICE, self.activations)
        return MemoryEstimate(
            stage=policies.stage.stage,
            world_size=world_size,
            compute_dtype=precision.compute_dtype,
            parameter_tier=TIER_NAMES[policies.offload.parameters],
            optimizer_tier=TIER_NAMES[policies.offload.optimizer],
            trainable_parameters=self.model.trainable_elements,
            frozen_parameters=self.model.frozen_elements,
            tiers=table.figures(),
            activations_known=self.activations is not None,
            assumptions=tuple(notes),
        )

def _check_world_size(world_size: Any) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgumentError(
            f"world_size must be a positive integer (the number of data-parallel ranks), got {world_size!r}",
            argument="world_size",
        )


# The model, as counts.
@dataclass(frozen=True)
class ModelCounts:
    """What the layouts need of a model: element counts and dtypes, no values."""

    trainable: tuple[int, ...]  # trained parameters' elements, in model.parameters() order
    frozen: tuple[tuple[int, torch.dtype], ...]  # frozen parameters: (elements, dtype)
    # Stage 3's groups (zcore.zero3.sharded_group.plan_groups): (elements of each
    # parameter, trained, dtype); None when only a count is known.
    groups: Optional[tuple[tuple[tuple[int, ...], bool, torch.dtype], ...]]
    buffers: tuple[tuple[int, torch.dtype], ...]
    module: Optional[torch.nn.Module]  # for the activations' forward
    assumptions: tuple[str, ...]

    @property
    def trainable_elements(self) -> int:
        return sum(self.trainable)

    @property
    def frozen_elements(self) -> int:
        return sum(n for n, _ in self.frozen)

    @staticmethod
    def of(model: Union[torch.nn.Module, int]) -> ModelCounts:
        if isinstance(model, torch.nn.Module):
            return ModelCounts.of_module(model)
        if isinstance(model, int) and not isinstance(model, bool) and model > 0:
            return ModelCounts.of_count(model)
        raise InvalidArgumentError(
            f"model_or_param_count must be a torch.nn.Module or a positive number of parameters, got {model!r}",
            argument="model_or_param_count",
        )

    @staticmethod
    def of_module(model: torch.nn.Module) -> ModelCounts:
        """A tensor-parallel model's DTensors count this rank's slices: what
        zcore shards over "dp" (zcore.parallel.mesh)."""
        params = list(model.parameters())

        def numel(t: torch.Tensor) -> int:
            return local_tensor(t).numel()

        groups = tuple(
            (tuple(numel(p) for p in kind), kind[0].requires_grad, kind[0].dtype)
            for _, _, kinds in plan_groups(model).owned
            for kind in kinds
        )
        return ModelCounts(
            trainable=tuple(numel(p) for p in params if p.requires_grad),
            frozen=tuple((numel(p), p.dtype) for p in params if not p.requires_grad),
            groups=groups,
            buffers=tuple((numel(b), b.dtype) for b in model.buffers()),
            module=model,
            assumptions=(),
        )

    @staticmethod
    def of_count(count: int) -> ModelCounts:
        return ModelCounts(
            trainable=(count,),
            frozen=(),
            groups=None,
            buffers=(),
            module=None,
            assumptions=(
                f"a bare count of {count:,} parameters: all trained, no buffers, small parameters; "
                "stage 3 groups unknown: none taken as persistent, and what depends on the largest group "
                "(its share of the gather arena and staging, reduce-scatter buckets, the gradient swap "
                "pool) left out: pass the model for exact figures",
            ),
        )

    def buffer_bytes(self, precision: MixedPrecision) -> int:
        """On the device, whole on every rank; floating point ones in the
        compute dtype when the config casts them."""
        def itemsize(dtype: torch.dtype) -> int:
            cast = precision.cast_buffers and dtype.is_floating_point
            return (precision.compute_dtype if cast else dtype).itemsize
        return sum(n * itemsize(d) for n, d in self.buffers)


class Shard:
    """A unit (stages 0-2, zcore.step.units.FlatUnit) or group (stage 3,
    zcore.zero3.sharded_group.ShardedGroup) as counts, rank 0's shard: enough of
    either for zcore's own sizing functions (arena, staging, swap files,
    sub-groups)."""

    def __init__(self, index: int, numels: tuple[int, ...], num_shards: int, dtype: torch.dtype, trainable: bool):
        self.index = index
        self.numel = sum(numels)
        self.padded_numel = -(-self.numel // num_shards) * num_shards
        self.shard_numel = self.padded_numel // num_shards
        offsets = list(itertools.accumulate(numels, initial=0))[:-1]
        self.pieces = pieces_of(offsets, list(numels), 0, self.shard_numel)
        self.dtype = dtype
        self.trainable = trainable

    @property
    def trained_elements(self) -> int:
        """Elements of rank 0's shard the optimizer keeps states for (no padding)."""
        return sum(p.numel for p in self.pieces)


@dataclass(frozen=True)
class Layout:
    """The units (stages 0-2) or groups (stage 3, trained and frozen) of a model."""

    shards: list[Shard]
    frozen_bytes: int  # stages 0-2: frozen parameters, whole on every rank
    groups_known: bool  # stage 3: False for a bare count (one group stands for all)

    @property
    def trained(self) -> list[Shard]:
        return [s for s in self.shards if s.trainable]

    @staticmethod
    def of(model: ModelCounts, policies: Policies, cfg: Config, precision: MixedPrecision) -> Layout:
        stage, compute = policies.stage, precision.compute_dtype
        if stage.shards_parameters:
            if model.groups is None:
                return Layout([Shard(0, model.trainable, stage.shard_size, compute, True)], 0, False)
            shards = [
                Shard(i, numels, stage.shard_size, compute if dtype.is_floating_point else dtype, trained)
                for i, (numels, trained, dtype) in enumerate(model.groups)
            ]
            return Layout(shards, 0, True)
        zero = cfg.zero_optimization
        bucket = min(zero.reduce_bucket_size, zero.allgather_bucket_size, MAX_UNIT_NUMEL)
        num_shards, _ = stage.unit_shards
        if model.groups is None:  # a bare count: full units, alike (one object: a count may be huge)
            whole, rest = divmod(model.trainable_elements, bucket)
            units = [Shard(0, (bucket,), num_shards, compute, True)] * whole
            units += [Shard(whole, (rest,), num_shards, compute, True)] if rest else []
        else:
            units = [Shard(i, u, num_shards, compute, True) for i, u in enumerate(_pack(model.trainable, bucket))]
        frozen = sum(n * (compute if d.is_floating_point else d).itemsize for n, d in model.frozen)
        return Layout(units, frozen, True)


def _pack(numels: tuple[int, ...], bucket: int) -> list[tuple[int, ...]]:
    """zcore.step.units.pack_units, on counts: whole parameters, in order,
    into units of at most ``bucket`` elements (a larger one alone)."""
    units: list[tuple[int, ...]] = []
    current: list[int] = []
    for n in numels:
        if current and sum(current) + n > bucket:
            units.append(tuple(current))
            current = []
        current.append(n)
    if current:
        units.append(tuple(current))
    return units


class _Table:
    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], int] = {}

    def add(self, category: str, tier: str, nbytes: int) -> None:
        self._bytes[(category, tier)] = self._bytes.get((category, tier), 0) + nbytes

    def figures(self) -> dict[str, EstimateFigures]:
        return {
            t: EstimateFigures(**{f.name: self._bytes.get((f.name, t), 0) for f in fields(EstimateFigures)})
            for t in TIERS
        }


# Model states: what zcore.observe.memory_report measures, category by category.
def _parameters(layout: Layout, policies: Policies, threshold: int, table: _Table) -> None:
    """Stages 0-2: every unit whole on the device, with the frozen
    parameters. Stage 3: each group's shard on offload_param's tier (NVMe:
    see ``_nvme_groups``); a persistent group (fewer padded elements than
    stage3_param_persistence_threshold) keeps its shard and its gathered
    buffer on the device."""
    if not policies.stage.shards_parameters:
        units = sum(u.padded_numel * u.dtype.itemsize for u in layout.shards)
        table.add("parameters", DEVICE, units + layout.frozen_bytes)
        return
    offload = policies.offload
    if not layout.groups_known and offload.parameters is Tier.NVME:
        # One group stands for all: max_in_cpu keeps elements, not groups.
        (g,) = layout.shards
        in_host = min(g.shard_numel, offload.nvme_host_elements)
        table.add("parameters", HOST, in_host * g.dtype.itemsize)
        table.add("parameters", NVME, _aligned((g.shard_numel - in_host) * g.dtype.itemsize))
        return
    on_nvme = _nvme_groups(layout, offload, threshold)
    table.add("parameters", NVME, parameter_swap_capacity(on_nvme))
    nvme_ids = {g.index for g in on_nvme}
    for g in layout.shards:
        shard = g.shard_numel * g.dtype.itemsize
        if layout.groups_known and g.padded_numel < threshold:
            table.add("parameters", DEVICE, shard + g.padded_numel * g.dtype.itemsize)
        elif g.index not in nvme_ids:
            # NVMe shards within max_in_cpu stay in host memory.
            tier = Tier.HOST if offload.parameters is Tier.NVME else offload.parameters
            table.add("parameters", TIER_NAMES[tier], shard)


def _gradients(
    layout: Layout, policies: Policies, device: torch.device, precision: MixedPrecision, table: _Table
) -> None:
    """fp32, on the device: stages 0-1 a full-size accumulator per unit
    (stage 1 plus the reduced shard); stages 2-3 the shard only, on NVMe
    with an NVMe optimizer, or in memory from backward to the step (working
    memory: none is held between steps). An optimizer on the host, with a
    GPU computing, keeps host copies of the shards beside it, in the
    master's dtype."""
    stage, offload = policies.stage, policies.offload
    trained = layout.trained
    shards = FP32 * sum(u.shard_numel for u in trained)
    if not stage.reduce_scatters_every_micro_step:
        accumulator = FP32 * sum(u.padded_numel for u in trained)
        table.add("gradients", DEVICE, accumulator + (shards if stage.shards_optimizer_states else 0))
    elif offload.optimizer is Tier.NVME:
        table.add("gradients", NVME, gradient_swap_capacity(trained, PAGE_ALIGNMENT))
    else:
        table.add("gradient_shards", DEVICE, shards)
    if offload.optimizer is Tier.HOST and device.type != "cpu":
        table.add("gradients", HOST, precision.master_dtype.itemsize * sum(u.shard_numel for u in trained))


def _optimizer_states(
    layout: Layout, offload: OffloadPolicy, host_available: int, precision: MixedPrecision, table: _Table
) -> None:
    """The master shard (padding included) and Adam's two moments of its
    trained elements, in their dtypes (fp32, or bf16: bf16 master weights
    and optimizer states), on offload_optimizer's tier; on NVMe, the
    sub-groups' extents in the swap file."""
    trained = layout.trained
    if offload.optimizer is Tier.NVME:
        sub_groups = _sub_groups(trained, offload, host_available, precision.master_dtype.itemsize)
        table.add("optimizer_states", NVME, optimizer_swap_capacity(sub_groups))
        return
    master = precision.master_dtype.itemsize * sum(u.shard_numel for u in trained)
    moments = ADAM_MOMENTS * precision.state_dtype.itemsize * sum(u.trained_elements for u in trained)
    table.add("optimizer_states", TIER_NAMES[offload.optimizer], master + moments)


def _compressed_states(layout: Layout, kind: str, world_size: int, table: _Table) -> None:
    """1-bit Adam and 0/1 Adam (zcore.observe.memory_report._theory_compressed),
    on the device, once compressing: per trained parameter (a piece: stage
    0 keeps them whole), fp32 error feedback of its elements padded as
    DeepSpeed pads them (worker) and 1/N of that (server); 0/1 Adam's local
    phase adds each parameter's fp32 values at the last synchronisation."""
    numels = [p.numel for u in layout.trained for p in u.pieces]
    padded = [padded_numel(n, world_size) for n in numels]
    errors = FP32 * sum(n + n // world_size for n in padded)
    synchronised = FP32 * sum(numels) if kind == "ZeroOneAdam" else 0
    table.add("optimizer_states", DEVICE, errors + synchronised)


def _sub_groups(trained: list[Shard], offload: OffloadPolicy, host_available: int, element_size: int) -> list:
    """zcore.initialize's sub-groups of the NVMe optimizer's states
    (``element_size``: of the master and the moments)."""
    total = sum(u.trained_elements for u in trained)
    size = sub_group_elements(
        total, offload.optimizer_buffers, offload.sub_group_size, offload.sub_group_size_set, host_available,
        element_size,
    )
    return plan_sub_groups(trained, size, element_size)


# Working memory: what memory_report leaves out.
def _working_memory(
    layout: Layout,
    policies: Policies,
    cfg: Config,
    precision: MixedPrecision,
    device: torch.device,
    host_available: int,
    table: _Table,
) -> None:
    _reduce_buckets(layout, policies, precision, table)
    if policies.stage.shards_parameters:
        _stage3_buffers(layout, policies, coordinator_config(cfg.zero_optimization), device, table)
    if policies.offload.optimizer is Tier.NVME:
        _optimizer_swap_pools(layout, policies, host_available, precision.master_dtype.itemsize, table)


def _checkpoint_copy(layout: Layout, buffer_bytes: int, precision: MixedPrecision) -> int:
    """The bytes of rank 0's checkpoint tensors, which an asynchronous save
    copies (zcore.checkpoint.rank_payload): the master and Adam's two
    moments of the trained elements of its shards, in their dtypes, frozen parameters (stage
    3: its shards of frozen groups; stages 0-2: whole, which rank 0 writes)
    and buffers (rank 0 writes them). The RNG state and the 64-byte
    alignment of each tensor (a few KiB) are left out."""
    per_element = precision.master_dtype.itemsize + ADAM_MOMENTS * precision.state_dtype.itemsize
    trained = per_element * sum(u.trained_elements for u in layout.trained)
    frozen = layout.frozen_bytes + sum(g.shard_numel * g.dtype.itemsize for g in layout.shards if not g.trainable)
    return trained + frozen + buffer_bytes


def _reduce_buckets(layout: Layout, policies: Policies, precision: MixedPrecision, table: _Table) -> None:
    """Stages 2-3: a bucket of a unit's whole gradient and its reduced
    shard, in the reduce dtype, for each reduce-scatter in flight and the
    one being launched (at most, the largest units). Stages 0-1: at the
    boundary every unit is sent at once, the accumulator itself when it is
    in the reduce dtype (fp32), else a copy; stage 1 receives the shards
    beside them."""
    stage, trained = policies.stage, layout.trained
    size = precision.reduce_dtype.itemsize
    if stage.reduce_scatters_every_micro_step:
        if layout.groups_known:
            largest = sorted(trained, key=lambda u: u.padded_numel, reverse=True)[: MAX_REDUCES_IN_FLIGHT + 1]
            table.add("reduce_buckets", DEVICE, sum(u.padded_numel + u.shard_numel for u in largest) * size)
        return
    sends = 0 if size == FP32 else sum(u.padded_numel for u in trained) * size
    received = sum(u.shard_numel for u in trained) * size if stage.shards_optimizer_states else 0
    table.add("reduce_buckets", DEVICE, sends + received)


def _stage3_buffers(
    layout: Layout, policies: Policies, coordinator: _C.CoordinatorConfig, device: torch.device, table: _Table
) -> None:
    """The gather arena on the device (zcore.zero3.gather_buffers.arena_capacity);
    with offloaded parameters, the shards staged for all-gathers on the
    device (zcore.zero3.param_fetcher.staging_bytes) and, on NVMe, the host pool
    they are read through (on a CPU device that pool is the staging).
    Staging is allocated as shards are fetched, so never more than the
    offloaded shards take."""
    offload, groups = policies.offload, layout.shards
    threshold = coordinator.persistence_threshold if layout.groups_known else 0
    persistent = [g.padded_numel < threshold for g in groups]
    live, bucket = coordinator.max_live_elements, coordinator.prefetch_bucket_elements
    if layout.groups_known:
        arena = arena_capacity(groups, persistent, live, bucket)
    else:
        arena = min(live + bucket, groups[0].padded_numel) * groups[0].dtype.itemsize
    table.add("gather_buffers", DEVICE, arena)
    if offload.parameters is Tier.DEVICE:
        return
    offloaded = sum(g.shard_numel * g.dtype.itemsize for g, p in zip(groups, persistent) if not p)
    if layout.groups_known:
        staging = staging_bytes(groups, coordinator, policies.stage.shard_size, offload)
    else:
        staging = 2 * bucket // policies.stage.shard_size * groups[0].dtype.itemsize
    on_nvme = _nvme_groups(layout, offload, threshold)
    if on_nvme:
        pool = nvme_host_bytes(on_nvme, staging) if layout.groups_known else staging
        table.add("staging_buffers", HOST, min(pool, parameter_swap_capacity(on_nvme)))
    if device.type == "cuda" or offload.parameters is Tier.HOST:
        table.add("staging_buffers", DEVICE, min(staging, offloaded))


def _optimizer_swap_pools(
    layout: Layout, policies: Policies, host_available: int, element_size: int, table: _Table
) -> None:
    """Host pools of the NVMe optimizer (zcore.initialize): buffer_count
    sub-groups (``element_size``: of their master and moments), and (stages
    2-3) three unit-sized gradient shards; the pools allocate as they are
    used, so never more buffers than keys."""
    offload, trained = policies.offload, layout.trained
    subs = _sub_groups(trained, offload, host_available, element_size)
    biggest = max((s.nbytes for s in subs), default=PAGE_ALIGNMENT)
    table.add("staging_buffers", HOST, min(offload.optimizer_buffers, len(subs)) * (biggest + PAGE_ALIGNMENT))
    if policies.stage.reduce_scatters_every_micro_step and layout.groups_known:
        largest = max(u.shard_numel for u in trained)
        table.add("staging_buffers", HOST, min(3, len(trained)) * (largest * FP32 + PAGE_ALIGNMENT))


def _nvme_groups(layout: Layout, offload: OffloadPolicy, threshold: int) -> list[Shard]:
    """The groups whose shards rest on NVMe, as zcore's coordinator places
    them: max_in_cpu elements of shards stay in host memory, the first
    groups in order up to the first that does not fit; persistent groups
    stay on the device."""
    if offload.parameters is not Tier.NVME:
        return []
    if not layout.groups_known:
        return [g for g in layout.shards if g.shard_numel > offload.nvme_host_elements]  # partly
    kept, spilled, out = 0, False, []
    for g in layout.shards:
        if g.padded_numel < threshold:
            continue
        spilled = spilled or kept + g.shard_numel > offload.nvme_host_elements
        if spilled:
            out.append(g)
        else:
            kept += g.shard_numel
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PAGE_ALIGNMENT) * PAGE_ALIGNMENT


# Activations.
def _activations(
    model: ModelCounts, sample_input: Optional[SampleInput], given: Optional[int], precision: MixedPrecision
) -> tuple[Optional[int], str]:
    """(bytes, a note for the result) from ``given``, or measured with one
    forward of ``sample_input`` (through a GPT-like shape for a bare count);
    (None, why) when unknown."""
    if given is not None and sample_input is not None:
        raise InvalidArgumentError("give activations or sample_input, not both", argument="activations")
    if given is not None:
        if not isinstance(given, int) or isinstance(given, bool) or given < 0:
            raise InvalidArgumentError(f"activations must be a number of bytes >= 0, got {given!r}",
                                       argument="activations")
        return given, "activations: as given"
    if sample_input is None:
        return None, ("activations unknown: neither a sample input (--seq-len, sample_input=) nor their bytes "
                      "(--activations, activations=) given")
    module = model.module
    note = "activations: what autograd saves in one training forward of the sample input (meta device)"
    if module is None:
        shape = _assumed_shape(model.trainable_elements, sample_input)
        module = shape.build()
        note += f" through a shape assumed from the parameter count, {shape}: pass the model for its own"
    try:
        saved = saved_tensor_bytes(module, sample_input, precision)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward: reported, not raised
        return None, f"activations unknown: the forward on the meta device failed ({type(exc).__name__}: {exc})"
    return saved, note


def _assumed_shape(count: int, sample_input: SampleInput) -> GPTShape:
    """A bare count runs token ids (micro-batch x sequence length) through
    a GPT-like shape assumed from it."""
    ids = sample_input
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        what = (f"a {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                else type(ids).__name__)
        raise InvalidArgumentError(
            f"with a bare parameter count, sample_input must be token ids (an integer tensor of micro-batch x "
            f"sequence length, e.g. torch.zeros(4, 1024, dtype=torch.long)), which run through a GPT-like shape "
            f"assumed from the count; got {what}. Or pass the model itself, or give activations=<bytes>",
            argument="sample_input",
        )
    return GPTShape.of(count, positions=ids.shape[1])


# Text.
def size_text(nbytes: int, digits: int = 1) -> str:
    if nbytes >= _GIB:
        return f"{nbytes / _GIB:.{digits}f} GiB"
    return f"{nbytes / _MIB:.{digits}f} MiB"


def sizes_text(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` with as many decimals (up to 4) as it takes to tell them apart."""
    for digits in range(1, 5):
        texts = size_text(a, digits), size_text(b, digits)
        if texts[0] != texts[1]:
            break
    return texts
