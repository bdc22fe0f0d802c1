"""``zcore.initialize``: from a model and a DeepSpeed-style config to an engine.

Reads as the sequence of steps it performs: check the arguments, decode the
config, join the process group, find the ranks it shards over, then
assemble a training or an inference engine from its parts
(zcore.engine.assemble). It takes deepspeed.initialize's arguments too:
``args`` (its command-line namespace), ``config_params`` and
``dist_init_required``, checked beside it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zcore.comm import collectives as comm
from zcore.config.policies import Policies, policies_from_config
from zcore.config.schema import Config, load_config
from zcore.engine import assemble, fragments
from zcore.engine.assemble import OptimizerArg
from zcore.engine.compiled_units import unwrap_compiled
from zcore.engine.engine import Engine
from zcore.errors import ConfigError, InvalidArgumentError, InvalidStateError
from zcore.parallel.mesh import (
    ModelParallelMesh,
    check_parameters,
    model_parallel_mesh,
    refuse_stages_without_parameters,
    refuse_with_model_parallel,
)
from zcore.step.precision import precision_from_config
from zcore.step.sharded_optimizer import ShardedOptimizer
from zcore.zero3.meta_init import MetaInit, is_meta

log = logging.getLogger("zcore")

# Models wrapped by an engine: their parameters were re-pointed at zcore's
# buffers and carry its hooks, so a second engine over them would corrupt the first.
_WRAPPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def initialize(
    model: torch.nn.Module,
    config: Union[Config, dict, str, Path, None] = None,
    optimizer: OptimizerArg = None,
    model_parameters: Optional[Iterable] = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    collate_fn: Optional[Callable] = None,
    meta_init: Optional[MetaInit] = None,
    device_mesh: Optional[DeviceMesh] = None,
    tied_parameters: Optional[dict[str, torch.nn.Parameter]] = None,
    *,
    args: Any = None,
    config_params: Union[Config, dict, str, Path, None] = None,
    dist_init_required: Optional[bool] = None,
) -> tuple[Engine, Optional[ShardedOptimizer], Optional[torch.utils.data.DataLoader], Any]:
    """Wraps ``model`` for ZeRO training, as ``deepspeed.initialize`` does.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the
    data loader is None unless ``training_data`` is given, the scheduler None
    unless configured or passed. ``optimizer`` may be None (built from the
    config's ``optimizer`` section), a torch optimizer over the model's
    parameters (zcore re-points it at the master shards), a pair of a
    whole-matrix optimizer (``torch.optim.Muon``, a ``zcore.optim.MatrixOptimizer``)
    and an element-wise one over the other parameters, or a callable that
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

    deepspeed.initialize's own arguments: ``args``, its command-line
    namespace, whose ``deepspeed_config`` (a path) is the config when
    ``config`` is not given, whose ``local_rank`` (the DeepSpeed launcher's
    ``--local_rank``; -1 or None: unset) and ``device_rank`` must name this
    rank's LOCAL_RANK and device, and whose ``local_rank`` is then set to
    it, as DeepSpeed sets it; ``config_params``, DeepSpeed's older name of
    ``config``; ``dist_init_required``: None or True joins the process
    group or creates it, False requires one already initialized.
    """
    _check_arguments(model, optimizer, model_parameters, collate_fn, meta_init, tied_parameters, dist_init_required)
    _refuse_wrapped(model)
    cfg = load_config(_config_source(config, config_params, args))
    trains = optimizer is not None or cfg.optimizer is not None
    if not trains:
        _check_inference(cfg, model_parameters, lr_scheduler, tied_parameters)
    context = _join_process_group(dist_init_required)
    if context.rank == 0:
        _report_deepspeed_keys(cfg)
    _take_launch_arguments(args, context)
    precision = precision_from_config(cfg)
    if precision.compute_dtype != torch.float32 and not precision.cast_buffers:
        _check_norm_statistics(model, precision.compute_dtype)  # before the model is changed
    model_parallel = _model_parallel(model, device_mesh, cfg, trains)
    policies = policies_from_config(cfg, context, None if model_parallel is None else model_parallel.data_parallel)
    ranks = assemble.data_parallel_ranks(policies, device_mesh, context, model_parallel)
    model = unwrap_compiled(model, policies.stage.shards_parameters)  # note "compiled units"
    parts = assemble.Assembly(model, cfg, context, precision, policies, ranks, _meta_init(model, meta_init, policies, cfg))
    if trains:
        engine, sharded, scheduler = assemble.training_engine(
            parts, optimizer, model_parameters, lr_scheduler, tied_parameters
        )
    else:
        engine, sharded, scheduler = assemble.inference_engine(parts), None, None
    fragments.track(engine)
    _WRAPPED.add(model)
    return engine, sharded, assemble.data_loader(
        training_data, engine.batch, ranks.data_parallel, collate_fn, cfg.dataloader_drop_last
    ), scheduler


def _report_deepspeed_keys(cfg: Config) -> None:
    """Once per run (rank 0): the config's keys that are DeepSpeed's tuning
    choices, with what zcore does instead, and those nobody reads."""
    ignored = cfg.ignored_keys_line()
    if ignored is not None:
        log.warning(ignored)
    decided = cfg.decided_keys_line()
    if decided is not None:
        log.info(decided)


def _config_source(config: Any, config_params: Any, args: Any) -> Any:
    """The config as deepspeed.initialize finds it: ``config``, its older
    name ``config_params``, or the path ``args.deepspeed_config``; given
    more than one way, refused (DeepSpeed refuses a config in both ``args``
    and ``config``)."""
    given = [
        (name, value) for name, value in (
            ("config", config),
            ("config_params", config_params),
            ("args.deepspeed_config", getattr(args, "deepspeed_config", None)),
        ) if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(
            f"zcore.initialize got a config both as {given[0][0]} and as {given[1][0]}: give it one way"
        )
    if not given:
        raise ConfigError(
            "zcore.initialize needs a config: pass config= (a dict, a zcore.config.Config or a JSON file's "
            "path), or args whose deepspeed_config is the JSON file's path, as deepspeed.initialize takes"
        )
    return given[0][1]


def _join_process_group(dist_init_required: Optional[bool]) -> comm.DistributedContext:
    """As deepspeed.initialize: None or True joins the process group (or
    creates one), False requires one initialized already."""
    if dist_init_required is False and not dist.is_initialized():
        raise InvalidStateError(
            "zcore.initialize(dist_init_required=False) needs a process group initialized already "
            "(torch.distributed.init_process_group), as deepspeed.initialize does; pass None to let zcore "
            "join the launcher's group or create a group of one"
        )
    return comm.init_distributed()


def _take_launch_arguments(args: Any, context: comm.DistributedContext) -> None:
    """``args.local_rank`` and ``args.device_rank`` (Lightning's) must agree
    with the LOCAL_RANK zcore takes its device from; then, as DeepSpeed
    does, ``args.local_rank`` is set to it for scripts that read it after."""
    if args is None:
        return
    local_rank = getattr(args, "local_rank", None)
    if local_rank is not None and local_rank != -1 and local_rank != context.local_rank:
        raise InvalidArgumentError(
            f"args.local_rank is {local_rank!r}, but this process's LOCAL_RANK is {context.local_rank} (0 "
            "without a launcher), which zcore takes its device from; launch with torchrun or the deepspeed "
            "launcher (both set LOCAL_RANK), or leave args.local_rank at -1",
            argument="args.local_rank",
        )
    device_rank = getattr(args, "device_rank", None)
    if device_rank is not None and context.device.type == "cuda" and device_rank != context.device.index:
        raise InvalidArgumentError(
            f"args.device_rank is {device_rank!r}, but zcore computes on {context.device} (LOCAL_RANK's GPU); "
            "launch so that each rank's LOCAL_RANK is its GPU's index",
            argument="args.device_rank",
        )
    if hasattr(args, "local_rank"):
        args.local_rank = context.local_rank


def _model_parallel(
    model: torch.nn.Module, device_mesh: Optional[DeviceMesh], cfg: Config, trains: bool
) -> Optional[ModelParallelMesh]:
    """The mesh's parallelisms where it names a "dp" dimension, with what
    zcore refuses under them checked first."""
    model_parallel = model_parallel_mesh(device_mesh)
    if model_parallel is not None:
        refuse_with_model_parallel(cfg, model_parallel)
        check_parameters(model, model_parallel)
        refuse_stages_without_parameters(model, model_parallel, trains)
    return model_parallel


def _meta_init(
    model: torch.nn.Module, meta_init: Optional[MetaInit], policies: Policies, cfg: Config
) -> Optional[MetaInit]:
    """How a model on the meta device is materialised (only stage 3 can, shard
    by shard); None for a model on a real device."""
    if not is_meta(model):
        return None
    if not policies.stage.shards_parameters:
        raise ConfigError(
            f"the model is on the meta device, which only ZeRO stage 3 can materialise (shard by "
            f"shard); set zero_optimization.stage to 3 (it is {cfg.zero_optimization.stage}) or "
            "build the model on a real device"
        )
    return meta_init or MetaInit()


def _check_inference(
    cfg: Config, model_parameters: Optional[Iterable], lr_scheduler: Any, tied_parameters: Optional[dict]
) -> None:
    """No optimizer, passed or configured: an engine for forward passes and
    generation only (ZeRO-Inference). What only training uses is refused,
    but ``model_parameters``, which DeepSpeed's scripts pass whatever the
    config, is only noted (DeepSpeed ignores it too)."""
    if model_parameters is not None and not (isinstance(model_parameters, (list, tuple)) and not model_parameters):
        log.info("zcore.initialize: no optimizer (an engine for inference only): model_parameters are not used")
    given = [
        name for name, value in (
            ("lr_scheduler", lr_scheduler),
            ("the config's 'scheduler' section", cfg.scheduler),
        ) if value is not None
    ]
    if cfg.zero_optimization.offload_optimizer.device != "none":
        given.append(f"zero_optimization.offload_optimizer.device = {cfg.zero_optimization.offload_optimizer.device!r}")
    if tied_parameters:
        raise ConfigError(
            "tied_parameters ties the updates of a weight across pipeline stages; an engine without an "
            "optimizer (inference) updates nothing: remove them, or add an optimizer to train"
        )
    if given:
        raise ConfigError(
            f"zcore.initialize got no optimizer (none passed, no 'optimizer' section in the config), "
            f"which makes an engine for inference only, but also {', '.join(given)}, which only "
            "training uses: add an optimizer to train, or remove them"
        )


def _check_arguments(
    model: Any, optimizer: Any, model_parameters: Any, collate_fn: Any, meta_init: Any, tied_parameters: Any,
    dist_init_required: Any,
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
            optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)
            or (isinstance(optimizer, (tuple, list)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)),
            "None, a torch.optim.Optimizer, a pair of them (a whole-matrix optimizer such as torch.optim.Muon "
            "and an element-wise one for the other parameters) or a callable building one from parameter groups",
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
        (
            "dist_init_required",
            dist_init_required,
            dist_init_required is None or isinstance(dist_init_required, bool),
            "None, True or False",
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
