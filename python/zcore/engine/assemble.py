"""The parts ``zcore.initialize`` assembles an engine from, each built by one
function: parameters placed or sharded (stage 3: groups gathered on demand,
filled module by module), fp32 master shards (in memory or on NVMe), the
optimizer update over them, the gradient reducer of the stage, the step
observation, the scheduler and the data loader.

The raw config stops here: what is built takes policies and sections."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh

import zcore._C as _C
from zcore.comm import collectives as comm
from zcore.comm.quantized_collectives import gradient_reduce_scatter
from zcore.comm.topology import RankGroup, build_topology
from zcore.config.policies import CommPolicy, OffloadPolicy, Policies, StagePolicy, Tier
from zcore.config.schema import Config
from zcore.engine import gathered_parameters, hooks
from zcore.engine.engine import BatchSizes, Engine, EngineParts
from zcore.engine.observation import StepLog, StepObservation
from zcore.engine.residency import ParamResidency, ResidentParams
from zcore.errors import ConfigError
from zcore.memory.host_memory import PAGE_ALIGNMENT
from zcore.observe.flops_profiler import FlopsProfiler
from zcore.observe.monitors import open_monitors
from zcore.observe.step_metrics import StepMetrics
from zcore.optim import CompressedAdam, CPUAdam
from zcore.optim.lr_schedules import SCHEDULES
from zcore.parallel.dtensor import local_tensor
from zcore.parallel.mesh import DataParallelRanks, ModelParallelMesh
from zcore.progress import progress_bar
from zcore.step.background_step import BackgroundStep
from zcore.step.grad_reduction import AccumulateThenReduce, GradientReducer, ReduceScatterEveryMicroStep
from zcore.step.gradient_shards import SwappedGradients
from zcore.step.gradient_shards import swap_capacity as gradient_swap_capacity
from zcore.optim.matrix_optimizer import MatrixAndElementwise
from zcore.step.matrix_step import matrix_step, matrix_update
from zcore.step.optimizers import ParamGroups, build_optimizer, collect_param_groups, combine_optimizers
from zcore.step.precision import MixedPrecision
from zcore.step.sharded_optimizer import (
    FusedCpuUpdate,
    GatherUnits,
    KeepUnits,
    MasterShards,
    Publisher,
    ShardedOptimizer,
    StoredShards,
    TorchUpdate,
    UnitShards,
)
from zcore.step.swapped_matrix import SwappedMatrixUpdate
from zcore.step.swapped_optimizer import (
    STATES,
    SwappedAdamUpdate,
    SwappedMaster,
    host_bytes_available,
    plan_sub_groups,
    sub_group_elements,
    swap_capacity,
)
from zcore.step.units import FlatUnit, Unit, pack_units
from zcore.zero3.leaf_modules import apply_leaf_module_config
from zcore.zero3.meta_init import MetaInit
from zcore.zero3.param_fetcher import ParamFetcher, coordinator_config
from zcore.zero3.sharded_group import GroupPlan, ShardedGroup, build_groups, fill_groups, plan_groups
from zcore.zero3.sharded_parameter import mark_sharded, refuse_empty_state_dicts
from zcore.zero3.synced_generation import sync_generation

if TYPE_CHECKING:
    from zcore.parallel.pipelining import Tie

OptimizerArg = Union[
    None, torch.optim.Optimizer, tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    Callable[[list[dict]], torch.optim.Optimizer],
]


@dataclass(frozen=True)
class Assembly:
    """What every part is built from: the model, its decoded config and the
    ranks it trains on. ``meta_init``: how a model built on the meta device
    is materialised (None: the model is on a real device)."""

    model: torch.nn.Module
    cfg: Config
    context: comm.DistributedContext
    precision: MixedPrecision
    policies: Policies
    ranks: DataParallelRanks
    meta_init: Optional[MetaInit]


def training_engine(
    a: Assembly,
    optimizer: OptimizerArg,
    model_parameters: Optional[Iterable],
    lr_scheduler: Any,
    tied_parameters: Optional[dict[str, torch.nn.Parameter]],
) -> tuple[Engine, ShardedOptimizer, Any]:
    """A training engine over the model: parameters placed (stages 0-2) or
    sharded (stage 3), master shards and the optimizer over them, the
    gradient reducer and its hooks; with the scheduler."""
    model, cfg, context, precision, policies, ranks = a.model, a.cfg, a.context, a.precision, a.policies, a.ranks
    batch = BatchSizes(*cfg.batch_sizes(ranks.data_parallel.size))
    offload = policies.offload
    optimizer = combine_optimizers(optimizer)  # a whole-matrix optimizer and an element-wise one, as one
    master: Union[MasterShards, SwappedMaster]
    # Weights tied across pipeline stages: a unit (stage 3: a group) of their own.
    alone = frozenset(id(p) for p in (tied_parameters or {}).values())
    if policies.stage.shards_parameters:
        groups = collect_param_groups(model, optimizer, model_parameters, cfg.optimizer)
        plan, sharded_groups, hooked = _plan_shards(model, cfg, context, precision, ranks, alone)
        units: list[Unit] = [g for g in sharded_groups if g.trainable]
        fetcher, fetcher_hooks = _fetcher(model, sharded_groups, hooked, cfg, policies, ranks)
        master = _master(units, offload, context, precision)
        _fill(plan, sharded_groups, context, ranks.data_parallel, a.meta_init, fetcher, master, units)
        fetcher_hooks += _present_sharded(model, sharded_groups, context)
        fetcher_hooks += hooks.register_backward_exit_hooks(fetcher)
        layouts: list = []  # placed in the compute dtype already
    else:
        _place_and_synchronise(model, context, ranks.data_parallel)
        groups = collect_param_groups(model, optimizer, model_parameters, cfg.optimizer)
        units = layouts = _pack(groups, cfg, policies.stage, context.device, alone)
        master = _master(units, offload, context, precision)
        _write_states(master, units)
    _cast_model(model, layouts, precision)

    inner = build_optimizer(optimizer, cfg, offload, groups, master.piece_of())
    reducer = _reducer(policies.stage, offload, policies.comm, units, precision, ranks)
    if isinstance(inner, CompressedAdam):  # 1-bit or 0/1 Adam (stage 0): it says which steps' gradients are averaged
        reducer.averaging = inner
    handles = hooks.register_gradient_hooks(units, reducer)
    residency: ParamResidency
    publisher: Publisher
    if policies.stage.shards_parameters:
        fetcher.set_master_writer(functools.partial(_write_master, master, units))
        _hold_leaf_units(fetcher, reducer, units)
        handles += fetcher_hooks
        residency = publisher = fetcher
        shards: UnitShards = StoredShards(fetcher)
    else:
        publisher = (
            GatherUnits(units, ranks.data_parallel.group) if policies.stage.gathers_updated_units else KeepUnits()
        )
        residency = ResidentParams(units, publisher)
        shards = UnitShards()
    sharded = ShardedOptimizer(
        inner=inner,
        master=master,
        reducer=reducer,
        update=_update(inner, master, reducer, shards, offload, groups, ranks, context.device),
        precision=precision,
        gradient_clipping=cfg.gradient_clipping,
        shard=ranks.shard,
        publisher=publisher,
        group_params=[g["params"] for g in groups.groups],
        model_parallel=ranks.model_parallel,
        ties=_ties(tied_parameters, units, ranks),
    )
    scheduler = _scheduler(cfg, lr_scheduler, sharded)
    parts = EngineParts(policies, context, batch, residency, _observation(a), handles, ranks)
    return Engine(model, sharded, scheduler, cfg, parts), sharded, scheduler


def inference_engine(a: Assembly) -> Engine:
    """ZeRO-Inference: parameters placed as the stage says (stage 3: sharded,
    on the tier offload_param names, gathered for each module's forward),
    in the compute dtype; no gradients, master weights or optimizer."""
    model, cfg, context, precision, policies, ranks = a.model, a.cfg, a.context, a.precision, a.policies, a.ranks
    given = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    if any(v is not None for v in given):
        batch = BatchSizes(*cfg.batch_sizes(ranks.data_parallel.size))
    else:  # a batch size only sizes the data loader here
        batch = BatchSizes(ranks.data_parallel.size, 1, 1)
    residency: ParamResidency
    handles: list = []
    if policies.stage.shards_parameters:
        plan, groups, hooked = _plan_shards(model, cfg, context, precision, ranks, frozenset())  # no ties without an optimizer
        fetcher, handles = _fetcher(model, groups, hooked, cfg, policies, ranks)
        _fill(plan, groups, context, ranks.data_parallel, a.meta_init, fetcher)
        handles += _present_sharded(model, groups, context)
        handles += hooks.register_backward_exit_hooks(fetcher)
        _cast_model(model, [], precision)
        residency = fetcher
    else:
        _place_and_synchronise(model, context, ranks.data_parallel)
        _cast_model(model, [], precision)
        residency = ResidentParams([], KeepUnits())
    parts = EngineParts(policies, context, batch, residency, _observation(a), handles, ranks)
    return Engine(model, None, None, cfg, parts)


def _observation(a: Assembly) -> StepObservation:
    """Step metrics and monitors where a monitor or wall_clock_breakdown asks
    for them; DeepSpeed's flops profiler where its section enables it."""
    cfg, context = a.cfg, a.context
    metrics, monitors = None, []
    if cfg.records_step_metrics:
        metrics = StepMetrics(a.model, context.world_size, a.ranks.data_parallel.size)
        monitors = open_monitors(cfg, context.rank)
    profiler = None
    if cfg.flops_profiler.enabled:
        profiler = FlopsProfiler(a.model, cfg.flops_profiler, context.rank, context.world_size)
    return StepObservation(metrics, monitors, profiler, StepLog(context.rank, cfg.steps_per_print, cfg.wall_clock_breakdown))


def _write_states(master: Union[MasterShards, SwappedMaster], units: list[Unit]) -> None:
    """Stages 0-2: each unit's values become its master shard (on NVMe, its
    optimizer states are written there now)."""
    state_bytes = _optimizer_bytes_on_nvme(master, units)
    with progress_bar("writing optimizer states to NVMe", sum(state_bytes)) as bar:
        for u, unit in enumerate(units):
            master.take(u, unit.local_shard)
            bar.update(state_bytes[u])
    master.finish()


def _fetcher(
    model: torch.nn.Module,
    groups: list[ShardedGroup],
    hooked: list[tuple[torch.nn.Module, list[int]]],
    cfg: Config,
    policies: Policies,
    ranks: DataParallelRanks,
) -> tuple[ParamFetcher, list]:
    """Stage 3's parameter fetcher over the groups, with its module hooks
    (the parameters' hooks come once ``_fill`` has materialised them: a
    meta parameter's hooks do not survive materialisation)."""
    zero, offload = cfg.zero_optimization, policies.offload
    fetcher = ParamFetcher(
        model, groups, hooked, coordinator_config(zero), ranks.shard, offload,
        check_every_module=zero.stage3_rank_agreement_check == "every_module",
        swap=functools.partial(offload.parameter_swap.open, "params") if offload.parameter_swap else None,
        comm_policy=policies.comm,
        topology=ranks.topology,
        data_parallel=ranks.data_parallel,
    )
    handles = hooks.register_module_hooks(fetcher, dict(enumerate(fetcher.modules)))
    gathered_parameters.track(fetcher)
    fetcher.set_external_adopter(functools.partial(gathered_parameters.add_external, fetcher))
    for module in model.modules():
        for param in gathered_parameters.pending_external(module):
            gathered_parameters.add_external(fetcher, module, param)
    return fetcher, handles


def _hold_leaf_units(fetcher: ParamFetcher, reducer: GradientReducer, units: list[Unit]) -> None:
    """Stage 3: a leaf module's units are reduced once its calls have left
    backward (note "leaf gradients" in zcore.zero3.leaf_reductions)."""
    unit_of = {id(unit): u for u, unit in enumerate(units)}
    group_unit = {g.index: unit_of[id(g)] for g in fetcher.groups if id(g) in unit_of}
    reducer.hold([group_unit[g] for g in fetcher.leaf_groups()])
    fetcher.set_leaf_release(lambda groups: reducer.release([group_unit[g] for g in groups]))


def _present_sharded(model: torch.nn.Module, groups: list[ShardedGroup], context: comm.DistributedContext) -> list:
    """Stage 3, once the groups are filled: what code outside zcore sees of
    the model (parameter counts, state dicts, generation); the hooks' handles."""
    mark_sharded(groups)
    if context.world_size > 1:
        sync_generation(model)
    return refuse_empty_state_dicts(model)


def _place_and_synchronise(
    model: torch.nn.Module, context: comm.DistributedContext, data_parallel: RankGroup
) -> None:
    model.to(context.device)
    if data_parallel.size > 1:
        # Every rank starts from the first data-parallel rank's weights, as
        # DDP and DeepSpeed do (a DTensor's: its local slice, from the rank
        # holding the same slice).
        with torch.no_grad():
            tensors = [local_tensor(t) for t in (*model.parameters(), *model.buffers())]
            comm.broadcast_from_rank0(tensors, data_parallel.group)


def _plan_shards(
    model: torch.nn.Module,
    cfg: Config,
    context: comm.DistributedContext,
    precision: MixedPrecision,
    ranks: DataParallelRanks,
    alone: frozenset[int],
) -> tuple[GroupPlan, list[ShardedGroup], list[tuple[torch.nn.Module, list[int]]]]:
    """Stage 3: which parameters form which group (those in ``alone`` one
    each), and the groups (without values: ``_fill`` gives them); buffers go
    to the device whole, the first data-parallel rank's on every rank (those
    on the meta device later, as ``_fill`` materialises them). The modules
    the config's leaf_module section names are marked leaves first."""
    apply_leaf_module_config(model, cfg.zero_optimization.leaf_module)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if not buf.is_meta:
                setattr(module, name, buf.to(context.device))
    if ranks.data_parallel.size > 1:
        with torch.no_grad():
            buffers = [local_tensor(b) for b in model.buffers() if not b.is_meta]
            comm.broadcast_from_rank0(buffers, ranks.data_parallel.group)
    plan = plan_groups(model, alone)
    groups, hooked = build_groups(plan, ranks.shard.size, ranks.shard.rank, context.device, precision.compute_dtype)
    return plan, groups, hooked


def _fill(
    plan: GroupPlan,
    groups: list[ShardedGroup],
    context: comm.DistributedContext,
    data_parallel: RankGroup,
    meta_init: Optional[MetaInit],
    fetcher: ParamFetcher,
    master: Optional[Union[MasterShards, SwappedMaster]] = None,
    units: Sequence[Unit] = (),
) -> None:
    """Stage 3: each group's shard, one module at a time, from the first
    data-parallel rank's values (materialised first where the model was built on the meta
    device, zcore.zero3.meta_init): its trained values to the master first, then,
    in the compute dtype, to the tier its shard rests on. Memory holds one
    module's full parameters and one sub-group of optimizer states beyond
    the shards that stay in memory."""
    unit_of = {g.index: u for u, g in enumerate(units)}
    state_bytes = _optimizer_bytes_on_nvme(master, units)
    shard_bytes = {
        g.index: g.shard_numel * g.dtype.itemsize for g in groups if fetcher.shard_tier(g.index) == _C.ShardTier.NVME
    }
    written = {"parameters": sum(shard_bytes.values()), "optimizer states": sum(state_bytes)}
    bar = progress_bar(
        f"writing {' and '.join(what for what, size in written.items() if size)} to NVMe", sum(written.values())
    )

    def place(group: ShardedGroup, values: torch.Tensor) -> None:
        u = unit_of.get(group.index)
        if master is not None and u is not None:
            master.take(u, values)
        fetcher.place_shard(group, values)
        bar.update((state_bytes[u] if u is not None else 0) + shard_bytes.get(group.index, 0))

    synchronise = data_parallel if data_parallel.size > 1 else None
    with bar:
        if meta_init is None:
            fill_groups(plan, groups, synchronise, place)
        else:
            with meta_init.materialising(plan.model, context.device, synchronise is not None) as materialise:
                fill_groups(plan, groups, synchronise, place, materialise)
    if master is not None:
        master.finish()


def _optimizer_bytes_on_nvme(master: Optional[Union[MasterShards, SwappedMaster]], units: Sequence[Unit]) -> list[int]:
    """What start-up writes to NVMe for each unit's optimizer states: none
    unless they live there (zcore.step.swapped_optimizer)."""
    if not isinstance(master, SwappedMaster):
        return [0] * len(units)
    size = torch.empty((), dtype=master.dtype).element_size()
    return [STATES * size * sum(piece.numel for piece in unit.pieces) for unit in units]


def _master(
    units: list[Unit], offload: OffloadPolicy, context: comm.DistributedContext, precision: MixedPrecision
) -> Union[MasterShards, SwappedMaster]:
    if offload.optimizer is Tier.NVME:
        return _swapped_master(units, offload, precision)
    return MasterShards(
        units, offload.master_device(context.device), pin_memory=offload.pin_memory, dtype=precision.master_dtype
    )


def _swapped_master(units: list[Unit], offload: OffloadPolicy, precision: MixedPrecision) -> SwappedMaster:
    """Optimizer states on NVMe: sub-groups sized for the host memory they
    pass through (zcore.step.swapped_optimizer); their values come by take()."""
    assert offload.optimizer_swap is not None
    if precision.master_dtype != precision.state_dtype:
        raise ConfigError(
            "optimizer states on NVMe keep the master weights and the moments in one dtype, but "
            "bf16.bf16_master_weights_and_grads is true and bf16_optimizer_states false: set "
            "bf16_optimizer_states to true too, or offload_optimizer.device to 'cpu' (host memory keeps fp32 "
            "moments beside bf16 weights)"
        )
    element_size = torch.empty((), dtype=precision.master_dtype).element_size()
    total = sum(p.numel for u in units for p in u.pieces)
    size = sub_group_elements(
        total, offload.optimizer_buffers, offload.sub_group_size, offload.sub_group_size_set,
        host_bytes_available(), element_size,
    )
    sub_groups = plan_sub_groups(units, size, element_size)
    largest = max((s.nbytes for s in sub_groups), default=PAGE_ALIGNMENT)
    open_swap = functools.partial(
        offload.optimizer_swap.open,
        "optimizer", swap_capacity(sub_groups), offload.optimizer_buffers * (largest + PAGE_ALIGNMENT),
    )
    return SwappedMaster(units, sub_groups, open_swap, read_ahead=offload.read_ahead, dtype=precision.master_dtype)


def _update(
    inner: torch.optim.Optimizer,
    master: Union[MasterShards, SwappedMaster],
    reducer: GradientReducer,
    shards: UnitShards,
    offload: OffloadPolicy,
    groups: ParamGroups,
    ranks: DataParallelRanks,
    device: torch.device,
) -> Any:
    group_params = [g["params"] for g in groups.groups]
    if isinstance(inner, MatrixAndElementwise) and isinstance(master, SwappedMaster):
        _check_swap_buffers(offload)
        cpu = torch.device("cpu")
        step = matrix_step(inner, master, group_params, ranks.shard, ranks.model_parallel, device, home=cpu)
        return SwappedMatrixUpdate(
            inner, master, reducer, shards, step, read_ahead=offload.read_ahead, write_behind=offload.write_behind
        )
    if isinstance(inner, MatrixAndElementwise):  # matrices by owner compute (zcore.step.matrix_step)
        elementwise = (
            TorchUpdate(inner, master, reducer, shards) if inner.elementwise is None  # then it only writes the shards
            else _update(inner.elementwise, master, reducer, shards, offload, groups, ranks, device)
        )
        return matrix_update(inner, elementwise, group_params, ranks.shard, ranks.model_parallel, device)
    if isinstance(master, SwappedMaster):
        _check_swap_buffers(offload)
        return SwappedAdamUpdate(
            inner, master, reducer, shards, read_ahead=offload.read_ahead, write_behind=offload.write_behind,
            background=BackgroundStep() if _updates_in_host_memory(master.units, shards) else None,
        )
    if isinstance(inner, CPUAdam):
        return FusedCpuUpdate(inner, master, reducer, shards)
    return TorchUpdate(inner, master, reducer, shards)


def _check_swap_buffers(offload: OffloadPolicy) -> None:
    needed = 1 + offload.read_ahead + offload.write_behind
    if offload.optimizer_buffers < needed:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.buffer_count = {offload.optimizer_buffers} is too "
            f"few for pipeline_read = {offload.read_ahead} and pipeline_write = {offload.write_behind}: "
            f"they need {needed} buffers; set buffer_count to {needed} or turn a pipeline off"
        )


def _updates_in_host_memory(units: list[Unit], shards: UnitShards) -> bool:
    """Stage 3, every unit's shard updated in place in host memory: the
    optimizer step may go on behind the next forward (zcore.step.background_step)."""
    if not isinstance(shards, StoredShards) or not units:
        return False
    for unit in units:
        resident = shards.resident(unit)
        if resident is None or resident.device.type != "cpu":
            return False
    return True


def _write_master(
    master: Union[MasterShards, SwappedMaster], units: list[Unit], group: ShardedGroup, values: torch.Tensor
) -> None:
    if isinstance(master, SwappedMaster):
        master.write_unit(units.index(group), values)
    else:
        master.shards[units.index(group)].copy_(values)


def _pack(
    groups: ParamGroups, cfg: Config, stage: StagePolicy, device: torch.device, alone: frozenset[int]
) -> list[FlatUnit]:
    zero = cfg.zero_optimization
    num_shards, shard_index = stage.unit_shards
    return pack_units(
        groups.trainable,
        # Units serve both the reduce-scatter and the all-gather.
        min(zero.reduce_bucket_size, zero.allgather_bucket_size),
        num_shards,
        shard_index,
        device,
        alone,
    )


def _cast_model(
    model: torch.nn.Module, layouts: list[Union[FlatUnit, ShardedGroup]], precision: MixedPrecision
) -> None:
    """Parameters to the compute dtype (the fp32 master shards were taken
    before, so they keep full precision); floating-point buffers only when
    the config casts them."""
    dtype = precision.compute_dtype
    for layout in layouts:
        if layout.dtype.is_floating_point:
            layout.cast_(dtype)
    in_units = {id(p) for u in layouts for p in u.params}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in in_units and p.is_floating_point():
                p.data = p.data.to(dtype)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point() and precision.cast_buffers:
                    setattr(module, name, buf.to(dtype))


def _reducer(
    stage: StagePolicy, offload: OffloadPolicy, comm_policy: CommPolicy, units: list[Unit], precision: MixedPrecision,
    ranks: DataParallelRanks,
) -> GradientReducer:
    reduce_scatter = gradient_reduce_scatter(comm_policy.quantized_gradients, ranks.shard, _nodes(ranks))
    if stage.reduce_scatters_every_micro_step:
        grads = None
        if offload.optimizer_swap is not None:  # gradient shards go where the optimizer runs
            largest = max((u.shard_numel * 4 for u in units), default=PAGE_ALIGNMENT)
            swap = offload.optimizer_swap.open(
                "gradients", gradient_swap_capacity(units, PAGE_ALIGNMENT), 3 * (largest + PAGE_ALIGNMENT)
            )
            grads = SwappedGradients(units, swap, pending_limit=2 * largest)
        return ReduceScatterEveryMicroStep(
            units, stage.world_size, precision.reduce_dtype, reduce_scatter, grads,
            shard_size=ranks.shard.size, replicas=ranks.replicas, group=ranks.data_parallel.group,
        )
    return AccumulateThenReduce(
        units, stage.world_size, precision.reduce_dtype, reduce_scatter, sharded=stage.shards_optimizer_states,
        group=ranks.data_parallel.group,
    )


def data_parallel_ranks(
    policies: Policies, device_mesh: Optional[DeviceMesh], context: comm.DistributedContext,
    model_parallel: Optional[ModelParallelMesh],
) -> DataParallelRanks:
    """Stage 3's shard and replica groups, from the nodes (zcore.comm.topology)
    where hpZ, MiCS or qgZ needs to know them, or a mesh was given; with a
    mesh of several parallelisms, its "dp" dimension (zcore.parallel.mesh).
    Collective: every rank creates the same process groups."""
    if model_parallel is not None:
        return DataParallelRanks(model_parallel.data_parallel, model_parallel=model_parallel)
    stage, wire = policies.stage, policies.comm
    hierarchical = stage.replicates_shards or wire.hpz_size > 1 or wire.hierarchical_gather or wire.quantized_gradients
    if device_mesh is None and not hierarchical:
        return DataParallelRanks(RankGroup.world())
    topology = build_topology(device_mesh, context.device.type)
    if wire.hierarchical_gather:
        topology.check_two_level_gather(stage.shard_size)
    if not stage.replicates_shards:
        return DataParallelRanks(RankGroup.world(), None, topology)
    return DataParallelRanks(topology.blocks(stage.shard_size), topology.strided(stage.shard_size), topology)


def _nodes(ranks: DataParallelRanks) -> Optional[tuple[RankGroup, RankGroup]]:
    """qgZ's two levels within the shard group: this rank's node and the
    ranks with its local index on the group's other nodes, where the group
    spans several nodes of several ranks each, numbered node by node."""
    topology, size = ranks.topology, ranks.shard.size
    if topology is None or not topology.in_rank_order:
        return None
    h = topology.local_size
    if h == 1 or size <= h or size % h:
        return None
    return topology.node_local(), topology.across_nodes_within(size)


def _ties(tied: Optional[dict[str, torch.nn.Parameter]], units: list[Unit], ranks: DataParallelRanks) -> list[Tie]:
    """Weights tied across pipeline stages (collective over the world when
    the mesh pipelines: every stage takes part, with ties or without)."""
    from zcore.parallel.pipelining import tie_parameters  # torch's pipelining, imported only where it is used

    mesh = ranks.model_parallel
    if mesh is None or not mesh.pipelined:
        if tied:
            raise ConfigError(
                "tied_parameters ties weights across pipeline stages: pass a device_mesh with a \"pp\" dimension, "
                "or tie the weight in the model itself (one Parameter in both places)"
            )
        return []
    return tie_parameters(tied or {}, units, mesh)


def _scheduler(cfg: Config, lr_scheduler: Any, optimizer: ShardedOptimizer) -> Any:
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError(
            "a scheduler is both configured (config key 'scheduler') and passed to "
            "zcore.initialize(lr_scheduler=...); keep one"
        )
    if cfg.scheduler is not None:
        return SCHEDULES[cfg.scheduler.type](optimizer, cfg.scheduler.params)
    if callable(lr_scheduler):
        # As DeepSpeed: the torch optimizer (its parameter groups are the
        # engine's), which torch's schedulers require.
        return lr_scheduler(optimizer.inner)
    _check_scheduler_drives(lr_scheduler, optimizer)
    return lr_scheduler


def _check_scheduler_drives(scheduler: Any, optimizer: ShardedOptimizer) -> None:
    """A scheduler object must move the learning rates of the optimizer the
    engine steps (the one given to zcore.initialize, whose parameter groups
    the engine keeps, or a part of a whole-matrix pair); over any other it
    would change nothing, silently (DeepSpeed refuses it too)."""
    driven = getattr(scheduler, "optimizer", None)
    if driven is None or scheduler is None:
        return
    engine_groups = {id(g) for g in optimizer.inner.param_groups}
    if all(id(g) in engine_groups for g in getattr(driven, "param_groups", [None])):
        return
    raise ConfigError(
        f"zcore.initialize(lr_scheduler=...) got a {type(scheduler).__name__} over a {type(driven).__name__} "
        "that is not the optimizer the engine steps, so it would change no learning rate the engine uses: "
        "build it over the optimizer passed to zcore.initialize(optimizer=...), or pass a callable that "
        "takes the engine's optimizer and returns the scheduler (with a config 'optimizer' section, only "
        "the callable can)"
    )


def data_loader(
    data: Optional[torch.utils.data.Dataset],
    batch: BatchSizes,
    data_parallel: RankGroup,
    collate_fn: Optional[Callable],
    drop_last: bool = False,
) -> Optional[torch.utils.data.DataLoader]:
    """Each data-parallel rank its own samples (the ranks of a "dp" group's
    other dimensions: the same ones); ``drop_last``: the config's
    dataloader_drop_last, each rank's incomplete last micro-batch dropped."""
    if data is None:
        return None
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=data_parallel.size, rank=data_parallel.rank
    )
    return torch.utils.data.DataLoader(
        data, batch_size=batch.micro_batch_per_rank, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last
    )
