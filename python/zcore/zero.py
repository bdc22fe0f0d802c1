"""DeepSpeed's ``deepspeed.zero`` names, for code written against DeepSpeed:
``Init`` (sharded construction), ``GatheredParameters``,
``register_external_parameter`` and ``unregister_external_parameter``, and
the leaf-module helpers DeepSpeed keeps in ``deepspeed.utils``
(``set_z3_leaf_modules`` and its companions).

    import zcore
    with zcore.zero.Init(config_dict_or_path=config):
        model = MyModel()                  # on the meta device: no values, no memory
    engine, *_ = zcore.initialize(model=model, config=config)   # built shard by shard
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist

from zcore.config.schema import Config, load_config
from zcore.engine.gathered_parameters import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zcore.errors import ConfigError, InvalidArgumentError
from zcore.zero3.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "get_z3_leaf_modules",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "unwrap_model_for_generation",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

_FLOATING = (torch.float32, torch.bfloat16, torch.float16)


class Init(contextlib.AbstractContextManager):
    """A block in which the models built are sharded as ZeRO-3 builds them,
    never whole on a rank: DeepSpeed's ``deepspeed.zero.Init``.

    zcore builds them on the meta device (no values, no memory) and
    ``zcore.initialize`` (stage 3) materialises them one module at a time
    straight into each rank's shards, as ``zcore.MetaInit`` describes: each
    module's ``reset_parameters()``, then Hugging Face's ``_init_weights``
    where the model has one, under a seed per module. A parameter made by
    a legacy constructor (``nn.Parameter(torch.Tensor(n))``, which ignores
    the meta device) keeps the values ``__init__`` gave it; other values an
    ``__init__`` computes itself (an in-place init of its own meta tensors,
    a buffer filled from ``torch.arange``) are not kept: give them through
    ``zcore.initialize(..., meta_init=zcore.MetaInit(init_fn=...))``. The
    parameters have no values before ``zcore.initialize``: a
    ``GatheredParameters`` block on them is refused.

    DeepSpeed's arguments (its signature, hence more than zcore's usual
    eight), and what zcore does with each:

    - ``enabled``: False, the block does nothing.
    - ``module``: a model built before, passed to be sharded: on the meta
      device, or whole (``zcore.initialize`` shards it then).
    - ``config_dict_or_path`` (``config``, its older name): validated as
      ``zcore.initialize`` validates it; its stage must be 3, the only one
      that builds a model from the meta device.
    - ``dtype``: float32, bfloat16 or float16, and where a config is given,
      float32 or its compute dtype (bf16/fp16 sections). zcore builds in
      fp32 and casts to the config's compute dtype at ``zcore.initialize``,
      so the master weights start from unrounded values.
    - ``zero_quantized_weights``: True only with a config whose
      ``zero_optimization.zero_quantized_weights`` is true (that key, in the
      config given to ``zcore.initialize``, quantizes the all-gathers).
    - Refused, as changing results in ways zcore does not offer:
      ``data_parallel_group`` other than every rank (zcore shards over the
      world, or over the "dp" dimension of ``zcore.initialize(device_mesh=...)``),
      ``mpu`` (tensor parallelism comes as a device mesh),
      ``sequence_data_parallel_group`` (no sequence parallelism), and
      ``zero_quantized_nontrainable_weights`` (frozen weights are not stored
      quantized).
    - Accepted and ignored, as they tune where and how shards are placed
      and not what is computed: ``mem_efficient_linear``, ``remote_device``
      and ``pin_memory`` (the config's ``offload_param`` places shards),
      ``zero_param_parallel_group`` (hpZ comes from the config's
      ``zero_hpz_partition_size``), ``param_swapper`` (zcore swaps with its
      own swap manager) and ``tensor_overrides``.
    """

    def __init__(
        self,
        module: Optional[torch.nn.Module] = None,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        mem_efficient_linear: bool = True,
        remote_device: Optional[str] = None,
        pin_memory: bool = False,
        config_dict_or_path: Union[Config, dict, str, Path, None] = None,
        config: Union[Config, dict, str, Path, None] = None,
        enabled: bool = True,
        dtype: Optional[torch.dtype] = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        self.enabled = enabled
        self.module = module
        self._meta: Optional[torch.device] = None
        if not enabled:
            return
        cfg = _stage_3_config(config_dict_or_path if config_dict_or_path is not None else config)
        _refuse_unsupported(data_parallel_group, mpu, sequence_data_parallel_group, zero_quantized_nontrainable_weights)
        _check_dtype(dtype, cfg)
        if zero_quantized_weights and (cfg is None or not cfg.zero_optimization.zero_quantized_weights):
            raise InvalidArgumentError(
                "zcore.zero.Init(zero_quantized_weights=True): zcore quantizes stage 3's all-gathers as the "
                "config given to zcore.initialize says; set zero_optimization.zero_quantized_weights to true "
                "there (and in the config passed here), or leave the argument out",
                argument="zero_quantized_weights",
            )

    def __enter__(self) -> Init:
        if self.enabled:
            self._meta = torch.device("meta")
            self._meta.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._meta is not None:
            meta, self._meta = self._meta, None
            meta.__exit__(exc_type, exc, tb)


def _stage_3_config(given: Union[Config, dict, str, Path, None]) -> Optional[Config]:
    if given is None:
        return None
    cfg = load_config(given)
    if cfg.zero_optimization.stage != 3:
        raise ConfigError(
            f"zcore.zero.Init builds the model on the meta device, which only ZeRO stage 3 materialises "
            f"(straight into shards), but the config's zero_optimization.stage is "
            f"{cfg.zero_optimization.stage}: set it to 3, or build the model outside zcore.zero.Init"
        )
    return cfg


def _refuse_unsupported(
    data_parallel_group: Optional[dist.ProcessGroup],
    mpu: Any,
    sequence_data_parallel_group: Any,
    zero_quantized_nontrainable_weights: bool,
) -> None:
    if data_parallel_group is not None and not _is_world(data_parallel_group):
        raise InvalidArgumentError(
            "zcore.zero.Init(data_parallel_group=...) names a group smaller than the world: zcore shards "
            "over every rank, or over the 'dp' dimension of zcore.initialize(device_mesh=...); leave the "
            "argument out and give the mesh to zcore.initialize",
            argument="data_parallel_group",
        )
    refused = {
        "mpu": (mpu is not None, "zcore composes with tensor parallelism through "
                "zcore.initialize(device_mesh=...) with 'dp' and 'tp' dimensions"),
        "sequence_data_parallel_group": (sequence_data_parallel_group is not None,
                                         "zcore has no sequence parallelism"),
        "zero_quantized_nontrainable_weights": (zero_quantized_nontrainable_weights,
                                                "zcore does not store frozen weights quantized"),
    }
    for name, (given, why) in refused.items():
        if given:
            raise InvalidArgumentError(f"zcore.zero.Init({name}=...) is not supported: {why}; leave it out",
                                       argument=name)


def _is_world(group: dist.ProcessGroup) -> bool:
    return group is dist.group.WORLD or (
        dist.is_initialized() and dist.get_world_size(group) == dist.get_world_size()
    )


def _check_dtype(dtype: Optional[torch.dtype], cfg: Optional[Config]) -> None:
    if dtype is None or dtype == torch.float32:
        return
    if dtype not in _FLOATING:
        raise InvalidArgumentError(
            f"zcore.zero.Init(dtype={dtype}): parameters are float32, bfloat16 or float16; the config "
            "given to zcore.initialize chooses the compute dtype (bf16 or fp16 sections)",
            argument="dtype",
        )
    if cfg is not None:
        compute = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
        if dtype != compute:
            raise InvalidArgumentError(
                f"zcore.zero.Init(dtype={dtype}) differs from the config's compute dtype {compute} "
                "(its bf16 and fp16 sections), which zcore trains in: enable the matching section, "
                "or leave dtype out",
                argument="dtype",
            )

@contextlib.contextmanager
def unwrap_model_for_generation(engine: Any) -> Iterator[torch.nn.Module]:
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation``:
    a block in which ``engine``'s model is whole on every rank, gathered
    once for the block, so that a long ``generate`` runs without gathering
    for each token; yields the model (``engine.module``). Every rank enters
    it (a collective); at stages 0-2, where the model is whole already, the
    block does nothing. It holds the whole model in device memory."""
    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module) or not hasattr(engine, "lifetime"):
        raise InvalidArgumentError(
            f"unwrap_model_for_generation takes the engine zcore.initialize returned, got {type(engine).__name__}",
            argument="engine",
        )
    engine.lifetime.check_usable()
    with GatheredParameters(list(module.parameters())):
        yield module


# Public objects name the path users import them from (zcore.zero); those
# the package exports too name zcore (set in zcore/__init__.py).
for _name in __all__:
    globals()[_name].__module__ = __name__
