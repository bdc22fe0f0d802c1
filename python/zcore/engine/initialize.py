"""``zcore.initialize``: from a model and a DeepSpeed-style config to an engine.

Reads as the sequence of steps it performs: decode the config, join the
process group, place and synchronise the model, pack trainable parameters
into units (stage 3: shard every module's parameters into groups gathered on
demand), build fp32 master shards and the optimizer over them, pick the
gradient-reduction policy of the stage, hook autograd, and wrap it all.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh

import zcore._C as _C
from zcore.comm import collectives as comm
from zcore.engine import gathered_parameters
from zcore.engine import hooks
from zcore.step.background_step import BackgroundStep
from zcore.config.schema import Config, load_config
from zcore.engine.engine import BatchSizes, Engine, ParamResidency, ResidentParams
from zcore.errors import ConfigError, InvalidArgumentError, InvalidStateError
from zcore.step.grad_reduction import AccumulateThenReduce, GradientReducer, ReduceScatterEveryMicroStep
from zcore.step.gradient_shards import SwappedGradients
from zcore.step.gradient_shards import swap_capacity as gradient_swap_capacity
from zcore.optim.lr_schedules import SCHEDULES
from zcore.zero3.meta_init import MetaInit, is_meta
from zcore.parallel.dtensor import local_tensor
from zcore.parallel.mesh import (
    DataParallelRanks,
    ModelParallelMesh,
    check_parameters,
    model_parallel_mesh,
    refuse_stages_without_parameters,
    refuse_with_model_parallel,
)
from zcore.step.optimizers import ParamGroups, build_optimizer, collect_param_groups
from zcore.zero3.param_fetcher import ParamFetcher, coordinator_config
from zcore.memory.host_memory import PAGE_ALIGNMENT
from zcore.config.policies import CommPolicy, OffloadPolicy, Policies, StagePolicy, Tier, policies_from_config
from zcore.step.units import FlatUnit, Unit, pack_units
from zcore.step.precision import MixedPrecision, precision_from_config
from zcore.comm.quantized_collectives import gradient_reduce_scatter
from zcore.comm.topology import RankGroup, build_topology
from zcore.progress import progress_bar
from zcore.optim import CompressedAdam, CPUAdam
from zcore.zero3.sharded_group import GroupPlan, ShardedGroup, build_groups, fill_groups, plan_groups
from zcore.zero3.sharded_parameter import mark_sharded, refuse_empty_state_dicts
from zcore.zero3.synced_generation import sync_generation
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

from zcore.step.swapped_optimizer import (
    FP32_BYTES,
    STATES,
    SwappedAdamUpdate,
    SwappedMaster,
    host_bytes_available,
    plan_sub_groups,
    sub_group_elements,
    swap_capacity,
)

if TYPE_CHECKING:
    from zcore.parallel.pipelining import Tie

OptimizerArg = Union[None, torch.optim.Optimizer, Callable[[list[dict]], torch.optim.Optimizer]]

# Models wrapped by an engine: their parameters were re-pointed at zcore's
# buffers and carry its hooks, so a second engine over them would corrupt the first.
_WRAPPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def initialize(
    model: torch.nn.Module,
    config: Union[Config, dict, str, Path],
    optimizer: OptimizerArg = None,
    model_parameters: Optional[Iterable] = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    collate_fn: Optional[Callable] = None,
    meta_init: Optional[MetaInit] = None,
    device_mesh: Optional[DeviceMesh] = None,
    tied_parameters: Optional[dict[str, torch.nn.Parameter]] = None,
) -> tuple[Engine, Optional[ShardedOptimizer], Optional[torch.utils.data.DataLoader], Any]:
    """Wraps ``model`` for ZeRO training, as ``deepspeed.initialize`` does.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the
    data loader is None unless ``training_data`` is given, the scheduler None
    unless configured or passed. ``optimizer`` may be None (built from the
    config's ``optimizer`` section), a torch optimizer over the model's
    parameters (zcore re-points it at the master shards), or a callable that
    receives parameter groups and returns an optimizer. A model built on
    the meta device (stage 3 only) is materialised straight into shards, as
    ``meta_init`` says (default: each module's reset_parameters()).
    ``device_mesh``: which ranks share a node, for hpZ, MiCS and qgZ
    (zcore.comm.topology); default: nodes of LOCAL_WORLD_SIZE ranks. A mesh
    whose dimensions are named "dp" and "tp" instead composes zcore with
    torch's tensor parallelism: zcore shards over "dp" only, and the model's
    layers may be DTensors parallelized over "tp" (zcore.parallel.mesh),
    or the model may be one stage of a pipeline over "pp" (zcore.parallel.pipelining).
    ``tied_parameters``: with "pp", a weight several stages hold (a tied
    embedding and LM head), named with the same key on each stage.

    With no optimizer at all (none passed, none configured), the engine is
    for forward passes and generation only (ZeRO-Inference): parameters are
    placed, sharded and offloaded as for training, the optimizer returned is
    None, and backward, step and save_checkpoint are refused.
    """
    _check_arguments(model, optimizer, model_parameters, collate_fn, meta_init, tied_parameters)
    _refuse_wrapped(model)
    cfg = load_config(config)
    if optimizer is None and cfg.optimizer is None:
        _check_inference(cfg, model_parameters, lr_scheduler)
    context = comm.init_distributed()
    precision = precision_from_config(cfg)
    if precision.compute_dtype != torch.float32 and not precision.cast_buffers:
        _check_norm_statistics(model, precision.compute_dtype)  # before the model is changed
    model_parallel = model_parallel_mesh(device_mesh)
    if model_parallel is not None:
        refuse_with_model_parallel(cfg, model_parallel)
        check_parameters(model, model_parallel)
        refuse_stages_without_parameters(model, model_parallel, optimizer is not None or cfg.optimizer is not None)
    policies = policies_from_config(cfg, context, None if model_parallel is None else model_parallel.data_parallel)
    ranks = _data_parallel_ranks(policies, device_mesh, context, model_parallel)

    on_meta = is_meta(model)
    if on_meta and not policies.stage.shards_parameters:
        raise ConfigError(
            f"the model is on the meta device, which only ZeRO stage 3 can materialise (shard by "
            f"shard); set zero_optimization.stage to 3 (it is {cfg.zero_optimization.stage}) or "
            "build the model on a real device"
        )
    meta = (meta_init or MetaInit()) if on_meta else None
    if optimizer is None and cfg.optimizer is None:
        if tied_parameters:
            raise ConfigError(
                "tied_parameters ties the updates of a weight across pipeline stages; an engine without an "
                "optimizer (inference) updates nothing: remove them, or add an optimizer to train"
            )
        engine = _inference_engine(model, cfg, context, precision, policies, ranks, meta)
        _WRAPPED.add(model)
        return engine, None, _data_loader(training_data, engine.batch, ranks.data_parallel, collate_fn), None
    batch = BatchSizes(*cfg.batch_sizes(ranks.data_parallel.size))
    offload = policies.offload
    master: Union[MasterShards, SwappedMaster]
    # Weights tied across pipeline stages: a unit (stage 3: a group) of their own.
    alone = frozenset(id(p) for p in (tied_parameters or {}).values())
    if policies.stage.shards_parameters:
        groups = collect_param_groups(model, optimizer, model_parameters)
        plan, sharded_groups, hooked = _plan_shards(model, context, precision, ranks, alone)
        units: list[Unit] = [g for g in sharded_groups if g.trainable]
        fetcher, fetcher_hooks = _fetcher(model, sharded_groups, hooked, cfg, policies, ranks)
        master = _master(units, offload, context)
        _fill(plan, sharded_groups, context, ranks.data_parallel, meta, fetcher, master, units)
        fetcher_hooks += _present_sharded(model, sharded_groups, context)
        fetcher_hooks += hooks.register_backward_exit_hooks(fetcher)
        layouts: list = []  # placed in the compute dtype already
    else:
        _place_and_synchronise(model, context, ranks.data_parallel)
        groups = collect_param_groups(model, optimizer, model_parameters)
        units = layouts = _pack(groups, cfg, policies.stage, context.device, alone)
        master = _master(units, offload, context)
        state_bytes = _optimizer_bytes_on_nvme(master, units)
        with progress_bar("writing optimizer states to NVMe", sum(state_bytes)) as bar:
            for u, unit in enumerate(units):
                master.take(u, unit.local_shard)
                bar.update(state_bytes[u])
        master.finish()
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
        update=_update(inner, master, reducer, shards, offload),
        precision=precision,
        gradient_clipping=cfg.gradient_clipping,
        shard=ranks.shard,
        publisher=publisher,
        group_params=[g["params"] for g in groups.groups],
        model_parallel=ranks.model_parallel,
        ties=_ties(tied_parameters, units, ranks),
    )
    scheduler = _scheduler(cfg, lr_scheduler, sharded)
    engine = Engine(model, sharded, scheduler, cfg, policies, context, batch, residency, handles, ranks)
    _WRAPPED.add(model)
    loader = _data_loader(training_data, batch, ranks.data_parallel, collate_fn)
    return engine, sharded, loader, scheduler


def _check_inference(cfg: Config, model_parameters: Optional[Iterable], lr_scheduler: Any) -> None:
    """No optimizer, passed or configured: an engine for forward passes and
    generation only (ZeRO-Inference). What only training uses is refused."""
    given = [
        name for name, value in (
            ("model_parameters", model_parameters),
            ("lr_scheduler", lr_scheduler),
            ("the config's 'scheduler' section", cfg.scheduler),
        ) if value is not None
    ]
    if cfg.zero_optimization.offload_optimizer.device != "none":
        given.append(f"zero_optimization.offload_optimizer.device = {cfg.zero_optimization.offload_optimizer.device!r}")
    if given:
        raise ConfigError(
            f"zcore.initialize got no optimizer (none passed, no 'optimizer' section in the config), "
            f"which makes an engine for inference only, but also {', '.join(given)}, which only "
            "training uses: add an optimizer to train, or remove them"
        )


def _inference_engine(
    model: torch.nn.Module,
    cfg: Config,
    context: comm.DistributedContext,
    precision: MixedPrecision,
    policies: Policies,
    ranks: DataParallelRanks,
    meta_init: Optional[MetaInit],
) -> Engine:
    """ZeRO-Inference: parameters placed as the stage says (stage 3: sharded,
    on the tier offload_param names, gathered for each module's forward),
    in the compute dtype; no gradients, master weights or optimizer."""
    given = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    if any(v is not None for v in given):
        batch = BatchSizes(*cfg.batch_sizes(ranks.data_parallel.size))
    else:  # a batch size only sizes the data loader here
        batch = BatchSizes(ranks.data_parallel.size, 1, 1)
    residency: ParamResidency
    handles: list = []
    if policies.stage.shards_parameters:
        plan, groups, hooked = _plan_shards(model, context, precision, ranks, frozenset())  # no ties without an optimizer
        fetcher, handles = _fetcher(model, groups, hooked, cfg, policies, ranks)
        _fill(plan, groups, context, ranks.data_parallel, meta_init, fetcher)
        handles += _present_sharded(model, groups, context)
        handles += hooks.register_backward_exit_hooks(fetcher)
        _cast_model(model, [], precision)
        residency = fetcher
    else:
        _place_and_synchronise(model, context, ranks.data_parallel)
        _cast_model(model, [], precision)
        residency = ResidentParams([], KeepUnits())
    return Engine(model, None, None, cfg, policies, context, batch, residency, handles, ranks)


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
    for module in model.modules():
        for param in gathered_parameters.pending_external(module):
            gathered_parameters.add_external(fetcher, module, param)
    return fetcher, handles


def _present_sharded(model: torch.nn.Module, groups: list[ShardedGroup], context: comm.DistributedContext) -> list:
    """Stage 3, once the groups are filled: what code outside zcore sees of
    the model (parameter counts, state dicts, generation); the hooks' handles."""
    mark_sharded(groups)
    if context.world_size > 1:
        sync_generation(model)
    return refuse_empty_state_dicts(model)


def _check_arguments(
    model: Any, optimizer: Any, model_parameters: Any, collate_fn: Any, meta_init: Any, tied_parameters: Any
) -> None:
    """Refuses an argument of the wrong kind by name before anything is set
    up; otherwise it fails later, deep inside, as an AttributeError or a
    TypeError that names neither the argument nor what it should be."""
    iterable = isinstance(model_parameters, Iterable) and not isinstance(
        model_parameters, (str, bytes, Mapping)
    )
    checks = (
        ("model", model, isinstance(model, torch.nn.Module), "a torch.nn.Module"),
        (
            "optimizer",
            optimizer,
            optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer),
            "None, a torch.optim.Optimizer or a callable building one from parameter groups",
        ),
        (
            "model_parameters",
            model_parameters,
            model_parameters is None or iterable,
            "None or an iterable of parameters or of parameter-group dicts",
        ),
        ("collate_fn", collate_fn, collate_fn is None or callable(collate_fn), "None or a callable"),
        ("meta_init", meta_init, meta_init is None or isinstance(meta_init, MetaInit), "None or a zcore.MetaInit"),
        (
            "tied_parameters",
            tied_parameters,
            tied_parameters is None or (
                isinstance(tied_parameters, Mapping)
                and all(isinstance(k, str) and isinstance(v, torch.nn.Parameter) for k, v in tied_parameters.items())
            ),
            "None or a dict of str keys to torch.nn.Parameter (each stage's copy of a tied weight)",
        ),
    )
    for name, value, ok, expected in checks:
        if not ok:
            raise InvalidArgumentError(
                f"zcore.initialize({name}=...) must be {expected}, got {type(value).__name__}",
                argument=name,
            )


def _refuse_wrapped(model: torch.nn.Module) -> None:
    wrapped = next((name for name, m in model.named_modules() if m in _WRAPPED), None)
    if wrapped is not None:
        where = "this model" if wrapped == "" else f"its submodule {wrapped!r}"
        raise InvalidStateError(
            f"zcore.initialize was already called on {where}: an engine owns its parameters "
            "and hooks. Keep using that engine (engine.module is the model), or build a new model"
        )


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
    context: comm.DistributedContext,
    precision: MixedPrecision,
    ranks: DataParallelRanks,
    alone: frozenset[int],
) -> tuple[GroupPlan, list[ShardedGroup], list[tuple[torch.nn.Module, list[int]]]]:
    """Stage 3: which parameters form which group (those in ``alone`` one
    each), and the groups (without values: ``_fill`` gives them); buffers go
    to the device whole, the first data-parallel rank's on every rank (those
    on the meta device later, as ``_fill`` materialises them)."""
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
    return [STATES * FP32_BYTES * sum(piece.numel for piece in unit.pieces) for unit in units]


def _master(units: list[Unit], offload: OffloadPolicy, context: comm.DistributedContext) -> Union[MasterShards, SwappedMaster]:
    if offload.optimizer is Tier.NVME:
        return _swapped_master(units, offload)
    return MasterShards(units, offload.master_device(context.device), pin_memory=offload.pin_memory)


def _swapped_master(units: list[Unit], offload: OffloadPolicy) -> SwappedMaster:
    """Optimizer states on NVMe: sub-groups sized for the host memory they
    pass through (zcore.step.swapped_optimizer); their values come by take()."""
    assert offload.optimizer_swap is not None
    total = sum(p.numel for u in units for p in u.pieces)
    size = sub_group_elements(
        total, offload.optimizer_buffers, offload.sub_group_size, offload.sub_group_size_set,
        host_bytes_available(),
    )
    sub_groups = plan_sub_groups(units, size)
    largest = max((s.nbytes for s in sub_groups), default=PAGE_ALIGNMENT)
    open_swap = functools.partial(
        offload.optimizer_swap.open,
        "optimizer", swap_capacity(sub_groups), offload.optimizer_buffers * (largest + PAGE_ALIGNMENT),
    )
    return SwappedMaster(units, sub_groups, open_swap, read_ahead=offload.read_ahead)


def _update(
    inner: torch.optim.Optimizer,
    master: Union[MasterShards, SwappedMaster],
    reducer: GradientReducer,
    shards: UnitShards,
    offload: OffloadPolicy,
) -> TorchUpdate:
    if isinstance(master, SwappedMaster):
        needed = 1 + offload.read_ahead + offload.write_behind
        if offload.optimizer_buffers < needed:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.buffer_count = {offload.optimizer_buffers} is too "
                f"few for pipeline_read = {offload.read_ahead} and pipeline_write = {offload.write_behind}: "
                f"they need {needed} buffers; set buffer_count to {needed} or turn a pipeline off"
            )
        return SwappedAdamUpdate(
            inner, master, reducer, shards, read_ahead=offload.read_ahead, write_behind=offload.write_behind,
            background=BackgroundStep() if _updates_in_host_memory(master.units, shards) else None,
        )
    if isinstance(inner, CPUAdam):
        return FusedCpuUpdate(inner, master, reducer, shards)
    return TorchUpdate(inner, master, reducer, shards)


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


def _check_norm_statistics(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """torch's batch and instance norms need their running statistics in
    their weight's dtype: refused here rather than at the first forward."""
    for name, module in model.named_modules():
        stats = getattr(module, "running_mean", None)
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, torch.nn.modules.batchnorm._NormBase)
            and isinstance(stats, torch.Tensor)
            and isinstance(weight, torch.Tensor)
            and stats.dtype != dtype
        ):
            key = "bf16" if dtype == torch.bfloat16 else "fp16"
            raise ConfigError(
                f"{name or 'the model'} ({type(module).__name__}) keeps its running statistics in "
                f"{stats.dtype} while its weight computes in {dtype}, which torch's norm refuses; set "
                f"{key}.cast_buffers to true (floating-point buffers then compute in {dtype} too), or "
                "build the norm without affine weights"
            )


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


def _data_parallel_ranks(
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
    return lr_scheduler


def _data_loader(
    data: Optional[torch.utils.data.Dataset],
    batch: BatchSizes,
    data_parallel: RankGroup,
    collate_fn: Optional[Callable],
) -> Optional[torch.utils.data.DataLoader]:
    """Each data-parallel rank its own samples (the ranks of a "dp" group's
    other dimensions: the same ones)."""
    if data is None:
        return None
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=data_parallel.size, rank=data_parallel.rank
    )
    return torch.utils.data.DataLoader(
        data, batch_size=batch.micro_batch_per_rank, sampler=sampler, collate_fn=collate_fn
    )
